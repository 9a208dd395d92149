"""Parameter counts and FLOPs of the decoder that moetrain trains, from a Config.

Symbols (per layer unless stated): h hidden, a heads, d = h/a head dim (or a stated one),
h_q = a·d query width, h_kv = kv_heads·d, h_v = a·d_v value width, F dense MLP width, E experts,
k top-k, f expert SwiGLU width, S shared experts, V vocabulary, s sequence length, L layers.

moetrain's own configs give a Llama/Mixtral decoder (SwiGLU, d = h/a, full attention). Published
runs of other models need a few more facts, which only the planner knows (they are never read
from a moetrain config): a stated head dim (Qwen3, GPT-OSS), separate value head dim and
low-rank projections (DeepSeek's multi-head latent attention, given as its parameter count),
a two-matrix GELU MLP (GPT-3, MPT), sliding-window layers (GPT-OSS).

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
    capacity_factor: float | None = None      # moe.capacity_factor: None = dropless
    max_nodes_per_token: int | None = None    # moe.max_nodes_per_token: node-limited routing (DeepSeek-V3 §2.1.2)
    # whether the EP dispatch sends a token once per destination node and forwards it over NVLink
    # (DeepSeek-V3 §3.2.2, DeepEP; moe.token_dispatcher: hierarchical), else every routed copy
    dispatch_dedup: bool = False
    # planner-only architecture facts (see the module doc)
    head_dim_override: int | None = None      # query/key width per head when not hidden/heads
    v_head_dim: int | None = None             # value width per head when not the query/key one
    attn_params_override: int | None = None   # attention projection parameters per layer (MLA)
    mlp_matrices: int = 3                     # dense MLP: 3 = SwiGLU, 2 = GELU
    window: int | None = None                 # sliding-window span (tokens) of ``window_layers`` layers
    window_layers: int = 0

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
                   moe_layer_flags=flags, vocab_assumed=assumed, head_dim_override=m.head_dim,
                   capacity_factor=moe.capacity_factor if moe.num_experts else None,
                   max_nodes_per_token=moe.max_nodes_per_token if moe.num_experts else None,
                   dispatch_dedup=moe.token_dispatcher == "hierarchical")

    # -- widths ------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.heads

    @property
    def h_q(self) -> int:
        return self.heads * self.head_dim

    @property
    def h_kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def h_v(self) -> int:
        """Attention output width (the out-projection's input): a·d_v."""
        return self.heads * (self.v_head_dim or self.head_dim)

    @property
    def h_kv_v(self) -> int:
        """Value projection width: kv_heads·d_v."""
        return self.kv_heads * (self.v_head_dim or self.head_dim)

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
        if self.attn_params_override is not None:
            return self.attn_params_override
        h = self.hidden
        return h * (self.h_q + self.h_kv + self.h_kv_v) + self.h_v * h

    @property
    def attn_out_params(self) -> int:
        """The output projection's share of :attr:`attn_params` (h_v × h)."""
        return self.h_v * self.hidden

    @property
    def norm_params(self) -> int:
        return 2 * self.hidden

    @property
    def mlp_params(self) -> int:
        """Dense MLP of one layer: SwiGLU w1, w3 (h×F) and w2 (F×h); GELU w1 and w2."""
        return self.mlp_matrices * self.hidden * self.ffn

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
        """Forward QKᵀ and AV FLOPs per token of one layer, averaged over the layers:
        2·s·(h_q + h_v) (= 4·s·h_q when d_v = d), half with a causal mask; a sliding-window
        layer attends to ``window`` keys (all of them, causal or not)."""
        full = 2.0 * self.seq_len * (self.h_q + self.h_v) * (0.5 if causal else 1.0)
        if not self.window or not self.window_layers:
            return full
        windowed = 2.0 * min(self.window, self.seq_len) * (self.h_q + self.h_v)
        return (full * (self.layers - self.window_layers) + windowed * self.window_layers) / self.layers

    @property
    def logits_flops(self) -> float:
        return 2.0 * self.hidden * self.vocab

    def model_flops_per_token(self) -> float:
        """Forward + backward model FLOPs per token (the MFU numerator), see module doc."""
        fwd = sum(self.layer_matmul_flops(flag) + self.attention_flops() for flag in self.moe_layer_flags)
        return 3.0 * (fwd + self.logits_flops)

    def recompute_flops_per_token(self, checkpointing: str, modules: tuple[str, ...] = ("core_attn",)) -> float:
        """Extra forward FLOPs per token that activation checkpointing executes (same convention).
        ``modules``: what selective checkpointing recomputes (layout.RECOMPUTE_MODULES):
        ``core_attn`` the attention core, ``mla_up_proj`` the core and the attention input
        projections (all of them: the planner keeps MLA's chain as one GEMM), ``mlp`` the dense
        MLPs; ``layernorm`` and ``moe_act`` recompute elementwise kernels only (no matmul FLOPs)."""
        if checkpointing == "full":
            return sum(self.layer_matmul_flops(flag) + self.attention_flops() for flag in self.moe_layer_flags)
        if checkpointing != "selective":
            return 0.0
        f = 0.0
        if "core_attn" in modules or "mla_up_proj" in modules:
            f += self.layers * self.attention_flops()
        if "mla_up_proj" in modules:
            f += self.layers * 2.0 * (self.attn_params - self.attn_out_params)
        if "mlp" in modules:
            f += self.dense_layers * 2.0 * self.mlp_params
        return f

    def dedup_args(self) -> tuple[int | None, tuple[int, int] | None]:
        """(max_nodes, spread) for traffic.ep_all_to_all: a de-duplicating dispatcher sends a token
        once per destination domain, limited to ``max_nodes_per_token`` or, without a limit, to
        the domains its top-k experts fall into; the flat dispatcher sends every copy (None, None)."""
        if not self.dispatch_dedup:
            return None, None
        if self.max_nodes_per_token is not None:
            return self.max_nodes_per_token, None
        return None, (self.num_experts, self.top_k)

    def expert_copies(self, imbalance: float = 1.0) -> float:
        """Routed copies of one token that the busiest expert rank computes and receives, in
        units of a token: top_k × the load of the busiest expert over the mean, capped by the
        capacity factor (moetrain drops an expert's assignments beyond
        ⌈capacity_factor·T·k/E⌉ before dispatch, Switch Transformer §2.2, so no expert ever
        gets more than capacity_factor × the mean)."""
        load = imbalance if self.capacity_factor is None else min(imbalance, self.capacity_factor)
        return self.top_k * load

    def dispatched_copies(self) -> float:
        """Routed copies of one token that are dispatched at all: top_k, fewer when a
        capacity factor below 1 forces drops."""
        return self.top_k * (1.0 if self.capacity_factor is None else min(1.0, self.capacity_factor))
