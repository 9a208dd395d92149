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
:class:`DeferredWeightGrads`, which computes it right after the backward issues its next transfer, before the
hand-over, so the transfer leaves earlier and travels during the weight GEMMs as well:

    backward (mb i):  ... experts dX ─ dispatch-bwd a2a issued ─ experts dW ─┐
    forward (mb i+1):                                                        └─ experts ...

FSDP2's post-backward of a parameter group waits for the group's deferred gradients
(:func:`hold_for_weight_grads`). Still bit for bit the step without overlap.

The turn-taking is logged at DEBUG level on the ``moetrain.ep_overlap`` logger, one record per
event with ``side`` (``forward`` / ``backward``) and ``what`` (``issue``: a hand-over with a
transfer in flight; ``resume``: that side runs again; ``wgrad``: deferred weight gradients
computed; ``done``: the side ended) as record attributes: what to read when an overlap hangs or
hides less than it should (tests/test_ep_overlap.py reads it to check the order).

What it costs: two micro-batches' activations are alive in a pair (as in Megatron-Core). What it
needs (refused otherwise by :func:`moetrain.config.validate`): ep > 1, with pp > 1 the 1F1B or
interleaved 1F1B schedule, no full-block recomputation, no ``train.compile`` (the hand-overs are
Python), and ZeRO stage 0-2: under ZeRO-3 FSDP frees a block's parameters after that block's
backward, while the other micro-batch's forward may be inside the same block.
"""

from __future__ import annotations

import logging
import threading
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from moetrain.internals import queue_backward_callback
from moetrain.model.wgrad import weight_grads_to
from moetrain.parallel.exchange import Exchange
from moetrain.parallel.peers import waiting_on_peers
from moetrain.ranges import ALL_TO_ALL, WAIT, phase

FORWARD, BACKWARD = 0, 1
_SIDE_NAMES = ("forward", "backward")
_log = logging.getLogger(__name__)


def _event(side: int, what: str) -> None:
    """One turn-taking event at DEBUG level (module docstring)."""
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("%s %s", _SIDE_NAMES[side], what, extra={"side": _SIDE_NAMES[side], "what": what})


class TurnTaking:
    """Two sides of a merged pair, :data:`FORWARD` and :data:`BACKWARD`, of which exactly one
    runs at a time. The backward side has the first turn. Each hand-over, resumption and end is
    logged (:func:`_event`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn = BACKWARD
        self._done = [False, False]
        self._ending = [False, False]  # in let_other_finish: takes no more turns

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
            _event(side, "issue")
            self._turn = 1 - side
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == side or self._done[1 - side])
            _event(side, "resume")

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
            _event(side, "done")
            self._turn = 1 - side
            self._cond.notify_all()


class DeferredWeightGrads:
    """One micro-batch's :class:`~moetrain.model.wgrad.WeightGradStore` under
    ``parallel.delay_wgrad_compute``: while its backward runs in a merged pair (``in_pair``), its
    GEMMs leave their weight gradients here, and :meth:`flush` computes them right after the
    backward issues its next all-to-all (they run while it travels) and at the backward's end."""

    def __init__(self) -> None:
        self.in_pair = False
        self._pending: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []
        # FSDP post-backwards that waited for this micro-batch's deferred weight gradients
        self._owed: list[Callable[[], None]] = []

    def deferring(self) -> bool:
        """True while this micro-batch's backward runs in a pair."""
        return self.in_pair

    def put(self, weight: torch.Tensor, compute: Callable[[], torch.Tensor]) -> None:
        self._pending.append((weight, compute))

    def has_pending(self) -> bool:
        return bool(self._pending)

    def __len__(self) -> int:
        """How many weight gradients are pending."""
        return len(self._pending)

    def owe(self, post_backward: Callable[[], None]) -> None:
        """Run ``post_backward`` (an FSDP parameter group's) after the next flush."""
        self._owed.append(post_backward)

    def flush(self) -> None:
        """Compute the deferred weight gradients and back-propagate them from the weights the
        GEMMs saw, in one ``torch.autograd.backward`` (so an unbound expert stack is stacked back
        once, as without the delay); then the FSDP post-backwards that waited for them."""
        if self._pending:
            pending, self._pending = self._pending, []
            with torch.no_grad():
                grads = [compute() for _, compute in pending]
            torch.autograd.backward([w for w, _ in pending], grads)
            _event(BACKWARD, "wgrad")
        owed, self._owed = self._owed, []
        for post_backward in owed:
            post_backward()


