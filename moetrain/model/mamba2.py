"""Mamba-2: the selective state-space layer of "Transformers are SSMs" (Dao & Gu 2024, §§6-7, the
SSD layer), as NVIDIA's Nemotron-H hybrids compute it.

Shape legend: B batch, S sequence, D hidden, H heads, P head dim, G groups (of heads sharing B
and C), N state size, C chunk length.

The recurrence, per head, with a state h_t ∈ R^{P×N} (§6, eq. 1-2 with scalar A):

    h_t = exp(Δ_t A) h_{t−1} + Δ_t x_t B_tᵀ,      y_t = h_t C_t + D x_t

with Δ_t = clamp(softplus(dt_t + dt_bias), time_step_min, ∞) and A = −exp(A_log) per head; the
G groups of B_t, C_t ∈ R^N are shared by H / G consecutive heads. Two paths compute it:

* :func:`recurrent_ssd` — token by token, the definition (the reference the tests hold the
  chunked path to);
* :func:`mamba_ssm_scan` — mamba-ssm's Triton kernel (``mamba_chunk_scan_combined``: CUDA;
  ``model.mamba_backend: mamba_ssm``), a thin adapter with this module's conventions, proved
  against the chunked path below by ``benchmarks/gpu_check.py``;
* :func:`chunk_ssd` — chunks of C tokens (§7, the block decomposition): inside a chunk, with
  A_i = Π_{j≤i} exp(Δ_j A) and Γ_ij = A_i / A_j, Y = (C Bᵀ ⊙ Γ ⊙ causal)(Δ X) + diag(A) C h₀ᵀ and
  the last state h_C = A_C h₀ + (Δ X)ᵀ (B ⊙ A_C / A); the state passes from chunk to chunk.
  This is what runs on CPU (pure PyTorch, fp32 inside).

The layer (:class:`Mamba2`, Nemotron-H's ``NemotronHMamba2Mixer`` with its parameter names):
``in_proj`` to the gate z [H·P], the convolution's input xBC [H·P + 2·G·N] and dt [H]; a causal
depthwise convolution over xBC (``conv1d``, with a bias when ``conv_bias``), SiLU; the scan; y
gated by SiLU(z), then an RMSNorm over each group's H/G·P channels (``norm``: gate before norm, as
Nemotron-H's ``norm_before_gate=False``); ``out_proj``. Packed documents restart the state and
the convolution at every document, as :mod:`moetrain.model.gated_deltanet` does.

moetrain keeps ``in_proj``'s rows and the convolution's channels grouped by group (each group's
z, x, B, C, dt rows together; its x, B, C channels together; :func:`in_proj_rows_in_hf_order`,
:func:`conv_channels_in_hf_order` give Hugging Face's order), so that tensor parallelism splits
whole groups in contiguous blocks (G / tp of them per rank, with their heads), and context
parallelism exchanges whole groups for the sequence (each cp rank runs the whole sequence of
G / cp groups, :class:`moetrain.parallel.context.HeadAllToAll`), as gated DeltaNet does with its
key heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.attention import DocumentMask
from moetrain.model.gated_deltanet import HeadExchange, over_documents
from moetrain.model.layers import Linear, local_cast

__all__ = ["Mamba2", "GroupedGatedRMSNorm", "chunk_ssd", "recurrent_ssd", "in_proj_rows_in_hf_order",
           "conv_channels_in_hf_order", "mamba_ssm_scan", "ssd_scan"]

MAMBA_BACKENDS = ("torch", "mamba_ssm")


def _prepare(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor):
    """x [B, S, H, P], dt [B, S, H] (already Δ), A [H], B / C [B, S, G, N] → fp32 [B, H, S, *] with
    B, C repeated over the heads of each group, Δ·x and the per-token log decays Δ·A."""
    H, G = x.shape[2], B.shape[2]
    if H % G:
        raise ValueError(f"{H} heads are not a multiple of {G} groups")
    B, C = (t.repeat_interleave(H // G, dim=2) for t in (B, C))
    x, B, C = (t.transpose(1, 2).float() for t in (x, B, C))
    dt = dt.transpose(1, 2).float()
    return x * dt.unsqueeze(-1), dt * A.float()[None, :, None], B, C


def recurrent_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD recurrence token by token (the module docstring's, without D).

    x: [B, S, H, P]; dt: [B, S, H] the step Δ (after softplus and clamp); A: [H] (negative);
    B, C: [B, S, G, N]; initial_state: [B, H, P, N] or None (zeros). Returns (y [B, S, H, P] in x's
    dtype, final state [B, H, P, N] fp32)."""
    dtype = x.dtype
    xdt, log_a, B, C = _prepare(x, dt, A, B, C)
    Bsz, H, S, P = xdt.shape
    h = torch.zeros(Bsz, H, P, B.shape[-1], device=x.device) if initial_state is None else initial_state.float()
    out = []
    for t in range(S):
        h = h * log_a[:, :, t].exp()[..., None, None] + xdt[:, :, t].unsqueeze(-1) * B[:, :, t].unsqueeze(-2)
        out.append((h * C[:, :, t].unsqueeze(-2)).sum(-1))
    return torch.stack(out, dim=2).transpose(1, 2).to(dtype), h


