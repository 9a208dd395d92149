"""The demo config itself trains for a few steps through `python -m moetrain.submit`
(submitit's local executor, 4 gloo processes, dp=4 × ep=2), on the real demo data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_trains_through_submit(tmp_path):
    data = tmp_path / "demo"
    prep = subprocess.run([sys.executable, "tools/prepare_demo.py", "--root", str(data)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "moetrain.submit", "--config", "configs/demo-moe.yaml",
           "--set", f"run.dir={run_dir}", "--set", f"data.path={data / 'shards'}", "--set", "train.steps=3",
           "--set", "train.val_every=3", "--set", "train.warmup_steps=1", "--set", "checkpoint.every=0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 3/3" in proc.stdout and "run done" in proc.stdout

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "expert_load"):
        assert key in records[0], key
    assert records[-1]["loss"] < records[0]["loss"], "the demo loss must fall"
    assert "val_loss" in records[-1]
    loads = records[0]["expert_load"]
    assert len(loads) == 4 and all(len(v["tokens"]) == 8 for v in loads.values())
    # Tokens per expert add up to every token's top-2 choices: 16 samples × 256 tokens × 2.
    assert all(sum(v["tokens"]) == 16 * 256 * 2 for v in loads.values())

    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["model"]["vocab_size"] == 8192  # resolved from the manifest
    assert (run_dir / "checkpoints" / "step_00000003" / "manifest.json").is_file()
    assert json.loads((run_dir / "submission.json").read_text())["jobs"]
