"""Blends: which source each training sample comes from, and which of that source's samples.

**The schedule.** Megatron-LM's ``BlendedDataset`` builds, for every position ``n`` of the
blended stream, an index of the source whose share is furthest behind: the greedy rule
``argmax_i (w_i · max(n, 1) - c_i(n))`` with ``c_i(n)`` the samples taken from source ``i``
before ``n`` (its ``build_blending_indices``, ties to the lowest index). Its index holds one
entry per sample (two int arrays as long as the run), and resuming at sample ``n`` reads it.
:class:`BlendSchedule` uses the same rule with the share counted *after* the pick,
``argmax_i (w_i · (n + 1) - c_i(n))`` — Megatron's counts the share before it, and its first
pick is special (``max(n, 1)``), so its sequence never repeats —, runs it over one *period* of
``P`` positions with the weights as exact fractions ``q_i / P``, and repeats it: after ``P``
positions every source has taken exactly ``q_i`` samples (checked when the period is built), so
the state at ``k·P`` equals the state at 0 and the periodic sequence *is* this rule's sequence
for the weights ``q_i / P``. Position ``n`` is then ``(n // P, n % P)``: one table lookup,
whatever ``n``; the memory is ``O(P)`` (< 400 KiB), never the run's length.

``P`` is the common denominator of the normalised weights when each is a fraction with a
denominator <= 4096 within 1e-9 and ``P`` <= 65536 (``0.3 / 0.7`` gives ``P = 10``: the weights
are exact); other weights are rounded to multiples of 1/65536 (largest remainder, every source
at least 1/65536: each moves by less than (sources)/65536 — relatively more for a tiny weight,
which the trainer says). **Bound.** No source is ever a whole sample ahead of its share: a source is picked only when
its key is positive (the keys sum to 1), so after the pick ``c_i < w_i (n + 1) + 1``. How far
one falls behind is not proven; over 150 random blends of 2-40 sources
(``tests/test_data_order.py``) it stays under 1.4 samples, and the test holds every count within
2 samples of ``q_i / P · n`` at every position.

**Epochs.** The ``m``-th sample a source gives (``m`` counted over the whole run) is sample
``perm_e(m mod N)`` of its ``N`` samples, ``e = m // N`` its epoch and ``perm_e`` the epoch's
:func:`~moetrain.data.order.epoch_permutation`: a source that runs out starts its next epoch,
reshuffled, while the others go on.

**A changed blend.** A run resumed with other weights (or sources added or removed) starts the
new schedule at the checkpoint's position ``n0`` and each source from its own count there
(``anchor``): the position ``n`` maps to the new schedule's position ``n - n0`` and source
``i``'s sample ``anchor_i + c_i(n - n0)``. The anchor is saved with every checkpoint.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from moetrain.data.order import FeistelPermutation, epoch_permutation

__all__ = ["BlendSchedule", "BlendedOrder", "SourceOrder", "EXACT_DENOMINATOR", "QUANTUM"]

EXACT_DENOMINATOR = 4096  # the largest period tried for exact weights
QUANTUM = 2**16  # the period of weights that are not exact fractions of a small denominator


def _quotas(weights: Sequence[float]) -> tuple[np.ndarray, int]:
    """Integer shares ``q`` [S] and the period ``P = sum(q)``: the exact fractions of the
    normalised weights when a denominator <= :data:`EXACT_DENOMINATOR` expresses them within
    1e-9, else multiples of 1/:data:`QUANTUM` (largest remainder, each at least 1)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    fracs = [Fraction(float(x)).limit_denominator(EXACT_DENOMINATOR) for x in w]
    if all(abs(float(f) - x) <= 1e-9 for f, x in zip(fracs, w)) and sum(fracs) == 1:
        period = math.lcm(*(f.denominator for f in fracs))
        if period <= QUANTUM:
            return np.array([int(f * period) for f in fracs], dtype=np.int64), period
    raw = w * QUANTUM
    q = np.maximum(np.floor(raw).astype(np.int64), 1)
    while q.sum() > QUANTUM:  # the minimum of 1 took too much: give it back from the largest
        q[np.argmax(q)] -= 1
    order = np.argsort(-(raw - np.floor(raw)), kind="stable")
    for i in order[: QUANTUM - int(q.sum())]:
        q[i] += 1
    return q, QUANTUM


