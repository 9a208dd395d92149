"""``train.compile``: step time of the trainer with compiled blocks against eager, same model and
batches, measured in the same run (alternating rounds, medians). Prints JSON, including what the
compilation itself cost (the first steps). One process, or ``--tp N`` processes in tensor
parallelism (there only the DTensor-free regions compile, see moetrain.parallel.compile; rank 0's
times).

    python tools/prepare_demo.py
    python benchmarks/bench_compile.py [--config configs/demo-moe.yaml --steps 4 --rounds 3 --tp 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from moetrain.config import load_config  # noqa: E402
from moetrain.launch.preflight import resolve_vocab  # noqa: E402
from multiproc import free_port, run_distributed  # noqa: E402


def measure(rank: int, world: int, a: argparse.Namespace) -> dict:
    from moetrain.train.trainer import Trainer

    torch.set_num_threads(a.threads)
    sp = ["parallel.sequence_parallel=true"] if a.sp else []
    trainers, first = {}, {}
    for mode in ("eager", "compiled"):
        cfg = resolve_vocab(load_config(a.config, [
            "parallel.dp=1", "parallel.ep=1", f"parallel.tp={world}", *sp, f"train.precision={a.precision}",
            "train.val_every=0", "checkpoint.every=0", "checkpoint.resume=false", f"train.compile={mode == 'compiled'}",
            f"data.path={a.data}", "data.verify=size", f"run.dir={tempfile.mkdtemp()}"]))
        trainers[mode] = Trainer(cfg, write_files=False)
        t0 = time.perf_counter()
        for _ in range(3):  # compilation and the recompilation for dynamic shapes
            trainers[mode].train_step()
        first[mode] = time.perf_counter() - t0
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for _ in range(a.rounds):
        for mode, trainer in trainers.items():
            t0 = time.perf_counter()
            for _ in range(a.steps):
                trainer.train_step()
            times[mode].append((time.perf_counter() - t0) / a.steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"config": a.config, "precision": a.precision, "tp": world, "sequence_parallel": a.sp,
            "threads": a.threads, "first_3_steps_s": {k: round(v, 2) for k, v in first.items()},
            "step_s": {k: round(v, 4) for k, v in med.items()},
            "compiled_over_eager": round(med["compiled"] / med["eager"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/demo-moe.yaml"))
    ap.add_argument("--data", default=str(ROOT / "data/demo/shards"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel processes (1: one process, no tp)")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per process (default: cores / tp)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    a = ap.parse_args()
    if not (Path(a.data) / "manifest.json").is_file():
        sys.exit(f"no token shards in {a.data}: run `python tools/prepare_demo.py` first")
    a.threads = a.threads or max(1, len(os.sched_getaffinity(0)) // a.tp)
    if a.tp == 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        out = measure(0, 1, a)
    else:
        out = run_distributed(measure, a.tp, a, timeout=3600)[0]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
