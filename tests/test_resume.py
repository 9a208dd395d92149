"""Stop + resume gives the uninterrupted run's losses; checkpoints are atomic and verified."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moetrain.train.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed

TOTAL, STOP = 20, 10


def train_steps(rank: int, world: int, data: str, run_dir: str, parallel: dict, n_steps: int, save: bool) -> dict:
    cfg = tiny_config(data, run_dir, parallel=parallel, train={"steps": TOTAL},
                      checkpoint={"resume": True, "every": 0})
    trainer = Trainer(cfg, write_files=False)
    start = trainer.step
    losses = [trainer.train_step().loss for _ in range(n_steps)]
    if save:
        trainer.save_checkpoint()
    return {"start": start, "losses": losses, "consumed": trainer.loader.consumed_samples}


@pytest.fixture(scope="module")
def uninterrupted(tiny_shards, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    return run_distributed(train_steps, 2, str(tiny_shards), str(run_dir), {"dp": 2, "ep": 2}, TOTAL, False)[0]


@pytest.mark.parametrize("second", [{"dp": 2, "ep": 2}, {"dp": 4, "ep": 4}, {"dp": 1}],
                         ids=["same-layout", "to-dp4-ep4", "to-single-process"])
@pytest.mark.slow
def test_resume_matches_uninterrupted(second, uninterrupted, tiny_shards, tmp_path):
    first = run_distributed(train_steps, 2, str(tiny_shards), str(tmp_path), {"dp": 2, "ep": 2}, STOP, True)[0]
    assert first["start"] == 0
    resumed = run_distributed(train_steps, second["dp"], str(tiny_shards), str(tmp_path), second, TOTAL - STOP,
                              False)[0]
    assert_resumed_like_uninterrupted(first, resumed, uninterrupted, STOP)


def assert_resumed_like_uninterrupted(first: dict, resumed: dict, uninterrupted: dict, stop: int) -> None:
    """The resumed run started at ``stop``, and the two parts' losses equal the uninterrupted
    run's (1e-5 relative per step), with the same data position at the end."""
    assert resumed["start"] == stop, "did not resume from the checkpoint"
    losses = first["losses"] + resumed["losses"]
    for step, (a, b) in enumerate(zip(losses, uninterrupted["losses"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} after resume vs {b} uninterrupted"
    assert resumed["consumed"] == uninterrupted["consumed"]


def save_twice(rank: int, world: int, data: str, run_dir: str) -> None:
    cfg = tiny_config(data, run_dir, parallel={"dp": 2}, checkpoint={"resume": True, "keep": 2})
    trainer = Trainer(cfg, write_files=False)
    for _ in range(3):
        trainer.train_step()
        trainer.save_checkpoint()


def resume_step(rank: int, world: int, data: str, run_dir: str) -> int:
    cfg = tiny_config(data, run_dir, parallel={"dp": 2}, checkpoint={"resume": True})
    return Trainer(cfg, write_files=False).step


def test_corrupt_checkpoint_is_detected_and_skipped(tiny_shards, tmp_path):
    run_distributed(save_twice, 2, str(tiny_shards), str(tmp_path))
    ckpts = list_checkpoints(tmp_path / "checkpoints")
    assert [s for s, _ in ckpts] == [2, 3], "keep=2 must keep the last two"
    assert not list(Path(tmp_path / "checkpoints").glob("*.tmp-*")), "temporary directory left behind"
    latest = ckpts[-1][1]
    verify_checkpoint(latest)  # intact
    shard = sorted(latest.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        verify_checkpoint(latest)
    # Resuming skips the corrupt step-3 checkpoint and takes step 2.
    assert run_distributed(resume_step, 2, str(tiny_shards), str(tmp_path)) == [2, 2]
    # A truncated file is caught by its size.
    shard2 = sorted(ckpts[0][1].glob("*.distcp"))[0]
    shard2.write_bytes(shard2.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        verify_checkpoint(ckpts[0][1])


def test_incomplete_checkpoint_is_invisible(tmp_path):
    # A directory without the final name (still being written by some attempt) is never listed.
    (tmp_path / "step_00000005.tmp-0").mkdir()
    (tmp_path / "step_00000004").mkdir()  # no manifest: not complete
    assert list_checkpoints(tmp_path) == []
    manifest = tmp_path / "step_00000004" / "manifest.json"
    manifest.write_text(json.dumps({"files": {"missing.distcp": {"bytes": 1, "sha256": "0"}}}))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4]
    with pytest.raises(CheckpointError, match="missing"):
        verify_checkpoint(tmp_path / "step_00000004")


def lr_schedule_run(rank: int, world: int, data: str, run_dir: str, train: dict, n_steps: int) -> list[float]:
    cfg = tiny_config(data, run_dir, train={"warmup_steps": 1, **train}, checkpoint={"resume": True, "every": 0})
    trainer = Trainer(cfg)
    lrs = [trainer.train_step().lr for _ in range(n_steps)]
    trainer.save_checkpoint()
    return lrs


def test_extending_a_run_keeps_its_schedule_with_decay_steps_and_says_when_it_changes(tiny_shards, tmp_path):
    """Raising train.steps stretches the cosine over the steps already taken: the resumed run
    says so (log and event, with the fix); with train.decay_steps = the old steps it does not,
    and the learning rate goes on from where the old schedule was, to min_lr after it."""
    def events(run: Path) -> list[dict]:
        return [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
                if e["event"] == "schedule_changed"]

    first = run_distributed(lr_schedule_run, 1, str(tiny_shards), str(tmp_path / "a"), {"steps": 4}, 4)[0]
    for run in ("b", "c"):
        (tmp_path / run).mkdir()
        shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / run / "checkpoints")
    run_distributed(lr_schedule_run, 1, str(tiny_shards), str(tmp_path / "b"), {"steps": 8}, 1)
    changed = events(tmp_path / "b")
    assert len(changed) == 1 and changed[0]["step"] == 4
    assert "decay_steps 4 → 8" in changed[0]["changed"] and "train.decay_steps=4" in changed[0]["hint"]
    kept = run_distributed(lr_schedule_run, 1, str(tiny_shards), str(tmp_path / "c"), {"steps": 8, "decay_steps": 4},
                           4)[0]
    assert not events(tmp_path / "c")
    cfg = tiny_config(tiny_shards, tmp_path)
    assert first[-1] > cfg.train.min_lr and kept == [pytest.approx(cfg.train.min_lr)] * 4
