"""The parallel state: process group initialisation and the device meshes with named axes.

One :class:`ParallelState` object is built per process and passed explicitly to whoever needs
a group; nothing here is a module global.

Axes (:mod:`moetrain.axes`):

* dense mesh ``(pp, dp, cp, tp)`` — world = pp × dp × cp × tp;
* expert mesh ``(pp, edp, tp, ep)`` — inside one pipeline stage, the dp × cp ranks (flattened
  dp-major) are split into ``edp`` × ``ep`` with ``ep`` innermost ("parallel folding",
  Megatron-Core; torchtitan does the same). Experts are split over ``ep`` (and their ffn width
  over ``tp`` under expert-tensor parallelism); the ranks with the same ``(pp, ep)`` coordinate
  hold replicas of the same experts and reduce their gradients (``edp_tp``, or ``edp`` under
  expert-tensor parallelism).

Both meshes are built from the same rank tensor ``[pp, dp, cp, tp]`` given by the topology
mapper, so the placement shown by ``python -m moetrain.ranks`` is the one used.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from moetrain.axes import CP, CP_TP, DENSE_AXES, DP, DP_CP, DP_CP_TP, EDP, EDP_TP, EP, EXPERT_AXES, PP, TP
from moetrain.config import ParallelConfig
from moetrain.internals import flatten_mesh, unflatten_mesh

__all__ = ["ParallelState", "hsdp_sizes", "init_distributed", "PP", "DP", "CP", "TP", "EDP", "EP", "DP_CP", "CP_TP",
           "DP_CP_TP", "EDP_TP"]


def hsdp_sizes(p: ParallelConfig) -> dict[str, tuple[int, int]]:
    """(replicate, shard) sizes of each FSDP replica axis that HSDP (``parallel.dp_shard``)
    splits, shard innermost: ``dp_cp`` into dp·cp/dp_shard × dp_shard; ``dp_cp_tp`` likewise
    with the tp ranks inside the shard group (tp is innermost); the experts' ``edp`` and
    ``edp_tp`` over :attr:`~moetrain.config.ParallelConfig.expert_dp_shard` (× tp). Empty
    without HSDP; an axis whose shard group is all of it is left out (plain FSDP)."""
    if p.dp_shard is None:
        return {}
    s, se = p.dp_shard, p.expert_dp_shard
    sizes = {DP_CP: (p.dp * p.cp, s), DP_CP_TP: (p.dp * p.cp * p.tp, s * p.tp), EDP: (p.edp, se),
             EDP_TP: (p.edp * p.tp, se * p.tp)}
    return {axis: (size // shard, shard) for axis, (size, shard) in sizes.items() if shard < size}


def init_distributed(backend: str = "auto", timeout_s: float = 600.0) -> torch.device:
    """Initialise the default process group from the environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK) unless already done; returns this rank's device.

    ``backend="auto"`` (or ``"nccl"``) on a CUDA machine initialises one process group per device
    type, ``"cpu:gloo,cuda:nccl"``: collectives on CUDA tensors (every one of the training step)
    run on NCCL, the few on CPU tensors (the stop-flag agreement, checkpoint and rank-map
    metadata, which must not cost a device sync) on gloo — an NCCL-only group would reject them.
    Without CUDA it is gloo. ``timeout_s`` bounds every collective, so a dead peer is noticed
    instead of hanging forever.
    """
    use_cuda = torch.cuda.is_available() and backend in ("auto", "nccl")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        chosen = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
        # device_id binds the NCCL communicator to this rank's GPU eagerly (no guessing later).
        dist.init_process_group(chosen, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if use_cuda else None)
    return device


@dataclass
class ParallelState:
    """This process's coordinates and groups on the dense and expert meshes.

    Build with :meth:`build`. ``group(axis)`` returns the process group of an axis name
    (``pp``, ``dp``, ``cp``, ``tp``, ``ep``, ``edp``, ``dp_cp``, ``edp_tp``, ``cp_tp``, ``dp_cp_tp``); ``size`` and
    ``coord`` likewise. A size-1 axis still has a (trivial) group.
    """

    parallel: ParallelConfig
    mesh: DeviceMesh
    expert_mesh: DeviceMesh
    device: torch.device
    rank: int
    world_size: int
    flat: dict[str, DeviceMesh]  # the flattened axes (dp_cp, cp_tp, dp_cp_tp, edp_tp), kept as returned
    # HSDP (parallel.dp_shard): the (replicate, shard) mesh of each replica axis that is not
    # sharded whole — see hsdp_sizes
    hsdp: dict[str, DeviceMesh] = field(default_factory=dict)
    # NVLink domain of every global rank (from the rank map), for node-limited routing; None: one
    domains: list[int] | None = None
    _axes: dict[str, tuple] = field(default_factory=dict, repr=False)  # see _axis
    _stage_ends: dist.ProcessGroup | None = field(default=None, repr=False)  # see stage_ends_group
    # Process groups the parallel layer builds on first use, by name ("hierarchical": this rank's
    # (rail, domain) groups, moetrain.parallel.expert.hierarchical_groups); new_group is collective,
    # so each is built once, by every rank, in one order.
    extra_groups: dict[str, object] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, parallel: ParallelConfig, device: torch.device, mesh_ranks: Sequence | torch.Tensor | None = None,
              domains: Sequence[int] | None = None) -> "ParallelState":
        """Create both meshes. ``mesh_ranks``: global ranks laid out ``[pp, dp, cp, tp]`` (from
        :func:`moetrain.topology.build_rank_map`); ``None`` is the identity order. ``domains``:
        the NVLink domain (node) of every global rank, from the same rank map; ``None``: all in
        one.

        Raises:
            ValueError: the process group's world size differs from pp × dp × cp × tp, or
                ``mesh_ranks`` is not a permutation of the ranks with that shape.
        """
        world = dist.get_world_size()
        p = parallel
        if world != p.world_size:
            raise ValueError(f"world size {world} != pp × dp × cp × tp = {p.pp} × {p.dp} × {p.cp} × {p.tp} "
                             f"= {p.world_size}; launch one process per rank")
        shape = (p.pp, p.dp, p.cp, p.tp)
        ranks = torch.arange(world).reshape(shape) if mesh_ranks is None else torch.as_tensor(mesh_ranks)
        if tuple(ranks.shape) != shape or sorted(ranks.flatten().tolist()) != list(range(world)):
            raise ValueError(f"mesh_ranks must be a permutation of 0..{world - 1} shaped {shape}, "
                             f"got shape {tuple(ranks.shape)}")
        dev_type = device.type
        mesh = DeviceMesh(dev_type, ranks, mesh_dim_names=DENSE_AXES)
        flat = {DP_CP: flatten_mesh(mesh[(DP, CP)], DP_CP), CP_TP: flatten_mesh(mesh[(CP, TP)], CP_TP),
                DP_CP_TP: flatten_mesh(mesh[(DP, CP, TP)], DP_CP_TP)}
        expert_ranks = ranks.reshape(p.pp, p.edp, p.ep, p.tp).permute(0, 1, 3, 2)
        expert_mesh = DeviceMesh(dev_type, expert_ranks, mesh_dim_names=EXPERT_AXES)
        flat[EDP_TP] = flatten_mesh(expert_mesh[(EDP, TP)], EDP_TP)
        if domains is not None and len(domains) != world:
            raise ValueError(f"domains gives {len(domains)} ranks' NVLink domains, the world has {world}")
        hsdp = {}
        for axis, (replicate, shard) in hsdp_sizes(p).items():  # the same order on every rank
            one_d = flat[axis] if axis in flat else expert_mesh[axis]
            hsdp[axis] = unflatten_mesh(one_d, (replicate, shard), (f"{axis}_replicate", f"{axis}_shard"))
        return cls(parallel=p, mesh=mesh, expert_mesh=expert_mesh, device=device,
                   rank=dist.get_rank(), world_size=world, flat=flat, hsdp=hsdp,
                   domains=list(domains) if domains is not None else None)

    def _axis(self, axis: str) -> tuple[DeviceMesh, dist.ProcessGroup, int, int]:
        """(1-D mesh, group, size, coordinate) of an axis. Cached: slicing a DeviceMesh works on
        its rank tensor in Python, and every step asks for sizes and groups many times."""
        if axis not in self._axes:
            if axis in self.flat:
                mesh = self.flat[axis]
            elif axis in (EDP, EP):
                mesh = self.expert_mesh[axis]
            else:
                mesh = self.mesh[axis]
            self._axes[axis] = (mesh, mesh.get_group(), mesh.size(), mesh.get_local_rank())
        return self._axes[axis]

    def submesh(self, axis: str) -> DeviceMesh:
        """The 1-D mesh of an axis (flattened axes included)."""
        return self._axis(axis)[0]

    def fsdp_mesh(self, axis: str) -> DeviceMesh:
        """The mesh FSDP2 shards a replica group ``axis`` over: its (replicate, shard) mesh under
        HSDP (``parallel.dp_shard``), else its 1-D mesh."""
        return self.hsdp.get(axis) or self.submesh(axis)

    def group(self, axis: str) -> dist.ProcessGroup:
        return self._axis(axis)[1]

    def size(self, axis: str) -> int:
        return self._axis(axis)[2]

    def coord(self, axis: str) -> int:
        return self._axis(axis)[3]

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this process's group on ``axis``, in axis order."""
        return dist.get_process_group_ranks(self.group(axis))

    def stage_ends_group(self) -> dist.ProcessGroup:
        """The group of this rank and its peer at the other end of the pipeline (pp coordinates 0
        and pp − 1, the same dp, cp and tp coordinates): Megatron's embedding group, which sums
        the gradients of a weight both ends hold (the embedding under multi-token prediction).
        Collective: every rank calls it, the first time, in the same order. Raises
        ``ValueError`` with pp = 1."""
        if self.size(PP) == 1:
            raise ValueError("the stage-ends group needs pipeline parallelism (pp > 1)")
        if self._stage_ends is None:
            ends = self.mesh.mesh[[0, -1]].reshape(2, -1).T.tolist()  # [dp·cp·tp pairs, 2]
            self._stage_ends, _ = dist.new_subgroups_by_enumeration(ends)
        return self._stage_ends

    @property
    def is_logging_rank(self) -> bool:
        """Rank 0 writes metrics and logs for the whole run."""
        return self.rank == 0
