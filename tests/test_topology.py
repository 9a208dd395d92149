"""Topology-aware rank mapping: node lists, switch topology, placement rules on many shapes,
allocations that break rules, and (multi-process) the trainer's groups equal the mapper's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import yaml

from moetrain.config import config_from_dict
from moetrain.topology import (
    GROUP_AXES,
    ProfileError,
    allocation_from_names,
    build_rank_map,
    expand_nodelist,
    list_profiles,
    load_profile,
    map_ranks,
    parse_topology,
    synthetic_allocation,
)
from moetrain.topology.cluster import Allocation, Node

H100 = load_profile("h100-superpod")
NVL72 = load_profile("gb200-nvl72")


def _cfg(pp=1, dp=1, cp=1, tp=1, ep=1, nodes=1, gpn=8, experts=8, cluster=None, profile=None):
    """A config with these sizes; the model only has to accept them (validation skipped)."""
    return config_from_dict({
        "model": {"layers": 64, "hidden": 4096, "heads": 64, "kv_heads": 64, "seq_len": 4096},
        "moe": {"num_experts": experts},
        "parallel": {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep},
        "launch": {"cluster": cluster or ("slurm" if nodes > 1 else "local"), "nodes": nodes,
                   "gpus_per_node": gpn, "profile": profile},
    }, validate_config=False)


def _check_invariants(rm):
    """Every axis's groups partition the ranks and agree with the coordinate formulas."""
    s = rm.sizes
    world = rm.world
    mesh = rm.mesh_ranks
    assert mesh.shape == (s["pp"], s["dp"], s["cp"], s["tp"])
    assert sorted(mesh.reshape(-1).tolist()) == list(range(world))
    for axis in GROUP_AXES:
        arr = rm.group_array(axis)
        assert sorted(arr.reshape(-1).tolist()) == list(range(world)), axis
    pp, dp, cp, tp, ep = (rm.coord_array(a) for a in ("pp", "dp", "cp", "tp", "ep"))
    edp = rm.coord_array("edp")
    folded = dp * s["cp"] + cp
    assert (ep == folded % s["ep"]).all() and (edp == folded // s["ep"]).all()
    for members in rm.group_array("ep"):
        m = np.asarray(members)
        assert len(set(zip(pp[m], tp[m]))) == 1                   # one (pp, tp) slice
        assert (ep[m] == np.arange(s["ep"])).all()                 # in ep order
        assert len(set(edp[m])) == 1
    for members in rm.group_array("edp_tp"):
        m = np.asarray(members)
        assert len(set(pp[m])) == 1 and len(set(ep[m])) == 1       # same pp, same ep_idx
        assert len(m) == s["edp"] * s["tp"]
    for members in rm.group_array("dp_cp"):
        m = np.asarray(members)
        assert (folded[m] == np.arange(s["dp"] * s["cp"])).all()   # dp outer, cp inner
    # the rank ↔ node arithmetic SLURM uses
    c = rm.coords(world - 1)
    assert c["node"] == (world - 1) // rm.tasks_per_node and c["local_rank"] == (world - 1) % rm.tasks_per_node


# ---------------------------------------------------------------------------------------------
# Node lists and switch topology
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, names", [
    ("gpu001", ["gpu001"]),
    ("gpu[001-003]", ["gpu001", "gpu002", "gpu003"]),
    ("gpu[1-2,7],dgx-a[09-10]", ["gpu1", "gpu2", "gpu7", "dgx-a09", "dgx-a10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a,b[3],c", ["a", "b3", "c"]),
])
def test_expand_nodelist(text, names):
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("bad", ["gpu[1-3", "gpu1-3]", "gpu[a-c]", "gpu[5-2]"])
def test_expand_nodelist_rejects(bad):
    with pytest.raises(ProfileError):
        expand_nodelist(bad)


SCONTROL = """\
SwitchName=leaf-a Level=0 LinkSpeed=1 Nodes=gpu[01-03]
SwitchName=leaf-b Level=0 LinkSpeed=1 Nodes=gpu[04-06]
SwitchName=spine Level=1 LinkSpeed=1 Switches=leaf-[a-b]
"""


def test_parse_topology_tree_and_block():
    leaf, block = parse_topology(SCONTROL + "# comment\nBlockName=rack1 Nodes=gpu[01-02]\nBlockName=rack2 Nodes=gpu03\n")
    assert leaf["gpu01"] == leaf["gpu03"] == "leaf-a" and leaf["gpu06"] == "leaf-b"
    assert block == {"gpu01": "rack1", "gpu02": "rack1", "gpu03": "rack2"}


