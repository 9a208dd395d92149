"""Step time of a layout: compute, communication, pipeline bubble, and what overlaps.

Phases of one step on the slowest pipeline rank (all times per micro-batch unless stated):
1. compute: every GEMM pass at the roofline of compute and HBM traffic (:func:`gemm_pass_time`),
   compute at ``peak × gemm_efficiency × wave efficiency × short-K efficiency`` (in fp8
   training the dense linears' and experts' GEMMs run at the profile's FP8 peak and FP8
   efficiency on 1-byte operands, and every operand of each of their three GEMMs is quantized
   first at HBM speed, ``fp8_cast_bytes`` per element; the router, the head and attention stay
   bf16) (wave
   quantisation: a GEMM's 128×256 output tiles fill the SMs in whole waves; short K: a fixed
   per-tile cost, :func:`k_efficiency`); the routed experts as one grouped GEMM with the
   busiest rank's tokens per expert (``_Compute.moe``); causal flash attention at
   ``peak × attention_efficiency`` (backward executes 2.5× the forward FLOPs: FlashAttention-2
   recomputes the scores, Dao 2023 §3.1); elementwise kernels (norms, residuals, RoPE,
   SwiGLU, routing, permutation) at HBM bandwidth; recomputation runs the forward again
   (full) or the modules selective recomputation names again (the attention core by default;
   Megatron-Core's norms, expert activation, dense MLP, MLA up-projections: _Compute.recompute).
2. communication inside a micro-batch: TP (SP all-gather / reduce-scatter, and the expert-TP
   all-gather / reduce-scatter with etp = tp) and the pipeline's point-to-point sends are not
   overlapped; the EP all-to-all (traffic.ep_all_to_all: top-k, capacity, node-limited
   routing) is exposed unless the software and the schedule hide it (:func:`ep_exposed`); CP's
   K/V ring overlaps with the attention it feeds (only the excess counts).
3. pipeline: 1F1B and GPipe take (m + p − 1)(t_f + t_b), interleaved 1F1B
   (m + (p − 1)/v)(t_f + t_b) (Narayanan et al. 2021 §2.2), ZB-H1 m(t_f + t_b) + (p − 1)·t_f
   (Qi et al. 2023 §3, with the backward split evenly into input and weight gradients).
4. data parallel: the gradient reduce-scatter (all-reduce at ZeRO-0) overlaps with the last
   micro-batch's backward, the parameter all-gather with the next step's first forward
   (Megatron's overlap_grad_reduce / overlap_param_gather); ZeRO-2 reduce-scatters every
   micro-batch, ZeRO-3 also gathers parameters for every forward and backward. Where the expert
   all-to-alls cross the same off-node tier as the data-parallel group, they hold that link
   for their share of the forward and backward, and only the rest hides the reduction.
Under ``train.lora`` the frozen base's GEMMs have no weight-gradient pass (the adapters' rank-r
GEMMs are not counted: r ≪ the widths), and steps 4-5 reduce and update the adapters only.
5. optimizer: Adam reads and writes 30 bytes per local parameter shard at HBM bandwidth; the
   software's passes over the whole gradient buffer (``grad_buffer_bytes`` per local parameter:
   Megatron-Core zeroes, NaN-checks and pre-scales it) likewise.

Every memory-bound term runs at the profile's achievable HBM bandwidth
(``ClusterProfile.hbm_bandwidth``: the datasheet × the profile's ``hbm_efficiency``), the
elementwise kernels at its ``elementwise_efficiency`` share of it. A calibrated profile
(``python -m moetrain.calibrate``, :mod:`moetrain.planner.calibration`) brings measured
collective bandwidths per tier and collective, its own short-K loss (``gemm_k0``) and
``layer_efficiency``, by which every compute term of phase 1 is divided.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moetrain.config import splits_micro_batches
from moetrain.planner.layout import Layout
from moetrain.planner.memory import MemoryAssumptions, stage_counts
from moetrain.planner.model import ModelShape
from moetrain.planner.traffic import AxisPlace, comm_time, ep_all_to_all, expert_grad_axis, microbatch_buffers

if TYPE_CHECKING:  # pragma: no cover
    from moetrain.topology.cluster import ClusterProfile

__all__ = ["TimingAssumptions", "StepTime", "step_time", "bubble_time", "pipeline_time", "k_efficiency",
           "gemm_pass_time", "ep_exposed", "merged_pair_hidden", "merged_pair_share", "EP_OVERLAP",
           "K_REF", "muon_time"]

EP_OVERLAP = ("none", "shared_expert", "combined_1f1b", "merged_pairs")
K_REF = 4096
"""Inner dimension of the "training-shaped" GEMMs the profiles' ``gemm_efficiency`` describes."""


