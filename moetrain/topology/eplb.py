"""Expert placement by measured load (EPLB, DeepSeek-V3 §3.4 "redundant experts"; DeepSeek's
Expert Parallelism Load Balancer): which expert-parallel rank holds which experts, with the
hottest ones replicated into spare slots, so that the busiest rank's tokens come close to the mean.

Shape legend: E logical experts, R physical expert slots (E + redundant), P expert-parallel ranks
(R / P slots each), N nodes (NVLink domains; P / N ranks each).

The placement (:func:`place_experts`) is hierarchical when the nodes are more than one:

1. the experts are split over the nodes, E / N each, balancing the nodes' loads (greedy balanced
   packing: heaviest first, into the lightest node that has room) — so a token's copies stay
   within the nodes its routing chose, whatever the replicas;
2. inside each node, the node's R / N slots go to its experts: one each, then one at a time to
   the expert with the largest load per replica (a replica takes an equal share of its
   expert's tokens);
3. the node's replicas are packed onto its ranks, R / P each, by the same balanced packing of
   their per-replica loads (two replicas of one expert may share a rank only when nothing
   lighter fits).

Everything is deterministic (ties broken by index), on host integers and floats: the loads are
the step metrics' per-expert token counts, the same on every rank, so every rank computes the same
placement without a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Placement", "place_experts", "rank_loads"]


@dataclass(frozen=True)
class Placement:
    """Where each expert lives: ``slots[p]`` the logical experts of rank p's R / P slots, in slot
    order (a logical expert appears in as many slots as it has replicas)."""

    slots: tuple[tuple[int, ...], ...]

    @property
    def replicas(self) -> dict[int, int]:
        """Replicas per logical expert."""
        out: dict[int, int] = {}
        for rank in self.slots:
            for e in rank:
                out[e] = out.get(e, 0) + 1
        return out

    def physical_to_logical(self) -> list[int]:
        """The logical expert of every physical slot, ranks in order: [R]."""
        return [e for rank in self.slots for e in rank]


def _balanced_packing(weights: list[float], packs: int, capacity: int) -> list[list[int]]:
    """Items (by index) into ``packs`` packs of exactly ``capacity`` items (len(weights) ==
    packs · capacity), heaviest first into the lightest pack with room (ties: the lower index)."""
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    loads = [0.0] * packs
    out: list[list[int]] = [[] for _ in range(packs)]
    for i in order:
        p = min((p for p in range(packs) if len(out[p]) < capacity), key=lambda p: (loads[p], p))
        out[p].append(i)
        loads[p] += weights[i]
    return out


def place_experts(loads: list[float], slots: int, ranks: int, nodes: int = 1) -> Placement:
    """The placement of E logical experts with measured ``loads`` [E] (tokens, or any
    non-negative weights) over ``ranks`` expert-parallel ranks of ``slots`` // ranks slots each,
    in ``nodes`` nodes (module docstring).

    Raises:
        ValueError: ``slots`` not a multiple of ``ranks``, fewer slots than experts, ``ranks``
            not a multiple of ``nodes``, experts or slots that do not split evenly over the
            nodes, or a negative load.
    """
    E = len(loads)
    if slots % ranks or slots < E:
        raise ValueError(f"{slots} expert slots over {ranks} ranks: need a multiple of the ranks, at least the "
                         f"{E} experts")
    if ranks % nodes or E % nodes or slots % nodes:
        raise ValueError(f"{E} experts, {slots} slots and {ranks} ranks must each split evenly over {nodes} nodes")
    if any(x < 0 for x in loads):
        raise ValueError("expert loads must not be negative")
    per_node_experts, per_node_slots, per_node_ranks = E // nodes, slots // nodes, ranks // nodes
    # 1. experts to nodes
    node_experts = _balanced_packing(list(loads), nodes, per_node_experts)
    rank_slots: list[tuple[int, ...]] = []
    for experts in node_experts:
        experts = sorted(experts)
        # 2. the node's slots to its experts: one each, then the largest load per replica
        count = {e: 1 for e in experts}
        for _ in range(per_node_slots - len(experts)):
            hot = max(experts, key=lambda e: (loads[e] / count[e], -e))
            count[hot] += 1
        replicas = [e for e in experts for _ in range(count[e])]
        # 3. the node's replicas onto its ranks
        packed = _balanced_packing([loads[e] / count[e] for e in replicas], per_node_ranks,
                                   per_node_slots // per_node_ranks)
        rank_slots += [tuple(sorted(replicas[i] for i in pack)) for pack in packed]
    return Placement(tuple(rank_slots))


def rank_loads(loads: list[float], placement: Placement) -> list[float]:
    """Each rank's share of the tokens when every expert's tokens split evenly over its replicas:
    [P]. Without redundant experts (one slot each) it is the sum of the rank's experts' loads."""
    count = placement.replicas
    return [sum(loads[e] / count[e] for e in rank) for rank in placement.slots]
