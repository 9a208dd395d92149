"""A planner profile from measurements on the user's cluster (``python -m moetrain.calibrate``).

What is measured (by :mod:`moetrain.launch.calibrate`, on every rank of a short job at once, so
the ranks contend for the node as they do in training) and what it sets:

1. GEMMs of the shapes the config's model runs (:func:`gemm_shapes`: each forward GEMM of the
   planner's compute model, with its input- and weight-gradient GEMMs, in the training dtype;
   fp8 ones where the device has FP8 tensor cores and the config trains in fp8): the profile's
   ``gemm_efficiency`` (``fp8_gemm_efficiency``) is the one value at which the planner's
   :func:`moetrain.planner.timing.gemm_pass_time` over all of them takes the measured seconds
   (:func:`fit_rate`); GEMMs that ran at or below the memory-bound floor at the measured copy
   bandwidth are fitted from their compute terms alone, and the report says so;
2. causal attention forward and backward at the model's heads, head size and sequence:
   ``attention_efficiency`` (the planner's attention FLOPs over peak × seconds); one layer's
   memory-bound kernels forward and backward (norms, residuals, RoPE, routing, permutation,
   SwiGLU): ``elementwise_efficiency`` (the planner's bytes for them over the copy bandwidth ×
   seconds, at most 1);
3. a device-to-device copy: ``hbm_efficiency`` (bytes read + written per second over the
   datasheet ``hbm_gb_s``);
4. all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point inside an NVSwitch
   domain (tier ``nvlink``), across domains inside a rail group (``rail``) and across rail groups
   (``spine``), every group of a tier at the same time, at message sizes from
   :func:`message_sizes` (the layout's own buffers bracket them): per tier and collective the
   line ``seconds = steps · α + bus bytes / β`` through the sizes (:func:`fit_collective`) gives
   the bus bandwidth β (``collective_gb_s``) and the per-step latency α (``<tier>_latency_us``).

5. one layer of the model itself (:func:`layer_config`), forward and backward in one process:
   ``layer_efficiency``, the planner's time for it from the terms above over the measured time
   (what the software spends beyond its GEMMs, attention and memory traffic: host overheads,
   unfused kernels, the dispatch's bookkeeping).

The profile describes the nodes as the job ran them: where the job ran fewer (or more) tasks per
node than the base profile's ``gpus_per_node``, the calibrated profile has that many GPUs per node
(each per-GPU figure is what one task got with that many on its node).

Where a measured rate exceeds what the base profile calls peak (a CPU profile's made-up peak),
the peak is raised to it and the efficiency set to 1: the product, which is what the planner
uses, is the measurement either way. Terms nothing here measures (memory size, the SM count,
``ep_overlap_efficiency``, the network's nominal rates) are the base profile's.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetrain.planner.layout import Layout
from moetrain.planner.memory import MemoryAssumptions
from moetrain.planner.model import ModelShape
from moetrain.planner.timing import K_REF, TimingAssumptions, _Compute, gemm_pass_time
from moetrain.planner.traffic import bus_factor, microbatch_buffers
from moetrain.topology.cluster import COLLECTIVES as OPS
from moetrain.topology.cluster import LINK_TIERS as TIERS

if TYPE_CHECKING:  # pragma: no cover
    from moetrain.config import Config
    from moetrain.topology.cluster import ClusterProfile

__all__ = ["GemmShape", "gemm_shapes", "k_sweep_shapes", "fit_k0", "layer_config", "layer_seconds_predicted",
           "message_sizes", "fit_line", "fit_collective", "collective_steps",
           "fit_rate", "attention_flops", "calibrated_profile", "CalibrationError", "OPS", "TIERS"]

class CalibrationError(ValueError):
    """Measurements that cannot give a profile term (too few points, times that fall with size);
    the message names the measurement."""


@dataclass(frozen=True)
class GemmShape:
    """One GEMM C[m×n] = A[m×k]·B[k×n], ``count`` of them side by side (a grouped GEMM of the
    experts); ``fp8``: at the FP8 rate. ``pass_``: ``fwd``, ``dgrad`` or ``wgrad``."""

    m: int
    n: int
    k: int
    count: int = 1
    fp8: bool = False
    pass_: str = "fwd"

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


class _Recorder(_Compute):
    """The planner's compute model, listing the GEMMs it times instead of timing them."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.shapes: list[GemmShape] = []

    def gemm(self, m: float, n: float, k: float, count: int = 1, fp8: bool | None = None) -> tuple[float, float]:
        fp8 = self.s.fp8_gemms if fp8 is None else fp8
        m_, n_, k_ = (max(1, round(v)) for v in (m, n, k))
        if m > 0 and n > 0 and k > 0:
            self.shapes += [GemmShape(m_, n_, k_, count, fp8, "fwd"), GemmShape(m_, k_, n_, count, fp8, "dgrad"),
                            GemmShape(k_, n_, m_, count, fp8, "wgrad")]
        return 0.0, 0.0


