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
``MoEAuxLossAutoScaler``). Their values, the tokens per expert and the dropped fraction are
summed on the device in :attr:`MoE.stats_accum`; the trainer reads them once per step.

Precision: the router (logits, softmax, top-k) and both losses are fp32 whatever the compute
dtype; the experts compute in ``compute_dtype``; the weighted sum over the top-k is fp32.

Padding (the trailing filler of packed fine-tuning sequences, :class:`TokenMask`) is not routed:
its assignments carry the expert id E, one past the last, which no dispatcher sends and no
expert computes; the losses and the load statistics count the real tokens only, so a padded batch
trains exactly as the same batch without its padding (``moe.route_padding``).

Host reads (device → host copies; on a GPU each stalls the queue): none on the dropless path with
the ``grouped_mm`` backend (padding or not). The ``loop`` backend needs the per-expert row counts
on the host (its split sizes): one read per layer per micro-batch, or none when the dispatcher
already has them there (the all-to-all's split sizes, :mod:`moetrain.parallel.expert`). A capacity factor selects
the kept rows by a boolean mask: one read per layer per micro-batch. Ops that hide a sync on CUDA
are avoided: ``bincount`` (sizes its output from the max), ``repeat_interleave`` without
``output_size``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model import wgrad
from moetrain.model.fp8 import round_trip
from moetrain.model.fp8_gemm import Fp8Recipe, fp8_mm
from moetrain.model.layers import FeedForward, Linear, adapter_local, dequantize, local_cast
from moetrain.model.recompute import is_recomputing

# ``moe.expert_backend`` values this module computes with (``auto`` is resolved to one of them by
# :func:`resolve_expert_backend`).
EXPERT_BACKENDS = ("loop", "grouped_mm", "megablocks")


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
class TokenMask:
    """Which tokens of a micro-batch are real, not padding: what :meth:`MoE.forward` routes.

    real_BS: [B, S] bool, True for the real tokens among the ones this rank's blocks hold (under
    context parallelism its chunks of each sequence); ``count_B``: [B] int64, the real tokens of
    each whole sequence (over every rank that holds a part of it), the length the per-sequence
    losses normalise by. Built by :meth:`from_padding`."""

    real_BS: torch.Tensor
    count_B: torch.Tensor

    @classmethod
    def from_padding(cls, padding_BS: torch.Tensor, positions: torch.Tensor) -> "TokenMask":
        """padding_BS: [B, S_full] bool over whole samples, True at padding; positions: [S] int64,
        the global positions of this rank's tokens."""
        real = ~padding_BS
        return cls(real[:, positions], real.sum(1))

    def part(self, index: int, parts: int) -> torch.Tensor:
        """The real-token mask of the ``index``-th of ``parts`` equal pieces of the local sequence
        (a MoE layer that routes its tensor-parallel rank's piece): [B, S / parts] bool."""
        return self.real_BS.chunk(parts, dim=1)[index] if parts > 1 else self.real_BS


@dataclass
class DispatchHandle:
    """What a dispatcher's :meth:`~Dispatcher.combine` needs to undo its dispatch. Every
    dispatcher's handle has ``kept``, ``host_counts`` and ``padding_rows``."""

    order: torch.Tensor  # [N] positions in the flattened T·K assignments, sorted by expert
    num_assignments: int  # T·K
    kept: torch.Tensor | None  # [T·K] bool in sorted order, False where the capacity factor dropped
    host_counts: list[int] | None = None  # rows per local expert, when already on the host
    # The rows handed to the experts end with padding rows (beyond Σ counts; their assignments
    # were padding, sorted last): the experts give them 0 and no gradient.
    padding_rows: bool = False


class Dispatcher(Protocol):
    """Moves a MoE layer's token-expert assignments to the experts that hold them and back.

    Shapes: T tokens of this rank, K top-k, D hidden, El experts held by this rank, N rows that
    reach them. Phases 2-3 and 5-6 of :meth:`MoE.forward`; :class:`LocalDispatcher` (every expert
    here) is the reference, :mod:`moetrain.parallel.expert` has the all-to-all ones.
    """

    def take_rows_sent(self) -> tuple[int, int]:
        """Rows the dispatches since the last call sent to ranks (in this NVLink domain, in
        others): host integers from the split sizes; the count starts again from zero."""

    def start(self, x_TD: torch.Tensor, expert_idx_TK: torch.Tensor, capacity: int | torch.Tensor | None,
              padded: bool = False) -> Any:
        """Begin the dispatch of x_TD [T, D] by expert_idx_TK [T, K] (int64; the id E marks a
        padding assignment, which is neither sent nor computed and combines as 0; ``padded``:
        there may be some; ``capacity``: the rows an expert keeps, an int or a 0-dim device
        tensor, None for dropless); the rows may still travel when it returns."""

    def finish(self, pending: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """End it: (x_ND rows grouped by local expert, counts_El [El] int64 on the device, the
        handle for :meth:`combine`, which has ``kept`` and ``host_counts``)."""

    def combine(self, y_ND: torch.Tensor, handle: Any, weights_TK: torch.Tensor) -> torch.Tensor:
        """The experts' outputs y_ND back to their tokens, weighted by weights_TK [T, K] (fp32)
        and summed over k (in fp32): y_TD [T, D] in y_ND's dtype; dropped assignments add 0."""


def weighted_sum(y_TKD: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Σ_k weights_TK · y_TKD in fp32, returned in y's dtype: [T, K, D], [T, K] → [T, D]."""
    return (y_TKD.float() * weights_TK.unsqueeze(-1)).sum(1).to(y_TKD.dtype)


class LocalDispatcher:
    """Dispatch without communication: every expert lives on this rank (ep = 1)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def take_rows_sent(self) -> tuple[int, int]:
        return 0, 0  # nothing leaves the rank

    def start(self, x_TD: torch.Tensor, expert_idx_TK: torch.Tensor, capacity: int | torch.Tensor | None,
              padded: bool = False) -> tuple:
        return permute_by_expert(x_TD, expert_idx_TK, self.num_experts, capacity, padded)

    def finish(self, pending: tuple) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        return pending

    def combine(self, y_ND: torch.Tensor, handle: DispatchHandle, weights_TK: torch.Tensor) -> torch.Tensor:
        return weighted_sum(unpermute(y_ND, handle).view(*weights_TK.shape, -1), weights_TK)


class SlotMap:
    """Where a layer's E logical experts sit among its R physical expert slots (EPLB,
    ``moe.eplb``; :mod:`moetrain.parallel.eplb` places them): ``slots[s]`` is the logical expert
    held by slot s, every expert in at least one slot. Under expert parallelism slot s lives on ep
    rank s // (R / ep), as expert e does without EPLB.

    :meth:`physical` sends each routed assignment to exactly one replica of its expert: to the
    replica on this rank when ``rank`` (this rank's index among the ``ranks`` expert-parallel
    ranks) holds one — the token does not travel —, else token t (its position among this
    rank's tokens) to replica t mod c_e of the c_e replicas, so the ranks that hold none spread
    their tokens evenly over the replicas; on the device, no host read.

    Raises:
        ValueError: a slot holds an id outside [0, E), or an expert has no slot.
    """

    def __init__(self, slots: list[int], num_experts: int, device: torch.device | str = "cpu",
                 rank: int | None = None, ranks: int = 1):
        if any(not 0 <= e < num_experts for e in slots) or len(set(slots)) != num_experts:
            raise ValueError(f"slots {slots} must hold each of the {num_experts} experts at least once")
        self.slots, self.num_experts, self.rank, self.ranks = list(slots), num_experts, rank, ranks
        table: list[list[int]] = [[] for _ in range(num_experts)]
        for s, e in enumerate(slots):
            table[e].append(s)
        width = max(len(t) for t in table)
        self.replicas = [len(t) for t in table]  # per expert, host integers
        self.replicas_E = torch.tensor(self.replicas, dtype=torch.int64, device=device)
        # [E, C]: the slots of each expert, padded with its first (never chosen: j < c_e).
        self.table_EC = torch.tensor([t + t[:1] * (width - len(t)) for t in table], dtype=torch.int64, device=device)
        # [E]: the first slot of each expert on this rank, −1 where it holds none.
        self.local_E = None
        if rank is not None:
            per = len(slots) // ranks
            mine = {}
            for s in range(rank * per, (rank + 1) * per):
                mine.setdefault(slots[s], s)
            self.local_E = torch.tensor([mine.get(e, -1) for e in range(num_experts)], dtype=torch.int64,
                                        device=device)

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def physical(self, expert_idx_TK: torch.Tensor, padded: bool = False) -> torch.Tensor:
        """Logical expert ids [T, K] (int64; E: padding when ``padded``) → slot ids [T, K] (R:
        padding)."""
        E = self.num_experts
        idx = expert_idx_TK.clamp(max=E - 1) if padded else expert_idx_TK
        token = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1)
        out = self.table_EC[idx, token % self.replicas_E[idx]]
        if self.local_E is not None:
            local = self.local_E[idx]
            out = torch.where(local >= 0, local, out)
        return out.masked_fill(expert_idx_TK >= E, self.num_slots) if padded else out


@dataclass
class MoEParallel:
    """How a MoE layer's tokens and experts are spread over ranks: the one object
    :mod:`moetrain.parallel` hands the layer (the defaults are one process).

    * ``dispatcher`` — where the experts are (:class:`Dispatcher`);
    * a sequence split over ``seq_ranks`` ranks (context × tensor parallelism) needs its whole
      expert counts for the per-sequence balance loss: ``sum_seq_counts`` sums [B, E] counts over
      those ranks (no autograd); ``aux_scale`` / ``z_scale`` multiply this rank's share of the
      aux / z loss so that the gradient reduction of its parameters gives the one-process
      gradient (see :func:`moetrain.parallel.expert.sequence_split`);
    * node-limited routing: ``expert_groups`` (the NVLink domain of each expert's rank) and
      ``max_groups`` (how many of them a token may use), or None;
    * ``overlap_shared``: the shared experts compute while the routed tokens travel;
    * ``token_part``: (index, parts) when the layer routes one of ``parts`` equal pieces of the
      local sequence (tensor parallelism without expert-tensor parallelism: each tp rank routes
      its own piece), so that it takes its piece of the :class:`TokenMask`; None: all of it.
    """

    dispatcher: Dispatcher
    seq_ranks: int = 1
    sum_seq_counts: Callable[[torch.Tensor], torch.Tensor] | None = None
    aux_scale: float = 1.0
    z_scale: float = 1.0
    expert_groups: "ExpertGroups | None" = None
    max_groups: int | None = None
    # Compute the shared experts while the dispatch is in flight (False: after it, the overlap
    # benchmark's baseline).
    overlap_shared: bool = True
    token_part: tuple[int, int] | None = None


def permute_by_expert(x_TD: torch.Tensor, expert_idx_TK: torch.Tensor, num_experts: int,
                      capacity: int | torch.Tensor | None, padded: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """Sort the T·K token-expert assignments by expert (stable, so token order is kept within an
    expert). With ``capacity`` each expert keeps its first ``capacity`` assignments (Switch §2.2
    drops by position) and the rest are dropped (a boolean selection: one host read). Padding
    assignments (id E, ``padded``) sort last: dropped with a capacity, else left as rows after
    Σ counts (the handle's ``padding_rows``; dropping them would need their number on the host).
    Returns x_ND, counts_E (int64 on the device of ``expert_idx_TK``, real assignments only),
    handle."""
    K = expert_idx_TK.shape[1]
    flat = expert_idx_TK.reshape(-1)
    order, counts, kept = sort_by_expert(flat, num_experts, capacity)
    if kept is not None:
        order = order[kept]
        counts = counts.clamp(max=capacity)
    x_ND = x_TD[order // K]
    return x_ND, counts, DispatchHandle(order=order, num_assignments=flat.numel(), kept=kept,
                                        padding_rows=padded and kept is None)


def sort_by_expert(flat: torch.Tensor, num_experts: int, capacity: int | torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Assignments flat [T·K] (expert ids; E: padding, sorted last) sorted by expert, stably:
    (order [T·K], counts [E] int64 of the real assignments, kept [T·K] bool in sorted order — an
    expert's first ``capacity`` assignments, Switch §2.2; never a padding one — or None without
    a capacity). On the device, no host read."""
    order = torch.argsort(flat, stable=True)
    with_padding = expert_counts(flat, num_experts + 1)  # [E + 1]: the last bin counts the padding
    counts = with_padding[:num_experts]
    if capacity is None:
        return order, counts, None
    # Position of each sorted assignment inside its expert's run.
    starts = torch.cumsum(with_padding, 0) - with_padding
    pos = (torch.arange(flat.numel(), device=flat.device)
           - starts.repeat_interleave(with_padding, output_size=flat.numel()))
    return order, counts, (pos < capacity) & (flat[order] < num_experts)


def expert_counts(expert_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert: expert_idx [...] int64 in [0, E] → [E] int64 on the same device
    (id E, a padding assignment, counts nowhere), without a host read (``torch.bincount`` reads
    the max on CUDA)."""
    flat = expert_idx.reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))[:num_experts]


def unpermute(y_ND: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Scatter rows back to assignment order; assignments dropped by capacity get zeros, and so
    do padding ones (sorted last in ``handle.order``: y_ND may stop before them)."""
    out = y_ND.new_zeros(handle.num_assignments, y_ND.shape[-1])
    order = handle.order if y_ND.shape[0] == handle.order.shape[0] else handle.order[:y_ND.shape[0]]
    return out.index_copy(0, order, y_ND)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored stacked so a grouped GEMM can run them at once.

    w1, w3: [E, D, F]; w2: [E, F, D] (under EPLB E counts physical slots, R, each holding the logical
    expert ``slot_map.slots[s]``). Under expert parallelism they are DTensors placed
    Shard(0) over ep (and, with expert-tensor parallelism, over tp along F): the forward computes
    with the local pieces [El, D, F/etp], on the rows of this rank's experts. ``backend`` (one of
    :data:`EXPERT_BACKENDS`):

    * ``loop`` — one GEMM per expert in plain PyTorch, the reference path (and the faster one on
      CPU); needs the row counts on the host;
    * ``grouped_mm`` — ``torch.nn.functional.grouped_mm`` with offsets computed on the device: all
      experts in one kernel, no host read (the fast path on CUDA, bf16);
    * ``megablocks`` — MegaBlocks' grouped GEMM (``megablocks.grouped_gemm_util.ops.gmm``, the
      ``grouped_gemm`` package's CUTLASS kernel; Gale et al. 2023, "MegaBlocks", §5) on CUDA in
      bf16, with moetrain's router, dispatcher and losses so results stay comparable; it takes
      the row counts as a host tensor (one read per layer per micro-batch, as ``loop``).

    ``activation``: ``swiglu`` silu(x w1)·(x w3), ``clamped_swiglu`` (GPT-OSS), or ``relu2``,
    relu(x w1)² with no w3 (non-gated experts, Nemotron-H's): two matrices per expert.

    Low-rank adapters (:func:`moetrain.model.lora.add_adapters`): ``lora_A1`` [E, D, r] /
    ``lora_B1`` [E, r, F] beside w1, the same for w3, ``lora_A2`` [E, F, r] / ``lora_B2`` [E, r, D]
    beside w2 (None where a matrix has none); each row of expert e gains ``lora_scaling`` ·
    dropout(x) A_e B_e, in the same pass (``loop``: in the expert's own step; ``grouped_mm``: two
    more grouped GEMMs on the same offsets). With ``lora_shared`` the stacks hold one pair,
    [1, ...], for every expert of the layer. Not on ``megablocks``. A frozen FP8 base
    (``w1_scale_inv`` ... set) is dequantized per use (:meth:`base_matrix`).

    Weights are cast to ``compute_dtype`` at use (see :mod:`moetrain.model.layers`). With ``fp8``
    (a :class:`~moetrain.model.fp8_gemm.Fp8Recipe`, ``train.precision: fp8``) each expert's three
    GEMMs run in fp8, forward and backward, on the ``loop`` backend (per expert, so every scale
    covers one expert's rows or weights). On ``loop`` and ``grouped_mm`` without fp8 the weight
    gradients may be deferred (:mod:`moetrain.model.wgrad`, ``parallel.delay_wgrad_compute``).
    """

    compute_dtype: torch.dtype | None = None
    fp8: Fp8Recipe | None = None

    def __init__(self, dim: int, hidden: int, num_experts: int, backend: str = "loop", biases: bool = False,
                 activation: str = "swiglu", alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.backend = backend
        gated = activation != "relu2"
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden)) if gated else None
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        # GPT-OSS: b1, b3 [E, F], b2 [E, D].
        self.b1 = nn.Parameter(torch.empty(num_experts, hidden)) if biases else None
        self.b3 = nn.Parameter(torch.empty(num_experts, hidden)) if biases and gated else None
        self.b2 = nn.Parameter(torch.empty(num_experts, dim)) if biases else None
        self.act = {"clamped_swiglu": partial(clamped_swiglu, alpha=alpha, limit=limit), "relu2": relu2}.get(
            activation, swiglu)
        self.lora_A1 = self.lora_B1 = self.lora_A3 = self.lora_B3 = self.lora_A2 = self.lora_B2 = None
        self.lora_scaling, self.lora_dropout, self.lora_shared = 1.0, 0.0, False
        self.w1_scale_inv = self.w3_scale_inv = self.w2_scale_inv = None  # a frozen FP8 base's block scales
        self.base_block = 128
        # EPLB (moetrain.parallel.eplb): which logical expert each of the stacks' rows (slots)
        # holds, when they are slots; None: row e is expert e.
        self.slot_map: SlotMap | None = None

    def base_matrix(self, i: str) -> torch.Tensor | None:
        """This rank's piece of w1, w3 or w2 (``i``) in the compute dtype, dequantized when it is
        a frozen FP8 base (``w{i}_scale_inv`` [E, ⌈in/B⌉, ⌈out/B⌉], B = ``base_block``); None for
        a matrix the experts lack (w3 of non-gated ones)."""
        w = getattr(self, f"w{i}")
        if w is None:
            return None
        scale = getattr(self, f"w{i}_scale_inv")
        if scale is None:
            return local_cast(w, self.compute_dtype)
        return dequantize(local_cast(w, None), local_cast(scale, None), self.base_block, self.compute_dtype)

    def adapters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The matrices that carry an adapter ("1", "3", "2") → this rank's (A, B) pieces in the
        compute dtype (:func:`~moetrain.model.layers.adapter_local`)."""
        out = {}
        for i in ("1", "3", "2"):
            a = getattr(self, f"lora_A{i}")
            if a is not None:
                out[i] = (adapter_local(a, self.compute_dtype), adapter_local(getattr(self, f"lora_B{i}"),
                                                                               self.compute_dtype))
        return out

    def _adapter_rows(self, x_ND: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor] | None,
                      offs: torch.Tensor) -> torch.Tensor | int:
        """scaling · dropout(x) A B for the rows of every expert at once ([N, in] → [N, out]), or 0
        without an adapter."""
        if pair is None:
            return 0
        a, b = pair
        if self.lora_dropout and self.training:
            x_ND = F.dropout(x_ND, self.lora_dropout)
        if self.lora_shared:
            return (x_ND @ a[0]) @ b[0] * self.lora_scaling
        r = a.shape[-1]
        align = 16 // a.element_size()  # grouped_mm wants 16-byte strides: r padded with zero ranks
        if r % align:
            a = F.pad(a, (0, align - r % align))
            b = F.pad(b, (0, 0, 0, align - r % align))
        return F.grouped_mm(F.grouped_mm(x_ND, a, offs=offs), b, offs=offs) * self.lora_scaling

    def forward(self, x_ND: torch.Tensor, counts_El: torch.Tensor, host_counts: list[int] | None = None,
                padding_rows: bool = False) -> torch.Tensor:
        """x_ND: rows grouped by local expert, ``counts_El[e]`` rows for expert e ([El] int64 on
        x's device; ``host_counts``: the same on the host, when the caller has it). → [N, D].
        ``padding_rows``: x_ND may end with rows beyond Σ counts (padding): they are not
        computed, their output is 0 and they get no gradient."""
        if self.fp8 is not None and self.backend != "loop":
            raise ValueError(f"fp8 experts run on expert backend 'loop', not {self.backend!r}")
        w1, w3, w2 = (self.base_matrix(i) for i in ("1", "3", "2"))
        b1, b3, b2 = (local_cast(b, self.compute_dtype) if b is not None else None for b in (self.b1, self.b3, self.b2))
        x_ND = x_ND.to(w1.dtype)
        lora = self.adapters()
        if self.backend == "grouped_mm":
            # offs[e] = end row of expert e; empty experts are empty groups (zero gradient).
            offs = torch.cumsum(counts_El, 0, dtype=torch.int32)
            real_N = None
            if padding_rows:
                # grouped_mm skips the rows after offs[-1] and leaves their output (and, in
                # backward, their input gradient) unwritten: select zeros there, on the device.
                real_N = (torch.arange(x_ND.shape[0], device=x_ND.device) < offs[-1]).unsqueeze(1)
                x_ND = torch.where(real_N, x_ND, 0)
            gate = wgrad.grouped_mm(x_ND, w1, offs) + self._adapter_rows(x_ND, lora.get("1"), offs)
            up = wgrad.grouped_mm(x_ND, w3, offs) + self._adapter_rows(x_ND, lora.get("3"), offs) \
                if w3 is not None else None
            if b1 is not None:  # each row's expert's biases (padding rows: the last expert's, unused)
                experts = torch.arange(len(counts_El), device=x_ND.device)
                row = torch.repeat_interleave(experts, counts_El, output_size=x_ND.shape[0]) if not padding_rows \
                    else torch.bucketize(torch.arange(x_ND.shape[0], device=x_ND.device), offs, right=True
                                         ).clamp(max=len(counts_El) - 1)
                gate, up = gate + b1[row], up + b3[row] if b3 is not None else up
            if real_N is not None:
                # Zeros where the activation runs on padding rows: finite values forward, and no
                # gradient back from the rows the second GEMM's backward leaves unwritten.
                gate = torch.where(real_N, gate, 0)
                up = torch.where(real_N, up, 0) if up is not None else None
            h_NF = self.act(gate, up)
            out = wgrad.grouped_mm(h_NF, w2, offs) + self._adapter_rows(h_NF, lora.get("2"), offs)
            out = out + b2[row] if b2 is not None else out
            return out if real_N is None else torch.where(real_N, out, 0)
        if self.backend not in EXPERT_BACKENDS:
            raise ValueError(f"expert backend {self.backend!r}: expected one of {', '.join(EXPERT_BACKENDS)}")
        sizes = host_counts if host_counts is not None else counts_El.tolist()  # the loop's host read
        rows = sum(sizes)
        if padding_rows and rows < x_ND.shape[0]:  # compute the real rows; the padding rows give 0
            out = self.forward(x_ND[:rows], counts_El, sizes)
            return torch.cat([out, out.new_zeros(x_ND.shape[0] - rows, out.shape[1])])
        if self.backend == "megablocks":
            if lora:
                raise ValueError("expert adapters (train.lora) run on expert backend 'loop' or 'grouped_mm', "
                                 "not 'megablocks'")
            return _megablocks_experts(x_ND, w1, w3, w2, sizes)
        return _loop_experts(x_ND, w1, w3, w2, sizes, self.act, b1, b3, b2, self.fp8,
                             _LoopAdapters(lora, self.lora_scaling, self.lora_dropout if self.training else 0.0,
                                           self.lora_shared, len(sizes)) if lora else None)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up (Shazeer 2020)."""
    return F.silu(gate) * up


def relu2(gate: torch.Tensor, up: None = None) -> torch.Tensor:
    """relu(gate)², the non-gated squared ReLU (So et al. 2021, "Primer" §3; Nemotron-H's
    experts); there is no up projection."""
    return F.relu(gate).square()


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation (OpenAI's reference ``swiglu``): min(gate, limit) ·
    sigmoid(alpha · min(gate, limit)) · (clamp(up, ±limit) + 1)."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


class _LoopAdapters:
    """The experts' adapters as the loop takes them: for matrix "1", "3" or "2", expert e's
    (A_e, B_e), and the term scaling · dropout(x) A_e B_e."""

    def __init__(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float, dropout: float,
                 shared: bool, experts: int):
        self.scaling, self.dropout = scaling, dropout
        self.per_expert = {i: ([a[0]] * experts, [b[0]] * experts) if shared else (a.unbind(0), b.unbind(0))
                           for i, (a, b) in pairs.items()}

    def term(self, i: str, e: int, x: torch.Tensor) -> torch.Tensor | int:
        if i not in self.per_expert:
            return 0
        a, b = self.per_expert[i]
        if self.dropout:
            x = F.dropout(x, self.dropout)
        return (x @ a[e]) @ b[e] * self.scaling


@torch.compiler.disable  # per-expert GEMMs of data-dependent sizes: nothing to fuse, endless recompiles
def _loop_experts(x_ND: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, sizes: list[int],
                  act: Callable = swiglu, b1: torch.Tensor | None = None, b3: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, fp8: Fp8Recipe | None = None,
                  adapters: _LoopAdapters | None = None) -> torch.Tensor:
    """The reference expert computation: one gated MLP per expert on its ``sizes[e]`` rows, its
    GEMMs in fp8 with ``fp8`` (an empty expert's plain: no scale to take of zero rows), each
    matrix plus its low-rank adapter's term where ``adapters`` has one (in the compute dtype)."""

    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fp8_mm(a, b, fp8) if fp8 is not None and a.shape[0] else wgrad.mm(a, b)

    outs = []
    none = (None,) * len(sizes)
    biases = (b1.unbind(0), b3.unbind(0) if b3 is not None else none, b2.unbind(0)) if b1 is not None else (none,) * 3
    # unbind: one backward node stacks the experts' gradients (indexing w[e] would allocate and
    # zero-fill a whole [El, ...] gradient per expert).
    lora = adapters.term if adapters is not None else lambda i, e, x: 0
    for e, (x, w1_e, w3_e, w2_e, b1_e, b3_e, b2_e) in enumerate(zip(
            torch.split(x_ND, sizes), w1.unbind(0), w3.unbind(0) if w3 is not None else none, w2.unbind(0), *biases)):
        # Empty groups still touch the weights so every expert gets a (zero) gradient.
        gate = matmul(x, w1_e) + lora("1", e, x)
        up = matmul(x, w3_e) + lora("3", e, x) if w3_e is not None else None
        if b1_e is not None:
            gate, up = gate + b1_e, up + b3_e if b3_e is not None else up
        h = act(gate, up)
        out = matmul(h, w2_e) + lora("2", e, h)
        outs.append(out + b2_e if b2_e is not None else out)
    return torch.cat(outs) if outs else x_ND.new_zeros(0, w2.shape[-1])


def _megablocks_experts(x_ND: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor | None, w2: torch.Tensor,
                        sizes: list[int]) -> torch.Tensor:
    """SwiGLU (or, without w3, squared-ReLU) experts through MegaBlocks' grouped GEMM:
    ``gmm(a [N, K], b [El, K, M], batch_sizes)`` → [N, M] with ``a``'s rows grouped by expert,
    batch sizes a CPU int64 tensor (CUDA, bf16; differentiable)."""
    from megablocks import grouped_gemm_util as gg

    batch_sizes = torch.tensor(sizes, dtype=torch.int64)
    gate = gg.ops.gmm(x_ND, w1, batch_sizes)
    h_NF = F.silu(gate) * gg.ops.gmm(x_ND, w3, batch_sizes) if w3 is not None else relu2(gate)
    return gg.ops.gmm(h_NF, w2, batch_sizes)


def resolve_expert_backend(requested: str, device: torch.device, compute_dtype: torch.dtype, fp8: bool = False
                           ) -> str:
    """The backend ``moe.expert_backend`` stands for on ``device``: ``auto`` is ``grouped_mm`` on
    CUDA in bf16 (one kernel for all experts; torch's CUDA grouped GEMM takes bf16) and ``loop``
    elsewhere (on CPU grouped_mm takes 1.0–1.8× the loop's time: ``benchmarks/bench_experts.py``) and
    for fp8 experts (``fp8``: the experts' GEMMs are fp8, which only the loop runs).

    Raises:
        ValueError: an unknown backend.
    """
    if requested == "auto":  # measured: benchmarks/bench_experts.py
        return "grouped_mm" if device.type == "cuda" and compute_dtype == torch.bfloat16 and not fp8 else "loop"
    if requested not in EXPERT_BACKENDS:
        raise ValueError(f"expert backend {requested!r}: expected auto or one of {', '.join(EXPERT_BACKENDS)}")
    return requested


class Router(nn.Linear):
    """The routing projection, always in fp32 (logits, softmax and top-k decide which expert a
    token goes to; bf16 rounding flips close choices): x [T, D] → logits [T, E] fp32; with a
    bias (GPT-OSS) when built with one."""

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return F.linear(x_TD.float(), self.weight.float(), None if self.bias is None else self.bias.float())


class MoE(nn.Module):
    """Routed experts (+ optional shared experts) replacing the MLP of a block.

    Args:
        dim: hidden size D. hidden: expert ffn width F. num_experts: E. top_k: K.
        shared_experts: number of always-on experts, fused into one SwiGLU of width
            shared_experts·F (DeepSeekMoE §3.2), or ``shared_hidden`` when given.
        aux_loss_coef, z_loss_coef: loss weights; see :meth:`router_losses`.
        capacity_factor: None for dropless.
        norm_topk_prob: renormalise the K selected probabilities to sum to 1 (Mixtral).
        shared_hidden: the shared SwiGLU's width, when not shared_experts·F (Qwen1.5-MoE).
        shared_gate: scale the shared output per token by sigmoid(``shared_gate`` x), a
            [1, D] projection (Qwen1.5-MoE / Qwen2-MoE).
        dispatch_wire: the dtype the routed tokens travel in (``moe.dispatch_dtype``: None as
            computed, bf16 or float8 E4M3); the layer rounds them to it before dispatching
            (:func:`moetrain.model.fp8.round_trip`), whether or not they leave the rank.
        probs_on_input: the routing weight scales the token before its expert, f(p·x), and the
            outputs combine with weight 1 (Llama 4; ``moe.apply_probs_on_input``; top_k 1).
        num_slots: R >= E rows of the experts' stacks under EPLB (``moe.eplb``): physical slots,
            each holding one logical expert (``experts.slot_map``); None: E, row e expert e.

    ``parallel`` (:class:`MoEParallel`) says how tokens and experts are spread over ranks. A
    training step calls :meth:`begin_step` before its micro-batches and :meth:`take_statistics`
    after them.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, shared_experts: int = 0,
                 aux_loss_coef: float = 0.01, z_loss_coef: float = 0.001, capacity_factor: float | None = None,
                 norm_topk_prob: bool = True, score_function: str = "softmax", routed_scaling_factor: float = 1.0,
                 bias_update_rate: float = 0.0, shared_hidden: int | None = None, shared_gate: bool = False,
                 n_group: int | None = None, topk_group: int | None = None, routing_bias: bool = False,
                 router_bias: bool = False, expert_biases: bool = False, activation: str = "swiglu",
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, probs_on_input: bool = False,
                 dispatch_wire: torch.dtype | None = None, num_slots: int | None = None):
        super().__init__()
        if probs_on_input and top_k != 1:
            raise ValueError(f"probs_on_input needs top_k 1 (got {top_k}): one weight per token")
        self.probs_on_input = probs_on_input
        self.dispatch_wire = dispatch_wire
        self.num_experts, self.top_k = num_experts, top_k
        self.score_function, self.routed_scaling_factor = score_function, routed_scaling_factor
        # Aux-loss-free balancing (DeepSeek-V3 §2.1.2): a per-expert bias added to the scores
        # for the top-k choice only, moved by bias_update_rate after every optimizer step
        # (update_expert_bias), or kept as imported (routing_bias). A buffer, so checkpoints carry it.
        self.bias_update_rate = bias_update_rate
        if bias_update_rate > 0 or routing_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        else:
            self.expert_bias = None
        self.n_group, self.topk_group = n_group, topk_group
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.capacity_factor, self.norm_topk_prob = capacity_factor, norm_topk_prob
        self.router = Router(dim, num_experts, bias=router_bias)
        self.experts = GroupedExperts(dim, hidden, num_slots or num_experts, biases=expert_biases,
                                      activation=activation, alpha=swiglu_alpha, limit=swiglu_limit)
        width = (shared_hidden if shared_hidden is not None else hidden * shared_experts) if shared_experts else 0
        self.shared = FeedForward(dim, width, "relu2" if activation == "relu2" else "swiglu") if width else None
        self.shared_gate = Linear(dim, 1, bias=False) if shared_gate and width else None
        self.parallel = MoEParallel(LocalDispatcher(num_slots or num_experts))
        # The gradient given to the aux losses in backward: 1 / micro-batches (begin_step).
        self.aux_loss_scale = 1.0
        # Sums over the micro-batches of a step, on the device, from begin_step: aux_loss, z_loss,
        # dropped_fraction (float64 scalars) and tokens_per_expert ([E] float64).
        self.stats_accum: dict[str, torch.Tensor] = {}

    def begin_step(self, micro_batches: int) -> None:
        """Start a training step of ``micro_batches`` forward + backward passes: the aux losses'
        gradients are scaled by 1 / micro_batches (the LM loss is divided the same way), and the
        statistics and the dispatch's row count start from zero (an evaluation since the last
        step is not counted)."""
        self.aux_loss_scale = 1.0 / micro_batches
        self.stats_accum = {}
        self.parallel.dispatcher.take_rows_sent()

    def take_statistics(self) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
        """What this layer measured since :meth:`begin_step`: (sums over the micro-batches on the
        device — ``aux_loss``, ``z_loss``, ``dropped_fraction`` float64 scalars,
        ``tokens_per_expert`` [E] float64 and under EPLB ``tokens_per_slot`` [R] —, rows its
        dispatch sent within / across NVLink
        domains, host integers); both start again from zero."""
        stats, self.stats_accum = self.stats_accum, {}
        return stats, self.parallel.dispatcher.take_rows_sent()

    @torch.no_grad()
    def _record_stats(self, aux: torch.Tensor, z: torch.Tensor, idx_TK: torch.Tensor, kept: torch.Tensor | None,
                      assignments: torch.Tensor | int, slot_TK: torch.Tensor | None = None) -> None:
        """``assignments``: the real (not padding) token-expert assignments of ``idx_TK``;
        ``slot_TK``: their slots under EPLB (counted as ``tokens_per_slot``), else None."""
        if kept is None:
            dropped = torch.zeros((), dtype=torch.float64, device=idx_TK.device)
        else:  # (a micro-batch of padding only has no assignment: nothing dropped)
            total = assignments.clamp(min=1) if isinstance(assignments, torch.Tensor) else assignments
            dropped = (total - kept.sum()).double() / total
        new = {"aux_loss": aux.detach().double(), "z_loss": z.detach().double(),
               "tokens_per_expert": expert_counts(idx_TK, self.num_experts).double(),
               "dropped_fraction": dropped}
        if slot_TK is not None:
            new["tokens_per_slot"] = expert_counts(slot_TK, self.experts.slot_map.num_slots).double()
        for k, v in new.items():
            self.stats_accum[k] = self.stats_accum[k] + v if k in self.stats_accum else v

    def route(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routing of T tokens from their fp32 logits [T, E]: (scores [T, E], combine weights
        [T, K], expert ids [T, K]).

        1. scores: ``softmax`` over the experts (Mixtral, Switch) or an independent ``sigmoid``
           per expert (DeepSeek-V3 §2.1.2 eq. 15);
        2. the choice uses scores + ``expert_bias`` when aux-loss-free balancing is on (the bias
           never enters the weights);
        2a. group-limited routing with fixed groups (``n_group`` / ``topk_group``):
           :func:`limit_to_fixed_groups`;
        3. node-limited routing (DeepSeek-V3 §2.2 "node-limited routing", Megatron-Core's
           group-limited top-k): with ``parallel.max_groups`` M, each group of experts (the
           experts of one NVLink domain's ranks) is scored by the sum of its top ⌈K / M⌉ choice
           scores, the M best groups kept, the other experts masked;
        4. top-k of the choice; the weights are the unbiased scores of the chosen experts,
           renormalised to sum to 1 with ``norm_topk_prob``, times ``routed_scaling_factor``.
        """
        scores_TE = logits_TE.softmax(-1) if self.score_function == "softmax" else logits_TE.sigmoid()
        choice_TE = scores_TE if self.expert_bias is None else scores_TE + self.expert_bias
        if self.n_group is not None:
            choice_TE = limit_to_fixed_groups(choice_TE, self.n_group, self.topk_group)
        if self.parallel.max_groups is not None:
            choice_TE = limit_to_groups(choice_TE, self.parallel.expert_groups, self.parallel.max_groups, self.top_k)
        topk_idx_TK = choice_TE.topk(self.top_k, dim=-1).indices
        topk_p_TK = scores_TE.gather(1, topk_idx_TK)
        if self.norm_topk_prob:
            topk_p_TK = topk_p_TK / (topk_p_TK.sum(-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            topk_p_TK = topk_p_TK * self.routed_scaling_factor
        return scores_TE, topk_p_TK, topk_idx_TK

    def _shared_output(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The shared experts' output [T, D], scaled per token by sigmoid(gate · x) when gated
        (Qwen2-MoE)."""
        shared_TD = self.shared(x_TD)
        if self.shared_gate is not None:
            shared_TD = torch.sigmoid(self.shared_gate(x_TD)) * shared_TD
        return shared_TD

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor, skip: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing step (DeepSeek-V3 §2.1.2): bias_e += rate · sign(mean load −
        load_e). ``tokens_per_expert``: [E], this step's assignments over the whole global batch
        (the same on every rank, so the bias is too); ``skip``: a 0-dim device flag, 1 when the
        step's update is not applied (the bias stays); on the device, no host read."""
        load = tokens_per_expert.to(self.expert_bias.dtype)
        step = torch.sign(load.mean() - load)
        if skip is not None:
            step = step * (1 - skip.to(step.dtype))
        self.expert_bias.add_(step, alpha=self.bias_update_rate)

    def router_losses(self, logits_BSE: torch.Tensor, probs_BSE: torch.Tensor, idx_BSK: torch.Tensor,
                      real_BS: torch.Tensor | None = None, count_B: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Load-balancing loss per sequence and router z-loss.

        aux = mean over sequences b of E/(S²·K) · Σ_e count_be · Σ_s p_bse, the Switch
        Transformer loss (Fedus et al. 2021, eq. 4-6) in Megatron-Core's top-k form, evaluated on
        each sequence (GShard's groups = sequences; DeepSeek-V3 §2.1.2 "sequence-wise" loss) so
        its value does not depend on how a batch is split over ranks or micro-batches. Equals 1
        for a perfectly uniform router. z = mean over tokens of logsumexp(logits)² (Zoph et al.
        2022, ST-MoE eq. 5). S is the whole sequence: this rank holds 1 / ``parallel.seq_ranks``
        of it. With padding (``real_BS`` [B, S] bool, this rank's real tokens; ``count_B`` [B],
        the real tokens of each whole sequence; padding assignments carry the id E in
        ``idx_BSK``) both count the real tokens only: S is the sequence's real length and z the
        mean over the micro-batch's real tokens. Returns (aux, z, counts_BE).
        """
        B, S, E = probs_BSE.shape
        par = self.parallel
        idx = idx_BSK.reshape(B, -1)
        counts_BE = torch.zeros(B, E + (real_BS is not None), device=idx_BSK.device, dtype=probs_BSE.dtype)
        counts_BE.scatter_add_(1, idx, torch.ones_like(idx, dtype=probs_BSE.dtype))
        counts_BE = counts_BE[:, :E]  # the padding column, if any, dropped
        if par.sum_seq_counts is not None:
            counts_BE = par.sum_seq_counts(counts_BE)
        lse2_BS = torch.logsumexp(logits_BSE, dim=-1).pow(2)
        if real_BS is None:
            seq_len = S * par.seq_ranks
            psum_BE = probs_BSE.sum(1)
            aux = (counts_BE * psum_BE).sum(-1).mean() * (E / (seq_len * seq_len * self.top_k)) * par.aux_scale
            return aux, lse2_BS.mean() * par.z_scale, counts_BE
        real = real_BS.to(probs_BSE.dtype)
        psum_BE = (probs_BSE * real.unsqueeze(-1)).sum(1)
        seq_len_B = count_B.to(probs_BSE.dtype).clamp(min=1)
        aux = ((counts_BE * psum_BE).sum(-1) / seq_len_B.square()).mean() * (E / self.top_k) * par.aux_scale
        # This rank's tokens' share of the mean over the real tokens of the whole micro-batch,
        # scaled as the per-sequence loss is (aux_scale: the gradient reduction divides by cp).
        z = (lse2_BS * real).sum() / seq_len_B.sum() * par.aux_scale
        return aux, z, counts_BE

    def forward(self, x_BSD: torch.Tensor, tokens: TokenMask | None = None) -> torch.Tensor:
        """x_BSD: [B, S, D] → [B, S, D]. ``tokens``: which tokens are real (None: all); padding
        is not routed: no expert, no dispatch, no share of the losses or statistics, and the
        routed experts add 0 to it (the shared experts still compute it)."""
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(-1, D)
        dispatcher = self.parallel.dispatcher
        real_BS = count_B = None
        if tokens is not None:
            real_BS = tokens.part(*(self.parallel.token_part or (0, 1)))
            count_B = tokens.count_B

        # 1. route (fp32): scores, the top-k choice and its combine weights; the losses.
        logits_TE = self.router(x_TD)
        scores_TE, topk_p_TK, topk_idx_TK = self.route(logits_TE)
        assignments: torch.Tensor | int = topk_idx_TK.numel()
        if real_BS is not None:  # padding assignments get the expert id E (none) and weight 0
            real_T1 = real_BS.reshape(-1, 1)
            topk_idx_TK = topk_idx_TK.masked_fill(~real_T1, self.num_experts)
            topk_p_TK = topk_p_TK.masked_fill(~real_T1, 0.0)
            assignments = real_BS.sum() * self.top_k
        # The balance loss wants a distribution per token: sigmoid scores are normalised first
        # (DeepSeek-V3 eq. 18).
        probs_TE = scores_TE if self.score_function == "softmax" else scores_TE / scores_TE.sum(-1, keepdim=True)
        aux, z, _ = self.router_losses(logits_TE.view(B, S, -1), probs_TE.view(B, S, -1), topk_idx_TK.view(B, S, -1),
                                       real_BS, count_B)

        # 2.-3. permute by expert and dispatch to the ranks holding them.
        capacity: int | torch.Tensor | None = None
        if self.capacity_factor is not None:
            if real_BS is None:
                capacity = math.ceil(self.capacity_factor * x_TD.shape[0] * self.top_k / self.num_experts)
            else:  # of the real tokens, on the device (the capacity's selection reads the host anyway)
                capacity = torch.ceil(real_BS.sum().double() * self.capacity_factor * self.top_k
                                      / self.num_experts).long()
        routed_TD, combine_TK = x_TD, topk_p_TK
        if self.probs_on_input:  # f(p·x): the token scaled before it leaves (fp32 product, x's dtype)
            routed_TD = (x_TD.float() * topk_p_TK).to(x_TD.dtype)
            combine_TK = torch.ones_like(topk_p_TK)
        # Under EPLB each assignment goes to one replica (slot) of its expert.
        slot_map = self.experts.slot_map
        dispatch_TK = topk_idx_TK if slot_map is None else slot_map.physical(topk_idx_TK, real_BS is not None)
        pending = dispatcher.start(round_trip(routed_TD, self.dispatch_wire), dispatch_TK, capacity,
                                   real_BS is not None)
        # The shared experts need no routed token: they compute while the dispatch all-to-all is
        # in flight (under expert parallelism the rows travel asynchronously until finish()).
        shared_TD = self._shared_output(x_TD) if self.shared is not None and self.parallel.overlap_shared else None
        x_ND, counts_El, handle = dispatcher.finish(pending)

        # 4. expert compute, rows grouped by local expert.
        y_ND = self.experts(x_ND, counts_El, handle.host_counts, padding_rows=handle.padding_rows)

        # 5.-6. back to the source rank, in assignment order, weighted (fp32) and summed over k.
        y_TD = dispatcher.combine(y_ND, handle, combine_TK)
        if self.shared is not None:
            y_TD = y_TD + (shared_TD if shared_TD is not None else self._shared_output(x_TD))

        if not is_recomputing():  # activation recomputation must not count twice
            self._record_stats(aux, z, topk_idx_TK, handle.kept, assignments,
                               dispatch_TK if slot_map is not None else None)
        total_aux = self.aux_loss_coef * aux + self.z_loss_coef * z
        out = y_TD.view(B, S, D).to(x_BSD.dtype)
        if self.training and total_aux.requires_grad:
            out = AttachAuxLoss.apply(out, total_aux, self.aux_loss_scale)
        return out


def limit_to_fixed_groups(choice_TE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Mask (−inf) the experts outside each token's ``topk_group`` best of ``n_group`` groups of
    consecutive expert ids, a group scored by the sum of its two best choice scores (DeepSeek-V3's
    and GLM-4.5's router: Hugging Face's ``DeepseekV3TopkRouter``; DeepSeek-V3 §2.1.2 with
    K_r / M = 8 / 4 = 2). choice_TE: [T, E] → [T, E]."""
    T, E = choice_TE.shape
    per = E // n_group
    group_scores_TG = choice_TE.view(T, n_group, per).topk(min(2, per), dim=-1).values.sum(-1)
    keep_TG = torch.zeros(T, n_group, dtype=torch.bool, device=choice_TE.device)
    keep_TG.scatter_(1, group_scores_TG.topk(topk_group, dim=-1).indices, True)
    return choice_TE.masked_fill(~keep_TG.repeat_interleave(per, dim=1), float("-inf"))


def limit_to_groups(choice_TE: torch.Tensor, groups: "ExpertGroups", max_groups: int, top_k: int) -> torch.Tensor:
    """Mask (−inf) the experts outside each token's ``max_groups`` best groups.

    choice_TE: [T, E] scores; ``groups``: the group of each expert (G groups of equal size); a
    group's score is the sum of its top ⌈top_k / max_groups⌉ expert scores (DeepSeek-V3's "sum
    of the highest K_r / M affinity scores of the experts distributed on each node").
    """
    T, E = choice_TE.shape
    G = groups.num_groups
    per = E // G
    k = min(per, -(-top_k // max_groups))
    group_scores_TG = choice_TE[:, groups.order].view(T, G, per).topk(k, dim=-1).values.sum(-1)
    keep_TG = torch.zeros(T, G, dtype=torch.bool, device=choice_TE.device)
    keep_TG.scatter_(1, group_scores_TG.topk(max_groups, dim=-1).indices, True)
    return choice_TE.masked_fill(~keep_TG[:, groups.of_expert], float("-inf"))


@dataclass
class ExpertGroups:
    """Experts grouped by the NVLink domain of the rank that holds them (node-limited routing).

    of_expert: [E] int64, the group of each expert; order: [E] int64, the experts sorted by group
    (stable); num_groups: G (a host int: no device read to learn it)."""

    of_expert: torch.Tensor
    order: torch.Tensor
    num_groups: int

    @classmethod
    def from_list(cls, group_of_expert: list[int], device: torch.device) -> "ExpertGroups":
        """Raises ValueError: groups of unequal size."""
        sizes = {g: group_of_expert.count(g) for g in set(group_of_expert)}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"expert groups of unequal sizes {sorted(sizes.values())}")
        ids = sorted(sizes)
        dense = [ids.index(g) for g in group_of_expert]  # 0..G-1
        of_expert = torch.tensor(dense, dtype=torch.int64, device=device)
        return cls(of_expert, torch.argsort(of_expert, stable=True), len(ids))
