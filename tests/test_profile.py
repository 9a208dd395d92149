"""``train.profile``: torch.profiler traces of chosen steps, their named ranges, and the monitor's
per-phase table (moetrain/train/profile.py, moetrain/ranges.py)."""

from __future__ import annotations

import json

import pytest

from moetrain import ranges
from moetrain.monitor import main as monitor
from moetrain.train.profile import phase_table, trace_files
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed


def profiled_run(rank: int, world: int, data: str, run_dir: str, parallel: dict, model: dict) -> None:
    cfg = tiny_config(data, run_dir, parallel=parallel, model=model,
                      train={"steps": 4, "profile": {"start": 2, "steps": 2, "ranks": []}})
    Trainer(cfg, write_files=False).run()


def names_in(path) -> set[str]:
    return {e["name"] for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"}


@pytest.mark.slow
def test_traces_name_every_phase_and_the_monitor_splits_each_step(tiny_shards, tmp_path, capsys):
    """dp2 × ep2, ZeRO-3: one trace per rank for steps 2-3 with the step, forward, backward and optimizer
    ranges, each dispatch / combine all-to-all and its wait, FSDP's gather and reduction; the
    monitor's table gives each rank 2 steps whose compute, communication and idle shares add up
    to 1, with time in compute and in communication."""
    run_dir = tmp_path / "run"
    run_distributed(profiled_run, 2, str(tiny_shards), str(run_dir), {"dp": 2, "ep": 2, "zero_stage": 3}, {})
    files = trace_files(run_dir)
    assert [f.name for f in files] == ["rank00000.steps2-3.json", "rank00001.steps2-3.json"]
    for f in files:
        names = names_in(f)
        for want in (ranges.STEP, ranges.FORWARD, ranges.BACKWARD, ranges.OPTIMIZER, ranges.DISPATCH,
                     ranges.DISPATCH + ranges.WAIT, ranges.COMBINE + ranges.WAIT,
                     ranges.DISPATCH + "_backward" + ranges.WAIT, ranges.COMBINE + "_backward" + ranges.WAIT,
                     "FSDP::all_gather", "FSDP::post_backward_reduce"):
            assert want in names, (f.name, want)
    assert monitor([str(run_dir), "--profile", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["steps"] == 2 and r["source"] == "cpu"
        assert r["compute"] + r["communication"] + r["idle"] == pytest.approx(1.0)
        assert r["compute"] > 0.2 and r["communication"] > 0
        assert 0 < r["forward_ms"] < r["step_ms"] and 0 < r["backward_ms"] < r["step_ms"] and r["optimizer_ms"] > 0
    assert monitor([str(run_dir), "--profile"]) == 0
    assert "compute" in capsys.readouterr().out


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
@pytest.mark.slow
def test_pipeline_traces_mark_each_stage_s_forward_backward_and_transfers(schedule, tiny_shards, tmp_path):
    """pp2 (torch's 1F1B schedule, and interleaved 1F1B on moetrain's runtime): the stages'
    forwards and backwards are ranges, the activations' sends and receives are collectives."""
    run_dir = tmp_path / "pp"
    vs = 2 if schedule == "interleaved_1f1b" else 1
    run_distributed(profiled_run, 2, str(tiny_shards), str(run_dir),
                    {"pp": 2, "dp": 1, "pp_schedule": schedule, "virtual_stages": vs}, {"layers": 4})
    for f in trace_files(run_dir):
        names = names_in(f)
        assert {ranges.FORWARD, ranges.BACKWARD, ranges.OPTIMIZER} <= names, f.name
        assert any("send" in n for n in names) and any("recv" in n for n in names), f.name
    rows = phase_table(run_dir)
    assert len(rows) == 2 and all(r["communication"] > 0 and r["compute"] > 0.2 for r in rows)


def test_the_table_counts_hidden_communication_as_compute(tmp_path):
    """A synthetic trace: step [0, 100] µs; forward [0, 40] with a wait [10, 30] nested in it; a
    backward in another thread [20, 60]; the optimizer [70, 80]; collectives in flight over
    [30, 35] (under compute) and [85, 95]. Compute: [0, 10], [20, 60], [70, 80] = 60;
    communication nothing overlapped: [10, 20] and [85, 95] = 20; idle: 20."""
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": ranges.STEP, "ts": 0, "dur": 100, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": ranges.FORWARD, "ts": 0, "dur": 40, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": ranges.DISPATCH + ranges.WAIT, "ts": 10, "dur": 20,
         "pid": 1, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": ranges.BACKWARD, "ts": 20, "dur": 40, "pid": 1, "tid": 2},
        {"ph": "X", "cat": "user_annotation", "name": ranges.OPTIMIZER, "ts": 70, "dur": 10, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "gloo:all_to_all", "ts": 30, "dur": 5, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "ts": 85, "dur": 10, "pid": 1, "tid": 1},
    ]
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "rank00003.steps1-1.json").write_text(json.dumps({"traceEvents": ev}))
    (row,) = phase_table(tmp_path)
    assert row["rank"] == 3 and row["step_ms"] == pytest.approx(0.1)
    assert (row["compute"], row["communication"], row["idle"]) == pytest.approx((0.6, 0.2, 0.2))
    assert row["forward_ms"] == pytest.approx(0.04) and row["backward_ms"] == pytest.approx(0.04)


def test_a_run_without_traces_says_how_to_get_them(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    assert monitor([str(tmp_path), "--profile"]) == 2
    assert "set train.profile" in capsys.readouterr().err
