"""Re-plan a run's layout for the ranks an elastic attempt actually has.

An elastic job (``launch.elastic``) may start on fewer nodes than ``launch.nodes``. What a run
promises stays fixed — the model, the optimizer, the global batch and the order in which the
samples are seen — so that the loss trajectory is the one the full layout would have trained
(losses are equal across layouts, checkpoints load into any layout). What may change is how the
work is spread: dp, and with it the micro-batches per step (gradient accumulation), and — only
when no layout keeping them fits in memory or divides the new rank count — the ZeRO stage, the
recomputation, the micro-batch size, and last tp, pp and ep.

Candidates, in order of preference; the first valid one that fits in memory (the planner's
memory model, :func:`moetrain.planner.memory.memory_per_gpu`) is taken:

1. the configured layout with dp = ranks ÷ (tp × pp × cp) (HSDP's ``dp_shard`` kept when it
   still divides dp × cp);
2. the fastest layout keeping tp, pp, cp, ep, etp and the pipeline schedule;
3. the fastest keeping tp, pp and ep;
4. the fastest of any.

A layout that would not fit is never chosen. When the node count the attempt has allows none
(the global batch is not a multiple of the new dp, or the model does not fit), the next smaller
count is tried, down to ``launch.elastic.min_nodes``: the ranks of the nodes left over sit the
attempt out (e.g. 7 of 8 nodes with a global batch of 1024 train on 4). With none at all,
:class:`ElasticError` says why, for the count the attempt has.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moetrain.config import Config, ConfigError
from moetrain.planner.layout import Layout
from moetrain.planner.search import Plan, Planner
from moetrain.topology.cluster import ClusterProfile
from moetrain.topology.mapper import resolve_profile

__all__ = ["ElasticError", "Replan", "replan", "layout_text", "node_counts_without_layout"]


class ElasticError(RuntimeError):
    """No layout of the model fits on the ranks the attempt has (or they are below
    ``launch.elastic.min_nodes``); the message says what the closest candidate needs."""


@dataclass(frozen=True)
class Replan:
    """What a re-plan changed. ``nodes_*`` / ``world_*``: nodes and ranks asked for and had.
    ``before`` / ``after``: the layouts. ``accum_*``: micro-batches per rank per step.
    ``predicted_ratio``: the planner's step time after ÷ before (None where the planner cannot
    time the configured layout). ``memory_gib`` / ``capacity_gib``: the chosen layout's
    predicted memory per GPU and the profile's usable memory. ``how``: which candidate was
    taken (see the module docstring)."""

    nodes_before: int
    nodes_had: int
    nodes_after: int
    world_before: int
    world_after: int
    before: Layout
    after: Layout
    accum_before: int
    accum_after: int
    predicted_ratio: float | None
    memory_gib: float
    capacity_gib: float
    how: str

    def message(self) -> str:
        """One line for the console and the event log, e.g. ``re-planned: 2 nodes → 1 node:
        dp4×ep2 → dp2×ep2, accumulation 2 → 4, predicted 1.9× step time (tp, pp, ep kept; ...)``."""
        def n(k: int) -> str:
            return f"{k} node{'s' if k != 1 else ''}"

        ratio = f", predicted {self.predicted_ratio:.1f}× step time" if self.predicted_ratio else ""
        used = (f" (training on {self.nodes_after}: no layout fits {self.nodes_had})"
                if self.nodes_after != self.nodes_had else "")
        return (f"re-planned: {n(self.nodes_before)} → {n(self.nodes_had)}{used}: "
                f"{layout_text(self.before, self.after)}"
                f", accumulation {self.accum_before} → {self.accum_after}{ratio} ({self.how}; "
                f"{self.memory_gib:.1f} of {self.capacity_gib:.0f} GiB per GPU predicted)")

    def to_dict(self) -> dict[str, Any]:
        return {"nodes_before": self.nodes_before, "nodes_had": self.nodes_had, "nodes_after": self.nodes_after, "world_before": self.world_before,
                "world_after": self.world_after, "before": self.before.short(), "after": self.after.short(),
                "accum_before": self.accum_before, "accum_after": self.accum_after,
                "predicted_ratio": self.predicted_ratio, "memory_gib": self.memory_gib, "how": self.how}


def layout_text(before: Layout, after: Layout | None = None) -> str:
    """``dp4×ep2`` (the sizes above 1, in the order tp, pp, dp, cp, ep), or ``dp4×ep2 → dp2×ep2``
    with the other fields that changed (ZeRO stage, micro-batch size, recomputation)."""
    def sizes(lay: Layout) -> str:
        parts = [f"{k}{getattr(lay, k)}" for k in ("tp", "pp", "dp", "cp", "ep") if getattr(lay, k) > 1]
        return "×".join(parts) or "dp1"

    if after is None:
        return sizes(before)
    extra = [f"{name} {getattr(before, key)} → {getattr(after, key)}"
             for key, name in (("zero", "ZeRO"), ("mbs", "micro-batch"), ("ac", "recompute"), ("etp", "etp"),
                               ("dp_shard", "dp_shard"), ("schedule", "schedule"), ("vpp", "virtual stages"))
             if getattr(before, key) != getattr(after, key)]
    return f"{sizes(before)} → {sizes(after)}" + "".join(f", {e}" for e in extra)


def _planner(cfg: Config, nodes: int, tasks_per_node: int, profile: ClusterProfile) -> Planner:
    return Planner.from_config(cfg, profile, nodes, gpus_per_node=tasks_per_node)


def _apply(cfg: Config, lay: Layout, nodes: int, tasks_per_node: int, keep: bool) -> Config:
    """``cfg`` on ``nodes`` × ``tasks_per_node`` ranks with ``lay`` (``keep``: only dp and
    dp_shard differ from the config). Raises ConfigError when the trainer refuses it."""
    launch = {"nodes": nodes, "tasks_per_node": tasks_per_node}
    if keep:
        return cfg.replace(parallel={"dp": lay.dp, "dp_shard": lay.dp_shard}, launch=launch)
    par = {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "ep": lay.ep, "etp": lay.etp,
           "zero_stage": lay.zero, "virtual_stages": lay.vpp, "pp_schedule": lay.schedule,
           "activation_checkpointing": lay.ac, "sequence_parallel": lay.sp, "dp_shard": lay.dp_shard}
    return cfg.replace(parallel=par, train={"micro_batch_size": lay.mbs}, launch=launch)


def replan(cfg: Config, nodes: int, tasks_per_node: int,
           profile: ClusterProfile | str | None = None) -> tuple[Config, Replan | None]:
    """``cfg`` re-planned for ``nodes`` × ``tasks_per_node`` ranks (or the first ``k`` nodes of
    them, ``Replan.nodes_after``, when ``nodes`` allows no layout: see the module docstring), and
    what changed (None when ``nodes`` is the configured count: ``cfg`` is returned as it is).

    Args:
        cfg: the run's resolved config (its layout is for ``launch.nodes`` nodes).
        nodes: nodes the attempt has; tasks_per_node: ranks on each.
        profile: the planner's cluster profile (default ``launch.profile``, else a generic one).

    Raises:
        ElasticError: ``nodes`` is below ``launch.elastic.min_nodes``, or no count from ``nodes``
            down to it has a layout that fits (the message says why for ``nodes``).
    """
    if nodes * tasks_per_node == cfg.world_size:
        return cfg, None
    el = cfg.launch.elastic
    lowest = el.min_nodes if el is not None else 1
    if nodes < lowest:
        raise ElasticError(f"the attempt has {nodes} node(s), fewer than launch.elastic.min_nodes = {lowest}")
    prof, _ = resolve_profile(cfg, profile, tasks_per_node)
    first: ElasticError | None = None
    for k in range(min(nodes, cfg.launch.nodes - 1), lowest - 1, -1):
        try:
            new, plan = _replan_exact(cfg, k, tasks_per_node, prof)
        except ElasticError as e:
            first = first or e
            continue
        return new, dataclasses.replace(plan, nodes_had=nodes)
    raise first if first is not None else ElasticError(f"no node count from {nodes} down to {lowest} has a layout")


def _replan_exact(cfg: Config, nodes: int, tasks_per_node: int, prof: ClusterProfile) -> tuple[Config, Replan]:
    """:func:`replan` on exactly ``nodes`` nodes."""
    world = nodes * tasks_per_node
    planner = _planner(cfg, nodes, tasks_per_node, prof)
    before = Layout.from_config(cfg)
    tp, pp, cp = before.tp, before.pp, before.cp
    candidates: list[tuple[str, Layout, bool]] = []
    if world % (tp * pp * cp) == 0:
        dp = world // (tp * pp * cp)
        shard = before.dp_shard if before.dp_shard is not None and (dp * cp) % before.dp_shard == 0 else None
        candidates.append(("tp, pp, ep kept", dataclasses.replace(before, dp=dp, dp_shard=shard), True))
    searches = [("tp, pp, cp, ep kept", {"tp": tp, "pp": pp, "cp": cp, "ep": before.ep, "etp": before.etp,
                                         "schedule": before.schedule, "sp": before.sp}),
                ("tp, pp, ep kept", {"tp": tp, "pp": pp, "ep": before.ep}),
                ("layout searched", {})]
    closest: Plan | None = None
    refused: list[str] = []

    def consider(how: str, plan: Plan, keep: bool) -> tuple[Config, Replan] | None:
        nonlocal closest
        if not plan.fits:
            if closest is None or plan.memory_gib < closest.memory_gib:
                closest = plan
            return None
        try:
            new = _apply(cfg, plan.layout, nodes, tasks_per_node, keep)
        except ConfigError as e:
            refused.append(f"{plan.layout.short()}: {e}")
            return None
        return new, _describe(cfg, plan, how, nodes, tasks_per_node, prof)

    for how, lay, keep in candidates:
        if planner.check(lay) is None:
            got = consider(how, planner.evaluate(lay), keep)
            if got:
                return got
    for how, fixed in searches:
        found = planner.search(fixed, top=0)
        for plan in found.ranked:
            if plan.layout.runs_in_moetrain:
                got = consider(how, plan, False)
                if got:
                    return got
        miss = found.smallest_miss
        if miss is not None and (closest is None or miss.memory_gib < closest.memory_gib):
            closest = miss
    if closest is not None:
        need = (f"the smallest candidate, {closest.layout.short()}, needs {closest.memory_gib:.1f} GiB per GPU, "
                f"{prof.name} has {planner.capacity:.1f}")
    elif refused:
        need = f"every fitting layout was refused by the config's rules, e.g. {refused[0]}"
    else:
        need = planner.why_empty({}).split(". Fix:")[0]
    raise ElasticError(f"no layout of the model fits on {nodes} node(s) × {tasks_per_node} ranks: {need}")


def _describe(cfg: Config, plan: Plan, how: str, nodes: int, tasks_per_node: int, prof: ClusterProfile) -> Replan:
    """What :func:`replan` chose (``plan`` is timed: both :meth:`Planner.evaluate` and
    :meth:`Planner.search` time what they return), with the planner's step time against the
    configured layout on the configured nodes."""
    before = Layout.from_config(cfg)
    ratio = None
    try:
        full = _planner(cfg, cfg.launch.nodes, cfg.launch.resolved_tasks_per_node(cfg.world_size), prof)
        before_s = full.evaluate(before).step_s
        ratio = plan.step_s / before_s if before_s > 0 else None
    except ValueError:  # the planner cannot time the configured layout (e.g. an uneven pp split)
        ratio = None
    gb = cfg.train.global_batch_size
    return Replan(cfg.launch.nodes, nodes, nodes, cfg.world_size, nodes * tasks_per_node, before, plan.layout,
                  cfg.grad_accum_steps, plan.layout.microbatches(gb), ratio, plan.memory_gib, plan.capacity_gib, how)


def node_counts_without_layout(cfg: Config, profile: ClusterProfile | str | None = None) -> dict[int, str]:
    """For each node count an elastic job may start with (``launch.elastic.min_nodes`` up to
    ``launch.nodes`` − 1), why :func:`replan` finds no layout there, not even on fewer of its
    nodes; empty when every count has one. Used by ``submit`` before anything starts."""
    el = cfg.launch.elastic
    if el is None:
        return {}
    tpn = cfg.launch.resolved_tasks_per_node(cfg.world_size)
    out = {}
    for n in range(el.min_nodes, cfg.launch.nodes):
        try:
            replan(cfg, n, tpn, profile)
        except ElasticError as e:
            out[n] = str(e)
    return out
