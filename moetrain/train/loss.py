"""The language-model loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy. logits: [B, S, V] fp32 (a DTensor sharded over the vocabulary
    under tensor parallelism: then computed by ``loss_parallel`` without gathering the logits);
    targets: [B, S] int64. Returns a scalar (a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits_BSV, DTensor):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten())
        return loss.full_tensor() if isinstance(loss, DTensor) else loss
    return F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten())
