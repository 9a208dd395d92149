"""Padding not routed (``moe.route_padding: false``, the default) against routed, on the demo's
fine-tuning run. Prints JSON.

The model, layout and batch of ``configs/finetune-chat.yaml`` (4 layers, hidden 256, 8 experts,
top-2, sequences of 256, dp 2 × ep 2, 2 gloo processes with one thread each, micro-batch 2,
global batch 16), from random weights, on the demo's chats packed into sequences of 256 tokens
(``data/demo/chat/shards``; built with the demo's tools when missing). Rounds alternate routed /
not routed; the step times are medians. Per step it counts what the MoE layers move and compute:
the dispatch all-to-all's bytes (the trainer's ``dispatch_bytes``, all ranks) and the token-expert
rows the routed experts compute (the sum of the expert loads over layers), and each ratio is
not routed / routed in the same run.

    python benchmarks/bench_padding.py [--rounds 3 --steps 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import tiny_config  # noqa: E402
from multiproc import run_distributed  # noqa: E402

DATA = ROOT / "data" / "demo" / "chat" / "shards"
MODEL = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "ffn_hidden": 688, "vocab_size": 8192,
         "seq_len": 256, "tie_embeddings": False}
MOE = {"num_experts": 8, "top_k": 2, "every": 1, "ffn_hidden": 256, "shared_experts": 0}


def build_data(out: Path) -> None:
    """The demo's chats tokenized and packed as the README's fine-tuning commands do."""
    chat = out.parent
    for cmd in (["tools/prepare_demo.py"], ["tools/build_demo_chat.py", "--out", str(chat)],
                ["tools/tokenize_corpus.py", "--input", str(chat / "chats.jsonl.zst"), "--tokenizer",
                 "data/demo/tokenizer.json", "--chat", "--chat-template", str(chat / "chat_template.jinja"),
                 "--seq-len", "256", "--out", str(out), "--quiet"]):
        subprocess.run([sys.executable, *cmd], cwd=ROOT, check=True)


def _bench(rank: int, world: int, data: str, run_dir: str, rounds: int, steps: int) -> dict:
    from moetrain.train.trainer import Trainer

    torch.set_num_threads(1)
    trainers = {}
    for routed in (True, False):
        cfg = tiny_config(data, f"{run_dir}/{routed}", model=MODEL, moe={**MOE, "route_padding": routed},
                          parallel={"dp": 2, "ep": 2}, data={"loss_mask": True, "document_mask": True},
                          train={"steps": 10_000, "micro_batch_size": 2, "global_batch_size": 16, "grad_clip": 1.0})
        trainers[routed] = Trainer(cfg, write_files=False)
        trainers[routed].train_step()  # warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    moved: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(rounds):
        for routed in (True, False):
            dist.barrier()
            t0 = time.perf_counter()
            results = [trainers[routed].train_step() for _ in range(steps)]
            dist.barrier()
            times[routed].append((time.perf_counter() - t0) / steps)
            for r in results:
                moved[routed].append({"bytes": sum(r.extra["dispatch_bytes"].values()),
                                      "rows": sum(sum(v["tokens"]) for v in r.extra["expert_load"].values())})
    out = {}
    for key in ("bytes", "rows"):
        per_step = {routed: statistics.median(m[key] for m in moved[routed]) for routed in moved}
        out[f"dispatch_{key}_per_step" if key == "bytes" else "expert_rows_per_step"] = {
            "routed": per_step[True], "not_routed": per_step[False], "not_routed_over_routed":
                per_step[False] / per_step[True]}
    # Every token is routed to top_k experts when routed: the rows not routed are the padding.
    out["padding_fraction"] = 1 - sum(m["rows"] for m in moved[False]) / sum(m["rows"] for m in moved[True])
    off, on = statistics.median(times[True]), statistics.median(times[False])
    out["step_s"] = {"routed": off, "not_routed": on, "not_routed_over_routed": on / off}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--data", type=Path, default=DATA, help="packed chat shards (default: %(default)s)")
    args = ap.parse_args()
    if not (args.data / "manifest.json").exists():
        build_data(args.data)
    with tempfile.TemporaryDirectory() as tmp:
        res = run_distributed(_bench, 2, str(args.data), tmp, args.rounds, args.steps, timeout=1800)
    print(json.dumps({"bench": "padding", "layout": "dp2 x ep2, gloo over loopback, 1 thread per rank",
                      "model": "configs/finetune-chat.yaml's", **res[0]}, indent=1))


if __name__ == "__main__":
    main()
