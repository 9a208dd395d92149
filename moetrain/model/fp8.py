"""FP8 numerics: E4M3 rows with power-of-two scales per tile, the format of the token dispatch.

``moe.dispatch_dtype: fp8`` sends the tokens of the dispatch all-to-all as float8 E4M3 (largest
finite value 448; Micikevicius et al. 2022, "FP8 Formats for Deep Learning", §3) with one scale
per 1 × ``tile`` slice of each row — DeepSeek-V3's 1 × 128 activation tiles (§3.3.1) when the
hidden size is a multiple of 128, one scale per row otherwise. The scales are powers of two
(the UE8M0 scale of the OCP microscaling formats; DeepSeek-V3.1 and DeepEP send them so), stored
as their int8 exponent, so:

* a row costs ``D + D / tile`` bytes on the wire, against ``2·D`` in bf16 (0.504× with 1 × 128
  tiles: :func:`row_bytes`);
* scaling is exact (a division by a power of two), so the only rounding is E4M3's own: at most
  2⁻⁴ of a value's magnitude for the values of a tile whose exponent E4M3 keeps, and at most
  2⁻¹⁰ · scale below that (E4M3's subnormal step);
* quantizing a dequantized row again returns the same values bit for bit (power-of-two scales
  divide exactly), so a row rounded by the MoE layer and encoded again by each hop of a
  dispatcher (the hierarchical one has two) is rounded once.

Shapes: N rows, D hidden, D / tile scales per row.
"""

from __future__ import annotations

from typing import Any

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128  # DeepSeek-V3's activation tile (§3.3.1)


def tile_width(dim: int) -> int:
    """The quantization tile of a row of ``dim`` values: 128 where it divides ``dim``, else the
    whole row (one scale per token)."""
    return BLOCK if dim % BLOCK == 0 else dim


def row_bytes(dim: int, wire: torch.dtype) -> int:
    """Bytes one dispatched row of ``dim`` values takes on the wire in ``wire`` (float8 E4M3:
    the values and one int8 scale exponent per tile; any other dtype: its item size)."""
    if wire == E4M3:
        return dim + dim // tile_width(dim)
    return dim * wire.itemsize


def quantize(x_ND: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x_ND [N, D] (any float dtype) → (q [N, D] float8 E4M3, exponents [N, D / tile] int8) with
    x ≈ q · 2**exponent per tile; the exponent is the smallest that fits the tile's largest
    magnitude under 448 (all-zero tiles get the smallest, −126).

    Raises:
        ValueError: ``tile`` does not divide D.
    """
    N, D = x_ND.shape
    if D % tile:
        raise ValueError(f"quantize: tile {tile} does not divide the row width {D}")
    x = x_ND.float().view(N, D // tile, tile)
    amax = x.abs().amax(-1)
    # ceil(log2(amax / 448)) exactly: frexp gives amax / 448 = m · 2**e with m in [0.5, 1).
    mant, exp = torch.frexp(amax / E4M3_MAX)
    exp = (exp - (mant == 0.5).to(exp.dtype)).clamp(-126, 127)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -126))
    q = (x * torch.exp2(-exp.float()).unsqueeze(-1)).to(E4M3)
    return q.view(N, D), exp.to(torch.int8)


def dequantize(q_ND: torch.Tensor, exp_NB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`quantize`: [N, D] float8 and [N, D / tile] int8 → [N, D] ``dtype``."""
    N, D = q_ND.shape
    B = exp_NB.shape[1]
    x = q_ND.float().view(N, B, D // B) * torch.exp2(exp_NB.float()).unsqueeze(-1)
    return x.view(N, D).to(dtype)


def pack(x_ND: torch.Tensor) -> torch.Tensor:
    """x_ND [N, D] → its wire form [N, D + D / tile] uint8: the E4M3 values, then the exponents."""
    q, exp = quantize(x_ND, tile_width(x_ND.shape[1]))
    return torch.cat([q.view(torch.uint8), exp.view(torch.uint8)], 1)


def unpack(packet: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`pack`: [N, D + D / tile] uint8 → [N, D] ``dtype``."""
    q = packet[:, :dim].contiguous().view(E4M3)
    exp = packet[:, dim:].contiguous().view(torch.int8)
    return dequantize(q, exp, dtype)


class _RoundTrip(torch.autograd.Function):
    """Forward: the values the fp8 wire delivers; backward: the gradient as it is (the
    straight-through estimator — the dispatch's backward sends gradients unquantized)."""

    @staticmethod
    def forward(ctx: Any, x_ND: torch.Tensor) -> torch.Tensor:
        return unpack(pack(x_ND), x_ND.shape[1], x_ND.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def round_trip(x_ND: torch.Tensor, wire: torch.dtype | None) -> torch.Tensor:
    """x_ND [N, D] as a dispatch in ``wire`` delivers it (None: unchanged), differentiable with
    the gradient passed straight through. The MoE layer applies it to the tokens it routes, so a
    one-process run computes with exactly the values an expert-parallel dispatch delivers."""
    if wire is None or wire == x_ND.dtype:
        return x_ND
    if wire == E4M3:
        return _RoundTrip.apply(x_ND)
    return _Cast.apply(x_ND, wire)


class _Cast(torch.autograd.Function):
    """Round to ``wire`` and back, the gradient passed straight through in the input's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
        return x.to(wire).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def dispatch_wire(dispatch_dtype: str, precision: str) -> torch.dtype | None:
    """The dtype of the dispatch all-to-all's rows for ``moe.dispatch_dtype`` under
    ``train.precision``: None sends them as computed (``auto`` outside fp8 training), else
    bfloat16 or float8 E4M3.

    Raises:
        ValueError: an unknown ``dispatch_dtype``.
    """
    if dispatch_dtype == "auto":
        return E4M3 if precision == "fp8" else None
    wires = {"bf16": torch.bfloat16, "fp8": E4M3}
    if dispatch_dtype not in wires:
        raise ValueError(f"dispatch dtype {dispatch_dtype!r}: expected auto, bf16 or fp8")
    return wires[dispatch_dtype]


def quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight in DeepSeek-V3's FP8 checkpoint format (§3.3.1: B × B weight blocks; its
    checkpoints' ``weight_scale_inv``): w [..., R, C] (any float dtype, plain tensor) → (codes
    [..., R, C] float8 E4M3, scale_inv [..., ⌈R/B⌉, ⌈C/B⌉] fp32) with w ≈ codes · scale_inv per
    block, scale_inv = the block's largest magnitude / 448 (1 for an all-zero block). The edge
    blocks may be partial."""
    R, C = w.shape[-2:]
    pr, pc = -R % block, -C % block
    x = torch.nn.functional.pad(w.float(), (0, pc, 0, pr))
    lead = x.shape[:-2]
    blocks = x.view(*lead, (R + pr) // block, block, (C + pc) // block, block)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return codes.view(*lead, R + pr, C + pc)[..., :R, :C].contiguous(), scale


def dequantize_blocks(codes: torch.Tensor, scale_inv: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., R, C] (float8 E4M3, or any dtype holding its values exactly) · scale_inv
    [..., ⌈R/B⌉, ⌈C/B⌉] per B × B block → [..., R, C] in ``dtype`` (the product in fp32)."""
    R, C = codes.shape[-2:]
    s = scale_inv.float().repeat_interleave(block, dim=-2)[..., :R, :].repeat_interleave(block, dim=-1)[..., :C]
    return (codes.float() * s).to(dtype)
