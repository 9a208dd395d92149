"""Failures of a local run, driven as a user drives it (``python -m moetrain.submit --config X``):
a rank SIGKILLed mid-step → the command relaunches the run from its latest complete checkpoint
and it finishes with the uninterrupted run's losses; a corrupt checkpoint is skipped, said on the
console and in events.jsonl; a rank's own error (a truncated shard) is reported in a few lines —
rank, exception, message, log path — and not restarted.

The tiny MoE of ``conftest.tiny_config`` at dp 2 × ep 2 (2 processes), 12 steps, a checkpoint
every 4. Fault injection: ``MOETRAIN_TEST_KILL="<rank>:<step>"`` makes that rank SIGKILL itself
in the forward pass of that step, in the first attempt only; ``MOETRAIN_TEST_SLOW="<s>:1"`` idles
before each step of the first attempt. About 40 s on 2 shared cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moetrain.config import to_dict
from moetrain.monitor import collect, render
from moetrain.train.checkpoint import list_checkpoints
from moetrain.train.records import read_events
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 12, 4
PARALLEL = {"dp": 2, "ep": 2}


def config(shards: Path, run_dir: Path):
    return tiny_config(shards, run_dir, run={"name": "restart"}, parallel=PARALLEL, train={"steps": STEPS},
                       checkpoint={"every": EVERY, "keep": 2, "resume": True},
                       launch={"cluster": "local", "max_restarts": 2, "cpus_per_task": 1})


def submit(cfg, tmp: Path, **env: str) -> tuple[int, str]:
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                "MOETRAIN_HOME": str(tmp / "home"), **env}
    proc = subprocess.run([sys.executable, "-m", "moetrain.submit", "--config", str(path)], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def uninterrupted(rank: int, world: int, shards: str, run_dir: str) -> str:
    return Trainer(config(Path(shards), Path(run_dir)), job_id="reference").run()


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_sigkill_mid_step_restarts_with_the_same_losses_and_corrupt_checkpoint_is_skipped(tiny_shards, tmp_path):
    assert run_distributed(uninterrupted, 2, str(tiny_shards), str(tmp_path / "ref")) == ["done", "done"]
    reference = losses(tmp_path / "ref")

    run_dir = tmp_path / "run"
    # Steps of 0.3 s in the first attempt, so that the step-4 checkpoint commits before the kill.
    rc, out = submit(config(tiny_shards, run_dir), tmp_path, MOETRAIN_TEST_KILL="1:7", MOETRAIN_TEST_SLOW="0.3:1")
    assert rc == 0 and "run done" in out, out
    got = losses(run_dir)
    assert [s for s, _ in got] == list(range(1, STEPS + 1)), f"every step exactly once: {got}"
    for (step, a), (_, b) in zip(got, reference):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} after the restart vs {b} uninterrupted"

    # The cause, on the console and in events.jsonl; the monitor shows it.
    assert "rank(s) 1 died without an error" in out, out
    assert "event: restarting from the latest complete checkpoint (restart 1 of 2)" in out, out
    assert "event: resumed from" in out and "step_00000004 at step 4" in out, out
    ev = read_events(run_dir)
    assert [e["event"] for e in ev] == ["started", "restart", "resumed", "started", "recovered", "finished"], ev
    assert ev[1]["restart"] == 1 and "rank(s) 1 died" in ev[1]["cause"] and ev[2]["step"] == 4
    status = collect(run_dir)
    assert status.state == "done" and [e["event"] for e in status.restarts] == ["restart", "resumed"]
    assert "restart: " in render(status) and "rank(s) 1 died" in render(status)

    # A corrupt checkpoint: skipped with its reason, on the console and in events.jsonl.
    last = list_checkpoints(run_dir / "checkpoints")[-1][1]
    shard = sorted(last.glob("__0_*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    rc, out = submit(config(tiny_shards, run_dir), tmp_path)
    assert rc == 0, out
    assert f"event: skipped corrupt checkpoint {last}" in out and "sha256" in out, out
    assert "step_00000008 at step 8" in out, out
    skipped = [e for e in read_events(run_dir) if e["event"] == "checkpoint_skipped"]
    assert len(skipped) == 1 and skipped[0]["checkpoint"] == str(last) and "sha256" in skipped[0]["reason"]


@pytest.mark.slow
def test_rank_error_is_reported_in_a_few_lines_and_not_restarted(tiny_shards, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_shards, data)
    shard = data / "train_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-100])
    rc, out = submit(config(data, tmp_path / "run"), tmp_path)
    assert rc == 1, out
    lines = out[out.index("run failed:"):].splitlines()
    assert len(lines) <= 4, out
    assert lines[0].startswith("run failed: rank ") and "raised ShardError" in lines[0], out
    assert f"{shard}: size" in lines[0] and "truncated" in lines[0], out
    log_path = Path(lines[1].split("log (full traceback): ")[1])
    assert log_path.is_file() and "Traceback" in log_path.read_text(), log_path
    assert "Traceback" not in out, "the console shows the error, the traceback stays in the log"
    assert "restart" not in [e["event"] for e in read_events(tmp_path / "run")], "a rank's own error restarted"


def test_rendezvous_ports_avoid_the_ephemeral_range_and_change_between_attempts():
    """A port in Linux's ephemeral range (32768-60999) can be held by any outgoing connection on
    the node; rank 0's TCPStore then cannot listen (EADDRINUSE, seen in CI)."""
    from moetrain.launch.job import master_port

    ports = [master_port(str(job), restart) for job in range(2000) for restart in range(3)]
    assert 20000 <= min(ports) and max(ports) < 32768
    assert len(set(ports)) > 4500, "spread over the range (6000 uniform draws from 12768 give ~4790 distinct)"
    assert all(master_port(str(j), 0) != master_port(str(j), 1) for j in range(2000))


