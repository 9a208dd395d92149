"""Asynchronous, sharded checkpoints: training goes on while the write is held back; the
checkpoint holds the state of its step (resume equals the uninterrupted run, into another layout);
ZeRO-3 experts are saved as the shards they are (nothing gathered); every rank hashes only its
own files, at save and at resume; a failed write reaches every rank and commits nothing."""

from __future__ import annotations

import errno
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.tensor import DTensor

import moetrain.data.verify as verify
import moetrain.train.checkpoint as checkpoint
from moetrain.train.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint
from moetrain.train.trainer import Trainer
from moetrain.utils import sha256_file, split_by_bytes

from conftest import tiny_config
from multiproc import run_distributed

STOP, MORE = 3, 3
# dp4 × ep2 × ZeRO-3: each ep slice's 2 experts sharded over edp = 2 ranks (1 expert each).
FIRST = {"dp": 4, "ep": 2, "zero_stage": 3}
# dp3 × ZeRO-3 (ep 1): the 4 experts over 3 ranks, chunked unevenly (2, 2, 0).
SECOND = {"dp": 3, "zero_stage": 3}
TRAIN = {"steps": STOP + MORE, "micro_batch_size": 1, "global_batch_size": 12}


def record_hashes(calls: list[str]) -> None:
    """Count the files this process hashes (checkpoint and data alike)."""
    original = verify.sha256_file

    def counting(path, bar=None):
        calls.append(str(path))
        return original(path, bar)

    verify.sha256_file = counting
    checkpoint.sha256_file = counting


def save_while_training(rank: int, world: int, data: str, run_dir: str) -> dict:
    """Train STOP steps, start a checkpoint whose write is held back, train MORE steps, check it
    is not committed, release it, wait. The full tensors of experts are never computed."""
    hashed: list[str] = []
    record_hashes(hashed)
    gate = threading.Event()
    write_data = FileSystemWriter.write_data

    def held_write(self, plan, planner):
        gate.wait(120)
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = held_write

    def no_full_tensor(self, *args, **kwargs):
        raise AssertionError("full_tensor() called: an expert tensor was gathered")

    cfg = tiny_config(data, run_dir, parallel=FIRST, train=TRAIN, checkpoint={"resume": True, "async": True})
    trainer = Trainer(cfg, write_files=False)
    data_hashed = list(hashed)
    losses = [trainer.train_step().loss for _ in range(STOP)]
    hashed.clear()
    DTensor.full_tensor, full_tensor = no_full_tensor, DTensor.full_tensor
    path = trainer.save_checkpoint(wait=False)
    DTensor.full_tensor = full_tensor
    losses += [trainer.train_step().loss for _ in range(MORE)]  # collectives while the write is held
    committed_while_held = path.exists()
    dist.barrier()
    gate.set()
    assert trainer.checkpointer.wait() == path
    dist.barrier()
    return {"losses": losses, "committed_while_held": committed_while_held, "data_hashed": data_hashed,
            "ckpt_hashed": [str(Path(h).relative_to(path.with_name(path.name + ".tmp-0"))) for h in hashed]}


def resume(rank: int, world: int, data: str, run_dir: str) -> dict:
    hashed: list[str] = []
    record_hashes(hashed)
    cfg = tiny_config(data, run_dir, parallel=SECOND, train=TRAIN, checkpoint={"resume": True})
    trainer = Trainer(cfg, write_files=False)
    verified = [Path(h).name for h in hashed if "step_" in h]
    return {"start": trainer.step, "verified": verified,
            "losses": [trainer.train_step().loss for _ in range(MORE)]}


