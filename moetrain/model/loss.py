"""The language-model loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor, divisor: torch.Tensor | None = None) -> torch.Tensor:
    """Token cross-entropy. logits: [B, S, V] fp32 — under tensor parallelism a DTensor
    sharded over the vocabulary, and then the caller runs forward and backward inside
    ``torch.distributed.tensor.parallel.loss_parallel()`` so the full logits are never gathered
    (Megatron's vocabulary-parallel cross-entropy); targets: [B, S] int64, -100 where a token is
    not trained (the loss mask). ``divisor``: None gives the mean over the trained targets; a
    scalar tensor gives their sum divided by it (the trainer's share of the whole batch's trained
    tokens, :class:`~moetrain.data.loader.MicroBatch`). Returns a scalar."""
    if divisor is None:
        return F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten())
    return F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten(), reduction="sum") / divisor


def model_loss(logits: torch.Tensor, targets: torch.Tensor, mtp_coef: float = 0.0,
               divisor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(objective, LM loss, MTP loss or None) of the model's output.

    Without multi-token prediction: logits [B, S, V], targets [B, S]; the objective is
    :func:`lm_loss`. With it (DeepSeek-V3 §2.2, eq. 24-25): logits [B, S, 1 + D, V] and targets
    [B, S, 1 + 2D] (:func:`moetrain.model.transformer.future_tokens`; channels 0 … D are the
    targets); the LM loss is module 0's, module k's loss is the cross-entropy summed over the
    positions whose target k + 1 ahead is trained, divided by all B·S positions (so that it adds
    up the same however a sample is split over ranks) or by ``divisor`` when given: a scalar for
    every module, or [1 + D], one per depth (with a loss mask, each depth's trained targets, as
    Megatron-Core divides each MTP depth's loss by its own mask), and the objective is LM +
    ``mtp_coef`` · mean over k of them.
    """
    if logits.dim() == 3:  # no MTP (also a model in eval mode given MTP targets: module 0's)
        lm = lm_loss(logits, targets if targets.dim() == 2 else targets[..., 0],
                     divisor if divisor is None or divisor.dim() == 0 else divisor[0])
        return lm, lm, None
    B, S, K = logits.shape[:3]

    def div(k: int) -> torch.Tensor | float:
        if divisor is None:
            return B * S
        return divisor if divisor.dim() == 0 else divisor[k]

    lm = lm_loss(logits[:, :, 0], targets[..., 0], None if divisor is None else div(0))
    per = [F.cross_entropy(logits[:, :, k].flatten(0, 1), targets[..., k].flatten(), ignore_index=-100,
                           reduction="sum") / div(k) for k in range(1, K)]
    mtp = torch.stack(per).mean()
    return lm + mtp_coef * mtp, lm, mtp
