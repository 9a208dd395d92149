"""The callable every task runs: set up logging and torch.distributed, then train.

``TrainJob`` is a ``submitit.helpers.Checkpointable``: submitit pickles it into the run folder,
starts it once per task (locally or on SLURM), and re-submits it on requeue.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys

import submitit

from moetrain.config import Config, config_from_dict, to_dict


def setup_logging(rank: int) -> None:
    """Rank 0 logs INFO to stdout; the others only warnings (each task has its own log file)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def _exit_quietly() -> None:
    # gloo workers abort in ~5 % of interpreter exits after their work is done
    # (../shared/FACTS.md); once the job has succeeded, skip the teardown that aborts.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class TrainJob(submitit.helpers.Checkpointable):
    """Train ``config`` (a plain dict, so the pickle does not depend on class layouts)."""

    def __init__(self, config: dict):
        self.config = config

    def __call__(self) -> str:
        import torch
        import torch.distributed as dist

        from moetrain.train.trainer import StopFlag, Trainer

        cfg: Config = config_from_dict(self.config)
        env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        setup_logging(env.rank)
        torch.set_num_threads(max(1, cfg.launch.cpus_per_task))
        attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        stop = StopFlag()
        # Signals only set a flag; the loop checkpoints at the next step boundary.
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: stop.set(signal.Signals(signum).name))
        trainer = Trainer(cfg, attempt=attempt, stop_flag=stop)
        status = trainer.run()
        dist.destroy_process_group()
        atexit.register(_exit_quietly)
        return status


def job_config(cfg: Config) -> dict:
    return to_dict(cfg)
