"""Metrics sinks: TensorBoard event files read back with TensorBoard's own reader equal
metrics.jsonl; a W&B run in offline mode; a missing extra is refused with the fix; the console
line has elapsed time and ETA; ``monitor --plot`` writes a figure that opens."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from moetrain import monitor, submit
from moetrain.config import ConfigError
from moetrain.train.metrics import check_sinks_installed, flat_scalars
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed

STEPS = 4


def train(rank: int, world: int, data: str, run_dir: str, metrics: dict) -> str:
    cfg = tiny_config(data, run_dir, train={"steps": STEPS, "val_every": 2}, metrics=metrics)
    return Trainer(cfg, job_id="sinks").run()


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_equals_metrics_jsonl_and_plot_opens(tiny_shards, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    assert run_distributed(train, 1, str(tiny_shards), str(run_dir), {"tensorboard": True}) == ["done"]
    recs = records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    expected: dict[str, dict[int, float]] = {}
    for r in recs:
        for tag, value in flat_scalars(r).items():
            expected.setdefault(tag, {})[r["step"]] = value
    assert {"train/loss", "train/aux_loss", "train/z_loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
            "train/tflops_per_device", "train/mem_gib", "train/eta_s", "val/loss",
            "expert_load/0/max_over_mean", "expert_load/1/max_over_mean"} <= set(expected), sorted(expected)
    assert set(acc.Tags()["scalars"]) == set(expected)
    for tag, by_step in expected.items():
        got = {e.step: e.value for e in acc.Scalars(tag)}
        assert set(got) == set(by_step), tag
        for step, value in by_step.items():
            assert got[step] == pytest.approx(value, rel=1e-6, abs=1e-12), f"{tag} at step {step}"
    assert sorted(expected["val/loss"]) == [2, 4]
    for layer in ("0", "1"):
        hist = {e.step: e.histogram_value for e in acc.Histograms(f"expert_load/{layer}/tokens")}
        for r in recs:
            tokens = r["expert_load"][layer]["tokens"]
            assert hist[r["step"]].num == len(tokens) and hist[r["step"]].sum == pytest.approx(sum(tokens))

    line = submit.format_metrics(recs[-1], STEPS)
    assert f"step {STEPS}/{STEPS}" in line and " elapsed, eta 0m00s" in line, line

    pytest.importorskip("matplotlib")
    import matplotlib.image

    out = tmp_path / "run.png"
    assert monitor.main([str(run_dir), "--plot", str(out)]) == 0
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (900, 800) and image.std() > 0.01, "an empty figure"


def test_wandb_offline(tiny_shards, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    metrics = {"wandb": {"project": "moetrain-test", "mode": "offline"}}
    assert run_distributed(train, 1, str(tiny_shards), str(run_dir), metrics) == ["done"]
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    assert offline.name.endswith((run_dir / "wandb_id.txt").read_text())
    rows = wandb_history(next(offline.glob("*.wandb")))
    recs = records(run_dir)
    assert [int(r["train/step"]) for r in rows] == [r["step"] for r in recs]
    for row, rec in zip(rows, recs):
        for tag, value in flat_scalars(rec).items():
            assert float(row[tag]) == pytest.approx(value), f"{tag} at step {rec['step']}"
        for layer, load in rec["expert_load"].items():  # histogram: counts of experts per bin
            assert row[f"expert_load/{layer}/tokens/_type"] == "histogram"
            assert sum(row[f"expert_load/{layer}/tokens/values"]) == len(load["tokens"])


def wandb_history(path: Path) -> list[dict]:
    """The history rows of a W&B run file: a LevelDB-style log (32 KiB blocks of records with a
    7-byte header: crc32, length, type full/first/middle/last) after a 7-byte ":W&B" file header,
    each record a ``wandb_internal_pb2.Record``."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, pos, buf, rows = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # block padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or last fragment
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in rec.history.item})
    return rows


def test_missing_extras_are_refused_with_the_fix(tiny_shards, tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a))
    with pytest.raises(ConfigError, match=r"metrics.tensorboard = True: TensorBoard is not installed. "
                                          r"Fix: pip install 'moetrain\[tensorboard\]'"):
        check_sinks_installed(tiny_config(tiny_shards, tmp_path, metrics={"tensorboard": True}))
    with pytest.raises(ConfigError, match=r"metrics.wandb = .*pip install 'moetrain\[wandb\]'"):
        check_sinks_installed(tiny_config(tiny_shards, tmp_path, metrics={"wandb": {"project": "p"}}))
    config = tmp_path / "run.yaml"
    config.write_text(f"data: {{path: {tiny_shards}}}\nmodel: {{vocab_size: 257}}\n")
    assert submit.main(["--config", str(config), "--set", "metrics.tensorboard=true", "--dry-run"]) == 2
    assert "pip install 'moetrain[tensorboard]'" in capsys.readouterr().err
