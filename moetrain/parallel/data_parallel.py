"""Data-parallel gradient reduction (ZeRO stage 0) and the global gradient norm.

The training objective is the mean of the per-micro-batch losses over every micro-batch of the
global batch. Each rank back-propagates its own micro-batches scaled by 1 / accumulation steps;
gradients then have to be *averaged* over the ranks that saw different data:

* dense parameters are replicated on every rank of ``dp_cp`` (dp × cp): sum there, divide by
  dp·cp;
* expert parameters live on one rank per ep group and are replicated over ``edp_tp``. Each
  replica already holds the sum of the contributions of its ep group's dp·cp/edp ranks (the
  all-to-all backward brings them home), so they are summed over ``edp_tp`` and divided by the
  same dp·cp.

Reduction happens once per optimizer step (no communication during gradient accumulation), in
flat buckets to keep the number of collectives small. :class:`OverlappedGradReducer` starts each
bucket's all-reduce during the last micro-batch's backward, as soon as autograd has produced its
gradients (PyTorch DDP's bucketing, Li et al. 2020 §3.2.3, in reverse parameter order), so the
communication runs while earlier layers still compute their gradients; what it cannot start
early (DTensor and tp-summed gradients, pipeline stages) goes through :func:`reduce_gradients`
after the backward, as before.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor, Replicate

from moetrain.model.moe import GroupedExperts
from moetrain.parallel.peers import waiting_on_peers
from moetrain.parallel.state import DP_CP, EDP, EDP_TP, EP, PP, TP, ParallelState
from moetrain.parallel.tensor import TP_PARTIAL

BUCKET_BYTES = 32 * 2**20


def split_expert_params(parts: list[nn.Module]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense parameters, expert parameters) of the model parts, each in a stable order, shared
    (tied) parameters once."""
    expert_ids = {id(p) for part in parts for m in part.modules() if isinstance(m, GroupedExperts)
                  for p in m.parameters()}
    dense, expert, seen = [], [], set()
    for p in (p for part in parts for p in part.parameters()):
        if id(p) in seen:
            continue
        seen.add(id(p))
        (expert if id(p) in expert_ids else dense).append(p)
    return dense, expert


def _allreduce_mean(grads: list[torch.Tensor], group: dist.ProcessGroup, divisor: float) -> None:
    """Sum ``grads`` over ``group`` in ≤ BUCKET_BYTES flat buckets, then divide by ``divisor``."""
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if not bucket:
            return
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        flat.div_(divisor)
        for g, r in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(r)
        bucket, size = [], 0

    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= BUCKET_BYTES:
            flush()
    flush()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _replicate_partial_grads(params: list[nn.Parameter]) -> None:
    """Sum DTensor gradients that are ``Partial(sum)`` over their partial mesh axes and mark them
    ``Replicate``. They come from replicated parameters applied to sharded activations: the norm
    weights under sequence parallelism (each tp rank holds its sequence shard's part of the sum).
    Without this the data-parallel reduction and the norm would see only this rank's part, and
    the optimizer would mix Partial gradients into Replicate parameters."""
    pending: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            dims = tuple(i for i, pl in enumerate(g.placements) if pl.is_partial())
            for i in dims:
                if getattr(g.placements[i], "reduce_op", "sum") != "sum":
                    raise NotImplementedError(f"gradient placement {g.placements[i]} (only Partial(sum) is reduced)")
            pending.setdefault((id(g.device_mesh), dims), []).append(p)
    for (_, dims), ps_ in sorted(pending.items(), key=lambda kv: kv[0][1]):  # same order on every rank
        mesh = ps_[0].grad.device_mesh
        locals_ = [p.grad.to_local() for p in ps_]
        for i in dims:
            _allreduce_mean(locals_, mesh.get_group(i), 1.0)
        for p, local in zip(ps_, locals_):
            placements = [Replicate() if pl.is_partial() else pl for pl in p.grad.placements]
            p.grad = DTensor.from_local(local, mesh, placements, run_check=False)


def expert_replica_axis(ps: ParallelState) -> str:
    """The axis of the ranks holding replicas of the same expert pieces: ``edp_tp``, or ``edp``
    under expert-tensor parallelism (where the tp ranks hold different columns)."""
    return EDP if ps.parallel.etp > 1 else EDP_TP


def reduced_by_fsdp(p: nn.Parameter) -> bool:
    """True for parameters whose gradients FSDP (ZeRO) reduces itself."""
    return getattr(p, "_moetrain_fsdp", False)


