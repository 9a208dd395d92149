"""Every private PyTorch and submitit internal moetrain uses, in one place.

Private attributes change with every torch release. Each one moetrain needs is wrapped here, in a
function or class named for what it does, with what it stands for; nothing else in the package
touches a private attribute of torch or submitit (``tests/test_internals.py`` scans the source
tree and fails on one, and checks that each internal below still exists, naming the torch version
when one is gone). Checked on torch 2.11, 2.13 and 2.14.1 (:data:`CHECKED_TORCH`: the whole suite
run on each, docs/development.md) and submitit 1.5.

torch 2.15 (October 2026; not installable on the project's machines, read from its release notes
and source against each wrapper below): ``PipelineStage.fwd_cache`` is gone (replaced by
``_forward_chunk_states``), so :func:`stage_keeps_outputs` is False there and ``ep_overlap`` with
pp > 1 is refused at config time; its pipeline stages also finalize FSDP's backward themselves,
which :func:`gate_post_backward` has not been run against. The other wrappers' names are present
in 2.15 as in 2.14.

Not wrapped, being used as public by torchao and TorchTitan: ``torch._scaled_mm`` (fp8 GEMMs),
``torch.distributed._functional_collectives`` (the differentiable all-to-all) and the private aten
attention ops (``torch.ops.aten._scaled_dot_product_*``).

Public APIs are used where they exist: ``DTensor.to_local`` (under ``no_grad`` it returns the
local tensor itself, which in-place gradient ops need), FSDP2's ``fully_shard`` and
``set_requires_gradient_sync``, ``torch.distributed.pipelining``'s schedule classes and
``register_custom_function``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import ScheduleInterleaved1F1B
from torch.distributed.pipelining import schedules as _schedules

__all__ = ["Action", "CHECKED_TORCH", "FORWARD", "FULL_BACKWARD", "LastStageOutputsUnchecked", "OVERLAP_F_B",
           "PipelineRuntime", "disable_backward",
           "flatten_mesh", "unflatten_mesh", "foreach_norms", "fsdp_replicate", "gate_post_backward", "interleaved_1f1b_order",
           "keep_local_job", "local_shape_and_offset", "missing", "queue_backward_callback", "record_cuda_memory_history",
           "dump_cuda_memory_snapshot", "render_submission", "stage_keeps_outputs"]

CHECKED_TORCH = ("2.11", "2.13", "2.14")

# -- DeviceMesh, DTensor ---------------------------------------------------------------------


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D mesh over all the ranks of the (multi-dimensional, sliced) ``mesh``, registered
    under ``name`` on its root mesh so that ``root[name]`` finds it (``DeviceMesh._flatten``, as
    TorchTitan uses it; no public equivalent in torch 2.11-2.15)."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """The 1-D ``mesh`` (a flattened axis) viewed as ``sizes`` (outer first) with axes ``names``,
    on the same root mesh, so that FSDP2 composes it with tensor-parallel DTensors
    (``DeviceMesh._unflatten``; HSDP's (replicate, shard) mesh; no public equivalent in torch
    2.11-2.15). Collective: it creates a process group per new axis."""
    return mesh._unflatten(0, sizes, names)


def local_shape_and_offset(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Any]
                           ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's piece of a tensor of global ``shape`` placed by ``placements`` on ``mesh``:
    (its shape, the global index of its first element)
    (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(tuple(shape), mesh, tuple(placements))
    return tuple(local), tuple(offset)


def foreach_norms(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The L2 norm of each tensor, accumulated in ``dtype``, in one fused call per device
    (``torch._foreach_norm``; the public ``torch.nn.utils.get_total_norm`` takes no dtype)."""
    return list(torch._foreach_norm(tensors, 2.0, dtype=dtype))


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the backward now running ends, after the callbacks queued before it and
    before those queued later (``Variable._execution_engine.queue_callback``: what FSDP2 uses
    for its own end-of-backward work). Call it from inside a backward hook."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


# -- FSDP2 ------------------------------------------------------------------------------------


