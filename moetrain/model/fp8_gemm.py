"""FP8 training GEMMs (``train.precision: fp8``): the recipes, a reference path and ``_scaled_mm``.

Every GEMM of an fp8 layer — the forward ``y = a @ b`` and both of its backward GEMMs — takes its
two operands in float8 with scales along the GEMM's contraction dimension, accumulates in fp32
and returns in the compute dtype (bf16), as an H100's fp8 tensor cores do (Micikevicius et al.
2022, "FP8 Formats for Deep Learning"). The master weights, gradients and optimizer states stay
fp32 (:mod:`moetrain.parallel.precision`). Recipes (``train.fp8_recipe``):

* ``tensorwise`` — one fp32 scale ``448 / amax`` per operand, E4M3 for activations and weights,
  E5M2 for the output gradient (torchao's ``tensorwise`` recipe, the Float8Linear of TorchTitan);
* ``rowwise`` — one power-of-two scale per row of each operand along the contraction dimension,
  E4M3 throughout (torchao's ``rowwise`` recipe); the weight is scaled again along the other
  dimension for the input-gradient GEMM;
* ``blockwise`` — DeepSeek-V3's fine-grained scaling (DeepSeek-AI 2024, §3.3.1-3.3.2): activations
  and gradients in 1 × B tiles along the contraction dimension (so 1 × 128 in the forward and
  128 × 1 for the weight gradient), weights in B × B blocks (B = ``train.fp8_block``, 128), fp32
  scales, E4M3 throughout; a dimension B does not divide is one tile;
* ``unscaled`` — a control, not a recipe: a plain cast to E4M3 (values above 448 saturate, below
  2⁻⁹ vanish), to show what scaling buys. Never train with it.

Forward and backward, with a: [N, K] activations, b: [K, M] weight, g: [N, M] output gradient:
``y = q(a, K) @ q(b, K)``, ``da = q(g, M) @ q(bᵀ, M)``, ``db = q(aᵀ, N) @ q(g, N)``.

The reference path dequantizes the two operands to fp32 and multiplies them in fp32; the fast path
(:func:`torch._scaled_mm`, tensor-wise and row-wise scales) multiplies the float8 values and
applies the scales to the fp32 accumulator. Both quantize the same way, so they differ by the
order of the fp32 additions only (``tests/test_fp8_training.py`` proves it on the CPU, where torch
2.13 runs ``_scaled_mm``). The fast path is taken for plain CUDA tensors; DTensor operands (tensor
parallelism) take the reference path, whose reductions (the amax of a sharded operand) DTensor
completes over the mesh: a tensor-wise or row-wise scale is the same as in one process. Block
scales are computed on the local shard, which equals one process's when the shard boundaries
fall on block boundaries (checked: :class:`ValueError` otherwise).

Saved for the backward: the operands in the compute dtype (not float8; a memory saving left for
later). Block scales are materialised at the operand's full size on the reference path (simple,
not frugal: an fp32 copy per operand and GEMM).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise", "blockwise", "unscaled")
_EPS = 1e-12  # amax floor: an all-zero operand gets a finite scale (torchao's EPS)


@dataclass(frozen=True)
class Fp8Recipe:
    """How an fp8 GEMM scales its operands. ``scaling``: one of :data:`RECIPES`; ``block``: the
    tile / block edge of ``blockwise``; ``fast``: use :func:`torch._scaled_mm` where it applies
    (``None``: on CUDA only; ``True`` forces it, e.g. on the CPU to test it).

    Raises:
        ValueError: an unknown scaling or a block < 1.
    """

    scaling: str = "tensorwise"
    block: int = 128
    fast: bool | None = None

    def __post_init__(self) -> None:
        if self.scaling not in RECIPES:
            raise ValueError(f"fp8 recipe {self.scaling!r}: expected one of {', '.join(RECIPES)}")
        if self.block < 1:
            raise ValueError(f"fp8 block {self.block}: expected a positive tile edge")

    @property
    def grad_dtype(self) -> torch.dtype:
        """The output gradient's float8 format: E5M2 (range) for tensor-wise scaling, else E4M3."""
        return E5M2 if self.scaling == "tensorwise" else E4M3


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _tile(n: int, block: int) -> int:
    return block if n % block == 0 else n


