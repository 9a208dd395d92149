"""Elastic training on the real SLURM dev cluster (`slurm/dev-cluster up`), driven as a user
drives it: ``python -m moetrain.submit --config <yaml>`` with ``launch.elastic: {min_nodes: 1}``.

The tiny MoE at dp 4 × ep 2 on 2 nodes × 2 tasks, 40 steps, a checkpoint every 10. Node n2 fails
mid-run (its slurmd and its two tasks SIGKILLed; the node stays down): the surviving rank that
requeues the job excludes n2, the next attempt starts on n1 alone and re-plans (dp 2 × ep 2, 2
micro-batches per step); once n2 is back, the run stops at a step, requeues for 2 nodes and
finishes on both. Every step's loss equals the uninterrupted 4-rank run's within 1e-5 relative.
About 2 minutes on 2 shared cores.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from moetrain.config import to_dict
from moetrain.train.records import read_events
from moetrain.train.trainer import Trainer

from conftest import require_slurm_cluster, tiny_config
from multiproc import run_distributed

pytestmark = pytest.mark.slurm

require_slurm_cluster()

from test_slurm_lifecycle import (  # noqa: E402 - after the module-level skip
    STATE, _task_pids, finish, home, instances, job_id_of, jobs, logs, metrics, restore_nodes, submit,
    wait_for, wait_steps)

__all__ = ["home", "jobs"]  # the fixtures, imported for this module's tests

STEPS, EVERY = 40, 10


def elastic_config(shards: Path, run_dir: Path, **launch) -> dict:
    return to_dict(tiny_config(shards, run_dir, run={"name": "elastic"}, parallel={"dp": 4, "ep": 2},
                               train={"steps": STEPS}, checkpoint={"every": EVERY, "keep": 2, "resume": True},
                               launch={"cluster": "slurm", "nodes": 2, "time_min": 10, "max_restarts": 3,
                                       **launch}))


def _reference(rank: int, world: int, shards: str, run_dir: str) -> str:
    cfg = tiny_config(Path(shards), Path(run_dir), parallel={"dp": 4, "ep": 2}, train={"steps": STEPS},
                      checkpoint={"every": EVERY, "keep": 2, "resume": True})
    return Trainer(cfg, job_id="reference").run()


def test_node_failure_shrinks_replans_grows_back_with_the_same_losses(tiny_shards, tmp_path, home, jobs):
    if os.geteuid() != 0:
        pytest.skip("killing a slurmd needs root (the dev cluster's daemons run as root)")
    assert run_distributed(_reference, 4, str(tiny_shards), str(tmp_path / "ref")) == ["done"] * 4
    reference = [r["loss"] for r in metrics(tmp_path / "ref")]

    run_dir = tmp_path / "run"
    config = tmp_path / "elastic.yaml"
    config.write_text(yaml.safe_dump(elastic_config(tiny_shards, run_dir, elastic={"min_nodes": 1, "grow": True,
                                                                                 "grow_check_s": 3}),
                                     sort_keys=False))
    # 0.6 s per step in the first two attempts: the failure lands mid-run, and the shrunk attempt
    # is still running when n2 comes back.
    proc = submit(config, home, detach=False, MOETRAIN_TEST_SLOW="0.6:2")
    job = job_id_of(run_dir, jobs)
    wait_steps(run_dir, EVERY + 3)  # past the step-10 checkpoint
    # n2's tasks (the supervisors) and their ranks: everything of the job on the failed node
    victims = _task_pids(run_dir, "n2", job, supervisors=True) + _task_pids(run_dir, "n2", job)
    assert len(victims) == 4, victims
    slurmd = int((STATE / "run" / "slurmd-n2.pid").read_text())
    assert Path(f"/proc/{slurmd}/comm").read_text().strip() == "slurmd"
    killed_at = time.time()
    try:
        os.kill(slurmd, signal.SIGKILL)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: any(e["event"] == "replanned" for e in read_events(run_dir)), 120,
                 f"the attempt on n1 alone to re-plan\n{logs(run_dir)}")
        wait_steps(run_dir, 1, timeout_s=120, attempt=1)
        first_shrunk_step = time.time()
    finally:
        restore_nodes()  # n2 back: the run grows onto it
    rc, out = finish(proc, config, 300)
    assert rc == 0 and "run done" in out, out + logs(run_dir)

    got = metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), f"every step once: {[r['step'] for r in got]}"
    for r, ref in zip(got, reference):
        assert abs(r["loss"] - ref) <= 1e-5 * abs(ref), f"step {r['step']}: loss {r['loss']} vs uninterrupted {ref}"
    attempts = sorted({r["attempt"] for r in got})
    assert attempts == [0, 1, 2], attempts

    ev = read_events(run_dir)
    kinds = [e["event"] for e in ev]
    requeues = [e for e in ev if e["event"] == "requeue"]
    assert requeues[0]["excluded_failed_nodes"] == ["n2"] and requeues[0]["ok"], requeues
    (replanned,) = [e for e in ev if e["event"] == "replanned"]
    assert replanned["message"].startswith("re-planned: 2 nodes → 1 node: dp4×ep2 → dp2×ep2, accumulation 1 → 2"), \
        replanned
    assert requeues[1]["cause"] == "grow back to 2 nodes" and requeues[1]["readmitted"] == ["n2"], requeues
    recovered = [e for e in ev if e["event"] == "recovered"]
    assert [e["world_size"] for e in recovered] == [2, 4], recovered
    assert kinds.count("resumed") == 2 and kinds[-1] == "finished", kinds
    # Each attempt's ranks: 4 on n1 + n2, then 2 on n1, then 4 again.
    hosts = sorted(json.loads(p.read_text())["host"] for p in (run_dir / "heartbeats").glob("rank*.json")
                   if json.loads(p.read_text())["attempt"] == 2)
    assert hosts == ["n1", "n1", "n2", "n2"], hosts
    assert "event: re-planned: 2 nodes → 1 node" in out and "first step after the restart" in out, out
    assert instances(job)[-1]["state"] == "COMPLETED", instances(job)
    assert not (run_dir / "failed_nodes.txt").exists(), "the failed node was readmitted"
    # The recovery time the run measured (from the survivors' failure records) against ours.
    seconds = recovered[0]["seconds"]
    assert 0 < seconds <= first_shrunk_step - killed_at + 1, (seconds, first_shrunk_step - killed_at)
