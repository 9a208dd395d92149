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

from moetrain.config import Config, ModelConfig, MoEConfig
from moetrain.model.attention import DocumentMask, attention_kernel, positions_in_document
from moetrain.model.dsa import Indexer
from moetrain.model.layers import (Attention, Embedding, FeedForward, Linear, Llama3RopeScaling, RMSNorm,
                                   YarnRopeScaling, attention_temperature, rope_cos_sin, yarn_mscale)
from moetrain.model.fp8 import dispatch_wire
from moetrain.model.gated_deltanet import GatedDeltaNet, delta_rule
from moetrain.model.kda import KimiDeltaAttention, kda_rule
from moetrain.model.mamba2 import Mamba2, ssd_scan
from moetrain.model.mla import MLAttention
from moetrain.model.moe import MoE, SlotMap, TokenMask
from moetrain.model.recompute import recompute_context


# The token mixers that carry a state along the sequence (no positions, no attention kernel).
RECURRENT = (GatedDeltaNet, KimiDeltaAttention, Mamba2)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)); then + mlp(norm(x)) where mlp is dense or MoE.
    ``attention`` is the block's token mixer: attention (GQA or MLA), or gated DeltaNet, Kimi
    Delta Attention or Mamba-2 where ``model.layer_types`` says ``linear_attention``, ``kda`` or
    ``mamba``. A block of ``model.hybrid_override_pattern`` has one of the two sublayers (its
    norm with it): ``attention`` and ``attention_norm`` None in an MLP / MoE block, ``moe``,
    ``feed_forward`` and ``ffn_norm`` None in a token-mixer block."""

    def __init__(self, m: ModelConfig, moe: MoEConfig, layer: int, dispatch_wire: torch.dtype | None = None):
        super().__init__()
        self.layer = layer
        zc = m.zero_centered_norm
        mixer, ffn = m.layer_type(layer), m.ffn_type(layer, moe)
        self.attention_norm: RMSNorm | None = RMSNorm(m.hidden, m.norm_eps, zc) if mixer != "none" else None
        window = m.window_of(layer)
        self.attention: Attention | MLAttention | GatedDeltaNet | KimiDeltaAttention | Mamba2 | None
        if mixer == "none":
            self.attention = None
        elif mixer == "mamba":
            self.attention = Mamba2(m.hidden, m.mamba_num_heads, m.mamba_head_dim, m.ssm_state_size, m.n_groups,
                                    m.conv_kernel, m.use_conv_bias, m.norm_eps, m.mamba_chunk_size, m.time_step_min)
            self.attention.scan = ssd_scan(m.mamba_backend)
        elif mixer == "linear_attention":
            self.attention = GatedDeltaNet(m.hidden, m.linear_num_key_heads, m.linear_num_value_heads,
                                           m.linear_key_head_dim, m.linear_value_head_dim, m.linear_conv_kernel_dim,
                                           m.norm_eps, m.linear_chunk_size)
            self.attention.rule = delta_rule(m.linear_attention_backend)
        elif mixer == "kda":
            self.attention = KimiDeltaAttention(m.hidden, m.linear_num_key_heads, m.linear_key_head_dim,
                                                m.linear_conv_kernel_dim, m.norm_eps, m.linear_chunk_size)
            self.attention.rule = kda_rule(m.linear_attention_backend)
        elif m.attention == "mla":
            d = m.dsa
            indexer = Indexer(m.hidden, m.q_lora_rank, d.index_heads, d.index_head_dim, m.qk_rope_head_dim,
                              d.index_topk, d.stage, d.indexer_loss_coef, d.attention == "gathered") if d.enabled else None
            self.attention = MLAttention(m.hidden, m.heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim,
                                         m.qk_rope_head_dim, m.v_head_dim, mla_scale(m), m.norm_eps, window,
                                         m.attention_sinks, indexer)
        else:
            self.attention = Attention(m.hidden, m.heads, m.kv_heads, m.resolved_head_dim, m.qkv_bias, m.qk_norm,
                                       m.norm_eps, m.attention_out_bias, m.attention_sinks, window,
                                       m.attention_output_gate, zc, rope=m.rope_of(layer), chunk=m.chunk_of(layer))
        if isinstance(self.attention, (Attention, MLAttention)):
            self.attention.kernel = attention_kernel(m.attention_backend)
        self.ffn_norm: RMSNorm | None = RMSNorm(m.hidden, m.norm_eps, zc) if ffn != "none" else None
        self.moe: MoE | None = None
        self.feed_forward: FeedForward | None = None
        if ffn == "moe":
            self.moe = MoE(m.hidden, moe.ffn_hidden, moe.num_experts, moe.top_k, moe.shared_experts,
                           moe.aux_loss_coef, moe.z_loss_coef, moe.capacity_factor, moe.norm_topk_prob,
                           moe.score_function, moe.routed_scaling_factor, moe.bias_update_rate,
                           shared_hidden=moe.shared_hidden, shared_gate=moe.shared_expert_gate, n_group=moe.n_group,
                           topk_group=moe.topk_group, routing_bias=moe.routing_bias, router_bias=moe.router_bias,
                           expert_biases=moe.expert_biases, activation=moe.activation, swiglu_alpha=moe.swiglu_alpha,
                           swiglu_limit=moe.swiglu_limit, probs_on_input=moe.apply_probs_on_input,
                           dispatch_wire=dispatch_wire, num_slots=moe.num_slots)
            if moe.eplb.enabled:  # the first placement: experts in order, then replicas of the first ones
                E = moe.num_experts
                self.moe.experts.slot_map = SlotMap([s % E for s in range(moe.num_slots)], E)
        elif ffn == "dense":
            self.feed_forward = FeedForward(m.hidden, m.ffn_hidden, m.mlp_activation)

        # Full activation recomputation of this block (set by moetrain.parallel.activation).
        self.recompute = False

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc: DocumentMask | None = None, tokens: TokenMask | None = None,
                temperature: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens``: the real (not padding) tokens, which the MoE layer routes (None: all);
        ``temperature``: the NoPE blocks' query scale (:func:`attention_temperature`; None: 1)."""
        if self.recompute and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x_BSD, cos, sin, doc, tokens, temperature,
                                                     use_reentrant=False, context_fn=recompute_context)
        return self._forward(x_BSD, cos, sin, doc, tokens, temperature)

    def _forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 doc: DocumentMask | None = None, tokens: TokenMask | None = None,
                 temperature: torch.Tensor | None = None) -> torch.Tensor:
        if self.attention is None:
            h = x_BSD
        elif isinstance(self.attention, RECURRENT):  # no positions: its state orders the tokens
            h = x_BSD + self.attention(self.attention_norm(x_BSD), doc)
        elif isinstance(self.attention, Attention):
            h = x_BSD + self.attention(self.attention_norm(x_BSD), cos, sin, doc=doc, temperature=temperature)
        else:
            h = x_BSD + self.attention(self.attention_norm(x_BSD), cos, sin, doc=doc)
        if self.moe is not None:
            return h + self.moe(self.ffn_norm(h), tokens=tokens)
        if self.feed_forward is not None:
            return h + self.feed_forward(self.ffn_norm(h))
        return h


