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


def place_adapters(model: nn.Module) -> None:
    """Turn every adapter of ``model`` (meta device, added by
    :func:`moetrain.model.lora.add_adapters`) whose weight is a DTensor into a DTensor on the
    weight's mesh, placed as the module docstring's table says."""
    for module in model.modules():
        if isinstance(module, Linear) and module.lora_A is not None and isinstance(module.weight, DTensor):
            w = module.weight
            _place(module, "lora_A", w, _following(w, (1,)))
            _place(module, "lora_B", w, _following(w, (0,)))
        elif isinstance(module, GroupedExperts):
            for i in ("1", "3", "2"):
                w = getattr(module, f"w{i}")
                if getattr(module, f"lora_A{i}") is None or not isinstance(w, DTensor):
                    continue
                _place(module, f"lora_A{i}", w, _following(w, (0, 1), module.lora_shared))
                _place(module, f"lora_B{i}", w, _following(w, (0, 2), module.lora_shared))
