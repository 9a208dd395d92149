"""Inspect the rank map: which rank runs where, in which groups, over which network tier.

    python -m moetrain.ranks --config configs/mixtral-8x7b.yaml --nodes 64 [--profile h100-superpod]
        [--format table|json|svg|png] [--output FILE] [--rank R] [--all] [--set section.key=value ...]

``--nodes N`` fits the config to N nodes: ``launch.nodes`` becomes N and, unless
``parallel.dp`` is given with ``--set``, dp is re-derived so that pp·dp·cp·tp fills the nodes
(the global batch is rounded up to a multiple of micro-batch × dp when needed; a note says so).
``--nodelist "gpu[001-016]"`` with ``--topology topology.conf`` maps a real allocation.
The map is the one the trainer uses: both call ``moetrain.topology.build_rank_map``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


from moetrain.config import Config, ConfigError, config_from_dict, parse_override, read_layers
from moetrain.planner.layout import Layout
from moetrain.planner.memory import MemoryAssumptions
from moetrain.planner.model import ModelShape
from moetrain.planner.search import Planner
from moetrain.planner.timing import TimingAssumptions
from moetrain.planner.traffic import places_from_rank_map, step_collectives
from moetrain.topology.cluster import ClusterProfile, ProfileError, expand_nodelist, load_profile
from moetrain.topology.mapper import GROUP_AXES, RankMap, build_rank_map, resolve_profile

__all__ = ["main", "config_for_nodes", "rank_report"]


def config_for_nodes(path: str | Path | list, sets: list[str], n_nodes: int | None,
                     profile: ClusterProfile | None) -> tuple[Config, list[str]]:
    """Load ``path`` (one file, or several layered as for submit) with ``--set`` overrides and
    fit it to ``n_nodes`` nodes (see module doc).

    Raises:
        ConfigError: a file is bad, or the layout cannot fill ``n_nodes`` nodes.
    """
    raw = read_layers(path, sets).data
    notes: list[str] = []
    if n_nodes is None:
        return config_from_dict(raw), notes
    given = {parse_override(s)[0][:2] for s in sets}
    par = dict(raw.get("parallel") or {})
    if par.get("dp") == "auto":  # re-derived below from the nodes, as an unset dp is
        par["dp"], given = 1, given - {("parallel", "dp")}
    launch = dict(raw.get("launch") or {})
    train = dict(raw.get("train") or {})
    pp, cp, tp, dp = (int(par.get(k, 1)) for k in ("pp", "cp", "tp", "dp"))
    world_now = pp * dp * cp * tp
    nodes_now = int(launch.get("nodes", 1))
    tpn = launch.get("tasks_per_node")
    if tpn is None:
        if profile is not None and (launch.get("cluster") == "slurm" or n_nodes > 1):
            tpn = profile.gpus_per_node
        else:
            tpn = world_now // nodes_now if world_now % nodes_now == 0 else world_now
    world = n_nodes * int(tpn)
    if world != world_now:
        if ("parallel", "dp") in given:
            raise ConfigError(f"--nodes {n_nodes}: {n_nodes} × {tpn} = {world} ranks, but --set parallel.dp={dp} gives "
                              f"pp·dp·cp·tp = {world_now}. Fix: drop --set parallel.dp or change --nodes")
        if world % (pp * cp * tp):
            raise ConfigError(f"--nodes {n_nodes}: {world} ranks are not a multiple of pp·cp·tp = {pp * cp * tp}. "
                              f"Fix: use a node count N with N × {tpn} divisible by {pp * cp * tp}")
        dp = world // (pp * cp * tp)
        notes.append(f"dp set to {dp} so that pp·dp·cp·tp = {world} fills {n_nodes} nodes × {tpn}")
        par["dp"] = dp
    mbs = int(train.get("micro_batch_size", 2))
    gbs = int(train.get("global_batch_size", 16))
    q = mbs * dp
    need = q * (pp if pp > 1 and par.get("pp_schedule", "1f1b") != "gpipe" else 1)
    if gbs % q or gbs < need:
        new = max(need, -(-gbs // q) * q)
        if ("train", "global_batch_size") not in given:
            notes.append(f"train.global_batch_size {gbs} → {new} (a multiple of micro_batch_size × dp = {q}"
                         + (", at least pp micro-batches" if new == need and need > q else "") + ")")
            train["global_batch_size"] = new
    launch["nodes"] = n_nodes
    if n_nodes > 1:
        launch["cluster"] = "slurm"
    launch["tasks_per_node"] = None if ("launch", "tasks_per_node") not in given else launch.get("tasks_per_node")
    if launch.get("cluster") == "slurm" and int(launch.get("gpus_per_node", 0) or 0) < int(tpn) and \
            profile is not None and profile.gpus_per_node >= int(tpn):
        launch["gpus_per_node"] = int(tpn)
    raw = dict(raw, parallel=par, launch=launch, train=train)
    return config_from_dict(raw), notes


def _traffic(cfg: Config, rm: RankMap) -> list[dict[str, Any]]:
    shape = ModelShape.from_config(cfg)
    lay = Layout.from_config(cfg)
    mem = MemoryAssumptions.for_train(cfg.train)
    vols = step_collectives(shape, lay, cfg.train.global_batch_size, places_from_rank_map(rm), rm.profile,
                            grad_bytes=mem.grad_bytes, param_bytes=mem.param_bytes)
    return [v.to_dict() for v in vols]


def _ep_overlap(cfg: Config, rm: RankMap) -> dict[str, Any] | None:
    """The planner's step for this layout and rank map without ``parallel.ep_overlap``, with it,
    and with it and ``parallel.delay_wgrad_compute`` (seconds: step, EP all-to-all exposed,
    hidden); None without expert parallelism."""
    shape = ModelShape.from_config(cfg)
    if not shape.is_moe or cfg.parallel.ep == 1:
        return None
    lay = Layout.from_config(cfg)
    out: dict[str, Any] = {"enabled": cfg.parallel.ep_overlap, "delay_wgrad": cfg.parallel.delay_wgrad_compute}
    for key, mode, delay in (("without", "none", False), ("with", "merged_pairs", False),
                             ("with_delay_wgrad", "merged_pairs", True)):
        planner = Planner(shape, rm.profile, len(rm.allocation), cfg.train.global_batch_size, rm.allocation,
                          gpus_per_node=rm.tasks_per_node, mem=MemoryAssumptions.for_train(cfg.train),
                          timing=TimingAssumptions(ep_overlap=mode, delay_wgrad=delay,
                                                   ep_overlap_split=cfg.parallel.ep_overlap_split))
        try:
            t = planner.evaluate(lay).time
        except ValueError as e:  # e.g. ZeRO-3 or pp_schedule gpipe: not with the overlap
            out[key] = {"error": str(e)}
            continue
        assert t is not None
        out[key] = {"step_s": t.step, "ep_exposed_s": t.breakdown.get("ep_comm", 0.0), "ep_hidden_s": t.ep_hidden}
    return out


def rank_report(cfg: Config, rm: RankMap, notes: list[str]) -> dict[str, Any]:
    """Everything the tool shows, JSON-ready."""
    d = rm.to_dict(groups=True)
    d["config"] = {"run": cfg.run.name, "parallel": {k: getattr(cfg.parallel, k)
                                                    for k in ("pp", "dp", "cp", "tp", "ep", "ep_overlap")}}
    d["traffic"] = _traffic(cfg, rm)
    d["ep_overlap"] = _ep_overlap(cfg, rm)
    d["placement_summary"] = rm.placement_summary()
    d["notes"] = notes + d["notes"]
    return d


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _fmt_s(t: float) -> str:
    return f"{t:.3f} s" if t >= 1 else (f"{t * 1e3:.2f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} µs")


def _table(cfg: Config, rm: RankMap, report: dict[str, Any], show_all: bool, config_path: str) -> str:
    s = rm.sizes
    lines = [f"moetrain rank map — {config_path} on {len(rm.allocation)} node(s), profile {rm.profile.name}",
             f"layout pp={s['pp']} dp={s['dp']} cp={s['cp']} tp={s['tp']} ep={s['ep']} (edp={s['edp']}); "
             f"{rm.world} ranks, {rm.tasks_per_node} per node; digest {rm.digest}",
             f"allocation: {rm.allocation.summary()}",
             f"placement: {rm.placement}", ""]
    for n in report["notes"]:
        lines.append(f"note: {n}")
    if report["notes"]:
        lines.append("")
    lines.append("rules")
    for r in rm.rules:
        lines.append(f"  {r.status:7s} {r.name:17s} {r.text}")
        if r.detail:
            lines.append(f"  {'':7s} {'':17s}   {r.detail}")
    lines += ["", "ranks"]
    lines.append(f"  {'rank':>6} {'node':>5} {'node_name':<14} {'gpu':>3} {'pp':>4} {'dp':>5} {'cp':>3} {'tp':>3} {'ep':>4} {'edp':>4}")
    limit = rm.world if show_all or rm.world <= 256 else 64
    for row in report["ranks"][:limit]:
        lines.append(f"  {row['rank']:>6} {row['node']:>5} {row['node_name']:<14} {row['local_rank']:>3} {row['pp']:>4} "
                     f"{row['dp']:>5} {row['cp']:>3} {row['tp']:>3} {row['ep']:>4} {row['edp']:>4}")
    if limit < rm.world:
        lines.append(f"  ... {rm.world - limit} more ranks (--all, --format json, or --rank R)")
    lines += ["", "groups (axis: groups × size, tiers their traffic crosses)"]
    for axis in GROUP_AXES:
        arr = rm.group_array(axis)
        tiers = ", ".join(f"{k} {v}" for k, v in rm.tier_counts(axis).items())
        lines.append(f"  {axis:7s} {arr.shape[0]} × {arr.shape[1]}: {tiers}")
        if arr.shape[1] == 1:
            continue
        glimit = arr.shape[0] if show_all else min(arr.shape[0], 4)
        tl = rm.tiers(axis)
        for i in range(glimit):
            members = arr[i].tolist()
            txt = ", ".join(str(m) for m in members[:16]) + (", ..." if len(members) > 16 else "")
            lines.append(f"      [{txt}] {tl[i]}")
        if glimit < arr.shape[0]:
            lines.append(f"      ... {arr.shape[0] - glimit} more")
    lines += ["", "traffic per GPU per optimizer step (busiest stage; tier = slowest link of the worst group)"]
    lines.append(f"  {'axis':7s} {'collective':15s} {'calls':>8} {'per call':>10} {'nvlink':>10} {'network':>10} {'tier':>6} "
                 f"{'time':>9}  what")
    for t in report["traffic"]:
        b = t["bytes_per_step"]
        net_tier = next((k for k in b if k != "nvlink"), "-")
        lines.append(f"  {t['axis']:7s} {t['op']:15s} {t['calls_per_step']:>8.0f} {_fmt_bytes(t['bytes_per_call']):>10} "
                     f"{_fmt_bytes(b.get('nvlink', 0.0)):>10} {_fmt_bytes(b.get(net_tier, 0.0)) if net_tier != '-' else '-':>10} "
                     f"{net_tier:>6} {_fmt_s(t['seconds_per_step']):>9}  {t['what']}")
    if not report["traffic"]:
        lines.append("  (none: one rank per group on every axis)")
    ov = report.get("ep_overlap")
    if ov:
        lines += ["", f"EP all-to-all overlap (parallel.ep_overlap: {'on' if ov['enabled'] else 'off'}, "
                      f"delay_wgrad_compute: {'on' if ov.get('delay_wgrad') else 'off'}; "
                      "the planner's step for this layout, moetrain.plan explains it)"]
        for key in ("without", "with", "with_delay_wgrad"):
            r = ov[key]
            label = {"with_delay_wgrad": "with + delay_wgrad"}.get(key, key)
            lines.append(f"  {label:18s} " + (f"not available: {r['error']}" if "error" in r else
                                           f"{_fmt_s(r['step_s'])}/step, EP exposed {_fmt_s(r['ep_exposed_s'])}, "
                                           f"hidden {_fmt_s(r['ep_hidden_s'])}"))
    return "\n".join(lines)


def _explain_rank(rm: RankMap, rank: int) -> str:
    c = rm.coords(rank)
    nodes = rm.allocation.nodes
    lines = [f"rank {rank}: node {c['node']} ({c['node_name']}, NVSwitch domain {nodes[c['node']].domain}, "
             f"rail group {nodes[c['node']].rail_group}), GPU {c['local_rank']}",
             "coordinates: " + ", ".join(f"{a}={c[a]}" for a in ("pp", "dp", "cp", "tp", "ep", "edp")), ""]
    for axis in GROUP_AXES:
        members = rm.group_of(rank, axis)
        if len(members) == 1:
            lines.append(f"{axis:7s} alone")
            continue
        tier = rm.tiers(axis)[rm.group_index(rank, axis)]
        peers = ", ".join(f"{m}@{nodes[m // rm.tasks_per_node].name}:{m % rm.tasks_per_node}"
                          for m in members[:12]) + (", ..." if len(members) > 12 else "")
        lines.append(f"{axis:7s} {len(members)} ranks over {tier}: {peers}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moetrain.ranks", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, action="append", help="run config (YAML); repeat to layer files")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--nodes", type=int, help="number of nodes (contiguous, as a topology-aware scheduler gives)")
    where.add_argument("--nodelist", help="SLURM host list of the allocation, e.g. 'gpu[001-016]'")
    ap.add_argument("--topology", help="topology.conf or saved `scontrol show topology` output for --nodelist")
    ap.add_argument("--profile", help="cluster profile name or YAML path (default: launch.profile)")
    ap.add_argument("--format", choices=("table", "json", "svg", "png"), default="table")
    ap.add_argument("--output", "-o", help="write to this file instead of stdout (svg/png default: ranks.svg/ranks.png)")
    ap.add_argument("--rank", type=int, help="explain one rank: coordinates, groups and peers")
    ap.add_argument("--all", action="store_true", help="table: list every rank and group")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value (repeatable), as for submit")
    args = ap.parse_args(argv)
    try:
        prof = load_profile(args.profile) if args.profile else None
        names = expand_nodelist(args.nodelist) if args.nodelist else None
        n_nodes = args.nodes if args.nodes is not None else (len(names) if names else None)
        if prof is None:
            prof_name = (read_layers(args.config, args.sets).data.get("launch") or {}).get("profile")
            prof = load_profile(prof_name) if prof_name else None
        cfg, notes = config_for_nodes(args.config, args.sets, n_nodes, prof)
        if prof is None:
            prof, more = resolve_profile(cfg, None, cfg.launch.resolved_tasks_per_node(cfg.world_size))
            notes += more
        rm = build_rank_map(cfg, nodes=names if names is not None else cfg.launch.nodes, profile=prof,
                            topology=args.topology)
    except (ConfigError, ProfileError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.rank is not None:
        if not 0 <= args.rank < rm.world:
            print(f"error: --rank {args.rank}: outside 0..{rm.world - 1}", file=sys.stderr)
            return 2
        text = _explain_rank(rm, args.rank)
        print(text)
        return 0
    if args.format in ("svg", "png"):
        from moetrain.topology.svg import render_svg

        names = " + ".join(Path(c).name for c in args.config)
        svg = render_svg(rm, title=f"{names} on {len(rm.allocation)} nodes")
        out = Path(args.output or f"ranks.{args.format}")
        if args.format == "svg":
            out.write_text(svg)
        else:
            try:
                import cairosvg  # type: ignore[import-not-found]
            except ImportError:
                print("error: --format png needs cairosvg (pip install cairosvg); --format svg needs nothing",
                      file=sys.stderr)
                return 2
            cairosvg.svg2png(bytestring=svg.encode(), write_to=str(out))
        print(f"wrote {out}")
        return 0
    report = rank_report(cfg, rm, notes)
    text = json.dumps(report, indent=1) if args.format == "json" else \
        _table(cfg, rm, report, args.all, " + ".join(args.config))
    if args.output:
        Path(args.output).write_text(text + "\n")
        print(f"wrote {args.output}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
