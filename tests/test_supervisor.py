"""Restarts inside the job (:mod:`moetrain.launch.supervisor`) without SLURM: the decision rules,
and two supervised ranks, one of which is SIGKILLed mid-step, finishing with the uninterrupted
run's losses after a restart inside the job (the SLURM dev-cluster version is
tests/test_slurm_lifecycle.py::test_sigkill_of_one_task_restarts_inside_the_job)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from moetrain.launch.job import RankEnv
from moetrain.launch import supervisor
from moetrain.launch.supervisor import _decide, inner_restarts, supervise
from moetrain.train.records import atomic_write_json, read_events, record_failure
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed

STEPS, EVERY = 12, 4


def config(shards: Path, run_dir: Path, **launch):
    return tiny_config(shards, run_dir, run={"name": "supervised"}, parallel={"dp": 2, "ep": 2},
                       train={"steps": STEPS}, checkpoint={"every": EVERY, "keep": 2, "resume": True},
                       launch={"max_restarts": 2, **launch})


def _env(rank: int, world: int = 2) -> RankEnv:
    return RankEnv(rank, world, rank, world, "job", f"rank{rank}.log", requeue=True, launcher="test")


def _beat(run_dir: Path, rank: int, t: float) -> None:
    atomic_write_json(run_dir / "supervisors" / "job" / f"rank{rank:05d}.json",
                      {"rank": rank, "host": "n1", "pid": 1, "time": t})


@pytest.mark.parametrize("alive,restart,own_error,action", [
    ([0, 1], 0, False, "inner"),      # every task's supervisor is there: restart inside the job
    ([0], 0, False, "requeue"),       # rank 1's went silent (its node failed): requeue
    ([0, 1], 2, False, "give_up"),    # launch.max_restarts = 2 reached
    ([0, 1], 0, True, "fail"),        # a rank's own error: a restart would repeat it
])
def test_decision(tmp_path, monkeypatch, alive, restart, own_error, action):
    # Rank 1 never records its failure here: the decision waits SETTLE_S for it, then decides on
    # what it has (the wait's bound is what is used, not its length).
    monkeypatch.setattr(supervisor, "SETTLE_S", 0.5)
    cfg = config(tmp_path, tmp_path / "run")
    run_dir = tmp_path / "run"
    since = time.time()
    for r in alive:
        _beat(run_dir, r, since + 0.01)
    record_failure(run_dir, "job", restart, 0, "error" if own_error else "peer", "X", "boom", "log")
    rec = _decide(cfg, _env(0), restart, since)
    assert rec["action"] == action, rec
    assert rec["silent_supervisors"] == [r for r in (0, 1) if r not in alive]
    saved = json.loads((run_dir / "failures" / f"job.{restart}" / "decision.json").read_text())
    assert saved["action"] == action
    assert _decide(cfg, _env(1), restart, since) == saved, "the second supervisor reads the first one's decision"
    assert inner_restarts(run_dir, "job") == (action == "inner")


def test_decision_names_the_dead_rank_once_the_live_ranks_have_recorded(tmp_path):
    """Rank 2's child was SIGKILLed (its supervisor saw it end and decides at once); ranks 0 and
    1 record their lost connection half a second later. The cause waits for them, so it names
    rank 2 alone, not every rank without a record yet."""
    import threading

    cfg = config(tmp_path, tmp_path / "run")
    run_dir = tmp_path / "run"
    since = time.time()
    for r in range(3):
        _beat(run_dir, r, since + 0.01)
    atomic_write_json(run_dir / "failures" / "job.0" / "ended-rank00002.json", {"rank": 2, "returncode": -9})
    late = [threading.Timer(0.5, record_failure, (run_dir, "job", 0, r, "peer", "DistNetworkError",
                                                  "Connection closed by peer", "log")) for r in (0, 1)]
    for t in late:
        t.start()
    rec = _decide(cfg, _env(2, 3), 0, since)
    for t in late:
        t.join()
    assert rec["action"] == "inner" and rec["cause"].startswith("rank(s) 2 died without an error"), rec


def _uninterrupted(rank: int, world: int, shards: str, run_dir: str) -> str:
    return Trainer(config(Path(shards), Path(run_dir)), job_id="reference").run()


def _supervised(rank: int, world: int, shards: str, run_dir: str) -> str:
    return supervise(config(Path(shards), Path(run_dir)), _env(rank, world), 0)


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_a_killed_rank_restarts_inside_the_job_with_the_same_losses(tiny_shards, tmp_path, monkeypatch):
    """Rank 1's child SIGKILLs itself in step 7 (tests/faults.py): both supervisors agree on a
    restart inside the job, start new children on a new port, which resume from the step-4
    checkpoint; every step's loss equals the uninterrupted run's."""
    assert run_distributed(_uninterrupted, 2, str(tiny_shards), str(tmp_path / "ref")) == ["done", "done"]
    run_dir = tmp_path / "run"
    monkeypatch.setenv("MOETRAIN_TEST_KILL", "1:7")
    monkeypatch.setenv("MOETRAIN_TEST_SLOW", "0.3:1")  # the step-4 checkpoint commits before the kill
    assert run_distributed(_supervised, 2, str(tiny_shards), str(run_dir), init=False) == ["done", "done"]
    got, ref = _losses(run_dir), _losses(tmp_path / "ref")
    assert [s for s, _ in got] == list(range(1, STEPS + 1)), got
    for (step, a), (_, b) in zip(got, ref):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} after the restart vs {b} uninterrupted"
    ev = read_events(run_dir)
    assert [e["event"] for e in ev] == ["started", "restart", "resumed", "started", "recovered", "finished"], ev
    restart = ev[1]
    assert restart["in_job"] is True and restart["cause"].startswith("rank(s) 1 died without an error"), restart
    assert json.loads((run_dir / "failures" / "job.0" / "decision.json").read_text())["action"] == "inner"
    assert ev[4]["seconds"] < 30, ev[4]
