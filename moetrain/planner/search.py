"""Enumerate layouts for a model on a cluster, predict memory and speed, rank, explain.

Search space: tp (divides heads and kv_heads, fits an NVSwitch domain), cp (powers of two that
split the sequence), pp (divides the layers), dp (the rest), ep (divides the experts and
dp × cp), etp (1, or tp for MoE models: experts split by tp), virtual stages, ZeRO stage 0-3,
micro-batch 1/2/4/8, activation checkpointing
none / selective / full, schedule 1F1B / ZB-H1 / interleaved 1F1B. Sequence parallelism is on
whenever tp > 1 (Korthikanti et al. 2022: it only removes redundant work). The global batch
and sequence length come from the config and are kept.

Each layout's groups are placed by the topology mapper on the given allocation, so the tier
each collective crosses is the one the trainer would use.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from moetrain.config import LayoutFacts, layout_refusal
from moetrain.planner.layout import Layout
from moetrain.planner.memory import GIB, MemoryAssumptions, MemoryBreakdown, memory_per_gpu
from moetrain.planner.model import ModelShape
from moetrain.planner.timing import StepTime, TimingAssumptions, step_time
from moetrain.planner.traffic import AxisPlace, places_from_rank_map
from moetrain.topology.cluster import TIERS, Allocation, ClusterProfile, synthetic_allocation
from moetrain.topology.eplb import Placement, place_experts, rank_loads
from moetrain.topology.mapper import map_ranks

if TYPE_CHECKING:  # pragma: no cover
    from moetrain.config import Config

__all__ = ["Plan", "Planner", "SearchResult"]

MBS_CHOICES = (1, 2, 4, 8)
AC_CHOICES = ("none", "selective", "full")


@dataclass
class Plan:
    """One evaluated layout."""

    layout: Layout
    memory: MemoryBreakdown
    capacity_gib: float
    time: StepTime | None = None
    world: int = 0
    peak_tflops: float = 0.0
    tokens_per_step: int = 0
    broken_rules: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def memory_gib(self) -> float:
        return self.memory.total / GIB

    @property
    def fits(self) -> bool:
        return self.memory_gib <= self.capacity_gib

    @property
    def step_s(self) -> float:
        return self.time.step if self.time else math.inf

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.time else 0.0

    @property
    def tokens_per_gpu(self) -> float:
        """Tokens per second per GPU."""
        return self.tokens_per_s / self.world if self.time else 0.0

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU (no recomputation counted: the MFU numerator)."""
        return self.time.model_flops / self.step_s / self.world / 1e12 if self.time else 0.0

    @property
    def hw_tflops_per_gpu(self) -> float:
        """TFLOP/s per GPU counting recomputation (Narayanan et al. 2021's "achieved" metric)."""
        return self.time.executed_flops / self.step_s / self.world / 1e12 if self.time else 0.0

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu / self.peak_tflops if self.time else 0.0

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        d: dict[str, Any] = {
            "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "ep": lay.ep, "etp": lay.etp, "vpp": lay.vpp,
            "zero_stage": lay.zero, "micro_batch_size": lay.mbs, "activation_checkpointing": lay.ac,
            "recompute_modules": list(lay.recompute_modules) if lay.ac == "selective" else [], "ep_fold": lay.ep_fold,
            "recompute_num_layers": lay.recompute_num_layers if lay.ac == "full" else None,
            "pp_schedule": lay.schedule, "sequence_parallel": lay.sp,
            "microbatches": self.time.microbatches if self.time else None,
            "memory_gib_per_gpu": round(self.memory_gib, 3), "capacity_gib": round(self.capacity_gib, 3),
            "fits": self.fits, "memory_breakdown_gib": self.memory.to_dict(),
            "step_time_s": self.step_s if self.time else None,
            "tokens_per_s": self.tokens_per_s, "tflops_per_gpu": self.tflops_per_gpu,
            "hw_tflops_per_gpu": self.hw_tflops_per_gpu, "mfu": self.mfu,
            "broken_rules": self.broken_rules, "notes": self.notes,
            "overrides": lay.overrides() if lay.runs_in_moetrain else None,
        }
        if self.time:
            d["time_breakdown_s"] = {k: v for k, v in self.time.breakdown.items()}
            d["tiers"] = self.time.comm_tiers
        return d


