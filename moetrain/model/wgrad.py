"""GEMMs whose weight gradient can be computed later than their input gradient.

``parallel.delay_wgrad_compute`` (Megatron-Core's ``--delay-wgrad-compute``; DualPipe's
``WeightGradStore``): in the backward of a merged pair (:mod:`moetrain.parallel.ep_overlap`) a
GEMM y = x·W returns dx at once and leaves dW = xᵀ·dy for later, so the gradient that the next
token all-to-all sends (the dispatch's, below the experts; the combine's, below the attention of
the layer above) leaves earlier, and the weight GEMMs then run while it travels.

The three GEMMs here compute what ``F.linear``, ``a @ b`` and ``F.grouped_mm`` compute, forward
and backward, with the ops autograd runs for them (the same ``mm`` / ``grouped_mm`` calls on the
same operands: bit for bit the same values, tests/test_wgrad.py). Where no store is set (one
process, no overlap) the model calls the plain functions. A store (:class:`WeightGradStore`) is
set per micro-batch by :func:`weight_grads_to` around its forward; at backward time it says
whether to defer: then the GEMM hands it the weight tensor *as the forward saw it* (the
parameter, or its cast / local shard / unbound slice) and a function that computes dW, and
returns no gradient for it. The store later computes the dW's and sends them into the graph
with one ``torch.autograd.backward(weights, dWs)``: the cast's, the shard's and the stacking's
backward run as they would have, and the gradient accumulates into the parameter the usual way.

Nothing of moetrain's parallel layer is imported here: the model stays a single-process model
(DTensor only to recognise tensor-parallel operands), and the store is the parallel layer's.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, Protocol

import torch
import torch.nn.functional as F


class WeightGradStore(Protocol):
    """Where the GEMMs of one micro-batch's forward send their weight gradients."""

    def deferring(self) -> bool:
        """At backward time: True to receive the weight gradients (:meth:`put`), False to let the
        GEMMs compute them at once."""

    def put(self, weight: torch.Tensor, compute: Callable[[], torch.Tensor]) -> None:
        """``compute()`` returns the gradient of ``weight`` (same shape and dtype); the store
        calls it later and back-propagates it from ``weight``."""


_STORE: contextvars.ContextVar[WeightGradStore | None] = contextvars.ContextVar("moetrain_wgrad_store", default=None)


@contextlib.contextmanager
def weight_grads_to(store: WeightGradStore | None) -> Iterator[None]:
    """The GEMMs of the enclosed forward report to ``store`` (None: plain GEMMs)."""
    token = _STORE.set(store)
    try:
        yield
    finally:
        _STORE.reset(token)


def _weight_grad(store: WeightGradStore, weight: torch.Tensor, compute: Callable[[], torch.Tensor]
                 ) -> torch.Tensor | None:
    """dW now (returned), or handed to ``store`` (None returned)."""
    if store.deferring():
        store.put(weight, compute)
        return None
    return compute()


class _Linear(torch.autograd.Function):
    """y = x·Wᵀ for x [..., in], W [out, in] (no bias), as ``F.linear`` computes it: the rows
    folded to [M, in], one ``mm``; backward dx = dy·W, dW = dyᵀ·x."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, store: WeightGradStore) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.store = store
        return x.reshape(-1, x.shape[-1]).mm(w.t()).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple:  # type: ignore[override]
        x, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dy2.mm(w).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            dw = _weight_grad(ctx.store, w, lambda: dy2.t().mm(x2))
        return dx, dw, None


class _MM(torch.autograd.Function):
    """a [M, K] @ b [K, N] (2-D), as ``torch.mm``; backward da = dy·bᵀ, db = aᵀ·dy."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, store: WeightGradStore) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b)
        ctx.store = store
        return a.mm(b)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple:  # type: ignore[override]
        a, b = ctx.saved_tensors
        da = dy.mm(b.t()) if ctx.needs_input_grad[0] else None
        db = _weight_grad(ctx.store, b, lambda: a.t().mm(dy)) if ctx.needs_input_grad[1] else None
        return da, db, None


class _GroupedMM(torch.autograd.Function):
    """``F.grouped_mm(x [N, K], w [G, K, M], offs=offs)``: rows offs[g-1]:offs[g] times w[g];
    backward dx = grouped_mm(dy, wᵀ), dW = grouped_mm(xᵀ, dy) (one [K, M] per group)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, store: WeightGradStore  # type: ignore[override]
                ) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        ctx.store = store
        return F.grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple:  # type: ignore[override]
        x, w, offs = ctx.saved_tensors
        dx = F.grouped_mm(dy, w.transpose(-2, -1), offs=offs) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = _weight_grad(ctx.store, w, lambda: F.grouped_mm(x.t(), dy, offs=offs))
        return dx, dw, None, None


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` (x [..., in], w [out, in] → [..., out]), its weight gradient deferrable
    to the store of this forward (:func:`weight_grads_to`); plain ``F.linear`` for tensor-parallel
    (DTensor) operands."""
    from torch.distributed.tensor import DTensor

    store = _STORE.get()
    # Tensor-parallel weights (DTensors) keep autograd's own GEMMs: their dW is computed at once.
    if store is None or not w.requires_grad or isinstance(w, DTensor) or isinstance(x, DTensor):
        return F.linear(x, w)
    return _Linear.apply(x, w, store)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for a [M, K], b [K, N] (b the weight), its weight gradient deferrable."""
    store = _STORE.get()
    if store is None or not b.requires_grad:
        return a @ b
    return _MM.apply(a, b, store)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm(x, w, offs=offs)`` for x [N, K], w [G, K, M], offs [G] int32 end rows
    (→ [N, M]), its weight gradient deferrable."""
    store = _STORE.get()
    if store is None or not w.requires_grad:
        return F.grouped_mm(x, w, offs=offs)
    return _GroupedMM.apply(x, w, offs, store)
