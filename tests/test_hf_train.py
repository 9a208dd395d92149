"""Import a Hugging Face model, train it in several layouts, export it: transformers' logits equal
moetrain's (fp32, CPU, gloo).

For every architecture of tests/hf_models.py, ``checkpoint.init_from`` loads the imported
weights directory into dp2×ep2 (dp2 for the dense Llama) and tp2×pp2 — Qwen2-MoE also into
dp2×tp2×ep2 with ZeRO-3, and DeepSeek-V3, GLM-4.5 and GPT-OSS into dp2×tp2×ep2 with SP and
cp2×ep2 or pp2×dp2×ep2 instead (Qwen3-Next, Kimi Linear, MiniMax-M2, Llama 4 and DeepSeek-V3.2: cp2×ep2;
Nemotron-H and GLM-5: pp2×dp2×ep2) — where every rank's parameters must equal the file's bit for bit; each
trains 5 steps (enough to move every weight away from the file's: an export that ignored training
would fail) and saves a training checkpoint. Then, in one process, ``init_from`` that
checkpoint (weights only: step 0, empty optimizer state) gives moetrain's logits; the export of
the same checkpoint, loaded by transformers, must give them within 1e-5 relative. The layouts'
losses agree with each other step by step (that each equals one process is the proof of
tests/test_equivalence.py and, over 20 steps for the architectures of 2025-26, of
tests/test_architectures.py).
A run that has a checkpoint of its own resumes from it although ``init_from`` is set.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from moetrain.config import config_from_dict, save_config, to_dict
from moetrain.hf.convert import export_hf, import_hf
from moetrain.train.trainer import Trainer
from moetrain.train.weights import model_parameters

from hf_models import ARCHS, VOCAB, build_hf_model
from multiproc import CASES_PER_SPAWN, run_distributed, spawn_chunks

pytest.importorskip("transformers")

# The module fixture trains every architecture's layouts (27 runs, then their reloads, in a few
# spawns) inside the setup of whichever test comes first: 242 s alone on a slow machine of this
# kind (a 2-core Zen 3), more beside the other pytest worker, where the suite's 600 s per test was
# once too little. A hang still ends the module; each spawn has its own limit.
pytestmark = pytest.mark.timeout(1800)
SPAWN_TIMEOUT_S = 600

STEPS = 5


# The architectures of 2025-26: tp2 (+ SP) with ep, and cp2 or pp2 with ep (MLA and the sliding
# window under ring attention; GLM-4.5's three blocks split 1 + 2 over two stages).
SECOND = {"deepseek_v3": {"cp": 2, "ep": 2}, "glm4_moe": {"pp": 2, "dp": 2, "ep": 2, "pp_first_stage_layers": 1},
          "gpt_oss": {"cp": 2, "ep": 2}, "qwen3_next": {"cp": 2, "ep": 2}, "kimi_linear": {"cp": 2, "ep": 2},
          "nemotron_h": {"pp": 2, "dp": 2, "ep": 2}, "minimax_m2": {"cp": 2, "ep": 2},
          "llama4_text": {"cp": 2, "ep": 2}, "deepseek_v32": {"cp": 2, "ep": 2},
          "glm_moe_dsa": {"pp": 2, "dp": 2, "ep": 2}}


def layouts(arch: str) -> dict[str, dict]:
    if arch in SECOND:
        second = SECOND[arch]
        return {"dp2-tp2-sp-ep2": {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True},
                "-".join(f"{k}{v}" for k, v in second.items() if k != "pp_first_stage_layers"): second}
    first = {"dp": 2} if arch == "llama" else {"dp": 2, "ep": 2}
    out = {"-".join(f"{k}{v}" for k, v in first.items()): first, "tp2-pp2": {"tp": 2, "pp": 2}}
    if arch == "qwen2_moe":
        out["dp2-tp2-ep2-zero3"] = {"dp": 2, "tp": 2, "ep": 2, "zero_stage": 3}
    return out


def train_config(data: str, run_dir: Path, sections: dict, parallel: dict, **checkpoint):
    return config_from_dict({
        "run": {"name": "hf", "dir": str(run_dir), "seed": 3},
        "model": {**sections["model"], "seq_len": 16}, "moe": sections["moe"], "parallel": parallel,
        "data": {"path": data, "val_batches": 2},
        "train": {"steps": STEPS, "micro_batch_size": 2, "global_batch_size": 8, "lr": 3e-3, "min_lr": 3e-4,
                  "warmup_steps": 2, "grad_clip": 1.0, "val_every": 0},
        "checkpoint": {"every": 0, "keep": 1, "resume": False, **checkpoint}})


def full_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's parameters as the single-process model holds them (DTensors made whole).
    Collective."""
    out = {}
    for part in trainer.model_parts:
        for name, p, _ in model_parameters(part):
            out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return out


