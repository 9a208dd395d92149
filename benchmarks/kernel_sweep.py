"""What the planner's H100 profile assumes of one GPU, measured on it in steady state.

Run through ``python benchmarks/gpu_check.py --gemm-sweep [--seconds 2]`` (``--cpu`` for a
small version that proves the code on a CPU). Three measurements, each repeated for
``seconds`` so the clocks settle under the power cap, the median of the second half kept:

1. HBM: a 1 GiB device-to-device copy, bytes read + written per second, over the datasheet
   figure: the profile's ``hbm_efficiency`` (0.90 in ``h100-superpod``, from one such copy).
2. The short-K sweep: bf16 GEMMs [16384 × K]·[K × 8192] for K = 512 … 16384. Each output tile
   costs a time per K-step plus a fixed time, so seconds = a·K + b and k0 = b / a in elements of
   K (:func:`fit_k0`) — the planner's ``gemm_k0`` (640, set on A100 rows; docs/topology.md §5
   asks whether an H100 needs more). Its rate at K = 4096 over peak (wave-corrected) is the
   profile's ``gemm_efficiency``.
3. The forward GEMMs of one layer of each Megatron-LM weak-scaling row that issue 21 held back
   (16,384 tokens; QKV, projection, fc1, fc2 at that row's tp), each beside the planner's
   :func:`moetrain.planner.timing.gemm_pass_time` for the profile: measured / predicted.

Returns a dict; ``implied`` holds the profile values the measurements give.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from moetrain.planner.timing import K_REF, TimingAssumptions, _wave, gemm_pass_time
from moetrain.topology.cluster import load_profile

__all__ = ["fit_k0", "per_call_seconds", "kernel_sweep"]

# (model, hidden, tp) of Megatron-LM's weak-scaling rows (moetrain/planner/published.py, _mlm)
MLM_ROWS = (("1.7b", 2048, 1), ("7.1b", 4096, 2), ("16b", 6144, 4), ("32b", 7168, 8), ("70b", 8192, 8),
            ("177b", 12288, 8), ("462b", 18432, 8))


def fit_k0(ks: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares line ``seconds = a·K + b`` through GEMMs that differ only in K; returns
    (k0 = b / a, a). ``k0``: the fixed cost of an output tile in elements of K
    (:func:`moetrain.planner.timing.k_efficiency`).

    Raises:
        ValueError: fewer than two points, or times that do not grow with K.
    """
    if len(ks) < 2 or len(ks) != len(seconds):
        raise ValueError(f"fit_k0 needs two or more (K, seconds) pairs, got {len(ks)} K and {len(seconds)} times")
    mk, ms = statistics.fmean(ks), statistics.fmean(seconds)
    var = sum((k - mk) ** 2 for k in ks)
    a = sum((k - mk) * (s - ms) for k, s in zip(ks, seconds)) / var if var else 0.0
    if a <= 0:
        raise ValueError(f"GEMM times do not grow with K ({list(zip(ks, seconds))}): nothing to fit")
    return (ms - a * mk) / a, a


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
    ≥ 50 ms, the median of the second half."""
    _batch(fn, 1, cuda)
    reps = 1
    while (t := _batch(fn, reps, cuda)) < 0.05 and reps < 1 << 16:
        reps *= 2
    times = [t / reps]
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        times.append(_batch(fn, reps, cuda) / reps)
    return statistics.median(times[len(times) // 2:])


def kernel_sweep(cuda: bool, seconds: float = 2.0, peak_tflops: float | None = None,
                 profile: str = "h100-superpod") -> dict:
    """Measure HBM, the short-K sweep and the weak-scaling table's GEMMs (module doc). On the CPU
    (``cuda`` False) the shapes shrink 32× per side so the code runs in seconds; its numbers
    describe nothing."""
    dev = "cuda" if cuda else "cpu"
    div = 1 if cuda else 32
    prof = load_profile(profile)
    ta = TimingAssumptions()
    peak = (peak_tflops or prof.peak_tflops) * 1e12
    out: dict = {"profile": prof.name, "seconds_per_shape": seconds}

    n = (1 << 30 if cuda else 1 << 24) // 2
    x, y = torch.randn(n, device=dev, dtype=torch.bfloat16), torch.empty(n, device=dev, dtype=torch.bfloat16)
    t = per_call_seconds(lambda: y.copy_(x), seconds, cuda)
    hbm = 2 * 2 * n / t
    out["hbm"] = {"bytes_per_s": hbm, "over_datasheet": hbm / (prof.hbm_gb_s * 1e9)}
    del x, y

    def gemm(m: int, n: int, k: int) -> float:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)  # a weight [out, in], as F.linear holds it
        c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        return per_call_seconds(lambda: torch.mm(a, w.t(), out=c), seconds, cuda)

    m, n = 16384 // div, 8192 // div
    ks = [k // div for k in (512, 1024, 2048, 4096, 8192, 16384)]
    times = [gemm(m, n, k) for k in ks]
    out["k_sweep"] = [{"m": m, "n": n, "k": k, "tflops": 2 * m * n * k / s / 1e12} for k, s in zip(ks, times)]
    implied: dict = {"hbm_efficiency": round(out["hbm"]["over_datasheet"], 3)}
    try:
        k0, _ = fit_k0([float(k) for k in ks], times)
        implied["gemm_k0"] = round(k0 * div)
    except ValueError as e:
        implied["gemm_k0"] = f"not fitted: {e}"
    at_ref = times[ks.index(K_REF // div)]
    implied["gemm_efficiency"] = round(2 * m * n * (K_REF // div) / at_ref / peak / _wave(m, n, prof.sm_count, ta.tile), 3)
    out["implied"] = implied

    rows = []
    rate = prof.peak_tflops * 1e12 * prof.gemm_efficiency
    for model, h, tp in MLM_ROWS:
        tokens = 16384 // div
        for name, nn, kk in (("qkv", 3 * h // tp, h), ("proj", h, h // tp), ("fc1", 4 * h // tp, h),
                             ("fc2", h, 4 * h // tp)):
            nn, kk = nn // div, kk // div
            s = gemm(tokens, nn, kk)
            pred = gemm_pass_time(tokens, nn, kk, 1, rate, prof.hbm_bandwidth(), prof.sm_count, ta.tile, ta.gemm_k0)
            rows.append({"model": model, "gemm": name, "m": tokens, "n": nn, "k": kk, "seconds": s,
                         "tflops": 2 * tokens * nn * kk / s / 1e12, "measured_over_planner": s / pred})
    out["mlm_layer_gemms"] = rows
    # per row: the layer's four GEMMs together, measured seconds over the planner's
    out["measured_over_planner_by_model"] = {
        model: sum(r["seconds"] for r in rows if r["model"] == model)
        / sum(r["seconds"] / r["measured_over_planner"] for r in rows if r["model"] == model)
        for model, _, _ in MLM_ROWS}
    return out
