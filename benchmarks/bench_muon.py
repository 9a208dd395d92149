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

With ``--ranks N`` it also builds the config's layout in N gloo processes (the config's
``parallel`` section, ``--zero`` stages in turn) and reports, per rank, what
:class:`moetrain.parallel.whole_matrix.WholeMatrices` gives it: the Newton–Schulz GFLOP it owns
(against the total / N), the bytes it sends (against the analytic minimum — each matrix's blocks
once to its owner and back — and against gathering every matrix on every rank, which each rank
computing all of its matrices needs), the time of the exchange alone, of the whole distributed
Newton–Schulz, and of the same work done by gathering every matrix on every rank; and the time
its owned FLOPs predict at the matmul rate all ranks measure at the same moment (the ranks share
this machine's cores, so a rank's rate is measured under the same contention).

    python benchmarks/bench_muon.py [--config configs/demo-moe.yaml] [--repeats 5] [--ranks 4 --zero 0 1 3]
        [--set parallel.dp=2 ...]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from moetrain.config import load_config  # noqa: E402
from moetrain.model.transformer import Transformer  # noqa: E402
from moetrain.train.flops import flops_per_token  # noqa: E402
from moetrain.planner.model import newton_schulz_flops  # noqa: E402
from moetrain.train.optim import newton_schulz, uses_muon  # noqa: E402


def ns_flops(shape: tuple[int, ...], steps: int = 5) -> float:
    """FLOPs of :func:`newton_schulz` on one tensor of ``shape`` [..., m, n]."""
    *batch, m, n = shape
    count = 1
    for b in batch:
        count *= b
    return count * newton_schulz_flops(m, n, steps)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _synced(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats``, every rank starting each repeat together."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _layout(rank: int, world: int, config: str, overrides: list[str], repeats: int) -> dict:
    """One rank of ``--ranks``: the plan's share, bytes and times for this layout."""
    from torch.distributed.tensor import DTensor

    from moetrain.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(config, overrides)
    trainer = Trainer(cfg, write_files=False)
    opt = trainer.optimizers[0]
    params = [p for g in opt.param_groups if g["muon"] for p in g["params"]]
    dirs = [torch.randn_like(p.to_local() if isinstance(p, DTensor) else p) for p in params]
    whole = opt.whole
    exchange_s = _synced(lambda: whole.apply(dirs, lambda x: x.clone()), repeats)
    distributed_s = _synced(lambda: whole.apply(dirs, newton_schulz), repeats)
    shared = [DTensor.from_local(d, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
              if isinstance(p, DTensor) else d for p, d in zip(params, dirs)]
    everywhere_s = _synced(lambda: [newton_schulz(d.full_tensor() if isinstance(d, DTensor) else d)
                                    for d in shared], repeats)
    # bytes the everywhere scheme receives: every rank all-gathers each matrix it holds a block of
    everywhere_bytes = sum(4 * (p.numel() - d.numel()) for p, d in zip(params, dirs) if isinstance(p, DTensor))
    mine = [whole.units[k] for k in whole.owned] + [u for u in whole.units if u.param in whole.local_only
                                                       and u.owner == whole.me]
    owned_flops = sum(newton_schulz_flops(*u.shape) for u in mine)
    # the matmul rate on the owned shapes: X·Xᵀ of each owned matrix (m ≤ n), stacked by shape as
    # the plan runs them, timed while the other ranks do the same
    by_shape: dict[tuple[int, int], int] = {}
    for u in mine:
        by_shape[(min(u.shape), max(u.shape))] = by_shape.get((min(u.shape), max(u.shape)), 0) + 1
    probe = [torch.randn(k, m, n) for (m, n), k in by_shape.items()] or [torch.randn(1, 256, 512)]
    gram_s = _synced(lambda: [x @ x.mT for x in probe], repeats)
    rate = sum(2 * x.shape[0] * x.shape[1] ** 2 * x.shape[2] for x in probe) / gram_s
    traffic = whole.traffic(4)
    return {"least_stage_mb": least_bytes(whole) / 1e6, "rank": rank, "owned_ns_gflop": owned_flops / 1e9, "total_ns_gflop": sum(traffic["work"]) / 1e9,
            "sent_mb": traffic["sent"][whole.me] / 1e6, "stage_sent_mb": traffic["total"] / 1e6,
            "everywhere_received_mb": everywhere_bytes / 1e6,
            "exchange_seconds": exchange_s, "distributed_ns_seconds": distributed_s,
            "everywhere_ns_seconds": everywhere_s, "matmul_gflop_s": rate / 1e9,
            "predicted_ns_seconds": owned_flops / rate,
            "measured_over_predicted": (distributed_s - exchange_s) / (owned_flops / rate) if owned_flops else None}


def least_bytes(plan) -> int:
    """The analytic minimum of one apply(): for every matrix, the blocks its owner lacks (gather)
    and every other holder's block (scatter) — computed from the plan's blocks, not its transfers."""
    total = 0
    for u in plan.units:
        size = u.shape[0] * u.shape[1]
        own = max((b.numel for b in u.holders if b.rank == u.owner), default=0)
        total += (size - own) + sum(b.numel for b in u.holders if b.rank != u.owner)
    return 4 * total


def distributed(a, overrides: list[str]) -> list[dict]:
    from multiproc import run_distributed

    rows = []
    for zero in a.zero:
        outs = run_distributed(_layout, a.ranks, a.config,
                               overrides + ["train.optimizer=muon", f"parallel.zero_stage={zero}",
                                            "checkpoint.resume=false"], a.repeats)
        rows.append({"zero_stage": zero, "ranks": outs})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/demo-moe.yaml"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary when the config leaves it to the data")
    ap.add_argument("--ranks", type=int, default=0, help="also run the config's layout in this many processes")
    ap.add_argument("--zero", type=int, nargs="+", default=[0, 1, 3], help="ZeRO stages for --ranks")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for --ranks, e.g. parallel.dp=2 (repeatable)")
    a = ap.parse_args()
    overrides = [f"model.vocab_size={a.vocab}"] if load_config(a.config).model.vocab_size is None else []
    cfg = load_config(a.config, overrides)
    overrides += a.set
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
        "measured_over_predicted": ns_s / (flops / rate),
        **({"layouts": distributed(a, overrides)} if a.ranks else {})}, indent=1))


if __name__ == "__main__":
    main()
