"""Pipeline parallelism: the model cut into stages of whole blocks, micro-batches run by a schedule.

Shape legend: B micro-batch size, S sequence length held by this rank (seq_len / cp), D hidden,
V vocabulary, n micro-batches per optimizer step on this rank, P = pp, v = virtual stages.

Split and placement (``split_model``, ``stage_ids``):

* the ``layers`` blocks are cut into P·v stages of ``layers / (P·v)`` consecutive blocks; stage 0
  also holds the embedding, the last stage the final norm and the head, and with multi-token
  prediction the MTP modules and a copy of the embedding (its gradient summed with stage 0's
  over :meth:`moetrain.parallel.state.ParallelState.stage_ends_group`, Megatron's embedding
  group; the gradient norm counts it once);
* the rank with pp coordinate r holds stages r, r + P, r + 2P, ... — the looped ("interleaved")
  placement of Narayanan et al. 2021, §2.2, which every schedule here uses (with v = 1 it is
  one stage per rank);
* every stage is a deep copy of the meta-device model with the blocks it does not own deleted:
  parameter names stay those of the full model, so initialisation (``moetrain.model.init``)
  and checkpoints do not depend on the layout.

Schedules (``parallel.pp_schedule``) map to ``torch.distributed.pipelining``: ``gpipe`` →
``ScheduleGPipe`` (Huang et al. 2019), ``1f1b`` → ``Schedule1F1B`` (PipeDream-Flush, Narayanan et
al. 2021 §2.2.1), ``interleaved_1f1b`` → ``ScheduleInterleaved1F1B`` (§2.2.2), ``zero_bubble`` →
``ScheduleInterleavedZeroBubble`` (ZB-1P, Qi et al. 2024: backward split into input and weight
gradients, the weight part filling the bubbles), looped placement for any v.

One step (:meth:`PipelineRunner.forward_backward`):

1. concatenate this rank's n micro-batches into one [n·B, S] batch; the schedule splits it
   back along dim 0 into the same n chunks, in order (``torch.tensor_split``);
2. the schedule runs forwards and backwards in its order, sending [B, S, D] activations and
   their gradients to the neighbouring stages;
3. the last stage's loss function returns lm_loss / n, so each micro-batch's backward is
   exactly the single-process one (``scale_grads=False``: no division of the gradients
   afterwards, which would also divide the MoE losses' gradients that the trainer already
   scaled by 1/n through ``MoE.aux_loss_scale``);
4. the MoE auxiliary losses need nothing here: :class:`moetrain.model.moe.AttachAuxLoss` hangs
   them on the activations, so their gradients flow through every stage's backward.

Composition with the other axes (each part goes through steps 3-8 of
:func:`moetrain.parallel.apply.build_model_parts` like a whole model):

* tensor parallelism: the residual stream between stages is a plain local tensor ([B, S/tp, D]
  under sequence parallelism, [B, S, D] without) and the head's vocabulary-sharded logits never
  leave the last stage, whose loss runs inside ``loss_parallel`` (forward and backward);
* context parallelism: the stages exchange the rank's S = seq_len / cp tokens;
* expert parallelism: the ep group lies inside one pipeline stage (expert mesh (pp, edp, ep,
  tp)), so its all-to-alls pair up in the same schedule order on all its ranks;
* ZeRO / FSDP: the schedule's stages drive FSDP themselves (gradient sync and resharding after
  backward off for every micro-batch, one reduce-scatter per stage after the last one): that
  is stage 1 of :mod:`moetrain.parallel.data_parallel` exactly; stages 2 and 3 give the same gradients
  but keep them unsharded (and stage 3 its parameters re-gathered in backward) until the
  step's last backward instead of reduce-scattering after each micro-batch — ZeRO-1 memory
  for gradients during accumulation. ZeRO-3 with ``zero_bubble`` is refused (wrong gradients,
  :func:`moetrain.config.check_supported`).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)
from torch.distributed.tensor import DTensor

from moetrain.config import Config, pipeline_stage_layers
from moetrain.data.loader import MicroBatch
from moetrain.internals import (
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    Action,
    LastStageOutputsUnchecked,
    PipelineRuntime,
    disable_backward,
    interleaved_1f1b_order,
)
from moetrain.model.transformer import Transformer
from moetrain.model.loss import model_loss
from moetrain.parallel.ep_overlap import MergedPair, Slot, forward_of, queue_at_end_of_backward
from moetrain.parallel.precision import compute_dtype
from moetrain.parallel.state import CP, PP, TP, ParallelState
from moetrain.parallel.tensor import loss_context
from moetrain import ranges

__all__ = ["MergedPairsSchedule", "PipelineRunner", "SCHEDULES", "merge_backward_with_next_forward", "one_f_one_b_order",
           "pipeline_parts", "split_model", "stage_blocks", "stage_ids"]

# pp_schedule → (schedule class, runs several stages per rank)
SCHEDULES: dict[str, tuple[type, bool]] = {
    "gpipe": (ScheduleGPipe, False),
    "1f1b": (Schedule1F1B, False),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, True),
    "zero_bubble": (ScheduleInterleavedZeroBubble, True),
}


def stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Stages held by the rank with pp coordinate ``pp_rank``: r, r + pp, ... (looped placement)."""
    return [pp_rank + k * pp for k in range(virtual_stages)]