def test_allocation_from_topology_and_fallback():
    alloc = allocation_from_names([f"gpu0{i}" for i in range(1, 7)], H100, SCONTROL)
    assert [n.rail_group for n in alloc.nodes] == [0, 0, 0, 1, 1, 1]
    assert alloc.source == "switch topology"
    plain = allocation_from_names(["x", "y"], H100, None)
    assert plain.notes and "no switch topology" in plain.notes[0]


def test_profiles_load_and_reject():
    names = list_profiles()
    for required in ("h100-superpod", "gb200-nvl72", "single-node", "a100-superpod", "cpu-local"):
        assert required in names
    for n in names:
        p = load_profile(n)
        assert p.nvswitch_domain_gpus % p.gpus_per_node == 0 and p.bandwidth("rail") > 0
    assert NVL72.domain_nodes == 18 and H100.domain_nodes == 1
    with pytest.raises(ProfileError, match="no such file"):
        load_profile("no-such-cluster")
    assert load_profile("dev-emulated").ep_overlap_efficiency < 1.0 == H100.ep_overlap_efficiency  # measured / ideal


def test_profile_rejects_an_overlap_efficiency_outside_0_1(tmp_path):
    raw = load_profile("cpu-local").to_dict()
    raw.pop("path")
    raw["ep_overlap_efficiency"] = 1.5
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ProfileError, match="ep_overlap_efficiency=1.5 must lie in"):
        load_profile(tmp_path / "bad.yaml")


@pytest.mark.parametrize("value", [0.0, 1.2])
def test_profile_rejects_an_hbm_efficiency_outside_0_1(tmp_path, value):
    raw = load_profile("cpu-local").to_dict()
    raw.pop("path")
    raw["hbm_efficiency"] = value
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ProfileError, match=f"hbm_efficiency={value} must lie in"):
        load_profile(tmp_path / "bad.yaml")
    assert load_profile("cpu-local").hbm_efficiency == 1.0  # the datasheet where nothing was measured


# ---------------------------------------------------------------------------------------------
# Placement on well-shaped allocations: no rule broken
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [
    dict(pp=1, dp=2, cp=1, tp=4, ep=2), dict(pp=2, dp=2, cp=1, tp=2, ep=1), dict(pp=4, dp=1, cp=2, tp=1, ep=2),
    dict(pp=1, dp=8, cp=1, tp=1, ep=8),
])
def test_single_node_is_identity(sizes):
    rm = build_rank_map(_cfg(**sizes, gpn=8))
    assert rm.mesh_ranks.reshape(-1).tolist() == list(range(rm.world))
    assert not rm.broken_rules
    _check_invariants(rm)


