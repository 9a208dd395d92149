"""Run configuration: one YAML file → typed, frozen dataclasses, validated as a whole.

A run is described by the sections ``run``, ``model``, ``moe``, ``parallel``, ``data``,
``train``, ``checkpoint``, ``launch`` and ``metrics``. ``load_config(path, overrides)`` reads the YAML,
applies ``section.key=value`` overrides (values parsed as YAML scalars), checks every key and
type, and runs every rule of :func:`validate` (world size, divisibility, batch arithmetic): one
function per section, each rule with the field its message names. :func:`check_supported` adds
what this version cannot run on the device (backends, packages, pipeline layouts). Every failure
raises :class:`ConfigError` whose message names the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Literal

import yaml

from moetrain.utils import ConfigError, atomic_write, field_error  # the error shape every layer shares

__all__ = [
    "ConfigError",
    "field_error",
    "LayoutFacts",
    "layout_refusal",
    "RunConfig",
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "DataConfig",
    "BlendSource",
    "TrainConfig",
    "AnomalyConfig",
    "LoraConfig",
    "ProfileConfig",
    "CheckpointConfig",
    "LaunchConfig",
    "ContainerConfig",
    "ElasticConfig",
    "MetricsConfig",
    "WandbConfig",
    "Config",
    "load_config",
    "config_from_dict",
    "apply_overrides",
    "Layers",
    "read_layers",
    "load_layers",
    "resolve_dp_auto",
    "render_config",
    "explain",
    "save_config",
    "validate",
    "check_supported",
    "overlap_split",
    "splits_micro_batches",
]


# ---------------------------------------------------------------------------------------------
# Sections. Every field has a default unless a run cannot exist without it; docstrings give units.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """``name``: run name (used in job names). ``dir``: run directory (config, metrics, logs,
    checkpoints); relative paths are relative to the current directory. ``seed``: seeds the
    parameter initialisation and the data order."""

    name: str = "moetrain"
    dir: str = "runs/moetrain"
    seed: int = 1234


@dataclass(frozen=True)
class DSAConfig:
    """``model.dsa``: DeepSeek Sparse Attention on MLA (DeepSeek-AI 2025, "DeepSeek-V3.2-Exp"
    §2.1; DeepSeek-V3.2, GLM-5). A lightning indexer scores every earlier token of each query,
    I(t, s) = Σ_j w(t, j) · ReLU(q_I(t, j) · k_I(s)) · ``index_head_dim``^-1/2 over ``index_heads``
    heads j, from a query q_I [index_heads, index_head_dim] projected from MLA's query latent, one
    key k_I [index_head_dim] shared by the heads (LayerNorm; RoPE on its first ``qk_rope_head_dim``
    dims, as the query's) and per-head weights w projected from the block's input (times
    index_heads^-1/2); each query then attends to its ``index_topk`` best-scored visible keys (all
    of them when it sees fewer). ``index_topk`` 0 (the default) turns DSA off. ``stage``:

    * ``dense_warmup`` — attention stays dense, every parameter but the indexers' is frozen, and
      the indexers learn KL(p ‖ softmax(I)) with p the main attention's probabilities summed over
      its heads and L1-normalised (the report's eq. 3);
    * ``sparse`` — the attention is over the selected keys; the indexers learn the KL over the
      selected keys only (eq. 4) while the rest of the model learns the language-modelling loss.

    In both the indexer's inputs are detached (its loss trains the indexer alone; the selection
    gives the main model no gradient). The loss, weighted by ``indexer_loss_coef``, joins the
    objective through the indexers' gradients and is logged as ``indexer_loss`` (mean over the
    DSA layers and the tokens).

    ``attention``: how the sparse stage attends — ``masked``, the reference (dense scores with
    the selection as a mask: exact, O(S²) per layer, every layout), or ``gathered``: MLA in its
    absorbed form (DeepSeek-V2 §2.1.2: the key up-projection folded into the queries) over the
    K selected latents of each query, O(S·K) per layer, blocks of queries recomputed in backward
    (what DeepSeek's sparse kernels do, in PyTorch; needs ``parallel.cp`` 1)."""

    index_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 0
    stage: Literal["dense_warmup", "sparse"] = "sparse"
    indexer_loss_coef: float = 1.0
    attention: Literal["masked", "gathered"] = "masked"

    @property
    def enabled(self) -> bool:
        return self.index_topk > 0


@dataclass(frozen=True)
class ModelConfig:
    """Decoder shape. ``hidden``: model width d. ``ffn_hidden``: SwiGLU inner width of the dense
    MLP. ``vocab_size``: ``null`` takes the tokenizer's vocabulary from the data manifest,
    padded up to a multiple of ``vocab_multiple`` (Megatron pads so that the vocabulary splits
    evenly over tp). ``seq_len``: tokens per sample. ``rope_theta``: RoPE base (Su et al. 2021).
    ``rope``: ``false`` leaves the attention layers without positional encoding (NoPE, Kazemnejad
    et al. 2023: the causal mask and, in hybrids, the recurrent layers order the tokens), as Kimi
    Linear's MLA layers and Nemotron-H's attention have it. ``mlp_activation``: the dense MLP's —
    ``swiglu`` (three matrices) or ``relu2``, relu(x w1)² then w2 (non-gated, Nemotron-H's).
    ``init_std``: std of the normal initialisation; output projections are scaled by
    1/sqrt(2·layers) (GPT-2 §2.3). ``attention_backend``: the core-attention kernel —
    ``sdpa`` (``F.scaled_dot_product_attention``; the reference, every device), ``flash``
    (flash-attn's ``flash_attn_func`` / ``flash_attn_varlen_func``: CUDA, bf16, needs the
    ``flash-attn`` package), ``flex`` (``torch.nn.attention.flex_attention``, compiled: CUDA; it
    has no backward on CPU in torch 2.13).

    Options that the Hugging Face architectures need (``moetrain.hf``); each default is the plain
    Llama/Mixtral block:

    * ``head_dim``: query/key/value width per head; ``null`` is hidden / heads (Qwen3-MoE uses
      a wider head than that).
    * ``qk_norm``: RMSNorm of the queries and keys after their projection, before RoPE: ``head``
      over each head's ``head_dim`` with one weight shared by the heads (Qwen3; Dehghani et al.
      2023 §3.2), ``projection`` over the whole query (heads·head_dim) and key (kv_heads·head_dim)
      projection (OLMoE; Muennighoff et al. 2024), ``none``.
    * ``qkv_bias``: biases on the query, key and value projections (Qwen1.5-MoE / Qwen2-MoE).
    * ``rope_scaling``: ``llama3`` rescales the RoPE frequencies as Llama 3.1 does (Grattafiori
      et al. 2024 §3.3.1; Meta's reference ``apply_scaling``): wavelengths longer than
      ``rope_original_max_positions / rope_low_freq_factor`` tokens are divided by
      ``rope_scaling_factor``, those shorter than ``rope_original_max_positions /
      rope_high_freq_factor`` are kept, the ones between interpolated; ``yarn`` is YaRN (Peng et
      al. 2023, "YaRN", §3.2-3.4, as DeepSeek-V3 and GPT-OSS use it): frequencies blended between
      interpolated (÷ ``rope_scaling_factor``) and kept by a linear ramp over the dimensions whose
      wavelength lies between ``rope_beta_fast`` and ``rope_beta_slow`` rotations in
      ``rope_original_max_positions`` tokens (``rope_truncate`` rounds the ramp's ends out), and
      cos/sin multiplied by the attention factor 0.1·ln(factor) + 1 — or, when
      ``rope_mscale`` and ``rope_mscale_all_dim`` are both set, by the ratio of their two such
      factors (DeepSeek-V3); ``none`` keeps them all.
    * ``partial_rotary_factor``: RoPE on the first fraction of each head's dimensions only, the
      rest passing unrotated (GLM-4.5: 0.5).
    * ``attention_out_bias``: a bias on the output projection (GPT-OSS; ``qkv_bias`` covers q/k/v).
    * ``attention_sinks``: one learned logit per head that joins every query's softmax (its value
      is zero: a place for attention to go when no key fits; GPT-OSS, Xiao et al. 2023).
    * ``sliding_window``: each query sees at most this many keys, itself included, in the blocks
      i with i % ``window_every`` == 0 (GPT-OSS: 128, every other block); ``null``: none.
    * ``attention``: ``gqa`` (grouped-query attention, the blocks above) or ``mla``, DeepSeek's
      multi-head latent attention (DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1): queries through an
      optional low-rank bottleneck of ``q_lora_rank`` (``null``: one projection), keys and
      values from a compressed latent of ``kv_lora_rank`` (RMS-normed) expanded per head to
      ``qk_nope_head_dim`` (keys) and ``v_head_dim`` (values), plus a RoPE key of
      ``qk_rope_head_dim`` shared by all heads; the softmax scale is (qk_nope + qk_rope)^-1/2,
      times mscale² under YaRN with ``rope_mscale_all_dim``. ``kv_heads`` and ``head_dim`` do not
      apply.
    * ``mtp_depth``: multi-token prediction (DeepSeek-V3 §2.2): that many sequential modules after
      the last block, module k predicting the token k + 1 further from the previous module's
      hidden state and the embedding of the token k ahead, through one block of the model's kind;
      they share the embedding and the output head with the model. Their mean loss, weighted by
      ``mtp_loss_coef``, adds to the objective and is logged as ``mtp_loss``; validation and
      exports to architectures without MTP leave them out. In a hybrid the modules' blocks are
      full attention (Qwen3-Next's MTP layer), their norms zero-centred with
      ``zero_centered_norm``.

    Hybrid models (Qwen3-Next, :mod:`moetrain.model.gated_deltanet`; Mamba-2 as Nemotron-H has it,
    :mod:`moetrain.model.mamba2`):

    * ``layer_types``: each block's token mixer, Hugging Face's names — ``full_attention`` (the
      attention above), ``linear_attention`` (gated DeltaNet, Yang et al. 2024), ``kda`` (Kimi
      Delta Attention, Kimi Team 2025: the gated delta rule with a decay per key channel;
      :mod:`moetrain.model.kda`) or ``mamba`` (Mamba-2, Dao & Gu 2024; :mod:`moetrain.model.mamba2`);
      empty: every block ``full_attention``. Its length is ``layers``.
    * ``hybrid_override_pattern``: blocks of one sublayer each (Nemotron-H's layers), one symbol
      per block as Megatron-Core's hybrid models write them — ``M`` Mamba-2, ``*`` attention,
      ``-`` a dense MLP, ``E`` an MoE, and moetrain's ``G`` gated DeltaNet and ``K`` KDA — each
      ``x + sublayer(RMSNorm(x))``; e.g. ``M-M*-ME`` or a Qwen3-Next-like ``GEGEGE*E`` (its
      length is ``layers``; ``layer_types``, ``moe.every`` and ``moe.first_dense`` stay unset: the
      pattern says where the MoE blocks are). Empty: every block has a token mixer and an MLP.
    * the Mamba-2 layers' shape, Nemotron-H's names: ``mamba_num_heads``, ``mamba_head_dim`` (P),
      ``ssm_state_size`` (N), ``n_groups`` (groups of heads sharing B and C), ``conv_kernel`` (the
      convolution's width, tokens), ``use_conv_bias``, ``time_step_min`` (Δ's lower bound),
      ``mamba_chunk_size`` (tokens per chunk of the chunked scan; 128 as Nemotron-H).
      ``mamba_backend``: ``torch`` (the pure-PyTorch chunked scan, every device) or ``mamba_ssm``
      (mamba-ssm's Triton kernel: CUDA, needs the ``mamba-ssm`` package).
    * the gated-DeltaNet layers' shape, Hugging Face's names: ``linear_num_key_heads`` (query /
      key heads), ``linear_num_value_heads`` (value heads, a multiple of the key heads),
      ``linear_key_head_dim``, ``linear_value_head_dim`` (widths per head), ``linear_conv_kernel_dim``
      (the causal depthwise convolution's width, tokens), ``linear_chunk_size`` (tokens per chunk
      of the chunked delta rule: memory [chunk²] per head against the sequential steps between
      chunks; 64 as flash-linear-attention). ``linear_attention_backend``: ``torch`` (the pure-PyTorch
      chunked delta rule, every device) or ``fla`` (flash-linear-attention's Triton kernel: CUDA,
      needs the ``flash-linear-attention`` / ``fla-core`` package).
    * the KDA layers' shape: ``linear_num_key_heads`` heads (queries, keys and values alike:
      ``linear_num_value_heads`` must equal it) of ``linear_key_head_dim`` (=
      ``linear_value_head_dim``; also the rank of its gates' bottleneck), Kimi Linear's
      ``linear_num_heads`` and ``linear_head_dim``; ``linear_conv_kernel_dim``,
      ``linear_chunk_size`` and ``linear_attention_backend`` as above (its chunks hold
      chunk² × head dim values per head: a smaller chunk than gated DeltaNet's suits it on CPU).
    * ``attention_output_gate``: the attention's output is scaled per channel by sigmoid of a
      gate that the query projection also produces (its rows interleaved per head: [q_h; gate_h];
      Qwen3-Next's gated attention).
    * ``zero_centered_norm``: every RMSNorm of the blocks, the final norm and the q/k norms scale
      by (1 + weight), the weight starting at 0 (Qwen3-Next's ``Qwen3NextRMSNorm``).

    Llama 4's attention (Meta 2025, "The Llama 4 herd"; transformers' ``Llama4TextAttention``),
    with Hugging Face's names:

    * ``no_rope_layers``: one entry per block, 1 where the block rotates its queries and keys
      (RoPE) and 0 where it does not (NoPE; Llama 4 has every fourth block NoPE). Hugging Face's
      convention, whatever its name suggests. Empty: every block as ``rope`` says.
    * ``attention_chunk_size``: in the blocks that rotate, a query sees only the keys of its own
      chunk of that many positions (positions p and q attend when p // size == q // size, causal
      inside the chunk; Llama 4: 8192); the NoPE blocks attend to the whole (causal) sequence.
      Positions are the sample's (the chunks do not restart at a document boundary; the document
      mask applies as well). ``null``: no chunks.
    * ``qk_norm: l2``: the queries and keys divided by their root mean square over each head's
      dims (no weight, eps ``norm_eps``), after RoPE and in the blocks that rotate only (Llama 4's
      ``use_qk_norm``).
    * ``attn_temperature_tuning``: in the NoPE blocks the queries are multiplied by
      1 + ``attn_scale`` · ln(1 + floor((p + 1) / ``floor_scale``)) at position p, which keeps the
      attention sharp at long context (Nakanishi 2025, "Scalable-Softmax"; Llama 4's
      temperature tuning). p is the position RoPE uses (it restarts at each document with
      ``data.reset_position_ids``).

    ``dsa``: DeepSeek Sparse Attention on the MLA blocks (:class:`DSAConfig`)."""

    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    ffn_hidden: int = 688
    vocab_size: int | None = None
    vocab_multiple: int = 128
    seq_len: int = 256
    rope_theta: float = 10000.0
    rope: bool = True
    mlp_activation: Literal["swiglu", "relu2"] = "swiglu"
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention_backend: Literal["sdpa", "flash", "flex"] = "sdpa"
    head_dim: int | None = None
    qk_norm: Literal["none", "head", "projection", "l2"] = "none"
    qkv_bias: bool = False
    rope_scaling: Literal["none", "llama3", "yarn"] = "none"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    rope_truncate: bool = True
    partial_rotary_factor: float = 1.0
    attention_out_bias: bool = False
    attention_sinks: bool = False
    sliding_window: int | None = None
    window_every: int = 1
    attention: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mtp_depth: int = 0
    mtp_loss_coef: float = 0.3
    layer_types: tuple[str, ...] = ()
    hybrid_override_pattern: str = ""
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    linear_chunk_size: int = 64
    linear_attention_backend: Literal["torch", "fla"] = "torch"
    mamba_num_heads: int = 8
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 1
    conv_kernel: int = 4
    use_conv_bias: bool = True
    time_step_min: float = 0.0
    mamba_chunk_size: int = 128
    mamba_backend: Literal["torch", "mamba_ssm"] = "torch"
    attention_output_gate: bool = False
    zero_centered_norm: bool = False
    no_rope_layers: tuple[int, ...] = ()
    attention_chunk_size: int | None = None
    attn_temperature_tuning: bool = False
    floor_scale: int = 8192
    attn_scale: float = 0.1
    dsa: DSAConfig = field(default_factory=DSAConfig)

    def layer_type(self, layer: int) -> str:
        """Block ``layer``'s token mixer: ``full_attention``, ``linear_attention``, ``kda``,
        ``mamba``, or ``none`` (an MLP / MoE block of ``hybrid_override_pattern``); the
        multi-token-prediction blocks after the last one: ``full_attention``."""
        if layer < len(self.hybrid_override_pattern):
            return PATTERN_MIXERS.get(self.hybrid_override_pattern[layer], "none")
        return self.layer_types[layer] if layer < len(self.layer_types) else "full_attention"

    def ffn_type(self, layer: int, moe: "MoEConfig") -> str:
        """Block ``layer``'s feed-forward sublayer: ``moe``, ``dense``, or ``none`` (a token-mixer
        block of ``hybrid_override_pattern``)."""
        if layer < len(self.hybrid_override_pattern):
            return {"E": "moe", "-": "dense"}.get(self.hybrid_override_pattern[layer], "none")
        return "moe" if moe.is_moe_layer(layer) else "dense"

    @property
    def linear_attention(self) -> bool:
        """Some block mixes its tokens with gated DeltaNet or KDA (the ``linear_*`` fields)."""
        return "linear_attention" in self.layer_types or "G" in self.hybrid_override_pattern or self.kda

    @property
    def kda(self) -> bool:
        """Some block mixes its tokens with Kimi Delta Attention."""
        return "kda" in self.layer_types or "K" in self.hybrid_override_pattern

    @property
    def mamba(self) -> bool:
        """Some block mixes its tokens with Mamba-2."""
        return "mamba" in self.layer_types or "M" in self.hybrid_override_pattern

    @property
    def resolved_head_dim(self) -> int:
        """Width of one attention head: ``head_dim``, or hidden / heads when it is ``null``
        (under MLA, a query/key head: qk_nope_head_dim + qk_rope_head_dim)."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def rotary_dim(self) -> int:
        """Dimensions of a head that RoPE rotates (the RoPE key's under MLA)."""
        if self.attention == "mla":
            return self.qk_rope_head_dim
        return int(self.resolved_head_dim * self.partial_rotary_factor)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of block ``layer`` (None: full causal attention)."""
        return self.sliding_window if self.sliding_window is not None and layer % self.window_every == 0 else None

    def rope_of(self, layer: int) -> bool:
        """Whether block ``layer`` rotates its queries and keys (``rope`` and ``no_rope_layers``;
        the multi-token-prediction blocks after the last one do)."""
        return self.rope and (layer >= len(self.no_rope_layers) or bool(self.no_rope_layers[layer]))

    def chunk_of(self, layer: int) -> int | None:
        """The attention chunk of block ``layer`` (None: attention over the whole sequence):
        ``attention_chunk_size`` in the blocks that rotate, as Llama 4."""
        return self.attention_chunk_size if self.rope_of(layer) else None


# model.hybrid_override_pattern's token-mixer symbols (the others, - and E, are MLP / MoE blocks).
PATTERN_MIXERS = {"M": "mamba", "*": "full_attention", "G": "linear_attention", "K": "kda"}


@dataclass(frozen=True)
class EPLBConfig:
    """``moe.eplb``: expert placement by measured load during training (DeepSeek-V3 §3.4
    "redundant experts"; DeepSeek's Expert Parallelism Load Balancer). Each expert-parallel rank
    holds (num_experts + ``redundant_experts``) / ep expert *slots*; every ``every`` optimizer
    steps each MoE layer's slots are re-assigned from its tokens per expert summed over the last
    ``window`` steps — the hottest experts replicated into the spare slots, the replicas packed onto
    ranks so that the busiest rank's tokens come close to the mean
    (:func:`moetrain.topology.eplb.place_experts`) — and the moved experts' weights and optimizer
    states travel to their new ranks (one all-to-all per tensor). A token of a replicated expert
    goes to the replica on its own rank when there is one, else to one chosen by its position,
    and the replicas' gradients are summed before
    the optimizer: the training is the one without EPLB up to fp32 summation order
    (:mod:`moetrain.parallel.eplb`). Checkpoints hold the experts in logical order, so a run
    resumes with or without EPLB. ``every`` 0 (the default) turns it off."""

    redundant_experts: int = 0
    every: int = 0
    window: int = 10

    @property
    def enabled(self) -> bool:
        return self.every > 0


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts layers. ``num_experts``: 0 makes a dense model. ``every``: an MoE layer
    replaces the MLP in blocks i with i % every == every - 1 ... unless ``first_dense`` says how
    many leading blocks stay dense (DeepSeek keeps the first ones dense). ``top_k``: experts per
    token. ``ffn_hidden``: each expert's SwiGLU inner width. ``shared_experts``: always-active
    experts added to the routed output (DeepSeekMoE, Dai et al. 2024). ``aux_loss_coef``:
    weight of the Switch load-balancing loss (Fedus et al. 2021, eq. 4), computed per sequence
    (GShard's groups = sequences, as DeepSeek-V3's sequence-wise balance loss) so it does not
    depend on how a batch is split over ranks. ``z_loss_coef``: router z-loss (Zoph et al. 2022,
    ST-MoE eq. 5). ``norm_topk_prob``: renormalise the top-k probabilities to sum to 1 (Mixtral).
    ``capacity_factor``: ``null`` is dropless; a number caps each expert at
    capacity_factor·tokens·top_k/experts tokens and drops the rest (a deviation from dropless,
    the dropped fraction is logged). ``expert_backend``: how the experts compute —
    ``loop`` one GEMM per expert (the reference path; the faster one on CPU), ``grouped_mm``
    ``torch.nn.functional.grouped_mm`` (all experts in one kernel, no host read; the fast path
    on CUDA in bf16), ``auto`` the faster for the device and precision, ``megablocks``
    (MegaBlocks' grouped GEMM; CUDA, bf16, installed separately). ``score_function``: ``softmax``
    over the experts, or ``sigmoid`` per expert (DeepSeek-V3 §2.1.2); the chosen scores are
    renormalised with ``norm_topk_prob`` and multiplied by ``routed_scaling_factor``.
    ``bias_update_rate``: > 0 turns on aux-loss-free balancing (DeepSeek-V3 §2.1.2, their γ =
    0.001): a per-expert bias, added to the scores for the top-k choice only, moves by this much
    after every step towards the mean load; ``aux_loss_coef`` stays as the complementary
    sequence-wise loss (0 turns it off). ``max_nodes_per_token``: node-limited routing — each
    token's experts lie on at most this many NVLink domains (nodes) of its expert-parallel group,
    taken from the rank map, so its all-to-all crosses the network to at most that many
    (DeepSeek-V3 §2.2: M = 4). ``token_dispatcher``: how routed tokens travel under expert
    parallelism — ``alltoall`` sends one row per token-expert pair (Megatron-Core's all-to-all
    dispatcher), ``hierarchical`` sends a token once to each NVLink domain (node) holding its
    experts, then within the domain to the experts' ranks, and sums the domain's weighted
    expert outputs there before the row returns (DeepSeek-V3 §3.2.2, DeepEP's inter-node mode):
    with ``max_nodes_per_token`` the network bytes fall with M. ``shared_ffn_hidden``: inner width of the shared experts'
    SwiGLU (they are fused into one); ``null`` is shared_experts × ffn_hidden (Qwen1.5-MoE's
    shared expert is wider than its routed ones). ``shared_expert_gate``: scale the shared
    experts' output per token by sigmoid(w · x), w a learned [hidden] vector (Qwen1.5-MoE /
    Qwen2-MoE); ``false`` adds it as it is (DeepSeekMoE).

    The routing of the models of 2025-26: ``n_group`` / ``topk_group`` — group-limited routing
    with fixed groups: the experts fall into ``n_group`` equal groups by id, each group is scored
    by the sum of its two best choice scores, and a token picks its experts within the
    ``topk_group`` best groups (DeepSeek-V3's and GLM-4.5's router; independent of the layout,
    unlike ``max_nodes_per_token``). ``routing_bias``: a per-expert score-correction bias added
    to the choice scores (DeepSeek-V3's ``e_score_correction_bias``; ``bias_update_rate`` > 0
    trains it, else it stays as imported). ``router_bias``: a learned bias of the router's
    projection (GPT-OSS). ``expert_biases``: biases on every expert's projections (GPT-OSS).
    ``activation``: ``swiglu`` silu(x w1)·(x w3), ``relu2`` relu(x w1)² with no w3 (non-gated
    experts and shared experts, Nemotron-H's: So et al. 2021, "Primer" §3), or ``clamped_swiglu`` (GPT-OSS):
    g = min(x w1, limit), u = clamp(x w3, ±limit), g·sigmoid(``swiglu_alpha``·g)·(u + 1) with
    limit = ``swiglu_limit``.

    ``dispatch_dtype``: the format of the routed tokens on the dispatch all-to-all — ``auto``
    as computed (fp8 once ``train.precision`` is fp8), ``bf16``, or ``fp8``: float8 E4M3 with a
    power-of-two scale per 1 × 128 tile of each row (per row when the hidden size is not a
    multiple of 128), D + D/128 bytes a row against 2·D in bf16 (DeepSeek-V3 §3.3; see
    :mod:`moetrain.model.fp8`). The layer rounds the tokens to it in every layout, one process
    included, so layouts stay equal; gradients and the combine travel in the compute dtype.

    ``route_padding``: ``false`` (the default) keeps the padding that ends packed fine-tuning
    sequences (``data.loss_mask`` data packed by ``--chat --seq-len``) out of the MoE layers: it
    is not routed, not dispatched, not computed by the routed experts, and counts in neither the
    aux and z losses nor the expert loads, so a padded batch trains as the same batch without
    its padding; ``true`` routes it like any token.

    ``apply_probs_on_input``: the routing weight scales the token going into its expert, p·x,
    instead of the expert's output, p·f(x) (Llama 4's routing: one expert per token, scored by
    a sigmoid of its logit; Megatron-Core's ``moe_apply_probs_on_input``); needs ``top_k`` 1.

    ``eplb``: redundant experts placed by measured load during training (:class:`EPLBConfig`)."""

    num_experts: int = 8
    top_k: int = 2
    every: int = 1
    first_dense: int = 0
    ffn_hidden: int = 512
    shared_experts: int = 0
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    capacity_factor: float | None = None
    norm_topk_prob: bool = True
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    routed_scaling_factor: float = 1.0
    bias_update_rate: float = 0.0
    max_nodes_per_token: int | None = None
    expert_backend: Literal["auto", "loop", "grouped_mm", "megablocks"] = "auto"
    token_dispatcher: Literal["alltoall", "hierarchical"] = "alltoall"
    shared_ffn_hidden: int | None = None
    shared_expert_gate: bool = False
    n_group: int | None = None
    topk_group: int | None = None
    routing_bias: bool = False
    router_bias: bool = False
    expert_biases: bool = False
    activation: Literal["swiglu", "clamped_swiglu", "relu2"] = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    dispatch_dtype: Literal["auto", "bf16", "fp8"] = "auto"
    route_padding: bool = False
    apply_probs_on_input: bool = False
    eplb: EPLBConfig = field(default_factory=EPLBConfig)

    @property
    def num_slots(self) -> int:
        """Physical expert slots per MoE layer: num_experts, plus the redundant ones under EPLB."""
        return self.num_experts + (self.eplb.redundant_experts if self.eplb.enabled else 0)

    @property
    def shared_hidden(self) -> int:
        """Inner width of the fused shared-expert SwiGLU (0: no shared experts)."""
        if not self.shared_experts:
            return 0
        return self.shared_ffn_hidden if self.shared_ffn_hidden is not None else self.shared_experts * self.ffn_hidden

    def is_moe_layer(self, layer: int) -> bool:
        """True when block ``layer`` (0-based) carries an MoE layer instead of a dense MLP."""
        if self.num_experts == 0 or layer < self.first_dense:
            return False
        return (layer - self.first_dense) % self.every == self.every - 1


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel sizes. World = pp × dp × cp × tp. Experts are split over ``ep`` ranks carved out
    of the dp × cp ranks of one pipeline stage ("parallel folding", Megatron-Core); the remaining
    dp·cp/ep ranks (times tp) hold expert replicas (the expert-data-parallel axis).
    ``zero_stage``: 0 plain data parallel, 1 sharded optimizer states, 2 + sharded gradients,
    3 + sharded parameters. ``backend``: ``auto`` is nccl on CUDA, gloo on CPU.
    ``pp_first_stage_layers`` / ``pp_last_stage_layers``: blocks on the first pipeline stage
    (which also holds the embedding) and on the last (which also holds the final norm, the head
    and the loss); the other blocks split evenly over the remaining stages (Megatron-Core's
    ``decoder_first/last_pipeline_num_layers``). ``None`` splits evenly; giving the end stages
    fewer blocks balances the embedding and, above all, the head: see
    :func:`pipeline_stage_layers`. ``etp``:
    expert-tensor-parallel size, 1 or tp. With 1 (default) experts stay whole on every rank and
    under tp each tp rank routes its own 1/tp of the sequence; with tp, every tp rank routes the
    whole sequence and each expert's ffn width is split over the tp ranks (w1/w3 by columns, w2
    by rows, Megatron-Core's ``expert_tensor_parallel_size``): a 1/tp of every expert's weights
    per rank, for experts too large to hold whole. ``activation_checkpointing``: ``full`` (whole
    blocks), ``selective`` (core attention), ``mla_up_proj`` (MLA's up-projections and the core
    attention; Megatron-Core's recompute module of that name), ``none``. ``ep_overlap``: run
    the forward of each micro-batch together with the backward of the one before it, taking
    turns at their token all-to-alls so that each transfer is in flight while the other
    micro-batch computes (Megatron-Core's ``--overlap-moe-expert-parallel-comm``;
    :mod:`moetrain.parallel.ep_overlap`): needs ep > 1 and two or more micro-batches per step to
    hide anything; with pp > 1 the 1F1B schedules (``1f1b``, ``interleaved_1f1b``) merge each
    backward with the forward that follows it; ZeRO 0-2, no full recomputation, no compile.
    ``delay_wgrad_compute`` (with ``ep_overlap``; Megatron-Core's ``--delay-wgrad-compute``): in
    a merged pair's backward the GEMMs return their input gradient at once and compute their
    weight gradient after the backward's next token all-to-all is issued, while it travels
    (:mod:`moetrain.model.wgrad`): the experts' behind the dispatch's backward, the attention's
    and shared experts' behind the combine's backward of the layer below. Tensor-parallel
    (DTensor) linears, fp8 GEMMs and the output head compute theirs at once.
    ``ep_overlap_split`` (with ``ep_overlap`` at pp = 1): run each micro-batch as two halves of
    its samples, so that the halves pair up too (DeepSeek's two-micro-batch overlap) — with n
    micro-batches per step, 2n halves in 2n − 1 pairs hide all but 1/(2n) of the transfers instead
    of all but 1/n. ``auto``: when the step has 2 micro-batches per rank or fewer; ``always``;
    ``never`` (each half's GEMMs are half as long: on a GPU, less efficient). Needs an even
    micro-batch size, no capacity factor (each half would drop by its own capacity) and, with
    multi-token prediction, ``data.loss_mask`` (the MTP loss's divisor). The step equals the unsplit one within fp32's rounding (sums reordered), not bit
    for bit; :func:`overlap_split` says whether a config splits."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    virtual_stages: int = 1
    pp_first_stage_layers: int | None = None
    pp_last_stage_layers: int | None = None
    activation_checkpointing: Literal["none", "full", "selective", "mla_up_proj"] = "none"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    collective_timeout_s: float = 600.0
    ep_overlap: bool = False
    ep_overlap_split: Literal["auto", "always", "never"] = "auto"
    delay_wgrad_compute: bool = False
    dp_shard: int | None = None
    """Hybrid sharding (HSDP: FSDP2 on a (replicate, shard) mesh; TorchTitan's
    ``data_parallel_shard_degree``): ZeRO 1-3 shard each parameter over groups of ``dp_shard``
    consecutive ranks of the dp × cp order and replicate it across the groups — the all-gathers
    and reduce-scatters stay inside a group (placed inside an NVSwitch domain by the rank map),
    and only an all-reduce of each shard's gradient, 1/dp_shard of it, crosses between groups.
    ``null``: the whole dp × cp group (plain FSDP). Must divide dp × cp; needs zero_stage ≥ 1.
    The experts shard over the edp ranks inside one shard group (:attr:`expert_dp_shard`):
    dp_shard / ep of them, so with dp_shard ≤ ep they are replicated and their whole gradient is
    all-reduced across the groups — give dp_shard a multiple of ep of at least 2·ep
    (``python -m moetrain.ranks`` shows the bytes)."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def expert_dp_shard(self) -> int:
        """Ranks of edp one expert shard is sharded over under HSDP: the edp ranks inside one
        dense shard group — ``dp_shard / ep`` of them when ep divides ``dp_shard`` (ep is the
        inner part of the dp × cp order, so a group of dp_shard ranks holds dp_shard / ep
        replicas of each expert), reduced to its greatest common divisor with edp; 1 (the
        experts replicated over edp, gradients all-reduced) when a shard group is smaller than
        an ep group. All of edp without HSDP."""
        return self.edp if self.dp_shard is None else hsdp_expert_shard(self.edp, self.ep, self.dp_shard)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size inside one (pp, tp) slice: replicas of each expert shard."""
        return self.dp * self.cp // self.ep


def hsdp_expert_shard(edp: int, ep: int, dp_shard: int) -> int:
    """Edp ranks one expert is sharded over under HSDP with shard groups of ``dp_shard`` ranks of
    the dp × cp order (:attr:`ParallelConfig.expert_dp_shard`)."""
    return math.gcd(edp, dp_shard // ep) if dp_shard >= ep else 1


@dataclass(frozen=True)
class BlendSource:
    """One source of ``data.blend``: a shard directory and its share of the samples."""

    path: str = ""
    """A shard directory (``manifest.json`` and token shards) written by
    ``tools/tokenize_corpus.py`` or ``tools/import_megatron.py``."""
    weight: float = 1.0
    """Relative share of the training samples drawn from this source (> 0); the weights of a blend
    are normalised to sum to 1 (Megatron-LM's ``--data-path 0.3 web 0.7 code``)."""
    name: str | None = None
    """The source's name in metrics (``consumed_samples_by_source``, ``val_loss_by_source``) and
    checkpoints; ``null``: the directory's name. Unique within a blend."""

    @property
    def resolved_name(self) -> str:
        return self.name if self.name is not None else Path(self.path.rstrip("/")).name


@dataclass(frozen=True)
class DataConfig:
    """The training data: one shard directory (``path``) or a weighted blend of several
    (``blend``), how it is checked, and how samples are masked. The sample order is
    :mod:`moetrain.data.order`'s; the blend's, :mod:`moetrain.data.blend`'s."""

    path: str | None = None
    """One shard directory (``manifest.json`` and token shards, from ``tools/tokenize_corpus.py``
    or ``tools/import_megatron.py``): the one-source case of ``blend``. Unset (``null``) when
    ``blend`` is given."""
    blend: tuple[BlendSource, ...] = ()
    """Several sources mixed by weight, e.g. ``[{path: data/web, weight: 0.7}, {path: data/code,
    weight: 0.3, name: code}]`` (:class:`BlendSource`). Every source must share the tokenizer,
    vocabulary and token dtype; each draws its own samples in its own order and starts a new
    (reshuffled) epoch when it runs out."""
    verify: Literal["sha256", "size"] = "sha256"
    """Checked before training, each rank a disjoint share of the files (about 1/ranks of the
    bytes) and one collective agreeing: ``sha256`` every shard's checksum once per content (a
    shard whose size and mtime match a verified entry of the cache, ``<path>/.moetrain-verified.json``
    or, when the data directory is read-only, ``<run.dir>/verified-shards.json`` for ``path`` and
    ``<run.dir>/verified-shards-<name>.json`` for a blend's source, is not read again); ``size``
    only the lengths (instant; catches truncation, not altered bytes)."""
    val_batches: int = 4
    """Validation micro-batches per evaluation, per source."""
    document_mask: bool = False
    """Attention stays inside each document of a packed sample (documents as the shards' index
    records them) instead of seeing the end of the previous one."""
    reset_position_ids: bool = False
    """With ``document_mask``: RoPE positions restart at 0 at every document start (Megatron's
    ``--reset-position-ids``)."""
    max_open_maps: int = 256
    """Files (token shards, loss masks, document indexes) each rank keeps memory-mapped at once,
    least recently used out first; each also holds a file descriptor, so stay below
    ``ulimit -n`` and ``vm.max_map_count`` (:class:`~moetrain.data.reader.MapCache`)."""
    loss_mask: bool = False
    """Train only the tokens the data's loss mask marks (fine-tuning data written by
    ``tools/tokenize_corpus.py --chat``: assistant / completion tokens); the loss is the mean
    over the trained tokens of the whole global batch, the same in every layout."""

    def sources(self) -> list[BlendSource]:
        """The sources as a blend: ``path`` as one source of weight 1, or ``blend``.

        Raises:
            ConfigError: neither is set (checked where data is read, so that the planner and the
                rank map need none).
        """
        if self.path is None and not self.blend:
            raise field_error("data.path", None, "no training data: neither data.path nor data.blend is set",
                              "set data.path to a shard directory (tools/tokenize_corpus.py --out DIR) or list "
                              "sources in data.blend")
        return [BlendSource(path=self.path)] if self.path is not None else list(self.blend)


@dataclass(frozen=True)
class AnomalyConfig:
    """What a step does with a non-finite loss or gradient norm and with a loss spike
    (``train.anomaly``; Megatron-Core's ``--check-for-nan-in-loss-and-grad`` and
    ``--check-for-spiky-loss``). Both are detected on the device from the step's global LM loss
    and gradient norm, and every rank takes the same decision before the optimizer step (no host
    read is added: :mod:`moetrain.train.anomaly`).

    ``on_nan``: ``stop`` — the update is not applied and the run stops with one line naming the
    step, the value and this setting; ``skip`` — the update is not applied (parameters, optimizer
    state and the expert-bias balancing untouched; the batch is consumed and logged) and the run
    goes on; ``rollback`` — as ``skip``, then every rank reloads the latest complete checkpoint and
    goes on from its step with the data that follows the anomalous batch (the batches since the
    checkpoint are skipped, PaLM's recipe, Chowdhery et al. 2022 §5.1). ``on_spike``: ``off``,
    ``warn`` (console and event log), ``skip`` or ``rollback``; a spike is an LM loss more than
    ``spike_z`` standard deviations above the mean of the last ``window`` accepted steps (checked
    once ``window`` steps are in; the window starts empty after a restart). ``max_skips``: after
    that many skipped or rolled-back steps in one run attempt the next anomaly stops the run,
    naming the steps."""

    on_nan: Literal["stop", "skip", "rollback"] = "stop"
    on_spike: Literal["off", "warn", "skip", "rollback"] = "warn"
    spike_z: float = 6.0
    window: int = 50
    max_skips: int = 10


@dataclass(frozen=True)
class ProfileConfig:
    """``train.profile``: run ``torch.profiler`` on ``steps`` steps from step ``start`` (1-based)
    on ``ranks`` (``[]``: every rank) — CPU and CUDA activities, shapes and memory — and write a
    Chrome / Perfetto trace per rank to ``<run.dir>/profile/`` (:mod:`moetrain.train.profile`;
    ``python -m moetrain.monitor RUN --profile`` sums it up). Profile a few steps after the first
    ones: the first steps pay allocation and, with ``compile``, compilation."""

    start: int = 3
    steps: int = 2
    ranks: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class LoraConfig:
    """``train.lora``: low-rank adapters (LoRA, Hu et al. 2021 §4.1) on a frozen base; the field
    names are PEFT's ``LoraConfig``'s. ``r``: the rank (0: off, every parameter trains). Each
    targeted weight W [out, in] gains A [r, in] and B [out, r] and computes
    W x + (``lora_alpha`` / r) · B A dropout(x), with ``lora_dropout`` on the adapter's input
    only; A starts as PEFT's (Kaiming-uniform, bound 1/√in), B at 0, so training starts from the
    base model itself. ``target_modules``: names that select the weights, PEFT's rule (a module
    whose path is the name or ends with ``.`` + name): ``wq``, ``wk``, ``wv``, ``wo`` (attention),
    MLA's ``wq``/``wq_a``/``wq_b``/``wkv_a``/``wkv_b``/``wo``, ``w1``/``w2``/``w3`` (dense MLPs,
    shared experts and the routed experts; ``experts.w1`` or ``shared.w1`` narrow it), the linear
    attention / SSM projections (``in_proj_qkvz``, ``in_proj``, ``out_proj``, ...), or
    ``all-linear`` — every projection of the blocks and the experts (not the embedding, the head
    or the router). ``router`` (the MoE routers) trains whole, not as an adapter (PEFT's
    ``modules_to_save``); otherwise the router, norms, embedding and head stay frozen.
    ``experts``: the routed experts' adapters — ``per_expert``, one pair per expert (A [E, in,
    r], B [E, r, out], placed with the experts over ep / etp and computed in the experts' own
    pass), or ``shared``, one pair per layer for all its experts (Megatron-Bridge's shared expert
    LoRA). The base gets no gradient, no optimizer state and no gradient reduction.
    ``base_dtype``: how the frozen base is stored — ``null``: as the training precision stores
    parameters (fp32); ``bf16``; ``fp8``: every linear of the blocks and every expert matrix as
    float8 E4M3 with fp32 scales per ``train.fp8_block`` × ``train.fp8_block`` block
    (DeepSeek-V3's checkpoint format, ``weight_scale_inv``), dequantized per GEMM (the adapters,
    activations and gradients keep the compute dtype), the rest in bf16
    (:func:`moetrain.model.lora.convert_base`); a base loaded from unquantized weights is
    quantized as it is loaded. Autograd keeps each dequantized weight for the input gradient until
    the layer's backward: with ``parallel.activation_checkpointing: full`` only the layer in
    flight's."""

    r: int = 0
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ("all-linear",)
    experts: Literal["per_expert", "shared"] = "per_expert"
    base_dtype: Literal["bf16", "fp8"] | None = None

    @property
    def scaling(self) -> float:
        """lora_alpha / r, the factor of B A x (Hu et al. 2021 §4.1)."""
        return self.lora_alpha / self.r


@dataclass(frozen=True)
class TrainConfig:
    """``steps``: optimizer steps. ``micro_batch_size``: sequences per rank per forward.
    ``global_batch_size``: sequences per optimizer step over all data-parallel ranks
    (= micro_batch_size × accumulation × dp). ``lr``: peak learning rate after linear warm-up of
    ``warmup_steps``, then cosine decay to ``min_lr`` at ``decay_steps`` (``null``: ``steps``; as
    Megatron's ``--lr-decay-iters``), ``min_lr`` after it (Loshchilov & Hutter 2017). To train a
    finished run further without changing the schedule of the steps it took, raise ``steps`` and
    set ``decay_steps`` to the old ``steps``; a resumed run whose schedule differs says so in its
    log.
    ``grad_clip``: max global L2 norm (0 disables). ``log_every`` / ``val_every`` in steps
    (``val_every: 0`` disables validation). ``precision``: ``fp32``; ``bf16`` — bf16 matmuls
    and activations with fp32 master weights, gradients, gradient reduction and AdamW states, the
    router and every loss in fp32 (see :mod:`moetrain.parallel.precision`); ``fp8`` — bf16 as
    above, and the GEMMs of the dense linears and the experts (forward and backward) in float8
    with ``fp8_recipe``'s scales (:mod:`moetrain.model.fp8_gemm`): ``tensorwise``, ``rowwise`` or
    ``blockwise`` (DeepSeek-V3's 1 × ``fp8_block`` activation tiles and ``fp8_block``²
    weight blocks); ``unscaled`` is a control that shows what scaling buys, never a recipe; not
    with ``compile`` yet.
    ``fp8_keep``: module names (patterns as ``fnmatch``) whose linears stay bf16 under fp8 —
    by default the output head and the shared experts' gate (the router, embeddings, norms
    and attention's softmax are never fp8). ``compile``: compile
    each transformer block with ``torch.compile`` (inductor); under tensor parallelism only its
    regions free of DTensors (:mod:`moetrain.parallel.compile`); the first steps pay the
    compilation (tens of seconds per distinct block on a CPU). ``anomaly``: what a non-finite or
    spiking loss does (:class:`AnomalyConfig`). ``profile``: ``null`` or which steps and ranks to
    profile (:class:`ProfileConfig`). ``memory_history``: on CUDA, record the stack of every
    allocation, so that the snapshot written on an out-of-memory error
    (``<run.dir>/memory/oom.step<N>.rank<r>.pickle``, for https://pytorch.org/memory_viz) shows
    which allocations filled the GPU (costs host time per allocation; the snapshot is written
    either way). ``straggler_every``: every that many steps the ranks compare how long each was
    busy (its step less its waits on peers; :mod:`moetrain.train.stragglers`; 0 turns it off), and
    a rank busier than the median rank by more than ``straggler_threshold`` (0.2: 20 %) in
    ``straggler_windows`` windows in a row is named in the console and the event log.
    ``optimizer``: ``adamw``, or ``muon`` — Muon (:class:`moetrain.train.optim.Muon`) for the 2-D
    hidden matrices and each routed expert's matrices, AdamW (``lr``, ``beta1``, ``beta2``,
    ``weight_decay``) for the embedding, head, router, norms and the names matching
    ``muon_adamw`` (fnmatch patterns); ``muon_momentum``: Muon's Nesterov momentum (0.95). The same
    ``lr`` drives both: Muon's update is scaled to AdamW's RMS. ``qk_clip`` (τ, e.g. 100; null:
    off): MuonClip's QK-clip (Kimi K2, §2.1; :mod:`moetrain.train.qk_clip`) — after each
    optimizer step, every attention head whose largest logit of the step exceeded τ has its
    query and key projections scaled by γ = τ / max (√γ each; MLA: its per-head query and key
    parts √γ, its RoPE query γ, the shared RoPE key untouched), so that logit would have been τ;
    costs one more q·kᵀ per attention forward; the step's largest logit is in the metrics
    (``max_logit``). Not with context parallelism, q/k norms or compile. ``lora``: fine-tune
    low-rank adapters on a frozen base instead of every parameter (:class:`LoraConfig`)."""

    steps: int = 100
    micro_batch_size: int = 2
    global_batch_size: int = 16
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    decay_steps: int | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    log_every: int = 1
    val_every: int = 25
    precision: Literal["fp32", "bf16", "fp8"] = "fp32"
    fp8_recipe: Literal["tensorwise", "rowwise", "blockwise", "unscaled"] = "tensorwise"
    fp8_block: int = 128
    fp8_keep: tuple[str, ...] = ("output", "*.shared_gate")
    compile: bool = False
    anomaly: AnomalyConfig = field(default_factory=AnomalyConfig)
    profile: ProfileConfig | None = None
    memory_history: bool = False
    straggler_every: int = 10
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_momentum: float = 0.95
    muon_adamw: tuple[str, ...] = ("tok_embeddings.*", "output.*", "*.router.*", "*shared_gate*")
    straggler_threshold: float = 0.2
    straggler_windows: int = 3
    qk_clip: float | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)

    @property
    def resolved_decay_steps(self) -> int:
        return self.steps if self.decay_steps is None else self.decay_steps


@dataclass(frozen=True)
class CheckpointConfig:
    """``dir``: ``null`` puts checkpoints in ``<run.dir>/checkpoints``. ``every``: steps between
    checkpoints (0: only at the end and on a requeue signal). ``keep``: complete checkpoints kept
    (older ones are deleted). ``resume``: resume from the latest complete checkpoint when
    present. ``init_from``: start from the weights of another checkpoint — a weights directory
    written by ``python -m moetrain.hf import``, a training checkpoint ``step_XXXXXXXX`` or a
    directory of them (its latest complete one is taken) — with a fresh optimizer, step 0 and the
    data from its start; ignored when this run has a checkpoint to resume from (resume wins). See
    :mod:`moetrain.train.weights`. ``async`` (YAML key; ``async_`` in Python): the periodic
    checkpoints are staged to host memory and written, hashed and committed in the background
    while training goes on; the next checkpoint waits for the previous one (``false``: the step
    waits for the write). ``timeout_s``: seconds a checkpoint may take to be written by every rank
    and committed (bounds the checkpoint's own collectives and rank 0's wait for every rank's
    hashes)."""

    dir: str | None = None
    every: int = 50
    keep: int = 2
    resume: bool = True
    init_from: str | None = None
    async_: bool = field(default=True, metadata={"key": "async"})
    timeout_s: float = 1800.0


@dataclass(frozen=True)
class ContainerConfig:
    """The container every rank runs in (``launch.container``). The ranks start the image's own
    Python (``python``), so the image must hold moetrain and its dependencies (or mount them).

    ``runtime``: ``pyxis`` (NVIDIA's SLURM plugin over enroot: ``--container-image``,
    ``--container-mounts`` and ``--container-workdir`` on ``srun``), ``apptainer`` (each task runs
    ``apptainer exec [--nv] --bind ... --pwd ... IMAGE python``) or ``podman`` (each task runs
    ``podman run --rm --network=host --ipc=host ... IMAGE python``, the SLURM, torch.distributed and
    ``launch.env`` variables passed in). ``image``: what the runtime takes (pyxis:
    ``nvcr.io#nvidia/pytorch:25.01-py3`` or a ``.sqsh`` file; apptainer: a ``.sif`` file or
    ``docker://...``; podman: an image name). ``mounts``: ``SRC:DST`` or ``SRC:DST:FLAGS`` with
    absolute paths (pyxis' and apptainer's syntax, e.g. ``/lustre:/lustre:ro``); the submit
    directory and the run directory are mounted at their own paths besides, so that relative
    paths in the config mean the same inside. ``workdir``: the directory the ranks start in
    (``null``: the submit directory). ``runtime_args``: more options for the runtime, one per
    item: pyxis, more ``srun`` flags (``--no-container-mount-home``); apptainer, options of
    ``apptainer exec`` (``--cleanenv``); podman, options of ``podman run`` (``--runtime=runc``,
    ``--ulimit=nofile=65536:65536``)."""

    image: str = ""
    runtime: Literal["pyxis", "apptainer", "podman"] = "pyxis"
    mounts: tuple[str, ...] = ()
    workdir: str | None = None
    python: str = "python3"
    runtime_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ElasticConfig:
    """Elastic training on SLURM (``launch.elastic``): the job asks for ``min_nodes`` to
    ``launch.nodes`` nodes (``sbatch --nodes=min-max``), and an attempt that starts on fewer nodes
    than ``launch.nodes`` — a node failed and was excluded, the allocation shrank, SLURM had only
    that many free — re-plans its layout for the ranks it has before it builds the mesh
    (:func:`moetrain.planner.elastic.replan`): the model, optimizer, global batch and data order
    stay; dp and the gradient accumulation change (tp, pp, ep kept when a layout keeping them fits
    in memory), and the latest complete checkpoint loads into the new layout.

    ``min_nodes``: the fewest nodes to train on (1 ≤ min_nodes ≤ launch.nodes); ``submit``
    refuses a value on which the planner finds no layout that fits. ``grow``: while shrunk, ask
    SLURM every ``grow_check_s`` seconds (``sbatch --test-only``) whether the missing nodes could
    start now, and when they could, stop at the next step (checkpoint saved) and requeue the job,
    lifting the exclusion of the nodes that had failed: the next attempt runs on every node
    again. ``too_few``: an attempt on fewer ranks than any fitting layout needs (a cluster that
    differs from the planner's profile) ``stop``s with the reason, or ``wait``s: the job is
    requeued asking for the node count that fits."""

    min_nodes: int = 1
    grow: bool = True
    grow_check_s: float = 60.0
    too_few: Literal["stop", "wait"] = "stop"


@dataclass(frozen=True)
class LaunchConfig:
    """Where and how the processes run. ``cluster``: ``local`` (submitit's local executor, one
    process per rank on this machine) or ``slurm``. ``tasks_per_node``: ``null`` follows from
    the parallel sizes (world size / nodes). ``gpus_per_node``: 0 on CPU. ``time_min``: SLURM
    time limit in minutes. ``signal_delay_s``: seconds before the time limit at which SLURM sends
    the pre-timeout signal. ``max_restarts``: restarts from the latest complete checkpoint —
    SLURM requeues (time-outs, preemptions, node failures, dead ranks, hangs) or, locally,
    relaunches by the submit command (dead ranks, failed collectives, hangs) — before the run
    gives up. ``profile``: cluster profile name or path (see slurm/).
    ``cpus_per_task``: CPU cores per process, asked of SLURM and used as the process's torch
    threads; ``null`` (default) asks SLURM for nothing and uses the cores the launcher gives the
    task: SLURM's ``SLURM_CPUS_PER_TASK`` or the task's CPU affinity, shared by the local ranks.

    Site settings (a site file, ``configs/sites/``, holds them): ``container`` (see
    :class:`ContainerConfig`); ``env``: variables every rank gets, ``{NCCL_IB_HCA: mlx5,
    NCCL_SOCKET_IFNAME: ib0}`` (values are quoted, never interpreted by a shell); ``setup``: shell
    lines run once per job before the ranks start (``module load cuda/12.4``, ``source
    /opt/site/env.sh``) — the one field that is shell by design; ``srun_args`` / ``sbatch_args``:
    passed through to ``srun`` / as ``#SBATCH`` lines (long options, ``--reservation=x``), checked
    with ``sbatch --test-only`` where SLURM answers. ``allocation``: ``auto`` runs inside the SLURM
    allocation ``submit`` is started in (``salloc``, a user's sbatch script: ``srun`` steps, no new
    job) and submits a new job elsewhere; ``new`` always submits one. ``exclude_stragglers``: a
    rank named a straggler (``train.straggler_every``) has its node added to the nodes the next
    requeue excludes. ``restart_in_job``: in a SLURM batch job, each task runs its rank as a child
    process and, after a rank died on a node that is still there, every task restarts its rank
    inside the job instead of requeueing it (:mod:`moetrain.launch.supervisor`); ``false``:
    every such failure requeues the job. ``elastic``: see :class:`ElasticConfig`.

    On GPUs every rank runs with NCCL's flight recorder on (``TORCH_NCCL_TRACE_BUFFER_SIZE``
    2000, dumped on a collective's time-out beside the hang watchdog's stacks in
    ``<run.dir>/stacks/``), unless ``env`` sets those variables."""

    cluster: Literal["local", "slurm"] = "local"
    nodes: int = 1
    tasks_per_node: int | None = None
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    mem_gb: float | None = None
    time_min: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    exclude_stragglers: bool = False
    signal_delay_s: int = 120
    max_restarts: int = 3
    profile: str | None = None
    heartbeat_timeout_factor: float = 10.0
    heartbeat_min_timeout_s: float = 120.0
    container: ContainerConfig | None = None
    env: dict[str, str] = field(default_factory=dict)
    setup: tuple[str, ...] = ()
    srun_args: tuple[str, ...] = ()
    sbatch_args: tuple[str, ...] = ()
    allocation: Literal["auto", "new"] = "auto"
    elastic: ElasticConfig | None = None
    restart_in_job: bool = True

    def resolved_tasks_per_node(self, world_size: int) -> int:
        return self.tasks_per_node if self.tasks_per_node is not None else world_size // self.nodes


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases (``metrics.wandb``, e.g. ``{project: moe, mode: offline}``). ``project``:
    the W&B project. ``mode``: ``offline`` writes ``<run.dir>/wandb`` only (``wandb sync`` it
    later), ``online`` streams to the W&B server (needs ``wandb login``). ``entity``: team or
    user; ``null`` is the account's default."""

    project: str = ""
    mode: Literal["offline", "online"] = "offline"
    entity: str | None = None


@dataclass(frozen=True)
class MetricsConfig:
    """Where the step metrics go besides ``<run.dir>/metrics.jsonl`` and the console (rank 0
    writes them all, from the same record). ``tensorboard``: TensorBoard event files in
    ``tensorboard_dir`` (``null``: ``<run.dir>/tensorboard``); needs the ``tensorboard`` extra.
    ``wandb``: ``null`` or a mapping (see :class:`WandbConfig`); needs the ``wandb`` extra.
    ``peak_tflops``: the device's peak TFLOP/s for MFU (model TFLOP/s per device ÷ peak);
    ``null`` looks the CUDA device's dense bf16 peak up by name (H100, H200, A100, ...) and
    logs no MFU on CPU."""

    tensorboard: bool = False
    tensorboard_dir: str | None = None
    wandb: WandbConfig | None = None
    peak_tflops: float | None = None


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    # Derived quantities used across the code base.
    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per rank per optimizer step."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"

    def replace(self, **sections: Any) -> "Config":
        """Copy with whole sections or ``section={"key": value}`` dicts replaced, re-validated."""
        data = to_dict(self)
        for name, value in sections.items():
            if isinstance(value, dict):
                data[name].update(value)
            else:
                data[name] = to_dict(value)
        return config_from_dict(data)


SECTIONS: dict[str, type] = {f.name: f.type for f in fields(Config)}  # type: ignore[misc]
_SECTION_TYPES = {
    "run": RunConfig,
    "model": ModelConfig,
    "moe": MoEConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "launch": LaunchConfig,
    "metrics": MetricsConfig,
}


# ---------------------------------------------------------------------------------------------
# Parsing: keys and types
# ---------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping {" + ", ".join(f"{_key(f)}: ..." for f in fields(tp)) + "}"
    return getattr(tp, "__name__", str(tp))


_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")

def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):  # a nested mapping such as metrics.wandb
        return _build_dataclass(name, tp, value)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            if dataclasses.is_dataclass(a) and isinstance(value, dict):
                return _build_dataclass(name, a, value)  # its own, precise errors
            try:
                return _coerce(name, value, a)
            except ConfigError:
                continue
        raise field_error(name, value, f"expected {_type_name(tp)}", f"give a value of type {_type_name(tp)}")
    if origin is dict:  # dict[str, X]: a YAML mapping of names to values
        if not isinstance(value, dict):
            raise field_error(name, value, "expected a mapping", "write `NAME: value` lines under the key")
        value_type = typing.get_args(tp)[1]
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise field_error(f"{name}.{k}", v, "a key must be a name", "quote the key")
            if value_type is str and isinstance(v, bool):
                raise field_error(f"{name}.{k}", v, "true/false is ambiguous as a string",
                                  "quote the value as it should read, e.g. '1' or 'true'")
            out[k] = _coerce(f"{name}.{k}", v, value_type)
        return out
    if origin is tuple:  # tuple[X, ...]: a YAML list
        if not isinstance(value, (list, tuple)):
            raise field_error(name, value, "expected a list", "write a YAML list such as [output]")
        return tuple(_coerce(f"{name}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(value))
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        raise field_error(name, value, f"not one of {', '.join(repr(c) for c in choices)}",
                   f"choose one of {', '.join(repr(c) for c in choices)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise field_error(name, value, "expected true or false", "write true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise field_error(name, value, "expected an integer", "write a whole number such as 4")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 (PyYAML) reads an exponent without a dot, `3e-4`, as a string
        if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
            return float(value)
        raise field_error(name, value, "expected a number", "write a number such as 1e-3")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise field_error(name, value, "expected a string", "quote the value")
    raise TypeError(f"unsupported annotation {tp!r} for {name}")


def _key(f: dataclasses.Field) -> str:
    """A field's YAML key: its name, or ``metadata["key"]`` where the key is a Python keyword
    (``checkpoint.async`` is the field ``async_``)."""
    return f.metadata.get("key", f.name)


def _build_section(section: str, raw: Any) -> Any:
    return _build_dataclass(section, _SECTION_TYPES[section], raw)


def _build_dataclass(section: str, cls: type, raw: Any) -> Any:
    """``cls`` from the mapping ``raw`` (a section, or a nested mapping such as metrics.wandb)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise field_error(section, raw, "a section must be a mapping of keys to values",
                   f"write `{section}:` followed by indented `key: value` lines")
    hints = typing.get_type_hints(cls)
    by_key = {_key(f): f.name for f in fields(cls)}
    known = set(by_key)
    kwargs = {}
    for key, value in raw.items():
        if f"{section}.{key}" in REMOVED_KEYS:
            problem, fix = REMOVED_KEYS[f"{section}.{key}"](value)
            raise field_error(f"{section}.{key}", value, problem, fix)
        if key not in known:
            raise field_error(f"{section}.{key}", value, "unknown key", _unknown_key_fix(section, str(key), known))
        kwargs[by_key[key]] = _coerce(f"{section}.{key}", value, hints[by_key[key]])
    return cls(**kwargs)


def _removed_dtype(value: Any) -> tuple[str, str]:
    new = {"float32": "fp32", "bfloat16": "bf16"}.get(value, "fp32 or bf16")
    return ("removed: it cast the whole model, gradients and optimizer states to that dtype; "
            "train.precision trains in bf16 with fp32 master weights"), f"write `precision: {new}` in the train section"


# Keys of earlier versions: (value) -> (problem, fix), so an old config fails with the way forward.
REMOVED_KEYS: dict[str, Callable[[Any], tuple[str, str]]] = {
    "train.dtype": _removed_dtype,
    "parallel.grad_bucket_mb": lambda value: (
        "removed: FSDP2 reduces the gradients of each block as one group (stage 0 too), as soon as its "
        "backward is done", "delete the key"),
}


def _unknown_key_fix(section: str, key: str, known: set[str]) -> str:
    """Where an unknown key belongs: another section that has it (``train.init_from`` →
    ``checkpoint.init_from``), a close spelling in its own section, or the section's keys."""
    owners = [name for name, cls in _SECTION_TYPES.items() if name != section and key in {_key(f) for f in fields(cls)}]
    if owners:
        return " or ".join(f"it belongs to the {o} section: write it as {o}.{key}" for o in owners)
    close = _closest(key, known)
    return f"did you mean {section}.{close}?" if close else f"valid keys: {', '.join(sorted(known))}"


def _closest(key: str, known: set[str]) -> str | None:
    import difflib

    m = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return m[0] if m else None


def config_from_dict(data: dict[str, Any], *, validate_config: bool = True, world_size: int | None = None) -> Config:
    """Build and validate a :class:`Config` from nested dicts (as read from YAML).

    ``parallel.dp: auto`` is resolved first (:func:`resolve_dp_auto`; ``world_size``: the ranks
    actually started, when known).

    Raises:
        ConfigError: unknown section or key, wrong type, or a violated cross-field rule.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config = {data!r}: the top level must be a mapping of sections. "
                          f"Fix: start the file with sections such as `run:` and `model:`")
    for section in data:
        if section not in _SECTION_TYPES:
            close = _closest(section, set(_SECTION_TYPES))
            raise field_error(section, data[section], "unknown section",
                       f"did you mean `{close}`?" if close else f"sections are {', '.join(_SECTION_TYPES)}")
    data, _ = resolve_dp_auto(data, world_size)
    cfg = Config(**{name: _build_section(name, data.get(name)) for name in _SECTION_TYPES})
    if validate_config:
        validate(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------
# Layers: several files, then --set, merged key by key; where each value came from
# ---------------------------------------------------------------------------------------------


def resolve_dp_auto(data: dict[str, Any], world_size: int | None = None) -> tuple[dict[str, Any], str | None]:
    """``parallel.dp: auto`` → world size ÷ (tp × pp × cp), the world size being ``world_size``
    (the ranks actually started) or else ``launch.nodes × launch.tasks_per_node``. Returns the
    data with dp filled in (the same object when dp is not ``auto``) and a note saying how, or
    None.

    Raises:
        ConfigError: ``auto`` without ``launch.tasks_per_node`` (and no ``world_size``), or a world
            size that tp × pp × cp does not divide.
    """
    par = data.get("parallel") if isinstance(data.get("parallel"), dict) else {}
    if par.get("dp") != "auto":
        return data, None
    launch = data.get("launch") if isinstance(data.get("launch"), dict) else {}
    sizes = {k: par.get(k, 1) for k in ("tp", "pp", "cp")}
    for k, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise field_error(f"parallel.{k}", v, "expected a positive integer", "write a whole number such as 2")
    if world_size is None:
        nodes, tpn = launch.get("nodes", 1), launch.get("tasks_per_node")
        if not isinstance(tpn, int) or isinstance(tpn, bool) or tpn < 1:
            raise field_error("parallel.dp", "auto", "dp = world size ÷ (tp × pp × cp) needs the ranks per node, and "
                              f"launch.tasks_per_node = {tpn!r}", "set launch.tasks_per_node (e.g. 8 on an "
                              "8-GPU node; a site file usually does), or give parallel.dp")
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
            raise field_error("launch.nodes", nodes, "expected a positive integer", "write a whole number such as 2")
        world, where = nodes * tpn, f"launch.nodes {nodes} × launch.tasks_per_node {tpn}"
    else:
        world, where = world_size, f"{world_size} ranks started"
    inner = sizes["tp"] * sizes["pp"] * sizes["cp"]
    if world % inner:
        raise field_error("parallel.dp", "auto", f"{where} = {world} ranks is not a multiple of tp × pp × cp = "
                          f"{sizes['tp']} × {sizes['pp']} × {sizes['cp']} = {inner}",
                          "change the node or task count, or give parallel.dp")
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    out["parallel"] = {**par, "dp": world // inner}
    return out, f"auto: {where} = {world} ÷ (tp {sizes['tp']} × pp {sizes['pp']} × cp {sizes['cp']})"


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """``"a.b.c=value"`` → (``("a", "b", "c")``, value parsed as a YAML scalar, list or mapping).

    Raises:
        ConfigError: no ``=``, a key path of fewer than two parts or with an empty one, or a
            value that is not YAML.
    """
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value. Fix: e.g. --set train.steps=20")
    path, raw = text.split("=", 1)
    parts = tuple(path.strip().split("."))
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"--set {text!r}: the key must be section.key (or deeper, section.key.name). "
                          f"Fix: e.g. --set parallel.dp=2 or --set launch.env.NCCL_DEBUG=INFO")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text!r}: the value is not valid YAML ({e}). Fix: quote it") from e
    return parts, value


@dataclass
class Layers:
    """Config layers merged in order: ``data`` the merged mapping; ``origins`` the history of
    every value set, by dotted key (``"launch.env.NCCL_DEBUG"``): ``[(source, value), ...]``,
    the last entry the one in force (a source is a file path or ``--set``). Mappings merge key by
    key; anything else (scalars, lists such as ``data.blend`` or ``launch.setup``) is replaced
    whole by a later layer."""

    data: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, list[tuple[str, Any]]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def add(self, layer: dict[str, Any], source: str) -> None:
        self._merge(self.data, layer, (), source)

    def set(self, path: tuple[str, ...], value: Any, source: str = "--set") -> None:
        node = self.data
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if not isinstance(child, dict):
                if child is not None:
                    raise field_error(".".join(path[: i + 1]), child, "is not a mapping, so it has no key "
                                      f"{path[i + 1]!r}", f"set {'.'.join(path[: i + 1])} itself")
                child = node[part] = {}
            node = child
        self._merge(node, {path[-1]: value}, path[:-1], source)

    def _merge(self, into: dict[str, Any], layer: dict[str, Any], prefix: tuple[str, ...], source: str) -> None:
        for key, value in layer.items():
            path = (*prefix, str(key))
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                self._merge(into[key], value, path, source)
                continue
            dotted = ".".join(path)
            for old in [k for k in self.origins if k.startswith(dotted + ".")]:
                del self.origins[old]  # a whole mapping (or a scalar) replaced what was under it
            into[key] = _copy(value)
            self._record(value, path, source)

    def _record(self, value: Any, path: tuple[str, ...], source: str) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                self._record(v, (*path, str(k)), source)
            return
        self.origins.setdefault(".".join(path), []).append((source, _copy(value)))

    def origin(self, key: str) -> str:
        """Who set ``key`` last: a source, ``auto: ...``, ``default``, or the sources of the keys
        under it (for a mapping)."""
        if key in self.notes:
            return self.notes[key]
        if key in self.origins:
            return self.origins[key][-1][0]
        under = sorted({h[-1][0] for k, h in self.origins.items() if k.startswith(key + ".")})
        return ", ".join(under) if under else "default"


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _check_override_section(path: tuple[str, ...], value: Any) -> None:
    if path[0] not in _SECTION_TYPES:
        close = _closest(path[0], set(_SECTION_TYPES))
        dotted = ".".join(path)
        raise field_error(dotted, value, f"unknown section {path[0]!r} in --set",
                          f"did you mean {'.'.join((close, *path[1:]))}?" if close else
                          f"sections are {', '.join(_SECTION_TYPES)}")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b[.c...]=value`` strings to a nested dict (returns a new dict; mappings on the
    way are created).

    Raises:
        ConfigError: see :func:`parse_override`; an unknown section.
    """
    layers = Layers()
    layers.add(data or {}, "base")
    for text in overrides:
        path, value = parse_override(text)
        _check_override_section(path, value)
        layers.set(path, value)
    return layers.data


def read_layers(paths: str | os.PathLike | list, overrides: list[str] | None = None) -> Layers:
    """The config files ``paths`` (later ones override earlier ones key by key), then the
    ``--set`` overrides, merged (:class:`Layers`), unvalidated.

    Raises:
        ConfigError: a file missing, not YAML or not a mapping; a bad override.
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    layers = Layers()
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config {str(path)!r}: no such file. Fix: pass a YAML file such as "
                              "configs/demo-moe.yaml")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {str(path)!r}: not valid YAML: {e}") from e
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"--config {str(path)!r}: the top level must be a mapping of sections. "
                              "Fix: start the file with sections such as `run:` and `model:`")
        layers.add(data or {}, str(path))
    for text in overrides or []:
        path, value = parse_override(text)
        _check_override_section(path, value)
        layers.set(path, value)
    return layers


def load_layers(paths: str | os.PathLike | list, overrides: list[str] | None = None, *,
                world_size: int | None = None) -> tuple[Config, Layers]:
    """:func:`read_layers`, then ``parallel.dp: auto`` resolved (noted in the layers' origins)
    and the config built and validated.

    Raises:
        ConfigError: see :func:`read_layers` and :func:`config_from_dict`.
    """
    layers = read_layers(paths, overrides)
    data, note = resolve_dp_auto(layers.data, world_size)
    if note:
        layers.notes["parallel.dp"] = note
    return config_from_dict(data), layers


def load_config(path: str | os.PathLike | list, overrides: list[str] | None = None) -> Config:
    """Read one YAML config or several layered ones (a list: base, site, experiment), apply
    ``--set`` overrides and validate.

    Raises:
        ConfigError: a file is missing or not YAML, or any field is wrong (see module doc).
    """
    return load_layers(path, overrides)[0]


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {_key(f): to_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _flow(value: Any) -> str:
    """One YAML line for a value (lists and mappings in flow style)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, sort_keys=False)
    return text.strip().removesuffix("...").strip()


def render_config(cfg: Config, layers: Layers | None = None) -> str:
    """The resolved config as YAML, each value followed by a comment naming the layer that set it
    (a file, ``--set``, ``auto: ...`` or ``default``) when ``layers`` is given."""
    if layers is None:
        return yaml.safe_dump(to_dict(cfg), sort_keys=False)
    lines = ["# resolved config: each value's comment names the file (or --set) that set it; "
             "`python -m moetrain.submit --explain KEY` shows the history"]

    def emit(value: Any, path: tuple[str, ...], indent: int) -> None:
        key = path[-1]
        pad = "  " * indent
        if isinstance(value, dict) and value and (len(path) == 1 or ".".join(path) in _NESTED_KEYS or
                                                  any(k.startswith(".".join(path) + ".") for k in layers.origins)):
            lines.append(f"{pad}{key}:")
            for k, v in value.items():
                emit(v, (*path, k), indent + 1)
            return
        lines.append(f"{pad}{key}: {_flow(value)}  # {layers.origin('.'.join(path))}")

    for section, values in to_dict(cfg).items():
        emit(values, (section,), 0)
    return "\n".join(lines) + "\n"


_NESTED_KEYS = {"metrics.wandb", "launch.container", "launch.env", "launch.elastic", "train.anomaly", "train.profile",
                "train.lora"}


def explain(layers: Layers, cfg: Config, key: str) -> str:
    """Lines saying the value of ``key`` (dotted) in ``cfg`` and every layer that set it, in order.

    Raises:
        ConfigError: ``key`` names no field of the config.
    """
    value: Any = to_dict(cfg)
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            section = key.split(".")[0]
            raise ConfigError(f"--explain {key!r}: no such key in the config. Fix: give a dotted key such as "
                              f"parallel.dp" + (f" (sections: {', '.join(_SECTION_TYPES)})"
                                                if section not in _SECTION_TYPES else ""))
        value = value[part]
    out = [f"{key} = {_flow(value)}"]
    history = [(k, h) for k, hs in layers.origins.items() if k == key or k.startswith(key + ".") for h in hs]
    if not history and key not in layers.notes:
        out.append("  default (no layer sets it)")
    for k, (source, v) in history:
        out.append(f"  {source}: {k} = {_flow(v)}")
    if key in layers.notes:
        out.append(f"  resolved by {layers.notes[key]}")
    return "\n".join(out)


def save_config(cfg: Config, path: str | os.PathLike, layers: Layers | None = None) -> None:
    """Write the resolved config as YAML (atomically and durably: :func:`~moetrain.utils.atomic_write`),
    with each value's origin as a comment when ``layers`` is given (:func:`render_config`)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, render_config(cfg, layers))


# ---------------------------------------------------------------------------------------------
# Rules: one function per section; a rule sits with the field its message names
# ---------------------------------------------------------------------------------------------


def _check_dsa(cfg: Config) -> None:
    """model.dsa (DeepSeek Sparse Attention), each field named with its fix."""
    m, d = cfg.model, cfg.model.dsa
    if d.index_topk < 0:
        raise field_error("model.dsa.index_topk", d.index_topk, "must be 0 (off) or positive", "use e.g. 2048")
    if not d.enabled:
        return
    _bounds(cfg, "model.dsa", positive="index_heads index_head_dim", non_negative="indexer_loss_coef")
    if m.attention != "mla" or m.q_lora_rank is None:
        raise field_error("model.dsa.index_topk", d.index_topk, "DSA's indexer reads MLA's query latent: it needs "
                          f"model.attention = 'mla' with a q_lora_rank (got {m.attention!r}, q_lora_rank "
                          f"{m.q_lora_rank})", "set attention: mla and q_lora_rank, or index_topk: 0")
    if d.index_head_dim < m.qk_rope_head_dim or d.index_head_dim % 2:
        raise field_error("model.dsa.index_head_dim", d.index_head_dim, "must be even and at least "
                          f"model.qk_rope_head_dim={m.qk_rope_head_dim} (RoPE rotates its first dims)",
                          "use e.g. 128 (DeepSeek-V3.2)")
    if m.layer_types or m.hybrid_override_pattern or m.mtp_depth:
        field = ("model.layer_types" if m.layer_types else "model.hybrid_override_pattern"
                 if m.hybrid_override_pattern else "model.mtp_depth")
        raise field_error(field, getattr(m, field.split(".")[1]), "is not built beside model.dsa",
                          "train DSA on MLA blocks only, without MTP modules")
    if m.sliding_window is not None or m.attention_sinks:
        raise field_error("model.sliding_window" if m.sliding_window is not None else "model.attention_sinks",
                          m.sliding_window if m.sliding_window is not None else True,
                          "is not built beside model.dsa", "remove it")
    if m.attention_backend != "sdpa":
        raise field_error("model.attention_backend", m.attention_backend, "runs no DSA selection mask",
                          "use attention_backend sdpa (the masked attention; moetrain.model.dsa)")
    if cfg.train.lora.r:
        raise field_error("train.lora.r", cfg.train.lora.r, "is not built beside model.dsa", "set train.lora.r: 0")
    if d.attention == "gathered" and cfg.parallel.cp > 1:
        raise field_error("model.dsa.attention", d.attention, f"gathers each query's keys from this rank's sequence, "
                          f"and parallel.cp = {cfg.parallel.cp} splits it", "use attention: masked with cp")


def _check_llama4_attention(cfg: Config) -> None:
    """model.no_rope_layers, attention_chunk_size, qk_norm l2, attn_temperature_tuning and
    moe.apply_probs_on_input (Llama 4's), each named with its fix."""
    m, moe = cfg.model, cfg.moe
    if m.no_rope_layers:
        if len(m.no_rope_layers) != m.layers or any(v not in (0, 1) for v in m.no_rope_layers):
            raise field_error("model.no_rope_layers", list(m.no_rope_layers), f"needs one 0 (NoPE) or 1 (RoPE) per "
                              f"block, model.layers={m.layers}", "give one entry per block, or [] for RoPE in all")
        if not m.rope:
            raise field_error("model.no_rope_layers", list(m.no_rope_layers), "is set while model.rope is false "
                              "(no block rotates)", "remove it, or set model.rope: true")
    llama4 = m.no_rope_layers or m.attention_chunk_size is not None or m.qk_norm == "l2" or m.attn_temperature_tuning
    if llama4 and (m.attention != "gqa" or m.hybrid_override_pattern or m.layer_types):
        field = "model.attention" if m.attention != "gqa" else (
            "model.hybrid_override_pattern" if m.hybrid_override_pattern else "model.layer_types")
        raise field_error(field, getattr(m, field.split(".")[1]), "Llama 4's attention options (no_rope_layers, "
                          "attention_chunk_size, qk_norm l2, attn_temperature_tuning) are built for grouped-query "
                          "attention blocks", "use attention: gqa without hybrid blocks, or drop those options")
    if m.attention_chunk_size is not None:
        if m.attention_chunk_size < 1:
            raise field_error("model.attention_chunk_size", m.attention_chunk_size, "must be at least 1",
                              "use null or e.g. 8192 (Llama 4)")
        if m.sliding_window is not None:
            raise field_error("model.attention_chunk_size", m.attention_chunk_size, "is set beside "
                              f"model.sliding_window={m.sliding_window}", "keep one of them")
        if m.attention_backend == "flash":
            raise field_error("model.attention_backend", m.attention_backend, "has no chunked attention mask",
                              "use attention_backend sdpa or flex")
    if m.attn_temperature_tuning:
        _bounds(cfg, "model", positive="floor_scale")
    if moe.apply_probs_on_input and moe.num_experts and moe.top_k != 1:
        raise field_error("moe.apply_probs_on_input", True, f"needs one expert per token, moe.top_k is {moe.top_k} "
                          "(a token scaled by two weights would be two different inputs)",
                          "set moe.top_k: 1 (Llama 4), or apply_probs_on_input: false")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(n: int, allowed: list[int]) -> str:
    if not allowed:
        return "none"
    best = sorted(allowed, key=lambda a: (abs(a - n), a))[:3]
    return ", ".join(str(b) for b in sorted(best))


def pipeline_stage_layers(layers: int, num_stages: int, first: int | None = None,
                          last: int | None = None) -> list[int]:
    """Transformer blocks per pipeline stage, in stage order (``num_stages`` = pp × virtual
    stages; stage 0 holds the embedding, stage ``num_stages - 1`` the head).

    ``first`` / ``last`` fix the block count of the end stages (0 allowed: a stage of only the
    embedding, or only the head); the other stages share the remaining blocks evenly. Per token,
    the head's forward FLOPs (2·D·V) are about V / (4·D + 3·F + 2·S) dense SwiGLU blocks of
    hidden D, MLP width F and sequence S (4·D² projections, 3·D·F MLP, 2·S·D attention scores,
    ×2 FLOPs per multiply-add): ≈ 1.7 blocks for Llama-3-8B's 128k vocabulary, plus the memory of
    its logits — the imbalance that Megatron-Core's uneven first/last stage options remove.

    Raises:
        ValueError: the blocks do not split that way (the message says why and what would).
    """
    if num_stages == 1:
        if first is not None or last is not None:
            raise ValueError("pp_first_stage_layers / pp_last_stage_layers need pp × virtual_stages > 1")
        return [layers]
    fixed = {i: n for i, n in ((0, first), (num_stages - 1, last)) if n is not None}
    for n in fixed.values():
        if n < 0:
            raise ValueError(f"a stage cannot hold {n} blocks")
    others = num_stages - len(fixed)
    rest = layers - sum(fixed.values())
    if others == 0 and rest != 0:
        raise ValueError(f"with only two stages the end stages' blocks ({sum(fixed.values())}) must add up to "
                         f"all {layers}")
    if rest < 0:
        raise ValueError(f"the end stages' blocks ({sum(fixed.values())}) are more than the {layers} there are")
    if others and (rest % others or rest == 0):
        raise ValueError(f"the {rest} remaining blocks do not split evenly (at least one each) over the other "
                         f"{others} stage(s)")
    per = rest // others if others else 0
    return [fixed.get(i, per) for i in range(num_stages)]



@dataclass(frozen=True)
class LayoutFacts:
    """A parallel layout (sizes, schedule, ZeRO stage, micro-batch, recomputation) and what of
    the model, batch and run its rules read: the input of :func:`layout_refusal`, the one set of
    rules that refuses layouts, which :func:`validate` applies to a config and the planner
    (:meth:`moetrain.planner.search.Planner.check`) to every layout it evaluates or searches.

    Field names are the config's (``parallel.*``, ``train.*``, ``model.*``, ``moe.*``): a
    refusal names the field to change. :meth:`from_config` reads them from a config; the
    planner replaces the layout's fields in it for each candidate."""

    # the layout (parallel.*, train.micro_batch_size)
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    virtual_stages: int = 1
    zero_stage: int = 1
    pp_schedule: str = "1f1b"
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"
    dp_shard: int | None = None
    micro_batch_size: int = 1
    pp_first_stage_layers: int | None = None
    pp_last_stage_layers: int | None = None
    # Also refuse what this version of moetrain cannot run on any device yet (tied embeddings
    # over pp, ZeRO-3 under zero_bubble, the interleaved schedules' rounds): validate with a
    # device (submit's check, every rank) and the planner of moetrain.plan.
    runnable: bool = True
    # A published run of another framework, planned as it ran: its own split of the layers over
    # the stages, its own padding of the dense MLP's width to tp, none of moetrain's limits (nor
    # those of the installed torch).
    published: bool = False
    # the model
    layers: int = 1
    heads: int = 1
    kv_heads: int = 1
    hidden: int = 1
    ffn_hidden: int = 1
    dense_layers: bool = True  # some layer has a dense MLP (model.ffn_hidden is split over tp)
    seq_len: int = 1
    vocab_size: int | None = None
    num_experts: int = 0
    moe_ffn_hidden: int = 0
    expert_biases: bool = False
    tie_embeddings: bool = False
    flex_attention: bool = False  # model.attention_backend = flex
    linear_attention: bool = False  # some block is gated DeltaNet or KDA (model.layer_types)
    linear_num_key_heads: int = 1
    mamba: bool = False  # some block is Mamba-2 (model.layer_types)
    n_groups: int = 1
    # the batch and the run
    global_batch_size: int = 1
    ep_overlap: bool = False
    ep_overlap_split: str = "auto"
    split_blocker: str | None = None  # why micro-batches cannot be halved whatever the layout
    compile: bool = False
    fp8_block: int | None = None  # train.fp8_block with the blockwise fp8 recipe, else None
    qk_clip: float | None = None
    profile_ranks: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, cfg: "Config", runnable: bool = True, published: bool = False) -> "LayoutFacts":
        m, moe, par, tr = cfg.model, cfg.moe, cfg.parallel, cfg.train
        return cls(runnable=runnable and not published, published=published,
                   tp=par.tp, pp=par.pp, dp=par.dp, cp=par.cp, ep=par.ep, etp=par.etp,
                   virtual_stages=par.virtual_stages, zero_stage=par.zero_stage, pp_schedule=par.pp_schedule,
                   sequence_parallel=par.sequence_parallel, activation_checkpointing=par.activation_checkpointing,
                   dp_shard=par.dp_shard, micro_batch_size=tr.micro_batch_size,
                   pp_first_stage_layers=par.pp_first_stage_layers, pp_last_stage_layers=par.pp_last_stage_layers,
                   layers=m.layers, heads=m.heads, kv_heads=m.kv_heads, hidden=m.hidden, ffn_hidden=m.ffn_hidden,
                   dense_layers=_has_dense_layers(cfg), seq_len=m.seq_len, vocab_size=m.vocab_size,
                   num_experts=moe.num_experts, moe_ffn_hidden=moe.ffn_hidden,
                   expert_biases=moe.expert_biases and moe.num_experts > 0, tie_embeddings=m.tie_embeddings,
                   flex_attention=m.attention_backend == "flex", linear_attention=m.linear_attention,
                   linear_num_key_heads=m.linear_num_key_heads, mamba=m.mamba, n_groups=m.n_groups,
                   global_batch_size=tr.global_batch_size,
                   ep_overlap=par.ep_overlap, ep_overlap_split=par.ep_overlap_split,
                   split_blocker=_static_split_blocker(cfg), compile=tr.compile,
                   fp8_block=tr.fp8_block if tr.precision == "fp8" and tr.fp8_recipe == "blockwise" else None,
                   qk_clip=tr.qk_clip, profile_ranks=tuple(tr.profile.ranks) if tr.profile else ())


def _has_dense_layers(cfg: "Config") -> bool:
    try:
        return any(cfg.model.ffn_type(i, cfg.moe) == "dense" for i in range(cfg.model.layers))
    except (ZeroDivisionError, ValueError):  # moe.every out of bounds: _check_moe names it
        return True


def layout_refusal(f: LayoutFacts) -> tuple[str, Any, str, str] | None:
    """Why this layout cannot run, as ``(field, value, why, fix)`` (:func:`field_error`'s
    arguments), or None: every rule that refuses a layout for its sizes, schedule, ZeRO stage,
    micro-batch or recomputation, on any device. ``validate`` raises the first refusal as a
    :class:`ConfigError`; the planner gives it as the reason a layout is not ranked."""
    ranks, stages = f.dp * f.cp, f.pp * f.virtual_stages
    for name in ("dp", "tp", "pp", "cp", "ep", "virtual_stages", "micro_batch_size", "global_batch_size"):
        if getattr(f, name) <= 0:
            section = "train" if name.endswith("batch_size") else "parallel"
            return f"{section}.{name}", getattr(f, name), "must be positive", "use a value greater than 0"
    if f.num_experts % f.ep:
        fit = [d for d in _divisors(f.num_experts) if ranks % d == 0]
        return ("parallel.ep", f.ep, f"moe.num_experts={f.num_experts} is not divisible by it",
                f"choose ep among {_nearest(f.ep, fit)}")
    if not f.num_experts and f.ep != 1:
        return ("parallel.ep", f.ep, "expert parallelism needs experts but moe.num_experts = 0",
                "set parallel.ep=1 or give moe.num_experts")
    if ranks % f.ep:
        return ("parallel.ep", f.ep, f"ep is carved out of dp × cp = {f.dp} × {f.cp} = {ranks} ranks and must "
                "divide it", f"choose ep among {_nearest(f.ep, _divisors(ranks))} or raise dp/cp")
    if f.zero_stage not in (0, 1, 2, 3):
        return "parallel.zero_stage", f.zero_stage, "not a ZeRO stage", "use 0, 1, 2 or 3"
    if f.dp_shard is not None:
        if f.dp_shard < 1 or ranks % f.dp_shard:
            return ("parallel.dp_shard", f.dp_shard, f"HSDP shards over groups that must divide dp × cp = {f.dp} × "
                    f"{f.cp} = {ranks} ranks", f"choose among {_divisors(ranks)} or null (shard over all of them)")
        if f.zero_stage == 0:
            return ("parallel.dp_shard", f.dp_shard, "HSDP shards parameters, optimizer states and gradients, but "
                    "zero_stage 0 replicates them all", "set parallel.zero_stage to 1, 2 or 3, or dp_shard: null")
    if f.runnable and f.pp > 1 and f.zero_stage == 3 and f.pp_schedule == "zero_bubble":
        # Measured: with parameters resharded after forward, the weight-gradient half of the split
        # backward leaves the FSDP-managed gradients of every stage but the first at zero.
        return ("parallel.zero_stage", 3, "gives wrong gradients with pp_schedule='zero_bubble' (torch 2.13)",
                "use zero_stage 1 or 2, or another pp_schedule")
    if f.mamba:
        # The Mamba-2 layers split their groups (of heads sharing B and C) over tp, then over cp.
        if f.n_groups % f.tp:
            return ("parallel.tp", f.tp, f"the Mamba-2 layers split their model.n_groups={f.n_groups} over the tp "
                    "ranks, and it does not divide them", f"choose tp among {_nearest(f.tp, _divisors(f.n_groups))}")
        if (f.n_groups // f.tp) % f.cp:
            per_tp = f.n_groups // f.tp
            return ("parallel.cp", f.cp, f"the Mamba-2 layers split the {per_tp} groups of a tp rank "
                    f"(model.n_groups={f.n_groups} / tp) over the cp ranks (each runs the whole sequence of some "
                    "groups), and it does not divide them", f"choose cp among {_nearest(f.cp, _divisors(per_tp))}")
    if f.linear_attention:
        # The gated-DeltaNet layers split their key heads over tp, then the tp rank's over cp.
        if f.linear_num_key_heads % f.tp:
            return ("parallel.tp", f.tp, f"the gated-DeltaNet / KDA layers split their model.linear_num_key_heads="
                    f"{f.linear_num_key_heads} over the tp ranks, and it does not divide them",
                    f"choose tp among {_nearest(f.tp, _divisors(f.linear_num_key_heads))}")
        if (f.linear_num_key_heads // f.tp) % f.cp:
            per_tp = f.linear_num_key_heads // f.tp
            return ("parallel.cp", f.cp, f"the gated-DeltaNet / KDA layers split the {per_tp} key heads of a tp rank "
                    f"(model.linear_num_key_heads={f.linear_num_key_heads} / tp) over the cp ranks (each runs the whole "
                    "sequence of some heads), and it does not divide them",
                    f"choose cp among {_nearest(f.cp, _divisors(per_tp))}")
    if f.heads % f.tp:
        return ("parallel.tp", f.tp, f"model.heads={f.heads} is not divisible by it",
                f"choose tp among {_nearest(f.tp, _divisors(f.heads))}")
    if f.kv_heads % f.tp:
        return ("parallel.tp", f.tp, f"model.kv_heads={f.kv_heads} is not divisible by it",
                f"choose tp among {_nearest(f.tp, _divisors(f.kv_heads))} or raise kv_heads")
    if not f.published and f.ffn_hidden % f.tp and f.dense_layers:
        return ("model.ffn_hidden", f.ffn_hidden, f"not divisible by parallel.tp = {f.tp} (the dense MLP's width "
                "is split over tp)", f"use a multiple of {f.tp}")
    if f.virtual_stages > 1 and f.pp == 1:
        return ("parallel.virtual_stages", f.virtual_stages, "virtual stages split a pipeline rank's blocks, and "
                "pp = 1", "set parallel.virtual_stages=1, or pp >= 2")
    if f.published:
        if stages > f.layers:
            return ("parallel.pp", f.pp, f"pp × virtual_stages = {stages} stages for model.layers={f.layers}",
                    f"choose pp × virtual_stages <= {f.layers}")
    elif f.pp_first_stage_layers is None and f.pp_last_stage_layers is None:
        if f.layers % stages:
            return ("parallel.pp", f.pp, f"model.layers={f.layers} is not divisible by pp × virtual_stages = "
                    f"{stages}", f"choose pp × virtual_stages among {_nearest(stages, _divisors(f.layers))}, or "
                    "set parallel.pp_first_stage_layers / pp_last_stage_layers for an uneven split")
    else:
        try:
            pipeline_stage_layers(f.layers, stages, f.pp_first_stage_layers, f.pp_last_stage_layers)
        except ValueError as e:
            name = "pp_first_stage_layers" if f.pp_first_stage_layers is not None else "pp_last_stage_layers"
            return (f"parallel.{name}", getattr(f, name), f"{e} (model.layers={f.layers}, pp × virtual_stages="
                    f"{stages})", "choose end-stage block counts that leave a multiple of the other stages' count")
    if f.virtual_stages > 1 and f.pp_schedule not in ("interleaved_1f1b", "zero_bubble"):
        return ("parallel.virtual_stages", f.virtual_stages, f"pp_schedule={f.pp_schedule!r} runs one stage per "
                "rank", "use pp_schedule interleaved_1f1b or zero_bubble, or virtual_stages=1")
    if f.etp not in (1, f.tp):
        return ("parallel.etp", f.etp, f"expert-tensor parallelism splits experts over all tp ranks or none "
                f"(tp = {f.tp})", f"use etp 1 or {f.tp}")
    if f.etp > 1 and f.num_experts and f.moe_ffn_hidden % f.etp:
        return ("parallel.etp", f.etp, f"moe.ffn_hidden={f.moe_ffn_hidden} is not divisible by it",
                f"use etp=1 or an ffn_hidden that is a multiple of {f.etp}")
    if f.expert_biases and f.etp > 1:
        return ("moe.expert_biases", True, f"not supported with parallel.etp = {f.etp} (the output bias would be "
                "added on every tp rank before their sum)", "use etp: 1")
    if f.sequence_parallel and f.tp == 1:
        return ("parallel.sequence_parallel", True, "sequence parallelism needs tp > 1",
                "set parallel.sequence_parallel=false or tp >= 2")
    if (refusal := _ep_overlap_refusal(f)) is not None:
        return refusal
    # Under tp an MoE layer works on a 1/tp slice of the (cp-local) sequence (with etp = 1), with
    # or without SP.
    tp_splits_seq = f.tp > 1 and (f.sequence_parallel or (f.num_experts > 0 and f.etp == 1))
    seq_div = (2 * f.cp if f.cp > 1 else 1) * (f.tp if tp_splits_seq else 1)
    if f.seq_len % seq_div:
        what = f"2 × cp ({2 * f.cp})" if f.cp > 1 else ""
        if tp_splits_seq:
            why = ("sequence parallelism" if f.sequence_parallel
                   else "MoE layers (each tp rank routes 1/tp of the sequence)")
            what = (what + " × " if what else "") + f"tp ({f.tp}) with {why}"
        return ("model.seq_len", f.seq_len, f"not divisible by {what}", f"use a seq_len that is a multiple of "
                f"{seq_div}, e.g. {max(seq_div, f.seq_len // seq_div * seq_div)}")
    if f.vocab_size is not None and f.vocab_size % f.tp:
        return ("model.vocab_size", f.vocab_size, f"not divisible by tp={f.tp} (vocabulary-parallel embedding)",
                "pad the vocabulary to a multiple of tp or set vocab_size: null")
    if f.flex_attention and f.cp > 1:
        return ("model.attention_backend", "flex", "under context parallelism the ring attention computes "
                "attention (its kernels are sdpa's and flash-attn's)",
                "use attention_backend sdpa or flash with cp > 1")
    if f.runnable and f.tie_embeddings and f.pp > 1:
        # The tied weight would live on the first and the last stage; summing its two gradients
        # over pp (Megatron's embedding group) is not implemented.
        return ("model.tie_embeddings", True, f"not supported with parallel.pp = {f.pp} yet",
                "set model.tie_embeddings=false or pp=1")
    if f.global_batch_size % (q := f.micro_batch_size * f.dp):
        return ("train.global_batch_size", f.global_batch_size, f"not divisible by micro_batch_size × dp = "
                f"{f.micro_batch_size} × {f.dp} = {q}", f"use a multiple of {q}, e.g. "
                f"{max(q, f.global_batch_size // q * q)}")
    n = f.global_batch_size // q
    if f.pp > 1 and n < f.pp and f.pp_schedule != "gpipe":
        return ("train.global_batch_size", f.global_batch_size, f"gives {n} micro-batches per step but "
                f"pp_schedule={f.pp_schedule!r} needs at least pp = {f.pp}", f"use global_batch_size >= {f.pp * q}")
    # torch's interleaved schedules run n in rounds of n // pp micro-batches (at least one round).
    rounds = max(1, n // f.pp)
    if f.runnable and f.pp > 1 and f.pp_schedule in ("interleaved_1f1b", "zero_bubble") and n % rounds:
        return ("train.global_batch_size", f.global_batch_size, f"gives {n} micro-batches per step; "
                f"pp_schedule={f.pp_schedule!r} needs a multiple of {rounds} (rounds of n // pp)",
                f"use a number of micro-batches that is < pp·2 or a multiple of pp, e.g. {f.pp * rounds}")
    if f.fp8_block is not None and f.tp > 1:
        # Block scales are taken on each tp rank's shard: the shards must be whole blocks.
        widths = {"model.hidden": (f.hidden, f.tp), "model.ffn_hidden": (f.ffn_hidden, f.tp)}
        if f.num_experts and f.etp > 1:
            widths["moe.ffn_hidden"] = (f.moe_ffn_hidden, f.etp)
        for name, (width, shards) in widths.items():
            if width and (width // shards) % f.fp8_block:
                return ("train.fp8_block", f.fp8_block, f"a tp shard of {name} = {width} is {width // shards} wide, "
                        "no whole number of blocks", f"use a block that divides {width // shards}")
    if f.qk_clip is not None and f.cp > 1:
        return ("train.qk_clip", f.qk_clip, "QK-clip needs each head's largest logit over all its keys, but under "
                "context parallelism each rank computes the logits of its key blocks inside ring attention and "
                "they never exist whole", "set parallel.cp=1 or qk_clip: null")
    world = f.pp * f.dp * f.cp * f.tp
    if bad := [r for r in f.profile_ranks if not 0 <= r < world]:
        return ("train.profile.ranks", list(f.profile_ranks), f"rank(s) {bad} outside the world of {world}",
                f"use ranks in 0..{world - 1}, or [] for every rank")
    return None


def _ep_overlap_refusal(f: LayoutFacts) -> tuple[str, Any, str, str] | None:
    if not f.ep_overlap:
        if f.ep_overlap_split == "always":
            return ("parallel.ep_overlap_split", "always", "splits the micro-batches of ep_overlap, which is off",
                    "set parallel.ep_overlap: true, or parallel.ep_overlap_split: auto")
        return None
    if f.ep_overlap_split == "always":
        if (why := _split_layout_blocker(f.pp, f.micro_batch_size) or f.split_blocker) is not None:
            return "parallel.ep_overlap_split", "always", why, "set parallel.ep_overlap_split: auto or never"
    if f.ep == 1:
        return ("parallel.ep_overlap", True, "there is no expert all-to-all to hide with ep = 1",
                "set parallel.ep_overlap: false, or ep >= 2")
    if blocked := ep_overlap_blocker(f.pp, f.pp_schedule, f.zero_stage, f.activation_checkpointing):
        return ("parallel.ep_overlap", True, *blocked)
    if not f.published and f.pp > 1:
        from moetrain.internals import stage_keeps_outputs  # torch's pipelining: only where it matters

        if not stage_keeps_outputs():
            import torch

            return ("parallel.ep_overlap", True, f"with pp > 1 starts a merged pair's backward from the stage's saved "
                    f"forward outputs, which torch {torch.__version__}'s pipeline stages no longer keep (fwd_cache, "
                    f"removed in torch 2.15)", "set parallel.ep_overlap: false with pp > 1, or use torch 2.11-2.14")
    if f.compile:
        return ("parallel.ep_overlap", True, "does not run with train.compile (the turn-taking at the all-to-alls is "
                "Python, a graph break inside every block)", "set train.compile: false, or parallel.ep_overlap: false")
    return None


def validate(cfg: Config, device: str | None = None) -> None:
    """Check every rule, one function per section; raises :class:`ConfigError` on the first violation.

    Each rule sits in the function of the field its message names; the parallel sizes come first
    (the other sections divide by them). ``device`` (``cpu`` or ``cuda``) adds what this version
    cannot run there (:func:`check_supported`); without it no rule needs torch.
    """
    for check in (_check_parallel, _check_model, _check_moe, _check_train, _check_data, _check_checkpoint,
                  _check_launch, _check_metrics):
        check(cfg, device)


def check_supported(cfg: Config, device_type: str | None = None) -> None:
    """:func:`validate` plus what this version cannot run on ``device_type`` (default:
    :func:`planned_device_type`): backends, packages, precision, pipeline layouts. Called by
    ``moetrain.launch.preflight`` before any process starts, and by
    :func:`moetrain.parallel.apply.build_model_parts` in every rank with the device it got, so a
    layout built without the launcher (a test, a notebook) is refused the same way. GPU-only
    backends are refused, never replaced silently: the message names what is missing."""
    validate(cfg, device_type or planned_device_type(cfg))


def planned_device_type(cfg: Config) -> str:
    """``cuda`` where the ranks will train on GPUs (SLURM with ``launch.gpus_per_node`` > 0, or a
    local run on a machine with CUDA and a backend other than gloo), else ``cpu``."""
    if cfg.launch.cluster == "slurm":
        return "cuda" if cfg.launch.gpus_per_node > 0 else "cpu"
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")):
        return "cpu"  # no NVIDIA, ROCm or WSL GPU driver here: torch (1-2 s to import) cannot find one
    import torch

    return "cuda" if torch.cuda.is_available() and cfg.parallel.backend != "gloo" else "cpu"


def _bounds(cfg: Config, section: str, positive: str = "", non_negative: str = "") -> None:
    """The fields of ``section`` named in ``positive`` must be > 0 (``null`` passes), those in
    ``non_negative`` >= 0. ``section`` may be dotted (``model.dsa``)."""
    values = cfg
    for part in section.split("."):
        values = getattr(values, part)
    for name in positive.split():
        if (value := getattr(values, name)) is not None and value <= 0:
            raise field_error(f"{section}.{name}", value, "must be positive", "use a value greater than 0")
    for name in non_negative.split():
        if (value := getattr(values, name)) < 0:
            raise field_error(f"{section}.{name}", value, "must not be negative", "use 0 or a positive value")


def _check_parallel(cfg: Config, device: str | None) -> None:
    par = cfg.parallel
    # what the layout rules divide by
    _bounds(cfg, "model", positive="layers hidden heads kv_heads ffn_hidden seq_len vocab_multiple vocab_size")
    _bounds(cfg, "train", positive="micro_batch_size global_batch_size")
    if refusal := layout_refusal(LayoutFacts.from_config(cfg, runnable=device is not None)):
        raise field_error(*refusal)
    if par.delay_wgrad_compute and not par.ep_overlap:
        raise field_error("parallel.delay_wgrad_compute", True, "defers weight gradients behind the token "
                          "all-to-alls of ep_overlap's merged pairs, and ep_overlap is off",
                          "set parallel.ep_overlap: true, or parallel.delay_wgrad_compute: false")


def _split_blocker(cfg: Config) -> str | None:
    """Why ``parallel.ep_overlap_split`` cannot split this config's micro-batches, or None."""
    if not cfg.parallel.ep_overlap:
        return "it splits the micro-batches of ep_overlap at pp = 1"
    return _split_layout_blocker(cfg.parallel.pp, cfg.train.micro_batch_size) or _static_split_blocker(cfg)


def _split_layout_blocker(pp: int, micro_batch_size: int) -> str | None:
    if pp > 1:
        return "it splits the micro-batches of ep_overlap at pp = 1"
    if micro_batch_size % 2:
        return f"train.micro_batch_size = {micro_batch_size} does not split into two halves"
    return None


def _static_split_blocker(cfg: Config) -> str | None:
    """What keeps ``parallel.ep_overlap_split`` from halving micro-batches in any layout."""
    if cfg.moe.capacity_factor is not None:
        return "with moe.capacity_factor each half would drop tokens by its own capacity"
    if cfg.model.mtp_depth and not cfg.data.loss_mask:
        return "multi-token prediction's loss divides by the whole micro-batch's positions (set data.loss_mask)"
    return None


def splits_micro_batches(mode: str, pp: int, micro_batch_size: int, micro_batches: int) -> bool:
    """The rule of ``parallel.ep_overlap_split`` = ``mode`` for a layout (the runner's, through
    :func:`overlap_split`, and the planner's): halves at pp = 1 of an even micro-batch size,
    ``always``, or ``auto`` with 2 micro-batches per rank or fewer."""
    if mode == "never" or pp > 1 or micro_batch_size % 2:
        return False
    return mode == "always" or micro_batches <= 2


def overlap_split(cfg: Config) -> bool:
    """Whether the step runs each micro-batch as two halves (``parallel.ep_overlap_split``; see
    :class:`ParallelConfig`): :func:`splits_micro_batches`, where nothing else blocks it."""
    return _split_blocker(cfg) is None and splits_micro_batches(
        cfg.parallel.ep_overlap_split, cfg.parallel.pp, cfg.train.micro_batch_size, cfg.grad_accum_steps)


def ep_overlap_blocker(pp: int, pp_schedule: str, zero_stage: int, activation_checkpointing: str
                       ) -> tuple[str, str] | None:
    """Why ``parallel.ep_overlap`` cannot run in this layout, as (why, fix), or None: the one rule
    that :func:`validate` raises with and the planner's search applies to each candidate layout."""
    if pp > 1 and pp_schedule not in ("1f1b", "interleaved_1f1b"):
        return (f"merges a backward with the next forward of 1F1B schedules; pp_schedule={pp_schedule!r} is not one",
                "use pp_schedule 1f1b or interleaved_1f1b, or set parallel.ep_overlap: false")
    if zero_stage == 3:
        return ("does not run with ZeRO-3: FSDP frees a block's parameters after its backward while the other "
                "micro-batch's forward may be inside that block",
                "use zero_stage 0, 1 or 2, or set parallel.ep_overlap: false")
    if activation_checkpointing == "full":
        return ("does not run with activation_checkpointing: full (the recomputed blocks would exchange tokens "
                "again inside the backward)",
                "use activation_checkpointing: selective or none, or set parallel.ep_overlap: false")
    return None


def _check_model(cfg: Config, device: str | None) -> None:
    m = cfg.model
    if m.attention == "mla":
        pass  # MLA's head widths are its own fields (checked below)
    elif m.head_dim is None:
        if m.hidden % m.heads:
            raise field_error("model.hidden", m.hidden, f"not divisible by model.heads={m.heads}", f"choose heads "
                              f"among {_nearest(m.heads, _divisors(m.hidden))}, change hidden, or set model.head_dim")
        if (m.hidden // m.heads) % 2:
            raise field_error("model.heads", m.heads, f"head dim {m.hidden // m.heads} is odd; RoPE rotates pairs",
                              "choose heads so that hidden / heads is even, or set an even model.head_dim")
    elif m.head_dim <= 0 or m.head_dim % 2:
        raise field_error("model.head_dim", m.head_dim, "must be a positive even number (RoPE rotates pairs)",
                          "use an even width such as 128, or null for hidden / heads")
    if m.rope_scaling == "llama3":
        _bounds(cfg, "model", positive="rope_scaling_factor rope_low_freq_factor rope_original_max_positions")
        if m.rope_high_freq_factor < m.rope_low_freq_factor:
            raise field_error("model.rope_high_freq_factor", m.rope_high_freq_factor, "must be at least model."
                              f"rope_low_freq_factor={m.rope_low_freq_factor} (the interpolated band lies between "
                              "them)", "use e.g. rope_low_freq_factor 1 and rope_high_freq_factor 4 (Llama 3.1)")
    if m.rope_scaling == "yarn":
        _bounds(cfg, "model", positive="rope_scaling_factor rope_original_max_positions rope_beta_fast rope_beta_slow")
        if m.rope_beta_fast <= m.rope_beta_slow:
            raise field_error("model.rope_beta_fast", m.rope_beta_fast, f"must exceed model.rope_beta_slow="
                              f"{m.rope_beta_slow} (rotations at the ramp's two ends)",
                              "use YaRN's 32 and 1")
    if not 0 < m.partial_rotary_factor <= 1 or m.rotary_dim % 2:
        raise field_error("model.partial_rotary_factor", m.partial_rotary_factor, f"rotates {m.rotary_dim} of a head's "
                          f"{m.resolved_head_dim} dimensions: needs a fraction in (0, 1] giving an even count",
                          "use 1.0 or e.g. 0.5 (GLM-4.5)")
    if m.sliding_window is not None and m.sliding_window < 1:
        raise field_error("model.sliding_window", m.sliding_window, "must be at least 1", "use null or e.g. 128")
    _check_llama4_attention(cfg)
    _check_dsa(cfg)
    _bounds(cfg, "model", positive="window_every", non_negative="mtp_depth mtp_loss_coef")
    if m.hybrid_override_pattern:
        p = m.hybrid_override_pattern
        bad_symbols = sorted(set(p) - set("M*-EGK"))
        if bad_symbols:
            raise field_error("model.hybrid_override_pattern", p, f"has the symbol {bad_symbols[0]!r}",
                              "use M (Mamba-2), * (attention), G (gated DeltaNet), K (KDA), - (dense MLP) and "
                              "E (MoE), one per block")
        if len(p) != m.layers:
            raise field_error("model.hybrid_override_pattern", p, f"gives {len(p)} blocks, model.layers is "
                              f"{m.layers}", f"set model.layers={len(p)}")
        if m.layer_types:
            raise field_error("model.layer_types", list(m.layer_types), "is set beside model.hybrid_override_pattern",
                              "give the blocks in one of them")
        if "E" in p and not cfg.moe.num_experts:
            raise field_error("model.hybrid_override_pattern", p, "has MoE blocks (E) but moe.num_experts is 0",
                              "set moe.num_experts, or use - for dense MLP blocks")
        for name in ("every", "first_dense"):
            if getattr(cfg.moe, name) != MoEConfig.__dataclass_fields__[name].default:
                raise field_error(f"moe.{name}", getattr(cfg.moe, name), "does not apply beside "
                                  "model.hybrid_override_pattern (its E blocks are the MoE ones)", "remove it")
        if m.mtp_depth:
            raise field_error("model.mtp_depth", m.mtp_depth, "multi-token prediction is not built for "
                              "single-sublayer blocks (Nemotron's MTP layers have a pattern of their own)",
                              "set model.mtp_depth=0")
    if m.layer_types:
        if len(m.layer_types) != m.layers:
            raise field_error("model.layer_types", list(m.layer_types), f"gives {len(m.layer_types)} blocks, "
                              f"model.layers is {m.layers}", "give one entry per block, or [] for full attention")
        bad = sorted(set(m.layer_types) - {"full_attention", "linear_attention", "kda", "mamba"})
        if bad:
            raise field_error("model.layer_types", bad[0], "is not a token mixer moetrain has",
                              "use full_attention, linear_attention (gated DeltaNet), kda (Kimi Delta Attention) "
                              "or mamba (Mamba-2)")
    if m.mamba:
        _bounds(cfg, "model", positive="mamba_num_heads mamba_head_dim ssm_state_size n_groups conv_kernel "
                                       "mamba_chunk_size")
        if m.mamba_num_heads % m.n_groups:
            raise field_error("model.n_groups", m.n_groups, f"does not divide model.mamba_num_heads="
                              f"{m.mamba_num_heads} (each group's B and C serve whole heads)",
                              f"choose among {_divisors(m.mamba_num_heads)}")
        if m.mtp_depth:
            raise field_error("model.mtp_depth", m.mtp_depth, "multi-token prediction is not built for hybrid "
                              "models", "set model.mtp_depth=0")
    if m.linear_attention:
        _bounds(cfg, "model", positive="linear_num_key_heads linear_num_value_heads linear_key_head_dim "
                                       "linear_value_head_dim linear_conv_kernel_dim linear_chunk_size")
        if m.kda and m.linear_num_value_heads != m.linear_num_key_heads:
            raise field_error("model.linear_num_value_heads", m.linear_num_value_heads, "must equal model."
                              f"linear_num_key_heads={m.linear_num_key_heads}: a KDA head has its own query, key "
                              "and value (Kimi Linear's linear_num_heads)", "set both to the number of heads")
        if m.kda and m.linear_value_head_dim != m.linear_key_head_dim:
            raise field_error("model.linear_value_head_dim", m.linear_value_head_dim, "must equal model."
                              f"linear_key_head_dim={m.linear_key_head_dim} in KDA layers (Kimi Linear's "
                              "linear_head_dim)", "set both to the head width")
        if m.linear_num_value_heads % m.linear_num_key_heads:
            raise field_error("model.linear_num_value_heads", m.linear_num_value_heads, "is not a multiple of "
                              f"model.linear_num_key_heads={m.linear_num_key_heads} (each query/key head serves "
                              "whole value heads)", "use a multiple of it (Qwen3-Next: 16 key, 32 value heads)")
    if m.attention == "mla":
        _bounds(cfg, "model", positive="kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim q_lora_rank")
        if m.qk_rope_head_dim % 2:
            raise field_error("model.qk_rope_head_dim", m.qk_rope_head_dim, "must be even (RoPE rotates pairs)",
                              "use e.g. 64 (DeepSeek-V3)")
        for name in ("qk_norm", "partial_rotary_factor"):
            if getattr(m, name) != ModelConfig.__dataclass_fields__[name].default:
                raise field_error(f"model.{name}", getattr(m, name), "does not apply to model.attention = 'mla'",
                                  "remove it, or use attention: gqa")
        if m.qkv_bias or m.attention_out_bias:
            raise field_error("model.qkv_bias" if m.qkv_bias else "model.attention_out_bias", True,
                              "MLA's projections have no biases in moetrain (nor in DeepSeek-V3)", "remove it")
    elif m.heads % m.kv_heads:
        raise field_error("model.kv_heads", m.kv_heads, f"model.heads={m.heads} is not divisible by it (GQA groups)",
                          f"choose kv_heads among {_nearest(m.kv_heads, _divisors(m.heads))}")
    if m.attention_sinks and m.attention_backend != "sdpa":
        raise field_error("model.attention_backend", m.attention_backend, "takes no attention sinks",
                          "use attention_backend sdpa (its blockwise kernel merges the sinks)")
    if not device:
        return
    prec = cfg.train.precision
    if m.attention_backend == "flash":  # moetrain.model.attention
        if device != "cuda":
            raise field_error("model.attention_backend", "flash", f"flash-attn runs on CUDA only and this run is on "
                              f"{device}", "use attention_backend sdpa")
        if importlib.util.find_spec("flash_attn") is None:
            raise field_error("model.attention_backend", "flash", "the flash-attn package is not installed",
                              "pip install flash-attn (README: GPU backends), or use attention_backend sdpa")
        if prec not in ("bf16", "fp8"):
            raise field_error("model.attention_backend", "flash", f"flash-attn takes bf16/fp16, train.precision is "
                              f"{prec!r}", "set train.precision=bf16 or use attention_backend sdpa")
    if m.linear_attention and m.linear_attention_backend == "fla":  # moetrain.model.gated_deltanet
        if device != "cuda":
            raise field_error("model.linear_attention_backend", "fla", f"flash-linear-attention's kernels run on CUDA "
                              f"only and this run is on {device}", "use linear_attention_backend torch")
        if importlib.util.find_spec("fla") is None:
            raise field_error("model.linear_attention_backend", "fla", "the flash-linear-attention package is not "
                              "installed", "pip install flash-linear-attention, or use linear_attention_backend torch")
    if m.mamba and m.mamba_backend == "mamba_ssm":  # moetrain.model.mamba2
        if device != "cuda":
            raise field_error("model.mamba_backend", "mamba_ssm", f"mamba-ssm's kernels run on CUDA only and this run "
                              f"is on {device}", "use mamba_backend torch")
        if importlib.util.find_spec("mamba_ssm") is None:
            raise field_error("model.mamba_backend", "mamba_ssm", "the mamba-ssm package is not installed",
                              "pip install mamba-ssm, or use mamba_backend torch")
    if m.attention_backend == "flex":
        if device != "cuda":
            raise field_error("model.attention_backend", "flex", "flex_attention has no backward on CPU in torch 2.13",
                              "use attention_backend sdpa on CPU (document masks work there too)")


def _check_moe(cfg: Config, device: str | None) -> None:
    moe, prec = cfg.moe, cfg.train.precision
    _bounds(cfg, "moe", non_negative="num_experts shared_experts first_dense")
    _check_eplb(cfg)
    if not moe.num_experts:
        return
    _bounds(cfg, "moe", positive="top_k every ffn_hidden")
    if moe.top_k > moe.num_experts:
        raise field_error("moe.top_k", moe.top_k, f"more than moe.num_experts={moe.num_experts}",
                          f"use top_k <= {moe.num_experts}")
    if moe.routed_scaling_factor <= 0:
        raise field_error("moe.routed_scaling_factor", moe.routed_scaling_factor, "must be positive",
                          "use 1.0 (no scaling) or e.g. 2.5 (DeepSeek-V3)")
    if moe.bias_update_rate < 0:
        raise field_error("moe.bias_update_rate", moe.bias_update_rate, "must not be negative",
                          "use 0 (off) or a small rate such as 0.001")
    if moe.max_nodes_per_token is not None and moe.max_nodes_per_token < 1:
        raise field_error("moe.max_nodes_per_token", moe.max_nodes_per_token, "must be at least 1",
                          "use null (no limit) or e.g. 4")
    if moe.shared_ffn_hidden is not None and moe.shared_experts == 0:
        raise field_error("moe.shared_ffn_hidden", moe.shared_ffn_hidden, "moe.shared_experts = 0: no shared "
                          "experts to size", "set moe.shared_experts >= 1 or shared_ffn_hidden: null")
    _bounds(cfg, "moe", positive="shared_ffn_hidden")
    if moe.shared_expert_gate and moe.shared_experts == 0:
        raise field_error("moe.shared_expert_gate", True, "moe.shared_experts = 0: no shared experts to gate",
                          "set moe.shared_experts >= 1 or shared_expert_gate: false")
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        raise field_error("moe.capacity_factor", moe.capacity_factor, "must be positive",
                          "use null for dropless or a value such as 1.25")
    if (moe.n_group is None) != (moe.topk_group is None):
        which = "moe.n_group" if moe.n_group is not None else "moe.topk_group"
        raise field_error(which, getattr(moe, which.split(".")[1]), "group-limited routing needs both moe.n_group and "
                          "moe.topk_group", "set both (DeepSeek-V3: 8 and 4), or neither")
    if moe.n_group is not None:
        if moe.n_group < 1 or moe.num_experts % moe.n_group:
            raise field_error("moe.n_group", moe.n_group, f"must divide moe.num_experts={moe.num_experts} (equal "
                              f"groups)", f"choose n_group among {_nearest(moe.n_group, _divisors(moe.num_experts))}")
        if not 1 <= moe.topk_group <= moe.n_group or moe.top_k > moe.topk_group * (moe.num_experts // moe.n_group):
            raise field_error("moe.topk_group", moe.topk_group, f"must lie in 1..n_group={moe.n_group} and its groups "
                              f"must hold top_k={moe.top_k} experts",
                              f"use topk_group >= {-(-moe.top_k // (moe.num_experts // moe.n_group))}")
        if moe.max_nodes_per_token is not None:
            raise field_error("moe.max_nodes_per_token", moe.max_nodes_per_token, "node-limited routing and "
                              "moe.n_group both limit the groups a token may use", "use one of them")
    if moe.swiglu_limit <= 0:
        raise field_error("moe.swiglu_limit", moe.swiglu_limit, "must be positive", "use e.g. 7.0 (GPT-OSS)")
    # moetrain.model.moe's backends: megablocks and CUDA's grouped GEMM want CUDA and bf16.
    if device and moe.expert_backend == "megablocks":
        if device != "cuda":
            raise field_error("moe.expert_backend", "megablocks", f"megablocks runs on CUDA only and this run is on "
                              f"{device}", "use expert_backend auto, loop or grouped_mm")
        if missing := [p for p in ("megablocks", "grouped_gemm") if importlib.util.find_spec(p) is None]:
            raise field_error("moe.expert_backend", "megablocks", f"{', '.join(missing)} not installed",
                              "install them in an environment that megablocks supports (README: GPU backends), "
                              "or use expert_backend auto")
        if prec != "bf16":
            raise field_error("moe.expert_backend", "megablocks", f"its grouped GEMM takes bf16, train.precision is "
                              f"{prec!r}", "set train.precision=bf16 or use expert_backend loop")
    if prec == "fp8" and moe.expert_backend not in ("auto", "loop"):
        raise field_error("moe.expert_backend", moe.expert_backend, "fp8 experts run their GEMMs per expert on the "
                          "loop backend (moetrain.model.fp8_gemm)", "use expert_backend auto or loop")
    if moe.expert_backend == "grouped_mm" and device == "cuda" and prec != "bf16":
        raise field_error("moe.expert_backend", "grouped_mm", f"torch's CUDA grouped GEMM takes bf16, train.precision "
                          f"is {prec!r}", "set train.precision=bf16 or use expert_backend loop (auto picks it)")


def _check_eplb(cfg: Config) -> None:
    """moe.eplb (expert placement by measured load), each field named with its fix."""
    moe, e = cfg.moe, cfg.moe.eplb
    _bounds(cfg, "moe.eplb", positive="window", non_negative="redundant_experts every")
    if not e.enabled:
        if e.redundant_experts:
            raise field_error("moe.eplb.redundant_experts", e.redundant_experts, "is set while moe.eplb.every is 0 "
                              "(EPLB off)", "set moe.eplb.every, e.g. 100, or redundant_experts: 0")
        return
    if not moe.num_experts:
        raise field_error("moe.eplb.every", e.every, "places experts but moe.num_experts is 0", "set every: 0")
    ep = cfg.parallel.ep
    if moe.num_slots % ep:
        fit = [r for r in range(e.redundant_experts, e.redundant_experts + ep) if (moe.num_experts + r) % ep == 0]
        raise field_error("moe.eplb.redundant_experts", e.redundant_experts, f"num_experts + redundant_experts = "
                          f"{moe.num_slots} slots do not split over parallel.ep={ep} ranks",
                          f"use redundant_experts {fit[0]}")
    refused = [("moe.capacity_factor", moe.capacity_factor, moe.capacity_factor is not None,
                "a capacity counts per expert, a replica sees part of its tokens", "use capacity_factor: null"),
               ("moe.max_nodes_per_token", moe.max_nodes_per_token, moe.max_nodes_per_token is not None,
                "node-limited routing groups experts by the node of a fixed rank", "use max_nodes_per_token: null"),
               ("train.lora.r", cfg.train.lora.r, cfg.train.lora.r > 0,
                "the adapters' stacks are not placed by EPLB", "set train.lora.r: 0"),
               ("train.optimizer", cfg.train.optimizer, cfg.train.optimizer != "adamw",
                "EPLB moves AdamW's states only", "use train.optimizer: adamw"),
               ("train.compile", cfg.train.compile, cfg.train.compile,
                "a re-placement changes the MoE layers' slot tables", "set train.compile: false")]
    for field_name, value, bad, why, fix in refused:
        if bad:
            raise field_error(field_name, value, f"is not built beside moe.eplb ({why})", fix)


def _check_train(cfg: Config, device: str | None) -> None:
    tr = cfg.train
    _bounds(cfg, "train", positive="steps micro_batch_size global_batch_size lr log_every",
            non_negative="warmup_steps val_every grad_clip min_lr")
    if tr.decay_steps is not None and tr.decay_steps <= tr.warmup_steps:
        raise field_error("train.decay_steps", tr.decay_steps, f"must exceed train.warmup_steps = {tr.warmup_steps}",
                          "use a larger value, or null for train.steps")
    if tr.min_lr > tr.lr:
        raise field_error("train.min_lr", tr.min_lr, f"larger than train.lr={tr.lr}", "use min_lr <= lr")
    if tr.fp8_block < 1:
        raise field_error("train.fp8_block", tr.fp8_block, "must be positive", "use 128 (DeepSeek-V3)")
    if tr.precision == "fp8" and tr.compile:
        raise field_error("train.compile", True, "not proved with train.precision fp8 yet (the fp8 GEMMs' autograd "
                          "function under inductor)", "set train.compile: false, or train.precision: bf16")
    an = tr.anomaly
    if not an.spike_z > 0:
        raise field_error("train.anomaly.spike_z", an.spike_z, "must be positive", "use e.g. 6")
    if an.window < 2:
        raise field_error("train.anomaly.window", an.window, "a standard deviation needs 2 steps or more",
                          "use e.g. 50")
    if an.max_skips < 0:
        raise field_error("train.anomaly.max_skips", an.max_skips, "must not be negative", "use e.g. 10")
    _bounds(cfg, "train", non_negative="straggler_every", positive="straggler_threshold straggler_windows")
    if not 0 <= tr.muon_momentum < 1:
        raise field_error("train.muon_momentum", tr.muon_momentum, "a momentum must lie in [0, 1)",
                          "use 0.95 (Moonlight, Kimi K2)")
    if tr.qk_clip is not None:
        if not tr.qk_clip > 0:
            raise field_error("train.qk_clip", tr.qk_clip, "a logit threshold must be positive",
                              "use e.g. 100 (Kimi K2), or null to turn QK-clip off")
        if cfg.model.qk_norm != "none":
            raise field_error("train.qk_clip", tr.qk_clip, f"with model.qk_norm={cfg.model.qk_norm!r} the norm "
                              "divides out any scale of W_q / W_k, so clipping cannot bound the logits (and the "
                              "norm bounds them already)", "set qk_clip: null, or model.qk_norm: none")
        if tr.compile:
            raise field_error("train.qk_clip", tr.qk_clip, "the max-logit record inside the compiled attention "
                              "core is not proved under train.compile", "set train.compile=false or qk_clip: null")
    _check_lora(cfg)
    if (pr := tr.profile) is not None:
        if pr.start < 1 or pr.steps < 1:
            raise field_error("train.profile.start" if pr.start < 1 else "train.profile.steps",
                              pr.start if pr.start < 1 else pr.steps, "must be at least 1 (steps count from 1)",
                              "use e.g. start: 3, steps: 2")
    for name, policy in (("on_nan", an.on_nan), ("on_spike", an.on_spike)):
        if policy == "rollback" and not cfg.checkpoint.every:
            raise field_error(f"train.anomaly.{name}", "rollback", "rolls back to the latest checkpoint, and "
                              "checkpoint.every is 0", "set checkpoint.every (e.g. 100), or use skip")


def _check_lora(cfg: Config) -> None:
    lo = cfg.train.lora
    if lo.r < 0:
        raise field_error("train.lora.r", lo.r, "a rank cannot be negative", "use e.g. 16, or 0 to train every "
                          "parameter")
    if not lo.r:
        if lo.base_dtype is not None:
            raise field_error("train.lora.base_dtype", lo.base_dtype, "stores a LoRA run's frozen base, and "
                              "train.lora.r is 0 (every parameter trains)", "set train.lora.r (e.g. 16), or "
                              "base_dtype: null")
        return
    if not lo.lora_alpha > 0:
        raise field_error("train.lora.lora_alpha", lo.lora_alpha, "the adapter's scale alpha / r must be positive",
                          "use e.g. 2 * r (32 for r = 16)")
    if not 0 <= lo.lora_dropout < 1:
        raise field_error("train.lora.lora_dropout", lo.lora_dropout, "a dropout probability lies in [0, 1)",
                          "use 0 or e.g. 0.05")
    if not lo.target_modules:
        raise field_error("train.lora.target_modules", [], "no weight would train", "use [all-linear], or names "
                          "such as [wq, wk, wv, wo, w1, w2, w3]")
    if cfg.train.optimizer != "adamw":
        raise field_error("train.optimizer", cfg.train.optimizer, "the adapters train with AdamW (Muon's "
                          "orthogonalised update is not proved on rank-r factors)", "set train.optimizer: adamw")
    if cfg.train.qk_clip is not None:
        raise field_error("train.qk_clip", cfg.train.qk_clip, "QK-clip rescales W_q and W_k, which train.lora "
                          "freezes", "set train.qk_clip: null")
    if cfg.moe.num_experts and cfg.moe.expert_backend == "megablocks":
        raise field_error("moe.expert_backend", "megablocks", "the experts' adapters run in moetrain's own expert "
                          "pass", "use moe.expert_backend: grouped_mm or loop")


def _check_data(cfg: Config, device: str | None) -> None:
    data = cfg.data
    _bounds(cfg, "data", non_negative="val_batches", positive="max_open_maps")
    if data.path is not None and data.blend:
        raise field_error("data.path", data.path, "set together with data.blend; a blend lists every source",
                          "remove data.path (or add it to data.blend as one more source)")
    if data.path is not None and not data.path.strip():
        raise field_error("data.path", data.path, "an empty path", "give a shard directory")
    seen: dict[str, int] = {}
    for i, src in enumerate(data.blend):
        if not src.path.strip():
            raise field_error(f"data.blend[{i}].path", src.path, "every source needs a shard directory",
                              "write `{path: DIR, weight: W}`")
        if not (src.weight > 0 and math.isfinite(src.weight)):
            raise field_error(f"data.blend[{i}].weight", src.weight, "a weight must be a positive number",
                              "give the source's relative share, e.g. 0.3, or remove the source")
        name = src.resolved_name
        if not name or name in (".", ".."):
            raise field_error(f"data.blend[{i}].name", src.name, f"no usable name from the path {src.path!r}",
                              "give the source a name")
        if name in seen:
            raise field_error(f"data.blend[{i}].name", name, f"the same name as data.blend[{seen[name]}]; metrics "
                              "and checkpoints count samples by source name", "give one of them another `name`")
        seen[name] = i
    if data.reset_position_ids and not data.document_mask:
        raise field_error("data.reset_position_ids", True, "positions restart per document only with document masking",
                          "set data.document_mask=true as well, or reset_position_ids=false")


def _check_checkpoint(cfg: Config, device: str | None) -> None:
    ck = cfg.checkpoint
    _bounds(cfg, "checkpoint", positive="keep", non_negative="every")
    if ck.init_from is not None and not ck.init_from.strip():
        raise field_error("checkpoint.init_from", ck.init_from, "an empty path",
                          "give a directory written by `python -m moetrain.hf import` or a checkpoint, or null")
    if ck.timeout_s <= 0:
        raise field_error("checkpoint.timeout_s", ck.timeout_s, "must be positive",
                          "use the seconds a checkpoint may take, e.g. 1800")


def _check_launch(cfg: Config, device: str | None) -> None:
    ln, par, world = cfg.launch, cfg.parallel, cfg.world_size
    _bounds(cfg, "launch", positive="nodes time_min cpus_per_task", non_negative="max_restarts gpus_per_node")
    tpn = ln.resolved_tasks_per_node(world)
    if ln.tasks_per_node is None and world % ln.nodes:
        raise field_error("launch.nodes", ln.nodes, f"world size pp·dp·cp·tp = {world} does not split evenly over "
                          f"the nodes", f"choose nodes among {_nearest(ln.nodes, _divisors(world))} or set "
                          "launch.tasks_per_node")
    if ln.nodes * tpn != world:
        raise field_error("launch.tasks_per_node", ln.tasks_per_node,
                          f"nodes × tasks_per_node = {ln.nodes} × {tpn} = {ln.nodes * tpn} processes, but the world "
                          f"size pp × dp × cp × tp = {par.pp} × {par.dp} × {par.cp} × {par.tp} = {world}",
                          f"set launch.tasks_per_node={world // ln.nodes if world % ln.nodes == 0 else 'null'} "
                          f"or change the parallel sizes so their product is {ln.nodes * tpn}")
    if ln.cluster == "local" and ln.nodes != 1:
        raise field_error("launch.nodes", ln.nodes, "the local executor runs on this one machine",
                          "use launch.nodes=1 or launch.cluster=slurm")
    if ln.gpus_per_node and ln.gpus_per_node < tpn and ln.cluster == "slurm":
        raise field_error("launch.gpus_per_node", ln.gpus_per_node, f"fewer GPUs than tasks per node ({tpn}); one "
                          "task drives one GPU", f"set launch.gpus_per_node={tpn} or 0 for CPU runs")
    if ln.heartbeat_timeout_factor <= 1:
        raise field_error("launch.heartbeat_timeout_factor", ln.heartbeat_timeout_factor,
                          "a hang is a pause longer than this many median steps; it must exceed 1", "use e.g. 10")
    _check_site(cfg)
    _check_elastic(cfg)


def _check_elastic(cfg: Config) -> None:
    """``launch.elastic``: a SLURM run with checkpoints to resume from, and a node range."""
    el, ln = cfg.launch.elastic, cfg.launch
    if el is None:
        return
    if ln.cluster != "slurm":
        raise field_error("launch.elastic", to_dict(cfg)["launch"]["elastic"], "elastic training re-plans when SLURM "
                          "starts the job on fewer nodes; the local executor always has its one machine",
                          "set launch.cluster: slurm, or --set launch.elastic=null")
    if not 1 <= el.min_nodes <= ln.nodes:
        raise field_error("launch.elastic.min_nodes", el.min_nodes, f"must be between 1 and launch.nodes = {ln.nodes}",
                          f"use e.g. min_nodes: {max(1, ln.nodes // 2)}")
    if not cfg.checkpoint.every or not cfg.checkpoint.resume:
        raise field_error("checkpoint.every" if not cfg.checkpoint.every else "checkpoint.resume",
                          cfg.checkpoint.every if not cfg.checkpoint.every else cfg.checkpoint.resume,
                          "an elastic run goes on from its latest checkpoint after a node is lost",
                          "set checkpoint.every (e.g. 100) and checkpoint.resume: true")
    if el.grow_check_s <= 0:
        raise field_error("launch.elastic.grow_check_s", el.grow_check_s, "must be positive",
                          "use the seconds between two checks, e.g. 60")


_SHELL_NAME = r"[A-Za-z_][A-Za-z0-9_]*"


def _check_site(cfg: Config) -> None:
    """The site settings of ``launch``: names that are shell names, values without NUL (a shell
    cannot carry it), mounts and arguments in the form their tool takes."""
    import re

    ln = cfg.launch
    if ln.cluster == "local" and ln.container is not None:
        raise field_error("launch.container.image", ln.container.image, "containers start through SLURM (srun); "
                          "the local executor runs this machine's Python", "--set launch.container=null for a local "
                          "run, or launch.cluster: slurm")
    if ln.cluster == "local" and ln.setup:
        raise field_error("launch.setup", list(ln.setup), "setup lines run in the SLURM job script before the ranks "
                          "start; the local executor has none", "run them in your shell before submit, and "
                          "--set launch.setup=[] (launch.env works locally)")
    for name, value in ln.env.items():
        if not re.fullmatch(_SHELL_NAME, name):
            raise field_error(f"launch.env.{name}", value, f"{name!r} is not a shell variable name",
                              "use letters, digits and _, not starting with a digit (e.g. NCCL_IB_HCA)")
        if "\0" in value:
            raise field_error(f"launch.env.{name}", value, "contains a NUL character", "remove it")
    for i, line in enumerate(ln.setup):
        if "\0" in line:
            raise field_error(f"launch.setup[{i}]", line, "contains a NUL character, which no shell line can hold",
                              "remove it")
    for key in ("srun_args", "sbatch_args"):
        for i, arg in enumerate(getattr(ln, key)):
            if "\0" in arg or not arg.startswith("-"):
                raise field_error(f"launch.{key}[{i}]", arg, "not an option (each item is one argument starting "
                                  "with -, or contains a NUL)", "write options such as --reservation=maint, one "
                                  "per item")
            if key == "sbatch_args" and not re.fullmatch(r"--[A-Za-z][A-Za-z0-9-]*(=.*)?", arg, re.S):
                raise field_error(f"launch.{key}[{i}]", arg, "an #SBATCH line needs the long form --name or "
                                  "--name=value", "write e.g. --reservation=maint instead of a short -x form")
    c = ln.container
    if c is None:
        return
    plain = re.compile(r"[^\s\0]+")
    if not plain.fullmatch(c.image):
        raise field_error("launch.container.image", c.image, "empty, or contains whitespace or NUL",
                          "name an image, e.g. nvcr.io#nvidia/pytorch:25.01-py3 (pyxis) or /images/train.sif")
    if not plain.fullmatch(c.python):
        raise field_error("launch.container.python", c.python, "empty, or contains whitespace or NUL",
                          "name the image's Python, e.g. python3 or /opt/conda/bin/python")
    for i, mount in enumerate(c.mounts):
        parts = mount.split(":")
        if len(parts) not in (2, 3) or not all(parts[:2]):
            raise field_error(f"launch.container.mounts[{i}]", mount, "a mount is SRC:DST or SRC:DST:FLAGS",
                              "write e.g. /lustre/data:/data or /lustre/data:/data:ro")
        if not (parts[0].startswith("/") and parts[1].startswith("/")) or not plain.fullmatch(mount) or "," in mount:
            raise field_error(f"launch.container.mounts[{i}]", mount, "SRC and DST must be absolute paths without "
                              "spaces or commas", "write e.g. /lustre/data:/data")
    for i, arg in enumerate(c.runtime_args):
        if "\0" in arg or not arg.startswith("-"):
            raise field_error(f"launch.container.runtime_args[{i}]", arg, "not an option (each item is one argument "
                              "starting with -, or contains a NUL)", "write options such as --cleanenv, one per item")
    if c.workdir is not None and (not c.workdir.startswith("/") or not plain.fullmatch(c.workdir)):
        raise field_error("launch.container.workdir", c.workdir, "not an absolute path (or it contains whitespace)",
                          "write an absolute path inside the image, or null for the submit directory")


def _check_metrics(cfg: Config, device: str | None) -> None:
    mt = cfg.metrics
    if mt.peak_tflops is not None and mt.peak_tflops <= 0:
        raise field_error("metrics.peak_tflops", mt.peak_tflops, "must be positive",
                          "give the device's peak TFLOP/s (e.g. 989 for an H100 in bf16) or null")
    if mt.wandb is not None and not mt.wandb.project.strip():
        raise field_error("metrics.wandb.project", mt.wandb.project, "a W&B run needs a project",
                          "write `wandb: {project: NAME, mode: offline}` in the metrics section")


def padded_vocab(vocab: int, multiple: int, tp: int) -> int:
    """Vocabulary padded up to a multiple of ``multiple × tp`` (Megatron's padding rule)."""
    q = multiple * tp
    return int(math.ceil(vocab / q) * q)