@torch.no_grad()
def reduce_gradients(parts: list[nn.Module], ps: ParallelState, exclude: frozenset[int] = frozenset()) -> None:
    """Average gradients over the data-parallel ranks (see the module docstring).

    Parameters without a gradient get a zero gradient first so every rank joins every bucket.
    DTensor gradients (tensor parallelism) are reduced through their local shards; parameters
    under FSDP are skipped (FSDP reduce-scatters them itself). Parameters tagged
    ``_moetrain_tp_partial`` (plain parameters fed different tokens on each tp rank, e.g. the
    router under sequence parallelism) are also summed over tp, FSDP's shards of them included.
    ``Partial(sum)`` DTensor gradients (norm weights under sequence parallelism) are first summed
    over their partial axes and become ``Replicate``. Parameters whose ``id`` is in ``exclude`` are
    left alone (an :class:`OverlappedGradReducer` reduces them).
    """
    all_dense, expert = split_expert_params(parts)
    dense = [p for p in all_dense if not reduced_by_fsdp(p) and id(p) not in exclude]
    expert = [p for p in expert if not reduced_by_fsdp(p) and id(p) not in exclude]
    # [zero] FSDP averages over dp_cp only: tp-partial parameters under FSDP still need the tp sum.
    tp_partial = [p for p in all_dense if getattr(p, "_moetrain_tp_partial", False)]
    for p in dense + expert + tp_partial:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    _replicate_partial_grads(dense)
    divisor = ps.size(DP_CP)
    if ps.size(DP_CP) > 1 and dense:
        _allreduce_mean([_local(p.grad) for p in dense], ps.group(DP_CP), divisor)
    if ps.size(TP) > 1 and tp_partial:
        _allreduce_mean([_local(p.grad) for p in tp_partial], ps.group(TP), 1.0)
    if expert:
        axis = expert_replica_axis(ps)
        if ps.size(axis) > 1:
            _allreduce_mean([_local(p.grad) for p in expert], ps.group(axis), divisor)
        elif divisor != 1:
            for p in expert:
                p.grad.div_(divisor)


