"""Parameter counts and FLOPs of the decoder that moetrain trains, from a Config.

Symbols (per layer unless stated): h hidden, a heads, d = h/a head dim, h_q = a·d query width,
h_kv = kv_heads·d, F dense SwiGLU width, E experts, k top-k, f expert SwiGLU width, S shared
experts, V vocabulary, s sequence length, L layers.

FLOP convention (the one MFU is reported in, as Megatron-LM eq. 3 of Narayanan et al. 2021 and
PaLM appendix B): a matmul of m×k by k×n costs 2mkn; backward costs twice forward; attention
counts the full s×s score matrix (4·s·h_q per token forward for QKᵀ and AV), causal or not;
recomputation is not model FLOPs. The time model separately counts what the GPU executes
(causal flash attention skips the upper triangle; recomputation runs the forward again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from moetrain.config import Config

__all__ = ["ModelShape", "DEFAULT_VOCAB"]

DEFAULT_VOCAB = 32000
"""Vocabulary assumed when the config leaves ``model.vocab_size`` to the tokenizer."""


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    tie_embeddings: bool
    num_experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int
    moe_layer_flags: tuple[bool, ...]
    vocab_assumed: bool = False

    @classmethod
    def from_config(cls, cfg: "Config") -> "ModelShape":
        m, moe = cfg.model, cfg.moe
        vocab = m.vocab_size
        assumed = vocab is None
        if vocab is None:
            vocab = DEFAULT_VOCAB
        q = m.vocab_multiple
        vocab = -(-vocab // q) * q
        flags = tuple(moe.is_moe_layer(i) for i in range(m.layers))
        return cls(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads, ffn=m.ffn_hidden,
                   vocab=vocab, seq_len=m.seq_len, tie_embeddings=m.tie_embeddings,
                   num_experts=moe.num_experts, top_k=moe.top_k if moe.num_experts else 0,
                   expert_ffn=moe.ffn_hidden, shared_experts=moe.shared_experts if moe.num_experts else 0,
                   moe_layer_flags=flags, vocab_assumed=assumed)

    # -- widths ------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def h_q(self) -> int:
        return self.heads * self.head_dim

    @property
    def h_kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> int:
        return sum(self.moe_layer_flags)

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    # -- parameters (counts) -----------------------------------------------------------------
    @property
    def attn_params(self) -> int:
        """QKV and output projections (no biases) of one layer."""
        h = self.hidden
        return h * (self.h_q + 2 * self.h_kv) + self.h_q * h

    @property
    def norm_params(self) -> int:
        return 2 * self.hidden

    @property
    def mlp_params(self) -> int:
        """Dense SwiGLU MLP of one layer: w1, w3 (h×F) and w2 (F×h)."""
        return 3 * self.hidden * self.ffn

    @property
    def expert_params(self) -> int:
        """All routed experts of one MoE layer."""
        return self.num_experts * 3 * self.hidden * self.expert_ffn

    @property
    def router_params(self) -> int:
        return self.hidden * self.num_experts

    @property
    def shared_params(self) -> int:
        return self.shared_experts * 3 * self.hidden * self.expert_ffn

    @property
    def embedding_params(self) -> int:
        """Input embedding plus output head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    def layer_params(self, moe: bool) -> tuple[int, int]:
        """(dense, expert) parameters of one layer; dense includes norms, router, shared experts."""
        dense = self.attn_params + self.norm_params
        if moe:
            return dense + self.router_params + self.shared_params, self.expert_params
        return dense + self.mlp_params, 0

    @property
    def total_params(self) -> int:
        n = self.embedding_params + self.hidden  # final norm
        for flag in self.moe_layer_flags:
            d, e = self.layer_params(flag)
            n += d + e
        return n

    @property
    def active_params(self) -> int:
        """Parameters one token touches (routed experts: top_k of them)."""
        n = self.embedding_params + self.hidden
        for flag in self.moe_layer_flags:
            d, e = self.layer_params(flag)
            n += d + (e * self.top_k // self.num_experts if flag else 0)
        return n

    # -- FLOPs per token, forward ------------------------------------------------------------
    def layer_matmul_flops(self, moe: bool) -> float:
        """Forward matmul FLOPs per token of one layer (2 per multiply-add)."""
        f = 2.0 * self.attn_params
        if moe:
            f += 2.0 * self.router_params + 2.0 * 3 * self.hidden * self.expert_ffn * (self.top_k + self.shared_experts)
        else:
            f += 2.0 * self.mlp_params
        return f

    def attention_flops(self, causal: bool = False) -> float:
        """Forward QKᵀ and AV FLOPs per token of one layer: 4·s·h_q (half with a causal mask)."""
        return 4.0 * self.seq_len * self.h_q * (0.5 if causal else 1.0)

    @property
    def logits_flops(self) -> float:
        return 2.0 * self.hidden * self.vocab

    def model_flops_per_token(self) -> float:
        """Forward + backward model FLOPs per token (the MFU numerator), see module doc."""
        fwd = sum(self.layer_matmul_flops(flag) + self.attention_flops() for flag in self.moe_layer_flags)
        return 3.0 * (fwd + self.logits_flops)

    def recompute_flops_per_token(self, checkpointing: str) -> float:
        """Extra forward FLOPs per token that activation checkpointing executes (same convention)."""
        if checkpointing == "full":
            return sum(self.layer_matmul_flops(flag) + self.attention_flops() for flag in self.moe_layer_flags)
        if checkpointing == "selective":
            return self.layers * self.attention_flops()
        return 0.0
