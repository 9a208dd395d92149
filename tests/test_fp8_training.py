"""FP8 training (``train.precision: fp8``, moetrain.model.fp8_gemm): every recipe against fp32,
the ``_scaled_mm`` fast path and torchao's Float8Linear against the reference path, the layouts
against one process, and what scaling buys (the ``unscaled`` control).

Tolerances, from the formats (Micikevicius et al. 2022, §3): E4M3 keeps 3 mantissa bits, so one
rounding of a normal value is off by at most 2⁻⁴ of it; E5M2 (tensor-wise gradients) by 2⁻³.
A GEMM of two rounded operands is then off by at most 2⁻⁴ + 2⁻⁴ + 2⁻⁸ ≈ 0.129 of |a|·|b|
(E4M3 × E4M3) or 2⁻³ + 2⁻⁴ + 2⁻⁷ ≈ 0.195 (E5M2 × E4M3), entry by entry; the tests bound the
norm-wise error by that and check it is above 1e-3 (the operands were rounded to fp8, not
bf16: bf16 alone is off by ~2⁻⁹).

Layouts: a layout that reorders an fp32 sum can move a value across an fp8 rounding boundary,
which changes it by a whole fp8 step — 2⁻³ of the value in E4M3, 2⁻² in E5M2 — where bf16 moves
2⁻⁸; and a tensor-wise scale over an expert's rows depends on which rows arrive together. So fp8
layouts agree to fp8's tolerance, not bf16's: losses within 2e-3 relative over 20 steps (measured
≤ 2.8e-4), first-step gradients within one fp8 step of each tensor's largest entry (0.25 with
E5M2 gradients, measured ≤ 0.088; 0.125 with E4M3, measured ≤ 0.054). That the scales
themselves are the one process's under tensor parallelism (a sharded operand's amax taken over
the mesh) is proved exactly, GEMM by GEMM, by test_sharded_operands_are_scaled_as_in_one_process.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.model.fp8_gemm import E4M3, Fp8Recipe, fp8_linear, fp8_mm, quantize, set_fp8
from moetrain.model.layers import set_compute_dtype
from moetrain.model.transformer import Transformer
from moetrain.model.init import init_weights
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed
from test_equivalence import merged, steps_with_first_grads

MODEL = {"layers": 4, "vocab_size": 260}
STEPS = 20
E4M3_GEMM = 2 ** -4 + 2 ** -4 + 2 ** -8  # two E4M3 roundings
E5M2_GEMM = 2 ** -3 + 2 ** -4 + 2 ** -7  # an E5M2 gradient and an E4M3 operand
SCALED = ("tensorwise", "rowwise", "blockwise")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def gemm_errors(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor, recipe: Fp8Recipe) -> tuple[float, float, float]:
    """Norm-wise relative errors of y, da, db of fp8_mm against the fp32 GEMMs."""
    A, B = a.clone().requires_grad_(), b.clone().requires_grad_()
    y = fp8_mm(A, B, recipe)
    y.backward(g)
    return rel(y, a @ b), rel(A.grad, g @ b.t()), rel(B.grad, a.t() @ g)


@pytest.mark.parametrize("scaling", SCALED)
def test_each_scaling_is_within_the_formats_error(scaling):
    torch.manual_seed(0)
    a, b, g = torch.randn(64, 256), torch.randn(256, 128) * 0.02, torch.randn(64, 128) * 1e-3
    recipe = Fp8Recipe(scaling)
    ey, ea, eb = gemm_errors(a, b, g, recipe)
    grad_bound = E5M2_GEMM if recipe.grad_dtype == torch.float8_e5m2 else E4M3_GEMM
    assert 1e-3 < ey <= E4M3_GEMM, f"forward error {ey:.3e}"
    assert 1e-3 < ea <= grad_bound and 1e-3 < eb <= grad_bound, f"gradient errors {ea:.3e} {eb:.3e}"


def test_finer_scales_keep_the_rows_an_outlier_would_flush():
    """One token row 10⁵× larger than the rest (DeepSeek-V3 §3.3.1's case for fine scaling): a
    tensor-wise scale sized for it pushes the other rows into E4M3's subnormals; per-row and
    per-tile scales keep them."""
    torch.manual_seed(1)
    a, b = torch.randn(64, 256), torch.randn(256, 128) * 0.02
    a[0] *= 1e5
    errs = {}
    for scaling in SCALED:
        y = fp8_mm(a, b, Fp8Recipe(scaling))
        errs[scaling] = rel(y[1:], (a @ b)[1:])
    assert errs["tensorwise"] > 0.3, errs
    assert errs["rowwise"] <= E4M3_GEMM and errs["blockwise"] <= E4M3_GEMM, errs


def test_unscaled_loses_small_gradients():
    """Gradients of 1e-6 lie below E4M3's smallest subnormal (2⁻⁹): cast unscaled they vanish."""
    torch.manual_seed(2)
    a, b, g = torch.randn(64, 256), torch.randn(256, 128) * 0.02, torch.randn(64, 128) * 1e-6
    _, ea, eb = gemm_errors(a, b, g, Fp8Recipe("unscaled"))
    assert ea > 0.9 and eb > 0.9, (ea, eb)
    _, ea, eb = gemm_errors(a, b, g, Fp8Recipe("rowwise"))
    assert ea <= E4M3_GEMM and eb <= E4M3_GEMM


def test_quantize_is_scaled_along_the_contraction_dimension():
    """Row-wise scales are powers of two, one per row of a (dim 1) / column of b (dim 0); block-wise
    weights take one scale per B × B block; the float8 values use E4M3's range."""
    torch.manual_seed(3)
    t = torch.randn(32, 48)
    q, s = quantize(t, 1, E4M3, Fp8Recipe("rowwise"))
    assert q.dtype == E4M3 and s.shape == (32, 1) and torch.equal(s, torch.exp2(torch.log2(s).round()))
    assert q.float().abs().amax(1).min() >= 224  # every row reaches the top binade of E4M3
    _, s = quantize(t, 0, E4M3, Fp8Recipe("rowwise"))
    assert s.shape == (1, 48)
    _, s = quantize(t, 0, E4M3, Fp8Recipe("blockwise", block=16), weight=True)
    assert s.shape == (32, 48) and s.unique().numel() == 2 * 3
    _, s = quantize(t, 1, E4M3, Fp8Recipe("blockwise", block=16))  # 1 × 16 tiles along dim 1
    assert s.unique().numel() == 32 * 3


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("tokens,out_features", [(64, 128), (37, 120)])
def test_scaled_mm_fast_path_equals_the_reference(scaling, tokens, out_features):
    """torch._scaled_mm (the H100 path; torch 2.13 runs it on the CPU) multiplies the same float8
    values with the same scales: equal up to the order of fp32 additions, then bf16 rounding.
    37 tokens and 120 outputs (an expert's odd token count; cuBLASLt wants multiples of 16) go
    through the fast path zero-padded, with the same result."""
    if scaling == "rowwise" and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13):
        pytest.skip("before torch 2.13 the CPU's _scaled_mm takes tensor-wise scales only")
    torch.manual_seed(4)
    x = torch.randn(1, tokens, 256, dtype=torch.bfloat16)
    w = (torch.randn(out_features, 256) * 0.02).to(torch.bfloat16)
    g = torch.randn(1, tokens, out_features, dtype=torch.bfloat16)
    out = {}
    for fast in (False, True):
        X, W = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(X, W, Fp8Recipe(scaling, fast=fast))
        y.backward(g)
        out[fast] = (y, X.grad, W.grad)
    for ref, fast in zip(out[False], out[True]):
        assert rel(fast, ref) <= 1e-3  # a few bf16 ulps at most (measured ≤ 3e-5)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_scaled_mm_gets_the_layouts_cublaslt_accepts(scaling, monkeypatch):
    """Forward and both backward GEMMs hand torch._scaled_mm a row-major a, a column-major b and
    fp32 scales ([N, 1] / [1, M] row-wise) with a bf16 output row-wise: cuBLASLt's rules, which the
    CPU kernel does not enforce (an H200 refused the backward's transposed aᵀ: "Only
    multiplication of row-major and column-major matrices is supported by cuBLASLt")."""
    calls = []

    def checked(a, b, scale_a, scale_b, out_dtype=None, **kw):
        (n, k), m = a.shape, b.shape[1]
        assert a.stride() == (k, 1), f"a {tuple(a.shape)} not row-major: stride {a.stride()}"
        assert b.stride() == (1, k), f"b {tuple(b.shape)} not column-major: stride {b.stride()}"
        assert scale_a.dtype == scale_b.dtype == torch.float32
        if scaling == "rowwise":
            assert scale_a.shape == (n, 1) and scale_b.shape == (1, m) and out_dtype == torch.bfloat16
            assert scale_a.is_contiguous() and scale_b.is_contiguous()
        calls.append((n, k, m))
        return (a.float() * scale_a) @ (b.float() * scale_b)

    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: checked(*a, **kw).to(kw["out_dtype"]))
    X = torch.randn(1, 21, 64, dtype=torch.bfloat16, requires_grad=True)  # 21 tokens: padded to 32
    W = (torch.randn(32, 64) * 0.02).to(torch.bfloat16).requires_grad_()
    fp8_linear(X, W, Fp8Recipe(scaling, fast=True)).backward(torch.randn(1, 21, 32, dtype=torch.bfloat16))
    assert calls == [(32, 64, 32), (32, 32, 64), (64, 32, 32)]  # y, dx = g @ w, dwᵀ = xᵀ @ g (as [K, M])
    assert X.grad.shape == X.shape and W.grad.shape == W.shape


