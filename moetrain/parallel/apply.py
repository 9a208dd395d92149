"""Build this rank's model: the one place where the parallel dimensions are applied.

The order is fixed; each step says why it sits where it does:

1. build the full model on the meta device (shapes only: no memory, no initialisation);
2. pipeline split — keep this stage's blocks (pp > 1); everything after works per part;
3. tensor + sequence parallelism — shard attention / MLP / embedding / head over tp
   (before EP and FSDP: both must see the TP-sharded parameters);
4. the MoE layers' spread — the experts placed over ep (and tp under expert-tensor
   parallelism), the token dispatcher, the losses of sequences split over cp × tp ranks,
   node-limited routing: one :class:`~moetrain.model.moe.MoEParallel` per layer;
5. context parallelism — swap the attention kernel for ring attention over cp;
6. activation checkpointing — wraps whole blocks, so it comes after their contents changed;
   then ``train.compile`` compiles each block's computation (the recomputation wraps it);
7. data parallelism / ZeRO — FSDP2 (``replicate`` for stage 0) wraps each parameter group over
   its replica group, last, as it takes over the (possibly DTensor) parameters; with ZeRO in
   bf16 its mixed-precision policy all-gathers bf16 copies of the fp32 shards;
8. materialise on the device, initialise with layout-independent values (fp32: the master
   weights), set the compute dtype and the expert backend (see
   :mod:`moetrain.parallel.precision`).

After it every parameter is a DTensor that carries its placement (or, in one process, a plain
tensor): the gradient reduction, the norm, checkpoints and exports read it from there. Steps
that a layout does not use are skipped here, by this caller, never inside the step.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import nn

from moetrain.config import Config, check_supported, overlap_split
from moetrain.data.loader import IGNORE_INDEX, MicroBatch
from moetrain.model.init import init_weights
from moetrain.model.fp8_gemm import set_fp8
from moetrain.model.layers import set_compute_dtype
from moetrain.model.loss import model_loss
from moetrain.model.moe import GroupedExperts, resolve_expert_backend
from moetrain.model.transformer import Transformer
from moetrain.parallel.activation import apply_activation_checkpointing
from moetrain.parallel.compile import apply_compile
from moetrain.parallel.context import apply_context_parallel
from moetrain.internals import gate_post_backward
from moetrain.parallel.data_parallel import MicroBatchSync, apply_data_parallel
from moetrain.parallel.ep_overlap import (InTurnExchange, MergedPair, Slot, forward_of, hold_for_weight_grads,
                                          queue_at_end_of_backward)
from moetrain.parallel.exchange import Exchange
from moetrain.parallel.expert import apply_expert_parallel, hierarchical_groups
from moetrain.parallel.pipeline import PipelineRunner, pipeline_parts
from moetrain.parallel.precision import compute_dtype, fp8_recipe
from moetrain.parallel.state import CP, EP, PP, TP, ParallelState
from moetrain.parallel.tensor import apply_tensor_parallel, loss_context


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
    return [MicroBatch(mb.inputs[s], mb.targets[s], None if mb.doc_ids is None else mb.doc_ids[s], divisor)
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
        # The merged pairs' turn-taking, (side, event) in order, when a list (tests).
        self.overlap_events: list[tuple[str, str]] | None = None

    def _loss(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(objective, LM loss, MTP loss or None); ``mb.targets`` [B, S, 1 + D] carries the MTP
        targets (:func:`moetrain.model.transformer.future_tokens`)."""
        doc_ids = mb.doc_ids.to(self.device) if mb.doc_ids is not None else None
        targets = mb.targets.to(self.device)
        future = targets if targets.dim() == 3 else None
        logits = self.model(mb.inputs.to(self.device), doc_ids=doc_ids, future=future)
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
                pair = MergedPair(slots[i - 1], slots[i], self.overlap_events)
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


