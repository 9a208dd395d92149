"""Context parallelism (moetrain.parallel.context) against single-process references.

Ring attention on cp = 2 and cp = 4 gloo ranks (CPU, fp32) must reproduce full-sequence SDPA
(``F.scaled_dot_product_attention(..., enable_gqa=True)``) in outputs and in dq/dk/dv, for the
CPU flash kernel and the math fallback, causal and not. Tolerance: 1e-5 absolute on outputs and
gradients (q, k, v ~ N(0, 1); values and gradients are O(1)). Each world size is spawned once
(module fixture) and every case is computed inside that one run, to keep the file fast.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moetrain.model import attention
from moetrain.parallel.context import cp_gather, cp_positions, cp_shard, cp_unshard, ring_attention
from multiproc import run_distributed

B, HQ, HKV, D = 2, 4, 2, 16
TOL = 1e-5  # fp32, absolute, outputs and gradients
BF16_TOL = 2e-2  # bf16 case, relative to the largest entry of the fp32 reference
SEQ_DIM = 2


def _inputs(seq_len: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, seq_len, D, generator=gen)
    k = torch.randn(B, HKV, seq_len, D, generator=gen)
    v = torch.randn(B, HKV, seq_len, D, generator=gen)
    dout = torch.randn(B, HQ, seq_len, D, generator=gen)
    return [t.to(dtype) for t in (q, k, v, dout)]


def _reference(q, k, v, dout, causal):
    """Full-sequence SDPA in one process: output and (dq, dk, dv)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


def _ring_errors(rank, cp, group, q, k, v, dout, causal, kernel, shard=cp_shard, gather=None, relative=False):
    """Max abs errors of ring attention (gathered) vs the fp32 reference on the same inputs:
    out, dq, dk, dv; ``relative``: divided by the reference's largest entry."""
    gather = gather or (lambda x: cp_gather(x, group, SEQ_DIM))
    ref_out, ref_grads = _reference(q.float(), k.float(), v.float(), dout.float(), causal)
    local = [shard(t, rank, cp, SEQ_DIM).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group, causal=causal, kernel=kernel)
    out.backward(shard(dout, rank, cp, SEQ_DIM))
    errs = {}
    for name, x, ref in zip(("out", "dq", "dk", "dv"), (out.detach(), *(t.grad for t in local)), (ref_out, *ref_grads)):
        errs[name] = ((gather(x).float() - ref).abs().max() / (ref.abs().max() if relative else 1)).item()
    return errs


def _contiguous_shard(x, rank, cp, dim):
    """The naive layout (rank r holds the r-th of cp contiguous pieces): wrong for ring_attention."""
    return x.chunk(cp, dim=dim)[rank].contiguous()


def _worker(rank: int, cp: int) -> dict:
    group = dist.group.WORLD
    res = {}
    # 1. Exactness: every kernel, causal or not, two sequence lengths.
    for seq_len in (32, 64):
        q, k, v, dout = _inputs(seq_len)
        for causal in (True, False):
            for kernel in ("cpu_flash", "math"):
                res[f"S={seq_len} causal={causal} kernel={kernel}"] = _ring_errors(
                    rank, cp, group, q, k, v, dout, causal, kernel)
    # 2. bf16 through the CPU flash kernel (fp32 accumulation) vs fp32 SDPA on the same inputs.
    q, k, v, dout = _inputs(32, torch.bfloat16)
    res["bf16"] = _ring_errors(rank, cp, group, q, k, v, dout, True, "auto", relative=True)
    # 3. The test can fail: the naive contiguous layout must give a large causal error.
    def gather_contiguous(x):
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, SEQ_DIM)
    q, k, v, dout = _inputs(32)
    res["wrong_layout"] = _ring_errors(rank, cp, group, q, k, v, dout, True, "cpu_flash",
                                       shard=_contiguous_shard, gather=gather_contiguous)
    # 4. A group of one rank is plain local attention.
    singles = [dist.new_group([r]) for r in range(cp)]
    res["cp1"] = _ring_errors(0, 1, singles[rank], q, k, v, dout, True, "cpu_flash", gather=lambda x: x)
    # 5. Gathered positions and data are the natural order.
    res["positions"] = cp_gather(cp_positions(64, rank, cp), group, 0)
    x = torch.randn(3, 64, 5, generator=torch.Generator().manual_seed(1))
    res["roundtrip"] = torch.equal(cp_gather(cp_shard(x, rank, cp, 1), group, 1), x)
    return res


