"""How much communication each overlap hides, on CPU (2 gloo processes, one thread each).
Prints JSON.

For each overlap the same training step is timed with it on and off, alternating rounds,
medians; ``hidden_fraction = (off − on) / communication`` where the communication time is
measured alone in the same run:

* ``dp_gradients`` — dp = 2, no ZeRO: the step as it runs (FSDP2's ``replicate`` all-reduces each
  block's gradients once per step, during the last micro-batch's backward) and the same
  all-reduces alone; no "off" variant (FSDP2 has no switch to defer them), so ``step_off_s`` is
  absent. Compared with moetrain 0.1's hand-written bucketed reducer in docs/performance.md.
* ``ep_shared_expert`` — one MoE block (attention + MoE) under dp = 2 × ep = 2 (8 192 tokens
  per rank, a shared expert 4× the routed width), forward and backward: the shared expert computed while the
  dispatch all-to-all is in flight vs after it; communication = that layer's dispatch
  all-to-all alone (a step's are too small against its noise at the tiny model's size).
* ``fsdp_prefetch`` — dp = 2, ZeRO-3: one-block-ahead forward/backward prefetch vs FSDP2's own
  order; communication = the step's all-gathers and reduce-scatters alone.

On this machine the two processes already use both cores for compute and gloo's transport runs
on threads that need a core too, so CPU figures are a floor; on GPUs NCCL runs on its own
stream and the same structure hides most of it (see docs/performance.md).

    python benchmarks/bench_overlap.py [--rounds 5 --steps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
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
         "seq_len": 128}


def _timed(trainer, steps: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    dist.barrier()
    return (time.perf_counter() - t0) / steps


def _comm_alone(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(rank: int, world: int, data: str, run_dir: str, case: str, rounds: int, steps: int) -> dict:
    from moetrain.train.trainer import Trainer

    parallel = {"dp": 2}
    moe = {"num_experts": 8, "top_k": 2, "ffn_hidden": 256, "shared_experts": 0}
    if case == "ep_shared_expert":
        parallel, moe = {"dp": 2, "ep": 2}, {**moe, "shared_experts": 4}
    if case == "fsdp_prefetch":
        parallel = {"dp": 2, "zero_stage": 3}
    cfg = tiny_config(data, run_dir, parallel=parallel, model=MODEL, moe=moe,
                      train={"micro_batch_size": 2, "global_batch_size": 8})
    trainer = Trainer(cfg, write_files=False)
    part = trainer.model_parts[0]

    if case == "dp_gradients":
        toggle = None
        grads = [torch.randn_like(p._local_tensor) for p in part.parameters()]
        comm = lambda: [w.wait() for w in [dist.all_reduce(g, async_op=True) for g in grads]]  # noqa: E731
    elif case == "ep_shared_expert":
        moes = list(trainer.moe_layers.values())

        def toggle(on: bool) -> None:
            for m in moes:
                m.parallel = dataclasses.replace(m.parallel, overlap_shared=on)

        comm = None  # set below, with the layer's input
    else:  # fsdp_prefetch
        blocks = [b for b in part.layers.values()]
        states = [(b._get_fsdp_state()._states_to_forward_prefetch, b._get_fsdp_state()._states_to_backward_prefetch)
                  for b in blocks]

        def toggle(on: bool) -> None:
            for b, (fwd, bwd) in zip(blocks, states):
                b._get_fsdp_state()._states_to_forward_prefetch = fwd if on else []
                b._get_fsdp_state()._states_to_backward_prefetch = bwd if on else []

        params = [p.to_local() for p in part.parameters()]
        full = [torch.empty(p.numel() * 2) for p in params]

        def comm() -> None:  # per micro-batch 2 all-gathers and a reduce-scatter of every shard
            for _ in range(cfg.grad_accum_steps):
                for p, f in zip(params, full):
                    dist.all_gather_single(f, p.detach().reshape(-1).float())
                    dist.all_gather_single(f, p.detach().reshape(-1).float())
                    dist.reduce_scatter_single(torch.empty(p.numel()), f)

    trainer.train_step()  # warm-up
    run = lambda: _timed(trainer, steps)  # noqa: E731
    if case == "ep_shared_expert":
        from moetrain.model.layers import rope_cos_sin

        # The MoE layer's block (its FSDP2 hooks gather the parameters): attention + MoE.
        name = next(iter(trainer.moe_layers))
        block, x = part.layers[name], torch.randn(4, 2048, cfg.model.hidden, generator=torch.Generator().manual_seed(rank))
        cos, sin = rope_cos_sin(torch.arange(2048), cfg.model.resolved_head_dim, cfg.model.rope_theta)
        moe_layer = lambda h: block(h, cos, sin)  # noqa: E731

        def run() -> float:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                moe_layer(x.requires_grad_()).sum().backward()
            dist.barrier()
            return (time.perf_counter() - t0) / steps

        def comm() -> None:
            rows = torch.randn(x.shape[0] * x.shape[1] * cfg.moe.top_k, cfg.model.hidden)
            dist.all_to_all_single(torch.empty_like(rows), rows, group=trainer.ps.group("ep"))
    on, off = [], []
    for _ in range(rounds):
        if toggle is not None:
            toggle(True)
        on.append(run())
        if toggle is not None:
            toggle(False)
            off.append(run())
    if toggle is not None:
        toggle(True)
    return {"on_s": statistics.median(on), "off_s": statistics.median(off) if off else None,
            "comm_s": _comm_alone(comm)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps (or MoE-layer passes) per round")
    ap.add_argument("--cases", nargs="+", default=["dp_gradients", "ep_shared_expert", "fsdp_prefetch"])
    a = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shards"
        write_shards(_documents(600), ByteTokenizer(), data, shard_tokens=100_000, val_docs=10, progress=False)
        for case in a.cases:
            r = run_distributed(worker, 2, str(data), str(Path(tmp) / case), case, a.rounds, a.steps, timeout=900)[0]
            out[case] = {"step_on_s": round(r["on_s"], 4), "communication_alone_s": round(r["comm_s"], 4)}
            if r["off_s"] is not None:
                hidden = (r["off_s"] - r["on_s"]) / r["comm_s"] if r["comm_s"] > 0 else 0.0
                out[case].update(step_off_s=round(r["off_s"], 4), on_over_off=round(r["on_s"] / r["off_s"], 3),
                                 hidden_fraction=round(hidden, 3))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
