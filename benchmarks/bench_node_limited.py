"""Inter-node all-to-all bytes with and without node-limited routing, with the flat and the
hierarchical token dispatcher, on a real SLURM allocation of 2 nodes (the dev cluster:
``slurm/dev-cluster up``). Prints JSON.

The demo model trained ``--steps`` steps at dp = 4 × ep = 4 over 2 nodes × 2 tasks with
``moe.max_nodes_per_token`` null or 1 and ``moe.token_dispatcher`` alltoall or hierarchical; the
rank map puts each node's two ranks in one NVLink domain, so an ep group spans 2 domains of 4
experts. Reported per variant: the mean bytes per step that the forward dispatch sent within a
domain and across domains (``dispatch_bytes`` in metrics.jsonl), the inter-node fraction, and the
losses; the baseline is the flat dispatcher without the limit, in the same invocation.

    slurm/dev-cluster up && python tools/prepare_demo.py
    python benchmarks/bench_node_limited.py [--steps 12]
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


def run(steps: int, run_dir: Path, limit: str, dispatcher: str) -> list[dict]:
    sets = ["launch.cluster=slurm", "launch.nodes=2", "parallel.dp=4", "parallel.ep=4", f"train.steps={steps}",
            "train.val_every=0", "checkpoint.every=0", "checkpoint.resume=false", f"run.dir={run_dir}",
            f"moe.max_nodes_per_token={limit}", f"moe.token_dispatcher={dispatcher}", "launch.time_min=20"]
    cmd = [sys.executable, "-m", "moetrain.submit", "--config", "configs/demo-moe.yaml",
           *sum((["--set", s] for s in sets), [])]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    out: dict = {"steps": a.steps, "layout": "2 nodes x 2 tasks, dp4 x ep4, 8 experts top-2"}
    with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as tmp:
        for name, limit, dispatcher in (("alltoall", "null", "alltoall"), ("alltoall_m1", "1", "alltoall"),
                                        ("hierarchical", "null", "hierarchical"),
                                        ("hierarchical_m1", "1", "hierarchical")):
            recs = run(a.steps, Path(tmp) / name, limit, dispatcher)
            intra = statistics.mean(r["dispatch_bytes"]["intra_node"] for r in recs)
            inter = statistics.mean(r["dispatch_bytes"]["inter_node"] for r in recs)
            out[name] = {"intra_node_bytes_per_step": round(intra), "inter_node_bytes_per_step": round(inter),
                         "inter_fraction": round(inter / (intra + inter), 3),
                         "loss_first_last": [round(recs[0]["loss"], 4), round(recs[-1]["loss"], 4)]}
    base = out["alltoall"]["inter_node_bytes_per_step"]
    out["inter_node_over_alltoall"] = {name: round(out[name]["inter_node_bytes_per_step"] / base, 3)
                                       for name in ("alltoall_m1", "hierarchical", "hierarchical_m1")}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
