"""The run lifecycle on the real SLURM dev cluster (`slurm/dev-cluster up`), driven as a user
drives it: ``python -m moetrain.submit --config <yaml> [--detach]`` with ``launch.cluster: slurm``,
the tiny MoE of ``conftest.tiny_config`` on 2 nodes × 2 tasks (dp 4, ep 2), 30 steps.

Every interrupted run is compared with one uninterrupted run of the same config (the first test,
shared through a module fixture): the same loss at every step (1e-5 relative), every step exactly
once in ``metrics.jsonl``. The interruptions: ``scancel --signal=USR2``, a preemption by a job in
the ``high`` partition, a node failure (its slurmd killed and its tasks frozen), a hung rank, the
restart budget (``launch.max_restarts``), and the pre-timeout signal of a 2-minute time limit.

Fault injection through the jobs' environment (sbatch passes the submitting environment on):
``MOETRAIN_TEST_SLOW="<s>:<attempts>"`` idles ``s`` seconds before each step in the first
``attempts`` attempts, so that a signal lands mid-run (the steps themselves take ≈0.1 s);
``MOETRAIN_TEST_HANG="<rank>:<step>"`` makes a rank hang at a step.

About 5 minutes in all on 2 shared cores; the time-limit test alone ≈ 2.5 minutes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from moetrain.config import to_dict
from moetrain.train.records import read_events
from moetrain.train.checkpoint import list_checkpoints, verify_checkpoint

from conftest import require_slurm_cluster, tiny_config

pytestmark = pytest.mark.slurm

require_slurm_cluster()

ROOT = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("MOETRAIN_SLURM_DIR", "/var/tmp/moetrain-slurm"))
STEPS = 30
TEST_ENV = ("MOETRAIN_TEST_SLOW", "MOETRAIN_TEST_HANG")
ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "COMPLETING", "REQUEUE_HOLD", "CONFIGURING", "SUSPENDED"}


# ---------------------------------------------------------------------------------------------
# Helpers: config, submission, SLURM state, run directory
# ---------------------------------------------------------------------------------------------


def write_config(path: Path, shards: Path, run_dir: Path, name: str, **launch) -> Path:
    """The YAML a user would write: the tiny model, 2 nodes × 2 tasks, a checkpoint every 5 steps."""
    cfg = tiny_config(shards, run_dir, run={"name": name}, parallel={"dp": 4, "ep": 2},
                      train={"steps": STEPS}, checkpoint={"every": 5, "keep": 2, "resume": True},
                      launch={"cluster": "slurm", "nodes": 2, "time_min": 10, **launch})
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def _env(home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TEST_ENV}
    # The jobs import moetrain from this checkout (also when it is not pip-installed).
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["MOETRAIN_HOME"] = str(home)  # the job registry of `monitor JOB_ID`, away from ~/.cache
    env.update(extra)
    return env


def submit(config: Path, home: Path, *, detach: bool, **env: str) -> subprocess.Popen:
    """``python -m moetrain.submit --config CONFIG [--detach]``; output in ``<config>.out``."""
    cmd = [sys.executable, "-m", "moetrain.submit", "--config", str(config)] + (["--detach"] if detach else [])
    with open(config.with_suffix(".out"), "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(home, **env), stdout=out, stderr=subprocess.STDOUT)


def wait_for(cond, timeout_s: float, what: str, interval_s: float = 0.3):
    deadline = time.time() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def job_id_of(run_dir: Path, jobs: list[str], timeout_s: float = 60) -> str:
    """The job id `submit` recorded in the run directory (registered for clean-up)."""
    path = run_dir / "submission.json"
    wait_for(path.is_file, timeout_s, f"{path}")
    job = json.loads(path.read_text())["jobs"][-1]["job_id"]
    jobs.append(job)
    return job


def sh(*args: str, check: bool = True) -> str:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=60).stdout.strip()


def queued(job: str) -> str:
    """The job's state in squeue ('' once it has left the queue)."""
    return sh("squeue", "-h", "-j", job, "-o", "%T", check=False)