def mla_scale(m: ModelConfig) -> float:
    """MLA's softmax scale: (qk_nope + qk_rope)^-1/2, times mscale(factor, mscale_all_dim)² under
    YaRN with ``rope_mscale_all_dim`` (DeepSeek-V3's reference code and Hugging Face's)."""
    scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    if m.rope_scaling != "none" and m.rope_mscale_all_dim:
        scale *= yarn_mscale(m.rope_scaling_factor, m.rope_mscale_all_dim) ** 2
    return scale


def rope_scaling(m: ModelConfig):
    """The frequency rescaling of ``model.rope_scaling`` (None for ``none``)."""
    if m.rope_scaling == "llama3":
        return Llama3RopeScaling(m.rope_scaling_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
                                 m.rope_original_max_positions)
    if m.rope_scaling == "yarn":
        return YarnRopeScaling(m.rope_scaling_factor, m.rope_original_max_positions, m.rope_beta_fast,
                               m.rope_beta_slow, m.rope_mscale, m.rope_mscale_all_dim, m.rope_truncate)
    return None


class MTPModule(nn.Module):
    """Multi-token prediction module k (DeepSeek-V3 §2.2, eq. 21-23): h' = W [RMSNorm(Emb(t_{i+k}));
    RMSNorm(h_i^{k-1})] (Hugging Face's order), one block of the model's kind, and its own final
    norm before the shared output head. x: [B, S, D] → [B, S, D]."""

    def __init__(self, m: ModelConfig, moe: MoEConfig, layer: int, dispatch_wire: torch.dtype | None = None):
        super().__init__()
        zc = m.zero_centered_norm  # Qwen3-Next's module scales its norms by 1 + weight, as its blocks
        self.enorm = RMSNorm(m.hidden, m.norm_eps, zc)
        self.hnorm = RMSNorm(m.hidden, m.norm_eps, zc)
        self.eh_proj = Linear(2 * m.hidden, m.hidden, bias=False)
        self.block = Block(m, moe, layer, dispatch_wire)
        self.norm = RMSNorm(m.hidden, m.norm_eps, zc)

    def forward(self, h_BSD: torch.Tensor, emb_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc: DocumentMask | None = None, tokens: TokenMask | None = None) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb_BSD), self.hnorm(h_BSD)], dim=-1))
        return self.norm(self.block(x, cos, sin, doc, tokens))


