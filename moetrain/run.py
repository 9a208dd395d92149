"""``torchrun ... -m moetrain.run --config X.yaml [--config SITE.yaml ...] [--set a.b=c ...]``

The trainer under a launcher other than ``submit``: torchrun (Kubernetes with Kubeflow's
PyTorchJob, other schedulers, a workstation), or the ``srun`` steps ``submit`` starts inside an
existing SLURM allocation. Each process reads who it is from its launcher's variables (torchrun's
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
or the srun step's), loads and checks the config as ``submit`` does (``parallel.dp: auto``
resolved from the ranks actually started; ``launch.nodes`` and ``launch.tasks_per_node`` taken
from the launcher), and trains with the same lifecycle: checkpoints, resume, failure records,
the hang watchdog. Restarts are the launcher's (torchrun's ``--max-restarts``): a failed or
stopped process exits, and the next attempt resumes from the latest complete checkpoint.

Exit status: 0 when training finished, 1 when it failed, 2 for a bad config, 3 when it stopped
early (a signal; the checkpoint is saved and the next start resumes).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from moetrain.config import Config, ConfigError, load_layers, save_config
from moetrain.launch.job import LauncherError, exit_now, rank_env_from_environ, run_rank

log = logging.getLogger("moetrain")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="torchrun ... -m moetrain.run", description=__doc__.split("\n\n")[1])
    ap.add_argument("--config", action="append", required=True, metavar="X.yaml",
                    help="YAML run config; repeat to layer files (later ones override earlier ones)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value at any depth (repeatable), e.g. --set train.steps=20")
    ap.add_argument("--restart", type=int, default=None,
                    help="attempt number (default: torchrun's TORCHELASTIC_RESTART_COUNT, else 0)")
    ap.add_argument("--job-id", default=None, help="name of the job in failure records (default: the launcher's)")
    ap.add_argument("--log", default=None, help="this rank's log path, {rank} replaced (named in failure records)")
    ap.add_argument("--resolved", action="store_true",
                    help="the config is a run directory's resolved config.yaml (do not write it again)")
    return ap


def fit_to_launcher(cfg: Config, world: int, local_world: int) -> Config:
    """``cfg`` with ``launch.nodes`` / ``launch.tasks_per_node`` those the launcher started.

    Raises:
        ConfigError: the layout needs another number of ranks than were started (naming
            ``parallel.dp``).
    """
    if cfg.world_size != world:
        par = cfg.parallel
        raise ConfigError(f"parallel.dp = {par.dp}: the layout pp {par.pp} × dp {par.dp} × cp {par.cp} × tp {par.tp} "
                          f"needs {cfg.world_size} ranks, but the launcher started {world}. Fix: set parallel.dp: auto "
                          f"(dp = {world} ÷ (tp × pp × cp)), or start {cfg.world_size} processes")
    nodes = max(1, world // max(1, local_world))
    if (cfg.launch.nodes, cfg.launch.resolved_tasks_per_node(world)) == (nodes, world // nodes):
        return cfg
    return cfg.replace(launch={"nodes": nodes, "tasks_per_node": world // nodes})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    restart = args.restart if args.restart is not None else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    try:
        renv = rank_env_from_environ(restart, args.job_id, args.log)
    except LauncherError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from moetrain.launch.preflight import preflight

    try:
        cfg, layers = load_layers(args.config, args.overrides, world_size=renv.world_size)
        cfg = preflight(fit_to_launcher(cfg, renv.world_size, renv.local_world_size), live=False)
    except ConfigError as e:
        if renv.rank == 0:
            print(f"config error: {e}", file=sys.stderr)
        return 2
    if renv.rank == 0 and not args.resolved:
        save_config(cfg, cfg.run_dir / "config.yaml", layers)
    try:
        status = run_rank(cfg, renv, restart)
    except Exception:  # noqa: BLE001 - recorded, with the full traceback, by run_rank (RestartsExhausted too)
        return 1
    return 0 if status == "done" else 3


if __name__ == "__main__":
    exit_now(main())  # without the interpreter's teardown, as the submit path's ranks leave
