"""Step time of a layout: compute, communication, pipeline bubble, and what overlaps.

Phases of one step on the slowest pipeline rank (all times per micro-batch unless stated):
1. compute: every GEMM at ``peak × gemm_efficiency × wave efficiency`` (wave quantisation:
   a GEMM's 128×256 output tiles fill the SMs in whole waves); causal flash attention at
   ``peak × attention_efficiency`` (backward executes 2.5× the forward FLOPs: FlashAttention-2
   recomputes the scores, Dao 2023 §3.1); elementwise kernels (norms, residuals, RoPE,
   SwiGLU, routing, permutation) at HBM bandwidth; recomputation runs the forward again
   (full) or the attention core again (selective).
2. communication inside a micro-batch: TP (SP all-gather / reduce-scatter), EP all-to-all and
   the pipeline's point-to-point sends are not overlapped; CP's K/V ring overlaps with the
   attention it feeds (only the excess counts).
3. pipeline: 1F1B and GPipe take (m + p − 1)(t_f + t_b), interleaved 1F1B
   (m + (p − 1)/v)(t_f + t_b) (Narayanan et al. 2021 §2.2), ZB-H1 m(t_f + t_b) + (p − 1)·t_f
   (Qi et al. 2023 §3, with the backward split evenly into input and weight gradients).
4. data parallel: the gradient reduce-scatter (all-reduce at ZeRO-0) overlaps with the last
   micro-batch's backward, the parameter all-gather with the next step's first forward
   (Megatron's overlap_grad_reduce / overlap_param_gather); ZeRO-2 reduce-scatters every
   micro-batch, ZeRO-3 also gathers parameters for every forward and backward.
5. optimizer: Adam reads and writes 30 bytes per local parameter shard at HBM bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moetrain.planner.layout import Layout
from moetrain.planner.memory import MemoryAssumptions, stage_counts
from moetrain.planner.model import ModelShape
from moetrain.planner.traffic import AxisPlace, microbatch_buffers, comm_time

if TYPE_CHECKING:  # pragma: no cover
    from moetrain.topology.cluster import ClusterProfile

__all__ = ["TimingAssumptions", "StepTime", "step_time", "bubble_time", "pipeline_time"]


@dataclass(frozen=True)
class TimingAssumptions:
    """Stated constants of the time model (not fitted to any published table).

    ``moe_imbalance``: tokens on the busiest expert rank over the mean (dropless routing with a
    load-balancing loss). ``tile``: GEMM output tile (rows, cols) for wave quantisation.
    ``attention_backward``: executed backward/forward FLOP ratio of flash attention.
    ``adam_bytes``: bytes moved per local parameter by the optimizer step.
    ``kernel_gap_us`` × ``kernels_per_layer`` (forward; backward twice): launch gaps between
    dependent kernels on the critical path.

    Software (moetrain's by default; a published run's when reproducing it):
    ``attention``: ``flash`` (fused, causal half skipped) or ``unfused`` (s×s scores written
    to memory, masked softmax, AV as batched GEMMs, as Megatron-LM in 2021);
    ``dropout``: dropout on attention probabilities and residual branches (GPT-3 era).
    ``overlap_grad_reduce``: the data-parallel gradient reduction overlaps the last backward
    (Megatron-LM added this after 2021; before, the all-reduce ran after the backward).
    ``overlap_slowdown``: compute lost per second of a collective hidden behind it: NCCL's
    kernels hold SMs (16-32 channels of 132 SMs) and HBM bandwidth while they run.
    """

    moe_imbalance: float = 1.1
    tile: tuple[int, int] = (128, 256)
    attention_backward: float = 2.5
    adam_bytes: float = 30.0
    kernel_gap_us: float = 4.0
    kernels_per_layer: int = 20
    attention: str = "flash"
    dropout: bool = False
    overlap_grad_reduce: bool = True
    overlap_slowdown: float = 0.15


def pipeline_time(schedule: str, pp: int, vpp: int, m: int, t_f: float, t_b: float) -> float:
    """Seconds for m micro-batches through p stages (t_f, t_b: one micro-batch on one rank,
    all its virtual stages together)."""
    if pp == 1:
        return m * (t_f + t_b)
    if schedule == "zero_bubble":
        return m * (t_f + t_b) + (pp - 1) * t_f
    if schedule == "interleaved_1f1b" and vpp > 1:
        return (m + (pp - 1) / vpp) * (t_f + t_b)
    return (m + pp - 1) * (t_f + t_b)


def bubble_time(schedule: str, pp: int, vpp: int, m: int, t_f: float, t_b: float) -> float:
    """Idle seconds of the pipeline: total minus the m·(t_f + t_b) of useful work."""
    return pipeline_time(schedule, pp, vpp, m, t_f, t_b) - m * (t_f + t_b)


@dataclass
class StepTime:
    """Predicted step of one layout. Times in seconds; ``breakdown`` adds up to ``step``."""

    step: float
    t_f: float
    t_b: float
    microbatches: int
    breakdown: dict[str, float] = field(default_factory=dict)
    comm_tiers: dict[str, str] = field(default_factory=dict)
    model_flops: float = 0.0       # per step, all GPUs
    executed_flops: float = 0.0    # including recomputation (the "hardware" FLOPs), per step

    def to_dict(self) -> dict[str, Any]:
        return {"step_time_s": self.step, "t_forward_s": self.t_f, "t_backward_s": self.t_b,
                "microbatches": self.microbatches, "breakdown_s": dict(self.breakdown), "tiers": dict(self.comm_tiers)}


def _wave(m: float, n: float, sms: int, tile: tuple[int, int], count: int = 1) -> float:
    """Fraction of SM-slots doing useful work for ``count`` GEMMs with an m×n output each."""
    if m <= 0 or n <= 0:
        return 1.0
    tiles = math.ceil(m / tile[0]) * math.ceil(n / tile[1]) * count
    waves = math.ceil(tiles / sms)
    useful = (m * n * count) / (tile[0] * tile[1])
    return min(1.0, useful / (waves * sms))


class _Compute:
    """Per-layer, per-micro-batch compute times on one rank."""

    def __init__(self, shape: ModelShape, layout: Layout, prof: "ClusterProfile", ta: TimingAssumptions,
                 act_bytes: int):
        self.s, self.l, self.p, self.ta = shape, layout, prof, ta
        self.T = layout.mbs * shape.seq_len / layout.cp
        self.sp = layout.sp and layout.tp > 1
        self.Tt = self.T / layout.tp if self.sp else self.T   # tokens of the norms / residuals
        self.Tm = self.T / layout.tp                           # tokens an MoE block routes (1/tp slice)
        self.act_bytes = act_bytes
        self.rate = prof.peak_tflops * 1e12 * prof.gemm_efficiency
        self.hbm = prof.hbm_gb_s * 1e9

    def gemm(self, m: float, n: float, k: float, count: int = 1) -> tuple[float, float]:
        """(forward, backward) seconds of ``count`` GEMMs [m×k]·[k×n]."""
        flops = 2.0 * m * n * k * count
        sms, tile = self.p.sm_count, self.ta.tile
        fwd = flops / (self.rate * _wave(m, n, sms, tile, count))
        bwd = flops / (self.rate * _wave(m, k, sms, tile, count)) + flops / (self.rate * _wave(k, n, sms, tile, count))
        return fwd, bwd

    def attention(self) -> tuple[float, float, float, float]:
        """(GEMMs fwd, GEMMs bwd, attention core fwd, attention core bwd) of the attention block."""
        s, tp = self.s, self.l.tp
        f1, b1 = self.gemm(self.T, (s.h_q + 2 * s.h_kv) / tp, s.hidden)
        f2, b2 = self.gemm(self.T, s.hidden, s.h_q / tp)
        if self.ta.attention == "flash":
            core_flops = 4.0 * self.T * s.seq_len * s.h_q / tp * 0.5  # causal: half the score matrix
            core = core_flops / (self.p.peak_tflops * 1e12 * self.p.attention_efficiency)
            return f1 + f2, b1 + b2, core, core * self.ta.attention_backward
        # Unfused: QKᵀ and AV as batched GEMMs over the full s×s matrix (masked afterwards),
        # and the scores pass through memory: write QKᵀ, masked softmax (read, write), dropout
        # (read, write, 1-byte mask), read by AV: 13 (8 without dropout) bytes per score.
        heads = s.heads / tp
        n_seq = self.T / s.seq_len  # sequences in the micro-batch (CP: a fraction)
        count = max(1, round(heads * max(1.0, n_seq)))
        qk_f, qk_b = self.gemm(self.T / max(1.0, n_seq), s.seq_len, s.head_dim, count)
        av_f, av_b = self.gemm(self.T / max(1.0, n_seq), s.head_dim, s.seq_len, count)
        per_score = 13.0 if self.ta.dropout else 8.0
        mem = per_score * self.T * s.seq_len * heads / self.hbm
        return f1 + f2, b1 + b2, qk_f + av_f + mem, qk_b + av_b + 2 * mem

    def mlp(self) -> tuple[float, float]:
        s, tp = self.s, self.l.tp
        f1, b1 = self.gemm(self.T, 2 * s.ffn / tp, s.hidden)
        f2, b2 = self.gemm(self.T, s.hidden, s.ffn / tp)
        return f1 + f2, b1 + b2

    def moe(self) -> tuple[float, float]:
        s, l = self.s, self.l
        local_experts = max(1, s.num_experts // l.ep)
        # Tokens reaching one local expert: T_m·k per rank, spread over E experts, from ep ranks.
        per_expert = self.Tm * s.top_k * l.ep / s.num_experts * self.ta.moe_imbalance
        f1, b1 = self.gemm(per_expert, 2 * s.expert_ffn, s.hidden, local_experts)
        f2, b2 = self.gemm(per_expert, s.hidden, s.expert_ffn, local_experts)
        fr, br = self.gemm(self.Tm, s.num_experts, s.hidden)
        fwd, bwd = f1 + f2 + fr, b1 + b2 + br
        if s.shared_experts:
            g1, c1 = self.gemm(self.Tm, 2 * s.expert_ffn * s.shared_experts, s.hidden)
            g2, c2 = self.gemm(self.Tm, s.hidden, s.expert_ffn * s.shared_experts)
            fwd, bwd = fwd + g1 + g2, bwd + c1 + c2
        return fwd, bwd

    def elementwise(self, moe: bool) -> float:
        """Forward seconds of the memory-bound kernels of one layer (each tensor read and
        written once); the backward moves twice as much."""
        s, tp = self.s, self.l.tp
        b = self.act_bytes
        per_seq_shard = 10.0 * s.hidden                     # 2 norms (r+w), 2 residual adds (2r+w)
        if self.ta.dropout:
            per_seq_shard += 5.0 * s.hidden                 # 2 dropouts: read, write, 1-byte mask
        per_tp_shard = 4.0 * (s.h_q + s.h_kv) / tp          # RoPE on Q and K (r+w)
        nbytes = b * (per_seq_shard * self.Tt + per_tp_shard * self.T)
        if moe:
            k, f = s.top_k, s.expert_ffn
            nbytes += b * self.Tm * (4.0 * k * s.hidden + 3.0 * k * f + 3.0 * f * s.shared_experts)
            nbytes += 4 * self.Tm * 3.0 * s.num_experts      # fp32 router softmax / top-k
        else:
            nbytes += b * self.T * 3.0 * s.ffn / tp          # SwiGLU: read gate and up, write product
        return nbytes / self.hbm

    def logits(self) -> tuple[float, float]:
        s = self.s
        f, b = self.gemm(self.T, s.vocab / self.l.tp, s.hidden)
        ce = 3 * 4.0 * self.T * s.vocab / self.l.tp / self.hbm  # fp32 softmax cross-entropy passes
        return f + ce, b + ce


def step_time(shape: ModelShape, layout: Layout, global_batch: int, profile: "ClusterProfile",
              places: dict[str, AxisPlace], mem: MemoryAssumptions = MemoryAssumptions(),
              ta: TimingAssumptions = TimingAssumptions()) -> StepTime:
    """Predicted seconds per optimizer step of ``layout`` (see the module doc for the model)."""
    lay = layout
    m = max(1, lay.microbatches(global_batch))
    c = _Compute(shape, lay, profile, ta, mem.act_bytes)
    sz = microbatch_buffers(shape, lay, mem.act_bytes)
    prof = profile

    att_f, att_b, core_f, core_b = c.attention()
    mlp_f, mlp_b = c.mlp()
    moe_f, moe_b = c.moe() if shape.is_moe else (0.0, 0.0)
    el_d, el_m = c.elementwise(False), c.elementwise(True)

    # 2. communication inside one layer, one micro-batch
    t_ag, _ = comm_time("all_gather", sz["tp"], places["tp"], prof)
    t_rs, _ = comm_time("reduce_scatter", sz["tp"], places["tp"], prof)
    tp_region = t_ag + t_rs  # one TP region, forward or backward (AR without SP costs the same bytes)
    t_cp, _ = comm_time("all_gather", sz["cp"], places["cp"], prof)
    cp_f = max(0.0, t_cp - core_f)
    cp_b = max(0.0, 2 * t_cp - core_b)
    t_a2a, _ = comm_time("all_to_all", sz["ep"] * ta.moe_imbalance, places["ep"], prof) if shape.is_moe else (0.0, {})
    t_p2p, _ = comm_time("p2p", sz["pp"], places["pp"], prof)

    gap = ta.kernel_gap_us * 1e-6 * ta.kernels_per_layer

    def layer(moe: bool) -> dict[str, float]:
        regions = 1 if moe else 2
        launches = gap * (1.75 if moe else 1.0)  # routing, permutation and the all-to-alls add kernels
        d = {
            "launch_f": launches, "launch_b": 2 * launches,
            "gemm_f": att_f + (moe_f if moe else mlp_f), "gemm_b": att_b + (moe_b if moe else mlp_b),
            "attn_f": core_f, "attn_b": core_b,
            "elem_f": el_m if moe else el_d, "elem_b": 2 * (el_m if moe else el_d),
            "tp_f": regions * tp_region, "tp_b": regions * tp_region,
            "cp_f": cp_f, "cp_b": cp_b,
            "ep_f": 2 * t_a2a if moe else 0.0, "ep_b": 2 * t_a2a if moe else 0.0,
        }
        return d

    per = {False: layer(False), True: layer(True)}
    log_f, log_b = c.logits()

    # 1-2. per micro-batch on each pipeline rank; the slowest rank sets the pace
    worst = None
    for r, (n_dense, n_moe) in enumerate(stage_counts(shape, lay.pp, lay.vpp)):
        acc = {k: n_dense * per[False][k] + n_moe * per[True][k] for k in per[False]}
        if r == lay.pp - 1:
            acc["gemm_f"] = acc.get("gemm_f", 0.0) + log_f
            acc["gemm_b"] = acc.get("gemm_b", 0.0) + log_b
        acc["pp_f"] = acc["pp_b"] = lay.vpp * t_p2p if lay.pp > 1 else 0.0
        keys_f = [k for k in acc if k.endswith("_f")]
        t_f = sum(acc[k] for k in keys_f)
        rec = 0.0
        if lay.ac == "full":
            rec = sum(acc[k] for k in keys_f if k not in ("pp_f",)) - (log_f if r == lay.pp - 1 else 0.0)
        elif lay.ac == "selective":
            rec = acc.get("attn_f", 0.0)
        t_b = sum(acc[k] for k in acc if k.endswith("_b")) + rec
        if worst is None or t_f + t_b > worst[0] + worst[1]:
            worst = (t_f, t_b, acc, rec, r, n_dense + n_moe)
    assert worst is not None
    t_f, t_b, acc, rec, r_worst, n_layers = worst

    # 3. pipeline
    t_pipe = pipeline_time(lay.schedule, lay.pp, lay.vpp, m, t_f, t_b)
    bubble = t_pipe - m * (t_f + t_b)

    # 4. data parallel
    dense_p, expert_p = _rank_params(shape, lay)
    z = lay.zero
    dp_exposed = 0.0
    rs = ag = 0.0
    for axis, p in (("dp_cp", dense_p), ("edp_tp", expert_p)):
        if p <= 0:
            continue
        if z == 0:
            rs += comm_time("all_reduce", p * mem.grad_bytes, places[axis], prof)[0]
        else:
            rs += comm_time("reduce_scatter", p * mem.grad_bytes, places[axis], prof)[0]
            ag += comm_time("all_gather", p * mem.param_bytes, places[axis], prof)[0]
    window_b = t_b if ta.overlap_grad_reduce else 0.0
    window_f = t_f if ta.overlap_grad_reduce else 0.0
    if z <= 1:
        dp_exposed = max(0.0, rs - window_b) + max(0.0, ag - window_f)
        dp_hidden = min(rs, window_b) + min(ag, window_f)
    elif z == 2:
        dp_exposed = m * max(0.0, rs - t_b) + max(0.0, ag - t_f)
        dp_hidden = m * min(rs, t_b) + min(ag, t_f)
    else:
        dp_exposed = m * (max(0.0, ag - t_f) + max(0.0, ag + rs - t_b))
        dp_hidden = m * (min(ag, t_f) + min(ag + rs, t_b))
    cp_hidden = m * n_layers * (min(t_cp, core_f) + min(2 * t_cp, core_b)) if lay.cp > 1 else 0.0
    overlap_cost = ta.overlap_slowdown * (dp_hidden + cp_hidden)

    # 5. optimizer
    shard_d = lay.dp * lay.cp if z >= 1 else 1
    shard_e = lay.dp * lay.cp * lay.tp // lay.ep if z >= 1 else 1
    t_opt = ta.adam_bytes * (dense_p / shard_d + expert_p / shard_e) / (prof.hbm_gb_s * 1e9)

    step = t_pipe + dp_exposed + overlap_cost + t_opt
    useful = m * (t_f + t_b)
    scale = useful / (t_f + t_b) if t_f + t_b else 0.0  # = m
    bd = {
        "compute": scale * (acc.get("gemm_f", 0) + acc.get("gemm_b", 0) + acc.get("attn_f", 0) + acc.get("attn_b", 0)),
        "elementwise": scale * (acc.get("elem_f", 0) + acc.get("elem_b", 0)),
        "kernel_launch": scale * (acc.get("launch_f", 0) + acc.get("launch_b", 0)),
        "recompute": scale * rec,
        "tp_comm": scale * (acc.get("tp_f", 0) + acc.get("tp_b", 0)),
        "cp_comm_exposed": scale * (acc.get("cp_f", 0) + acc.get("cp_b", 0)),
        "ep_comm": scale * (acc.get("ep_f", 0) + acc.get("ep_b", 0)),
        "pp_p2p": scale * (acc.get("pp_f", 0) + acc.get("pp_b", 0)),
        "bubble": bubble,
        "dp_comm_exposed": dp_exposed,
        "overlap_slowdown": overlap_cost,
        "optimizer": t_opt,
    }
    tokens = global_batch * shape.seq_len
    model_flops = tokens * shape.model_flops_per_token()
    executed = model_flops + tokens * shape.recompute_flops_per_token(lay.ac)
    tiers = {a: places[a].tier for a in places}
    return StepTime(step, t_f, t_b, m, bd, tiers, model_flops, executed)


def _rank_params(shape: ModelShape, lay: Layout) -> tuple[float, float]:
    """(dense, expert) parameters on the fullest pipeline rank after TP and EP."""
    best = (0.0, 0.0)
    dense_layer, moe_layer = shape.layer_params(False), shape.layer_params(True)
    for r, (n_dense, n_moe) in enumerate(stage_counts(shape, lay.pp, lay.vpp)):
        d = n_dense * dense_layer[0] + n_moe * moe_layer[0]
        e = n_moe * moe_layer[1]
        if r == 0:
            d += shape.vocab * shape.hidden
        if r == lay.pp - 1 and (lay.pp > 1 or not shape.tie_embeddings):
            d += shape.vocab * shape.hidden
        cand = (d / lay.tp, e / lay.ep)
        if sum(cand) > sum(best):
            best = cand
    return best
