"""HSDP (``parallel.dp_shard``): FSDP2 on a (replicate, shard) mesh trains as one process does —
losses and gradient norms within 1e-5 relative at each of 20 steps, parameters after them within
1e-4 of their largest value (fp32; the gradients are reduced in another order: a reduce-scatter
inside each shard group, then an all-reduce of the shards across the groups) — in every ZeRO
stage, with expert and with tensor parallelism; and a config error names what cannot compose."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import DTensor

from moetrain.config import ConfigError
from moetrain.parallel.state import hsdp_sizes
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed

STEPS = 20


def hsdp_run(rank: int, world: int, data: str, run_dir: str, parallel: dict) -> dict:
    cfg = tiny_config(data, run_dir, parallel=parallel, model={"vocab_size": 260},  # a multiple of tp
                      train={"steps": STEPS, "grad_clip": 1.0})
    trainer = Trainer(cfg, write_files=False)
    results = [trainer.train_step() for _ in range(STEPS)]
    parts = trainer.model_parts
    meshes = {n: (p.device_mesh.mesh_dim_names, tuple(p.device_mesh.shape), tuple(type(pl).__name__ for pl in p.placements))
              for part in parts for n, p in part.named_parameters()
              if isinstance(p, DTensor) and n in ("layers.0.attention.wq.weight", "layers.0.moe.experts.w1")}
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for part in parts for n, p in part.named_parameters()}
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results], "params": params,
            "meshes": meshes}


@pytest.fixture(scope="module")
def one_process(tiny_shards, tmp_path_factory):
    return run_distributed(hsdp_run, 1, str(tiny_shards), str(tmp_path_factory.mktemp("hsdp1")), {})[0]


CASES = {
    # two shard groups of two ranks; each expert (ep = 2, edp = 2) on one rank of a group:
    # replicated over edp (a shard group of dp_shard / ep = 1)
    "dp4-ep2-zero1": {"dp": 4, "ep": 2, "zero_stage": 1, "dp_shard": 2},
    "dp4-ep2-zero2": {"dp": 4, "ep": 2, "zero_stage": 2, "dp_shard": 2},
    "dp4-ep2-zero3": {"dp": 4, "ep": 2, "zero_stage": 3, "dp_shard": 2},
    # (replicate 2, shard 1) beside tp's DTensors: FSDP2 composes the 2-D dp mesh with tp
    "dp2-tp2-zero3": {"dp": 2, "tp": 2, "zero_stage": 3, "dp_shard": 1},
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_hsdp_trains_as_one_process(name, one_process, tiny_shards, tmp_path):
    parallel = CASES[name]
    outs = run_distributed(hsdp_run, parallel["dp"] * parallel.get("tp", 1), str(tiny_shards), str(tmp_path),
                           parallel)
    for step, (a, b) in enumerate(zip(outs[0]["losses"], one_process["losses"]), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs one process {b}"
    for step, (a, b) in enumerate(zip(outs[0]["norms"], one_process["norms"]), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: grad norm {a} vs one process {b}"
    for name_, ref in one_process["params"].items():
        diff = (outs[0]["params"][name_] - ref).abs().max().item()
        assert diff <= 1e-4 * ref.abs().max().item() + 1e-6, f"{name_}: max diff {diff}"
    # the dense weights live on the (replicate, shard) mesh
    names, shape, placements = outs[0]["meshes"]["layers.0.attention.wq.weight"]
    replicate, shard = hsdp_sizes(tiny_config("x", "y", parallel=parallel, model={"vocab_size": 260}).parallel)["dp_cp"]
    assert names[:2] == ("dp_cp_replicate", "dp_cp_shard") and shape[:2] == (replicate, shard)
    assert placements[0] == "Replicate" and "Shard" in placements[1]


def test_expert_shard_groups_follow_the_dense_ones():
    def sizes(**parallel):
        return hsdp_sizes(tiny_config("x", "y", parallel={"zero_stage": 3, **parallel}, model={"vocab_size": 260},
                                      moe={"num_experts": 16}, train={"global_batch_size": 64}).parallel)

    # 16 ranks, ep 2, shard groups of 8: each holds 4 replicas of every expert (edp 8 → 2 × 4)
    assert sizes(dp=16, ep=2, dp_shard=8) == {"dp_cp": (2, 8), "dp_cp_tp": (2, 8), "edp": (2, 4),
                                              "edp_tp": (2, 4)}
    # a shard group smaller than an ep group holds one replica of each expert: replicated over edp
    assert sizes(dp=8, ep=4, dp_shard=2)["edp"] == (2, 1)
    # with tp, the tp ranks sit inside the shard groups of the groups that span them
    assert sizes(dp=4, tp=2, dp_shard=2)["dp_cp_tp"] == (2, 4)
    assert sizes(dp=4, dp_shard=4) == {}  # the whole group: plain FSDP


@pytest.mark.parametrize("parallel, match", [
    ({"dp": 4, "dp_shard": 3, "zero_stage": 3}, "must divide dp × cp"),
    ({"dp": 4, "dp_shard": 2, "zero_stage": 0}, "zero_stage 0 replicates"),
])
def test_hsdp_settings_that_cannot_work_are_refused(parallel, match):
    with pytest.raises(ConfigError, match=match) as e:
        tiny_config("x", "y", parallel=parallel)
    assert "parallel.dp_shard" in str(e.value)


def hsdp_resume_run(rank: int, world: int, data: str, run_dir: str, parallel: dict, until: int) -> list[float]:
    cfg = tiny_config(data, run_dir, parallel=parallel, model={"vocab_size": 260},
                      train={"steps": STEPS, "grad_clip": 1.0}, checkpoint={"every": 10, "resume": True})
    trainer = Trainer(cfg, write_files=False)
    losses = [trainer.train_step().loss for _ in range(until - trainer.step)]
    trainer.save_checkpoint()
    return losses


@pytest.mark.slow
def test_an_hsdp_checkpoint_resumes_in_another_layout(one_process, tiny_shards, tmp_path):
    """10 steps under HSDP (ZeRO-3), checkpointed; steps 11-20 in one process follow the
    uninterrupted run (parameters and AdamW's states were saved from the 2-D placements)."""
    run_dir = str(tmp_path / "run")
    run_distributed(hsdp_resume_run, 4, str(tiny_shards), run_dir, CASES["dp4-ep2-zero3"], 10)
    resumed = run_distributed(hsdp_resume_run, 1, str(tiny_shards), run_dir, {}, 20)[0]
    assert len(resumed) == 10
    for step, (a, b) in enumerate(zip(resumed, one_process["losses"][10:]), start=11):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs uninterrupted {b}"
