"""Planner: model arithmetic, memory against the ZeRO and Korthikanti formulas, pipeline bubble
against the schedule formulas, communication tiers, the search, and published results."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moetrain.config import load_config
from moetrain.planner.layout import Layout, LayoutError, parse_layout_spec
from moetrain.planner.memory import (
    ActivationArch,
    MemoryAssumptions,
    _inflight,
    activation_terms,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    memory_per_gpu,
    stage_layers,
    zero_model_state_bytes,
)
from moetrain.planner.model import ModelShape
from moetrain.planner.search import Planner
from moetrain.planner.timing import bubble_time, pipeline_time
from moetrain.planner.traffic import AxisPlace, bus_factor, comm_time, step_collectives
from moetrain.topology import load_profile

H100 = load_profile("h100-superpod")
GB = 1e9


def _shape(path: str) -> ModelShape:
    return ModelShape.from_config(load_config(path))


# ---------------------------------------------------------------------------------------------
# Model arithmetic
# ---------------------------------------------------------------------------------------------


def test_parameter_counts_match_the_published_models():
    mix = _shape("configs/mixtral-8x7b.yaml")
    assert mix.total_params / 1e9 == pytest.approx(46.7, abs=0.1)    # Mixtral paper: 46.7B total
    assert mix.active_params / 1e9 == pytest.approx(12.9, abs=0.1)   # 12.9B active
    assert _shape("configs/llama3-70b-like.yaml").total_params / 1e9 == pytest.approx(70.6, abs=0.1)
    assert _shape("configs/gpt3-175b.yaml").total_params / 1e9 == pytest.approx(174.6, abs=0.5)
    ds = _shape("configs/deepseek-v3-like.yaml")
    main = ds.total_params - sum(ds.mtp_params())  # DeepSeek-V3's 671B leave its MTP module out
    assert main / 1e9 == pytest.approx(671, rel=0.01) and ds.active_params / 1e9 == pytest.approx(37, rel=0.06)


def test_flops_follow_megatron_eq3():
    # Narayanan et al. 2021 eq. (3): 96·B·s·l·h²(1 + s/6h + V/16lh) with recomputation.
    s = _shape("configs/megatron2021/gpt-1.7b.yaml")  # h = 2304: the SwiGLU of 8h/3 is exact
    h, l, seq, v = s.hidden, s.layers, s.seq_len, s.vocab
    eq3_per_token = 96 * l * h * h * (1 + seq / (6 * h) + v / (16 * l * h))
    ours = s.model_flops_per_token() + s.recompute_flops_per_token("full")
    assert ours == pytest.approx(eq3_per_token, rel=1e-9)
    assert s.model_flops_per_token() == pytest.approx(eq3_per_token * 72 / 96 + 6 * h * v / 4, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


def test_zero_formulas_reproduce_the_paper_example():
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N_d = 64, K = 12.
    psi = 7.5e9
    got = [zero_model_state_bytes(psi, 64, z) / GB for z in range(4)]
    assert got == pytest.approx([120.0, 31.4, 16.6, 1.9], abs=0.06)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_planner_model_states_equal_zero_formulas(zero):
    shape = _shape("configs/llama3-70b-like.yaml")
    paper = MemoryAssumptions(param_bytes=2, grad_bytes=2, optim_bytes=12)
    lay = Layout(tp=1, pp=1, dp=16, zero=zero, mbs=1)
    mem = memory_per_gpu(shape, lay, global_batch=16, assumptions=paper)
    states = mem.params + mem.grads + mem.optimizer
    assert states == pytest.approx(zero_model_state_bytes(shape.total_params, 16, zero), rel=1e-9)


def test_experts_are_split_by_ep_and_sharded_over_edp_tp():
    shape = _shape("configs/mixtral-8x7b.yaml")
    m1 = memory_per_gpu(shape, Layout(tp=1, pp=1, dp=8, ep=1, zero=0), 64)
    m8 = memory_per_gpu(shape, Layout(tp=1, pp=1, dp=8, ep=8, zero=0), 64)
    assert m1.detail["expert_params"] == pytest.approx(8 * m8.detail["expert_params"])
    z1 = memory_per_gpu(shape, Layout(tp=2, pp=1, dp=8, ep=4, zero=1, sp=True), 64)
    expert = z1.detail["expert_params"]
    dense = z1.detail["dense_params"]
    # ZeRO-1: optimizer states of experts sharded over edp·tp = 8·2/4 = 4, dense over dp·cp = 8
    assert z1.optimizer == pytest.approx(12 * (dense / 8 + expert / 4))


@pytest.mark.parametrize("t, sp, ac", [(1, False, "none"), (8, False, "none"), (8, True, "none"),
                                       (8, True, "selective"), (4, True, "full"), (1, False, "full")])
def test_activation_accounting_reproduces_korthikanti(t, sp, ac):
    # GPT-3 175B's layer: s = 2048, h = 12288, a = 96 (Korthikanti et al. 2022, Table 2 / eq. 1-5)
    s, b, h, a = 2048, 1, 12288, 96
    terms = activation_terms(ActivationArch.gpt(s, h, a))
    assert layer_activation_bytes(terms, s * b, t, sp, ac) == pytest.approx(
        korthikanti_layer_bytes(s, b, h, a, t, sp, ac), rel=1e-12)
    if not sp and ac == "none":
        assert korthikanti_layer_bytes(s, b, h, a, t, sp) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))


def test_moetrain_layer_keeps_less_than_gpt():
    arch = ActivationArch(hidden=4096, heads=32, h_q=4096, h_kv=1024, ffn=14336, seq_len=4096)
    flash = layer_activation_bytes(activation_terms(arch), 4096, 1, False, "none")
    eager = layer_activation_bytes(activation_terms(ActivationArch(**{**arch.__dict__, "fused_swiglu": False})),
                                   4096, 1, False, "none")
    assert eager - flash == pytest.approx(4096 * 4 * 14336)  # silu(gate) and the product, 2 bytes each


@pytest.mark.parametrize("pp, v", [(4, 1), (8, 2), (16, 4)])
def test_pipeline_keeps_korthikanti_in_flight_activations(pp, v):
    # First stage of 1F1B holds pp micro-batches (L layers in all); interleaving adds (p−1)/(p·v).
    lay = Layout(pp=pp, vpp=v, schedule="interleaved_1f1b" if v > 1 else "1f1b")
    inflight = _inflight(lay, m=64, r=0)
    layers = 64
    assert inflight * layers / pp == pytest.approx(layers * (1 + (pp - 1) / (pp * v)) if v > 1 else layers)
    assert _inflight(Layout(pp=pp, schedule="gpipe"), m=64, r=0) == 64


def test_stage_layers_round_robin_and_uneven():
    shape = _shape("configs/llama3-405b-like.yaml")  # 126 layers
    stages = stage_layers(shape, 16, 1)
    assert sorted(i for st in stages for i in st) == list(range(126))
    assert max(map(len, stages)) == 8 and min(map(len, stages)) == 7
    inter = stage_layers(shape, 9, 2)
    assert inter[0][:7] == list(range(7)) and inter[0][7] == 63  # chunks 0 and 9 on rank 0


# ---------------------------------------------------------------------------------------------
# Pipeline bubble and communication
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp, v, m", [(4, 1, 8), (8, 1, 64), (8, 2, 64), (16, 4, 32)])
def test_bubble_matches_schedule_formulas(pp, v, m):
    tf, tb = 1.0, 2.0
    # Narayanan et al. 2021 §2.2: 1F1B bubble fraction (p−1)/m; interleaved (p−1)/(v·m)
    assert bubble_time("1f1b", pp, 1, m, tf, tb) / (m * (tf + tb)) == pytest.approx((pp - 1) / m)
    assert bubble_time("gpipe", pp, 1, m, tf, tb) == pytest.approx(bubble_time("1f1b", pp, 1, m, tf, tb))
    if v > 1:
        assert bubble_time("interleaved_1f1b", pp, v, m, tf, tb) / (m * (tf + tb)) == pytest.approx((pp - 1) / (v * m))
    # ZB-H1 (Qi et al. 2023): (p−1)(T_F + T_B − T_W) with the backward split evenly = (p−1)·t_f
    assert bubble_time("zero_bubble", pp, 1, m, tf, tb) == pytest.approx((pp - 1) * tf)
    assert pipeline_time("1f1b", 1, 1, m, tf, tb) == pytest.approx(m * (tf + tb))


def test_bus_factors_and_hierarchical_split():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == pytest.approx(3 / 4)
    assert bus_factor("all_reduce", 1) == 0
    S = 1e9
    t_nv, tiers = comm_time("all_reduce", S, AxisPlace(8, "nvlink", 8), H100)
    assert tiers == {"nvlink": pytest.approx(2 * 7 / 8 * S)}
    assert t_nv == pytest.approx(2 * 7 / 8 * S / H100.bandwidth("nvlink") + 6 * H100.latency("nvlink"))
    # 16 ranks, 8 per NVSwitch domain: each GPU's NIC carries 1/8 of the ring traffic
    _, tiers = comm_time("all_reduce", S, AxisPlace(16, "spine", 8), H100)
    assert tiers["spine"] == pytest.approx(2 * 15 / 16 * S / 8)
    assert tiers["nvlink"] == pytest.approx(2 * 15 / 16 * S * 7 / 8)
    _, tiers = comm_time("all_to_all", S, AxisPlace(16, "rail", 4), H100)
    assert tiers["rail"] == pytest.approx(S * 12 / 16) and tiers["nvlink"] == pytest.approx(S * 3 / 16)


# ---------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------


def test_search_keeps_fitting_layouts_ranked_by_step_time():
    cfg = load_config("configs/mixtral-8x7b.yaml")
    planner = Planner.from_config(cfg, H100, 8)
    res = planner.search({"tp": 2}, top=0)
    assert res.fitting == len(res.ranked) > 10 and res.enumerated > res.fitting
    times = [p.step_s for p in res.ranked]
    assert times == sorted(times)
    assert all(p.fits and p.layout.tp == 2 for p in res.ranked)
    best = res.ranked[0]
    d = best.to_dict()
    for key in ("tp", "pp", "dp", "cp", "ep", "zero_stage", "memory_gib_per_gpu", "step_time_s", "tflops_per_gpu", "mfu"):
        assert key in d
    assert 0 < d["mfu"] < H100.gemm_efficiency
    assert d["tflops_per_gpu"] == pytest.approx(d["mfu"] * H100.peak_tflops)
    assert sum(best.time.breakdown.values()) == pytest.approx(best.step_s)
    # a config made from the winner loads and validates
    cfg2 = load_config("configs/mixtral-8x7b.yaml", best.layout.overrides() + ["parallel.pp_schedule=" + best.layout.schedule])
    assert cfg2.parallel.world_size == 64


def test_a_model_that_cannot_fit_says_so():
    cfg = load_config("configs/llama3-405b-like.yaml")
    res = Planner.from_config(cfg, H100, 2).search(top=3)
    assert res.ranked == [] and res.smallest_miss is not None and res.smallest_miss.memory_gib > 74


def test_invalid_layout_is_explained():
    planner = Planner.from_config(load_config("configs/mixtral-8x7b.yaml"), H100, 8)
    with pytest.raises(ValueError, match="model.kv_heads=8 is not divisible by it"):
        planner.evaluate(Layout(tp=16, pp=1, dp=4, mbs=1))  # kv_heads = 8
    with pytest.raises(ValueError, match="64 GPUs"):
        planner.evaluate(Layout(tp=2, pp=1, dp=8, mbs=1))
    empty = Planner.from_config(load_config("configs/mixtral-8x7b.yaml"), load_profile("gb200-nvl72"), 18).search()
    assert empty.enumerated == 0 and "train.global_batch_size" in empty.empty_reason


def test_layout_spec_parsing():
    assert parse_layout_spec("tp=8, pp=4,zero=1,ac=full,vpp=2") == {"tp": 8, "pp": 4, "zero": 1, "ac": "full", "vpp": 2}
    with pytest.raises(LayoutError, match="unknown key"):
        parse_layout_spec("tq=8")
    with pytest.raises(LayoutError, match="ZeRO|0, 1, 2 or 3"):
        parse_layout_spec("zero=4")


@pytest.mark.slow
def test_plan_cli_json(capsys):
    from moetrain.plan import main

    rc = main(["--config", "configs/mixtral-8x7b.yaml", "--nodes", "8", "--layout", "tp=2,pp=4", "--top", "3",
               "--format", "json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"] == 64 and len(out["layouts"]) == 3
    for lay in out["layouts"]:
        assert lay["tp"] == 2 and lay["pp"] == 4 and lay["fits"]
    rc = main(["--config", "configs/mixtral-8x7b.yaml", "--nodes", "8",
               "--layout", "tp=2,pp=4,dp=8,cp=1,ep=8,vpp=2,zero=1,mbs=1,ac=full"])
    assert rc == 0 and "tp2 pp4x2 dp8 ep8 z1 mbs1 ac=full" in capsys.readouterr().out
    # Megatron-Core's per-module recomputation: planned, but no --set lines moetrain cannot run
    rc = main(["--config", "configs/mixtral-8x7b.yaml", "--nodes", "8", "--layout", "recompute_modules=layernorm+moe_act",
               "--top", "1"])
    text = capsys.readouterr().out
    assert rc == 0 and "ac=selective(layernorm+moe_act)" in text and "to use #1" not in text
    assert "not a layout moetrain's trainer runs: recompute_modules=layernorm+moe_act" in text
    rc = main(["--config", "configs/mixtral-8x7b.yaml", "--nodes", "8", "--layout", "modules=layernorm",
               "--top", "1", "--format", "json"])
    lay = json.loads(capsys.readouterr().out)["layouts"][0]
    assert lay["recompute_modules"] == ["layernorm"] and lay["overrides"] is None


# ---------------------------------------------------------------------------------------------
# Published results (docs/topology.md §5; only the short-K constant was set from four of them)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def published_rows():
    from moetrain.planner.published import compare_all

    return compare_all()


def test_published_results_within_tolerance(published_rows):
    from moetrain.planner.published import MEDIAN_GOAL, TOLERANCE, summary

    rows = published_rows
    held = [r for r in rows if r["held"]]
    assert sum(not r["moe"] for r in held) >= 20 and sum(r["moe"] for r in held) >= 7
    for r in held:
        assert abs(r["error"]) <= TOLERANCE, r
    stats = summary(rows)
    for group in ("dense", "moe", "held-out dense", "held-out moe"):
        assert stats[group]["median"] <= MEDIAN_GOAL, (group, stats[group])
    # what is not held says why, and is still compared
    for r in rows:
        assert r["held"] or (r["note"] and r["error"] is not None), r
    # the dense rows of the earlier comparison stay as close as before this model (mean 6.1 %)
    old = [abs(r["error"]) for r in held if r["key"].startswith(("megatron2021", "llama3"))]
    assert len(old) == 12 and sum(old) / len(old) < 0.065


def test_megatron_core_weak_scaling_table_is_held(published_rows, monkeypatch):
    """The Megatron-LM README's H100 table of dense GPTs, 1.7B to 462B (issue 21 held it back while
    its smallest rows came out 22-33 % too fast): held now, every row within 20 %. What closed the
    gap (docs/topology.md §5): the H100's reported HBM efficiency and Megatron-Core r0.8's passes
    over its gradient buffer; without either, a row is above 20 % again."""
    import dataclasses
    import statistics

    from moetrain.planner import published

    rows = {r["key"]: r for r in published_rows if r["key"].startswith("megatron-core-r0.8-")}
    assert len(rows) == 9 and all(r["held"] for r in rows.values())
    errors = [abs(r["error"]) for r in rows.values()]
    assert max(errors) <= 0.20 and statistics.median(errors) <= 0.12, [(k, r["error"]) for k, r in rows.items()]
    # each of the two terms is needed: without either some row is above 20 % again (today: without
    # the gradient-buffer passes 7.1B and 70B, 20.9 and 20.8 %; without the HBM efficiency 70B, 20.1 %)
    mlm = [e for e in published.PUBLISHED if e.key.startswith("megatron-core-r0.8-")]
    plan = published._planner
    for drop in ("grad_buffer", "hbm"):
        def without(entry, drop=drop):
            planner = plan(entry)
            if drop == "hbm":
                planner.profile = dataclasses.replace(planner.profile, hbm_efficiency=1.0)
            else:
                planner.timing = dataclasses.replace(planner.timing, grad_buffer_bytes=0.0)
            return planner
        monkeypatch.setattr(published, "_planner", without)
        assert any(published.predict(e)["error"] > 0.20 for e in mlm), drop


def _megatron_1p7b_tp2():
    """(shape, layout, places, profile): the weak-scaling table's 1.7B shape at tp2 + SP, dp8 on
    the H100 profile, one NVLink tp group and a rail dp group."""
    from moetrain.planner.published import model_shape

    shape = model_shape(24, 2048, 16, 131072, 4096, ffn=8192, mlp_matrices=2)
    lay = Layout(tp=2, pp=1, dp=8, zero=1, mbs=1, sp=True)
    none = AxisPlace(1, "none", 1)
    places = {"tp": AxisPlace(2, "nvlink", 2), "cp": none, "pp": none, "dp_cp": AxisPlace(8, "rail", 1),
              "ep": none, "edp": none, "edp_tp": none}
    prof = load_profile("h100-superpod")
    return shape, lay, places, prof


def test_grad_buffer_passes_and_hbm_efficiency_cost_what_they_should():
    """grad_buffer_bytes moves that many bytes per local parameter once a step (tp shards them;
    a negative count is refused); hbm_efficiency slows the memory-bound terms (elementwise
    kernels, optimizer) by its inverse and leaves communication alone."""
    import dataclasses

    from moetrain.planner.timing import TimingAssumptions, step_time

    shape, lay, places, prof = _megatron_1p7b_tp2()
    assert prof.hbm_efficiency == 0.90 and prof.hbm_bandwidth() == pytest.approx(3350e9 * 0.9)
    plain = step_time(shape, lay, 64, prof, places)
    passes = step_time(shape, lay, 64, prof, places, ta=TimingAssumptions(grad_buffer_bytes=16.0))
    local = (24 * shape.layer_params(False)[0] + 2 * 131072 * 2048) / 2
    assert plain.breakdown["grad_buffer"] == 0.0
    assert passes.breakdown["grad_buffer"] == pytest.approx(16.0 * local / prof.hbm_bandwidth(), rel=1e-9)
    assert passes.step - plain.step == pytest.approx(passes.breakdown["grad_buffer"], rel=1e-9)
    datasheet = step_time(shape, lay, 64, dataclasses.replace(prof, hbm_efficiency=1.0), places)
    for key in ("elementwise", "optimizer"):
        assert plain.breakdown[key] == pytest.approx(datasheet.breakdown[key] / 0.9, rel=1e-9), key
    assert plain.breakdown["tp_comm"] == datasheet.breakdown["tp_comm"]
    with pytest.raises(ValueError, match="grad_buffer_bytes"):
        TimingAssumptions(grad_buffer_bytes=-4.0)


def test_megatron_software_facts_cost_what_they_should():
    """tp_comm_overlap hides the TP collectives behind the layer's GEMMs; the unfused cross-entropy
    moves 56 instead of 24 bytes per logit; both are refused when misspelt."""
    from moetrain.planner.timing import TimingAssumptions, step_time

    shape, lay, places, prof = _megatron_1p7b_tp2()
    plain = step_time(shape, lay, 64, prof, places)
    overlapped = step_time(shape, lay, 64, prof, places, ta=TimingAssumptions(tp_comm_overlap=True))
    assert plain.breakdown["tp_comm"] > 0 and overlapped.breakdown["tp_comm"] < 0.2 * plain.breakdown["tp_comm"]
    assert overlapped.step < plain.step
    unfused = step_time(shape, lay, 64, prof, places, ta=TimingAssumptions(cross_entropy="unfused"))
    logits = 4096 * 131072 / 2  # per micro-batch: tokens × vocabulary / tp
    grown = unfused.t_f + unfused.t_b - plain.t_f - plain.t_b
    assert grown == pytest.approx((56 - 24) * logits / prof.hbm_bandwidth(), rel=1e-6)
    with pytest.raises(ValueError, match="cross_entropy"):
        TimingAssumptions(cross_entropy="chunked")


# The published runs (GPT-3, Megatron 2021) tie their embeddings over pp, which moetrain's trainer
# does not run: they are planned as those runs, not as runs to submit.
@pytest.mark.parametrize("path, published", [
    ("configs/mixtral-8x7b.yaml", False), ("configs/deepseek-v3-like.yaml", False),
    ("configs/llama3-70b-like.yaml", False), ("configs/llama3-405b-like.yaml", False),
    ("configs/llama4-scout-like.yaml", False), ("configs/deepseek-v32-like.yaml", False),
    ("configs/gpt3-175b.yaml", True), ("configs/megatron2021/gpt-145.6b.yaml", True)])
def test_shipped_configs_load_and_fit_their_own_layout(path, published):
    cfg = load_config(path)
    prof = load_profile(cfg.launch.profile)
    plan = Planner.from_config(cfg, prof, cfg.launch.nodes, published=published).evaluate(Layout.from_config(cfg))
    assert plan.fits and plan.step_s > 0, (path, plan.memory_gib)


# ---------------------------------------------------------------------------------------------
# HSDP and Muon
# ---------------------------------------------------------------------------------------------


def test_hsdp_shards_states_over_its_group_and_keeps_the_gathers_on_nvlink():
    cfg = load_config("configs/mixtral-8x7b.yaml", ["train.global_batch_size=256"])
    planner = Planner.from_config(cfg, H100, 16)  # 128 GPUs, 8 per NVSwitch domain
    flat = Layout(tp=1, pp=1, dp=128, ep=8, zero=3, mbs=1)
    hsdp = dataclasses.replace(flat, dp_shard=8)
    # states: dense over 8 ranks instead of 128; the experts (edp 16) over the 8 // ep = 1 replica
    # inside a group of 8 — replicated, as the trainer does
    m_flat, m_hsdp = memory_per_gpu(planner.shape, flat, 256), memory_per_gpu(planner.shape, hsdp, 256)
    dense = m_flat.detail["dense_params"]
    expert = m_flat.detail["expert_params"]
    assert m_hsdp.optimizer == pytest.approx(12 * (dense / 8 + expert / 1))
    assert m_flat.optimizer == pytest.approx(12 * (dense / 128 + expert / 16))
    places, _ = planner.places(hsdp)
    assert places["dp_cp_shard"].tier == "nvlink" and places["dp_cp_shard"].size == 8
    assert places["dp_cp_replicate"].size == 16 and places["dp_cp_replicate"].tier != "nvlink"
    assert planner.places(flat)[0]["dp_cp"].tier != "nvlink"
    # ZeRO-3's per-micro-batch all-gathers and reduce-scatters of the dense weights stay on
    # NVLink; only an all-reduce of each 1/8 shard's gradient crosses the network
    got = {(c.axis, c.op): c for c in step_collectives(planner.shape, hsdp, 256, places, H100)}
    assert set(got[("dp_cp_shard", "all_gather")].tier_bytes) == {"nvlink"}
    assert set(got[("dp_cp_shard", "reduce_scatter")].tier_bytes) == {"nvlink"}
    ar = got[("dp_cp_replicate", "all_reduce")]
    assert ar.bytes_per_call == pytest.approx(got[("dp_cp_shard", "reduce_scatter")].bytes_per_call / 8)
    assert set(ar.tier_bytes) - {"nvlink"}
    flat_ag = next(c for c in step_collectives(planner.shape, flat, 256, planner.places(flat)[0], H100)
                   if (c.axis, c.op) == ("dp_cp", "all_gather"))
    assert set(flat_ag.tier_bytes) - {"nvlink"}  # without HSDP they cross the network
    assert "hsdp8" in hsdp.short() and "parallel.dp_shard=8" in hsdp.overrides()
    assert "zero_stage 0 replicates them all" in planner.check(dataclasses.replace(hsdp, zero=0))
    assert "must divide" in planner.check(dataclasses.replace(hsdp, dp_shard=48))


def test_muon_costs_its_newton_schulz_flops_spread_over_the_stage():
    cfg = load_config("configs/demo-moe.yaml", ["model.vocab_size=8192"])
    shape = ModelShape.from_config(cfg)
    # the demo's 124 matrices: 59.2 GFLOP per step (benchmarks/bench_muon.py counts the model's
    # own parameters and finds the same)
    assert shape.layers * shape.muon_ns_flops(True) == pytest.approx(59.22357248e9)
    adamw = Planner.from_config(cfg, H100, 1)
    muon = Planner.from_config(load_config("configs/demo-moe.yaml", ["model.vocab_size=8192",
                                                                      "train.optimizer=muon"]), H100, 1)
    lay = Layout(tp=1, pp=1, dp=8, ep=2, zero=1, mbs=2)
    t_a, t_m = adamw.evaluate(lay).time, muon.evaluate(lay).time
    rate = H100.peak_tflops * 1e12 * H100.gemm_efficiency
    assert t_a.breakdown["muon"] == 0.0
    assert t_m.breakdown["muon"] >= 59.22357248e9 / 8 / rate  # 1/8 of the work per rank, plus its exchange
    assert t_m.breakdown["muon"] < 59.22357248e9 / rate  # not all of it on every rank


def test_unseen_runs_keep_a_third_of_their_families_apart(monkeypatch):
    """The runs collected after the terms were set (issue 34): a third of the families of each
    kind set apart by the stated rule (SHA-256 order), labelled so in every report."""
    import hashlib

    from moetrain.planner import published

    rows = published.UNSEEN
    assert len(rows) == 23 and len({r.key for r in rows}) == 23
    apart = {r.family for r in rows if r.split == "apart"}
    assert apart == {"fms-70b", "nemo-llama3.1-70b", "nemo-nemotron4-340b", "nemo-grok1-314b"}
    assert 0.3 <= sum(r.split == "apart" for r in rows) / len(rows) <= 0.4
    # the rule: within a kind, the families in SHA-256 order, the first UNSEEN_KINDS[kind] apart
    fms = sorted({r.family for r in rows if r.family.startswith("fms-")},
                 key=lambda f: hashlib.sha256(f.encode()).hexdigest())
    assert fms[0] == "fms-70b" and published.split_of()["fms-70b"] == "apart"
    assert published.split_of({"fsdp": 0, "nvidia-dense": 0, "nvidia-moe": 0}) == {r.family: "dev" for r in rows}
    # every row predicted once, with its split and family
    seen = []
    monkeypatch.setattr(published, "predict", lambda e: seen.append(e.key) or {"error": 0.0})
    out = published.compare_unseen()
    assert seen == [r.key for r in rows]
    assert [(r["split"], r["family"]) for r in out] == [(r.split, r.family) for r in rows]


def test_rows_set_apart_meet_the_goal_with_the_final_terms():
    """Issue 34's goal on the published runs the terms were not changed from: median |error|
    <= 10 %, max <= 20 % (first predicted at APART_REVEALED; docs/topology.md §5). A term
    change that breaks it fails here."""
    from moetrain.planner import published

    rows = published.compare_unseen()
    stats = published.split_summary(rows)
    assert stats["apart"]["rows"] == 8 and stats["dev"]["rows"] == 15
    assert stats["apart"]["median"] <= published.MEDIAN_GOAL, stats
    assert stats["apart"]["max"] <= published.TOLERANCE, stats


def test_unseen_development_rows_are_predicted():
    from moetrain.planner import published

    dev = [published.predict(e) for e in published.UNSEEN if e.split == "dev"]
    assert len(dev) == 15 and all(r["error"] is not None and r["fits"] for r in dev), dev
    # the fms clusters' network as the README states it (per node), not the reference design's
    fms = next(e for e in published.UNSEEN if e.key == "fms-llama2-7b-h100")
    assert published._planner(fms).profile.rail_gb_s == 12.5


def test_plan_takes_a_null_vocabulary_from_the_data_as_the_run_does(tiny_shards, tmp_path, capsys):
    """The demo leaves ``model.vocab_size`` null (the run takes its tokenizer's 8192); a plan that
    assumed 32000 instead counted 4× the embedding and head — most of a small model's gradient
    all-reduce and a large share of its compute — and predicted the measured step 1.7× too slow.
    With the data readable the plan uses the manifest's vocabulary (padded as the run pads it);
    without it, the assumption is named."""
    import json

    from moetrain.config import padded_vocab, save_config
    from moetrain.plan import main as plan_main
    from moetrain.planner.model import DEFAULT_VOCAB

    from conftest import tiny_config

    cfg = tiny_config(tiny_shards, tmp_path / "run")
    cfg = cfg.replace(model={"vocab_size": None})
    path = tmp_path / "c.yaml"
    save_config(cfg, path)
    layout = "tp=1,pp=1,dp=8,cp=1,ep=1,zero=0,mbs=1,ac=none"  # one 8-GPU node, global batch 8

    def plan(*sets: str) -> dict:
        args = ["--config", str(path), "--profile", "h100-superpod", "--nodes", "1", "--layout", layout,
                "--format", "json"]
        for s in sets:
            args += ["--set", s]
        assert plan_main(args) == 0
        return json.loads(capsys.readouterr().out)

    vocab = padded_vocab(257, cfg.model.vocab_multiple, 1)
    from_data, stated = plan(), plan(f"model.vocab_size={vocab}")
    assert "note" not in from_data and from_data["model_params"] == stated["model_params"]
    assert from_data["layouts"][0]["step_time_s"] == stated["layouts"][0]["step_time_s"]
    no_data = plan(f"data.path={tmp_path / 'missing'}")
    assert f"assumed {DEFAULT_VOCAB}" in no_data["note"] and "data.path" in no_data["note"]
    assert no_data["model_params"] > from_data["model_params"]
