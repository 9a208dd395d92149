"""Mixture-of-experts layer: top-k router, load-balancing and z losses, dropless dispatch.

Shape legend: T tokens on this rank (B·S), D hidden, E experts (global), El experts held by
this rank, K top-k, F expert ffn width, N token-expert assignments handled by this rank's
experts.

The layer runs in six phases (numbered in :meth:`MoE.forward`): route → permute (group the
T·K assignments by expert) → dispatch (to the rank that holds each expert; an all-to-all under
expert parallelism, see :mod:`moetrain.parallel.expert`) → expert compute → combine (the reverse
trip) → unpermute and weight by the router probabilities.

The router's auxiliary losses are attached to the layer's output with :class:`AttachAuxLoss`:
their gradient flows in backward without being returned through the model, which keeps
pipeline stages free of extra outputs (the same device as Megatron-Core's
``MoEAuxLossAutoScaler``). Their values are summed on the module in :attr:`MoE.stats_accum` for logging.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.layers import FeedForward


class AttachAuxLoss(torch.autograd.Function):
    """Forward: return ``x`` unchanged. Backward: pass ``grad`` through and give ``aux_loss`` the
    gradient ``scale`` — as if ``scale · aux_loss`` had been added to the final loss."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


@dataclass
class DispatchHandle:
    """What :meth:`LocalDispatcher.combine` needs to undo :meth:`LocalDispatcher.dispatch`."""

    order: torch.Tensor  # [N] positions in the flattened T·K assignments, sorted by expert
    num_assignments: int  # T·K
    kept: torch.Tensor | None  # [N_all] bool, False for assignments dropped by the capacity factor


