"""Where the step metrics go: ``metrics.jsonl``, TensorBoard, Weights & Biases; elapsed time and ETA.

Rank 0 builds one record per step from the host-side :class:`~moetrain.train.trainer.StepResult`
(the step's single host read already happened; nothing here touches the device) and hands it to
:class:`MetricSinks`, which writes it to every sink the ``metrics`` config section asks for:

* ``metrics.jsonl`` (always): the record as one JSON line;
* TensorBoard (``metrics.tensorboard: true``, the ``tensorboard`` extra): the same numbers as
  scalars — ``train/<key>`` for the step's scalars, ``val/loss``, ``expert_load/<layer>/max_over_mean``
  — and ``expert_load/<layer>/tokens``, a histogram of the tokens each expert received;
* Weights & Biases (``metrics.wandb: {project, mode}``, the ``wandb`` extra): the same names,
  against ``train/step``.

A sink whose package is missing is refused before anything starts, naming the extra to install
(:func:`check_sinks_installed`). After a restart the steps after the checkpoint run again:
``metrics.jsonl`` is truncated by the trainer, TensorBoard discards the old events from that step
on (``purge_step``), W&B plots against ``train/step`` so repeated steps overwrite on the chart.
A rollback inside an attempt (``train.anomaly``: ``rollback``) does the same through
:meth:`MetricSinks.rewind` and marks where it happened: a ``train/rollback`` scalar at the step
rolled back to, whose value is the step rolled back from.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import statistics
import time
import uuid
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from moetrain.config import Config, field_error, to_dict

if TYPE_CHECKING:  # torch is imported where used: the monitor and submit CLIs read this module
    import torch

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peak per GPU, TFLOP/s (vendor data sheets, SXM parts, no sparsity).
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "B200": 2250.0, "GB200": 2500.0,
                    "A100": 312.0, "A800": 312.0}

# Record keys that are per-step scalars (everything else is structure or bookkeeping).
SCALARS = ("loss", "mtp_loss", "indexer_loss", "aux_loss", "z_loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu", "mem_gib",
           "step_time_s", "dropped_fraction", "elapsed_s", "eta_s")


def device_peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """Peak TFLOP/s of one device for MFU: ``metrics.peak_tflops`` when set, else the CUDA
    device's dense bf16 peak looked up by name (:data:`PEAK_BF16_TFLOPS`), else ``None`` (CPU)."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((v for k, v in sorted(PEAK_BF16_TFLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def format_duration(seconds: float | None) -> str:
    """``75`` → ``1m15s``, ``3725`` → ``1h02m``; ``None`` → ``?``."""
    if seconds is None:
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class EtaClock:
    """Elapsed wall time of this attempt, and the time left: steps to go × the median of the last
    ``window`` intervals between step records (wall clock, so evaluation and checkpoint stalls
    count; the first interval is the step's own time)."""

    def __init__(self, total_steps: int, window: int = 20):
        self.total, self.t0, self.last = total_steps, time.time(), None
        self.intervals: deque[float] = deque(maxlen=window)

    def tick(self, step: int, step_time_s: float) -> tuple[float, float]:
        """Record step ``step``; returns (elapsed seconds, ETA seconds)."""
        now = time.time()
        self.intervals.append(step_time_s if self.last is None else now - self.last)
        self.last = now
        return now - self.t0, max(0, self.total - step) * statistics.median(self.intervals)


def flat_scalars(rec: dict) -> dict[str, float]:
    """The record's numbers under the names the sinks use: ``train/<key>`` (:data:`SCALARS`),
    ``val/loss``, ``val/loss/<source>``, ``data/consumed_samples/<source>``,
    ``expert_load/<layer>/max_over_mean``."""
    out = {f"train/{k}": float(rec[k]) for k in SCALARS if rec.get(k) is not None}
    if rec.get("val_loss") is not None:
        out["val/loss"] = float(rec["val_loss"])
    for name, loss in (rec.get("val_loss_by_source") or {}).items():
        out[f"val/loss/{name}"] = float(loss)
    for name, n in (rec.get("consumed_samples_by_source") or {}).items():
        out[f"data/consumed_samples/{name}"] = float(n)
    for layer, load in rec.get("expert_load", {}).items():
        out[f"expert_load/{layer}/max_over_mean"] = float(load["max_over_mean"])
    return out


