"""Expert backends: forward + backward of one layer's experts, each backend against ``loop`` (the
reference) in the same run. Prints JSON.

Shapes: the demo (8 experts, hidden 256, expert width 256, 4096 tokens × top-2) and a 1B-MoE-like
layer (8 experts, hidden 1024, width 1408, 4096 tokens × top-2); fp32 and bf16; rows spread over
the experts as a router early in training spreads them (uneven, one expert empty). On CUDA it also
times ``megablocks`` when installed. ``moe.expert_backend: auto`` picks from these figures:
``loop`` on CPU, ``grouped_mm`` on CUDA in bf16.

    python benchmarks/bench_experts.py [--repeats 7 --threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from moetrain.model.moe import GroupedExperts  # noqa: E402

SHAPES = {"demo": (8, 256, 256, 4096 * 2), "1b-moe": (8, 1024, 1408, 4096 * 2)}


def counts_for(E: int, N: int) -> torch.Tensor:
    w = torch.tensor([3.0, 1.0, 2.0, 0.0, 1.5, 0.5, 2.5, 1.5][:E])
    c = (w / w.sum() * N).floor().long()
    c[0] += N - c.sum()
    return c


def time_backend(backend: str, shape, dtype, device, repeats: int) -> float:
    E, D, F, N = shape
    ex = GroupedExperts(D, F, E, backend=backend).to(device)
    with torch.no_grad():
        for w in (ex.w1, ex.w3, ex.w2):
            w.normal_(std=0.02)
    ex.compute_dtype = dtype
    counts = counts_for(E, N).to(device)
    x = torch.randn(N, D, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(N, D, device=device, dtype=dtype)
    times = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ex(x, counts, counts.tolist()).backward(dy)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = ["loop", "grouped_mm"]
    if device.type == "cuda" and importlib.util.find_spec("megablocks"):
        backends.append("megablocks")
    rows = []
    for name, shape in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            base = time_backend("loop", shape, dtype, device, a.repeats)
            row = {"shape": name, "dtype": str(dtype).split(".")[-1], "loop_s": round(base, 5)}
            for b in backends[1:]:
                try:
                    t = time_backend(b, shape, dtype, device, a.repeats)
                    row[f"{b}_s"], row[f"{b}_over_loop"] = round(t, 5), round(t / base, 3)
                except RuntimeError as e:  # e.g. CUDA grouped_mm refuses fp32
                    row[f"{b}_s"] = f"unsupported: {str(e).splitlines()[0][:120]}"
            rows.append(row)
    print(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "threads": a.threads, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