def gemm_shapes(shape: ModelShape, layout: Layout, profile: "ClusterProfile",
                mem: MemoryAssumptions = MemoryAssumptions(), ta: TimingAssumptions = TimingAssumptions()
                ) -> list[GemmShape]:
    """The distinct GEMMs one rank runs per micro-batch of ``layout`` (attention projections,
    the dense MLP, the router, the routed experts as a grouped GEMM with the busiest rank's
    tokens per expert, shared experts, the output head), each with its input-gradient (dgrad)
    and weight-gradient (wgrad) GEMM, as the planner's compute model counts them
    (:class:`moetrain.planner.timing._Compute`). Sizes are rounded to whole rows."""
    # the recorder times nothing: any FP8 peak lets an fp8 model's GEMMs be listed on any profile
    profile = dataclasses.replace(profile, fp8_peak_tflops=profile.fp8_peak_tflops or profile.peak_tflops)
    rec = _Recorder(shape, layout, profile, ta, mem.act_bytes, mem.grad_bytes)
    rec.attention()
    if shape.layers > shape.moe_layers:
        rec.mlp()
    if shape.is_moe:
        rec.moe()
    rec.logits()
    seen: dict[GemmShape, None] = {}
    for g in rec.shapes:
        seen.setdefault(g)
    return list(seen)


