"""``torchrun ... -m moetrain.run``: the trainer under torchrun trains the same losses as
``submit`` in the same layout (dp 2 × ep 2, 20 steps, the tiny MoE), resolves ``parallel.dp: auto``
from the ranks torchrun started, and refuses a layout the started ranks cannot fill (one line,
exit 2). About 40 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moetrain.config import to_dict

from conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("MOETRAIN_FAULT_HOOK", None)
    return env


def _config(path: Path, shards: Path, run_dir: Path) -> Path:
    cfg = tiny_config(shards, run_dir, parallel={"dp": 2, "ep": 2}, train={"steps": STEPS})
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           "-m", "moetrain.run", *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_torchrun_trains_the_same_losses_as_submit(tiny_shards, tmp_path):
    config = _config(tmp_path / "tiny.yaml", tiny_shards, tmp_path / "submit")
    ref = subprocess.run([sys.executable, "-m", "moetrain.submit", "--config", str(config)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
    run = _torchrun(2, "--config", str(config), "--set", "parallel.dp=auto", "--set", f"run.dir={tmp_path / 'tr'}")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    a, b = _metrics(tmp_path / "submit"), _metrics(tmp_path / "tr")
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    # Same layout, same threads per rank (1: 2 cores / 2 local ranks), same data order: the same
    # numbers to the last bit; a relative 1e-6 leaves room only for a reordered reduction.
    for x, y in zip(a, b):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert abs(x[key] - y[key]) <= 1e-6 * max(1.0, abs(x[key])), (x["step"], key, x[key], y[key])
    assert a[-1]["loss"] < a[0]["loss"] - 0.5, "the run learned something (a test that cannot fail otherwise)"
    resolved = (tmp_path / "tr" / "config.yaml").read_text()
    assert "dp: 2  # auto: 2 ranks started = 2 ÷ (tp 1 × pp 1 × cp 1)" in resolved
    rank1 = json.loads(next((tmp_path / "tr" / "environment").glob("attempt*/rank00001.json")).read_text())
    assert rank1["variables"]["WORLD_SIZE"] == "2" and rank1["variables"]["LOCAL_RANK"] == "1"


@pytest.mark.slow
def test_layout_the_started_ranks_cannot_fill_is_refused(tiny_shards, tmp_path):
    config = _config(tmp_path / "tiny.yaml", tiny_shards, tmp_path / "run")
    run = _torchrun(1, "--config", str(config))
    assert run.returncode != 0
    assert ("config error: parallel.dp = 2: the layout pp 1 × dp 2 × cp 1 × tp 1 needs 2 ranks, but the launcher "
            "started 1. Fix: set parallel.dp: auto") in run.stderr
    assert not (tmp_path / "run").exists(), "nothing written"


def test_run_outside_a_launcher_says_how_to_start_it(tmp_path):
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID")}
    out = subprocess.run([sys.executable, "-m", "moetrain.run", "--config", "configs/demo-moe.yaml"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not started by torchrun" in out.stderr and "torchrun --nproc-per-node" in out.stderr
