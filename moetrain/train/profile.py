"""Profiles of chosen steps (``train.profile``) and where their time went.

:class:`StepProfiler` runs ``torch.profiler`` over the configured steps on the configured ranks
(CPU activities, and CUDA's on a GPU; shapes and memory recorded) and writes one Chrome / Perfetto
trace per rank, ``<run.dir>/profile/rank<r>.steps<a>-<b>.json`` (open it in https://ui.perfetto.dev
or ``chrome://tracing``). The named ranges in it are :mod:`moetrain.ranges`' (step, forward,
backward, optimizer, each dispatch / combine all-to-all and its wait) and torch's own (FSDP2's
gathers and reductions, the pipeline runtime's actions and sends / receives, the collectives).

:func:`phase_table` reads the traces back and splits each profiled step of each rank into
compute, communication that nothing else overlapped, and idle time (``python -m moetrain.monitor
RUN --profile``):

* on the CPU (the ranges of the host threads): a thread computes inside a forward, backward or
  optimizer range except where it waits in a communication range nested in it (an all-to-all's
  wait, an FSDP gather or reduction, a collective's call); a moment counts as compute when any
  thread computes, as communication when some thread waits or a collective is in flight (a
  pipeline send or receive, a gradient all-reduce) and no thread computes, as idle otherwise
  (data loading, Python between phases);
* on a GPU (kernels, when the trace has them): compute kernels against NCCL kernels, over all
  streams, the same way.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Iterable

import torch

from moetrain.config import ProfileConfig
from moetrain.ranges import BACKWARD, FORWARD, OPTIMIZER, STEP, WAIT

__all__ = ["StepProfiler", "phase_table", "render_phase_table", "trace_files"]

log = logging.getLogger(__name__)

# Host time spent in communication: moetrain's waits, FSDP2's gathers and reductions, the
# collectives' calls. A collective's whole flight (issue to completion, "gloo:all_reduce",
# "nccl:all_to_all") is recorded as a range too: it counts only where no thread computes.
_FSDP_COMM = re.compile(r"^FSDP::(all_gather|post_backward_reduce|post_backward_rs_wait)($| )")
_CALL = re.compile(r"^(c10d::|record_param_comms)")
_FLIGHT = re.compile(r"^(gloo|nccl):")


class StepProfiler:
    """``torch.profiler`` over steps ``cfg.start`` .. ``cfg.start + cfg.steps - 1`` on this
    rank when ``cfg.ranks`` names it (or is empty); call :meth:`begin` before each step and
    :meth:`end` after it. ``cfg`` None: does nothing."""

    def __init__(self, cfg: ProfileConfig | None, rank: int, run_dir: Path, cuda: bool):
        self.cfg, self.rank, self.out_dir, self.cuda = cfg, rank, Path(run_dir) / "profile", cuda
        self.on = cfg is not None and (not cfg.ranks or rank in cfg.ranks)
        self._prof: torch.profiler.profile | None = None

    @property
    def last(self) -> int:
        return self.cfg.start + self.cfg.steps - 1 if self.cfg else 0

    def begin(self, step: int) -> None:
        """Step ``step`` (1-based) is about to run."""
        if self.on and step == self.cfg.start and self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self._prof.__enter__()

    def end(self, step: int) -> Path | None:
        """Step ``step`` finished; after the last profiled one, writes the trace and returns its path."""
        if self._prof is None or step < self.last:
            return None
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"rank{self.rank:05d}.steps{self.cfg.start}-{self.last}.json"
        prof.export_chrome_trace(str(path))
        log.info("profile of steps %d-%d written to %s (python -m moetrain.monitor %s --profile sums it up)",
                 self.cfg.start, self.last, path, self.out_dir.parent)
        return path


def trace_files(run_dir: Path) -> list[Path]:
    """The traces in ``<run_dir>/profile``, by rank."""
    return sorted((Path(run_dir) / "profile").glob("rank*.steps*.json"))


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def _minus(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union ``xs`` less the union ``ys`` (both merged, sorted)."""
    out, j = [], 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(ys) and ys[k][0] < b:
            if ys[k][0] > cur:
                out.append((cur, ys[k][0]))
            cur = max(cur, ys[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def _clip(xs: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in xs if b > lo and a < hi]


def _length(xs: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in xs)


def _host_kind(name: str) -> str | None:
    """A compute phase (FORWARD / BACKWARD / OPTIMIZER), ``comm`` (the thread waits),
    ``flight`` (a collective in flight), or None."""
    if name in (FORWARD, BACKWARD, OPTIMIZER):
        return name
    if name.endswith(WAIT) or _FSDP_COMM.match(name) or _CALL.match(name):
        return "comm"
    if _FLIGHT.match(name):
        return "flight"
    return None


def _rank_of(path: Path) -> int:
    return int(re.match(r"rank(\d+)", path.name).group(1))


def phase_table(run_dir: Path) -> list[dict]:
    """One row per traced rank: ``rank``, ``steps`` (profiled), ``source`` (``cpu`` or ``cuda``),
    the mean ``step_ms``, the host's ``forward_ms`` / ``backward_ms`` / ``optimizer_ms`` per step,
    and the shares of each step's time (summing to 1) that were ``compute``, exposed
    ``communication`` and ``idle`` (module docstring).

    Raises:
        ValueError: a trace that is not a Chrome trace, or has no ``moetrain.step`` range.
    """
    rows = []
    for path in trace_files(run_dir):
        try:
            events = json.loads(path.read_text())["traceEvents"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a Chrome trace ({e})") from e
        spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
        steps = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in spans
                       if e["name"] == STEP and e.get("cat") == "user_annotation")
        if not steps:
            raise ValueError(f"{path}: no {STEP} range (was it written by train.profile?)")
        kernels = [e for e in spans if e.get("cat") == "kernel"]
        named: dict[str, list[tuple[float, float]]] = {FORWARD: [], BACKWARD: [], OPTIMIZER: []}
        if kernels:
            comp = _union((e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower())
            comm = _minus(_union((e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()), comp)
        threads: dict[tuple, dict[str, list]] = {}
        flights = []
        for e in spans:
            if e.get("cat") not in ("user_annotation", "cpu_op"):
                continue
            kind = _host_kind(e["name"])
            if kind is None:
                continue
            iv = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            if kind == "flight":
                flights.append(iv)
                continue
            t = threads.setdefault((e.get("pid"), e.get("tid")), {"compute": [], "comm": []})
            t["comm" if kind == "comm" else "compute"].append(iv)
            if kind in named:
                named[kind].append(iv)
        if not kernels:
            comp, comms = [], list(flights)
            for t in threads.values():
                c = _union(t["comm"])
                comp.extend(_minus(_union(t["compute"]), c))
                comms.extend(c)
            comp = _union(comp)
            comm = _minus(_union(comms), comp)
        total = sum(b - a for a, b in steps)
        c_t = sum(_length(_clip(comp, a, b)) for a, b in steps)
        m_t = sum(_length(_clip(comm, a, b)) for a, b in steps)
        row = {"rank": _rank_of(path), "steps": len(steps), "source": "cuda" if kernels else "cpu",
               "step_ms": total / len(steps) / 1e3}
        for name, key in ((FORWARD, "forward_ms"), (BACKWARD, "backward_ms"), (OPTIMIZER, "optimizer_ms")):
            row[key] = sum(_length(_clip(_union(named[name]), a, b)) for a, b in steps) / len(steps) / 1e3
        row.update(compute=c_t / total, communication=m_t / total, idle=max(0.0, 1 - (c_t + m_t) / total))
        rows.append(row)
    return rows


def render_phase_table(rows: list[dict]) -> str:
    """The rows of :func:`phase_table` as a text table (times in ms per step, shares in %)."""
    head = f"{'rank':>5} {'steps':>5} {'src':>4} {'step ms':>9} {'forward':>9} {'backward':>9} {'optim':>8} " \
           f"{'compute':>8} {'comm':>6} {'idle':>6}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['rank']:>5} {r['steps']:>5} {r['source']:>4} {r['step_ms']:>9.1f} {r['forward_ms']:>9.1f} "
                     f"{r['backward_ms']:>9.1f} {r['optimizer_ms']:>8.1f} {r['compute']:>7.0%} "
                     f"{r['communication']:>6.0%} {r['idle']:>6.0%}")
    return "\n".join(lines)
