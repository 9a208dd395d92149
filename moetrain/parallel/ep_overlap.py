"""Hide the expert all-to-all behind another micro-batch's compute (``parallel.ep_overlap``).

With gradient accumulation over n micro-batches, the step runs the forward of micro-batch i+1
*together with* the backward of micro-batch i (Megatron-Core's merged forward-backward,
``--overlap-moe-expert-parallel-comm``; DualPipe's overlapped chunks):

    F0 | B0+F1 | B1+F2 | ... | B(n-2)+F(n-1) | B(n-1)

Inside a merged pair the two sides take turns at their token all-to-alls (the dispatch and the
combine rows, in both directions): a side that has just *issued* one hands over to the other,
which computes until it issues its own all-to-all (or ends), then hands back; the first side
then waits for its transfer, which was in flight all that time. So each all-to-all overlaps the
other micro-batch's attention, router, experts or their backward:

    backward (mb i):  ... combine-bwd a2a ─┐                    ┌─ expert bwd ... dispatch-bwd a2a ─┐
    forward (mb i+1):                      └─ attention, router ┘   (dispatch a2a in flight)      └─ experts ...

The forward runs in the calling thread and the backward (one ``Tensor.backward`` call, as
without overlap) in a helper thread, but **exactly one of them runs at a time** (a baton, not
parallelism): the order of every collective on a rank is fixed by the program, the same on all
ranks, and each micro-batch's arithmetic is the step without overlap's, op for op — so losses and
gradients are equal to it bit for bit (tests/test_ep_overlap.py). The transfer itself proceeds
in the communication library's own threads (gloo) or stream (NCCL) while the other side computes.

Under pipeline parallelism the 1F1B schedules pair each backward with the forward that follows
it on the rank (:class:`moetrain.parallel.pipeline.MergedPairsSchedule`), with the same
:class:`MergedPair`.

With ``parallel.delay_wgrad_compute`` a pair's backward also splits its GEMMs' weight gradients
from their input gradients (:mod:`moetrain.model.wgrad`): the GEMMs leave dW in the micro-batch's
:class:`Slot`, which computes it right after the backward issues its next transfer, before the
hand-over, so the transfer leaves earlier and travels during the weight GEMMs as well:

    backward (mb i):  ... experts dX ─ dispatch-bwd a2a issued ─ experts dW ─┐
    forward (mb i+1):                                                        └─ experts ...

FSDP2's post-backward of a parameter group waits for the group's deferred gradients
(:func:`hold_for_weight_grads`). Still bit for bit the step without overlap.

What it costs: two micro-batches' activations are alive in a pair (as in Megatron-Core). What it
needs (refused otherwise by :func:`moetrain.config.validate`): ep > 1, with pp > 1 the 1F1B or
interleaved 1F1B schedule, no full-block recomputation, no ``train.compile`` (the hand-overs are
Python), and ZeRO stage 0-2: under ZeRO-3 FSDP frees a block's parameters after that block's
backward, while the other micro-batch's forward may be inside the same block.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from moetrain.internals import queue_backward_callback
from moetrain.model.wgrad import weight_grads_to
from moetrain.parallel.exchange import Exchange
from moetrain.parallel.peers import waiting_on_peers

FORWARD, BACKWARD = 0, 1
_SIDE_NAMES = ("forward", "backward")


class TurnTaking:
    """Two sides of a merged pair, :data:`FORWARD` and :data:`BACKWARD`, of which exactly one
    runs at a time. The backward side has the first turn. ``events`` (when a list is given)
    records ``(side name, what)`` for the structural test: ``issue`` at each hand-over with a
    transfer in flight, ``resume`` when that side runs again, ``done`` at its end."""

    def __init__(self, events: list[tuple[str, str]] | None = None):
        self._cond = threading.Condition()
        self._turn = BACKWARD
        self._done = [False, False]
        self._ending = [False, False]  # in let_other_finish: takes no more turns
        self.events = events

    def log(self, side: int, what: str) -> None:
        if self.events is not None:
            self.events.append((_SIDE_NAMES[side], what))

    def wait_turn(self, side: int) -> None:
        """Block until it is ``side``'s turn (or the other side has ended)."""
        with self._cond:
            self._cond.wait_for(lambda: self._turn == side or self._done[1 - side])

    def hand_over(self, side: int) -> None:
        """Called by ``side`` right after issuing an all-to-all: the other side runs until its
        next hand-over or its end; returns when ``side`` may go on. A no-op once the other side
        has ended (nothing left to overlap with)."""
        with self._cond:
            if self._done[1 - side] or self._ending[1 - side]:
                return
            self.log(side, "issue")
            self._turn = 1 - side
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == side or self._done[1 - side])
            self.log(side, "resume")

    def let_other_finish(self, side: int) -> None:
        """``side`` has nothing left to overlap: the other side runs to its end, then this
        returns (the backward side calls it before FSDP's end-of-backward callback, so that
        runs with the forward complete, as after a plain forward)."""
        with self._cond:
            self._ending[side] = True
            if self._done[1 - side]:
                return
            self._turn = 1 - side
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._done[1 - side])

    def finish(self, side: int) -> None:
        """``side`` has ended (also on an error: the other side must not wait for it)."""
        with self._cond:
            self._done[side] = True
            self.log(side, "done")
            self._turn = 1 - side
            self._cond.notify_all()


