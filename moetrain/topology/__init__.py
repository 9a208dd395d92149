"""Cluster topology and topology-aware rank mapping (pure Python, no torch.distributed).

``build_rank_map(cfg, nodes=None, profile=None)`` → :class:`RankMap`, whose ``mesh_ranks``
[pp, dp, cp, tp] the trainer turns into its DeviceMesh. See ``mapper.py`` for the placement
rules and ``cluster.py`` for profiles, SLURM node lists and switch topology.
"""

from moetrain.topology.cluster import (
    TIERS,
    Allocation,
    ClusterProfile,
    Node,
    ProfileError,
    allocation_from_names,
    expand_nodelist,
    list_profiles,
    load_profile,
    parse_topology,
    synthetic_allocation,
)
from moetrain.topology.mapper import GROUP_AXES, MESH_AXES, RankMap, Rule, build_rank_map, check_mesh, map_ranks

__all__ = [
    "TIERS", "Allocation", "ClusterProfile", "Node", "ProfileError", "allocation_from_names", "expand_nodelist",
    "list_profiles", "load_profile", "parse_topology", "synthetic_allocation",
    "GROUP_AXES", "MESH_AXES", "RankMap", "Rule", "build_rank_map", "check_mesh", "map_ranks",
]
