"""Layout-independent parameter initialisation.

Each parameter (and each expert of a stacked expert tensor) draws from its own generator seeded
by ``(seed, name)``, so a rank that holds only some experts, or a pipeline stage that holds only
some blocks, gets exactly the values the single-process model has. Norm weights start at 1
(0 where the norm scales by 1 + weight), biases at 0. Gated DeltaNet: A = exp(A_log) uniform in
[1, 16], dt_bias 1 (Qwen3-Next's), the convolution normal with std kernel^−½. Mamba-2: A_log =
log(1 … H), D and dt_bias 1 (Nemotron-H's), the convolution as gated DeltaNet's, its bias 0.
Output projections (``wo``, ``w2``) use std / sqrt(2·layers) (GPT-2, Radford et al. 2019 §2.3).
DSA's indexer key norm: weight 1, bias 0. Low-rank adapters (:mod:`moetrain.model.lora`): A uniform in ±1/√in, per expert for the experts'
stacks, B zero. An FP8 base draws the same values and stores them quantized (codes and block scales).
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from moetrain.model.dsa import KeyNorm
from moetrain.model.fp8 import quantize_blocks
from moetrain.model.gated_deltanet import GatedDeltaNet, GatedRMSNorm
from moetrain.model.kda import KimiDeltaAttention
from moetrain.model.mamba2 import GroupedGatedRMSNorm, Mamba2
from moetrain.model.layers import Attention, RMSNorm
from moetrain.model.mla import MLAttention
from moetrain.model.moe import GroupedExperts, MoE


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1))
    return g


def _normal(shape: torch.Size, std: float, seed: int, name: str) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(seed, name)) * std


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float, layers: int, prefix: str = "") -> None:
    """Initialise every parameter of ``model`` in place (after ``to_empty``).

    Names are the parameters' names in the *full* single-process model; ``prefix`` is prepended
    when ``model`` is a sub-module. Parameters that are DTensors are initialised from the full
    tensor and then sliced, so tensor/FSDP sharding does not change the values.
    """
    out_std = std / math.sqrt(2 * layers)
    for mod_name, module in model.named_modules():
        full = f"{prefix}{mod_name}"
        if isinstance(module, RMSNorm):
            module.weight.fill_(0.0 if module.zero_centered else 1.0)
        elif isinstance(module, KeyNorm):  # DSA's indexer key norm: the identity LayerNorm
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, (GatedRMSNorm, GroupedGatedRMSNorm)):
            module.weight.fill_(1.0)
        elif isinstance(module, Mamba2):
            _fill(module.A_log, torch.arange(1, module.num_heads + 1, dtype=torch.float32).log())
            module.D.fill_(1.0)
            module.dt_bias.fill_(1.0)
            w = module.conv1d.weight
            _fill(w, _normal(w.shape, w.shape[-1] ** -0.5, seed, f"{full}.conv1d.weight"))
            if module.conv1d.bias is not None:
                module.conv1d.bias.zero_()
        elif isinstance(module, (GatedDeltaNet, KimiDeltaAttention)):
            # A ∈ [1, 16] per head (flash-linear-attention's initialisation), Δ's bias 1.
            heads = module.A_log.shape[0]
            a = torch.empty(heads).uniform_(1.0, 16.0, generator=_generator(seed, f"{full}.A_log"))
            _fill(module.A_log, a.log())
            module.dt_bias.fill_(1.0)
            convs = ("conv1d",) if isinstance(module, GatedDeltaNet) else ("q_conv1d", "k_conv1d", "v_conv1d")
            for conv in convs:
                w = getattr(module, conv).weight
                _fill(w, _normal(w.shape, w.shape[-1] ** -0.5, seed, f"{full}.{conv}.weight"))
        elif isinstance(module, MoE) and module.expert_bias is not None:
            module.expert_bias.zero_()  # aux-loss-free balancing starts unbiased
        elif isinstance(module, GroupedExperts):
            for b in (module.b1, module.b3, module.b2):
                if b is not None:
                    b.zero_()
            for i in ("1", "3", "2"):  # low-rank adapters: A as PEFT draws it, per expert; B at 0
                a = getattr(module, f"lora_A{i}")
                if a is not None:
                    local, offset = _local_and_offset(a)
                    for e in range(local.shape[0]):
                        one = _uniform(a.shape[1:], a.shape[1] ** -0.5, seed, f"{full}.lora_A{i}.{offset[0] + e}")
                        for dim, (first, size) in enumerate(zip(offset[1:], local.shape[1:])):
                            one = one.narrow(dim, first, size)
                        local[e].copy_(one.to(local.dtype))
                    getattr(module, f"lora_B{i}").zero_()
            for pname in ("w1", "w3", "w2"):
                p = getattr(module, pname)
                if p is None:  # non-gated experts have no w3
                    continue
                s = out_std if pname == "w2" else std
                scale = getattr(module, f"{pname}_scale_inv")  # an FP8 base: codes and block scales
                # This rank's experts (offset[0]: the global id of the first; ep and FSDP shard
                # dim 0) and, under expert-tensor parallelism, its columns of each.
                local, offset = _local_and_offset(p)
                for e in range(local.shape[0]):
                    # Under EPLB row offset[0] + e is a slot: it holds its logical expert's values.
                    logical = offset[0] + e if module.slot_map is None else module.slot_map.slots[offset[0] + e]
                    one = _normal(p.shape[1:], s, seed, f"{full}.{pname}.{logical}")
                    if scale is not None:
                        one, scales = quantize_blocks(one, module.base_block)
                        _copy_piece(scale, offset[0] + e, scales)
                    for dim, (first, size) in enumerate(zip(offset[1:], local.shape[1:])):
                        one = one.narrow(dim, first, size)
                    local[e].copy_(one.to(local.dtype))
        elif isinstance(module, (Attention, MLAttention)) and module.sinks is not None:
            module.sinks.zero_()  # no mass on the sink to begin with beyond e^0 (GPT-OSS trains them)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            leaf = mod_name.rsplit(".", 1)[-1]
            s = out_std if leaf in ("wo", "w2", "out_proj") else std
            if getattr(module, "weight_scale_inv", None) is not None:  # an FP8 base: codes and block scales
                codes, scales = quantize_blocks(_normal(module.weight.shape, s, seed, f"{full}.weight"),
                                                module.base_block)
                _fill(module.weight, codes)
                _fill(module.weight_scale_inv, scales)
            else:
                _fill_normal(module.weight, s, seed, f"{full}.weight")
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
            if getattr(module, "lora_A", None) is not None:
                a = module.lora_A
                _fill(a, _uniform(a.shape, a.shape[1] ** -0.5, seed, f"{full}.lora_A"))
                module.lora_B.zero_()


def _local_and_offset(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's piece of ``p`` and the index of its first element in the whole tensor (zeros
    for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    from moetrain.internals import local_shape_and_offset

    if not isinstance(p, DTensor):
        return p, (0,) * p.ndim
    _, offset = local_shape_and_offset(p.shape, p.device_mesh, p.placements)
    return p.to_local(), offset


def local_piece(p: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's piece of parameter ``p`` (a DTensor's local shard, or ``p`` itself) and where it
    lies in the single-process model's tensor: one slice per dim. Tensor-parallel, expert-parallel
    and FSDP shards are contiguous blocks of the whole tensor."""
    local, offset = _local_and_offset(p)
    return local, tuple(slice(s, s + n) for s, n in zip(offset, local.shape))