def fsdp_replicate(modules: nn.Module | list[nn.Module], mesh: DeviceMesh, mp_policy: Any) -> nn.Module:
    """FSDP2's data-parallel mode (replicated parameters, all-reduced gradients, FSDP2's hooks
    and mixed precision): ``torch.distributed._composable.replicate_with_fsdp.replicate``."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate(modules, mesh=mesh, mp_policy=mp_policy)


def _param_groups(module: nn.Module) -> list[Any]:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13, 2.14
    if groups is not None:
        return list(groups)
    if not hasattr(state, "_fsdp_param_group"):  # torch 2.11
        raise NotImplementedError(f"torch {torch.__version__}'s FSDP2 keeps its parameter groups where moetrain "
                                  f"does not look (parallel.delay_wgrad_compute)")
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def gate_post_backward(modules: list[nn.Module], hold: Callable[[Callable[[], None]], bool]) -> None:
    """Route the post-backward (gradient reduction) of every FSDP2 parameter group of
    ``modules`` (``fully_shard`` or :func:`fsdp_replicate`) through ``hold``: ``hold(run)``
    returns True when it takes ``run`` to call later, False to let it run now. Each group's
    ``post_backward`` is wrapped on the instance (FSDP2's ``FSDPState._fsdp_param_groups``;
    torch 2.11's ``_fsdp_param_group``), so both FSDP's hook and its end-of-backward callback go
    through ``hold``. Idempotent.

    Raises:
        NotImplementedError: this torch's FSDP2 keeps its parameter groups elsewhere.
    """
    for module in modules:
        for group in _param_groups(module):
            if getattr(group, "_moetrain_gated", False):
                continue
            post_backward = group.post_backward

            def gate(*args: object, _run: Callable[..., None] = post_backward) -> None:
                if not hold(lambda: _run(*args)):
                    _run(*args)

            group.post_backward = gate
            group._moetrain_gated = True


# -- torch.distributed.pipelining ------------------------------------------------------------

Action = _schedules._Action  # one entry of a schedule's order: (stage, computation type, micro-batch[, sub-actions])
FORWARD = _schedules.FORWARD
FULL_BACKWARD = _schedules.FULL_BACKWARD
# The merged forward + backward action of torch's pipeline runtime (torch >= 2.8, with
# ScheduleDualPipeV); None where this torch lacks it.
OVERLAP_F_B = getattr(_schedules, "OVERLAP_F_B", None)


def interleaved_1f1b_order(schedule: Any, rank: int) -> list[Any]:
    """``ScheduleInterleaved1F1B``'s compute order for pp rank ``rank``, computed by its own method
    on ``schedule`` (which must carry the attributes that method reads: ``pp_group_size``,
    ``n_local_stages``, ``number_of_rounds``, ``microbatches_per_round``, ``_n_microbatches``)."""
    return ScheduleInterleaved1F1B._calculate_single_rank_operations(schedule, rank)


def disable_backward(schedule: Any) -> None:
    """Make ``schedule`` run forwards and the loss only (what ``schedule.eval()`` sets, without
    its merged return value of every micro-batch's output): ``_has_backward = False``."""
    schedule._has_backward = False


def stage_keeps_outputs() -> bool:
    """Whether this torch's pipeline stages keep each micro-batch's forward (outputs, inputs) in
    ``fwd_cache`` until its backward, which :class:`PipelineRuntime` reaches (torch 2.11-2.14; 2.15
    replaced it with ``_forward_chunk_states``, which may drop the outputs once they are sent)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    return "fwd_cache" in _PipelineStageBase.__init__.__code__.co_names


class LastStageOutputsUnchecked:
    """Mixin for a ``PipelineStage``: torch 2.11-2.13 check every forward's outputs against the
    shapes of the stage's first forward (``_validate_fwd_outputs``; 2.14 no longer does). The last
    stage's outputs go to the loss, never to a peer, and with multi-token prediction its logits
    are [B, S, 1 + D, V] in training and [B, S, V] in evaluation: the check is skipped there and
    kept for every stage that sends its outputs on."""

    def _validate_fwd_outputs(self, outputs: tuple) -> None:
        if not self.is_last:  # type: ignore[attr-defined]
            check = getattr(super(), "_validate_fwd_outputs", None)
            if check is not None:
                check(outputs)


class PipelineRuntime(_schedules._PipelineScheduleRuntime):
    """torch's pipeline runtime (``_PipelineScheduleRuntime``) with the pieces a custom order
    needs, under public names: :meth:`set_order` lowers a compute order with torch's send/recv
    and FSDP passes; :meth:`wait_recv`, :meth:`forward_chunk` and :meth:`backward_chunk` do what
    the runtime's own FORWARD / FULL_BACKWARD actions do; :meth:`stage_outputs` and
    :meth:`replace_stage_outputs` reach the stage's saved forward outputs. Custom actions are
    registered with the runtime's ``register_custom_function``.

    Raises:
        NotImplementedError: (at construction) this torch's runtime lacks custom functions.
    """

    def __init__(self, stages: list[Any], n_microbatches: int, loss_fn: Callable) -> None:
        if OVERLAP_F_B is None or not hasattr(_schedules._PipelineScheduleRuntime, "register_custom_function"):
            raise NotImplementedError(f"torch {torch.__version__}'s pipeline runtime lacks the OVERLAP_F_B actions "
                                      f"and custom functions this schedule needs")
        if not stage_keeps_outputs():
            raise NotImplementedError(f"torch {torch.__version__}'s pipeline stages keep no per-micro-batch forward "
                                      f"outputs (fwd_cache, removed in torch 2.15) for a backward to start from")
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        self.stage_of = {s.stage_index: s for s in stages}

    @property
    def n_microbatches(self) -> int:
        return self._n_microbatches

    def set_order(self, order: dict[int, list[Any]]) -> None:
        """Run ``order`` (pp rank → its actions): lowered with the runtime's communication passes."""
        self.pipeline_order = order
        self._prepare_schedule_with_comms(order)

    def wait_recv(self, action: Any) -> None:
        """Wait for the activations (forward) or gradients (backward) ``action`` receives."""
        stage = self.stage_of[action.stage_index]
        key = (action.stage_index, action.microbatch_index)
        if action.computation_type == FORWARD and not stage.is_first:
            _schedules._wait_batch_p2p(self.fwd_recv_ops.pop(key))
        elif action.computation_type == FULL_BACKWARD and not stage.is_last:
            _schedules._wait_batch_p2p(self.bwd_recv_ops.pop(key))

    def forward_chunk(self, action: Any, ctx: Any, **forward_kwargs: Any) -> None:
        """The forward of ``action``'s micro-batch on its stage, and the loss on the last stage."""
        stage, mb = self.stage_of[action.stage_index], action.microbatch_index
        self._assert_unsharded(stage)
        output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], **forward_kwargs)
        self._maybe_compute_loss(stage, output, ctx.target_mbs, mb)

    def loss_of(self, action: Any) -> torch.Tensor | None:
        """The loss of ``action``'s micro-batch (last stage), None elsewhere."""
        return self._maybe_get_loss(self.stage_of[action.stage_index], action.microbatch_index)

    def stage_outputs(self, action: Any) -> tuple[tuple, Any]:
        """(outputs, inputs) saved by the forward of ``action``'s micro-batch on its stage."""
        outputs, inputs = self.stage_of[action.stage_index].fwd_cache[action.microbatch_index]
        return (tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)), inputs

    def replace_stage_outputs(self, action: Any, outputs: tuple, inputs: Any) -> None:
        """Replace what :meth:`stage_outputs` returns (the backward starts from these outputs)."""
        self.stage_of[action.stage_index].fwd_cache[action.microbatch_index] = (outputs, inputs)

    def backward_chunk(self, action: Any, loss: torch.Tensor | None) -> None:
        """The full backward of ``action``'s micro-batch on its stage (``loss`` on the last)."""
        stage, mb = self.stage_of[action.stage_index], action.microbatch_index
        self._assert_unsharded(stage)
        self.backward_counter[action.stage_index] += 1
        last = self.backward_counter[action.stage_index] == self._n_microbatches
        stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)


