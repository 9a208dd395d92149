"""Data parallelism and ZeRO 1-3 on PyTorch's FSDP2, and the global gradient norm.

One gradient path for every ``parallel.zero_stage``: each parameter group is wrapped bottom-up
(one group per block, as torchtitan does) by FSDP2 — ``replicate`` (its DDP mode) for stage 0,
``fully_shard`` for stages 1-3 — over the ranks that hold the same piece of it and see different
tokens: its *replica group*. FSDP2 reduces each group's gradients once per step, as soon as the
last micro-batch's backward has produced them (overlapped with the rest of the backward), and
every parameter becomes a DTensor that says where its pieces are.

ZeRO (Rajbhandari et al. 2020, §5.1-5.3), with A micro-batches per optimizer step and Ψ
parameter bytes per group:

* **0 — replicated.** ``replicate``: gradients accumulate locally and are all-reduced once
  (the last micro-batch's backward; ``set_requires_gradient_sync``).
* **1 — optimizer states sharded.** Each rank keeps AdamW's states (and the update) for its
  1/N shard only. ``reshard_after_forward=False``, and for every micro-batch but the last
  ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``: gradients
  accumulate full (unsharded) on every rank with no communication during accumulation; the
  last backward reduce-scatters them once (Ψ) and reshards the parameters.
* **2 — + gradients sharded.** As 1, but gradients are reduce-scattered after *every*
  micro-batch (A × Ψ) and only the 1/N gradient shard is kept between micro-batches.
* **3 — + parameters sharded.** ``reshard_after_forward=True``: parameters are freed after each
  group's forward and all-gathered again for its backward; gradients reduce-scatter after every
  micro-batch. The last block keeps its parameters from its forward to its backward, which
  follows at once.

Overlap under ZeRO: each block's forward prefetches the next block's all-gathers and each
block's backward the previous block's (one block ahead). Where FSDP2 differs from the paper's
wording (same volume, less memory): stages 1 and 2 hold full parameters from the first forward
of a step to the last backward, and the all-gather that ZeRO-1/2 do after the step happens at the
next step's first forward.

Replica groups (:func:`apply_data_parallel`):

1. the experts: ``edp_tp`` — the ranks with the same ep coordinate; the tp ranks see different
   tokens of the same experts — or ``edp`` under expert-tensor parallelism (tp splits them);
2. under tensor parallelism without expert-tensor parallelism, the MoE router, shared experts
   and shared gate (each tp rank routes its own 1/tp of the tokens), the q/k norm weights
   (each tp rank normalises its own heads), and under sequence parallelism the MTP modules'
   input projection (each tp rank projects its own sequence shard): ``dp_cp_tp``;
3. the rest of each block (tensor-parallel DTensors on ``tp``, whose pieces FSDP keeps), then
   the root (embedding, final norm, head): ``dp_cp``.

Every group sums its gradients over its mesh and divides by dp·cp, the number of different
sequences (``set_gradient_divide_factor``; a sum then a division, as gloo has no pre-multiplied
sum), so each gradient is the one-process gradient of the global batch. In bf16, ZeRO's
``MixedPrecisionPolicy`` all-gathers bf16 copies (the router stays fp32 in its own group); stage 0
keeps the modules' own casts (:mod:`moetrain.parallel.precision`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from moetrain.internals import foreach_norms, fsdp_replicate
from moetrain.model.gated_deltanet import GatedRMSNorm
from moetrain.model.layers import QKNorm
from moetrain.model.transformer import Transformer
from moetrain.parallel.precision import FP32_POLICY, STORED_POLICY, fsdp_policy
from moetrain.parallel.state import DP_CP, DP_CP_TP, EDP, EDP_TP, PP, TP, ParallelState

ZERO_STAGES = (0, 1, 2, 3)


def apply_data_parallel(model: Transformer, ps: ParallelState, stage: int, precision: str = "fp32",
                        keep_dtypes: bool = False) -> list[FSDPModule]:
    """Wrap ``model`` (or a pipeline part of it) for ZeRO ``stage`` (0: replicated) in place, with
    the mixed-precision policy of ``precision`` (``train.precision``; with ``keep_dtypes``, a LoRA
    base stored in bf16 / FP8, every parameter gathered in its own dtype), group by group as the
    module docstring lists them.

    Call on the meta-device model after tensor, expert and context parallelism, activation
    checkpointing and compilation, before materialisation. Returns the FSDP modules, root last.

    Raises:
        ValueError: ``stage`` is not 0-3.
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"zero stage {stage!r}: expected one of 0, 1, 2, 3")
    reshard = stage == 3
    policy = fsdp_policy(precision) if stage else FP32_POLICY
    router_policy = FP32_POLICY
    if keep_dtypes:  # a LoRA base stored in bf16 / FP8: gathered as stored, never cast
        policy = router_policy = STORED_POLICY
    divide = float(ps.size(DP_CP))
    tp = ps.size(TP) > 1
    tp_split = tp and ps.parallel.etp == 1  # the MoE works on 1/tp of the tokens on each tp rank
    wrapped: list[FSDPModule] = []

    # Expert stacks under EPLB (moe.eplb) are sharded along dim 1, so that every rank of their
    # replica group keeps a piece of each of its ep rank's slots and a re-placement moves whole
    # slots within the ep group (moetrain.parallel.eplb); FSDP's Shard(0) for everything else.
    slot_stacks = {id(p) for block in model.blocks().values() if block.moe is not None
                   and block.moe.experts.slot_map is not None for p in block.moe.experts.parameters()}

    def slots_whole(p: nn.Parameter) -> Shard | None:
        return Shard(1) if id(p) in slot_stacks else None

    def wrap(modules: nn.Module | list[nn.Module], axis: str, mp_policy: MixedPrecisionPolicy = policy,
             reshard_after: bool = reshard) -> FSDPModule:
        """One FSDP group of ``modules`` over ``axis``; returns its first module."""
        mesh = ps.fsdp_mesh(axis)  # under HSDP (parallel.dp_shard): (replicate, shard)
        if stage == 0:
            out = fsdp_replicate(modules, mesh, mp_policy)
        else:
            out = fully_shard(modules, mesh=mesh, reshard_after_forward=reshard_after, mp_policy=mp_policy,
                              shard_placement_fn=slots_whole)
        group = out if isinstance(out, list) else [out]
        for fsdp in group:
            if stage:
                # A rank whose experts received no tokens, or a parameter unused on one rank, must
                # still join its group's reduce-scatter with a zero gradient.
                # (The experts always get one: empty experts still run their empty GEMMs. torch
                # 2.11 and 2.12 lack the setter.)
                if hasattr(fsdp, "set_reduce_scatter_unused_params"):
                    fsdp.set_reduce_scatter_unused_params(True, recurse=False)
            fsdp.set_gradient_divide_factor(divide)
            # fully_shard: sum, then divide (gloo has no pre-multiplied sum), except where the shard
            # axis is one rank (a 1-rank mesh, or HSDP's (replicate, 1)). Neither for replicate.
            # Measured in torch 2.13: each of those divides twice.
            fsdp.set_force_sum_reduction_for_comms(stage > 0 and mesh.shape[-1] > 1)
        wrapped.extend(group)
        return group[0]

    # Per block, its groups: (modules, replica axis, policy). The MTP modules' blocks are blocks.
    per_block: list[list[tuple[list[nn.Module], str, MixedPrecisionPolicy]]] = []
    for block in model.blocks().values():
        groups = []
        moe = block.moe
        if moe is not None:  # 1. experts
            groups.append(([moe.experts], EDP if ps.parallel.etp > 1 else EDP_TP, policy))
        # 2. parameters that see different tokens (router) or heads (q/k norms) on each tp rank;
        #    the router in fp32 whatever the precision
        if moe is not None and (tp_split or policy.param_dtype != router_policy.param_dtype):
            groups.append(([moe.router], DP_CP_TP if tp_split else DP_CP, router_policy))
        split = [m for m in (moe.shared, moe.shared_gate) if m is not None] if tp_split and moe is not None else []
        if tp and block.attention is not None:
            split += [m for m in block.attention.modules() if isinstance(m, (QKNorm, GatedRMSNorm))]
        if split:
            groups.append((split, DP_CP_TP, policy))
        groups.append(([block], DP_CP, policy))  # 3. the rest of the block
        per_block.append(groups)
    if tp and ps.parallel.sequence_parallel and len(model.mtp):
        # MTP's input projection works on this rank's sequence shard (plain, not tensor-parallel).
        per_block[-1].insert(0, ([m.eh_proj for m in model.mtp.values()], DP_CP_TP, policy))
    units: list[list[FSDPModule]] = []  # per block: its FSDP modules, the block's own last
    for i, groups in enumerate(per_block):
        # ZeRO-3 keeps the last block's parameters after its forward: its backward comes next
        # (after the head's), and resharding would only all-gather them again at once.
        after = reshard and i < len(per_block) - 1
        units.append([wrap(modules if len(modules) > 1 else modules[0], axis, mp, after)
                      for modules, axis, mp in groups])
    if stage:
        # Explicit prefetch, one block ahead: block i's forward starts block i+1's all-gathers,
        # block i's backward block i-1's (FSDP2's own prefetching waits for the next hooks).
        for i, unit in enumerate(units):
            if i + 1 < len(units):
                unit[-1].set_modules_to_forward_prefetch(units[i + 1])
            if i > 0:
                unit[-1].set_modules_to_backward_prefetch(units[i - 1])
    wrap(model, DP_CP)  # 3. the root: embedding, final norm, head
    return wrapped


