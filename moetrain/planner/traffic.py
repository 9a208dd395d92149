"""Communication of one training step: which collectives, how many bytes, on which tier, how long.

Every collective is described by its buffer size S per GPU (bytes), its group and how often it
runs. The bytes a GPU puts on the wire follow NCCL's bus-bandwidth factors (nccl-tests
PERFORMANCE.md): all-reduce 2(n−1)/n·S, all-gather and reduce-scatter (n−1)/n·S (S = the full,
gathered buffer), all-to-all (n−1)/n·S, point-to-point S.

Hierarchy: a group of n ranks with m members in each NVSwitch domain moves the intra-domain
share on NVLink and the rest on the network. For ring/tree collectives NCCL runs one ring per
NIC, so each GPU's NIC carries factor·S/m and its NVLink factor·S·(m−1)/m; for all-to-all a GPU
sends S/n to each peer: (m−1)/n·S on NVLink, (n−m)/n·S on the network. The two parts overlap:
time = max(network bytes / network bus bandwidth, NVLink bytes / NVLink bus bandwidth) plus a
latency of α per algorithm step (⌈log₂ n⌉ steps, twice for all-reduce, as NCCL's trees).
The network tier is the slowest a group crosses (``rail`` or ``spine``, see topology.cluster).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moetrain.planner.layout import Layout
from moetrain.planner.model import ModelShape

if TYPE_CHECKING:  # pragma: no cover
    from moetrain.topology.cluster import ClusterProfile
    from moetrain.topology.mapper import RankMap

__all__ = ["AxisPlace", "places_from_rank_map", "bus_factor", "comm_time", "CollectiveVolume",
           "step_collectives", "microbatch_buffers", "COMM_AXES"]

COMM_AXES = ("tp", "cp", "pp", "dp_cp", "ep", "edp_tp")


@dataclass(frozen=True)
class AxisPlace:
    """Where one axis's groups sit: size n, the slowest tier crossed, and the fewest members any
    group has inside one NVSwitch domain."""

    size: int
    tier: str
    per_domain: int


def places_from_rank_map(rm: "RankMap") -> dict[str, AxisPlace]:
    """Per communicating axis, its placement on the rank map (worst group)."""
    out = {}
    for axis in COMM_AXES:
        arr = rm.group_array(axis)
        out[axis] = AxisPlace(int(arr.shape[1]), rm.worst_tier(axis), max(1, rm.members_per_domain(axis)))
    return out


def bus_factor(op: str, n: int) -> float:
    """Bytes on the wire per byte of buffer, per GPU (nccl-tests bus-bandwidth factors)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "p2p":
        return 1.0
    raise ValueError(f"collective {op!r}: not one of all_reduce, all_gather, reduce_scatter, all_to_all, p2p")


def comm_time(op: str, nbytes: float, place: AxisPlace, profile: "ClusterProfile") -> tuple[float, dict[str, float]]:
    """Seconds for one collective of an ``nbytes`` buffer over ``place``, and the bytes each GPU
    puts on each tier (``{"nvlink": ..., "rail" or "spine": ...}``)."""
    n = place.size
    if n <= 1 or nbytes <= 0 or place.tier == "none":
        return 0.0, {}
    steps = 1 if op == "p2p" else max(1, math.ceil(math.log2(n))) * (2 if op == "all_reduce" else 1)
    if place.tier == "nvlink":
        b = bus_factor(op, n) * nbytes
        return b / profile.bandwidth("nvlink") + steps * profile.latency("nvlink"), {"nvlink": b}
    m = min(max(1, place.per_domain), n)
    if op == "p2p":
        net, nv = float(nbytes), 0.0
    elif op == "all_to_all":
        net, nv = nbytes * (n - m) / n, nbytes * (m - 1) / n
    else:
        f = bus_factor(op, n) * nbytes
        net, nv = f / m, f * (m - 1) / m
    t = max(net / profile.bandwidth(place.tier), nv / profile.bandwidth("nvlink")) + steps * profile.latency(place.tier)
    tiers = {place.tier: net}
    if nv:
        tiers["nvlink"] = nv
    return t, tiers


@dataclass
class CollectiveVolume:
    """One kind of collective in a training step, per GPU."""

    axis: str
    op: str
    what: str
    bytes_per_call: float
    calls_per_step: float
    overlap: str
    tier_bytes: dict[str, float] = field(default_factory=dict)  # per step, per GPU
    seconds: float = 0.0                                         # per step, before overlap

    def to_dict(self) -> dict[str, Any]:
        return {"axis": self.axis, "op": self.op, "what": self.what, "bytes_per_call": self.bytes_per_call,
                "calls_per_step": self.calls_per_step, "bytes_per_step": {k: v for k, v in self.tier_bytes.items()},
                "seconds_per_step": self.seconds, "overlap": self.overlap}


