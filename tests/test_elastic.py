"""Elastic training (``launch.elastic``) without SLURM: the re-plan's choices, the config and
preflight errors, the pieces of the node-failure and grow-back paths, and one run that loses a
"node" mid-way and goes on with a re-planned layout and the same losses (the SLURM dev-cluster
version, a real node failure and grow-back, is in tests/test_slurm_elastic.py)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from moetrain.config import ConfigError, load_layers, to_dict
from moetrain.launch.elastic import GrowWatcher, failed_nodes, missing_nodes_can_start, start_attempt
from moetrain.launch.preflight import check_elastic
from moetrain.planner.elastic import ElasticError, replan
from moetrain.planner.layout import Layout
from moetrain.planner.memory import GIB, MemoryAssumptions, memory_per_gpu
from moetrain.planner.model import ModelShape
from moetrain.planner.timing import TimingAssumptions
from moetrain.topology import load_profile
from moetrain.train.records import Diagnosis, read_events
from moetrain.train.trainer import Trainer

from conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]
from multiproc import run_distributed

STEPS, EVERY = 20, 10


def elastic_tiny(shards: Path, run_dir: Path, nodes: int = 2, tasks_per_node: int = 2, **elastic):
    return tiny_config(shards, run_dir, run={"name": "elastic"}, parallel={"dp": 4, "ep": 2},
                       train={"steps": STEPS}, checkpoint={"every": EVERY, "keep": 3, "resume": True},
                       launch={"cluster": "slurm", "nodes": nodes, "tasks_per_node": tasks_per_node,
                               "elastic": {"min_nodes": 1, **elastic}})


def mixtral(*sets: str):
    cfg, _ = load_layers(["configs/mixtral-8x7b.yaml"], ["launch.cluster=slurm", *sets])
    return cfg


# ---------------------------------------------------------------------------------------------
# The re-plan
# ---------------------------------------------------------------------------------------------


def test_replan_keeps_tp_pp_ep_and_changes_dp_and_accumulation(tmp_path):
    cfg = elastic_tiny(tmp_path, tmp_path / "run")
    same, none = replan(cfg, 2, 2)
    assert same is cfg and none is None, "the configured size is not re-planned"
    new, plan = replan(cfg, 1, 2)
    p = new.parallel
    assert (p.dp, p.ep, p.tp, p.pp) == (2, 2, 1, 1)
    assert (new.launch.nodes, new.world_size, new.train.global_batch_size) == (1, 2, cfg.train.global_batch_size)
    assert (cfg.grad_accum_steps, new.grad_accum_steps) == (1, 2)
    assert plan.message().startswith("re-planned: 2 nodes → 1 node: dp4×ep2 → dp2×ep2, accumulation 1 → 2, "
                                     "predicted "), plan.message()
    assert "tp, pp, ep kept" in plan.message()


def test_replan_never_chooses_a_layout_that_does_not_fit():
    """Mixtral 8x7B on 8 H100 nodes: on every smaller count the chosen layout fits by the memory
    model computed here independently; where the configured layout with a smaller dp does not fit
    (2 nodes) something else changes; on 1 node nothing fits and the error says what it needs."""
    cfg = mixtral("launch.elastic={min_nodes: 1}")
    prof = load_profile("h100-superpod")
    capacity = prof.memory_gib - prof.reserved_gib
    shape, mem = ModelShape.from_config(cfg), MemoryAssumptions.for_train(cfg.train)
    imbalance = TimingAssumptions().moe_imbalance  # the planner's allowance for uneven expert loads
    kept_fits = {}
    for nodes in range(2, 8):
        new, plan = replan(cfg, nodes, 8)
        lay = Layout.from_config(new)
        gib = memory_per_gpu(shape, lay, new.train.global_batch_size, mem, imbalance).total / GIB
        assert gib <= capacity, f"{nodes} nodes: chose {lay.short()} needing {gib:.1f} GiB > {capacity:.1f}"
        assert abs(gib - plan.memory_gib) < 1e-6
        assert new.world_size <= nodes * 8 and new.train.global_batch_size == 1024
        kept = Layout.from_config(cfg)
        kept = type(kept)(**{**kept.__dict__, "dp": new.world_size // (kept.tp * kept.pp * kept.cp)})
        kept_fits[plan.nodes_after] = memory_per_gpu(shape, kept, 1024, mem, imbalance).total / GIB <= capacity
        if kept_fits[plan.nodes_after]:
            assert (lay.tp, lay.pp, lay.ep, lay.zero, lay.mbs, lay.ac) == (kept.tp, kept.pp, kept.ep, kept.zero,
                                                                           kept.mbs, kept.ac), lay.short()
        else:
            assert lay != kept and (lay.tp, lay.pp, lay.ep) == (kept.tp, kept.pp, kept.ep), lay.short()
    assert kept_fits[4] and not kept_fits[2], kept_fits  # both branches were taken
    with pytest.raises(ElasticError, match=r"on 1 node\(s\) × 8 ranks: the smallest candidate, .* needs [\d.]+ GiB "
                                           r"per GPU, h100-superpod has 74.1"):
        replan(cfg, 1, 8)


def test_a_node_count_without_a_layout_trains_on_fewer_of_its_nodes():
    """7 of 8 nodes: 1024 sequences split over no dp that 7 nodes give, so 4 of them train."""
    cfg = mixtral("launch.elastic={min_nodes: 2}")
    new, plan = replan(cfg, 7, 8)
    assert (plan.nodes_had, plan.nodes_after, new.world_size, new.launch.nodes) == (7, 4, 32, 4)
    assert "8 nodes → 7 nodes (training on 4: no layout fits 7)" in plan.message()


def test_start_attempt_is_a_no_op_for_the_full_size_and_records_the_replan(tmp_path):
    cfg = elastic_tiny(tmp_path, tmp_path / "run")
    (tmp_path / "run").mkdir()
    assert start_attempt(cfg, 4, 2, 0) == (cfg, None)
    new, plan = start_attempt(cfg, 2, 2, 0)
    assert new.world_size == 2 and plan is not None
    (ev,) = read_events(tmp_path / "run")
    assert ev["event"] == "replanned" and ev["message"] == plan.message() and "re-plan" in ev["message"]


# ---------------------------------------------------------------------------------------------
# Config, preflight, the batch script
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("launch,field", [
    ({"cluster": "local", "nodes": 1, "elastic": {"min_nodes": 1}}, "launch.elastic"),
    ({"cluster": "slurm", "nodes": 2, "elastic": {"min_nodes": 3}}, "launch.elastic.min_nodes = 3"),
    ({"cluster": "slurm", "nodes": 2, "elastic": {"min_nodes": 0}}, "launch.elastic.min_nodes = 0"),
    ({"cluster": "slurm", "nodes": 2, "elastic": {"grow_check_s": 0}}, "launch.elastic.grow_check_s"),
])
def test_config_errors_name_the_field(tmp_path, launch, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        tiny_config(tmp_path, tmp_path / "run", parallel={"dp": 4, "ep": 2},
                    checkpoint={"every": 5, "resume": True}, launch=launch)


def test_an_elastic_run_inside_an_allocation_is_refused_in_one_line(tiny_shards, tmp_path):
    # inside salloc the nodes are fixed and a lost node ends the steps: the refusal says so, and
    # what to do, before anything starts
    config = tmp_path / "elastic.yaml"
    config.write_text(yaml.safe_dump(to_dict(elastic_tiny(tiny_shards, tmp_path / "run")), sort_keys=False))
    env = {**os.environ, "SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    res = subprocess.run([sys.executable, "-m", "moetrain.submit", "--config", str(config), "--dry-run"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: launch.elastic = {'min_nodes': 1}: submit runs "
                                                   "inside SLURM allocation 77"), res.stderr
    assert "launch.allocation=new" in lines[0]


def test_elastic_needs_checkpoints(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint\.every = 0: an elastic run goes on from its latest checkpoint"):
        tiny_config(tmp_path, tmp_path / "run", parallel={"dp": 4, "ep": 2},
                    launch={"cluster": "slurm", "nodes": 2, "elastic": {"min_nodes": 1}})


def test_preflight_refuses_a_min_nodes_the_model_does_not_fit_on():
    with pytest.raises(ConfigError, match=r"launch\.elastic\.min_nodes = 1: the job may start on 1 node\(s\), where "
                                          r"no layout .* fits .* Fix: use min_nodes: 2"):
        check_elastic(mixtral("launch.elastic={min_nodes: 1}"))
    check_elastic(mixtral("launch.elastic={min_nodes: 2}"))  # every count from 2 to 7 has one


def test_batch_script_asks_for_a_node_range(tmp_path):
    from moetrain.launch.slurm import render_batch_script

    script = render_batch_script(elastic_tiny(tmp_path, tmp_path / "run"), tmp_path / "logs")
    assert "#SBATCH --nodes=1-2\n" in script and "#SBATCH --ntasks-per-node=2\n" in script, script
    plain = tiny_config(tmp_path, tmp_path / "run", parallel={"dp": 4, "ep": 2},
                        launch={"cluster": "slurm", "nodes": 2})
    assert "#SBATCH --nodes=2\n" in render_batch_script(plain, tmp_path / "logs")


# ---------------------------------------------------------------------------------------------
# Node failure and grow-back pieces
# ---------------------------------------------------------------------------------------------


def _beats(run_dir: Path, hosts: dict[int, str], attempt: int = 3) -> None:
    d = run_dir / "heartbeats"
    d.mkdir(parents=True)
    for rank, host in hosts.items():
        (d / f"rank{rank:05d}.json").write_text(json.dumps({"rank": rank, "host": host, "attempt": attempt,
                                                             "time": time.time(), "pid": 1, "step": 4}))


def test_failed_nodes_are_those_whose_every_rank_died(tmp_path):
    _beats(tmp_path, {0: "n1", 1: "n1", 2: "n2", 3: "n2"})
    assert failed_nodes(tmp_path, Diagnosis("x", True, dead=[2, 3])) == ["n2"]
    # one process of n2 killed, its neighbour recorded the lost connection: a healthy node
    assert failed_nodes(tmp_path, Diagnosis("x", True, dead=[3])) == []
    assert failed_nodes(tmp_path, Diagnosis("x", True, dead=[1, 2, 3])) == ["n2"]


def test_grow_watcher_stops_the_run_once_slurm_can_start_the_missing_nodes(tmp_path):
    cfg = elastic_tiny(tmp_path, tmp_path / "run", grow_check_s=0.05)
    answers = iter([(False, "later"), (False, "later"), (True, "now")])
    asked, grown = [], []

    def check(c, have, exclude):
        asked.append((have, exclude))
        return next(answers)

    w = GrowWatcher(cfg, ["n1"], lambda: ["n7"], grown.append, check=check).start()
    deadline = time.time() + 10
    while not grown and time.time() < deadline:
        time.sleep(0.02)
    w.stop()
    assert grown == ["now"] and asked == [(["n1"], ["n7"])] * 3


def test_missing_nodes_can_start_reads_sbatch_test_only(tmp_path, monkeypatch):
    """A stand-in ``sbatch`` answers as SLURM does (on stderr); the request names the missing
    count and keeps the job's own and the excluded nodes out."""
    cfg = elastic_tiny(tmp_path, tmp_path / "run")
    when = {"at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\necho \"sbatch: Job 9 to start at $WHEN using 2 "
                    "processors on nodes n2 in partition low\" >&2\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("WHEN", when["at"])
    ok, line = missing_nodes_can_start(cfg, ["n1"], ["n9"])
    assert ok and "to start at" in line
    args = (tmp_path / "args").read_text()
    assert "--test-only --nodes=1 --ntasks-per-node=2" in args and "--exclude=n1,n9" in args, args
    monkeypatch.setenv("WHEN", time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 3600)))
    assert missing_nodes_can_start(cfg, ["n1"], [])[0] is False, "an hour away is not now"
    assert missing_nodes_can_start(cfg, ["n1", "n2"], [])[0] is False, "nothing missing"


