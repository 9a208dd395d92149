"""Rank parallel layouts for a model on a cluster by predicted speed, within memory.

    python -m moetrain.plan --config configs/mixtral-8x7b.yaml --nodes 64 [--profile h100-superpod]
        [--top K] [--format table|json] [--layout tp=8,pp=4,...] [--set section.key=value ...]
    python -m moetrain.plan --published [--format table|json]

The model, global batch and sequence length come from the config (a null ``model.vocab_size``
from the data's manifest where the data is readable here, as the run will take it; otherwise an
assumed vocabulary, which the output names); the layout (tp, pp, virtual
stages, dp, cp, ep, ZeRO stage, micro-batch, activation checkpointing, schedule) is searched.
``--layout`` fixes some or all of those keys (``tp, pp, dp, cp, ep, etp, vpp, zero, mbs, ac,
schedule, sp``); with all of them it evaluates that one layout, fitting or not.
``--expert-loads FILE`` (a run's ``metrics.jsonl``, or a JSON list of tokens per expert) takes
the busiest expert-parallel rank's share of the tokens from measured loads at each ep (each
step's, averaged over the steps: a step waits for its own busiest rank), instead of the assumed
imbalance; ``--redundant-experts N`` shows what N spare slots placed by EPLB
(:mod:`moetrain.topology.eplb`) make of it.
``--published`` prints the comparison with published training results, dense and MoE: run,
hardware, GPUs, precision, metric, published value, prediction, error, layout, and the median /
max |error| of the held rows (docs/topology.md §5).
Every number is a prediction from stated physical assumptions (moetrain/planner/*.py,
slurm/profiles/*.yaml), not a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moetrain.config import ConfigError, load_config
from moetrain.data.sources import vocab_for_planning
from moetrain.planner.layout import LayoutError, parse_layout_spec
from moetrain.planner.search import Planner, explain
from moetrain.topology.cluster import ProfileError, expand_nodelist, load_profile
from moetrain.topology.mapper import resolve_allocation

__all__ = ["main"]


def _published(fmt: str) -> int:
    from moetrain.planner.published import (
        APART_REVEALED,
        MEDIAN_GOAL,
        TOLERANCE,
        compare_all,
        compare_unseen,
        split_summary,
        summary,
    )

    rows = compare_all()
    stats = summary(rows)
    unseen = compare_unseen()
    split_stats = split_summary(unseen)
    if fmt == "json":
        print(json.dumps({"median_goal": MEDIAN_GOAL, "max_goal": TOLERANCE, "summary": stats, "results": rows,
                          "unseen": split_stats | {"apart_revealed_at": APART_REVEALED, "results": unseen}},
                         indent=1))
        return 0
    print(f"{'run':28s} {'hardware':12s} {'GPUs':>5} {'prec':5s} {'metric':17s} {'published':>9} {'predicted':>9} "
          f"{'error':>7}  layout (planner's choice within the published one)")
    notes: list[str] = []
    for r in rows:
        err = "n/a" if r["error"] is None else f"{r['error']:+.1%}"
        tag = " (calibration)" if r["calibration"] else ""
        if not r["held"]:
            if r["note"] not in notes:
                notes.append(r["note"])
            tag += f" (not held, note {notes.index(r['note']) + 1})"
        if r.get("fits") is False:
            tag += f" (as published; the planner's memory model: {r['memory_gib']:.0f} > {r['capacity_gib']:.0f} GiB)"
        pred = "-" if r["predicted"] is None else f"{r['predicted']:.1f}"
        print(f"{r['key']:28s} {r['hardware']:12s} {r['gpus']:>5} {r['precision']:5s} {r['metric']:17s} "
              f"{r['published']:>9g} {pred:>9} {err:>7}  {r['layout']}{tag}")
    for i, note in enumerate(notes):
        print(f"note {i + 1}: {note}")
    print(f"\n|error| (goal for the held rows: median <= {MEDIAN_GOAL:.0%}, max <= {TOLERANCE:.0%}; "
          f"held-out: no constant set from them; every row: held or not):")
    for name, st in stats.items():
        print(f"  {name:15s} {st['rows']:>3} rows: median {st['median']:.1%}, mean {st['mean']:.1%}, "
              f"max {st['max']:.1%}")
    print("\nRuns collected after the terms were set (docs/topology.md §5): the development rows (dev), whose "
          "errors were in view while terms changed, and a third of the families set apart (apart), first "
          f"predicted with the final terms of commit {APART_REVEALED}:")
    for r in unseen:
        err = "n/a" if r["error"] is None else f"{r['error']:+.1%}"
        pred = "-" if r["predicted"] is None else f"{r['predicted']:.1f}"
        print(f"{r['split']:5s} {r['key']:36s} {r['hardware']:12s} {r['gpus']:>5} {r['precision']:5s} "
              f"{r['published']:>9.1f} {pred:>9} {err:>7}  {r['layout']}")
    for split, name in (("dev", "development"), ("apart", "set apart")):
        if split in split_stats:
            st = split_stats[split]
            print(f"  {name:15s} {st['rows']:>3} rows: median {st['median']:.1%}, mean {st['mean']:.1%}, "
                  f"max {st['max']:.1%}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moetrain.plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", help="run config (YAML): model, global batch, sequence length; "
                    "repeat to layer files")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--nodes", type=int, help="number of nodes")
    where.add_argument("--nodelist", help="SLURM host list of the allocation (with --topology)")
    ap.add_argument("--topology", help="topology.conf or saved `scontrol show topology` output")
    ap.add_argument("--profile", help="cluster profile name or YAML path (default: launch.profile)")
    ap.add_argument("--top", type=int, default=5, help="layouts to show (default 5)")
    ap.add_argument("--format", choices=("table", "json"), default="table")
    ap.add_argument("--layout", help="fix layout keys, e.g. tp=8,pp=4,zero=1,ac=full")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value (repeatable), as for submit")
    ap.add_argument("--published", action="store_true", help="compare with published training results")
    ap.add_argument("--expert-loads", metavar="FILE",
                    help="measured tokens per expert: a run's metrics.jsonl (each step's expert_load, per MoE "
                         "layer) or a JSON list (one layer) or list of lists; the busiest expert-parallel rank's "
                         "share of each step, averaged over the steps, then comes from them at each ep instead of "
                         "the assumed 1.1")
    ap.add_argument("--redundant-experts", type=int, default=None, metavar="N",
                    help="with --expert-loads: N spare expert slots placed by EPLB, its effect on the busiest rank "
                         "(default: the config's moe.eplb.redundant_experts when moe.eplb is on, else 0)")
    args = ap.parse_args(argv)
    if args.published:
        return _published(args.format)
    if not args.config:
        ap.error("--config is required (or --published)")
    try:
        cfg, vocab_unknown = vocab_for_planning(load_config(args.config, args.sets))
        prof_name = args.profile or cfg.launch.profile
        if prof_name is None:
            raise ProfileError("no cluster profile: pass --profile (e.g. h100-superpod) or set launch.profile")
        prof = load_profile(prof_name)
        names = expand_nodelist(args.nodelist) if args.nodelist else None
        n_nodes = args.nodes if args.nodes is not None else (len(names) if names else cfg.launch.nodes)
        alloc = resolve_allocation(names if names is not None else n_nodes, cfg, prof, args.topology)
        fixed: dict[str, Any] = parse_layout_spec(args.layout) if args.layout else {}
        planner = Planner.from_config(cfg, prof, n_nodes, allocation=alloc)
        if args.expert_loads:
            planner.expert_load_steps = read_expert_load_steps(Path(args.expert_loads))
            planner.expert_loads = mean_loads(planner.expert_load_steps)
            planner.redundant_experts = (args.redundant_experts if args.redundant_experts is not None
                                         else planner.shape.redundant_experts)
            if len(planner.expert_loads[0]) != planner.shape.num_experts:
                raise ValueError(f"--expert-loads {args.expert_loads}: {len(planner.expert_loads[0])} experts, the "
                                 f"model has moe.num_experts = {planner.shape.num_experts}")
    except (ConfigError, ProfileError, LayoutError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    full_keys = {"tp", "pp", "dp", "cp", "ep", "vpp", "zero", "mbs", "ac"}
    single = full_keys <= set(fixed) or (full_keys - {"ep"} <= set(fixed) and not planner.shape.is_moe)
    if single:
        from moetrain.planner.layout import Layout

        lay = Layout(**{k: fixed[k] for k in full_keys if k in fixed},
                     schedule=fixed.get("schedule", "interleaved_1f1b" if fixed.get("vpp", 1) > 1 else "1f1b"),
                     sp=fixed.get("sp", fixed["tp"] > 1), etp=fixed.get("etp", 1))
        try:
            plans = [planner.evaluate(lay)]
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        result = None
    else:
        result = planner.search(fixed, top=args.top)
        plans = result.ranked
    header = {"config": " + ".join(args.config), "profile": prof.name, "nodes": planner.n_nodes, "gpus": planner.world,
              "allocation": planner.allocation.summary(), "model_params": planner.shape.total_params,
              "active_params": planner.shape.active_params, "global_batch": planner.global_batch,
              "seq_len": planner.shape.seq_len, "capacity_gib": planner.capacity,
              "enumerated": result.enumerated if result else 1, "fitting": result.fitting if result else None}
    if planner.shape.vocab_assumed:
        header["note"] = f"{vocab_unknown}: assumed {planner.shape.vocab}"
    if args.format == "json":
        out = dict(header, layouts=[p.to_dict() for p in plans])
        if result and not plans:
            out["reason"] = result.empty_reason or (
                f"nothing fits; closest: {result.smallest_miss.layout.short()} at "
                f"{result.smallest_miss.memory_gib:.1f} GiB" if result.smallest_miss else "no layout")
        print(json.dumps(out, indent=1, default=float))
        return 0 if plans else 1
    print(f"moetrain plan — {' + '.join(args.config)}: {planner.shape.total_params / 1e9:.1f}B parameters "
          f"({planner.shape.active_params / 1e9:.1f}B active), batch {planner.global_batch} × {planner.shape.seq_len} "
          f"tokens, on {planner.n_nodes} nodes × {planner.gpn} ({prof.name}: {prof.peak_tflops:g} TFLOP/s peak, "
          f"{planner.capacity:.1f} GiB usable)")
    print(f"allocation: {planner.allocation.summary()}")
    if "note" in header:
        print(f"note: {header['note']}")
    if result is not None:
        print(f"{result.enumerated} layouts evaluated for memory, {result.fitting} fit")
        if not plans:
            if result.empty_reason:
                print(f"no layout: {result.empty_reason}")
            elif result.smallest_miss:
                sm = result.smallest_miss
                print(f"nothing fits: the closest is {sm.layout.short()} at {sm.memory_gib:.1f} GiB "
                      f"(weights+grads+optimizer {sum(v for k, v in sm.memory.gib().items() if k in ('params', 'grads', 'optimizer')):.1f}, "
                      f"activations {sm.memory.gib()['activations']:.1f}); add nodes or raise ZeRO / recomputation")
            return 1
    print()
    if plans:
        print(f"{'#':>2} {'layout':52s} {'GiB':>6} {'s/step':>8} {'TFLOP/s':>8} {'MFU':>6} {'tokens/s':>12}")
        for i, p in enumerate(plans):
            fit = "" if p.fits else " (does not fit)"
            print(f"{i + 1:>2} {p.layout.short():52s} {p.memory_gib:>6.1f} {p.step_s:>8.3f} {p.tflops_per_gpu:>8.0f} "
                  f"{p.mfu:>6.1%} {p.tokens_per_s:>12,.0f}{fit}")
        print()
        for i, p in enumerate(plans[:3]):
            for line in explain(p, i + 1, plans[i + 1] if i + 1 < len(plans) else None):
                print(line)
        best = plans[0]
        try:
            print("\nto use #1: --set " + " --set ".join(best.layout.overrides()))
        except ValueError as e:  # a published run's layout (Layout.runs_in_moetrain)
            print(f"\n#1 is not a layout moetrain's trainer runs: {e}")
    return 0


def read_expert_load_steps(path: Path) -> list[list[list[float]]]:
    """Tokens per expert per MoE layer of each record ([records][layers][E]) from ``path``: a
    run's ``metrics.jsonl`` (one record per step that logged ``expert_load``, every layer in
    each) or a JSON list (one layer) or list of lists (one record).

    Raises:
        ValueError: no loads in the file, layers of different expert counts, or a record
            without some layer.
    """
    text = path.read_text()
    if path.suffix == ".jsonl":
        records = []
        for line in text.splitlines():
            rec = json.loads(line) if line.strip() else {}
            if rec.get("expert_load"):
                records.append({k: v["tokens"] for k, v in rec["expert_load"].items()})
        layers = sorted({k for r in records for k in r}, key=lambda k: (len(k), k))
        if any(set(r) != set(layers) for r in records):
            raise ValueError(f"{path}: some records' expert_load lack some of the layers {layers}")
        steps = [[r[k] for k in layers] for r in records]
    else:
        data = json.loads(text)
        steps = [[data] if data and not isinstance(data[0], list) else data]
    if not steps or not steps[0] or not steps[0][0]:
        raise ValueError(f"{path}: no expert loads (a metrics.jsonl with expert_load, or a JSON list)")
    if len({len(row) for rec in steps for row in rec}) != 1:
        raise ValueError(f"{path}: the layers have different numbers of experts")
    return [[[float(x) for x in row] for row in rec] for rec in steps]


def mean_loads(steps: list[list[list[float]]]) -> list[list[float]]:
    """Tokens per expert per MoE layer ([layers][E]): the mean over the records of ``steps``
    ([records][layers][E], :func:`read_expert_load_steps`)."""
    return [[sum(col) / len(steps) for col in zip(*layer)] for layer in zip(*steps)]


def read_expert_loads(path: Path) -> list[list[float]]:
    """Tokens per expert per MoE layer ([layers][E]) from ``path``: the mean over the records
    of :func:`read_expert_load_steps`.

    Raises:
        ValueError: as :func:`read_expert_load_steps`.
    """
    return mean_loads(read_expert_load_steps(path))


if __name__ == "__main__":
    sys.exit(main())