def train_cases(rank: int, world: int, cases: list) -> dict:
    """In every layout: init_from the imported weights (checked), train, save a checkpoint."""
    from safetensors import safe_open

    results = {}
    for case, cfg, weights in cases:
        trainer = Trainer(cfg, write_files=False)
        stored = {}
        for f in Path(weights).glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as h:
                stored.update({k: h.get_tensor(k) for k in h.keys()})
        wrong = [name for name, t in full_params(trainer).items() if not torch.equal(stored[name].to(t.dtype), t)]
        losses = [trainer.train_step().loss for _ in range(STEPS)]
        trainer.save_checkpoint()
        results[case] = {"losses": losses, "wrong": wrong}
    return results


def reload_cases(rank: int, world: int, cases: list, tokens: torch.Tensor, resume_cfg) -> dict:
    """One process: init_from each trained checkpoint directory → logits; and, given ``resume_cfg``,
    resume wins."""
    out = {}
    for case, cfg in cases:
        trainer = Trainer(cfg, write_files=False)
        assert trainer.step == 0 and trainer.loader.consumed_samples == 0
        assert all(not opt.state for opt in trainer.optimizers), "init_from must leave the optimizer fresh"
        with torch.no_grad():
            out[case] = trainer.model_parts[0].eval()(tokens)
    if resume_cfg is not None:
        out["resumed_step"] = Trainer(resume_cfg, write_files=False).step
    return out


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf-train")
    train, reload, configs = [], [], {}
    for i, arch in enumerate(ARCHS):
        build_hf_model(arch, root / f"{arch}-hf", seed=10 + i)
        cfg = import_hf(root / f"{arch}-hf", root / f"{arch}-weights", progress=False)
        sections = {"model": to_dict(cfg.model), "moe": to_dict(cfg.moe)}
        for name, parallel in layouts(arch).items():
            case = f"{arch}/{name}"
            run_dir = root / arch / name
            tcfg = train_config(str(tiny_shards), run_dir, sections, parallel,
                                init_from=str(root / f"{arch}-weights"))
            save_config(tcfg, run_dir / "config.yaml")  # what submit writes; export finds it there
            train.append((case, tcfg, str(root / f"{arch}-weights")))
            reload.append((case, train_config(str(tiny_shards), root / "reload" / case, sections, {},
                                              init_from=str(run_dir / "checkpoints"))))
            configs[case] = tcfg
    # Spawns of 2 ranks (dp2×ep2, dp2) and of 4 (tp2×pp2, dp2×tp2×ep2, ...), a few cases each
    # (multiproc.CASES_PER_SPAWN: all 14 four-rank cases in one spawn left each rank 130 idle
    # gloo groups); a spawn costs about 0.3 s.
    trained = {}
    for world in (2, 4):
        for chunk in spawn_chunks([c for c in train if c[1].world_size == world]):
            trained.update(run_distributed(train_cases, world, chunk, timeout=SPAWN_TIMEOUT_S)[0])
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    first_case, first_cfg, _ = train[0]
    resume_cfg = first_cfg.replace(parallel={"dp": 1, "ep": 1}, checkpoint={"resume": True})
    reloaded = {}
    for i, chunk in enumerate(spawn_chunks(reload, 2 * CASES_PER_SPAWN)):
        reloaded.update(run_distributed(reload_cases, 1, chunk, tokens, resume_cfg if i == 0 else None,
                                        timeout=SPAWN_TIMEOUT_S)[0])
    return {"root": root, "trained": trained, "reloaded": reloaded, "tokens": tokens, "configs": configs}


