"""Each sharded weight matrix whole on one rank: gather it, apply a function, scatter it back.

Muon (:class:`moetrain.train.optim.Muon`) orthogonalizes every weight matrix as a whole, but
FSDP2 (ZeRO 1-3), tensor and expert-tensor parallelism leave each rank a block of it, and expert
parallelism leaves each rank some of the experts. :class:`WholeMatrices` gives every matrix one
*owner* among the ranks that hold a piece of it and spreads the matrices over those ranks so
that each computes about 1/k of the work of the matrices k ranks share (Moonlight, Liu et al.
2025, §2.3 "Distributed Muon" — there over ZeRO-1's dp group; here over whatever placement the
parameter's DTensor says it has). One :meth:`WholeMatrices.apply`, on the ranks of one pipeline
stage (the plan is the same on each):

1. gather — every block not on its matrix's owner goes there, all in one all-to-all;
2. apply — each owner runs the function on the matrices it owns, stacked by shape (one batched
   call per shape);
3. scatter — every rank that holds a block of a matrix gets its block of the result back, in one
   all-to-all.

A matrix one rank holds whole and alone (a routed expert under ep, or under FSDP, which shards
the expert stack along its expert dim) is never sent: its owner is that rank. A matrix held whole
by several ranks (ZeRO-0's replicas) is computed by one of them and sent to the others.
Traffic: each matrix's blocks are sent once to the owner and once back — the least any scheme
that computes each matrix once on one rank can send (:meth:`WholeMatrices.traffic`).

Legend: a *unit* is one matrix — a 2-D parameter, or one [m, n] slice of a 3-D stack
[E, m, n] of routed experts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moetrain.internals import local_shape_and_offset

__all__ = ["WholeMatrices"]


def _elements(m: int, n: int) -> int:
    return m * n


@dataclass(frozen=True)
class _Block:
    """One rank's block of one unit: its group rank, index into its local stack (None: 2-D),
    rows and columns of the matrix it holds."""

    rank: int
    local_index: int | None
    rows: tuple[int, int]
    cols: tuple[int, int]

    @property
    def numel(self) -> int:
        return (self.rows[1] - self.rows[0]) * (self.cols[1] - self.cols[0])


@dataclass
class _Unit:
    param: int  # index into the tensors given to apply()
    shape: tuple[int, int]
    owner: int  # group rank
    sources: list[_Block]  # the blocks the owner assembles the matrix from (its own included)
    holders: list[_Block]  # every block held, each receives its piece of the result


def _describe(t: torch.Tensor, group_rank_of: dict[int, int], me: int) -> tuple:
    """(global shape, group ranks sharing it, offset, local shape) of one parameter on this rank.
    A plain tensor is this rank's alone."""
    if isinstance(t, DTensor):
        if any(p.is_partial() for p in t.placements):
            raise ValueError(f"a matrix placed {t.placements} cannot be gathered whole: a Partial placement "
                             f"holds unreduced sums, not blocks")
        local, offset = local_shape_and_offset(t.shape, t.device_mesh, t.placements)
        ranks = tuple(sorted(group_rank_of[r] for r in t.device_mesh.mesh.flatten().tolist()))
        return tuple(t.shape), ranks, offset, local
    return tuple(t.shape), (me,), (0,) * t.ndim, tuple(t.shape)


def _block_of(tensors: Sequence[torch.Tensor | None], i: int, blk: _Block) -> torch.Tensor:
    t = tensors[i]
    assert t is not None
    return t if blk.local_index is None else t[blk.local_index]


