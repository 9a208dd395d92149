"""How one optimizer step's micro-batches run: the one component that orders forwards and backwards.

:func:`build_runner` builds it for a model built by :func:`moetrain.parallel.apply.build_model_parts`:

* plain gradient accumulation over the micro-batches (:class:`SingleStageRunner`);
* with ``parallel.ep_overlap``, merged forward / backward pairs that take turns at their token
  all-to-alls (:mod:`moetrain.parallel.ep_overlap`), and with few micro-batches each one run as
  two halves that pair up too (:func:`split_micro_batch`, ``parallel.ep_overlap_split``);
* under pipeline parallelism, torch's pipeline schedules (:class:`moetrain.parallel.pipeline.PipelineRunner`,
  merged 1F1B orders with the overlap);
* FSDP2's per-micro-batch gradient sync and resharding (:class:`MicroBatchSync`; under pp the
  schedule drives FSDP itself);
* with ``parallel.delay_wgrad_compute``, the gate that holds FSDP's reductions until the deferred
  weight gradients are in (:func:`moetrain.internals.gate_post_backward`).

The trainer calls :meth:`StepRunner.forward_backward` once per step and never orders micro-batches
itself.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch.distributed.fsdp import FSDPModule

from moetrain.config import Config, overlap_split
from moetrain.data.loader import IGNORE_INDEX, MicroBatch
from moetrain.internals import gate_post_backward
from moetrain.model.loss import model_loss
from moetrain.model.transformer import Transformer
from moetrain.parallel.ep_overlap import MergedPair, Slot, forward_of, hold_for_weight_grads, queue_at_end_of_backward
from moetrain.parallel.pipeline import PipelineRunner
from moetrain.parallel.state import PP, ParallelState
from moetrain.parallel.tensor import loss_context
from moetrain.ranges import BACKWARD, FORWARD, phase

__all__ = ["MicroBatchSync", "SingleStageRunner", "StepRunner", "build_runner", "split_micro_batch"]


class StepRunner(Protocol):
    """Runs forward and backward of one optimizer step's micro-batches over the model parts."""

    def forward_backward(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Back-propagate objective/len(micro_batches) per micro-batch; return the sums of the
        micro-batches' LM and MTP losses as float64 [2] on the training device (0 on ranks that
        compute no loss, and without MTP), without reading it to the host."""

    def forward_only(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Sum of LM losses without gradients (validation); same conventions."""

    def forwards_per_step(self, micro_batches: int) -> int:
        """How many forward passes a step of ``micro_batches`` runs (what the MoE layers' losses
        and statistics are averaged over)."""


def split_micro_batch(mb: MicroBatch) -> list[MicroBatch]:
    """``mb`` as two halves of its samples whose losses add up to ``mb``'s: each keeps the whole
    micro-batch's loss divisor (with none, the count of its trained targets: a device scalar, no
    host read), so each half's loss is its summed token losses over that count.

    Raises:
        ValueError: an odd number of samples.
    """
    B = mb.inputs.shape[0]
    if B % 2:
        raise ValueError(f"a micro-batch of {B} samples does not split into two halves")
    divisor = mb.loss_divisor
    if divisor is None:
        lm_targets = mb.targets if mb.targets.dim() == 2 else mb.targets[..., 0]
        divisor = (lm_targets != IGNORE_INDEX).sum().clamp(min=1)
    h = B // 2
    return [MicroBatch(mb.inputs[s], mb.targets[s], None if mb.doc_ids is None else mb.doc_ids[s], divisor,
                       padding=None if mb.padding is None else mb.padding[s])
            for s in (slice(0, h), slice(h, B))]