class BlendSchedule:
    """The greedy blending sequence of the given weights, periodic (module docstring).

    Args:
        weights: relative weights [S], each > 0 (normalised here).

    Attributes:
        quotas: int64 [S], samples of each source per period. period: ``P = sum(quotas)``.
        weights: the weights the schedule follows exactly, ``quotas / period``.
        max_deviation: the largest ``|quotas_i / P - w_i|`` (0 for exact fractions);
        max_relative_deviation: the largest ``|quotas_i / P - w_i| / w_i``.

    Raises:
        ValueError: no weights, or a weight that is not a positive finite number.
    """

    def __init__(self, weights: Sequence[float]):
        if not len(weights) or any(not (w > 0 and math.isfinite(w)) for w in weights):
            raise ValueError(f"blend weights {list(weights)}: need at least one, each a positive number")
        self.quotas, self.period = _quotas(weights)
        w = np.asarray(weights, dtype=np.float64)
        self.weights = self.quotas / self.period
        self.max_deviation = float(np.abs(self.weights - w / w.sum()).max())
        self.max_relative_deviation = float((np.abs(self.weights - w / w.sum()) / (w / w.sum())).max())
        S, P = len(self.quotas), self.period
        # Greedy over one period in exact integers: key_i = q_i·(n + 1) - P·c_i is P times
        # Megatron's error w_i·(n + 1) - c_i; argmax takes the first of equal keys, as it does.
        src = np.empty(P, dtype=np.int32 if S > 32767 else np.int16)
        rank = np.empty(P, dtype=np.int32)  # how many earlier slots of the period took the same source
        counts = np.zeros(S, dtype=np.int64)
        for n in range(P):
            i = int(np.argmax(self.quotas * (n + 1) - P * counts))
            src[n], rank[n] = i, counts[i]
            counts[i] += 1
        if not np.array_equal(counts, self.quotas):  # the greedy rule always gives these (tested)
            raise AssertionError(f"greedy period gave {counts.tolist()}, not the quotas {self.quotas.tolist()}")
        self.source, self.rank = src, rank

    def locate(self, position: int) -> tuple[int, int]:
        """``(source, m)``: position ``position`` (>= 0) of the blended stream is the ``m``-th
        sample (0-based, over the whole run) the schedule takes from ``source``."""
        k, r = divmod(int(position), self.period)
        i = int(self.source[r])
        return i, k * int(self.quotas[i]) + int(self.rank[r])  # int(): no int32 arithmetic

    def locate_many(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`locate` of int64 ``positions`` [n]: (source [n], m [n]), vectorised."""
        k, r = np.divmod(np.asarray(positions, dtype=np.int64), self.period)
        src = self.source[r].astype(np.int64)
        return src, k * self.quotas[src] + self.rank[r].astype(np.int64)

    def counts(self, position: int) -> np.ndarray:
        """int64 [S]: samples taken from each source in positions ``[0, position)``."""
        k, r = divmod(int(position), self.period)
        return k * self.quotas + np.bincount(self.source[:r], minlength=len(self.quotas)).astype(np.int64)


@functools.lru_cache(maxsize=8)
def _schedule(weights: tuple[float, ...]) -> BlendSchedule:
    """One schedule per weights per process: building a period of 65,536 takes ~0.4 s."""
    return BlendSchedule(weights)


@dataclass
class SourceOrder:
    """A source's samples in run order: epoch after epoch, each a fresh permutation.

    ``num_samples``: N, the source's samples per epoch. ``seed``, ``key``: the epochs' keys
    (:func:`~moetrain.data.order.epoch_permutation`). ``shuffle``: False visits the samples in
    stored order every epoch (tests, evaluation).
    """

    name: str
    num_samples: int
    seed: int
    shuffle: bool = True
    key: str | None = None  # the shuffle key; None: the name

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"source {self.name!r} has no sample to draw")
        self._perm: tuple[int, FeistelPermutation] | None = None
        if self.key is None:
            self.key = self.name

    def samples(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(epoch [n], sample id [n]) of the source's samples ``m`` (int64 [n]), vectorised."""
        epochs, offsets = np.divmod(np.asarray(m, dtype=np.int64), self.num_samples)
        if not self.shuffle:
            return epochs, offsets
        out = np.empty_like(offsets)
        for epoch in np.unique(epochs).tolist():
            sel = epochs == epoch
            out[sel] = self._permutation(epoch).map(offsets[sel])
        return epochs, out

    def _permutation(self, epoch: int) -> FeistelPermutation:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, epoch_permutation(self.num_samples, self.seed, self.key, epoch))
        return self._perm[1]