def _copy_piece(p: torch.Tensor, expert: int, values: torch.Tensor) -> None:
    """Write expert ``expert``'s whole values [...] into stacked parameter ``p`` [E, ...], where
    this rank holds that expert (its piece of it)."""
    local, offset = _local_and_offset(p)
    if not offset[0] <= expert < offset[0] + local.shape[0]:
        return
    for dim, (first, size) in enumerate(zip(offset[1:], local.shape[1:])):
        values = values.narrow(dim, first, size)
    local[expert - offset[0]].copy_(values.to(local.dtype))


def _uniform(shape: torch.Size, bound: float, seed: int, name: str) -> torch.Tensor:
    """Uniform in [-bound, bound): a low-rank adapter's A, whose bound 1/√in is what PEFT's
    Kaiming-uniform (a = √5) gives for fan-in ``in``."""
    return (torch.rand(shape, generator=_generator(seed, name)) * 2 - 1) * bound


def _fill_normal(p: torch.Tensor, std: float, seed: int, name: str) -> None:
    _fill(p, _normal(p.shape, std, seed, name))


def _fill(p: torch.Tensor, full: torch.Tensor) -> None:
    """Parameter ``p`` ← the single-process model's values ``full`` (this rank's piece of them)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        full = full.to(p.dtype)
        # src_data_rank=None: every rank holds the same full tensor, so each takes its piece
        # locally instead of receiving it from rank 0.
        shard = distribute_tensor(full.to(p.device_mesh.device_type), p.device_mesh, p.placements,
                                  src_data_rank=None)
        p.to_local().copy_(shard.to_local())
    else:
        p.copy_(full.to(p.dtype))