class Slot:
    """One micro-batch's place in the schedule: which pair it belongs to now and on which side.
    Its all-to-alls keep a reference to it, so the backward of micro-batch i (paired with the
    forward of i+1) hands over in the pair it belongs to by then.

    With ``delay_wgrad`` (``parallel.delay_wgrad_compute``) it is also the micro-batch's
    :class:`~moetrain.model.wgrad.WeightGradStore`: while its backward runs in a pair, its GEMMs
    leave their weight gradients here, and :meth:`flush_weight_grads` computes them right after
    the backward issues its next all-to-all (they run while it travels) and at the backward's end.
    """

    def __init__(self, delay_wgrad: bool = False) -> None:
        self.turns: TurnTaking | None = None
        self.side = FORWARD
        self.delay_wgrad = delay_wgrad
        self._pending: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []
        # FSDP post-backwards that waited for this micro-batch's deferred weight gradients
        self._owed: list[Callable[[], None]] = []

    def while_in_flight(self) -> None:
        """Called with one of this micro-batch's all-to-alls in flight: the partner's turn."""
        turns = self.turns
        if turns is not None:
            turns.hand_over(self.side)

    # -- WeightGradStore (moetrain.model.wgrad) --

    def deferring(self) -> bool:
        """True while this micro-batch's backward runs in a pair with ``delay_wgrad``."""
        return self.delay_wgrad and self.turns is not None and self.side == BACKWARD

    def put(self, weight: torch.Tensor, compute: Callable[[], torch.Tensor]) -> None:
        self._pending.append((weight, compute))

    def has_pending_weight_grads(self) -> bool:
        return bool(self._pending)

    def owe(self, post_backward: Callable[[], None]) -> None:
        """Run ``post_backward`` (an FSDP parameter group's) after the next flush."""
        self._owed.append(post_backward)

    def flush_weight_grads(self) -> None:
        """Compute the deferred weight gradients and back-propagate them from the weights the
        GEMMs saw, in one ``torch.autograd.backward`` (so an unbound expert stack is stacked back
        once, as without the delay); then the FSDP post-backwards that waited for them."""
        if self._pending:
            pending, self._pending = self._pending, []
            with torch.no_grad():
                grads = [compute() for _, compute in pending]
            torch.autograd.backward([w for w, _ in pending], grads)
            if self.turns is not None:
                self.turns.log(BACKWARD, "wgrad")
        owed, self._owed = self._owed, []
        for post_backward in owed:
            post_backward()


_slot: ContextVar[Slot | None] = ContextVar("moetrain_ep_overlap_slot", default=None)


def current_slot() -> Slot | None:
    """The slot of the micro-batch whose forward runs in this context (None without overlap)."""
    return _slot.get()


@contextmanager
def forward_of(slot: Slot) -> Iterator[None]:
    """The enclosed forward belongs to ``slot``'s micro-batch (and its GEMMs' weight gradients
    go to it when it delays them)."""
    token = _slot.set(slot)
    try:
        with weight_grads_to(slot if slot.delay_wgrad else None):
            yield
    finally:
        _slot.reset(token)


# The slot whose backward runs in a pair with delayed weight gradients now (one per process: the
# pairs run one after the other), for the FSDP post-backward gate.
_deferring: list[Slot] = []