class WholeMatrices:
    """The gather → apply → scatter plan of a fixed list of parameters (see the module docstring).

    Args:
        params: the parameters, 2-D [m, n] or 3-D stacks [E, m, n], DTensors or plain tensors, in
            the same order on every rank of ``group`` (the same model part of one pipeline stage).
        group: the ranks of the pipeline stage (every mesh a parameter lives on is inside it), or
            None for one process. Building the plan is collective over it (one object all-gather).
        cost: work of one [m, n] matrix, for balancing (Muon passes Newton–Schulz's FLOPs,
            :func:`moetrain.planner.model.newton_schulz_flops`; default: its elements).

    Raises:
        ValueError: a parameter is not 2-D or 3-D, has a Partial placement, the ranks disagree on
            the parameter list, or a matrix's blocks do not tile it.
    """

    def __init__(self, params: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None,
                 cost: Callable[[int, int], int] = _elements):
        for t in params:
            if t.ndim not in (2, 3):
                raise ValueError(f"a parameter of shape {tuple(t.shape)} is not a matrix [m, n] nor a stack "
                                 f"[E, m, n]")
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.me = dist.get_rank(group) if group is not None else 0
        group_rank_of = ({g: i for i, g in enumerate(dist.get_process_group_ranks(group))} if group is not None
                         else {dist.get_rank() if dist.is_initialized() else 0: 0})
        mine = [_describe(t, group_rank_of, self.me) for t in params]
        every: list = [None] * self.world
        if group is not None and self.world > 1:
            dist.all_gather_object(every, mine, group=group)
        else:
            every = [mine]
        shapes = [[m[0] for m in rank_meta] for rank_meta in every]
        if any(s != shapes[0] for s in shapes):
            bad = next(r for r, s in enumerate(shapes) if s != shapes[0])
            raise ValueError(f"ranks 0 and {bad} of the stage hold different parameter lists "
                             f"({len(shapes[0])} vs {len(shapes[bad])} parameters): the plan needs one list")
        self.load = [0] * self.world  # work owned per rank, in cost units
        self.units = self._plan(every, cost)
        self._steps(len(params))

    # -- the plan, the same on every rank --------------------------------------------------------

    def _plan(self, every: list, cost: Callable[[int, int], int]) -> list[_Unit]:
        """Every matrix's holders, owner and source blocks, from every rank's description of
        every parameter; each owner is the least-loaded holder (one holding it whole first)."""
        units: list[_Unit] = []
        load = self.load
        for i, (shape, _, _, _) in enumerate(every[0]):
            m, n = shape[-2:]
            count = shape[0] if len(shape) == 3 else 1
            by_mesh: dict[tuple, list[tuple[int, tuple, tuple]]] = defaultdict(list)
            for rank, rank_meta in enumerate(every):
                _, ranks, offset, local = rank_meta[i]
                if math.prod(local):
                    by_mesh[ranks].append((rank, offset, local))
            # replicas on different meshes (tp ranks each holding a whole copy) are planned apart
            for ranks in sorted(by_mesh):
                for b in range(count):
                    held = []
                    for rank, offset, local in by_mesh[ranks]:
                        if len(shape) == 3 and not offset[0] <= b < offset[0] + local[0]:
                            continue
                        held.append(_Block(rank, b - offset[0] if len(shape) == 3 else None,
                                           (offset[-2], offset[-2] + local[-2]), (offset[-1], offset[-1] + local[-1])))
                    if not held:
                        continue
                    whole = [blk.rank for blk in held if blk.numel == m * n]
                    candidates = whole or sorted({blk.rank for blk in held})
                    owner = min(candidates, key=lambda r: (load[r], r))
                    load[owner] += cost(m, n)
                    sources: dict[tuple, _Block] = {}
                    for blk in sorted(held, key=lambda blk: (blk.rank != owner, blk.rank)):
                        sources.setdefault((blk.rows, blk.cols), blk)  # the owner's own block first
                    if whole:
                        sources = {((0, m), (0, n)): next(blk for blk in held if blk.rank == owner)}
                    if sum(blk.numel for blk in sources.values()) != m * n:
                        raise ValueError(f"parameter {i} {tuple(shape)}: the blocks held of matrix {b} do not tile "
                                         f"it: {sorted(sources)}")
                    units.append(_Unit(i, (m, n), owner, list(sources.values()), held))
        return units

    def _steps(self, n_params: int) -> None:
        """This rank's part of the plan, in the order both ends of each transfer walk it."""
        me = self.me
        self.gather_send: list[list[tuple[int, _Block]]] = [[] for _ in range(self.world)]
        self.gather_recv: list[list[tuple[int, _Block]]] = [[] for _ in range(self.world)]
        self.scatter_send: list[list[tuple[int, _Block]]] = [[] for _ in range(self.world)]
        self.scatter_recv: list[list[tuple[int, _Block]]] = [[] for _ in range(self.world)]
        self.sent_numel = [0] * self.world  # per rank, both phases: elements sent per apply()
        # Parameters whose every matrix here is this rank's alone and whole: one batched call on
        # the local stack, no copies (the routed experts under ep, or FSDP's expert-dim shards).
        alone: dict[int, bool] = {}
        for u in self.units:
            mine = [blk for blk in u.holders if blk.rank == me]
            if mine:
                alone[u.param] = alone.get(u.param, True) and (
                    u.owner == me and len(u.holders) == 1 and mine[0].numel == math.prod(u.shape))
        self.local_only = {i for i, ok in alone.items() if ok}
        self.owned: list[int] = []  # units I assemble and compute (the local-only ones aside)
        self.kept: list[tuple[int, _Block]] = []  # (unit, my block) of units I own and hold
        for k, u in enumerate(self.units):
            for blk in u.sources:
                if blk.rank != u.owner:
                    self.sent_numel[blk.rank] += blk.numel
                    if blk.rank == me:
                        self.gather_send[u.owner].append((u.param, blk))
                    if u.owner == me:
                        self.gather_recv[blk.rank].append((k, blk))
            for blk in u.holders:
                if blk.rank != u.owner:
                    self.sent_numel[u.owner] += blk.numel
                    if u.owner == me:
                        self.scatter_send[blk.rank].append((k, blk))
                    if blk.rank == me:
                        self.scatter_recv[u.owner].append((u.param, blk))
                elif blk.rank == me and u.param not in self.local_only:
                    self.kept.append((k, blk))
            if u.owner == me and u.param not in self.local_only:
                self.owned.append(k)
        self.n_params = n_params
        self.communicates = any(self.sent_numel)
        # what apply() would otherwise work out every step: the sizes each all-to-all receives,
        # and the owned matrices by shape (one fn call per shape)
        self.gather_numels = [[blk.numel for _, blk in recvs] for recvs in self.gather_recv]
        self.scatter_numels = [[blk.numel for _, blk in recvs] for recvs in self.scatter_recv]
        by_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
        for k in self.owned:
            by_shape[self.units[k].shape].append(k)
        self.owned_by_shape = list(by_shape.values())

    # -- one step --------------------------------------------------------------------------------

    def apply(self, tensors: Sequence[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor],
              wire_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """``fn`` of every whole matrix, each computed once, on its owner; returns this rank's
        blocks of the results (same shapes and dtypes as ``tensors``).

        Args:
            tensors: this rank's local blocks of the parameters the plan was built for, in the
                same order: [m', n'] or [E', m', n'] (plain tensors, not DTensors).
            fn: the matrix function, applied to a stack [k, m, n] of whole matrices; returns the
                same shape.
            wire_dtype: dtype of the blocks on the wire and of ``fn``'s input (bf16 when ``fn``
                computes in bf16 anyway); default: the tensors' own.
        """
        if len(tensors) != self.n_params:
            raise ValueError(f"{len(tensors)} tensors for a plan of {self.n_params} parameters")
        wire = wire_dtype or tensors[0].dtype
        device = tensors[0].device
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for i in self.local_only:
            out[i] = fn(tensors[i].to(wire)).to(tensors[i].dtype)

        # 1. gather: my blocks of the matrices others own, to their owners
        received = self._exchange([[_block_of(tensors, i, blk).to(wire).reshape(-1) for i, blk in sends]
                                   for sends in self.gather_send], self.gather_numels, wire, device)
        # 2. apply: assemble each owned matrix from its blocks, run fn once per shape
        full: dict[int, torch.Tensor] = {}
        for k in self.owned:
            u = self.units[k]
            own = _block_of(tensors, u.param, u.sources[0]).to(wire)  # the owner holds a block of it
            if u.sources[0].numel == math.prod(u.shape):
                full[k] = own
            else:
                (r0, r1), (c0, c1) = u.sources[0].rows, u.sources[0].cols
                full[k] = torch.empty(u.shape, dtype=wire, device=device)
                full[k][r0:r1, c0:c1] = own
        for src, recvs in enumerate(self.gather_recv):
            for (k, blk), flat in zip(recvs, received[src]):
                (r0, r1), (c0, c1) = blk.rows, blk.cols
                full[k][r0:r1, c0:c1] = flat.view(r1 - r0, c1 - c0)
        result: dict[int, torch.Tensor] = {}
        for ks in self.owned_by_shape:
            for k, r in zip(ks, fn(torch.stack([full[k] for k in ks])).to(wire).unbind(0)):
                result[k] = r
        # 3. scatter: each holder's block of the results
        sends = [[result[k][blk.rows[0]:blk.rows[1], blk.cols[0]:blk.cols[1]].reshape(-1) for k, blk in s]
                 for s in self.scatter_send]
        back = self._exchange(sends, self.scatter_numels, wire, device)
        for i, t in enumerate(tensors):
            if out[i] is None:
                out[i] = torch.empty_like(t)
        for k, blk in self.kept:
            (r0, r1), (c0, c1) = blk.rows, blk.cols
            _block_of(out, self.units[k].param, blk).copy_(result[k][r0:r1, c0:c1])
        for src, recvs in enumerate(self.scatter_recv):
            for (i, blk), flat in zip(recvs, back[src]):
                dst = _block_of(out, i, blk)
                dst.copy_(flat.view(dst.shape))
        return out  # type: ignore[return-value]

    def _exchange(self, sends: list[list[torch.Tensor]], recv_numels: list[list[int]], dtype: torch.dtype,
                  device: torch.device) -> list[list[torch.Tensor]]:
        """One all-to-all of the flattened pieces ``sends[dest]``; returns ``[src][piece]``."""
        if not self.communicates:
            return [[] for _ in range(self.world)]
        in_splits = [sum(p.numel() for p in s) for s in sends]
        out_splits = [sum(r) for r in recv_numels]
        send = torch.cat([p for s in sends for p in s]) if any(in_splits) else torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(out_splits), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group)
        pieces, start = [], 0
        for numels in recv_numels:
            row = []
            for n in numels:
                row.append(recv[start:start + n])
                start += n
            pieces.append(row)
        return pieces

    # -- reporting -------------------------------------------------------------------------------

    def traffic(self, bytes_per_element: int) -> dict[str, list[int] | int]:
        """Bytes one :meth:`apply` sends, per rank of the group (``sent``: gather and scatter
        together) and in all (``total``), and the work each rank owns (``work``, in the plan's
        cost units)."""
        sent = [n * bytes_per_element for n in self.sent_numel]
        return {"sent": sent, "total": sum(sent), "work": list(self.load)}