@dataclass
class SearchResult:
    """``ranked``: the fitting layouts, fastest first (the ``top`` asked for). ``enumerated``:
    layouts whose memory was evaluated; ``fitting``: those that fit. ``smallest_miss``: the
    layout closest to fitting when none fits. ``empty_reason``: why nothing was valid."""

    ranked: list[Plan]
    enumerated: int
    fitting: int
    smallest_miss: Plan | None = None
    empty_reason: str | None = None


def shape_facts(shape: ModelShape, global_batch: int) -> LayoutFacts:
    """The layout rules' facts of a model known by its shape alone (a published run): no
    vocabulary rule (such runs pad it to their tp) and the stage split theirs."""
    return LayoutFacts(layers=shape.layers, heads=shape.heads, kv_heads=shape.kv_heads, hidden=shape.hidden,
                       ffn_hidden=shape.ffn, dense_layers=shape.dense_layers > 0, seq_len=shape.seq_len,
                       num_experts=shape.num_experts, moe_ffn_hidden=shape.expert_ffn,
                       tie_embeddings=False, global_batch_size=global_batch, published=True)


class Planner:
    """Predicts memory and step time of layouts of ``shape`` on ``n_nodes`` nodes of ``profile``.

    Args:
        shape: the model.
        profile: the cluster kind.
        n_nodes: nodes in the job (or give ``allocation``).
        global_batch: sequences per optimizer step (kept for every layout).
        allocation: the actual nodes (default: contiguous nodes, see synthetic_allocation).
    """

    def __init__(self, shape: ModelShape, profile: ClusterProfile, n_nodes: int, global_batch: int,
                 allocation: Allocation | None = None, gpus_per_node: int | None = None,
                 mem: MemoryAssumptions = MemoryAssumptions(), timing: TimingAssumptions = TimingAssumptions(),
                 facts: LayoutFacts | None = None):
        self.shape = shape
        # Measured tokens per expert ([layers][E], moetrain.plan --expert-loads): the busiest
        # expert-parallel rank's share then comes from them at each ep (measured_imbalance),
        # with ``redundant_experts`` spare slots placed by EPLB; None: timing.moe_imbalance.
        self.expert_loads: list[list[float]] | None = None
        # The same per record ([steps][layers][E]): each step waits for that step's busiest rank
        # (measured_imbalance); None: the mean loads alone.
        self.expert_load_steps: list[list[list[float]]] | None = None
        self.redundant_experts = 0
        # What the layout rules (moetrain.config.layout_refusal) read besides the layout: the
        # config's for a planner made from one, else the model shape's with the stage split left
        # to the framework of a published run.
        self.facts = facts or shape_facts(shape, global_batch)
        self.profile = profile
        self.gpn = gpus_per_node or profile.gpus_per_node
        self.allocation = allocation or synthetic_allocation(n_nodes, profile)
        self.n_nodes = len(self.allocation)
        self.world = self.n_nodes * self.gpn
        self.global_batch = global_batch
        self.mem = mem
        self.timing = timing
        self.capacity = profile.memory_gib - profile.reserved_gib
        self._places: dict[tuple[int, ...], tuple[dict[str, AxisPlace], list[str]]] = {}

    @classmethod
    def from_config(cls, cfg: "Config", profile: ClusterProfile, n_nodes: int,
                    allocation: Allocation | None = None, gpus_per_node: int | None = None,
                    published: bool = False) -> "Planner":
        """A planner of ``cfg``'s layouts: the layouts this version of moetrain runs (a run to
        submit), or with ``published`` those of ``cfg`` as another framework's published run
        (:class:`moetrain.config.LayoutFacts`)."""
        return cls(ModelShape.from_config(cfg), profile, n_nodes, cfg.train.global_batch_size, allocation,
                   gpus_per_node=gpus_per_node,
                   mem=MemoryAssumptions.for_train(cfg.train),
                   timing=TimingAssumptions(ep_overlap="merged_pairs" if cfg.parallel.ep_overlap else "none",
                                            delay_wgrad=cfg.parallel.delay_wgrad_compute,
                                            ep_overlap_split=cfg.parallel.ep_overlap_split,
                                            optimizer=cfg.train.optimizer),
                   facts=LayoutFacts.from_config(cfg, published=published))

    def timing_for(self, lay: Layout) -> TimingAssumptions:
        """The timing assumptions of ``lay``: :attr:`timing`, its MoE imbalance taken from the
        measured expert loads at ``lay.ep`` when there are some."""
        if self.expert_loads is None or not self.shape.is_moe:
            return self.timing
        return dataclasses.replace(self.timing, moe_imbalance=self.measured_imbalance(lay.ep))

    def measured_imbalance(self, ep: int) -> float:
        """Tokens on the busiest of ``ep`` expert-parallel ranks over the mean, from the measured
        loads, averaged over the layers (each layer waits for its own busiest rank): the experts
        placed contiguously (E / ep per rank, moetrain's placement), or with
        :attr:`redundant_experts` spare slots by EPLB from the mean loads
        (:func:`moetrain.topology.eplb.place_experts`; where the slots do not split over ``ep``,
        contiguously). With :attr:`expert_load_steps` the ratio is each step's, averaged over the
        steps: a step waits for its own busiest rank, and the mean loads hide how that rank moves
        from step to step (the demo config's first 16 steps at dp2 × ep2: 1.41 per step, 1.06 from
        the mean loads). An ep the experts do not split over keeps ``timing.moe_imbalance``."""
        steps = self.expert_load_steps or [self.expert_loads]
        ratios = []
        for li, loads in enumerate(self.expert_loads):
            E = len(loads)
            if self.redundant_experts and (E + self.redundant_experts) % ep == 0:
                pl = place_experts(loads, E + self.redundant_experts, ep)
            else:
                if E % ep:
                    return self.timing.moe_imbalance
                n = E // ep
                pl = Placement(tuple(tuple(range(p * n, (p + 1) * n)) for p in range(ep)))
            per_step = []
            for rec in steps:
                per_rank = rank_loads(rec[li], pl)
                mean = sum(per_rank) / ep
                per_step.append(max(per_rank) / mean if mean > 0 else 1.0)
            ratios.append(sum(per_step) / len(per_step))
        return sum(ratios) / len(ratios)

    # -- placement ---------------------------------------------------------------------------
    def places(self, lay: Layout) -> tuple[dict[str, AxisPlace], list[str]]:
        """Axis placements and broken rules of the rank map for this layout (cached)."""
        key = (lay.tp, lay.pp, lay.dp, lay.cp, lay.ep, lay.ep_fold, lay.dp_shard)
        if key not in self._places:
            # a folded ep group is one tp group times ep/tp ranks of dp × cp: mapped as the latter,
            # then widened by the tp group it takes in (which the map keeps inside a domain)
            ep = lay.ep // lay.tp if lay.ep_fold else lay.ep
            sizes = {"pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "tp": lay.tp, "ep": ep}
            if lay.dp_shard is not None:
                sizes["dp_shard"] = lay.dp_shard
            rm = map_ranks(sizes, self.allocation, self.profile, self.gpn)
            places = places_from_rank_map(rm)
            if lay.ep_fold:
                part, tp = places["ep"], places["tp"]
                tier = max(part.tier if part.size > 1 else "none", tp.tier, key=TIERS.index)
                places["ep"] = AxisPlace(lay.ep, tier, part.per_domain * tp.size)
            self._places[key] = (places, [f"{r.name}: {r.detail}" for r in rm.broken_rules])
        return self._places[key]

    # -- evaluation --------------------------------------------------------------------------
    def check(self, lay: Layout) -> str | None:
        """Why ``lay`` is not a valid layout here, or None: the job's GPU count, the planner-only
        fields (``ep_fold``, ``recompute_num_layers``), then the rules the config's validation
        applies (:func:`moetrain.config.layout_refusal`, the one set both use), so a layout the
        planner ranks is one ``submit`` accepts."""
        s = self.shape
        if lay.world != self.world:
            return f"tp·pp·dp·cp = {lay.world}, but the job has {self.world} GPUs"
        ep = lay.ep
        if lay.ep_fold:
            if lay.etp != 1 or lay.tp == 1 or lay.ep % lay.tp or (lay.dp * lay.cp) % (lay.ep // lay.tp) \
                    or not s.is_moe or s.num_experts % lay.ep:
                return (f"ep_fold: ep = {lay.ep} must be tp = {lay.tp} (> 1, etp = 1) times a divisor of dp·cp = "
                        f"{lay.dp * lay.cp}, and divide the experts ({s.num_experts})")
            ep = lay.ep // lay.tp  # the part of the ep group inside dp × cp
        if lay.recompute_num_layers is not None and (lay.ac != "full" or lay.recompute_num_layers < 1):
            return f"recompute_num_layers = {lay.recompute_num_layers} needs ac = full and at least 1 layer"
        facts = dataclasses.replace(
            self.facts, tp=lay.tp, pp=lay.pp, dp=lay.dp, cp=lay.cp, ep=ep, etp=lay.etp, virtual_stages=lay.vpp,
            zero_stage=lay.zero, pp_schedule=lay.schedule, sequence_parallel=lay.sp, activation_checkpointing=lay.ac,
            dp_shard=lay.dp_shard, micro_batch_size=lay.mbs, global_batch_size=self.global_batch,
            ep_overlap=self.timing.ep_overlap == "merged_pairs")
        if refusal := layout_refusal(facts):
            field, value, why, _ = refusal
            return f"{field} = {value!r}: {why}"
        return None

    def evaluate(self, lay: Layout, with_time: bool = True) -> Plan:
        """Memory and (when ``with_time``) step time of one layout.

        Raises:
            ValueError: the layout is invalid here (see :meth:`check`).
        """
        why = self.check(lay)
        if why:
            raise ValueError(f"layout {lay.short()}: {why}")
        timing = self.timing_for(lay)
        mem = memory_per_gpu(self.shape, lay, self.global_batch, self.mem, timing.moe_imbalance)
        plan = Plan(lay, mem, self.capacity, world=self.world, peak_tflops=self.profile.peak_tflops,
                    tokens_per_step=self.global_batch * self.shape.seq_len)
        if self.shape.layers % (lay.pp * lay.vpp):
            plan.notes.append(f"{self.shape.layers} layers do not split evenly over pp·vpp = {lay.pp * lay.vpp}: "
                              f"timed by the fullest stage; the trainer's config needs an even split")
        if with_time:
            places, broken = self.places(lay)
            plan.time = step_time(self.shape, lay, self.global_batch, self.profile, places, self.mem, timing)
            plan.broken_rules = broken
        return plan

    # -- search ------------------------------------------------------------------------------
    def _bases(self, fixed: dict[str, Any]) -> Iterator[Layout]:
        """Valid layouts agreeing with ``fixed``, with ``zero`` and ``ac`` still to choose."""
        s = self.shape
        dom = self.profile.nvswitch_domain_gpus

        def choices(key: str, default: list[Any]) -> list[Any]:
            return [fixed[key]] if key in fixed else default

        fold = bool(fixed.get("ep_fold", False))
        g = math.gcd(s.heads, s.kv_heads)
        tps = choices("tp", [t for t in range(1, g + 1) if g % t == 0 and t <= max(dom, 1) and self.world % t == 0])
        for tp in tps:
            sp = bool(fixed.get("sp", tp > 1)) and tp > 1
            cps = choices("cp", [c for c in (1, 2, 4, 8, 16, 32) if self.world % (tp * c) == 0])
            for cp in cps:
                pps = choices("pp", [p for p in range(1, s.layers + 1) if s.layers % p == 0
                                     and self.world % (tp * cp * p) == 0])
                for pp in pps:
                    if self.world % (tp * cp * pp):
                        continue
                    dp = self.world // (tp * cp * pp)
                    if "dp" in fixed and fixed["dp"] != dp:
                        continue
                    e_all = s.num_experts or 1
                    eps = choices("ep", [e for e in range(1, e_all + 1) if e_all % e == 0 and
                                         (e % tp == 0 and (dp * cp) % (e // tp) == 0 if fold else (dp * cp) % e == 0)]
                                  if s.is_moe else [1])
                    if pp == 1:
                        sched_v = [("1f1b", 1)]
                    else:
                        per = s.layers // pp if s.layers % pp == 0 else 0
                        vs = [v for v in (2, 3, 4, 6, 8) if per % v == 0] if per else [2, 4]
                        sched_v = [("1f1b", 1), ("zero_bubble", 1)] + [("interleaved_1f1b", v) for v in vs]
                    if "vpp" in fixed:
                        sched_v = [(sch, v) for sch, v in sched_v if v == fixed["vpp"]] or \
                                  [("interleaved_1f1b" if fixed["vpp"] > 1 else "1f1b", fixed["vpp"])]
                    if "schedule" in fixed:
                        sched_v = [(sch, v) for sch, v in sched_v if sch == fixed["schedule"]] or \
                                  [(fixed["schedule"], fixed.get("vpp", 1))]
                    etps = choices("etp", [1, tp] if tp > 1 and s.is_moe else [1])
                    for ep in eps:
                        for etp in etps:
                            for sched, v in sched_v:
                                for mbs in choices("mbs", list(MBS_CHOICES)):
                                    lay = Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, vpp=v, zero=fixed.get("zero", 1),
                                                 mbs=mbs, ac=fixed.get("ac", "none"), schedule=sched, sp=sp, etp=etp,
                                                 recompute_modules=fixed.get("recompute_modules", ("core_attn",)),
                                                 ep_fold=fold, dp_shard=fixed.get("dp_shard"),
                                                 recompute_num_layers=fixed.get("recompute_num_layers"))
                                    if self.check(lay) is None:
                                        yield lay

    def enumerate(self, fixed: dict[str, Any] | None = None) -> Iterator[Layout]:
        """Every valid layout agreeing with ``fixed`` (keys of :class:`Layout`), all ZeRO stages
        and checkpointing choices included."""
        fixed = dict(fixed or {})
        for base in self._bases(fixed):
            for ac in ([fixed["ac"]] if "ac" in fixed else AC_CHOICES):
                for z in ([fixed["zero"]] if "zero" in fixed else (0, 1, 2, 3)):
                    lay = dataclasses.replace(base, ac=ac, zero=z)
                    if not self.check(lay):  # the bases are valid; ep_overlap may refuse a stage or ac
                        yield lay

    def search(self, fixed: dict[str, Any] | None = None, top: int = 5) -> SearchResult:
        """Rank the valid layouts that fit in memory by predicted step time (fastest first).

        Pruned without loss (the time model makes them slower, never faster): a higher ZeRO
        stage once ZeRO-1 (or ZeRO-0 and ZeRO-1) fits, and more recomputation once a lighter
        checkpointing fits with ZeRO ≤ 1. Ties go to the simpler layout (less cp, pp, tp).
        """
        fixed = dict(fixed or {})
        fitting: list[Plan] = []
        n = 0
        smallest: Plan | None = None
        acs = [fixed["ac"]] if "ac" in fixed else list(AC_CHOICES)
        zeros = [fixed["zero"]] if "zero" in fixed else [0, 1, 2, 3]
        for base in self._bases(fixed):
            for ac in acs:
                lowest_fit = None
                for z in zeros:
                    lay = dataclasses.replace(base, ac=ac, zero=z)
                    if self.check(lay):  # the bases are valid; ep_overlap may refuse a stage or ac
                        continue
                    n += 1
                    plan = self.evaluate(lay, with_time=False)
                    if plan.fits:
                        fitting.append(plan)
                        lowest_fit = z if lowest_fit is None else lowest_fit
                        if z >= 1:
                            break
                    elif smallest is None or plan.memory_gib < smallest.memory_gib:
                        smallest = plan
                if lowest_fit is not None and lowest_fit <= 1:
                    break
        for plan in fitting:
            places, broken = self.places(plan.layout)
            plan.time = step_time(self.shape, plan.layout, self.global_batch, self.profile, places, self.mem,
                                  self.timing_for(plan.layout))
            plan.broken_rules = broken
        fitting.sort(key=lambda p: (round(p.step_s, 9), p.layout.cp, p.layout.pp, p.layout.tp, p.layout.vpp,
                                    p.layout.zero, p.memory_gib))
        return SearchResult(fitting[:top] if top else fitting, n, len(fitting), smallest,
                            None if n else self.why_empty(fixed))

    def why_empty(self, fixed: dict[str, Any]) -> str:
        """Why no layout is valid here (the first rule every candidate breaks)."""
        s = self.shape
        reasons: dict[str, int] = {}
        g = math.gcd(s.heads, s.kv_heads)
        for tp in [t for t in range(1, g + 1) if g % t == 0]:
            for pp in [p for p in range(1, s.layers + 1) if s.layers % p == 0]:
                if self.world % (tp * pp):
                    reasons["tp·pp must divide the GPU count"] = reasons.get("tp·pp must divide the GPU count", 0) + 1
                    continue
                lay = Layout(tp=tp, pp=pp, dp=self.world // (tp * pp), sp=tp > 1, **{k: v for k, v in fixed.items()
                                                                                     if k in ("mbs", "zero", "ac")})
                why = self.check(lay)
                if why:
                    reasons[why] = reasons.get(why, 0) + 1
        if not reasons:
            return "every candidate is excluded by --layout"
        if len(reasons) > 1:
            reasons.pop("tp·pp must divide the GPU count", None)
        worst = sorted(reasons.items(), key=lambda kv: -kv[1])[:3]
        return (f"{self.world} GPUs: no valid layout; e.g. " + "; ".join(w for w, _ in worst) +
                ". Fix: change --nodes or train.global_batch_size")


def explain(plan: Plan, rank: int, nxt: Plan | None = None) -> list[str]:
    """A few lines on why this layout is where it is."""
    lay, t = plan.layout, plan.time
    lines = [f"#{rank} {lay.short()}: {plan.step_s:.3f} s/step, {plan.tflops_per_gpu:.0f} TFLOP/s/GPU "
             f"(MFU {plan.mfu:.1%}), {plan.tokens_per_s:,.0f} tokens/s, {plan.memory_gib:.1f} of "
             f"{plan.capacity_gib:.1f} GiB"]
    if t is None:
        return lines
    bd = t.breakdown
    total = t.step
    parts = []
    tier = t.comm_tiers
    label = {"tp_comm": f"TP on {tier.get('tp')}", "ep_comm": f"EP exposed on {tier.get('ep')}",
             "overlap_slowdown": "compute lost to overlapped collectives",
             "pp_p2p": f"PP p2p on {tier.get('pp')}", "dp_comm_exposed": f"DP exposed on {tier.get('dp_cp')}",
             "cp_comm_exposed": f"CP exposed on {tier.get('cp')}"}
    for k, v in sorted(bd.items(), key=lambda kv: -kv[1]):
        if v <= 0.005 * total:
            continue
        name = label.get(k, k)
        if k == "bubble":
            name = f"bubble (pp={lay.pp}, m={t.microbatches}" + (f", v={lay.vpp})" if lay.vpp > 1 else ")")
        parts.append(f"{name} {v:.3f} s ({v / total:.0%})")
    lines.append("   time: " + ", ".join(parts))
    if t.ep_hidden > 0:
        lines.append(f"   EP all-to-all hidden under the other micro-batch's compute: {t.ep_hidden:.3f} s/step "
                     f"(exposed {bd.get('ep_comm', 0.0):.3f} s)")
    mg = plan.memory.gib()
    zero_txt = {0: "no ZeRO", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[lay.zero]
    lines.append(f"   memory: weights {mg['params']:.1f}, grads {mg['grads']:.1f}, optimizer {mg['optimizer']:.1f} "
                 f"({zero_txt} over {lay.dense_shard} ranks{' (HSDP)' if lay.dp_shard is not None else ''}), "
                 f"activations {mg['activations']:.1f} "
                 f"(ac={lay.ac}, mbs={lay.mbs}), buffers {mg['buffers']:.1f} GiB")
    if nxt is not None and nxt.time is not None:
        diff = {k: nxt.time.breakdown.get(k, 0.0) - bd.get(k, 0.0) for k in set(bd) | set(nxt.time.breakdown)}
        k, v = max(diff.items(), key=lambda kv: kv[1])
        if v > 0:
            lines.append(f"   ahead of the next ({nxt.layout.short()}) by {nxt.step_s - plan.step_s:.3f} s/step, "
                         f"mostly {label.get(k, k)} (+{v:.3f} s there)")
    for b in plan.broken_rules:
        lines.append(f"   rank map: {b}")
    for n in plan.notes:
        lines.append(f"   note: {n}")
    return lines