class BlendedOrder:
    """The training stream of a blend: position → (source, its sample id), in O(1) memory.

    Args:
        names: the sources' names [S]. num_samples: their samples per epoch [S].
        weights: their relative weights [S]. seed: the run's seed.
        anchor_position: the position from which these weights apply (0, or where a resumed run
            changed its blend). anchor_counts: each source's count of samples taken before it
            (name → samples; missing names count 0).
        shuffle: False visits each source in stored order (validation-like order, tests).
        keys: each source's shuffle key (None: its name). A run of one ``data.path`` uses ``""``:
            its order does not change when the directory is moved or renamed.

    Raises:
        ValueError: bad weights (:class:`BlendSchedule`), a source without samples, or
            ``anchor_position`` < 0.
    """

    def __init__(self, names: Sequence[str], num_samples: Sequence[int], weights: Sequence[float], seed: int,
                 anchor_position: int = 0, anchor_counts: dict[str, int] | None = None, shuffle: bool = True,
                 keys: Sequence[str | None] | None = None):
        if anchor_position < 0:
            raise ValueError(f"anchor_position={anchor_position}: must be >= 0")
        self.names = list(names)
        self.schedule = _schedule(tuple(float(w) for w in weights))
        keys = list(keys) if keys is not None else [None] * len(self.names)
        self.sources = [SourceOrder(n, int(s), seed, shuffle, k) for n, s, k in zip(self.names, num_samples, keys)]
        self.anchor_position = int(anchor_position)
        self.anchor_counts = {k: int(v) for k, v in (anchor_counts or {}).items()}
        self._base = np.array([self.anchor_counts.get(n, 0) for n in self.names], dtype=np.int64)

    def locate_many(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index [n], sample id [n]) of int64 ``positions`` [n], each >= ``anchor_position``."""
        rel = np.asarray(positions, dtype=np.int64) - self.anchor_position
        if rel.size and rel.min() < 0:
            raise IndexError(f"position {int(rel.min()) + self.anchor_position} precedes the blend's anchor "
                             f"{self.anchor_position}")
        src, m = self.schedule.locate_many(rel)
        m = m + self._base[src]
        sample = np.empty_like(m)
        for i in np.unique(src).tolist():
            sel = src == i
            sample[sel] = self.sources[i].samples(m[sel])[1]
        return src, sample

    def consumed_by_source(self, position: int) -> dict[str, int]:
        """Samples taken from each source before ``position`` (>= ``anchor_position``), also
        from sources no longer in the blend (their count at the anchor)."""
        counts = self._base + self.schedule.counts(int(position) - self.anchor_position)
        return {**self.anchor_counts, **{n: int(c) for n, c in zip(self.names, counts)}}

    def epochs(self, position: int) -> dict[str, int]:
        """The epoch (0-based) each source is in at ``position``: its count over its samples."""
        counts = self.consumed_by_source(position)
        return {s.name: counts[s.name] // s.num_samples for s in self.sources}
