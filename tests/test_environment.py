"""Each attempt's environment in its run directory: the git state of the source tree, versions,
each rank's variables; the change between attempts as a warning and an event; the monitor's view."""

from __future__ import annotations

import importlib.metadata
import logging
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

import moetrain
from moetrain import monitor
from moetrain.train import environment
from moetrain.train.environment import (collect_environment, read_environment, record_environment,
                                        summarize_environment)
from moetrain.train.records import Fence, read_events

ROOT = Path(__file__).resolve().parents[1]
GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "commit.gpgsign=false"]

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(cwd: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout


def source_repo(tmp_path: Path) -> Path:
    """A throwaway git work tree holding a committed ``moetrain`` package, clean."""
    src = tmp_path / "src"
    (src / "moetrain").mkdir(parents=True)
    (src / "moetrain" / "__init__.py").write_text('__version__ = "0.0.1"\n')
    git(src, "init", "-q")
    git(src, "add", ".")
    git(src, "commit", "-q", "-m", "first")
    return src


def new_attempt(run: Path) -> Fence:
    run.mkdir(parents=True, exist_ok=True)
    return Fence(run, Fence.advance(run, "job", 0))


@needs_git
def test_collect_environment_of_this_repository():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("this checkout is not a git work tree")
    rec = collect_environment()
    status = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True).stdout
    assert rec["git"]["commit"] == head.stdout.strip()
    assert rec["git"]["dirty"] is bool(status.strip())
    assert rec["git"]["reason"] is None
    assert rec["moetrain"] == moetrain.__version__
    assert rec["python"] == platform.python_version()
    assert rec["packages"]["torch"] == importlib.metadata.version("torch")
    assert rec["packages"]["numpy"] == importlib.metadata.version("numpy")


def test_a_copy_outside_git_has_no_commit(tmp_path):
    src = tmp_path / "copy"
    shutil.copytree(ROOT / "moetrain", src / "moetrain", ignore=shutil.ignore_patterns("__pycache__"))
    git_state = collect_environment(src)["git"]
    assert git_state["commit"] is None and git_state["dirty"] is None
    assert git_state["reason"] in ("git is not installed",) or git_state["reason"].startswith(
        ("not a git work tree", "the moetrain package in"))


@needs_git
def test_an_untracked_copy_inside_another_repository_has_no_commit(tmp_path):
    # A virtualenv inside some project: the project's commit is not moetrain's.
    outer = tmp_path / "project"
    outer.mkdir()
    (outer / "README").write_text("x")
    git(outer, "init", "-q")
    git(outer, "add", ".")
    git(outer, "commit", "-q", "-m", "project")
    shutil.copytree(ROOT / "moetrain", outer / "venv" / "moetrain", ignore=shutil.ignore_patterns("__pycache__"))
    git_state = collect_environment(outer / "venv")["git"]
    assert git_state["commit"] is None
    assert "not tracked" in git_state["reason"]


@needs_git
def test_dirty_tree_writes_its_diff(tmp_path):
    src = source_repo(tmp_path)
    run = tmp_path / "run"
    fence = new_attempt(run)
    rec = record_environment(run, fence.seq, 0, fence=fence, source_dir=src)
    assert rec["git"]["commit"] == git(src, "rev-parse", "HEAD").strip()
    assert rec["git"]["dirty"] is False and rec["git"]["diff_file"] is None
    assert not (run / "environment" / "attempt0.diff").exists()

    (src / "moetrain" / "__init__.py").write_text('__version__ = "0.0.2"\n')
    fence = new_attempt(run)
    rec = record_environment(run, fence.seq, 0, fence=fence, source_dir=src)
    assert rec["git"]["dirty"] is True and rec["git"]["status"] == [" M moetrain/__init__.py"]
    assert rec["git"]["diff_file"] == "environment/attempt1.diff"
    diff = (run / "environment" / "attempt1.diff").read_text()
    assert '+__version__ = "0.0.2"' in diff and '-__version__ = "0.0.1"' in diff
    assert "diff" not in read_environment(run, 1)["git"]  # the text lives in the .diff file only
    assert summarize_environment(rec)[0] == (f"code: moetrain {moetrain.__version__}, commit "
                                             f"{rec['git']['commit'][:12]} (dirty: diff in environment/attempt1.diff)")
    # Clean → dirty is a change of the record, with the new diff's hash.
    [event] = [e for e in read_events(run) if e["event"] == "environment_changed"]
    assert event["changed"]["dirty"] == ["false", "true"]
    assert event["changed"]["diff"] == [None, rec["git"]["diff_sha256"][:12]]


