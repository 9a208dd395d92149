"""Activation checkpointing (recomputation), per block.

* ``full``: a block keeps only its input; its whole forward runs again in backward
  (Chen et al. 2016). Memory per block drops to one [B, S, D] tensor.
* ``selective``: only the core attention (scores, softmax, weighted sum) is recomputed — the
  part whose activations grow with S² while costing few FLOPs to redo (Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models", §4.2);
* ``mla_up_proj``: MLA's up-projections (per-head q, k, v from the latents, RoPE included) are
  recomputed, so only the latents stay (Megatron-Core's recompute module of that name); together
  with ``selective`` for the core attention.

Recomputation is done with ``torch.utils.checkpoint`` (non-reentrant) inside the modules, not
with a wrapper module, so parameter names — and therefore checkpoints and initialisation —
stay the same as without it. MoE statistics are not counted twice (see ``moe._in_backward``).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from moetrain.model.attention import DocumentMask
from moetrain.model.layers import Attention
from moetrain.model.mla import MLAttention
from moetrain.model.recompute import recompute_context
from moetrain.model.transformer import Block


class RecomputedKernel:
    """An attention kernel whose activations are recomputed in backward."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: DocumentMask | None = None,
                 **kwargs) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.kernel(q, k, v, doc, **kwargs)
        return torch.utils.checkpoint.checkpoint(self.kernel, q, k, v, doc, use_reentrant=False,
                                                 context_fn=recompute_context, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Turn on ``full``, ``selective`` or ``mla_up_proj`` recomputation for every block of ``model``.

    Raises:
        ValueError: unknown mode (``none`` is handled by the caller: nothing to apply).
    """
    if mode == "full":
        for m in model.modules():
            if isinstance(m, Block):
                m.recompute = True
    elif mode in ("selective", "mla_up_proj"):
        for m in model.modules():
            if isinstance(m, (Attention, MLAttention)):
                m.kernel = RecomputedKernel(m.kernel)
            if isinstance(m, MLAttention) and mode == "mla_up_proj":
                m.recompute_up = True
    else:
        raise ValueError(f"activation checkpointing mode {mode!r}: use 'full', 'selective' or 'mla_up_proj'")