def instances(job: str) -> list[dict]:
    """Every instance of the job (requeues included) as sacct records it."""
    rows = sh("sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "State,Start,End,Elapsed,NodeList").splitlines()
    keys = ("state", "start", "end", "elapsed", "nodes")
    return [dict(zip(keys, r.split("|"))) for r in rows if r]


def wait_job_end(job: str, timeout_s: float) -> list[dict]:
    """Wait until the job has left the queue for good; returns its instances."""
    def ended():
        if queued(job):
            return None
        rows = instances(job)
        return rows if rows and rows[-1]["state"].split()[0] not in ACTIVE else None
    return wait_for(ended, timeout_s, f"job {job} to end", interval_s=1.0)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def events(run_dir: Path) -> list[str]:
    return [e["event"] for e in read_events(run_dir)]


def wait_steps(run_dir: Path, n: int, timeout_s: float = 120, attempt: int = 0) -> None:
    wait_for(lambda: sum(r.get("attempt") == attempt for r in metrics(run_dir)) >= n, timeout_s,
             f"{n} steps of attempt {attempt} in {run_dir / 'metrics.jsonl'}")


def logs(run_dir: Path, lines: int = 15) -> str:
    """The end of every task log, for failure messages."""
    out = []
    for p in sorted((run_dir / "logs").glob("*_log.*")):
        out.append(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(out)


def assert_same_losses(run_dir: Path, reference: list[float]) -> None:
    got = metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), \
        f"every step exactly once: {[r['step'] for r in got]}\n{logs(run_dir)}"
    for r, ref in zip(got, reference):
        assert abs(r["loss"] - ref) <= 1e-5 * abs(ref), f"step {r['step']}: loss {r['loss']} vs uninterrupted {ref}"


def assert_final_checkpoint(run_dir: Path) -> None:
    found = list_checkpoints(run_dir / "checkpoints")
    assert found and found[-1][0] == STEPS, found
    assert verify_checkpoint(found[-1][1])["step"] == STEPS


def monitor(run_dir: Path, home: Path) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "moetrain.monitor", str(run_dir), "--format", "json"], cwd=ROOT,
                          env=_env(home), capture_output=True, text=True, timeout=60)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def finish(proc: subprocess.Popen, config: Path, timeout_s: float) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"submit did not return within {timeout_s} s:\n{config.with_suffix('.out').read_text()}")
    return rc, config.with_suffix(".out").read_text()


def nodes_healthy() -> bool:
    states = sh("sinfo", "-h", "-N", "-n", "n1,n2", "-o", "%t", check=False).split()
    return len(states) >= 2 and all(s.rstrip("*") in ("idle", "mix", "alloc", "comp") and not s.endswith("*")
                                    for s in states)


def restore_nodes() -> None:
    """Restart a dead slurmd (`up` starts only what is not running) and resume its node."""
    subprocess.run([str(ROOT / "slurm" / "dev-cluster"), "up"], capture_output=True, timeout=120)
    for node in ("n1", "n2"):
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True, timeout=30)


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("moetrain-home")


@pytest.fixture
def jobs():
    """Job ids a test submits; whatever is still queued afterwards is cancelled, and the nodes are
    left up, so one failing test leaves the cluster healthy for the next."""
    ids: list[str] = []
    yield ids
    for job in ids:
        if queued(job):
            sh("scancel", job, check=False)
    for job in ids:
        wait_for(lambda: not queued(job), 60, f"job {job} to leave the queue", interval_s=0.5)
    if not nodes_healthy():
        restore_nodes()
        wait_for(nodes_healthy, 60, "nodes n1 and n2 to be up again", interval_s=1.0)


