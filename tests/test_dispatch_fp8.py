"""Low-precision token dispatch (``moe.dispatch_dtype``): the fp8 wire format against fp32, its
bytes against bf16, and the same numbers in every layout (one process, the flat all-to-all, the
hierarchical dispatcher, tp2 + SP) over 20 steps, compared where E4M3's rounding allows
(tests/lockstep.py).
"""

from __future__ import annotations

import pytest
import torch

from moetrain.model import fp8
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from lockstep import Recorder, compare_in_lockstep, envelope, expert_loads, merge_ranks
from multiproc import run_distributed
from test_equivalence import assert_matches, merged, steps_with_first_grads

STEPS = 20
# hidden 256: two 1 × 128 tiles per row, so a tile's scale is proved independent of the other's.
MODEL = {"hidden": 256, "heads": 4, "kv_heads": 2, "vocab_size": 258}  # 258: split over tp = 2
MOE = {"num_experts": 4, "top_k": 2}


def wide_rows(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """Rows whose tiles span 12 orders of magnitude, with exact zeros and one outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-6, 6, n).unsqueeze(1)
    x[1] = 0.0
    x[2, 3] = 1e4  # an outlier in the first tile of row 2 only
    return x


def test_fp8_rows_are_within_e4m3_rounding_of_fp32():
    x = wide_rows(13, 256)
    q, exp = fp8.quantize(x, 128)
    y = fp8.dequantize(q, exp, torch.float32)
    scale = torch.exp2(exp.float()).repeat_interleave(128, 1)  # [N, D]
    # E4M3 keeps 3 mantissa bits: half an ulp is 2⁻⁴ of a normal value; below 2⁻⁶ (its smallest
    # normal) the step is 2⁻⁹, so the error is at most 2⁻¹⁰ in units of the tile's scale.
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    assert ((y - x).abs() <= bound).all()
    # The largest magnitude of every nonzero tile lands in E4M3's top binade: (224, 448].
    amax = (x.view(13, 2, 128).abs().amax(-1) / torch.exp2(exp.float()))
    nonzero = amax > 0
    assert ((amax[nonzero] > 224) & (amax[nonzero] <= 448)).all()
    # The outlier sets its own tile's scale, not the other tile's.
    assert exp[2, 0] > exp[2, 1] + 5
    assert torch.equal(y[1], torch.zeros(256))
    # A format with no scaling loses the small rows entirely (what the scales are for).
    unscaled = x.to(fp8.E4M3).float()
    assert (unscaled[0] == 0).all() and (y[0] != 0).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizing_a_delivered_row_again_is_exact(dtype):
    # A dispatcher encodes rows the MoE layer already rounded (and the hierarchical one encodes
    # them twice): decoding must give the same values, bit for bit. (The encoding itself may
    # differ: a tile whose largest value rounded down to 224 is re-encoded with half the scale.)
    x = wide_rows(13, 256).to(dtype)
    once = fp8.unpack(fp8.pack(x), 256, dtype)
    assert not torch.equal(once, x)
    assert torch.equal(fp8.unpack(fp8.pack(once), 256, dtype), once)


def test_round_trip_passes_the_gradient_straight_through():
    x = wide_rows(5, 64).requires_grad_()
    y = fp8.round_trip(x, fp8.E4M3)
    assert y.shape == x.shape and not torch.equal(y, x)  # per-row scales: D = 64 is not a multiple of 128
    g = torch.randn_like(x)
    y.backward(g)
    assert torch.equal(x.grad, g)
    assert fp8.round_trip(x, None) is x


def test_fp8_rows_take_at_most_055_of_bf16():
    for d in (256, 7168, 96):  # the demo, DeepSeek-V3, per-row scales
        ratio = fp8.row_bytes(d, fp8.E4M3) / fp8.row_bytes(d, torch.bfloat16)
        assert ratio <= 0.55, (d, ratio)
    assert fp8.row_bytes(7168, fp8.E4M3) == 7168 + 56
    assert fp8.pack(torch.randn(3, 256)).shape == (3, 258)


def dispatch_capture(rank: int, world: int, data: str, run_dir: str, parallel: dict, moe: dict) -> dict:
    cfg = tiny_config(data, run_dir, parallel=parallel, moe={**MOE, **moe}, model=MODEL,
                      train={"steps": STEPS, "grad_clip": 1.0})
    kwargs = {"mesh_ranks": torch.arange(world).reshape(1, world, 1, 1).tolist(), "rank_domains": [0, 0, 1, 1]
              } if world == 4 else {}
    trainer = Trainer(cfg, write_files=False, **kwargs)
    recorder = Recorder().install(trainer)
    results, grads = steps_with_first_grads(trainer, STEPS)
    return {"losses": [r.loss for r in results], "grads": grads, "norms": [r.grad_norm for r in results],
            "bytes": [r.extra.get("dispatch_bytes") for r in results], "loads": expert_loads(results),
            "samples": recorder.result()}


def runs(ranks: list[dict]) -> dict:
    """One layout's run as :func:`lockstep.compare_in_lockstep` takes it."""
    return {**merged(ranks), "bytes": ranks[0]["bytes"], "loads": ranks[0]["loads"],
            "samples": merge_ranks([r["samples"] for r in ranks])}


@pytest.fixture(scope="module")
def fp8_reference(tiny_shards, tmp_path_factory):
    run = tmp_path_factory.mktemp("fp8_ref")
    return runs(run_distributed(dispatch_capture, 1, str(tiny_shards), str(run), {}, {"dispatch_dtype": "fp8"}))


@pytest.fixture(scope="module")
def bf16_reference(tiny_shards, tmp_path_factory):
    """One process with the bf16 wire: how far the wire's rounding moves the fp8 reference."""
    run = tmp_path_factory.mktemp("bf16_ref")
    return runs(run_distributed(dispatch_capture, 1, str(tiny_shards), str(run), {}, {"dispatch_dtype": "bf16"}))


@pytest.mark.slow
def test_fp8_dispatch_is_the_same_in_every_layout(fp8_reference, bf16_reference, tiny_shards, tmp_path):
    """Every layout puts the same E4M3 rows on the wire as one process, compared where the rounding
    allows it (tests/lockstep.py): step 1 (the same weights) gives one process's gradients within
    fp32 reordering (1e-5 of each tensor's largest entry, as every layout test); until a token
    first goes to another expert than in one process, the losses are within 1e-4 relative (fp32
    reordering and E4M3 rounding boundaries crossed one way in one run and the other way in the
    other); at every step, the same samples, finite losses within what the bf16 wire changes."""
    ref = fp8_reference
    bound = envelope(ref["losses"], bf16_reference["losses"])
    layouts = {
        "dp2-ep2": run_distributed(dispatch_capture, 2, str(tiny_shards), str(tmp_path / "flat"), {"dp": 2, "ep": 2},
                                   {"dispatch_dtype": "fp8"}),
        "dp4-ep4-hierarchical": run_distributed(dispatch_capture, 4, str(tiny_shards), str(tmp_path / "hier"),
                                                {"dp": 4, "ep": 4},
                                                {"dispatch_dtype": "fp8", "token_dispatcher": "hierarchical"}),
        "tp2-sp": run_distributed(dispatch_capture, 2, str(tiny_shards), str(tmp_path / "tp"),
                                  {"tp": 2, "sequence_parallel": True}, {"dispatch_dtype": "fp8"}),
    }
    assert layouts["dp4-ep4-hierarchical"][0]["bytes"][0]["inter_node"] > 0
    for name, ranks in layouts.items():
        res = runs(ranks)
        compare_in_lockstep(name, res, ref, rel=1e-4, bound=bound)
        assert_matches({"losses": res["losses"][:1], "grads": res["grads"]}, ref)


@pytest.mark.slow
def test_fp8_dispatch_bytes_and_loss_against_bf16(fp8_reference, bf16_reference, tiny_shards, tmp_path):
    wires = {wire: runs(run_distributed(dispatch_capture, 2, str(tiny_shards), str(tmp_path / wire), {"dp": 2, "ep": 2},
                                        {"dispatch_dtype": wire})) for wire in ("bf16", "fp8")}
    # Step 1 routes the same tokens (same weights and data): the bytes differ by the row format
    # alone, (D + D/128) / 2D with the scales counted.
    b16, b8 = wires["bf16"]["bytes"][0], wires["fp8"]["bytes"][0]
    sent16, sent8 = sum(b16.values()), sum(b8.values())
    assert sent16 > 0 and sent8 / sent16 == pytest.approx((256 + 2) / 512)
    assert sent8 / sent16 <= 0.55
    # The fp8 run is the reference's numbers (the same wire in one process; tests/lockstep.py).
    compare_in_lockstep("dp2-ep2 fp8", wires["fp8"], fp8_reference, rel=1e-4,
                        bound=envelope(fp8_reference["losses"], bf16_reference["losses"]))
    # The rounding is real and small. At step 1 (the same weights) E4M3 moves each routed value by
    # up to 2⁻⁴ of it, bf16 by 2⁻⁹, and the loss, an average over 128 tokens of what those values
    # feed, by far less: above zero, below 1e-3 relative (measured 1.8e-5). Over the first four
    # steps the two wires stay closer than a tenth of what one step of training changes the loss
    # (the steps change it by 0.1-1.2; the wires differ by at most 3.9e-4 by step 4, measured).
    # After that the two runs part as any two whose weights differ in the last bits do.
    fp, bf = wires["fp8"]["losses"], wires["bf16"]["losses"]
    assert 0 < abs(fp[0] - bf[0]) / bf[0] < 1e-3, (fp, bf)
    assert min(abs(bf[i] - bf[i - 1]) for i in range(1, 4)) > 10 * max(abs(a - b) for a, b in zip(fp[:4], bf[:4]))
    assert bf16_reference["losses"] != fp8_reference["losses"]
