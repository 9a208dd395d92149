"""Build the model for this rank: the one place where the parallel dimensions are applied.

The order is fixed and each step's reason is given where it happens:

1. build the full model on the meta device (no memory, no initialisation yet);
2. pipeline split — keep this stage's blocks (pp > 1);
3. tensor + sequence parallelism — shard attention / MLP / embedding / head over tp;
4. expert parallelism — keep this rank's experts, dispatch tokens by all-to-all over ep;
5. context parallelism — swap the attention kernel for ring attention over cp;
6. activation checkpointing;
7. ZeRO / FSDP wrapping;
8. materialise on the device and initialise with layout-independent values.

Steps that a layout does not use are skipped here, by the caller of each step, never inside
the step.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.config import Config
from moetrain.model.init import init_weights
from moetrain.model.transformer import Transformer
from moetrain.parallel.expert import apply_expert_parallel
from moetrain.parallel.state import EP, ParallelState


def build_parallel_model(cfg: Config, ps: ParallelState) -> Transformer:
    """This rank's part of the model, materialised on ``ps.device`` and initialised.

    Raises:
        NotImplementedError: a dimension that this version cannot apply yet was requested.
    """
    p = cfg.parallel
    unsupported = [name for name, on in (("pp", p.pp > 1), ("tp", p.tp > 1), ("cp", p.cp > 1),
                                         ("zero_stage", p.zero_stage > 0),
                                         ("activation_checkpointing", p.activation_checkpointing != "none"))
                   if on]
    if unsupported:
        raise NotImplementedError(f"parallel.{unsupported[0]} is not supported yet by this version of moetrain")

    # 1. the full model, on meta: shapes only.
    with torch.device("meta"):
        model = Transformer.from_config(cfg)

    # 4. expert parallelism: local experts + all-to-all dispatch.
    if ps.size(EP) > 1:
        apply_expert_parallel(model.moe_layers(), ps)

    # 8. materialise and initialise (values depend on names and global expert ids only).
    model.to_empty(device=ps.device)
    init_weights(model, cfg.run.seed, cfg.model.init_std, cfg.model.layers)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.train.dtype]
    if dtype != torch.float32:
        model.to(dtype)
    return model
