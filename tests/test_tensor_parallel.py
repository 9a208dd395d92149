"""Tensor (+ sequence) parallelism gives the single-process losses, gradients and gradient norms
(fp32, CPU, gloo), alone and composed with data, expert and context parallelism; tied embeddings
work; a checkpoint written at tp = 2 resumes at dp = 2 on the uninterrupted losses.

The model is the tiny one of conftest with block 0 dense (so the column/row-parallel SwiGLU is
covered) and block 1 MoE with a shared expert, and a vocabulary of 260 so it splits over tp.
Tolerances as in test_equivalence: losses 1e-5 relative per step; gradients 1e-5 relative to
the tensor's largest entry plus 1e-7; gradient norms 1e-5 relative.
"""

from __future__ import annotations

import pytest

from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed
from test_equivalence import STEPS, assert_matches, merged, steps_with_first_grads

MODEL = {"vocab_size": 260}  # a multiple of tp: the embedding and head split over the vocabulary
MOE = {"first_dense": 1}  # block 0 dense MLP, block 1 MoE
STOP = 3  # the checkpoint test saves after this step and resumes under another layout


def capture(rank: int, world: int, data: str, run_dir: str, parallel: dict, n_steps: int = STEPS,
            save: bool = False, model: dict | None = None) -> dict:
    """Train ``n_steps`` (resuming from ``run_dir``'s checkpoint when there is one); return the
    losses, gradient norms and the first step's gradients as the single-process model holds them."""
    cfg = tiny_config(data, run_dir, parallel=parallel, model={**MODEL, **(model or {})}, moe=MOE,
                      checkpoint={"resume": True, "every": 0})
    trainer = Trainer(cfg, write_files=False)
    start = trainer.step
    results, captured = steps_with_first_grads(trainer, n_steps)
    if save:
        trainer.save_checkpoint()
    return {"start": start, "losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
            "aux": [r.aux_loss for r in results], "z": [r.z_loss for r in results],
            "load": [{n: v["tokens"] for n, v in r.extra["expert_load"].items()} for r in results], "grads": captured}


@pytest.fixture(scope="module")
def tp_reference(tiny_shards, tmp_path_factory):
    return run_distributed(capture, 1, str(tiny_shards), str(tmp_path_factory.mktemp("tp-ref")), {})[0]


def assert_matches_with_norms(results: list[dict], ref: dict) -> None:
    assert_matches(merged(results), ref)
    # The norm is checked apart: a wrong reduction of the norm weights' gradients under SP
    # leaves the update right (DTensor's optimizer ops reduce Partial gradients) but not the norm.
    for step, (a, b) in enumerate(zip(results[0]["grad_norms"], ref["grad_norms"]), 1):
        assert abs(a - b) <= 1e-5 * b, f"step {step}: grad norm {a} vs single-process {b}"
    # The logged MoE metrics add up over the tp ranks (each routes its own tokens).
    for key in ("aux", "z"):
        for step, (a, b) in enumerate(zip(results[0][key], ref[key]), 1):
            assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {key} loss {a} vs single-process {b}"
    assert results[0]["load"] == ref["load"], "tokens per expert differ from one process"


def _world(parallel: dict) -> int:
    return parallel.get("pp", 1) * parallel.get("dp", 1) * parallel.get("cp", 1) * parallel.get("tp", 1)


CASES = [
    {"tp": 2},
    {"tp": 2, "sequence_parallel": True},
    {"dp": 2, "tp": 2},
    {"dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True},  # ep folded over dp; 4 processes
    # RoPE under SP + CP: attention sees the all-gathered cp-local chunks at their global positions.
    {"cp": 2, "tp": 2, "sequence_parallel": True},
]


@pytest.mark.parametrize("parallel", CASES,
                         ids=["-".join(k if v is True else f"{k}{v}" for k, v in c.items())
                              .replace("sequence_parallel", "sp") for c in CASES])
@pytest.mark.slow(fast=["tp2-sp"])
def test_tensor_parallel_matches_single_process(parallel, tp_reference, tiny_shards, tmp_path):
    results = run_distributed(capture, _world(parallel), str(tiny_shards), str(tmp_path), parallel)
    assert_matches_with_norms(results, tp_reference)


def test_tied_embeddings(tiny_shards, tmp_path):
    # Embedding (RowwiseParallel) and head (ColwiseParallel) both shard the [V, D] weight on dim
    # 0, so one tied DTensor parameter serves both.
    tied = {"tie_embeddings": True}
    ref = run_distributed(capture, 1, str(tiny_shards), str(tmp_path / "ref"), {}, STEPS, False, tied)[0]
    assert "output.weight" not in ref["grads"], "the single-process model is not tied"
    results = run_distributed(capture, 2, str(tiny_shards), str(tmp_path / "tp"), {"tp": 2, "sequence_parallel": True},
                              STEPS, False, tied)
    assert_matches_with_norms(results, ref)


def test_checkpoint_from_tp2_resumes_at_dp2(tp_reference, tiny_shards, tmp_path):
    first = run_distributed(capture, 2, str(tiny_shards), str(tmp_path), {"tp": 2, "sequence_parallel": True},
                            STOP, True)[0]
    second = run_distributed(capture, 2, str(tiny_shards), str(tmp_path), {"dp": 2}, STEPS - STOP)[0]
    assert (first["start"], second["start"]) == (0, STOP), "did not resume from the checkpoint"
    losses = first["losses"] + second["losses"]
    for step, (a, b) in enumerate(zip(losses, tp_reference["losses"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} after tp2 → dp2 resume vs {b} uninterrupted"
