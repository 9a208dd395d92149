"""Low-rank adapters placed as their weights are (step 4b of
:func:`moetrain.parallel.apply.build_model_parts`, after tensor and expert parallelism).

An adapter pair shares one dim with its weight each: for a linear W [out, in], A [r, in] shares
``in`` and B [out, r] shares ``out``; for stacked experts w [E, in, out], A [E, in, r] shares E
and ``in``, B [E, r, out] E and ``out``. Each factor takes the weight's placement along the dims
it shares and is replicated along the others:

==========================  ==================  ===================  ==================================
weight                      A                   B                    the adapter's term
==========================  ==================  ===================  ==================================
column-parallel Shard(0)    Replicate           Shard(0)             this rank's output columns
row-parallel Shard(1)       Shard(1)            Replicate            a partial sum, reduced with the
                                                                     layer's own (Partial) output
experts Shard(0) over ep    Shard(0)            Shard(0)             this rank's experts (per expert)
  (``experts: shared``)     Replicate           Replicate            gradient Partial over ep
experts' ffn over etp       w1/w3: Replicate,   w1/w3: Shard(2),     as the row / column-parallel
                            w2: Shard(1)        w2: Replicate        linear; replicated factors'
                                                                     gradients Partial over tp
==========================  ==================  ===================  ==================================

Under tensor parallelism the linears compute on DTensors, so DTensor itself gives each
replicated factor's gradient its Partial placement; the experts compute on local pieces, and
:func:`~moetrain.model.layers.adapter_local` declares it. Either way the data-parallel wrapper
(FSDP2) redistributes a Partial gradient to the parameter's placement — a sum over the axis — before
its own reduction, so every adapter's gradient is the one-process gradient.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from moetrain.config import ConfigError
from moetrain.model.layers import Linear
from moetrain.model.moe import GroupedExperts


def _following(weight: DTensor, shared_dims: tuple[int, ...], replicate_dim0: bool = False) -> list[Placement]:
    """The placements of a factor that shares ``shared_dims`` with ``weight``: the weight's
    Shard(d) where d is shared, Replicate elsewhere (and along dim 0 with ``replicate_dim0``:
    one pair for every expert)."""
    out: list[Placement] = []
    for pl in weight.placements:
        keep = isinstance(pl, Shard) and pl.dim in shared_dims and not (replicate_dim0 and pl.dim == 0)
        out.append(pl if keep else Replicate())
    return out


def _place(module: nn.Module, name: str, weight: DTensor, placements: list[Placement]) -> None:
    p = getattr(module, name)
    setattr(module, name, nn.Parameter(distribute_tensor(p, weight.device_mesh, placements, src_data_rank=None),
                                       requires_grad=p.requires_grad))


def _place_scales(module: nn.Module, name: str, weight: DTensor, block: int, path: str) -> None:
    """The block scales of an FP8 base weight, placed as the weight is: a shard of whole blocks.

    Raises:
        ConfigError: a tensor- or expert-tensor-parallel shard that is not a whole number of
            blocks."""
    for pl, size in zip(weight.placements, weight.device_mesh.shape):
        if isinstance(pl, Shard) and pl.dim >= weight.ndim - 2 and (weight.shape[pl.dim] // size) % block:
            raise ConfigError(f"train.fp8_block = {block}: {path} [{', '.join(map(str, weight.shape))}] is split "
                              f"{size} ways along dim {pl.dim} into shards of {weight.shape[pl.dim] // size}, no whole "
                              f"number of {block}-blocks, so its FP8 base cannot keep DeepSeek-V3's block scales "
                              f"per shard. Fix: a train.fp8_block dividing {weight.shape[pl.dim] // size}, or a "
                              f"smaller tp")
    _place(module, name, weight, list(weight.placements))


def place_adapters(model: nn.Module) -> None:
    """Turn every adapter of ``model`` (meta device, added by
    :func:`moetrain.model.lora.add_adapters`) whose weight is a DTensor into a DTensor on the
    weight's mesh, placed as the module docstring's table says; so are the block scales of an
    FP8 base (:func:`moetrain.model.lora.convert_base`), along whole blocks."""
    for path, module in model.named_modules():
        if isinstance(module, Linear) and isinstance(module.weight, DTensor):
            w = module.weight
            if module.lora_A is not None:
                _place(module, "lora_A", w, _following(w, (1,)))
                _place(module, "lora_B", w, _following(w, (0,)))
            if module.weight_scale_inv is not None:
                _place_scales(module, "weight_scale_inv", w, module.base_block, path)
        elif isinstance(module, GroupedExperts):
            for i in ("1", "3", "2"):
                w = getattr(module, f"w{i}")
                if not isinstance(w, DTensor):
                    continue
                if getattr(module, f"lora_A{i}") is not None:
                    _place(module, f"lora_A{i}", w, _following(w, (0, 1), module.lora_shared))
                    _place(module, f"lora_B{i}", w, _following(w, (0, 2), module.lora_shared))
                if getattr(module, f"w{i}_scale_inv") is not None:
                    _place_scales(module, f"w{i}_scale_inv", w, module.base_block, f"{path}.w{i}")
