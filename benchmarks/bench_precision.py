"""Precisions against each other on a real run: the same config trained once per precision
through ``python -m moetrain.submit`` (every process, the real loader and logging), from the
same initial weights and data. ``--precisions``: the first is the baseline; ``fp8-RECIPE`` is
``train.precision: fp8`` with ``train.fp8_recipe: RECIPE`` (``fp8`` alone: tensorwise).
Prints JSON: each run's per-step and validation losses, their largest and mean relative
difference from the baseline, the mean over the last 10 steps, the baseline's own noise (the
median relative step-to-step change of its loss, steps 50 on), and step times as ratios to the
baseline's.

    python tools/prepare_demo.py
    python benchmarks/bench_precision.py [--config configs/demo-moe.yaml --steps 150]
    python benchmarks/bench_precision.py --precisions bf16,fp8,fp8-unscaled

On this CPU the bf16 matmuls run through oneDNN (AVX512-BF16 where the CPU has it); the speed
ratio says nothing about a GPU's tensor cores. ``tests/test_precision.py`` shows on a small
model that casting the whole model and optimizer to bf16 drifts ≥ 3× further than this.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def overrides(name: str) -> list[str]:
    """``--set`` values of a precision name: fp32, bf16, fp8 or fp8-RECIPE."""
    precision, _, recipe = name.partition("-")
    return [f"train.precision={precision}", *([f"train.fp8_recipe={recipe}"] if recipe else [])]


def run(config: str, name: str, steps: int, run_dir: Path, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "moetrain.submit", "--config", config, *sum((["--set", s] for s in overrides(name)), []),
           "--set", f"train.steps={steps}", "--set", f"run.dir={run_dir}", "--set", "checkpoint.every=0",
           "--set", "checkpoint.resume=false", *sum((["--set", s] for s in extra), [])]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo-moe.yaml")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--precisions", default="fp32,bf16", help="comma-separated; the first is the baseline")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="more config overrides")
    a = ap.parse_args()
    names = a.precisions.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        recs = {p: run(a.config, p, a.steps, Path(tmp) / p, a.extra) for p in names}
    base = recs[names[0]]

    def tail(r: list[dict]) -> float:
        return statistics.mean(x["loss"] for x in r[-10:])

    late = [x["loss"] for x in base[49:]]
    noise = statistics.median(abs(b - a) / a for a, b in zip(late, late[1:])) if len(late) > 1 else None
    step_time = {p: statistics.median(x["step_time_s"] for x in r[2:]) for p, r in recs.items()}
    runs = {}
    for p, r in recs.items():
        rel = [abs(y["loss"] - x["loss"]) / x["loss"] for x, y in zip(base, r)]
        runs[p] = {
            "loss": [round(x["loss"], 4) for x in r],
            "val_loss": {x["step"]: round(x["val_loss"], 4) for x in r if "val_loss" in x},
            "max_step_rel_diff": round(max(rel), 5), "mean_step_rel_diff": round(statistics.mean(rel), 5),
            "last10_mean": round(tail(r), 4), "last10_rel_diff": round(abs(tail(r) - tail(base)) / tail(base), 5),
            "max_val_rel_diff": round(max([abs(y["val_loss"] - x["val_loss"]) / x["val_loss"] for x, y in zip(base, r)
                                           if "val_loss" in x and "val_loss" in y] or [0.0]), 5),
            "step_time_s": round(step_time[p], 3), "step_time_vs_baseline": round(step_time[p] / step_time[names[0]], 3),
        }
    print(json.dumps({"config": a.config, "steps": a.steps, "extra": a.extra, "baseline": names[0],
                      "baseline_noise_median_step_change": None if noise is None else round(noise, 5),
                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