def _block_amax(t: torch.Tensor, dim: int, block: int, square: bool) -> torch.Tensor:
    """amax of 2-D ``t`` per 1 × B tile along ``dim`` (or per B × B block when ``square``),
    broadcast back to t's shape."""
    R, C = t.shape
    tr = _tile(R, block) if square or dim == 0 else 1
    tc = _tile(C, block) if square or dim == 1 else 1
    a = t.abs().view(R // tr, tr, C // tc, tc).amax(dim=(1, 3), keepdim=True)
    return a.expand(R // tr, tr, C // tc, tc).reshape(R, C)


def _amax(t: torch.Tensor, dim: int, recipe: Fp8Recipe, weight: bool) -> torch.Tensor:
    """The amax each element of 2-D fp32 ``t`` is scaled by, broadcastable to t."""
    if recipe.scaling == "tensorwise":
        return t.abs().amax()
    if recipe.scaling == "rowwise":
        return t.abs().amax(dim=dim, keepdim=True)
    if not _is_dtensor(t):
        return _block_amax(t, dim, recipe.block, weight)
    # Blocks on the local shard: the same blocks as one process's when every sharded dimension's
    # shard is a whole number of blocks.
    from torch.distributed.tensor import DTensor, Replicate

    if any(p.is_partial() for p in t.placements):
        t = t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])
    loc = t.to_local()
    for p in t.placements:
        if p.is_shard() and loc.shape[p.dim] != t.shape[p.dim] and loc.shape[p.dim] % recipe.block:
            raise ValueError(f"fp8 blockwise: a tensor-parallel shard of {loc.shape[p.dim]} along dim {p.dim} "
                             f"is no whole number of {recipe.block}-blocks; set train.fp8_block to a divisor "
                             f"of {loc.shape[p.dim]}")
    a = _block_amax(loc, dim, recipe.block, weight)
    return DTensor.from_local(a, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=a.stride())


def quantize(t: torch.Tensor, dim: int, fmt: torch.dtype, recipe: Fp8Recipe, weight: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | float]:
    """2-D ``t`` → (q in float8 ``fmt``, scale fp32 broadcastable to t) with t ≈ q / scale, the
    scales constant along ``dim`` (the GEMM's contraction dimension) as ``recipe`` groups them;
    ``weight``: B × B blocks for ``blockwise``. ``unscaled``: scale 1."""
    fmax = torch.finfo(fmt).max
    t = t.float()
    if recipe.scaling == "unscaled":
        scale: torch.Tensor | float = 1.0
    else:
        scale = fmax / _amax(t, dim, recipe, weight).clamp(min=_EPS)
        if recipe.scaling == "rowwise":  # torchao's rowwise rounds its scales to powers of two
            scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (t * scale).clamp(-fmax, fmax).to(fmt)
    return q, scale


def _fast(a: torch.Tensor, b: torch.Tensor, recipe: Fp8Recipe) -> bool:
    """Whether :func:`torch._scaled_mm` takes a @ b: tensor-wise or row-wise scales, plain
    tensors (a dimension that is no multiple of 16, cuBLASLt's FP8 rule, is zero-padded by
    :func:`mm`: an expert's token count rarely is one)."""
    if recipe.scaling not in ("tensorwise", "rowwise") or _is_dtensor(a) or _is_dtensor(b):
        return False
    return a.is_cuda if recipe.fast is None else recipe.fast


def _pad16(t: torch.Tensor) -> torch.Tensor:
    """2-D ``t`` zero-padded at the end of each dimension to a multiple of 16 (``t`` itself when
    both are). Exact for a GEMM: zero rows and columns add nothing to the kept outputs, leave a
    tensor-wise amax and a row-wise amax along K unchanged, and their own row-wise scales stay
    finite (the amax floor)."""
    pr, pc = -t.shape[0] % 16, -t.shape[1] % 16
    return torch.nn.functional.pad(t, (0, pc, 0, pr)) if pr or pc else t