def chunk_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              chunk_size: int = 128, initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan in chunks of ``chunk_size`` tokens (the module docstring's block form); the
    same arguments and results as :func:`recurrent_ssd`, equal to it within fp32 rounding. The
    last chunk may be shorter (padded with Δ = 0 tokens, which change nothing).

    Raises:
        ValueError: heads not a multiple of groups.
    """
    dtype = x.dtype
    xdt, log_a, B, C = _prepare(x, dt, A, B, C)
    Bsz, H, S, P = xdt.shape
    N, L = B.shape[-1], chunk_size
    pad = (-S) % L
    if pad:
        xdt, B, C = (F.pad(t, (0, 0, 0, pad)) for t in (xdt, B, C))
        log_a = F.pad(log_a, (0, pad))
    n = (S + pad) // L
    xdt, B, C = (t.view(Bsz, H, n, L, -1) for t in (xdt, B, C))
    cum = log_a.view(Bsz, H, n, L).cumsum(-1)  # log A_i from the chunk's start
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    gamma = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    scores = (C @ B.transpose(-1, -2)) * gamma  # [.., L, L], causal
    c_a = C * cum.exp().unsqueeze(-1)  # C_i A_i
    b_last = B * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # B_j A_L / A_j
    a_last = cum[..., -1].exp()[..., None, None]
    h = torch.zeros(Bsz, H, P, N, device=x.device) if initial_state is None else initial_state.float()
    out = []
    # unbind: one backward node stacks the chunks' gradients (indexing would zero-fill a whole
    # gradient per chunk).
    for x_c, s_c, ca_c, b_c, a_c in zip(*(t.unbind(2) for t in (xdt, scores, c_a, b_last, a_last))):
        out.append(s_c @ x_c + ca_c @ h.transpose(-1, -2))
        h = a_c * h + x_c.transpose(-1, -2) @ b_c
    y = torch.stack(out, dim=2).reshape(Bsz, H, n * L, P)[:, :, :S]
    return y.transpose(1, 2).to(dtype), h


def mamba_ssm_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   chunk_size: int = 128, initial_state: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`chunk_ssd` through mamba-ssm's Triton kernel (``mamba_chunk_scan_combined``, CUDA):
    the same arguments (dt already Δ: no bias, softplus or clamp left to the kernel) and output
    y [B, S, H, P] in x's dtype; the final state is not returned (None): training reads the
    outputs only."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    y = mamba_chunk_scan_combined(x, dt.float(), A.float(), B.to(x.dtype), C.to(x.dtype), chunk_size,
                                  initial_states=initial_state)
    return y.to(x.dtype), None


def ssd_scan(backend: str):
    """The scan of ``model.mamba_backend``: ``torch`` (:func:`chunk_ssd`) or ``mamba_ssm``
    (:func:`mamba_ssm_scan`).

    Raises:
        ValueError: an unknown backend.
    """
    if backend == "torch":
        return chunk_ssd
    if backend == "mamba_ssm":
        return mamba_ssm_scan
    raise ValueError(f"mamba backend {backend!r}: expected one of {', '.join(MAMBA_BACKENDS)}")


def conv_channels_in_hf_order(num_heads: int, head_dim: int, state_size: int, groups: int) -> torch.Tensor:
    """perm [H·P + 2·G·N] int64: moetrain's convolution channel i is Hugging Face's channel perm[i]
    (moetrain: per group its x, B, C; HF: all x, all B, all C)."""
    xg, N = num_heads // groups * head_dim, state_size
    x_all = num_heads * head_dim
    return torch.cat([torch.cat([torch.arange(g * xg, (g + 1) * xg), x_all + torch.arange(g * N, (g + 1) * N),
                                 x_all + groups * N + torch.arange(g * N, (g + 1) * N)]) for g in range(groups)])


def in_proj_rows_in_hf_order(num_heads: int, head_dim: int, state_size: int, groups: int) -> torch.Tensor:
    """perm [2·H·P + 2·G·N + H] int64: moetrain's ``in_proj`` row i is Hugging Face's row perm[i]
    (moetrain: per group its z, x, B, C, dt; HF: all z, then the convolution's input in its
    order, then all dt)."""
    inner, hg = num_heads * head_dim, num_heads // groups
    conv = inner + conv_channels_in_hf_order(num_heads, head_dim, state_size, groups).view(groups, -1)
    dt = inner + inner + 2 * groups * state_size
    return torch.cat([torch.cat([torch.arange(g * hg * head_dim, (g + 1) * hg * head_dim), conv[g],
                                 dt + torch.arange(g * hg, (g + 1) * hg)]) for g in range(groups)])


class GroupedGatedRMSNorm(nn.Module):
    """y · SiLU(z), then an RMSNorm over each group of ``group_size`` channels, times the weight
    (Nemotron-H's ``NemotronHRMSNormGated``, gate before norm): y, z: [..., c] → [..., c] in y's
    dtype (c: the channels this rank holds, whole groups); statistics in fp32."""

    compute_dtype: torch.dtype | None = None

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        g = (y.float() * F.silu(z.float())).unflatten(-1, (-1, self.group_size))
        g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return local_cast(self.weight, self.compute_dtype) * g.to(y.dtype)


class Mamba2(nn.Module):
    """Nemotron-H's Mamba-2 token mixer (module docstring). x: [B, S, D] → [B, S, D].

    Args:
        dim: D. num_heads, head_dim: H, P (HF ``mamba_num_heads`` / ``mamba_head_dim``).
        state_size: N (``ssm_state_size``). groups: G (``n_groups``; H a multiple of G).
        conv_kernel: the convolution's width (``conv_kernel``). conv_bias: the convolution has a
        bias (``use_conv_bias``). norm_eps: the gated norm's epsilon. chunk_size: C of
        :func:`chunk_ssd`. time_step_min: Δ's lower bound (``time_step_min``).

    Parameters (HF names): ``in_proj`` [2·H·P + 2·G·N + H, D] (z, x, B, C, dt of each group in
    turn); ``conv1d`` weight [H·P + 2·G·N, 1, conv_kernel] (and bias; x, B, C of each group in
    turn); ``dt_bias``, ``A_log``, ``D`` [H]; ``norm.weight`` [H·P]; ``out_proj`` [D, H·P].

    Under tensor parallelism (:mod:`moetrain.parallel.tensor`) each tp rank holds G / tp groups
    and their heads: ``in_proj`` by rows, ``conv1d``, ``dt_bias``, ``A_log``, ``D`` and the norm's
    weight Shard(0), ``out_proj`` by columns.

    Raises:
        ValueError: H not a multiple of G.
    """

    compute_dtype: torch.dtype | None = None

    def __init__(self, dim: int, num_heads: int, head_dim: int, state_size: int, groups: int = 1,
                 conv_kernel: int = 4, conv_bias: bool = True, norm_eps: float = 1e-5, chunk_size: int = 128,
                 time_step_min: float = 0.0):
        super().__init__()
        if num_heads % groups:
            raise ValueError(f"mamba_num_heads {num_heads} is not a multiple of n_groups {groups}")
        self.num_heads, self.head_dim, self.state_size, self.groups = num_heads, head_dim, state_size, groups
        self.chunk_size, self.time_step_min = chunk_size, time_step_min
        inner = num_heads * head_dim
        channels = inner + 2 * groups * state_size
        self.in_proj = Linear(dim, inner + channels + num_heads, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, conv_kernel, groups=channels, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.empty(num_heads))
        self.norm = GroupedGatedRMSNorm(inner, inner // groups, norm_eps)
        self.out_proj = Linear(inner, dim, bias=False)
        self.scan = chunk_ssd
        # Context parallelism: exchanges tokens for groups; None in one process.
        self.context: HeadExchange | None = None

    def _mix(self, mixed: torch.Tensor, first_group: int) -> torch.Tensor:
        """One stretch of tokens that shares a state (a sequence, or one document of it) of groups
        ``first_group`` … of this rank's: ``mixed`` [B, S, g, xg + 2·N + hg] holds each group's x
        (its hg heads' xg = hg·P channels), B, C and dt; the convolution, Δ, the scan and the D
        skip. → y [B, S, g·hg, P]."""
        Bsz, S, g, _ = mixed.shape
        P, N, hg = self.head_dim, self.state_size, self.num_heads // self.groups
        width = hg * P + 2 * N  # one group's channels of the convolution: its x, B, C
        xbc, dt = mixed.split([width, hg], dim=-1)
        w = local_cast(self.conv1d.weight, self.compute_dtype).narrow(0, first_group * width, g * width)
        bias = (None if self.conv1d.bias is None
                else local_cast(self.conv1d.bias, self.compute_dtype).narrow(0, first_group * width, g * width))
        heads = (first_group * hg, g * hg)
        dt_bias, A_log, D = (local_cast(t, None).narrow(0, *heads).float() for t in (self.dt_bias, self.A_log, self.D))
        xbc = F.silu(F.conv1d(F.pad(xbc.reshape(Bsz, S, -1).transpose(1, 2), (w.shape[-1] - 1, 0)).to(w.dtype), w,
                              bias, groups=w.shape[0])).transpose(1, 2)
        x, B, C = xbc.reshape(Bsz, S, g, width).split([hg * P, N, N], dim=-1)
        x = x.reshape(Bsz, S, g * hg, P)
        step = F.softplus(dt.reshape(Bsz, S, -1).float() + dt_bias).clamp(min=self.time_step_min)
        y, _ = self.scan(x, step, -A_log.exp(), B, C, self.chunk_size)
        return y + (D[:, None] * x.float()).to(y.dtype)

    def forward(self, x_BSD: torch.Tensor, doc: DocumentMask | None = None) -> torch.Tensor:
        """``doc``: the documents of the whole samples (:class:`~moetrain.model.attention.DocumentMask`):
        the state and the convolution start afresh at every document; None: each sequence is one
        document."""
        Bsz, S, _ = x_BSD.shape
        P, N, hg = self.head_dim, self.state_size, self.num_heads // self.groups
        # -1 groups: under tensor parallelism the projection holds this rank's.
        proj = self.in_proj(x_BSD).view(Bsz, S, -1, 2 * hg * P + 2 * N + hg)
        z = proj[..., :hg * P].reshape(Bsz, S, -1)
        mixed = proj[..., hg * P:]  # per group: x, B, C, dt
        first = 0
        if self.context is not None:  # the whole sequence of some groups
            first = self.context.rank * (mixed.shape[2] // self.context.size)
            mixed = self.context.to_heads(mixed)
        y = over_documents(mixed, doc, lambda part: self._mix(part, first))
        if self.context is not None:  # back to this rank's tokens, every group
            y = self.context.to_sequence(y.unflatten(2, (-1, hg)).flatten(3)).unflatten(3, (hg, P)).flatten(2, 3)
        return self.out_proj(self.norm(y.reshape(Bsz, S, -1), z))
