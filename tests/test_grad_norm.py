"""The gradient norm moetrain logs and clips with is the norm of the whole model's gradient, each
element counted once, in every layout — experts included, under ep × tp, etp and ZeRO-3.

Two independent references at every step: one process's norm, and the float64 norm of the
parallel run's own gradients gathered whole (``full_tensor`` of every DTensor). Tolerance 1e-6
relative: both are float64 sums of the same fp32 gradients, which differ only by the order of
the gradient reduction. The model's vocabulary (4096 × 64 embedding and head) is large enough for
the fp32 norm that moetrain 0.1 took (sequential accumulation on CPU) to be off by more than that.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moetrain.parallel.data_parallel import global_grad_norm
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed
from test_equivalence import full_grads

STEPS = 6
MODEL = {"vocab_size": 4096, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128}
MOE = {"ffn_hidden": 64}


def test_norm_of_a_large_tensor_is_exact():
    """CPU's fp32 norm kernels add the squares one after another: 4e-4 relative low on this
    tensor, which made the clip factor depend on how tensors were split over ranks."""
    linear = nn.Linear(256, 8192, bias=False)
    linear.weight.grad = torch.full_like(linear.weight, 1e-3)
    ps = SimpleNamespace(device=torch.device("cpu"), size=lambda axis: 1)
    exact = linear.weight.grad.double().norm().item()
    assert abs(global_grad_norm([linear], ps).item() - exact) <= 1e-6 * exact


def norms(rank: int, world: int, data: str, run_dir: str, parallel: dict) -> dict:
    # No clipping, so that the gradients the optimizer sees are the ones the norm was taken of.
    cfg = tiny_config(data, run_dir, parallel=parallel, model=MODEL, moe=MOE, train={"grad_clip": 0.0})
    trainer = Trainer(cfg, write_files=False)
    gathered: list[float] = []

    def hook(opt, args, kwargs):
        grads = full_grads(trainer)
        gathered.append(sum(g.double().pow(2).sum().item() for g in grads.values()) ** 0.5)

    trainer.optimizers[0].register_step_pre_hook(hook)
    logged = [trainer.train_step().grad_norm for _ in range(STEPS)]
    return {"logged": logged, "gathered": gathered}


@pytest.fixture(scope="module")
def reference(tiny_shards, tmp_path_factory):
    return run_distributed(norms, 1, str(tiny_shards), str(tmp_path_factory.mktemp("ref")), {})[0]


CASES = [
    {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True},
    {"dp": 2, "tp": 2, "ep": 2, "etp": 2, "zero_stage": 3},
    {"dp": 2, "tp": 2, "ep": 2, "etp": 2, "sequence_parallel": True, "zero_stage": 2},
    {"dp": 4, "ep": 2, "zero_stage": 3},
]


@pytest.mark.parametrize("parallel", CASES, ids=["-".join(f"{k}{v}" for k, v in p.items()) for p in CASES])
@pytest.mark.slow
def test_norm_equals_one_process_and_the_gathered_gradient(parallel, reference, tiny_shards, tmp_path):
    world = parallel["dp"] * parallel.get("tp", 1)
    results = run_distributed(norms, world, str(tiny_shards), str(tmp_path), parallel)
    assert len({tuple(r["logged"]) for r in results}) == 1, "ranks disagree on the gradient norm"
    for step, (got, ref) in enumerate(zip(results[0]["logged"], reference["logged"]), 1):
        assert abs(got - ref) <= 1e-6 * ref, f"step {step}: norm {got} vs one process {ref}"
        whole = results[0]["gathered"][step - 1]
        assert abs(got - whole) <= 1e-6 * whole, f"step {step}: norm {got} vs its gathered gradient's {whole}"