@dataclass(frozen=True)
class TimingAssumptions:
    """Stated constants of the time model (only ``gemm_k0`` is set from published runs).

    ``moe_imbalance``: tokens on the busiest expert rank over the mean (dropless routing with a
    load-balancing loss; a capacity factor caps it, see ModelShape.expert_copies).
    ``gemm_k0``: the short-K loss of a GEMM, see :func:`k_efficiency` (calibrated, the one
    constant set from published runs: docs/topology.md §5; a profile's measured ``gemm_k0``
    replaces it). ``tile``: GEMM output tile (rows,
    cols) for wave quantisation.
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
    ``ep_overlap``: what hides the EP all-to-all (see :func:`ep_exposed`): ``none`` (moetrain's
    trainer, and Megatron-Core before its combined-1F1B overlap), ``shared_expert`` (the shared
    experts' MLP runs while tokens travel, Megatron's ``--moe-shared-expert-overlap``),
    ``combined_1f1b`` (the all-to-all of one micro-batch runs under the computation of another,
    DeepSeek-V3 §3.2.1's DualPipe idea as Megatron-Core's ``--overlap-moe-expert-parallel-comm``;
    only where the schedule interleaves a forward and a backward: pp = 1 or virtual stages),
    ``merged_pairs`` (moetrain's ``parallel.ep_overlap``: each backward merged with the forward
    after it, at any pp with the 1F1B schedules; see :func:`merged_pair_share`).
    ``delay_wgrad``: with ``merged_pairs``, moetrain's ``parallel.delay_wgrad_compute`` (the
    backward's weight-gradient GEMMs run after its next all-to-all is issued; see
    :func:`merged_pair_hidden`). ``ep_overlap_split``: with ``merged_pairs``, moetrain's
    ``parallel.ep_overlap_split`` (``auto`` / ``always`` / ``never``; :func:`split_pairs`).
    ``tp_comm_overlap``: the TP all-gathers / reduce-scatters hide behind the layer's GEMMs
    (Megatron's ``--tp-comm-overlap``; moetrain does not overlap them).
    ``cross_entropy``: ``fused`` — the fp32 softmax cross-entropy reads and writes each logit
    three times (4 bytes) in each direction; ``unfused`` — Megatron-Core's vocab-parallel
    cross-entropy without ``--cross-entropy-loss-fusion``: the bf16 logits cast to fp32, then
    max, subtract, exp, sum and divide as separate passes (38 bytes a logit forward), and a
    backward that reads the saved softmax, scales it and casts it back (18 bytes).
    ``attention_efficiency``: the attention kernel of that run, when not the profile's
    (FlashAttention-1-era kernels reach 25-40 % of A100 peak, Dao 2023 §1).
    ``grad_buffer_bytes``: HBM bytes per local parameter per step that the software moves over its
    whole (unsharded) gradient buffer outside the optimizer. 0 for moetrain (its optimizer sets
    gradients to None, so no zeroing pass; none other is counted); 16 for Megatron-Core r0.8's DDP with its
    defaults: ``zero_grad_buffer`` writes the fp32 buffer (4), ``check_for_nan_in_grad``
    (``--check-for-nan-in-loss-and-grad``, on unless ``--no-…`` is passed) takes each bucket's
    norm (4) and ``start_grad_sync`` scales it by 1/dp before the reduce-scatter (read + write 8)
    (``megatron/core/distributed/param_and_grad_buffer.py``, ``Bucket.start_grad_sync``).
    ``optimizer``: ``adamw``, or ``muon`` (``train.optimizer``): Newton–Schulz of each matrix
    once, the stage's work spread over its ranks, at the profile's GEMM rate, plus the
    gather / scatter of the sharded matrices' blocks in bf16 (:func:`muon_time`).
    ``fp8_cast_bytes``: HBM bytes per element to quantize a GEMM operand to fp8 with a current
    scale: read it for the amax (2), read it again and write the float8 copy (2 + 1), as
    unfused kernels do (torchao fuses some under torch.compile: an upper bound).
    """

    moe_imbalance: float = 1.1
    gemm_k0: float = 640.0
    tile: tuple[int, int] = (128, 256)
    attention_backward: float = 2.5
    adam_bytes: float = 30.0
    kernel_gap_us: float = 4.0
    kernels_per_layer: int = 20
    attention: str = "flash"
    dropout: bool = False
    overlap_grad_reduce: bool = True
    overlap_slowdown: float = 0.15
    ep_overlap: str = "none"
    delay_wgrad: bool = False
    ep_overlap_split: str = "never"
    attention_efficiency: float | None = None
    fp8_cast_bytes: float = 5.0
    grad_buffer_bytes: float = 0.0
    tp_comm_overlap: bool = False
    cross_entropy: str = "fused"
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer {self.optimizer!r}: use adamw or muon")
        if self.cross_entropy not in ("fused", "unfused"):
            raise ValueError(f"cross_entropy {self.cross_entropy!r}: use fused or unfused")
        if self.ep_overlap not in EP_OVERLAP:
            raise ValueError(f"ep_overlap {self.ep_overlap!r}: use one of {', '.join(EP_OVERLAP)}")
        if self.grad_buffer_bytes < 0:
            raise ValueError(f"grad_buffer_bytes {self.grad_buffer_bytes!r}: bytes per parameter, 0 or more")


def ep_exposed(a2a_f: float, a2a_b: float, compute_f: float, compute_b: float, shared_f: float, shared_b: float,
               mode: str, layout: Layout, m: int, segments: tuple[float, ...] | None = None,
               efficiency: float = 1.0) -> tuple[float, float, float]:
    """(exposed forward, exposed backward, hidden) seconds of one MoE layer's all-to-alls for one
    micro-batch (``a2a_*``: dispatch + combine in that direction; ``compute_*``: the layer's
    computation; ``shared_*``: its shared experts' part).

    - ``none``: nothing hides them (every layer waits for its tokens);
    - ``shared_expert``: the shared experts compute while the tokens travel;
    - ``combined_1f1b``: where the schedule runs a forward and a backward of different
      micro-batches side by side (pp = 1, or virtual stages), each direction's all-to-all
      hides under the other's computation; the first forward and the last backward of a step
      have no partner, so only (m − 1)/m of the micro-batches get the overlap. With plain
      1F1B (pp > 1, no virtual stages) nothing is hidden;
    - ``merged_pairs``: moetrain's ``parallel.ep_overlap``, for the share of the micro-batches
      that :func:`merged_pair_share` finds paired. With ``segments`` (the layer's transfers
      and compute pieces, :func:`merged_pair_hidden`) each transfer hides only behind the one
      piece of the partner that runs while it is in flight, and ``efficiency`` (the share of
      that ideal which was measured, ``ClusterProfile.ep_overlap_efficiency``) scales it;
      without ``segments`` as ``combined_1f1b``.
    """
    if mode == "shared_expert":
        hf, hb = min(a2a_f, shared_f), min(a2a_b, shared_b)
    elif mode == "merged_pairs" and segments is not None:
        paired = merged_pair_share(layout.pp, layout.vpp, m) * efficiency
        hf, hb = (paired * h for h in merged_pair_hidden(*segments))
    elif mode == "merged_pairs" or mode == "combined_1f1b" and (layout.pp == 1 or layout.vpp > 1):
        paired = merged_pair_share(layout.pp, layout.vpp, m) if mode == "merged_pairs" else (m - 1) / m
        hf, hb = paired * min(a2a_f, compute_b), paired * min(a2a_b, compute_f)
    else:
        hf = hb = 0.0
    return a2a_f - hf, a2a_b - hb, hf + hb


