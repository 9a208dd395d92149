"""MuonClip's QK-clip (``train.qk_clip``; Kimi K2, Kimi Team 2025, §2.1).

Muon lets attention logits grow until training diverges; QK-clip bounds them at their source.
Every attention module records, during the step's forwards, each head's largest logit
(:func:`moetrain.model.attention.head_max_logits`). After the optimizer step:

1. agree — one all-reduce (MAX) over the pipeline stage's ranks of a [modules, heads] table in
   which each rank filled the heads it computes (its tp slice), so every replica clips alike;
2. factors — for every head h with S_max > τ, γ_h = τ / S_max (1 elsewhere);
3. scale — multi-head / grouped-query attention: the key head g shared by a group of query
   heads is scaled by √(min γ over the group), each query head by γ_h / √(min γ), so that head
   h's logits scale by exactly γ_h (plain multi-head attention: √γ_h each, as the paper); MLA:
   each head's non-RoPE query and key rows by √γ_h, its RoPE query rows by γ_h, the shared
   RoPE key untouched. Biases of the scaled rows are scaled with them. Each rank scales the rows
   of its own shard (FSDP, tensor parallelism: the weights are DTensors).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.internals import local_shape_and_offset
from moetrain.model.layers import Attention
from moetrain.model.mla import MLAttention
from moetrain.parallel.state import DP_CP_TP, PP, TP, ParallelState

__all__ = ["QKClip"]


class QKClip:
    """QK-clip at threshold ``tau`` over the attention modules of ``parts`` (this rank's model
    pieces); turns on their max-logit record."""

    def __init__(self, parts: list[nn.Module], tau: float, ps: ParallelState):
        self.tau = tau
        self.device = ps.device
        self.tp, self.tp_rank = ps.size(TP), ps.coord(TP)
        self.group = ps.group(DP_CP_TP) if ps.world_size > 1 else None
        self.pp_group = ps.group(PP) if ps.size(PP) > 1 else None
        self.modules = [m for part in parts for m in part.modules() if isinstance(m, (Attention, MLAttention))]
        self.heads = max((_heads(m) for m in self.modules), default=0)
        for m in self.modules:
            m.track_max_logits(_heads(m) // self.tp)

    def reset(self) -> None:
        """Forget the logits recorded so far (the step's forwards start a new record)."""
        for m in self.modules:
            m.max_logit.fill_(float("-inf"))

    @torch.no_grad()
    def apply(self) -> torch.Tensor:
        """Clip after the optimizer step (module docstring); returns the step's largest logit
        over every head of the model (every pipeline stage), before clipping: a float32 scalar on
        the device. No host read."""
        # 1. agree: every head's largest logit, the same table on every rank of the stage
        table = torch.full((len(self.modules), self.heads), float("-inf"), device=self.device)
        for i, m in enumerate(self.modules):
            local = m.max_logit
            table[i, self.tp_rank * local.numel():(self.tp_rank + 1) * local.numel()] = local
        if self.group is not None:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.group)
        # 2. factors: τ / max where the max passed τ
        gamma = torch.where(table > self.tau, self.tau / table, torch.ones_like(table))
        # 3. scale each module's query / key rows
        for m, g in zip(self.modules, gamma):
            g = g[:_heads(m)]
            if isinstance(m, MLAttention):
                _clip_mla(m, g)
            else:
                _clip_gqa(m, g)
        self.reset()
        largest = table.amax() if self.modules else torch.tensor(float("-inf"), device=self.device)
        if self.pp_group is not None:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.pp_group)
        return largest


def _heads(m: nn.Module) -> int:
    return m.heads if isinstance(m, MLAttention) else m.n_heads


def _clip_gqa(m: Attention, gamma: torch.Tensor) -> None:
    """Head h's logits × γ_h: key head g × √min(γ of its query heads), query head h ×
    γ_h / √that (module docstring). gamma: [n_heads]."""
    group = m.n_heads // m.n_kv_heads
    key = gamma.view(m.n_kv_heads, group).amin(dim=1).sqrt()  # [n_kv_heads]
    query = gamma / key.repeat_interleave(group)
    q_rows = query.repeat_interleave(m.head_dim)
    if m.output_gate:  # wq's rows per head are [q_h; gate_h]: the gate's rows stay
        q_rows = torch.stack([q_rows.view(-1, m.head_dim), torch.ones_like(q_rows).view(-1, m.head_dim)], 1)
    _scale_rows(m.wq, q_rows.reshape(-1))
    _scale_rows(m.wk, key.repeat_interleave(m.head_dim))


def _clip_mla(m: MLAttention, gamma: torch.Tensor) -> None:
    """MLA (Kimi K2 §2.1): per head, the query's non-RoPE rows and the key's (in W_kv_b) × √γ,
    the query's RoPE rows × γ; values and the shared RoPE key untouched. gamma: [heads]."""
    root = gamma.sqrt()[:, None]
    q_rows = torch.cat([root.expand(-1, m.nope), gamma[:, None].expand(-1, m.rope)], dim=1)  # [heads, Dn + Dr]
    kv_rows = torch.cat([root.expand(-1, m.nope), torch.ones_like(root).expand(-1, m.v_dim)], dim=1)
    _scale_rows(m.wq if m.wq is not None else m.wq_b, q_rows.reshape(-1))
    _scale_rows(m.wkv_b, kv_rows.reshape(-1))


def _scale_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    """Multiply output row r of ``linear`` (weight [out, in] and bias [out]) by rows[r], on this
    rank's shard of each. rows: [out] float32."""
    for p in (linear.weight, linear.bias):
        if p is None:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p  # (no_grad: the local tensor itself)
        if local.shape[1:] != p.shape[1:]:
            raise RuntimeError(f"QK-clip scales whole rows, but this rank holds a {tuple(local.shape)} block of a "
                               f"{tuple(p.shape)} projection placed {p.placements}")
        start = local_shape_and_offset(p.shape, p.device_mesh, p.placements)[1][0] if isinstance(p, DTensor) else 0
        factor = rows[start:start + local.shape[0]].to(local.dtype)
        local.mul_(factor.view(-1, *([1] * (local.ndim - 1))))