class SingleStageRunner:
    """Gradient accumulation over micro-batches on a model that is not pipelined; with
    ``ep_overlap`` (``parallel.ep_overlap``) the forward of each micro-batch runs merged with the
    backward of the one before it (:mod:`moetrain.parallel.ep_overlap`), and with ``split``
    (:func:`moetrain.config.overlap_split`) each micro-batch runs as two halves that pair up the
    same way (:func:`split_micro_batch`)."""

    def __init__(self, model: Transformer, ps: ParallelState, ep_overlap: bool = False,
                 delay_wgrad: bool = False, split: bool = False):
        self.model, self.ps, self.device = model, ps, ps.device
        self.ep_overlap, self.delay_wgrad = ep_overlap, delay_wgrad
        self.split = ep_overlap and split
        # Called as (index, count) before each micro-batch's backward is due (before its forward
        # without overlap): FSDP's gradient sync and resharding (MicroBatchSync); None in one
        # process. Its settings act in the backward only.
        self.before_micro_batch: Callable[[int, int], None] | None = None

    def _loss(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(objective, LM loss, MTP loss or None); ``mb.targets`` [B, S, 1 + 2D] carries the MTP
        targets (:func:`moetrain.model.transformer.future_tokens`)."""
        with phase(FORWARD):
            doc_ids = mb.doc_ids.to(self.device) if mb.doc_ids is not None else None
            targets = mb.targets.to(self.device)
            future = targets if targets.dim() == 3 else None
            padding = mb.padding.to(self.device) if mb.padding is not None else None
            logits = self.model(mb.inputs.to(self.device), doc_ids=doc_ids, future=future, padding=padding)
            return model_loss(logits, targets, self.model.model_cfg.mtp_loss_coef, mb.loss_divisor)

    def forwards_per_step(self, micro_batches: int) -> int:
        return 2 * micro_batches if self.split else micro_batches

    def forward_backward(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        if self.split:
            halves = [h for mb in micro_batches for h in split_micro_batch(mb)]
            return self._merged_forward_backward(halves, len(micro_batches))
        if self.ep_overlap and len(micro_batches) > 1:
            return self._merged_forward_backward(micro_batches, len(micro_batches))
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i, mb in enumerate(micro_batches):
            if self.before_micro_batch is not None:
                self.before_micro_batch(i, len(micro_batches))
            with loss_context(self.ps):
                loss, lm, mtp = self._loss(mb)
                with phase(BACKWARD):
                    (loss / len(micro_batches)).backward()
            total[0] += _full_tensor(lm).detach()
            if mtp is not None:
                total[1] += _full_tensor(mtp).detach()
        return total

    def _merged_forward_backward(self, micro_batches: list[MicroBatch], divide: int) -> torch.Tensor:
        """F0 | B0+F1 | ... | B(n-2)+F(n-1) | B(n-1): the same micro-batches, losses and
        gradient accumulation order as :meth:`forward_backward`, each pair taking turns at its
        all-to-alls; each objective is divided by ``divide`` (the step's micro-batches: halves of
        one add up to it)."""
        n = len(micro_batches)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        slots = [Slot(self.delay_wgrad) for _ in micro_batches]

        def backward(i: int, loss: torch.Tensor, at_end: Callable[[], None] | None = None) -> None:
            if self.before_micro_batch is not None:
                self.before_micro_batch(i, n)
            scaled = loss / divide
            if at_end is not None:
                scaled = queue_at_end_of_backward(scaled, at_end)
            with phase(BACKWARD):
                scaled.backward()

        def add(lm: torch.Tensor, mtp: torch.Tensor | None) -> None:
            # After the pair: DTensor losses (tp) reduce over tp, a collective no side may interleave.
            total[0] += _full_tensor(lm).detach()
            if mtp is not None:
                total[1] += _full_tensor(mtp).detach()

        # loss_parallel is process-wide, not per thread: entered once around both sides.
        with loss_context(self.ps):
            with forward_of(slots[0]):
                loss, lm, mtp = self._loss(micro_batches[0])
            add(lm, mtp)
            for i in range(1, n):
                pair = MergedPair(slots[i - 1], slots[i])
                prev, mb = loss, micro_batches[i]
                loss, lm, mtp = pair.run(lambda at_end, i=i, prev=prev: backward(i - 1, prev, at_end),
                                         lambda mb=mb: self._loss(mb))
                add(lm, mtp)
            backward(n - 1, loss)
        return total

    @torch.no_grad()
    def forward_only(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb in micro_batches:
            with loss_context(self.ps):
                total += _full_tensor(self._loss(mb)[1])
        return total


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: the whole value of a DTensor (a loss under tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class MicroBatchSync:
    """Called by the step runner before each micro-batch's backward is due: FSDP's gradient sync
    and resharding for the stage (module docstring). Stages 0 and 1: no reduction until the last
    micro-batch; 1 and 2: parameters kept unsharded until the last; 3: FSDP's defaults.

    With ``ep_overlap`` (:mod:`moetrain.parallel.ep_overlap`) stage 0 keeps its parameters'
    unsharded copies until the last backward too: a forward that runs through a block while the
    other micro-batch's backward is inside it finds FSDP's state there in backward, so FSDP takes
    it for a recomputation and registers no hooks for its backward, which must then find the
    parameters still in place (FSDP's end-of-backward callback reduces what no hook did)."""

    def __init__(self, modules: list[FSDPModule], stage: int, ep_overlap: bool = False):
        # stage and its pairing with ep_overlap are the validated config's (config.ep_overlap_blocker)
        self.modules, self.stage, self.ep_overlap = modules, stage, ep_overlap

    def __call__(self, index: int, count: int) -> None:
        """Before micro-batch ``index`` (0-based) of ``count``."""
        last = index == count - 1
        for m in self.modules:
            if self.stage in (0, 1):
                m.set_requires_gradient_sync(last, recurse=False)
            if self.stage in (1, 2) or self.ep_overlap:
                m.set_reshard_after_backward(last, recurse=False)


def build_runner(parts: list[Transformer], stages: list[int], cfg: Config, ps: ParallelState,
                 fsdp_modules: list[FSDPModule]) -> StepRunner:
    """The step runner for this rank's model ``parts`` (its pipeline ``stages``; one part without
    pp) and their FSDP2 modules: a pipeline schedule over the stages, or accumulation on one part,
    with FSDP's per-micro-batch sync and, with ``parallel.delay_wgrad_compute``, the
    weight-gradient gate."""
    runner: StepRunner = (PipelineRunner(parts, stages, cfg, ps) if ps.size(PP) > 1
                          else SingleStageRunner(parts[0], ps, cfg.parallel.ep_overlap,
                                                 cfg.parallel.delay_wgrad_compute, overlap_split(cfg)))
    if cfg.parallel.delay_wgrad_compute and fsdp_modules:
        # FSDP reduces a group's gradients once its module has its input gradient: with weight
        # gradients deferred past that point, it waits for them (moetrain.parallel.ep_overlap).
        gate_post_backward(fsdp_modules, hold_for_weight_grads)
    # Gradient sync / resharding per micro-batch (under pp the schedule drives FSDP: pipeline.py)
    if fsdp_modules and ps.size(PP) == 1:
        runner.before_micro_batch = MicroBatchSync(fsdp_modules, cfg.parallel.zero_stage, cfg.parallel.ep_overlap)
    return runner