def k_sweep_shapes(gpu: bool) -> list[GemmShape]:
    """GEMMs that differ only in K (K_REF/8 … K_REF): [16384 × K]·[K × 8192] on a GPU, the output
    32× smaller per side elsewhere (K kept: k0 is in elements of K). :func:`fit_k0` turns their
    times into the short-K loss."""
    m, n = (16384, 8192) if gpu else (512, 256)
    return [GemmShape(m, n, k) for k in (K_REF // 8, K_REF // 4, K_REF // 2, K_REF)]


def fit_k0(ks: list[float], seconds: list[float]) -> tuple[float, float, float]:
    """Least-squares line ``seconds = a·K + b`` through GEMMs that differ only in K; returns
    (k0 = b / a, a, the largest |residual| / seconds). ``k0``: the fixed cost of an output tile
    in elements of K (:func:`moetrain.planner.timing.k_efficiency`), clamped at 0.

    Raises:
        CalibrationError: fewer than two points, or times that do not grow with K.
    """
    if len(ks) < 2 or len(ks) != len(seconds):
        raise CalibrationError(f"fit_k0 needs two or more (K, seconds) pairs, got {len(ks)} K and {len(seconds)} times")
    mk, ms = statistics.fmean(ks), statistics.fmean(seconds)
    var = sum((k - mk) ** 2 for k in ks)
    a = sum((k - mk) * (s - ms) for k, s in zip(ks, seconds)) / var if var else 0.0
    if a <= 0:
        raise CalibrationError(f"GEMM times do not grow with K ({list(zip(ks, seconds))}): nothing to fit")
    b = ms - a * mk
    return max(0.0, b / a), a, max(abs(a * k + b - s) / s for k, s in zip(ks, seconds))


def layer_config(cfg: "Config") -> "Config":
    """The model the layer measurement runs in one process: one block (an MoE block where the
    model has MoE layers) with the embedding and head, holding the rank's share of the experts
    (E / ep, at least top-k; group-limited routing off) so that each expert gets the tokens
    per expert of the layout; the micro-batch of the config."""
    moe = cfg.moe
    if moe.num_experts:
        local = max(moe.top_k, moe.num_experts // cfg.parallel.ep)
        moe = dataclasses.replace(moe, num_experts=local, every=1, first_dense=0, n_group=None, topk_group=None)
    model = dataclasses.replace(cfg.model, layers=1, vocab_size=ModelShape.from_config(cfg).vocab)
    return dataclasses.replace(cfg, model=model, moe=moe)


def layer_seconds_predicted(shape: ModelShape, mbs: int, profile: "ClusterProfile",
                            mem: MemoryAssumptions = MemoryAssumptions(),
                            ta: TimingAssumptions = TimingAssumptions()) -> float:
    """The planner's forward + backward seconds of :func:`layer_config`'s model (``shape``) for
    one micro-batch in one process: its block's GEMMs, attention core, elementwise kernels and
    launch gaps, and the head, with balanced routing."""
    lay = Layout(tp=1, pp=1, dp=1, cp=1, ep=1, mbs=mbs)
    ta = dataclasses.replace(ta, moe_imbalance=1.0)
    c = _Compute(shape, lay, profile, ta, mem.act_bytes, mem.grad_bytes)
    att_f, att_b, core_f, core_b = c.attention()
    ffn_f, ffn_b = c.moe()[:2] if shape.is_moe else c.mlp()
    head_f, head_b = c.logits()
    launch = ta.kernel_gap_us * 1e-6 * ta.kernels_per_layer * (1.75 if shape.is_moe else 1.0)
    return (att_f + att_b + core_f + core_b + ffn_f + ffn_b + 3 * c.elementwise(shape.is_moe) + head_f + head_b
            + 3 * launch)


def attention_flops(shape: ModelShape, layout: Layout) -> float:
    """Forward FLOPs of the causal attention core of one layer for one micro-batch on one rank
    (``layout.mbs`` sequences, ``heads / tp`` heads), as the planner counts them (half the score
    matrix; ``ModelShape.attention_flops``)."""
    tokens = layout.mbs * shape.seq_len / layout.cp
    return tokens * shape.attention_flops(causal=True) / layout.tp


def message_sizes(shape: ModelShape, layout: Layout, act_bytes: int = 2, lo: int = 1 << 16,
                  hi: int = 1 << 28) -> list[int]:
    """Buffer sizes (bytes, powers of two) to time each collective at: from ``lo`` up to the
    largest per-call buffer the layout moves (its expert all-to-all, TP activation, one layer's
    gradients), at least 4 MiB, at most ``hi``. The measuring job stops a sweep early where
    one call takes longer than its time budget allows."""
    sz = microbatch_buffers(shape, layout, act_bytes)
    per_layer = shape.total_params / max(1, shape.layers) / (layout.tp * layout.pp) * 4
    top = max(sz["ep"], sz["tp"], sz["pp"], per_layer, 4 << 20)
    top = min(hi, 1 << math.ceil(math.log2(top)))
    out, s = [], lo
    while s <= top:
        out.append(s)
        s *= 2
    return out


def collective_steps(op: str, n: int) -> int:
    """Latency steps of one collective over n ranks, as :func:`moetrain.planner.traffic.comm_time`
    counts them (⌈log₂ n⌉, twice for all-reduce; 1 for point-to-point)."""
    if op == "p2p":
        return 1
    return max(1, math.ceil(math.log2(max(2, n)))) * (2 if op == "all_reduce" else 1)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the line through (x, y) that minimises the squared *relative*
    residuals (weights 1/y²), so small messages, where latency rules, count as much as large.

    Raises:
        CalibrationError: fewer than two points, or all x equal.
    """
    if len(xs) < 2 or len(xs) != len(ys):
        raise CalibrationError(f"a line needs two or more points, got {len(xs)} x and {len(ys)} y")
    w = [1.0 / max(y, 1e-12) ** 2 for y in ys]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    my = sum(wi * y for wi, y in zip(w, ys)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    if sxx <= 0:
        raise CalibrationError("a line needs two or more distinct x values")
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / sxx
    return slope, my - slope * mx


def fit_collective(op: str, n: int, sizes: list[int], seconds: list[float]) -> dict[str, float]:
    """Bus bandwidth and latency of ``op`` over groups of ``n`` ranks from its time per call at
    each buffer size (bytes; the full buffer as :mod:`moetrain.planner.traffic` counts it).

    Returns ``{"bus_gb_s": β / 1e9, "latency_us": α · 1e6, "max_residual": ...}`` from
    ``seconds = collective_steps · α + bus_factor · size / β`` (:func:`fit_line`); α is
    clamped at 0. Where the line's slope is not positive (sizes too small to see the
    bandwidth) the largest size's bus bytes over its time give β.

    Raises:
        CalibrationError: no sizes, or sizes and times of different lengths.
    """
    if not sizes or len(sizes) != len(seconds):
        raise CalibrationError(f"{op} over {n} ranks: {len(sizes)} sizes and {len(seconds)} times")
    wire = [bus_factor(op, n) * s for s in sizes]
    steps = collective_steps(op, n)
    if len(sizes) >= 2:
        slope, icpt = fit_line(wire, seconds)
    else:
        slope, icpt = 0.0, 0.0
    if slope <= 0:
        slope, icpt = seconds[-1] / wire[-1], 0.0
    alpha = max(0.0, icpt) / steps
    resid = max(abs(steps * alpha + slope * w - t) / t for w, t in zip(wire, seconds))
    return {"bus_gb_s": 1.0 / slope / 1e9, "latency_us": alpha * 1e6, "max_residual": resid}


def fit_rate(shapes: list[GemmShape], seconds: list[float], peak_flops: float, hbm: float, sm_count: int,
             ta: TimingAssumptions = TimingAssumptions(), in_bytes: float = 2.0, out_bytes: float = 2.0,
             cast_bytes: float = 0.0) -> tuple[float, float | None]:
    """The efficiency E at which the planner's time of every GEMM in ``shapes``
    (:func:`moetrain.planner.timing.gemm_pass_time` at ``peak_flops · E``, plus
    ``cast_bytes`` per operand element at ``hbm`` for fp8) adds up to the measured seconds
    (bisection on a log scale, 1e-4 … 1e3; the result may exceed 1 where the given peak is
    not the device's), and None.

    Where the measured total is at or below the planner's memory-bound floor at ``hbm`` (the
    GEMMs' operands moved faster than the copy measured: small shapes that stay in cache, or
    a copy measurement slowed by noise), no efficiency gives the measurement; then E is the
    one at which the compute terms alone take the measured seconds, returned with the floor
    (seconds), so that the caller records the measurement and says it hit the floor.

    Raises:
        CalibrationError: no shapes, lengths that differ, or a measured total that is not
        positive.
    """
    if not shapes or len(shapes) != len(seconds):
        raise CalibrationError(f"GEMM fit: {len(shapes)} shapes and {len(seconds)} times")
    measured = sum(seconds)
    if not measured > 0:
        raise CalibrationError(f"GEMM fit: the measured times add up to {measured} s")

    def total(e: float, bandwidth: float = hbm) -> float:
        t = 0.0
        for g in shapes:
            t += gemm_pass_time(g.m, g.n, g.k, g.count, peak_flops * e, bandwidth, sm_count, ta.tile, ta.gemm_k0,
                                in_bytes, out_bytes)
            t += cast_bytes * g.count * (g.m * g.k + g.k * g.n) / bandwidth
        return t

    lo, hi = 1e-4, 1e3
    floor = total(hi)
    if floor >= measured:
        # compute time is proportional to 1 / E: the E whose compute alone is the measurement
        return total(1.0, math.inf) / measured, floor
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        if total(mid) > measured:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi), None


def _floor_note(floor: float | None, seconds: list[float], hbm: float) -> dict[str, Any]:
    """The report's record of GEMMs measured at or below the memory-bound floor (:func:`fit_rate`)."""
    if floor is None:
        return {}
    return {"at_memory_floor": {"measured_s": sum(seconds), "floor_s": floor, "copy_gb_s": hbm / 1e9,
                                "note": "the GEMMs took no longer than moving their operands at the measured copy "
                                        "bandwidth: their rate is fitted from the compute terms alone"}}


def _efficiency(measured_rate: float, peak: float) -> tuple[float, float]:
    """(peak, efficiency) whose product is ``measured_rate``: the given peak unless the rate
    exceeds it, then the rate itself at efficiency 1."""
    if measured_rate <= peak:
        return peak, measured_rate / peak
    return measured_rate, 1.0


def calibrated_profile(base: "ClusterProfile", measured: dict[str, Any], shape: ModelShape, layout: Layout,
                       mem: MemoryAssumptions = MemoryAssumptions(), ta: TimingAssumptions = TimingAssumptions(),
                       name: str | None = None, layer_shape: ModelShape | None = None
                       ) -> tuple["ClusterProfile", dict[str, Any]]:
    """``base`` with every term ``measured`` gives replaced (module doc), and the report of
    each term: measured value, base value, and the fit's figures.

    ``measured`` (what :func:`moetrain.launch.calibrate.measure_rank` returns, medians over
    ranks): ``hbm_copy_gb_s``; ``gemm``: ``[{"m", "n", "k", "count", "fp8", "pass", "seconds"}]``;
    ``attention``, ``elementwise``: ``{"seconds": forward + backward}``; ``layer``:
    ``{"seconds": forward + backward}`` of :func:`layer_config`'s model, whose shape is
    ``layer_shape`` (``layer_efficiency``, fitted last, from the other terms); ``collectives``:
    ``{tier: {"n": group size, op: {"sizes": [...], "seconds": [...]}}}``; ``meta``: recorded as
    is.

    Raises:
        CalibrationError: a measurement the fits cannot use (says which).
    """
    report: dict[str, Any] = {}
    changes: dict[str, Any] = {}
    if shape.fp8_gemms and not base.fp8_peak_tflops and not any(r["fp8"] for r in measured["gemm"]):
        # an fp8 config on a device without FP8 tensor cores: its GEMMs ran, and are timed, in 16 bits
        shape = dataclasses.replace(shape, fp8_gemms=False)
        layer_shape = layer_shape and dataclasses.replace(layer_shape, fp8_gemms=False)
        report["fp8"] = "no FP8 tensor cores measured: the fp8 model's GEMMs counted as 16-bit"
    hbm_meas = float(measured["hbm_copy_gb_s"])
    hbm_gb_s, hbm_eff = _efficiency(hbm_meas, base.hbm_gb_s)
    changes.update(hbm_gb_s=hbm_gb_s, hbm_efficiency=hbm_eff)
    report["hbm"] = {"copy_gb_s": hbm_meas, "base_gb_s": base.hbm_bandwidth() / 1e9}
    hbm = hbm_meas * 1e9

    ks = measured.get("k_sweep") or []
    if len(ks) >= 2:
        k0, _, resid = fit_k0([float(r["k"]) for r in ks], [float(r["seconds"]) for r in ks])
        changes["gemm_k0"] = round(k0, 1)
        ta = dataclasses.replace(ta, gemm_k0=changes["gemm_k0"])
        report["k_sweep"] = {"k0": changes["gemm_k0"], "max_residual": resid,
                             "base_k0": base.gemm_k0 if base.gemm_k0 is not None else TimingAssumptions().gemm_k0}
    rows = measured["gemm"]
    for fp8 in (False, True):
        sel = [r for r in rows if bool(r["fp8"]) == fp8]
        if not sel:
            continue
        shapes = [GemmShape(r["m"], r["n"], r["k"], r["count"], fp8, r["pass"]) for r in sel]
        secs = [float(r["seconds"]) for r in sel]
        flops = sum(g.flops for g in shapes)
        if fp8:
            peak = (base.fp8_peak_tflops or 2 * base.peak_tflops) * 1e12
            e, floor = fit_rate(shapes, secs, peak, hbm, base.sm_count, ta, 1.0, mem.act_bytes, ta.fp8_cast_bytes)
            p8, e8 = _efficiency(peak * e, peak)
            changes.update(fp8_peak_tflops=p8 / 1e12, fp8_gemm_efficiency=e8)
            report["gemm_fp8"] = {"shapes": len(shapes), "tflops": flops / sum(secs) / 1e12,
                                  "fitted_rate_tflops": peak * e / 1e12,
                                  "base_rate_tflops": peak * (base.fp8_gemm_efficiency or base.gemm_efficiency) / 1e12,
                                  **_floor_note(floor, secs, hbm)}
        else:
            peak = base.peak_tflops * 1e12
            e, floor = fit_rate(shapes, secs, peak, hbm, base.sm_count, ta, mem.act_bytes, mem.act_bytes)
            p, eff = _efficiency(peak * e, peak)
            changes.update(peak_tflops=p / 1e12, gemm_efficiency=eff)
            report["gemm"] = {"shapes": len(shapes), "tflops": flops / sum(secs) / 1e12,
                              "fitted_rate_tflops": peak * e / 1e12,
                              "base_rate_tflops": base.peak_tflops * base.gemm_efficiency,
                              **_floor_note(floor, secs, hbm)}
    peak = changes.get("peak_tflops", base.peak_tflops) * 1e12
    att = measured.get("attention")
    if att and att.get("seconds"):
        flops = attention_flops(shape, dataclasses.replace(layout, cp=1))  # measured on whole sequences
        rate = flops * (1 + ta.attention_backward) / float(att["seconds"])
        changes["attention_efficiency"] = rate / peak
        report["attention"] = {"tflops": rate / 1e12, "base_tflops": base.peak_tflops * base.attention_efficiency}

    el = measured.get("elementwise")
    if el and el.get("seconds"):
        # the bytes do not depend on the GEMMs' precision (16-bit: no FP8 peak needed to count them)
        comp = _Compute(dataclasses.replace(shape, fp8_gemms=False), layout, base, ta, mem.act_bytes,
                        mem.grad_bytes)
        nbytes = 3 * comp.elementwise_bytes(shape.is_moe)  # forward, and the backward's twice as much
        rate = nbytes / float(el["seconds"])
        changes["elementwise_efficiency"] = min(1.0, rate / hbm)
        report["elementwise"] = {"gb_s": rate / 1e9, "copy_gb_s": hbm / 1e9, "moe_layer": shape.is_moe}
    layer = measured.get("layer")
    if layer and layer.get("seconds") and layer_shape is not None:
        pred = layer_seconds_predicted(layer_shape, layout.mbs, dataclasses.replace(base, **changes), mem, ta)
        changes["layer_efficiency"] = pred / float(layer["seconds"])
        report["layer"] = {"seconds": float(layer["seconds"]), "predicted_from_terms_s": pred}
    coll: dict[str, dict[str, float]] = {}
    report["collectives"] = {}
    for tier, ops in measured.get("collectives", {}).items():
        n = int(ops["n"])
        lat = []
        for op in OPS:
            if op not in ops:
                continue
            fit = fit_collective(op, n, ops[op]["sizes"], ops[op]["seconds"])
            coll.setdefault(tier, {})[op] = round(fit["bus_gb_s"], 6)
            lat.append(fit["latency_us"])
            base_bw = base.bandwidth(tier) / 1e9
            report["collectives"].setdefault(tier, {"group_size": n})[op] = {**fit, "base_gb_s": base_bw}
        if lat:
            changes[f"{tier}_latency_us"] = round(statistics.median(lat), 3)
    if coll:
        changes["collective_gb_s"] = coll
    meta = dict(measured.get("meta", {}))
    tpn = int(meta.get("tasks_per_node") or base.gpus_per_node)
    if tpn != base.gpus_per_node:
        # Every per-GPU figure above is what one of the job's tasks got with tpn tasks on its node
        # (a node link shared by tpn, or each its own): the profile describes the nodes as the job
        # ran them, so that a plan at the job's layout counts the bandwidth its tasks measured.
        changes.update(gpus_per_node=tpn, nvswitch_domain_gpus=tpn * base.domain_nodes,
                       rails_per_node=min(base.rails_per_node, tpn))
        report["tasks_per_node"] = {"job": tpn, "base_gpus_per_node": base.gpus_per_node}
    changes["calibration"] = {**meta, "base_profile": base.name, "terms": sorted(k for k in changes
                                                                                 if k != "calibration")}
    prof = dataclasses.replace(base, name=name or f"{base.name}-calibrated", path=None,
                               description=f"{base.description} (calibrated: python -m moetrain.calibrate)".strip(),
                               **changes)
    return prof, report