@pytest.mark.slow
def test_async_sharded_save_while_training_then_resume_into_another_layout(tiny_shards, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_shards, data, ignore=shutil.ignore_patterns(".moetrain-verified.json"))  # no cache yet
    first = run_distributed(save_while_training, 4, str(data), str(tmp_path / "run"))
    assert not any(r["committed_while_held"] for r in first), "the step waited for the write"
    (step, path), = list_checkpoints(tmp_path / "run" / "checkpoints")
    manifest = verify_checkpoint(path)
    assert step == STOP and manifest["train_state"]["step"] == STOP

    # Every rank hashed exactly the files it wrote, and the manifest lists each rank's files.
    for r, res in enumerate(first):
        own = sorted(manifest["ranks"][str(r)])
        assert sorted(res["ckpt_hashed"]) == own, f"rank {r} hashed {res['ckpt_hashed']}, wrote {own}"
        assert f"rng/rank{r:05d}.pt" in own and all(f.startswith(f"__{r}_") or f.startswith("rng/")
                                                     or f == ".metadata" for f in own)
    assert sorted(sum((res["ckpt_hashed"] for res in first), [])) == sorted(manifest["files"])

    # The data shards were hashed once in all, each rank a disjoint share (the train split: no
    # validation in this config).
    data_files = sorted(str(p) for p in data.glob("train_*"))
    hashed = [h for res in first for h in res["data_hashed"]]
    assert sorted(hashed) == data_files and all(res["data_hashed"] for res in first), hashed

    # Experts are stored with their global shape [experts, ...], as the FSDP shards they were.
    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    w1 = meta["model.layers.0.moe.experts.w1"]
    assert tuple(w1.size)[0] == 4 and len(w1.chunks) == 4, w1.chunks  # 4 ranks, 1 expert each
    assert len(meta["optim.state.layers.0.moe.experts.w1.exp_avg"].chunks) == 4

    second = run_distributed(resume, 3, str(data), str(tmp_path / "run"))
    assert {r["start"] for r in second} == {STOP}
    for step, (a, b) in enumerate(zip(second[0]["losses"], first[0]["losses"][STOP:]), STOP + 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} after resume vs {b} uninterrupted"
    verified = [f for res in second for f in res["verified"]]
    assert sorted(verified) == sorted(Path(f).name for f in manifest["files"]), "each file verified once"


def fail_write(rank: int, world: int, data: str, run_dir: str, async_save: bool) -> str:
    write_data = FileSystemWriter.write_data

    def disk_full(self, plan, planner):
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = disk_full
    cfg = tiny_config(data, run_dir, parallel={"dp": 2}, checkpoint={"resume": True, "async": async_save})
    trainer = Trainer(cfg, write_files=False)
    trainer.train_step()
    try:
        trainer.save_checkpoint(wait=False)
        trainer.train_step()  # async: the failure shows at the next wait, not in the step
        trainer.checkpointer.wait()
    except (CheckpointError, OSError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_failed_write_reaches_every_rank_and_commits_nothing(async_save, tiny_shards, tmp_path):
    errors = run_distributed(fail_write, 2, str(tiny_shards), str(tmp_path), async_save)
    for r, err in enumerate(errors):
        assert "No space left on device" in err, f"rank {r}: {err}"
    assert list_checkpoints(tmp_path / "checkpoints") == [], "a failed checkpoint was committed"


def test_manifest_parts_and_verification_split(tmp_path):
    # Each rank's share of a checkpoint's files: disjoint, complete, about equal bytes.
    ck = tmp_path / "step_00000001"
    ck.mkdir()
    files = {}
    for i, size in enumerate([5000, 10, 3000, 3000, 20, 4000]):
        (ck / f"f{i}").write_bytes(bytes([i]) * size)
        files[f"f{i}"] = {"bytes": size, "sha256": sha256_file(ck / f"f{i}")}
    (ck / "manifest.json").write_text(json.dumps({"step": 1, "files": files}))
    owners = split_by_bytes([files[n]["bytes"] for n in sorted(files)], 3)
    assert sorted(set(owners)) == [0, 1, 2]
    for r in range(3):
        verify_checkpoint(ck, rank=r, world=3)
    (ck / "f1").write_bytes(b"x" * 10)  # altered, same size
    culprit = owners[sorted(files).index("f1")]
    for r in range(3):
        if r == culprit:
            with pytest.raises(CheckpointError, match="sha256"):
                verify_checkpoint(ck, rank=r, world=3)
        else:
            verify_checkpoint(ck, rank=r, world=3)  # not its file
