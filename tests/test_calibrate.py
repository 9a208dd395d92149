"""``python -m moetrain.calibrate``: the fits recover known terms from times the planner's own
formulas produce, the calibrated profile then predicts what the true one does, the profile file
round-trips, and a real local job (4 gloo ranks) writes a profile the planner takes.

The dev cluster's emulated network (a known link rate) is recovered in
tests/test_dev_cluster_network.py; docs/topology.md §6 compares calibrated predictions with
measured steps."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moetrain.calibrate import write_profile
from moetrain.launch.calibrate import tier_groups
from moetrain.planner.calibration import (
    CalibrationError, GemmShape, attention_flops, calibrated_profile, collective_steps, fit_collective, fit_k0,
    fit_line, fit_rate, gemm_shapes, k_sweep_shapes, layer_config, layer_seconds_predicted, message_sizes)
from moetrain.planner.layout import Layout
from moetrain.planner.memory import MemoryAssumptions
from moetrain.planner.model import ModelShape
from moetrain.planner.search import Planner
from moetrain.planner.timing import TimingAssumptions, _Compute, gemm_pass_time, k_efficiency
from moetrain.planner.traffic import bus_factor
from moetrain.topology.cluster import ProfileError, load_profile

from conftest import run_calibrate, tiny_config

ROOT = Path(__file__).resolve().parents[1]


def _demo():
    from moetrain.config import load_config

    cfg = load_config(ROOT / "configs" / "demo-moe.yaml", ["model.vocab_size=384"])
    return cfg, ModelShape.from_config(cfg), Layout.from_config(cfg), MemoryAssumptions.for_train(cfg.train)


def test_fit_line_and_its_errors():
    slope, icpt = fit_line([1.0, 2.0, 4.0], [3.0, 5.0, 9.0])
    assert slope == pytest.approx(2.0) and icpt == pytest.approx(1.0)
    with pytest.raises(CalibrationError, match="two or more points"):
        fit_line([1.0], [1.0])
    with pytest.raises(CalibrationError, match="distinct"):
        fit_line([2.0, 2.0], [1.0, 3.0])


@pytest.mark.parametrize("op,n", [("all_reduce", 2), ("all_gather", 4), ("reduce_scatter", 8), ("all_to_all", 4),
                                  ("p2p", 2)])
def test_fit_collective_recovers_bandwidth_and_latency(op, n):
    beta, alpha = 3.7e9, 25e-6
    sizes = [1 << s for s in range(16, 27)]
    noise = [1.0 + 0.02 * math.sin(7 * i) for i in range(len(sizes))]  # ±2 %, fixed
    secs = [(collective_steps(op, n) * alpha + bus_factor(op, n) * s / beta) * e for s, e in zip(sizes, noise)]
    fit = fit_collective(op, n, sizes, secs)
    assert fit["bus_gb_s"] == pytest.approx(3.7, rel=0.03)
    assert fit["latency_us"] == pytest.approx(25.0, rel=0.1)


def test_fit_collective_without_a_visible_bandwidth_uses_the_largest_size():
    # times that do not grow with size (latency only): the largest size's bytes over its time
    fit = fit_collective("all_reduce", 2, [1 << 16, 1 << 17], [1e-3, 1e-3])
    assert fit["bus_gb_s"] == pytest.approx((1 << 17) / 1e-3 / 1e9) and fit["latency_us"] == 0.0
    with pytest.raises(CalibrationError, match="2 sizes and 1 times"):
        fit_collective("all_reduce", 2, [1, 2], [1.0])


def test_fit_k0_recovers_the_short_k_loss():
    a, k0 = 2e-6, 300.0
    ks = [g.k for g in k_sweep_shapes(gpu=True)]
    fitted, slope, resid = fit_k0(ks, [a * (k + k0) for k in ks])
    assert fitted == pytest.approx(k0) and slope == pytest.approx(a) and resid < 1e-9
    with pytest.raises(CalibrationError, match="do not grow with K"):
        fit_k0(ks, [1.0] * len(ks))


def test_gemm_shapes_are_the_planners():
    cfg, shape, lay, mem = _demo()
    prof = load_profile("cpu-local")
    shapes = gemm_shapes(shape, lay, prof, mem)
    passes = {g.pass_ for g in shapes}
    assert passes == {"fwd", "dgrad", "wgrad"} and len(shapes) % 3 == 0
    # the routed experts: one grouped GEMM of E/ep experts of width expert_ffn
    experts = [g for g in shapes if g.count == shape.num_experts // lay.ep and g.pass_ == "fwd"]
    assert {g.n for g in experts} == {2 * shape.expert_ffn, shape.hidden}
    # the head [T × h]·[h × vocab] and its weight gradient [h × T]·[T × vocab]
    tokens = lay.mbs * shape.seq_len
    assert GemmShape(tokens, shape.vocab, shape.hidden) in shapes
    assert GemmShape(shape.hidden, shape.vocab, tokens, pass_="wgrad") in shapes


def test_fit_rate_recovers_a_known_efficiency():
    cfg, shape, lay, mem = _demo()
    prof = load_profile("cpu-local")
    ta = TimingAssumptions()
    shapes = gemm_shapes(shape, lay, prof, mem)
    peak, hbm = 1e11, 2e10
    secs = [gemm_pass_time(g.m, g.n, g.k, g.count, peak * 0.37, hbm, prof.sm_count, ta.tile, ta.gemm_k0, 4, 4)
            for g in shapes]
    e, floor = fit_rate(shapes, secs, peak, hbm, prof.sm_count, ta, 4, 4)
    assert e == pytest.approx(0.37, rel=1e-6) and floor is None
    # A million times faster than the operands can move at hbm: recorded, fitted from the compute
    # alone (the time is then proportional to 1 / E), with the floor it fell under.
    fast = [s * 1e-6 for s in secs]
    e, floor = fit_rate(shapes, fast, peak, hbm, prof.sm_count, ta, 4, 4)
    compute = sum(gemm_pass_time(g.m, g.n, g.k, g.count, peak, math.inf, prof.sm_count, ta.tile, ta.gemm_k0, 4, 4)
                  for g in shapes)
    assert e == pytest.approx(compute / sum(fast), rel=1e-12)
    assert floor > sum(fast)
    with pytest.raises(CalibrationError, match="add up to 0"):
        fit_rate(shapes, [0.0] * len(shapes), peak, hbm, prof.sm_count, ta, 4, 4)


def _synthetic(true, shape, lay, mem, ta):
    """What a cluster described by ``true`` (its ``collective_gb_s`` and latencies) would measure,
    by the planner's own formulas."""
    k0 = ta.gemm_k0 if true.gemm_k0 is None else true.gemm_k0
    ta_true = dataclasses.replace(ta, gemm_k0=k0)
    rate, hbm = true.peak_tflops * 1e12 * true.gemm_efficiency, true.hbm_bandwidth()
    gemm = [dict(m=g.m, n=g.n, k=g.k, count=g.count, fp8=False, pass_=g.pass_,
                 seconds=gemm_pass_time(g.m, g.n, g.k, g.count, rate, hbm, true.sm_count, ta.tile, k0,
                                        mem.act_bytes, mem.act_bytes))
            for g in gemm_shapes(shape, lay, true, mem, ta_true)]
    for r in gemm:
        r["pass"] = r.pop("pass_")
    ks = k_sweep_shapes(gpu=False)
    k_sweep = [dict(m=g.m, n=g.n, k=g.k, seconds=2.0 * g.m * g.n * g.k / (rate * k_efficiency(g.k, k0)))
               for g in ks]
    att = attention_flops(shape, lay) * (1 + ta.attention_backward) / (true.peak_tflops * 1e12 *
                                                                        true.attention_efficiency)
    sizes = message_sizes(shape, lay, mem.act_bytes)
    colls = {}
    for tier, ops in true.collective_gb_s.items():
        colls[tier] = {"n": 2}
        for op, bw in ops.items():
            lat = getattr(true, f"{tier}_latency_us") * 1e-6
            colls[tier][op] = {"sizes": sizes, "seconds": [collective_steps(op, 2) * lat + bus_factor(op, 2) * s /
                                                           (bw * 1e9) for s in sizes]}
    elem = 3 * _Compute(shape, lay, true, ta_true, mem.act_bytes).elementwise_bytes(shape.is_moe) / (
        hbm * true.elementwise_efficiency)
    return {"hbm_copy_gb_s": true.hbm_bandwidth() / 1e9, "gemm": gemm, "k_sweep": k_sweep,
            "attention": {"seconds": att}, "elementwise": {"seconds": elem}, "collectives": colls,
            "meta": {"world_size": 4}}