@torch.no_grad()
def global_grad_norm(parts: list[nn.Module], ps: ParallelState,
                     row_weights: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """L2 norm of the whole model's gradient, each element counted once: an fp32 scalar on the
    training device (nothing is read to the host).

    Each gradient says where its pieces are: a DTensor's local piece is one of several along
    every mesh axis its placement shards (``Shard``, FSDP's ``_StridedShard``) and a copy along
    the others (``Replicate``). So the squares of the local pieces are summed over the sharding
    axes only, and over pp (stages hold different parameters; the last stage's copy of the
    embedding under multi-token prediction is left to stage 0). The squares are taken and added
    in float64: CPU's fp32 norm kernels accumulate sequentially and lose 4e-4 relative on an
    8192 × 256 tensor, which made the clip factor, and then the training, depend on the layout.

    ``row_weights``: parameters (by ``id``) whose local gradient's rows count with a weight
    ([rows] float64 on the device): EPLB's slot stacks, where an expert's replicas count once
    (:meth:`moetrain.parallel.eplb.ExpertPlacer.norm_weights`).

    Raises:
        RuntimeError: a gradient still ``Partial`` (not reduced over its replica group).
    """
    row_weights = row_weights or {}
    pieces: dict[tuple, tuple[list[torch.Tensor], object, tuple[int, ...]]] = {}
    weighted: dict[tuple, list[torch.Tensor]] = {}  # per key: the weighted sums of squares
    # The last pipeline stage's copy of the embedding (multi-token prediction) is stage 0's.
    copies = {id(p) for part in parts if not getattr(part, "embeds_input", True)
              and getattr(part, "tok_embeddings", None) is not None for p in part.tok_embeddings.parameters()}
    for p in {id(p): p for part in parts for p in part.parameters()}.values():
        g = p.grad
        if g is None or id(p) in copies:
            continue
        mesh, axes = None, ()
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                raise RuntimeError(f"gradient placed {g.placements}: not reduced over its replica group")
            mesh, axes = g.device_mesh, tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            g = g.to_local()  # (no_grad: the local tensor itself)
        key = (mesh.mesh_dim_names if mesh is not None else (), axes)
        entry = pieces.setdefault(key, ([], mesh, axes))
        if id(p) in row_weights:
            rows = g.detach().double().pow(2).reshape(g.shape[0], -1).sum(1)
            weighted.setdefault(key, []).append((rows * row_weights[id(p)]).sum())
        else:
            entry[0].append(g.detach())
    total = torch.zeros((), dtype=torch.float64, device=ps.device)
    for key in sorted(pieces):  # the same order on every rank of a stage
        grads, mesh, axes = pieces[key]
        value = torch.zeros((), dtype=torch.float64, device=ps.device)
        if grads:
            value = value + torch.stack(foreach_norms(grads, torch.float64)).pow(2).sum()
        for part_sum in weighted.get(key, []):
            value = value + part_sum
        for axis in axes:
            dist.all_reduce(value, group=mesh.get_group(axis))
        total += value
    if ps.size(PP) > 1:
        dist.all_reduce(total, group=ps.group(PP))
    return total.sqrt().float()


@torch.no_grad()
def clip_gradients(parts: list[nn.Module], max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)) with
    ``torch.nn.utils.clip_grads_with_norm_`` (foreach; the factor stays on the device, no host
    read). ``norm``: the global norm from :func:`global_grad_norm`. A non-finite norm makes the
    gradients non-finite too; the trainer stops on it when it reads the step's metrics.
    ``max_norm <= 0`` is handled by the caller (no clipping)."""
    # Every piece is scaled by the same factor, so DTensor gradients are scaled through their
    # local shards (DTensor's foreach ops do not take a plain-tensor factor; the gradients of
    # different meshes could not share one call anyway).
    holders = [SimpleNamespace(grad=p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
               for p in {id(p): p for part in parts for p in part.parameters()}.values() if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(holders, max_norm, norm, foreach=True)