@pytest.mark.parametrize("nodes, sizes", [
    (2, dict(pp=2, dp=1, cp=1, tp=8)),
    (4, dict(pp=4, dp=2, cp=1, tp=4, ep=2)),
    (8, dict(pp=4, dp=8, cp=1, tp=2, ep=8)),
    (16, dict(pp=2, dp=4, cp=2, tp=8, ep=8)),          # tp·cp = 16 > 8: CP over the network, rail-aligned
    (64, dict(pp=4, dp=64, cp=1, tp=2, ep=8)),
    (256, dict(pp=8, dp=32, cp=1, tp=8, ep=4)),
    (2048, dict(pp=16, dp=128, cp=1, tp=8, ep=1)),
])
def test_h100_shapes_keep_every_rule(nodes, sizes):
    rm = build_rank_map(_cfg(**sizes, nodes=nodes), profile=H100)
    _check_invariants(rm)
    assert not rm.broken_rules, [r.detail for r in rm.broken_rules]
    assert set(rm.tiers("tp")) <= {"none", "nvlink"}
    if sizes["pp"] > 1:
        # neighbouring stages: different nodes, same local GPU index, same rail group
        a, b = rm.mesh_ranks[:-1].reshape(-1), rm.mesh_ranks[1:].reshape(-1)
        tpn = rm.tasks_per_node
        assert (a // tpn != b // tpn).all() and (a % tpn == b % tpn).all()
        groups = np.array([n.rail_group for n in rm.allocation.nodes])
        assert (groups[a // tpn] == groups[b // tpn]).all()
    if sizes["tp"] * sizes["cp"] > 8 and sizes["cp"] > 1:
        assert next(r for r in rm.rules if r.name == "cp_in_domain").status == "n/a"
        assert set(rm.tiers("cp")) == {"rail"}


def test_dp_takes_the_cross_group_links():
    rm = build_rank_map(_cfg(pp=4, dp=64, tp=2, ep=8, nodes=64), profile=H100)  # 2 rail groups of 32
    assert set(rm.tiers("pp")) == {"rail"}
    assert rm.worst_tier("dp_cp") == "spine"
    assert next(r for r in rm.rules if r.name == "dp_ep_outer").status == "ok"


@pytest.mark.parametrize("nodes, sizes", [
    (18, dict(pp=1, dp=9, cp=1, tp=8, ep=1)),          # TP of 8 over 2 nodes of one NVLink domain
    (16, dict(pp=4, dp=4, cp=1, tp=4, ep=4)),
    (36, dict(pp=2, dp=18, cp=1, tp=4, ep=6)),
    (288, dict(pp=8, dp=36, cp=1, tp=4, ep=4)),        # 16 racks: pipelines must stay in 144-node groups
])
def test_nvl72_shapes(nodes, sizes):
    rm = build_rank_map(_cfg(**sizes, nodes=nodes, gpn=4), profile=NVL72)
    _check_invariants(rm)
    assert not rm.broken_rules, [r.detail for r in rm.broken_rules]
    assert set(rm.tiers("tp")) <= {"none", "nvlink"}
    if sizes["ep"] > 1 and nodes <= 36:
        assert set(rm.tiers("ep")) == {"nvlink"}  # the rest of the rack holds dp, so EP stays on NVLink


def test_rank_map_of_16384_gpus():
    # Its speed is measured by benchmarks/bench_rank_map.py, not asserted here.
    cfg = _cfg(pp=16, dp=128, cp=1, tp=8, ep=1, nodes=2048)
    rm = build_rank_map(cfg, profile=H100)
    assert rm.world == 16384 and not rm.broken_rules
    assert sorted(r for g in rm.groups("tp") for r in g) == list(range(16384)), "tp groups partition the ranks"


# ---------------------------------------------------------------------------------------------
# Allocations that break rules: the map stays valid and says why
# ---------------------------------------------------------------------------------------------


def test_nodes_from_two_rail_groups():
    alloc = allocation_from_names([f"gpu0{i}" for i in range(1, 7)], H100, SCONTROL)  # 3 + 3 nodes
    rm = map_ranks({"pp": 2, "dp": 3, "cp": 1, "tp": 8, "ep": 1}, alloc, H100, 8)
    _check_invariants(rm)
    broken = {r.name: r.detail for r in rm.broken_rules}
    assert "pp_in_rail_group" in broken and "2 rail groups" in broken["pp_in_rail_group"]
    assert "8 of 24" in broken["pp_in_rail_group"]  # one pipeline of three straddles, the best possible


def test_odd_node_count_and_stages_sharing_nodes():
    rm = map_ranks({"pp": 8, "dp": 1, "cp": 1, "tp": 2, "ep": 1}, synthetic_allocation(2, H100), H100, 8)
    _check_invariants(rm)
    rules = {r.name: r for r in rm.rules}
    assert rules["pp_cross_node"].status == "broken" and "share a node" in rules["pp_cross_node"].detail
    assert rules["pp_same_rail"].status == "ok"  # the snake keeps every cross-node hop on one rail
    rm3 = map_ranks({"pp": 3, "dp": 1, "cp": 1, "tp": 8, "ep": 1}, synthetic_allocation(3, H100), H100, 8)
    assert not rm3.broken_rules


def test_tp_that_does_not_fit_a_node():
    rm = map_ranks({"pp": 1, "dp": 4, "cp": 1, "tp": 6, "ep": 1}, synthetic_allocation(3, H100), H100, 8)
    _check_invariants(rm)
    detail = next(r.detail for r in rm.broken_rules if r.name == "tp_in_domain")
    assert "tp = 6" in detail
    rm16 = map_ranks({"pp": 1, "dp": 1, "cp": 1, "tp": 16, "ep": 1}, synthetic_allocation(2, H100), H100, 8)
    assert "larger than an NVSwitch domain" in next(r.detail for r in rm16.broken_rules)


def test_nvl72_rack_cut_in_pieces():
    # 17 + 1 nodes of two racks: a TP group of 8 GPUs (2 nodes) must straddle racks somewhere
    nodes = tuple(Node(f"n{i:02d}", 0 if i < 17 else 1, 0) for i in range(18))
    rm = map_ranks({"pp": 1, "dp": 9, "cp": 1, "tp": 8, "ep": 1}, Allocation(nodes), NVL72, 4)
    _check_invariants(rm)
    detail = next(r.detail for r in rm.broken_rules if r.name == "tp_in_domain")
    assert "1 of 9" in detail and "17/1" in detail


def test_hsdp_shard_groups_stay_inside_a_domain():
    rm = map_ranks({"pp": 2, "dp": 8, "cp": 1, "tp": 2, "ep": 1, "dp_shard": 4}, synthetic_allocation(4, H100), H100, 8)
    _check_invariants(rm)
    rule = next(r for r in rm.rules if r.name == "dp_shard_in_domain")
    assert rule.status == "ok" and "all 4 shard groups" in rule.detail
    for group in rm.mesh_ranks.reshape(-1, 4 * 2):  # dp_shard consecutive dp ranks with their tp ranks
        assert len({int(r) // 8 for r in group}) == 1
    # groups of 6 ranks on nodes of 8: some straddle, and the rule says so
    broken = map_ranks({"pp": 1, "dp": 24, "cp": 1, "tp": 1, "ep": 1, "dp_shard": 6}, synthetic_allocation(3, H100),
                       H100, 8)
    assert next(r for r in broken.rules if r.name == "dp_shard_in_domain").status == "broken"
    too_big = map_ranks({"pp": 1, "dp": 32, "cp": 1, "tp": 1, "ep": 1, "dp_shard": 16}, synthetic_allocation(4, H100),
                        H100, 8)
    rule = next(r for r in too_big.rules if r.name == "dp_shard_in_domain")
    assert rule.status == "n/a" and "cross the network" in rule.detail


def test_pipeline_longer_than_a_rail_group():
    rm = build_rank_map(_cfg(pp=64, dp=1, tp=8, nodes=64), profile=H100)
    detail = next(r.detail for r in rm.broken_rules if r.name == "pp_in_rail_group")
    assert "more than the largest rail group" in detail


def test_mismatched_world_is_rejected():
    with pytest.raises(ValueError, match="does not split"):
        build_rank_map(_cfg(pp=1, dp=3, tp=1, nodes=2))


# ---------------------------------------------------------------------------------------------
# Where the nodes come from
# ---------------------------------------------------------------------------------------------


def test_nodes_from_slurm_environment(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-04]")
    monkeypatch.setattr("moetrain.topology.mapper.read_slurm_topology", lambda: SCONTROL.replace("06", "04"))
    rm = build_rank_map(_cfg(pp=2, dp=2, tp=8, nodes=4, cluster="slurm"), profile="h100-superpod")
    assert rm.allocation.names == ["gpu01", "gpu02", "gpu03", "gpu04"]
    assert [n.rail_group for n in rm.allocation.nodes] == [0, 0, 0, 1]
    assert rm.coords(8)["node_name"] == "gpu02"
    same = build_rank_map(_cfg(pp=2, dp=2, tp=8, nodes=4, cluster="slurm"), profile="h100-superpod")
    assert same.digest == rm.digest


def test_profile_from_config_and_generic_fallback():
    rm = build_rank_map(_cfg(pp=2, tp=8, nodes=2, profile="h100-superpod"))
    assert rm.profile.name == "h100-superpod" and not rm.notes
    rm2 = build_rank_map(_cfg(pp=2, tp=8, nodes=2))
    assert rm2.notes and "no cluster profile" in rm2.notes[0]


def test_to_dict_has_the_documented_fields():
    rm = build_rank_map(_cfg(pp=2, dp=2, tp=2, ep=2, nodes=1))
    d = rm.to_dict()
    assert {"rank", "node", "local_rank", "pp", "dp", "cp", "tp", "ep"} <= set(d["ranks"][0])
    assert {"axis", "members", "tier"} <= set(d["groups"][0])
    assert {g["axis"] for g in d["groups"]} == set(GROUP_AXES)


# ---------------------------------------------------------------------------------------------
# The trainer's process groups are the mapper's groups (gloo, 4 processes)
# ---------------------------------------------------------------------------------------------


def _groups_worker(rank: int, world: int, mesh_ranks: list, parallel: dict) -> dict:
    import torch

    from moetrain.config import ParallelConfig
    from moetrain.parallel.state import ParallelState

    ps = ParallelState.build(ParallelConfig(**parallel), torch.device("cpu"), mesh_ranks)
    return {axis: ps.group_ranks(axis) for axis in GROUP_AXES}


@pytest.mark.slow
def test_process_groups_equal_the_mapper_groups():
    pytest.importorskip("moetrain.parallel.state")
    from multiproc import run_distributed

    # 4 one-GPU nodes: the mapper puts neighbouring stages on neighbouring nodes and dp
    # outermost, so the mesh is [[0, 2], [1, 3]] rather than the identity [[0, 1], [2, 3]].
    prof = dataclasses.replace(H100, name="1-gpu-nodes", gpus_per_node=1, nvswitch_domain_gpus=1, rails_per_node=1)
    parallel = {"pp": 2, "dp": 2, "cp": 1, "tp": 1, "ep": 2}
    rm = build_rank_map(_cfg(**parallel, nodes=4, gpn=1), profile=prof)
    assert rm.mesh_ranks.reshape(-1).tolist() == [0, 2, 1, 3]
    results = run_distributed(_groups_worker, 4, rm.mesh_ranks.tolist(), parallel)
    for rank, groups in enumerate(results):
        for axis in GROUP_AXES:
            assert groups[axis] == rm.group_of(rank, axis), (rank, axis)
