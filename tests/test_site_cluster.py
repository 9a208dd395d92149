"""Site settings and other ways in, on the real SLURM dev cluster (`slurm/dev-cluster up`), the
tiny MoE on 2 nodes × 2 tasks (dp 4, ep 2), 20 steps, each run through ``moetrain.submit`` as a
user starts it:

* a batch job with ``launch.env``, ``launch.setup``, ``srun_args`` and ``sbatch_args``: every rank
  sees the variables (the value literally, never interpreted) and what setup exported, the setup
  ran once, the pass-through options are in the script; an option SLURM refuses is caught by
  ``sbatch --test-only`` before anything is submitted;
* ``submit`` inside ``salloc``: no second job, the ranks run as steps of the allocation, the same
  losses as the batch job; ``moetrain.calibrate`` inside ``salloc`` measures as one step of it;
* the same run in a podman container (an image built from this machine's files; skipped where
  podman cannot run containers): every rank inside the container, the same losses.

Each rank reports what it saw through a hook (``MOETRAIN_FAULT_HOOK``) in the run directory.
About 2 minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import container_image
from moetrain.config import to_dict

from conftest import require_slurm_cluster, tiny_config

pytestmark = pytest.mark.slurm

require_slurm_cluster()

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20
VALUE = "a b; $(echo no) `id` 'q' \"dq\" $HOME"

HOOK = '''
import importlib.util, json, os, socket
from pathlib import Path


def report(trainer, rank, restart):
    spec = importlib.util.spec_from_file_location("faults", FAULTS)
    faults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(faults)
    faults.install(trainer, rank, restart)  # MOETRAIN_TEST_KILL and the others, as in the lifecycle tests
    out = Path(trainer.cfg.run_dir) / "seen" / f"rank{rank}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rank": rank, "host": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
                               "value": os.environ.get("MOETRAIN_SITE_VALUE"),
                               "mark": os.environ.get("MOETRAIN_SETUP_MARK"),
                               "container": os.path.exists("/run/.containerenv"),
                               "job": os.environ.get("SLURM_JOB_ID"), "step": os.environ.get("SLURM_STEP_ID")}))
'''


def write_run(tmp: Path, shards: Path, name: str, **launch) -> tuple[Path, Path]:
    run_dir = tmp / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "hook.py").write_text(f"FAULTS = {str(ROOT / 'tests' / 'faults.py')!r}\n" + HOOK)
    cfg = tiny_config(shards, run_dir, run={"name": name}, parallel={"dp": 4, "ep": 2}, train={"steps": STEPS},
                      launch={"cluster": "slurm", "nodes": 2, "time_min": 10, "cpus_per_task": 1, **launch})
    config = tmp / "run.yaml"
    config.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return config, run_dir


def env_for(run_dir: Path, home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOETRAIN_TEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["MOETRAIN_HOME"] = str(home)
    env["MOETRAIN_FAULT_HOOK"] = f"{run_dir / 'hook.py'}:report"
    return env


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=60).stdout.strip()


def seen(run_dir: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in (run_dir / "seen").glob("rank*.json")), key=lambda r: r["rank"])


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [r["loss"] for r in rows]


def run_submit(config: Path, run_dir: Path, home: Path, prefix: list[str] = (), timeout_s: float = 300, **env):
    out = subprocess.run([*prefix, sys.executable, "-m", "moetrain.submit", "--config", str(config)], cwd=ROOT,
                         env={**env_for(run_dir, home), **env}, capture_output=True, text=True, timeout=timeout_s)
    return out.returncode, out.stdout + out.stderr


def task_logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted((run_dir / "logs").glob("*"))
                     if p.suffix in (".out", ".err"))


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("moetrain-home")


@pytest.fixture(scope="module")
def batch(tiny_shards, tmp_path_factory, home) -> dict:
    """The batch job with every site setting, shared with the tests that compare losses."""
    tmp = tmp_path_factory.mktemp("site-batch")
    run_dir = tmp / "run"
    config, run_dir = write_run(tmp, tiny_shards, "site-batch", env={"MOETRAIN_SITE_VALUE": VALUE},
                                setup=["export MOETRAIN_SETUP_MARK=from-setup-$SLURM_JOB_ID",
                                       f"echo \"setup on $(hostname)\" >> {run_dir}/setup-ran.txt"],
                                srun_args=["--cpu-bind=none"], sbatch_args=["--comment=moetrain-site-test"])
    rc, out = run_submit(config, run_dir, home)
    return {"rc": rc, "out": out, "run_dir": run_dir}


def test_env_and_setup_reach_every_rank(batch):
    run_dir = batch["run_dir"]
    assert batch["rc"] == 0, batch["out"] + task_logs(run_dir)
    ranks = seen(run_dir)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and sorted(r["host"] for r in ranks) == ["n1", "n1", "n2", "n2"]
    job = ranks[0]["job"]
    for r in ranks:
        assert r["value"] == VALUE, "quoted, never interpreted"
        assert r["mark"] == f"from-setup-{job}", "what setup exported reached the rank"
    assert len((run_dir / "setup-ran.txt").read_text().splitlines()) == 1, "setup runs once per job"
    script = next((run_dir / "logs").glob("*_submission.sh")).read_text()
    assert "#SBATCH --comment=moetrain-site-test" in script
    assert "--cpu-bind=none" in next(line for line in script.splitlines() if line.startswith("srun "))
    rank0 = json.loads(next((run_dir / "environment").glob("attempt*/rank00000.json")).read_text())
    assert rank0["variables"]["MOETRAIN_SITE_VALUE"] == VALUE, "the launch env is in the environment record"


def test_option_slurm_refuses_is_caught_before_submitting(tiny_shards, tmp_path, home):
    config, run_dir = write_run(tmp_path, tiny_shards, "site-refused", sbatch_args=["--reservation=no-such-resv"])
    before = sh("squeue", "-h", "-o", "%i").split()
    rc, out = run_submit(config, run_dir, home, timeout_s=120)
    assert rc == 2, out
    assert "config error: launch.sbatch_args = ['--reservation=no-such-resv']: `sbatch --test-only` refuses" in out
    assert sh("squeue", "-h", "-o", "%i").split() == before and not (run_dir / "submission.json").exists()


def test_submit_inside_salloc_runs_in_the_allocation(batch, tiny_shards, tmp_path, home):
    config, run_dir = write_run(tmp_path, tiny_shards, "site-salloc", env={"MOETRAIN_SITE_VALUE": VALUE})
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 1))
    rc, out = run_submit(config, run_dir, home, prefix=["salloc", "--nodes=2", "--ntasks-per-node=2",
                                                        "--cpus-per-task=1", "--time=10", "--job-name=my-salloc"])
    assert rc == 0, out + task_logs(run_dir)
    assert "inside SLURM allocation" in out and "no new job is submitted" in out
    ranks = seen(run_dir)
    alloc = ranks[0]["job"]
    assert {r["job"] for r in ranks} == {alloc} and all(r["step"] not in (None, "batch") for r in ranks)
    assert all(r["value"] == VALUE for r in ranks)
    jobs = sh("sacct", "-X", "-n", "-P", "-S", start, "-o", "JobID,JobName").splitlines()
    assert [j.split("|") for j in jobs if j.split("|")[1] != "site-batch"] == [[alloc, "my-salloc"]], \
        f"one job, the allocation: {jobs}"
    assert losses(run_dir) == pytest.approx(losses(batch["run_dir"]), rel=1e-5)


def test_calibrate_inside_salloc_measures_as_a_step_of_the_allocation(tiny_shards, tmp_path, home):
    config, run_dir = write_run(tmp_path, tiny_shards, "site-calibrate")
    out = tmp_path / "calibrated.yaml"
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 1))
    res = subprocess.run(["salloc", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10",
                          "--job-name=my-calibrate-alloc", sys.executable, "-m", "moetrain.calibrate", "--config",
                          str(config), "--out", str(out), "--seconds", "0.05", "--collective-budget", "0.5"],
                         cwd=ROOT, env=env_for(run_dir, home), capture_output=True, text=True, timeout=300)
    logs = "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted((run_dir / "calibrate").glob("*.err")))
    assert res.returncode == 0, res.stdout + res.stderr + logs
    assert "calibrate: inside SLURM allocation" in res.stdout and "no new job" in res.stdout, res.stdout
    jobs = [j.split("|") for j in sh("sacct", "-X", "-n", "-P", "-S", start, "-o", "JobID,JobName").splitlines()]
    assert [j for j in jobs if j[1].startswith(("site-", "my-calibrate"))] == [[jobs[-1][0], "my-calibrate-alloc"]], \
        f"one job, the allocation: {jobs}"
    from moetrain.topology.cluster import load_profile

    prof = load_profile(out)
    assert prof.calibration["world_size"] == 4 and prof.calibration["hosts"] == ["n1", "n2"]
    assert len(prof.collective_gb_s) >= 2, "the collectives inside a node and across the two"


def test_failed_attempt_restarts_within_the_allocation(batch, tiny_shards, tmp_path, home):
    config, run_dir = write_run(tmp_path, tiny_shards, "site-salloc-kill")
    cfg = yaml.safe_load(config.read_text())
    cfg["checkpoint"].update({"every": 5, "resume": True})
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, out = run_submit(config, run_dir, home, prefix=["salloc", "--nodes=2", "--ntasks-per-node=2",
                                                        "--cpus-per-task=1", "--time=10"],
                         MOETRAIN_TEST_KILL="1:8")
    assert rc == 0, out + task_logs(run_dir)
    assert "event: restarting from the latest complete checkpoint (restart 1 of 3)" in out, out
    assert "rank(s) 1 died" in out.split("event: restarting")[1].splitlines()[0], "the cause names the killed rank"
    jobs = {r["job"] for r in seen(run_dir)}
    assert len(jobs) == 1, "both attempts are steps of one allocation"
    assert losses(run_dir) == pytest.approx(losses(batch["run_dir"]), rel=1e-5)


@pytest.fixture(scope="module")
def image() -> str:
    tag, why = container_image.build()  # ImageError (a broken image) fails the test; no runtime skips it
    if tag is None:
        pytest.skip(f"no container runtime here: {why}")
    return tag


def test_unmounted_data_is_refused_before_submitting(tiny_shards, tmp_path, home):
    config, run_dir = write_run(tmp_path, tiny_shards, "site-unmounted",
                                container={"runtime": "podman", "image": "localhost/any", "mounts": ["/opt:/opt"]})
    rc, out = run_submit(config, run_dir, home, timeout_s=120)
    assert rc == 2, out
    assert (f"config error: launch.container.mounts = ['/opt:/opt']: data.path = {tiny_shards} is not mounted in the "
            f"container") in out and f"Fix: add {tiny_shards}:{tiny_shards}" in out


def test_podman_container_run(batch, image, tiny_shards, tmp_path, home):
    config, run_dir = write_run(tmp_path, tiny_shards, "site-podman", env={"MOETRAIN_SITE_VALUE": VALUE},
                                container={"runtime": "podman", "image": image, "python": sys.executable,
                                           "mounts": [*container_image.mounts(), f"{tiny_shards}:{tiny_shards}:ro"],
                                           "runtime_args": container_image.RUNTIME_ARGS})
    rc, out = run_submit(config, run_dir, home)
    assert rc == 0, out + task_logs(run_dir)
    ranks = seen(run_dir)
    assert len(ranks) == 4 and all(r["container"] for r in ranks), ranks
    assert all(r["value"] == VALUE for r in ranks)
    script = next((run_dir / "logs").glob("*_submission.sh")).read_text()
    assert "podman run --rm --network=host --ipc=host" in script and image in script
    assert losses(run_dir) == pytest.approx(losses(batch["run_dir"]), rel=1e-5)
