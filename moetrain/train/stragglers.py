"""Name the rank that slows every step (``train.straggler``).

A slow GPU, host or data path makes its rank late, and every other rank then waits for it in the
next collective: step times say only that the run is slow. What tells the slow rank apart is
how long each rank is *busy* — its whole cycle from the end of one step to the end of the next
(the step, and what the rank does between two steps: metrics, sinks, hooks, a GC pause, a host
contended by something else) less what it spent waiting for peers (the token all-to-alls' waits
and the dispatch counts' exchange: :mod:`moetrain.ranges`' ``….wait`` ranges; with
``parallel.ep_overlap`` only one side of a pair runs at a time, so the two threads' waits never
overlap). A slow data path is busy time too (it is in the step, outside the forward). The phase a
straggler is named for is the one (forward, backward, optimizer, or ``outside`` them: data,
metrics, the time between steps) in which it spends the most over the median rank.
:class:`StragglerDetector` watches those ranges
(:func:`moetrain.ranges.observe`), sums them per rank over a window of ``every`` steps — host
clocks on the CPU, CUDA events on a GPU, whose times are read once per window —, gathers the
sums of all ranks in one all-gather per window, and names a rank busier than the median rank by
more than ``threshold`` in ``windows`` windows in a row (Megatron-Core's ``StragglerDetector``
compares ranks the same way, by their own compute time).

Waits that moetrain does not mark count as busy time: FSDP2's gathers and reductions and the
receives of torch's own pipeline schedules. So a straggler is seen sharply where its peers wait
for it in an expert all-to-all (every MoE layer with ep > 1), and less so in a layout without
expert parallelism, where they wait in FSDP's collectives.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moetrain.ranges import BACKWARD, FORWARD, OPTIMIZER, STEP, WAIT

__all__ = ["Straggler", "StragglerDetector"]

_PHASES = {STEP: "step", FORWARD: "forward", BACKWARD: "backward", OPTIMIZER: "optimizer"}
# The per-rank sums a window gathers, in order (seconds).
FIELDS = ("busy", "forward", "backward", "optimizer", "outside", "waits", "step")
_NAMED = ("forward", "backward", "optimizer", "outside")  # what a straggler is named for


@dataclass(frozen=True)
class Straggler:
    """A rank named slow: ``factor`` is its busy time over the median rank's (last window);
    ``phase`` the phase it is slowest in relative to the median (``forward`` / ``backward`` /
    ``optimizer`` / ``outside`` them), ``phase_factor`` by how much."""

    rank: int
    node: str
    factor: float
    phase: str
    phase_factor: float
    windows: int


class _HostClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, a: float, b: float) -> float:
        return b - a


class _CudaClock:
    """CUDA events on the current stream: the device time between two marks, read once per
    window (``elapsed_time`` needs both events done: the window's last one is waited for)."""

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3


class StragglerDetector:
    """Busy time per rank over windows of ``every`` steps (module docstring). Call
    :meth:`enter` / :meth:`leave` from :func:`moetrain.ranges.observe` and :meth:`end_step` after
    each step on every rank (a collective every ``every`` steps). ``nodes``: each rank's node."""

    def __init__(self, every: int, threshold: float, windows: int, device: torch.device, nodes: list[str]):
        self.every, self.threshold, self.windows = every, threshold, windows
        self.device, self.nodes = device, nodes
        self._clock = _CudaClock() if device.type == "cuda" else _HostClock()
        self._open = threading.local()  # per thread: open ranges [(name, start mark)] (ep_overlap runs two)
        self._spans: list[tuple[str, str, Any, Any]] = []  # this window's (kind, phase it is in, start, end)
        self._lock = threading.Lock()
        self._streak = [0] * len(nodes)
        self._last_end: Any = None  # the mark at which the last step ended: the next cycle starts there
        self.last_table: list[list[float]] = []  # the last window's sums, a row of FIELDS per rank
        self.last_factors: list[float] = []  # each rank's busy time over the median's, last window

    def enter(self, name: str) -> None:
        if name in _PHASES or name.endswith(WAIT):
            stack = getattr(self._open, "stack", None)
            if stack is None:
                stack = self._open.stack = []
            now = self._clock.mark()
            if name == STEP and self._last_end is not None:
                # the time since the last step ended is this step's cycle too, outside its phases
                with self._lock:
                    self._spans.append(("step", "step", self._last_end, now))
            stack.append((name, now))

    def leave(self, name: str) -> None:
        if name in _PHASES or name.endswith(WAIT):
            stack = self._open.stack
            opened, start = stack.pop()
            assert opened == name, (opened, name)
            # a wait belongs to the innermost phase open on its thread (the step's own otherwise)
            owner = next((_PHASES[n] for n, _ in reversed(stack) if n in _PHASES), "step")
            end = self._clock.mark()
            with self._lock:
                self._spans.append((_PHASES.get(name, "waits"), owner, start, end))
            if name == STEP:
                self._last_end = end

    def _sums(self) -> list[float]:
        """This window's seconds by :data:`FIELDS`: ``step`` = the step-to-step cycles (each step
        and the time since the one before ended); ``busy`` = step − waits; each phase's time less
        the waits inside it; ``outside`` = busy − the phases' busy time (data, metrics, between
        steps)."""
        if isinstance(self._clock, _CudaClock) and self._spans:
            self._spans[-1][3].synchronize()
        span = dict.fromkeys(("step", "forward", "backward", "optimizer", "waits"), 0.0)
        waits_in = dict.fromkeys(("step", "forward", "backward", "optimizer"), 0.0)
        for kind, owner, a, b in self._spans:
            seconds = self._clock.seconds(a, b)
            span[kind] += seconds
            if kind == "waits":
                waits_in[owner] += seconds
        self._spans = []
        sums = {p: span[p] - waits_in[p] for p in ("forward", "backward", "optimizer")}
        sums.update(busy=span["step"] - span["waits"], waits=span["waits"], step=span["step"])
        sums["outside"] = max(0.0, sums["busy"] - sums["forward"] - sums["backward"] - sums["optimizer"])
        return [sums[k] for k in FIELDS]

    def end_step(self, step: int) -> list[Straggler]:
        """After step ``step`` on every rank: at a window's end, gather every rank's sums (one
        all-gather, one host read) and return the ranks slow in ``windows`` windows in a row
        (the same list on every rank); else []."""
        if step % self.every:
            return []
        mine = torch.tensor(self._sums(), dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in self.nodes]
        start = self._clock.mark()
        dist.all_gather(every, mine)
        # waiting for the other ranks here is a wait of the next cycle, like any collective's
        with self._lock:
            self._spans.append(("waits", "step", start, self._clock.mark()))
        return self.judge(torch.stack(every).tolist())

    def judge(self, table: list[list[float]]) -> list[Straggler]:
        """One window's sums (a row of :data:`FIELDS` per rank) → the ranks now named slow."""
        self.last_table = table
        medians = [statistics.median(row[i] for row in table) for i in range(len(FIELDS))]
        busy = FIELDS.index("busy")
        self.last_factors = [row[busy] / medians[busy] if medians[busy] > 0 else 1.0 for row in table]
        named = []
        for r, factor in enumerate(self.last_factors):
            self._streak[r] = self._streak[r] + 1 if factor > 1 + self.threshold else 0
            if self._streak[r] == self.windows:
                self._streak[r] = 0  # named again after as many windows if it stays slow
                extra = [(table[r][FIELDS.index(n)] - medians[FIELDS.index(n)], n) for n in _NAMED]
                phase = max(extra)[1]
                i = FIELDS.index(phase)
                phase_factor = table[r][i] / medians[i] if medians[i] > 0 else float("inf")
                named.append(Straggler(r, self.nodes[r], factor, phase, phase_factor, self.windows))
        return named
