"""The callable every task of a submitted run executes (``submit`` hands it to submitit).

:class:`TrainJob` is a ``submitit.helpers.Checkpointable``: submitit pickles it into the run's log
folder, starts it once per task (locally or on SLURM), and starts the same pickle again after a
requeue. On SLURM with ``launch.restart_in_job`` the task supervises its rank in a child process
(:mod:`moetrain.launch.supervisor`); otherwise it is the rank (:func:`moetrain.launch.job.run_rank`).
It sits above both, so that neither imports the other's caller.
"""

from __future__ import annotations

import atexit
import os

import submitit

from moetrain.config import Config, config_from_dict
from moetrain.launch.job import RankEnv, exit_now, master_port, run_rank
from moetrain.launch.supervisor import inner_restarts, supervise

__all__ = ["TrainJob"]


class TrainJob(submitit.helpers.Checkpointable):
    """Train ``config`` (a plain dict, so the pickle does not depend on class layouts).
    ``restart``: the local relaunch number (the submit command's); SLURM's requeues add
    ``SLURM_RESTART_COUNT``."""

    def __init__(self, config: dict, restart: int = 0):
        self.config = config
        self.restart = restart

    def __call__(self) -> str:
        cfg: Config = config_from_dict(self.config)
        env = submitit.JobEnvironment()
        # A batch job of submitit's own on SLURM (not the local executor started inside someone's
        # allocation, which sees SLURM_JOB_ID too): the run may requeue it, and SLURM counts its
        # requeues.
        own_slurm_job = os.environ.get("SUBMITIT_EXECUTOR") == "slurm"
        requeues = int(os.environ.get("SLURM_RESTART_COUNT", "0")) if own_slurm_job else 0
        supervised = own_slurm_job and cfg.launch.restart_in_job
        if supervised:
            requeues += inner_restarts(cfg.run_dir, str(env.job_id))  # attempts restarted inside the job
        restart = getattr(self, "restart", 0) + requeues
        os.environ["MASTER_PORT"] = str(master_port(str(env.job_id), restart))
        denv = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        renv = RankEnv(denv.rank, denv.world_size, denv.local_rank, denv.local_world_size, str(env.job_id),
                       str(env.paths.stdout), requeue=own_slurm_job, launcher="submitit")
        if supervised:
            status = supervise(cfg, renv, restart)
        else:
            status = run_rank(cfg, renv, restart)
        atexit.register(exit_now, 0)  # after submitit records the result (gloo may abort at exit)
        return status
