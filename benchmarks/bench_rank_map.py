"""Topology-aware rank mapping vs the identity order, on SuperPOD-scale allocations. Prints JSON.

For each case: the time ``build_rank_map`` takes (median of ``--repeats``), and the placement
it gives against the baseline computed in the same run — the identity order
``rank = ((pp·dp + dp)·cp + cp)·tp + tp`` that ``init_device_mesh`` uses: how many TP groups
stay on NVLink, how many neighbouring-stage pairs share a rail and a rail group, EP members
per NVSwitch domain, the tier of each group kind, and the rules each breaks.

    python benchmarks/bench_rank_map.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from moetrain.config import config_from_dict  # noqa: E402
from moetrain.topology import build_rank_map, load_profile  # noqa: E402
from moetrain.topology.mapper import RankMap, check_mesh  # noqa: E402

CASES = [
    # name, profile, nodes, gpus per node, sizes
    ("16384 H100, tp8 pp16 dp128", "h100-superpod", 2048, 8, dict(pp=16, dp=128, cp=1, tp=8, ep=1)),
    ("16384 H100, MoE tp2 pp8 dp1024 ep64", "h100-superpod", 2048, 8, dict(pp=8, dp=1024, cp=1, tp=2, ep=64)),
    ("16384 H100, tp8 cp16 pp16 dp8", "h100-superpod", 2048, 8, dict(pp=16, dp=8, cp=16, tp=8, ep=1)),
    ("16128 GB200 NVL72 (224 racks), tp4 pp4 dp1008 ep16", "gb200-nvl72", 4032, 4, dict(pp=4, dp=1008, cp=1, tp=4, ep=16)),
    ("512 H100, Mixtral tp2 pp4 dp64 ep8", "h100-superpod", 64, 8, dict(pp=4, dp=64, cp=1, tp=2, ep=8)),
]


def _cfg(nodes: int, gpn: int, sizes: dict) -> object:
    return config_from_dict({"model": {"layers": 64, "hidden": 8192, "heads": 64, "kv_heads": 64},
                             "moe": {"num_experts": 64 if sizes["ep"] > 1 else 0},
                             "parallel": sizes, "launch": {"cluster": "slurm", "nodes": nodes, "gpus_per_node": gpn}},
                            validate_config=False)


def _quality(rm: RankMap) -> dict:
    s = rm.sizes
    tpn = rm.tasks_per_node
    domain = np.array([n.domain for n in rm.allocation.nodes])
    group = np.array([n.rail_group for n in rm.allocation.nodes])
    out: dict = {"tiers": {a: rm.tier_counts(a) for a in ("tp", "cp", "pp", "dp_cp", "ep", "edp_tp")}}
    if s["pp"] > 1:
        a, b = rm.mesh_ranks[:-1].reshape(-1), rm.mesh_ranks[1:].reshape(-1)
        na, nb = a // tpn, b // tpn
        xdom = domain[na] != domain[nb]
        out["pp_pairs"] = int(a.size)
        out["pp_pairs_same_node"] = int((na == nb).sum())
        out["pp_pairs_same_gpu_index_across_domains"] = int((xdom & (a % tpn == b % tpn)).sum())
        out["pp_pairs_across_domains"] = int(xdom.sum())
        out["pp_pairs_across_rail_groups"] = int((group[na] != group[nb]).sum())
    if s["ep"] > 1:
        out["ep_min_members_per_domain"] = rm.members_per_domain("ep")
    out["broken_rules"] = [r.name for r in rm.broken_rules]
    return out


def _identity(rm: RankMap) -> RankMap:
    s = rm.sizes
    mesh = np.arange(rm.world, dtype=np.int64).reshape(s["pp"], s["dp"], s["cp"], s["tp"])
    return check_mesh(mesh, s["ep"], rm.allocation, rm.profile, rm.tasks_per_node, "identity")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    results = []
    for name, prof_name, nodes, gpn, sizes in CASES:
        prof = load_profile(prof_name)
        cfg = _cfg(nodes, gpn, sizes)
        times = []
        rm = None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            rm = build_rank_map(cfg, profile=prof)
            times.append(time.perf_counter() - t0)
        assert rm is not None
        t0 = time.perf_counter()
        base = _identity(rm)
        t_base = time.perf_counter() - t0
        results.append({
            "case": name, "gpus": rm.world, "profile": prof_name,
            "build_rank_map_s": {"median": statistics.median(times), "min": min(times)},
            "identity_baseline_check_s": t_base,
            "placement": rm.placement,
            "topology_aware": _quality(rm),
            "identity_baseline": _quality(base),
        })
    print(json.dumps({"benchmark": "rank_map", "repeats": args.repeats, "results": results}, indent=2))


if __name__ == "__main__":
    main()
