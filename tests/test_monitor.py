"""The monitor reads a run directory: progress, restarts and causes, heartbeats, stalls."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from moetrain.monitor import collect, register_job, render, resolve_run_dir

ROOT = Path(__file__).resolve().parents[1]


def make_run(tmp: Path, now: float, beat_age: float) -> Path:
    run = tmp / "run"
    (run / "heartbeats").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": 100},
                                                     "launch": {"heartbeat_timeout_factor": 10,
                                                                "heartbeat_min_timeout_s": 30}}))
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(1, 41):
            f.write(json.dumps({"step": step, "loss": 5 - step / 100, "tokens_per_s": 1000.0, "step_time_s": 2.0,
                                "time": now - (40 - step) * 2}) + "\n")
    events = [{"time": now - 200, "event": "started", "attempt": 0},
              {"time": now - 150, "event": "stopped", "attempt": 0, "reason": "SIGUSR2", "step": 20},
              {"time": now - 149, "event": "requeue", "attempt": 0, "cause": "SIGUSR2", "ok": True},
              {"time": now - 100, "event": "resumed", "attempt": 1, "step": 20},
              {"time": now - 100, "event": "started", "attempt": 1}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    for r in range(2):
        (run / "heartbeats" / f"rank{r:05d}.json").write_text(json.dumps(
            {"rank": r, "host": "n1", "pid": 1, "attempt": 1, "step": 40, "phase": "train",
             "time": now - (beat_age if r == 1 else 1)}))
    return run


def test_healthy_run(tmp_path):
    now = time.time()
    st = collect(make_run(tmp_path, now, beat_age=2), now)
    assert (st.state, st.step, st.total_steps) == ("running", 40, 100)
    assert st.eta_s == 60 * 2.0
    assert [e["event"] for e in st.restarts] == ["stopped", "requeue", "resumed"]
    text = render(st, now)
    assert "40/100" in text and "SIGUSR2" in text and "rank    1" in text
    assert not st.warnings


def test_stalled_run_is_flagged(tmp_path):
    now = time.time()
    st = collect(make_run(tmp_path, now, beat_age=45), now)  # limit is max(30, 10 × 2 s) = 30 s
    assert st.state == "stalled"
    assert any("rank(s) 1@n1" in w for w in st.warnings)


def test_cli_by_job_id(tmp_path, monkeypatch):
    run = make_run(tmp_path, time.time(), beat_age=2)
    env = {"MOETRAIN_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    monkeypatch.setenv("MOETRAIN_HOME", env["MOETRAIN_HOME"])
    register_job("4242", run)
    assert resolve_run_dir("4242") == run.resolve()
    out = subprocess.run([sys.executable, "-m", "moetrain.monitor", "4242", "--format", "json"], cwd=ROOT,
                         capture_output=True, text=True, env={**env, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["step"] == 40
    bad = subprocess.run([sys.executable, "-m", "moetrain.monitor", "nope"], cwd=ROOT, capture_output=True,
                         text=True, env={**env, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert bad.returncode == 4 and "neither a run directory" in bad.stderr


def test_node_fail_then_pending_instance_reads_as_requeued(tmp_path, monkeypatch):
    # sacct may list the requeued instance as PENDING before it starts: the failed instance is
    # still the latest that ran, and a job SLURM still lists is waiting to restart, not failing.
    import moetrain.monitor as monitor

    now = time.time()
    run = make_run(tmp_path, now, beat_age=2)
    (run / "submission.json").write_text(json.dumps({"jobs": [{"job_id": "7"}]}))
    rows = [{"job_id": "7", "state": "NODE_FAIL", "exit_code": "0:0", "start": "", "end": "", "nodes": "n[1-2]"},
            {"job_id": "7", "state": "PENDING", "exit_code": "0:0", "start": "", "end": "", "nodes": "None"}]
    monkeypatch.setattr(monitor, "sacct_states", lambda ids: rows)
    monkeypatch.setattr(monitor, "slurm_job_queued", lambda job: True)
    st = collect(run, now)
    assert st.state == "running" and any("NODE_FAIL" in w and "requeued" in w for w in st.warnings), st.warnings
    monkeypatch.setattr(monitor, "slurm_job_queued", lambda job: False)
    st = collect(run, now)
    assert st.state == "failing" and st.warnings == ["job 7 is NODE_FAIL"], st.warnings
