"""benchmarks/bench_emulated_network.py's layouts and the planner's view of them, without the dev
cluster: ``--ranks 2`` gives one rank per node (dp2 × ep2) and the planner gives that rank the
whole node link, as the profile ``slurm/dev-cluster up`` writes for one rank per node would. The
bench's step times are in docs/performance.md §5; nothing here asserts them."""

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_emulated_network as ben  # noqa: E402
from moetrain.topology.cluster import load_profile  # noqa: E402

PROFILE = ROOT / "slurm" / "profiles" / "dev-emulated.yaml"  # 2 ranks per node share a node link


@pytest.mark.parametrize("ranks", [4, 2])
def test_layouts_at_either_rank_count(tmp_path, ranks):
    for name in ("one-node", "flat", "flat+overlap"):
        cfg = ben.layout_config(name, tmp_path, tmp_path / name, 4, 8, PROFILE, ranks=ranks)
        nodes = 1 if name == "one-node" else 2
        assert (cfg.parallel.dp, cfg.parallel.ep, cfg.launch.nodes, cfg.launch.tasks_per_node) == \
            (ranks, ranks, nodes, ranks // nodes)
        assert cfg.grad_accum_steps == 8  # micro-batches per rank, whatever the rank count
        assert cfg.parallel.ep_overlap == (name == "flat+overlap")


def test_one_rank_per_node_has_the_whole_node_link(tmp_path):
    prof = load_profile(PROFILE)
    assert prof.gpus_per_node == 2
    flat2 = ben.layout_config("flat", tmp_path, tmp_path / "f2", 4, 8, PROFILE, ranks=2)
    # the profile dev-cluster's write_profile gives for one rank per node: R / 8000 / 1 per rank
    one_per_node = dataclasses.replace(prof, gpus_per_node=1, nvswitch_domain_gpus=1,
                                       rail_gb_s=prof.rail_gb_s * 2, spine_gb_s=prof.spine_gb_s * 2)
    assert ben.predict(flat2, prof) == ben.predict(flat2, one_per_node)
    # and the link is what its all-to-all waits on: the rank's share of it halved, the exposed
    # all-to-all (no overlap, no compute beside it) takes twice as long, less the per-message latency
    half = dataclasses.replace(one_per_node, rail_gb_s=prof.rail_gb_s, spine_gb_s=prof.spine_gb_s)
    full_ep, half_ep = ben.predict(flat2, one_per_node)["ep_exposed_s"], ben.predict(flat2, half)["ep_exposed_s"]
    assert 1.8 < half_ep / full_ep < 2.0