@needs_git
def test_diff_is_cut_at_the_cap(tmp_path, monkeypatch):
    src = source_repo(tmp_path)
    (src / "moetrain" / "__init__.py").write_text("x = 1\n" * 5000)
    monkeypatch.setattr(environment, "DIFF_CAP_BYTES", 1000)
    run = tmp_path / "run"
    fence = new_attempt(run)
    rec = record_environment(run, fence.seq, 0, fence=fence, source_dir=src)
    assert rec["git"]["diff_cut"] is True and rec["git"]["diff_bytes"] == 1000
    text = (run / "environment" / "attempt0.diff").read_text()
    assert text.endswith("the tree's full diff is longer\n")


@needs_git
def test_version_change_between_attempts_is_one_event(tmp_path, monkeypatch, caplog):
    src = source_repo(tmp_path)
    run = tmp_path / "run"
    packages = {"numpy": "2.4.6"}
    monkeypatch.setattr(environment, "_package_versions", lambda: dict(packages))

    def attempt(torch_version: str) -> list[dict]:
        packages["torch"] = torch_version
        fence = new_attempt(run)
        rec = record_environment(run, fence.seq, 0, fence=fence, source_dir=src)
        assert rec["packages"]["torch"] == torch_version
        return [e for e in read_events(run) if e["event"] == "environment_changed"]

    assert attempt("2.11.0") == []
    [first] = attempt("2.12.0")
    assert (first["attempt"], first["previous_attempt"], first["changed"]) == (1, 0, {"torch": ["2.11.0", "2.12.0"]})
    assert len(attempt("2.12.0")) == 1  # alike to attempt 1, the latest: nothing new

    (run / "environment" / "attempt2.json").unlink()  # attempt 3 compares with the latest recorded: 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moetrain.train.environment"):
        events = attempt("2.13.0")
    assert len(events) == 2
    assert (events[1]["attempt"], events[1]["previous_attempt"]) == (3, 1)
    assert events[1]["changed"] == {"torch": ["2.12.0", "2.13.0"]}
    assert [r.getMessage() for r in caplog.records] == ["environment changed since attempt 1: torch 2.12.0 → 2.13.0"]


@needs_git
def test_every_rank_writes_what_it_saw(tmp_path, monkeypatch):
    src = source_repo(tmp_path)
    run = tmp_path / "run"
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("MY_SETTING", "42")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    monkeypatch.setenv("LOCAL_RANK", "1")
    fence = new_attempt(run)
    assert record_environment(run, fence.seq, 1, extra_names={"MY_SETTING": "42", "HF_TOKEN": "x"},
                              fence=fence, source_dir=src) is None
    assert not (run / "environment" / "attempt0.json").exists()  # rank 0's alone
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert record_environment(run, fence.seq, 0, fence=fence, source_dir=src)["attempt"] == 0
    ranks = environment.read_rank_environments(run, 0)
    assert [(r["rank"], r["local_rank"], r["attempt"]) for r in ranks] == [(0, 0, 0), (1, 1, 0)]
    one = ranks[1]["variables"]
    assert one["NCCL_DEBUG"] == "INFO" and one["MY_SETTING"] == "42" and one["LOCAL_RANK"] == "1"
    assert one["HF_TOKEN"] == environment.REDACTED
    assert "UNRELATED_SETTING" not in one and "MY_SETTING" not in ranks[0]["variables"]
    assert read_environment(run)["attempt"] == 0


