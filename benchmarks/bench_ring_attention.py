"""Ring attention (cp = 2 gloo processes, one thread each) vs single-process SDPA on the full
sequence: causal forward + backward time, as a ratio, measured in the same run. Prints JSON.

Same total work: the two ranks each compute half of the causal attention (the load-balanced
layout gives them equal halves), so a perfect ring would take 0.5× the one-thread SDPA time;
what stays above that is communication, merging and the per-block kernels' overhead. SDPA is
also timed with two threads (the same cores as the two ranks). Timings on a shared machine
are noisy: medians of ``--repeats`` runs.

    python benchmarks/bench_ring_attention.py [--seq 2048 --heads 8 --kv-heads 2 --dim 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from moetrain.parallel.context import cp_shard, ring_attention  # noqa: E402
from multiproc import run_distributed  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(a):
    gen = torch.Generator().manual_seed(0)
    dtype = DTYPES[a.dtype]
    q = torch.randn(a.batch, a.heads, a.seq, a.dim, generator=gen).to(dtype)
    k = torch.randn(a.batch, a.kv_heads, a.seq, a.dim, generator=gen).to(dtype)
    v = torch.randn(a.batch, a.kv_heads, a.seq, a.dim, generator=gen).to(dtype)
    dout = torch.randn(a.batch, a.heads, a.seq, a.dim, generator=gen).to(dtype)
    return q, k, v, dout


def _sdpa_times(a, threads: int) -> list[float]:
    """Seconds per causal forward + backward of full-sequence SDPA in this process."""
    torch.set_num_threads(threads)
    q, k, v, dout = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_inputs(a)))
    times = []
    for i in range(a.warmup + a.repeats):
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
        q.grad = k.grad = v.grad = None
    return times


def _ring_worker(rank: int, cp: int, a) -> list[float]:
    """Seconds per ring forward + backward: the slowest rank's time, each repeat."""
    group = dist.group.WORLD
    q, k, v, dout = (cp_shard(t, rank, cp, 2) for t in _inputs(a))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    times = []
    for i in range(a.warmup + a.repeats):
        dist.barrier(group)
        t0 = time.perf_counter()
        ring_attention(q, k, v, group, causal=True).backward(dout)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        if i >= a.warmup:
            times.append(elapsed.item())
        q.grad = k.grad = v.grad = None
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048, help="full sequence length (tokens)")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args()
    cp = 2

    # SDPA before and after the ring run, so a load change on the shared machine shows up.
    sdpa1 = _sdpa_times(a, threads=1)
    ring = run_distributed(_ring_worker, cp, a)[0]
    sdpa1 += _sdpa_times(a, threads=1)
    sdpa2 = _sdpa_times(a, threads=2)

    med = statistics.median
    result = {
        "benchmark": "ring_attention_fwd_bwd",
        "shape": {"batch": a.batch, "heads": a.heads, "kv_heads": a.kv_heads, "seq": a.seq, "dim": a.dim,
                  "dtype": a.dtype, "causal": True},
        "cp": cp,
        "threads_per_rank": 1,
        "repeats": a.repeats,
        "ring_cp2_s": med(ring),
        "sdpa_full_1thread_s": med(sdpa1),
        "sdpa_full_2threads_s": med(sdpa2),
        "ratio_ring_over_sdpa_1thread": med(ring) / med(sdpa1),
        "ratio_ring_over_sdpa_2threads": med(ring) / med(sdpa2),
        "ideal_ratio_1thread": 1 / cp,
        "raw_s": {"ring": ring, "sdpa_1thread": sdpa1, "sdpa_2threads": sdpa2},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