def test_calibrated_profile_recovers_the_cluster_and_its_predictions():
    """A base profile wrong in every measured term, calibrated on what a known cluster measures,
    comes out as that cluster, and the planner's step on it equals the step on the truth (and
    differs from the base's: the check can fail)."""
    cfg, shape, lay, mem = _demo()
    base = load_profile("dev-emulated")
    true = dataclasses.replace(
        base, peak_tflops=0.2, gemm_efficiency=0.31, attention_efficiency=0.12, hbm_gb_s=20, hbm_efficiency=0.45,
        elementwise_efficiency=0.3, layer_efficiency=0.7, gemm_k0=150.0, nvlink_latency_us=300.0,
        rail_latency_us=900.0,
        collective_gb_s={"nvlink": {"all_reduce": 0.8, "all_gather": 0.6, "reduce_scatter": 0.35, "all_to_all": 0.7,
                                    "p2p": 0.9},
                         "rail": {"all_reduce": 0.0031, "all_gather": 0.0024, "reduce_scatter": 0.0015,
                                  "all_to_all": 0.0022, "p2p": 0.002}})
    ta = TimingAssumptions()
    one = ModelShape.from_config(layer_config(cfg))
    measured = _synthetic(true, shape, lay, mem, ta)
    measured["layer"] = {"seconds": layer_seconds_predicted(one, lay.mbs, true, mem, ta)}
    prof, report = calibrated_profile(base, measured, shape, lay, mem, ta, layer_shape=one)
    assert prof.gemm_k0 == pytest.approx(150.0, abs=0.1)
    assert prof.peak_tflops * prof.gemm_efficiency == pytest.approx(0.2 * 0.31, rel=1e-3)
    assert prof.peak_tflops * prof.attention_efficiency == pytest.approx(0.2 * 0.12, rel=1e-3)
    assert prof.hbm_bandwidth() == pytest.approx(true.hbm_bandwidth(), rel=1e-6)
    assert prof.elementwise_efficiency == pytest.approx(0.3, rel=1e-6)
    assert prof.layer_efficiency == pytest.approx(0.7, rel=2e-3)  # through the fitted terms (k0 to 0.1)
    for tier, ops in true.collective_gb_s.items():
        for op, bw in ops.items():
            assert prof.collective_gb_s[tier][op] == pytest.approx(bw, rel=1e-3), (tier, op)
    assert prof.nvlink_latency_us == pytest.approx(300.0, rel=1e-3)
    assert prof.rail_latency_us == pytest.approx(900.0, rel=1e-3)
    assert prof.calibration["base_profile"] == "dev-emulated" and "collective_gb_s" in prof.calibration["terms"]
    assert set(report) >= {"hbm", "gemm", "k_sweep", "attention", "elementwise", "layer", "collectives"}

    def step(p):
        return Planner(shape, p, 2, cfg.train.global_batch_size, gpus_per_node=2, mem=mem,
                       timing=ta).evaluate(lay).time.step

    assert step(prof) == pytest.approx(step(true), rel=1e-3)
    assert abs(step(base) / step(true) - 1) > 0.2


