"""Where a rank's main thread waits on its peers outside a ``torch.distributed`` call.

The hang watchdog (:mod:`moetrain.launch.lifecycle`) tells a hung rank from the ranks waiting on
it by what their main threads are doing. A collective called synchronously shows
``torch/distributed`` frames on the stack, but a wait on an async work handle
(``work.wait()``: a C++ call made from our code) and, on GPU, the host read that completes a
step's queued collectives do not. Those places run inside :func:`waiting_on_peers`, which the
watchdog reads from its own thread.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

_depth = 0  # only the main thread (the one that trains) changes it; the watchdog reads it


@contextmanager
def waiting_on_peers() -> Iterator[None]:
    """Mark the enclosed code as waiting on other ranks (nestable; no cost beyond an int)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def is_waiting_on_peers() -> bool:
    """True while the main thread is inside :func:`waiting_on_peers`."""
    return _depth > 0
