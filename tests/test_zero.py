"""ZeRO stages 1-3 (FSDP2) give the single-process losses, gradients and gradient norms; stage 1
does not communicate during gradient accumulation; checkpoints load across stages and layouts.

Tolerances as in test_equivalence: losses and gradient norms within 1e-5 relative per step;
gradients (after reduction, made full) within 1e-5 of each tensor's largest entry + 1e-7.
"""

from __future__ import annotations

import shutil

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.train.trainer import Trainer

from multiproc import run_distributed
from test_equivalence import assert_matches, merged, train_and_capture
from test_resume import assert_resumed_like_uninterrupted, train_steps
from test_tensor_parallel import capture as tp_capture


def train_and_count(rank: int, world: int, data: str, run_dir: str, parallel: dict, train: dict) -> dict:
    """``train_and_capture`` plus: the gradient norm of every step, FSDP's all-gathers and
    reduce-scatters in each micro-batch of step 1 (forward + backward), and whether every
    parameter carries its placement (a DTensor)."""
    calls = {"all_gather": 0, "reduce_scatter": 0}
    marks: list[dict] = []  # call counts at the start of every forward of the whole model
    norms: list[float] = []
    marked: list[bool] = []

    def counting(fn, name):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    # FSDP2 calls these through the torch.distributed module, so patching the attribute counts them
    # (torch 2.13 names them *_single; 2.11 calls the *_tensor ones).
    for name, ops in (("all_gather", ("all_gather_single", "all_gather_into_tensor")),
                      ("reduce_scatter", ("reduce_scatter_single", "reduce_scatter_tensor"))):
        op = next(o for o in ops if hasattr(dist, o))
        setattr(dist, op, counting(getattr(dist, op), name))

    def mark(module, args):
        if type(module).__name__.endswith("Transformer"):  # FSDP renames the class FSDPTransformer
            marks.append(dict(calls))

    nn.modules.module.register_module_forward_pre_hook(mark)  # runs before FSDP's own pre-hooks
    step = Trainer.train_step

    def recording_step(self):
        if not marked:
            marked.append(all(isinstance(p, DTensor) for part in self.model_parts for p in part.parameters()))
        res = step(self)
        norms.append(res.grad_norm)
        return res

    Trainer.train_step = recording_step
    out = train_and_capture(rank, world, data, run_dir, parallel, train)
    accum = 8 // ((train or {}).get("micro_batch_size", 2) * parallel.get("dp", 1))
    per_mb = [{k: marks[i + 1][k] - marks[i][k] for k in calls} for i in range(accum)]
    return {**out, "norms": norms, "per_micro_batch": per_mb, "all_marked": marked[0]}


@pytest.fixture(scope="module")
def reference(tiny_shards, tmp_path_factory):
    return run_distributed(train_and_count, 1, str(tiny_shards), str(tmp_path_factory.mktemp("ref")), {}, {})[0]


