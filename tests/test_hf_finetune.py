"""A fine-tuning run from an imported Hugging Face model through ``python -m moetrain.submit``, on
the demo: build a Mixtral-shaped model of the demo config's (smaller) shape locally, import it,
train it with the demo config (4 processes, dp4 × ep2) from ``checkpoint.init_from``, export the
run's checkpoint, and generate with transformers from the export with the demo's tokenizer.

The demo config's one shared expert is overridden to 0: it is ungated, and no supported Hugging
Face architecture has an ungated shared expert (the export refuses it, tests/test_hf_convert.py).
Also: each configs/finetune-*.yaml (Qwen3-MoE, DeepSeek-V3, GLM-4.5, GPT-OSS) describes the model
tools/make_hf_model.py builds from it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetrain.config import load_config
from moetrain.hf.__main__ import main as hf_main
from moetrain.hf.arch import choose_architecture
from moetrain.model.transformer import Transformer
from moetrain.train.weights import CheckpointReader, check_init_from

from multiproc import run_distributed

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
DEMO_SMALL = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=128",
              "moe.ffn_hidden=64", "moe.shared_experts=0"]


def make_hf_model():
    spec = importlib.util.spec_from_file_location("make_hf_model", ROOT / "tools" / "make_hf_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_hf_model


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo")
    prep = subprocess.run([sys.executable, "tools/prepare_demo.py", "--root", str(root)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr
    return root


@pytest.mark.slow
def test_demo_finetunes_from_an_imported_model_and_exports(demo_data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sets = DEMO_SMALL + [f"data.path={demo_data / 'shards'}"]
    cfg = load_config(ROOT / "configs" / "demo-moe.yaml", sets)
    make_hf_model()(cfg, tmp_path / "hf", "mixtral", seed=1)
    assert hf_main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "init")]) == 0

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "moetrain.submit", "--config", "configs/demo-moe.yaml",
           *[a for s in sets for a in ("--set", s)], "--set", f"run.dir={run_dir}",
           "--set", f"checkpoint.init_from={tmp_path / 'init'}", "--set", "train.steps=3",
           "--set", "train.val_every=0", "--set", "train.warmup_steps=1", "--set", "checkpoint.every=0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = [json.loads(line)["event"] for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events[:2] == ["initialised", "started"] and "finished" in events

    assert hf_main(["export", str(run_dir / "checkpoints"), "--out", str(tmp_path / "export")]) == 0
    export = tmp_path / "export"
    assert json.loads((export / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(export)
    # The ids are the shipped (run's) tokenizer's, not the imported Mixtral's (its eos 2 is another token here).
    for f in ("config.json", "generation_config.json"):
        conf = json.loads((export / f).read_text())
        assert conf["eos_token_id"] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
        assert conf.get("bos_token_id") is None and conf.get("pad_token_id") is None
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    prompt = tokenizer("To be, or not to be", return_tensors="pt").input_ids
    out = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, prompt.shape[1] + 5)
    assert tokenizer.decode(out[0]).startswith("To be, or not to be")

    # The first generated token is moetrain's own greedy choice for the prompt.
    run_cfg = load_config(run_dir / "config.yaml")
    ours = Transformer.from_config(run_cfg)
    reader = CheckpointReader(run_dir / "checkpoints", progress=False)
    ours.load_state_dict(reader.read(list(reader.shapes)), strict=True)
    with torch.no_grad():
        assert ours.eval()(prompt)[0, -1].argmax().item() == out[0, prompt.shape[1]].item()


# Training choices that a Hugging Face config does not hold (import writes moetrain's defaults).
TRAINING_ONLY = ("aux_loss_coef", "z_loss_coef", "bias_update_rate")
FINETUNE = {"finetune-qwen3-moe": "Qwen3MoeForCausalLM", "finetune-deepseek-v3": "DeepseekV3ForCausalLM",
            "finetune-glm4-moe": "Glm4MoeForCausalLM", "finetune-gpt-oss": "GptOssForCausalLM"}


@pytest.mark.parametrize("name", list(FINETUNE))
def test_finetune_config_matches_the_model_built_from_it(name, demo_data, tmp_path):
    """Each fine-tuning example describes the model its documented commands build and import;
    its first training step runs from those weights."""
    import dataclasses

    cfg = load_config(ROOT / "configs" / f"{name}.yaml", [f"data.path={demo_data / 'shards'}",
                                                           f"checkpoint.init_from={tmp_path / 'init'}"])
    assert choose_architecture(cfg).name == FINETUNE[name]
    make_hf_model()(cfg, tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [FINETUNE[name]]
    assert hf_main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "init"),
                    "--config", str(tmp_path / "import.yaml")]) == 0
    check_init_from(cfg)  # names and shapes fit the config as written
    imported = load_config(tmp_path / "import.yaml")
    moe = dataclasses.replace(imported.moe, **{k: getattr(cfg.moe, k) for k in TRAINING_ONLY})
    assert imported.model == cfg.model and moe == cfg.moe
    one = cfg.replace(parallel={"dp": 1, "ep": 1}, run={"dir": str(tmp_path / "run")},
                      train={"steps": 1, "val_every": 0, "global_batch_size": 2})
    assert 0 < run_distributed(one_step, 1, one)[0] < 20


def one_step(rank: int, world: int, cfg) -> float:
    from moetrain.train.trainer import Trainer

    return Trainer(cfg, write_files=False).train_step().loss


def lora_steps(rank: int, world: int, cfg) -> list[float]:
    from moetrain.train.trainer import Trainer

    trainer = Trainer(cfg, write_files=False)
    losses = [trainer.train_step().loss for _ in range(cfg.train.steps)]
    trainer.save_checkpoint()
    trainer.checkpointer.wait()
    return losses


def test_the_lora_example_trains_and_exports_both_ways(demo_data, tmp_path):
    """configs/lora-finetune-qwen3-moe.yaml over configs/finetune-qwen3-moe.yaml: its commands —
    import, 3 steps of LoRA on an FP8 base in dp2 × ep2, ``export --merge`` and ``export --lora``.
    transformers' merged model gives the logits of moetrain's adapted model on its FP8 base (in
    one process, fp32); PEFT loads the adapters onto the imported model and they move its logits
    (their exact equality is tests/test_lora.py's, on an unrounded base)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from moetrain.config import save_config
    from moetrain.model.layers import set_compute_dtype
    from moetrain.model.lora import add_adapters, convert_base
    from moetrain.train.weights import load_weights_dir

    files = [ROOT / "configs" / "finetune-qwen3-moe.yaml", ROOT / "configs" / "lora-finetune-qwen3-moe.yaml"]
    cfg = load_config(files, [f"data.path={demo_data / 'shards'}", f"checkpoint.init_from={tmp_path / 'init'}",
                              f"run.dir={tmp_path / 'run'}", "train.steps=3", "train.val_every=0",
                              "checkpoint.every=0", "checkpoint.async=false"])
    assert cfg.train.lora.base_dtype == "fp8" and cfg.train.lora.r == 16
    make_hf_model()(cfg, tmp_path / "hf")
    assert hf_main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "init")]) == 0
    losses = run_distributed(lora_steps, 2, cfg)[0]
    assert all(0 < x < 20 for x in losses)
    save_config(cfg, tmp_path / "run.yaml")
    ckpts = str(tmp_path / "run" / "checkpoints")
    conf = ["--config", str(tmp_path / "run.yaml")]
    assert hf_main(["export", ckpts, "--lora", "--out", str(tmp_path / "adapter"), *conf]) == 0
    assert hf_main(["export", ckpts, "--merge", "--dtype", "float32", "--out", str(tmp_path / "merged"), *conf]) == 0

    ours = Transformer.from_config(cfg)  # the run's model in one process: FP8 base + the adapters
    add_adapters(ours, cfg.train.lora)
    convert_base(ours, "fp8", cfg.train.fp8_block)
    load_weights_dir(tmp_path / "init", [ours])
    set_compute_dtype(ours, torch.float32)  # the bf16-stored parts computed in fp32, as the merged model is
    reader = CheckpointReader(ckpts, progress=False)
    ours.load_state_dict(reader.read(list(reader.shapes)), strict=False)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, 8192, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, plain = ours.eval()(ids), merged(ids).logits, base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (adapted - plain).abs().max() > 1e-3, "PEFT must apply the trained adapters"
