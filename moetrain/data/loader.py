"""Deterministic, resumable batches for every data-parallel rank, from one source or a blend.

Samples are fixed windows of ``seq_len + 1`` tokens of a source's token shards (input = first S,
target = last S; :class:`~moetrain.data.reader.TokenShards`). The training stream is endless:
position ``n`` is a sample of the source that the blend's schedule names there, the next one of
that source's own order, epoch after epoch, each a fresh permutation
(:class:`~moetrain.data.blend.BlendedOrder`; one source is a blend of one). Nothing is stored
per sample: the sample at a position is computed when a rank reads it.

The global batch of optimizer step ``s`` is the ``global_batch`` samples at positions
``[consumed, consumed + global_batch)``; dp rank d takes the d-th contiguous slice of it and cuts
it into micro-batches. The position is therefore one number, ``consumed_samples`` (Megatron's
name), saved with every checkpoint beside ``consumed_samples_by_source`` and the blend's anchor.

Under context parallelism every cp rank of a dp slice loads the same samples; the trainer cuts
them to the rank's two sequence chunks (``moetrain.parallel.context.cp_shard``).

Because the global batch does not depend on dp or cp, any layout sees the same samples in the
same optimizer step as one process does.

With a loss mask (``loss_mask=True``), a target whose token the data does not train (a prompt,
padding, the first token of a conversation) is :data:`IGNORE_INDEX`, which the loss skips. With
``padding=True`` each micro-batch also says which input tokens are the padding that ends a
packed sequence (:meth:`~moetrain.data.reader.TokenShards.sample_padding`), which the MoE layers
do not route.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moetrain.data.blend import BlendedOrder
from moetrain.data.reader import TokenShards, trailing_padding

__all__ = ["IGNORE_INDEX", "MicroBatch", "DataSource", "BatchLoader", "validation_batches"]

IGNORE_INDEX = -100  # targets the loss skips (torch.nn.functional.cross_entropy's default)


@dataclass
class MicroBatch:
    """inputs, targets: [micro_batch, seq_len] int64 token ids ([micro_batch, seq_len / cp] once
    the trainer has cut them for context parallelism); targets the loss mask excludes are
    :data:`IGNORE_INDEX`. doc_ids: with document masking, the document of every input token,
    [micro_batch, seq_len] int64 (whole samples, never cut). loss_divisor: with a loss mask, the
    divisor of this micro-batch's summed token losses (a device scalar set by the trainer: the
    trained tokens of the whole global batch over micro-batches × dp × cp, so that the mean over
    them is the mean over every trained token; with multi-token prediction one per depth, [1 + D]);
    None: the mean over the micro-batch's tokens. next_tokens: with a loss mask, the next token of
    every position unmasked, [micro_batch, seq_len] int64 (what multi-token prediction's modules
    embed, :func:`moetrain.model.transformer.future_tokens`); None: ``targets`` are unmasked.
    padding: the padding that ends packed sequences, True on its input tokens, [micro_batch,
    seq_len] bool (whole samples, never cut: the model takes each rank's part); None: not
    asked for."""

    inputs: torch.Tensor
    targets: torch.Tensor
    doc_ids: torch.Tensor | None = None
    loss_divisor: torch.Tensor | None = None
    next_tokens: torch.Tensor | None = None
    padding: torch.Tensor | None = None


@dataclass
class DataSource:
    """One source of a blend: ``name`` (metrics, checkpoints), its split's ``shards``, ``weight``;
    ``key``: its shuffle key (None: the name; ``""`` for the one source of ``data.path``, whose
    order then does not depend on where the directory lies)."""

    name: str
    shards: TokenShards
    weight: float = 1.0
    key: str | None = None


class BatchLoader:
    """Micro-batches of one dp rank.

    Args:
        sources: the training split of each source of the blend (or one ``TokenShards``: a blend
            of one, named after its directory). seq_len: S. global_batch: samples per optimizer
            step over all dp ranks. micro_batch: samples per forward. dp_rank, dp_size: this
            rank's slice. seed: the order's seed. shuffle: False visits each source in stored
            order. document_mask: also give each micro-batch its ``doc_ids``. loss_mask: set the
            targets the data does not train to :data:`IGNORE_INDEX`. padding: give each
            micro-batch its ``padding`` (when a source is packed; None otherwise).

    Raises:
        ValueError: a source with no sample of ``seq_len + 1`` tokens, a blend smaller than one
            global batch, or batch arithmetic that does not divide.
    """

    def __init__(self, sources: TokenShards | Sequence[DataSource], seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int, dp_size: int, seed: int, shuffle: bool = True, document_mask: bool = False,
                 loss_mask: bool = False, padding: bool = False):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {global_batch} not divisible by micro_batch × dp = {micro_batch * dp_size}")
        if isinstance(sources, TokenShards):
            sources = [DataSource(sources.path.resolve().name, sources, key="")]
        self.sources = list(sources)
        self.seq_len = seq_len
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.document_mask, self.loss_mask = document_mask, loss_mask
        self.padding = padding and any(s.shards.pad_id is not None for s in self.sources)
        self.num_samples = {s.name: s.shards.num_samples(seq_len) for s in self.sources}
        for s in self.sources:
            if self.num_samples[s.name] == 0:
                raise ValueError(f"source {s.name!r} ({s.shards.path}): its {s.shards.split} split has no sample of "
                                 f"{seq_len + 1} tokens; use more data or a shorter sequence")
        if sum(self.num_samples.values()) < global_batch:
            raise ValueError(f"{self.sources[0].shards.split} split has {sum(self.num_samples.values())} samples of "
                             f"{seq_len + 1} tokens, fewer than one global batch ({global_batch}); use more data or a "
                             f"smaller batch")
        self.consumed_samples = 0
        self._set_order(0, {})

    def _set_order(self, anchor_position: int, anchor_counts: dict[str, int]) -> None:
        self.order = BlendedOrder([s.name for s in self.sources], [self.num_samples[s.name] for s in self.sources],
                                  [s.weight for s in self.sources], self.seed, anchor_position, anchor_counts,
                                  self.shuffle, [s.key for s in self.sources])
        self.announced_epochs = self.order.epochs(self.consumed_samples)

    @property
    def weights(self) -> dict[str, float]:
        """The weights the blend follows exactly (normalised; :class:`~moetrain.data.blend.BlendSchedule`)."""
        return {s.name: float(w) for s, w in zip(self.sources, self.order.schedule.weights)}

    def consumed_samples_by_source(self) -> dict[str, int]:
        """Samples taken from each source so far ({name: samples}), sources dropped from the
        blend included."""
        return self.order.consumed_by_source(self.consumed_samples)

    def next_batch(self) -> list[MicroBatch]:
        """This rank's micro-batches of the next optimizer step; advances the position. A source
        that runs out during the step starts its next epoch, reshuffled (:meth:`new_epochs`)."""
        per_rank = self.global_batch // self.dp_size
        start = self.consumed_samples + self.dp_rank * per_rank
        src, sample = self.order.locate_many(np.arange(start, start + per_rank, dtype=np.int64))
        self.consumed_samples += self.global_batch
        return _micro_batches([(self.sources[i].shards, s) for i, s in zip(src.tolist(), sample.tolist())],
                              self.seq_len, self.micro_batch, self.document_mask, self.loss_mask, self.padding)

    def new_epochs(self) -> list[tuple[str, int]]:
        """``[(source, epoch)]`` for each source that started a new epoch (0-based) since the
        last call: the whole global batch counts, so every rank gives the same answer."""
        out = []
        for name, epoch in self.order.epochs(self.consumed_samples).items():
            if epoch > self.announced_epochs.get(name, 0):
                out.append((name, epoch))
                self.announced_epochs[name] = epoch
        return out

    def _describe_sources(self) -> list[dict]:
        return [{"name": s.name, "weight": w, "key": s.key if s.key is not None else s.name,
                 "num_samples": self.num_samples[s.name]}
                for s, w in zip(self.sources, self.weights.values())]

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the position, each source's count, and the blend — its
        sources in order (name, weight, shuffle key, samples per epoch) and anchor
        (:mod:`moetrain.data.blend`)."""
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "seq_len": self.seq_len,
                "consumed_samples_by_source": self.consumed_samples_by_source(),
                "blend": {"sources": self._describe_sources(), "anchor_samples": self.order.anchor_position,
                          "anchor_by_source": dict(self.order.anchor_counts)}}

    def load_state_dict(self, state: dict) -> str | None:
        """Continue from a checkpoint's position: with the blend it was trained with (the same
        sources in the same order with the same weights, sizes, seed and sequence length),
        exactly where it stopped; otherwise every source from its own count, the new schedule
        starting at the checkpoint's position. A source that continues keeps its shuffle key, so
        its epoch in progress goes on in the same order (also when a ``data.path`` run becomes a
        blend).

        Returns:
            None, or a sentence saying what changed (for the log and the event file).
        """
        self.consumed_samples = consumed = int(state["consumed_samples"])
        blend = state.get("blend")
        if blend is None or "sources" not in blend:
            # A checkpoint of a version that drew each epoch as a stored permutation: the counts
            # go on, the order of the rest of the epoch in progress cannot.
            counts = {self.sources[0].name: consumed} if len(self.sources) == 1 else {}
            self._set_order(consumed, counts)
            return (f"the checkpoint comes from a moetrain that stored each epoch's order; the samples after position "
                    f"{consumed:,} follow the computed order, so the epoch in progress may repeat or skip some "
                    f"samples" + ("" if counts else "; every source of the blend starts from its first sample"))
        saved = {d["name"]: d for d in blend["sources"]}
        for src in self.sources:  # a source that continues keeps its order
            if src.name in saved:
                src.key = saved[src.name]["key"]
        counts = {k: int(v) for k, v in state["consumed_samples_by_source"].items()}
        now = self._describe_sources()
        same = ([(d["name"], d["key"], d["num_samples"]) for d in blend["sources"]]
                == [(d["name"], d["key"], d["num_samples"]) for d in now]
                and all(abs(a["weight"] - b["weight"]) <= 1e-12 for a, b in zip(blend["sources"], now))
                and state.get("seed", self.seed) == self.seed and state.get("seq_len", self.seq_len) == self.seq_len)
        if same:
            self._set_order(int(blend["anchor_samples"]), blend["anchor_by_source"])
            if self.order.consumed_by_source(consumed) == counts:
                return None
        self._set_order(consumed, counts)
        return describe_blend_change(blend["sources"], now, counts, state.get("seed"), self.seed,
                                     state.get("seq_len"), self.seq_len)


