"""Expert placement by measured load (moetrain/topology/eplb.py): every expert placed, the
slots and the nodes respected, the busiest rank brought near the mean on a skewed load."""

from __future__ import annotations

import random

import pytest

from moetrain.topology.eplb import Placement, place_experts, rank_loads


def contiguous(E: int, ranks: int) -> Placement:
    """moetrain's placement without EPLB: rank p holds experts p·E/P … (p + 1)·E/P − 1."""
    n = E // ranks
    return Placement(tuple(tuple(range(p * n, (p + 1) * n)) for p in range(ranks)))


def test_every_expert_placed_in_whole_slots_within_its_node():
    rng = random.Random(0)
    loads = [rng.expovariate(1.0) for _ in range(16)]
    pl = place_experts(loads, slots=24, ranks=8, nodes=2)
    assert all(len(r) == 3 for r in pl.slots)
    assert sorted(pl.replicas) == list(range(16)) and sum(pl.replicas.values()) == 24
    node_experts = [set(e for r in pl.slots[n * 4:(n + 1) * 4] for e in r) for n in range(2)]
    assert not node_experts[0] & node_experts[1], "an expert's replicas stay in its node"
    assert all(len(s) == 8 for s in node_experts)
    assert pl == place_experts(list(loads), slots=24, ranks=8, nodes=2), "deterministic"
    assert len(pl.physical_to_logical()) == 24


def test_a_skewed_load_is_brought_near_the_mean():
    # half of the tokens to two of 16 experts, over 4 ranks: without EPLB the rank holding both
    # carries 2.3× the mean; 4 redundant slots bring it within 1.15×
    loads = [0.25, 0.25] + [0.5 / 14] * 14
    plain = rank_loads(loads, contiguous(16, 4))
    assert max(plain) / (sum(plain) / 4) == pytest.approx(2.2857, rel=1e-3)
    pl = place_experts(loads, slots=20, ranks=4)
    balanced = rank_loads(loads, pl)
    assert sum(balanced) == pytest.approx(1.0)
    assert max(balanced) / (sum(balanced) / 4) <= 1.15
    assert pl.replicas[0] == pl.replicas[1] == 3
    # without spare slots the packing alone can only separate the two hot experts
    packed = rank_loads(loads, place_experts(loads, slots=16, ranks=4))
    assert max(packed) / 0.25 < max(plain) / 0.25


def test_uniform_loads_stay_uniform():
    pl = place_experts([1.0] * 8, slots=8, ranks=4)
    assert rank_loads([1.0] * 8, pl) == [2.0] * 4


@pytest.mark.parametrize("args, match", [
    (dict(slots=10, ranks=4), "multiple of the ranks"),
    (dict(slots=4, ranks=4), "at least the 8 experts"),
    (dict(slots=12, ranks=4, nodes=3), "split evenly over 3 nodes"),
])
def test_bad_shapes_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        place_experts([1.0] * 8, **args)


def test_the_planner_takes_the_busiest_rank_from_measured_loads(tmp_path):
    """``moetrain.plan --expert-loads``: the busiest ep rank's share at each ep from a run's
    metrics (contiguous placement), what ``--redundant-experts`` spare slots make of it, and the
    busiest rank of each step where the loads move between ranks from step to step."""
    import dataclasses
    import json

    from moetrain.config import load_config
    from moetrain.plan import read_expert_load_steps, read_expert_loads
    from moetrain.planner.layout import Layout
    from moetrain.planner.search import Planner
    from moetrain.topology import load_profile

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "expert_load": {"0": {"tokens": [30, 20, 10, 10, 10, 10, 5, 5]},
                                        "1": {"tokens": [10] * 8}}} for s in (1, 2)]
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    loads = read_expert_loads(metrics)
    assert loads == [[30.0, 20, 10, 10, 10, 10, 5, 5], [10.0] * 8]
    (tmp_path / "one.json").write_text("[1, 2, 3, 4, 5, 6, 7, 8]")
    assert read_expert_loads(tmp_path / "one.json") == [[1.0, 2, 3, 4, 5, 6, 7, 8]]

    cfg = load_config("configs/mixtral-8x7b.yaml")
    planner = Planner.from_config(cfg, load_profile("h100-superpod"), 16)
    planner.expert_loads = loads
    # one expert per rank at ep 8: layer 0's busiest rank has 30 of a mean 12.5, layer 1 is even
    assert planner.measured_imbalance(8) == pytest.approx((30 / 12.5 + 1.0) / 2)
    assert planner.measured_imbalance(2) == pytest.approx((70 / 50 + 1.0) / 2)
    lay = Layout(tp=2, pp=1, dp=64, ep=8, zero=1, mbs=1, ac="selective")
    skewed = planner.evaluate(lay).step_s
    planner.redundant_experts = 8
    assert planner.measured_imbalance(8) < 1.2
    balanced = planner.evaluate(lay).step_s
    planner.expert_loads = None
    assumed = planner.evaluate(dataclasses.replace(lay)).step_s
    assert balanced < skewed and abs(balanced - assumed) < 0.2 * assumed

    # Loads that move between ranks from step to step: even on the mean, but each step waits for
    # that step's busiest rank (all of layer 0's tokens on one of 2 ranks: 2.0)
    rows = [{"step": s, "expert_load": {"0": {"tokens": [20, 20, 0, 0] if s % 2 else [0, 0, 20, 20]}}}
            for s in (1, 2, 3, 4)]
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    planner.redundant_experts = 0
    planner.expert_loads = read_expert_loads(metrics)
    assert planner.expert_loads == [[10.0] * 4]
    assert planner.measured_imbalance(2) == pytest.approx(1.0)
    planner.expert_load_steps = read_expert_load_steps(metrics)
    assert len(planner.expert_load_steps) == 4
    assert planner.measured_imbalance(2) == pytest.approx(2.0)
    assert planner.measured_imbalance(4) == pytest.approx(2.0)  # one expert per rank: 20 of a mean 10