def test_gemms_at_the_memory_floor_are_recorded_and_said_to_be():
    """GEMMs that ran faster than their operands move at the measured copy rate (a small model in
    cache, a copy measurement slowed by noise) give a profile, fitted from their compute alone,
    and the report and the summary say that they hit the floor."""
    from moetrain.calibrate import summary_lines

    cfg, shape, lay, mem = _demo()
    base = load_profile("cpu-local")
    measured = {**_synthetic(base, shape, lay, mem, TimingAssumptions()), "collectives": {}}
    for r in measured["gemm"]:
        r["seconds"] *= 1e-3
    prof, report = calibrated_profile(base, measured, shape, lay, mem)
    floor = report["gemm"]["at_memory_floor"]
    assert floor["measured_s"] < floor["floor_s"] and floor["copy_gb_s"] == measured["hbm_copy_gb_s"]
    assert prof.peak_tflops * prof.gemm_efficiency == pytest.approx(report["gemm"]["fitted_rate_tflops"], rel=1e-9)
    assert any("at or below the memory-bound floor" in line for line in summary_lines(report, prof))
    clean, report = calibrated_profile(base, {**measured, "gemm": _synthetic(base, shape, lay, mem,
                                                                             TimingAssumptions())["gemm"]},
                                       shape, lay, mem)
    assert "at_memory_floor" not in report["gemm"]
    assert not any("memory-bound floor" in line for line in summary_lines(report, clean))


