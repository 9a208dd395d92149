"""bf16 mixed precision vs fp32 on a real run: the same config trained twice through
``python -m moetrain.submit`` (every process, the real loader and logging), once per
``train.precision``, from the same initial weights and data. Prints JSON: per-step and
validation losses side by side, their largest relative difference, the mean over the last 10
steps, and the bf16/fp32 step-time ratio.

    python tools/prepare_demo.py
    python benchmarks/bench_precision.py [--config configs/demo-moe.yaml --steps 150]

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


def run(config: str, precision: str, steps: int, run_dir: Path, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "moetrain.submit", "--config", config, "--set", f"train.precision={precision}",
           "--set", f"train.steps={steps}", "--set", f"run.dir={run_dir}", "--set", "checkpoint.every=0",
           "--set", "checkpoint.resume=false", *sum((["--set", s] for s in extra), [])]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo-moe.yaml")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--set", dest="extra", action="append", default=[], help="more config overrides")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        recs = {p: run(a.config, p, a.steps, Path(tmp) / p, a.extra) for p in ("fp32", "bf16")}
    f, b = recs["fp32"], recs["bf16"]
    rel = [abs(y["loss"] - x["loss"]) / x["loss"] for x, y in zip(f, b)]
    val = [(x["step"], x["val_loss"], y["val_loss"]) for x, y in zip(f, b) if "val_loss" in x]

    def tail(r: list[dict]) -> float:
        return statistics.mean(x["loss"] for x in r[-10:])

    step_time = {p: statistics.median(x["step_time_s"] for x in r[2:]) for p, r in recs.items()}
    print(json.dumps({
        "config": a.config, "steps": a.steps, "extra": a.extra,
        "loss_fp32": [round(x["loss"], 4) for x in f], "loss_bf16": [round(x["loss"], 4) for x in b],
        "max_step_rel_diff": round(max(rel), 5), "mean_step_rel_diff": round(statistics.mean(rel), 5),
        "last10_mean": {"fp32": round(tail(f), 4), "bf16": round(tail(b), 4),
                        "rel_diff": round(abs(tail(b) - tail(f)) / tail(f), 5)},
        "val_loss": [{"step": s, "fp32": round(x, 4), "bf16": round(y, 4), "rel_diff": round(abs(y - x) / x, 5)}
                     for s, x, y in val],
        "step_time_s": {k: round(v, 3) for k, v in step_time.items()},
        "bf16_over_fp32_step_time": round(step_time["bf16"] / step_time["fp32"], 3),
    }, indent=1))


if __name__ == "__main__":
    main()
