"""Muon's Newton–Schulz work on a config's model: FLOPs, time, and the time its FLOPs predict.

For every matrix ``train.optimizer: muon`` orthogonalizes (:func:`moetrain.train.optim.uses_muon`;
a routed expert stack is E matrices) the quintic Newton–Schulz iteration costs, per step of
X [m, n] with m ≤ n, 2·m²·n (X·Xᵀ) + 2·m³ (S·S) + 2·m²·n (the product with X) FLOPs, times 5
steps. The benchmark times :func:`moetrain.train.optim.newton_schulz` on all of them (median of
``--repeats``) and, in the same run, the matmul throughput of this device on the same shapes
(the X·Xᵀ product alone, timed the same way), and reports the time the FLOPs predict at that
throughput beside the measured one (``measured_over_predicted``; the goal of issue 32 is within
25 %). Also the Newton–Schulz FLOPs against the model's training FLOPs per step
(``train.global_batch_size`` × ``model.seq_len`` tokens): what one step adds when each matrix
is orthogonalized once. Prints JSON.

    python benchmarks/bench_muon.py [--config configs/demo-moe.yaml] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from moetrain.config import load_config  # noqa: E402
from moetrain.model.transformer import Transformer  # noqa: E402
from moetrain.train.flops import flops_per_token  # noqa: E402
from moetrain.train.optim import newton_schulz, uses_muon  # noqa: E402


def ns_flops(shape: tuple[int, ...], steps: int = 5) -> float:
    """FLOPs of :func:`newton_schulz` on one tensor of ``shape`` [..., m, n]."""
    *batch, m, n = shape
    m, n = min(m, n), max(m, n)
    count = 1
    for b in batch:
        count *= b
    return count * steps * (4 * m * m * n + 2 * m ** 3)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/demo-moe.yaml"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary when the config leaves it to the data")
    a = ap.parse_args()
    cfg = load_config(a.config, [f"model.vocab_size={a.vocab}"] if load_config(a.config).model.vocab_size is None
                      else [])
    model = Transformer.from_config(cfg)
    mats = [p.detach() for n, p in model.named_parameters() if uses_muon(n, p, cfg.train.muon_adamw)]
    flops = sum(ns_flops(tuple(p.shape)) for p in mats)
    grads = [torch.randn_like(p) for p in mats]
    ns_s = timed(lambda: [newton_schulz(g) for g in grads], a.repeats)

    def gram_only() -> None:  # the device's matmul rate on these shapes: X·Xᵀ of each (m ≤ n)
        for g in grads:
            x = g if g.shape[-2] <= g.shape[-1] else g.mT
            x @ x.mT

    gram_flops = sum(2 * min(p.shape[-2:]) ** 2 * max(p.shape[-2:]) * (p.numel() // (p.shape[-2] * p.shape[-1]))
                     for p in mats)
    rate = gram_flops / timed(gram_only, a.repeats)
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    train_flops = flops_per_token(cfg) * tokens
    print(json.dumps({
        "bench": "muon_newton_schulz", "config": a.config, "device": "cpu", "threads": torch.get_num_threads(),
        "matrices": sum(p.numel() // (p.shape[-2] * p.shape[-1]) for p in mats),
        "ns_gflop_per_step": flops / 1e9, "training_gflop_per_step": train_flops / 1e9,
        "ns_over_training_flops": flops / train_flops,
        "matmul_gflop_s": rate / 1e9, "ns_seconds": ns_s, "predicted_seconds": flops / rate,
        "measured_over_predicted": ns_s / (flops / rate)}, indent=1))


if __name__ == "__main__":
    main()
