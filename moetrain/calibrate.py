"""``python -m moetrain.calibrate --config X.yaml [--config SITE.yaml ...] [--set a.b=v ...] --out PROFILE.yaml
[--seconds S] [--collective-budget S]``

Measures on the cluster the config's launch section describes (``launch.cluster: local`` on
this machine, ``slurm`` through the same executor ``moetrain.submit`` uses: its nodes, tasks,
partition, container and environment) what the planner's profile holds — GEMM throughput at the
model's shapes and the short-K loss, attention, memory bandwidth, and the bus bandwidth and
latency of each collective inside a node and across nodes (and rail groups) at the sizes the
layout moves — and writes a profile (``launch.profile`` with the measured terms replaced,
:mod:`moetrain.planner.calibration`) to ``--out``, with what was measured, where and when.
Give it to ``moetrain.plan --profile`` or ``launch.profile``. One short job: about a minute on
this CPU machine, a few on a GPU cluster; progress lines say what it is measuring.

Where it runs, as ``submit`` decides: inside a SLURM allocation (``salloc``, a batch script of
the user's; ``launch.allocation: auto``) the measuring job is one ``srun`` step of it, no new
job; under torchrun (``torchrun --nproc-per-node N -m moetrain.calibrate ...``) every process
it started is a rank of the measuring job and rank 0 writes the profile; otherwise a new job.

Exit status: 0 written, 1 the job failed (the rank's log is named), 2 a bad config or option.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from moetrain.config import Config, ConfigError, load_layers, to_dict
from moetrain.data.sources import vocab_for_planning
from moetrain.launch.slurm import SlurmUnavailableError
from moetrain.planner.calibration import CalibrationError, calibrated_profile, layer_config
from moetrain.planner.layout import Layout
from moetrain.planner.memory import MemoryAssumptions
from moetrain.planner.model import ModelShape
from moetrain.topology.cluster import ClusterProfile, ProfileError
from moetrain.utils import atomic_write

__all__ = ["main", "build_parser", "write_profile", "summary_lines"]


def build_parser(prog: str = "python -m moetrain.calibrate") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[1].replace("\n", " "))
    ap.add_argument("--config", action="append", required=True, help="run config (repeat to layer files)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value (repeatable)")
    ap.add_argument("--out", required=True, type=Path, help="the profile YAML to write")
    ap.add_argument("--name", default=None, help="profile name (default: the base profile's name + -calibrated)")
    ap.add_argument("--seconds", type=float, default=0.5, help="seconds each GEMM shape, the attention and the "
                    "copy are timed for (default 0.5)")
    ap.add_argument("--collective-budget", type=float, default=8.0,
                    help="seconds per collective and tier at most (default 8)")
    return ap


def write_profile(prof: ClusterProfile, report: dict[str, Any], path: Path, command: str) -> None:
    """Write ``prof`` as profile YAML (loadable by ``load_profile``), atomically; the header says
    how it was made and the report's figures go under ``calibration.report``."""
    d = prof.to_dict()
    d.pop("path", None)
    d["calibration"] = {**d.get("calibration", {}), "report": report}
    head = (f"# Written by `{command}`\n# Measured terms: {', '.join(prof.calibration.get('terms', []))}; "
            f"the rest is the base profile {prof.calibration.get('base_profile')!r}'s.\n")
    atomic_write(path, head + yaml.safe_dump(_plain(d), sort_keys=False, width=110))


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, str):
        return str(x)  # a str subclass (torch's version) as a plain string
    return x


