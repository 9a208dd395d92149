"""Restarts inside the SLURM job: each task supervises its rank in a child process.

A requeue costs more than the restart itself: SLURM waits until every process of the job has
ended, holds the requeued job for the credential lifetime (``AuthInfo=cred_expire``, 120 s by
default), then schedules it again. A rank that died on a healthy node (SIGKILL, the OOM killer, a
crash) needs none of that: the nodes are still the job's. So in a batch job of moetrain's own
(``launch.restart_in_job: true``, the default) every SLURM task is a small supervisor that runs
its rank as a child process (``python -m moetrain.launch.supervisor SPEC``) and restarts it:

1. A child that fails on a peer (a collective broke) records why and exits with
   :data:`EXIT_PEER`; a child killed by a signal records nothing. Either way its supervisor
   takes part in the decision for that attempt.
2. The first supervisor to claim ``failures/<job>.<restart>/decision.claim`` decides: when every
   task's supervisor shows it is alive (a heartbeat written after the failure, within
   :data:`ALIVE_WAIT_S`), the ranks restart inside the job; when one is silent (its node failed)
   the job is requeued as before (:func:`moetrain.launch.job.requeue_after_failure`: an elastic
   job without the failed node); past ``launch.max_restarts`` the run gives up. The decision is
   written to ``decision.json``.
3. On a restart inside the job each supervisor ends its child if it still runs (a rank blocked in
   a collective) and starts the next attempt's child on a new rendezvous port; it resumes from the
   latest complete checkpoint like any restart.

Everything else is the child's, as before: the stop at the time limit or a preemption and its
requeue, the hang watchdog and its requeue, the elastic re-plan and grow-back. A child exits with
:data:`moetrain.launch.job.EXIT_REQUEUED` once its job is requeued, and its supervisor then
leaves without a result. Children die with their supervisor (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from moetrain.config import Config, config_from_dict, to_dict
from moetrain.launch.job import (
    EXIT_REQUEUED,
    RankEnv,
    end_with_attempt,
    exit_now,
    master_port,
    requeue_after_failure,
    run_rank,
)
from moetrain.train.records import (
    append_event,
    atomic_write_json,
    diagnose,
    failures_dir,
    node_name,
    read_failures,
    read_json,
)

__all__ = ["supervise", "inner_restarts", "EXIT_PEER", "EXIT_IDLE"]

log = logging.getLogger("moetrain")

EXIT_PEER = 75  # the child recorded a peer failure (a collective broke): its supervisor decides
EXIT_IDLE = 4  # the child's rank sits the attempt out (an elastic re-plan on fewer ranks)
BEAT_S = 0.5  # a supervisor's heartbeat period
ALIVE_WAIT_S = 3.0  # how long the decision waits for every supervisor's heartbeat after a failure
SETTLE_S = 10.0  # how long it then waits for the live ranks' failure records (or their children's end)


def _beats_dir(run_dir: Path, job_id: str) -> Path:
    return Path(run_dir) / "supervisors" / job_id


def inner_restarts(run_dir: Path, job_id: str) -> int:
    """Restarts inside job ``job_id`` so far (its ``decision.json`` records saying ``inner``): with
    SLURM's requeue count, the number of this job's attempts before the current one."""
    n = 0
    for p in (Path(run_dir) / "failures").glob(f"{job_id}.*/decision.json"):
        rec = read_json(p)
        n += isinstance(rec, dict) and rec.get("action") == "inner"
    return n


class _Heartbeat:
    """The supervisor's own heartbeat (``supervisors/<job>/rank<r>.json``), every :data:`BEAT_S`."""

    def __init__(self, run_dir: Path, job_id: str, rank: int):
        self.path = _beats_dir(run_dir, job_id) / f"rank{rank:05d}.json"
        self.rank = rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moetrain-supervisor-beat", daemon=True)

    def start(self) -> "_Heartbeat":
        self._beat()
        self._thread.start()
        return self

    def _beat(self) -> None:
        try:
            atomic_write_json(self.path, {"rank": self.rank, "host": node_name(), "pid": os.getpid(),
                                          "time": time.time()}, fsync=False)
        except OSError:
            pass

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._beat()