@pytest.fixture(scope="module")
def reference(tiny_shards, tmp_path_factory, home) -> dict:
    """One uninterrupted run through `submit` (following it to the end), shared by the tests."""
    tmp = tmp_path_factory.mktemp("reference")
    run_dir = tmp / "run"
    config = write_config(tmp / "tiny.yaml", tiny_shards, run_dir, "lifecycle-ref")
    t0 = time.time()
    proc = submit(config, home, detach=False)
    ids: list[str] = []
    try:
        job = job_id_of(run_dir, ids)
        rc, out = finish(proc, config, 300)
    finally:
        for j in ids:
            sh("scancel", j, check=False)
    return {"rc": rc, "out": out, "run_dir": run_dir, "job": job, "seconds": time.time() - t0,
            "losses": [r["loss"] for r in metrics(run_dir)]}


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_trains_to_the_end_on_two_nodes(reference):
    run_dir = reference["run_dir"]
    assert reference["rc"] == 0, reference["out"] + logs(run_dir)
    assert f"step {STEPS}/{STEPS}" in reference["out"] and "run done" in reference["out"]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, STEPS + 1))
    assert events(run_dir) == ["started", "finished"]
    assert [i["state"] for i in instances(reference["job"])] == ["COMPLETED"]
    beats = sorted(json.loads(p.read_text())["host"] for p in (run_dir / "heartbeats").glob("rank*.json"))
    assert beats == ["n1", "n1", "n2", "n2"], "2 nodes × 2 tasks"
    assert_final_checkpoint(run_dir)


def test_usr2_checkpoints_requeues_and_resumes(reference, tiny_shards, tmp_path, home, jobs):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml", tiny_shards, run_dir, "lifecycle-usr2")
    proc = submit(config, home, detach=False, MOETRAIN_TEST_SLOW="1:1")  # follows through the requeue
    job = job_id_of(run_dir, jobs)
    wait_steps(run_dir, 2)
    sh("scancel", "--signal=USR2", job)
    rc, out = finish(proc, config, 240)
    assert rc == 0 and "run done" in out, out + logs(run_dir)

    assert_same_losses(run_dir, reference["losses"])
    ev = read_events(run_dir)
    assert [e["event"] for e in ev] == ["started", "stopped", "requeue", "resumed", "started", "recovered",
                                        "finished"], ev
    stopped, requeue, resumed = ev[1], ev[2], ev[3]
    assert stopped["reason"] == "SIGUSR2" and requeue["ok"] is True and requeue["cause"] == "SIGUSR2"
    assert resumed["step"] == stopped["step"] and resumed["attempt"] == 1, "resumed from the stop's checkpoint"
    assert [i["state"] for i in instances(job)] == ["REQUEUED", "COMPLETED"]
    assert_final_checkpoint(run_dir)


def test_preemption_by_high_partition(reference, tiny_shards, tmp_path, home, jobs):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml", tiny_shards, run_dir, "lifecycle-preempt", partition="low")
    assert submit(config, home, detach=True, MOETRAIN_TEST_SLOW="1:1").wait(60) == 0, config.with_suffix(".out")
    job = job_id_of(run_dir, jobs)
    wait_steps(run_dir, 2)
    high = sh("sbatch", "--parsable", "-p", "high", "-N", "2", "--exclusive", f"--output={tmp_path / 'high.out'}",
              "--job-name=lifecycle-high", "--wrap", "sleep 5")
    jobs.append(high)
    low = wait_job_end(job, 240)
    assert [i["state"] for i in low] == ["REQUEUED", "COMPLETED"], f"{low}\n{logs(run_dir)}"
    (high_run,) = instances(high)
    assert high_run["state"] == "COMPLETED"
    assert low[0]["end"] <= high_run["start"] <= high_run["end"] <= low[1]["start"], \
        f"the high job ran in between the low job's attempts: {low} {high_run}"

    ev = read_events(run_dir)
    assert [e["event"] for e in ev] == ["started", "stopped", "requeue", "resumed", "started", "recovered",
                                        "finished"], ev
    assert ev[1]["reason"] == "SIGUSR2", "preempt_send_user_signal delivers the job's --signal"
    assert_same_losses(run_dir, reference["losses"])
    assert_final_checkpoint(run_dir)


