"""Run lifecycle without SLURM: stop flag → checkpoint → resume with no step lost or repeated,
attempt fencing, and the hang watchdog's detection."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from moetrain.launch.lifecycle import Watchdog
from moetrain.train.records import Fence, Heartbeat, StaleAttemptError, read_events
from moetrain.train.checkpoint import list_checkpoints
from moetrain.train.trainer import Trainer

import faults
from conftest import tiny_config
from multiproc import run_distributed

STEPS = 8


def run_until(rank: int, world: int, data: str, run_dir: str, stop_after: int | None) -> str:
    cfg = tiny_config(data, run_dir, parallel={"dp": 2, "ep": 2}, train={"steps": STEPS},
                      checkpoint={"resume": True, "every": 0})
    trainer = Trainer(cfg, job_id="test", restart=0)
    if stop_after is not None:
        # What the signal handler does: set the flag (here, once step `stop_after` is done).
        original = trainer.train_step

        def step_then_flag():
            res = original()
            if res.step == stop_after and rank == 1:
                trainer.stop_flag.set("SIGUSR2")
            return res

        trainer.train_step = step_then_flag
    return trainer.run()


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_stop_checkpoint_resume_loses_and_repeats_nothing(tiny_shards, tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    assert run_distributed(run_until, 2, str(tiny_shards), str(ref_dir), None) == ["done", "done"]
    assert run_distributed(run_until, 2, str(tiny_shards), str(run_dir), 3) == ["stopped", "stopped"]
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [3], "checkpoint at the stop step"
    assert run_distributed(run_until, 2, str(tiny_shards), str(run_dir), None) == ["done", "done"]
    got, ref = losses(run_dir), losses(ref_dir)
    assert [s for s, _ in got] == list(range(1, STEPS + 1)), "every step exactly once"
    for (step, a), (_, b) in zip(got, ref):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs uninterrupted {b}"
    kinds = [e["event"] for e in read_events(run_dir)]
    assert kinds == ["started", "stopped", "resumed", "started", "finished"], kinds
    assert json.loads((run_dir / "attempt.json").read_text())["seq"] == 1


def signalled_while_starting(rank: int, world: int, data: str, run_dir: str) -> str:
    """A rank started as every launcher starts it (``run_rank``) that gets SLURM's time-limit
    signal before its trainer exists (while importing torch and building the model, as on a slow
    filesystem or a loaded host)."""
    from moetrain.launch import job

    cfg = tiny_config(data, run_dir, parallel={"dp": 2, "ep": 2}, train={"steps": STEPS},
                      checkpoint={"resume": True, "every": 0})
    starting = job._elastic_start

    def signal_then_start(*args):
        os.kill(os.getpid(), signal.SIGUSR2)
        return starting(*args)
    job._elastic_start = signal_then_start
    return job.run_rank(cfg, job.RankEnv(rank, world, rank, world, "test", "", False, "torchrun"), 0)


def test_a_stop_signal_during_start_up_stops_at_the_first_step(tiny_shards, tmp_path):
    """The signal is noted from the rank's first moment and acted on at the first step boundary:
    a checkpoint, a ``stopped`` event, status ``stopped`` (its default action would end the
    process with nothing saved, and the run would restart as after a failure)."""
    run_dir = tmp_path / "run"
    assert run_distributed(signalled_while_starting, 2, str(tiny_shards), str(run_dir), init=False) == \
        ["stopped", "stopped"]
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [1]
    stopped = [e for e in read_events(run_dir) if e["event"] == "stopped"]
    assert [(e["step"], e["reason"]) for e in stopped] == [(1, "SIGUSR2")], stopped


def stale_writer(rank: int, world: int, data: str, run_dir: str) -> dict:
    cfg = tiny_config(data, run_dir, parallel={"dp": 2}, train={"steps": 4}, checkpoint={"resume": True, "every": 0})
    trainer = Trainer(cfg, job_id="old", restart=0)
    trainer.train_step()
    trainer.save_checkpoint()  # a complete checkpoint of step 1
    dist.barrier()
    if rank == 0:
        Fence.advance(Path(run_dir), "new", 1)  # a newer attempt takes over the run directory
    dist.barrier()
    trainer.train_step()
    out = {}
    for name, action in (("checkpoint", trainer.save_checkpoint), ("heartbeat", lambda: trainer._beat("train"))):
        try:
            action()
            out[name] = "wrote"
        except StaleAttemptError as e:
            out[name] = str(e)
    return out


def test_stale_attempt_never_writes(tiny_shards, tmp_path):
    results = run_distributed(stale_writer, 2, str(tiny_shards), str(tmp_path))
    assert "is stale" in results[0]["checkpoint"], results
    assert all("is stale" in r["heartbeat"] for r in results), results
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [1], "the stale step-2 checkpoint landed"


def hang_worker(rank: int, world: int, run_dir: str) -> None:
    run_dir = Path(run_dir)
    fence = Fence(run_dir, 0)
    if rank == 0:
        Fence.advance(run_dir, "test", 0)
    dist.barrier()
    beat = Heartbeat(run_dir, rank, fence)
    beat.beat(1, "train")

    def on_hang(nodes):
        (run_dir / f"on_hang-{rank}.json").write_text(json.dumps(nodes))
        os._exit(0)

    wd = Watchdog(run_dir, rank, fence, beat, factor=3.0, min_timeout_s=1.0, on_hang=on_hang,
                  startup_timeout_s=1.0, grace_s=1.0, poll_s=0.2).start()
    for _ in range(3):  # a few healthy steps
        time.sleep(0.05)
        wd.step_done(0.05)
    if rank == 1:
        # Stuck in its own code until a watchdog has handled the hang (then leave, as on_hang
        # does, rather than keep the test waiting for its time-out).
        while not (run_dir / "hang-0.json").exists():
            time.sleep(0.1)
        time.sleep(0.5)
        os._exit(0)
    dist.barrier()  # rank 0 waits on rank 1 forever


def test_watchdog_dumps_stacks_and_names_the_hung_rank(tmp_path):
    with pytest.raises(RuntimeError):  # the workers leave through on_hang without a result
        run_distributed(hang_worker, 2, str(tmp_path), timeout=60)
    claims = list(tmp_path.glob("hang-0.json"))
    assert claims, "no rank claimed the hang"
    hang = json.loads(claims[0].read_text())
    assert [s["rank"] for s in hang["suspects"]] == [1], hang
    assert hang["nodes"] == [os.uname().nodename]
    for r in (0, 1):
        text = (tmp_path / "stacks" / f"attempt0-rank{r:05d}.txt").read_text()
        assert "hang_worker" in text  # the rank's Python stack
    assert (tmp_path / "stacks" / "attempt0-rank00000.json").read_text().find('"waiting_on_peers": true') > 0
    assert (tmp_path / "exclude_nodes.txt").read_text().split() == [os.uname().nodename]
    assert [e["event"] for e in read_events(tmp_path)] == ["hang"]


def trainer_hang_worker(rank: int, world: int, data: str, run_dir: str) -> None:
    # dp4 × ep2, rank 3 hangs: its ep peer (rank 2) waits inside an all-to-all, but ranks 0 and 1
    # finish their backward and wait on rank 3 in the gradient reduction or the step's host read.
    cfg = tiny_config(data, run_dir, parallel={"dp": 4, "ep": 2}, train={"steps": STEPS},
                      checkpoint={"every": 0})
    trainer = Trainer(cfg, job_id="test", restart=0)
    if rank == 3:
        os.environ["MOETRAIN_TEST_HANG"] = "3:3"
        faults.install(trainer, rank, 0)

    def on_hang(nodes):
        os._exit(0)

    def leave_once_handled():
        # Only the rank that claims the hang calls on_hang; the others would wait in their
        # collectives until gloo's time-out. Leave as the job's requeue would end them.
        while not (Path(run_dir) / "hang-0.json").exists():
            time.sleep(0.2)
        time.sleep(2.0)
        os._exit(0)

    trainer.watchdog = Watchdog(cfg.run_dir, rank, trainer.fence, trainer.heartbeat, factor=3.0,
                                min_timeout_s=2.0, on_hang=on_hang, grace_s=2.0, poll_s=0.2).start()
    threading.Thread(target=leave_once_handled, daemon=True).start()
    trainer.run()


def test_watchdog_sees_ranks_waiting_on_async_work_as_waiting(tiny_shards, tmp_path):
    with pytest.raises(RuntimeError):
        run_distributed(trainer_hang_worker, 4, str(tiny_shards), str(tmp_path), timeout=120)
    hang = json.loads((tmp_path / "hang-0.json").read_text())
    assert [s["rank"] for s in hang["suspects"]] == [3], hang
    waiting = {r: json.loads((tmp_path / "stacks" / f"attempt0-rank{r:05d}.json").read_text())["waiting_on_peers"]
               for r in range(4)}
    assert waiting == {0: True, 1: True, 2: True, 3: False}, waiting