def _alive_since(run_dir: Path, job_id: str, world: int, since: float) -> tuple[list[int], list[int]]:
    """Ranks whose supervisor wrote a heartbeat after ``since``, and those that did not, waiting
    up to :data:`ALIVE_WAIT_S` for all of them. The times are each host's clock: a node whose
    clock lags by more than about ``ALIVE_WAIT_S - BEAT_S`` counts as silent, and the job is
    requeued instead of restarted inside — slower, never wrong."""
    deadline = since + ALIVE_WAIT_S
    while True:
        alive = []
        for r in range(world):
            rec = read_json(_beats_dir(run_dir, job_id) / f"rank{r:05d}.json")
            if isinstance(rec, dict) and rec.get("time", 0) > since:
                alive.append(r)
        if len(alive) == world or time.time() > deadline:
            return alive, [r for r in range(world) if r not in alive]
        time.sleep(0.1)


def _set_pdeathsig() -> None:
    """This process gets SIGKILL when its parent (the supervisor) dies (Linux ``prctl``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _spawn(cfg: dict, renv: RankEnv, restart: int) -> subprocess.Popen:
    spec = Path(cfg["run"]["dir"]) / "logs" / f"{renv.job_id}.{restart}.rank{renv.rank}.child.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(spec, {"config": cfg, "rank_env": dataclasses.asdict(renv), "restart": restart,
                             "parent": os.getpid()}, fsync=False)
    env = dict(os.environ, MASTER_PORT=str(master_port(renv.job_id, restart)))
    # stdout / stderr inherited: the child writes to the task's log, as the rank did before.
    return subprocess.Popen([sys.executable, "-u", "-m", "moetrain.launch.supervisor", str(spec)], env=env)


def _decide(cfg: Config, renv: RankEnv, restart: int, failed_at: float) -> dict:
    """The decision of attempt ``restart`` (see the module docstring): made by the first
    supervisor that claims it, read by the others."""
    where = failures_dir(cfg.run_dir, renv.job_id, restart)
    where.mkdir(parents=True, exist_ok=True)
    path = where / "decision.json"
    try:
        os.close(os.open(where / "decision.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        deadline = time.time() + 30 + ALIVE_WAIT_S
        while time.time() < deadline:  # another supervisor decides
            rec = read_json(path)
            if isinstance(rec, dict):
                return rec
            time.sleep(0.1)
        # The deciding supervisor vanished mid-decision (its node failed): what it would have decided.
        return {"action": "requeue", "cause": "the supervisor deciding the restart stopped answering",
                "silent_supervisors": []}
    alive, silent = _alive_since(cfg.run_dir, renv.job_id, renv.world_size, failed_at)
    # The cause names the dead ranks: those with neither a failure record nor a child that a live
    # supervisor saw end. Wait (bounded: a child may be blocked in a collective) for the ranks
    # of the live supervisors to have one or the other.
    deadline = time.time() + SETTLE_S
    while time.time() < deadline and not all(
            (where / f"rank{r:05d}.json").is_file() or (where / f"ended-rank{r:05d}.json").is_file() for r in alive):
        time.sleep(0.1)
    why = diagnose(read_failures(cfg.run_dir, renv.job_id, restart), renv.world_size)
    if not why.restartable:
        action = "fail"
    elif restart >= cfg.launch.max_restarts:
        action = "give_up"
    elif not silent:
        action = "inner"
    else:
        action = "requeue"
    rec = {"action": action, "cause": why.cause, "silent_supervisors": silent, "time": time.time()}
    atomic_write_json(path, rec)
    if action == "inner":
        append_event(cfg.run_dir, None, "restart", restart=restart + 1, max_restarts=cfg.launch.max_restarts,
                     cause=why.cause, in_job=True, job_id=renv.job_id)
    elif action == "give_up":
        append_event(cfg.run_dir, None, "gave_up", cause=why.cause,
                     reason=f"launch.max_restarts={cfg.launch.max_restarts} reached")
    return rec


def supervise(cfg: Config, renv: RankEnv, restart: int) -> str:
    """Run this task's rank as a child process, restarting it inside the job after a peer
    failure when every task is still there (module docstring). Returns the rank's status
    (``done``, ``idle``); leaves the process without a result once the job is requeued.

    Raises:
        RuntimeError: the rank failed with its own error, or the run gave up (the failure
            records say why; ``submit`` prints them).
    """
    terminated = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        # The child got the same signal (SLURM signals every process of the step): it stops,
        # checkpoints and requeues; this process only notes a SIGTERM (its job is ending).
        if signum == signal.SIGTERM:
            terminated.set()
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, on_signal)
    beat = _Heartbeat(cfg.run_dir, renv.job_id, renv.rank).start()
    data = to_dict(cfg)
    child_env = dataclasses.replace(renv, supervised=True)
    while True:
        child = _spawn(data, child_env, restart)
        decision: dict | str | None = None
        while decision is None:
            try:
                rc = child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                rc = None
            if rc is not None:
                break
            rec = read_json(failures_dir(cfg.run_dir, renv.job_id, restart) / "decision.json")
            if isinstance(rec, dict):
                decision = rec  # a peer failed: stop this child, which may be blocked on it
                child.kill()
                child.wait()
                _record_stopped(cfg, renv, restart)
        if decision is None:
            if rc == 0:
                return "done"
            if rc == EXIT_IDLE:
                # Sit out, but stay: an inner restart restarts this rank too.
                decision = _wait_decision(cfg, renv, restart, terminated)
                if decision == "finished":
                    return "idle"
                if decision is None:
                    exit_now(0)  # the job is ending (a requeue): leave without a result
            elif rc == EXIT_REQUEUED or (terminated.is_set() and _requeued(cfg, renv, restart)):
                exit_now(0)  # the job is requeued: leave without a result, as the ranks do
            elif terminated.is_set():
                exit_now(1)  # SLURM is ending the job (a node failure, a cancel): nothing to decide
            elif rc == EXIT_PEER or rc < 0:
                where = failures_dir(cfg.run_dir, renv.job_id, restart)
                atomic_write_json(where / f"ended-rank{renv.rank:05d}.json", {"rank": renv.rank, "returncode": rc,
                                                                             "time": time.time()})
                # Every supervisor still alive writes a heartbeat after this moment, which is
                # after the failure; a failed node's never do.
                decision = _decide(cfg, renv, restart, time.time())
            else:
                if _requeued(cfg, renv, restart):
                    end_with_attempt(1)
                beat.stop()
                recs = read_failures(cfg.run_dir, renv.job_id, restart)
                why = diagnose(recs, renv.world_size) if recs else None
                raise RuntimeError(f"rank {renv.rank} exited with status {rc}"
                                   + (f": {why.cause}" if why else ""))
        action = decision["action"]
        if action == "inner":
            log.warning("restarting rank %d inside the job (attempt %d): %s", renv.rank, restart + 1,
                        decision["cause"])
            restart += 1
            continue
        if action == "requeue":
            requeue_after_failure(cfg, renv, restart, settle_s=0.0)  # the decision waited for the records
            exit_now(1)  # the requeue failed or never came: end with a failure
        beat.stop()
        raise RuntimeError(f"{decision['cause']}" + (" (launch.max_restarts reached)" if action == "give_up" else ""))


def _requeued(cfg: Config, renv: RankEnv, restart: int) -> bool:
    rec = read_json(failures_dir(cfg.run_dir, renv.job_id, restart) / "requeue.json")
    return isinstance(rec, dict) and bool(rec.get("ok"))


def _record_stopped(cfg: Config, renv: RankEnv, restart: int) -> None:
    """The failure record of a child this supervisor ended for a decision (it may have been
    blocked in a collective and recorded nothing): without it the rank would count as dead."""
    from moetrain.train.records import record_failure

    if not (failures_dir(cfg.run_dir, renv.job_id, restart) / f"rank{renv.rank:05d}.json").is_file():
        record_failure(cfg.run_dir, renv.job_id, restart, renv.rank, "peer", "Stopped",
                       "ended by its supervisor after a peer failed", renv.log_path)


def _wait_decision(cfg: Config, renv: RankEnv, restart: int, terminated: threading.Event) -> dict | str | None:
    """An idle rank's wait: the decision of a restart of this attempt, ``"finished"`` once the
    run is over, or None when the job ends otherwise (a SIGTERM: a requeue)."""
    from moetrain.train.records import read_events

    path = failures_dir(cfg.run_dir, renv.job_id, restart) / "decision.json"
    while not terminated.is_set():
        rec = read_json(path)
        if isinstance(rec, dict):
            return rec
        events = read_events(cfg.run_dir)
        if events and events[-1].get("event") in ("finished", "gave_up"):
            return "finished"
        time.sleep(0.5)
    return None


def _child_main(spec_path: str) -> None:
    _set_pdeathsig()
    spec = json.loads(Path(spec_path).read_text())
    if os.getppid() != spec["parent"]:
        exit_now(1)  # the supervisor died before this process could tie itself to it
    from moetrain.train.records import failure_kind

    cfg = config_from_dict(spec["config"])
    renv = RankEnv(**spec["rank_env"])
    try:
        status = run_rank(cfg, renv, int(spec["restart"]))
    except BaseException as e:  # noqa: BLE001 - recorded by run_rank; the exit status tells the supervisor
        exit_now(EXIT_PEER if failure_kind(e) == "peer" else 1)
    exit_now({"done": 0, "idle": EXIT_IDLE}.get(status, 1))


if __name__ == "__main__":
    _child_main(sys.argv[1])
