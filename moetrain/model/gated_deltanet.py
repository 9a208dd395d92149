"""Gated DeltaNet: linear attention with the gated delta rule (Yang, Kautz & Hatamizadeh 2024,
"Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025), as Qwen3-Next's linear
attention layers compute it.

Shape legend: B batch, S sequence, D hidden, Hk query/key heads, Hv value heads (a multiple of
Hk: each query/key head serves Hv / Hk consecutive value heads), Dk key head dim, Dv value head
dim, C chunk length.

The recurrence, per value head, with a state S_t ∈ R^{Dk×Dv} (paper §3, eq. 10):

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,      o_t = S_tᵀ q_t

with α_t = exp(g_t) ∈ (0, 1] the gate (decay) and β_t ∈ (0, 1) the write strength; q and k are
L2-normalised and q is scaled by Dk^−½. Two paths compute it:

* :func:`recurrent_gated_delta_rule` — token by token, the definition (the reference the tests
  hold the chunked path to);
* :func:`fla_gated_delta_rule` — flash-linear-attention's chunked kernel
  (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, Triton: CUDA; ``model.linear_attention_backend:
  fla``), a thin adapter with this module's conventions, proved against the chunked path below
  by ``benchmarks/gpu_check.py``;
* :func:`chunk_gated_delta_rule` — chunks of C tokens (paper §3.3, the WY representation of
  DeltaNet, Yang et al. 2024 §3): inside a chunk, with A_i = Π_{j≤i} α_j (relative to the chunk's
  start) and Γ_ij = A_i / A_j, the per-token corrections δ solve one unit-lower-triangular
  system, δ = (I + tril₋₁(diag(β) (K Kᵀ ⊙ Γ)))⁻¹ diag(β) (V − diag(A) K S₀), so the chunk's
  output O = diag(A) Q S₀ + (Q Kᵀ ⊙ Γ ⊙ causal) δ and its last state S_C = A_C S₀ +
  (K ⊙ A_C / A)ᵀ δ are matmuls; the state passes from chunk to chunk. This is what runs on CPU
  (pure PyTorch, fp32 inside).

The layer (:class:`GatedDeltaNet`, Qwen3-Next's ``Qwen3NextGatedDeltaNet`` with its parameter
layout, so checkpoints convert by name): projections of q, k, v and the output gate z
(``in_proj_qkvz``, grouped by key head) and of b, a (``in_proj_ba``); a causal depthwise
convolution of width ``conv_kernel`` over q, k, v, then SiLU; β = σ(b); g = −exp(A_log) ·
softplus(a + dt_bias) (the decay's discretisation as in Mamba-2); the delta rule; an RMSNorm of
each head's output gated by SiLU(z) (``norm``), and ``out_proj``.

Packed documents: with document ids the state and the convolution window start afresh at every
document (each document is computed alone, as flash-linear-attention's variable-length kernels
take ``cu_seqlens``).

Context parallelism (``context``, set by :func:`moetrain.parallel.context.apply_context_parallel`):
the projections run on this rank's tokens; what the convolution and the delta rule read (q, k,
v, b, a) is exchanged by an all-to-all so that each cp rank holds the whole sequence of 1/cp of
the key heads (and their value heads), the recurrence runs there unchanged, and a second
all-to-all returns each token's output heads to the rank that holds the token (Ulysses' head
exchange, Jacobs et al. 2023, as Megatron-Core's gated DeltaNet does under cp). Per layer and
micro-batch that is 2·(cp − 1)/cp of the tokens' q, k, v, b, a and outputs in each direction of
the forward, the same in backward; no state passes between ranks.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.attention import DocumentMask
from moetrain.model.layers import Linear, cast, local_cast

__all__ = ["GatedDeltaNet", "GatedRMSNorm", "chunk_gated_delta_rule", "recurrent_gated_delta_rule", "l2_normalize",
           "conv_channels_in_hf_order", "fla_gated_delta_rule", "delta_rule"]

LINEAR_ATTENTION_BACKENDS = ("torch", "fla")


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last dim (flash-linear-attention's and Qwen3-Next's form:
    eps inside the root, on the sum)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """[B, S, H*, *] inputs → fp32 [B, Hv, S, *]: q/k repeated over the value heads they serve,
    L2-normalised, q scaled by Dk^−½."""
    Hk, Hv = k.shape[2], v.shape[2]
    if Hv % Hk:
        raise ValueError(f"{Hv} value heads are not a multiple of {Hk} key heads")
    if Hv != Hk:
        q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    q, k = l2_normalize(q), l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g.transpose(1, 2).float(), beta.transpose(1, 2).float()  # g: [B, Hv, S] or [B, Hv, S, Dk]


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token (the module docstring's recurrence).

    q, k: [B, S, Hk, Dk]; v: [B, S, Hv, Dv]; g: [B, S, Hv] log decays (≤ 0), one per head, or
    [B, S, Hv, Dk], one per key channel (Kimi Delta Attention: α_t = diag(exp(g_t)) scales each
    row of the state); beta: [B, S, Hv]; initial_state: [B, Hv, Dk, Dv] or None (zeros). Returns
    (o [B, S, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] fp32). q and k are L2-normalised
    here.
    """
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, S, Dk = k.shape
    state = (torch.zeros(B, H, Dk, v.shape[-1], device=v.device) if initial_state is None
             else initial_state.float())
    out = []
    for t in range(S):
        # α_t scales the whole state, or (per channel, KDA) each of its Dk rows.
        state = state * (g[:, :, t].exp()[..., None] if g.dim() == 4 else g[:, :, t].exp()[..., None, None])
        k_t = k[:, :, t]
        delta = beta[:, :, t, None] * (v[:, :, t] - (k_t.unsqueeze(-1) * state).sum(-2))
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out.append((q[:, :, t].unsqueeze(-1) * state).sum(-2))
    return torch.stack(out, dim=2).transpose(1, 2).to(dtype), state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           chunk_size: int = 64, initial_state: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in chunks of ``chunk_size`` tokens (the module docstring's WY form);
    the same arguments and results as :func:`recurrent_gated_delta_rule` (g per head or per key
    channel), equal to it within fp32 rounding. The last chunk may be shorter (it is padded with g = 0, β = 0 tokens, which
    change neither the outputs nor the state).

    Raises:
        ValueError: value heads not a multiple of key heads.
    """
    dtype = v.dtype
    per_channel = g.dim() == 4
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, S, Dk = k.shape
    Dv, C = v.shape[-1], chunk_size
    pad = (-S) % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g = F.pad(g, (0, 0, 0, pad) if per_channel else (0, pad))
        beta = F.pad(beta, (0, pad))
    n = (S + pad) // C
    q, k, v = (x.view(B, H, n, C, -1) for x in (q, k, v))
    g, beta = g.view(B, H, n, C, -1), beta.view(B, H, n, C)  # g: [..., C, Dk] or [..., C, 1]

    log_a = g.cumsum(-2)  # log A_i (per channel, or one column), from the chunk's start
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # Γ_ij = A_i / A_j for j ≤ i (exponent ≤ 0), 0 above the diagonal (masked before exp):
    # [..., C, C] per head, [..., C, C, Dk] per channel, where it weighs each product q_i·k_j and
    # k_i·k_j channel by channel (C·C·Dk floats a chunk: the price of the reference path).
    if per_channel:
        gamma = (log_a.unsqueeze(-2) - log_a.unsqueeze(-3)).masked_fill(~causal[..., None], float("-inf")).exp()
        kk = (k.unsqueeze(-2) * k.unsqueeze(-3) * gamma).sum(-1)
        attn = (q.unsqueeze(-2) * k.unsqueeze(-3) * gamma).sum(-1)  # causal, diagonal included
    else:
        log_a1 = log_a.squeeze(-1)
        gamma = (log_a1.unsqueeze(-1) - log_a1.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
        kk = (k @ k.transpose(-1, -2)) * gamma
        attn = (q @ k.transpose(-1, -2)) * gamma  # causal, diagonal included
    system = (beta.unsqueeze(-1) * kk).tril(-1) + torch.eye(C, device=q.device)
    a = log_a.exp()  # A_i: [..., C, Dk] or [..., C, 1]
    # δ = U − W S₀ for every chunk at once: U = T β V, W = T β A K with T = system⁻¹.
    rhs = torch.cat([beta.unsqueeze(-1) * v, beta.unsqueeze(-1) * a * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :Dv], solved[..., Dv:]
    q_a = q * a
    k_last = k * (log_a[..., -1:, :] - log_a).exp()  # k_j A_C / A_j
    a_last = log_a[..., -1, :].exp().unsqueeze(-1)  # [..., Dk, 1] or [..., 1, 1]: scales the state's rows

    state = torch.zeros(B, H, Dk, Dv, device=v.device) if initial_state is None else initial_state.float()
    out = []
    # unbind: one backward node stacks the chunks' gradients (indexing chunk c would allocate and
    # zero-fill a whole gradient per chunk: quadratic in the sequence).
    for u_c, w_c, q_c, attn_c, k_c, a_c in zip(*(t.unbind(2) for t in (u, w, q_a, attn, k_last, a_last))):
        delta = u_c - w_c @ state
        out.append(q_c @ state + attn_c @ delta)
        state = a_c * state + k_c.transpose(-1, -2) @ delta
    o = torch.stack(out, dim=2).reshape(B, H, n * C, Dv)[:, :, :S]
    return o.transpose(1, 2).to(dtype), state


def fla_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         chunk_size: int = 64, initial_state: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`chunk_gated_delta_rule` through flash-linear-attention's Triton kernel (CUDA): the
    same arguments (q, k [B, S, Hk, Dk] not yet normalised, v [B, S, Hv, Dv], g and beta
    [B, S, Hv]) and output o [B, S, Hv, Dv] in v's dtype; it normalises q and k in the kernel
    (``use_qk_l2norm_in_kernel``, eps 1e-6 as here) and chooses its own chunk length. The final
    state is not returned (None): training reads the outputs only. g and beta go in fp32."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    o, _ = fla_chunk(q, k, v.to(q.dtype), g.float(), beta.float(), scale=q.shape[-1] ** -0.5,
                     initial_state=initial_state, output_final_state=False, use_qk_l2norm_in_kernel=True)
    return o.to(v.dtype), None


def delta_rule(backend: str):
    """The delta rule of ``model.linear_attention_backend``: ``torch`` (:func:`chunk_gated_delta_rule`)
    or ``fla`` (:func:`fla_gated_delta_rule`).

    Raises:
        ValueError: an unknown backend.
    """
    if backend == "torch":
        return chunk_gated_delta_rule
    if backend == "fla":
        return fla_gated_delta_rule
    raise ValueError(f"linear attention backend {backend!r}: expected one of {', '.join(LINEAR_ATTENTION_BACKENDS)}")


def over_documents(mixed: torch.Tensor, doc: DocumentMask | None, mix) -> torch.Tensor:
    """``mix`` run on each document of each sequence alone (its state and convolution start
    afresh), the outputs concatenated back: mixed [B, S_full, ...] (whole sequences), ``mix``:
    [1, n, ...] → [1, n, ...]; ``doc`` None: ``mix(mixed)``. The documents' lengths are read to
    the host once per forward (cached in ``doc.cache``) and reused by every layer."""
    if doc is None:
        return mix(mixed)
    lengths = doc.cache.get("document_lengths")
    if lengths is None:
        ids = doc.doc_ids
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        rows: list[list[int]] = [[] for _ in range(ids.shape[0])]
        for b, s in starts.nonzero().tolist():  # the one host read
            rows[b].append(s)
        lengths = [[end - s for s, end in zip(r, r[1:] + [ids.shape[1]])] for r in rows]
        doc.cache["document_lengths"] = lengths
    return torch.cat([torch.cat([mix(part) for part in mixed[i:i + 1].split(row, dim=1)], dim=1)
                      for i, row in enumerate(lengths)])


def over_heads(mixed: torch.Tensor, doc: DocumentMask | None, context: HeadExchange | None, mix) -> torch.Tensor:
    """A recurrent layer's heads mixed per document (:func:`over_documents`), with context
    parallelism's head exchange around them: ``mixed`` [B, S, h, W], per head (this rank's tokens
    under ``context``) what the recurrence reads; ``mix(part, first_head)`` → [1, n, h', W'], with
    ``first_head`` the first of the heads it gets among this rank's (0 without ``context``, else
    the whole sequence of 1/cp of them). → [B, S, h', W'] for this rank's tokens."""
    first = 0
    if context is not None:  # the whole sequence of some heads
        first = context.rank * (mixed.shape[2] // context.size)
        mixed = context.to_heads(mixed)
    o = over_documents(mixed, doc, lambda part: mix(part, first))
    return context.to_sequence(o) if context is not None else o  # back to this rank's tokens, every head


def conv_channels_in_hf_order(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
                              ) -> torch.Tensor:
    """perm [2·Hk·Dk + Hv·Dv] int64 with moetrain's convolution channel i = Hugging Face's
    channel perm[i]: moetrain groups them by key head (q_h, k_h, the v of its value heads), HF
    (Qwen3-Next's ``conv1d``) puts all q, then all k, then all v."""
    Dk, rv = head_k_dim, num_v_heads // num_k_heads * head_v_dim
    kd = num_k_heads * Dk
    return torch.cat([torch.cat([torch.arange(h * Dk, (h + 1) * Dk), kd + torch.arange(h * Dk, (h + 1) * Dk),
                                 2 * kd + torch.arange(h * rv, (h + 1) * rv)]) for h in range(num_k_heads)])


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, scaled by SiLU of the gate (Qwen3-Next's
    ``Qwen3NextRMSNormGated``; flash-linear-attention's ``FusedRMSNormGated``) or, with ``gate
    = "sigmoid"``, by its sigmoid (Kimi Linear's ``o_norm``): x, z: [..., Dv] → [..., Dv] in x's
    dtype; the statistics in fp32, the weight [Dv] shared by the heads.

    Raises:
        ValueError: ``gate`` neither ``silu`` nor ``sigmoid``."""

    compute_dtype: torch.dtype | None = None

    def __init__(self, dim: int, eps: float = 1e-6, gate: str = "silu"):
        super().__init__()
        if gate not in ("silu", "sigmoid"):
            raise ValueError(f"gate {gate!r}: expected silu or sigmoid")
        self.eps, self.gate = eps, gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = cast(self.weight, self.compute_dtype)
        gate = F.silu(z.float()) if self.gate == "silu" else torch.sigmoid(z.float())
        return ((w * xf.to(x.dtype)).float() * gate).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's gated-DeltaNet token mixer (module docstring). x: [B, S, D] → [B, S, D].

    Args:
        dim: D. num_k_heads, num_v_heads: Hk, Hv (HF ``linear_num_key_heads`` /
        ``linear_num_value_heads``; Hv a multiple of Hk). head_k_dim, head_v_dim: Dk, Dv
        (``linear_key_head_dim`` / ``linear_value_head_dim``). conv_kernel: the causal depthwise
        convolution's width (``linear_conv_kernel_dim``). norm_eps: the gated norm's epsilon.
        chunk_size: C of :func:`chunk_gated_delta_rule`.

    Parameters (HF names): ``in_proj_qkvz`` [Hk·(2Dk + 2·Hv/Hk·Dv), D], rows grouped by key head
    (q, k, v, z of its value heads); ``in_proj_ba`` [2·Hv, D], grouped likewise (b, a);
    ``conv1d.weight`` [2·Hk·Dk + Hv·Dv, 1, conv_kernel], its channels grouped by key head too
    (q, k, v of its value heads; HF orders them all q, all k, all v: :mod:`moetrain.hf.tensors`
    permutes them), so that every per-head tensor splits over ranks by key heads in contiguous
    blocks; ``A_log``, ``dt_bias`` [Hv]; ``norm.weight`` [Dv]; ``out_proj`` [D, Hv·Dv].

    Under tensor parallelism (:mod:`moetrain.parallel.tensor`) each tp rank holds Hk / tp key
    heads and their value heads: the projections by rows, ``conv1d``, ``A_log`` and ``dt_bias``
    Shard(0), ``out_proj`` by columns; the gated norm's weight is whole on every rank.

    Raises:
        ValueError: Hv not a multiple of Hk.
    """

    compute_dtype: torch.dtype | None = None

    def __init__(self, dim: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int = 4, norm_eps: float = 1e-6, chunk_size: int = 64):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads {num_v_heads} is not a multiple of linear_num_key_heads "
                             f"{num_k_heads}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.chunk_size = chunk_size
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.in_proj_qkvz = Linear(dim, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = Linear(dim, 2 * num_v_heads, bias=False)
        channels = 2 * key_dim + value_dim
        self.conv1d = nn.Conv1d(channels, channels, conv_kernel, groups=channels, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, norm_eps)
        self.out_proj = Linear(value_dim, dim, bias=False)
        # The delta rule's implementation (chunk_gated_delta_rule's signature).
        self.rule = chunk_gated_delta_rule
        # Context parallelism: exchanges tokens for heads (module docstring); None in one process.
        self.context: HeadExchange | None = None

    def _mix(self, mixed: torch.Tensor, first_head: int) -> torch.Tensor:
        """One stretch of tokens that shares a state (a sequence, or one document of it) of key
        heads ``first_head`` … of this rank's: ``mixed`` [B, S, hk, 2·Dk + r·Dv + 2·r] holds each
        key head's q, k and the v, b, a of its r value heads; the convolution, the gates and the
        delta rule. → o [B, S, hk·r, Dv]."""
        B, S, hk, _ = mixed.shape
        Dk, Dv, r = self.head_k_dim, self.head_v_dim, self.num_v_heads // self.num_k_heads
        width = 2 * Dk + r * Dv  # one key head's channels of the convolution: its q, k, v
        qkv, b, a = mixed.split([width, r, r], dim=-1)
        # This rank's heads (under tp these tensors hold them already), then the ones given.
        w = local_cast(self.conv1d.weight, self.compute_dtype).narrow(0, first_head * width, hk * width)
        A_log = local_cast(self.A_log, None).narrow(0, first_head * r, hk * r)
        dt_bias = local_cast(self.dt_bias, None).narrow(0, first_head * r, hk * r)
        # Causal depthwise convolution: left-pad by width − 1, so position t sees t − width + 1 … t.
        qkv = F.silu(F.conv1d(F.pad(qkv.reshape(B, S, -1).transpose(1, 2), (w.shape[-1] - 1, 0)).to(w.dtype), w,
                              groups=w.shape[0])).transpose(1, 2)
        q, k, v = qkv.reshape(B, S, hk, width).split([Dk, Dk, r * Dv], dim=-1)
        beta = torch.sigmoid(b.reshape(B, S, -1).float())
        g = -A_log.float().exp() * F.softplus(a.reshape(B, S, -1).float() + dt_bias.float())
        o, _ = self.rule(q, k, v.reshape(B, S, hk * r, Dv), g, beta, self.chunk_size)
        return o

    def forward(self, x_BSD: torch.Tensor, doc: DocumentMask | None = None) -> torch.Tensor:
        """``doc``: the documents of the whole samples (:class:`~moetrain.model.attention.DocumentMask`):
        the state and the convolution start afresh at every document; None: each sequence is one
        document."""
        B, S, _ = x_BSD.shape
        Dk, Dv, r = self.head_k_dim, self.head_v_dim, self.num_v_heads // self.num_k_heads
        # -1 key heads: under tensor parallelism the projections hold this rank's.
        qkvz = self.in_proj_qkvz(x_BSD).view(B, S, -1, 2 * Dk + 2 * r * Dv)
        ba = self.in_proj_ba(x_BSD).view(B, S, -1, 2 * r)
        z = qkvz[..., 2 * Dk + r * Dv:].reshape(B, S, -1, Dv)
        # Per key head what the recurrence reads: q, k, v (its value heads), b, a.
        mixed = torch.cat([qkvz[..., :2 * Dk + r * Dv], ba], dim=-1)
        o = over_heads(mixed, doc, self.context, self._mix)
        o = self.norm(o, z.to(o.dtype))
        return self.out_proj(o.reshape(B, S, -1))


class HeadExchange(Protocol):
    """Context parallelism's exchange of a layer's tokens for its heads
    (:class:`moetrain.parallel.context.HeadAllToAll`): ``rank`` / ``size`` of the cp group."""

    rank: int
    size: int

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S/cp, H, W] this rank's tokens of every head → [B, S, H/cp, W] the whole
        sequence (in position order) of heads rank·H/cp …, with autograd."""

    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse: [B, S, H'/cp, W] → [B, S/cp, H', W], with autograd."""
