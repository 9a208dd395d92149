"""Device → host reads per optimizer step, per layout and expert backend. Prints JSON.

The tiny MoE of the tests (2 MoE layers, 2 micro-batches per rank) trained in gloo processes on
CPU; one loop iteration (``train_step`` + the stop-flag agreement) counted with
:class:`moetrain.train.host_sync.HostReadCounter` after a warm-up step, on every rank. The
baseline is the floor, ``per_step_floor`` = 2 (the metrics read and the stop flag); each row
gives the reads above it per MoE layer per micro-batch. tests/test_host_syncs.py pins the
layouts it covers.

    python benchmarks/bench_host_syncs.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import ByteTokenizer, _documents, tiny_config  # noqa: E402
from moetrain.data.writer import write_shards  # noqa: E402
from multiproc import run_distributed  # noqa: E402

FLOOR = 2
LAYOUTS = [
    ({}, "loop"), ({}, "grouped_mm"),
    ({"dp": 2}, "loop"), ({"dp": 2, "ep": 2}, "loop"), ({"dp": 2, "ep": 2}, "grouped_mm"),
    ({"tp": 2, "sequence_parallel": True}, "loop"), ({"pp": 2}, "loop"),
    ({"dp": 2, "ep": 2, "zero_stage": 3}, "grouped_mm"), ({"cp": 2}, "loop"),
]


def count(rank: int, world: int, data: str, run_dir: str, parallel: dict, backend: str) -> dict:
    from moetrain.train.host_sync import HostReadCounter
    from moetrain.train.trainer import Trainer

    cfg = tiny_config(data, run_dir, parallel=parallel, moe={"expert_backend": backend},
                      model={"layers": 2, "vocab_size": 260})
    trainer = Trainer(cfg, write_files=False)
    trainer.train_step()
    trainer._stop_agreed()
    with HostReadCounter("cpu") as counter:
        trainer.train_step()
        trainer._stop_agreed()
    return {"reads": counter.count, "kinds": dict(counter.kinds), "micro_batches": cfg.grad_accum_steps,
            "moe_layers": len(trainer.moe_layers)}


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shards"
        write_shards(_documents(200), ByteTokenizer(), data, shard_tokens=30_000, val_docs=10, progress=False)
        for parallel, backend in LAYOUTS:
            world = parallel.get("dp", 1) * parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("cp", 1)
            results = run_distributed(count, world, str(data), str(Path(tmp) / "run"), parallel, backend)
            worst = max(results, key=lambda r: r["reads"])
            per_layer_mb = [(r["reads"] - FLOOR) / max(1, r["moe_layers"] * r["micro_batches"]) for r in results]
            rows.append({"layout": " ".join(f"{k}={v}" for k, v in parallel.items()) or "1 process",
                         "expert_backend": backend, "reads_per_step_by_rank": [r["reads"] for r in results],
                         "kinds_worst_rank": dict(Counter(worst["kinds"])),
                         "reads_above_floor_per_moe_layer_per_micro_batch": max(per_layer_mb)})
    print(json.dumps({"per_step_floor": FLOOR, "layouts": rows}, indent=1))


if __name__ == "__main__":
    main()
