"""Mixed precision: bf16 compute with fp32 master weights, the same in every layout.

``train.precision`` (Micikevicius et al. 2018, "Mixed Precision Training", §3; bf16 needs no loss
scaling, Kalamkar et al. 2019):

* ``fp32`` — parameters, activations, gradients and optimizer states in fp32.
* ``bf16`` — as Megatron-Core and torchtitan train in bf16:

  - fp32: the parameters (the master weights), their gradients, the data-parallel gradient
    reduction, the gradient norm, AdamW's states and update, checkpoints;
  - bf16: the matmuls and the activations between them (the residual stream, attention, the
    dense MLP and the experts);
  - fp32 inside a bf16 step: the MoE router (logits, softmax, top-k) and the aux / z losses, RMSNorm
    statistics, the RoPE rotation, the top-k weighted sum of the expert outputs, the logits and the
    cross-entropy (SDPA and the ring attention accumulate their softmax in fp32).

Two mechanisms give these semantics:

* without ZeRO each module casts its fp32 weights to bf16 where it uses them
  (:func:`moetrain.model.layers.set_compute_dtype`); the cast's backward returns fp32 gradients,
  which accumulate over micro-batches in fp32 and are reduced in fp32;
* with ZeRO, FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` all-gathers bf16
  copies of the fp32 shards and reduce-scatters the gradients in fp32; the router is its own FSDP
  group with an fp32 policy. The modules' casts are then no-ops. ``cast_forward_inputs=False``:
  the RoPE tables passed to every block stay fp32, as without ZeRO.

* ``fp8`` — bf16 as above, and the GEMMs of the dense linears and the experts in float8, forward
  and backward, scaled by ``train.fp8_recipe`` (:mod:`moetrain.model.fp8_gemm`); the linears
  named by ``train.fp8_keep`` (the output head), the router, embeddings, norms and attention
  stay bf16 or fp32 as in bf16. FSDP2 all-gathers the weights in bf16 (not yet float8).

Either way a micro-batch's weight gradients are computed by bf16 matmuls and rounded to bf16 once
before they are added up in fp32. Parameters are fp32 in both, so a checkpoint of an fp32 run
resumes in bf16 and the other way round.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from moetrain.model.fp8_gemm import Fp8Recipe

# fp8 computes between its GEMMs in bf16; the GEMMs themselves are set by fp8_recipe (below).
PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def fp8_recipe(train: Any) -> Fp8Recipe | None:
    """The fp8 GEMM recipe of a ``train`` config section (None unless ``precision: fp8``)."""
    if train.precision != "fp8":
        return None
    return Fp8Recipe(train.fp8_recipe, train.fp8_block)


def compute_dtype(precision: str) -> torch.dtype:
    """The matmul / activation dtype of ``train.precision``.

    Raises:
        ValueError: an unknown precision.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def fsdp_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``train.precision``: compute-dtype parameters, fp32 gradient reduction."""
    return MixedPrecisionPolicy(param_dtype=compute_dtype(precision), reduce_dtype=torch.float32,
                                cast_forward_inputs=False)


# The router's FSDP group: fp32 whatever the precision (see the module docstring).
FP32_POLICY = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
# A LoRA run whose frozen base is stored in bf16 or FP8 (train.lora.base_dtype): every parameter
# gathered as stored (FP8 codes as bytes, their fp32 scales, the fp32 adapters), gradients reduced
# in fp32; the modules cast at use.
STORED_POLICY = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, cast_forward_inputs=False)