def test_the_planner_counts_eplbs_spare_slots(tmp_path):
    """With ``moe.eplb`` each ep rank holds (E + redundant) / ep experts: the planner's memory
    counts them, and ``plan --expert-loads`` places the config's spare slots by default."""
    from moetrain.config import load_config
    from moetrain.plan import main
    from moetrain.planner.layout import Layout
    from moetrain.planner.search import Planner
    from moetrain.topology import load_profile

    lay = Layout(tp=2, pp=1, dp=64, ep=8, zero=1, mbs=1, ac="selective")
    prof = load_profile("h100-superpod")
    plain = Planner.from_config(load_config("configs/mixtral-8x7b.yaml"), prof, 16).evaluate(lay).memory
    cfg = load_config("configs/mixtral-8x7b.yaml", ["moe.eplb.every=100", "moe.eplb.redundant_experts=8"])
    eplb = Planner.from_config(cfg, prof, 16).evaluate(lay).memory
    # 16 slots for 8 experts at ep 8: twice the expert weights, gradients and optimizer states
    assert eplb.total > plain.total
    assert eplb.detail["expert_params"] == pytest.approx(2 * plain.detail["expert_params"])
    loads = tmp_path / "loads.json"
    loads.write_text("[40, 20, 10, 10, 5, 5, 5, 5]")
    args = ["--config", "configs/mixtral-8x7b.yaml", "--profile", "h100-superpod", "--nodes", "16", "--format", "json",
            "--layout", "tp=2,pp=1,dp=64,ep=8,zero=1,mbs=1,ac=selective", "--expert-loads", str(loads)]
    assert main(args) == 0
    assert main(args + ["--set", "moe.eplb.every=100", "--set", "moe.eplb.redundant_experts=8"]) == 0


def test_the_planner_times_the_replicas_gradient_sum_and_the_moves():
    """A step with EPLB adds the replicated experts' gradient all-reduce over ep (at most
    ``redundant_experts`` experts' rows, fp32, each rank's ZeRO shard of them) and the
    re-placements' moves, amortised over ``every`` steps; the spare slots' share of the
    data-parallel traffic and the optimizer grows with (E + r) / E."""
    import dataclasses

    from moetrain.config import load_config
    from moetrain.planner.layout import Layout
    from moetrain.planner.search import Planner
    from moetrain.planner.timing import step_time
    from moetrain.planner.traffic import comm_time
    from moetrain.topology import load_profile

    lay = Layout(tp=2, pp=1, dp=64, ep=8, zero=1, mbs=1, ac="selective")
    prof = load_profile("h100-superpod")

    def planner(*sets):
        return Planner.from_config(load_config("configs/mixtral-8x7b.yaml", list(sets)), prof, 16)

    plain = planner().evaluate(lay).time
    rare = planner("moe.eplb.every=100", "moe.eplb.redundant_experts=8")
    often = planner("moe.eplb.every=10", "moe.eplb.redundant_experts=8").evaluate(lay).time
    places, _ = rare.places(lay)
    no_moves = step_time(dataclasses.replace(rare.shape, eplb_every=0), lay, rare.global_batch, prof, places,
                         rare.mem, rare.timing)
    # 8 replicated experts of 3 × 4096 × 14336 per layer, 32 layers, one rank's ZeRO shard of them
    rows = 32 * 8 * 3 * 4096 * 14336 / lay.expert_shard
    assert no_moves.breakdown["eplb"] == pytest.approx(comm_time("all_reduce", rows * 4.0, places["ep"], prof)[0])
    moves_100 = rare.evaluate(lay).time.breakdown["eplb"] - no_moves.breakdown["eplb"]
    moves_10 = often.breakdown["eplb"] - no_moves.breakdown["eplb"]
    assert moves_100 > 0 and moves_10 == pytest.approx(10 * moves_100)
    assert plain.breakdown["eplb"] == 0.0
    assert no_moves.breakdown["optimizer"] > plain.breakdown["optimizer"]
    assert sum(often.breakdown.values()) == pytest.approx(often.step)
