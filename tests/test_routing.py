"""Routing at the frontier (moetrain.model.moe.MoE.route): sigmoid scores, routed scaling,
aux-loss-free balancing and node-limited routing, proved against a per-token reference; the
balancing bias is the same in every layout and across a resume; node-limited routing keeps each
token's experts on at most M NVLink domains of its ep group (taken from the rank map).
"""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.model.moe import ExpertGroups, MoE
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed
from test_equivalence import assert_matches, merged, steps_with_first_grads


def reference_route(logits, score_function, bias, groups, max_groups, top_k, norm, scale):
    """One token at a time, written from DeepSeek-V3 §2.1.2 / §2.2 as directly as possible."""
    T, E = logits.shape
    weights, chosen = torch.zeros(T, top_k), torch.zeros(T, top_k, dtype=torch.long)
    for t in range(T):
        if score_function == "softmax":
            s = [math.exp(x) for x in logits[t].tolist()]
            s = [x / sum(s) for x in s]
        else:
            s = [1 / (1 + math.exp(-x)) for x in logits[t].tolist()]
        choice = [s[e] + (bias[e] if bias is not None else 0.0) for e in range(E)]
        allowed = set(range(E))
        if max_groups is not None:
            ids = sorted(set(groups))
            k = min(E // len(ids), -(-top_k // max_groups))
            gscore = {g: sum(sorted((choice[e] for e in range(E) if groups[e] == g), reverse=True)[:k]) for g in ids}
            best = sorted(ids, key=lambda g: -gscore[g])[:max_groups]
            allowed = {e for e in range(E) if groups[e] in best}
        top = sorted(allowed, key=lambda e: -choice[e])[:top_k]
        w = [s[e] for e in top]
        if norm:
            w = [x / sum(w) for x in w]
        weights[t] = torch.tensor([x * scale for x in w])
        chosen[t] = torch.tensor(top)
    return weights, chosen


CASES = [
    ("softmax", False, None, None, True, 1.0),
    ("sigmoid", False, None, None, True, 2.5),
    ("sigmoid", True, None, None, False, 1.0),
    ("softmax", True, [0, 0, 1, 1, 2, 2, 3, 3], 2, True, 1.0),
    ("sigmoid", True, [0, 1, 0, 1, 2, 3, 2, 3], 1, True, 2.5),  # domains interleaved over experts
]


@pytest.mark.parametrize("score_function, with_bias, groups, max_groups, norm, scale", CASES,
                         ids=["softmax", "sigmoid-scaled", "sigmoid-bias-unnormed", "grouped-2-of-4",
                              "interleaved-1-of-4"])
def test_route_equals_reference(score_function, with_bias, groups, max_groups, norm, scale):
    torch.manual_seed(0)
    moe = MoE(dim=8, hidden=16, num_experts=8, top_k=2, norm_topk_prob=norm, score_function=score_function,
              routed_scaling_factor=scale, bias_update_rate=0.001 if with_bias else 0.0)
    bias = None
    if with_bias:
        moe.expert_bias.copy_(torch.randn(8) * 0.3)
        bias = moe.expert_bias.tolist()
    if groups is not None:
        moe.parallel.expert_groups, moe.parallel.max_groups = ExpertGroups.from_list(groups, torch.device("cpu")), max_groups
    logits = torch.randn(64, 8) * 2
    _, weights, chosen = moe.route(logits)
    ref_w, ref_idx = reference_route(logits, score_function, bias, groups, max_groups, 2, norm, scale)
    assert torch.equal(chosen, ref_idx)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
    if groups is not None:  # every token's experts within max_groups domains
        g = torch.tensor(groups)[chosen]
        assert all(len(set(row)) <= max_groups for row in g.tolist())


def test_bias_moves_towards_the_mean_load():
    moe = MoE(dim=8, hidden=16, num_experts=4, top_k=1, bias_update_rate=0.01)
    moe.update_expert_bias(torch.tensor([10.0, 2.0, 4.0, 4.0]))  # mean 5
    assert moe.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    moe.update_expert_bias(torch.tensor([5.0, 5.0, 5.0, 5.0]))  # balanced: no change
    assert moe.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])


BALANCE = {"bias_update_rate": 0.01, "score_function": "sigmoid", "routed_scaling_factor": 2.0}