class Sink(Protocol):
    def write(self, rec: dict) -> None: ...

    def rewind(self, from_step: int, to_step: int) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """``metrics.jsonl``: one JSON line per record, appended."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, rec: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def rewind(self, from_step: int, to_step: int) -> None:
        pass  # the trainer truncates the file under its fence (truncate_metrics)

    def close(self) -> None:
        pass


class TensorBoardSink:
    """TensorBoard event files in ``log_dir`` (torch.utils.tensorboard's ``SummaryWriter``).
    ``start_step``: the step this attempt resumed from; events of later steps written by an
    earlier attempt are discarded by readers (``purge_step``), as those steps run again."""

    def __init__(self, log_dir: Path, start_step: int):
        self.log_dir = log_dir
        self.writer = self._open(start_step)

    def _open(self, start_step: int) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.log_dir), purge_step=start_step + 1 if start_step else None, flush_secs=10)

    def rewind(self, from_step: int, to_step: int) -> None:
        """Steps ``to_step + 1``.. run again: mark the rollback (``train/rollback`` = ``from_step``
        at ``to_step``) and start a new event file whose ``purge_step`` makes readers drop the
        first run's events of those steps."""
        self.writer.add_scalar("train/rollback", from_step, to_step)
        self.writer.close()
        self.writer = self._open(to_step)

    def write(self, rec: dict) -> None:
        import numpy as np

        step = rec["step"]
        for tag, value in flat_scalars(rec).items():
            self.writer.add_scalar(tag, value, step)
        for layer, load in rec.get("expert_load", {}).items():
            self.writer.add_histogram(f"expert_load/{layer}/tokens", np.asarray(load["tokens"], dtype=np.float64), step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run (``metrics.wandb``), one per run directory: its id is kept in
    ``<run.dir>/wandb_id.txt`` so restarts log into the same run."""

    def __init__(self, cfg: Config):
        import wandb

        w = cfg.metrics.wandb
        id_file = cfg.run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self.wandb = wandb
        self.run = wandb.init(project=w.project, entity=w.entity, mode=w.mode, dir=str(cfg.run_dir), id=run_id,
                              name=cfg.run.name, resume="allow", config=to_dict(cfg))
        # Restarted attempts repeat steps: plot against our step, not W&B's own counter.
        self.run.define_metric("train/step")
        self.run.define_metric("*", step_metric="train/step")

    def write(self, rec: dict) -> None:
        row: dict[str, Any] = {"train/step": rec["step"], **flat_scalars(rec)}
        for layer, load in rec.get("expert_load", {}).items():
            row[f"expert_load/{layer}/tokens"] = self.wandb.Histogram(load["tokens"])
        self.run.log(row)

    def rewind(self, from_step: int, to_step: int) -> None:
        """A W&B run keeps every row it was sent: the re-run steps are new rows with the same
        ``train/step`` (the chart overwrites them), marked by a ``train/rollback`` row (value:
        the step rolled back from) at ``to_step``."""
        self.run.log({"train/step": to_step, "train/rollback": from_step})

    def close(self) -> None:
        self.run.finish()


def check_sinks_installed(cfg: Config) -> None:
    """Refuse sinks whose package is missing, before anything starts.

    Raises:
        ConfigError: ``metrics.tensorboard`` without the ``tensorboard`` package, or
            ``metrics.wandb`` without ``wandb``; the fix names the extra to install.
    """
    if cfg.metrics.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise field_error("metrics.tensorboard", True, "TensorBoard is not installed",
                          "pip install 'moetrain[tensorboard]', or set metrics.tensorboard: false")
    if cfg.metrics.wandb is not None and importlib.util.find_spec("wandb") is None:
        raise field_error("metrics.wandb", to_dict(cfg.metrics.wandb), "Weights & Biases is not installed",
                          "pip install 'moetrain[wandb]', or remove metrics.wandb")


class MetricSinks:
    """Every sink of a run (rank 0 only). ``write`` adds ``mfu`` (when the device's peak is
    known, :func:`device_peak_tflops`) to the record, then writes it everywhere.

    Raises:
        ConfigError: a configured sink's package is missing (:func:`check_sinks_installed`).
    """

    def __init__(self, cfg: Config, metrics_path: Path, device: torch.device, start_step: int = 0):
        check_sinks_installed(cfg)
        self.peak_tflops = device_peak_tflops(device, cfg.metrics.peak_tflops)
        self.sinks: list[Sink] = [JsonlSink(metrics_path)]
        if cfg.metrics.tensorboard:
            tb_dir = Path(cfg.metrics.tensorboard_dir) if cfg.metrics.tensorboard_dir else cfg.run_dir / "tensorboard"
            self.sinks.append(TensorBoardSink(tb_dir, start_step))
        if cfg.metrics.wandb is not None:
            self.sinks.append(WandbSink(cfg))

    def write(self, rec: dict) -> None:
        if self.peak_tflops and "tflops_per_device" in rec:
            rec["mfu"] = rec["tflops_per_device"] / self.peak_tflops
        for sink in self.sinks:
            sink.write(rec)

    def rewind(self, from_step: int, to_step: int) -> None:
        """A rollback from ``from_step`` to the checkpoint of ``to_step``: every sink that keeps
        what it was sent marks it and drops (TensorBoard) or overwrites (W&B) the steps after
        ``to_step`` as they run again; metrics.jsonl is truncated by the trainer."""
        for sink in self.sinks:
            sink.rewind(from_step, to_step)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:  # noqa: BLE001 - one sink failing to flush must not hide the others
                log.exception("closing metrics sink %s failed", type(sink).__name__)
