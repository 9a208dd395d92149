"""``parallel.ep_overlap`` on CPU: step time with and without merging micro-batch i+1's forward
with micro-batch i's backward, and the EP all-to-all time it hides. Prints JSON.

dp = 2 × ep = 2 (2 gloo processes, one thread each), the demo's block sizes, 4 micro-batches per
step. Rounds alternate off / on; medians. The step's token all-to-alls are recorded in the "on"
run (split sizes, widths, group) and replayed alone in the same processes, so
``hidden_fraction = (off − on) / all_to_all_alone``.

On this machine the ranks talk over loopback: the all-to-alls are a small part of the step and
the figure is within noise; the turn-taking's own cost is what ``on / off`` shows. The issue's
measurement on a shaped inter-node link (slurm/dev-cluster's emulated network) is separate.

    python benchmarks/bench_ep_overlap.py [--rounds 5 --steps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import ByteTokenizer, _documents, tiny_config  # noqa: E402
from moetrain.data.writer import write_shards  # noqa: E402
from multiproc import run_distributed  # noqa: E402

MODEL = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "ffn_hidden": 688, "vocab_size": 384,
         "seq_len": 256}
MOE = {"num_experts": 8, "top_k": 2, "every": 1, "ffn_hidden": 256, "shared_experts": 1}


def _bench(rank: int, world: int, data: str, run_dir: str, rounds: int, steps: int) -> dict:
    import moetrain.parallel.ep_overlap as ov
    from moetrain.train.trainer import Trainer

    torch.set_num_threads(1)
    recorded: list = []
    original = ov.InTurnExchange.transfer

    def recording(self, out, inp, output_splits, input_splits, token, backward=False):
        recorded.append((tuple(out.shape), tuple(inp.shape), out.dtype, list(output_splits), list(input_splits),
                         self.group))
        return original(self, out, inp, output_splits, input_splits, token, backward)

    trainers = {}
    for flag in (False, True):
        cfg = tiny_config(data, f"{run_dir}/{flag}", model=MODEL, moe=MOE,
                          parallel={"dp": 2, "ep": 2, "ep_overlap": flag},
                          train={"steps": 10_000, "micro_batch_size": 2, "global_batch_size": 16, "grad_clip": 1.0})
        trainers[flag] = Trainer(cfg, write_files=False)
        trainers[flag].train_step()  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for flag in (False, True):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                trainers[flag].train_step()
            dist.barrier()
            times[flag].append((time.perf_counter() - t0) / steps)
    # One "on" step recorded, then its all-to-alls replayed alone (synchronously, same order).
    ov.InTurnExchange.transfer = recording
    trainers[True].train_step()
    ov.InTurnExchange.transfer = original
    alone = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for out_shape, in_shape, dtype, out_splits, in_splits, group in recorded:
            dist.all_to_all_single(torch.empty(out_shape, dtype=dtype), torch.zeros(in_shape, dtype=dtype), out_splits,
                                   in_splits, group=group)
        dist.barrier()
        alone.append(time.perf_counter() - t0)
    off, on, comm = statistics.median(times[False]), statistics.median(times[True]), statistics.median(alone)
    return {"step_off_s": off, "step_on_s": on, "on_over_off": on / off, "all_to_all_alone_s": comm,
            "all_to_alls_per_step": len(recorded), "hidden_fraction": (off - on) / comm if comm else None,
            "micro_batches": trainers[True].cfg.grad_accum_steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_shards(_documents(400), ByteTokenizer(), Path(tmp) / "shards", shard_tokens=60_000, val_docs=10,
                     progress=False)
        res = run_distributed(_bench, 2, str(Path(tmp) / "shards"), str(Path(tmp) / "run"), args.rounds, args.steps,
                              timeout=1800)
    out = {"bench": "ep_overlap", "layout": "dp2 x ep2, gloo over loopback, 1 thread per rank", **res[0]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
