"""Run lifecycle inside the job: hang watchdog, stack dumps, requeue on SLURM.

The run's own records (attempt fence, heartbeats, events) are written by the trainer and live in
:mod:`moetrain.train.records`. Files this module adds to the run directory:

* ``stacks/attempt<seq>-rank<r>.txt`` — Python stacks of every thread of a rank, dumped when a
  hang is detected.
* ``exclude_nodes.txt`` — nodes suspected by the hang watchdog, excluded on requeue.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from moetrain.parallel.peers import is_waiting_on_peers
from moetrain.train.records import (
    Fence,
    Heartbeat,
    StaleAttemptError,
    append_event,
    atomic_write_json,
    exclude_nodes,
    node_name,
    read_heartbeats,
    read_json,
)

log = logging.getLogger(__name__)


def slurm_job_id() -> str | None:
    """The job id to requeue: the array/het-aware id submitit uses, else SLURM_JOB_ID."""
    if "SLURM_ARRAY_JOB_ID" in os.environ and "SLURM_ARRAY_TASK_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def _scontrol(*args: str) -> None:
    # Requeueing sends SIGTERM to every process of the job, and to these scontrol commands too if
    # they have not ended. SIGTERM is blocked in this thread while they are spawned: the child
    # inherits the mask from fork through exec, so no window is left (a `trap "" TERM` in a
    # shell left one: the signal could land before the trap ran). Otherwise the `release` that
    # follows `requeuehold` can die before it is sent, and the job stays held forever. The
    # process-directed SIGTERM still reaches this process's other threads (the stop flag).
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        subprocess.run(["scontrol", *args], check=True, timeout=60, capture_output=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def requeue_slurm_job(exclude: list[str] | None = None, *, decide: Callable[[], list[str]] | None = None,
                      nodes: tuple[int, int, int] | None = None) -> bool:
    """Requeue this SLURM job, optionally changing its request first; returns True when requeued.

    With ``exclude`` (the job's whole ``ExcNodeList``: an empty list clears it), ``decide`` (a
    function called once the job is held that returns that list: the failed nodes are known only
    after the surviving ranks have recorded themselves) or ``nodes`` (``(min, max, tasks per
    node)``: an elastic job's node range, set again as ``NumNodes=min-max NumTasks=min × tasks``
    because SLURM fixes both to the allocation's once the job starts, and with ``NumTasks`` left
    at it a smaller job can never start), the job is requeued held, updated (SLURM refuses these
    for a running job), then released, so the scheduler cannot restart it on a suspected node in
    between.
    """
    job = slurm_job_id()
    if job is None:
        return False
    try:
        if exclude is not None or decide is not None or nodes:
            _scontrol("requeuehold", job)
            try:
                if decide is not None:
                    exclude = decide()
                if exclude is not None:
                    _scontrol("update", f"JobId={job}", f"ExcNodeList={','.join(sorted(set(exclude)))}")
                if nodes:
                    low, high, tasks = nodes
                    _scontrol("update", f"JobId={job}", f"NumNodes={low}-{high}", f"NumTasks={low * tasks}")
            finally:
                _scontrol("release", job)
        else:
            _scontrol("requeue", job)
        return True
    except (subprocess.SubprocessError, OSError) as e:
        err = getattr(e, "stderr", b"") or b""
        log.error("requeue of job %s failed: %s %s", job, e, err.decode(errors="replace").strip())
        return False


def _main_thread_waits_on_peers() -> bool:
    """Whether the main thread is blocked on other ranks rather than in its own computation: inside
    a place marked by :func:`moetrain.parallel.peers.waiting_on_peers` (async work handles, host
    reads that complete collectives), or with torch.distributed among its innermost frames."""
    if is_waiting_on_peers():
        return True
    frame = sys._current_frames().get(threading.main_thread().ident)
    depth = 0
    while frame is not None and depth < 12:
        name = frame.f_code.co_filename
        if "torch/distributed" in name or "_functional_collectives" in name:
            return True
        frame, depth = frame.f_back, depth + 1
    return False


class Watchdog:
    """Notices a rank that stops making progress, dumps its stacks, and ends the attempt.

    A stall is ``max(min_timeout_s, factor × median step time)`` without a completed step
    (``startup_timeout_s`` before the first one). Each rank's watchdog dumps its own stacks and
    records whether its main thread was waiting on peers; after ``grace_s`` the first rank to
    claim ``hang-<seq>.json`` names the suspects (ranks busy in their own code, or with stale
    heartbeats), adds their nodes to ``exclude_nodes.txt`` and calls ``on_hang(suspect_nodes)``
    — which requeues the SLURM job with the nodes excluded and exits.
    """

    def __init__(self, run_dir: Path, rank: int, fence: Fence, heartbeat: Heartbeat, factor: float,
                 min_timeout_s: float, on_hang: Callable[[list[str]], None], startup_timeout_s: float | None = None,
                 grace_s: float = 5.0, poll_s: float = 1.0):
        self.run_dir, self.rank, self.fence, self.heartbeat = Path(run_dir), rank, fence, heartbeat
        self.factor, self.min_timeout_s = factor, min_timeout_s
        self.startup_timeout_s = startup_timeout_s if startup_timeout_s is not None else 3 * min_timeout_s
        self.on_hang, self.grace_s, self.poll_s = on_hang, grace_s, poll_s
        self.step_times: list[float] = []
        self.last_progress = time.time()
        self.started = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moetrain-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def step_done(self, step_time_s: float) -> None:
        self.step_times = (self.step_times + [step_time_s])[-50:]
        self.started = True
        self.last_progress = time.time()

    def timeout_s(self) -> float:
        if not self.started:
            return self.startup_timeout_s
        return max(self.min_timeout_s, self.factor * statistics.median(self.step_times))

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if time.time() - self.last_progress > self.timeout_s():
                try:
                    self._handle_hang()
                except StaleAttemptError:
                    return
                except Exception:  # noqa: BLE001 - the watchdog must never die silently
                    log.exception("watchdog failed while handling a hang")
                return

    def dump_stacks(self) -> Path:
        waiting = _main_thread_waits_on_peers()
        path = self.run_dir / "stacks" / f"attempt{self.fence.seq}-rank{self.rank:05d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(f"# rank {self.rank} on {node_name()} pid {os.getpid()}, step {self.heartbeat.step} "
                    f"phase {self.heartbeat.phase}, no progress for {time.time() - self.last_progress:.0f} s; "
                    f"main thread waiting on peers: {waiting}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        atomic_write_json(path.with_suffix(".json"), {"rank": self.rank, "host": node_name(),
                                                      "waiting_on_peers": waiting, "time": time.time()})
        return path

    def _handle_hang(self) -> None:
        self.fence.check()
        log.error("no progress for %.0f s (limit %.0f s) at step %d: dumping stacks", time.time() - self.last_progress,
                  self.timeout_s(), self.heartbeat.step)
        self.dump_stacks()
        time.sleep(self.grace_s)  # let the other ranks dump theirs
        claim = self.run_dir / f"hang-{self.fence.seq}.json"
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # another rank handles it
        suspects = self.suspects()
        nodes = sorted({s["host"] for s in suspects})
        with os.fdopen(fd, "w") as f:
            json.dump({"detected_by": self.rank, "time": time.time(), "suspects": suspects, "nodes": nodes}, f)
        exclude_nodes(self.run_dir, nodes)
        append_event(self.run_dir, self.fence, "hang", step=self.heartbeat.step, suspects=[s["rank"] for s in suspects],
                     nodes=nodes)
        self.on_hang(nodes)

    def suspects(self) -> list[dict]:
        """Ranks busy in their own code while the others wait on them; failing that, the ranks
        whose heartbeat is the oldest (a dead or frozen process writes nothing)."""
        dumps = {}
        for p in (self.run_dir / "stacks").glob(f"attempt{self.fence.seq}-rank*.json"):
            rec = read_json(p)
            if isinstance(rec, dict):
                dumps[rec["rank"]] = rec
        beats = {b["rank"]: b for b in read_heartbeats(self.run_dir) if b.get("attempt") == self.fence.seq}
        busy = [r for r, d in dumps.items() if not d["waiting_on_peers"]]
        if busy and len(busy) < max(len(dumps), 2):
            return [{"rank": r, "host": dumps[r]["host"], "reason": "busy in its own code while peers wait"}
                    for r in sorted(busy)]
        if beats:
            oldest = min(b["time"] for b in beats.values())
            return [{"rank": r, "host": b["host"], "reason": "oldest heartbeat"} for r, b in sorted(beats.items())
                    if b["time"] - oldest < 1.0 and r not in dumps]
        return []


def existing_excludes(run_dir: Path) -> list[str]:
    path = Path(run_dir) / "exclude_nodes.txt"
    if not path.is_file():
        return []
    return sorted({line.strip() for line in path.read_text().splitlines() if line.strip()})


def job_exclusions(run_dir: Path, configured: str | None) -> list[str]:
    """The job's whole exclusion list for a requeue: the nodes the run excluded
    (``exclude_nodes.txt``) and ``launch.exclude`` (``configured``, a SLURM host list), which a
    ``scontrol update ExcNodeList`` would otherwise replace."""
    from moetrain.topology.cluster import expand_nodelist

    given = expand_nodelist(configured) if configured else []
    return sorted(set(existing_excludes(run_dir)) | set(given))


def rewrite_excludes(run_dir: Path, drop: list[str]) -> None:
    """Remove ``drop`` from ``exclude_nodes.txt`` (nodes a grown-back run may use again)."""
    keep = [n for n in existing_excludes(run_dir) if n not in set(drop)]
    path = Path(run_dir) / "exclude_nodes.txt"
    if path.is_file():
        path.write_text("".join(n + "\n" for n in keep))
