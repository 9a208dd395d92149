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
  requeued, restarted (locally), hang detected, checkpoint skipped as corrupt, failed, gave up,
  finished.
* ``failures/<job id>.<restart>/rank00000.json`` — per rank that failed: its exception's type
  and message (the traceback stays in the rank's log, whose path is recorded), and its kind:
  ``error`` (its own: a bad shard, a full disk), ``peer`` (a collective failed because another
  rank died or timed out) or ``hang`` (the watchdog ended it). :func:`diagnose` turns the
  records of an attempt into its cause, and whether restarting can help.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from moetrain.utils import atomic_write


class StaleAttemptError(RuntimeError):
    """This process belongs to an attempt that a newer one has replaced; it must not write."""


def atomic_write_json(path: Path, obj: object, fsync: bool = True) -> None:
    """``obj`` as JSON through :func:`~moetrain.utils.atomic_write` (parent directories made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(obj), fsync=fsync)


def node_name() -> str:
    """This process's node as SLURM names it (``SLURMD_NODENAME``), else the host name. The two
    differ where hosts have FQDNs or several slurmds share a host; ``ExcNodeList`` needs the first."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def exclude_nodes(run_dir: Path, nodes: list[str]) -> None:
    """Add ``nodes`` to ``<run_dir>/exclude_nodes.txt``, the nodes a requeue excludes
    (:func:`moetrain.launch.lifecycle.existing_excludes` reads them)."""
    if nodes:
        with open(Path(run_dir) / "exclude_nodes.txt", "a") as f:
            f.write("".join(n + "\n" for n in nodes))


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


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file ([] when absent; a partly written line is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_events(run_dir: Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / "events.jsonl")


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
        atomic_write_json(self.path, {"rank": self.rank, "host": self.host, "pid": self.pid, "attempt": self.fence.seq,
                                      "step": step, "phase": phase, "time": time.time()}, fsync=False)


def read_heartbeats(run_dir: Path) -> list[dict]:
    d = Path(run_dir) / "heartbeats"
    if not d.is_dir():
        return []
    beats = [read_json(p) for p in sorted(d.glob("rank*.json"))]
    return [b for b in beats if isinstance(b, dict)]


# -- failures ---------------------------------------------------------------------------------

# What a collective raises when its peer is gone or silent (gloo: "Connection closed by peer",
# "Timed out waiting ... for recv"; NCCL: DistBackendError, "watchdog", "timeout").
_PEER_SIGNS = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out", "timeout",
               "gloo/transport", "nccl", "socket", "remote worker")


def failure_kind(exc: BaseException) -> str:
    """``peer`` for a failed collective (another rank died or is stuck: restarting can help),
    else ``error`` (this rank's own: restarting would repeat it)."""
    import torch.distributed as dist

    if isinstance(exc, StaleAttemptError):
        return "error"
    text = str(exc).lower()
    if isinstance(exc, dist.DistError) or any(sign in text for sign in _PEER_SIGNS):
        return "peer"
    return "error"


def failures_dir(run_dir: Path, job_id: str, restart: int) -> Path:
    return Path(run_dir) / "failures" / f"{job_id}.{restart}"


def _pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def dead_ranks_on_this_node(run_dir: Path) -> list[int]:
    """Ranks of the newest attempt that ran on this node (their heartbeats say so) and whose
    process is gone: the evidence a survivor can give about a peer that died without a word."""
    beats = read_heartbeats(run_dir)
    if not beats:
        return []
    newest = max(b.get("attempt", -1) for b in beats)
    here = node_name()
    return sorted(b["rank"] for b in beats if b.get("attempt") == newest and b.get("host") == here
                  and b.get("pid") != os.getpid() and not _pid_alive(int(b.get("pid", 0))))


def record_failure(run_dir: Path, job_id: str, restart: int, rank: int, kind: str, type_name: str, message: str,
                   log_path: str) -> dict:
    """Write this rank's failure record (see the module docstring), with the ranks of its node
    found dead (:func:`dead_ranks_on_this_node`); returns it."""
    rec = {"rank": rank, "kind": kind, "type": type_name, "message": message.strip()[:2000], "log": log_path,
           "host": node_name(), "pid": os.getpid(), "time": time.time(),
           "dead_on_node": dead_ranks_on_this_node(run_dir)}
    atomic_write_json(failures_dir(run_dir, job_id, restart) / f"rank{rank:05d}.json", rec)
    return rec


def read_failures(run_dir: Path, job_id: str, restart: int | None = None) -> list[dict]:
    """The failure records of one attempt of a job, by rank; ``restart=None``: its latest
    attempt that recorded any (a SLURM job keeps its id across requeues)."""
    if restart is None:
        found = [p.name.rsplit(".", 1)[1] for p in (Path(run_dir) / "failures").glob(f"{job_id}.*")]
        restart = max((int(r) for r in found if r.isdigit()), default=0)
    d = failures_dir(run_dir, job_id, restart)
    recs = [read_json(p) for p in sorted(d.glob("rank*.json"))] if d.is_dir() else []
    return [r for r in recs if isinstance(r, dict)]


@dataclass
class Diagnosis:
    """Why an attempt failed. ``cause``: one line. ``restartable``: a rank died, hung or a
    collective failed (a restart from the checkpoint can succeed); not for a rank's own error.
    ``culprit``: the failure record that explains it (None when a rank died without one).
    ``dead``: ranks that left no record and were seen dead (or, without such evidence, every
    rank that left no record). ``silent``: ranks that left no record but were not seen dead
    (still blocked in a collective when the diagnosis was made)."""

    cause: str
    restartable: bool
    culprit: dict | None = None
    dead: list[int] = field(default_factory=list)
    peers: list[dict] = field(default_factory=list)
    silent: list[int] = field(default_factory=list)

    def lines(self) -> list[str]:
        """A few lines for the console: the cause, where the full traceback is, the others."""
        out = [self.cause]
        if self.culprit is not None:
            out.append(f"  log (full traceback): {self.culprit['log']}")
        if self.silent:
            out.append(f"  rank(s) {_ranks(self.silent)} recorded nothing (still waiting in a collective)")
        if self.peers:
            ranks = ", ".join(str(p["rank"]) for p in self.peers[:8]) + (" ..." if len(self.peers) > 8 else "")
            out.append(f"  rank(s) {ranks} then failed on the lost connection "
                       f"({self.peers[0]['type']}: {_first_line(self.peers[0]['message'])})")
        return out


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks[:8]) + (" ..." if len(ranks) > 8 else "")


