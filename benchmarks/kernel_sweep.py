"""What the planner's H100 profile assumes of one GPU, measured on it in steady state.

Run through ``python benchmarks/gpu_check.py --gemm-sweep [--seconds 2]`` (``--cpu`` for a
version shrunk 32× per side that proves the code on a CPU; its numbers describe nothing). Each
shape is repeated for ``seconds`` so the clocks settle under the power cap, and the median of
the second half is kept:

1. HBM: a 1 GiB device-to-device copy, bytes read + written per second, over the device's
   datasheet bandwidth (H100 SXM 3,350 GB/s, H200 4,800): the profile's ``hbm_efficiency``
   (0.90 in ``h100-superpod``, from one such copy reported for an H100 of this workplace).
2. The short-K sweep: bf16 GEMMs [16384 × K]·[K × 8192] for K = 512 … 16384. Up to the
   planner's reference K (4096, :data:`moetrain.planner.timing.K_REF`) each output tile costs a
   time per K-step plus a fixed time (filling its pipeline, writing the tile), so seconds =
   a·K + b and k0 = b / a in elements of K (:func:`fit_k0`): the planner's ``gemm_k0`` (640, set
   on A100 rows; docs/topology.md §5 asks whether an H100 needs more). The rate at K = 4096
   over peak, divided by the planner's wave efficiency of that shape, is the profile's
   ``gemm_efficiency``. K = 8192 and 16384 are reported, not fitted (the planner caps the
   short-K term at K_REF).
3. The forward GEMMs of one layer of each row of Megatron-LM's H100 weak-scaling table (QKV,
   projection, fc1, fc2 at that row's tp, the tokens of the micro-batch the planner picks for
   it), beside the planner's :func:`moetrain.planner.timing.gemm_pass_time` for the profile
   with the device's datasheet HBM bandwidth: measured / predicted, per GEMM and per row.

Returns a dict; ``implied`` holds the profile values the measurements give. The timing and the
short-K fit are ``python -m moetrain.calibrate``'s own (:func:`moetrain.launch.calibrate.per_call_seconds`,
:func:`moetrain.planner.calibration.fit_k0`), which measures the same terms, and the collectives,
on a whole cluster and writes them into a profile.
"""

from __future__ import annotations

import dataclasses

import torch

from moetrain.launch.calibrate import per_call_seconds
from moetrain.planner import published
from moetrain.planner.calibration import fit_k0
from moetrain.planner.timing import K_REF, TimingAssumptions, _wave, gemm_pass_time
from moetrain.topology.cluster import load_profile

__all__ = ["fit_k0", "per_call_seconds", "time_copy", "time_gemm", "mlm_rows", "kernel_sweep"]

# Datasheet HBM bandwidth of the SXM parts, GB/s (NVIDIA data sheets)
DATASHEET_HBM_GB_S = {"H100": 3350.0, "H200": 4800.0, "H800": 3350.0, "A100": 2039.0}
SWEEP_KS = (512, 1024, 2048, 4096, 8192, 16384)


def time_copy(nbytes: int, device: str, seconds: float) -> float:
    """Seconds per device-to-device copy of ``nbytes`` (bf16)."""
    x = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return per_call_seconds(lambda: y.copy_(x), seconds, device == "cuda")


