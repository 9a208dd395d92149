"""Pipeline parallelism gives the single-process losses, MoE losses, gradients and validation loss.

A 4-layer tiny MoE, 5 steps (fp32, CPU, gloo). Tolerances are those of test_equivalence: losses
within 1e-5 relative per step, gradients within 1e-5 of each tensor's largest entry + 1e-7.
Layouts of the same world size run in one spawn, one after the other (only the trainer is
rebuilt), to keep the file fast:

* one process: the references, and a pp=2 checkpoint resumed at pp=1;
* two: every schedule at pp=2, zero bubble with activation recomputation, a deliberately broken
  gradient scaling that must fail, a pp=2 checkpoint resumed at dp=2;
* four: pp × dp, pp × dp × ep (with ZeRO-2 and ZeRO-3), pp × cp, pp × tp with sequence
  parallelism, a pp × ep checkpoint resumed at dp=4 × ep=4, a tp × pp checkpoint resumed at dp=4;
* eight: pp × tp × dp (SP, ZeRO-1) and the five-dimension pp × dp × cp with ep=2 folded over
  dp × cp (ZeRO-2).

Under tp the model's vocabulary is 260 (divisible by tp) and has its own reference.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from moetrain.config import ConfigError, check_supported
from moetrain.parallel.pipeline import split_model, stage_blocks, stage_ids
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed, spawn_chunks
from test_equivalence import assert_matches, merged, steps_with_first_grads

STEPS, SAVE_AT = 5, 3
LAYERS = {"layers": 4}
TP_MODEL = {"vocab_size": 260}  # a multiple of tp: the embedding and the head split over the vocabulary


def _config(data: str, run_dir: str, parallel: dict, resume: bool = False, model: dict | None = None):
    # val_every > 0 loads the validation batches (evaluate() is called by the worker itself).
    return tiny_config(data, run_dir, model={**LAYERS, **(model or {})}, parallel=parallel,
                       train={"val_every": STEPS}, checkpoint={"resume": resume})


def run_layouts(rank: int, world: int, data: str, run_dir: str, cases: list[dict]) -> list[dict]:
    """Train each case's layout in turn in this one set of processes; a case is a dict with
    ``parallel`` and optionally ``model`` (overrides), ``steps`` (default STEPS), ``save``
    (checkpoint after the steps), ``resume`` (start from the latest checkpoint in ``run_dir``),
    ``dir`` (a subdirectory of ``run_dir`` for its checkpoints), ``break_scaling`` (negative control: back-propagate the last stage's loss without its 1/n)."""
    out = []
    for case in cases:
        # A case may keep its checkpoints in a subdirectory ("dir"), apart from the other cases'.
        cfg = _config(data, f"{run_dir}/{case.get('dir', '')}", case["parallel"], case.get("resume", False),
                      case.get("model"))
        trainer = Trainer(cfg, write_files=False)
        start = trainer.step
        # Validation before training too: the runner then switches from evaluation to training.
        val_before = trainer.evaluate()
        if case.get("break_scaling"):
            trainer.runner.train_loss.divisor = 1
        results, captured = steps_with_first_grads(trainer, case.get("steps", STEPS))
        if case.get("save"):
            trainer.save_checkpoint()
        out.append({"start": start, "losses": [r.loss for r in results], "aux": [r.aux_loss for r in results],
                    "z": [r.z_loss for r in results], "grads": captured,
                    "val": [val_before[0], trainer.evaluate()[0]]})
    return out


def run_layouts_in_spawns(world: int, data: str, run_dir: str, cases: list[dict], **kw) -> list[list[dict]]:
    """:func:`run_layouts` over ``cases`` in order, a few to a spawn (multiproc.CASES_PER_SPAWN);
    per rank, every case's result."""
    out: list[list[dict]] = [[] for _ in range(world)]
    for chunk in spawn_chunks(cases):
        for rank, res in enumerate(run_distributed(run_layouts, world, data, run_dir, chunk, **kw)):
            out[rank].extend(res)
    return out


def _by_case(results: list[list[dict]]) -> list[dict]:
    """Per case: rank 0's losses and the union of every rank's gradients (stages differ)."""
    return [{**merged([r[i] for r in results]), **{k: results[0][i][k] for k in ("start", "aux", "z", "val")}}
            for i in range(len(results[0]))]


def _close(a: list[float], b: list[float], what: str) -> None:
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= 1e-5 * abs(y), f"step {step}: {what} {x} vs single-process {y}"


def _assert_same_run(res: dict, ref: dict, same_val: bool = True) -> None:
    assert_matches(res, ref)  # LM losses and gradients
    _close(res["aux"], ref["aux"], "aux loss")  # logged MoE losses: summed over stages and tp
    _close(res["z"], ref["z"], "z loss")
    if same_val:  # the validation batches are split over dp: comparable at dp = 1
        _close(res["val"], ref["val"], "validation loss (before, after training)")


# --- two processes: every schedule, the negative control, a pp=2 checkpoint ------------------

PP2_SCHEDULES = {
    "gpipe": {"pp": 2, "pp_schedule": "gpipe"},
    "1f1b": {"pp": 2, "pp_schedule": "1f1b"},
    "zero_bubble": {"pp": 2, "pp_schedule": "zero_bubble"},
    "interleaved_1f1b-v2": {"pp": 2, "virtual_stages": 2, "pp_schedule": "interleaved_1f1b"},
    "zero_bubble-v2": {"pp": 2, "virtual_stages": 2, "pp_schedule": "zero_bubble"},
    # Uneven splits (Megatron's first / last stage layers): blocks [1, 3]; and [2, 1, 1, 0] over
    # 2 × 2 virtual stages, the last stage holding only the final norm and the head.
    "1f1b-first1": {"pp": 2, "pp_schedule": "1f1b", "pp_first_stage_layers": 1},
    "interleaved_1f1b-v2-first2-last0": {"pp": 2, "virtual_stages": 2, "pp_schedule": "interleaved_1f1b",
                                         "pp_first_stage_layers": 2, "pp_last_stage_layers": 0},
    # Recomputation inside the split (input / weight) backward: MoE statistics counted once.
    "zero_bubble-v2-ac_full": {"pp": 2, "virtual_stages": 2, "pp_schedule": "zero_bubble",
                               "activation_checkpointing": "full"},
}
SAVE = {"parallel": {"pp": 2, "pp_schedule": "1f1b"}, "steps": SAVE_AT, "save": True}


@pytest.fixture(scope="module")
def two_procs(tiny_shards, tmp_path_factory) -> dict:
    run_dir = str(tmp_path_factory.mktemp("pp2"))
    cases = ([{"parallel": p} for p in PP2_SCHEDULES.values()]
             + [{"parallel": PP2_SCHEDULES["1f1b"], "break_scaling": True},
                SAVE,
                {"parallel": {"dp": 2}, "steps": STEPS - SAVE_AT, "resume": True}])
    res = _by_case(run_layouts_in_spawns(2, str(tiny_shards), run_dir, cases))
    n = len(PP2_SCHEDULES)
    return {"schedules": dict(zip(PP2_SCHEDULES, res[:n])), "broken": res[n], "saved": res[n + 1],
            "resumed_dp2": res[n + 2], "run_dir": run_dir}


@pytest.fixture(scope="module")
def single(two_procs, tiny_shards) -> dict:
    """The single-process references (vocabulary 257, and 260 for tp), then the pp=2 checkpoint
    resumed at pp=1 (one spawn)."""
    # All in the pp=2 run directory: the references neither save nor resume.
    cases = [{"parallel": {}}, {"parallel": {}, "model": TP_MODEL},
             {"parallel": {}, "steps": STEPS - SAVE_AT, "resume": True}]
    ref, ref_tp, resumed = _by_case(run_layouts_in_spawns(1, str(tiny_shards), two_procs["run_dir"], cases))
    return {"ref": ref, "ref_tp": ref_tp, "resumed_pp1": resumed}


@pytest.mark.slow
def test_reference_learns(single):
    ref = single["ref"]
    assert ref["losses"][-1] < ref["losses"][0]
    assert all(g.abs().sum() > 0 for n, g in ref["grads"].items() if "router" in n or "experts" in n)


@pytest.mark.parametrize("schedule", list(PP2_SCHEDULES))
def test_schedule_matches_single_process(schedule, two_procs, single):
    _assert_same_run(two_procs["schedules"][schedule], single["ref"])


def test_wrong_gradient_scaling_is_caught(two_procs, single):
    # The comparison can fail: without the 1/n on the loss, the LM gradients are n times too large.
    # Both halves of the comparison see it: the gradients of step 1, and the losses from step 2.
    with pytest.raises(AssertionError, match="max grad error"):
        assert_matches({**two_procs["broken"], "losses": single["ref"]["losses"]}, single["ref"])
    with pytest.raises(AssertionError, match="step 2: loss"):
        assert_matches(two_procs["broken"], single["ref"])


@pytest.mark.parametrize("second", ["resumed_dp2", "resumed_pp1"])
def test_pp2_checkpoint_resumes_in_other_layouts(second, two_procs, single):
    saved = two_procs["saved"]
    resumed = two_procs[second] if second in two_procs else single[second]
    assert saved["start"] == 0 and resumed["start"] == SAVE_AT, "did not resume from the pp=2 checkpoint"
    _close(saved["losses"] + resumed["losses"], single["ref"]["losses"], "loss after resume")


# --- four processes: pp × dp, pp × dp × ep (× ZeRO), pp × cp, pp × tp (+ SP) -----------------

PP2_COMPOSED = {
    "dp2-pp2-1f1b": {"dp": 2, "pp": 2, "pp_schedule": "1f1b"},
    "dp2-ep2-pp2-interleaved_1f1b-v2-zero3": {"dp": 2, "ep": 2, "pp": 2, "virtual_stages": 2,
                                              "pp_schedule": "interleaved_1f1b", "zero_stage": 3},
    "dp2-ep2-pp2-zero_bubble-zero2": {"dp": 2, "ep": 2, "pp": 2, "pp_schedule": "zero_bubble", "zero_stage": 2},
    "cp2-pp2-gpipe": {"cp": 2, "pp": 2, "pp_schedule": "gpipe"},
    "tp2-sp-pp2-zero_bubble-v2": {"tp": 2, "sequence_parallel": True, "pp": 2, "virtual_stages": 2,
                                  "pp_schedule": "zero_bubble"},
}


# Experts are DTensors on each stage's own expert mesh in the checkpoint: save at dp2·ep2·pp2,
# resume without pipeline at dp4·ep4.
SAVE_EP = {"parallel": {"dp": 2, "ep": 2, "pp": 2, "pp_schedule": "1f1b"}, "steps": SAVE_AT, "save": True}
RESUME_EP = {"parallel": {"dp": 4, "ep": 4}, "steps": STEPS - SAVE_AT, "resume": True}


# Tensor-parallel (DTensor) dense weights and pipeline stages in the checkpoint: save at
# tp2·pp2 with SP, resume with neither at dp4.
SAVE_TP = {"parallel": {"tp": 2, "sequence_parallel": True, "pp": 2, "pp_schedule": "1f1b"}, "model": TP_MODEL,
           "steps": SAVE_AT, "save": True, "dir": "tp2pp2"}
RESUME_TP = {"parallel": {"dp": 4}, "model": TP_MODEL, "steps": STEPS - SAVE_AT, "resume": True, "dir": "tp2pp2"}


@pytest.fixture(scope="module")
def four_procs(tiny_shards, tmp_path_factory) -> dict:
    cases = ([{"parallel": p, "model": TP_MODEL if "tp" in p else None} for p in PP2_COMPOSED.values()]
             + [SAVE_EP, RESUME_EP, SAVE_TP, RESUME_TP])
    res = _by_case(run_layouts_in_spawns(4, str(tiny_shards), str(tmp_path_factory.mktemp("pp4")), cases))
    return {**dict(zip(PP2_COMPOSED, res)), "saved": res[-4], "resumed": res[-3], "saved_tp": res[-2],
            "resumed_tp": res[-1]}


@pytest.mark.parametrize("layout", list(PP2_COMPOSED))
@pytest.mark.slow
def test_composed_layout_matches_single_process(layout, four_procs, single):
    parallel = PP2_COMPOSED[layout]
    _assert_same_run(four_procs[layout], single["ref_tp" if "tp" in parallel else "ref"],
                     same_val="dp" not in parallel)


def test_pp2_ep2_checkpoint_resumes_at_dp4_ep4(four_procs, single):
    saved, resumed = four_procs["saved"], four_procs["resumed"]
    assert resumed["start"] == SAVE_AT, "did not resume from the pp=2 checkpoint"
    _close(saved["losses"] + resumed["losses"], single["ref"]["losses"], "loss after resume")


def test_tp2_pp2_checkpoint_resumes_at_dp4(four_procs, single):
    saved, resumed = four_procs["saved_tp"], four_procs["resumed_tp"]
    assert saved["start"] == 0 and resumed["start"] == SAVE_AT, "did not resume from the tp2·pp2 checkpoint"
    _close(saved["losses"] + resumed["losses"], single["ref_tp"]["losses"], "loss after resume")


# --- eight processes: pp × tp × dp, and all five dimensions -------------------------------------

PP2_EIGHT = {
    "dp2-tp2-sp-pp2-1f1b-zero1": {"dp": 2, "tp": 2, "sequence_parallel": True, "pp": 2, "pp_schedule": "1f1b",
                                  "zero_stage": 1},
    # ep=2 folded over dp × cp = 4 (each ep group spans a dp pair of one cp rank); ZeRO-2 shards
    # dense states over dp × cp and expert states over the expert-data-parallel ranks.
    "dp2-cp2-ep2-pp2-1f1b-zero2": {"dp": 2, "cp": 2, "ep": 2, "pp": 2, "pp_schedule": "1f1b", "zero_stage": 2},
}


@pytest.fixture(scope="module")
def eight_procs(tiny_shards, tmp_path_factory) -> dict:
    cases = [{"parallel": p, "model": TP_MODEL if "tp" in p else None} for p in PP2_EIGHT.values()]
    res = _by_case(run_layouts_in_spawns(8, str(tiny_shards), str(tmp_path_factory.mktemp("pp8")), cases,
                                   timeout=600))
    return dict(zip(PP2_EIGHT, res))


@pytest.mark.parametrize("layout", list(PP2_EIGHT))
@pytest.mark.slow
def test_eight_process_layout_matches_single_process(layout, eight_procs, single):
    tp = "tp" in PP2_EIGHT[layout]
    _assert_same_run(eight_procs[layout], single["ref_tp" if tp else "ref"], same_val=False)


# --- no processes: split, placement, batch chunking, refusals ---------------------------------


def test_stages_hold_their_blocks_with_global_names(tiny_shards, tmp_path):
    from moetrain.model.transformer import Transformer

    cfg = _config(str(tiny_shards), str(tmp_path), {"pp": 2, "virtual_stages": 2, "pp_schedule": "interleaved_1f1b"})
    with torch.device("meta"):
        model = Transformer.from_config(cfg)
    assert stage_ids(1, 2, 2) == [1, 3] and list(stage_blocks(3, 4, 4)) == [3]
    first, third = split_model(model, stage_ids(0, 2, 2), 4)
    assert list(first.layers) == ["0"] and first.tok_embeddings is not None and first.output is None
    assert list(third.layers) == ["2"] and third.tok_embeddings is None and third.norm is None
    (last,) = split_model(model, [3], 4)
    assert last.output is not None and last.norm is not None
    names = {n for part in split_model(model, [0, 1, 2, 3], 4) for n, _ in part.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}, "a parameter was lost or renamed by the split"


def test_uneven_stage_split(tiny_shards, tmp_path):
    from moetrain.config import pipeline_stage_layers

    assert pipeline_stage_layers(32, 4) == [8, 8, 8, 8]
    assert pipeline_stage_layers(32, 4, first=7, last=5) == [7, 10, 10, 5]
    assert pipeline_stage_layers(9, 4, first=0) == [0, 3, 3, 3]
    assert list(stage_blocks(1, 4, 8, first=2, last=0)) == [2, 3, 4]
    assert list(stage_blocks(3, 4, 8, first=2, last=0)) == []
    with pytest.raises(ValueError, match="add up to all 4"):
        pipeline_stage_layers(4, 2, first=1, last=1)
    with pytest.raises(ValueError, match="do not split evenly"):
        pipeline_stage_layers(5, 3, first=2)
    # Refused before launch, naming the field.
    with pytest.raises(ConfigError, match="parallel.pp_first_stage_layers = 3"):
        _config(str(tiny_shards), str(tmp_path), {"pp": 2, "pp_first_stage_layers": 3, "pp_last_stage_layers": 3})
    with pytest.raises(ConfigError, match="pp_first_stage_layers / pp_last_stage_layers"):
        tiny_config(str(tiny_shards), str(tmp_path), model={"layers": 5}, parallel={"pp": 2})


def test_schedule_splits_the_batch_into_the_micro_batches():
    # The runner concatenates the micro-batches; the schedule must cut them apart again, in order.
    micro = [torch.randint(0, 257, (2, 16)) for _ in range(4)]
    chunks, _ = split_args_kwargs_into_chunks((torch.cat(micro),), None, len(micro))
    assert len(chunks) == 4
    assert all(torch.equal(c[0], m) for c, m in zip(chunks, micro))


@pytest.mark.parametrize("override, field", [
    ({"parallel": {"pp": 2}, "model": {**LAYERS, "tie_embeddings": True}}, "model.tie_embeddings"),
    ({"parallel": {"pp": 2, "dp": 2, "zero_stage": 3, "pp_schedule": "zero_bubble"}}, "parallel.zero_stage"),
    # 10 micro-batches at pp=2 run as 5 rounds of 2: fine; 5 would be 2 rounds of 2.5.
    ({"parallel": {"pp": 2, "pp_schedule": "interleaved_1f1b"}, "train": {"global_batch_size": 10}},
     "train.global_batch_size"),
])
def test_unsupported_pipeline_layouts_are_refused(override, field, tiny_shards, tmp_path):
    cfg = tiny_config(str(tiny_shards), str(tmp_path), **{"model": LAYERS, **override})
    with pytest.raises(ConfigError, match=field):
        check_supported(cfg)
