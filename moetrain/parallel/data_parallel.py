"""Data-parallel gradient reduction (ZeRO stage 0) and the global gradient norm.

The training objective is the mean of the per-micro-batch losses over every micro-batch of the
global batch. Each rank back-propagates its own micro-batches scaled by 1 / accumulation steps;
gradients then have to be *averaged* over the ranks that saw different data:

* dense parameters are replicated on every rank of ``dp_cp`` (dp × cp): sum there, divide by
  dp·cp;
* expert parameters live on one rank per ep group and are replicated over ``edp_tp``. Each
  replica already holds the sum of the contributions of its ep group's dp·cp/edp ranks (the
  all-to-all backward brings them home), so they are summed over ``edp_tp`` and divided by the
  same dp·cp.

Reduction happens once per optimizer step, after the last micro-batch (no communication during
gradient accumulation), in flat buckets to keep the number of collectives small.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from moetrain.model.moe import GroupedExperts
from moetrain.parallel.state import DP_CP, EDP_TP, EP, PP, ParallelState

BUCKET_BYTES = 32 * 2**20


def split_expert_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense parameters, expert parameters) of ``model``, each in a stable order, shared
    (tied) parameters once."""
    expert_ids = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    dense, expert, seen = [], [], set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        (expert if id(p) in expert_ids else dense).append(p)
    return dense, expert


def _allreduce_mean(grads: list[torch.Tensor], group: dist.ProcessGroup, divisor: float) -> None:
    """Sum ``grads`` over ``group`` in ≤ BUCKET_BYTES flat buckets, then divide by ``divisor``."""
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if not bucket:
            return
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        flat.div_(divisor)
        for g, r in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(r)
        bucket, size = [], 0

    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= BUCKET_BYTES:
            flush()
    flush()


@torch.no_grad()
def reduce_gradients(model: nn.Module, ps: ParallelState) -> None:
    """Average gradients over the data-parallel ranks (see the module docstring).
    Parameters without a gradient get a zero gradient first so every rank joins every bucket."""
    dense, expert = split_expert_params(model)
    for p in dense + expert:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    divisor = ps.size(DP_CP)
    if ps.size(DP_CP) > 1:
        _allreduce_mean([p.grad for p in dense], ps.group(DP_CP), divisor)
    if expert:
        if ps.size(EDP_TP) > 1:
            _allreduce_mean([p.grad for p in expert], ps.group(EDP_TP), divisor)
        elif divisor != 1:
            for p in expert:
                p.grad.div_(divisor)


@torch.no_grad()
def global_grad_norm(model: nn.Module, ps: ParallelState) -> torch.Tensor:
    """L2 norm of the full gradient: replicated parameters count once; expert parameters are
    summed over the ep ranks that hold different experts, and everything over pipeline stages."""
    dense, expert = split_expert_params(model)
    sq_dense = _sum_sq(p.grad for p in dense)
    sq_expert = _sum_sq(p.grad for p in expert)
    if ps.size(EP) > 1:
        dist.all_reduce(sq_expert, group=ps.group(EP))
    total = sq_dense + sq_expert
    if ps.size(PP) > 1:
        dist.all_reduce(total, group=ps.group(PP))
    return total.sqrt()


def _sum_sq(grads: Iterable[torch.Tensor | None]) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        if g is not None:
            total += g.detach().double().pow(2).sum().cpu()
    return total


@torch.no_grad()
def clip_gradients(model: nn.Module, max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient by max_norm / norm when the global ``norm`` exceeds ``max_norm``."""
    if max_norm > 0 and math.isfinite(float(norm)) and float(norm) > max_norm:
        coef = max_norm / (float(norm) + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