class LocalDispatcher:
    """Dispatch without communication: every expert lives on this rank (ep = 1)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD: torch.Tensor, expert_idx_TK: torch.Tensor, capacity: int | None
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Group assignments by expert. Returns x_ND (rows grouped by expert), counts_E (rows per
        expert, a CPU long tensor) and the handle for :meth:`combine`."""
        x_ND, counts_E, handle = permute_by_expert(x_TD, expert_idx_TK, self.num_experts, capacity)
        return x_ND, counts_E, handle

    def combine(self, y_ND: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Inverse of :meth:`dispatch`: y_ND → y_(T·K)D in assignment order (dropped rows zero)."""
        return unpermute(y_ND, handle)


def permute_by_expert(x_TD: torch.Tensor, expert_idx_TK: torch.Tensor, num_experts: int, capacity: int | None
                      ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """Sort the T·K token-expert assignments by expert (stable, so token order is kept within an
    expert). With ``capacity`` each expert keeps its first ``capacity`` assignments (Switch §2.2
    drops by position) and the rest are dropped. Returns x_ND, counts_E (int64, CPU), handle."""
    K = expert_idx_TK.shape[1]
    flat = expert_idx_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    kept = None
    if capacity is not None:
        # Position of each sorted assignment inside its expert's run.
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(flat.numel(), device=flat.device) - starts.repeat_interleave(counts)
        kept = pos < capacity
        order = order[kept]
        counts = counts.clamp(max=capacity)
    x_ND = x_TD[order // K]
    return x_ND, counts.cpu(), DispatchHandle(order=order, num_assignments=flat.numel(), kept=kept)


def unpermute(y_ND: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Scatter rows back to assignment order; assignments dropped by capacity get zeros."""
    out = y_ND.new_zeros(handle.num_assignments, y_ND.shape[-1])
    return out.index_copy(0, handle.order, y_ND)


class GroupedExperts(nn.Module):
    """``num_local`` SwiGLU experts stored stacked so a grouped GEMM can run them at once.

    w1, w3: [El, D, F]; w2: [El, F, D]. ``expert_offset`` is the global index of local expert 0
    (non-zero under expert parallelism); initialisation uses it so every layout gets the same
    weights. The compute is a loop of per-expert GEMMs in plain PyTorch (the portable path);
    rows are grouped by expert with ``counts`` rows each.
    """

    def __init__(self, dim: int, hidden: int, num_local: int, expert_offset: int = 0, num_experts: int | None = None):
        super().__init__()
        self.num_local, self.expert_offset = num_local, expert_offset
        self.num_experts = num_experts if num_experts is not None else num_local
        self.w1 = nn.Parameter(torch.empty(num_local, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_local, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, dim))

    def forward(self, x_ND: torch.Tensor, counts_El: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, x in enumerate(torch.split(x_ND, counts_El.tolist())):
            # Empty groups still touch the weights so every expert gets a (zero) gradient.
            h = F.silu(x @ self.w1[e]) * (x @ self.w3[e])
            outs.append(h @ self.w2[e])
        return torch.cat(outs) if outs else x_ND.new_zeros(0, self.w2.shape[-1])


SeqCountReducer = Callable[[torch.Tensor], torch.Tensor]


class MoE(nn.Module):
    """Routed experts (+ optional shared experts) replacing the MLP of a block.

    Args:
        dim: hidden size D. hidden: expert ffn width F. num_experts: E. top_k: K.
        shared_experts: number of always-on experts, fused into one SwiGLU of width
            shared_experts·F (DeepSeekMoE §3.2).
        aux_loss_coef, z_loss_coef: loss weights; see :meth:`router_losses`.
        capacity_factor: None for dropless.
        norm_topk_prob: renormalise the K selected probabilities to sum to 1 (Mixtral).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, shared_experts: int = 0,
                 aux_loss_coef: float = 0.01, z_loss_coef: float = 0.001, capacity_factor: float | None = None,
                 norm_topk_prob: bool = True):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.capacity_factor, self.norm_topk_prob = capacity_factor, norm_topk_prob
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, num_experts, 0, num_experts)
        self.shared = FeedForward(dim, hidden * shared_experts) if shared_experts else None
        self.dispatcher: Any = LocalDispatcher(num_experts)
        # Set by the trainer: gradient given to the aux losses in backward (1 / micro-batches).
        self.aux_loss_scale = 1.0
        # Sums the per-sequence expert counts over the ranks that share a sequence (context /
        # sequence parallelism); identity when a rank holds whole sequences.
        self.seq_count_reducer: SeqCountReducer | None = None
        # Multiplies the local aux loss when a sequence is split over ranks whose gradients are
        # averaged (cp): each rank's part must count fully, see router_losses.
        self.seq_split_scale = 1.0
        # Multiplies the local z-loss when tokens are split over ranks whose gradients are summed
        # (tp: 1/tp), so the sum over those ranks is the mean over all tokens.
        self.token_split_scale = 1.0
        # Sums over the micro-batches of a step, reset by the trainer (``{}``): aux_loss, z_loss,
        # dropped_fraction (float64 scalars) and tokens_per_expert ([E] float64).
        self.stats_accum: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def _record_stats(self, aux: torch.Tensor, z: torch.Tensor, idx_TK: torch.Tensor, handle: Any) -> None:
        kept = handle_kept(handle)
        new = {"aux_loss": aux.detach().double().cpu(), "z_loss": z.detach().double().cpu(),
               "tokens_per_expert": torch.bincount(idx_TK.reshape(-1), minlength=self.num_experts).double().cpu(),
               "dropped_fraction": torch.tensor(0.0 if kept is None else float((~kept).sum()) / idx_TK.numel(),
                                                dtype=torch.float64)}
        for k, v in new.items():
            self.stats_accum[k] = self.stats_accum[k] + v if k in self.stats_accum else v

    def router_losses(self, logits_BSE: torch.Tensor, probs_BSE: torch.Tensor, idx_BSK: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Load-balancing loss per sequence and router z-loss.

        aux = mean over sequences b of E/(S²·K) · Σ_e count_be · Σ_s p_bse, the Switch
        Transformer loss (Fedus et al. 2021, eq. 4-6) in Megatron-Core's top-k form, evaluated on
        each sequence (GShard's groups = sequences; DeepSeek-V3 §2.1.2 "sequence-wise" loss) so
        its value does not depend on how a batch is split over ranks or micro-batches. Equals 1
        for a perfectly uniform router. z = mean over tokens of logsumexp(logits)² (Zoph et al.
        2022, ST-MoE eq. 5). Returns (aux, z, counts_BE).
        """
        B, S, E = probs_BSE.shape
        counts_BE = torch.zeros(B, E, device=idx_BSK.device, dtype=probs_BSE.dtype)
        counts_BE.scatter_add_(1, idx_BSK.reshape(B, -1), torch.ones_like(idx_BSK.reshape(B, -1), dtype=probs_BSE.dtype))
        seq_len = S
        if self.seq_count_reducer is not None:
            counts_BE = self.seq_count_reducer(counts_BE)
            seq_len = int(round(counts_BE[0].sum().item() / self.top_k))
        psum_BE = probs_BSE.sum(1)
        aux = (counts_BE * psum_BE).sum(-1).mean() * (E / (seq_len * seq_len * self.top_k)) * self.seq_split_scale
        z = torch.logsumexp(logits_BSE, dim=-1).pow(2).mean() * self.token_split_scale
        return aux, z, counts_BE

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(-1, D)

        # 1. route: softmax over all experts in fp32, pick top-k.
        logits_TE = self.router(x_TD).float()
        probs_TE = logits_TE.softmax(-1)
        topk_p_TK, topk_idx_TK = probs_TE.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_p_TK = topk_p_TK / topk_p_TK.sum(-1, keepdim=True)
        aux, z, _ = self.router_losses(logits_TE.view(B, S, -1), probs_TE.view(B, S, -1), topk_idx_TK.view(B, S, -1))

        # 2.-3. permute by expert and dispatch to the ranks holding them.
        capacity = None
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * x_TD.shape[0] * self.top_k / self.num_experts)
        x_ND, counts_El, handle = self.dispatcher.dispatch(x_TD, topk_idx_TK, capacity)

        # 4. expert compute, rows grouped by local expert.
        y_ND = self.experts(x_ND, counts_El)

        # 5.-6. return to the source rank, restore assignment order, weight and sum over k.
        y_TKD = self.dispatcher.combine(y_ND, handle).view(-1, self.top_k, D)
        y_TD = (y_TKD * topk_p_TK.unsqueeze(-1).to(y_TKD.dtype)).sum(1)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)

        if not _in_backward():  # activation recomputation must not count twice
            self._record_stats(aux, z, topk_idx_TK, handle)
        total_aux = self.aux_loss_coef * aux + self.z_loss_coef * z
        out = y_TD.view(B, S, D).to(x_BSD.dtype)
        if self.training and total_aux.requires_grad:
            out = AttachAuxLoss.apply(out, total_aux, self.aux_loss_scale)
        return out


def _in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. recomputing a checkpointed forward)."""
    return torch._C._current_graph_task_id() != -1


def handle_kept(handle: Any) -> torch.Tensor | None:
    """The capacity mask of a dispatch handle, whatever dispatcher made it."""
    return getattr(handle, "kept", None)