def test_a_job_with_fewer_tasks_per_node_gives_a_profile_of_such_nodes():
    """A calibration job of 1 task per node on a base profile of 2 GPUs per node (dp2 × ep2 on 2
    nodes × 1 task of the dev cluster) measured what one task gets with the node to itself: the
    profile describes nodes of 1, so a plan of that layout counts 2 GPUs on 2 nodes (with the
    base's 2 it counted 4 and found no layout). A job that filled the nodes changes nothing."""
    from moetrain.planner.search import Planner

    cfg, shape, lay, mem = _demo()
    base = load_profile("dev-emulated")
    assert base.gpus_per_node == 2
    measured = {**_synthetic(base, shape, lay, mem, TimingAssumptions()), "collectives": {}}
    one, report = calibrated_profile(base, {**measured, "meta": {"tasks_per_node": 1}}, shape, lay, mem)
    assert (one.gpus_per_node, one.nvswitch_domain_gpus, one.rails_per_node) == (1, 1, 1)
    assert report["tasks_per_node"] == {"job": 1, "base_gpus_per_node": 2}
    assert Planner(shape, one, 2, cfg.train.global_batch_size).world == 2
    full, report = calibrated_profile(base, {**measured, "meta": {"tasks_per_node": 2}}, shape, lay, mem)
    assert (full.gpus_per_node, full.nvswitch_domain_gpus) == (2, 2) and "tasks_per_node" not in report


def test_a_measured_rate_above_the_base_peak_raises_the_peak():
    cfg, shape, lay, mem = _demo()
    base = load_profile("cpu-local")
    true = dataclasses.replace(base, peak_tflops=5.0, gemm_efficiency=0.8, hbm_gb_s=400.0)
    prof, _ = calibrated_profile(base, {**_synthetic(true, shape, lay, mem, TimingAssumptions()), "collectives": {}},
                                 shape, lay, mem)
    assert prof.gemm_efficiency == 1.0 and prof.peak_tflops == pytest.approx(4.0, rel=1e-3)
    assert prof.hbm_efficiency == 1.0 and prof.hbm_gb_s == pytest.approx(400.0)


def test_profile_file_round_trips(tmp_path):
    cfg, shape, lay, mem = _demo()
    base = load_profile("dev-emulated")
    true = dataclasses.replace(base, collective_gb_s={"rail": {"all_to_all": 0.007}}, gemm_k0=100.0)
    prof, report = calibrated_profile(base, _synthetic(true, shape, lay, mem, TimingAssumptions()), shape, lay, mem,
                                      name="site-a")
    out = tmp_path / "p.yaml"
    write_profile(prof, report, out, "python -m moetrain.calibrate --config X")
    back = load_profile(out)
    assert back.name == "site-a" and back.gemm_k0 == pytest.approx(prof.gemm_k0)
    assert back.collective_gb_s == {"rail": {"all_to_all": pytest.approx(0.007, rel=1e-3)}}
    assert back.bandwidth("rail", "all_to_all") == pytest.approx(0.007e9, rel=1e-3)
    assert back.bandwidth("rail", "all_reduce") == pytest.approx(base.bandwidth("rail"))  # not measured
    assert back.calibration["report"]["gemm"]["shapes"] == len(gemm_shapes(shape, lay, base, mem))
    assert out.read_text().startswith("# Written by `python -m moetrain.calibrate --config X`")


@pytest.mark.parametrize("bad,words", [
    ({"collective_gb_s": {"infiniband": {"all_reduce": 1.0}}}, "collective_gb_s.infiniband"),
    ({"collective_gb_s": {"rail": {"allreduce": 1.0}}}, "collective_gb_s.rail.allreduce"),
    ({"collective_gb_s": {"rail": {"all_reduce": -1}}}, "positive bus bandwidth"),
    ({"calibration": [1, 2]}, "calibration: expected a mapping"),
])
def test_bad_measured_terms_are_refused(tmp_path, bad, words):
    raw = yaml.safe_load((ROOT / "slurm" / "profiles" / "cpu-local.yaml").read_text())
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump({**raw, **bad}))
    with pytest.raises(ProfileError, match=words.replace(".", r"\.")):
        load_profile(p)


