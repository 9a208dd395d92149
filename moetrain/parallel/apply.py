"""Build this rank's model: the one place where the parallel dimensions are applied.

The order is fixed; each step says why it sits where it does:

1. build the full model on the meta device (shapes only: no memory, no initialisation);
2. pipeline split — keep this stage's blocks (pp > 1); everything after works per part;
3. tensor + sequence parallelism — shard attention / MLP / embedding / head over tp
   (before EP and FSDP: both must see the TP-sharded parameters);
4. the MoE layers' spread — the experts placed over ep (and tp under expert-tensor
   parallelism), the token dispatcher, the losses of sequences split over cp × tp ranks,
   node-limited routing: one :class:`~moetrain.model.moe.MoEParallel` per layer;
4b. low-rank adapters (``train.lora``) — beside the weights they adapt, placed as those are
   (so after 3-4), the base frozen (and stored in ``base_dtype``) before FSDP takes the
   parameters over; likewise DSA's dense warm-up freezes all but the indexers;
5. context parallelism — swap the attention kernel for ring attention over cp; DSA's indexers
   gather their keys over cp and sum the attention's probabilities over tp;
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

import torch
from torch import nn

from moetrain.config import Config, check_supported
from moetrain.model.dsa import Indexer
from moetrain.model.init import init_weights
from moetrain.model.fp8_gemm import set_fp8
from moetrain.model.layers import set_compute_dtype
from moetrain.model.lora import adapter_targets, add_adapters, convert_base
from moetrain.model.moe import GroupedExperts, resolve_expert_backend
from moetrain.model.transformer import Transformer
from moetrain.parallel.activation import apply_activation_checkpointing
from moetrain.parallel.compile import apply_compile
from moetrain.parallel.context import apply_context_parallel, apply_indexer_parallel
from moetrain.parallel.data_parallel import apply_data_parallel
from moetrain.parallel.ep_overlap import InTurnExchange
from moetrain.parallel.exchange import Exchange
from moetrain.parallel.expert import apply_expert_parallel, hierarchical_groups
from moetrain.parallel.lora import place_adapters
from moetrain.parallel.pipeline import pipeline_parts
from moetrain.parallel.precision import compute_dtype, fp8_recipe
from moetrain.parallel.runner import StepRunner, build_runner
from moetrain.parallel.state import CP, EP, PP, TP, ParallelState
from moetrain.parallel.tensor import apply_tensor_parallel


def freeze_all_but_indexers(model: nn.Module) -> None:
    """DSA's dense warm-up (``model.dsa.stage: dense_warmup``): every parameter but the
    indexers' stops training."""
    for p in model.parameters():
        p.requires_grad_(False)
    for m in model.modules():
        if isinstance(m, Indexer):
            for p in m.parameters():
                p.requires_grad_(True)


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

    if cfg.train.lora.r:  # names in train.lora.target_modules that select nothing are refused here
        adapter_targets(model, cfg.train.lora)

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
        # 4b. LoRA: adapters beside the targeted weights, placed as they are; the base frozen.
        if cfg.train.lora.r:
            add_adapters(part, cfg.train.lora)
            if cfg.train.lora.base_dtype is not None:
                convert_base(part, cfg.train.lora.base_dtype, cfg.train.fp8_block)
            place_adapters(part)
        # 4c. DSA's dense warm-up trains the indexers alone: the rest is frozen (no gradient,
        #     optimizer state or reduction), as LoRA's base.
        if cfg.model.dsa.enabled and cfg.model.dsa.stage == "dense_warmup":
            freeze_all_but_indexers(part)
        # 5. context parallelism: ring attention over cp, RoPE at the chunks' global positions.
        if ps.size(CP) > 1:
            apply_context_parallel(part, ps.group(CP), cfg.model.seq_len)
        # 5b. DSA under tp / cp: the indexer keys gathered over cp, the attention's probabilities
        #     summed over tp.
        if cfg.model.dsa.enabled and (ps.size(CP) > 1 or ps.size(TP) > 1):
            apply_indexer_parallel(part, ps, cfg.model.seq_len)
        # 6. activation checkpointing: recompute blocks (full) or core attention (selective).
        if cfg.parallel.activation_checkpointing != "none":
            apply_activation_checkpointing(part, cfg.parallel.activation_checkpointing)
        # 6b. torch.compile of each block (after AC, before FSDP, as torchtitan orders them).
        if cfg.train.compile:
            apply_compile(part, ps.size(TP) > 1)
        # 7. data parallelism / ZeRO: every parameter group over its replica group (FSDP2).
        if ps.world_size > 1:
            # A base stored in bf16 / fp8 is gathered as stored (an fp8 base's fp32 scales too): no
            # cast by FSDP; every module casts its weights at use, as in stage 0.
            fsdp_modules += apply_data_parallel(part, ps, cfg.parallel.zero_stage, cfg.train.precision,
                                                keep_dtypes=cfg.train.lora.base_dtype is not None)
        # 8. materialise and initialise (values depend on names and global expert ids only).
        _materialize(part, cfg, ps)

    return parts, build_runner(parts, stages, cfg, ps, fsdp_modules)

