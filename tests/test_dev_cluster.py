"""The single-host SLURM dev cluster (`slurm/dev-cluster up`) does what the orchestration needs:
plain jobs reach sacct, submitit spreads ranks over both fake nodes, and a USR2 signal makes a
submitit Checkpointable job checkpoint, requeue and restart. About 20 s in all."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import submitit


from conftest import require_slurm_cluster

pytestmark = pytest.mark.slurm

_CLUSTER = require_slurm_cluster()

# The jobs' interpreters cannot import this test module (pytest put tests/ on sys.path, the jobs
# do not have it): ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=30).stdout.strip()


def _wait_sacct_state(job_id: str, states: set[str], timeout_s: float) -> str:
    deadline, state = time.time() + timeout_s, ""
    while time.time() < deadline:
        state = _sh("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State")
        if state in states:
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} is {state!r} after {timeout_s} s, expected one of {states}")


def test_two_nodes_with_gpus():
    assert {n.name for n in _CLUSTER.nodes} >= {"n1", "n2"}
    assert all(n.gpus >= 2 for n in _CLUSTER.nodes)
    assert {"low", "high"} <= set(_CLUSTER.partitions) and _CLUSTER.default_partition == "low"


def test_sbatch_wrap_completes_and_is_in_sacct(tmp_path):
    out = tmp_path / "out.txt"
    job_id = _sh("sbatch", "--parsable", f"--output={out}", "--wrap", "echo hello from $SLURMD_NODENAME")
    assert _wait_sacct_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 30) == "COMPLETED"
    assert out.read_text().startswith("hello from n")


def _wait_done(job: submitit.Job, timeout_s: float) -> None:
    # job.result() alone would wait forever on a job that never finishes.
    deadline = time.time() + timeout_s
    while not job.done():
        assert time.time() < deadline, f"job {job.job_id} not done after {timeout_s} s; see {job.paths.stderr}"
        time.sleep(0.5)


def _rank_report() -> tuple[int, int, int, str, str]:
    env = submitit.JobEnvironment()
    return (env.global_rank, env.local_rank, env.node, env.hostnames[env.node], os.environ["SLURMD_NODENAME"])


def test_submitit_two_nodes_global_ranks(tmp_path):
    ex = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    ex.update_parameters(nodes=2, tasks_per_node=2, timeout_min=5, name="ranks")
    job = ex.submit(_rank_report)
    _wait_done(job, 40)
    reports = sorted(job.results(), key=lambda r: r[0])
    assert [r[0] for r in reports] == [0, 1, 2, 3]
    assert [r[1] for r in reports] == [0, 1, 0, 1]
    assert [r[3] for r in reports] == ["n1", "n1", "n2", "n2"]
    assert [r[4] for r in reports] == [r[3] for r in reports]  # the node each rank really ran on


class _WaitForRequeue(submitit.helpers.Checkpointable):
    """First run: says it started, then waits to be signalled. Run after the requeue: returns."""

    def __call__(self, started: str) -> int:
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        if restarts == 0:
            Path(started).touch()
            time.sleep(120)  # the USR2 arrives here; submitit checkpoints and requeues
        return restarts


def test_usr2_checkpoints_and_requeues(tmp_path):
    ex = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    ex.update_parameters(nodes=1, tasks_per_node=1, timeout_min=5, name="requeue")
    started = tmp_path / "started"
    job = ex.submit(_WaitForRequeue(), str(started))
    deadline = time.time() + 30
    while not started.exists():
        assert time.time() < deadline, f"job {job.job_id} did not start; see {job.paths.stderr}"
        time.sleep(0.2)
    _sh("scancel", "--signal=USR2", job.job_id)
    _wait_done(job, 60)  # ≈ 9 s: cred_expire=5 and sched_interval=5 on the dev cluster
    assert job.result() == 1  # SLURM_RESTART_COUNT seen by the restarted job
