"""Expert-tensor parallelism (``parallel.etp`` = tp, moetrain.parallel.expert
._expert_tensor_parallel): each expert's ffn width split over the tp ranks gives the
one-process losses and gradients (the test_equivalence tolerances), with and without sequence
parallelism, with expert parallelism and with ZeRO; the experts hold 1/tp of their weights.
"""

from __future__ import annotations

import pytest

from moetrain.model.moe import GroupedExperts
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed
from test_equivalence import STEPS, assert_matches, merged, steps_with_first_grads

MODEL = {"vocab_size": 260}
MOE = {"first_dense": 1, "ffn_hidden": 48}


def etp_capture(rank: int, world: int, data: str, run_dir: str, parallel: dict, train: dict | None = None) -> dict:
    cfg = tiny_config(data, run_dir, parallel=parallel, model=MODEL, moe=MOE, train=train or {})
    trainer = Trainer(cfg, write_files=False)
    # The pieces this rank holds (a DTensor's local shard).
    shapes = {n: tuple(getattr(m.w1, "_local_tensor", m.w1).shape) for part in trainer.model_parts
              for n, m in part.named_modules() if isinstance(m, GroupedExperts)}
    results, grads = steps_with_first_grads(trainer, STEPS)  # experts made whole from their ep and tp pieces
    return {"losses": [r.loss for r in results], "grads": grads, "shapes": shapes}


@pytest.fixture(scope="module")
def reference(tiny_shards, tmp_path_factory):
    return run_distributed(etp_capture, 1, str(tiny_shards), str(tmp_path_factory.mktemp("etp-ref")), {})[0]


CASES = [
    ({"tp": 2, "etp": 2}, 2),
    ({"tp": 2, "etp": 2, "sequence_parallel": True}, 2),
    ({"dp": 2, "tp": 2, "ep": 2, "etp": 2, "sequence_parallel": True}, 4),
    ({"dp": 2, "tp": 2, "etp": 2, "zero_stage": 2}, 4),
]


@pytest.mark.parametrize("parallel, world", CASES, ids=["tp2-etp2", "tp2-sp-etp2", "dp2-tp2-ep2-sp-etp2",
                                                        "dp2-tp2-etp2-zero2"])
def test_etp_matches_single_process(parallel, world, reference, tiny_shards, tmp_path):
    results = run_distributed(etp_capture, world, str(tiny_shards), str(tmp_path), parallel)
    assert_matches(merged(results), reference)
    # Each rank holds 1/tp of every expert's width (and 1/ep of the experts).
    E, D, F = reference["shapes"]["layers.1.moe.experts"]
    if "zero_stage" not in parallel:
        assert results[0]["shapes"]["layers.1.moe.experts"] == (E // parallel.get("ep", 1), D, F // parallel["tp"])


def etp_steps(rank: int, world: int, data: str, run_dir: str, parallel: dict, n_steps: int, save: bool) -> dict:
    cfg = tiny_config(data, run_dir, parallel=parallel, model=MODEL, moe=MOE, train={"steps": 6},
                      checkpoint={"resume": True, "every": 0})
    trainer = Trainer(cfg, write_files=False)
    start = trainer.step
    losses = [trainer.train_step().loss for _ in range(n_steps)]
    if save:
        trainer.save_checkpoint()
    return {"start": start, "losses": losses}


@pytest.mark.parametrize("first, second", [
    ({"tp": 2, "etp": 2}, {"tp": 2}),
    ({"tp": 2}, {"dp": 2, "tp": 2, "etp": 2, "zero_stage": 2}),
], ids=["etp2-to-etp1", "etp1-to-etp2-zero2"])
@pytest.mark.slow
def test_checkpoints_move_between_etp_layouts(first, second, tiny_shards, tmp_path):
    def world(p: dict) -> int:
        return p.get("dp", 1) * p.get("tp", 1)

    full = run_distributed(etp_steps, 1, str(tiny_shards), str(tmp_path / "full"), {}, 6, False)[0]
    a = run_distributed(etp_steps, world(first), str(tiny_shards), str(tmp_path / "run"), first, 3, True)[0]
    b = run_distributed(etp_steps, world(second), str(tiny_shards), str(tmp_path / "run"), second, 3, False)[0]
    assert (a["start"], b["start"]) == (0, 3)
    for step, (x, y) in enumerate(zip(a["losses"] + b["losses"], full["losses"]), 1):
        assert abs(x - y) <= 1e-5 * y, f"step {step}: {x} across the etp change vs {y} uninterrupted"


LONG = 20


def long_run(rank: int, world: int, data: str, run_dir: str, parallel: dict) -> dict:
    cfg = tiny_config(data, run_dir, parallel=parallel, model=MODEL, moe=MOE,
                      train={"steps": LONG, "grad_clip": 1.0})
    trainer = Trainer(cfg, write_files=False)
    results = [trainer.train_step() for _ in range(LONG)]
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results]}


LONG_CASES = [
    {"tp": 2, "sequence_parallel": True},
    {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True},
    {"dp": 2, "tp": 2, "ep": 2, "etp": 2, "zero_stage": 2},
]


@pytest.mark.parametrize("parallel", LONG_CASES, ids=["-".join(f"{k}{v}" for k, v in p.items()) for p in LONG_CASES])
@pytest.mark.slow
def test_twenty_clipped_steps_with_tp_and_etp_equal_one_process(parallel, tiny_shards, tmp_path):
    """Over 20 steps, gradient clipping on: a clip factor taken from a layout-dependent norm (as
    moetrain 0.1's fp32 norm was) made tp × etp layouts depart from one process after ~10 steps."""
    ref = run_distributed(long_run, 1, str(tiny_shards), str(tmp_path / "ref"), {})[0]
    got = run_distributed(long_run, parallel.get("dp", 1) * parallel["tp"], str(tiny_shards), str(tmp_path / "run"),
                          parallel)[0]
    assert max(ref["norms"]) > 1.0, "the test must clip"
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs single-process {b}"
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: grad norm {a} vs single-process {b}"