def _cpu_scaled_mm_takes_rowwise_scales() -> bool:
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_recipes_match_torchao_float8_linear(scaling):
    """moetrain's tensorwise and rowwise are torchao's recipes of the same names (TorchTitan's
    Float8Linear), proved on a layer: output and both gradients."""
    torchao_float8 = pytest.importorskip("torchao.float8")
    if scaling == "rowwise" and not _cpu_scaled_mm_takes_rowwise_scales():
        pytest.skip(f"torch {torch.__version__}'s CPU torch._scaled_mm takes per-tensor scales only: torchao's "
                    "rowwise recipe, the reference here, cannot run (it does from torch 2.13)")
    torch.manual_seed(5)
    lin = torch.nn.Linear(256, 128, bias=False).to(torch.bfloat16)
    w = lin.weight.detach().clone()
    model = torch.nn.Sequential(lin)
    torchao_float8.convert_to_float8_training(model, config=torchao_float8.Float8LinearConfig.from_recipe_name(scaling))
    x = torch.randn(4, 16, 256, dtype=torch.bfloat16)
    X1 = x.clone().requires_grad_()
    y1 = model(X1)
    g = torch.randn_like(y1)
    y1.backward(g)
    X2, W2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y2 = fp8_linear(X2, W2, Fp8Recipe(scaling))
    y2.backward(g)
    # Measured: rowwise bit for bit; tensorwise ≤ 4e-5 (torchao rounds the gradient's scaled
    # operands through bf16 where the reference stays fp32).
    for ours, theirs in [(y2, y1), (X2.grad, X1.grad), (W2.grad, model[0].weight.grad)]:
        assert rel(ours, theirs) <= 2e-4


