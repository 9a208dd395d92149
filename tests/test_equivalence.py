"""Data and expert parallelism give the single-process losses and gradients (fp32, CPU, gloo).

Tolerances: losses within 1e-5 relative per step (issue #2); gradients within 1e-5 relative to
the largest gradient entry of each tensor plus 1e-7 absolute (reductions run in a different order
across ranks, so the last bits differ).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed

STEPS = 5


def full_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's parameters' gradients as the single-process model holds them: DTensor
    gradients (TP, EP, FSDP) made full. Under pipeline parallelism each rank returns its stage's
    parameters; the test takes the union over ranks. Frozen parameters (no gradient) are left
    out."""
    out = {}
    for part in trainer.model_parts:
        for name, p in part.named_parameters():
            g = p.grad
            if g is None and not p.requires_grad:
                continue
            out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def steps_with_first_grads(trainer: Trainer, steps: int) -> tuple[list, dict[str, torch.Tensor]]:
    """Train ``steps`` optimizer steps: their results, and the first step's gradients (before its
    optimizer step) as the single-process model holds them (:func:`full_grads`)."""
    captured: dict = {}

    def hook(opt, args, kwargs):
        if not captured:
            captured.update(full_grads(trainer))

    handle = trainer.optimizers[0].register_step_pre_hook(hook)
    results = [trainer.train_step() for _ in range(steps)]
    handle.remove()
    return results, captured


def train_and_capture(rank: int, world: int, data: str, run_dir: str, parallel: dict, train: dict | None = None,
                      moe: dict | None = None, model: dict | None = None, data_section: dict | None = None) -> dict:
    cfg = tiny_config(data, run_dir, parallel=parallel, train=train or {}, moe=moe or {}, model=model or {},
                      data=data_section or {})
    results, grads = steps_with_first_grads(Trainer(cfg, write_files=False), STEPS)
    return {"losses": [r.loss for r in results], "grads": grads}


@pytest.fixture(scope="module")
def reference(tiny_shards, tmp_path_factory):
    return run_distributed(train_and_capture, 1, str(tiny_shards), str(tmp_path_factory.mktemp("ref")), {})[0]


def merged(results: list[dict]) -> dict:
    """Losses of rank 0 and the union of all ranks' gradients (pipeline stages differ), after
    checking that the ranks agree: every rank reports the same losses, and a parameter that
    several ranks hold (replicas, or the full tensor of a sharded one) has the same gradient on
    each — bit for bit, since each is the result of one reduction that every rank receives."""
    grads: dict[str, torch.Tensor] = {}
    for rank, r in enumerate(results):
        assert r["losses"] == results[0]["losses"], f"rank {rank} reports losses {r['losses']}, rank 0 " \
                                                    f"{results[0]['losses']}"
        for name, g in r["grads"].items():
            if name in grads:
                err = (g - grads[name]).abs().max().item()
                assert torch.equal(g, grads[name]), f"{name}: rank {rank}'s gradient differs from an earlier " \
                                                    f"rank's by {err:.3e}"
            grads[name] = g
    return {"losses": results[0]["losses"], "grads": grads}


def train_layout(rank: int, world: int, data: str, run_dir: str, parallel: dict, model: dict, moe: dict,
                 data_section: dict, steps: int = 20) -> dict:
    """``steps`` optimizer steps of the tiny model with ``model`` / ``moe`` over its sections,
    gradients clipped at 0.5: the losses, the global gradient norms and the first step's gradients
    (the architecture proofs' run: 20 steps let a small error grow visible)."""
    cfg = tiny_config(data, run_dir, parallel=parallel, model=model, moe=moe, data=data_section,
                      train={"steps": steps, "grad_clip": 0.5})
    results, grads = steps_with_first_grads(Trainer(cfg, write_files=False), steps)
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results], "grads": grads}


def layout_world(parallel: dict) -> int:
    """The ranks of a ``parallel`` section: pp × dp × cp × tp."""
    return parallel.get("pp", 1) * parallel.get("dp", 1) * parallel.get("cp", 1) * parallel.get("tp", 1)


def assert_layout_matches(results: list[dict], ref: dict, norms: bool = True) -> None:
    """A layout's run (every rank's :func:`train_layout`) against the single-process ``ref``: the
    last rank's losses (the last pipeline stage's) and the union of the ranks' gradients
    (:func:`assert_matches`), and with ``norms`` the global gradient norm of every step within
    1e-5 relative."""
    got = {"losses": results[-1]["losses"], "grads": {}}
    for r in results:
        got["grads"].update(r["grads"])
    assert_matches(got, ref)
    if norms:
        for step, (a, b) in enumerate(zip(results[-1]["norms"], ref["norms"]), 1):
            assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: grad norm {a} vs single-process {b}"


def assert_matches(result: dict, ref: dict) -> None:
    for step, (a, b) in enumerate(zip(result["losses"], ref["losses"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs single-process {b}"
    assert result["grads"].keys() == ref["grads"].keys()
    for name, g in result["grads"].items():
        r = ref["grads"][name]
        tol = 1e-5 * r.abs().max().item() + 1e-7
        err = (g - r).abs().max().item()
        assert err <= tol, f"{name}: max grad error {err:.3e} > {tol:.3e}"


def test_reference_learns(reference):
    # Guards the comparisons below against a degenerate reference (e.g. zero gradients).
    assert reference["losses"][-1] < reference["losses"][0]
    assert all(g.abs().sum() > 0 for n, g in reference["grads"].items() if "router" in n or "experts" in n)


CASES = [
    ({"dp": 2}, {}),
    ({"dp": 4, "ep": 2}, {}),
    ({"dp": 4, "ep": 4}, {}),
    ({"dp": 2, "ep": 2}, {}),
    # Gradient accumulation: 1 and 4 micro-batches per step give the same step as 2.
    ({"dp": 2, "ep": 2}, {"micro_batch_size": 4}),
    ({"dp": 1}, {"micro_batch_size": 1}),
    # Experts replicated over edp = 2 and one micro-batch per step.
    ({"dp": 4, "ep": 2}, {"micro_batch_size": 1}),
]


@pytest.mark.parametrize("parallel, train", CASES,
                         ids=["-".join(f"{k}{v}" for k, v in {**p, **t}.items()) for p, t in CASES])
def test_matches_single_process(parallel, train, reference, tiny_shards, tmp_path):
    results = run_distributed(train_and_capture, parallel["dp"], str(tiny_shards), str(tmp_path), parallel, train)
    assert_matches(merged(results), reference)