def stage_blocks(stage: int, num_stages: int, layers: int, first: int | None = None,
                 last: int | None = None) -> range:
    """Global indices of the blocks of ``stage``: an even split, or the uneven one of
    :func:`moetrain.config.pipeline_stage_layers` when ``first`` / ``last`` are given.

    Raises:
        ValueError: the blocks do not split over ``num_stages`` stages that way.
    """
    counts = pipeline_stage_layers(layers, num_stages, first, last)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def split_model(model: Transformer, stages: list[int], num_stages: int, first: int | None = None,
                last: int | None = None) -> list[Transformer]:
    """One part per stage in ``stages``: a deep copy of the meta-device ``model`` without the blocks
    (and embedding / norm / head) that the stage does not own. Names stay global."""
    layers = len(model.layers)
    parts = []
    for s in stages:
        part = copy.deepcopy(model)
        keep = {str(i) for i in stage_blocks(s, num_stages, layers, first, last)}
        for name in [k for k in part.layers.keys() if k not in keep]:
            del part.layers[name]
        is_last = s == num_stages - 1
        if s != 0:
            part.embeds_input = False
            if not (is_last and len(part.mtp)):  # the MTP modules' copy (PipelineRunner syncs it)
                part.tok_embeddings = None
        if not is_last:
            part.norm = None
            part.output = None
            part.mtp = torch.nn.ModuleDict()
        parts.append(part)
    return parts


# -- parallel.ep_overlap under pipeline parallelism ---------------------------------------------

def one_f_one_b_order(rank: int, pp: int, n: int) -> list[Action]:
    """1F1B's compute order on pp rank ``rank`` (one stage per rank, stage = rank): ``pp - 1 -
    rank`` warm-up forwards, then a forward and a backward per step, then the cool-down backwards
    (PipeDream-Flush, Narayanan et al. 2021 §2.2.1; what ``Schedule1F1B`` runs)."""
    warmup = min(pp - 1 - rank, n)
    order = [Action(rank, FORWARD, i) for i in range(warmup)]
    for i in range(n - warmup):
        order += [Action(rank, FORWARD, warmup + i), Action(rank, FULL_BACKWARD, i)]
    return order + [Action(rank, FULL_BACKWARD, i) for i in range(n - warmup, n)]


def merge_backward_with_next_forward(order: list[Action | None]) -> list[Action]:
    """Each backward directly followed by a forward becomes one ``OVERLAP_F_B`` action with
    sub-actions (forward, backward); ``None`` (idle slots) are dropped. A forward never depends
    on a backward, so the two halves of a pair are independent by construction: on the last
    stage, where 1F1B runs F(i) B(i) F(i+1) ..., B(i) pairs with F(i+1) — Megatron-Core's extra
    warm-up forward of its combined 1F1B (``combined_1f1b.py``)."""
    out: list[Action] = []
    for a in order:
        if a is None:
            continue
        if a.computation_type == FORWARD and out and out[-1].computation_type == FULL_BACKWARD:
            out[-1] = Action(-1, OVERLAP_F_B, None, (a, out[-1]))
        else:
            out.append(a)
    return out


