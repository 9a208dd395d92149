"""The measuring job of ``python -m moetrain.calibrate``: every rank of the config's launch
times GEMMs, attention, a memory copy and the collectives of each network tier, at the same
time as the others (so they share the node as in training), and rank 0 returns the figures
:func:`moetrain.planner.calibration.calibrated_profile` turns into a planner profile.

Timings synchronise the device around each timed batch (CUDA events on a GPU): a benchmark's
host syncs, never a training step's. Collectives are timed as the slowest rank of each call
(the per-call times all-reduced with MAX), every group of a tier running at once, as the ranks of
a training step use the tier together.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime as _dt
import logging
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import submitit
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moetrain.config import Config, config_from_dict
from moetrain.launch.job import exit_now, master_port, process_threads, rank_env_from_environ
from moetrain.planner.calibration import (OPS, TIERS, attention_flops, gemm_shapes, k_sweep_shapes, layer_config,
                                          message_sizes)
from moetrain.planner.layout import Layout
from moetrain.planner.memory import MemoryAssumptions
from moetrain.planner.model import ModelShape
from moetrain.topology.cluster import ClusterProfile, generic_profile, load_profile

log = logging.getLogger("moetrain.calibrate")

__all__ = ["CalibrateJob", "measure_rank", "measure_in_group", "measure_under_launcher", "base_profile", "tier_groups",
           "per_call_seconds"]


def base_profile(cfg: Config, cuda: bool) -> ClusterProfile:
    """The profile the calibration starts from: ``launch.profile``, else ``cpu-local`` on a CPU
    and the generic GPU profile on a GPU (its topology fields describe the job's nodes)."""
    if cfg.launch.profile:
        return load_profile(cfg.launch.profile)
    gpn = cfg.launch.resolved_tasks_per_node(cfg.world_size)
    if cuda:
        return generic_profile(gpn)
    return dataclasses.replace(load_profile("cpu-local"), gpus_per_node=gpn, nvswitch_domain_gpus=gpn)


def tier_groups(hosts: list[str], profile: ClusterProfile) -> dict[str, list[list[int]]]:
    """The groups each tier is measured on, from each rank's host name (rank order): ``nvlink``
    the ranks of one NVSwitch domain; ``rail`` one rank per domain, the ranks of equal place in
    their domains, within one rail group; ``spine`` the same across rail groups. Nodes are
    numbered in the order of their lowest rank, domains and rail groups fill in that order
    (``ClusterProfile.domain_nodes``, ``nodes_per_rail_group``). A tier is left out where its
    groups would have one rank, or groups of different sizes."""
    node_of: dict[str, int] = {}
    for h in hosts:
        node_of.setdefault(h, len(node_of))
    domain = [node_of[h] // profile.domain_nodes for h in hosts]
    rail_group = [node_of[h] // profile.nodes_per_rail_group for h in hosts]
    place: list[int] = []
    seen: dict[int, int] = {}
    for d in domain:
        place.append(seen.get(d, 0))
        seen[d] = place[-1] + 1
    first_domain = {}
    for d, g in zip(domain, rail_group):
        first_domain.setdefault(g, d)
    keys = {
        "nvlink": [(d,) for d in domain],
        "rail": [(g, p) for g, p in zip(rail_group, place)],
        "spine": [(d - first_domain[g], p) for d, g, p in zip(domain, rail_group, place)],
    }
    out: dict[str, list[list[int]]] = {}
    for tier in TIERS:
        groups: dict[tuple, list[int]] = {}
        for rank, key in enumerate(keys[tier]):
            groups.setdefault(key, []).append(rank)
        sizes = {len(g) for g in groups.values()}
        if tier == "rail":  # one member per domain: a rail group spanning several domains
            ok = all(len({domain[r] for r in g}) == len(g) for g in groups.values())
        elif tier == "spine":
            ok = all(len({rail_group[r] for r in g}) == len(g) for g in groups.values())
        else:
            ok = True
        if ok and len(sizes) == 1 and sizes.pop() >= 2:
            out[tier] = [groups[k] for k in sorted(groups)]
    return out


def _batch(fn: Callable[[], object], reps: int, cuda: bool) -> float:
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return time.perf_counter() - t


def per_call_seconds(fn: Callable[[], object], seconds: float, cuda: bool) -> float:
    """Seconds per call of ``fn`` after it has run for ``seconds`` (clocks settled): batches of
    ≥ 20 ms, the median of the second half of them."""
    _batch(fn, 1, cuda)
    reps = 1
    while (t := _batch(fn, reps, cuda)) < 0.02 and reps < 1 << 16:
        reps *= 2
    times = [t / reps]
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        times.append(_batch(fn, reps, cuda) / reps)
    return statistics.median(times[len(times) // 2:])


def _copy_gb_s(nbytes: int, device: torch.device, seconds: float, cuda: bool) -> float:
    """Bytes read + written per second (GB/s) of a device-to-device copy of ``nbytes``."""
    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / per_call_seconds(lambda: dst.copy_(src), seconds, cuda) / 1e9


def _gemm_fn(g: Any, device: torch.device, dtype: torch.dtype) -> Callable[[], object]:
    if g.fp8:
        from moetrain.model.fp8_gemm import Fp8Recipe, fp8_mm

        a = torch.randn(g.m, g.k, device=device, dtype=torch.bfloat16)
        b = torch.randn(g.k, g.n, device=device, dtype=torch.bfloat16)
        recipe = Fp8Recipe()
        return lambda: [fp8_mm(a, b, recipe) for _ in range(g.count)]
    if g.count > 1:
        a = torch.randn(g.count, g.m, g.k, device=device, dtype=dtype)
        b = torch.randn(g.count, g.k, g.n, device=device, dtype=dtype)
        c = torch.empty(g.count, g.m, g.n, device=device, dtype=dtype)
        return lambda: torch.bmm(a, b, out=c)
    a = torch.randn(g.m, g.k, device=device, dtype=dtype)
    b = torch.randn(g.k, g.n, device=device, dtype=dtype)
    c = torch.empty(g.m, g.n, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=c)


def _attention_seconds(shape: ModelShape, layout: Layout, device: torch.device, dtype: torch.dtype,
                       seconds: float, cuda: bool) -> float:
    heads = max(1, shape.heads // layout.tp)
    kv = max(1, (shape.kv_heads or shape.heads) // layout.tp)
    d, dv = shape.head_dim, shape.h_v // shape.heads
    q = torch.randn(layout.mbs, heads, shape.seq_len, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(layout.mbs, kv, shape.seq_len, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(layout.mbs, kv, shape.seq_len, dv, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(layout.mbs, heads, shape.seq_len, dv, device=device, dtype=dtype)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    return per_call_seconds(step, seconds, cuda)


def _elementwise_seconds(shape: ModelShape, layout: Layout, device: torch.device, dtype: torch.dtype,
                         seconds: float, cuda: bool) -> float:
    """Seconds of one layer's memory-bound kernels, forward and backward through autograd, at
    the model's shapes: the kernels :meth:`moetrain.planner.timing._Compute.elementwise_bytes`
    counts (an MoE layer where the model has one: two RMSNorms, two residual adds, RoPE on Q and
    K, the router's fp32 softmax and top-k, the permutation of the routed copies and its
    weighted inverse, SwiGLU on the experts' outputs; else SwiGLU on the dense MLP's)."""
    tokens = max(1, layout.mbs * shape.seq_len // layout.cp)
    tt = tokens // layout.tp if layout.sp and layout.tp > 1 else tokens
    tm = max(1, tokens // layout.tp)
    h, tp = shape.hidden, layout.tp

    def leaf(*size: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*size, device=device, dtype=dt, requires_grad=True)

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-b, a), dim=-1) * sin

    x, w1, w2 = leaf(tt, h), leaf(h), leaf(h)
    hq, hkv = max(2, shape.h_q // tp) // 2 * 2, max(2, shape.h_kv // tp) // 2 * 2
    q, k = leaf(tokens, hq), leaf(tokens, hkv)
    cq, sq = torch.randn(tokens, hq, device=device, dtype=dtype), torch.randn(tokens, hq, device=device, dtype=dtype)
    ck, sk = cq[:, :hkv].contiguous(), sq[:, :hkv].contiguous()
    if shape.is_moe:
        top = shape.top_k
        f = shape.expert_ffn
        logits = leaf(tm, shape.num_experts, dt=torch.float32)
        src = torch.randperm(tm * top, device=device) // top      # each token's copies, permuted
        gate, up = leaf(tm * top, f), leaf(tm * top, f)
        expert_out = leaf(tm * top, h)
    else:
        f = shape.ffn // tp
        gate, up = leaf(tokens, f), leaf(tokens, f)

    def layer() -> None:
        y = x + rms(x, w1)
        outs = [rope(q, cq, sq), rope(k, ck, sk)]
        z = rms(y, w2)
        if shape.is_moe:
            probs, idx = torch.softmax(logits, dim=-1).topk(top, dim=-1)
            routed = z[:tm].index_select(0, src)                     # permute
            act = F.silu(gate) * up
            weighted = expert_out * probs.reshape(-1, 1).to(dtype)[src.argsort()]
            back = torch.zeros(tm, h, device=device, dtype=dtype).index_add(0, src, weighted)  # unpermute
            outs += [routed, act, back, idx.to(dtype)]
            out = y[:tm] + back
        else:
            outs.append(F.silu(gate) * up)
            out = y + z
        total = out.float().sum() + sum(o.float().sum() for o in outs)
        total.backward()
        for t in (x, w1, w2, q, k, gate, up) + ((logits, expert_out) if shape.is_moe else ()):
            t.grad = None

    return per_call_seconds(layer, seconds, cuda)


def _layer_seconds(cfg: Config, device: torch.device, seconds: float, cuda: bool) -> float:
    """Seconds of :func:`moetrain.planner.calibration.layer_config`'s model (one block with the
    rank's share of the experts, embedding and head), forward, loss and backward, for one
    micro-batch of random tokens; set up as the trainer sets up its model (fp32 parameters,
    modules computing in the precision's dtype, fp8 GEMMs, the expert backend it resolves)."""
    from moetrain.model.fp8_gemm import set_fp8
    from moetrain.model.layers import set_compute_dtype
    from moetrain.model.loss import model_loss
    from moetrain.model.moe import GroupedExperts, resolve_expert_backend
    from moetrain.model.transformer import Transformer
    from moetrain.parallel.precision import compute_dtype, fp8_recipe

    one = layer_config(cfg)
    model = Transformer(one.model, one.moe).to(device=device)
    run_dtype = compute_dtype(cfg.train.precision)
    set_compute_dtype(model, run_dtype)
    recipe = fp8_recipe(cfg.train)
    set_fp8(model, recipe, cfg.train.fp8_keep)
    backend = resolve_expert_backend(cfg.moe.expert_backend, device, run_dtype, fp8=recipe is not None)
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.backend = backend
    tokens = torch.randint(0, one.model.vocab_size, (cfg.train.micro_batch_size, one.model.seq_len), device=device)

    def step() -> None:
        loss = model_loss(model(tokens), tokens)[0]
        loss.backward()
        for prm in model.parameters():
            prm.grad = None

    return per_call_seconds(step, seconds, cuda)


def _collective(op: str, numel: int, group: Any, peers: tuple[int, int], device: torch.device
                ) -> Callable[[], object]:
    n = dist.get_world_size(group)
    x = torch.ones(numel, device=device, dtype=torch.float32)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":
        part = torch.ones(numel // n, device=device, dtype=torch.float32)
        return lambda: dist.all_gather_into_tensor(x, part, group=group)
    if op == "reduce_scatter":
        part = torch.empty(numel // n, device=device, dtype=torch.float32)
        return lambda: dist.reduce_scatter_tensor(part, x, group=group)
    if op == "all_to_all":
        y = torch.empty_like(x)
        return lambda: dist.all_to_all_single(y, x, group=group)
    if op == "p2p":  # a ring: send to the next rank of the group, receive from the previous
        y = torch.empty_like(x)

        def ring() -> None:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peers[0], group),
                                             dist.P2POp(dist.irecv, y, peers[1], group)]):
                w.wait()
        return ring
    raise ValueError(f"collective {op!r}: not one of {', '.join(OPS)}")


def _sweep(op: str, group: Any, members: list[int], sizes: list[int], device: torch.device, cuda: bool,
           max_call_s: float, budget_s: float) -> tuple[list[int], list[float]]:
    """Seconds per call of ``op`` at each size (the slowest rank's, median of the repetitions),
    every rank of the job taking part (each in its own group of the tier); stops where one call
    would pass ``max_call_s`` or the sweep its ``budget_s``."""
    me = dist.get_rank()
    i = members.index(me)
    n = len(members)
    peers = (members[(i + 1) % n], members[(i - 1) % n])
    done_sizes, done_times = [], []
    reps, spent = 5, 0.0
    for size in sizes:
        numel = max(n, size // 4 // n * n)
        fn = _collective(op, numel, group, peers, device)
        fn()  # warm-up: the first call of a size sets up its buffers / connections
        times = []
        for _ in range(reps):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # on the default group (gloo: CPU tensors)
        per_call = float(slowest.median())
        done_sizes.append(numel * 4)
        done_times.append(per_call)
        spent += per_call * (reps + 1)
        # the next size takes about twice as long: as many repetitions as fit 1/8 of the budget
        reps = int(max(3, min(20, budget_s / 8 / max(2 * per_call, 1e-6))))
        if 2 * per_call > max_call_s or spent + 2 * per_call * (reps + 1) > budget_s:
            break
    return done_sizes, done_times


def measure_rank(cfg: Config, seconds: float = 0.5, coll_budget_s: float = 8.0) -> dict[str, Any]:
    """Measure on this rank (torch.distributed initialised, every rank of the job calling);
    returns the figures on rank 0 (medians over ranks for compute), ``{}`` elsewhere.
    ``seconds``: time per GEMM shape / attention / copy; ``coll_budget_s``: per collective and
    tier. See :func:`moetrain.planner.calibration.calibrated_profile` for the returned keys."""
    t_start = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mem = MemoryAssumptions.for_train(cfg.train)
    dtype = torch.float32 if mem.act_bytes == 4 else torch.bfloat16
    shape, layout = ModelShape.from_config(cfg), Layout.from_config(cfg)
    prof = base_profile(cfg, cuda)
    fp8_ok = cuda and torch.cuda.get_device_capability() >= (8, 9) and cfg.train.precision == "fp8"

    def say(msg: str) -> None:
        if rank == 0:
            print(f"calibrate: {msg}", flush=True)

    # 1. memory copy
    dist.barrier()
    hbm = _copy_gb_s((1 << 30) if cuda else (64 << 20), device, seconds, cuda)
    say(f"copy: {hbm:.1f} GB/s (bytes read + written) on rank 0")
    # 2. the short-K sweep and the model's GEMMs
    dist.barrier()
    ksweep = [{"m": g.m, "n": g.n, "k": g.k, "seconds": per_call_seconds(_gemm_fn(g, device, dtype), seconds, cuda)}
              for g in k_sweep_shapes(cuda)]
    # every GEMM of the model in the 16/32-bit dtype (gemm_efficiency), and the fp8 ones again in
    # fp8 where the device runs them (fp8_gemm_efficiency)
    model_shapes = gemm_shapes(shape, layout, prof, mem)
    shapes = list(dict.fromkeys(dataclasses.replace(g, fp8=False) for g in model_shapes))
    shapes += [g for g in model_shapes if g.fp8 and fp8_ok]
    say(f"short-K sweep done; timing {len(shapes)} GEMMs of the model's shapes ({seconds:g} s each)")
    gemm = [{"m": g.m, "n": g.n, "k": g.k, "count": g.count, "fp8": g.fp8, "pass": g.pass_,
             "seconds": per_call_seconds(_gemm_fn(g, device, dtype), seconds, cuda)} for g in shapes]
    # 3. attention
    dist.barrier()
    att_s = _attention_seconds(shape, layout, device, dtype, seconds, cuda)
    att_rate = attention_flops(shape, dataclasses.replace(layout, cp=1)) * 3.5 / att_s / 1e12
    say(f"attention forward + backward: {att_s * 1e3:.2f} ms ({att_rate:.3g} TFLOP/s at 2.5x backward)")
    elem_s = _elementwise_seconds(shape, layout, device, dtype, seconds, cuda)
    say(f"one layer's elementwise kernels forward + backward: {elem_s * 1e3:.2f} ms")
    dist.barrier()
    layer_s = _layer_seconds(cfg, device, seconds, cuda)
    say(f"one layer of the model with its head, forward + backward: {layer_s * 1e3:.2f} ms")
    # 4. collectives, tier by tier
    hosts: list[Any] = [None] * world
    # SLURM's node name: nodes of one host (slurmd's multiple-slurmd mode, the dev cluster) share its
    # host name
    dist.all_gather_object(hosts, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    tiers = tier_groups(hosts, prof)
    sizes = message_sizes(shape, layout, mem.act_bytes, hi=(1 << 28) if cuda else (1 << 24))
    max_call = 0.5 if cuda else 1.0
    colls: dict[str, Any] = {}
    for tier, groups in tiers.items():
        handles = [dist.new_group(g) for g in groups]
        mine = next(i for i, g in enumerate(groups) if rank in g)
        colls[tier] = {"n": len(groups[0])}
        for op in OPS:
            s, t = _sweep(op, handles[mine], groups[mine], sizes, device, cuda, max_call, coll_budget_s)
            colls[tier][op] = {"sizes": s, "seconds": t}
            say(f"{tier} {op} over {len(groups)} group(s) of {len(groups[0])}: {len(s)} sizes up to "
                f"{s[-1] / 2**20:.1f} MiB, {s[-1] / t[-1] / 1e9:.3g} GB/s of buffer at the largest")
    if not tiers:
        say("no tier has groups of two or more ranks: no collective measured")
    mine_out = {"hbm": hbm, "gemm": [r["seconds"] for r in gemm], "k": [r["seconds"] for r in ksweep],
                "attention": att_s, "elementwise": elem_s, "layer": layer_s}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine_out)
    if rank != 0:
        return {}
    med = statistics.median
    for i, r in enumerate(gemm):
        r["seconds"] = med(e["gemm"][i] for e in every)
    for i, r in enumerate(ksweep):
        r["seconds"] = med(e["k"][i] for e in every)
    meta = {"when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "hosts": sorted(set(hosts)), "world_size": world, "tasks_per_node": hosts.count(hosts[0]),
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
            "torch": str(torch.__version__), "backend": dist.get_backend(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "python": sys.version.split()[0], "dtype": str(dtype).removeprefix("torch."),
            "config": cfg.run.name, "layout": layout.short(), "wall_s": round(time.time() - t_start, 1),
            "threads_per_rank": torch.get_num_threads(),
            "spread": {"hbm_gb_s": [min(e["hbm"] for e in every), max(e["hbm"] for e in every)],
                       "attention_s": [min(e["attention"] for e in every), max(e["attention"] for e in every)]}}
    return {"hbm_copy_gb_s": med(e["hbm"] for e in every), "gemm": gemm, "k_sweep": ksweep,
            "attention": {"seconds": med(e["attention"] for e in every)},
            "elementwise": {"seconds": med(e["elementwise"] for e in every)},
            "layer": {"seconds": med(e["layer"] for e in every)}, "collectives": colls, "meta": meta}


class CalibrateJob:
    """Submitit callable: one task of the measuring job (``config``: a plain dict). Rank 0
    returns the measurements, the others ``{}``."""

    def __init__(self, config: dict, seconds: float = 0.5, coll_budget_s: float = 8.0):
        self.config = config
        self.seconds = seconds
        self.coll_budget_s = coll_budget_s

    def __call__(self) -> dict[str, Any]:
        cfg = config_from_dict(self.config)
        env = submitit.JobEnvironment()
        os.environ.update(cfg.launch.env)
        os.environ["MASTER_PORT"] = str(master_port(str(env.job_id), 0))
        denv = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        out = measure_in_group(cfg, denv.local_rank, denv.local_world_size, self.seconds, self.coll_budget_s)
        atexit.register(exit_now, 0)  # after submitit records the result (gloo may abort at exit)
        return out


def measure_in_group(cfg: Config, local_rank: int, local_world: int, seconds: float = 0.5,
                     coll_budget_s: float = 8.0) -> dict[str, Any]:
    """Join the process group of the rendezvous variables already exported (``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), measure (:func:`measure_rank`) and leave it.
    Rank 0 returns the measurements, the others ``{}``."""
    threads, _ = process_threads(cfg.launch.cpus_per_task, local_world)
    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=_dt.timedelta(minutes=10))
    else:
        dist.init_process_group("gloo", timeout=_dt.timedelta(minutes=10))
    try:
        out = measure_rank(cfg, seconds, coll_budget_s)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return out


def measure_under_launcher(cfg: Config, seconds: float = 0.5, coll_budget_s: float = 8.0) -> tuple[int, dict]:
    """One rank of a measuring job started by torchrun or as an ``srun`` step (the launcher's
    variables, :func:`moetrain.launch.job.rank_env_from_environ`): returns (rank, what
    :func:`measure_in_group` returned).

    Raises:
        LauncherError: neither torchrun's nor an srun step's variables are set.
    """
    renv = rank_env_from_environ(0)
    os.environ.update(cfg.launch.env)
    return renv.rank, measure_in_group(cfg, renv.local_rank, renv.local_world_size, seconds, coll_budget_s)


def step_main(argv: list[str] | None = None) -> int:
    """``python -m moetrain.launch.calibrate --config RESOLVED.yaml --out RESULT.pt [--seconds S]
    [--collective-budget B]``: a task of the ``srun`` step ``moetrain.calibrate`` starts inside
    an allocation; rank 0 writes the measurements to ``--out`` (``torch.save``)."""
    import argparse

    from moetrain.config import load_config
    from moetrain.utils import atomic_write

    ap = argparse.ArgumentParser(prog="python -m moetrain.launch.calibrate")
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--collective-budget", type=float, default=8.0)
    args = ap.parse_args(argv)
    rank, out = measure_under_launcher(load_config(args.config), args.seconds, args.collective_budget)
    if rank == 0:
        import io

        buf = io.BytesIO()
        torch.save(out, buf)
        atomic_write(args.out, buf.getvalue())
    return 0


if __name__ == "__main__":
    exit_now(step_main())  # gloo may abort at interpreter exit after the work is done