def describe_blend_change(old: list[dict], new: list[dict], counts: dict[str, int], old_seed=None, seed=None,
                          old_seq_len=None, seq_len=None) -> str:
    """What changed between two blends (``state_dict()["blend"]["sources"]`` lists), e.g.
    ``"web 0.7 → 0.5, code 0.3, math (new) 0.2; each source continues from its own count (web
    1,200, code 400, math 0 samples)"``."""
    before, after = {d["name"]: d for d in old}, {d["name"]: d for d in new}
    parts = []
    for name in [*before, *(n for n in after if n not in before)]:
        if name not in after:
            parts.append(f"{name} {before[name]['weight']:.4g} → removed")
        elif name not in before:
            parts.append(f"{name} (new) {after[name]['weight']:.4g}")
        else:
            a, b = before[name], after[name]
            text = f"{name} {a['weight']:.4g}" + (f" → {b['weight']:.4g}" if abs(a["weight"] - b["weight"]) > 1e-12 else "")
            if a["num_samples"] != b["num_samples"]:
                text += f" ({a['num_samples']:,} → {b['num_samples']:,} samples per epoch: its data changed)"
            parts.append(text)
    common = [n for n in before if n in after]
    if common != [n for n in after if n in before]:
        parts.append("the sources are listed in another order (it decides the schedule's ties)")
    if old_seed is not None and old_seed != seed:
        parts.append(f"run.seed {old_seed} → {seed}")
    if old_seq_len is not None and old_seq_len != seq_len:
        parts.append(f"model.seq_len {old_seq_len} → {seq_len} (the counts are of samples of the old length)")
    kept = ", ".join(f"{n} {counts.get(n, 0):,}" for n in after)
    return f"{', '.join(parts)}; each source continues from its own count ({kept} samples)"


