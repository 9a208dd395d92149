"""The callable every task runs: logging, torch.distributed, lifecycle, then the trainer.

``TrainJob`` is a ``submitit.helpers.Checkpointable``: submitit pickles it into the run's log
folder, starts it once per task (locally or on SLURM), and starts the same pickle again after a
requeue. The job holds only the resolved config; everything else (step, data position, RNG) is
in the run directory's checkpoints, so a restart resumes where the last complete checkpoint is.

Lifecycle on SLURM:

* the pre-timeout signal (``--signal=USR2@signal_delay_s``) and preemption
  (``preempt_send_user_signal``) only set a flag; the loop finishes its step, checkpoints, and
  rank 0 requeues the job (``scontrol requeue``); the restarted attempt resumes;
* a node failure ends the attempt without a signal; SLURM requeues the job (``JobRequeue=1``)
  and the next attempt resumes from the latest complete checkpoint;
* a hang (no progress for ``launch.heartbeat_timeout_factor`` × the median step time, at least
  ``launch.heartbeat_min_timeout_s``) is caught by each rank's watchdog: stacks are dumped, the
  suspected node is excluded and the job requeued;
* ``SLURM_RESTART_COUNT`` counts restarts; past ``launch.max_restarts`` the run stops and
  says why (``events.jsonl``, the log, and the job's failure).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import time
import zlib

import submitit

from moetrain.config import Config, config_from_dict, to_dict

log = logging.getLogger("moetrain")


def setup_logging(rank: int) -> None:
    """Rank 0 logs INFO to stdout; the others only warnings (each task has its own log file)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def _exit_now(code: int) -> None:
    # gloo workers abort in ~5 % of interpreter exits after their work is done
    # (../shared/FACTS.md): skip the teardown that aborts.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def master_port(job_id: str, restart: int) -> int:
    """Rendezvous port for one attempt: differs between attempts, so a process left over from an
    earlier attempt cannot hold the new attempt's port."""
    return 20000 + zlib.crc32(f"{job_id}/{restart}".encode()) % 30000


def process_threads(cpus_per_task: int | None, local_world_size: int) -> tuple[int, str]:
    """Torch threads for one rank, and why: ``launch.cpus_per_task`` when set; else SLURM's
    ``SLURM_CPUS_PER_TASK``; else the cores this process may run on (its CPU affinity: on SLURM
    with task binding, the task's own) shared by the ranks of this node."""
    if cpus_per_task is not None:
        return cpus_per_task, "launch.cpus_per_task"
    if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return int(os.environ["SLURM_CPUS_PER_TASK"]), "SLURM_CPUS_PER_TASK"
    cores = len(os.sched_getaffinity(0))
    return max(1, cores // max(1, local_world_size)), f"{cores} cores / {local_world_size} local ranks"


class RestartsExhausted(RuntimeError):
    """The run was restarted more than ``launch.max_restarts`` times."""


class TrainJob(submitit.helpers.Checkpointable):
    """Train ``config`` (a plain dict, so the pickle does not depend on class layouts)."""

    def __init__(self, config: dict):
        self.config = config

    def __call__(self) -> str:
        import torch
        import torch.distributed as dist

        from moetrain.launch.lifecycle import Watchdog, append_event, existing_excludes, requeue_slurm_job
        from moetrain.train.trainer import StopFlag, Trainer

        cfg: Config = config_from_dict(self.config)
        env = submitit.JobEnvironment()
        on_slurm = "SLURM_JOB_ID" in os.environ
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        os.environ["MASTER_PORT"] = str(master_port(str(env.job_id), restart))
        denv = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        setup_logging(denv.rank)
        threads, why = process_threads(cfg.launch.cpus_per_task, denv.local_world_size)
        torch.set_num_threads(threads)
        if denv.rank == 0:
            log.info("torch threads per process: %d (%s)", threads, why)

        if restart > cfg.launch.max_restarts:
            msg = (f"restart {restart} exceeds launch.max_restarts={cfg.launch.max_restarts}: giving up; "
                   f"see {cfg.run_dir / 'events.jsonl'} for the causes")
            if denv.rank == 0:
                append_event(cfg.run_dir, None, "gave_up", restart=restart, reason=msg)
            log.error(msg)
            raise RestartsExhausted(msg)

        stop = StopFlag()
        # Signals only set a flag; the loop checkpoints at the next step boundary.
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: stop.set(signal.Signals(signum).name))

        trainer = Trainer(cfg, job_id=str(env.job_id), restart=restart, stop_flag=stop)
        hang = os.environ.get("MOETRAIN_TEST_HANG")  # "rank:step", fault injection for the tests
        if hang and int(hang.split(":")[0]) == denv.rank:
            trainer.hang_at_step = int(hang.split(":")[1])
        # "seconds:attempts": attempts with SLURM_RESTART_COUNT < attempts idle that long before each
        # step, so that a test's signal, preemption or node failure lands mid-run (fault injection).
        slow = os.environ.get("MOETRAIN_TEST_SLOW")
        if slow and restart < int(slow.split(":")[1]):
            trainer.step_delay_s = float(slow.split(":")[0])

        def on_hang(nodes: list[str]) -> None:
            excluded = sorted(set(existing_excludes(cfg.run_dir)) | set(nodes))
            if on_slurm and restart < cfg.launch.max_restarts:
                requeued = requeue_slurm_job(exclude=excluded)
                append_event(cfg.run_dir, trainer.fence, "requeue", cause="hang", excluded=excluded, ok=requeued)
                if requeued:
                    # SLURM now ends every process of this attempt (SIGTERM, SIGKILL after KillWait).
                    # Leaving first would make the other ranks fail on the closed connections and
                    # report those errors as the job's result.
                    time.sleep(600)
            else:
                append_event(cfg.run_dir, trainer.fence, "gave_up", cause="hang",
                             reason="not on SLURM" if not on_slurm else "launch.max_restarts reached")
            _exit_now(1)

        trainer.watchdog = Watchdog(cfg.run_dir, denv.rank, trainer.fence, trainer.heartbeat,
                                    cfg.launch.heartbeat_timeout_factor, cfg.launch.heartbeat_min_timeout_s,
                                    on_hang).start()
        status = trainer.run()
        trainer.watchdog.stop()
        if status == "stopped" and on_slurm:
            dist.barrier()
            give_up = restart >= cfg.launch.max_restarts
            if denv.rank == 0:
                if not give_up:
                    ok = requeue_slurm_job(exclude=existing_excludes(cfg.run_dir) or None)
                    append_event(cfg.run_dir, trainer.fence, "requeue", cause=stop.reason, ok=ok)
                else:
                    append_event(cfg.run_dir, trainer.fence, "gave_up", cause=stop.reason,
                                 reason=f"launch.max_restarts={cfg.launch.max_restarts} reached")
            dist.destroy_process_group()
            if give_up:
                # Fail with the reason, rather than end without a result ("has not produced any
                # output" is all submitit and `submit` could say then).
                msg = (f"stopped by {stop.reason} at step {trainer.step} (checkpoint saved) after {restart} "
                       f"restart(s): launch.max_restarts={cfg.launch.max_restarts} reached, so the job is not "
                       f"requeued; resubmit the same config to resume")
                log.error(msg)
                atexit.register(_exit_now, 1)
                raise RestartsExhausted(msg)
            # Leave without a result: the requeued attempt will produce it (as submitit does).
            _exit_now(0)
        dist.destroy_process_group()
        atexit.register(_exit_now, 0)
        return status


def job_config(cfg: Config) -> dict:
    return to_dict(cfg)
