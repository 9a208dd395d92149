"""The sample order and the blend schedule: permutations, uniformity, the greedy rule and its
bound, O(1) lookup at any position, and bounded memory maps (moetrain/data/order.py, blend.py,
reader.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moetrain.data.blend import BlendedOrder, BlendSchedule
from moetrain.data.order import FeistelPermutation, epoch_permutation
from moetrain.data.reader import MapCache, TokenShards
from moetrain.data.writer import write_shards

from conftest import ByteTokenizer, _documents


# -- the permutation ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 16, 17, 255, 256, 257, 1000, 4097, 65_537])
def test_each_sample_exactly_once_per_epoch(n):
    for epoch in range(3):
        perm = epoch_permutation(n, seed=11, source="web", epoch=epoch)
        image = perm.map(np.arange(n))
        assert np.array_equal(np.sort(image), np.arange(n)), f"n={n} epoch {epoch}: not a permutation"


def test_large_domains_are_bijective_on_a_window_and_in_range():
    # 3.7e9 samples: DeepSeek-V3's 15T tokens at 4,096 per sample. No collision in a window of
    # 200k positions (a birthday bound would give ~5 collisions for a non-bijective map).
    n = 3_700_000_000
    perm = epoch_permutation(n, seed=0, source="web", epoch=0)
    image = perm.map(np.arange(200_000) * 18_000 + 7)
    assert image.min() >= 0 and image.max() < n and len(np.unique(image)) == len(image)
    assert perm(123_456_789) == int(perm.map(np.array([123_456_789]))[0])


def test_permutation_is_uniform():
    """Over 20,000 keys, where each of 50 positions lands is uniform (chi-square per position,
    49 degrees of freedom: every statistic within 6 standard deviations, the mean within 3),
    and the fixed points average 1 (a random permutation's expectation). 50 is not a power of 4:
    the cycle-walking is exercised."""
    n, keys = 50, 20_000
    counts = np.zeros((n, n))
    fixed = 0
    for k in range(keys):
        image = epoch_permutation(n, seed=1, source="s", epoch=k).map(np.arange(n))
        counts[np.arange(n), image] += 1
        fixed += int((image == np.arange(n)).sum())
    expected = keys / n
    chi = ((counts - expected) ** 2 / expected).sum(axis=1)
    dof = n - 1
    assert chi.max() < dof + 6 * math.sqrt(2 * dof), chi.max()
    assert abs(chi.mean() - dof) < 3 * math.sqrt(2 * dof / n), chi.mean()
    assert abs(fixed / keys - 1.0) < 0.05, fixed / keys
    # Neighbouring positions are independent: the gap between the images of 0 and 1 is uniform
    # over the 63 non-zero values (a weak mix leaves it clustered).
    gaps = np.bincount([(epoch_permutation(n, 2, "s", k)(1) - epoch_permutation(n, 2, "s", k)(0)) % n
                        for k in range(4000)], minlength=n)[1:]
    e = 4000 / (n - 1)
    assert ((gaps - e) ** 2 / e).sum() < (n - 2) + 6 * math.sqrt(2 * (n - 2))


def test_epochs_and_sources_are_shuffled_apart_and_keys_are_stable():
    a = epoch_permutation(1000, 5, "web", 0).map(np.arange(1000))
    assert not np.array_equal(a, epoch_permutation(1000, 5, "web", 1).map(np.arange(1000)))
    assert not np.array_equal(a, epoch_permutation(1000, 5, "code", 0).map(np.arange(1000)))
    assert not np.array_equal(a, epoch_permutation(1000, 6, "web", 0).map(np.arange(1000)))
    # The same key gives the same order in a new object (another process, another restart).
    assert np.array_equal(a, FeistelPermutation(1000, b"5\0web\0000").map(np.arange(1000)))
    # Fixed values: a change to the network would silently reorder every resumed run's data.
    assert epoch_permutation(10**9, 7, "web", 3).map(np.array([0, 1, 999_999_999])).tolist() == \
        [477498190, 565999415, 350620492]
    assert epoch_permutation(10, 7, "web", 0).map(np.arange(10)).tolist() == [4, 3, 8, 2, 5, 1, 6, 7, 9, 0]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="n=0"):
        FeistelPermutation(0, b"k")
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        FeistelPermutation(10, b"k").map(np.array([10]))


# -- the blend schedule ---------------------------------------------------------------------------


def greedy(weights: np.ndarray, n: int, megatron: bool = False) -> np.ndarray:
    """The blending rules position by position, without periods: moetrain's (the source with
    the largest ``w_i · (position + 1) - taken_i``) or, with ``megatron``, Megatron-LM's
    ``build_blending_indices`` (``w_i · max(position, 1) - taken_i``); the first on ties."""
    taken = np.zeros(len(weights))
    out = np.empty(n, dtype=np.int64)
    for pos in range(n):
        i = int(np.argmax(weights * (max(pos, 1) if megatron else pos + 1) - taken))
        out[pos] = i
        taken[i] += 1
    return out


@pytest.mark.parametrize("weights", [[0.3, 0.7], [1, 1, 1], [0.5, 0.25, 0.125, 0.125], [3, 1, 4, 1, 5]])
def test_schedule_is_the_greedy_rule_repeated(weights):
    sched = BlendSchedule(weights)
    n = 3 * sched.period + 5
    expected = greedy(sched.weights, n)
    got = np.array([sched.locate(p)[0] for p in range(n)])
    assert np.array_equal(got, expected)  # the periodic table is the rule itself
    assert np.allclose(sched.weights, np.asarray(weights) / sum(weights))  # exact fractions: no rounding
    assert sched.max_deviation < 1e-12
    # Megatron's rule takes the same number of samples from every source, give or take one, at
    # every position.
    S, megatron = len(weights), greedy(sched.weights, n, megatron=True)
    ours, theirs = np.cumsum(np.eye(S)[got], axis=0), np.cumsum(np.eye(S)[megatron], axis=0)
    assert np.abs(ours - theirs).max() <= 1


@pytest.mark.slow
def test_every_source_stays_within_two_samples_of_its_share():
    """The bound the docs state: over one period (the state then repeats) of 150 random blends
    (2-40 sources; exact weights, and every third blend rounded to a period of 65,536), every
    source's count is within 2 samples of ``weight × n`` at every n, and never a whole sample
    ahead."""
    rng = np.random.default_rng(0)
    worst = 0.0
    for trial in range(150):
        S = int(rng.integers(2, 41))
        w = rng.random(S) ** 4 + 1e-4 if trial % 3 == 0 else rng.integers(1, 20, S).astype(float)
        sched = BlendSchedule(list(w))
        assert sched.quotas.sum() == sched.period and (sched.quotas >= 1).all()
        n = sched.period
        onehot = np.zeros((n, S), dtype=np.int32)
        onehot[np.arange(n), sched.source] = 1
        deviation = np.abs(np.cumsum(onehot, axis=0) - np.outer(np.arange(1, n + 1), sched.weights)).max()
        worst = max(worst, deviation)
        if trial % 3 == 0:  # rounded weights: each within (sources)/65536 of the asked-for one
            assert sched.max_deviation <= S / 65536
        # Never a whole sample ahead (the proven half of the bound).
        assert (np.cumsum(onehot, axis=0) - np.outer(np.arange(1, n + 1), sched.weights)).max() < 1
    assert worst <= 2.0, worst


def test_lookup_at_any_position_is_constant_time_and_consistent():
    sched = BlendSchedule([0.2, 0.3, 0.5])
    far = 10**15 + 12_345  # far past any stored index
    src, m = sched.locate(far)
    counts = sched.counts(far)
    assert counts.sum() == far and m == counts[src]  # the m-th of its source is preceded by m of them
    assert np.array_equal(sched.counts(far + 1) - counts, np.eye(3, dtype=np.int64)[src])
    positions = np.arange(far, far + 500)
    vs, vm = sched.locate_many(positions)
    assert [(int(a), int(b)) for a, b in zip(vs, vm)] == [sched.locate(int(p)) for p in positions]


def test_blended_order_visits_each_source_sample_once_per_epoch_and_resumes_anchored():
    order = BlendedOrder(["small", "big"], [7, 50], [0.5, 0.5], seed=3)
    src, sample = order.locate_many(np.arange(70))  # 35 from small: five epochs of 7
    small = sample[src == 0]
    for e in range(5):
        assert sorted(small[7 * e:7 * e + 7].tolist()) == list(range(7))
    assert not np.array_equal(small[:7], small[7:14])  # reshuffled
    assert order.consumed_by_source(70) == {"small": 35, "big": 35}
    assert order.epochs(70) == {"small": 5, "big": 0}
    # A changed blend from position 70: each source continues from its own count.
    changed = BlendedOrder(["small", "big", "new"], [7, 50, 9], [0.2, 0.6, 0.2], seed=3,
                           anchor_position=70, anchor_counts=order.consumed_by_source(70))
    src, sample = changed.locate_many(np.arange(70, 80))
    c = changed.consumed_by_source(80)
    assert c == {"small": 35 + int((src == 0).sum()), "big": 35 + int((src == 1).sum()), "new": int((src == 2).sum())}
    assert (src == 1).sum() == 6  # 0.6 of the 10 positions after the change
    # "big" goes on with the 36th sample of its own order (its first epoch): the samples it would
    # have given without the change.
    big_before = order.sources[1].samples(np.arange(35, 35 + 6))[1]
    assert np.array_equal(sample[src == 1], big_before)
    with pytest.raises(IndexError, match="anchor"):
        changed.locate_many(np.array([69]))


# -- memory maps ----------------------------------------------------------------------------------


def test_shards_are_mapped_when_read_and_at_most_max_open_maps_stay(tmp_path):
    write_shards(_documents(120), ByteTokenizer(), tmp_path, shard_tokens=2_000, val_docs=2, progress=False)
    maps = MapCache(3)  # one cache for the process: both splits count against it
    shards, val = TokenShards(tmp_path, "train", maps=maps), TokenShards(tmp_path, "val", maps=maps)
    assert len(shards.shards) > 10 and len(maps) == 0  # nothing mapped at open
    whole = np.concatenate([np.fromfile(tmp_path / sh["name"], dtype="<u2") for sh in shards.shards])
    n = shards.num_samples(16)
    cum = shards._cumulative(16)
    for index in range(0, n, 7):
        shard = int(np.searchsorted(cum, index, side="right"))
        start = sum(sh["tokens"] for sh in shards.shards[:shard]) + (index - (int(cum[shard - 1]) if shard else 0)) * 16
        assert np.array_equal(shards.sample(index, 16), whole[start:start + 17])
        shards.sample_document_ids(index, 16)  # the document index is mapped too
        val.sample(0, 16)
        assert len(maps) <= 3
    assert len(maps) == 3
    # Document ids from the mapped index equal those from the whole index read at once.
    starts = np.concatenate([shards.document_starts(i) + sum(sh["tokens"] for sh in shards.shards[:i])
                             for i in range(len(shards.shards))])
    for index in range(0, n, 11):
        shard = int(np.searchsorted(cum, index, side="right"))
        start = sum(sh["tokens"] for sh in shards.shards[:shard]) + (index - (int(cum[shard - 1]) if shard else 0)) * 16
        ids = np.searchsorted(starts, np.arange(start, start + 17), side="right")
        assert np.array_equal(shards.sample_document_ids(index, 16), ids - ids[0])