def test_fp8_reaches_the_linears_and_experts_but_not_the_kept_modules():
    cfg = tiny_config("unused", "unused", model=MODEL, moe={"first_dense": 1, "shared_expert_gate": True})
    model = Transformer.from_config(cfg)
    init_weights(model, 0, 0.02, cfg.model.layers)
    set_compute_dtype(model, torch.bfloat16)
    ids = torch.randint(0, 257, (2, 16))
    bf16 = model(ids)
    names = set_fp8(model, Fp8Recipe("tensorwise"), cfg.train.fp8_keep)
    assert "output" not in names and not any(n.endswith("shared_gate") or "router" in n for n in names)
    assert {"layers.0.attention.wq", "layers.0.feed_forward.w2", "layers.1.moe.experts",
            "layers.1.moe.shared.w1"} <= set(names)
    fp8 = model(ids)
    assert fp8.dtype == bf16.dtype == torch.float32
    assert 1e-3 < rel(fp8, bf16) < 0.1  # the GEMMs rounded to fp8, the model intact


def sharded_gemms(rank: int, world: int, scaling: str) -> float:
    """fp8_mm on DTensors placed as tensor parallelism places them — column-parallel (b split
    along M), row-parallel (a and b split along K) and sequence-parallel input (a split along N) —
    against fp8_mm on the full tensors: the largest relative difference of y, da and db."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(6)  # the same full tensors on every rank
    a, b, g = torch.randn(32, 64), torch.randn(64, 64) * 0.02, torch.randn(32, 64) * 1e-3
    a[3] *= 50  # an outlier row and column, so that a shard's own amax would differ
    b[:, 5] *= 50
    recipe = Fp8Recipe(scaling, block=16)
    A, B = a.clone().requires_grad_(), b.clone().requires_grad_()
    y = fp8_mm(A, B, recipe)
    y.backward(g)
    worst = 0.0
    for pa, pb, pg in [(Replicate(), Shard(1), Shard(1)), (Shard(1), Shard(0), Replicate()),
                       (Shard(0), Replicate(), Shard(0))]:
        Ad = distribute_tensor(a, mesh, [pa]).requires_grad_()
        Bd = distribute_tensor(b, mesh, [pb]).requires_grad_()
        yd = fp8_mm(Ad, Bd, recipe)
        yd.backward(distribute_tensor(g, mesh, [pg]))
        for ours, ref in [(yd, y), (Ad.grad, A.grad), (Bd.grad, B.grad)]:
            worst = max(worst, rel(ours.full_tensor(), ref))
    return worst


@pytest.mark.parametrize("scaling", SCALED)
def test_sharded_operands_are_scaled_as_in_one_process(scaling):
    """Under tensor parallelism a tensor-wise or row-wise amax spans the shards (DTensor reduces
    it over the mesh) and block scales are the shard's own, whole blocks: every GEMM equals one
    process's up to the order of fp32 additions. A scale taken on the local shard alone would be
    off by fp8 steps (≥ 1e-2 here, with an outlier in one shard)."""
    worst = max(run_distributed(sharded_gemms, 2, scaling))
    assert worst <= 1e-5, f"{scaling}: sharded fp8 GEMMs differ from one process's by {worst:.2e}"


def capture(rank: int, world: int, data: str, run_dir: str, parallel: dict, train: dict, steps: int = STEPS) -> dict:
    cfg = tiny_config(data, run_dir, parallel=parallel, train=train, model=MODEL)
    results, grads = steps_with_first_grads(Trainer(cfg, write_files=False), steps)
    return {"losses": [r.loss for r in results], "grads": {k: v.float() for k, v in grads.items()}}


FP8 = {"precision": "fp8"}
BLOCK8 = {"precision": "fp8", "fp8_recipe": "blockwise", "fp8_block": 8}  # the tiny model's head dim is 8


@pytest.fixture(scope="module")
def fp8_runs(tiny_shards, tmp_path_factory):
    """One-process runs: fp32, and fp8 with each recipe and the unscaled control."""
    recipes = {"fp32": {}, "tensorwise": FP8, "blockwise8": BLOCK8,
               **{s: {**FP8, "fp8_recipe": s} for s in ("rowwise", "blockwise", "unscaled")}}
    return {name: run_distributed(capture, 1, str(tiny_shards), str(tmp_path_factory.mktemp(name)), {}, train)[0]
            for name, train in recipes.items()}


@pytest.mark.slow
def test_fp8_recipes_track_fp32_and_unscaled_does_not(fp8_runs):
    """20 steps of the tiny MoE: each recipe within 3e-3 relative of fp32 at every step (the
    tiny model's own bf16 gap is ~3e-4); the unscaled control at least 3× further from fp32 than
    the worst recipe (measured 9e-3 vs ≤ 9e-4)."""

    def drift(name: str) -> float:
        return max(abs(a - b) / b for a, b in zip(fp8_runs[name]["losses"], fp8_runs["fp32"]["losses"]))

    worst = max(drift(s) for s in SCALED)
    assert worst <= 3e-3, {s: drift(s) for s in SCALED}
    assert drift("unscaled") >= 3 * worst, (drift("unscaled"), worst)


CASES = [({"dp": 2, "ep": 2}, FP8, "tensorwise"), ({"tp": 2, "sequence_parallel": True}, FP8, "tensorwise"),
         ({"tp": 2, "sequence_parallel": True}, BLOCK8, "blockwise8"),
         ({"dp": 2, "ep": 2}, {**FP8, "fp8_recipe": "rowwise"}, "rowwise"),
         ({"pp": 2}, FP8, "tensorwise"), ({"dp": 2, "zero_stage": 3}, FP8, "tensorwise")]


@pytest.mark.parametrize("parallel, train, reference", CASES,
                         ids=["dp2-ep2", "tp2-sp", "tp2-sp-blockwise", "dp2-ep2-rowwise", "pp2", "dp2-zero3"])
@pytest.mark.slow(fast=["dp2-ep2"])
def test_fp8_layouts_match_single_process(parallel, train, reference, fp8_runs, tiny_shards, tmp_path):
    ref = fp8_runs[reference]
    result = merged(run_distributed(capture, 2, str(tiny_shards), str(tmp_path), parallel, train))
    for step, (a, b) in enumerate(zip(result["losses"], ref["losses"]), 1):
        assert abs(a - b) <= 2e-3 * abs(b), f"step {step}: loss {a} vs single-process fp8 {b}"
    assert result["grads"].keys() == ref["grads"].keys()
    for name, g in result["grads"].items():
        r = ref["grads"][name]
        step = 2 ** -2 if train.get("fp8_recipe", "tensorwise") == "tensorwise" else 2 ** -3
        err, tol = (g - r).abs().max().item(), step * r.abs().max().item()
        assert err <= tol, f"{name}: max grad error {err:.3e} > {tol:.3e}"


def test_fp8_config_errors(tiny_shards, tmp_path):
    with pytest.raises(ConfigError, match=r"moe.expert_backend = 'grouped_mm'.*fp8 experts.*loop"):
        tiny_config(tiny_shards, tmp_path, train=FP8, moe={"expert_backend": "grouped_mm"})
    with pytest.raises(ConfigError, match=r"train.fp8_block = 32.*tp shard of model.hidden = 32 is 16 wide"):
        tiny_config(tiny_shards, tmp_path, train={**BLOCK8, "fp8_block": 32}, parallel={"tp": 2}, model=MODEL)
    with pytest.raises(ConfigError, match=r"train.compile = True.*fp8"):
        tiny_config(tiny_shards, tmp_path, train={**FP8, "compile": True})
    with pytest.raises(ConfigError, match=r"train.fp8_keep.*expected a list"):
        tiny_config(tiny_shards, tmp_path, train={**FP8, "fp8_keep": "output"})
    cfg = tiny_config(tiny_shards, tmp_path, train={**FP8, "fp8_keep": ["output", "*.wo"]})
    assert cfg.train.fp8_keep == ("output", "*.wo")