def microbatch_buffers(shape: ModelShape, layout: Layout, act_bytes: int = 2) -> dict[str, float]:
    """Buffer sizes (bytes) of the per-micro-batch collectives."""
    tokens = layout.mbs * shape.seq_len / layout.cp
    tm = tokens / layout.tp  # an MoE block routes its tp rank's 1/tp slice of the sequence
    return {
        "tokens": tokens,
        "tp": tokens * shape.hidden * act_bytes,                       # gathered activation of one TP region
        "cp": layout.cp * tokens * shape.h_kv * 2 * act_bytes / layout.tp,  # all K and V chunks of the ring
        "ep": tm * shape.top_k * shape.hidden * act_bytes,           # routed token copies of one dispatch
        "pp": tokens * shape.hidden * act_bytes / (layout.tp if layout.tp > 1 else 1),  # scatter/gather, §4.1
    }


def step_collectives(shape: ModelShape, layout: Layout, global_batch: int, places: dict[str, AxisPlace],
                     profile: "ClusterProfile", grad_bytes: int = 4, param_bytes: int = 2,
                     dense_params_rank: float | None = None, expert_params_rank: float | None = None,
                     moe_imbalance: float = 1.0) -> list[CollectiveVolume]:
    """Every collective of one training step on the busiest pipeline rank, per GPU.

    ``dense_params_rank`` / ``expert_params_rank``: parameters the rank holds (default: an even
    split over pp, tp and ep). Returns one :class:`CollectiveVolume` per kind, with bytes per
    tier per step and seconds per step (before any overlap with compute).
    """
    m = max(1, layout.microbatches(global_batch))
    sz = microbatch_buffers(shape, layout)
    lp = math.ceil(shape.layers / layout.pp)
    moe_frac = shape.moe_layers / shape.layers
    n_moe = round(lp * moe_frac)
    n_dense = lp - n_moe
    recompute = 1 if layout.ac == "full" else 0
    passes = 2 + recompute  # forward, backward, forward again under full recomputation
    out: list[CollectiveVolume] = []

    def add(axis: str, op: str, what: str, nbytes: float, calls: float, overlap: str) -> None:
        if calls <= 0 or nbytes <= 0 or places[axis].size <= 1:
            return
        t, tiers = comm_time(op, nbytes, places[axis], profile)
        out.append(CollectiveVolume(axis, op, what, nbytes, calls, overlap,
                                    {k: v * calls for k, v in tiers.items()}, t * calls))

    if layout.tp > 1:
        regions = 2 * n_dense + n_moe  # attention in every layer, the MLP in dense layers
        if layout.sp:
            add("tp", "all_gather", "SP all-gather into attention / MLP (and reduce-scatter's backward)",
                sz["tp"], regions * passes * m, "none")
            add("tp", "reduce_scatter", "SP reduce-scatter out of attention / MLP (and all-gather's backward)",
                sz["tp"], regions * passes * m, "none")
        else:
            add("tp", "all_reduce", "TP all-reduce after attention / MLP (f and g operators)",
                sz["tp"], regions * passes * m, "none")
    if layout.cp > 1:
        add("cp", "all_gather", "ring attention K/V exchange (forward, and backward with dK/dV)",
            sz["cp"], lp * (1 + 2 + recompute) * m, "attention compute")
    if shape.is_moe and layout.ep > 1:
        add("ep", "all_to_all", "token dispatch and combine (forward and backward)",
            sz["ep"] * moe_imbalance, n_moe * 2 * passes * m, "none")
    if layout.pp > 1:
        add("pp", "p2p", "activations forward, gradients backward between neighbouring stages",
            sz["pp"], 2 * layout.vpp * m, "none")
    dense_p = dense_params_rank if dense_params_rank is not None else \
        (shape.total_params - shape.moe_layers * shape.expert_params) / (layout.tp * layout.pp)
    expert_p = expert_params_rank if expert_params_rank is not None else \
        shape.moe_layers * shape.expert_params / (layout.pp * layout.ep)
    for axis, p, label in (("dp_cp", dense_p, "dense"), ("edp_tp", expert_p, "expert")):
        if p <= 0:
            continue
        z = layout.zero
        if z == 0:
            add(axis, "all_reduce", f"{label} gradient all-reduce", p * grad_bytes, 1, "last backward")
        else:
            add(axis, "reduce_scatter", f"{label} gradient reduce-scatter", p * grad_bytes, m if z >= 2 else 1,
                "backward")
            add(axis, "all_gather", f"{label} parameter all-gather", p * param_bytes, 2 * m if z == 3 else 1,
                "forward")
    return out
