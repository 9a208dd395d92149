"""The expert all-to-all across an emulated inter-node network, with and without
``parallel.ep_overlap``, beside the planner's prediction of every step. Prints JSON.

Needs the SLURM dev cluster up with its emulated network (as root)::

    sudo slurm/dev-cluster up --inter-node-mbps 300   # the README's figures (also measured at 200)
    python benchmarks/bench_emulated_network.py [--steps 10] [--micro-batches 8] [--ranks 2]

Every layout trains the same MoE (4 MoE blocks, hidden 256, 8 experts top-2, no shared expert,
byte-level data) with ``python -m moetrain.submit`` on the dev cluster, dp = ep = ``--ranks``:
4 (2 nodes × 2 tasks, the default) or 2 (2 nodes × 1 task). This machine has 2 cores: with 4
ranks two processes share each core, so the ranks' compute pieces contend and the ranks reach
each all-to-all tens of milliseconds apart (docs/performance.md §5), which no GPU cluster does;
with 2 each rank has a core of its own, as a rank has its GPU.

* ``one-node``: the ranks on one node (its loopback: the all-to-all costs little), the
  compute reference; the same 2 cores run the same processes in every layout;
* ``flat`` / ``flat+overlap``: 2 nodes, the flat all-to-all dispatcher, ep across the
  nodes' shaped links, without and with ``parallel.ep_overlap``;
* ``hierarchical`` / ``hierarchical+overlap``: the same with ``moe.token_dispatcher:
  hierarchical`` (a token crosses the link once per remote node its experts are on);
* ``…+overlap+delay_wgrad``: the overlap with ``parallel.delay_wgrad_compute`` (the backward's
  weight gradients computed while its all-to-alls travel); ``over_overlap_alone`` compares it
  with the overlap without it;
* ``flat+overlap+split`` / ``flat+overlap+whole``: the overlap with ``parallel.ep_overlap_split``
  ``always`` (each micro-batch as two halves) or ``never`` (``flat+overlap`` takes ``auto``: halves with
  2 micro-batches per rank or fewer).

Each figure is the median ``step_time_s`` of ``metrics.jsonl`` over the steps after the first
two. ``hidden_fraction`` of an overlapped layout = (off − on) / (off − one-node): the share of
the network's cost that the overlap removed; ``hidden_share`` = (off − on) / min(one-node,
off − one-node): the share of what can be hidden at all (a transfer longer than the compute
beside it cannot hide whole), with the planner's ``predicted_hidden_share`` beside it. With 2
micro-batches per rank (``--micro-batches 2``) the overlapped layouts split each micro-batch in
two halves (``parallel.ep_overlap_split: auto``; ``split_micro_batches``). With ``--config``,
``--micro-batches N`` sets the global batch to micro-batch size × ranks × N (default: the config's).

The planner (``moetrain.planner``) predicts each layout with the profile ``up`` wrote for the
link rate (whose per-rank bandwidth is the node link over the profile's ranks per node: with one
rank per node that rank has the whole link), after two fits in this run, each on one layout:

1. compute: one factor scales the profile's peak FLOP/s and memory bandwidth until the planner's
   one-node step equals the measured one;
2. the overlap: ``ep_overlap_efficiency``, the share of the ideal hiding of the planner's
   ``merged_pairs`` pieces (:func:`moetrain.planner.timing.merged_pair_hidden`), is solved so
   that the planner's step of ``--fit-overlap`` (``flat+overlap``) equals the measured one.

The other layouts are predictions: what the network adds without the overlap (``flat``,
``hierarchical``), and the overlap with the other dispatcher.

``--calibrate`` first runs ``python -m moetrain.calibrate`` on the cluster with the ``flat``
layout's config (back to back with the training runs) and adds, for every layout, the step the
planner predicts from that calibrated profile alone — nothing fitted on any layout's steps
(``calibrated_predicted_step_s``, ``calibrated_error``) — and the node link rate the calibration
recovered from its inter-node all-reduce (``calibrated_link_mbit_s``; the ranks of a node share
its link). ``predicted_with_profile_efficiency_s``
uses the profile's own ``ep_overlap_efficiency`` instead (the committed, earlier measurement).
One software fact of this machine is given to the planner, not fitted: FSDP2's gradient
all-reduce does not overlap the backward here (gloo's collectives run inside its hooks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import ByteTokenizer, _documents, tiny_config  # noqa: E402
from moetrain.config import overlap_split, to_dict  # noqa: E402
from moetrain.data.writer import write_shards  # noqa: E402
from moetrain.planner.layout import Layout  # noqa: E402
from moetrain.planner.memory import MemoryAssumptions  # noqa: E402
from moetrain.planner.model import ModelShape  # noqa: E402
from moetrain.planner.search import Planner  # noqa: E402
from moetrain.planner.timing import TimingAssumptions  # noqa: E402
from moetrain.topology.cluster import ClusterProfile, load_profile  # noqa: E402

SCRIPT = ROOT / "slurm" / "dev-cluster"
MODEL = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "ffn_hidden": 688, "vocab_size": 384,
         "seq_len": 256}
MOE = {"num_experts": 8, "top_k": 2, "every": 1, "ffn_hidden": 256, "shared_experts": 0}
OVERLAP = {"ep_overlap": True}
DELAY_WGRAD = {"ep_overlap": True, "delay_wgrad_compute": True}
HIER = {"token_dispatcher": "hierarchical"}
LAYOUTS = {  # name: (nodes, moe overrides, parallel overrides)
    "one-node": (1, {}, {}),
    "flat": (2, {}, {}),
    "flat+overlap": (2, {}, OVERLAP),
    "flat+overlap+delay_wgrad": (2, {}, DELAY_WGRAD),
    # ep_overlap_split forced: halves of every micro-batch (always), or whole ones (never)
    "flat+overlap+split": (2, {}, {**OVERLAP, "ep_overlap_split": "always"}),
    "flat+overlap+whole": (2, {}, {**OVERLAP, "ep_overlap_split": "never"}),
    "hierarchical": (2, HIER, {}),
    "hierarchical+overlap": (2, HIER, OVERLAP),
    "hierarchical+overlap+delay_wgrad": (2, HIER, DELAY_WGRAD),
    # ZeRO-3's per-micro-batch all-gathers and reduce-scatters across the nodes, or (HSDP, shard
    # groups of 2 = one node's ranks) inside each node with one all-reduce of the shards across
    "one-node+zero3": (1, {}, {"zero_stage": 3}),
    "flat+zero3": (2, {}, {"zero_stage": 3}),
    "flat+zero3+hsdp2": (2, {}, {"zero_stage": 3, "dp_shard": 2}),
}


def emulated_rate() -> tuple[float, Path]:
    """The dev cluster's link rate (Mbit/s) and the profile ``up`` wrote for it.

    Raises:
        SystemExit: the cluster is not up with an emulated network (says the command to run).
    """
    out = subprocess.run([str(SCRIPT), "status"], capture_output=True, text=True).stdout
    m = re.search(r"^network: emulated, each node link (\S+) Mbit/s", out, re.M)
    state = Path(os.environ.get("MOETRAIN_SLURM_DIR", "/var/tmp/moetrain-slurm"))
    if not m:
        raise SystemExit("the SLURM dev cluster is not up with an emulated network: run "
                         "`sudo slurm/dev-cluster down && sudo slurm/dev-cluster up --inter-node-mbps 300` "
                         f"(status said:\n{out})")
    return float(m.group(1)), state / "profiles" / "dev-emulated.yaml"


def layout_config(name: str, data: Path, run_dir: Path, steps: int, micro_batches: int | None, profile: Path,
                  config: str | None = None, ranks: int = 4):
    """The config of layout ``name`` at dp = ep = ``ranks`` (4: 2 per node, 2: one per node)."""
    nodes, moe, parallel = LAYOUTS[name]
    if config is not None:  # a user's config (its model, data and batch) at dp = ep = ranks here
        from moetrain.config import load_config
        from moetrain.launch.preflight import resolve_vocab

        base = load_config(ROOT / config)
        over = [f"moe.{k}={v}" for k, v in moe.items()] + [f"parallel.{k}={str(v).lower()}" for k, v in parallel.items()]
        if micro_batches is not None:  # the global batch that gives each rank that many micro-batches
            over.append(f"train.global_batch_size={base.train.micro_batch_size * ranks * micro_batches}")
        return resolve_vocab(load_config(ROOT / config, [
            f"parallel.dp={ranks}", f"parallel.ep={ranks}", f"train.steps={steps}", "train.val_every=0",
            "checkpoint.every=0", "checkpoint.resume=false", f"run.dir={run_dir}", f"run.name=bench-net-{name}",
            "data.verify=size", f"data.path={(ROOT / base.data.path).resolve()}", "launch.cluster=slurm",
            f"launch.nodes={nodes}", f"launch.tasks_per_node={ranks // nodes}", "launch.cpus_per_task=1",
            f"launch.profile={profile}", "launch.max_restarts=0", "launch.time_min=30", "train.log_every=1", *over]))
    return tiny_config(data, run_dir, run={"name": f"bench-net-{name}"}, model=MODEL,
                       moe={**MOE, **moe}, parallel={"dp": ranks, "ep": ranks, **parallel},
                       train={"steps": steps, "micro_batch_size": 2, "global_batch_size": 2 * ranks * micro_batches,
                              "grad_clip": 1.0, "log_every": 1},
                       data={"verify": "size"},
                       launch={"cluster": "slurm", "nodes": nodes, "tasks_per_node": ranks // nodes, "time_min": 30,
                               "cpus_per_task": 1, "profile": str(profile), "max_restarts": 0})


def run_layout(cfg, workdir: Path) -> list[float]:
    """Train ``cfg`` on the dev cluster; its step times (seconds), in order."""
    path = workdir / f"{cfg.run.name}.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               MOETRAIN_HOME=str(workdir / "home"))
    res = subprocess.run([sys.executable, "-m", "moetrain.submit", "--config", str(path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"{cfg.run.name}: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows if "step_time_s" in r]


def run_calibrate(cfg, workdir: Path) -> ClusterProfile:
    """``python -m moetrain.calibrate`` on the cluster with ``cfg``'s launch; the profile it wrote."""
    path = workdir / "calibrate.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    out = workdir / "calibrated-profile.yaml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    res = subprocess.run([sys.executable, "-m", "moetrain.calibrate", "--config", str(path), "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"calibrate: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    print(res.stdout, file=sys.stderr, flush=True)
    return load_profile(out)


def fitted(prof: ClusterProfile, f: float, e: float | None = None) -> ClusterProfile:
    """``prof`` with its compute ``f`` times as fast (peak FLOP/s and memory bandwidth) and, when
    given, ``ep_overlap_efficiency`` e."""
    prof = dataclasses.replace(prof, peak_tflops=prof.peak_tflops * f, hbm_gb_s=prof.hbm_gb_s * f)
    return prof if e is None else dataclasses.replace(prof, ep_overlap_efficiency=e)


def predict(cfg, prof: ClusterProfile) -> dict:
    """The planner's step (seconds) for ``cfg`` on ``prof``."""
    nodes = cfg.launch.nodes
    gpn = cfg.launch.resolved_tasks_per_node(cfg.parallel.dp)
    if nodes == 1:  # the ranks share one node's loopback: one domain
        prof = dataclasses.replace(prof, gpus_per_node=gpn, nvswitch_domain_gpus=gpn)
    elif gpn != prof.gpus_per_node:  # the profile gives each of its ranks per node a share of the node link
        share = prof.gpus_per_node / gpn
        prof = dataclasses.replace(prof, gpus_per_node=gpn, nvswitch_domain_gpus=gpn,
                                   rail_gb_s=prof.rail_gb_s * share, spine_gb_s=prof.spine_gb_s * share)
    # FSDP2's gradient all-reduce blocks in its backward hooks on gloo: not overlapped here.
    ta = TimingAssumptions(ep_overlap="merged_pairs" if cfg.parallel.ep_overlap else "none",
                           delay_wgrad=cfg.parallel.delay_wgrad_compute, overlap_grad_reduce=False,
                           ep_overlap_split=cfg.parallel.ep_overlap_split)
    planner = Planner(ModelShape.from_config(cfg), prof, nodes, cfg.train.global_batch_size,
                      gpus_per_node=gpn, mem=MemoryAssumptions.for_train(cfg.train), timing=ta)
    t = planner.evaluate(Layout.from_config(cfg)).time
    assert t is not None
    return {"step_s": t.step, "ep_exposed_s": t.breakdown.get("ep_comm", 0.0), "ep_hidden_s": t.ep_hidden,
            "dp_exposed_s": t.breakdown.get("dp_comm_exposed", 0.0)}


def solve(step_of, measured: float, lo: float, hi: float, geometric: bool = False) -> float:
    """x in [lo, hi] at which ``step_of(x)`` (falling as x grows) equals ``measured`` (bisection;
    clamped to the interval)."""
    for _ in range(60):
        mid = (lo * hi) ** 0.5 if geometric else (lo + hi) / 2
        if step_of(mid) > measured:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5 if geometric else (lo + hi) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="steps per layout (the first 2 are not counted)")
    ap.add_argument("--micro-batches", type=int, default=None,
                    help="micro-batches per step per rank (default 8; with --config, the config's global batch)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, from " + ", ".join(LAYOUTS))
    ap.add_argument("--config", default=None,
                    help="train this config (e.g. configs/demo-moe.yaml: its model, data and global batch) at "
                         "dp = ep = --ranks instead of the bench's model")
    ap.add_argument("--ranks", type=int, choices=(2, 4), default=4,
                    help="dp = ep = ranks: 4 (2 per node, two processes per core of this 2-core machine) or 2 "
                         "(one per node and per core, as a rank has its own GPU)")
    ap.add_argument("--calibrate", action="store_true",
                    help="calibrate a profile on the cluster first and predict every layout from it alone")
    ap.add_argument("--fit-overlap", default="flat+overlap",
                    help="the overlapped layout the planner's ep_overlap_efficiency is fitted on ('' for none: "
                         "the profile's value)")
    args = ap.parse_args()
    if args.micro_batches is None and args.config is None:
        args.micro_batches = 8
    names = args.layouts.split(",")
    if "one-node" not in names:
        raise SystemExit("--layouts must include one-node: the planner's compute is calibrated on it")
    mbps, profile_path = emulated_rate()
    prof = load_profile(profile_path)
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-net-", dir="/tmp") as tmp:
        work = Path(tmp)
        write_shards(_documents(1500), ByteTokenizer(), work / "shards", shard_tokens=200_000, val_docs=10,
                     progress=False)
        cfgs = {n: layout_config(n, work / "shards", work / n, args.steps, args.micro_batches, profile_path,
                                 args.config, args.ranks) for n in names}
        measured = {}
        calibrated = None
        if args.calibrate:
            flat = cfgs.get("flat") or layout_config("flat", work / "shards", work / "flat", args.steps,
                                                     args.micro_batches, profile_path, args.config, args.ranks)
            calibrated = run_calibrate(flat, work)
        for n in names:
            times = run_layout(cfgs[n], work)
            measured[n] = {"step_s": statistics.median(times[2:]), "steps": times}
            print(f"{n}: {measured[n]['step_s']:.3f} s per step", file=sys.stderr, flush=True)
    # 1. compute: the factor that makes the planner's one-node step the measured one.
    f = solve(lambda x: predict(cfgs["one-node"], fitted(prof, x))["step_s"], measured["one-node"]["step_s"],
              1e-3, 1e3, geometric=True)
    # 2. the overlap: the share of merged_pairs' ideal hiding that makes the planner's step of the
    #    fitted layout the measured one (the other overlapped layouts are then predictions).
    fit = args.fit_overlap if args.fit_overlap in measured else None
    e = (solve(lambda x: predict(cfgs[fit], fitted(prof, f, x))["step_s"], measured[fit]["step_s"], 0.0, 1.0)
         if fit else None)
    rows = {}
    ref = measured["one-node"]["step_s"]
    for n in names:
        pred = predict(cfgs[n], fitted(prof, f, e))
        row = {"measured_step_s": measured[n]["step_s"], "predicted_step_s": pred["step_s"],
               "predicted_over_measured": pred["step_s"] / measured[n]["step_s"],
               "fitted_here": n == "one-node" or n == fit,
               "predicted_with_profile_efficiency_s": predict(cfgs[n], fitted(prof, f))["step_s"],
               "planner": pred, "steps_s": measured[n]["steps"]}
        base = n.split("+overlap")[0]
        if n.endswith("+delay_wgrad") and f"{base}+overlap" in measured:
            row["over_overlap_alone"] = measured[n]["step_s"] / measured[f"{base}+overlap"]["step_s"]
        if "+overlap" in n and base in measured:
            off, on = measured[base]["step_s"], measured[n]["step_s"]
            row["on_over_off"] = on / off
            row["hidden_fraction"] = (off - on) / (off - ref) if off > ref else None
            pred_off = predict(cfgs[base], fitted(prof, f, e))["step_s"]
            row["predicted_on_over_off"] = pred["step_s"] / pred_off
            # What can be hidden at all: the network's cost (off - compute), or the compute when
            # the network costs more than the compute has room to cover.
            row["hidden_share"] = (off - on) / min(ref, off - ref) if off > ref else None
            row["predicted_hidden_share"] = ((pred_off - pred["step_s"]) / min(ref, pred_off - ref)
                                             if pred_off > ref else None)
            row["split_micro_batches"] = overlap_split(cfgs[n])
        if calibrated is not None:
            c = predict(cfgs[n], calibrated)["step_s"]
            row["calibrated_predicted_step_s"] = c
            row["calibrated_error"] = c / measured[n]["step_s"] - 1
        rows[n] = row
    out = {"bench": "emulated_network", "link_mbit_s": mbps, "profile": str(profile_path),
           "model": args.config or {**MODEL, **MOE},
           "parallel": f"dp{args.ranks} x ep{args.ranks}, 2 nodes x {args.ranks // 2} tasks "
                       f"(one-node: 1 x {args.ranks})",
           "micro_batches_per_rank": cfgs["one-node"].grad_accum_steps,
           "micro_batch_size": cfgs["one-node"].train.micro_batch_size,
           "calibration": {"compute": {"layout": "one-node", "factor": f, "peak_tflops": prof.peak_tflops * f,
                                       "hbm_gb_s": prof.hbm_gb_s * f},
                           "ep_overlap_efficiency": {"layout": fit, "value": e,
                                                     "profile_value": prof.ep_overlap_efficiency}},
           "layouts": rows, "wall_s": time.time() - t_start}
    if calibrated is not None:
        errs = [abs(r["calibrated_error"]) for r in rows.values()]
        rail = calibrated.collective_gb_s.get("rail", {}).get("all_reduce")
        out["calibrated"] = {"profile_terms": calibrated.calibration.get("terms"),
                             "wall_s": calibrated.calibration.get("wall_s"),
                             "calibrated_link_mbit_s": rail * 8000 * calibrated.gpus_per_node if rail else None,
                             "median_abs_error": statistics.median(errs), "max_abs_error": max(errs)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