class Slot:
    """One micro-batch's place in the schedule: which pair it belongs to now (``turns``) and on
    which side. Its all-to-alls keep a reference to it, so the backward of micro-batch i (paired
    with the forward of i+1) hands over in the pair it belongs to by then. ``weight_grads``: its
    deferred weight gradients with ``delay_wgrad`` (``parallel.delay_wgrad_compute``), else None.
    """

    def __init__(self, delay_wgrad: bool = False) -> None:
        self.turns: TurnTaking | None = None
        self.side = FORWARD
        self.weight_grads = DeferredWeightGrads() if delay_wgrad else None

    def while_in_flight(self) -> None:
        """Called with one of this micro-batch's all-to-alls in flight: the partner's turn."""
        turns = self.turns
        if turns is not None:
            turns.hand_over(self.side)


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
        with weight_grads_to(slot.weight_grads):
            yield
    finally:
        _slot.reset(token)


# The deferred weight gradients of the backward that runs in a pair now (one per process: the
# pairs run one after the other), for the FSDP post-backward gate.
_deferring: list[DeferredWeightGrads] = []


def hold_for_weight_grads(post_backward: Callable[[], None]) -> bool:
    """The hold of :func:`moetrain.internals.gate_post_backward` for delayed weight
    gradients: an FSDP parameter group's post-backward — its gradient accumulation or
    reduce-scatter, which FSDP starts when the group's module has its input gradient — that comes
    while the backward now running has weight gradients pending is taken (True) and run after
    that backward's next flush; otherwise (False) it runs at once."""
    weight_grads = _deferring[-1] if _deferring else None
    if weight_grads is not None and weight_grads.has_pending():
        weight_grads.owe(post_backward)
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
                 input_splits: list[int] | None, token: object, backward: bool = False,
                 name: str = ALL_TO_ALL) -> Callable[[], None]:
        with phase(name):
            work = dist.all_to_all_single(out, inp, output_splits, input_splits, group=self.group, async_op=True)
        slot = token if isinstance(token, Slot) else None
        if slot is not None:
            if backward and self.flush_wgrad and slot.weight_grads is not None and slot.weight_grads.deferring():
                slot.weight_grads.flush()
            slot.while_in_flight()
        with phase(name + WAIT), waiting_on_peers():
            work.wait()
        return _arrived


def _arrived() -> None:
    return None


class MergedPair:
    """Run the backward of one micro-batch (``backward``, in a helper thread) and the forward of
    the next (``forward``, in this thread) as one merged pair; see the module docstring.
    ``prev``/``nxt``: their slots. Returns what ``forward`` returns; an error on either side is
    raised here, after both have stopped."""

    def __init__(self, prev: Slot, nxt: Slot):
        self.turns = TurnTaking()
        self.prev, self.nxt = prev, nxt

    def run(self, backward: Callable[[Callable[[], None]], None], forward: Callable[[], object]) -> object:
        """``backward(at_end)`` must call ``at_end`` once its own work is over but before
        anything that must not run beside the forward (FSDP's end-of-backward callback):
        :func:`queue_at_end_of_backward` does that."""
        turns = self.turns
        self.prev.turns, self.prev.side = turns, BACKWARD
        self.nxt.turns, self.nxt.side = turns, FORWARD
        error: list[BaseException] = []

        weight_grads = self.prev.weight_grads
        on_callers_device = _callers_device_and_stream()

        def at_end() -> None:
            if weight_grads is not None:
                weight_grads.flush()  # before FSDP's end-of-backward callback
            turns.let_other_finish(BACKWARD)

        def backward_side() -> None:
            if weight_grads is not None:
                weight_grads.in_pair = True
                _deferring.append(weight_grads)
            try:
                turns.wait_turn(BACKWARD)
                with on_callers_device():
                    backward(at_end)
                if weight_grads is not None and weight_grads.has_pending():
                    raise RuntimeError("weight gradients were deferred after the backward's end: at_end was not "
                                       "called at the end of the backward")
            except BaseException as e:  # re-raised in the calling thread
                error.append(e)
            finally:
                if weight_grads is not None:
                    weight_grads.in_pair = False
                    _deferring.remove(weight_grads)
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


def _callers_device_and_stream() -> Callable[[], AbstractContextManager]:
    """What puts another thread on the calling thread's CUDA device and stream, both of which are
    per thread (a new thread starts on device 0 and its default stream): the backward side of a
    pair then creates its tensors (the loss's initial gradient) on the rank's GPU, in the order of
    the stream its forward ran on. Nothing to do on the CPU."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return nullcontext
    device, stream = torch.cuda.current_device(), torch.cuda.current_stream()

    @contextmanager
    def on_device() -> Iterator[None]:
        torch.cuda.set_device(device)
        with torch.cuda.stream(stream):
            yield
    return on_device


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