def mm(a: torch.Tensor, b: torch.Tensor, fmt_a: torch.dtype, fmt_b: torch.dtype, recipe: Fp8Recipe,
       weight_a: bool, weight_b: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """One fp8 GEMM: a [N, K] @ b [K, M] → [N, M] in ``out_dtype``, a scaled along K per row, b
    along K per column, as ``recipe`` says (the ``weight_*`` operand in B × B blocks)."""
    if _fast(a, b, recipe):
        (n, _), m = a.shape, b.shape[1]
        qa, sa = quantize(_pad16(a), 1, fmt_a, recipe, weight_a)
        qb, sb = quantize(_pad16(b), 0, fmt_b, recipe, weight_b)
        y = _scaled_mm(qa, qb, sa, sb, recipe, out_dtype)
        return y if y.shape == (n, m) else y[:n, :m].contiguous()
    qa, sa = quantize(a, 1, fmt_a, recipe, weight_a)
    qb, sb = quantize(b, 0, fmt_b, recipe, weight_b)
    return ((qa.float() / sa) @ (qb.float() / sb)).to(out_dtype)


def _scaled_mm(qa: torch.Tensor, qb: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, recipe: Fp8Recipe,
               out_dtype: torch.dtype) -> torch.Tensor:
    """qa [N, K] @ qb [K, M] through :func:`torch._scaled_mm`, in the layouts cuBLASLt accepts:
    qa row-major and qb column-major (the quantized operands keep their source's strides, and the
    backward's ``aᵀ`` / ``bᵀ`` are transposed views, so either may arrive the other way round);
    the scales as contiguous fp32 dequantization factors (row-wise: [N, 1] and [1, M]). Row-wise
    scaling gives a bf16 output only (cuBLASLt), cast to ``out_dtype`` after."""
    qa = qa.contiguous()
    qb = qb.t().contiguous().t()
    inv_a, inv_b = sa.reciprocal().float().contiguous(), sb.reciprocal().float().contiguous()
    mm_dtype = torch.bfloat16 if recipe.scaling == "rowwise" else out_dtype
    return torch._scaled_mm(qa, qb, inv_a, inv_b, out_dtype=mm_dtype).to(out_dtype)


class _Fp8MatMul(torch.autograd.Function):
    """y = a @ b with every GEMM in fp8 (the module docstring's three GEMMs)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.recipe = recipe
        return mm(a, b, E4M3, E4M3, recipe, False, True, a.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        a, b = ctx.saved_tensors
        r = ctx.recipe
        da = mm(g, b.t(), r.grad_dtype, E4M3, r, False, True, a.dtype) if ctx.needs_input_grad[0] else None
        db = mm(a.t(), g, E4M3, r.grad_dtype, r, False, False, b.dtype) if ctx.needs_input_grad[1] else None
        return da, db, None


def fp8_mm(a: torch.Tensor, b: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """a [N, K] @ b [K, M] → [N, M] in a's dtype, forward and backward GEMMs in fp8; b is the
    weight (B × B blocks under ``blockwise``). Differentiable in both."""
    return _Fp8MatMul.apply(a, b, recipe)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """``F.linear`` without bias in fp8: x [..., K], w [M, K] → [..., M] in x's dtype."""
    y = fp8_mm(x.reshape(-1, x.shape[-1]), w.t(), recipe)
    return y.view(*x.shape[:-1], w.shape[0])


def set_fp8(model: nn.Module, recipe: Fp8Recipe | None, keep: tuple[str, ...] = ()) -> list[str]:
    """Give every module of ``model`` that has an ``fp8`` attribute (the dense linears and the
    grouped experts) ``recipe``, except those whose qualified name matches a pattern of ``keep``
    (:func:`fnmatch.fnmatch`, e.g. ``output`` or ``*.shared_gate``), which stay in the compute
    dtype. ``None`` turns fp8 off. Returns the names of the modules set to fp8."""
    names = []
    for name, m in model.named_modules():
        if hasattr(type(m), "fp8"):
            kept = recipe is None or any(fnmatch.fnmatch(name, p) for p in keep)
            m.fp8 = None if kept else recipe
            if not kept:
                names.append(name)
    return names
