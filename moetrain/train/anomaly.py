"""Non-finite and spiking losses, decided on the device before the optimizer step (``train.anomaly``).

A step's one host read comes after its optimizer step (:meth:`moetrain.train.trainer.Trainer.train_step`),
so a decision to skip the update must take effect on the device: :class:`AnomalyGuard` turns the
step's global LM loss and gradient norm — the same values on every rank, so every rank decides
the same — into flags, and :func:`gated_step` hands the "skip" flag to the optimizer as the
``found_inf`` tensor that PyTorch's fused optimizers take from ``torch.amp.GradScaler``: the fused
kernel leaves parameters, moments and step count untouched when it is 1. The expert-bias balancing
takes the same flag (:meth:`moetrain.model.moe.MoE.update_expert_bias`). The host learns what
happened from the step's read and applies the policy (:class:`moetrain.config.AnomalyConfig`):
stop, go on, or roll back to the latest checkpoint.

A spike is a loss more than ``spike_z`` standard deviations above the mean of the last ``window``
accepted steps' losses, a ring buffer on the device; the deviation is floored at 0.1 % of the mean
so that a window of near-equal losses does not flag rounding noise.
"""

from __future__ import annotations

import math

import torch

from moetrain.config import AnomalyConfig

__all__ = ["AnomalyGuard", "FLAGS", "gated_step"]

# The flags :meth:`AnomalyGuard.check` returns, in order.
FLAGS = ("nonfinite", "spike", "skip", "z")


class AnomalyGuard:
    """The device side of ``train.anomaly``. The window of accepted losses travels with the
    checkpoints (:meth:`state_dict`), so a run resumed or rolled back checks spikes from its first
    step against the losses before it."""

    def __init__(self, cfg: AnomalyConfig, device: torch.device):
        self.cfg = cfg
        self._losses = torch.zeros(cfg.window, dtype=torch.float64, device=device)  # ring buffer
        self._count = torch.zeros((), dtype=torch.int64, device=device)  # accepted steps so far
        self._skip_spikes = cfg.on_spike in ("skip", "rollback")

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Flags of one step as float64 [4] on the device (:data:`FLAGS`): the loss or gradient
        norm is not finite; the loss spikes; the update must be skipped (non-finite, whatever
        ``on_nan`` says — with ``stop`` the run ends after the step, its weights untouched —, or a
        spike under ``on_spike: skip | rollback``); the loss's distance from the window's mean in
        standard deviations (0 until the window is full). An accepted step's loss enters the
        window. ``loss``, ``grad_norm``: 0-dim device tensors, the same on every rank. No host read.
        """
        loss = loss.to(torch.float64)
        nonfinite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        full = self._count >= self.cfg.window
        mean = self._losses.mean()
        std = torch.maximum(self._losses.std(correction=0), mean.abs() * 1e-3).clamp(min=1e-12)
        z = torch.where(full & ~nonfinite, (loss - mean) / std, torch.zeros_like(loss))
        spike = (z > self.cfg.spike_z) if self.cfg.on_spike != "off" else torch.zeros_like(nonfinite)
        skip = nonfinite | (spike & self._skip_spikes)
        slot = (self._count % self.cfg.window).view(1)
        self._losses.index_copy_(0, slot, torch.where(skip, self._losses.index_select(0, slot), loss.view(1)))
        self._count += (~skip).to(torch.int64)
        return torch.stack([nonfinite.to(torch.float64), spike.to(torch.float64), skip.to(torch.float64), z])

    def state_dict(self) -> dict:
        """``{"losses": [...]}``: the window's accepted losses, oldest first (at most ``window``).
        Reads the device once (a checkpoint's, never a step's)."""
        count, w = int(self._count.item()), self.cfg.window
        ring = self._losses.tolist()
        n = min(count, w)
        start = count % w if count >= w else 0
        return {"losses": [ring[(start + i) % w] for i in range(n)]}

    def load_state_dict(self, state: dict) -> None:
        """Continue with the window of :meth:`state_dict` (its latest ``window`` losses when the
        window is shorter now). Raises ValueError on a malformed state."""
        losses = [float(x) for x in state.get("losses", [])][-self.cfg.window:]
        if not all(math.isfinite(x) for x in losses):
            raise ValueError(f"the anomaly window holds a non-finite loss: {losses}")
        self._losses.zero_()
        if losses:
            self._losses[:len(losses)] = torch.tensor(losses, dtype=torch.float64)
        self._count.fill_(len(losses))


def gated_step(optimizers: list[torch.optim.Optimizer], skip: torch.Tensor) -> None:
    """Step every optimizer unless ``skip`` (a 0-dim device tensor, 1 to skip): the fused kernels'
    ``found_inf`` leaves parameters, optimizer state and step count as they were. No host read.

    Raises:
        TypeError: an optimizer that takes no device-side skip flag (a new optimizer must, so that
            ``train.anomaly`` works with it: PyTorch's fused Adam, AdamW and SGD do, and
            :class:`moetrain.train.optim.Muon`, which says so with ``takes_found_inf``).
    """
    found_inf = skip.to(torch.float32)
    for opt in optimizers:
        fused_torch = isinstance(opt, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)) and opt.defaults.get("fused")
        if not (getattr(opt, "takes_found_inf", False) or fused_torch):
            raise TypeError(f"{type(opt).__name__} takes no device-side skip flag (found_inf): train.anomaly needs "
                            f"one, as torch's fused Adam / AdamW and moetrain's Muon have")
        opt.found_inf = found_inf
        try:
            opt.step()
        finally:
            del opt.found_inf
