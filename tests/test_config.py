"""Every config error names the field, the value and the fix — and is raised before any process."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moetrain.config import ConfigError, Config, apply_overrides, config_from_dict, load_config, save_config, to_dict

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_valid_and_frozen():
    cfg = config_from_dict({})
    assert isinstance(cfg, Config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 3
    assert cfg.train.steps == config_from_dict({}).train.steps


def test_demo_config_loads_with_overrides():
    cfg = load_config(ROOT / "configs/demo-moe.yaml", ["train.steps=7", "parallel.ep=4", "run.dir=/tmp/x"])
    assert (cfg.train.steps, cfg.parallel.ep, cfg.run.dir) == (7, 4, "/tmp/x")
    assert cfg.launch.resolved_tasks_per_node(cfg.world_size) == 4  # follows from the parallel sizes


@pytest.mark.parametrize("data, field, words", [
    ({"train": {"stpes": 3}}, "train.stpes", ["unknown key", "did you mean train.steps"]),
    ({"modle": {}}, "modle", ["unknown section", "model"]),
    ({"train": {"init_from": "/w"}}, "train.init_from", ["unknown key", "belongs to the checkpoint section",
                                                         "checkpoint.init_from"]),
    ({"train": {"steps": "ten"}}, "train.steps", ["expected an integer"]),
    ({"train": {"lr": "fast"}}, "train.lr", ["expected a number"]),
    ({"model": {"tie_embeddings": "yes"}}, "model.tie_embeddings", ["true or false"]),
    ({"launch": {"cluster": "k8s"}}, "launch.cluster", ["'local'", "'slurm'"]),
    ({"parallel": {"dp": 4}, "launch": {"tasks_per_node": 2}}, "launch.tasks_per_node",
     ["world size", "tasks_per_node=4"]),
    ({"moe": {"num_experts": 6}, "parallel": {"dp": 4, "ep": 4}}, "parallel.ep",
     ["num_experts=6 is not divisible", "choose ep among 1, 2"]),
    ({"parallel": {"dp": 2, "ep": 4}}, "parallel.ep", ["must divide", "dp × cp"]),
    ({"model": {"heads": 8, "kv_heads": 3}}, "model.kv_heads", ["not divisible", "choose kv_heads among"]),
    ({"parallel": {"dp": 2}, "train": {"global_batch_size": 10, "micro_batch_size": 2}},
     "train.global_batch_size", ["micro_batch_size × dp", "multiple of 4"]),
    ({"model": {"hidden": 250, "heads": 8}}, "model.hidden", ["not divisible by model.heads"]),
    ({"moe": {"top_k": 9}}, "moe.top_k", ["more than moe.num_experts"]),
    ({"parallel": {"tp": 3}}, "parallel.tp", ["not divisible", "choose tp"]),
    ({"train": {"steps": 0}}, "train.steps", ["must be positive"]),
    ({"launch": {"nodes": 2}, "parallel": {"dp": 2}}, "launch.nodes", ["local executor"]),
    ({"model": {"head_dim": 7}}, "model.head_dim", ["positive even", "null for hidden / heads"]),
    ({"model": {"qk_norm": "layer"}}, "model.qk_norm", ["'none'", "'head'", "'projection'"]),
    ({"model": {"rope_scaling": "llama3", "rope_high_freq_factor": 0.5}}, "model.rope_high_freq_factor",
     ["must be at least model.rope_low_freq_factor"]),
    ({"moe": {"shared_ffn_hidden": 64}}, "moe.shared_ffn_hidden", ["moe.shared_experts = 0"]),
    ({"moe": {"shared_expert_gate": True}}, "moe.shared_expert_gate", ["no shared experts to gate"]),
    ({"checkpoint": {"init_from": " "}}, "checkpoint.init_from", ["an empty path"]),
])
def test_config_errors_name_field_value_and_fix(data, field, words):
    with pytest.raises(ConfigError) as exc:
        config_from_dict(data)
    msg = str(exc.value)
    assert msg.startswith(f"{field} = "), msg
    assert "Fix:" in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides({}, ["train.steps"])
    with pytest.raises(ConfigError, match="section.key"):
        apply_overrides({}, ["steps=3"])
    with pytest.raises(ConfigError, match=r"^trian.steps = 3: unknown section 'trian' in --set. Fix: did you mean "
                                          r"train.steps\?"):
        apply_overrides({}, ["trian.steps=3"])
    with pytest.raises(ConfigError, match=r"^modle.hidden = 64: .*Fix: did you mean model.hidden\?"):
        apply_overrides({}, ["modle.hidden=64"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(ROOT / "configs/demo-moe.yaml", ["train.steps=3"])
    save_config(cfg, tmp_path / "config.yaml")
    again = config_from_dict(yaml.safe_load((tmp_path / "config.yaml").read_text()))
    assert to_dict(again) == to_dict(cfg)


def test_submit_refuses_bad_config_before_starting_anything(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "moetrain.submit", "--config", str(ROOT / "configs/demo-moe.yaml"),
                           "--set", "parallel.ep=3", "--set", f"run.dir={run_dir}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "parallel.ep = 3" in proc.stderr and "Fix:" in proc.stderr
    assert not run_dir.exists(), "a refused config must not create the run directory"


def test_submit_refuses_missing_data(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moetrain.submit", "--config", str(ROOT / "configs/demo-moe.yaml"),
                           "--set", f"data.path={tmp_path / 'nowhere'}", "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "data.path" in proc.stderr and "prepare_demo" in proc.stderr


def test_exponent_without_a_dot_is_a_number():
    """PyYAML (YAML 1.1) reads `3e-4` as a string; a float field takes it as the number it is, in a
    file and in --set, and still refuses words."""
    cfg = load_config(ROOT / "configs/demo-moe.yaml", ["train.lr=3e-4", "train.min_lr=+2E-5", "train.weight_decay=.5"])
    assert (cfg.train.lr, cfg.train.min_lr, cfg.train.weight_decay) == (3e-4, 2e-5, 0.5)
    assert config_from_dict({"train": {"lr": "1e-3"}}).train.lr == 1e-3
    for bad in ("fast", "1e", "nan"):
        with pytest.raises(ConfigError, match="train.lr"):
            load_config(ROOT / "configs/demo-moe.yaml", [f"train.lr={bad}"])