def test_diagnosis_names_the_cause_and_whether_a_restart_can_help():
    from moetrain.data.format import ShardError
    from moetrain.train.records import StaleAttemptError, diagnose, failure_kind

    def peer(rank, dead=()):
        return {"rank": rank, "kind": "peer", "type": "RuntimeError", "host": "n1", "log": f"log{rank}",
                "message": "[gloo/transport/tcp/pair.cc:553] Connection closed by peer", "dead_on_node": list(dead)}

    own = {"rank": 2, "kind": "error", "type": "ShardError", "host": "n2", "log": "log2",
           "message": "x.bin: the file is truncated\nsecond line"}
    d = diagnose([peer(0), peer(1), own], 4)
    assert not d.restartable and d.cause == "rank 2 (n2) raised ShardError: x.bin: the file is truncated"
    assert d.lines()[1] == "  log (full traceback): log2" and "rank(s) 0, 1 then failed" in d.lines()[2]
    d = diagnose([peer(0, dead=[3]), peer(1)], 4)  # rank 3 seen dead on its node; rank 2 still blocked
    assert d.restartable and d.dead == [3] and d.silent == [2] and d.cause.startswith("rank(s) 3 died")
    d = diagnose([peer(0), peer(1)], 2)
    assert d.restartable and d.cause.startswith("every rank failed in a collective")
    # Rank 0 could not bind the rendezvous port; the others waited to connect until the job ended.
    bind = {**peer(0), "type": "DistNetworkError", "message": "The server socket has failed to listen on any local "
            "network address. port: 60638, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"}
    d = diagnose([bind], 4)
    assert d.restartable and d.culprit is bind and d.dead == [] and d.silent == [1, 2, 3], d
    assert d.cause == ("rank 0 (n1) could not listen on the rendezvous port (address already in use: another process "
                       "holds it); the next attempt uses another port")
    assert failure_kind(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1")) == "peer"
    assert failure_kind(RuntimeError("Timed out waiting 600000ms for recv operation")) == "peer"
    assert failure_kind(ShardError("x.bin: sha256 mismatch")) == "error"
    assert failure_kind(StaleAttemptError("attempt 1 is stale: ... timed out")) == "error"


@pytest.mark.slow
def test_ctrl_c_prints_one_line_and_no_traceback(tiny_shards, tmp_path):
    """Ctrl-C in the terminal reaches the whole foreground process group (this command, submitit's
    local controller, the ranks): the console gets one line, not the controller's tracebacks."""
    import signal
    import time

    cfg = config(tiny_shards, tmp_path / "run").replace(train={"steps": 10_000}, launch={"max_restarts": 0})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "MOETRAIN_HOME": str(tmp_path / "home")}
    def as_a_terminal_starts_it() -> None:
        # SIGINT at its default and unblocked, as a shell starts a command, whatever this test
        # process inherited (a SIGINT blocked here is blocked in the command and its ranks, and
        # unblocked again only in those that start a multiprocessing resource tracker: the run
        # then ignores Ctrl-C, or fails instead of stopping — both seen in full-suite runs).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    proc = subprocess.Popen([sys.executable, "-m", "moetrain.submit", "--config", str(path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=as_a_terminal_starts_it)
    try:
        deadline = time.time() + 120
        while "step 2/" not in proc.stdout.readline():
            assert time.time() < deadline and proc.poll() is None, "the run did not start"
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err  # the console says why, should Ctrl-C ever end otherwise
    assert [line for line in err.splitlines() if line.strip()] == [
        "interrupted: cancelling the run (use --detach to leave it running)"], err
