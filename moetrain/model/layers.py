"""Dense building blocks of the decoder: RMSNorm, rotary embedding, grouped-query attention, SwiGLU.

Shape legend: B batch, S sequence (local to this rank under context/sequence parallelism),
D hidden, H query heads, G kv heads, Dh head dim, F ffn width.

Every module is single-device and can be built on the meta device; ``reset_parameters`` is
not used. Initialisation is done by :func:`moetrain.model.init.init_weights` so that it does
not depend on how parameters are later split over ranks.

Mixed precision (``train.precision: bf16``): parameters stay fp32 (the master weights) and every
module that holds weights casts them to its ``compute_dtype`` where it uses them, so matmuls and
activations run in bf16 while autograd returns fp32 gradients to the fp32 parameters (the cast's
backward). :func:`set_compute_dtype` sets it on a whole model. Under ZeRO, FSDP2's
``MixedPrecisionPolicy`` has already cast the weights and the casts here are no-ops: both paths
compute the same thing (see :mod:`moetrain.parallel.precision`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.attention import DocumentMask, head_max_logits, sdpa_attention
from moetrain.model import wgrad
from moetrain.model.fp8 import dequantize_blocks
from moetrain.model.fp8_gemm import Fp8Recipe, fp8_linear


def cast(w: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``w`` in ``dtype`` (``None``: as it is). Differentiable: the gradient returns in w's dtype."""
    return w if dtype is None else w.to(dtype)


