"""AdamW and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from moetrain.config import TrainConfig


def lr_at(step: int, tc: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up over
    ``warmup_steps`` to ``lr``, then cosine decay to ``min_lr`` at ``decay_steps`` (default
    ``steps``), ``min_lr`` after it (SGDR, Loshchilov & Hutter 2017, without restarts)."""
    if tc.warmup_steps and step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    span = max(1, tc.resolved_decay_steps - tc.warmup_steps)
    progress = min(1.0, (step - tc.warmup_steps) / span)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019) with weight decay on matrices only (norm weights and
    other 1-D parameters are not decayed, as in GPT-3 / Megatron), on the fp32 master weights.

    ``fused=True``: one kernel per parameter group, and its step counters live on the device —
    the foreach implementation keeps them on the host and reads each one per step."""
    from torch.distributed.tensor import DTensor

    # Keyed by (decay?, DTensor?): the fused kernels refuse a group that mixes DTensor and plain
    # parameters (tensor parallelism shards the dense layers but leaves the MoE ones plain).
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    seen = set()
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        groups.setdefault((p.ndim >= 2, isinstance(p, DTensor)), []).append(p)
    param_groups = [{"params": params, "weight_decay": tc.weight_decay if decay else 0.0}
                    for (decay, _), params in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]
    return torch.optim.AdamW(param_groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.adam_eps, fused=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def schedule_fields(tc: TrainConfig) -> dict:
    """What decides :func:`lr_at` (kept in checkpoints, so that a resumed run can tell when its
    schedule changed)."""
    return {"lr": tc.lr, "min_lr": tc.min_lr, "warmup_steps": tc.warmup_steps, "decay_steps": tc.resolved_decay_steps}
