"""Deferred weight gradients (moetrain/model/wgrad.py, ``parallel.delay_wgrad_compute``).

The three GEMMs must compute what autograd computes for ``F.linear``, ``a @ b`` and
``F.grouped_mm`` — bit for bit, forward, input gradient and weight gradient — whether the
weight gradient is computed at once or deferred to a store and back-propagated from the weight
later (through the casts, shards and unbound expert slices the forward used). In one process,
fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.model import wgrad
from moetrain.model.layers import Linear
from moetrain.model.moe import GroupedExperts
from moetrain.parallel.ep_overlap import DeferredWeightGrads


def Store(defer: bool) -> DeferredWeightGrads:
    """ep_overlap's store of one micro-batch's weight gradients, deferring as in a merged pair's
    backward (``defer``) or not."""
    store = DeferredWeightGrads()
    store.in_pair = defer
    return store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("defer", [False, True])
def test_linear_matches_autograd_bit_for_bit(dtype, defer):
    torch.manual_seed(0)
    x0 = torch.randn(2, 7, 16)
    lin = Linear(16, 24, bias=False)
    lin.compute_dtype = dtype  # the weight cast to the compute dtype at use: its backward runs at the flush
    runs = []
    for store in (None, Store(defer)):
        x = x0.clone().to(dtype).requires_grad_()
        lin.zero_grad()
        with wgrad.weight_grads_to(store):
            y = lin(x)
        g = torch.linspace(-1, 1, y.numel()).view_as(y).to(dtype)
        y.backward(g)
        if store is not None:
            assert (lin.weight.grad is None or not lin.weight.grad.any()) == defer
            assert len(store) == int(defer)
            if defer:
                store.flush()
        runs.append((y.detach(), x.grad.clone(), lin.weight.grad.clone()))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_weight_grads_deferred_then_flushed_match_autograd(backend, dtype):
    torch.manual_seed(1)
    experts = GroupedExperts(16, 8, 4, backend=backend)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    experts.compute_dtype = dtype
    counts = torch.tensor([3, 0, 5, 2])  # an empty expert still gets its (zero) gradient
    x0 = torch.randn(10, 16)
    runs = []
    for store in (None, Store(True)):
        experts.zero_grad()
        x = x0.clone().to(dtype).requires_grad_()
        with wgrad.weight_grads_to(store):
            y = experts(x, counts, counts.tolist())
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y).to(dtype))
        if store is not None:
            assert len(store) == (12 if backend == "loop" else 3)  # 3 GEMMs per expert, or per group
            store.flush()
        runs.append((y.detach(), x.grad.clone(), *(p.grad.clone() for p in (experts.w1, experts.w3, experts.w2))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_without_a_store_the_plain_functions_run():
    """No store (one process, no overlap): no custom autograd node in the graph."""
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(2, 3)
    assert type(wgrad.linear(x, w).grad_fn).__name__ == "MmBackward0"
    assert type(wgrad.mm(torch.randn(2, 4), w).grad_fn).__name__ == "MmBackward0"
    with wgrad.weight_grads_to(Store(True)):
        assert type(wgrad.linear(x, w).grad_fn).__name__ == "_LinearBackward"
        assert type(wgrad.mm(torch.randn(2, 4), w).grad_fn).__name__ == "_MMBackward"
