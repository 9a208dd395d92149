"""What a run records in its directory besides checkpoints and metrics: the attempt fence,
heartbeats and lifecycle events. The trainer writes them; the launcher's watchdog and
``python -m moetrain.monitor`` read them.

Files (all written atomically: temp file + rename, or one appended line):

* ``attempt.json`` — the fence: ``{"seq": n, "job_id": ..., "restart": ...}``. Rank 0 of every
  new attempt (a requeue, a resubmission) increments ``seq`` before anything else is written.
  A process whose ``seq`` is older — left over from a failed attempt, e.g. on a node whose
  slurmd died — finds the fence moved and stops writing (:class:`StaleAttemptError`): it can
  never complete a checkpoint or add metrics of the current attempt.
* ``heartbeats/rank00000.json`` — per rank: step, phase, time, host, pid, attempt seq.
* ``events.jsonl`` — one line per lifecycle event: started, resumed, stopped by a signal,
  requeued, hang detected, gave up, finished.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path


class StaleAttemptError(RuntimeError):
    """This process belongs to an attempt that a newer one has replaced; it must not write."""


def atomic_write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def node_name() -> str:
    """This process's node as SLURM names it (``SLURMD_NODENAME``), else the host name. The two
    differ where hosts have FQDNs or several slurmds share a host; ``ExcNodeList`` needs the first."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def read_json(path: Path, default: object = None) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return default


class Fence:
    """The attempt fence of a run directory (see the module docstring)."""

    def __init__(self, run_dir: Path, seq: int):
        self.path = Path(run_dir) / "attempt.json"
        self.seq = seq

    @staticmethod
    def advance(run_dir: Path, job_id: str, restart: int) -> int:
        """Start a new attempt (rank 0 only): returns its sequence number."""
        path = Path(run_dir) / "attempt.json"
        old = read_json(path, {}) or {}
        seq = int(old.get("seq", -1)) + 1
        atomic_write_json(path, {"seq": seq, "job_id": job_id, "restart": restart, "time": time.time(),
                                 "host": node_name()})
        return seq

    def current(self) -> int:
        rec = read_json(self.path, {}) or {}
        return int(rec.get("seq", self.seq))

    def check(self) -> None:
        """Raise :class:`StaleAttemptError` when a newer attempt owns the run directory."""
        now = self.current()
        if now != self.seq:
            raise StaleAttemptError(f"attempt {self.seq} is stale: attempt {now} owns {self.path.parent}; "
                                    f"this process stops without writing")


def append_event(run_dir: Path, fence: Fence | None, kind: str, **fields: object) -> None:
    """Append one lifecycle event (fenced)."""
    if fence is not None:
        fence.check()
    rec = {"time": time.time(), "event": kind, "attempt": fence.seq if fence else None, **fields}
    with open(Path(run_dir) / "events.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def read_events(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class Heartbeat:
    """Per-rank heartbeat file, rewritten at each phase change."""

    def __init__(self, run_dir: Path, rank: int, fence: Fence):
        self.path = Path(run_dir) / "heartbeats" / f"rank{rank:05d}.json"
        self.rank, self.fence = rank, fence
        self.host, self.pid = node_name(), os.getpid()
        self.step, self.phase = 0, "start"

    def beat(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase
        self.fence.check()
        atomic_write_json(self.path, {"rank": self.rank, "host": self.host, "pid": self.pid,
                                      "attempt": self.fence.seq, "step": step, "phase": phase, "time": time.time()})


def read_heartbeats(run_dir: Path) -> list[dict]:
    d = Path(run_dir) / "heartbeats"
    if not d.is_dir():
        return []
    beats = [read_json(p) for p in sorted(d.glob("rank*.json"))]
    return [b for b in beats if isinstance(b, dict)]