def _micro_batches(picks: list[tuple[TokenShards, int]], seq_len: int, micro_batch: int, document_mask: bool,
                   loss_mask: bool, padding: bool = False) -> list[MicroBatch]:
    """Samples (their split and index) → micro-batches of (inputs, targets[, doc_ids][, padding])."""
    samples = np.stack([shards.sample(i, seq_len) for shards, i in picks])
    tokens = torch.from_numpy(samples)
    targets = tokens[:, 1:]
    nexts: list = [None] * len(picks)
    masks = None
    if loss_mask:
        masks = np.stack([shards.sample_loss_mask(i, seq_len) for shards, i in picks])
        trained = masks[:, 1:]
        nexts = list(targets.split(micro_batch))  # views of the unmasked tokens (masked_fill copies)
        targets = targets.masked_fill(~torch.from_numpy(trained), IGNORE_INDEX)
    inputs, targets = tokens[:, :-1].split(micro_batch), targets.split(micro_batch)
    docs: list = [None] * len(inputs)
    if document_mask:
        doc_ids = np.stack([shards.sample_document_ids(i, seq_len)[:-1] for shards, i in picks])
        docs = list(torch.from_numpy(doc_ids).split(micro_batch))
    pads: list = [None] * len(inputs)
    if padding:  # from the tokens and masks read above (packed data carries a mask)
        if masks is None:
            masks = np.stack([shards.sample_loss_mask(i, seq_len) for shards, i in picks])
        pad = np.stack([trailing_padding(t, m, shards.pad_id) for t, m, (shards, _) in zip(samples, masks, picks)])
        pads = list(torch.from_numpy(pad[:, :-1]).split(micro_batch))
    return [MicroBatch(i.contiguous(), t.contiguous(), d, next_tokens=n, padding=p)
            for i, t, d, n, p in zip(inputs, targets, docs, nexts, pads)]


def validation_batches(shards: TokenShards, seq_len: int, micro_batch: int, batches: int,
                       dp_rank: int, dp_size: int, document_mask: bool = False,
                       loss_mask: bool = False, padding: bool = False) -> list[MicroBatch]:
    """The first ``batches × micro_batch × dp_size`` validation samples (capped by the split's
    size), in order, split over dp ranks: a fixed set, so every evaluation is comparable.
    ``padding``: as :class:`BatchLoader`'s."""
    total = min(shards.num_samples(seq_len), batches * micro_batch * dp_size)
    per_rank = total // dp_size // micro_batch * micro_batch
    if per_rank == 0:
        return []
    return _micro_batches([(shards, dp_rank * per_rank + i) for i in range(per_rank)], seq_len, micro_batch,
                          document_mask, loss_mask, padding and shards.pad_id is not None)
