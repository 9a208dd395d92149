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

Expert-parallel all-to-all (:func:`ep_all_to_all`): the buffer is the routed copies of the
rank's tokens, T·c·h·bytes, with c the copies the busiest expert rank receives (top-k × the
load of the busiest expert over the mean, capped by the capacity factor; ModelShape.expert_copies).
Without node-limited routing every copy travels on its own: the share (n − m)/n crosses the
network. With ``moe.max_nodes_per_token`` = M each token's experts lie in at most M nodes; a
dispatcher that sends a token once per destination node and forwards it over NVLink to the GPUs
that need it (DeepSeek-V3 §3.2.2, DeepEP; ``moe.token_dispatcher: hierarchical``,
``ModelShape.dispatch_dedup``) then puts it on the network min(M, N)·(N − 1)/N times, N = n/m
the domains the EP group spans, never more than its c·(n − m)/n copies would; without a limit,
once per remote domain its experts fall into (:func:`remote_domains`, the expectation under
balanced routing: 0.786 of the flat dispatcher's bytes for the demo's 8 experts, top-2, over 2
domains; measured 0.775). The flat ``alltoall`` dispatcher sends every copy, so there the limit
changes which nodes a token touches but not the bytes (both measured on 2 nodes:
benchmarks/bench_node_limited.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moetrain.planner.layout import Layout, hsdp_axes
from moetrain.planner.model import ModelShape

if TYPE_CHECKING:  # pragma: no cover
    from moetrain.topology.cluster import ClusterProfile
    from moetrain.topology.mapper import RankMap

__all__ = ["AxisPlace", "places_from_rank_map", "bus_factor", "comm_time", "CollectiveVolume",
           "step_collectives", "microbatch_buffers", "ep_all_to_all", "a2a_network_share", "remote_domains",
           "expert_grad_axis",
           "COMM_AXES"]

COMM_AXES = ("tp", "cp", "pp", "dp_cp", "ep", "edp", "edp_tp")


@dataclass(frozen=True)
class AxisPlace:
    """Where one axis's groups sit: size n, the slowest tier crossed, and the fewest members any
    group has inside one NVSwitch domain."""

    size: int
    tier: str
    per_domain: int


def places_from_rank_map(rm: "RankMap") -> dict[str, AxisPlace]:
    """Per communicating axis, its placement on the rank map (worst group); under HSDP (the map's
    ``dp_shard`` size) also ``<axis>_shard`` and ``<axis>_replicate`` of each replica axis it
    splits (:func:`hsdp_axes`)."""
    out = {}
    for axis in COMM_AXES:
        arr = rm.group_array(axis)
        out[axis] = AxisPlace(int(arr.shape[1]), rm.worst_tier(axis), max(1, rm.members_per_domain(axis)))
    s = rm.sizes
    for axis, shard in hsdp_axes(s.get("dp_shard"), s["dp"] * s["cp"], s["ep"], s["tp"]).items():
        for name, groups in zip(("shard", "replicate"), rm.hsdp_groups(axis, shard)):
            tier, per_domain = rm.place_of(groups)
            out[f"{axis}_{name}"] = AxisPlace(int(groups.shape[1]), tier, max(1, per_domain))
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


def comm_time(op: str, nbytes: float, place: AxisPlace, profile: "ClusterProfile",
              a2a_shares: tuple[float, float] | None = None) -> tuple[float, dict[str, float]]:
    """Seconds for one collective of an ``nbytes`` buffer over ``place``, and the bytes each GPU
    puts on each tier (``{"nvlink": ..., "rail" or "spine": ...}``). ``a2a_shares``: the
    (network, NVLink) bytes per buffer byte of an all-to-all when not the plain (n − m)/n,
    (m − 1)/n (see :func:`a2a_network_share`)."""
    n = place.size
    if n <= 1 or nbytes <= 0 or place.tier == "none":
        return 0.0, {}
    steps = 1 if op == "p2p" else max(1, math.ceil(math.log2(n))) * (2 if op == "all_reduce" else 1)
    if place.tier == "nvlink":
        b = bus_factor(op, n) * nbytes
        return b / profile.bandwidth("nvlink", op) + steps * profile.latency("nvlink"), {"nvlink": b}
    m = min(max(1, place.per_domain), n)
    if op == "p2p":
        net, nv = float(nbytes), 0.0
    elif op == "all_to_all":
        net_share, nv_share = a2a_shares or ((n - m) / n, (m - 1) / n)
        net, nv = nbytes * net_share, nbytes * nv_share
    else:
        f = bus_factor(op, n) * nbytes
        net, nv = f / m, f * (m - 1) / m
    t = max(net / profile.bandwidth(place.tier, op), nv / profile.bandwidth("nvlink", op)) + steps * profile.latency(place.tier)
    tiers = {place.tier: net}
    if nv:
        tiers["nvlink"] = nv
    return t, tiers


def remote_domains(domains: int, experts: int, top_k: int) -> float:
    """Expected NVSwitch domains other than its own that a token's ``top_k`` distinct experts,
    drawn uniformly from ``experts`` spread evenly over ``domains``, fall into:
    (N − 1)·(1 − C(E − E/N, k) / C(E, k)). What a de-duplicating dispatcher without a node limit
    sends over the network per token (balanced routing, as the benchmarks force)."""
    if domains <= 1 or top_k <= 0:
        return 0.0
    per = experts // domains
    miss = math.comb(experts - per, top_k) / math.comb(experts, top_k) if experts - per >= top_k else 0.0
    return (domains - 1) * (1.0 - miss)


def a2a_network_share(copies: float, n: int, m: int, max_nodes: int | None,
                      spread: tuple[int, int] | None = None) -> tuple[float, float]:
    """(network, NVLink) bytes per byte of an EP all-to-all buffer of ``copies`` routed copies
    per token, over a group of n ranks with m in each NVSwitch domain (module doc). A
    de-duplicating dispatcher passes ``max_nodes`` (its node limit) or, without one, ``spread`` =
    (experts, top_k): a token then crosses once to each remote domain its experts lie in
    (:func:`remote_domains`).

    Raises:
        ValueError: max_nodes below 1.
    """
    if n <= 1:
        return 0.0, 0.0
    m = min(max(1, m), n)
    plain_net, plain_nv = (n - m) / n, (m - 1) / n
    if (max_nodes is None and spread is None) or m == n or copies <= 0:
        return plain_net, plain_nv
    if max_nodes is not None and max_nodes < 1:
        raise ValueError(f"max_nodes_per_token = {max_nodes}: must be at least 1")
    domains = math.ceil(n / m)
    if max_nodes is not None:
        per_token = min(max_nodes, domains) * (domains - 1) / domains   # network sends per token
    else:
        assert spread is not None
        per_token = remote_domains(domains, spread[0], spread[1])
    net = min(plain_net, per_token / copies)
    # arrivals fan out from the receiving GPU to the others of its domain that need them
    return net, plain_nv + plain_net * (m - 1) / m


def ep_all_to_all(nbytes: float, place: AxisPlace, profile: "ClusterProfile", copies: float,
                  max_nodes: int | None = None, spread: tuple[int, int] | None = None) -> tuple[float, dict[str, float]]:
    """Seconds and bytes per tier of one EP all-to-all of an ``nbytes`` buffer per GPU holding
    ``copies`` routed copies per token; a de-duplicating dispatcher passes ``max_nodes`` or
    ``spread`` (:func:`a2a_network_share`)."""
    shares = (a2a_network_share(copies, place.size, place.per_domain, max_nodes, spread)
              if place.size > 1 else None)
    return comm_time("all_to_all", nbytes, place, profile, shares)


def expert_grad_axis(layout: Layout) -> str:
    """The group that reduces expert gradients: edp × tp when the tp ranks hold whole-expert
    replicas, edp when tp splits the experts (etp = tp) or the ep groups fold them in."""
    return "edp" if layout.etp > 1 or layout.ep_fold else "edp_tp"


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


def microbatch_buffers(shape: ModelShape, layout: Layout, act_bytes: int = 2,
                       moe_imbalance: float = 1.0) -> dict[str, float]:
    """Buffer sizes (bytes) of the per-micro-batch collectives. ``ep``: the routed copies the
    busiest expert rank receives in one dispatch (or sends back in one combine); ``etp``: those
    copies gathered over the tp ranks (all-gather before, reduce-scatter after the experts,
    when etp = tp)."""
    tokens = layout.mbs * shape.seq_len / layout.cp
    tm = tokens / layout.tp  # an MoE block routes its tp rank's 1/tp slice of the sequence
    routed = tm * shape.expert_copies(moe_imbalance) * shape.hidden * act_bytes if shape.is_moe else 0.0
    return {
        "tokens": tokens,
        "tp": tokens * shape.hidden * act_bytes,                       # gathered activation of one TP region
        # all K and V chunks of the ring; with DSA also the indexer keys (one head, every tp rank)
        # and, for the indexer's loss, the attention's keys once more (moetrain.model.dsa)
        "cp": layout.cp * tokens * (shape.h_kv * 2 / layout.tp + (
            shape.index_head_dim + shape.h_kv / layout.tp if shape.dsa_topk else 0)) * act_bytes,
        # a gated-DeltaNet / Mamba-2 layer's head exchange, both ways, forward (its tp rank's heads)
        "cp_heads": tokens * shape.head_exchange_width() * act_bytes / layout.tp,
        "ep": routed,                                                  # routed token copies of one dispatch
        "etp": routed * layout.tp if layout.etp > 1 else 0.0,
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
    sz = microbatch_buffers(shape, layout, moe_imbalance=moe_imbalance)
    lp = math.ceil(shape.layers / layout.pp)
    moe_frac = shape.moe_layers / shape.layers
    # the last stage with its MTP modules' blocks (DeepSeek-V3 §2.2), the busiest one
    mtp_moe = shape.mtp_depth if shape.mtp_moe else 0
    n_moe = round(lp * moe_frac) + mtp_moe
    n_dense = lp - round(lp * moe_frac) + shape.mtp_depth - mtp_moe
    # the share of a stage's layers run forward again under full recomputation
    recompute = layout.full_recompute_share(lp / layout.vpp)
    passes = 2 + recompute  # forward, backward, forward again under full recomputation
    out: list[CollectiveVolume] = []

    def add(axis: str, op: str, what: str, nbytes: float, calls: float, overlap: str) -> None:
        if calls <= 0 or nbytes <= 0 or places[axis].size <= 1:
            return
        if op == "all_to_all" and axis == "ep":
            t, tiers = ep_all_to_all(nbytes, places[axis], profile, shape.expert_copies(moe_imbalance),
                                     *shape.dedup_args())
        else:
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
            sz["cp"], lp * shape.attention_share * (1 + 2 + recompute) * m, "attention compute")
        add("cp", "all_to_all", "gated-DeltaNet / Mamba-2 head exchange, both ways (forward and backward)",
            sz["cp_heads"], lp * (1 - shape.attention_share) * passes * m, "none")
    if shape.is_moe and layout.ep > 1 and shape.dispatch_fp8:
        forward = 1 + recompute  # the dispatches in fp8; the combine and the backward's in bf16
        add("ep", "all_to_all", "token dispatch in fp8 (forward)", sz["ep"] * shape.dispatch_ratio(),
            n_moe * forward * m, "none")
        add("ep", "all_to_all", "combine (forward) and both all-to-alls of the backward, bf16",
            sz["ep"], n_moe * (2 * passes - forward) * m, "none")
    elif shape.is_moe and layout.ep > 1:
        add("ep", "all_to_all", "token dispatch and combine (forward and backward)",
            sz["ep"], n_moe * 2 * passes * m, "none")
    if shape.is_moe and layout.etp > 1:
        add("tp", "all_gather", "expert-TP all-gather of the routed tokens (and reduce-scatter's backward)",
            sz["etp"], n_moe * passes * m, "none")
        add("tp", "reduce_scatter", "expert-TP reduce-scatter of the expert outputs (and all-gather's backward)",
            sz["etp"], n_moe * passes * m, "none")
    if layout.pp > 1:
        add("pp", "p2p", "activations forward, gradients backward between neighbouring stages",
            sz["pp"], 2 * layout.vpp * m, "none")
    expert_total = (shape.moe_layers + mtp_moe) * shape.expert_params
    dense_p = dense_params_rank if dense_params_rank is not None else \
        (shape.total_params - expert_total) / (layout.tp * layout.pp)
    expert_p = expert_params_rank if expert_params_rank is not None else \
        expert_total / (layout.pp * layout.ep * layout.etp)
    hsdp = layout.hsdp_axes()
    # Gradients of what trains: under train.lora the adapters only (whole on every tp rank).
    lo = shape.lora
    trained = {"dense": (lp * (1 - moe_frac) * lo.dense_layer + lp * moe_frac * lo.moe_layer) if lo else dense_p,
               "expert": (lp * moe_frac * lo.expert_layer / (1 if lo.experts_shared else layout.ep)) if lo else expert_p}
    for axis, p, label in (("dp_cp", dense_p, "dense"), (expert_grad_axis(layout), expert_p, "expert")):
        if p <= 0:
            continue
        z = layout.zero
        g = trained[label]
        if z == 0:
            add(axis, "all_reduce", f"{label} gradient all-reduce", g * grad_bytes, 1, "last backward")
            continue
        shard = f"{axis}_shard" if axis in hsdp else axis
        add(shard, "reduce_scatter", f"{label} gradient reduce-scatter", g * grad_bytes, m if z >= 2 else 1,
            "backward")
        if axis in hsdp:  # HSDP: each shard's gradient all-reduced across the shard groups
            add(f"{axis}_replicate", "all_reduce", f"{label} gradient shard all-reduce across HSDP groups",
                g * grad_bytes / hsdp[axis], m if z >= 2 else 1, "backward")
        gather = lo.gather_bytes if lo is not None and lo.gather_bytes else param_bytes
        add(shard, "all_gather", f"{label} parameter all-gather", p * gather, 2 * m if z == 3 else 1,
            "forward")
    return out
