"""Telling an activation recomputation apart from the forward it repeats.

``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=recompute_context)``
runs the forward as usual and the recomputation in backward inside :func:`recomputing`, so code
with side effects in a forward (the MoE statistics) can skip them the second time:
:func:`is_recomputing` is true only there. ``context_fn`` is torch's public hook for exactly this;
the flag is a ``ContextVar``, so it is local to the thread that runs the recomputation (on CUDA,
autograd's device thread).
"""

from __future__ import annotations

import contextlib
import contextvars

_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("moetrain_recomputing", default=False)


class _Recomputing:
    """While active, :func:`is_recomputing` is true. Re-enterable: a checkpoint's recomputation
    can run more than once (a zero-bubble pipeline schedule splits the backward in two)."""

    def __init__(self) -> None:
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> None:
        self._tokens.append(_RECOMPUTING.set(True))

    def __exit__(self, *exc: object) -> None:
        _RECOMPUTING.reset(self._tokens.pop())


def recomputing() -> contextlib.AbstractContextManager:
    """A context in which :func:`is_recomputing` is true."""
    return _Recomputing()


def is_recomputing() -> bool:
    """True inside the backward-time recomputation of a checkpointed forward."""
    return _RECOMPUTING.get()


def recompute_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: (forward context, recompute
    context)."""
    return contextlib.nullcontext(), recomputing()
