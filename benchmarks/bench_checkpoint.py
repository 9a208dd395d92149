"""Step-time stall per checkpoint, synchronous vs asynchronous (``checkpoint.async``), measured in
the same processes. Prints JSON.

The demo model (configs/demo-moe.yaml: 4 blocks, hidden 256, 8 experts + 1 shared, vocabulary
8192) at dp 2 × ep 2 in 2 gloo processes on CPU (``--procs 1``: one process, which leaves the
background a core of its own on a 2-core machine, as a GPU job leaves its host's cores mostly
idle). Each round, for each mode (alternating):

1. ``--steps`` steps without a checkpoint: the baseline seconds per step;
2. a checkpoint, then ``--steps`` steps, then waiting for the checkpoint to be committed: the
   window.

The stall of a checkpoint is window − steps × baseline: what the checkpoint cost the run when
checkpoints are ``--steps`` steps apart. Synchronous: stage, write, hash and commit inside the
save call. Asynchronous: the save call stages to host memory; the write, each rank's hashing of
its own files and rank 0's commit run in the background while the steps go on (on this 2-core
machine they compete with the training threads for the cores). Also reported: how long the save
call itself blocked (``save_call_s``) and how long the background part took (``background_s``).

    python tools/prepare_demo.py   # once: the demo shards
    python benchmarks/bench_checkpoint.py [--data data/demo/shards --steps 4 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from moetrain.config import load_config  # noqa: E402
from moetrain.launch.preflight import resolve_vocab  # noqa: E402
from multiproc import run_distributed  # noqa: E402


def _steps(trainer, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        trainer.train_step()
    return time.perf_counter() - t0


def bench(rank: int, world: int, a: argparse.Namespace, run_dir: str) -> dict:
    import torch.distributed as dist

    from moetrain.train.trainer import Trainer

    cfg = resolve_vocab(load_config(a.config, [
        f"parallel.dp={a.procs}", f"parallel.ep={a.procs}", "train.val_every=0", "checkpoint.every=0", "checkpoint.resume=false",
        "checkpoint.keep=1", f"train.global_batch_size={a.global_batch}", f"data.path={a.data}", "data.verify=size",
        f"run.dir={run_dir}"]))
    trainer = Trainer(cfg, write_files=False)
    _steps(trainer, 2)  # warm-up
    out: dict[str, dict[str, list[float]]] = {m: {"step_s": [], "stall_s": [], "save_call_s": [], "background_s": []}
                                              for m in ("sync", "async")}
    for _ in range(a.rounds):
        for mode in ("sync", "async"):
            trainer.checkpointer.async_save = mode == "async"
            dist.barrier()
            base = _steps(trainer, a.steps) / a.steps
            dist.barrier()
            t0 = time.perf_counter()
            trainer.save_checkpoint(wait=mode == "sync")
            call = time.perf_counter() - t0
            _steps(trainer, a.steps)
            trainer.checkpointer.wait()
            window = time.perf_counter() - t0
            dist.barrier()
            rec = out[mode]
            rec["step_s"].append(base)
            rec["save_call_s"].append(call)
            rec["stall_s"].append(window - a.steps * base)
            rec["background_s"].append(trainer.checkpointer.last_background_s)
    size = sum(f.stat().st_size for f in Path(run_dir, "checkpoints").rglob("*") if f.is_file())
    return {"bytes": size, **out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo-moe.yaml"))
    ap.add_argument("--data", default=str(ROOT / "data" / "demo" / "shards"))
    ap.add_argument("--steps", type=int, default=4, help="steps after each checkpoint (its window)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8, help="sequences of 256 tokens per step")
    ap.add_argument("--procs", type=int, default=2, choices=(1, 2), help="processes: dp = ep = procs")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(bench, a.procs, a, tmp, timeout=3600)
    r0 = results[0]
    med = {m: {k: statistics.median(v) for k, v in r0[m].items()} for m in ("sync", "async")}
    report = {
        "model": f"configs/demo-moe.yaml at dp{a.procs} x ep{a.procs}, {a.procs} process(es), 1 thread each",
        "global_batch": a.global_batch,
        "checkpoint_mb": round(r0["bytes"] / 2**20, 1), "steps_per_window": a.steps, "rounds": a.rounds,
        **{m: {k: round(v, 3) for k, v in med[m].items()} for m in med},
        "stall_ratio_async_over_sync": round(med["async"]["stall_s"] / med["sync"]["stall_s"], 3),
        "save_call_ratio_async_over_sync": round(med["async"]["save_call_s"] / med["sync"]["save_call_s"], 3),
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
