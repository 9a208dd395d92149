"""Running inside a SLURM allocation that already exists (``salloc``, a user's own sbatch script).

``submit`` started inside an allocation (``SLURM_JOB_ID`` set, ``launch.allocation: auto``)
submits no new job: it starts the ranks as one ``srun`` step of that allocation, each running
``python -m moetrain.run`` on the run directory's resolved config, and follows it as it follows a
job. A requeue needs a batch job of moetrain's own, which an allocation is not, so a failed
attempt (a rank died, a collective failed, a hang) is restarted as a new step within the same
allocation, up to ``launch.max_restarts`` times; a stop (the allocation's time limit, a signal)
checkpoints and ends the run, and a later ``submit`` resumes it.

The site settings apply as in a batch job: ``launch.env`` exported and ``launch.setup`` run by
one shell before ``srun`` (once per attempt), ``launch.srun_args`` and the container's flags on
``srun``, the container runtime's command around each task.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from moetrain.config import Config, field_error
from moetrain.launch.container import task_launch
from moetrain.launch.slurm import site_setup_lines

__all__ = ["Allocation", "current_allocation", "check_allocation", "step_script", "StepJob"]


@dataclass(frozen=True)
class Allocation:
    """The SLURM allocation this process runs in: ``job_id``, ``nodes`` (count) and
    ``nodelist`` (SLURM's compressed host list)."""

    job_id: str
    nodes: int
    nodelist: str


def current_allocation(environ: dict | None = None) -> Allocation | None:
    """The allocation named by ``SLURM_JOB_ID`` (and ``SLURM_JOB_NUM_NODES``,
    ``SLURM_JOB_NODELIST``) in ``environ`` (default: this process's), or None outside one."""
    env = os.environ if environ is None else environ
    if not env.get("SLURM_JOB_ID"):
        return None
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    return Allocation(env["SLURM_JOB_ID"], int(nodes) if nodes.isdigit() else 1, env.get("SLURM_JOB_NODELIST", ""))


def check_allocation(cfg: Config, alloc: Allocation) -> None:
    """The run fits the allocation.

    Raises:
        ConfigError: ``launch.nodes`` exceeds the allocation's nodes, or the run is elastic
            (``launch.elastic``), which an allocation cannot be.
    """
    if cfg.launch.elastic is not None:
        # An elastic run starts on the nodes the scheduler gives and requeues itself on others
        # (moetrain.launch.elastic); an allocation's nodes are fixed, a node that fails ends its
        # steps, and nothing can requeue it.
        raise field_error("launch.elastic", {"min_nodes": cfg.launch.elastic.min_nodes},
                          f"submit runs inside SLURM allocation {alloc.job_id}, whose nodes are fixed: a lost node "
                          "cannot be replaced nor the run requeued on the nodes left",
                          "remove launch.elastic to run inside the allocation, or run submit outside it (or "
                          "--set launch.allocation=new) for an elastic batch job")
    if cfg.launch.nodes > alloc.nodes:
        raise field_error("launch.nodes", cfg.launch.nodes, f"submit runs inside SLURM allocation {alloc.job_id}, "
                          f"which has {alloc.nodes} node(s) ({alloc.nodelist})",
                          f"use launch.nodes <= {alloc.nodes}, ask salloc for more nodes, or run outside the "
                          "allocation (or --set launch.allocation=new) to submit a new job")


def step_script(cfg: Config, alloc: Allocation, restart: int, log_dir: Path, cwd: Path | None = None,
                module: list[str] | None = None) -> str:
    """The shell script of one attempt: ``launch.env`` exported, ``launch.setup``, then ``exec
    srun`` of ``python -m moetrain.run`` (in the container when one is configured) on
    ``<run.dir>/config.yaml``; each rank's output in ``log_dir/<job>.<restart>_<rank>.out``.
    ``module``: another module and its arguments to run in each task instead (the measuring
    step of ``moetrain.calibrate``)."""
    ln = cfg.launch
    tpn = ln.resolved_tasks_per_node(cfg.world_size)
    launch = task_launch(cfg, cwd)
    out = log_dir / f"{alloc.job_id}.{restart}_%t.out"
    srun = ["srun", f"--nodes={ln.nodes}", f"--ntasks={cfg.world_size}", f"--ntasks-per-node={tpn}",
            f"--job-name={cfg.run.name}", "--unbuffered", f"--output={out}",
            f"--error={log_dir / f'{alloc.job_id}.{restart}_%t.err'}"]
    if ln.cpus_per_task is not None:
        srun.append(f"--cpus-per-task={ln.cpus_per_task}")
    if ln.gpus_per_node:
        srun.append(f"--gpus-per-node={ln.gpus_per_node}")
    run = [*launch.python, "-u", "-m", *(module or [
        "moetrain.run", "--config", str(cfg.run_dir / "config.yaml"), "--resolved", "--restart", str(restart),
        "--job-id", alloc.job_id, "--log", str(log_dir / f"{alloc.job_id}.{restart}_{{rank}}.out")])]
    lines = ["set -e", *site_setup_lines(cfg),
             "exec " + " ".join(shlex.quote(a) for a in [*srun, *launch.srun_args, *ln.srun_args, *run])]
    return "\n".join(lines) + "\n"


class StepJob:
    """One attempt inside the allocation, shaped like the submitit job ``submit`` follows:
    ``job_id`` (the allocation's), ``state``, ``done()``, ``results()`` (``["done"]`` or
    ``["stopped"]``; raises when the step failed) and ``cancel()``."""

    def __init__(self, script: str, job_id: str, stderr_path: Path):
        self.job_id = job_id
        self._stderr_path = stderr_path
        stderr_path.parent.mkdir(parents=True, exist_ok=True)
        with open(stderr_path, "ab") as err:
            self._proc = subprocess.Popen(["bash", "-c", script], stdout=err, stderr=err, start_new_session=True)

    @property
    def state(self) -> str:
        return "RUNNING" if self._proc.poll() is None else f"EXITED {self._proc.returncode}"

    def done(self) -> bool:
        return self._proc.poll() is not None

    def results(self) -> list[str]:
        code = self._proc.wait()
        if code == 0:
            return ["done"]
        if code == 3:
            return ["stopped"]
        tail = self._stderr_path.read_text(errors="replace").strip().splitlines()[-3:] if \
            self._stderr_path.is_file() else []
        raise RuntimeError(f"srun step of allocation {self.job_id} exited with {code}"
                           + (f": {' | '.join(tail)}" if tail else ""))

    def cancel(self) -> None:
        """End the step: srun forwards SIGTERM to its tasks (they checkpoint when they can),
        SIGKILL after 30 s."""
        if self._proc.poll() is not None:
            return
        os.killpg(self._proc.pid, signal.SIGTERM)
        deadline = time.time() + 30
        while self._proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
