"""The GPU check: what a CPU machine cannot prove, in one command on a machine with one CUDA GPU.

    python tools/prepare_demo.py && python benchmarks/gpu_check.py [--steps 50]

1. Trains the demo model (configs/demo-moe.yaml, one process: dp = ep = 1) ``--steps`` steps in
   fp32 and in bf16 from the same initial weights and data, and checks that the bf16 losses follow
   the fp32 ones: the mean loss of the last 10 steps within 2 % relative, every step within 5 %
   (bf16 rounds each matmul input to 8 significant bits; on the CPU the two stay within 0.2 % for
   40 steps of a tiny model, tests/test_precision.py; the demo model is larger and trains
   longer, and CUDA's bf16 kernels accumulate in other orders).
2. Reports tokens/s, TFLOP/s per GPU (the trainer's model-FLOPs count) and MFU against the GPU's
   dense bf16 peak (H100 / H200 SXM: 989 TFLOP/s; A100: 312).
3. Counts host syncs over 3 bf16 steps: Python-level reads with
   :class:`moetrain.train.host_sync.HostReadCounter` on CUDA tensors, and every synchronizing
   CUDA call with ``torch.cuda.set_sync_debug_mode("warn")`` (hidden syncs inside ops included).
   Expected with ep = 1 and the ``grouped_mm`` expert backend: 1 per step (the metrics read).
4. Runs each expert backend available (loop, grouped_mm, megablocks when installed) and flash
   attention (when flash-attn is installed) for a few bf16 steps and reports their step times;
   with flash-linear-attention installed, its gated delta rule against moetrain's chunked
   reference (forward and backward, Qwen3-Next's heads, 4,096 tokens); with mamba-ssm, its SSD
   scan against moetrain's (Nemotron-H-like heads).
5. fp8 dispatch (``moe.dispatch_dtype: fp8``; the MoE layer rounds the routed tokens to E4M3 with
   1 × 128 power-of-two scales in every layout): its bf16 losses against plain bf16 (the same
   limits as 1.), its step time and MFU, and the bytes per dispatched row against bf16.
6. fp8 training (``train.precision: fp8``) with each recipe — tensorwise and rowwise take
   ``torch._scaled_mm`` on CUDA (operands zero-padded to multiples of 16), blockwise the reference path: its losses
   against bf16 (the same limits as 1.), step time, speed-up over bf16 and MFU (against the bf16
   peak, as Megatron-Core and TorchTitan report fp8 runs).

7. ``parallel.ep_overlap`` (docs/design/ep-overlap.md): fp32, ``min(--steps, 20)`` steps of the
   demo model with the merged pairs (and delayed weight gradients) against the plain step, run
   twice to see how far two plain runs differ: losses and gradient norms within 10 times that
   (at least 1e-5 relative; bit for bit on the CPU). With two or more GPUs dp = ep = their
   number (up to 4) over NCCL; with one, one rank whose dispatchers send to themselves
   (:func:`_overlap_run`). Reports the step time with and without (on one rank there is no
   network to hide, so the ratio is the turn-taking's cost).

8. Memory: 4 bf16 steps with ``train.memory_history``: each phase's peak (allocated and reserved
   on CUDA), the run's peak beside the planner's prediction for the layout, and a memory snapshot
   written and read back (its segments and recorded allocations: what an out-of-memory error
   leaves for https://pytorch.org/memory_viz). Then 8 steps with ``train.straggler_every=4``: one
   window's busy, phase and wait seconds from the detector's CUDA events.

9. Muon (``train.optimizer: muon``, Newton–Schulz in bf16 on CUDA) for ``--steps`` bf16 steps
   against the AdamW run of 1.: its losses (finite and falling) and its step time over AdamW's.

9b. LoRA (``train.lora``, r 16 on every projection and expert) in bf16 for ``--steps`` steps: the
   experts' adapters on the device's backend (grouped_mm) against the loop's, an FP8 base
   (dequantized per GEMM) against the bf16 base — each within 1 % of its losses at every step —,
   and the step times against the full bf16 fine-tune of 1.

9c. DeepSeek Sparse Attention (``model.dsa``), one MLA layer of benchmarks/bench_dsa.py in bf16:
   the gathered sparse path against the masked reference at 1,024 tokens (outputs and input
   gradient within 2e-2), and its step against dense MLA at 4,096 and 16,384 tokens (k = 512).
   moetrain's PyTorch paths on the GPU: FlashMLA's and TileLang's kernels are not wired in.

10. ``--mfu`` instead: MFU on a model that fills the GPU (``--set`` overrides the demo config; the
   defaults of :data:`MFU_MODEL` make a 2.8B-parameter MoE, 6 layers of hidden 4096 with 8 experts
   of 4096 and top-2, 4096-token sequences): bf16 and fp8 tensorwise for ``--steps`` steps, their
   step time, TFLOP/s, MFU and peak memory. No parity check (the demo's checks above do that).

11. ``--gemm-sweep`` instead: what the planner's H100 profile assumes of the GPU, measured in
   steady state (benchmarks/kernel_sweep.py): HBM copy bandwidth, the short-K constant and the
   large-GEMM efficiency, and the forward GEMMs of Megatron-LM's weak-scaling rows against the
   planner's prediction; ``--seconds`` per shape (2).

12. ``--calibrate`` instead: ``python -m moetrain.calibrate`` on this GPU (one rank: no
   collective; the model of ``--mfu``, in fp8 where the GPU has FP8 tensor cores): the profile it
   writes (GEMM rate and short-K loss, fp8 GEMM rate, attention, copy, elementwise and layer
   efficiencies) beside ``h100-superpod``'s values.

On a machine with no package index (the GPU machines lent to this project carry torch 2.11):
``pip install --no-deps -e .``. ``--cpu`` runs the same checks on the CPU (few steps, the CUDA
sync counter left out) to prove a torch install before a GPU is at hand.

Prints one JSON object; exits 1 when a check fails. Never part of CI (no GPU there); the numbers
of the last run are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from moetrain.config import load_config  # noqa: E402
from moetrain.launch.preflight import resolve_vocab  # noqa: E402
from moetrain.train.host_sync import HostReadCounter  # noqa: E402
from multiproc import free_port  # noqa: E402

# Dense bf16 tensor-core peak per GPU, TFLOP/s (vendor data sheets, SXM parts, no sparsity).
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0}


def peak_tflops(name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


# --mfu: a model that fills one GPU (about 2.8B parameters, 0.95B active per token; fp32 master
# weights, gradients and AdamW states about 45 GB; activations of 2 x 4096 tokens per micro-batch).
MFU_MODEL = ["model.layers=6", "model.hidden=4096", "model.heads=32", "model.kv_heads=8", "model.ffn_hidden=14336",
             "model.seq_len=4096", "moe.num_experts=8", "moe.top_k=2", "moe.ffn_hidden=4096", "moe.shared_experts=1",
             "train.micro_batch_size=2", "train.global_batch_size=8", "train.lr=3e-4", "train.min_lr=3e-5",
             "train.warmup_steps=4"]


def make_trainer(a, precision: str, steps: int, backend: str = "auto", attention: str = "sdpa",
                 extra: list[str] | None = None):
    from moetrain.train.trainer import Trainer

    cfg = resolve_vocab(load_config(a.config, [*a.set, 
        "parallel.dp=1", "parallel.ep=1", f"train.precision={precision}", f"train.steps={steps}",
        "train.val_every=0", "checkpoint.every=0", "checkpoint.resume=false", f"moe.expert_backend={backend}",
        f"model.attention_backend={attention}", f"data.path={a.data}", "data.verify=size",
        f"run.dir={tempfile.mkdtemp()}", *(extra or [])]))
    return Trainer(cfg, write_files=False)


def train(a, precision: str, steps: int, backend: str = "auto", attention: str = "sdpa",
          extra: list[str] | None = None) -> dict:
    trainer = make_trainer(a, precision, steps, backend, attention, extra)
    results = [trainer.train_step() for _ in range(steps)]
    times = [r.extra["step_time_s"] for r in results[2:]] or [results[-1].extra["step_time_s"]]
    step_s = statistics.median(times)
    tflops = trainer.flops_per_token * trainer.tokens_per_step / step_s / 1e12
    backend_used = next((m.experts.backend for m in trainer.moe_layers.values()), None)
    return {"losses": [r.loss for r in results], "step_s": step_s, "tokens_per_s": trainer.tokens_per_step / step_s,
            "tflops_per_gpu": tflops, "expert_backend": backend_used, "trainer": trainer}


def count_syncs(trainer, steps: int = 3, cuda: bool = True) -> dict:
    """Python-level reads of device tensors and (CUDA) synchronizing calls per step."""
    trainer.train_step()  # warm-up
    with warnings.catch_warnings(record=True) as caught, \
            HostReadCounter("cuda" if cuda else "cpu", keep_stacks=True) as reads:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                trainer.train_step()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    # (the first warning says the debug mode is a prototype: not a sync)
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    return {"python_reads_per_step": reads.count / steps, "read_kinds": dict(reads.kinds),
            "cuda_syncs_per_step": len(syncs) / steps, "cuda_sync_samples": syncs[:5],
            "read_stacks": reads.stacks[:3]}


# --cpu: the --mfu model shrunk to a size the CPU times in seconds (proves the code, measures nothing)
CPU_SHRINK = ["model.layers=2", "model.hidden=256", "model.heads=8", "model.kv_heads=4", "model.ffn_hidden=512",
              "moe.ffn_hidden=256", "model.seq_len=256"]


def calibrate_here(cuda: bool, sets: list[str]) -> int:
    """``python -m moetrain.calibrate`` with one local rank on the --mfu model (fp8 on a GPU with
    FP8 tensor cores); prints the measured terms beside h100-superpod's. Returns the exit code."""
    from moetrain.topology.cluster import load_profile

    fp8 = cuda and torch.cuda.get_device_capability() >= (8, 9)
    over = [*MFU_MODEL, "parallel.dp=1", "parallel.ep=1", "launch.cluster=local", "launch.nodes=1",
            f"train.precision={'fp8' if fp8 else 'bf16'}", *([] if cuda else CPU_SHRINK),
            *sets]
    out = Path(tempfile.mkdtemp()) / "calibrated.yaml"
    cmd = [sys.executable, "-m", "moetrain.calibrate", "--config", str(ROOT / "configs" / "demo-moe.yaml"),
           "--out", str(out), *(["--seconds", "0.05"] if not cuda else [])]
    for s in over:
        cmd += ["--set", s]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        print(json.dumps({"calibrate": "failed", "exit": res.returncode, "stdout": res.stdout[-4000:],
                          "stderr": res.stderr[-4000:]}, indent=1))
        return 1
    prof, ref = load_profile(out), load_profile("h100-superpod")
    keys = ("peak_tflops", "gemm_efficiency", "gemm_k0", "fp8_peak_tflops", "fp8_gemm_efficiency",
            "attention_efficiency", "hbm_gb_s", "hbm_efficiency", "elementwise_efficiency", "layer_efficiency")
    print(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                      "model": over, "measured": {k: getattr(prof, k) for k in keys},
                      "h100_superpod": {k: getattr(ref, k) for k in keys},
                      "report": prof.calibration.get("report"), "log": res.stdout[-3000:]}, indent=1, default=str))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/demo-moe.yaml"))
    ap.add_argument("--data", default=str(ROOT / "data/demo/shards"))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (a check of the torch install)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override applied to every training of the check (repeatable)")
    ap.add_argument("--only", default="parity,syncs,backends,dispatch,fp8,overlap,memory,muon,lora,dsa",
                    help="comma-separated sections of the check to run (default: all); bf16 is trained as the "
                         "baseline of the fp8 sections either way")
    ap.add_argument("--overlap-ranks", type=int, default=0,
                    help="ranks of the ep_overlap check (default: the GPUs, up to 4; with one, the one-rank check)")
    ap.add_argument("--recipes", default="tensorwise,rowwise,blockwise", help="fp8 training recipes to check")
    ap.add_argument("--mfu", action="store_true",
                    help="only MFU on a model that fills the GPU (MFU_MODEL, then --set), bf16 and fp8 tensorwise")
    ap.add_argument("--gemm-sweep", action="store_true",
                    help="only measure HBM, the short-K sweep and the weak-scaling table's GEMMs (kernel_sweep.py)")
    ap.add_argument("--seconds", type=float, default=2.0, help="--gemm-sweep: seconds per shape (clocks settle)")
    ap.add_argument("--calibrate", action="store_true",
                    help="only run python -m moetrain.calibrate on this GPU with the --mfu model; print its profile")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.cpu
    if not cuda and not a.cpu:
        print(json.dumps({"skipped": "no CUDA device (--cpu runs the checks on the CPU)"}))
        return 0
    if a.calibrate:
        return calibrate_here(cuda, a.set)
    if a.gemm_sweep:
        from kernel_sweep import kernel_sweep

        name = torch.cuda.get_device_name() if cuda else "cpu"
        res = kernel_sweep(cuda, a.seconds if cuda else min(a.seconds, 0.05), name, peak_tflops(name) if cuda else None)
        print(json.dumps({"device": name, "torch": torch.__version__, **res}, indent=1, default=str))
        return 0
    if not (Path(a.data) / "manifest.json").is_file():
        sys.exit(f"no token shards in {a.data}: run `python tools/prepare_demo.py` first")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    from moetrain.launch.job import flight_recorder_env

    for name, value in flight_recorder_env(Path(tempfile.mkdtemp())).items():  # as every rank of a job runs
        os.environ.setdefault(name, value)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_tflops(name) if cuda else None
    out: dict = {"device": name, "torch": torch.__version__, "steps": a.steps}
    failures: list[str] = []

    def partial(*_):  # a timeout's SIGTERM: print what was measured so far
        print(json.dumps({**out, "failures": [*failures, "stopped by SIGTERM"]}, indent=1, default=str))
        sys.exit(124)

    signal.signal(signal.SIGTERM, partial)
    if a.mfu:
        a.set = [*MFU_MODEL, *a.set]
        out["model"] = a.set
        for precision, extra in (("bf16", []), ("fp8", ["train.fp8_recipe=tensorwise"])):
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            else:
                extra = [*extra, "parallel.backend=gloo"]
            try:
                r = train(a, precision, a.steps, extra=extra)
                out[precision] = {"step_s": r["step_s"], "tokens_per_s": r["tokens_per_s"],
                                  "tflops_per_gpu": r["tflops_per_gpu"], "expert_backend": r["expert_backend"],
                                  "mfu": r["tflops_per_gpu"] / peak if peak else None,
                                  "params": sum(p.numel() for m in r["trainer"].model_parts for p in m.parameters()),
                                  "losses": r["losses"][::max(1, a.steps // 5)],
                                  "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                                  "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None}
                del r
            except Exception as e:  # noqa: BLE001 - reported, and a failure of the check
                out[precision] = {"error": f"{type(e).__name__}: {e}"}
                failures.append(f"--mfu {precision}: {e}")
        out["failures"] = failures
        print(json.dumps(out, indent=1, default=str))
        return 1 if failures else 0

    # 1.-2. bf16 follows fp32; speed and MFU.
    only = set(a.only.split(","))
    t0 = time.time()
    extra = [] if cuda else ["parallel.backend=gloo"]
    bf16 = train(a, "bf16", a.steps, extra=extra)
    out["bf16"] = {k: bf16[k] for k in ("step_s", "tokens_per_s", "tflops_per_gpu", "expert_backend")}
    if "parity" in only:
        parity(a, out, bf16, extra, peak, failures)
    if "syncs" in only:
        syncs(a, out, bf16, extra, cuda, failures)
    if "backends" in only:
        backends(a, out, bf16, extra, cuda, failures)
    if "dispatch" in only:
        dispatch(a, out, bf16, extra, peak, failures)
    if "fp8" in only:
        fp8_training(a, out, bf16, extra, peak, failures)
    if "overlap" in only:
        overlap(a, out, extra, cuda, failures)
    if "memory" in only:
        memory(a, out, extra, cuda, failures)
    if "muon" in only:
        muon(a, out, bf16, extra, failures)
    if "lora" in only:
        lora(a, out, bf16, extra, failures)
    if "dsa" in only:
        dsa(out, cuda, failures)
    out["wall_s"] = time.time() - t0
    out["failures"] = failures
    print(json.dumps(out, indent=1, default=str))
    return 1 if failures else 0


def parity(a, out: dict, bf16: dict, extra: list[str], peak: float | None, failures: list[str]) -> None:
    fp32 = train(a, "fp32", a.steps, extra=extra)
    rel = [abs(b - f) / f for b, f in zip(bf16["losses"], fp32["losses"])]
    tail = abs(statistics.mean(bf16["losses"][-10:]) - statistics.mean(fp32["losses"][-10:])) / statistics.mean(
        fp32["losses"][-10:])
    out["parity"] = {"max_step_rel": max(rel), "last10_mean_rel": tail, "fp32_last": fp32["losses"][-1],
                     "bf16_last": bf16["losses"][-1], "first": fp32["losses"][0]}
    if tail > 0.02 or max(rel) > 0.05:
        failures.append(f"bf16 loss parity: last-10 mean {tail:.3%} (limit 2%), worst step {max(rel):.3%} (limit 5%)")
    for label, r in (("fp32", fp32), ("bf16", bf16)):
        out[label] = {k: r[k] for k in ("step_s", "tokens_per_s", "tflops_per_gpu", "expert_backend")}
        if peak:
            out[label]["mfu"] = r["tflops_per_gpu"] / peak
    out["peak_bf16_tflops"] = peak


def syncs(a, out: dict, bf16: dict, extra: list[str], cuda: bool, failures: list[str]) -> None:
    # 3. host syncs in the bf16 step (grouped_mm at ep = 1: the metrics read only).
    # (on the CPU "auto" picks the loop backend, which reads each layer's counts: count with grouped_mm)
    out["syncs"] = count_syncs(bf16["trainer"] if cuda else make_trainer(a, "bf16", 8, "grouped_mm", extra=extra),
                               cuda=cuda)
    if out["syncs"]["python_reads_per_step"] > 1:
        failures.append(f"{out['syncs']['python_reads_per_step']} Python-level reads of CUDA tensors per step "
                        f"(expected 1): {out['syncs']['read_stacks']}")



def backends(a, out: dict, bf16: dict, extra: list[str], cuda: bool, failures: list[str]) -> None:
    # 4. each expert backend (megablocks when installed) and flash attention (when installed).
    import importlib.util

    out["expert_backends"] = {}
    backends = ["loop", "grouped_mm"] + (["megablocks"] if cuda and importlib.util.find_spec("megablocks") else [])
    for backend in backends:
        try:
            r = train(a, "bf16", 6, backend, extra=extra)
            out["expert_backends"][backend] = {"step_s": r["step_s"], "tokens_per_s": r["tokens_per_s"]}
        except Exception as e:  # noqa: BLE001 - reported, and a failure of the check
            out["expert_backends"][backend] = {"error": f"{type(e).__name__}: {e}"}
            failures.append(f"expert backend {backend}: {e}")
    if cuda and importlib.util.find_spec("flash_attn"):
        try:
            r = train(a, "bf16", 6, "auto", attention="flash")
            out["attention_flash"] = {"step_s": r["step_s"], "tokens_per_s": r["tokens_per_s"],
                                      "over_sdpa": r["step_s"] / bf16["step_s"]}
        except Exception as e:  # noqa: BLE001
            out["attention_flash"] = {"error": f"{type(e).__name__}: {e}"}
            failures.append(f"flash attention: {e}")
    # The recurrent layers' kernels against moetrain's reference paths, where their package is here.
    for key, package, parity, what in (("gated_deltanet_fla", "fla", fla_parity, "gated DeltaNet fla"),
                                       ("kda_fla", "fla", kda_fla_parity, "KDA fla"),
                                       ("mamba2_mamba_ssm", "mamba_ssm", mamba_ssm_parity, "Mamba-2 mamba_ssm")):
        if not cuda or not importlib.util.find_spec(package):
            continue
        try:
            out[key] = parity()
            if out[key]["max_rel_error"] > 2e-2:
                failures.append(f"{what}: {out[key]}")
        except Exception as e:  # noqa: BLE001
            out[key] = {"error": f"{type(e).__name__}: {e}"}
            failures.append(f"{what}: {e}")


def _kernel_parity(reference, kernel, inputs: list, dout, names: list[str], chunk: int) -> dict:
    """``kernel`` against ``reference`` on the same inputs (bf16 where they are): the output and
    the inputs' gradients relative to each tensor's largest entry, and their seconds."""
    results = []
    for fn in (reference, kernel):
        xs = [t.clone().requires_grad_() for t in inputs]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y, _ = fn(*xs, chunk)
        y.backward(dout)
        torch.cuda.synchronize()
        results.append(([y.detach().float()] + [x.grad.float() for x in xs], time.perf_counter() - t0))
    (ref, t_ref), (got, t_kernel) = results
    errs = {name: ((a - b).abs().max() / b.abs().max()).item() for name, a, b in zip(names, got, ref)}
    return {"errors": errs, "max_rel_error": max(errs.values()), "torch_s": t_ref, "kernel_s": t_kernel}


def mamba_ssm_parity() -> dict:
    """mamba-ssm's SSD scan (bf16 x, B, C) against moetrain's chunked reference on the same
    inputs: Nemotron-H-like heads (64 of 64, state 128, 8 groups), 4,096 tokens."""
    from moetrain.model.mamba2 import chunk_ssd, mamba_ssm_scan

    g = torch.Generator(device="cuda").manual_seed(0)
    B, S, H, P, G, N = 1, 4096, 64, 64, 8, 128
    x = torch.randn(B, S, H, P, device="cuda", generator=g).to(torch.bfloat16)
    dt = 0.1 * torch.rand(B, S, H, device="cuda", generator=g)
    A = -torch.arange(1, H + 1, device="cuda", dtype=torch.float32) / H
    Bm, C = (torch.randn(B, S, G, N, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    dout = torch.randn(B, S, H, P, device="cuda", generator=g).to(torch.bfloat16)
    return _kernel_parity(chunk_ssd, mamba_ssm_scan, [x, dt, A, Bm, C], dout, ["y", "dx", "ddt", "dA", "dB", "dC"], 128)


def fla_parity() -> dict:
    """flash-linear-attention's gated delta rule (bf16 inputs) against moetrain's chunked
    reference on the same inputs (fp32 inside): outputs and the input gradients, relative to each
    tensor's largest entry; Qwen3-Next's head shape (16 key / 32 value heads of 128), 4,096 tokens."""
    from moetrain.model.gated_deltanet import chunk_gated_delta_rule, fla_gated_delta_rule

    g = torch.Generator(device="cuda").manual_seed(0)
    B, S, Hk, Hv, D = 1, 4096, 16, 32, 128
    base = [torch.randn(B, S, Hk, D, device="cuda", generator=g), torch.randn(B, S, Hk, D, device="cuda", generator=g),
            torch.randn(B, S, Hv, D, device="cuda", generator=g),
            -torch.rand(B, S, Hv, device="cuda", generator=g), torch.rand(B, S, Hv, device="cuda", generator=g)]
    base = [t.to(torch.bfloat16) if i < 3 else t for i, t in enumerate(base)]
    dout = torch.randn(B, S, Hv, D, device="cuda", generator=g).to(torch.bfloat16)
    return _kernel_parity(chunk_gated_delta_rule, fla_gated_delta_rule, base, dout,
                          ["o", "dq", "dk", "dv", "dg", "dbeta"], 64)


def kda_fla_parity() -> dict:
    """flash-linear-attention's KDA kernel (bf16 q, k, v; a log decay per key channel) against
    moetrain's chunked reference on the same inputs: Kimi Linear's head shape (32 heads of 128),
    4,096 tokens."""
    from moetrain.model.gated_deltanet import chunk_gated_delta_rule
    from moetrain.model.kda import fla_kda

    g = torch.Generator(device="cuda").manual_seed(0)
    B, S, H, D = 1, 4096, 32, 128
    base = [torch.randn(B, S, H, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)]
    base += [-0.1 * torch.rand(B, S, H, D, device="cuda", generator=g), torch.rand(B, S, H, device="cuda", generator=g)]
    dout = torch.randn(B, S, H, D, device="cuda", generator=g).to(torch.bfloat16)
    return _kernel_parity(chunk_gated_delta_rule, fla_kda, base, dout, ["o", "dq", "dk", "dv", "dg", "dbeta"], 64)


def dispatch(a, out: dict, bf16: dict, extra: list[str], peak: float | None, failures: list[str]) -> None:
    # 5. fp8 dispatch: parity with bf16, speed, bytes per row.
    from moetrain.model import fp8

    try:
        r = train(a, "bf16", a.steps, extra=[*extra, "moe.dispatch_dtype=fp8"])
        rel8 = [abs(x - b) / b for x, b in zip(r["losses"], bf16["losses"])]
        tail8 = abs(statistics.mean(r["losses"][-10:]) - statistics.mean(bf16["losses"][-10:])) / statistics.mean(
            bf16["losses"][-10:])
        hidden = r["trainer"].cfg.model.hidden
        out["fp8_dispatch"] = {"max_step_rel_to_bf16": max(rel8), "last10_mean_rel_to_bf16": tail8,
                               "step_s": r["step_s"], "tflops_per_gpu": r["tflops_per_gpu"],
                               "mfu": r["tflops_per_gpu"] / peak if peak else None,
                               "row_bytes_over_bf16": fp8.row_bytes(hidden, fp8.E4M3) / (2 * hidden)}
        if tail8 > 0.02 or max(rel8) > 0.05:
            failures.append(f"fp8 dispatch loss parity: last-10 mean {tail8:.3%} (limit 2%), worst step "
                            f"{max(rel8):.3%} (limit 5%)")
    except Exception as e:  # noqa: BLE001
        out["fp8_dispatch"] = {"error": f"{type(e).__name__}: {e}"}
        failures.append(f"fp8 dispatch: {e}")


def fp8_training(a, out: dict, bf16: dict, extra: list[str], peak: float | None, failures: list[str]) -> None:
    # 6. fp8 training, each recipe: parity with bf16, speed, MFU.
    out["fp8_training"] = {}
    for recipe in a.recipes.split(","):
        try:
            r = train(a, "fp8", a.steps, extra=[*extra, f"train.fp8_recipe={recipe}"])
            rel8 = [abs(x - b) / b for x, b in zip(r["losses"], bf16["losses"])]
            tail8 = abs(statistics.mean(r["losses"][-10:]) - statistics.mean(bf16["losses"][-10:])) / statistics.mean(
                bf16["losses"][-10:])
            out["fp8_training"][recipe] = {
                "max_step_rel_to_bf16": max(rel8), "last10_mean_rel_to_bf16": tail8, "step_s": r["step_s"],
                "speedup_over_bf16": bf16["step_s"] / r["step_s"], "tflops_per_gpu": r["tflops_per_gpu"],
                "mfu": r["tflops_per_gpu"] / peak if peak else None, "expert_backend": r["expert_backend"]}
            if tail8 > 0.02 or max(rel8) > 0.05:
                failures.append(f"fp8 {recipe} loss parity: last-10 mean {tail8:.3%} (limit 2%), worst step "
                                f"{max(rel8):.3%} (limit 5%)")
        except Exception as e:  # noqa: BLE001
            out["fp8_training"][recipe] = {"error": f"{type(e).__name__}: {e}"}
            failures.append(f"fp8 training {recipe}: {e}")


def lora(a, out: dict, bf16: dict, extra: list[str], failures: list[str]) -> None:
    # 10. LoRA (r 16 on every projection and expert) in bf16: the experts' adapters on the device's
    #     backend (grouped_mm on CUDA) against the loop's, an FP8 base against the bf16 base (the
    #     issue's 1 % over the steps), and the step time against the full bf16 fine-tune's.
    lora_sets = ["train.lora.r=16", "train.lora.lora_alpha=32"]
    try:
        runs = {name: train(a, "bf16", a.steps, backend=backend, extra=[*extra, *lora_sets,
                                                                         f"train.lora.base_dtype={base}"])
                for name, backend, base in (("bf16_base", "auto", "bf16"), ("bf16_base_loop", "loop", "bf16"),
                                            ("fp8_base", "auto", "fp8"))}
        ref = runs["bf16_base"]["losses"]
        res = {name: {"step_s": r["step_s"], "step_ratio_to_full_bf16": r["step_s"] / bf16["step_s"],
                      "expert_backend": r["expert_backend"],
                      "max_step_rel_to_bf16_base": max(abs(x - b) / b for x, b in zip(r["losses"], ref))}
               for name, r in runs.items()}
        out["lora"] = res
        for name in ("bf16_base_loop", "fp8_base"):
            if res[name]["max_step_rel_to_bf16_base"] > 0.01:
                failures.append(f"lora {name}: {res[name]['max_step_rel_to_bf16_base']:.3%} off the bf16 base's "
                                f"losses (limit 1%)")
    except Exception as e:  # noqa: BLE001
        out["lora"] = {"error": f"{type(e).__name__}: {e}"}
        failures.append(f"lora: {e}")


def dsa(out: dict, cuda: bool, failures: list[str]) -> None:
    # 9c. DeepSeek Sparse Attention, one MLA layer of benchmarks/bench_dsa.py in bf16 on the device:
    #     the gathered path against the masked reference at 1,024 tokens (outputs and the input's
    #     gradient within 2e-2 of the largest entry: bf16 rounding of differently ordered sums), and
    #     the layer's step against dense MLA at 4,096 and 16,384 tokens (k = 512). The GPU kernels
    #     (FlashMLA, TileLang) are not wired in: this times moetrain's PyTorch paths on the GPU.
    from bench_dsa import SHAPE, layer

    from moetrain.model.layers import rope_cos_sin, set_compute_dtype

    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32

    def build(kind: str):
        m = layer(kind).to(dev)
        set_compute_dtype(m, dtype)
        return m

    def run(m, seq: int, seed: int = 0):
        g = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn(1, seq, SHAPE["hidden"], device=dev, dtype=dtype, generator=g).requires_grad_()
        cos, sin = rope_cos_sin(torch.arange(seq, device=dev), SHAPE["qk_rope_head_dim"], 10000.0)
        y = m(x, cos, sin)
        y.float().square().mean().backward()
        return y.detach().float(), x.grad.float()

    def timed(kind: str, seq: int) -> float:
        m = build(kind)
        run(m, seq)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            run(m, seq)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 3

    try:
        (ym, gm), (yg, gg) = run(build("dsa-masked"), 1024), run(build("dsa-gathered"), 1024)
        res: dict = {"parity_out": ((ym - yg).abs().max() / ym.abs().max()).item(),
                     "parity_grad": ((gm - gg).abs().max() / gm.abs().max()).item()}
        for seq in (4096, 16384):
            dense, sparse = timed("dense", seq), timed("dsa-gathered", seq)
            res[str(seq)] = {"dense_s": dense, "gathered_s": sparse, "gathered_over_dense": sparse / dense}
        out["dsa"] = res
        if max(res["parity_out"], res["parity_grad"]) > 2e-2:
            failures.append(f"dsa: the gathered path is {res['parity_out']:.2e} / {res['parity_grad']:.2e} off the "
                            f"masked reference (limit 2e-2)")
    except Exception as e:  # noqa: BLE001
        out["dsa"] = {"error": f"{type(e).__name__}: {e}"}
        failures.append(f"dsa: {e}")


def muon(a, out: dict, bf16: dict, extra: list[str], failures: list[str]) -> None:
    # 9. Muon (bf16 Newton–Schulz on CUDA) against the bf16 AdamW run: losses, step time.
    import math

    try:
        r = train(a, "bf16", a.steps, extra=[*extra, "train.optimizer=muon"])
        out["muon"] = {"step_s": r["step_s"], "over_adamw": r["step_s"] / bf16["step_s"],
                       "loss_last": r["losses"][-1], "adamw_loss_last": bf16["losses"][-1],
                       "last10_mean": statistics.mean(r["losses"][-10:]),
                       "adamw_last10_mean": statistics.mean(bf16["losses"][-10:])}
        if not all(math.isfinite(x) for x in r["losses"]) or r["losses"][-1] >= r["losses"][0]:
            failures.append(f"muon: losses {r['losses'][0]} -> {r['losses'][-1]} (not finite, or not falling)")
    except Exception as e:  # noqa: BLE001
        out["muon"] = {"error": f"{type(e).__name__}: {e}"}
        failures.append(f"muon: {e}")


def memory(a, out: dict, extra: list[str], cuda: bool, failures: list[str]) -> None:
    # 8. memory per phase, the planner's prediction beside the measured peak, a snapshot; the
    # straggler detector's clock (CUDA events, read once per window).
    import pickle

    from moetrain.train.memory import dump_memory_snapshot, predicted_memory_gib

    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        trainer = make_trainer(a, "bf16", 4, extra=[*extra, "train.memory_history=true"])
        phases = [trainer.train_step().extra["memory_by_phase"] for _ in range(4)][-1]
        res = {"by_phase_last_step": phases, "peak_gib": trainer.phase_memory.peak_gib(),
               "predicted_gib": predicted_memory_gib(trainer.cfg)}
        want = {"allocated_gib", "reserved_gib"} if cuda else {"rss_gib"}
        if set(phases) != {"forward", "backward", "optimizer"} or any(set(v) != want for v in phases.values()):
            failures.append(f"memory by phase: {phases}")
        if cuda:
            path = dump_memory_snapshot(Path(tempfile.mkdtemp()), 0, "check")
            snap = pickle.loads(path.read_bytes())
            res["snapshot_segments"] = len(snap.get("segments", []))
            res["snapshot_traces"] = sum(len(t) for t in snap.get("device_traces", []))
            res["predicted_over_measured"] = res["predicted_gib"] / res["peak_gib"] if res["predicted_gib"] else None
            if not res["snapshot_segments"] or not res["snapshot_traces"]:
                failures.append(f"memory snapshot {path}: {res['snapshot_segments']} segments, "
                                f"{res['snapshot_traces']} recorded allocations")
        out["memory"] = res
        from moetrain.train.stragglers import FIELDS

        trainer = make_trainer(a, "bf16", 8, extra=[*extra, "train.straggler_every=4"])
        for _ in range(8):
            trainer.train_step()
        window = dict(zip(FIELDS, trainer.stragglers.last_table[0]))
        out["straggler_window_s"] = window
        if not (0 < window["busy"] <= window["step"] and window["waits"] >= 0 and window["forward"] > 0):
            failures.append(f"straggler window sums: {window}")
    except Exception as e:  # noqa: BLE001
        out["memory"] = {"error": f"{type(e).__name__}: {e}"}
        failures.append(f"memory: {e}")


def _overlap_run(a, extra: list[str], on: bool, steps: int, world: int) -> dict:
    """fp32 losses, gradient norms and median step time of ``steps`` steps of the demo model with
    ``parallel.ep_overlap`` (and ``delay_wgrad_compute``) ``on`` or off. ``world`` > 1: this is
    one rank of dp = ep = world (run_distributed). ``world`` = 1: one rank, whose MoE layers are
    given the all-to-all dispatcher over the one-rank world group (each transfer an NCCL
    all-to-all with itself) and whose runner merges the micro-batches' pairs — what a config
    cannot ask for (ep_overlap needs ep > 1), but every piece a GPU changes runs: the backward
    side's thread on the rank's device and stream, autograd's device thread handing over inside
    the exchange's backward, NCCL's wait as a stream wait, the deferred weight gradients."""
    import dataclasses

    import torch.distributed as dist

    from moetrain.parallel.ep_overlap import InTurnExchange
    from moetrain.parallel.exchange import Exchange
    from moetrain.parallel.expert import AllToAllDispatcher
    from moetrain.parallel.runner import SingleStageRunner

    sets = [*extra, f"parallel.dp={world}", f"parallel.ep={world}"]
    if world > 1:
        sets += [f"parallel.ep_overlap={on}", f"parallel.delay_wgrad_compute={on}"]
    trainer = make_trainer(a, "fp32", steps, extra=sets)
    if world == 1:
        group = dist.group.WORLD
        for moe in trainer.moe_layers.values():
            exchange = (InTurnExchange if on else Exchange)(group)
            moe.parallel = dataclasses.replace(moe.parallel, dispatcher=AllToAllDispatcher(
                moe.num_experts, group, exchange=exchange))
        trainer.runner = SingleStageRunner(trainer.model_parts[0], trainer.ps, ep_overlap=on, delay_wgrad=on)
    import logging

    hand_overs = [0]

    class Count(logging.Handler):  # the turn-taking's DEBUG records (moetrain.parallel.ep_overlap)
        def emit(self, record: logging.LogRecord) -> None:
            hand_overs[0] += getattr(record, "what", "") == "issue"

    log, handler = logging.getLogger("moetrain.parallel.ep_overlap"), Count()
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        results = [trainer.train_step() for _ in range(steps)]
    finally:
        log.removeHandler(handler)
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "step_s": statistics.median(r.extra["step_time_s"] for r in results[2:]),
            "micro_batches": trainer.cfg.grad_accum_steps, "hand_overs_per_step": hand_overs[0] / steps}


def _overlap_rank(rank: int, world: int, a, extra: list[str], on: bool, steps: int) -> dict:
    return _overlap_run(a, extra, on, steps, world)


def overlap(a, out: dict, extra: list[str], cuda: bool, failures: list[str]) -> None:
    # 7. parallel.ep_overlap: the merged pairs on this machine's devices, against the plain step.
    from multiproc import run_distributed

    gpus = torch.cuda.device_count() if cuda else 0
    world = a.overlap_ranks or (min(gpus, 4) if gpus >= 2 else 1)
    steps = max(min(a.steps, 20), 4)

    def run(on: bool) -> dict:
        if world == 1:
            return _overlap_run(a, extra, on, steps, 1)
        return run_distributed(_overlap_rank, world, a, extra, on, steps, timeout=600)[0]

    def rel(x: dict, y: dict) -> float:
        return max(abs(u - v) / max(abs(v), 1e-30) for k in ("losses", "norms") for u, v in zip(x[k], y[k]))

    try:
        off, off_again, on = run(False), run(False), run(True)
        res = {"ranks": world, "steps": steps, "micro_batches": on["micro_batches"],
               "bit_exact": on["losses"] == off["losses"] and on["norms"] == off["norms"],
               "max_rel_on_vs_off": rel(on, off), "max_rel_off_vs_off": rel(off_again, off),
               "step_s_off": off["step_s"], "step_s_on": on["step_s"], "on_over_off": on["step_s"] / off["step_s"],
               "hand_overs_per_step": on["hand_overs_per_step"], "loss_last": on["losses"][-1]}
        out["ep_overlap"] = res
        # The pairs run the plain step's kernels in its order: only kernels that are not
        # deterministic run to run (atomics) may make them differ, as they make two plain runs differ.
        limit = max(1e-5, 10 * res["max_rel_off_vs_off"])
        if not res["hand_overs_per_step"]:
            failures.append("ep_overlap: no pair handed over at a transfer (the overlap did not run)")
        if res["max_rel_on_vs_off"] > limit:
            failures.append(f"ep_overlap: losses / grad norms {res['max_rel_on_vs_off']:.2e} from the plain step "
                            f"(limit {limit:.1e}; two plain runs differ by {res['max_rel_off_vs_off']:.1e})")
    except Exception as e:  # noqa: BLE001
        out["ep_overlap"] = {"error": f"{type(e).__name__}: {e}"}
        failures.append(f"ep_overlap: {e}")


if __name__ == "__main__":
    sys.exit(main())
