"""Expert load balancing on a real run: the same config trained through ``python -m
moetrain.submit`` with the Switch aux loss only, the aux-loss-free bias only (DeepSeek-V3
§2.1.2), and both. Prints JSON: the max/mean expert load (averaged over the MoE layers) and the
loss at a few steps, and their means over the last 20 steps; the baseline is the aux-loss run,
measured in the same run.

    python tools/prepare_demo.py
    python benchmarks/bench_balancing.py [--config configs/demo-moe.yaml --steps 100 --rate 0.001]
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


def run(config: str, steps: int, run_dir: Path, extra: list[str]) -> list[dict]:
    sets = [f"train.steps={steps}", f"run.dir={run_dir}", "checkpoint.every=0", "checkpoint.resume=false", *extra]
    cmd = [sys.executable, "-m", "moetrain.submit", "--config", config, *sum((["--set", s] for s in sets), [])]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def load_ratio(rec: dict) -> float:
    """max/mean tokens per expert, averaged over the MoE layers."""
    return statistics.mean(v["max_over_mean"] for v in rec["expert_load"].values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo-moe.yaml")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rate", type=float, default=0.001, help="moe.bias_update_rate (DeepSeek-V3: 0.001)")
    a = ap.parse_args()
    variants = {
        "aux_loss_only": ["moe.bias_update_rate=0"],
        "bias_only": ["moe.aux_loss_coef=0", f"moe.bias_update_rate={a.rate}"],
        "aux_loss_and_bias": [f"moe.bias_update_rate={a.rate}"],
    }
    out: dict = {"config": a.config, "steps": a.steps, "bias_update_rate": a.rate}
    marks = [s for s in (1, 10, 25, 50, 75, 100, 150, 200) if s <= a.steps]
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in variants.items():
            recs = run(a.config, a.steps, Path(tmp) / name, extra)
            last = recs[-20:]
            out[name] = {
                "max_over_mean": {s: round(load_ratio(recs[s - 1]), 3) for s in marks},
                "loss": {s: round(recs[s - 1]["loss"], 4) for s in marks},
                "last20_max_over_mean": round(statistics.mean(load_ratio(r) for r in last), 3),
                "last20_loss": round(statistics.mean(r["loss"] for r in last), 4),
                "val_loss": {r["step"]: round(r["val_loss"], 4) for r in recs if "val_loss" in r},
            }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