def time_gemm(m: int, n: int, k: int, device: str, seconds: float) -> float:
    """Seconds per bf16 GEMM [m × k]·[k × n], the weight held [n × k] as ``F.linear`` holds it."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    c = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    return per_call_seconds(lambda: torch.mm(a, w.t(), out=c), seconds, device == "cuda")


def mlm_rows() -> list[tuple[str, int, int, int]]:
    """(row, hidden, tp, tokens of the micro-batch the planner picks) of Megatron-LM's H100
    weak-scaling table (moetrain/planner/published.py)."""
    rows = []
    for e in published.PUBLISHED:
        if e.key.startswith("megatron-core-r0.8-"):
            assert e.shape is not None
            mbs = published.predict(e)["mbs"]
            rows.append((e.key.removeprefix("megatron-core-r0.8-"), e.shape.hidden, e.fixed["tp"],
                         mbs * e.shape.seq_len))
    return rows


def kernel_sweep(cuda: bool, seconds: float = 2.0, device_name: str = "cpu", peak_tflops: float | None = None,
                 profile: str = "h100-superpod", shrink: int | None = None) -> dict:
    """Measure HBM, the short-K sweep and the weak-scaling table's GEMMs (module doc).
    ``shrink``: divide every GEMM side and the copy by this (default 1 on a GPU, 32 on the CPU)."""
    dev = "cuda" if cuda else "cpu"
    div = shrink or (1 if cuda else 32)
    prof = load_profile(profile)
    datasheet = next((v for k, v in DATASHEET_HBM_GB_S.items() if k in device_name), prof.hbm_gb_s)
    # the planner's assumptions for this device: the profile, with the device's datasheet HBM
    prof = dataclasses.replace(prof, hbm_gb_s=datasheet)
    ta = TimingAssumptions()
    peak = (peak_tflops or prof.peak_tflops) * 1e12
    out: dict = {"profile": prof.name, "device_hbm_datasheet_gb_s": datasheet, "seconds_per_shape": seconds,
                 "shrink": div}

    nbytes = (1 << 30) // div
    hbm = 2 * nbytes / time_copy(nbytes, dev, seconds)
    out["hbm"] = {"bytes_per_s": hbm, "over_datasheet": hbm / (datasheet * 1e9)}

    m, n = 16384 // div, 8192 // div
    ks = [k // div for k in SWEEP_KS]
    times = [time_gemm(m, n, k, dev, seconds) for k in ks]
    out["k_sweep"] = [{"m": m, "n": n, "k": k, "seconds": s, "tflops": 2 * m * n * k / s / 1e12}
                      for k, s in zip(ks, times)]
    implied: dict = {"hbm_efficiency": round(out["hbm"]["over_datasheet"], 3)}
    fit = [(float(k), s) for k, s in zip(ks, times) if k <= K_REF // div]
    try:
        k0, _, resid = fit_k0([k for k, _ in fit], [s for _, s in fit])
        implied["gemm_k0"] = round(k0 * div)
        out["k0_fit_max_residual"] = resid
    except ValueError as e:
        implied["gemm_k0"] = f"not fitted: {e}"
    at_ref = times[ks.index(K_REF // div)]
    implied["gemm_efficiency"] = round(
        2 * m * n * (K_REF // div) / at_ref / peak / _wave(m, n, prof.sm_count, ta.tile), 3)
    out["implied"] = implied

    rows = []
    rate = prof.peak_tflops * 1e12 * prof.gemm_efficiency
    for model, h, tp, tokens in mlm_rows():
        t = tokens // div
        for name, nn, kk in (("qkv", 3 * h // tp, h), ("proj", h, h // tp), ("fc1", 4 * h // tp, h),
                             ("fc2", h, 4 * h // tp)):
            nn, kk = nn // div, kk // div
            s = time_gemm(t, nn, kk, dev, seconds)
            pred = gemm_pass_time(t, nn, kk, 1, rate, prof.hbm_bandwidth(), prof.sm_count, ta.tile, ta.gemm_k0)
            rows.append({"model": model, "gemm": name, "m": t, "n": nn, "k": kk, "seconds": s,
                         "tflops": 2 * t * nn * kk / s / 1e12, "measured_over_planner": s / pred})
    out["mlm_layer_gemms"] = rows
    # per row: the layer's four GEMMs together, measured seconds over the planner's
    models = dict.fromkeys(r["model"] for r in rows)
    out["measured_over_planner_by_model"] = {
        model: sum(r["seconds"] for r in rows if r["model"] == model)
        / sum(r["seconds"] / r["measured_over_planner"] for r in rows if r["model"] == model)
        for model in models}
    return out