class Transformer(nn.Module):
    """Token ids [B, S] → logits [B, S, V] (fp32, whatever the compute dtype: the loss is fp32).

    ``positions`` ([S], optional) gives each local token's global position for RoPE; it is
    needed when a rank holds a non-contiguous part of the sequence (context parallelism).
    ``doc_ids`` ([B, S_full], optional: the document index of every token of the whole samples,
    see :class:`moetrain.model.attention.DocumentMask`) restricts attention to each token's
    document, and with ``data.reset_position_ids`` restarts RoPE positions at every document.
    ``padding`` ([B, S_full] bool, optional, whole samples: True at the padding that ends a packed
    sequence) keeps those tokens out of every MoE layer's routing, losses and statistics
    (:class:`moetrain.model.moe.TokenMask`); nothing after them in their sequence is trained, so
    the loss and the gradients are the ones of the sequences without their padding.
    ``tok_embeddings``, ``norm`` and ``output`` may be ``None`` in a pipeline stage that does not
    own them; ``embeds_input`` False: the input is the previous stage's hidden state [B, S, D]
    (the last stage keeps a copy of the embedding for its MTP modules).

    Built from the ``model`` and ``moe`` sections (:meth:`from_config` takes a run's config):
    ``dispatch_wire`` the dtype routed tokens travel in (:func:`moetrain.model.fp8.dispatch_wire`,
    None: as computed); ``reset_position_ids`` restarts RoPE positions at every document
    (``data.reset_position_ids``).

    Raises:
        ValueError: ``model.vocab_size`` unresolved (None).
    """

    def __init__(self, m: ModelConfig, moe: MoEConfig, *, dispatch_wire: torch.dtype | None = None,
                 reset_position_ids: bool = False):
        super().__init__()
        if m.vocab_size is None:
            raise ValueError("model.vocab_size is unresolved; resolve it from the data manifest first "
                             "(moetrain.launch.preflight.resolve_vocab) or set it in the config")
        self.model_cfg = m
        self.rotary_dim = m.rotary_dim
        self.rope_theta = m.rope_theta
        self.rope_scaling = rope_scaling(m)
        self.tok_embeddings: nn.Embedding | None = Embedding(m.vocab_size, m.hidden)
        self.embeds_input = True
        self.layers = nn.ModuleDict({str(i): Block(m, moe, i, dispatch_wire) for i in range(m.layers)})
        self.norm: RMSNorm | None = RMSNorm(m.hidden, m.norm_eps, m.zero_centered_norm)
        self.output: nn.Linear | None = Linear(m.hidden, m.vocab_size, bias=False)
        # The head's weight gets several gradient terms (the MTP heads, a tied embedding): computed
        # at once, so they add up in the order they do without delay_wgrad_compute.
        self.output.defer_wgrad = False
        # Multi-token prediction: keyed by their global index after the last block (the names
        # DeepSeek-V3's checkpoints give them), on the last pipeline stage.
        self.mtp = nn.ModuleDict({str(m.layers + k): MTPModule(m, moe, m.layers + k, dispatch_wire)
                                  for k in range(m.mtp_depth)})
        self.reset_position_ids = reset_position_ids
        if m.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Global positions of the local tokens when they are not 0..S-1 (context parallelism
        # holds two chunks of the sequence); set by moetrain.parallel.context.
        self.positions: torch.Tensor | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> "Transformer":
        """The model a run's config describes (its ``model``, ``moe``, the dispatch dtype that
        ``moe.dispatch_dtype`` and ``train.precision`` give, ``data.reset_position_ids``)."""
        return cls(cfg.model, cfg.moe, dispatch_wire=dispatch_wire(cfg.moe.dispatch_dtype, cfg.train.precision),
                   reset_position_ids=cfg.data.reset_position_ids)

    def blocks(self) -> dict[str, Block]:
        """Every transformer block held by this (possibly partial) model, the MTP modules' too,
        keyed by global block index."""
        return {**self.layers, **{name: module.block for name, module in self.mtp.items()}}

    def moe_layers(self) -> dict[str, MoE]:
        """The MoE modules held by this (possibly partial) model, the MTP modules' included,
        keyed by block index."""
        return {name: blk.moe for name, blk in self.blocks().items() if blk.moe is not None}

    def forward(self, tokens_or_h: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, future: torch.Tensor | None = None,
                padding: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, V] (fp32); with multi-token prediction, in training and given ``future``
        ([B, S, 1 + 2·mtp_depth] int64, :func:`future_tokens`), [B, S, 1 + mtp_depth, V]: the main
        head's and every MTP module's logits (:func:`moetrain.model.loss.model_loss`)."""
        h = self.tok_embeddings(tokens_or_h) if self.embeds_input else tokens_or_h
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
        cos, sin = rope_cos_sin(rope_positions, self.rotary_dim, self.rope_theta, self.rope_scaling)
        if not self.model_cfg.rope:  # NoPE: the rotation by angle 0 is the identity, exactly
            cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
        m = self.model_cfg
        temperature = (attention_temperature(rope_positions, m.floor_scale, m.attn_scale)
                       if m.attn_temperature_tuning else None)
        tokens = TokenMask.from_padding(padding.to(h.device), positions) if padding is not None else None
        for block in self.layers.values():
            h = block(h, cos, sin, doc, tokens, temperature)
        if self.output is None:
            return self.norm(h) if self.norm is not None else h
        logits = self.output(self.norm(h) if self.norm is not None else h).float()
        if not len(self.mtp) or future is None or not self.training:
            return logits
        # Module k sees the previous module's hidden state and the embedding of the token k ahead
        # (ids beyond the sample, -100, embed as token 0: their predictions are not scored).
        out, depth = [logits], len(self.mtp)
        for k, module in enumerate(self.mtp.values(), start=1):
            h = module(h, self.tok_embeddings(future[..., depth + k].clamp(min=0)), cos, sin, doc, tokens)
            out.append(self.output(h).float())
        return torch.stack(out, dim=2)


def future_tokens(targets_BS: torch.Tensor, depth: int, next_tokens_BS: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S, 1 + 2·depth] int64 for multi-token prediction, built on whole samples (before
    context parallelism splits them). Channels 0 … depth: the targets of position i, of the main
    head and of each module k (t_{i+1}, …, t_{i+1+depth}), −100 (ignored) where the loss mask
    excludes them (``targets_BS`` [B, S] carries it) or they lie beyond the sample: module k's
    target is trained where the mask trains that token. Channels depth + k (k = 1 … depth): the
    token module k embeds at position i, t_{i+k}, never masked (``next_tokens_BS`` [B, S], the
    unmasked next tokens; None: ``targets_BS`` has no mask), −100 beyond the sample (DeepSeek-V3
    §2.2)."""
    B, S = targets_BS.shape
    nxt = targets_BS if next_tokens_BS is None else next_tokens_BS

    def shifted(t: torch.Tensor, j: int) -> torch.Tensor:
        return torch.cat([t[:, j:], t.new_full((B, j), -100)], dim=1)

    return torch.stack([shifted(targets_BS, j) for j in range(depth + 1)]
                       + [shifted(nxt, k - 1) for k in range(1, depth + 1)], dim=-1)
