"""Memory per phase of a step, the planner's prediction beside it, and CUDA memory snapshots.

:class:`PhaseMemory` watches the forward, backward and optimizer ranges of each step
(:func:`moetrain.ranges.observe`) and keeps each phase's peak: on CUDA the caching allocator's
peak allocated and reserved bytes during the phase (its peak counter is reset when a phase
starts: host-side statistics, no device sync), on the CPU the resident set size when the phase
ends (the CPU has no per-phase peak counter; the process's peak RSS is the run's ``mem_gib``).
With ``parallel.ep_overlap`` a forward and a backward alternate inside a merged pair, so a peak is
the pair's, counted for the phase that ended last.

On CUDA, :func:`start_memory_history` records every allocation's stack
(``train.memory_history``) and :func:`dump_memory_snapshot` writes the allocator's state — what an
out-of-memory error leaves behind — as a pickle that PyTorch's memory viewer
(https://pytorch.org/memory_viz) reads. Both go through :mod:`moetrain.internals` (private API).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import torch

from moetrain.config import Config
from moetrain.internals import dump_cuda_memory_snapshot, record_cuda_memory_history
from moetrain.ranges import BACKWARD, FORWARD, OPTIMIZER

__all__ = ["PhaseMemory", "dump_memory_snapshot", "predicted_memory_gib", "start_memory_history"]

PHASES = {FORWARD: "forward", BACKWARD: "backward", OPTIMIZER: "optimizer"}
GIB = 2**30


def _rss_bytes() -> int:
    """This process's resident set size now (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class PhaseMemory:
    """Per-phase memory of the steps run inside :meth:`moetrain.ranges.observe` ``(self.enter,
    self.leave)``; :meth:`take` returns one step's and starts the next. ``peak_gib``: the run's
    peak so far (CUDA allocated; on the CPU the process's peak RSS)."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self._step: dict[str, dict[str, float]] = {}
        self._run_peak = 0.0

    def enter(self, name: str) -> None:
        if self.cuda and name in PHASES:
            torch.cuda.reset_peak_memory_stats(self.device)

    def leave(self, name: str) -> None:
        phase = PHASES.get(name)
        if phase is None:
            return
        if self.cuda:
            now = {"allocated_gib": torch.cuda.max_memory_allocated(self.device) / GIB,
                   "reserved_gib": torch.cuda.max_memory_reserved(self.device) / GIB}
            self._run_peak = max(self._run_peak, now["allocated_gib"])
        else:
            now = {"rss_gib": _rss_bytes() / GIB}
        seen = self._step.setdefault(phase, {})
        for k, v in now.items():
            seen[k] = max(seen.get(k, 0.0), v)

    def take(self) -> dict[str, dict[str, float]]:
        """This step's peaks by phase (``forward`` / ``backward`` / ``optimizer``), then reset."""
        out, self._step = self._step, {}
        return out

    def peak_gib(self) -> float:
        if self.cuda:
            return max(self._run_peak, torch.cuda.max_memory_allocated(self.device) / GIB)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def predicted_memory_gib(cfg: Config) -> float | None:
    """The planner's peak memory per GPU for ``cfg``'s model and layout (GiB; the fullest
    pipeline rank), or None where the planner does not model the config."""
    from moetrain.planner.layout import Layout
    from moetrain.planner.memory import MemoryAssumptions, memory_per_gpu
    from moetrain.planner.model import ModelShape

    try:
        shape = ModelShape.from_config(cfg)
        mem = memory_per_gpu(shape, Layout.from_config(cfg), cfg.train.global_batch_size,
                             MemoryAssumptions.for_train(cfg.train))
    except (ValueError, KeyError, NotImplementedError):
        return None
    return mem.total / GIB


def start_memory_history(max_entries: int = 100_000) -> None:
    """Record the stack of every CUDA allocation from now on (the snapshot's timeline)."""
    record_cuda_memory_history(max_entries)


def dump_memory_snapshot(run_dir: Path, rank: int, why: str) -> Path:
    """Write the CUDA allocator's state to ``<run_dir>/memory/<why>.rank<r>.pickle``; returns it."""
    path = Path(run_dir) / "memory" / f"{why}.rank{rank:05d}.pickle"
    path.parent.mkdir(parents=True, exist_ok=True)
    dump_cuda_memory_snapshot(str(path))
    return path