def merged_pair_hidden(dispatch_f: float, combine_f: float, combine_b: float, dispatch_b: float, attn_f: float,
                       moe_f: float, attn_b: float, moe_b: float, attn_dw: float = 0.0, moe_dw: float = 0.0
                       ) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE layer's all-to-alls that a merged pair hides
    (``parallel.ep_overlap``, moetrain/parallel/ep_overlap.py), per paired micro-batch.

    The two sides take turns at their transfers, so each transfer is in flight while exactly one
    piece of the partner computes, the piece between two of the partner's own transfers:

    1. the backward's combine gradient travels while the forward runs attention and router;
    2. the forward's dispatch travels while the backward runs the experts' backward;
    3. the backward's dispatch gradient travels while the forward runs the experts;
    4. the forward's combine travels while the backward runs the router and attention backward.

    Megatron-Core's combined 1F1B pairs the same pieces (``TransformerLayerSchedulePlan.run``).
    A transfer longer than its piece shows the rest; the pieces are the layer's, whatever the
    neighbouring layer's transfers cost.

    With delayed weight gradients (``parallel.delay_wgrad_compute``) the backward computes its
    deferred weight GEMMs right after issuing each of its transfers, before handing over, so
    they join the cover of its own transfers: ``attn_dw`` (the attention projections' weight
    gradients of the layer above, deferred to the combine's backward) in 1 and ``moe_dw`` (the
    experts') in 3. The pieces of 2 and 4 keep their length: the same work in another order."""
    hf = min(dispatch_f, moe_b) + min(combine_f, attn_b)
    hb = min(combine_b, attn_f + attn_dw) + min(dispatch_b, moe_f + moe_dw)
    return hf, hb


def split_pairs(mode: str, layout: Layout, m: int) -> int:
    """The number of forward passes a step's m micro-batches pair up as under
    ``parallel.ep_overlap_split`` (:func:`moetrain.config.splits_micro_batches`): 2m where each
    micro-batch runs as two halves, else m. Halves halve every transfer and compute piece, so a
    merged pair of halves hides half of what a pair of whole micro-batches hides, over twice as
    many pairs."""
    return 2 * m if splits_micro_batches(mode, layout.pp, layout.mbs, m) else m


def merged_pair_share(pp: int, vpp: int, m: int) -> float:
    """Share of a rank's m·vpp backwards that run merged with a forward under
    ``parallel.ep_overlap`` (``moetrain.parallel.pipeline.merge_backward_with_next_forward``), on
    the first pipeline rank, which has the most warm-up forwards and so the fewest pairs: every
    backward but the last is paired once the warm-up is over. pp = 1: (m − 1)/m; 1F1B: warm-up
    min(pp − 1, m); interleaved 1F1B: (vpp − 1)·(m per round) + 2·(pp − 1), torch's count."""
    if pp == 1:
        warmup, total = 0, m
    elif vpp == 1:
        warmup, total = min(pp - 1, m), m
    else:
        per_round = m // max(1, m // pp)
        warmup, total = min((vpp - 1) * per_round + 2 * (pp - 1), vpp * m), vpp * m
    return max(0, total - warmup - 1) / total


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
    ep_hidden: float = 0.0         # seconds of EP all-to-all hidden under compute per step (not in ``step``)

    def to_dict(self) -> dict[str, Any]:
        return {"step_time_s": self.step, "t_forward_s": self.t_f, "t_backward_s": self.t_b,
                "microbatches": self.microbatches, "breakdown_s": dict(self.breakdown), "tiers": dict(self.comm_tiers),
                "ep_hidden_s": self.ep_hidden}


def _wave(m: float, n: float, sms: int, tile: tuple[int, int], count: int = 1) -> float:
    """Fraction of SM-slots doing useful work for ``count`` GEMMs with an m×n output each."""
    if m <= 0 or n <= 0:
        return 1.0
    tiles = math.ceil(m / tile[0]) * math.ceil(n / tile[1]) * count
    waves = math.ceil(tiles / sms)
    useful = (m * n * count) / (tile[0] * tile[1])
    return min(1.0, useful / (waves * sms))


def k_efficiency(k: float, k0: float) -> float:
    """Efficiency of a GEMM with inner dimension ``k`` relative to one with k ≥ K_REF.

    Each output tile runs k / k_tile main-loop steps plus a fixed prologue and epilogue
    (loading the pipeline, writing the tile), worth k0 more elements of k, so the useful share
    is k / (k + k0). Normalised to K_REF, the profiles' reference; never above 1:
    ``min(1, k/(k + k0) · (K_REF + k0)/K_REF)``. This is what slows the GEMMs of small models
    (k = hidden = 768: 0.63 with k0 = 640) and the weight-gradient GEMMs of experts that get
    few tokens (k = tokens per expert).
    """
    if k <= 0:
        return 1.0
    return min(1.0, k / (k + k0) * (K_REF + k0) / K_REF)


def gemm_pass_time(m: float, n: float, k: float, count: int, rate: float, hbm: float, sms: int,
                   tile: tuple[int, int], k0: float, in_bytes: float = 2.0, out_bytes: float = 2.0) -> float:
    """Seconds of ``count`` GEMMs C[m×n] = A[m×k]·B[k×n] (a grouped GEMM when count > 1).

    Roofline (Williams et al. 2009): the longer of compute, at ``rate`` (FLOP/s) × wave
    efficiency × :func:`k_efficiency`, and memory, reading A and B once and writing C once at
    ``hbm`` (B/s). A grouped GEMM with few rows per group reads every group's B for little
    work: that is where expert GEMMs with few tokens per expert become memory-bound.
    """
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k * count
    t_c = flops / (rate * _wave(m, n, sms, tile, count) * k_efficiency(k, k0))
    t_m = count * (in_bytes * (m * k + k * n) + out_bytes * m * n) / hbm
    return max(t_c, t_m)


class _Compute:
    """Per-layer, per-micro-batch compute times on one rank."""

    def __init__(self, shape: ModelShape, layout: Layout, prof: "ClusterProfile", ta: TimingAssumptions,
                 act_bytes: int, grad_bytes: int = 4):
        self.s, self.l, self.p, self.ta = shape, layout, prof, ta
        self.T = layout.mbs * shape.seq_len / layout.cp
        self.sp = layout.sp and layout.tp > 1
        self.Tt = self.T / layout.tp if self.sp else self.T   # tokens of the norms / residuals
        self.Tm = self.T / layout.tp                           # tokens an MoE block routes (1/tp slice)
        self.act_bytes = act_bytes
        self.grad_bytes = grad_bytes
        # layer_efficiency: the software's measured overhead on top of every compute term
        self.speed = prof.layer_efficiency
        self.rate = prof.peak_tflops * 1e12 * prof.gemm_efficiency * self.speed
        self.hbm = prof.hbm_bandwidth() * self.speed
        if shape.fp8_gemms and not prof.fp8_peak_tflops:
            raise ValueError(f"profile {prof.name!r} has no fp8_peak_tflops (no FP8 tensor cores): plan it with "
                             f"train.precision bf16, or give the profile fp8_peak_tflops")
        self.rate8 = (prof.fp8_peak_tflops or 0.0) * 1e12 * (prof.fp8_gemm_efficiency or prof.gemm_efficiency) * self.speed
        self.att_eff = ta.attention_efficiency or prof.attention_efficiency

    def gemm(self, m: float, n: float, k: float, count: int = 1, fp8: bool | None = None) -> tuple[float, float]:
        """(forward, backward) seconds of ``count`` GEMMs [m×k]·[k×n]: forward C = A·B, input
        gradient dA = dC·Bᵀ (inner dimension n), weight gradient dB = Aᵀ·dC (inner dimension m,
        accumulated into the gradient buffer: read and written in ``grad_bytes``). ``fp8``
        (default: the shape's ``fp8_gemms``): at the FP8 rate on 1-byte operands, each pass's
        two operands quantized first (``fp8_cast_bytes`` per element)."""
        fp8 = self.s.fp8_gemms if fp8 is None else fp8
        rate, in_bytes = (self.rate8, 1.0) if fp8 else (self.rate, self.act_bytes)
        k0 = self.ta.gemm_k0 if self.p.gemm_k0 is None else self.p.gemm_k0
        args = (rate, self.hbm, self.p.sm_count, self.ta.tile, k0, in_bytes)
        fwd = gemm_pass_time(m, n, k, count, *args, out_bytes=self.act_bytes)
        bwd = gemm_pass_time(m, k, n, count, *args, out_bytes=self.act_bytes)
        if self.s.lora is None:  # a frozen base weight (train.lora) has no weight gradient
            bwd += gemm_pass_time(k, n, m, count, *args, out_bytes=2.0 * self.grad_bytes)
        if fp8 and m > 0:
            cast = self.ta.fp8_cast_bytes * count / self.hbm
            fwd += cast * (m * k + k * n)                       # A and B
            bwd += cast * ((m * n + n * k) + ((k * m + m * n) if self.s.lora is None else 0.0))  # dC, Bᵀ; Aᵀ, dC
        return fwd, bwd

    def score_gemm(self, m: float, n: float, k: float, count: int) -> tuple[float, float]:
        """(forward, backward) seconds of the batched QKᵀ / AV GEMMs of unfused attention, at
        compute speed only: their memory traffic (the s×s scores) is counted per score in
        :meth:`attention`."""
        sms, tile = self.p.sm_count, self.ta.tile
        flops = 2.0 * m * n * k * count
        fwd = flops / (self.rate * _wave(m, n, sms, tile, count))
        bwd = flops / (self.rate * _wave(m, k, sms, tile, count)) + flops / (self.rate * _wave(k, n, sms, tile, count))
        return fwd, bwd

    def input_projection(self) -> tuple[float, float]:
        """(forward, backward) seconds of the attention's input projections as one GEMM (QKV, or
        MLA's low-rank chain)."""
        s = self.s
        return self.gemm(self.T, (s.attn_params - s.attn_out_params) / s.hidden / self.l.tp, s.hidden)

    def up_projection(self) -> float:
        """Forward seconds of MLA's up-projections (what ``mla_up_proj`` recomputes besides the
        core): the query's r_q → a·d and the key-value's r_kv → a·(d_n + d_v) GEMMs; without MLA
        the whole input projection."""
        s, tp = self.s, self.l.tp
        if not s.is_mla:
            return self.input_projection()[0]
        q_in = s.q_lora_rank or s.hidden
        fq, _ = self.gemm(self.T, s.h_q / tp, q_in)
        fkv, _ = self.gemm(self.T, s.up_kv_params / s.kv_lora_rank / tp, s.kv_lora_rank)
        return fq + fkv

    def mtp_extra(self) -> tuple[float, float]:
        """(forward, backward) seconds of one MTP module beyond its block and the head: the
        projection W [2h → h] (DeepSeek-V3 §2.2)."""
        s = self.s
        return self.gemm(self.T, s.hidden / self.l.tp, 2 * s.hidden)

    def recompute(self, moe: bool, core_f: float) -> float:
        """Forward seconds that selective recomputation of ``layout.recompute_modules`` re-runs
        in one layer's backward (see memory.recomputed for what each drops): ``core_attn`` the
        attention core; ``mla_up_proj`` the core and MLA's up-projections; ``layernorm`` the
        two norms (read and write h per token each); ``moe_act`` the experts' SwiGLU (reads
        gate and up, writes their product); ``mlp`` a dense layer's MLP GEMMs and activation."""
        mods, s, b = self.l.recompute_modules, self.s, self.act_bytes
        t = 0.0
        if "core_attn" in mods or "mla_up_proj" in mods:
            t += core_f
        if "mla_up_proj" in mods:
            t += self.up_projection()
        if "layernorm" in mods:
            t += b * 2 * 2.0 * s.hidden * self.Tt / self.hbm
        if moe and "moe_act" in mods:
            t += b * self.Tm * 3.0 * s.expert_ffn * (s.expert_copies(self.ta.moe_imbalance) + s.shared_experts) / self.hbm
        if not moe and "mlp" in mods:
            t += self.mlp()[0] + b * self.T * s.mlp_matrices * s.ffn / self.l.tp / self.hbm
        return t

    def attention(self) -> tuple[float, float, float, float]:
        """(GEMMs fwd, GEMMs bwd, attention core fwd, attention core bwd) of the attention block."""
        s, tp = self.s, self.l.tp
        f1, b1 = self.input_projection()
        f2, b2 = self.gemm(self.T, s.hidden, s.h_v / tp)
        if self.ta.attention == "flash":
            core_flops = self.T * s.attention_flops(causal=True) / tp  # causal: half the score matrix
            core = core_flops / (self.p.peak_tflops * 1e12 * self.att_eff * self.speed)
            return f1 + f2, b1 + b2, core, core * self.ta.attention_backward
        # Unfused: QKᵀ and AV as batched GEMMs over the full s×s matrix (masked afterwards),
        # and the scores pass through memory: write QKᵀ, masked softmax (read, write), dropout
        # (read, write, 1-byte mask), read by AV: 13 (8 without dropout) bytes per score.
        heads = s.heads / tp
        n_seq = self.T / s.seq_len  # sequences in the micro-batch (CP: a fraction)
        count = max(1, round(heads * max(1.0, n_seq)))
        qk_f, qk_b = self.score_gemm(self.T / max(1.0, n_seq), s.seq_len, s.head_dim, count)
        av_f, av_b = self.score_gemm(self.T / max(1.0, n_seq), s.head_dim, s.seq_len, count)
        per_score = 13.0 if self.ta.dropout else 8.0
        mem = per_score * self.T * s.seq_len * heads / self.hbm
        return f1 + f2, b1 + b2, qk_f + av_f + mem, qk_b + av_b + 2 * mem

    def mlp(self) -> tuple[float, float]:
        s, tp = self.s, self.l.tp
        f1, b1 = self.gemm(self.T, (s.mlp_matrices - 1) * s.ffn / tp, s.hidden)  # SwiGLU: gate and up fused
        f2, b2 = self.gemm(self.T, s.hidden, s.ffn / tp)
        return f1 + f2, b1 + b2

    def moe(self) -> tuple[float, float, float, float]:
        """(forward, backward, shared-expert forward, shared-expert backward) seconds of one MoE
        block's GEMMs on the busiest expert rank.

        1. router: [T_m × h]·[h × E];
        2. routed experts: one grouped GEMM over the rank's E/ep experts, each with the tokens
           that reach it: T_m per rank × the busiest rank's routed copies per token
           (ModelShape.expert_copies) × ep source ranks / E experts, × tp with etp = tp (the tp
           ranks gather each other's tokens and each computes 1/tp of the width). Few tokens per
           expert make these GEMMs memory-bound on the expert weights and their weight-gradient
           GEMMs short-K (gemm_pass_time);
        3. shared experts: dense GEMMs on the rank's own tokens.
        """
        s, l = self.s, self.l
        local_experts = max(1, s.num_experts // l.ep)
        per_expert = self.Tm * s.expert_copies(self.ta.moe_imbalance) * l.ep / s.num_experts * l.etp
        width = s.expert_ffn / l.etp
        f1, b1 = self.gemm(per_expert, 2 * width, s.hidden, local_experts)
        f2, b2 = self.gemm(per_expert, s.hidden, width, local_experts)
        fr, br = self.gemm(self.Tm, s.num_experts, s.hidden, fp8=False)  # the router stays bf16
        g_f = g_b = 0.0
        if s.shared_experts:
            g1, c1 = self.gemm(self.Tm, 2 * s.expert_ffn * s.shared_experts, s.hidden)
            g2, c2 = self.gemm(self.Tm, s.hidden, s.expert_ffn * s.shared_experts)
            g_f, g_b = g1 + g2, c1 + c2
        return f1 + f2 + fr + g_f, b1 + b2 + br + g_b, g_f, g_b

    def elementwise(self, moe: bool) -> float:
        """Forward seconds of the memory-bound kernels of one layer (each tensor read and
        written once, :meth:`elementwise_bytes`) at the profile's HBM bandwidth × its
        ``elementwise_efficiency``; the backward moves twice as much."""
        return self.elementwise_bytes(moe) / (self.hbm * self.p.elementwise_efficiency)

    def elementwise_bytes(self, moe: bool) -> float:
        """HBM bytes of one layer's memory-bound kernels, forward: norms, residual adds, RoPE,
        and SwiGLU; in an MoE layer the permutation, the experts' SwiGLU and the router's fp32
        softmax and top-k."""
        s, tp = self.s, self.l.tp
        b = self.act_bytes
        per_seq_shard = 10.0 * s.hidden                     # 2 norms (r+w), 2 residual adds (2r+w)
        if self.ta.dropout:
            per_seq_shard += 5.0 * s.hidden                 # 2 dropouts: read, write, 1-byte mask
        per_tp_shard = 4.0 * (s.h_q + s.h_kv) / tp          # RoPE on Q and K (r+w)
        nbytes = b * (per_seq_shard * self.Tt + per_tp_shard * self.T)
        if moe:
            k, f = s.expert_copies(self.ta.moe_imbalance), s.expert_ffn
            # permute and unpermute (r+w of h-wide copies), SwiGLU on the f-wide expert outputs
            nbytes += b * self.Tm * (4.0 * k * s.hidden * self.l.etp + 3.0 * k * f + 3.0 * f * s.shared_experts)
            nbytes += 4 * self.Tm * 3.0 * s.num_experts      # fp32 router softmax / top-k
        else:
            # SwiGLU reads gate and up and writes their product; GELU reads and writes
            nbytes += b * self.T * s.mlp_matrices * s.ffn / tp
        return nbytes

    def logits(self) -> tuple[float, float]:
        s = self.s
        f, b = self.gemm(self.T, s.vocab / self.l.tp, s.hidden, fp8=False)  # the head stays bf16 (fp8_keep)
        per_logit = (38.0, 18.0) if self.ta.cross_entropy == "unfused" else (12.0, 12.0)
        logits = self.T * s.vocab / self.l.tp / self.hbm
        return f + per_logit[0] * logits, b + per_logit[1] * logits


def step_time(shape: ModelShape, layout: Layout, global_batch: int, profile: "ClusterProfile",
              places: dict[str, AxisPlace], mem: MemoryAssumptions = MemoryAssumptions(),
              ta: TimingAssumptions = TimingAssumptions()) -> StepTime:
    """Predicted seconds per optimizer step of ``layout`` (see the module doc for the model)."""
    lay = layout
    m = max(1, lay.microbatches(global_batch))
    c = _Compute(shape, lay, profile, ta, mem.act_bytes, mem.grad_bytes)
    sz = microbatch_buffers(shape, lay, mem.act_bytes, ta.moe_imbalance)
    prof = profile

    att_f, att_b, core_f, core_b = c.attention()
    mlp_f, mlp_b = c.mlp()
    moe_f, moe_b, shared_f, shared_b = c.moe() if shape.is_moe else (0.0, 0.0, 0.0, 0.0)
    el_d, el_m = c.elementwise(False), c.elementwise(True)

    # 2. communication inside one layer, one micro-batch
    t_ag, _ = comm_time("all_gather", sz["tp"], places["tp"], prof)
    t_rs, _ = comm_time("reduce_scatter", sz["tp"], places["tp"], prof)
    tp_region = t_ag + t_rs  # one TP region, forward or backward (AR without SP costs the same bytes)
    t_cp, _ = comm_time("all_gather", sz["cp"], places["cp"], prof)
    # Per layer, the mean over the token mixers: ring attention hides behind its core; a
    # gated-DeltaNet / Mamba-2 layer's head exchange (both ways) waits, in forward and backward.
    share = shape.attention_share
    t_heads = comm_time("all_to_all", sz["cp_heads"], places["cp"], prof)[0] if sz["cp_heads"] else 0.0
    cp_f = share * max(0.0, t_cp - core_f) + (1 - share) * t_heads
    cp_b = share * max(0.0, 2 * t_cp - core_b) + (1 - share) * t_heads
    t_p2p, _ = comm_time("p2p", sz["pp"], places["pp"], prof)
    # EP: dispatch and combine in each direction, the part the schedule cannot hide exposed;
    # with etp = tp an all-gather and a reduce-scatter of the routed tokens over tp as well
    t_a2a = ep_f = ep_b = ep_hidden = t_etp = 0.0
    if shape.is_moe:
        t_a2a = ep_all_to_all(sz["ep"], places["ep"], prof, shape.expert_copies(ta.moe_imbalance),
                              *shape.dedup_args())[0]
        # fp8 dispatch: the forward's dispatch carries (D + D/128) / 2D of the bytes
        t_disp = (ep_all_to_all(sz["ep"] * shape.dispatch_ratio(mem.act_bytes), places["ep"], prof,
                                shape.expert_copies(ta.moe_imbalance), *shape.dedup_args())[0]
                  if shape.dispatch_fp8 else t_a2a)
        segments: tuple[float, ...] = (t_disp, t_a2a, t_a2a, t_a2a, att_f + core_f, moe_f, att_b + core_b, moe_b)
        if ta.delay_wgrad:
            # A weight gradient costs the FLOPs of its forward GEMM. moetrain defers the experts' and,
            # without tp (its tensor-parallel linears compute theirs at once), the projections'.
            segments += (att_f if lay.tp == 1 else 0.0, moe_f)
        m_pairs = split_pairs(ta.ep_overlap_split, lay, m) if ta.ep_overlap == "merged_pairs" else m
        ep_f, ep_b, ep_hidden = ep_exposed(t_disp + t_a2a, 2 * t_a2a, att_f + core_f + moe_f, att_b + core_b + moe_b,
                                           shared_f, shared_b, ta.ep_overlap, lay, m_pairs, segments,
                                           prof.ep_overlap_efficiency)
        if lay.etp > 1:
            t_etp = (comm_time("all_gather", sz["etp"], places["tp"], prof)[0]
                     + comm_time("reduce_scatter", sz["etp"], places["tp"], prof)[0])

    gap = ta.kernel_gap_us * 1e-6 * ta.kernels_per_layer

    def layer(moe: bool) -> dict[str, float]:
        regions = 1 if moe else 2
        launches = gap * (1.75 if moe else 1.0)  # routing, permutation and the all-to-alls add kernels
        gemm_f, gemm_b = att_f + (moe_f if moe else mlp_f), att_b + (moe_b if moe else mlp_b)
        tp_f = tp_b = regions * tp_region
        tp_hidden = 0.0
        if ta.tp_comm_overlap:
            # Megatron's --tp-comm-overlap (Transformer Engine's userbuffers): each TP all-gather /
            # reduce-scatter is split into chunks pipelined with the GEMM it feeds or follows, so
            # only what outlasts the layer's GEMMs stays exposed.
            tp_hidden = min(tp_f, gemm_f) + min(tp_b, gemm_b)
            tp_f, tp_b = max(0.0, tp_f - gemm_f), max(0.0, tp_b - gemm_b)
        d = {
            "launch_f": launches, "launch_b": 2 * launches,
            "gemm_f": gemm_f, "gemm_b": gemm_b,
            "attn_f": core_f, "attn_b": core_b,
            "elem_f": el_m if moe else el_d, "elem_b": 2 * (el_m if moe else el_d),
            "tp_f": tp_f, "tp_b": tp_b, "tp_hidden": tp_hidden,
            "cp_f": cp_f, "cp_b": cp_b,
            "ep_f": ep_f + t_etp if moe else 0.0, "ep_b": ep_b + t_etp if moe else 0.0,
            "rec_selective": c.recompute(moe, core_f) if lay.ac == "selective" else 0.0,
        }
        return d

    per = {False: layer(False), True: layer(True)}
    log_f, log_b = c.logits()

    # 1-2. per micro-batch on each pipeline rank; the slowest rank sets the pace
    worst = None
    recomputed_layers = layers = 0.0  # over the pipeline ranks: layers recomputed whole (ac = full), all layers
    for r, (n_dense, n_moe) in enumerate(stage_counts(shape, lay.pp, lay.vpp)):
        acc = {k: n_dense * per[False][k] + n_moe * per[True][k] for k in per[False]}
        acc["n_moe"] = float(n_moe)
        if r == lay.pp - 1:
            acc["gemm_f"] = acc.get("gemm_f", 0.0) + log_f
            acc["gemm_b"] = acc.get("gemm_b", 0.0) + log_b
        if r == lay.pp - 1 and shape.mtp_depth:  # each MTP module: a block, W and the head again
            mtp_f, mtp_b = c.mtp_extra()
            for k, v in per[shape.mtp_moe].items():
                acc[k] += shape.mtp_depth * v
            acc["gemm_f"] += shape.mtp_depth * (mtp_f + log_f)
            acc["gemm_b"] += shape.mtp_depth * (mtp_b + log_b)
            acc["n_moe"] += shape.mtp_depth * shape.mtp_moe
        acc["pp_f"] = acc["pp_b"] = lay.vpp * t_p2p if lay.pp > 1 else 0.0
        keys_f = [k for k in acc if k.endswith("_f")]
        t_f = sum(acc[k] for k in keys_f)
        rec = 0.0
        layers += n_dense + n_moe
        if lay.ac == "full":
            # the recomputed share of the stage's layers (Layout.recompute_num_layers), each
            # layer's forward again; the heads are never recomputed
            share = lay.full_recompute_share((n_dense + n_moe) / lay.vpp)
            recomputed_layers += share * (n_dense + n_moe)
            heads = (1 + shape.mtp_depth) * log_f if r == lay.pp - 1 else 0.0
            rec = share * (sum(acc[k] for k in keys_f if k not in ("pp_f",)) - heads)
        elif lay.ac == "selective":
            rec = acc["rec_selective"]
        t_b = sum(acc[k] for k in acc if k.endswith("_b")) + rec
        if worst is None or t_f + t_b > worst[0] + worst[1]:
            worst = (t_f, t_b, acc, rec, r, n_dense + n_moe)
    assert worst is not None
    t_f, t_b, acc, rec, r_worst, n_layers = worst

    # 3. pipeline
    t_pipe = pipeline_time(lay.schedule, lay.pp, lay.vpp, m, t_f, t_b)
    bubble = t_pipe - m * (t_f + t_b)

    # 4. data parallel: the gradients of what trains (under train.lora the adapters), the
    #    parameters of all of it
    dense_p, expert_p = _rank_params(shape, lay)
    trained_d, trained_e = _rank_params(shape, lay, trained=True)
    t_eplb = eplb_time(shape, lay, places, prof, expert_p)
    slots = 1 + shape.redundant_experts / max(1, shape.num_experts)  # moe.eplb's spare slots
    expert_p, trained_e = expert_p * slots, trained_e * slots
    z = lay.zero
    dp_exposed = 0.0
    rs = ag = 0.0
    hsdp = lay.hsdp_axes()
    for axis, p, g in (("dp_cp", dense_p, trained_d), (expert_grad_axis(lay), expert_p, trained_e)):
        if p <= 0:
            continue
        if z == 0:
            rs += comm_time("all_reduce", g * mem.grad_bytes, places[axis], prof)[0] if g > 0 else 0.0
            continue
        # HSDP: reduce-scatter and all-gather inside the shard group, then each shard's gradient
        # all-reduced across the groups (1/dp_shard of it)
        shard = places[f"{axis}_shard"] if axis in hsdp else places[axis]
        if g > 0:
            rs += comm_time("reduce_scatter", g * mem.grad_bytes, shard, prof)[0]
            if axis in hsdp:
                rs += comm_time("all_reduce", g * mem.grad_bytes / hsdp[axis], places[f"{axis}_replicate"], prof)[0]
        gather = shape.lora.gather_bytes if shape.lora is not None and shape.lora.gather_bytes else mem.param_bytes
        ag += comm_time("all_gather", p * gather, shard, prof)[0]
    # The reductions hide behind a micro-batch's compute, not behind other traffic on their own
    # link: where the expert all-to-alls cross the same off-node tier as the data-parallel group,
    # that link carries them for ep_f / ep_b of every forward / backward, and the gradients queue
    # behind them.
    dp_tier = places["dp_cp"].tier
    shares_link = lay.ep > 1 and dp_tier != "nvlink" and places["ep"].tier == dp_tier
    busy_f, busy_b = (acc.get("ep_f", 0.0), acc.get("ep_b", 0.0)) if shares_link else (0.0, 0.0)
    free_f, free_b = max(0.0, t_f - busy_f), max(0.0, t_b - busy_b)
    window_b = free_b if ta.overlap_grad_reduce else 0.0
    window_f = free_f if ta.overlap_grad_reduce else 0.0
    if z <= 1:
        dp_exposed = max(0.0, rs - window_b) + max(0.0, ag - window_f)
        dp_hidden = min(rs, window_b) + min(ag, window_f)
    elif z == 2:
        dp_exposed = m * max(0.0, rs - free_b) + max(0.0, ag - free_f)
        dp_hidden = m * min(rs, free_b) + min(ag, free_f)
    else:
        dp_exposed = m * (max(0.0, ag - free_f) + max(0.0, ag + rs - free_b))
        dp_hidden = m * (min(ag, free_f) + min(ag + rs, free_b))
    cp_hidden = m * n_layers * share * (min(t_cp, core_f) + min(2 * t_cp, core_b)) if lay.cp > 1 else 0.0
    ep_hidden_step = m * acc.get("n_moe", 0.0) * ep_hidden
    tp_hidden_step = m * acc.get("tp_hidden", 0.0)
    overlap_cost = ta.overlap_slowdown * (dp_hidden + cp_hidden + ep_hidden_step + tp_hidden_step)

    # 5. optimizer
    shard_d = lay.dense_shard if z >= 1 else 1
    shard_e = lay.expert_shard if z >= 1 else 1
    t_opt = ta.adam_bytes * (trained_d / shard_d + trained_e / shard_e) / prof.hbm_bandwidth()
    # passes over the whole (unsharded) gradient buffer, on the compute stream, once a step
    t_grad = ta.grad_buffer_bytes * (trained_d + trained_e) / prof.hbm_bandwidth()

    t_muon = muon_time(shape, lay, prof, places, c.rate, dense_p, expert_p) if ta.optimizer == "muon" else 0.0

    step = t_pipe + dp_exposed + overlap_cost + t_opt + t_grad + t_muon + t_eplb
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
        "grad_buffer": t_grad,
        "muon": t_muon,
        "eplb": t_eplb,
    }
    tokens = global_batch * shape.seq_len
    model_flops = tokens * shape.model_flops_per_token()
    executed = model_flops + tokens * shape.recompute_flops_per_token(lay.ac, lay.recompute_modules,
                                                                      recomputed_layers / max(1.0, layers))
    tiers = {a: places[a].tier for a in places}
    return StepTime(step, t_f, t_b, m, bd, tiers, model_flops, executed, ep_hidden_step)


def muon_time(shape: ModelShape, lay: Layout, prof: "ClusterProfile", places: dict[str, AxisPlace], rate: float,
              dense_p: float, expert_p: float, wire_bytes: float = 2.0) -> float:
    """Seconds Muon adds to a step (moetrain.parallel.whole_matrix): the fullest stage's
    Newton–Schulz FLOPs (each matrix once, :meth:`ModelShape.muon_ns_flops`) over its dp·cp·tp
    ranks at ``rate`` (FLOP/s), plus one all-to-all of the blocks each rank sends in the gather
    and the scatter, ``wire_bytes`` per element (bf16): under ZeRO 1-3 its blocks of the dense
    matrices twice (an expert stack sharded along its expert dim has its matrices whole:
    nothing moves); under ZeRO-0 the results of the matrices it owns to their other replicas.
    ``dense_p`` / ``expert_p``: parameters on the fullest rank (counted as Muon's: the embedding
    and head are a small share of a large model, and over-count)."""
    stage_flops = max(n_d * shape.muon_ns_flops(False) + n_m * shape.muon_ns_flops(True)
                      for n_d, n_m in stage_counts(shape, lay.pp, lay.vpp))
    t_ns = stage_flops / (lay.dp * lay.cp * lay.tp) / rate
    if lay.zero >= 1:
        sent = 2.0 * dense_p / lay.dense_shard * wire_bytes
    else:
        k, ke = lay.dp * lay.cp, lay.expert_shard
        sent = (dense_p * (k - 1) / k + expert_p * (ke - 1) / ke) * wire_bytes
    place = places.get("dp_cp_shard", places["dp_cp"])
    return t_ns + comm_time("all_to_all", sent, place, prof)[0]


def eplb_time(shape: ModelShape, lay: Layout, places: dict[str, AxisPlace], prof: "ClusterProfile",
              expert_p: float, state_bytes: float = 12.0) -> float:
    """Seconds ``moe.eplb`` adds to a step besides its spare slots' share of the data-parallel
    traffic and the optimizer (which scale with (E + r) / E): the replicated experts' gradient
    all-reduce over ep after the backward (exposed: the optimizer waits for it), at most
    ``redundant_experts`` experts' rows per MoE layer, each rank's FSDP shard of them in fp32; and
    the re-placements' moves amortised over ``eplb_every`` steps, bounded by every slot of a rank
    sent and received once (an ``all_to_all`` of the weights and AdamW's two moments,
    ``state_bytes`` per parameter: 3 fp32 tensors). ``expert_p``: routed-expert parameters on the
    fullest rank without spare slots (:func:`_rank_params`). 0 without spare slots or ep."""
    r, E = shape.redundant_experts, shape.num_experts
    if not r or not E or lay.ep <= 1:
        return 0.0
    shard = lay.expert_shard if lay.zero >= 1 else 1
    per_expert = expert_p * lay.ep / E / shard  # one expert's rows on a rank (its etp and FSDP shard)
    t = comm_time("all_reduce", r * per_expert * 4.0, places["ep"], prof)[0]
    if shape.eplb_every:
        slots = (E + r) / lay.ep
        t += comm_time("all_to_all", slots * per_expert * state_bytes, places["ep"], prof)[0] / shape.eplb_every
    return t


def _rank_params(shape: ModelShape, lay: Layout, trained: bool = False) -> tuple[float, float]:
    """(dense, expert) parameters on the fullest pipeline rank after TP and EP; with
    ``trained``, those that train (under ``train.lora`` the adapters, whole on every tp rank, the
    routed experts' over ep when per expert)."""
    if trained and shape.lora is not None:
        lo = shape.lora
        counts = stage_counts(shape, lay.pp, lay.vpp)
        return max(((n_d * lo.dense_layer + n_m * lo.moe_layer,
                     n_m * lo.expert_layer / (1 if lo.experts_shared else lay.ep)) for n_d, n_m in counts), key=sum)
    best = (0.0, 0.0)
    dense_layer, moe_layer = shape.layer_params(False), shape.layer_params(True)
    for r, (n_dense, n_moe) in enumerate(stage_counts(shape, lay.pp, lay.vpp)):
        d = n_dense * dense_layer[0] + n_moe * moe_layer[0]
        e = n_moe * moe_layer[1]
        if r == 0:
            d += shape.vocab * shape.hidden
        if r == lay.pp - 1 and (lay.pp > 1 or not shape.tie_embeddings):
            d += shape.vocab * shape.hidden
        if r == lay.pp - 1 and shape.mtp_depth:
            md, me = shape.mtp_params()
            d += md + (shape.vocab * shape.hidden if lay.pp > 1 else 0)
            e += me
        cand = (d / lay.tp, e / (lay.ep * lay.etp))
        if sum(cand) > sum(best):
            best = cand
    return best
