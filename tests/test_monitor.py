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


def small_run(path: Path, losses: list[float], tokens_per_s: float, finished: bool) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": 10}}))
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "loss": loss, "tokens_per_s": tokens_per_s, "step_time_s": 1000 / tokens_per_s,
                    **({"val_loss": loss + 0.1} if i == len(losses) - 1 else {})}) + "\n"
        for i, loss in enumerate(losses)))
    events = [{"time": 1.0, "event": "started", "attempt": 0}]
    if finished:
        events.append({"time": 2.0, "event": "finished", "attempt": 0, "step": len(losses)})
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_list_shows_every_registered_run_newest_first(tmp_path, monkeypatch, capsys):
    from moetrain.monitor import main

    monkeypatch.setenv("MOETRAIN_HOME", str(tmp_path / "home"))
    a = small_run(tmp_path / "a", [5.0, 4.0], 1000.0, finished=False)
    b = small_run(tmp_path / "b", [5.0, 4.5, 4.2], 2000.0, finished=True)
    register_job("11", a)
    register_job("12", b)
    register_job("13", tmp_path / "gone")
    assert main(["--list", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [Path(r["run_dir"]).name for r in rows] == ["gone", "b", "a"]
    assert [r["state"] for r in rows] == ["missing", "done", "running"]
    assert (rows[1]["step"], rows[1]["loss"], rows[1]["last_event"], rows[1]["jobs"]) == (3, 4.2, "finished", ["12"])
    assert main(["--list"]) == 0
    text = capsys.readouterr().out
    assert "3/10" in text and "4.2000" in text and "finished" in text


def test_compare_puts_runs_side_by_side(tmp_path, capsys):
    from moetrain.monitor import main

    a = small_run(tmp_path / "a", [5.0, 4.0], 1000.0, finished=True)
    b = small_run(tmp_path / "b", [5.0, 4.5, 4.2], 2000.0, finished=True)
    assert main([str(a), "--compare", str(b), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["steps"], r["loss"], r["val_loss"], r["tokens_per_s"]) for r in rows] == [(2, 4.0, 4.1, 1000.0),
                                                                                      (3, 4.2, 4.3, 2000.0)]
    assert rows[1]["loss_last10"] == (5.0 + 4.5 + 4.2) / 3 and rows[0]["step_s"] == 1.0
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        return
    out = tmp_path / "cmp.png"
    assert main([str(a), "--compare", str(b), "--plot", str(out)]) == 0
    assert out.stat().st_size > 1000
