"""Deterministic, resumable batches for every data-parallel rank.

Samples are fixed windows of ``seq_len + 1`` tokens of the token shards (input = first S,
target = last S). Each epoch visits them in a permutation drawn from ``seed + epoch``. The
global batch of optimizer step ``s`` is the ``global_batch`` samples at positions
``[consumed, consumed + global_batch)`` of that endless sequence; dp rank d takes the d-th
contiguous slice of it and cuts it into micro-batches. The whole position is therefore one
number, ``consumed_samples`` (Megatron's name), saved with every checkpoint.

Under context parallelism every cp rank of a dp slice loads the same samples; the trainer cuts
them to the rank's two sequence chunks (``moetrain.parallel.context.cp_shard``).

Because the global batch does not depend on dp or cp, any layout sees the same samples in the
same optimizer step as one process does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moetrain.data.reader import TokenShards


@dataclass
class MicroBatch:
    """inputs, targets: [micro_batch, seq_len] int64 token ids ([micro_batch, seq_len / cp] once
    the trainer has cut them for context parallelism). doc_ids: with document masking, the
    document of every input token, [micro_batch, seq_len] int64 (whole samples, never cut)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    doc_ids: torch.Tensor | None = None


class BatchLoader:
    """Micro-batches of one dp rank.

    Args:
        shards: the memory-mapped split. seq_len: S. global_batch: samples per optimizer step
        over all dp ranks. micro_batch: samples per forward. dp_rank, dp_size: this rank's slice.
        seed: permutation seed. document_mask: also give each micro-batch its ``doc_ids``.

    Raises:
        ValueError: the split holds fewer samples than one global batch, or the batch arithmetic
            does not divide.
    """

    def __init__(self, shards: TokenShards, seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int, dp_size: int, seed: int, shuffle: bool = True, document_mask: bool = False):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {global_batch} not divisible by micro_batch × dp = {micro_batch * dp_size}")
        self.shards, self.seq_len = shards, seq_len
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.document_mask = document_mask
        self.num_samples = shards.num_samples(seq_len)
        if self.num_samples < global_batch:
            raise ValueError(f"{shards.split} split has {self.num_samples} samples of {seq_len + 1} tokens, "
                             f"fewer than one global batch ({global_batch}); use more data or a smaller batch")
        self.consumed_samples = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _sample_id(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        if not self.shuffle:
            return offset
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
            self._perm_epoch = epoch
        return int(self._perm[offset])

    def next_batch(self) -> list[MicroBatch]:
        """This rank's micro-batches of the next optimizer step; advances the position."""
        per_rank = self.global_batch // self.dp_size
        start = self.consumed_samples + self.dp_rank * per_rank
        ids = [self._sample_id(start + i) for i in range(per_rank)]
        self.consumed_samples += self.global_batch
        return _micro_batches(self.shards, ids, self.seq_len, self.micro_batch, self.document_mask)

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])


def _micro_batches(shards: TokenShards, sample_ids: list[int], seq_len: int, micro_batch: int,
                   document_mask: bool) -> list[MicroBatch]:
    """Samples → micro-batches of (inputs, targets[, doc_ids])."""
    tokens = torch.from_numpy(np.stack([shards.sample(i, seq_len) for i in sample_ids]))
    inputs, targets = tokens[:, :-1].split(micro_batch), tokens[:, 1:].split(micro_batch)
    docs: list = [None] * len(inputs)
    if document_mask:
        doc_ids = np.stack([shards.sample_document_ids(i, seq_len)[:-1] for i in sample_ids])
        docs = list(torch.from_numpy(doc_ids).split(micro_batch))
    return [MicroBatch(i.contiguous(), t.contiguous(), d) for i, t, d in zip(inputs, targets, docs)]


def validation_batches(shards: TokenShards, seq_len: int, micro_batch: int, batches: int,
                       dp_rank: int, dp_size: int, document_mask: bool = False) -> list[MicroBatch]:
    """The first ``batches × micro_batch × dp_size`` validation samples (capped by the split's
    size), in order, split over dp ranks: a fixed set, so every evaluation is comparable."""
    total = min(shards.num_samples(seq_len), batches * micro_batch * dp_size)
    per_rank = total // dp_size // micro_batch * micro_batch
    if per_rank == 0:
        return []
    return _micro_batches(shards, [dp_rank * per_rank + i for i in range(per_rank)], seq_len, micro_batch,
                          document_mask)
