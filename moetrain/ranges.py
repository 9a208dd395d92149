"""Named ranges in profiles: what a trace calls each phase of a step.

:func:`phase` marks a region for ``torch.profiler`` (a ``record_function`` range, which costs a
flag check when no profiler runs) and, once CUDA is initialised, for Nsight Systems (an NVTX range).
The trainer, the step runners and the token exchanges mark their regions with the names below;
``python -m moetrain.monitor RUN --profile`` sorts a trace's time by them
(:mod:`moetrain.train.profile`), together with the ranges torch itself records: FSDP2's
``FSDP::all_gather`` / ``FSDP::post_backward_reduce``, the pipeline runtime's ``PP:<action>`` and the
collectives (``c10d::…``, ``gloo:…``, ``nccl:…``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch.profiler import record_function

__all__ = ["STEP", "FORWARD", "BACKWARD", "OPTIMIZER", "DISPATCH", "COMBINE", "ALL_TO_ALL", "WAIT", "phase", "observe"]

STEP = "moetrain.step"
FORWARD = "moetrain.forward"  # one micro-batch's forward (loss included)
BACKWARD = "moetrain.backward"  # one micro-batch's backward
OPTIMIZER = "moetrain.optimizer"  # the optimizer step (gradient norm and clipping before it excluded)
DISPATCH = "moetrain.dispatch"  # an expert dispatch all-to-all (its backward: DISPATCH + "_backward")
COMBINE = "moetrain.combine"  # an expert combine all-to-all (likewise)
ALL_TO_ALL = "moetrain.all_to_all"  # another token all-to-all
WAIT = ".wait"  # suffix of the range in which a transfer is waited for (exposed communication)


# (enter, exit) callables told of every range, process-wide (the trainer's per-phase memory meter).
_observers: list[tuple[Callable[[str], None], Callable[[str], None]]] = []


@contextmanager
def phase(name: str) -> Iterator[None]:
    """The enclosed code as a range called ``name`` in profiles (and NVTX on CUDA)."""
    nvtx = torch.cuda.is_initialized()
    if nvtx:
        torch.cuda.nvtx.range_push(name)
    for enter, _ in _observers:
        enter(name)
    try:
        with record_function(name):
            yield
    finally:
        for _, leave in _observers:
            leave(name)
        if nvtx:
            torch.cuda.nvtx.range_pop()


@contextmanager
def observe(enter: Callable[[str], None], leave: Callable[[str], None]) -> Iterator[None]:
    """Call ``enter(name)`` / ``leave(name)`` at every range's start and end while the block
    runs (host-side bookkeeping only: they must not synchronize a device)."""
    _observers.append((enter, leave))
    try:
        yield
    finally:
        _observers.remove((enter, leave))
