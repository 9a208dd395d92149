"""The language-model loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy. logits: [B, S, V] fp32 — under tensor parallelism a DTensor
    sharded over the vocabulary, and then the caller runs forward and backward inside
    ``torch.distributed.tensor.parallel.loss_parallel()`` so the full logits are never gathered
    (Megatron's vocabulary-parallel cross-entropy); targets: [B, S] int64. Returns a scalar."""
    return F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten())