def assert_norms_match(results: list[dict], ref: dict) -> None:
    for step, (a, b) in enumerate(zip(results[0]["norms"], ref["norms"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: grad norm {a} vs single-process {b}"
    assert len({tuple(r["norms"]) for r in results}) == 1, "ranks disagree on the gradient norm"


# FSDP groups of the tiny model: per block its experts and the rest of it, plus the root.
GROUPS = 2 * 2 + 1
# Step 1 with 2 micro-batches, (all-gathers, reduce-scatters) in micro-batch 1 and 2. Stage 1:
# nothing reduced (and no parameter re-gathered) until the last backward.
EXPECTED_CALLS = {
    1: [(GROUPS, 0), (0, GROUPS)],
    2: [(GROUPS, GROUPS), (0, GROUPS)],
    # forward and backward all-gathers, but the last block's two groups (experts and the rest)
    # stay unsharded from forward to backward
    3: [(2 * GROUPS - 2, GROUPS), (2 * GROUPS - 2, GROUPS)],
}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_matches_single_process_with_accumulation(stage, reference, tiny_shards, tmp_path):
    parallel = {"dp": 2, "zero_stage": stage}  # global batch 8 = 2 ranks × 2 micro-batches × 2
    results = run_distributed(train_and_count, 2, str(tiny_shards), str(tmp_path), parallel, {})
    assert_matches(merged(results), reference)
    assert_norms_match(results, reference)
    assert all(r["all_marked"] for r in results), "a parameter under FSDP is not a DTensor"
    for r in results:
        got = [(c["all_gather"], c["reduce_scatter"]) for c in r["per_micro_batch"]]
        assert got == EXPECTED_CALLS[stage], f"zero {stage}: (all-gathers, reduce-scatters) per micro-batch {got}"


CASES = [
    # Expert FSDP mesh of one rank (edp = 1); 4 micro-batches per step.
    ({"dp": 2, "ep": 2, "zero_stage": 3}, {"micro_batch_size": 1}),
    # Experts sharded over edp = 2, dense parameters over dp = 4: different meshes in one optimizer.
    ({"dp": 4, "ep": 2, "zero_stage": 3}, {}),
]


@pytest.mark.parametrize("parallel, train", CASES,
                         ids=["-".join(f"{k}{v}" for k, v in {**p, **t}.items()) for p, t in CASES])
def test_zero3_with_expert_parallel(parallel, train, reference, tiny_shards, tmp_path):
    results = run_distributed(train_and_count, parallel["dp"], str(tiny_shards), str(tmp_path), parallel, train)
    assert_matches(merged(results), reference)
    assert_norms_match(results, reference)


def test_zero_with_tensor_sequence_and_expert_parallel(tiny_shards, tmp_path):
    # FSDP's 2-D (dp_cp, tp) DTensors shard dim 0 as _StridedShard; the router and shared expert
    # (local tokens under TP) are reduced over dp_cp_tp. Test_tensor_parallel's model: block 0
    # dense, block 1 MoE, vocabulary 260.
    ref = run_distributed(tp_capture, 1, str(tiny_shards), str(tmp_path / "ref"), {})[0]
    parallel = {"dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True, "zero_stage": 1}
    results = run_distributed(tp_capture, 4, str(tiny_shards), str(tmp_path / "run"), parallel)
    assert_matches(merged(results), ref)
    assert_norms_match([{"norms": r["grad_norms"]} for r in results], {"norms": ref["grad_norms"]})


# -- resume across zero stages and layouts ---------------------------------------------------

TOTAL, STOP = 6, 3
FIRST = {"dp": 2, "ep": 2, "zero_stage": 3}


@pytest.fixture(scope="module")
def uninterrupted(tiny_shards, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    return run_distributed(train_steps, 2, str(tiny_shards), str(run_dir), {"dp": 2, "ep": 2}, TOTAL, False)[0]


@pytest.fixture(scope="module")
def zero3_checkpoint(tiny_shards, tmp_path_factory):
    """A run directory with a checkpoint at step STOP written by (dp2, ep2, zero 3)."""
    run_dir = tmp_path_factory.mktemp("zero3")
    first = run_distributed(train_steps, 2, str(tiny_shards), str(run_dir), FIRST, STOP, True)[0]
    assert first["start"] == 0
    return run_dir, first


@pytest.mark.parametrize("second", [{"dp": 2, "zero_stage": 1}, {"dp": 4, "ep": 4, "zero_stage": 0}],
                         ids=["to-dp2-zero1", "to-dp4-ep4-zero0"])
def test_resume_across_stages(second, zero3_checkpoint, uninterrupted, tiny_shards, tmp_path):
    src, first = zero3_checkpoint
    shutil.copytree(src / "checkpoints", tmp_path / "checkpoints")
    resumed = run_distributed(train_steps, second["dp"], str(tiny_shards), str(tmp_path), second, TOTAL - STOP,
                              False)[0]
    assert_resumed_like_uninterrupted(first, resumed, uninterrupted, STOP)


def test_zero_stages_accepted_before_launch_and_others_refused(tiny_shards, tmp_path):
    from conftest import tiny_config
    from moetrain.config import ConfigError
    from moetrain.launch.preflight import preflight

    for stage in (1, 2, 3):
        cfg = preflight(tiny_config(tiny_shards, tmp_path, parallel={"dp": 2, "zero_stage": stage}))
        assert cfg.parallel.zero_stage == stage
    with pytest.raises(ConfigError, match=r"parallel.zero_stage = 4: .* Fix: use 0, 1, 2 or 3"):
        tiny_config(tiny_shards, tmp_path, parallel={"dp": 2, "zero_stage": 4})