def local_cast(w: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The piece of weight ``w`` this rank computes with, cast to ``dtype`` (None: as it is): ``w`` itself, or the
    local shard of a DTensor (a module whose inputs are this rank's own rows, such as the
    experts under expert parallelism). Differentiable: the gradient returns with w's placement."""
    from torch.distributed.tensor import DTensor

    return cast(w.to_local() if isinstance(w, DTensor) else w, dtype)


def dequantize(codes: torch.Tensor, scale_inv: torch.Tensor, block: int, dtype: torch.dtype | None) -> torch.Tensor:
    """A frozen FP8 weight (``train.lora.base_dtype: fp8``) in ``dtype`` (None: fp32), computed
    per use and never stored: codes [..., R, C] · scale_inv [..., ⌈R/B⌉, ⌈C/B⌉] per B × B block
    (:func:`moetrain.model.fp8.dequantize_blocks`). A tensor-parallel weight is dequantized on its
    local piece (its scales are placed on the same rows / columns, whole blocks) and returned as
    a DTensor placed as the codes are. No gradient flows to either."""
    from torch.distributed.tensor import DTensor

    dtype = dtype or torch.float32
    if isinstance(codes, DTensor):
        local = dequantize_blocks(codes.to_local(), scale_inv.to_local(), block, dtype)
        return DTensor.from_local(local, codes.device_mesh, codes.placements, run_check=False, shape=codes.shape,
                                  stride=codes.stride())
    return dequantize_blocks(codes, scale_inv, block, dtype)


def adapter_local(w: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """As :func:`local_cast`, for a low-rank adapter stacked with the experts
    (:mod:`moetrain.model.lora`). Where the adapter is replicated over a mesh axis — one pair for
    all experts (replicated over ep), or under expert-tensor parallelism the factor that does not
    split the ffn width (replicated over tp) — each rank's gradient holds only the terms of its
    own rows or columns: the local piece's gradient is declared ``Partial`` along those axes, and
    the data-parallel wrapper sums it there before its own reduction."""
    from torch.distributed.tensor import DTensor, Partial

    if isinstance(w, DTensor):
        w = w.to_local(grad_placements=[Partial() if pl.is_replicate() else pl for pl in w.placements])
    return cast(w, dtype)


class Linear(nn.Linear):
    """``nn.Linear`` (tensor parallelism styles accept it) computing in ``compute_dtype``:
    x: [..., in] → [..., out] in ``compute_dtype`` (or the weight's dtype when ``None``). With
    ``fp8`` (a :class:`~moetrain.model.fp8_gemm.Fp8Recipe`) its GEMMs run in fp8, forward and
    backward; the bias is added in the compute dtype. Without bias and fp8 its weight gradient
    may be deferred (``defer_wgrad``, :mod:`moetrain.model.wgrad`).

    With a low-rank adapter (``lora_A`` [r, in], ``lora_B`` [out, r]; set by
    :func:`moetrain.model.lora.add_adapters`, None without) it adds ``lora_scaling`` ·
    B A dropout(x), in the compute dtype, never in fp8 (Hu et al. 2021 §4.1). A frozen FP8 base
    weight (``weight`` float8 E4M3 codes, ``weight_scale_inv`` [⌈out/B⌉, ⌈in/B⌉] fp32, B =
    ``base_block``: DeepSeek-V3's checkpoint format) is dequantized per GEMM (:func:`dequantize`)."""

    compute_dtype: torch.dtype | None = None
    fp8: Fp8Recipe | None = None
    defer_wgrad = True
    lora_scaling = 1.0
    lora_dropout = 0.0
    base_block = 128

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lora_A: nn.Parameter | None = None
        self.lora_B: nn.Parameter | None = None
        self.weight_scale_inv: nn.Parameter | None = None

    def base_weight(self) -> torch.Tensor:
        """The weight as the GEMM takes it: in the compute dtype, dequantized when FP8."""
        if self.weight_scale_inv is None:
            return cast(self.weight, self.compute_dtype)
        return dequantize(self.weight, self.weight_scale_inv, self.base_block, self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.base_weight()
        b = None if self.bias is None else cast(self.bias, self.compute_dtype)
        if self.fp8 is not None:
            y = fp8_linear(x.to(w.dtype), w, self.fp8)
            y = y if b is None else y + b
        elif b is None and self.defer_wgrad:
            y = wgrad.linear(x.to(w.dtype), w)
        else:
            y = F.linear(x.to(w.dtype), w, b)
        return y if self.lora_A is None else y + self.adapter(x.to(y.dtype))

    def adapter(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's term scaling · B A dropout(x): x [..., in] → [..., out] in the compute
        dtype. Under tensor parallelism the operands are DTensors placed as the weight is
        (:mod:`moetrain.parallel.lora`): a column-parallel B gives this rank's output columns, a
        row-parallel A a partial sum that the layer's own output reduction adds up."""
        a, b = cast(self.lora_A, self.compute_dtype), cast(self.lora_B, self.compute_dtype)
        if self.lora_dropout and self.training:
            x = F.dropout(x, self.lora_dropout)
        return F.linear(F.linear(x.to(a.dtype), a), b) * self.lora_scaling


class Embedding(nn.Embedding):
    """``nn.Embedding`` returning rows in ``compute_dtype``: ids [...] → [..., D]."""

    compute_dtype: torch.dtype | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, cast(self.weight, self.compute_dtype))


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019). x: [..., D] → [..., D] in x's dtype;
    the statistics and the scaling are computed in fp32 whatever the compute dtype (the weight
    itself is the compute-dtype copy, as FSDP's mixed precision gives it). ``zero_centered``:
    the scale is 1 + weight, the weight starting at 0 (Qwen3-Next; ``model.zero_centered_norm``)."""

    compute_dtype: torch.dtype | None = None

    def __init__(self, dim: int, eps: float = 1e-5, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def scale(self) -> torch.Tensor:
        """The fp32 factor the normalised values are multiplied by: weight, or 1 + weight."""
        w = cast(self.weight, self.compute_dtype).float()
        return 1.0 + w if self.zero_centered else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.scale()).to(x.dtype)


def set_compute_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Set ``compute_dtype`` on every module of ``model`` that has one (``None``: compute in the
    parameters' own dtype). Modules that must stay fp32 (the MoE router) do not have one."""
    for m in model.modules():
        if hasattr(type(m), "compute_dtype"):
            m.compute_dtype = dtype


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency rescaling (``model.rope_scaling: llama3``; Grattafiori et al.
    2024 §3.3.1, Meta's reference ``apply_scaling``). A frequency f has wavelength λ = 2π / f
    tokens; with L = ``original_max_positions``:

    * λ < L / ``high_freq_factor`` (high frequencies): kept;
    * λ > L / ``low_freq_factor`` (low frequencies): f / ``factor``;
    * between: (1 − s) · f / ``factor`` + s · f with s = (L / λ − low_freq_factor) /
      (high_freq_factor − low_freq_factor), a linear blend in L / λ (no band when the two
      factors are equal, as in Llama 4 Scout's config: then f / ``factor`` at the boundary).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int

    def __call__(self, inv_freq: torch.Tensor, theta: float) -> tuple[torch.Tensor, float]:
        """Rescaled frequencies: inv_freq [Dr/2] fp32 → ([Dr/2] fp32, attention factor 1)."""
        L = self.original_max_positions
        wavelen = 2 * math.pi / inv_freq
        if self.high_freq_factor > self.low_freq_factor:
            s = (L / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            blended = (1 - s) * inv_freq / self.factor + s * inv_freq
        else:
            blended = inv_freq / self.factor
        out = torch.where(wavelen > L / self.low_freq_factor, inv_freq / self.factor, blended)
        return torch.where(wavelen < L / self.high_freq_factor, inv_freq, out), 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term 0.1 · mscale · ln(factor) + 1 (1 for factor ≤ 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (``model.rope_scaling: yarn``; Peng et al. 2023 §3.2-3.4, the form DeepSeek-V3 and
    GPT-OSS use). For rotary width Dr and L = ``original_max_positions`` the dimension pair i
    rotating ``r`` times in L tokens sits at d(r) = Dr·ln(L / (2π r)) / (2 ln θ); between
    d(``beta_fast``) and d(``beta_slow``) (floored / ceiled with ``truncate``) a linear ramp
    blends the frequency from kept (high frequencies) to interpolated (÷ ``factor``). cos/sin
    are multiplied by the attention factor ``mscale(factor)`` = 0.1 ln(factor) + 1, or
    mscale(factor, ``mscale``) / mscale(factor, ``mscale_all_dim``) when both are set."""

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def __call__(self, inv_freq: torch.Tensor, theta: float) -> tuple[torch.Tensor, float]:
        dim = 2 * inv_freq.shape[0]

        def at(rotations: float) -> float:
            return dim * math.log(self.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = at(self.beta_fast), at(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low)
                / ((high + 0.001 if low == high else high) - low)).clamp(0, 1)
        kept = 1 - ramp  # 1: extrapolate (keep), 0: interpolate
        out = inv_freq / self.factor * (1 - kept) + inv_freq * kept
        if self.mscale and self.mscale_all_dim:
            factor = yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        else:
            factor = yarn_mscale(self.factor)
        return out, factor


RopeScaling = Callable[[torch.Tensor, float], tuple[torch.Tensor, float]]


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, scaling: RopeScaling | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding tables (Su et al. 2021, RoFormer eq. 34).

    positions: [S] integer positions (global positions under context parallelism), or [B, S]
    when they differ per sample (positions restarting at every document). ``rotary_dim``: the
    dimensions rotated (a head's, or part of it). ``scaling`` rescales the frequencies and
    returns an attention factor that multiplies cos/sin (e.g. :class:`Llama3RopeScaling`,
    :class:`YarnRopeScaling`); ``None`` keeps θ^(−2i/Dr). Returns cos, sin: [S, Dr/2] (or
    [B, S, Dr/2]) in fp32.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.float32)
                                / rotary_dim))
    factor = 1.0
    if scaling is not None:
        inv_freq, factor = scaling(inv_freq, theta)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of the first 2·len(cos) dimensions by the position angle;
    the remaining ones pass (partial rotary). x: [B, S, heads, D]; cos/sin: [S, Dr/2] or
    [B, S, Dr/2]."""
    rot = 2 * cos.shape[-1]
    xf = x[..., :rot].float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = (cos[None, :, None, :], sin[None, :, None, :]) if cos.dim() == 2 else (cos[:, :, None], sin[:, :, None])
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)


# An attention kernel: (q [B,H,S,Dh], k [B,G,S,Dh], v [B,G,S,Dh], doc) -> [B,H,S,Dh], causal,
# within documents when doc (a moetrain.model.attention.DocumentMask) is given.
AttentionKernel = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class QKNormParallel:
    """How a whole-projection :class:`QKNorm` is split over tensor-parallel ranks, the one object
    :mod:`moetrain.parallel.tensor` hands it: ``rows`` — this rank's (first row, number of rows)
    of the [heads·Dh] weight (its heads); ``sum_over_ranks`` — sums a [B, S, 1, 1] sum of squares
    over the tp ranks, with autograd."""

    rows: tuple[int, int]
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]


class QKNorm(RMSNorm):
    """RMSNorm of the queries or keys after their projection, before RoPE. x: [B, S, heads, Dh]
    → the same shape and dtype.

    * ``per_head`` (Qwen3): over each head's Dh; ``weight`` [Dh] is shared by the heads.
    * otherwise (OLMoE): over the whole projection, all heads·Dh values of a token; ``weight``
      [heads·Dh]. Under tensor parallelism this rank holds a slice of the heads: ``parallel``
      (:class:`QKNormParallel`, None in one process) says which, and sums the statistic.
    """

    def __init__(self, width: int, eps: float, per_head: bool, zero_centered: bool = False):
        super().__init__(width, eps, zero_centered)
        self.per_head = per_head
        self.parallel: QKNormParallel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_head:
            return super().forward(x)
        xf = x.float()
        sum_sq = xf.pow(2).sum((-2, -1), keepdim=True)
        w = self.scale()
        if self.parallel is not None:
            sum_sq = self.parallel.sum_over_ranks(sum_sq)
            w = w.narrow(0, *self.parallel.rows)
        xf = xf * torch.rsqrt(sum_sq / self.weight.shape[0] + self.eps)
        return (xf * w.view(x.shape[-2:])).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention (Ainslie et al. 2023) with RoPE.

    ``n_heads``/``n_kv_heads`` are the heads held by this module (divided by tp after tensor
    parallelism). ``kernel`` computes the core attention (:mod:`moetrain.model.attention`); it is
    SDPA by default, set from ``model.attention_backend``, and replaced by ring attention under
    context parallelism. ``qkv_bias``: biases on wq/wk/wv; ``out_bias``: on wo. ``qk_norm``:
    ``none``, ``head`` or ``projection`` (:class:`QKNorm`, ``model.qk_norm``). ``sinks``: one
    learned logit per head joining the softmax. ``window``: a sliding window of that many keys.
    ``output_gate``: ``wq`` also gives each head a gate, its rows [q_h; gate_h] per head, and the
    attention output is multiplied by sigmoid(gate) before ``wo`` (Qwen3-Next's gated attention).
    ``zero_centered_norm``: the q/k norms scale by 1 + weight.

    Llama 4's options (``model.no_rope_layers`` and its neighbours): ``rope`` False leaves the
    queries and keys unrotated (NoPE), and the forward's ``temperature`` ([S] or [B, S], from
    :func:`attention_temperature`) then multiplies the queries; ``chunk``: each query sees the
    keys of its own chunk of positions only; ``qk_norm`` ``l2``: q and k divided by their RMS
    over each head's dims after RoPE (no weight), in a block that rotates.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qkv_bias: bool = False,
                 qk_norm: str = "none", norm_eps: float = 1e-5, out_bias: bool = False, sinks: bool = False,
                 window: int | None = None, output_gate: bool = False, zero_centered_norm: bool = False,
                 rope: bool = True, chunk: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.output_gate = output_gate
        self.rope, self.chunk = rope, chunk
        self.norm_eps = norm_eps
        # Llama 4's weightless q/k norm, in the blocks that rotate only
        self.l2_qk_norm = qk_norm == "l2" and rope
        self.wq = Linear(dim, n_heads * head_dim * (2 if output_gate else 1), bias=qkv_bias)
        self.wk = Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.wv = Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.wo = Linear(n_heads * head_dim, dim, bias=out_bias)
        self.q_norm: QKNorm | None = None
        self.k_norm: QKNorm | None = None
        if qk_norm in ("head", "projection"):
            per_head = qk_norm == "head"
            self.q_norm = QKNorm(head_dim if per_head else n_heads * head_dim, norm_eps, per_head, zero_centered_norm)
            self.k_norm = QKNorm(head_dim if per_head else n_kv_heads * head_dim, norm_eps, per_head,
                                 zero_centered_norm)
        self.sinks = nn.Parameter(torch.empty(n_heads)) if sinks else None
        self.window = window
        self.kernel: AttentionKernel = sdpa_attention
        # [heads on this rank] float32: each head's largest logit since the last reset (track_max_logits)
        self.register_buffer("max_logit", None, persistent=False)

    def track_max_logits(self, heads: int) -> None:
        """From now on keep, in ``max_logit`` [heads] float32, the largest attention logit each
        head this rank computes (``heads``: n_heads / tp) has seen
        (:func:`moetrain.model.attention.head_max_logits`: one more q·kᵀ per forward); the caller
        reads and resets it (``train.qk_clip``)."""
        self.max_logit = torch.full((heads,), float("-inf"), device=self.wq.weight.device)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc: DocumentMask | None = None, temperature: torch.Tensor | None = None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        # -1 heads: under tensor parallelism the projections hold a slice of the heads.
        q = self.wq(x_BSD).view(B, S, -1, self.head_dim * (2 if self.output_gate else 1))
        k = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        v = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        if not self.output_gate:
            return self.wo(self.core(q, k, v, cos, sin, doc, temperature))
        q, gate = q.split(self.head_dim, dim=-1)
        return self.wo(self.core(q, k, v, cos, sin, doc, temperature) * torch.sigmoid(gate.reshape(B, S, -1)))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             doc: DocumentMask | None = None, temperature: torch.Tensor | None = None) -> torch.Tensor:
        """What lies between the projections: q/k norm, RoPE and the attention kernel, on plain
        (local) tensors also under tensor parallelism. q: [B, S, H, Dh], k/v: [B, S, G, Dh] →
        [B, S, H·Dh]; ``temperature`` ([S] or [B, S] fp32): the NoPE blocks' query scale."""
        B, S = q.shape[:2]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.l2_qk_norm:
            q, k = l2_norm(q, self.norm_eps), l2_norm(k, self.norm_eps)
        if temperature is not None and not self.rope:
            t = temperature[None, :, None, None] if temperature.dim() == 1 else temperature[:, :, None, None]
            q = (q * t).to(q.dtype)
        if self.max_logit is not None:
            torch.maximum(self.max_logit, head_max_logits(q.transpose(1, 2), k.transpose(1, 2), self.head_dim ** -0.5,
                                                          doc, self.window, self.chunk), out=self.max_logit)
        sinks = local_cast(self.sinks, None) if self.sinks is not None else None
        out = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), doc, window=self.window,
                          sinks=sinks, chunk=self.chunk)  # [B, H, S, Dh]
        return out.transpose(1, 2).reshape(B, S, -1)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x divided by its root mean square over the last dim, in fp32, returned in x's dtype (no
    weight: Llama 4's ``Llama4TextL2Norm``). x: [..., D]."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def attention_temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama 4's query scale for its NoPE blocks: 1 + attn_scale · ln(1 + floor((p + 1) /
    floor_scale)) at position p (transformers' ``Llama4TextAttention``; Nakanishi 2025,
    "Scalable-Softmax Is Superior for Attention", whose scale grows with log of the context).
    positions: [S] or [B, S] integers → the same shape, fp32."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class FeedForward(nn.Module):
    """SwiGLU MLP (Shazeer 2020): w2(silu(w1 x) * w3 x); or, with ``activation = "relu2"``, the
    non-gated squared-ReLU MLP w2(relu(w1 x)²) (So et al. 2021, "Primer" §3; Nemotron-H's), which
    has no w3. x: [..., D] → [..., D].

    Raises:
        ValueError: an unknown activation."""

    def __init__(self, dim: int, hidden: int, activation: str = "swiglu"):
        super().__init__()
        if activation not in ("swiglu", "relu2"):
            raise ValueError(f"MLP activation {activation!r}: expected swiglu or relu2")
        self.w1 = Linear(dim, hidden, bias=False)
        self.w3 = Linear(dim, hidden, bias=False) if activation == "swiglu" else None
        self.w2 = Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x), self.w3(x) if self.w3 is not None else None))

    def act(self, gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
        """silu(gate) · up, or relu(gate)² without ``up``, on plain (local) tensors also under
        tensor parallelism."""
        return F.silu(gate) * up if up is not None else F.relu(gate).square()
