"""Tensor name and layout maps between moetrain's single-process state dict and the Hugging Face
checkpoint of each architecture.

Shape legend: D hidden, F an expert's (or the dense MLP's) inner width, E experts, H query heads,
G kv heads, Dh head dim, V vocabulary.

One :class:`TensorMap` pairs one moetrain tensor with the HF tensor(s) it is made of. Three layouts
occur:

* ``copy`` — the same tensor (norms, embedding, head, v/o projections, router, dense MLP, shared
  expert, shared-expert gate);
* ``rope`` — rows permuted inside each head. moetrain's RoPE rotates interleaved pairs
  (x[2i], x[2i+1]) (:func:`moetrain.model.layers.apply_rope`, as the RoFormer paper and Meta's
  Llama code do); HF's Llama-family code rotates halves (x[i], x[i + Dh/2]) (``rotate_half``). The
  same rotation on permuted coordinates: moetrain row 2i of a head is HF row i, row 2i + 1 is HF
  row i + Dh/2. It applies to every tensor whose rows index the query / key coordinates: the q/k
  projections, their biases and their norm weights (a per-head norm's [Dh] weight is one "head";
  an RMS statistic does not depend on the order of what it sums). Permuting the weights rather than
  adding a second RoPE layout to the model keeps one RoPE path (and the ring attention's) and lets
  the permutation be checked bit-exactly by a round trip;
* ``experts`` — moetrain stacks the experts: w1, w3 [E, D, F] and w2 [E, F, D] (x @ w); HF keeps
  one [F, D] (w1/gate_proj, w3/up_proj) or [D, F] (w2/down_proj) matrix per expert (x @ wᵀ): expert
  e of moetrain's tensor is HF's e-th matrix transposed. Expert order is kept: moetrain expert e is
  HF expert e (the router's row e).

Everything here works on tensors in memory, one tensor (or one expert) at a time; reading and
writing files is :mod:`moetrain.hf.convert`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from moetrain.config import Config

# HF names of the per-layer MoE tensors, by family: (MoE module, router, per-expert w1, w3, w2).
MIXTRAL_MOE = ("block_sparse_moe", "gate", "w1", "w3", "w2")
QWEN_MOE = ("mlp", "gate", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TensorMap:
    """moetrain tensor ``ours`` (global shape ``shape``) ↔ HF tensors ``hf`` (one name; for
    ``experts`` a template with ``{e}``). ``heads``: heads of a ``rope`` tensor (its rows are
    ``heads`` blocks of Dh)."""

    ours: str
    hf: str
    layout: str  # "copy", "rope" or "experts"
    shape: tuple[int, ...]
    heads: int = 1

    def hf_names(self) -> list[str]:
        """The HF tensor names, in order (E of them for ``experts``)."""
        if self.layout == "experts":
            return [self.hf.format(e=e) for e in range(self.shape[0])]
        return [self.hf]

    def hf_shape(self) -> tuple[int, ...]:
        """Shape of each HF tensor."""
        if self.layout == "experts":
            return (self.shape[2], self.shape[1])
        return self.shape

    def to_ours(self, get_hf: Callable[[str], torch.Tensor]) -> Iterator[torch.Tensor]:
        """moetrain's tensor from HF tensors read by ``get_hf(name)``, as consecutive row
        blocks (one per expert for ``experts``, else the whole tensor), in the HF dtype.

        Raises:
            ValueError: an HF tensor has the wrong shape.
        """
        if self.layout == "experts":
            for name in self.hf_names():
                yield _checked(name, get_hf(name), self.hf_shape()).t().contiguous().unsqueeze(0)
            return
        t = _checked(self.hf, get_hf(self.hf), self.shape)
        yield rope_to_interleaved(t, self.heads) if self.layout == "rope" else t

    def to_hf(self, ours: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs from moetrain's whole tensor ``ours``, in :meth:`hf_names`
        order. Raises ValueError on a wrong shape."""
        ours = _checked(self.ours, ours, self.shape)
        if self.layout == "experts":
            for e, name in enumerate(self.hf_names()):
                yield name, ours[e].t().contiguous()
        elif self.layout == "rope":
            yield self.hf, interleaved_to_rope(ours, self.heads)
        else:
            yield self.hf, ours


