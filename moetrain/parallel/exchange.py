"""The token all-to-all: the one way a dispatcher moves rows between ranks, and its one autograd path.

A dispatcher (:mod:`moetrain.parallel.expert`) is given an :class:`Exchange` bound to its process
group and calls it for every transfer: the dispatched rows (differentiable, in the wire format
``moe.dispatch_dtype`` asks for), the combined rows and routing weights (differentiable), and the
hierarchical dispatcher's expert ids (no autograd). How a transfer waits is the exchange's
business, not the dispatcher's:

* :class:`Exchange` issues the all-to-all and lets it travel until its rows are first needed
  (the shared experts compute meanwhile, :class:`moetrain.model.moe.MoE`); a backward transfer
  waits at once.
* ``moetrain.parallel.ep_overlap.InTurnExchange`` (``parallel.ep_overlap``) hands over to the
  partner micro-batch of a merged pair while the transfer is in flight, and computes deferred
  weight gradients meanwhile in a backward.

Rows: x_ND [N, D] (N rows of hidden D) leave as ``input_splits[r]`` rows to rank r and arrive as
[sum(output_splits), D] in x_ND's dtype; their gradient goes back the same way in the gradient's
own dtype (the compute dtype: a wire format is for the forward only).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from moetrain.model import fp8
from moetrain.parallel.peers import waiting_on_peers
from moetrain.ranges import ALL_TO_ALL, WAIT, phase

__all__ = ["Exchange"]


def _encode(x_ND: torch.Tensor, wire: torch.dtype | None) -> torch.Tensor:
    """x_ND in the wire format: itself (None, or its own dtype), float8 E4M3 rows packed with their
    scales (:func:`moetrain.model.fp8.pack`), or a cast (bf16)."""
    if wire is None or wire == x_ND.dtype:
        return x_ND
    return fp8.pack(x_ND) if wire == fp8.E4M3 else x_ND.to(wire)


def _decode(packet: torch.Tensor, D: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`_encode`: rows [R, D] in ``dtype``."""
    if packet.dtype == torch.uint8:
        return fp8.unpack(packet, D, dtype)
    return packet.to(dtype)


class _Rows(torch.autograd.Function):
    """The received rows as a function of the sent ones: forward decodes what arrived (``recv``,
    held in a list so that autograd does not take it for an input); backward sends the gradient
    of the received rows back to their senders through the same exchange (reversed splits)."""

    @staticmethod
    def forward(ctx: Any, x_sent: torch.Tensor, recv: list[torch.Tensor], output_splits: list[int],
                input_splits: list[int], exchange: "Exchange", token: object, name: str) -> torch.Tensor:
        ctx.splits, ctx.exchange, ctx.token, ctx.rows_sent = (output_splits, input_splits), exchange, token, \
            x_sent.shape[0]
        ctx.name = name
        return _decode(recv[0], x_sent.shape[1], x_sent.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        output_splits, input_splits = ctx.splits
        grad_sent = grad.new_empty(ctx.rows_sent, *grad.shape[1:])
        ctx.exchange.transfer(grad_sent, grad.contiguous(), input_splits, output_splits, ctx.token, backward=True,
                              name=ctx.name + "_backward")()
        return grad_sent, None, None, None, None, None, None


class Exchange:
    """Uneven all-to-all over ``group``, the transport every dispatcher is given.

    ``flush_wgrad``: whether a backward transfer of this exchange is where deferred weight
    gradients are computed (meaningful for the in-turn exchange only; False for transfers too
    short to hide them, the hierarchical dispatcher's within an NVLink domain).
    """

    def __init__(self, group: dist.ProcessGroup, flush_wgrad: bool = True) -> None:
        self.group = group
        self.flush_wgrad = flush_wgrad

    def token(self) -> object:
        """What a transfer started now must remember for its backward (None here; the in-turn
        exchange: the micro-batch's slot)."""
        return None

    def transfer(self, out: torch.Tensor, inp: torch.Tensor, output_splits: list[int] | None,
                 input_splits: list[int] | None, token: object, backward: bool = False,
                 name: str = ALL_TO_ALL) -> Callable[[], None]:
        """Start the all-to-all of ``inp`` into ``out`` (rows; splits: host ints per rank, None for
        even); returns what waits for it. ``backward``: a transfer of the backward. ``name``: its
        range in profiles (:mod:`moetrain.ranges`; the wait is ``name + ".wait"``)."""
        with phase(name):
            work = dist.all_to_all_single(out, inp, output_splits, input_splits, group=self.group, async_op=True)

        def wait() -> None:
            with phase(name + WAIT), waiting_on_peers():
                work.wait()
        return wait

    def __call__(self, x_ND: torch.Tensor, output_splits: list[int], input_splits: list[int],
                 wire: torch.dtype | None = None, name: str = ALL_TO_ALL) -> Callable[[], torch.Tensor]:
        """Send x_ND [N, D] (``input_splits`` rows to each rank, ``output_splits`` from each) in
        ``wire``; returns what waits for and decodes the received rows: [sum(output_splits), D]
        in x_ND's dtype, differentiable with respect to x_ND. ``name``: the transfer's range in
        profiles (``moetrain.ranges.DISPATCH`` or ``COMBINE``; its gradient's is ``name + "_backward"``)."""
        with torch.no_grad():
            packet = _encode(x_ND, wire).contiguous()
        recv = packet.new_empty((sum(output_splits), *packet.shape[1:]))
        token = self.token()
        wait = self.transfer(recv, packet, output_splits, input_splits, token, name=name)

        def arrive() -> torch.Tensor:
            wait()
            return _Rows.apply(x_ND, [recv], output_splits, input_splits, self, token, name)
        return arrive

    def ids(self, out: torch.Tensor, inp: torch.Tensor, output_splits: list[int], input_splits: list[int],
            name: str = ALL_TO_ALL) -> None:
        """All-to-all of ``inp`` into ``out`` with no autograd (the hierarchical dispatcher's
        expert ids), waited for before returning."""
        self.transfer(out, inp, output_splits, input_splits, self.token(), name=name)()
