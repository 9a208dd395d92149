"""Blends of several sources: the same global batches in every layout, exact resumption (also with
a changed blend), per-source counts and validation losses in the metrics, epochs of a small
source, and the refusals of mismatched or corrupt sources (moetrain/data/loader.py, trainer)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from moetrain.config import to_dict
from moetrain.data.loader import BatchLoader, DataSource
from moetrain.data.reader import TokenShards
from moetrain.data.writer import write_shards
from moetrain.submit import main as submit_main

from conftest import ByteTokenizer, _documents, tiny_config
from multiproc import run_distributed


class OtherTokenizer(ByteTokenizer):
    """The same ids as ByteTokenizer, but another tokenizer's identity (sha256)."""

    identity = {"name": "other-bytes", "vocab_size": 257, "sha256": hashlib.sha256(b"other").hexdigest()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Three sources: "web" (~90k tokens), "code" (~28k), "math" (small: 84 samples of 16 tokens,
    so a few steps of 8 samples run through it)."""
    root = tmp_path_factory.mktemp("blend")
    out = {}
    for name, docs, seed in (("web", 160, 0), ("code", 50, 1), ("math", 4, 2)):
        write_shards(_documents(docs, seed), ByteTokenizer(), root / name, shard_tokens=8_000, val_docs=1,
                     progress=False)
        out[name] = root / name
    return out


def blend(sources: dict[str, Path], weights: dict[str, float]) -> list[dict]:
    return [{"path": str(sources[n]), "weight": w} for n, w in weights.items()]


def _loader(sources, weights, dp_rank=0, dp=1, global_batch=16) -> BatchLoader:
    return BatchLoader([DataSource(n, TokenShards(sources[n], "train", verify="none"), w) for n, w in weights.items()],
                       16, global_batch, 2, dp_rank, dp, seed=5)


WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}


def test_global_batch_is_the_same_in_every_dp_layout_and_resumes_exactly(sources):
    one = _loader(sources, WEIGHTS)
    whole = [np.concatenate([mb.inputs.numpy() for mb in one.next_batch()]) for _ in range(12)]
    for dp in (2, 4):
        ranks = [_loader(sources, WEIGHTS, r, dp) for r in range(dp)]
        for step in range(12):
            got = np.concatenate([mb.inputs.numpy() for r in ranks for mb in r.next_batch()])
            assert np.array_equal(got, whole[step]), f"dp={dp} step {step + 1}"
    # Resume at step 5 in a new loader (another process, another layout): the same batches on.
    first = _loader(sources, WEIGHTS)
    for _ in range(5):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint's manifest keeps it
    resumed = _loader(sources, WEIGHTS, 1, 2)
    assert resumed.load_state_dict(state) is None
    other = _loader(sources, WEIGHTS, 0, 2)
    other.load_state_dict(state)
    for step in range(5, 12):
        got = np.concatenate([mb.inputs.numpy() for r in (other, resumed) for mb in r.next_batch()])
        assert np.array_equal(got, whole[step]), f"resumed step {step + 1}"
    # Counts follow the weights within the schedule's bound and add up.
    counts = one.consumed_samples_by_source()
    assert sum(counts.values()) == one.consumed_samples == 12 * 16
    for name, w in WEIGHTS.items():
        assert abs(counts[name] - w * one.consumed_samples) <= 2


def test_a_changed_blend_continues_each_source_from_its_own_count(sources):
    first = _loader(sources, WEIGHTS)
    for _ in range(4):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    before = state["consumed_samples_by_source"]
    changed = _loader(sources, {"web": 0.5, "code": 0.5})  # math removed, code up
    message = changed.load_state_dict(state)
    assert message is not None and "math 0.2 → removed" in message and "code 0.3 → 0.5" in message
    for _ in range(3):
        changed.next_batch()
    after = changed.consumed_samples_by_source()
    assert after["math"] == before["math"]  # kept, not trained
    assert after["web"] - before["web"] + after["code"] - before["code"] == 3 * 16
    assert abs((after["code"] - before["code"]) - 24) <= 2
    # A second resume keeps the new anchor: no further change reported, the same batches.
    again = _loader(sources, {"web": 0.5, "code": 0.5})
    assert again.load_state_dict(json.loads(json.dumps(changed.state_dict()))) is None
    cont = _loader(sources, {"web": 0.5, "code": 0.5})
    cont.load_state_dict(json.loads(json.dumps(changed.state_dict())))
    assert np.array_equal(again.next_batch()[0].inputs, cont.next_batch()[0].inputs)


def test_resuming_with_the_sources_reordered_or_from_one_source_keeps_each_order(sources):
    """The schedule's ties depend on the order of the sources: the same sources listed in another
    order re-anchor (no sample repeated or skipped); a one-source run that becomes a blend keeps
    its source's shuffle key, so the epoch in progress goes on in the same order."""
    ab = _loader(sources, {"web": 1, "code": 1, "math": 1})
    for _ in range(2):
        ab.next_batch()  # 32 samples: web 11, code 11, math 10 (ties go to the first)
    state = json.loads(json.dumps(ab.state_dict()))
    reordered = _loader(sources, {"math": 1, "code": 1, "web": 1})
    message = reordered.load_state_dict(state)
    assert message is not None and "another order" in message
    assert reordered.consumed_samples_by_source() == state["consumed_samples_by_source"]
    # One source (data.path: shuffle key ""), then the same source in a blend.
    one = BatchLoader(TokenShards(sources["web"], "train", verify="none"), 16, 16, 2, 0, 1, seed=5)
    for _ in range(3):
        one.next_batch()
    state = json.loads(json.dumps(one.state_dict()))
    alone = BatchLoader(TokenShards(sources["web"], "train", verify="none"), 16, 16, 2, 0, 1, seed=5)
    alone.load_state_dict(state)
    expected = np.concatenate([mb.inputs.numpy() for mb in alone.next_batch()])  # its next 16 samples
    blended = BatchLoader([DataSource("web", TokenShards(sources["web"], "train", verify="none"), 0.5),
                           DataSource("code", TokenShards(sources["code"], "train", verify="none"), 0.5)],
                          16, 16, 2, 0, 1, seed=5)
    assert "code (new)" in blended.load_state_dict(state)
    got = np.concatenate([mb.inputs.numpy() for mb in blended.next_batch()])
    from_web = [row for row in got if any(np.array_equal(row, e) for e in expected)]
    assert len(from_web) == 8  # web's 8 of these 16 are the next 8 of its order before the change


def test_a_checkpoint_of_the_stored_permutation_order_resumes_with_a_warning(sources):
    old = {"consumed_samples": 48, "seed": 5, "seq_len": 16}  # what checkpoints held before blends
    loader = BatchLoader(TokenShards(sources["web"], "train", verify="none"), 16, 16, 2, 0, 1, seed=5)
    message = loader.load_state_dict(old)
    assert message is not None and "may repeat or skip" in message
    assert loader.consumed_samples_by_source() == {"web": 48}
    loader.next_batch()
    assert loader.consumed_samples_by_source() == {"web": 64}


def train_blend(rank: int, world: int, cfg_dict: dict, n_steps: int, save: bool) -> dict:
    from moetrain.config import config_from_dict
    from moetrain.train.trainer import Trainer

    trainer = Trainer(config_from_dict(cfg_dict))
    start = trainer.step
    results = [trainer.train_step() for _ in range(n_steps)]
    val = trainer.evaluate()
    if save:
        trainer.save_checkpoint()
    return {"start": start, "losses": [r.loss for r in results], "val": val,
            "by_source": [r.extra["consumed_samples_by_source"] for r in results]}


def run_blend(rank: int, world: int, cfg_dict: dict) -> str:
    from moetrain.config import config_from_dict
    from moetrain.train.trainer import Trainer

    return Trainer(config_from_dict(cfg_dict)).run()


def _cfg(sources, run_dir, weights, parallel=None, steps=12) -> dict:
    cfg = tiny_config(sources["web"], run_dir, data={"path": None, "blend": blend(sources, weights)},
                      parallel=parallel or {}, train={"steps": steps, "val_every": 4},
                      checkpoint={"resume": True, "every": 0})
    return to_dict(cfg)


@pytest.mark.slow
def test_blended_training_resumes_in_another_layout_like_uninterrupted(sources, tmp_path):
    """dp2 × ep2 for 6 steps, checkpoint, then one process for 6 more: the losses, the counts by
    source and the validation losses by source equal one uninterrupted process's."""
    whole = run_distributed(train_blend, 1, _cfg(sources, tmp_path / "whole", WEIGHTS), 12, False)[0]
    split = tmp_path / "split"
    first = run_distributed(train_blend, 2, _cfg(sources, split, WEIGHTS, {"dp": 2, "ep": 2}), 6, True)[0]
    second = run_distributed(train_blend, 1, _cfg(sources, split, WEIGHTS), 6, False)[0]
    assert second["start"] == 6
    for step, (a, b) in enumerate(zip(first["losses"] + second["losses"], whole["losses"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs uninterrupted {b}"
    assert first["by_source"] + second["by_source"] == whole["by_source"]
    val, by_source = second["val"]
    assert set(by_source) == set(WEIGHTS)
    assert abs(val - sum(WEIGHTS[n] * v for n, v in by_source.items())) < 1e-9
    for n, v in by_source.items():
        assert abs(v - whole["val"][1][n]) <= 1e-5 * abs(v)
    # 12 steps of 8 samples, 20 % from "math": 19.2.
    assert whole["by_source"][-1]["math"] in (19, 20)


@pytest.mark.slow
def test_metrics_events_and_checkpoints_carry_the_sources(sources, tmp_path):
    """Through the trainer's own files: every metrics row has consumed_samples_by_source, an
    evaluation row val_loss_by_source; the small source's new epochs are announced once each;
    the checkpoint keeps the counts; a resume with another blend says what changed."""
    small = {"math": 0.8, "web": 0.2}  # math's 84 samples at 6.4 a step: it runs out in steps 14 and 27
    run_dir = tmp_path / "run"
    assert run_distributed(run_blend, 1, _cfg(sources, run_dir, small, steps=30))[0] == "done"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    for r in rows:
        assert sum(r["consumed_samples_by_source"].values()) == r["consumed_samples"] == 8 * r["step"]
    assert {r["step"] for r in rows if "val_loss_by_source" in r} == {4, 8, 12, 16, 20, 24, 28, 30}
    epochs = [e for e in events if e["event"] == "data_epoch"]
    assert [(e["source"], e["epoch"], e["step"], e["samples"]) for e in epochs] == [("math", 2, 14, 84),
                                                                                      ("math", 3, 27, 84)]
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    state = json.loads((ckpt / "manifest.json").read_text())["train_state"]
    assert state["consumed_samples_by_source"] == rows[-1]["consumed_samples_by_source"]
    # Resume with another blend: the event says what changed, each source continues.
    run_distributed(run_blend, 1, _cfg(sources, run_dir, {"math": 0.5, "web": 0.5}, steps=32))
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    changed = [e for e in events if e["event"] == "data_changed"]
    assert len(changed) == 1 and "math 0.8 → 0.5" in changed[0]["changed"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    before, after = rows[29]["consumed_samples_by_source"], rows[-1]["consumed_samples_by_source"]
    assert after["math"] - before["math"] == 8 and after["web"] - before["web"] == 8


def test_a_mismatched_source_is_refused_before_anything_starts(sources, tmp_path, capsys):
    other = tmp_path / "other"
    write_shards(_documents(30, 9), OtherTokenizer(), other, shard_tokens=8_000, val_docs=1, progress=False)
    cfg = tiny_config(sources["web"], tmp_path / "run", data={"path": None, "blend": [
        {"path": str(sources["web"]), "weight": 1}, {"path": str(other), "weight": 1}]})
    config = tmp_path / "cfg.yaml"
    import yaml
    config.write_text(yaml.safe_dump(to_dict(cfg)))
    assert submit_main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "data.blend[1].path" in err[0] and "'other'" in err[0] and "tokenizer" in err[0] and "Fix:" in err[0]
    assert not (tmp_path / "run").exists()  # nothing written


def verify_only(rank: int, world: int, cfg_dict: dict) -> str:
    from moetrain.config import config_from_dict
    from moetrain.data.format import ShardError
    from moetrain.train.trainer import Trainer

    try:
        Trainer(config_from_dict(cfg_dict), write_files=False)
    except ShardError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_a_corrupt_source_fails_at_verification_naming_source_and_shard(sources, tmp_path):
    damaged = tmp_path / "code"
    damaged.mkdir()
    for f in sources["code"].iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    shard = damaged / "train_00001.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    weights = {"web": 0.5, "code": 0.5}
    cfg = _cfg({**sources, "code": damaged}, tmp_path / "run", weights, {"dp": 2})
    errors = run_distributed(verify_only, 2, cfg)
    for e in errors:
        assert e.startswith("data.blend[1] ('code')") and "train_00001.bin" in e and "sha256 mismatch" in e, e


@pytest.mark.parametrize("data, field", [
    ({"path": "a", "blend": [{"path": "b"}]}, "data.path"),
    ({"path": None, "blend": [{"path": "a/web", "weight": 0}]}, r"data.blend\[0\].weight"),
    ({"path": None, "blend": [{"path": "a/web"}, {"path": "b/web"}]}, r"data.blend\[1\].name = 'web'"),
    ({"path": None, "blend": [{"pth": "a/web"}]}, r"data.blend\[0\].pth.*did you mean data.blend\[0\].path"),
    ({"path": None, "blend": [{"path": ""}]}, r"data.blend\[0\].path"),
])
def test_bad_blends_are_refused_naming_the_field(data, field, tmp_path):
    from moetrain.config import ConfigError

    with pytest.raises(ConfigError, match=field):
        tiny_config(tmp_path, tmp_path, data=data)


def test_no_data_at_all_is_refused_where_data_is_read(tmp_path):
    from moetrain.config import ConfigError
    from moetrain.launch.preflight import resolve_vocab

    cfg = tiny_config(tmp_path, tmp_path, data={"path": None})  # the planner and the rank map need no data
    with pytest.raises(ConfigError, match="data.path = None: no training data"):
        resolve_vocab(cfg)


def test_the_same_tokenizer_under_another_name_is_accepted(sources, tmp_path):
    """Sources are compared by the tokenizer's sha256, not its name (that of its directory)."""
    from moetrain.data.sources import check_sources

    other = tmp_path / "web-copy"
    other.mkdir()
    for f in sources["web"].iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["name"] = "elsewhere/tokenizer.json"
    (other / "manifest.json").write_text(json.dumps(manifest))
    cfg = tiny_config(sources["web"], tmp_path, data={"path": None, "blend": [
        {"path": str(sources["web"])}, {"path": str(other)}]})
    assert check_sources(cfg.data, cfg.model.seq_len)["vocab_size"] == 257