def bias_capture(rank: int, world: int, data: str, run_dir: str, parallel: dict, steps: int, save: bool) -> dict:
    cfg = tiny_config(data, run_dir, parallel=parallel, moe=BALANCE, checkpoint={"resume": True, "every": 0})
    trainer = Trainer(cfg, write_files=False)
    start = trainer.step
    losses = [trainer.train_step().loss for _ in range(steps)]
    if save:
        trainer.save_checkpoint()
    return {"start": start, "losses": losses,
            "bias": {n: m.expert_bias.clone() for n, m in trainer.moe_layers.items()}}


@pytest.fixture(scope="module")
def bias_reference(tiny_shards, tmp_path_factory):
    return run_distributed(bias_capture, 1, str(tiny_shards), str(tmp_path_factory.mktemp("bias")), {}, 6, False)[0]


@pytest.mark.slow
def test_bias_trajectory_is_layout_independent(bias_reference, tiny_shards, tmp_path):
    assert all(b.abs().sum() > 0 for b in bias_reference["bias"].values())
    for parallel, world in (({"dp": 2, "ep": 2}, 2), ({"dp": 4, "ep": 4}, 4), ({"cp": 2}, 2)):
        results = run_distributed(bias_capture, world, str(tiny_shards), str(tmp_path / str(world)), parallel, 6, False)
        for r in results:  # every rank holds the same bias as one process
            for name, b in r["bias"].items():
                torch.testing.assert_close(b, bias_reference["bias"][name], rtol=0, atol=1e-7)
        for a, b in zip(results[0]["losses"], bias_reference["losses"]):
            assert abs(a - b) <= 1e-5 * b


def test_bias_survives_a_resume(bias_reference, tiny_shards, tmp_path):
    first = run_distributed(bias_capture, 2, str(tiny_shards), str(tmp_path), {"dp": 2, "ep": 2}, 3, True)[0]
    second = run_distributed(bias_capture, 1, str(tiny_shards), str(tmp_path), {}, 3, False)[0]
    assert second["start"] == 3
    for name, b in second["bias"].items():
        torch.testing.assert_close(b, bias_reference["bias"][name], rtol=0, atol=1e-7)
    for a, b in zip(first["losses"] + second["losses"], bias_reference["losses"]):
        assert abs(a - b) <= 1e-5 * b


# -- node-limited routing in training: domains from the rank map -------------------------------

DOMAINS = [0, 0, 1, 1]  # dp4 × ep4 on two "nodes" of two ranks: experts {0,1} and {2,3}
LIMITED = {"max_nodes_per_token": 1, "num_experts": 4, "top_k": 2}


def limited_capture(rank: int, world: int, data: str, run_dir: str, parallel: dict, moe: dict, inject: bool) -> dict:
    cfg = tiny_config(data, run_dir, parallel=parallel, moe=moe)
    kwargs = {"mesh_ranks": torch.arange(world).reshape(1, world, 1, 1).tolist(), "rank_domains": DOMAINS
              } if world == 4 else {}
    trainer = Trainer(cfg, write_files=False, **kwargs)
    if inject:  # one process: the grouping the 4-rank layout gets from its domains
        for m in trainer.moe_layers.values():
            m.parallel.expert_groups, m.parallel.max_groups = ExpertGroups.from_list([0, 0, 1, 1], trainer.device), 1
    results, grads = steps_with_first_grads(trainer, 4)
    return {"losses": [r.loss for r in results], "grads": grads,
            "bytes": [r.extra.get("dispatch_bytes") for r in results]}


def test_node_limited_routing_matches_its_reference(tiny_shards, tmp_path):
    ref = run_distributed(limited_capture, 1, str(tiny_shards), str(tmp_path / "ref"), {}, LIMITED, True)[0]
    res = run_distributed(limited_capture, 4, str(tiny_shards), str(tmp_path / "ep4"), {"dp": 4, "ep": 4}, LIMITED,
                          False)
    assert_matches(merged(res), ref)
    assert res[0]["bytes"][0]["inter_node"] > 0 and res[0]["bytes"][0]["intra_node"] > 0


def test_node_limit_that_leaves_too_few_experts_is_refused_before_launch():
    from moetrain.config import ConfigError, load_config
    from moetrain.launch.preflight import check_node_limited

    # tp = 8 fills each node: the ep group spans 256 nodes with one expert each (and the node
    # limit replaces the fixed expert groups: moetrain refuses both at once).
    one_per_node = ["parallel.tp=8", "parallel.dp=256", "parallel.ep=256", "moe.n_group=null", "moe.topk_group=null"]
    cfg = load_config("configs/deepseek-v3-like.yaml", one_per_node + ["moe.max_nodes_per_token=4"])
    with pytest.raises(ConfigError, match="moe.max_nodes_per_token = 4.*fewer than top_k = 8"):
        check_node_limited(cfg)
    check_node_limited(load_config("configs/deepseek-v3-like.yaml", one_per_node + ["moe.max_nodes_per_token=8"]))