def test_tier_groups():
    a100 = load_profile("a100-superpod")  # 8 GPUs a node and a domain, 20 nodes a rail group
    two = tier_groups(["a"] * 8 + ["b"] * 8, a100)
    assert two["nvlink"] == [list(range(8)), list(range(8, 16))]
    assert two["rail"] == [[i, i + 8] for i in range(8)] and "spine" not in two
    small = dataclasses.replace(a100, nodes_per_rail_group=1)   # every node its own rail group
    hosts = [h for h in "abcd" for _ in range(2)]
    g = tier_groups(hosts, dataclasses.replace(small, gpus_per_node=2, nvswitch_domain_gpus=2))
    assert "rail" not in g and g["spine"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    nvl = dataclasses.replace(a100, gpus_per_node=2, nvswitch_domain_gpus=4, nodes_per_rail_group=2)
    g = tier_groups(hosts, nvl)   # 2 nodes a domain, 2 nodes a rail group: domains (ab), (cd)
    assert g["nvlink"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and "rail" not in g
    assert g["spine"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert tier_groups(["a", "a"], a100) == {"nvlink": [[0, 1]]}
    assert tier_groups(["a"], a100) == {}


def test_message_sizes_span_the_layouts_buffers():
    cfg, shape, lay, mem = _demo()
    sizes = message_sizes(shape, lay, mem.act_bytes)
    assert sizes[0] == 1 << 16 and all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert sizes[-1] >= 4 << 20
    assert message_sizes(shape, lay, mem.act_bytes, hi=1 << 20)[-1] == 1 << 20


@pytest.mark.slow
def test_calibrate_a_local_job(tmp_path, tiny_shards):
    """A real 4-rank local job: a profile the planner takes, its intra-node collectives measured
    for every op, the job's facts recorded; then a config error exits 2 before anything runs."""
    cfg = tiny_config(tiny_shards, tmp_path / "run", parallel={"dp": 4, "ep": 2}, launch={"cluster": "local"})
    res, out = run_calibrate(cfg, tmp_path, "--seconds", "0.05", "--collective-budget", "0.5")
    path = tmp_path / "c.yaml"
    assert res.returncode == 0, res.stdout + res.stderr
    assert "calibrate: nvlink all_to_all over 1 group(s) of 4" in res.stdout, res.stdout
    prof = load_profile(out)
    assert set(prof.collective_gb_s) == {"nvlink"}
    assert set(prof.collective_gb_s["nvlink"]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    meta = prof.calibration
    assert meta["world_size"] == 4 and meta["backend"] == "gloo" and meta["base_profile"] == "cpu-local"
    assert prof.gemm_efficiency > 0 and prof.attention_efficiency > 0 and prof.gemm_k0 is not None
    plan = subprocess.run([sys.executable, "-m", "moetrain.plan", "--config", str(path), "--nodes", "1",
                           "--profile", str(out), "--format", "json", "--top", "1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert json.loads(plan.stdout)
    bad, _ = run_calibrate(cfg, tmp_path, "--set", "parallel.ep=3", timeout=120)
    assert bad.returncode == 2 and "config error:" in bad.stderr and "parallel.ep" in bad.stderr, bad.stderr


@pytest.mark.slow
def test_calibrate_under_torchrun(tmp_path, tiny_shards):
    """``torchrun -m moetrain.calibrate``: the processes torchrun started are the measuring job's
    ranks (no job submitted), rank 0 writes the profile, with the world torchrun gave."""
    cfg = tiny_config(tiny_shards, tmp_path / "run", parallel={"dp": 2, "ep": 2}, launch={"cluster": "local"})
    res, out = run_calibrate(cfg, tmp_path, "--seconds", "0.05", "--collective-budget", "0.3",
                             launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nproc-per-node=2"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "calibrate: job" not in res.stdout and not (tmp_path / "run" / "calibrate").exists()
    prof = load_profile(out)
    assert prof.calibration["world_size"] == 2 and prof.gemm_efficiency > 0
    assert set(prof.collective_gb_s["nvlink"]) >= {"all_reduce", "all_to_all"}


def test_an_fp8_config_on_a_device_without_fp8_is_calibrated_in_16_bits():
    """train.precision: fp8 on a device with no FP8 tensor cores (the CPU): the GEMMs are listed
    (not refused for the profile's missing FP8 peak) and fitted as the 16-bit GEMMs they ran as."""
    cfg, shape, lay, mem = _demo()
    base = load_profile("cpu-local")
    measured = _synthetic(base, shape, lay, mem, TimingAssumptions())
    fp8 = dataclasses.replace(shape, fp8_gemms=True)
    assert any(g.fp8 for g in gemm_shapes(fp8, lay, base, mem))
    one = dataclasses.replace(ModelShape.from_config(layer_config(cfg)), fp8_gemms=True)
    measured["layer"] = {"seconds": layer_seconds_predicted(dataclasses.replace(one, fp8_gemms=False), lay.mbs,
                                                            base, mem)}
    prof, report = calibrated_profile(base, measured, fp8, lay, mem, layer_shape=one)
    assert "fp8" in report and prof.fp8_peak_tflops is None
    assert prof.layer_efficiency == pytest.approx(1.0, rel=2e-3)