def _task_pids(run_dir: Path, node: str, job: str, supervisors: bool = False) -> list[int]:
    """Pids of this job's ranks on ``node`` (from the heartbeats: each task's child process, see
    moetrain.launch.supervisor), checked against /proc; ``supervisors``: the tasks themselves."""
    pids = []
    where = run_dir / "supervisors" / job if supervisors else run_dir / "heartbeats"
    for p in where.glob("rank*.json"):
        beat = json.loads(p.read_text())
        if beat["host"] == node and beat.get("attempt", 0) == 0:
            cmdline = Path(f"/proc/{beat['pid']}/cmdline").read_bytes().decode(errors="replace")
            environ = Path(f"/proc/{beat['pid']}/environ").read_bytes().split(b"\0")
            want = "submitit.core._submit" if supervisors else "moetrain.launch.supervisor"
            assert want in cmdline and f"SLURM_JOB_ID={job}".encode() in environ, cmdline
            pids.append(beat["pid"])
    return pids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_node_failure_requeues_and_resumes(reference, tiny_shards, tmp_path, home, jobs):
    """slurmd of n2 killed and n2's tasks frozen (a node that stopped answering): SLURM marks n2
    DOWN, the job NODE_FAIL, and requeues it; it resumes from the step-5 checkpoint once n2 is
    back, dropping the metrics of the steps after it, which run again."""
    if os.geteuid() != 0:
        pytest.skip("killing a slurmd needs root (the dev cluster's daemons run as root)")
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml", tiny_shards, run_dir, "lifecycle-nodefail")
    assert submit(config, home, detach=True, MOETRAIN_TEST_SLOW="1:1").wait(60) == 0, config.with_suffix(".out")
    job = job_id_of(run_dir, jobs)
    wait_steps(run_dir, 7)  # past the step-5 checkpoint
    frozen = _task_pids(run_dir, "n2", job)
    assert len(frozen) == 2, frozen
    slurmd = int((STATE / "run" / "slurmd-n2.pid").read_text())
    assert Path(f"/proc/{slurmd}/comm").read_text().strip() == "slurmd"
    try:
        os.kill(slurmd, signal.SIGKILL)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: sh("sinfo", "-h", "-n", "n2", "-o", "%t").startswith("down"), 90, "n2 to be DOWN")
        wait_for(lambda: queued(job) == "PENDING", 60, f"job {job} to be requeued")
        assert instances(job)[0]["state"] == "NODE_FAIL"
        # The monitor sees a requeued job, not a failing one.
        rc, st = monitor(run_dir, home)
        assert (rc, st["state"]) == (0, "running"), st
        assert any("NODE_FAIL" in w and "requeued" in w for w in st["warnings"]), st["warnings"]
    finally:
        restore_nodes()  # restarts slurmd n2, whose registration ends the job's leftover tasks there
    runs = wait_job_end(job, 180)
    assert [i["state"] for i in runs] == ["NODE_FAIL", "COMPLETED"], f"{runs}\n{logs(run_dir)}"
    for pid in frozen:
        if _alive(pid):  # never expected: SLURM kills a requeued job's tasks on a returning node
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"task {pid} of the failed attempt was still alive after the job finished")

    ev = read_events(run_dir)
    resumed = [e for e in ev if e["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] == 5 and resumed[0]["attempt"] == 1, ev
    assert ev[-1]["event"] == "finished"
    assert_same_losses(run_dir, reference["losses"])
    assert {r["attempt"] for r in metrics(run_dir) if r["step"] > 5} == {1}, "steps after the checkpoint rerun"
    assert_final_checkpoint(run_dir)

    rc, st = monitor(run_dir, home)
    assert (rc, st["state"], st["step"], st["total_steps"]) == (0, "done", STEPS, STEPS), st
    assert [j["state"] for j in st["jobs"]] == ["NODE_FAIL", "COMPLETED"], "each instance and its end"
    assert [(e["event"], e["step"]) for e in st["restarts"]] == [("resumed", 5)], st["restarts"]
    assert {h["attempt"] for h in st["heartbeats"]} == {1}, "every rank's heartbeat is the new attempt's"


def test_sigkill_of_one_rank_restarts_inside_the_job_with_the_same_losses(reference, tiny_shards, tmp_path, home,
                                                                          jobs):
    """One rank SIGKILLed mid-run (past the step-5 checkpoint) on a node that stays up: the other
    ranks fail on the lost connection and record it; every task's supervisor is alive, so the
    ranks restart inside the job (no requeue), resume from the latest complete checkpoint and end
    with the uninterrupted run's losses."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml", tiny_shards, run_dir, "lifecycle-sigkill")
    proc = submit(config, home, detach=False, MOETRAIN_TEST_SLOW="0.5:1")  # follows through the requeue
    job = job_id_of(run_dir, jobs)
    wait_steps(run_dir, 7)
    victim = json.loads((run_dir / "heartbeats" / "rank00003.json").read_text())
    assert victim["pid"] in _task_pids(run_dir, victim["host"], job)
    os.kill(victim["pid"], signal.SIGKILL)
    rc, out = finish(proc, config, 240)
    assert rc == 0 and "run done" in out, out + logs(run_dir)

    assert_same_losses(run_dir, reference["losses"])
    ev = read_events(run_dir)
    assert [e["event"] for e in ev] == ["started", "restart", "resumed", "started", "recovered", "finished"], ev
    restart, resumed, recovered = ev[1], ev[2], ev[4]
    assert restart["in_job"] is True and restart["cause"].startswith("rank(s) 3 died without an error"), restart
    assert resumed["step"] in (5, 10) and resumed["attempt"] == 1, resumed
    assert "event: restarting from the latest complete checkpoint (restart 1 of 3): rank(s) 3 died" in out, out
    runs = instances(job)
    assert [i["state"] for i in runs] == ["COMPLETED"], "one instance: no requeue"
    # A restart inside the job is one start-up of the ranks, plus the failure's detection and a
    # checkpoint load: bounded by this job's own first start-up (SLURM's start of the job to the
    # trainer's "started") plus 20 s, so that a slower machine scales both sides (a wait on a
    # collective's timeout, minutes, still fails it).
    first_startup = ev[0]["time"] - datetime.fromisoformat(runs[0]["start"]).timestamp()
    assert recovered["seconds"] < first_startup + 20, (recovered, first_startup)
    assert_final_checkpoint(run_dir)
    rc, st = monitor(run_dir, home)
    assert (rc, st["state"]) == (0, "done") and [e["event"] for e in st["restarts"]] == ["restart", "resumed"]


def test_hung_rank_is_detected_and_its_node_excluded(tiny_shards, tmp_path, home, jobs):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml", tiny_shards, run_dir, "lifecycle-hang",
                          heartbeat_min_timeout_s=10, heartbeat_timeout_factor=5)
    assert submit(config, home, detach=True, MOETRAIN_TEST_HANG="3:5").wait(60) == 0, config.with_suffix(".out")
    job = job_id_of(run_dir, jobs)
    wait_for(lambda: "requeue" in events(run_dir), 120, f"the hang to be handled\n{logs(run_dir)}")
    wait_for(lambda: queued(job) == "PENDING", 60, f"job {job} to be requeued")

    ev = read_events(run_dir)
    assert [e["event"] for e in ev] == ["started", "hang", "requeue"], ev
    hang, requeue = ev[1], ev[2]
    assert hang["suspects"] == [3] and hang["nodes"] == ["n2"], hang
    assert requeue == {**requeue, "cause": "hang", "excluded": ["n2"], "ok": True}
    # Detected within the configured time: 10 s without progress (max(10 s, 5 × ~0.1 s)), then
    # 5 s for every rank to dump its stacks before the suspects are named.
    last_step = metrics(run_dir)[-1]
    assert last_step["step"] == 4
    assert 10 + 5 - 1 <= hang["time"] - last_step["time"] <= 10 + 5 + 10, hang["time"] - last_step["time"]
    for rank in range(4):
        text = (run_dir / "stacks" / f"attempt0-rank{rank:05d}.txt").read_text()
        dump = json.loads((run_dir / "stacks" / f"attempt0-rank{rank:05d}.json").read_text())
        assert "Thread" in text and "in run" in text, text  # faulthandler's dump, through Trainer.run
        assert dump["waiting_on_peers"] == (rank != 3), dump
    assert (run_dir / "exclude_nodes.txt").read_text().split() == ["n2"]
    info = sh("scontrol", "show", "job", job)
    assert "ExcNodeList=n2" in info and "Restarts=1" in info and "JobState=PENDING" in info, info
    assert "JobHeldUser" not in info, "released after the exclusion"

    rc, st = monitor(run_dir, home)
    assert any("hang(s) detected; suspected nodes ['n2']" in w for w in st["warnings"]), st["warnings"]
    # Only 2 nodes and one excluded: the job cannot run again; the `jobs` fixture cancels it.


def test_max_restarts_respected(tiny_shards, tmp_path, home, jobs):
    """launch.max_restarts=1: the first USR2 requeues, the second stops for good, with the reason."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml", tiny_shards, run_dir, "lifecycle-restarts", max_restarts=1)
    proc = submit(config, home, detach=False, MOETRAIN_TEST_SLOW="1:2")
    job = job_id_of(run_dir, jobs)
    wait_steps(run_dir, 2)
    sh("scancel", "--signal=USR2", job)
    wait_steps(run_dir, 1, attempt=1)
    sh("scancel", "--signal=USR2", job)
    rc, out = finish(proc, config, 240)
    assert rc == 1, out
    assert "RestartsExhausted" in out and "launch.max_restarts=1 reached" in out, out

    ev = read_events(run_dir)
    assert [e["event"] for e in ev] == ["started", "stopped", "requeue", "resumed", "started", "recovered", "stopped",
                                        "gave_up"], ev
    assert ev[-1]["reason"] == "launch.max_restarts=1 reached" and ev[-1]["attempt"] == 1
    runs = wait_job_end(job, 60)
    assert [i["state"] for i in runs] == ["REQUEUED", "FAILED"], runs
    last = list_checkpoints(run_dir / "checkpoints")[-1]
    assert last[0] == ev[-2]["step"] and verify_checkpoint(last[1]), "a resubmission can resume from it"

    rc, st = monitor(run_dir, home)
    assert (rc, st["state"]) == (1, "gave_up"), st
    assert [e["event"] for e in st["restarts"]] == ["stopped", "requeue", "resumed", "stopped", "gave_up"]
    assert any("the run gave up: launch.max_restarts=1 reached" in w for w in st["warnings"]), st["warnings"]


def test_time_limit_signal_checkpoints_requeues_and_resumes(reference, tiny_shards, tmp_path, home, jobs):
    """``launch.time_min=2``: SLURM sends the --signal=USR2@signal_delay_s at its periodic check
    (every 30 s), i.e. up to 30 s before the time asked for, and ends a job that is still running
    at the first check past its limit. With signal_delay_s=5 the signal arrives 85-115 s after the
    start and the job ends 120-150 s after it: the ranks have at least 2 minutes to start, take a
    step and checkpoint, and stop with at least 5 s of the first attempt's 30 × 4-s steps left.
    The signal lands mid-run after the ranks' start-up (≈ 13 s alone on a 2-core Zen 3), and may
    land during it on a loaded machine (over 2 minutes there beside a test whose ranks kept 130
    gloo groups each: docs/development.md), where the ranks note it and stop at their first step
    (``catch_stop_signals``). The resumed attempt is fast and may get a signal of its own; either
    way the losses are the uninterrupted run's. The first attempt ends REQUEUED, not TIMEOUT:
    the requeue was the ranks', before SLURM's limit took the job."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "tiny.yaml", tiny_shards, run_dir, "lifecycle-timelimit", time_min=2,
                          signal_delay_s=5)
    proc = submit(config, home, detach=False, MOETRAIN_TEST_SLOW="4:1")
    job = job_id_of(run_dir, jobs)
    rc, out = finish(proc, config, 540)
    assert rc == 0 and "run done" in out, out + logs(run_dir)

    ev = read_events(run_dir)
    kinds = [e["event"] for e in ev]
    assert kinds[:4] == ["started", "stopped", "requeue", "resumed"] and kinds[-1] == "finished", ev
    assert ev[1]["reason"] == "SIGUSR2" and ev[2]["ok"] is True
    runs = instances(job)
    assert [i["state"] for i in runs[:-1]] == ["REQUEUED"] * (len(runs) - 1) and runs[-1]["state"] == "COMPLETED"
    assert_same_losses(run_dir, reference["losses"])
    assert_final_checkpoint(run_dir)