def hold_for_weight_grads(post_backward: Callable[[], None]) -> bool:
    """The hold of :func:`moetrain.internals.gate_post_backward` for delayed weight
    gradients: an FSDP parameter group's post-backward — its gradient accumulation or
    reduce-scatter, which FSDP starts when the group's module has its input gradient — that comes
    while the backward now running has weight gradients pending is taken (True) and run after
    that slot's next flush; otherwise (False) it runs at once."""
    slot = _deferring[-1] if _deferring else None
    if slot is not None and slot.has_pending_weight_grads():
        slot.owe(post_backward)
        return True
    return False


class InTurnExchange(Exchange):
    """The :class:`~moetrain.parallel.exchange.Exchange` of ``parallel.ep_overlap``: each
    transfer is issued, then the micro-batch that issued it hands over to its partner in the
    merged pair (the partner computes while the transfer is in flight), then waits for it. In a
    backward, with ``flush_wgrad``, the deferred weight gradients are computed first, while the
    transfer travels. The slot a transfer belongs to is the micro-batch's whose forward issued it,
    remembered for its backward (which runs in the pair's helper thread).

    Why every transfer, the small ones too (the hierarchical dispatcher's expert ids and routing
    weights): a collective queues behind whatever the partner left in flight on the same group
    (gloo sends a pair's messages in order on one connection; NCCL runs a communicator's work in
    order), so a small synchronous exchange right after a hand-over would wait for the partner's
    whole transfer and expose it."""

    def token(self) -> object:
        return current_slot()

    def transfer(self, out: torch.Tensor, inp: torch.Tensor, output_splits: list[int] | None,
                 input_splits: list[int] | None, token: object, backward: bool = False) -> Callable[[], None]:
        work = dist.all_to_all_single(out, inp, output_splits, input_splits, group=self.group, async_op=True)
        slot = token if isinstance(token, Slot) else None
        if slot is not None:
            if backward and self.flush_wgrad and slot.deferring():
                slot.flush_weight_grads()
            slot.while_in_flight()
        with waiting_on_peers():
            work.wait()
        return _arrived


def _arrived() -> None:
    return None


class MergedPair:
    """Run the backward of one micro-batch (``backward``, in a helper thread) and the forward of
    the next (``forward``, in this thread) as one merged pair; see the module docstring.
    ``prev``/``nxt``: their slots. Returns what ``forward`` returns; an error on either side is
    raised here, after both have stopped."""

    def __init__(self, prev: Slot, nxt: Slot, events: list[tuple[str, str]] | None = None):
        self.turns = TurnTaking(events)
        self.prev, self.nxt = prev, nxt

    def run(self, backward: Callable[[Callable[[], None]], None], forward: Callable[[], object]) -> object:
        """``backward(at_end)`` must call ``at_end`` once its own work is over but before
        anything that must not run beside the forward (FSDP's end-of-backward callback):
        :func:`queue_at_end_of_backward` does that."""
        turns = self.turns
        self.prev.turns, self.prev.side = turns, BACKWARD
        self.nxt.turns, self.nxt.side = turns, FORWARD
        error: list[BaseException] = []

        prev = self.prev

        def at_end() -> None:
            prev.flush_weight_grads()  # before FSDP's end-of-backward callback
            turns.let_other_finish(BACKWARD)

        def backward_side() -> None:
            if prev.delay_wgrad:
                _deferring.append(prev)
            try:
                turns.wait_turn(BACKWARD)
                backward(at_end)
                if prev.has_pending_weight_grads():
                    raise RuntimeError("weight gradients were deferred after the backward's end: at_end was not "
                                       "called at the end of the backward")
            except BaseException as e:  # re-raised in the calling thread
                error.append(e)
            finally:
                if prev.delay_wgrad:
                    _deferring.remove(prev)
                turns.finish(BACKWARD)

        thread = threading.Thread(target=backward_side, name="moetrain-ep-overlap-backward", daemon=True)
        thread.start()
        try:
            turns.wait_turn(FORWARD)
            with forward_of(self.nxt):
                out = forward()
        finally:
            turns.finish(FORWARD)
            thread.join()
            self.prev.turns = self.nxt.turns = None
        if error:
            raise error[0]
        return out


def queue_at_end_of_backward(loss: torch.Tensor, at_end: Callable[[], None]) -> torch.Tensor:
    """``loss`` with a hook that, when the backward from it starts, queues ``at_end`` as the
    backward's first end-of-backward callback (before FSDP's, which its root queues when the
    gradient reaches the model's output)."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        queue_backward_callback(at_end)
        return grad

    if loss.requires_grad:
        loss.register_hook(hook)
    return loss
