"""``train.optimizer: muon`` (moetrain/train/optim.py): Newton–Schulz, the Muon update against a
reference written here, the Moonlight / Kimi K2 parameter split, the skip flag of
``train.anomaly``, and the same training in one process and in sharded layouts (every matrix is
orthogonalized whole)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from moetrain.train.optim import Muon, build_optimizer, newton_schulz, uses_muon
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed

STEPS = 20


def reference_ns(g: torch.Tensor) -> torch.Tensor:
    """Newton–Schulz written out for one matrix (Jordan et al. 2024), in float64."""
    x = g.double()
    if x.shape[0] > x.shape[1]:
        return reference_ns(g.T).T
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.to(g.dtype)


@pytest.mark.parametrize("shape", [(16, 24), (24, 16), (3, 8, 12)])
def test_newton_schulz_orthogonalizes_each_matrix(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    x = newton_schulz(g)
    mats = x.reshape(-1, *shape[-2:])
    for i, m in enumerate(mats):
        ref = reference_ns(g.reshape(-1, *shape[-2:])[i])
        torch.testing.assert_close(m, ref, rtol=1e-4, atol=1e-5)
        s = torch.linalg.svdvals(m)
        assert 0.6 < s.min() and s.max() < 1.3  # the quintic's fixed band around 1
        # and it is the polar factor's direction: close to U·Vᵀ of the SVD
        u, _, vh = torch.linalg.svd(g.reshape(-1, *shape[-2:])[i], full_matrices=False)
        assert torch.nn.functional.cosine_similarity(m.flatten(), (u @ vh).flatten(), dim=0) > 0.95


def test_a_muon_step_is_the_scaled_orthogonalized_nesterov_momentum():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 12))
    opt = Muon([{"params": [w], "weight_decay": 0.1, "muon": True}], lr=0.02, betas=(0.9, 0.95), eps=1e-8)
    w0, m = w.detach().clone(), torch.zeros(8, 12)
    for _ in range(3):
        g = torch.randn(8, 12)
        w.grad = g.clone()
        opt.step()
        m = 0.95 * m + g
        w0 = w0 * (1 - 0.02 * 0.1) - 0.02 * 0.2 * math.sqrt(12) * reference_ns(g + 0.95 * m)
        torch.testing.assert_close(w.detach(), w0, rtol=1e-5, atol=1e-6)
    # the update's RMS is AdamW's order: 0.2 · √max(m, n) · RMS(NS) ≈ 0.2
    rms = (0.2 * math.sqrt(12) * reference_ns(torch.randn(8, 12))).pow(2).mean().sqrt()
    assert 0.1 < rms < 0.3


def test_a_skipped_step_changes_nothing():
    w = torch.nn.Parameter(torch.randn(6, 6))
    e = torch.nn.Parameter(torch.randn(6))
    opt = Muon([{"params": [w], "weight_decay": 0.1, "muon": True},
                {"params": [e], "weight_decay": 0.0, "muon": False}], lr=0.02, betas=(0.9, 0.95), eps=1e-8)
    w.grad, e.grad = torch.randn(6, 6), torch.randn(6)
    opt.step()
    before = (w.detach().clone(), e.detach().clone(), opt.state[w]["momentum_buffer"].clone(),
              opt.state[e]["exp_avg"].clone())
    w.grad, e.grad = torch.full((6, 6), math.nan), torch.full((6,), math.nan)
    opt.found_inf = torch.ones(())
    opt.step()
    after = (w.detach(), e.detach(), opt.state[w]["momentum_buffer"], opt.state[e]["exp_avg"])
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_the_split_gives_muon_the_hidden_matrices_and_adamw_the_rest(tiny_shards, tmp_path):
    from moetrain.model.transformer import Transformer

    cfg = tiny_config(tiny_shards, tmp_path, train={"optimizer": "muon"}, model={"vocab_size": 257})
    model = Transformer.from_config(cfg)
    muon = {n for n, p in model.named_parameters() if uses_muon(n, p, cfg.train.muon_adamw)}
    assert "layers.0.attention.wq.weight" in muon and "layers.0.moe.experts.w1" in muon
    assert "layers.1.moe.shared.w2.weight" in muon
    for name in ("tok_embeddings.weight", "output.weight", "layers.0.moe.router.weight", "norm.weight",
                 "layers.0.attention_norm.weight"):
        assert name not in muon
    opt = build_optimizer(model, cfg.train)
    assert isinstance(opt, Muon)
    assert {id(p) for g in opt.param_groups if g["muon"] for p in g["params"]} == {
        id(p) for n, p in model.named_parameters() if n in muon}


def muon_run(rank: int, world: int, data: str, run_dir: str, parallel: dict) -> dict:
    cfg = tiny_config(data, run_dir, parallel=parallel, model={"vocab_size": 260},  # a multiple of tp
                      train={"steps": STEPS, "optimizer": "muon", "grad_clip": 1.0})
    trainer = Trainer(cfg, write_files=False)
    losses = [trainer.train_step().loss for _ in range(STEPS)]
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for part in trainer.model_parts for n, p in part.named_parameters()}
    return {"losses": losses, "params": params, "work": trainer.optimizers[0].whole.traffic(4)["work"]}


@pytest.fixture(scope="module")
def one_process(tiny_shards, tmp_path_factory):
    return run_distributed(muon_run, 1, str(tiny_shards), str(tmp_path_factory.mktemp("muon1")), {})[0]


@pytest.mark.parametrize("parallel", [
    {"dp": 2, "ep": 2, "zero_stage": 1}, {"dp": 2, "ep": 2, "zero_stage": 3},
    {"tp": 2, "sequence_parallel": True}, {"pp": 2}, {"tp": 2, "etp": 2}, {"dp": 2, "zero_stage": 0},
    {"dp": 2, "tp": 2, "zero_stage": 3}, {"dp": 4, "ep": 2, "zero_stage": 3, "dp_shard": 2}],
    ids=["dp2-ep2-zero1", "dp2-ep2-zero3", "tp2-sp", "pp2", "tp2-etp2", "dp2-zero0", "dp2-tp2-zero3", "hsdp"])
@pytest.mark.slow(fast=["dp2-zero0"])
def test_muon_trains_the_same_in_sharded_layouts(parallel, one_process, tiny_shards, tmp_path):
    """20 steps: losses within 1e-5 relative at every step and the parameters after them within
    1e-4 of their largest value (fp32; the layouts reduce gradients in other orders, and each
    matrix is gathered whole before Newton–Schulz)."""
    world = parallel.get("dp", 1) * parallel.get("tp", 1) * parallel.get("pp", 1)
    outs = run_distributed(muon_run, world, str(tiny_shards), str(tmp_path / "run"), parallel)
    for step, (a, b) in enumerate(zip(outs[0]["losses"], one_process["losses"]), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs one process {b}"
    params = {**outs[-1]["params"], **outs[0]["params"]}  # under pp each rank holds its stage's
    for name, ref in one_process["params"].items():
        diff = (params[name] - ref).abs().max().item()
        assert diff <= 1e-4 * ref.abs().max().item() + 1e-6, f"{name}: max diff {diff}"
    assert one_process["losses"][-1] < one_process["losses"][0] - 0.5  # it trains
    if "pp" not in parallel and "etp" not in parallel:  # (etp: each tp rank holds its own shared experts)
        # each matrix orthogonalized once in the stage, the work spread over its ranks
        work = outs[0]["work"]
        assert sum(work) == sum(one_process["work"]) and max(work) < sum(work)


def muon_resume_run(rank: int, world: int, data: str, run_dir: str, parallel: dict, until: int) -> list[float]:
    cfg = tiny_config(data, run_dir, parallel=parallel, model={"vocab_size": 260},
                      train={"steps": STEPS, "optimizer": "muon", "grad_clip": 1.0},
                      checkpoint={"every": 10, "resume": True})
    trainer = Trainer(cfg, write_files=False)
    losses = [trainer.train_step().loss for _ in range(until - trainer.step)]
    trainer.save_checkpoint()
    return losses


def test_muon_state_is_saved_and_resumed_across_layouts(one_process, tiny_shards, tmp_path):
    """10 steps in dp2 × ep2 (ZeRO-3), checkpointed; resumed in one process for steps 11-20: the
    losses follow the uninterrupted one-process run (momentum buffers included: a run that lost
    them would diverge at step 11)."""
    run_dir = str(tmp_path / "run")
    run_distributed(muon_resume_run, 2, str(tiny_shards), run_dir, {"dp": 2, "ep": 2, "zero_stage": 3}, 10)
    resumed = run_distributed(muon_resume_run, 1, str(tiny_shards), run_dir, {}, 20)[0]
    assert len(resumed) == 10
    for step, (a, b) in enumerate(zip(resumed, one_process["losses"][10:]), start=11):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs uninterrupted {b}"