@pytest.fixture(scope="module", params=[2, 4], ids=lambda cp: f"cp{cp}")
def ring_results(request):
    cp = request.param
    return cp, run_distributed(_worker, cp)


def _exact_cases(res):
    return {name: errs for name, errs in res.items() if name.startswith("S=")}


def test_outputs_match_full_sdpa(ring_results):
    cp, results = ring_results
    for rank, res in enumerate(results):
        bad = {n: e["out"] for n, e in _exact_cases(res).items() if e["out"] > TOL}
        assert not bad, f"cp={cp} rank {rank}: output error above {TOL}: {bad}"


def test_grads_match_full_sdpa(ring_results):
    cp, results = ring_results
    for rank, res in enumerate(results):
        bad = {(n, g): e[g] for n, e in _exact_cases(res).items() for g in ("dq", "dk", "dv") if e[g] > TOL}
        assert not bad, f"cp={cp} rank {rank}: gradient error above {TOL}: {bad}"


def test_bf16_and_single_rank_group(ring_results):
    cp, results = ring_results
    for res in results:
        assert max(res["bf16"].values()) < BF16_TOL, res["bf16"]
        assert max(res["cp1"].values()) < TOL, res["cp1"]


def test_wrong_layout_is_detected(ring_results):
    """Guards the tests themselves: a layout mistake must show up far above the tolerance."""
    cp, results = ring_results
    for res in results:
        assert res["wrong_layout"]["out"] > 0.1, res["wrong_layout"]


def test_gather_positions_and_roundtrip(ring_results):
    cp, results = ring_results
    for res in results:
        assert torch.equal(res["positions"], torch.arange(64))
        assert res["roundtrip"]


# ---------------------------------------------------------------------------------------------
# Single-process tests: sharding arithmetic and the per-block kernels.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_unshard_positions(cp):
    seq_len = 2 * cp * 3
    x = torch.arange(seq_len * 2).view(2, seq_len)
    parts = [cp_shard(x, r, cp, 1) for r in range(cp)]
    assert torch.equal(cp_unshard(torch.cat(parts, 1), cp, 1), x)
    for r, part in enumerate(parts):
        pos = cp_positions(seq_len, r, cp)
        assert pos.dtype == torch.long and torch.equal(part[0], pos)
        # one early chunk and one late chunk: every rank has the same causal work
        c = seq_len // (2 * cp)
        assert (pos[:c] + 1).sum() + (pos[c:] + 1).sum() == (seq_len + 1) * c


def test_shard_rejects_bad_lengths():
    with pytest.raises(ValueError, match="divisible by 2"):
        cp_shard(torch.zeros(1, 10), 0, 4, 1)
    with pytest.raises(ValueError, match="cp_rank"):
        cp_positions(16, 4, 4)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("native_gqa", [True, False])
def test_block_kernels(monkeypatch, causal, native_gqa):
    """CPU flash (native GQA, or the expand path of older torch) and math kernels. Forward: out
    equals SDPA, lse equals the kernels'. Backward of a sub-block (the first half of K/V; the
    top-left causal mask of a [32 × 16] block is the global one) given the full rows' out/lse:
    its dk/dv are exactly that half of the full gradients."""
    monkeypatch.setattr(attention, "_cpu_flash_native_gqa", lambda: native_gqa)
    q, k, v, dout = _inputs(32)
    ref_out, ref_grads = _reference(q, k, v, dout, causal)
    scale = D ** -0.5
    lses = []
    for kernel in ("cpu_flash", "math"):
        out, lse = attention.block_forward(kernel, q, k, v, causal, scale)
        assert (out - ref_out).abs().max() < TOL, kernel
        _, dk, dv = attention.block_backward(kernel, dout, q, k[:, :, :16], v[:, :, :16], out, lse, causal, scale)
        assert (dk - ref_grads[1][:, :, :16]).abs().max() < TOL, kernel
        assert (dv - ref_grads[2][:, :, :16]).abs().max() < TOL, kernel
        lses.append(lse)
    assert (lses[0] - lses[1]).abs().max() < TOL


def test_ring_attention_rejects_bad_input():
    q, k, v, _ = _inputs(32)
    with pytest.raises(ValueError, match="group is None"):
        ring_attention(q, k, v, None)
    with pytest.raises(ValueError, match="disagree"):
        ring_attention(q, k[:, :, :16], v[:, :, :16], object())