# -- CUDA memory -------------------------------------------------------------------------------


def record_cuda_memory_history(max_entries: int) -> None:
    """Keep the stack of each of the last ``max_entries`` CUDA allocations, for memory snapshots
    (``torch.cuda.memory._record_memory_history``, what PyTorch's memory-viz guide uses)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the CUDA caching allocator's state (and the recorded history) to ``path`` as a pickle
    for https://pytorch.org/memory_viz (``torch.cuda.memory._dump_snapshot``)."""
    torch.cuda.memory._dump_snapshot(path)


# -- submitit ---------------------------------------------------------------------------------


def render_submission(executor: Any, params: dict[str, Any]) -> str:
    """The sbatch script submitit's ``SlurmExecutor`` ``executor`` would submit with ``params``
    (``AutoExecutor.update_parameters`` keys): generic keys through the executor's equivalence
    table (``timeout_min`` → ``time``, ``mem_gb`` → ``mem``), ``slurm_`` keys with the prefix
    dropped (what ``AutoExecutor`` does), then submitit's own ``_make_submission_file_text``."""
    import submitit

    generic = set(submitit.AutoExecutor._typed_parameters())
    converted = executor._convert_parameters({k: v for k, v in params.items() if k in generic})
    converted.update({k[len("slurm_"):]: v for k, v in params.items() if k.startswith("slurm_")})
    executor.update_parameters(**converted)
    return executor._make_submission_file_text(executor._submitit_command_str, uid="dry-run")