# ---------------------------------------------------------------------------------------------
# A run that loses a node and goes on, re-planned, with the same losses
# ---------------------------------------------------------------------------------------------


def _uninterrupted(rank: int, world: int, shards: str, run_dir: str) -> str:
    return Trainer(elastic_tiny(Path(shards), Path(run_dir), nodes=4, tasks_per_node=1), job_id="ref").run()


def _until_step(rank: int, world: int, shards: str, run_dir: str, stop_at: int) -> str:
    trainer = Trainer(elastic_tiny(Path(shards), Path(run_dir), nodes=4, tasks_per_node=1), job_id="job")

    def before(step: int) -> None:
        if step == stop_at:
            trainer.stop_flag.set("node lost")
    trainer.before_step = before
    return trainer.run()


def _elastic_attempt(rank: int, world: int, shards: str, run_dir: str) -> str:
    from moetrain.launch.job import RankEnv, run_rank

    cfg = elastic_tiny(Path(shards), Path(run_dir), nodes=4, tasks_per_node=1)
    env = RankEnv(rank, world, 0, 1, "job", f"{run_dir}/rank{rank}.log", requeue=False, launcher="test")
    return run_rank(cfg, env, restart=1)


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_losing_a_node_replans_and_keeps_the_losses(tiny_shards, tmp_path):
    """4 nodes × 1 rank (dp4 × ep2) for 10 steps; the next attempt gets 3 nodes: dp 3 divides
    neither the global batch nor ep's groups, so it trains on 2 of them (dp2 × ep2, twice the
    micro-batches), the third rank sits out; every step's loss equals the uninterrupted 4-rank
    run's within 1e-5 relative (fp32; the sums are only reordered)."""
    assert run_distributed(_uninterrupted, 4, str(tiny_shards), str(tmp_path / "ref")) == ["done"] * 4
    reference = _losses(tmp_path / "ref")
    run_dir = tmp_path / "run"
    assert run_distributed(_until_step, 4, str(tiny_shards), str(run_dir), EVERY) == ["stopped"] * 4
    assert run_distributed(_elastic_attempt, 3, str(tiny_shards), str(run_dir), init=False) == \
        ["done", "done", "idle"]
    got = _losses(run_dir)
    assert [s for s, _ in got] == list(range(1, STEPS + 1)), got
    for (step, a), (_, b) in zip(got, reference):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} re-planned vs {b} uninterrupted"
    ev = read_events(run_dir)
    (re_,) = [e for e in ev if e["event"] == "replanned"]
    assert re_["message"].startswith("re-planned: 4 nodes → 3 nodes (training on 2: no layout fits 3): dp4×ep2 → "
                                     "dp2×ep2, accumulation 1 → 2"), re_["message"]
    (rec,) = [e for e in ev if e["event"] == "recovered"]
    assert rec["step"] == EVERY + 1 and rec["since"] == "stop (node lost)" and rec["world_size"] == 2
    assert [e["event"] for e in ev if e["event"] in ("resumed", "started")][-2:] == ["resumed", "started"]


