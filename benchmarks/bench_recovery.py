"""Seconds from a failure to the first step after recovery, on the SLURM dev cluster. Prints JSON.

Needs the dev cluster up (as root: a node failure kills a slurmd)::

    slurm/dev-cluster up
    python benchmarks/bench_recovery.py [--cases task,task-requeue,node] [--repeats 1]

Each case trains the tiny MoE of the tests (dp 4 × ep 2, 2 nodes × 2 tasks, 40 steps, a
checkpoint every 10) with ``python -m moetrain.submit``, idling 0.5 s before each step of the
first attempt so that the failure lands mid-run, and fails it after step 13:

* ``task``: one rank on n2 SIGKILLed (a process died on a healthy node): every task's
  supervisor is alive, so the ranks restart inside the job (``launch.restart_in_job``);
* ``task-requeue``: the same with ``launch.restart_in_job: false``: the job is requeued and starts
  again on both nodes;
* ``node``: n2's slurmd, both its tasks and their ranks SIGKILLed, the node left down; the job has
  ``launch.elastic: {min_nodes: 1}``: it is requeued without n2 and re-plans onto n1 alone
  (n2 is brought back after the first step of the recovered attempt).

For each, measured from outside: ``kill`` → ``detected`` (the first failure record a surviving
rank wrote), ``decided`` (the ``restart`` or ``requeue`` event), ``restarted`` (SLURM's start of
the next instance after a requeue, ``sacct``), ``first_step`` (the first metrics record of the
next attempt); and the
run's own ``recovered`` event (seconds since it noticed the failure). ``goal_s`` is 20 (kill to
first step).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import ByteTokenizer, _documents, tiny_config  # noqa: E402
from moetrain.config import to_dict  # noqa: E402
from moetrain.data.writer import write_shards  # noqa: E402
from moetrain.train.records import read_events, read_jsonl  # noqa: E402

STATE = Path(os.environ.get("MOETRAIN_SLURM_DIR", "/var/tmp/moetrain-slurm"))
GOAL_S = 20.0


def sh(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, timeout=60).stdout.strip()


def wait_for(cond, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval_s)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def restore_nodes() -> None:
    subprocess.run([str(ROOT / "slurm" / "dev-cluster"), "up"], capture_output=True, timeout=120)
    for node in ("n1", "n2"):
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True, timeout=30)


def one_case(case: str, shards: Path, work: Path) -> dict:
    run_dir = work / case / "run"
    launch = {"cluster": "slurm", "nodes": 2, "time_min": 10, "max_restarts": 2,
              "restart_in_job": case != "task-requeue"}
    if case == "node":
        launch["elastic"] = {"min_nodes": 1, "grow": False}
    cfg = tiny_config(shards, run_dir, run={"name": f"bench-recovery-{case}"}, parallel={"dp": 4, "ep": 2},
                      train={"steps": 40}, checkpoint={"every": 10, "keep": 2, "resume": True}, launch=launch)
    path = work / case / "run.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               MOETRAIN_HOME=str(work / "home"), MOETRAIN_TEST_SLOW="0.5:1",
               MOETRAIN_FAULT_HOOK=f"{ROOT / 'tests' / 'faults.py'}:install")
    proc = subprocess.Popen([sys.executable, "-m", "moetrain.submit", "--config", str(path)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and len(read_jsonl(metrics)) >= 13, 300, "13 steps")
    job = json.loads((run_dir / "submission.json").read_text())["jobs"][-1]["job_id"]
    # the ranks' heartbeats (child processes), and the tasks' supervisors (moetrain.launch.supervisor)
    beats = [json.loads(p.read_text()) for p in (run_dir / "heartbeats").glob("rank*.json")]
    tasks = [json.loads(p.read_text()) for p in (run_dir / "supervisors" / job).glob("rank*.json")]
    victims = [b["pid"] for b in beats if b["host"] == "n2"][: 1 if case.startswith("task") else 2]
    if case == "node":  # a failed node takes every process of the job on it
        victims += [b["pid"] for b in tasks if b["host"] == "n2"]
    killed = time.time()
    try:
        if case == "node":
            os.kill(int((STATE / "run" / "slurmd-n2.pid").read_text()), signal.SIGKILL)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        first = wait_for(lambda: next((r for r in read_jsonl(metrics) if r.get("attempt") == 1), None), 600,
                         "the first step after recovery")
    finally:
        if case == "node":
            restore_nodes()
    proc.wait(timeout=600)
    ev = read_events(run_dir)
    fails = [json.loads(p.read_text()) for p in (run_dir / "failures").glob("*/rank*.json")]
    starts = sh("sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "Start").splitlines()
    restarted = datetime.fromisoformat(starts[1]).timestamp() if len(starts) > 1 else None
    requeue = next(e for e in ev if e["event"] in ("requeue", "restart"))
    recovered = next((e for e in ev if e["event"] == "recovered"), {})
    return {"case": case, "kill_to_detected_s": round(min(f["time"] for f in fails) - killed, 2),
            "restart": "in the job" if requeue["event"] == "restart" else "requeue",
            "kill_to_decided_s": round(requeue["time"] - killed, 2),
            "kill_to_restarted_s": round(restarted - killed, 2) if restarted else None,
            "kill_to_first_step_s": round(first["time"] - killed, 2),
            "run_recovered_event_s": recovered.get("seconds"), "world_after": recovered.get("world_size"),
            "replanned": next((e["message"] for e in ev if e["event"] == "replanned"), None),
            "finished": ev[-1]["event"] == "finished"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="task,task-requeue,node")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-recovery-", dir="/tmp") as tmp:
        work = Path(tmp)
        write_shards(_documents(600), ByteTokenizer(), work / "shards", shard_tokens=100_000, val_docs=10,
                     progress=False)
        for i in range(args.repeats):
            for case in args.cases.split(","):
                r = one_case(case, work / "shards", work / f"{i}")
                print(json.dumps(r), file=sys.stderr, flush=True)
                results.append(r)
    by_case = {c: statistics.median(r["kill_to_first_step_s"] for r in results if r["case"] == c)
               for c in args.cases.split(",")}
    print(json.dumps({"goal_s": GOAL_S, "median_kill_to_first_step_s": by_case,
                      "meets_goal": {c: v <= GOAL_S for c, v in by_case.items()}, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
