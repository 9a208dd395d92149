"""ZeRO stages 1-3 (``parallel.zero_stage``) on PyTorch's FSDP2 ``fully_shard``.

ZeRO (Rajbhandari et al. 2020, §5.1-5.3) removes the replication of data-parallel training
state step by step. Stage 0 is plain data parallelism and does not come here:
:func:`moetrain.parallel.data_parallel.reduce_gradients` all-reduces once per step. For the
other stages, with A micro-batches per optimizer step, this is how each stage maps onto FSDP2
and what it communicates per FSDP group of Ψ parameter bytes:

* **1 — optimizer states sharded.** Each rank keeps AdamW's states (and the update) for its
  1/N shard only. ``reshard_after_forward=False``, and for every micro-batch but the last
  ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``: gradients
  accumulate full (unsharded) on every rank with no communication at all during accumulation;
  the last backward reduce-scatters them once (Ψ) and reshards the parameters.
* **2 — + gradients sharded.** As 1, but gradients are reduce-scattered after *every*
  micro-batch (A × Ψ) and only the 1/N gradient shard is kept between micro-batches.
* **3 — + parameters sharded.** ``reshard_after_forward=True``: parameters are freed after each
  group's forward and all-gathered again for its backward (2 all-gathers per micro-batch, but
  one for the last block, whose backward follows its forward at once); gradients reduce-scatter
  after every micro-batch.

Overlap: each block's forward starts the next block's all-gathers, each block's backward the
previous block's (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``, one
block ahead), so the communication of block i+1 runs during the compute of block i.

Where FSDP2 differs from the paper's wording (same communication volume, less memory):
stages 1 and 2 hold full parameters from the first forward of a step to the last backward; the
optimizer then updates the 1/N parameter shard, and the all-gather that ZeRO-1/2 do right after
the step happens at the next step's first forward instead. Between steps every stage stores
parameters sharded.

Groups and meshes (wrapped bottom-up, one group per block, as torchtitan does):

1. each MoE layer's ``GroupedExperts`` ([El, ...] tensors) on the expert-data-parallel mesh
   ``edp_tp`` — the ranks holding replicas of the same experts — and, in bf16, its router on
   ``dp_cp`` (its own group so that it stays fp32, :mod:`moetrain.parallel.precision`);
2. each transformer block (the rest of it: attention, norms, router, shared experts, dense MLP)
   on ``dp_cp``, a flattened axis of the dense root mesh, so FSDP composes with tensor-parallel
   DTensors on that root's ``tp`` axis;
3. the root (embedding, final norm, head) on ``dp_cp``.

Gradient averaging matches ``reduce_gradients``: every group sums over its mesh and divides by
dp·cp (FSDP would divide by its own mesh size, which for ``edp_tp`` is edp·tp). Reductions are
plain sums followed by a division (``set_force_sum_reduction_for_comms``), as in stage 0:
gloo has no pre-multiplied sum. FSDP-managed parameters are tagged ``_moetrain_fsdp`` so
``reduce_gradients`` does not reduce them again over data parallel; it still sums the ones
tagged ``_moetrain_tp_partial`` over tp (router and shared experts under tensor parallelism),
which is why ``fully_shard``'s new parameters inherit the tags of the ones they replace.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from moetrain.model.moe import GroupedExperts, Router
from moetrain.model.transformer import Transformer
from moetrain.parallel.data_parallel import expert_replica_axis
from moetrain.parallel.precision import FP32_POLICY, fsdp_policy
from moetrain.parallel.state import DP_CP, ParallelState

ZERO_STAGES = (1, 2, 3)


def apply_zero(model: Transformer, ps: ParallelState, stage: int, precision: str = "fp32") -> list[FSDPModule]:
    """Wrap ``model`` (or a pipeline part of it) with FSDP2 for ZeRO ``stage``, in place, with
    the mixed-precision policy of ``precision`` (``train.precision``).

    Call on the meta-device model after tensor, expert and context parallelism and activation
    checkpointing, before materialisation. Returns the FSDP modules, root last.

    Raises:
        ValueError: ``stage`` is not 1, 2 or 3, or an unknown precision.
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"zero stage {stage!r}: apply_zero handles 1, 2 and 3 (0 is plain data parallel)")
    reshard = stage == 3
    dense_mesh, expert_mesh = ps.submesh(DP_CP), ps.submesh(expert_replica_axis(ps))
    # fully_shard replaces every parameter with a new (DTensor) one: keep the ``_moetrain_*`` tags
    # earlier steps set (e.g. _moetrain_tp_partial from tensor parallelism).
    tags = {name: {k: v for k, v in vars(p).items() if k.startswith("_moetrain_")}
            for name, p in model.named_parameters()}
    divide = float(ps.size(DP_CP))
    policy = fsdp_policy(precision)
    wrapped: list[FSDPModule] = []

    def shard(module: nn.Module, mesh, mp_policy: MixedPrecisionPolicy = policy, reshard_after: bool = reshard
              ) -> FSDPModule:
        fsdp = fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after, mp_policy=mp_policy)
        fsdp.set_gradient_divide_factor(divide)
        # Sum, then divide: gloo has no pre-multiplied sum. Not on a 1-rank mesh, where torch
        # 2.13 would divide twice (its no-communication path divides, then the post-divide).
        fsdp.set_force_sum_reduction_for_comms(mesh.size() > 1)
        # A rank whose experts received no tokens, or a parameter unused on one rank, must still
        # join its group's reduce-scatter with a zero gradient.
        fsdp.set_reduce_scatter_unused_params(True, recurse=False)
        wrapped.append(fsdp)
        return fsdp

    blocks = list(model.layers.values())
    units: list[list[FSDPModule]] = []  # per block: its FSDP modules, the block's own last
    for i, block in enumerate(blocks):
        # ZeRO-3 keeps the last block's parameters after its forward: its backward comes next
        # (after the head's), and resharding would only all-gather them again at once.
        keep = reshard and i == len(blocks) - 1
        unit = []
        # 1. experts on their own expert-data-parallel mesh; the router fp32
        for module in block.modules():
            if isinstance(module, GroupedExperts):
                unit.append(shard(module, expert_mesh, reshard_after=reshard and not keep))
            elif isinstance(module, Router) and policy.param_dtype != FP32_POLICY.param_dtype:
                unit.append(shard(module, dense_mesh, FP32_POLICY, reshard_after=reshard and not keep))
        # 2. the rest of the block on dp_cp
        unit.append(shard(block, dense_mesh, reshard_after=reshard and not keep))
        units.append(unit)
    # Explicit prefetch, one block ahead: block i's forward starts block i+1's all-gathers, block
    # i's backward block i-1's (FSDP2's own prefetching waits until the next module's hooks run).
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            unit[-1].set_modules_to_forward_prefetch(units[i + 1])
        if i > 0:
            unit[-1].set_modules_to_backward_prefetch(units[i - 1])
    # 3. the root: embedding, final norm, head
    shard(model, dense_mesh)
    for name, p in model.named_parameters():
        for k, v in tags.get(name, {}).items():
            setattr(p, k, v)
        # FSDP reduces these over its mesh: reduce_gradients must not (the tag survives to_empty).
        p._moetrain_fsdp = True
    return wrapped


class ZeroMicroBatchSync:
    """Called by the step runner before each micro-batch: sets FSDP's gradient sync and
    resharding for the stage (see the module docstring).

    Stage 1: no reduction and no resharding until the last micro-batch. Stage 2: reduce every
    micro-batch, keep parameters unsharded until the last. Stage 3: FSDP's defaults.
    """

    def __init__(self, modules: list[FSDPModule], stage: int):
        if stage not in ZERO_STAGES:
            raise ValueError(f"zero stage {stage!r}: expected 1, 2 or 3")
        self.modules, self.stage = modules, stage

    def __call__(self, index: int, count: int) -> None:
        """Before micro-batch ``index`` (0-based) of ``count``."""
        last = index == count - 1
        for m in self.modules:
            if self.stage == 1:
                m.set_requires_gradient_sync(last, recurse=False)
            if self.stage in (1, 2):
                m.set_reshard_after_backward(last, recurse=False)