def summary_lines(report: dict[str, Any], prof: ClusterProfile) -> list[str]:
    """What was measured beside what the base profile assumed, one line per term."""
    out = [f"{'term':34s} {'measured':>12s} {'base profile':>14s}"]

    def row(name: str, meas: float, base: float, unit: str) -> None:
        out.append(f"{name:34s} {meas:>9.4g} {unit:2s} {base:>11.4g} {unit}")

    if "hbm" in report:
        row("memory copy", report["hbm"]["copy_gb_s"], report["hbm"]["base_gb_s"], "GB/s")
    for key, label in (("gemm", "GEMM rate (model's shapes)"), ("gemm_fp8", "fp8 GEMM rate")):
        if key in report:
            row(label, report[key]["fitted_rate_tflops"], report[key]["base_rate_tflops"], "TF")
            floor = report[key].get("at_memory_floor")
            if floor:
                out.append(f"  note: the GEMMs took {floor['measured_s']:.3g} s, at or below the memory-bound floor "
                           f"{floor['floor_s']:.3g} s at the measured copy rate {floor['copy_gb_s']:.3g} GB/s; "
                           f"the rate above is fitted from their compute alone")
    if "tasks_per_node" in report:
        t = report["tasks_per_node"]
        out.append(f"  note: the job ran {t['job']} task(s) per node where the base profile has "
                   f"{t['base_gpus_per_node']} GPUs: the profile describes nodes of {t['job']}")
    if "k_sweep" in report:
        row("short-K loss k0 (elements of K)", report["k_sweep"]["k0"], report["k_sweep"]["base_k0"], "")
    if "attention" in report:
        row("attention (fwd + bwd)", report["attention"]["tflops"], report["attention"]["base_tflops"], "TF")
    if "layer" in report:
        out.append(f"{'one layer + head (fwd + bwd)':34s} {report['layer']['seconds'] * 1e3:>9.4g} ms "
                   f"{report['layer']['predicted_from_terms_s'] * 1e3:>11.4g} ms from the terms above "
                   f"(layer_efficiency {prof.layer_efficiency:.3g})")
    if "elementwise" in report:
        row("elementwise kernels (fwd + bwd)", report["elementwise"]["gb_s"], report["elementwise"]["copy_gb_s"],
            "GB/s")
    for tier, ops in report.get("collectives", {}).items():
        for op, fit in ops.items():
            if op == "group_size":
                continue
            row(f"{tier} {op} (groups of {ops['group_size']})", fit["bus_gb_s"], fit["base_gb_s"], "GB/s")
        out.append(f"{tier + ' latency per step':34s} {getattr(prof, tier + '_latency_us'):>9.4g} us")
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg, _ = load_layers(args.config, args.overrides)
        # the model measured is the one the run trains: its vocabulary from the data where null
        cfg, vocab_unknown = vocab_for_planning(cfg)
        if args.seconds <= 0 or args.collective_budget <= 0:
            raise ConfigError(f"--seconds {args.seconds} / --collective-budget {args.collective_budget}: both must "
                              "be positive")
        # The measuring job is one attempt of fixed length: no elastic range, no restarts.
        cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, elastic=None, max_restarts=0,
                                                                  time_min=min(cfg.launch.time_min, 30)))
        torchrun = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
        alloc = None
        if not torchrun and cfg.launch.cluster == "slurm" and cfg.launch.allocation == "auto":
            from moetrain.launch.allocation import check_allocation, current_allocation

            alloc = current_allocation()
            if alloc is not None:
                check_allocation(cfg, alloc)
        folder = cfg.run_dir / "calibrate"
        executor = None
        if torchrun:
            from moetrain.run import fit_to_launcher

            cfg = fit_to_launcher(cfg, int(os.environ["WORLD_SIZE"]),
                                  int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
        elif alloc is None:
            from moetrain.submit import make_executor

            executor = make_executor(cfg, folder)
    except (ConfigError, ProfileError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except SlurmUnavailableError as e:
        print(f"calibrate: cannot submit the measuring job: {e}", file=sys.stderr)
        return 1
    command = "python -m moetrain.calibrate " + " ".join(sys.argv[1:] if argv is None else argv)
    start = time.time()
    if torchrun:  # every process torchrun started is a rank of the measuring job; rank 0 writes
        from moetrain.launch.calibrate import measure_under_launcher

        rank, measured = measure_under_launcher(cfg, args.seconds, args.collective_budget)
        if rank != 0:
            return 0
    else:
        measured = _measure_in_job(cfg, args, folder, alloc, executor, vocab_unknown)
        if measured is None:
            return 1
    from moetrain.launch.calibrate import base_profile

    base = base_profile(cfg, cuda=measured["meta"]["nccl"] is not None)
    try:
        prof, report = calibrated_profile(base, measured, ModelShape.from_config(cfg), Layout.from_config(cfg),
                                          MemoryAssumptions.for_train(cfg.train), name=args.name,
                                          layer_shape=ModelShape.from_config(layer_config(cfg)))
    except CalibrationError as e:
        print(f"calibrate: the measurements give no profile: {e}", file=sys.stderr)
        return 1
    write_profile(prof, report, args.out, command)
    print("\n".join(summary_lines(report, prof)))
    print(f"calibrate: wrote {args.out} (profile {prof.name!r}, {time.time() - start:.0f} s); use it with "
          f"--set launch.profile={args.out} or python -m moetrain.plan --profile {args.out}", flush=True)
    return 0


def _measure_in_job(cfg: Config, args: argparse.Namespace, folder: Path, alloc: Any, executor: Any,
                    vocab_unknown: str | None) -> dict | None:
    """Run the measuring job — a new job through ``executor`` (SLURM or local, as ``submit``), or
    one ``srun`` step of the SLURM allocation ``alloc`` this command runs inside (as ``submit``
    there) — echo rank 0's progress, and return rank 0's measurements (None: it failed, said)."""
    if alloc is not None:
        from moetrain.config import save_config
        from moetrain.launch.allocation import StepJob, step_script

        folder.mkdir(parents=True, exist_ok=True)
        resolved, result = folder / "config.yaml", folder / "measurements.pt"
        save_config(cfg, resolved)
        result.unlink(missing_ok=True)
        script = step_script(cfg, alloc, 0, folder, module=[
            "moetrain.launch.calibrate", "--config", str(resolved), "--out", str(result),
            "--seconds", str(args.seconds), "--collective-budget", str(args.collective_budget)])
        job: Any = StepJob(script, alloc.job_id, folder / f"{alloc.job_id}.calibrate_srun.err")
        stdout = folder / f"{alloc.job_id}.0_0.out"
        print(f"calibrate: inside SLURM allocation {alloc.job_id}: one srun step of {cfg.world_size} tasks on "
              f"{cfg.launch.nodes} node(s), no new job; logs in {folder}", flush=True)
    else:
        from moetrain.launch.calibrate import CalibrateJob

        job = executor.submit(CalibrateJob(to_dict(cfg), args.seconds, args.collective_budget))
        stdout = Path(job.paths.stdout)
        print(f"calibrate: job {job.job_id} ({cfg.launch.cluster}, {cfg.world_size} tasks on "
              f"{cfg.launch.nodes} node(s)); logs in {folder}", flush=True)
    if vocab_unknown:
        print(f"calibrate: note: {vocab_unknown}: the model is measured at an assumed vocabulary of "
              f"{ModelShape.from_config(cfg).vocab}; set model.vocab_size to the tokenizer's for a profile of "
              "this model", flush=True)
    shown = 0
    while not job.done():
        shown = _echo(stdout, shown)
        time.sleep(1.0)
    _echo(stdout, shown)
    try:
        out = job.results()
        if alloc is None:
            return out[0]
        import torch

        return torch.load(result, weights_only=False)
    except Exception as e:  # noqa: BLE001 - submitit re-raises the task's failure; a step's exit code
        print(f"calibrate: the measuring job failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}\n"
              f"  logs: {folder}", file=sys.stderr)
        return None


def _echo(path: Path, shown: int) -> int:
    """Print the lines of rank 0's output that start with ``calibrate:`` past the first ``shown``."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.startswith("calibrate:")]
    except OSError:
        return shown
    for ln in lines[shown:]:
        print(ln, flush=True)
    return len(lines)


if __name__ == "__main__":
    sys.exit(main())