def _materialize(part: nn.Module, cfg: Config, ps: ParallelState) -> None:
    # to_empty replaces the parameter objects: re-tie parameters shared by two modules (tied
    # embeddings), which come back as two.
    first_name: dict[int, str] = {}
    aliases = []  # (alias, name of the first holder)
    for name, p in part.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            aliases.append((name, first_name[id(p)]))
        first_name.setdefault(id(p), name)
    part.to_empty(device=ps.device)
    for alias, name in aliases:
        holder, _, leaf = alias.rpartition(".")
        setattr(part.get_submodule(holder), leaf, part.get_parameter(name))
    init_weights(part, cfg.run.seed, cfg.model.init_std, cfg.model.layers)
    if part.positions is not None:  # RoPE positions set by tp / cp: once to the device, not per forward
        part.positions = part.positions.to(ps.device)
    # Parameters stay fp32 (master weights); modules compute in the precision's dtype.
    dtype = compute_dtype(cfg.train.precision)
    set_compute_dtype(part, dtype)
    recipe = fp8_recipe(cfg.train)
    set_fp8(part, recipe, cfg.train.fp8_keep)
    backend = resolve_expert_backend(cfg.moe.expert_backend, ps.device, dtype, fp8=recipe is not None)
    for m in part.modules():
        if isinstance(m, GroupedExperts):
            m.backend = backend


def build_model_parts(cfg: Config, ps: ParallelState) -> tuple[list[Transformer], StepRunner]:
    """This rank's model parts, materialised on ``ps.device`` and initialised, and the runner
    that executes a step over them.

    Raises:
        NotImplementedError: a dimension that this version cannot apply yet was requested
            (``moetrain.launch.preflight`` refuses it before launch).
    """
    check_supported(cfg, ps.device.type)

    # 1. the full model, on meta: shapes only.
    with torch.device("meta"):
        model = Transformer.from_config(cfg)

    # 2. pipeline split (pp > 1): one part per stage this rank holds, each a copy of the model
    #    with only that stage's blocks (names stay global); see moetrain.parallel.pipeline.
    parts, stages = pipeline_parts(model, cfg, ps) if ps.size(PP) > 1 else ([model], [0])

    # The hierarchical dispatcher's process groups: created by every rank together (new_group is
    # collective over all ranks), also where this rank's pipeline stage holds no MoE layer.
    if ps.world_size > 1 and ps.size(EP) > 1 and cfg.moe.token_dispatcher == "hierarchical":
        hierarchical_groups(ps)
    fsdp_modules: list = []
    for part in parts:
        # 3. tensor + sequence parallelism: attention / MLP / embedding / head sharded over tp.
        if ps.size(TP) > 1:
            apply_tensor_parallel(part, ps, cfg)
        # 4. the MoE layers: experts over ep (and tp with etp), dispatcher, sequence split,
        #    node-limited routing.
        #    How a token transfer waits: in flight until its rows are needed, or (ep_overlap) in
        #    turn with the partner micro-batch of a merged pair.
        if part.moe_layers() and ps.world_size > 1:
            apply_expert_parallel(part.moe_layers(), ps, cfg, InTurnExchange if cfg.parallel.ep_overlap else Exchange)
        # 5. context parallelism: ring attention over cp, RoPE at the chunks' global positions.
        if ps.size(CP) > 1:
            apply_context_parallel(part, ps.group(CP), cfg.model.seq_len)
        # 6. activation checkpointing: recompute blocks (full) or core attention (selective).
        if cfg.parallel.activation_checkpointing != "none":
            apply_activation_checkpointing(part, cfg.parallel.activation_checkpointing)
        # 6b. torch.compile of each block (after AC, before FSDP, as torchtitan orders them).
        if cfg.train.compile:
            apply_compile(part, ps.size(TP) > 1)
        # 7. data parallelism / ZeRO: every parameter group over its replica group (FSDP2).
        if ps.world_size > 1:
            fsdp_modules += apply_data_parallel(part, ps, cfg.parallel.zero_stage, cfg.train.precision)
        # 8. materialise and initialise (values depend on names and global expert ids only).
        _materialize(part, cfg, ps)

    # The runner: a pipeline schedule over the stages, or plain accumulation on one part.
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
    return parts, runner

