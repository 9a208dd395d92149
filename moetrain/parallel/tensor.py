"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Megatron-SP,
Korthikanti et al. 2022), applied with DTensor's ``parallelize_module``.

Shape legend: B batch, S sequence (the rank's part under context parallelism), D hidden,
V vocabulary, t = tp.

Placement plan (``seq`` = ``Shard(1)`` with sequence parallelism, ``Replicate()`` without; the
residual stream between blocks is a plain local tensor: [B, S/t, D] with SP, [B, S, D] without):

=====================  ===========================  =====================================================
module                 style                        parameters / activations
=====================  ===========================  =====================================================
tok_embeddings         RowwiseParallel              weight [V, D] Shard(0) (vocabulary-parallel); token ids
                                                    Replicate in, out ``seq`` (reduce-scatter with SP,
                                                    all-reduce without)
attention_norm,        SequenceParallel (SP only)   weight Replicate; [B, S/t, D] Shard(1) in and out
ffn_norm, norm                                      (without SP: plain modules on replicated activations)
attention              PrepareModuleInput           x: ``seq`` → Replicate (all-gather with SP), one DTensor
                                                    for wq/wk/wv so their input gradients are reduced once
attention.wq/wk/wv     ColwiseParallel              weight Shard(0): this rank's H/t query and G/t kv heads
                                                    (and bias Shard(0), ``model.qkv_bias``)
attention.q_norm/      plain (``model.qk_norm``)    ``head``: weight [Dh] replicated; ``projection``: weight
k_norm                                              [heads·Dh] replicated, this rank uses its heads' rows
                                                    and sums the sum of squares over tp (:class:`AllReduceSum`)
attention.wo           RowwiseParallel              weight Shard(1); out ``seq`` (reduce-scatter / all-reduce)
gated DeltaNet         PrepareModuleInput           as attention, on ``attention`` (model.layer_types); in_proj_qkvz,
(``attention``)        + Colwise / Rowwise          in_proj_ba Colwise (rows grouped by key head: Hk/t key heads
                                                    and their value heads), conv1d, A_log, dt_bias Shard(0),
                                                    out_proj Rowwise; the gated norm's weight replicated
KDA (``attention``)    PrepareModuleInput (local)   x gathered as attention, local; q/k/v/b/f_b/g_b_proj Colwise
                       + Colwise / Rowwise          (H/t heads), the three convolutions, A_log, dt_bias Shard(0),
                                                    o_proj Rowwise; f_a_proj, g_a_proj, o_norm replicated
feed_forward           PrepareModuleInput           as attention
feed_forward.w1/w3     ColwiseParallel              weight Shard(0) over F
feed_forward.w2        RowwiseParallel              weight Shard(1); out ``seq``
moe                    PrepareModuleInputOutput     in ``seq`` → Shard(1) local, out Shard(1) → ``seq``
                                                    (all-gather without SP): the MoE works on S/t tokens
output                 ColwiseParallel              weight Shard(0) over V; in ``seq`` → Replicate, logits
                                                    [B, S, V/t] Shard(2) kept as a DTensor for
                                                    ``loss_parallel`` (vocabulary-parallel cross-entropy)
=====================  ===========================  =====================================================

What each redistribution does in forward and backward (DTensor implements them):

* Shard(1) → Replicate (into a TP region): all-gather along the sequence; backward
  reduce-scatter (Korthikanti et al. 2022 §4.2.2, operator g);
* row-parallel output Partial → Shard(1) (out of a TP region): reduce-scatter; backward
  all-gather (ibid., operator ḡ);
* without SP, row-parallel output Partial → Replicate: all-reduce, backward identity; a
  Replicate input of column-parallel layers: identity, backward one all-reduce of the summed
  partial input gradients (Shoeybi et al. 2019 §3 Fig. 3, operators g and f);
* Replicate → Shard(1) (the MoE's slice without SP): keep this rank's slice, no communication;
  backward all-gather.

MoE under tensor parallelism (expert-tensor-parallel = 1): the router, the experts, the
shared experts and their gate stay plain parameters and are not split. Every tp rank routes and
computes a different 1/t of the sequence, so no tp rank repeats another's expert work:

1. with SP the MoE takes the SP region's local [B, S/t, D] shard as it is; without SP the
   replicated [B, S, D] input is sliced to this rank's S/t (no communication);
2. the MoE runs on the slice (expert parallelism, if any, dispatches from there);
3. the output stays the local shard (SP) or is all-gathered back to [B, S, D] (no SP).

Gradients then (:mod:`moetrain.parallel.data_parallel`): the experts' are reduced over
``edp_tp`` (tp ranks saw different tokens of the same experts); the router, shared-expert and
shared-gate parameters, the q/k norm weights and gated DeltaNet's gated-norm weight (each tp rank
normalises its own heads of the same tokens), over ``dp_cp_tp`` — in both cases the sum over tp is the whole gradient. The
per-sequence load-balancing counts are summed over ``cp_tp`` and the z-loss is scaled by 1/t
(:func:`moetrain.parallel.expert.sequence_split`). Norm weights under SP get Partial(sum)
gradients from DTensor, which FSDP2 sums over tp before its own reduction.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from torch import nn
from torch.distributed.tensor import distribute_tensor

from moetrain.config import Config
from moetrain.model.gated_deltanet import GatedDeltaNet
from moetrain.model.kda import KimiDeltaAttention
from moetrain.model.layers import Attention, QKNormParallel
from moetrain.model.mamba2 import Mamba2
from moetrain.model.mla import MLAttention
from moetrain.model.transformer import Transformer
from moetrain.parallel.state import TP, ParallelState

__all__ = ["AllReduceSum", "CopyToTP", "ReduceFromTP", "apply_tensor_parallel", "loss_context",
           "tensor_parallel_plan"]


class AllReduceSum(torch.autograd.Function):
    """Forward: the sum of ``x`` over ``group`` (all-reduce). Backward: the sum of the incoming
    gradients over ``group`` (all-reduce) — every rank's output depends on every rank's input.
    Used for statistics over a tp-sharded dim (the ``projection`` q/k norm; Megatron-LM sums
    the LayerNorm statistics of a split hidden dim the same way)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class CopyToTP(torch.autograd.Function):
    """Forward: ``x`` as it is (every tp rank holds the same). Backward: the sum of the
    gradients over ``group`` — each rank's column slice of the weights gives a partial input
    gradient (Megatron-LM's ``f`` operator, Shoeybi et al. 2019 §3 Fig. 3)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class ReduceFromTP(torch.autograd.Function):
    """Forward: the sum of the partial outputs over ``group`` (all-reduce, in fp32). Backward:
    the gradient as it is — every rank uses the summed output the same way (Megatron-LM's ``g``
    operator)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.float().contiguous()
        dist.all_reduce(out, group=group)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _TPSum:
    """``sum_over_ranks`` of a projection q/k norm: :class:`AllReduceSum` over tp."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return AllReduceSum.apply(x, self.group)


def tensor_parallel_plan(model: Transformer, sequence_parallel: bool, expert_tensor_parallel: bool = False
                         ) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan (module path → style) for ``model`` (a whole
    :class:`Transformer` or a pipeline part of one: absent embedding / norm / head are left
    out). See the module docstring for the placements; with ``expert_tensor_parallel`` the MoE
    takes the whole (replicated) sequence like a dense MLP and gives a replicated output."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    blocks = {f"layers.{name}": block for name, block in model.layers.items()}
    for name, module in model.mtp.items():  # multi-token prediction: its norms and its block
        blocks[f"mtp.{name}.block"] = module.block
        if sequence_parallel:  # local outputs: the plain eh_proj takes them (replicated over dp_cp_tp)
            for norm in ("enorm", "hnorm", "norm"):
                plan[f"mtp.{name}.{norm}"] = SequenceParallel(use_local_output=True)
    for prefix, block in blocks.items():
        if sequence_parallel:  # (a block of model.hybrid_override_pattern has one of the two)
            for norm in ("attention_norm", "ffn_norm"):
                if getattr(block, norm) is not None:
                    plan[f"{prefix}.{norm}"] = SequenceParallel()
        if block.attention is None:
            pass
        elif isinstance(block.attention, KimiDeltaAttention):
            # KDA: the whole (gathered) sequence, this rank's heads. Local input, as MLA's: the
            # rank-R down-projections of the gates (f_a_proj, g_a_proj) are plain, whole on every
            # rank, and each column-parallel projection sums its own input gradient over tp.
            plan[f"{prefix}.attention"] = PrepareModuleInput(input_layouts=(seq, None),
                                                             desired_input_layouts=(Replicate(), None),
                                                             use_local_output=True)
            for proj in ("q_proj", "k_proj", "v_proj", "b_proj", "f_b_proj", "g_b_proj"):
                plan[f"{prefix}.attention.{proj}"] = ColwiseParallel()
            plan[f"{prefix}.attention.o_proj"] = RowwiseParallel(output_layouts=seq)
        elif isinstance(block.attention, (GatedDeltaNet, Mamba2)):
            # Gated DeltaNet / Mamba-2: the whole (gathered) sequence, this rank's key heads or
            # groups (the projections' rows grouped by them), the output summed back over tp.
            plan[f"{prefix}.attention"] = PrepareModuleInput(input_layouts=(seq, None),
                                                             desired_input_layouts=(Replicate(), None))
            projections = ("in_proj_qkvz", "in_proj_ba") if isinstance(block.attention, GatedDeltaNet) else ("in_proj",)
            for proj in projections:
                plan[f"{prefix}.attention.{proj}"] = ColwiseParallel()
            plan[f"{prefix}.attention.out_proj"] = RowwiseParallel(output_layouts=seq)
        elif isinstance(block.attention, MLAttention):
            # MLA: the latents and the RoPE key are computed from the whole (gathered) input on
            # every tp rank; the up-projections split the heads. Local input, so that each
            # up-projection sums its own input gradient over tp (the RoPE key's, which no
            # projection takes, gets a CopyToTP in apply_tensor_parallel).
            plan[f"{prefix}.attention"] = PrepareModuleInput(input_layouts=(seq, None, None),
                                                             desired_input_layouts=(Replicate(), None, None),
                                                             use_local_output=True)
            for proj in ("wq", "wq_b", "wkv_b"):
                if getattr(block.attention, proj, None) is not None:
                    plan[f"{prefix}.attention.{proj}"] = ColwiseParallel()
        else:
            # (x, cos, sin): only x is distributed; RoPE tables are plain and cover the full sequence.
            plan[f"{prefix}.attention"] = PrepareModuleInput(input_layouts=(seq, None, None),
                                                             desired_input_layouts=(Replicate(), None, None))
            for proj in ("wq", "wk", "wv"):
                plan[f"{prefix}.attention.{proj}"] = ColwiseParallel()
        if isinstance(block.attention, (Attention, MLAttention)):
            plan[f"{prefix}.attention.wo"] = RowwiseParallel(output_layouts=seq)
        if block.moe is not None:
            # etp = 1: each tp rank routes its own 1/tp of the sequence. etp = tp: every tp rank
            # routes the whole sequence; its experts hold 1/tp of the ffn width and reduce their
            # output over tp themselves (moetrain.parallel.expert._expert_tensor_parallel).
            local = Replicate() if expert_tensor_parallel else Shard(1)
            plan[f"{prefix}.moe"] = PrepareModuleInputOutput(
                input_layouts=(seq,), desired_input_layouts=(local,), use_local_input=True,
                output_layouts=(local,), desired_output_layouts=(seq,), use_local_output=True)
        elif block.feed_forward is not None:
            plan[f"{prefix}.feed_forward"] = PrepareModuleInput(input_layouts=(seq,),
                                                                desired_input_layouts=(Replicate(),))
            plan[f"{prefix}.feed_forward.w1"] = ColwiseParallel()
            if block.feed_forward.w3 is not None:  # (a non-gated MLP has none)
                plan[f"{prefix}.feed_forward.w3"] = ColwiseParallel()
            plan[f"{prefix}.feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
    return plan


def apply_tensor_parallel(model: Transformer, ps: ParallelState, cfg: Config) -> None:
    """Shard ``model`` (on the meta device, before materialisation) over the tp axis of ``ps``,
    with sequence parallelism when ``cfg.parallel.sequence_parallel``.

    Besides the plan (:func:`tensor_parallel_plan`) it (1) ties the head to the embedding again
    when ``model.tie_embeddings`` (both are [V, D] Shard(0), so the tie survives sharding);
    (2) gives each ``projection`` q/k norm its rows and the tp sum of its statistic (see the
    module docstring); (3) under SP
    gives RoPE the positions 0..S-1 explicitly: ``Transformer.forward`` sees the embedding's
    S/t local rows, but attention runs on the all-gathered S (context parallelism, applied
    later, replaces them by its chunks' positions).

    ``cfg`` must be validated (:func:`moetrain.config.validate`): heads, kv heads, the dense MLP
    width and the vocabulary divide by tp.
    """
    tp = ps.size(TP)
    m = cfg.model
    sp, etp = cfg.parallel.sequence_parallel, cfg.parallel.etp > 1
    parallelize_module(model, ps.submesh(TP), tensor_parallel_plan(model, sp, etp))
    if m.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight
    tp_rank, group = ps.coord(TP), ps.group(TP)
    for block in model.blocks().values():
        attn = block.attention
        if attn is None:  # an MLP / MoE block of model.hybrid_override_pattern
            continue
        per_head = None
        if isinstance(attn, GatedDeltaNet):
            per_head = ((attn.conv1d, "weight"), (attn, "A_log"), (attn, "dt_bias"))
        elif isinstance(attn, KimiDeltaAttention):
            per_head = ((attn.q_conv1d, "weight"), (attn.k_conv1d, "weight"), (attn.v_conv1d, "weight"),
                        (attn, "A_log"), (attn, "dt_bias"))
        elif isinstance(attn, Mamba2):
            per_head = ((attn.conv1d, "weight"), (attn.conv1d, "bias"), (attn, "A_log"), (attn, "dt_bias"),
                        (attn, "D"), (attn.norm, "weight"))
        if per_head is not None:  # per-head tensors: this rank's key heads / groups (grouped so)
            for owner, name in per_head:
                if getattr(owner, name) is None:
                    continue
                setattr(owner, name, nn.Parameter(distribute_tensor(getattr(owner, name), ps.submesh(TP), [Shard(0)],
                                                                    src_data_rank=None)))
            continue
        if attn.sinks is not None:  # one logit per head: each tp rank holds its heads'
            attn.sinks = nn.Parameter(distribute_tensor(attn.sinks, ps.submesh(TP), [Shard(0)], src_data_rank=None))
        if isinstance(attn, MLAttention):  # every rank's heads read the RoPE key: sum its gradient
            attn.wk_rope.register_forward_hook(lambda mod, args, out: CopyToTP.apply(out, group))
            # DSA's gathered attention reads the key-value latent without wkv_b's module (its heads'
            # rows of the weight): sum the latent's gradient over tp as wkv_b's input reduction does
            attn.latent_to_heads = lambda x: CopyToTP.apply(x, group)
            continue
        for norm in (attn.q_norm, attn.k_norm):
            if norm is not None and not norm.per_head:
                rows = norm.weight.shape[0] // tp
                norm.parallel = QKNormParallel((tp_rank * rows, rows), _TPSum(group))
    if sp:
        model.positions = torch.arange(m.seq_len)


def loss_context(ps: ParallelState) -> contextlib.AbstractContextManager:
    """``loss_parallel`` under tensor parallelism (the vocabulary-sharded cross-entropy needs its
    forward *and* backward inside it), a no-op context otherwise."""
    if ps.size(TP) > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()
