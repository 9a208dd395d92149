"""Topology-aware rank mapping: which coordinates each global rank gets. Pure Python + numpy.

SLURM numbers the tasks: global rank r runs on node ``r // tasks_per_node`` of the node list,
local device ``r % tasks_per_node``. The mapper does not move ranks; it chooses the coordinates
(pp, dp, cp, tp) each rank gets, and so which ranks form each group. The trainer builds its
DeviceMesh from :attr:`RankMap.mesh_ranks`, so the map shown by ``python -m moetrain.ranks`` is
the map used.

Placement, in order of priority (DESIGN.md, "Placement goal"):
1. TP groups inside one NVSwitch domain; then CP (tp × cp ranks) where it fits; then, under
   HSDP (``parallel.dp_shard``), each shard group (dp_shard consecutive members of the dp × cp
   order, with their tp ranks) where it fits.
2. The rest of the domain is filled with data-parallel ranks, so that EP groups (``ep``
   consecutive members of the dp × cp order) stay on NVLink where they fit.
3. Neighbouring pipeline stages on different nodes, on the same rail (same local GPU index)
   and, where possible, in the same rail group: one pipeline replica occupies a run of nodes
   inside one rail group.
4. The remaining data-parallel factor is outermost: DP (and EP beyond the domain) collectives
   are the ones that cross rail groups.

Each rule is checked on the resulting map, whatever produced it; a rule the allocation cannot
satisfy (odd node counts, nodes from several rail groups, domains cut in pieces) is reported as
broken with the reason, and the map stays valid.

How (the phases of :func:`build_rank_map`):
1. allocation: nodes in SLURM order with their NVSwitch domain and rail group;
2. candidates: for each size ``dp_in`` of the data-parallel block kept inside a domain, a slot
   order "tp, cp, dp_in, pp, dp_out" (fastest-varying first) over the nodes sorted so that
   chunks of ``tp·cp·dp_in`` GPUs fall inside domains and pipelines inside rail groups;
3. score each candidate by its broken-rule counts (TP, CP, PP off-node, PP rail, PP rail
   group) and then by how much of each EP group it keeps inside a domain and how large
   ``dp_in`` is; keep the best;
4. check every rule on the chosen map and record the reasons.

Expert axes (Megatron-Core "parallel folding"): inside one (pp, tp) slice the dp × cp ranks are
flattened dp-outer, cp-inner (index = dp_idx·cp + cp_idx) and split into (edp outer, ep inner):
``ep_idx = index % ep``, ``edp_idx = index // ep``. An ``ep`` group is ep consecutive members of
that order; an ``edp`` group holds the replicas of the same experts with the same tp coordinate;
``edp_tp`` (whose expert gradients are averaged together) is every rank with the same pp and
the same ep_idx: edp × tp ranks, edp outer.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moetrain.axes import CP, CP_TP, DENSE_AXES, DP, DP_CP, EDP, EDP_TP, EP, PP, TP
from moetrain.topology.cluster import (
    TIERS,
    Allocation,
    ClusterProfile,
    ProfileError,
    allocation_from_names,
    expand_nodelist,
    generic_profile,
    load_profile,
    read_slurm_topology,
    synthetic_allocation,
)

if TYPE_CHECKING:  # pragma: no cover
    from moetrain.config import Config

__all__ = ["MESH_AXES", "GROUP_AXES", "Rule", "RankMap", "build_rank_map", "map_ranks", "check_mesh",
           "resolve_profile", "resolve_allocation"]

MESH_AXES = DENSE_AXES
"""Mesh axes in mesh order: world = pp × dp × cp × tp, tp fastest."""

GROUP_AXES = (PP, DP, CP, TP, DP_CP, CP_TP, EP, EDP, EDP_TP)
"""Every group kind the map reports, named as ``moetrain.parallel.state`` names them: the mesh
axes; ``dp_cp`` (dense gradients, dp outer), ``cp_tp`` (the ranks sharing one sequence, cp
outer); the expert axes ``ep`` and ``edp`` (replicas of the same experts with the same tp
coordinate) and ``edp_tp`` (the expert gradient group: edp × tp, edp outer)."""


@dataclass(frozen=True)
class Rule:
    """One placement rule checked on a map. ``status``: ``ok``, ``broken`` or ``n/a``;
    ``detail`` says what was found and, when broken, why."""

    name: str
    text: str
    status: str
    detail: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "rule": self.text, "status": self.status, "detail": self.detail}


RULE_TEXT = {
    "tp_in_domain": "TP groups inside one NVSwitch domain",
    "cp_in_domain": "CP groups (with their TP ranks) inside one NVSwitch domain, where tp·cp fits",
    "dp_shard_in_domain": "HSDP shard groups (dp_shard × tp ranks) inside one NVSwitch domain, where they fit",
    "pp_cross_node": "neighbouring pipeline stages on different nodes",
    "pp_same_rail": "neighbouring stages in different NVSwitch domains on the same rail (local GPU index)",
    "pp_in_rail_group": "neighbouring stages in the same rail group, where possible",
    "dp_ep_outer": "only DP / EP groups (dp, dp_cp, ep, edp, edp_tp) cross rail groups",
}


# ---------------------------------------------------------------------------------------------
# The map
# ---------------------------------------------------------------------------------------------


class RankMap:
    """Global rank ↔ (node, local device) ↔ coordinates on every axis, and every group.

    Attributes:
        sizes: ``{"pp", "dp", "cp", "tp", "ep", "edp"}`` sizes.
        world: number of ranks.
        tasks_per_node: ranks per node.
        allocation: the nodes (SLURM order) with their domain and rail group.
        profile: the cluster profile used.
        mesh_ranks: int64 array [pp, dp, cp, tp]; entry = global rank at those coordinates. Build
            the DeviceMesh from it: ``DeviceMesh(dev, torch.tensor(rm.mesh_ranks),
            mesh_dim_names=("pp", "dp", "cp", "tp"))``.
        rules: the placement rules, checked on this map.
        notes: assumptions made (missing topology, no profile, ...).
        placement: the slot order used, fastest-varying first.
    """

    def __init__(self, sizes: dict[str, int], mesh_ranks: np.ndarray, tasks_per_node: int,
                 allocation: Allocation, profile: ClusterProfile, placement: str, notes: list[str],
                 dp_block: int = 1):
        self.sizes = dict(sizes)
        self.mesh_ranks = mesh_ranks
        self.world = int(mesh_ranks.size)
        self.tasks_per_node = tasks_per_node
        self.allocation = allocation
        self.profile = profile
        self.placement = placement
        self.dp_block = dp_block  # data-parallel ranks kept together inside a domain (dp_in)
        self.notes = list(notes)
        n = self.world
        coords = np.indices(mesh_ranks.shape).reshape(4, -1)
        flat = mesh_ranks.reshape(-1)
        self._coord = {}
        for i, axis in enumerate(MESH_AXES):
            arr = np.empty(n, dtype=np.int64)
            arr[flat] = coords[i]
            self._coord[axis] = arr
        folded = self._coord["dp"] * sizes["cp"] + self._coord["cp"]
        self._coord["ep"] = folded % sizes["ep"]
        self._coord["edp"] = folded // sizes["ep"]
        self._geo = _Geometry(allocation, profile, tasks_per_node)
        self._groups: dict[str, np.ndarray] = {}
        self._tiers: dict[str, np.ndarray] = {}
        self.rules: list[Rule] = []

    # -- basic look-ups ----------------------------------------------------------------------
    def node_of(self, rank: int) -> int:
        return rank // self.tasks_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.tasks_per_node

    def domain_of(self, rank: int) -> int:
        """The NVLink (NVSwitch) domain of ``rank``'s node."""
        return int(self._geo.domain[self.node_of(rank)])

    def coords(self, rank: int) -> dict[str, Any]:
        """``{"rank", "node", "node_name", "local_rank", "pp", "dp", "cp", "tp", "ep", "edp"}``.

        Raises:
            IndexError: rank outside [0, world).
        """
        if not 0 <= rank < self.world:
            raise IndexError(f"rank {rank}: outside 0..{self.world - 1}")
        node = self.node_of(rank)
        out: dict[str, Any] = {"rank": rank, "node": node, "node_name": self.allocation.nodes[node].name,
                               "local_rank": self.local_of(rank)}
        for axis in (*DENSE_AXES, EP, EDP):
            out[axis] = int(self._coord[axis][rank])
        return out

    def coord_array(self, axis: str) -> np.ndarray:
        """Coordinate of every rank on ``axis`` (int64 array of length world)."""
        return self._coord[axis]

    # -- groups ------------------------------------------------------------------------------
    def group_array(self, axis: str) -> np.ndarray:
        """All groups of ``axis`` as an int64 array [n_groups, group_size]; each row in
        coordinate order, rows ordered by the other coordinates in mesh order.

        Raises:
            KeyError: ``axis`` not in GROUP_AXES.
        """
        if axis not in GROUP_AXES:
            raise KeyError(f"axis {axis!r}: not one of {', '.join(GROUP_AXES)}")
        if axis not in self._groups:
            self._groups[axis] = _group_array(self.mesh_ranks, axis, self.sizes["ep"])
        return self._groups[axis]

    def groups(self, axis: str) -> list[list[int]]:
        """All groups of ``axis`` (``pp``, ``dp``, ``cp``, ``tp``, ``dp_cp``, ``ep``, ``edp``), each a
        list of global ranks in coordinate order."""
        return self.group_array(axis).tolist()

    def group_of(self, rank: int, axis: str) -> list[int]:
        """Members of the ``axis`` group that holds ``rank``."""
        arr = self.group_array(axis)
        row = int(np.nonzero((arr == rank).any(axis=1))[0][0])
        return arr[row].tolist()

    def group_index(self, rank: int, axis: str) -> int:
        arr = self.group_array(axis)
        return int(np.nonzero((arr == rank).any(axis=1))[0][0])

    def tiers(self, axis: str) -> list[str]:
        """The tier each ``axis`` group's traffic crosses (``none``/``nvlink``/``rail``/``spine``)."""
        return [TIERS[i] for i in self._tier_codes(axis)]

    def _tier_codes(self, axis: str) -> np.ndarray:
        if axis not in self._tiers:
            self._tiers[axis] = self._geo.tiers(self.group_array(axis))
        return self._tiers[axis]

    def tier_counts(self, axis: str) -> dict[str, int]:
        codes = self._tier_codes(axis)
        return {TIERS[i]: int(c) for i, c in enumerate(np.bincount(codes, minlength=len(TIERS))) if c}

    def worst_tier(self, axis: str) -> str:
        return TIERS[int(self._tier_codes(axis).max())] if self.group_array(axis).size else "none"

    def members_per_domain(self, axis: str) -> int:
        """Fewest members any ``axis`` group has in one NVSwitch domain (1 = fully spread)."""
        return self._geo.min_members_per_domain(self.group_array(axis))

    def hsdp_groups(self, axis: str, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """HSDP's split of every ``axis`` group: its runs of ``shard`` consecutive members (the
        shard groups, [n, shard]) and the members at the same place of each run (the replicate
        groups, [m, size / shard]).

        Raises:
            ValueError: ``shard`` does not divide the group size.
        """
        arr = self.group_array(axis)
        n, size = arr.shape
        if size % shard:
            raise ValueError(f"a shard group of {shard} does not divide the {axis} groups of {size}")
        return arr.reshape(-1, shard), arr.reshape(n, size // shard, shard).transpose(0, 2, 1).reshape(-1, size // shard)

    def place_of(self, groups: np.ndarray) -> tuple[str, int]:
        """(slowest tier any of ``groups`` [n, size] crosses, fewest members one has inside an
        NVSwitch domain) — what :meth:`worst_tier` and :meth:`members_per_domain` give for an
        axis, for any groups."""
        if groups.size == 0:
            return "none", 1
        return TIERS[int(self._geo.tiers(groups).max())], self._geo.min_members_per_domain(groups)

    def placement_summary(self) -> dict[str, dict[str, Any]]:
        """Per axis: group count and size, tiers crossed, fewest members per NVSwitch domain."""
        out = {}
        for axis in GROUP_AXES:
            arr = self.group_array(axis)
            out[axis] = {"groups": int(arr.shape[0]), "size": int(arr.shape[1]), "tiers": self.tier_counts(axis),
                         "worst_tier": self.worst_tier(axis), "min_members_per_domain": self.members_per_domain(axis)}
        return out

    @property
    def broken_rules(self) -> list[Rule]:
        return [r for r in self.rules if r.status == "broken"]

    @property
    def digest(self) -> str:
        """Short hash of the map and node names: every rank must compute the same one (compare
        it across ranks before building the mesh)."""
        h = hashlib.sha256(self.mesh_ranks.astype(np.int64).tobytes())
        h.update(",".join(self.allocation.names).encode())
        return h.hexdigest()[:16]

    def to_dict(self, groups: bool = True) -> dict[str, Any]:
        """JSON-ready: ``sizes``, ``world``, ``nodes``, ``ranks`` (per rank: rank, node, node_name,
        local_rank, pp, dp, cp, tp, ep, edp), ``groups`` (axis, index, members, tier), ``rules``."""
        node_of = np.arange(self.world) // self.tasks_per_node
        ranks = []
        names = self.allocation.names
        cols = {a: self._coord[a].tolist() for a in (*DENSE_AXES, EP, EDP)}
        for r in range(self.world):
            n = int(node_of[r])
            ranks.append({"rank": r, "node": n, "node_name": names[n], "local_rank": r % self.tasks_per_node,
                          **{a: cols[a][r] for a in cols}})
        d: dict[str, Any] = {
            "sizes": self.sizes, "world": self.world, "tasks_per_node": self.tasks_per_node,
            "profile": self.profile.name, "placement": self.placement, "digest": self.digest,
            "allocation": self.allocation.summary(),
            "nodes": [{"index": i, "name": n.name, "domain": n.domain, "rail_group": n.rail_group}
                      for i, n in enumerate(self.allocation.nodes)],
            "ranks": ranks,
            "rules": [r.to_dict() for r in self.rules],
            "notes": self.notes + list(self.allocation.notes),
        }
        if groups:
            d["groups"] = [{"axis": axis, "index": i, "members": m, "tier": t}
                           for axis in GROUP_AXES
                           for i, (m, t) in enumerate(zip(self.groups(axis), self.tiers(axis)))]
        return d


def _group_array(mesh: np.ndarray, axis: str, ep: int) -> np.ndarray:
    pp, dp, cp, tp = mesh.shape
    if axis in MESH_AXES:
        i = MESH_AXES.index(axis)
        return np.moveaxis(mesh, i, -1).reshape(-1, mesh.shape[i])
    if axis == "dp_cp":
        return mesh.transpose(0, 3, 1, 2).reshape(-1, dp * cp)
    if axis == "cp_tp":
        return mesh.reshape(-1, cp * tp)
    if axis == "ep":
        return mesh.transpose(0, 3, 1, 2).reshape(-1, ep)
    edp = dp * cp // ep
    expert = mesh.reshape(pp, edp, ep, tp)  # the expert mesh: dp·cp flattened dp-major, ep inner
    if axis == "edp":
        return expert.transpose(0, 2, 3, 1).reshape(-1, edp)
    if axis == "edp_tp":
        # same pp and ep_idx, edp outer, tp inner
        return expert.transpose(0, 2, 1, 3).reshape(-1, edp * tp)
    raise KeyError(axis)


# ---------------------------------------------------------------------------------------------
# Geometry: ranks → nodes, domains, rail groups, rails
# ---------------------------------------------------------------------------------------------


class _Geometry:
    def __init__(self, allocation: Allocation, profile: ClusterProfile, tasks_per_node: int):
        self.tpn = tasks_per_node
        self.domain = np.array([n.domain for n in allocation.nodes], dtype=np.int64)
        self.group = np.array([n.rail_group for n in allocation.nodes], dtype=np.int64)
        gpn = max(profile.gpus_per_node, tasks_per_node)
        local = np.arange(tasks_per_node)
        self.rail = np.minimum(local * profile.rails_per_node // gpn, profile.rails_per_node - 1)

    def parts(self, members: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        node = members // self.tpn
        return node, self.domain[node], self.group[node], self.rail[members % self.tpn]

    def tiers(self, members: np.ndarray) -> np.ndarray:
        """Tier code per group row (index into TIERS)."""
        g, n = members.shape
        if n <= 1 or g == 0:
            return np.zeros(g, dtype=np.int64)
        node, dom, grp, rail = self.parts(members)
        same_dom = (dom == dom[:, :1]).all(axis=1)
        same_grp = (grp == grp[:, :1]).all(axis=1)
        aligned = _rail_aligned(node, rail)
        return np.where(same_dom, 1, np.where(same_grp & aligned, 2, 3)).astype(np.int64)

    def min_members_per_domain(self, members: np.ndarray) -> int:
        if members.size == 0:
            return 0
        _, dom, _, _ = self.parts(members)
        s = np.sort(dom, axis=1)
        # run lengths of equal domain ids per row; the smallest run over all rows
        g, n = s.shape
        change = np.ones((g, n + 1), dtype=bool)
        change[:, 1:n] = s[:, 1:] != s[:, :-1]
        idx = np.flatnonzero(change.ravel())
        runs = np.diff(idx)[idx[:-1] % (n + 1) != n]  # drop the step from one row's end to the next
        return int(runs.min())


def _rail_aligned(node: np.ndarray, rail: np.ndarray) -> np.ndarray:
    """Per row: every node of the group hosts members on the same set of rails."""
    g, n = node.shape
    order = np.lexsort((rail, node), axis=-1)
    ns = np.take_along_axis(node, order, axis=1)
    rs = np.take_along_axis(rail, order, axis=1)
    k = 1 + (np.diff(ns, axis=1) != 0).sum(axis=1)
    out = np.zeros(g, dtype=bool)
    for kk in np.unique(k):
        rows = np.flatnonzero(k == kk)
        if n % kk:
            continue
        m = n // kk
        nsr = ns[rows].reshape(-1, kk, m)
        rsr = rs[rows].reshape(-1, kk, m)
        ok = (nsr == nsr[:, :, :1]).all(axis=(1, 2)) & (rsr == rsr[:, :1, :]).all(axis=(1, 2))
        out[rows] = ok
    return out


# ---------------------------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pack_nodes(allocation: Allocation, domain_unit: int | None, group_unit: int | None) -> np.ndarray:
    """Node order (indices into the allocation) that keeps as many ``domain_unit``-node windows
    inside one NVSwitch domain, and ``group_unit``-node windows inside one rail group, as the
    allocation allows: whole units first, per bin, remainders after."""
    groups: "OrderedDict[int, OrderedDict[int, list[int]]]" = OrderedDict()
    for i, n in enumerate(allocation.nodes):
        groups.setdefault(n.rail_group, OrderedDict()).setdefault(n.domain, []).append(i)
    out: list[int] = []
    group_left: list[int] = []
    for doms in groups.values():
        seq: list[int] = []
        dom_left: list[int] = []
        for idx in doms.values():
            k = len(idx) - len(idx) % domain_unit if domain_unit else len(idx)
            seq += idx[:k]
            dom_left += idx[k:]
        seq += dom_left
        k = len(seq) - len(seq) % group_unit if group_unit else len(seq)
        out += seq[:k]
        group_left += seq[k:]
    return np.array(out + group_left, dtype=np.int64)


@dataclass
class _Candidate:
    dp_in: int
    snake: int
    node_order: np.ndarray
    mesh: np.ndarray
    placement: str


def _place(sizes: dict[str, int], gpn: int, allocation: Allocation, domain_gpus: int, dp_in: int) -> _Candidate:
    pp, dp, cp, tp = (sizes[a] for a in MESH_AXES)
    world = pp * dp * cp * tp
    block = tp * cp * dp_in          # one stage's GPUs for dp_in data-parallel replicas
    domain_nodes = max(1, domain_gpus // gpn)

    # Stages share a node when one stage's block is smaller than a node: put m stages on a node
    # and walk the pipeline's nodes in a snake, so that every cross-node hop keeps the local
    # index (same rail) and the turn-around hop stays on NVLink.
    snake = 1
    if block < gpn and gpn % block == 0 and pp > 1:
        m = gpn // block
        if pp % m == 0:
            snake = m
        elif m % pp == 0:
            snake = pp
    tc = tp * cp
    domain_unit = None
    if block % gpn == 0 and block // gpn <= domain_nodes:
        domain_unit = block // gpn
    elif tc % gpn == 0 and tc // gpn <= domain_nodes:
        domain_unit = tc // gpn
    group_unit = (pp * block) // gpn if (pp * block) % gpn == 0 else None
    node_order = _pack_nodes(allocation, domain_unit, group_unit)

    slot = np.arange(world, dtype=np.int64)
    pos, local = np.divmod(slot, gpn)
    rank = node_order[pos] * gpn + local
    s = slot
    t = s % tp
    s = s // tp
    c = s % cp
    s = s // cp
    d_in = s % dp_in
    s = s // dp_in
    if snake > 1:
        q = pp // snake
        b = s % snake
        s = s // snake
        j = s % q
        s = s // q
        p = b * q + np.where(b % 2 == 0, j, q - 1 - j)
    else:
        p = s % pp
        s = s // pp
    d = s * dp_in + d_in
    mesh = np.empty((pp, dp, cp, tp), dtype=np.int64)
    mesh[p, d, c, t] = rank
    parts = [f"tp×{tp}", f"cp×{cp}", f"dp×{dp_in}"]
    parts += [f"pp×{snake} (snake)", f"pp×{pp // snake}"] if snake > 1 else [f"pp×{pp}"]
    parts.append(f"dp×{dp // dp_in}")
    placement = "slot order, fastest first: " + ", ".join(x for x in parts if not x.endswith("×1"))
    if placement.endswith(": "):
        placement += "one rank"
    return _Candidate(dp_in, snake, node_order, mesh, placement)


# ---------------------------------------------------------------------------------------------
# Rule checks
# ---------------------------------------------------------------------------------------------


@dataclass
class _Stats:
    tp_bad: int
    tp_total: int
    cp_bad: int
    cp_total: int
    pairs: int
    same_node: int
    cross_domain: int
    rail_bad: int
    group_bad: int
    ep_in_domain: int
    ep_local: int
    shard_bad: int = 0
    shard_total: int = 0


def _stats(mesh: np.ndarray, geo: _Geometry, ep: int, dp_shard: int | None = None) -> _Stats:
    pp, dp, cp, tp = mesh.shape
    # TP and TP×CP blocks inside one domain
    tpg = mesh.reshape(-1, tp)
    _, dom, _, _ = geo.parts(tpg)
    tp_bad = int((~(dom == dom[:, :1]).all(axis=1)).sum()) if tp > 1 else 0
    tcg = mesh.reshape(-1, cp * tp)
    _, dom, _, _ = geo.parts(tcg)
    cp_bad = int((~(dom == dom[:, :1]).all(axis=1)).sum()) if cp > 1 else 0
    # neighbouring stages
    if pp > 1:
        a = mesh[:-1].reshape(-1)
        b = mesh[1:].reshape(-1)
        na, nb = a // geo.tpn, b // geo.tpn
        same_node = int((na == nb).sum())
        xdom = geo.domain[na] != geo.domain[nb]
        rail_bad = int((xdom & (geo.rail[a % geo.tpn] != geo.rail[b % geo.tpn])).sum())
        group_bad = int((xdom & (geo.group[na] != geo.group[nb])).sum())
        pairs, cross = int(a.size), int(xdom.sum())
    else:
        same_node = rail_bad = group_bad = pairs = cross = 0
    # EP groups inside a domain, and EP neighbours sharing one (the all-to-all's NVLink share)
    if ep > 1:
        epg = _group_array(mesh, "ep", ep)
        _, dom, _, _ = geo.parts(epg)
        ep_in = int((dom == dom[:, :1]).all(axis=1).sum())
        ep_local = int((dom[:, 1:] == dom[:, :-1]).sum())
    else:
        ep_in = ep_local = 0
    # HSDP's shard groups: dp_shard consecutive members of a stage's dp × cp order, with their tp
    # ranks (the dp_cp_tp order is dp, cp, tp, tp fastest: the mesh's own)
    shard_bad = shard_total = 0
    if dp_shard is not None and dp_shard < dp * cp:
        sg = mesh.reshape(-1, dp_shard * tp)
        _, dom, _, _ = geo.parts(sg)
        shard_bad, shard_total = int((~(dom == dom[:, :1]).all(axis=1)).sum()), sg.shape[0]
    return _Stats(tp_bad, tpg.shape[0], cp_bad, tcg.shape[0], pairs, same_node, cross, rail_bad, group_bad, ep_in,
                  ep_local, shard_bad, shard_total)


def _check_rules(rm: RankMap, st: _Stats) -> list[Rule]:
    s = rm.sizes
    prof = rm.profile
    gpn = rm.tasks_per_node
    dom_gpus = prof.domain_nodes * gpn
    alloc = rm.allocation
    n_nodes = len(alloc)
    rules: list[Rule] = []

    def domain_sizes() -> str:
        counts: dict[int, int] = {}
        for n in alloc.nodes:
            counts[n.domain] = counts.get(n.domain, 0) + 1
        return "/".join(str(v) for v in sorted(set(counts.values()), reverse=True))

    # 1. TP
    name = "tp_in_domain"
    if s["tp"] == 1:
        rules.append(Rule(name, RULE_TEXT[name], "n/a", "tp = 1"))
    elif st.tp_bad == 0:
        rules.append(Rule(name, RULE_TEXT[name], "ok", f"all {st.tp_total} TP groups on NVLink"))
    else:
        if s["tp"] > dom_gpus:
            why = f"tp = {s['tp']} is larger than an NVSwitch domain ({dom_gpus} GPUs)"
        elif gpn % s["tp"] and s["tp"] % gpn:
            why = f"tp = {s['tp']} neither divides nor is a multiple of the {gpn} GPUs per node, so groups straddle nodes"
        else:
            why = (f"the allocation's NVSwitch domains hold {domain_sizes()} nodes, which do not split into "
                   f"whole {max(1, s['tp'] // gpn)}-node TP groups")
        rules.append(Rule(name, RULE_TEXT[name], "broken",
                          f"{st.tp_bad} of {st.tp_total} TP groups straddle NVSwitch domains: {why}"))
    # 2. CP
    name = "cp_in_domain"
    tc = s["tp"] * s["cp"]
    if s["cp"] == 1:
        rules.append(Rule(name, RULE_TEXT[name], "n/a", "cp = 1"))
    elif tc > dom_gpus:
        rules.append(Rule(name, RULE_TEXT[name], "n/a",
                          f"tp·cp = {tc} > {dom_gpus} GPUs per NVSwitch domain: CP traffic crosses the network "
                          f"(placed rail-aligned: CP peers share the local GPU index)"))
    elif st.cp_bad == 0:
        rules.append(Rule(name, RULE_TEXT[name], "ok", f"all {st.cp_total} TP×CP blocks on NVLink"))
    else:
        if gpn % tc and tc % gpn:
            why = f"tp·cp = {tc} neither divides nor is a multiple of the {gpn} GPUs per node"
        else:
            why = f"the allocation's NVSwitch domains hold {domain_sizes()} nodes"
        rules.append(Rule(name, RULE_TEXT[name], "broken",
                          f"{st.cp_bad} of {st.cp_total} TP×CP blocks straddle NVSwitch domains: {why}"))
    # HSDP shard groups
    name = "dp_shard_in_domain"
    shard = s.get("dp_shard", s["dp"] * s["cp"])
    if shard >= s["dp"] * s["cp"]:
        rules.append(Rule(name, RULE_TEXT[name], "n/a", "no HSDP (parallel.dp_shard unset): ZeRO shards over all of dp × cp"))
    elif shard * s["tp"] > dom_gpus:
        rules.append(Rule(name, RULE_TEXT[name], "n/a",
                          f"dp_shard·tp = {shard * s['tp']} > {dom_gpus} GPUs per NVSwitch domain: the shard groups' "
                          f"all-gathers cross the network"))
    elif st.shard_bad == 0:
        rules.append(Rule(name, RULE_TEXT[name], "ok", f"all {st.shard_total} shard groups on NVLink"))
    else:
        rules.append(Rule(name, RULE_TEXT[name], "broken",
                          f"{st.shard_bad} of {st.shard_total} shard groups straddle NVSwitch domains: "
                          f"dp_shard·tp = {shard * s['tp']} does not line up with the {gpn} GPUs per node or the "
                          f"allocation's domains hold {domain_sizes()} nodes"))
    # 3-5. PP
    block = s["dp"] * s["cp"] * s["tp"]  # ranks per stage
    pipe_nodes = s["pp"] * s["tp"] * s["cp"] * rm.dp_block / gpn  # nodes of one pipeline replica
    for name in ("pp_cross_node", "pp_same_rail", "pp_in_rail_group"):
        if s["pp"] == 1:
            rules.append(Rule(name, RULE_TEXT[name], "n/a", "pp = 1"))
            continue
        if name == "pp_cross_node":
            if n_nodes == 1:
                rules.append(Rule(name, RULE_TEXT[name], "n/a", "one node: every stage is on NVLink"))
            elif st.same_node == 0:
                rules.append(Rule(name, RULE_TEXT[name], "ok", f"all {st.pairs} neighbour pairs on different nodes"))
            else:
                per_stage = block // gpn if block >= gpn else block
                rules.append(Rule(name, RULE_TEXT[name], "broken",
                                  f"{st.same_node} of {st.pairs} neighbour pairs share a node (they talk over NVLink): "
                                  f"{s['pp']} stages of {block} ranks each on {n_nodes} nodes of {gpn} GPUs leave "
                                  f"fewer GPUs per stage ({per_stage}) than a node holds"))
        elif name == "pp_same_rail":
            if st.cross_domain == 0:
                rules.append(Rule(name, RULE_TEXT[name], "n/a" if n_nodes == 1 or prof.domain_nodes >= n_nodes else "ok",
                                  "no neighbour pair crosses NVSwitch domains"))
            elif st.rail_bad == 0:
                rules.append(Rule(name, RULE_TEXT[name], "ok",
                                  f"all {st.cross_domain} cross-domain neighbour pairs on one rail"))
            else:
                rules.append(Rule(name, RULE_TEXT[name], "broken",
                                  f"{st.rail_bad} of {st.cross_domain} cross-domain neighbour pairs change rails: "
                                  f"a stage's GPUs per node ({block} ranks per stage) do not line up with the "
                                  f"{gpn} GPUs of a node"))
        else:
            groups: dict[int, int] = {}
            for n in alloc.nodes:
                groups[n.rail_group] = groups.get(n.rail_group, 0) + 1
            if st.cross_domain == 0 or len(groups) == 1:
                rules.append(Rule(name, RULE_TEXT[name], "ok", "one rail group" if len(groups) == 1
                                  else "no neighbour pair leaves its NVSwitch domain"))
            elif st.group_bad == 0:
                rules.append(Rule(name, RULE_TEXT[name], "ok",
                                  f"all {st.cross_domain} cross-domain neighbour pairs inside a rail group"))
            else:
                sizes = sorted(groups.values(), reverse=True)
                pn = int(round(pipe_nodes)) if pipe_nodes >= 1 else 1
                largest = max(sizes)
                if pn > largest:
                    why = f"one pipeline spans {pn} nodes, more than the largest rail group ({largest} nodes)"
                else:
                    shown = ", ".join(str(x) for x in sizes[:8]) + (", ..." if len(sizes) > 8 else "")
                    why = (f"the nodes come from {len(groups)} rail groups holding {shown} nodes, "
                           f"not all multiples of the {pn}-node pipeline")
                rules.append(Rule(name, RULE_TEXT[name], "broken",
                                  f"{st.group_bad} of {st.cross_domain} cross-domain neighbour pairs cross rail groups: {why}"))
    # 6. only DP/EP cross rail groups
    name = "dp_ep_outer"
    crossing = [a for a in ("tp", "cp", "pp") if (rm._tier_codes(a) == 3).any()
                and _crosses_groups(rm, a)]
    if crossing:
        rules.append(Rule(name, RULE_TEXT[name], "broken",
                          f"{', '.join(crossing)} groups also cross rail groups (see the rules above)"))
    else:
        dp_cross = [a for a in ("dp_cp", "ep", "edp_tp") if _crosses_groups(rm, a)]
        rules.append(Rule(name, RULE_TEXT[name], "ok",
                          (f"{', '.join(dp_cross)} cross rail groups" if dp_cross else "no group crosses rail groups")))
    return rules


def _crosses_groups(rm: RankMap, axis: str) -> bool:
    arr = rm.group_array(axis)
    if arr.shape[1] <= 1:
        return False
    _, _, grp, _ = rm._geo.parts(arr)
    return bool((~(grp == grp[:, :1]).all(axis=1)).any())


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def map_ranks(sizes: dict[str, int], allocation: Allocation, profile: ClusterProfile,
              tasks_per_node: int, notes: list[str] | None = None) -> RankMap:
    """Place ``sizes`` (pp, dp, cp, tp, ep; ``dp_shard`` under HSDP) on ``allocation``; the core
    of :func:`build_rank_map`.

    Raises:
        ValueError: the sizes do not fill ``len(allocation) × tasks_per_node`` ranks, or ep
            does not divide dp × cp.
    """
    pp, dp, cp, tp, ep = (int(sizes[a]) for a in ("pp", "dp", "cp", "tp", "ep"))
    world = pp * dp * cp * tp
    if world != len(allocation) * tasks_per_node:
        raise ValueError(f"pp·dp·cp·tp = {world} ranks, but {len(allocation)} nodes × {tasks_per_node} tasks "
                         f"= {len(allocation) * tasks_per_node}. Fix: change the node count or the parallel sizes")
    if (dp * cp) % ep:
        raise ValueError(f"ep = {ep} does not divide dp·cp = {dp * cp}")
    full = {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep, "edp": dp * cp // ep}
    dp_shard = sizes.get("dp_shard")
    if dp_shard is not None:
        full["dp_shard"] = int(dp_shard)
    gpn = tasks_per_node
    domain_gpus = profile.domain_nodes * gpn
    geo = _Geometry(allocation, profile, tasks_per_node)

    # 2-3. candidates, scored by broken rules in the order of the rules (TP, CP, HSDP shard groups,
    # PP neighbours off-node, on one rail, in one rail group), then EP on NVLink, then the DP
    # block size
    best: tuple[tuple, _Candidate, _Stats] | None = None
    for dp_in in _divisors(dp):
        if dp_in > 1 and tp * cp * dp_in > max(domain_gpus, gpn):
            continue
        cand = _place(full, gpn, allocation, domain_gpus, dp_in)
        st = _stats(cand.mesh, geo, ep, full.get("dp_shard"))
        score = (st.tp_bad, st.cp_bad, st.shard_bad, st.same_node, st.rail_bad, st.group_bad, -st.ep_in_domain, -st.ep_local,
                 -dp_in)
        if best is None or score < best[0]:
            best = (score, cand, st)
    assert best is not None
    _, cand, st = best
    rm = RankMap(full, cand.mesh, tasks_per_node, allocation, profile, cand.placement, notes or [], cand.dp_in)
    # 4. rules on the chosen map
    rm.rules = _check_rules(rm, st)
    return rm


def check_mesh(mesh_ranks: np.ndarray, ep: int, allocation: Allocation, profile: ClusterProfile,
               tasks_per_node: int, placement: str = "given") -> RankMap:
    """A :class:`RankMap` for a rank tensor chosen elsewhere (e.g. the identity order), with
    the placement rules checked on it: to compare a hand-picked order with the mapper's.

    Raises:
        ValueError: the tensor is not a permutation of the allocation's ranks.
    """
    mesh = np.asarray(mesh_ranks, dtype=np.int64)
    pp, dp, cp, tp = mesh.shape
    if sorted(mesh.reshape(-1).tolist()) != list(range(len(allocation) * tasks_per_node)):
        raise ValueError(f"mesh_ranks is not a permutation of 0..{len(allocation) * tasks_per_node - 1}")
    sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep, "edp": dp * cp // ep}
    rm = RankMap(sizes, mesh, tasks_per_node, allocation, profile, placement, [])
    rm.rules = _check_rules(rm, _stats(mesh, rm._geo, ep))
    return rm


def resolve_profile(cfg: "Config", profile: "str | Path | ClusterProfile | None",
                    tasks_per_node: int) -> tuple[ClusterProfile, list[str]]:
    """The profile to use: the argument, else ``launch.profile``, else a generic one (noted)."""
    chosen = profile if profile is not None else cfg.launch.profile
    if chosen is not None:
        return load_profile(chosen), []
    gpn = cfg.launch.gpus_per_node or tasks_per_node
    prof = generic_profile(max(gpn, tasks_per_node), name="cpu-local" if cfg.launch.gpus_per_node == 0 else "generic")
    return prof, [f"no cluster profile given: assumed {prof.description}"]


def slurm_nodelist() -> str | None:
    """SLURM's node list of this process: its step's (an srun step may use fewer nodes than the
    allocation), else its job's."""
    env = os.environ
    return env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")


def resolve_allocation(n_or_names: "list[str] | int | None", cfg: "Config", profile: ClusterProfile,
                       topology: str | os.PathLike | None = None) -> Allocation:
    """Nodes from a list of names, a count, or (None) SLURM's environment / ``launch.nodes``.

    ``topology``: a topology.conf path or its text; with None, and SLURM node names in the
    environment, ``scontrol show topology`` is read when scontrol exists.
    """
    topo_text: str | None = None
    if isinstance(topology, str) and ("\n" in topology or "=" in topology):
        topo_text = topology  # the text itself
    elif topology is not None:
        p = Path(topology)
        if not p.is_file():
            raise ProfileError(f"--topology {str(topology)!r}: no such file. Fix: pass a topology.conf or "
                               f"the saved output of `scontrol show topology`")
        topo_text = p.read_text()
    if isinstance(n_or_names, int):
        if topo_text is None:
            return synthetic_allocation(n_or_names, profile)
        n_or_names = [n.name for n in synthetic_allocation(n_or_names, profile).nodes]
    if n_or_names is None:
        env = slurm_nodelist()
        if cfg.launch.cluster == "slurm" and env:
            names = expand_nodelist(env)[:cfg.launch.nodes]
            if topo_text is None:
                topo_text = read_slurm_topology()
            return allocation_from_names(names, profile, topo_text)
        return synthetic_allocation(cfg.launch.nodes, profile)
    return allocation_from_names(list(n_or_names), profile, topo_text)


def build_rank_map(cfg: "Config", nodes: "list[str] | int | None" = None,
                   profile: "str | Path | ClusterProfile | None" = None,
                   topology: str | os.PathLike | None = None) -> RankMap:
    """The rank map of ``cfg``'s parallel layout on the job's nodes.

    Args:
        cfg: the run config (``parallel`` sizes; ``launch`` for tasks per node and the profile).
        nodes: node names in SLURM order, a node count, or None: SLURM's node list
            (:func:`slurm_nodelist`, its first ``launch.nodes`` nodes) when ``launch.cluster ==
            "slurm"`` and it is set, else ``launch.nodes`` synthetic nodes.
        profile: profile name, path or object; None takes ``launch.profile``, else a generic
            profile (one NVSwitch domain per node; a note says so).
        topology: a topology.conf path or text (for tests and inspection); None reads
            ``scontrol show topology`` for real SLURM node lists when available.

    Returns:
        A :class:`RankMap`; ``mesh_ranks`` has shape [pp, dp, cp, tp]. For a single node the
        map is the identity order ``rank = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i``.

    Raises:
        ValueError / ProfileError: the world size does not split over the nodes, or a profile
            or node list is malformed.
    """
    par = cfg.parallel
    world = par.world_size
    if isinstance(nodes, int):
        n_nodes = nodes
    elif nodes is None:
        env = slurm_nodelist()
        n_nodes = min(len(expand_nodelist(env)), cfg.launch.nodes) if (cfg.launch.cluster == "slurm" and env) \
            else cfg.launch.nodes
    else:
        n_nodes = len(nodes)
    if n_nodes <= 0 or world % n_nodes:
        raise ValueError(f"world size pp·dp·cp·tp = {world} does not split over {n_nodes} nodes. "
                         f"Fix: use a node count that divides {world}")
    tpn = world // n_nodes
    if cfg.launch.tasks_per_node is not None and cfg.launch.tasks_per_node != tpn:
        raise ValueError(f"launch.tasks_per_node = {cfg.launch.tasks_per_node}, but {world} ranks on {n_nodes} nodes "
                         f"need {tpn}. Fix: set launch.tasks_per_node={tpn} or null")
    prof, notes = resolve_profile(cfg, profile, tpn)
    if prof.gpus_per_node < tpn and cfg.launch.gpus_per_node:
        notes.append(f"{tpn} tasks per node, more than the profile's {prof.gpus_per_node} GPUs per node")
    alloc = resolve_allocation(nodes if nodes is not None else None, cfg, prof, topology)
    sizes = {"pp": par.pp, "dp": par.dp, "cp": par.cp, "tp": par.tp, "ep": par.ep}
    if par.dp_shard is not None:
        sizes["dp_shard"] = par.dp_shard
    return map_ranks(sizes, alloc, prof, tpn, notes)


def ranks_per_domain(field: str, value: Any, group: list[int], domains: list[Any], fix: str) -> dict[Any, list[int]]:
    """The ranks of an ep ``group`` by NVLink domain (``domains[i]``: the domain of ``group[i]``),
    in order of first appearance.

    Raises:
        ConfigError: naming ``field`` = ``value``, when the domains hold different numbers of the
            group's ranks (the hierarchical dispatch and node-limited routing pair every rank with
            one rank of each other domain); ``fix`` says what to do.
    """
    from moetrain.config import field_error

    by_domain: dict[Any, list[int]] = {d: [] for d in dict.fromkeys(domains)}
    for rank, d in zip(group, domains):
        by_domain[d].append(rank)
    sizes = sorted(len(v) for v in by_domain.values())
    if len(set(sizes)) != 1:
        raise field_error(field, value, f"the ep group {group} spreads over NVLink domains unevenly ({sizes} "
                          f"ranks); the hierarchical dispatch and node-limited routing pair each rank with one "
                          f"rank of every other domain", fix)
    return by_domain