CASES = [(arch, name) for arch in ARCHS for name in layouts(arch)]


@pytest.mark.parametrize("arch, layout", CASES, ids=[f"{a}-{n}" for a, n in CASES])
@pytest.mark.slow
def test_train_then_export_matches_transformers(arch, layout, runs):
    from transformers import AutoModelForCausalLM

    case = f"{arch}/{layout}"
    result = runs["trained"][case]
    assert not result["wrong"], f"init_from loaded other values into {result['wrong'][:3]}"
    assert result["losses"][-1] < result["losses"][0], "training from the imported weights must lower the loss"
    out = runs["root"] / "export" / arch / layout
    export_hf(runs["root"] / arch / layout / "checkpoints", out, progress=False)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = model(runs["tokens"]).logits
    ours = runs["reloaded"][case]
    err = ((ours - hf_logits).abs().max() / hf_logits.abs().max()).item()
    assert err <= 1e-5, f"exported logits differ from moetrain's by {err:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_layouts_train_alike(arch, runs):
    names = list(layouts(arch))
    ref = runs["trained"][f"{arch}/{names[0]}"]["losses"]
    for name in names[1:]:
        losses = runs["trained"][f"{arch}/{name}"]["losses"]
        for step, (a, b) in enumerate(zip(losses, ref), 1):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name} step {step}: loss {a} vs {names[0]} {b}"


def test_resume_wins_over_init_from(runs):
    assert runs["reloaded"]["resumed_step"] == STEPS


def save_after(rank: int, world: int, cfg, steps: int) -> None:
    trainer = Trainer(cfg, write_files=False)
    for _ in range(steps):
        trainer.train_step()
    trainer.save_checkpoint()


@pytest.mark.slow
def test_export_of_a_dp_tp_ep_etp_checkpoint_equals_the_one_process_export(tiny_shards, tmp_path):
    """Every expert tensor of a checkpoint trained under dp2 × tp2 × ep2 × etp2 (each rank holds
    1/2 of the experts and 1/2 of each one's width) is gathered by the export: it equals, bit for
    bit, the export of the same weights loaded into one process and saved from there."""
    from safetensors.torch import load_file

    build_hf_model("mixtral", tmp_path / "hf", seed=21)
    imported = import_hf(tmp_path / "hf", tmp_path / "weights", progress=False)
    sections = {"model": to_dict(imported.model), "moe": to_dict(imported.moe)}
    parallel = {"dp": 2, "tp": 2, "ep": 2, "etp": 2, "sequence_parallel": True}
    cfg = train_config(str(tiny_shards), tmp_path / "run", sections, parallel, init_from=str(tmp_path / "weights"))
    save_config(cfg, tmp_path / "run" / "config.yaml")
    run_distributed(save_after, 4, cfg, 3, timeout=600)
    one = train_config(str(tiny_shards), tmp_path / "one", sections, {}, init_from=str(tmp_path / "run" / "checkpoints"))
    save_config(one, tmp_path / "one" / "config.yaml")
    run_distributed(save_after, 1, one, 0)
    for run in ("run", "one"):
        export_hf(tmp_path / run / "checkpoints", tmp_path / f"export-{run}", progress=False)
    load = lambda d: {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}  # noqa: E731
    sharded, whole = load(tmp_path / "export-run"), load(tmp_path / "export-one")
    assert sharded.keys() == whole.keys() and any(".experts." in k for k in whole)
    assert [k for k in whole if not torch.equal(sharded[k], whole[k])] == []
    original = load(tmp_path / "hf")
    assert any(not torch.equal(whole[k], original[k]) for k in whole if ".experts." in k and k in original), \
        "the experts were not trained"