# -- the hierarchical dispatcher: once per token and node over the network ---------------------

HIERARCHICAL = {"token_dispatcher": "hierarchical"}


@pytest.mark.slow
def test_hierarchical_dispatch_equals_one_process_and_crosses_once_per_node(tiny_shards, tmp_path):
    ref = run_distributed(limited_capture, 1, str(tiny_shards), str(tmp_path / "ref"), {}, LIMITED, True)[0]
    flat = run_distributed(limited_capture, 4, str(tiny_shards), str(tmp_path / "flat"), {"dp": 4, "ep": 4},
                           LIMITED, False)
    hier = run_distributed(limited_capture, 4, str(tiny_shards), str(tmp_path / "hier"), {"dp": 4, "ep": 4},
                           {**LIMITED, **HIERARCHICAL}, False)
    assert_matches(merged(hier), ref)
    # M = 1: both of a token's experts lie in one domain, so the flat all-to-all sends two rows
    # where the hierarchical one sends one (the same routing at step 1: same weights and data).
    f, h = flat[0]["bytes"][0], hier[0]["bytes"][0]
    assert f["inter_node"] > 0 and 2 * h["inter_node"] == f["inter_node"], (f, h)


def test_hierarchical_dispatch_without_limit_and_with_capacity_equals_the_flat_one(tiny_shards, tmp_path):
    # No node limit: a token may need both domains (one row to each). A capacity factor below 1
    # drops at the source exactly as the flat dispatcher does.
    moe = {"num_experts": 4, "top_k": 2, "capacity_factor": 0.75}
    flat = run_distributed(limited_capture, 4, str(tiny_shards), str(tmp_path / "flat"), {"dp": 4, "ep": 4},
                           moe, False)
    hier = run_distributed(limited_capture, 4, str(tiny_shards), str(tmp_path / "hier"), {"dp": 4, "ep": 4},
                           {**moe, **HIERARCHICAL}, False)
    assert_matches(merged(hier), merged(flat))
    f, h = flat[0]["bytes"][0], hier[0]["bytes"][0]
    assert 0 < h["inter_node"] < f["inter_node"], (f, h)


def pipelined_capture(rank: int, world: int, data: str, run_dir: str, moe: dict) -> list[float]:
    cfg = tiny_config(data, run_dir, parallel={"pp": 2, "dp": 2, "ep": 2}, moe=moe, model={"layers": 2},
                      train={"steps": 3, "micro_batch_size": 1})
    results, _ = steps_with_first_grads(Trainer(cfg, write_files=False), 3)
    return [r.loss for r in results]


def test_hierarchical_dispatch_with_a_pipeline_stage_without_moe_layers(tiny_shards, tmp_path):
    """Stage 0 holds only the dense first layer: its ranks never build an MoE layer, yet must
    join the creation of the dispatcher's process groups (collective over all ranks; it hung
    before). Same losses as the flat dispatcher."""
    moe = {"first_dense": 1}
    flat = run_distributed(pipelined_capture, 4, str(tiny_shards), str(tmp_path / "flat"), moe, timeout=120)
    hier = run_distributed(pipelined_capture, 4, str(tiny_shards), str(tmp_path / "hier"), {**moe, **HIERARCHICAL},
                           timeout=120)
    for h, f in zip(hier, flat):  # the sums differ from the flat dispatcher's only in order
        assert h == pytest.approx(f, rel=1e-5)


def test_hierarchical_dispatch_over_uneven_domains_is_refused_before_launch():
    from moetrain.config import ConfigError, load_config
    from moetrain.launch.preflight import check_node_limited

    sets = ["launch.cluster=slurm", "launch.nodes=4", "parallel.dp=12", "train.global_batch_size=48",
            "moe.token_dispatcher=hierarchical", "parallel.ep=4"]
    # 3 ranks per node: the ep group {3, 4, 5, 6} has 1 rank on one node and 3 on the next.
    with pytest.raises(ConfigError, match="moe.token_dispatcher = 'hierarchical'.*unevenly"):
        check_node_limited(load_config("configs/demo-moe.yaml", sets + ["launch.gpus_per_node=3"]))
    check_node_limited(load_config("configs/demo-moe.yaml", sets + ["launch.gpus_per_node=6", "launch.nodes=2"]))