def _checked(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"tensor {name} is {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def _half_to_interleaved_index(head_dim: int) -> torch.Tensor:
    """perm with moetrain coordinate j = HF coordinate perm[j] inside a head: perm[2i] = i,
    perm[2i + 1] = i + Dh/2."""
    half = torch.arange(head_dim // 2)
    return torch.stack((half, half + head_dim // 2), dim=1).reshape(-1)


def rope_to_interleaved(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rotate-half rows → moetrain interleaved rows, per head. t: [heads·Dh, ...] (or [Dh])."""
    head_dim = t.shape[0] // heads
    perm = _half_to_interleaved_index(head_dim)
    return t.reshape(heads, head_dim, *t.shape[1:])[:, perm].reshape(t.shape).contiguous()


def interleaved_to_rope(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`rope_to_interleaved`."""
    head_dim = t.shape[0] // heads
    inverse = torch.argsort(_half_to_interleaved_index(head_dim))
    return t.reshape(heads, head_dim, *t.shape[1:])[:, inverse].reshape(t.shape).contiguous()


def tensor_maps(cfg: Config, moe_names: tuple[str, str, str, str, str]) -> list[TensorMap]:
    """Every tensor of the model ``cfg`` describes, layer by layer, with its HF
    counterpart. ``moe_names``: the family's MoE names (:data:`MIXTRAL_MOE` or :data:`QWEN_MOE`).
    The shared expert and its gate, when the config has them, use Qwen2-MoE's names."""
    m, moe = cfg.model, cfg.moe
    D, Dh, H, G = m.hidden, m.resolved_head_dim, m.heads, m.kv_heads
    module, router, w1, w3, w2 = moe_names
    maps = [TensorMap("tok_embeddings.weight", "model.embed_tokens.weight", "copy", (m.vocab_size, D))]
    for i in range(m.layers):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        at = f"{hf}.self_attn"
        maps.append(TensorMap(f"{ours}.attention_norm.weight", f"{hf}.input_layernorm.weight", "copy", (D,)))
        maps += [TensorMap(f"{ours}.attention.wq.weight", f"{at}.q_proj.weight", "rope", (H * Dh, D), H),
                 TensorMap(f"{ours}.attention.wk.weight", f"{at}.k_proj.weight", "rope", (G * Dh, D), G),
                 TensorMap(f"{ours}.attention.wv.weight", f"{at}.v_proj.weight", "copy", (G * Dh, D))]
        if m.qkv_bias:
            maps += [TensorMap(f"{ours}.attention.wq.bias", f"{at}.q_proj.bias", "rope", (H * Dh,), H),
                     TensorMap(f"{ours}.attention.wk.bias", f"{at}.k_proj.bias", "rope", (G * Dh,), G),
                     TensorMap(f"{ours}.attention.wv.bias", f"{at}.v_proj.bias", "copy", (G * Dh,))]
        maps.append(TensorMap(f"{ours}.attention.wo.weight", f"{at}.o_proj.weight", "copy", (D, H * Dh)))
        if m.qk_norm == "head":
            maps += [TensorMap(f"{ours}.attention.q_norm.weight", f"{at}.q_norm.weight", "rope", (Dh,), 1),
                     TensorMap(f"{ours}.attention.k_norm.weight", f"{at}.k_norm.weight", "rope", (Dh,), 1)]
        elif m.qk_norm == "projection":
            maps += [TensorMap(f"{ours}.attention.q_norm.weight", f"{at}.q_norm.weight", "rope", (H * Dh,), H),
                     TensorMap(f"{ours}.attention.k_norm.weight", f"{at}.k_norm.weight", "rope", (G * Dh,), G)]
        maps.append(TensorMap(f"{ours}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", "copy", (D,)))
        if moe.is_moe_layer(i):
            E, F, mo = moe.num_experts, moe.ffn_hidden, f"{hf}.{module}"
            maps.append(TensorMap(f"{ours}.moe.router.weight", f"{mo}.{router}.weight", "copy", (E, D)))
            maps += [TensorMap(f"{ours}.moe.experts.w1", f"{mo}.experts.{{e}}.{w1}.weight", "experts", (E, D, F)),
                     TensorMap(f"{ours}.moe.experts.w3", f"{mo}.experts.{{e}}.{w3}.weight", "experts", (E, D, F)),
                     TensorMap(f"{ours}.moe.experts.w2", f"{mo}.experts.{{e}}.{w2}.weight", "experts", (E, F, D))]
            if moe.shared_hidden:
                S, sh = moe.shared_hidden, f"{mo}.shared_expert"
                maps += [TensorMap(f"{ours}.moe.shared.w1.weight", f"{sh}.gate_proj.weight", "copy", (S, D)),
                         TensorMap(f"{ours}.moe.shared.w3.weight", f"{sh}.up_proj.weight", "copy", (S, D)),
                         TensorMap(f"{ours}.moe.shared.w2.weight", f"{sh}.down_proj.weight", "copy", (D, S))]
                if moe.shared_expert_gate:
                    maps.append(TensorMap(f"{ours}.moe.shared_gate.weight", f"{mo}.shared_expert_gate.weight", "copy",
                                          (1, D)))
        else:
            F = m.ffn_hidden
            maps += [TensorMap(f"{ours}.feed_forward.w1.weight", f"{hf}.mlp.gate_proj.weight", "copy", (F, D)),
                     TensorMap(f"{ours}.feed_forward.w3.weight", f"{hf}.mlp.up_proj.weight", "copy", (F, D)),
                     TensorMap(f"{ours}.feed_forward.w2.weight", f"{hf}.mlp.down_proj.weight", "copy", (D, F))]
    maps.append(TensorMap("norm.weight", "model.norm.weight", "copy", (D,)))
    if not m.tie_embeddings:
        maps.append(TensorMap("output.weight", "lm_head.weight", "copy", (m.vocab_size, D)))
    return maps