def test_a_failed_write_does_not_end_the_run(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / "environment").write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING, logger="moetrain.train.environment"):
        assert record_environment(run, 0, 0, source_dir=tmp_path) is None
    assert any("could not record the environment of attempt 0" in r.getMessage() for r in caplog.records)
    assert any("could not record rank 0's environment" in r.getMessage() for r in caplog.records)


def test_summary_of_a_gpu_cluster_record():
    rec = {"attempt": 3, "moetrain": "0.1.0", "python": "3.11.7", "packages": {"torch": "2.5.1"},
           "cuda": "12.4", "nccl": "2.21.5", "cudnn": "90100", "host": "n1", "slurm_job_id": "77",
           "slurm_nodes": "n[1-2]", "gpus": ["NVIDIA H100 80GB HBM3"] * 8, "driver": "550.54.15",
           "git": {"commit": "abcdef0123456789", "dirty": False}}
    assert summarize_environment(rec) == [
        "code: moetrain 0.1.0, commit abcdef012345 (clean)",
        "python 3.11.7, torch 2.5.1 (CUDA 12.4, NCCL 2.21.5, cuDNN 90100)",
        "nodes: n[1-2] (job 77); GPUs on n1: 8 × NVIDIA H100 80GB HBM3, driver 550.54.15"]
    other = {**rec, "driver": "560.35.03", "gpus": ["NVIDIA H100 80GB HBM3"] * 4}
    assert environment.environment_changes(rec, other) == {
        "gpu": ["8 × NVIDIA H100 80GB HBM3", "4 × NVIDIA H100 80GB HBM3"], "driver": ["550.54.15", "560.35.03"]}


@needs_git
def test_monitor_shows_the_latest_attempts_environment(tmp_path, monkeypatch, capsys):
    src = source_repo(tmp_path)
    run = tmp_path / "run"
    for local, hca in ((0, "mlx5_0"), (1, "mlx5_1")):
        monkeypatch.setenv("NCCL_IB_HCA", hca)
        monkeypatch.setenv("RANK", str(local))  # differs between ranks by design: not reported
        fence = Fence(run, 0) if local else new_attempt(run)
        record_environment(run, 0, local, fence=fence, source_dir=src)
    commit = git(src, "rev-parse", "HEAD").strip()

    text = monitor.render(monitor.collect(run))
    assert (f"environment (attempt 0):\n  code: moetrain {moetrain.__version__}, commit {commit[:12]} (clean)\n"
            f"  python {platform.python_version()}, torch {importlib.metadata.version('torch')} (CUDA") in text

    assert monitor.main([str(run), "--environment"]) == 0
    out = capsys.readouterr().out
    assert f"commit {commit}" in out
    assert "  NCCL_IB_HCA=mlx5_0" in out and "  RANK=0" in out
    assert "2 rank(s) recorded; 1 saw something else:" in out
    assert "rank(s) 1 on " in out and ": NCCL_IB_HCA=mlx5_1 (rank 0: mlx5_0)" in out
    assert "RANK=1" not in out

    assert monitor.main([str(tmp_path / "src"), "--environment"]) == 2  # no record there


def test_format_event_names_the_change():
    from moetrain.submit import format_event

    event = {"event": "environment_changed", "attempt": 4, "previous_attempt": 3,
             "changed": {"torch": ["2.12.0", "2.13.0"], "commit": ["0123456789abcdef", "fedcba9876543210"],
                         "torchao": ["0.18.0", None]}}
    assert format_event(event) == ("the environment differs from attempt 3's: torch 2.12.0 → 2.13.0, "
                                   "commit 0123456789ab → fedcba987654, torchao 0.18.0 → -")