def _first_line(text: str, limit: int = 160) -> str:
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 1] + "…"


def diagnose(failures: list[dict], world_size: int) -> Diagnosis:
    """The cause of a failed attempt from its ranks' failure records (:func:`read_failures`).

    In order: a rank's own error (the lowest rank raising one; not restartable) — a hang the
    watchdog ended — a rendezvous port in use (EADDRINUSE) — ranks that left no record while
    others failed on lost connections (they died) — every rank failing in a collective (a
    time-out)."""
    by_rank = {f["rank"]: f for f in failures}
    peers = sorted((f for f in failures if f["kind"] == "peer"), key=lambda f: f["rank"])
    own = sorted((f for f in failures if f["kind"] == "error"), key=lambda f: f["rank"])
    hangs = sorted((f for f in failures if f["kind"] == "hang"), key=lambda f: f["rank"])
    unrecorded = [r for r in range(world_size) if r not in by_rank]
    seen_dead = {r for f in failures for r in f.get("dead_on_node", [])}
    dead = [r for r in unrecorded if r in seen_dead] or unrecorded
    silent = [r for r in unrecorded if r not in dead]
    if own:
        f = own[0]
        more = f" (and rank(s) {_ranks([o['rank'] for o in own[1:]])} the same)" if len(own) > 1 else ""
        return Diagnosis(f"rank {f['rank']} ({f['host']}) raised {f['type']}: {_first_line(f['message'], 400)}{more}",
                         False, f, dead, peers)
    if hangs:
        f = hangs[0]
        return Diagnosis(f"hang: {_first_line(f['message'], 400)}", True, f, dead, peers)
    in_use = [f for f in peers if any(s in f["message"].lower() for s in ("eaddrinuse", "address already in use"))]
    if in_use:
        f = in_use[0]
        # The ranks without a record were waiting to connect to it when the job was ended.
        return Diagnosis(f"rank {f['rank']} ({f['host']}) could not listen on the rendezvous port (address already "
                         f"in use: another process holds it); the next attempt uses another port", True, f, [],
                         [p for p in peers if p is not f], unrecorded)
    if dead:
        return Diagnosis(f"rank(s) {_ranks(dead)} died without an error (killed by a signal such as SIGKILL, the OOM "
                         f"killer, or a lost node)", True, None, dead, peers, silent)
    if peers:
        f = peers[0]
        return Diagnosis(f"every rank failed in a collective (a time-out or a network failure): "
                         f"{f['type']}: {_first_line(f['message'])}", True, f, [], peers[1:])
    return Diagnosis("the job failed without any rank recording why", True)