class MergedPairsSchedule(PipelineRuntime):
    """1F1B (one stage per rank) or interleaved 1F1B (``interleaved``: several) whose every
    backward that a forward follows runs merged with that forward, the two taking turns at their
    token all-to-alls (``parallel.ep_overlap``; :class:`moetrain.parallel.ep_overlap.MergedPair`).

    The compute order is the plain schedule's (:func:`one_f_one_b_order`, or
    ``ScheduleInterleaved1F1B``'s), merged by :func:`merge_backward_with_next_forward` and lowered
    with torch's send/recv and FSDP unshard/reshard/reduce passes (``OVERLAP_F_B`` is a runtime
    action with sub-actions, as in ``ScheduleDualPipeV``). Each stage still runs its micro-batches'
    forwards and backwards in the same order as without the overlap, so it accumulates the same
    gradients in the same order: the step is the plain schedule's, bit for bit.

    A pair waits for both halves' activations / gradients from the neighbouring stages before it
    starts, and sends both halves' results after it ends: the neighbour's pair waits for it (the
    price of the overlap at v = 1; Megatron-Core asks for virtual stages at pp > 1).
    """

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable, interleaved: bool,
                 delay_wgrad: bool = False):
        try:
            super().__init__(stages, n_microbatches, loss_fn)
        except NotImplementedError as e:
            raise NotImplementedError(f"parallel.ep_overlap with pp > 1: {e}; use pp = 1 or a newer torch") from e
        self.n_local_stages = len(stages)
        if interleaved:  # ScheduleInterleaved1F1B's order, computed by its own method
            self.number_of_rounds = max(1, n_microbatches // self.pp_group_size)
            self.microbatches_per_round = n_microbatches // self.number_of_rounds
            if n_microbatches % self.number_of_rounds:
                raise ValueError(f"interleaved 1F1B needs a multiple of {self.number_of_rounds} micro-batches, "
                                 f"got {n_microbatches}")
            plain = {r: interleaved_1f1b_order(self, r) for r in range(self.pp_group_size)}
        else:
            if len(stages) != 1:
                raise ValueError(f"1F1B runs one stage per rank, got {len(stages)}")
            plain = {r: one_f_one_b_order(r, self.pp_group_size, n_microbatches) for r in range(self.pp_group_size)}
        order = {r: merge_backward_with_next_forward(o) for r, o in plain.items()}
        self._slots: dict[tuple[int, int], Slot] = {}  # (stage, micro-batch) → its slot, this step
        self.delay_wgrad = delay_wgrad  # parallel.delay_wgrad_compute
        # forward_one_chunk keeps each output for the step's return value unless told not to
        # (the switch is newer than some torch versions this runs on).
        params = inspect.signature(PipelineStage.forward_one_chunk).parameters
        self._no_saved_output = {"save_forward_output": False} if "save_forward_output" in params else {}
        if any(s + 1 in self.stage_of for s in self.stage_of):
            raise ValueError("two adjacent stages on one rank (V placement) are not supported here")
        self.register_custom_function(FORWARD, self._run_forward)
        self.register_custom_function(OVERLAP_F_B, self._run_pair)
        self.set_order(order)

    # What the runtime's own FORWARD / FULL_BACKWARD do, with each forward run in its
    # micro-batch's slot so that its all-to-alls can hand over later.

    def _forward(self, action: Action, ctx: object) -> None:
        # The outputs are not returned (PipelineRunner steps with return_outputs=False): keep none.
        self.forward_chunk(action, ctx, **self._no_saved_output)

    def _backward(self, action: Action, at_end: Callable[[], None] | None) -> None:
        loss = self.loss_of(action)
        if at_end is not None:
            # ``at_end`` must be queued before FSDP's end-of-backward callback, which the part's
            # root queues when the gradient reaches the stage's output: hang it on the loss (last
            # stage) or on a view of the output that the backward now starts from.
            if loss is not None:
                queue_at_end_of_backward(loss, at_end)
            else:
                outputs, inputs = self.stage_outputs(action)
                k = next(i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and o.requires_grad)
                view = queue_at_end_of_backward(outputs[k].view_as(outputs[k]), at_end)
                self.replace_stage_outputs(action, outputs[:k] + (view,) + outputs[k + 1:], inputs)
        self.backward_chunk(action, loss)

    def _run_forward(self, action: Action, ctx: object) -> None:
        self.wait_recv(action)
        slot = self._slots[(action.stage_index, action.microbatch_index)] = Slot(self.delay_wgrad)
        with forward_of(slot):
            self._forward(action, ctx)

    def _run_pair(self, action: Action, ctx: object) -> None:
        fwd, bwd = action.sub_actions
        self.wait_recv(fwd)
        self.wait_recv(bwd)
        nxt = self._slots[(fwd.stage_index, fwd.microbatch_index)] = Slot(self.delay_wgrad)
        pair = MergedPair(self._slots.pop((bwd.stage_index, bwd.microbatch_index)), nxt)
        pair.run(lambda at_end: self._backward(bwd, at_end), lambda: self._forward(fwd, ctx))


class _Stage(LastStageOutputsUnchecked, PipelineStage):
    """torch's pipeline stage, its forward and backward of a micro-batch marked as
    :mod:`moetrain.ranges`' forward / backward in profiles (every schedule calls these three); the
    last stage's logits may change shape between training and evaluation (multi-token
    prediction: :class:`moetrain.internals.LastStageOutputsUnchecked`)."""

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with ranges.phase(ranges.FORWARD):
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with ranges.phase(ranges.BACKWARD):
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with ranges.phase(ranges.BACKWARD):
            return super().backward_weight_one_chunk(*args, **kwargs)


class _LMLoss:
    """The last stage's loss function: objective / ``divisor`` is back-propagated (the division
    the single-stage runner does; :func:`moetrain.model.loss.model_loss`); the undivided LM and
    MTP losses are kept, in call order, for the step's reported losses."""

    def __init__(self, divisor: int, mtp_coef: float):
        self.divisor, self.mtp_coef = divisor, mtp_coef
        # With a loss mask: the step's divisor of each micro-batch's summed token losses
        # (MicroBatch.loss_divisor, the same for every micro-batch of a step).
        self.loss_divisor: torch.Tensor | None = None
        self.values: list[torch.Tensor] = []
        self.mtp_values: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss, lm, mtp = model_loss(logits, targets, self.mtp_coef, self.loss_divisor)
        self.values.append(lm.detach())
        if mtp is not None:
            self.mtp_values.append(mtp.detach())
        return loss / self.divisor


class PipelineRunner:
    """Runs a step's micro-batches over this rank's pipeline stages (a ``StepRunner``).

    Args:
        parts: this rank's model parts, materialised, one per stage in ``stages`` (same order).
        stages: their global stage indices (:func:`stage_ids`).
        cfg, ps: the run config and parallel state (the pp group carries the activations).
    """

    def __init__(self, parts: list[Transformer], stages: list[int], cfg: Config, ps: ParallelState):
        self.parts, self.stages, self.ps = parts, stages, ps
        self.num_stages = ps.size(PP) * cfg.parallel.virtual_stages
        self.n_micro = cfg.grad_accum_steps
        self.has_first = 0 in stages
        self.has_last = self.num_stages - 1 in stages
        self.schedule_cls, self.multi = SCHEDULES[cfg.parallel.pp_schedule]
        B, S = cfg.train.micro_batch_size, cfg.model.seq_len // ps.size(CP)
        # Between blocks the residual stream is a plain local tensor; under sequence parallelism
        # it holds this tp rank's S/tp rows (moetrain.parallel.tensor).
        S_hidden = S // ps.size(TP) if cfg.parallel.sequence_parallel else S
        # The residual stream between stages is in the compute dtype (bf16 activations).
        dtype = compute_dtype(cfg.train.precision)
        # Static stage metadata (no shape-inference pass, which would run an extra forward and
        # backward on the first micro-batch and count it in the MoE statistics). The last
        # stage's output (vocabulary-sharded under tp) is never sent; its entry only completes
        # the stage's description.
        # Multi-token prediction: the last stage's MTP modules read the future tokens (a keyword
        # argument, which the schedule hands every stage) and embed them with the last stage's
        # copy of the embedding, whose gradient is summed with stage 0's after every step.
        self.mtp = cfg.model.mtp_depth
        self.mtp_coef = cfg.model.mtp_loss_coef
        self.stage_ends = ps.stage_ends_group() if self.mtp else None
        with torch.device("meta"):
            self._tokens = torch.empty(B, S, dtype=torch.long)
            self._hidden = torch.empty(B, S_hidden, cfg.model.hidden, dtype=dtype, requires_grad=True)
            heads = (1 + self.mtp,) if self.mtp else ()
            self._logits = torch.empty(B, S, *heads, cfg.model.vocab_size, dtype=torch.float32, requires_grad=True)
        self.train_loss = _LMLoss(self.n_micro, self.mtp_coef)
        # parallel.ep_overlap: the same schedule with each backward merged with the next forward.
        self.ep_overlap = cfg.parallel.ep_overlap
        self.delay_wgrad = cfg.parallel.delay_wgrad_compute
        self.schedule = self._build(self.schedule_cls, self.n_micro, self.train_loss, self.ep_overlap)
        # forward_only: one fill-drain schedule per number of micro-batches (validation may use
        # another n than training), with its own stage objects (stages keep per-n buffers).
        self._eval: dict[int, tuple[object, _LMLoss]] = {}

    def _build(self, cls: type, n: int, loss_fn: Callable, merged: bool = False) -> object:
        stages = []
        for part, s in zip(self.parts, self.stages):
            inp = self._tokens if s == 0 else self._hidden
            out = self._logits if s == self.num_stages - 1 else self._hidden
            stages.append(_Stage(part, s, self.num_stages, self.ps.device, input_args=(inp,),
                                        output_args=(out,), group=self.ps.group(PP)))
        if merged:  # a 1F1B schedule (config.ep_overlap_blocker)
            return MergedPairsSchedule(stages, n, loss_fn, interleaved=cls is ScheduleInterleaved1F1B,
                                       delay_wgrad=self.delay_wgrad)
        if cls in (ScheduleGPipe, Schedule1F1B):
            return cls(stages[0], n, loss_fn=loss_fn, scale_grads=False)
        return cls(stages, n, loss_fn=loss_fn, scale_grads=False)

    def _batch(self, micro_batches: list[MicroBatch]) -> tuple[tuple, torch.Tensor | None, dict]:
        """Step arguments: the [n·B, S] inputs where stage 0 lives, the [n·B, S] targets (or
        [n·B, S, 1 + 2·mtp_depth] with the MTP targets and inputs) where the last stage lives, and then also
        the keyword argument ``future`` for its MTP modules; with document masking, the keyword
        argument ``doc_ids`` ([n·B, S_full]) on every stage, and with a padding mask ``padding``
        ([n·B, S_full] bool): the schedule cuts keyword arguments into micro-batches and hands them
        to every stage, as every stage's attention (and MoE layers) need them."""
        sizes = {mb.inputs.shape[0] for mb in micro_batches}
        if len(sizes) != 1:
            # tensor_split would cut unequal micro-batches at other boundaries.
            raise ValueError(f"micro-batches of different sizes {sorted(sizes)} cannot be pipelined")
        dev = self.ps.device
        args = (torch.cat([mb.inputs for mb in micro_batches]).to(dev),) if self.has_first else ()
        target = torch.cat([mb.targets for mb in micro_batches]).to(dev) if self.has_last else None
        kwargs = {"future": target} if target is not None and target.dim() == 3 else {}
        if micro_batches[0].doc_ids is not None:
            kwargs["doc_ids"] = torch.cat([mb.doc_ids for mb in micro_batches]).to(dev)
        if micro_batches[0].padding is not None:
            kwargs["padding"] = torch.cat([mb.padding for mb in micro_batches]).to(dev)
        return args, target, kwargs

    def _total(self, values: list[torch.Tensor], n: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.ps.device)
        if self.has_last and n:
            if len(values) != n:
                raise RuntimeError(f"the schedule computed {len(values)} losses for {n} micro-batches")
            for v in values:
                total += v.full_tensor() if isinstance(v, DTensor) else v
        values.clear()
        return total

    def _sync_embedding_copies(self) -> None:
        """Sum the gradient of the embedding over its two copies (stage 0's and the last stage's,
        for the MTP modules), as Megatron sums tied embeddings over its embedding group: both
        copies then take the same optimizer step and stay equal. The copies have the same
        placement, so their local pieces line up."""
        for part in self.parts:
            if part.tok_embeddings is None:
                continue
            for p in part.tok_embeddings.parameters():
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                with torch.no_grad():  # to_local() is then the local tensor itself, reduced in place
                    local = grad.to_local() if isinstance(grad, DTensor) else grad
                dist.all_reduce(local, group=self.stage_ends)
                p.grad = grad

    def forward_backward(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Back-propagate objective/n per micro-batch through the pipeline; returns the sums of
        the micro-batches' LM and MTP losses (float64 [2], on the device; the MTP sum 0 without
        MTP) on the rank of the last stage, 0 elsewhere.

        Raises:
            ValueError: not ``cfg.grad_accum_steps`` micro-batches, or of different sizes.
        """
        if len(micro_batches) != self.n_micro:
            raise ValueError(f"{len(micro_batches)} micro-batches, the schedule was built for {self.n_micro}")
        args, target, kwargs = self._batch(micro_batches)
        self.train_loss.values.clear()
        self.train_loss.mtp_values.clear()
        self.train_loss.loss_divisor = micro_batches[0].loss_divisor
        with loss_context(self.ps):  # the vocabulary-parallel loss's forward and backward, under tp
            self.schedule.step(*args, target=target, return_outputs=False, **kwargs)
        if self.stage_ends is not None:
            self._sync_embedding_copies()
        lm = self._total(self.train_loss.values, self.n_micro)
        mtp = self._total(self.train_loss.mtp_values, self.n_micro if self.mtp else 0)
        return torch.stack([lm, mtp])

    def forwards_per_step(self, micro_batches: int) -> int:
        return micro_batches

    @torch.no_grad()
    def forward_only(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Sum of the LM losses without gradients, forward through the pipeline (GPipe, or Looped
        BFS with several stages per rank: a fill-drain order, any n)."""
        n = len(micro_batches)
        if n not in self._eval:
            loss_fn = _LMLoss(1, self.mtp_coef)
            cls = ScheduleLoopedBFS if self.multi else ScheduleGPipe
            schedule = self._build(cls, n, loss_fn)
            # What ``schedule.eval()`` does (a loss function but no backward), set once: eval()
            # has no return_outputs switch and would keep every micro-batch's [B, S, V] logits
            # for a merged return value that is not used.
            disable_backward(schedule)
            self._eval[n] = (schedule, loss_fn)
        schedule, loss_fn = self._eval[n]
        args, target, kwargs = self._batch(micro_batches)
        kwargs.pop("future", None)  # no MTP in evaluation
        loss_fn.values.clear()
        loss_fn.loss_divisor = micro_batches[0].loss_divisor
        with loss_context(self.ps):
            schedule.step(*args, target=target, return_outputs=False, **kwargs)
        return self._total(loss_fn.values, n)


def pipeline_parts(model: Transformer, cfg: Config, ps: ParallelState) -> tuple[list[Transformer], list[int]]:
    """This rank's stages of the meta-device ``model`` and their global indices."""
    stages = stage_ids(ps.coord(PP), ps.size(PP), cfg.parallel.virtual_stages)
    p = cfg.parallel
    return split_model(model, stages, ps.size(PP) * p.virtual_stages, p.pp_first_stage_layers,
                       p.pp_last_stage_layers), stages