class _Bucket:
    """Parameters whose gradients are all-reduced together, flattened into one buffer."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup):
        self.params, self.group = params, group
        self.ready = 0
        self.flat: torch.Tensor | None = None
        self.work = None


class OverlappedGradReducer:
    """Data-parallel gradient averaging that overlaps the last micro-batch's backward.

    Eligible are plain (non-DTensor) parameters outside FSDP and not summed over tp: dense ones
    are averaged over ``dp_cp``, experts over ``edp_tp`` (divided by dp·cp as in
    :func:`reduce_gradients`). They are cut into ≤ ``bucket_bytes`` buckets in reverse
    registration order, which is roughly the order backward produces their gradients. During the
    backward after :meth:`arm`, a ``post_accumulate_grad`` hook counts each bucket's parameters;
    a complete bucket is flattened and its all-reduce started asynchronously — in bucket order on
    every rank, so the collectives pair up (a bucket that completes early waits for the ones
    before it). :meth:`finish` starts what is left (parameters that got no gradient get zeros),
    reduces the other parameters with :func:`reduce_gradients`, then waits, averages and writes
    the results back into ``.grad``.

    Without :meth:`arm` (pipeline schedules, whose backward order is theirs) :meth:`finish` does
    the whole reduction after the backward.
    """

    def __init__(self, parts: list[nn.Module], ps: ParallelState, bucket_bytes: int = BUCKET_BYTES):
        self.parts, self.ps = parts, ps
        self.divisor = float(ps.size(DP_CP))
        dense, expert = split_expert_params(parts)
        self.buckets: list[_Bucket] = []
        for params, axis in ((dense, DP_CP), (expert, expert_replica_axis(ps))):
            if ps.size(axis) == 1:  # nothing to communicate (experts are only divided, by finish)
                continue
            eligible = [p for p in reversed(params) if p.requires_grad and not isinstance(p, DTensor)
                        and not reduced_by_fsdp(p) and not getattr(p, TP_PARTIAL, False)]
            current: list[nn.Parameter] = []
            size = 0
            for p in eligible:
                current.append(p)
                size += p.numel() * p.element_size()
                if size >= bucket_bytes:
                    self.buckets.append(_Bucket(current, ps.group(axis)))
                    current, size = [], 0
            if current:
                self.buckets.append(_Bucket(current, ps.group(axis)))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.overlapped = frozenset(self._bucket_of)
        self.armed = False
        self._next = 0  # index of the next bucket to start
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for b in self.buckets for p in b.params]

    def arm(self) -> None:
        """Start reducing during the coming backward (call before the step's last micro-batch)."""
        self.armed = True
        for b in self.buckets:
            b.ready, b.flat, b.work = 0, None, None
        self._next = 0

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.armed:
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        # Start every complete bucket whose predecessors have started: the same order on all ranks.
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._start(self.buckets[self._next])
            self._next += 1

    @torch.no_grad()
    def _start(self, b: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        b.flat = _flatten_dense_tensors(grads)
        b.work = dist.all_reduce(b.flat, group=b.group, async_op=True)

    @torch.no_grad()
    def finish(self) -> None:
        """Complete the step's reduction: every gradient averaged over its data-parallel ranks."""
        for b in self.buckets[self._next:]:
            self._start(b)
        reduce_gradients(self.parts, self.ps, exclude=self.overlapped)
        for b in self.buckets:
            with waiting_on_peers():
                b.work.wait()
            b.flat.div_(self.divisor)
            for p, g in zip(b.params, _unflatten_dense_tensors(b.flat, b.params)):
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.copy_(g)
            b.flat = b.work = None
        self.armed, self._next = False, 0


@torch.no_grad()
def global_grad_norm(parts: list[nn.Module], ps: ParallelState) -> torch.Tensor:
    """L2 norm of the full gradient, each element counted once: an fp32 scalar on the training
    device (nothing is read to the host).

    Per kind of placement, the local pieces' norm is taken with ``torch.nn.utils.get_total_norm``
    (foreach kernels) and squared; the squares are summed over the ranks that hold different
    pieces: the mesh axes a DTensor gradient is sharded on (tp, FSDP's axes), ep for expert
    parameters, and pp for everything. Replicated pieces are summed over no group, so they count
    once.
    """
    dense, expert = split_expert_params(parts)
    pieces: dict[tuple, tuple[list[torch.Tensor], tuple]] = {}
    for is_expert, params in ((False, dense), (True, expert)):
        for p in params:
            g = p.grad
            if g is None:
                continue
            groups: tuple = ()
            if isinstance(g, DTensor):
                mesh = g.device_mesh
                # [zero] FSDP × TP shards dim 0 over dp_cp as _StridedShard, for which is_shard()
                # is False (torch 2.13): count every placement that is neither Replicate nor Partial.
                groups = tuple((mesh.mesh_dim_names[i], mesh) for i, pl in enumerate(g.placements)
                               if not (pl.is_replicate() or pl.is_partial()))
            key = (is_expert, tuple(name for name, _ in groups))
            pieces.setdefault(key, ([], groups))[0].append(_local(g).detach())
    total = torch.zeros((), dtype=torch.float32, device=ps.device)
    for key in sorted(pieces):  # the same order on every rank of a stage
        grads, groups = pieces[key]
        value = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True).float().pow(2)
        for name, mesh in groups:
            dist.all_reduce(value, group=mesh.get_group(name))
        if key[0] and ps.size(EP) > 1:
            dist.all_reduce(value, group=ps.group(EP))
        if key[0] and ps.parallel.etp > 1:  # expert-tensor parallelism: experts' columns over tp
            dist.all_reduce(value, group=ps.group(TP))
        total += value
    if ps.size(PP) > 1:
        dist.all_reduce(total, group=ps.group(PP))
    return total.sqrt()


@torch.no_grad()
def clip_gradients(parts: list[nn.Module], max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)) with
    ``torch.nn.utils.clip_grads_with_norm_`` (foreach; the factor stays on the device, no host
    read). ``norm``: the global norm from :func:`global_grad_norm`. A non-finite norm makes the
    gradients non-finite too; the trainer stops on it when it reads the step's metrics.
    ``max_norm <= 0`` is handled by the caller (no clipping)."""
    # DTensor gradients are scaled through their local shards: DTensor's foreach ops do not take
    # the plain-tensor factor. clip_grads_with_norm_ only reads ``.grad`` of what it is given.
    holders = [SimpleNamespace(grad=_local(p.grad)) for p in {id(p): p for part in parts for p in part.parameters()}.values()
               if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(holders, max_norm, norm, foreach=True)
