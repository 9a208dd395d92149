"""The decoder-only transformer (Llama / Mixtral / DeepSeek style).

Shape legend: B batch, S sequence, D hidden, V vocabulary.

The model is single-device and meta-constructible::

    with torch.device("meta"):
        model = Transformer.from_config(cfg)
    parallelize(model, ...)            # moetrain.parallel.apply: splits, shards, wraps
    model.to_empty(device=...)
    init_weights(model, seed)          # moetrain.model.init: same values under every layout

Blocks live in a ``ModuleDict`` keyed by their global index, so that a pipeline stage that
keeps only some blocks keeps their names (and checkpoints stay layout-independent).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from moetrain.config import Config
from moetrain.model.attention import DocumentMask, attention_kernel, positions_in_document
from moetrain.model.layers import Attention, Embedding, FeedForward, Linear, Llama3RopeScaling, RMSNorm, rope_cos_sin
from moetrain.model.moe import MoE
from moetrain.model.recompute import recompute_context


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)); then + mlp(norm(x)) where mlp is dense or MoE."""

    def __init__(self, cfg: Config, layer: int):
        super().__init__()
        m, moe = cfg.model, cfg.moe
        self.layer = layer
        self.attention_norm = RMSNorm(m.hidden, m.norm_eps)
        self.attention = Attention(m.hidden, m.heads, m.kv_heads, m.resolved_head_dim, m.qkv_bias, m.qk_norm,
                                   m.norm_eps)
        self.attention.kernel = attention_kernel(m.attention_backend)
        self.ffn_norm = RMSNorm(m.hidden, m.norm_eps)
        self.moe: MoE | None = None
        self.feed_forward: FeedForward | None = None
        if moe.is_moe_layer(layer):
            self.moe = MoE(m.hidden, moe.ffn_hidden, moe.num_experts, moe.top_k, moe.shared_experts,
                           moe.aux_loss_coef, moe.z_loss_coef, moe.capacity_factor, moe.norm_topk_prob,
                           moe.score_function, moe.routed_scaling_factor, moe.bias_update_rate,
                           shared_hidden=moe.shared_hidden, shared_gate=moe.shared_expert_gate)
        else:
            self.feed_forward = FeedForward(m.hidden, m.ffn_hidden)

        # Full activation recomputation of this block (set by moetrain.parallel.activation).
        self.recompute = False

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc: DocumentMask | None = None) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x_BSD, cos, sin, doc, use_reentrant=False,
                                                     context_fn=recompute_context)
        return self._forward(x_BSD, cos, sin, doc)

    def _forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 doc: DocumentMask | None = None) -> torch.Tensor:
        h = x_BSD + self.attention(self.attention_norm(x_BSD), cos, sin, doc=doc)
        mlp = self.moe if self.moe is not None else self.feed_forward
        return h + mlp(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids [B, S] → logits [B, S, V] (fp32, whatever the compute dtype: the loss is fp32).

    ``positions`` ([S], optional) gives each local token's global position for RoPE; it is
    needed when a rank holds a non-contiguous part of the sequence (context parallelism).
    ``doc_ids`` ([B, S_full], optional: the document index of every token of the whole samples,
    see :class:`moetrain.model.attention.DocumentMask`) restricts attention to each token's
    document, and with ``data.reset_position_ids`` restarts RoPE positions at every document.
    ``tok_embeddings``, ``norm`` and ``output`` may be ``None`` in a pipeline stage that does not
    own them.
    """

    def __init__(self, cfg: Config):
        super().__init__()
        m = cfg.model
        if m.vocab_size is None:
            raise ValueError("model.vocab_size is unresolved; resolve it from the data manifest first "
                             "(moetrain.launch.preflight.resolve_vocab) or set it in the config")
        self.cfg = cfg
        self.head_dim = m.resolved_head_dim
        self.rope_theta = m.rope_theta
        self.rope_scaling = (Llama3RopeScaling(m.rope_scaling_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
                                               m.rope_original_max_positions)
                             if m.rope_scaling == "llama3" else None)
        self.tok_embeddings: nn.Embedding | None = Embedding(m.vocab_size, m.hidden)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(m.layers)})
        self.norm: RMSNorm | None = RMSNorm(m.hidden, m.norm_eps)
        self.output: nn.Linear | None = Linear(m.hidden, m.vocab_size, bias=False)
        self.reset_position_ids = cfg.data.reset_position_ids
        if m.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Global positions of the local tokens when they are not 0..S-1 (context parallelism
        # holds two chunks of the sequence); set by moetrain.parallel.context.
        self.positions: torch.Tensor | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> "Transformer":
        return cls(cfg)

    def moe_layers(self) -> dict[str, MoE]:
        """The MoE modules held by this (possibly partial) model, keyed by block index."""
        return {name: blk.moe for name, blk in self.layers.items() if blk.moe is not None}

    def forward(self, tokens_or_h: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens_or_h) if self.tok_embeddings is not None else tokens_or_h
        S = h.shape[1]
        if positions is None:
            positions = self.positions if self.positions is not None else torch.arange(S, device=h.device)
        positions = positions.to(h.device)
        doc = None
        if doc_ids is not None:
            doc = DocumentMask(doc_ids, positions)
            rope_positions = positions_in_document(doc_ids)[:, positions] if self.reset_position_ids else positions
        else:
            rope_positions = positions
        cos, sin = rope_cos_sin(rope_positions, self.head_dim, self.rope_theta, self.rope_scaling)
        for block in self.layers.values():
            h = block(h, cos, sin, doc)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h).float()
        return h