@pytest.mark.parametrize("too_few", ["stop", "wait"])
def test_too_few_nodes_stops_or_requeues_for_a_count_that_fits(tmp_path, monkeypatch, too_few):
    """An attempt on which no layout fits (here: the re-plan made to fail): ``stop`` raises the
    reason; ``wait`` has rank 0 requeue the job asking for the fewest nodes that have a layout
    (``NumNodes=2-2 NumTasks=4``) and waits to be ended with the attempt."""
    import moetrain.launch.elastic as elastic
    import moetrain.launch.job as job
    import moetrain.launch.lifecycle as lifecycle
    from moetrain.launch.job import RankEnv, _elastic_start

    cfg = elastic_tiny(tmp_path, tmp_path / "run", too_few=too_few)
    (tmp_path / "run").mkdir()

    def no_fit(*args):
        raise ElasticError("no layout of the model fits on 1 node(s) × 2 ranks: (made up)")

    asked = []
    monkeypatch.setattr(elastic, "start_attempt", no_fit)
    monkeypatch.setattr(lifecycle, "requeue_slurm_job", lambda **kw: asked.append(kw) or True)
    monkeypatch.setattr(job, "end_with_attempt", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    env = RankEnv(0, 2, 0, 2, "7", "log", requeue=True, launcher="test")
    if too_few == "stop":
        with pytest.raises(ElasticError, match="made up"):
            _elastic_start(cfg, env, 0)
        assert asked == []
        return
    with pytest.raises(SystemExit):
        _elastic_start(cfg, env, 0)
    assert asked == [{"nodes": (2, 2, 2)}]
    (ev,) = read_events(tmp_path / "run")
    assert ev["event"] == "requeue" and ev["nodes"] == "2-2" and "too few nodes" in ev["cause"], ev