def keep_local_job(job: Any) -> None:
    """Keep a submitit local job running when its handle is garbage-collected (submitit cancels
    it then: ``Job._cancel_at_deletion``)."""
    job._cancel_at_deletion = False


# -- the check ---------------------------------------------------------------------------------


def missing() -> list[str]:
    """The internals above that this torch / submitit lacks (empty when all are there), each
    named with where it was looked for."""
    import submitit
    from submitit.local.local import LocalJob
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    found = {
        "DeviceMesh._flatten / _unflatten": hasattr(DeviceMesh, "_flatten") and hasattr(DeviceMesh, "_unflatten"),
        "torch.distributed.tensor._utils.compute_local_shape_and_global_offset": _importable(
            "torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
        "torch._foreach_norm": hasattr(torch, "_foreach_norm"),
        "Variable._execution_engine.queue_callback": hasattr(torch.autograd.Variable._execution_engine,
                                                              "queue_callback"),
        "torch.distributed._composable.replicate_with_fsdp.replicate": _importable(
            "torch.distributed._composable.replicate_with_fsdp", "replicate"),
        "FSDPModule._get_fsdp_state, FSDPState._fsdp_param_group(s)": hasattr(FSDPModule, "_get_fsdp_state") and (
            "_fsdp_param_groups" in FSDPState.__init__.__code__.co_names
            or "_fsdp_param_group" in FSDPState.__init__.__code__.co_names),
        "pipelining._Action / FORWARD / FULL_BACKWARD / OVERLAP_F_B": all(
            hasattr(_schedules, n) for n in ("_Action", "FORWARD", "FULL_BACKWARD", "OVERLAP_F_B")),
        "ScheduleInterleaved1F1B._calculate_single_rank_operations": hasattr(
            ScheduleInterleaved1F1B, "_calculate_single_rank_operations"),
        "_PipelineScheduleRuntime (register_custom_function, _prepare_schedule_with_comms, _assert_unsharded, "
        "_maybe_compute_loss, _maybe_get_loss, _wait_batch_p2p)": hasattr(_schedules, "_wait_batch_p2p") and all(
            hasattr(_schedules._PipelineScheduleRuntime, n) for n in (
                "register_custom_function", "_prepare_schedule_with_comms", "_assert_unsharded",
                "_maybe_compute_loss", "_maybe_get_loss")),
        "AutoExecutor._typed_parameters": hasattr(submitit.AutoExecutor, "_typed_parameters"),
        "SlurmExecutor._convert_parameters / _make_submission_file_text / _submitit_command_str": all(
            hasattr(submitit.SlurmExecutor, n) for n in (
                "_convert_parameters", "_make_submission_file_text", "_submitit_command_str")),
        "LocalJob._cancel_at_deletion": "_cancel_at_deletion" in LocalJob.__init__.__code__.co_names,
        "PipelineStage.fwd_cache": stage_keeps_outputs(),
        "torch.cuda.memory._record_memory_history / _dump_snapshot": all(
            hasattr(torch.cuda.memory, n) for n in ("_record_memory_history", "_dump_snapshot")),
    }
    return [name for name, ok in found.items() if not ok]


def _importable(module: str, name: str) -> bool:
    try:
        return hasattr(__import__(module, fromlist=[name]), name)
    except ImportError:
        return False
