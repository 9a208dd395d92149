"""Model FLOPs per token, for tokens/s → TFLOP/s and MFU."""

from __future__ import annotations

import dataclasses

from moetrain.config import Config
from moetrain.planner.model import ModelShape


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token of the configured model: 6 FLOPs per active matmul parameter
    (forward 2, backward 4: top_k routed experts, the shared ones and the router in MoE blocks;
    MLA's compressions and up-projections; the MTP modules and the head) plus the attention
    scores, causal ones counted as half (the 12·L·H·Q·T term of PaLM, Chowdhery et al. 2022
    App. B, halved; a sliding-window block attends to its window). The planner's count
    (:meth:`moetrain.planner.model.ModelShape.model_flops_per_token`) with causal attention;
    under ``train.lora`` 4 per frozen parameter (no weight gradient)."""
    shape = ModelShape.from_config(cfg)
    if cfg.model.vocab_size is not None:  # the model's own vocabulary, not padded again
        shape = dataclasses.replace(shape, vocab=cfg.model.vocab_size)
    return shape.model_flops_per_token(causal=True)
