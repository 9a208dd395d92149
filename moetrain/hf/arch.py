"""The supported Hugging Face architectures in moetrain's terms: ``config.json`` ↔ the ``model`` and
``moe`` config sections, both ways, and what is refused.

==========================  ===========  ====================================================================
architecture                model_type   moetrain config
==========================  ===========  ====================================================================
MixtralForCausalLM          mixtral      every block MoE, softmax top-k renormalised (norm_topk_prob)
Qwen3MoeForCausalLM         qwen3_moe    qk_norm ``head``; norm_topk_prob as configured; dense blocks from
                                         decoder_sparse_step / mlp_only_layers; head_dim
Qwen2MoeForCausalLM         qwen2_moe    one shared expert of shared_expert_intermediate_size with its
                                         sigmoid gate; q/k/v bias (qkv_bias); norm_topk_prob; dense blocks
OlmoeForCausalLM            olmoe        qk_norm ``projection``; every block MoE; norm_topk_prob
LlamaForCausalLM            llama        dense (moe.num_experts 0); rope scaling ``llama3``
DeepseekV3ForCausalLM       deepseek_v3  MLA (q_lora_rank, kv_lora_rank, qk_nope/qk_rope/v head dims, YaRN with
                                         mscale); sigmoid routing with the score-correction bias, n_group /
                                         topk_group, routed_scaling_factor, n_shared_experts; dense first
                                         blocks (first_k_dense_replace); the MTP layers after the last block
                                         when asked for (``mtp_depth``)
Glm4MoeForCausalLM          glm4_moe     partial rotary (partial_rotary_factor); q/k/v bias (attention_bias);
                                         per-head q/k norm (use_qk_norm); DeepSeek-V3's routing and shared
                                         experts; MTP as DeepSeek-V3
GptOssForCausalLM           gpt_oss      attention sinks; sliding window on alternate blocks (layer_types);
                                         q/k/v/o biases; router bias; expert biases; clamped SwiGLU
                                         (swiglu_alpha, swiglu_limit); YaRN; MXFP4 experts dequantized on
                                         import (bf16, exact)
Qwen3NextForCausalLM        qwen3_next   hybrid: gated DeltaNet (``linear_attention``) and gated attention
                                         (``full_attention``) blocks from layer_types, the linear_* shapes;
                                         zero-centred RMSNorms; per-head q/k norm; partial rotary; a gated
                                         shared expert; dense blocks from decoder_sparse_step / mlp_only_layers;
                                         its MTP module (``mtp.*``, one layer) when asked for (``mtp_depth``)
Qwen3_5MoeForCausalLM       qwen3_5_moe  Qwen3-Next's blocks with gated DeltaNet's input projections split
                            _text        (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: regrouped by key head),
                                         every block MoE, partial rotary 0.25 by default; the multimodal RoPE's
                                         sections dropped (text positions make it the 1D RoPE); the MTP module
                                         as Qwen3-Next's
Qwen3_5MoeForConditional-   qwen3_5_moe  the published multimodal checkpoint: its text model (model.language_model),
Generation                               read from text_config; the vision tower left out; exported as the text model
KimiLinearForCausalLM       kimi_linear  hybrid: Kimi Delta Attention (``kda``; HF ``linear_attention``) and MLA
                                         without RoPE (``model.rope: false``) blocks from layer_types (or
                                         linear_attn_config's 1-indexed kda_layers / full_attn_layers); the
                                         KDA shape (linear_num_heads, linear_head_dim, linear_conv_kernel_dim);
                                         DeepSeek-V3's routing (sigmoid, score-correction bias, groups, routed
                                         scaling) and shared experts; dense first blocks (mlp_layer_types or
                                         first_k_dense_replace)
NemotronHForCausalLM        nemotron_h   single-sublayer blocks from layers_block_type (or
                                         hybrid_override_pattern) → ``model.hybrid_override_pattern``: Mamba-2
                                         (its in_proj rows and convolution channels regrouped by group),
                                         attention without RoPE, squared-ReLU MLPs (``model.mlp_activation``)
                                         and MoEs (squared-ReLU experts, ``moe.activation: relu2``; DeepSeek-V3's
                                         routing; one shared expert of its own width); ``backbone.*`` names
MiniMaxM2ForCausalLM        minimax_m2   q/k RMSNorm over the whole projection (``model.qk_norm: projection``;
                                         its ``qk_norm_type: per_layer``), partial rotary (``rotary_dim`` /
                                         ``partial_rotary_factor``), every block MoE with sigmoid scores and
                                         the score-correction bias (``block_sparse_moe.e_score_correction_bias``),
                                         top-k renormalised, no shared expert; Mixtral's expert names
Llama4ForCausalLM           llama4_text  RoPE (interleaved pairs, as moetrain's) and NoPE blocks
                                         (``no_rope_layers``, or every no_rope_layer_interval-th block NoPE);
                                         chunked attention in the RoPE blocks (``attention_chunk_size``);
                                         the weightless q/k norm after RoPE (``use_qk_norm`` → ``qk_norm:
                                         l2``); the NoPE blocks' temperature tuning (attn_temperature_tuning,
                                         floor_scale, attn_scale); MoE blocks from moe_layers /
                                         interleave_moe_layer_step, top-1 sigmoid routing that scales the
                                         expert's input (``moe.apply_probs_on_input``) and one shared expert of
                                         the experts' width (intermediate_size); dense blocks of
                                         intermediate_size_mlp; the experts fused (gate_up_proj, gate then up)
==========================  ===========  ====================================================================

All of them: RMSNorm pre-norm blocks, SwiGLU (``hidden_act: silu``), grouped-query attention
(or MLA), RoPE (``default``, ``llama3`` or ``yarn``), tied or separate embeddings
(``tie_word_embeddings``).

Refused, naming the field (never converted approximately): any other architecture or
``model_type``; a config.json key this mapping does not know (a new field could change the
forward pass); sliding-window attention except GPT-OSS's (Qwen's ``use_sliding_window``, a
``layer_types`` entry other than full / sliding attention, sliding blocks that are not every n-th
block from block 0); RoPE types other than default, llama3 and yarn; partial rotary outside
GLM-4-MoE, Qwen3-Next / 3.5 and MiniMax-M2; Llama 4's ``layer_types`` other than the chunked
RoPE / full NoPE blocks its other keys give, its top-k above 1 and router jitter; an activation
other than silu; attention biases where the architecture above lists none (``attention_bias``;
Llama's ``mlp_bias``); OLMoE's ``clip_qkv`` and a ``head_dim`` other
than hidden / heads; router jitter noise; attention dropout; quantized weights other than
GPT-OSS's MXFP4 experts and DeepSeek-V3's FP8 blocks; MiniMax-M2's other norm types, shared
experts or linear-attention blocks (``attn_type_list``) and its MTP modules; a pattern of dense and MoE blocks moetrain's ``moe.every`` /
``moe.first_dense`` cannot express; more MTP layers (``mtp_depth``) than the checkpoint has. In
the other direction, a moetrain model the target architecture cannot hold (e.g. shared experts
without a gate, or moetrain's ``moe.every`` for Mixtral) is refused with the moetrain field.

Training hyperparameters that ride along: ``router_aux_loss_coef`` ↔ ``moe.aux_loss_coef`` (HF's
load-balancing loss is over the whole batch, moetrain's per sequence: same intent, see
:meth:`moetrain.model.moe.MoE.router_losses`), ``initializer_range`` ↔ ``model.init_std``;
``moe.z_loss_coef`` is 0 on import (these architectures define no z-loss).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from moetrain.config import Config
from moetrain.hf.tensors import (DEEPSEEK_MOE, GLM_DSA_NAMES, GPT_OSS_MOE, KIMI_MOE, LLAMA4_NAMES, MINIMAX_M2_MOE, MIXTRAL_MOE,
                                 NEMOTRON_H_NAMES, QWEN3_5_NAMES,
                                 QWEN3_5_VL_NAMES, QWEN3_NEXT_NAMES, QWEN_MOE, Names)

log = logging.getLogger(__name__)

__all__ = ["ARCHITECTURES", "Architecture", "UnsupportedModel", "architecture_for", "choose_architecture"]


class UnsupportedModel(ValueError):
    """The model uses something moetrain cannot represent exactly; the message names it."""


# Keys of every config.json that do not change the forward pass (or that the mapping reads).
_INERT = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "output_router_logits", "output_attentions",
    "output_hidden_states", "return_dict", "tokenizer_class", "max_position_embeddings", "initializer_range",
    "router_aux_loss_coef", "auto_map",  # (auto_map: where remote code lives; moetrain runs none)
})
_MISSING = object()


@dataclass(frozen=True)
class Architecture:
    """One HF architecture: its class name, ``model_type``, MoE tensor names (see
    :mod:`moetrain.hf.tensors`), the ``config.json`` keys its mapping reads, and the RoPE base HF
    assumes when config.json has none."""

    name: str
    model_type: str
    moe_names: Names
    keys: frozenset
    default_theta: float = 10000.0
    # the checkpoint rotates interleaved pairs, as moetrain does (its q/k rows are copied as they are)
    rope_interleaved: bool = False


_COMMON = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "rms_norm_eps", "hidden_act", "attention_dropout", "tie_word_embeddings", "head_dim",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
})
_QWEN = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                   "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "use_sliding_window", "sliding_window",
                   "max_window_layers", "layer_types"})

MIXTRAL = Architecture("MixtralForCausalLM", "mixtral", MIXTRAL_MOE, _COMMON | {
    "num_local_experts", "num_experts_per_tok", "sliding_window", "router_jitter_noise"}, default_theta=1e6)
QWEN3_MOE = Architecture("Qwen3MoeForCausalLM", "qwen3_moe", QWEN_MOE, _COMMON | _QWEN | {"attention_bias"})
QWEN2_MOE = Architecture("Qwen2MoeForCausalLM", "qwen2_moe", QWEN_MOE, _COMMON | _QWEN | {
    "qkv_bias", "shared_expert_intermediate_size"})
OLMOE = Architecture("OlmoeForCausalLM", "olmoe", QWEN_MOE, _COMMON | {
    "num_experts", "num_experts_per_tok", "norm_topk_prob", "clip_qkv", "attention_bias"})
# (the released checkpoints' own keys besides transformers': read and checked in from_hf)
MINIMAX_M2 = Architecture("MiniMaxM2ForCausalLM", "minimax_m2", MINIMAX_M2_MOE, _COMMON | {
    "num_local_experts", "num_experts_per_tok", "router_jitter_noise", "rotary_dim", "output_router_logits",
    "use_qk_norm", "qk_norm_type", "scoring_func", "use_routing_bias", "shared_intermediate_size", "attn_type_list",
    "sliding_window", "use_mtp", "num_mtp_modules", "mtp_transformer_layers"}, default_theta=5e6)
LLAMA = Architecture("LlamaForCausalLM", "llama", QWEN_MOE, _COMMON | {"attention_bias", "mlp_bias", "pretraining_tp"})
# Llama 4's text model; its released config also carries inference-only keys (cache_implementation,
# for_llm_compressor), read and ignored.
LLAMA4_TEXT = Architecture("Llama4ForCausalLM", "llama4_text", LLAMA4_NAMES, _COMMON | {
    "intermediate_size_mlp", "num_local_experts", "num_experts_per_tok", "moe_layers", "interleave_moe_layer_step",
    "use_qk_norm", "router_jitter_noise", "no_rope_layers", "no_rope_layer_interval", "attention_chunk_size",
    "layer_types", "attn_temperature_tuning", "floor_scale", "attn_scale", "attention_bias", "cache_implementation",
    "for_llm_compressor"}, default_theta=500000.0, rope_interleaved=True)

_DEEPSEEK = frozenset({"n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                       "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob",
                       "num_nextn_predict_layers", "attention_bias", "topk_method", "scoring_func", "moe_layer_freq",
                       "ep_size", "aux_loss_alpha", "seq_aux", "pretraining_tp", "quantization_config"})
DEEPSEEK_V3 = Architecture("DeepseekV3ForCausalLM", "deepseek_v3", DEEPSEEK_MOE, _COMMON | _DEEPSEEK | {
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_head_dim",
    "rope_interleave"})
GLM4_MOE = Architecture("Glm4MoeForCausalLM", "glm4_moe", DEEPSEEK_MOE, _COMMON | _DEEPSEEK | {"use_qk_norm"})
# DeepSeek Sparse Attention on DeepSeek-V3's blocks: DeepSeek-V3.2 (its indexer rotates halves) and
# GLM-5 (interleaved pairs; its indexer_types may share a layer's top-k with the next: refused).
_DSA = frozenset({"kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_head_dim",
                  "index_topk", "index_head_dim", "index_n_heads", "layer_types", "mlp_layer_types", "mlp_bias"})
DEEPSEEK_V32 = Architecture("DeepseekV32ForCausalLM", "deepseek_v32", DEEPSEEK_MOE, _COMMON | _DEEPSEEK | _DSA,
                            rope_interleaved=True)
GLM_MOE_DSA = Architecture("GlmMoeDsaForCausalLM", "glm_moe_dsa", GLM_DSA_NAMES,
                           _COMMON | _DEEPSEEK | _DSA | {"indexer_types"}, rope_interleaved=True)
DSA_ARCHS = (DEEPSEEK_V32, GLM_MOE_DSA)
GPT_OSS = Architecture("GptOssForCausalLM", "gpt_oss", GPT_OSS_MOE, _COMMON | {
    "num_local_experts", "num_experts_per_tok", "attention_bias", "layer_types", "sliding_window", "swiglu_alpha",
    "swiglu_limit", "quantization_config"}, default_theta=150000.0)
QWEN3_NEXT = Architecture("Qwen3NextForCausalLM", "qwen3_next", QWEN3_NEXT_NAMES, _COMMON | {
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers", "layer_types", "attention_bias", "shared_expert_intermediate_size", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "full_attention_interval"})

# Qwen3.5's MoE text model: Qwen3-Next's blocks with gated DeltaNet's input projections split
# (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), every block MoE, and the multimodal RoPE's
# sections in its rope parameters.
QWEN3_5_MOE = Architecture("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", QWEN3_5_NAMES, _COMMON | {
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "layer_types", "attention_bias",
    "shared_expert_intermediate_size", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "full_attention_interval", "mtp_num_hidden_layers",
    "mtp_use_dedicated_embeddings"})

# Qwen3.5's MoE checkpoints as published: the multimodal model, its text model under
# model.language_model and its text_config; the vision tower (model.visual) is left out on import,
# and the export writes the text model (QWEN3_5_MOE).
QWEN3_5_MOE_VL = Architecture("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", QWEN3_5_VL_NAMES, frozenset({
    "text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
    "vision_end_token_id", "tie_word_embeddings"}))

# Kimi Linear: transformers writes its config.json with the names of its attribute_map
# (num_experts_per_token, moe_renormalize, ...); Moonshot's checkpoints carry the others and
# linear_attn_config. Both are read.
KIMI_LINEAR = Architecture("KimiLinearForCausalLM", "kimi_linear", KIMI_MOE, _COMMON | {
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_head_dim",
    "attention_bias", "pretraining_tp", "moe_intermediate_size", "routed_scaling_factor", "num_experts",
    "num_local_experts", "num_experts_per_token", "num_experts_per_tok", "num_shared_experts", "n_shared_experts",
    "moe_renormalize", "norm_topk_prob", "num_expert_group", "n_group", "topk_group", "mlp_layer_types",
    "first_k_dense_replace", "layer_types", "linear_attn_config", "linear_head_dim", "linear_num_heads",
    "linear_conv_kernel_dim", "model_max_length", "mla_use_nope", "moe_router_activation_func", "use_grouped_topk",
    "moe_layer_freq", "num_nextn_predict_layers"})

# Nemotron-H (Nemotron-H, Nemotron 3): the keys transformers writes; the old spellings
# (hybrid_override_pattern, mamba_n_groups, ...) are read too. Keys that set only the
# initialisation or the inference cache ride along.
_NEMOTRON_H_INIT = frozenset({"time_step_max", "time_step_floor", "time_step_limit", "rescale_prenorm_residual",
                              "use_mamba_kernels", "mamba_ssm_cache_dtype", "num_logits_to_keep",
                              "moe_shared_expert_overlap", "mtp_layers_block_type", "mtp_hybrid_override_pattern",
                              "expand"})
NEMOTRON_H = Architecture("NemotronHForCausalLM", "nemotron_h", NEMOTRON_H_NAMES, _NEMOTRON_H_INIT | {
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "tie_word_embeddings", "attention_bias", "attention_dropout", "sliding_window", "mlp_hidden_act", "mlp_bias",
    "layers_block_type", "hybrid_override_pattern", "num_hidden_layers", "ssm_state_size", "mamba_num_heads",
    "mamba_head_dim", "mamba_hidden_act", "n_groups", "mamba_n_groups", "conv_kernel", "mamba_d_conv",
    "time_step_min", "mamba_dt_min", "use_conv_bias", "mamba_conv_bias", "chunk_size", "mamba_chunk_size",
    "mamba_proj_bias", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
    "moe_shared_expert_intermediate_size", "moe_latent_size", "num_experts_per_tok", "routed_scaling_factor",
    "n_group", "topk_group", "norm_topk_prob", "num_nextn_predict_layers", "use_bias", "layer_norm_epsilon",
    "residual_in_fp32", "hidden_dropout"})

ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (MIXTRAL, QWEN3_MOE, QWEN2_MOE, OLMOE, LLAMA,
                                                                     DEEPSEEK_V3, GLM4_MOE, GPT_OSS, QWEN3_NEXT,
                                                                     QWEN3_5_MOE, QWEN3_5_MOE_VL, KIMI_LINEAR,
                                                                     NEMOTRON_H, MINIMAX_M2, LLAMA4_TEXT, DEEPSEEK_V32,
                                                                     GLM_MOE_DSA)}


def _supported() -> str:
    return ", ".join(f"{a.name} ({a.model_type})" for a in ARCHITECTURES.values())


def fp8_block_size(hf: dict) -> int | None:
    """The weight block B of a checkpoint in DeepSeek-V3's FP8 format (``quantization_config``:
    ``quant_method: fp8``, ``fmt: e4m3``, ``weight_block_size: [B, B]``; each quantized
    ``X.weight`` float8 E4M3 with ``X.weight_scale_inv`` [⌈rows/B⌉, ⌈cols/B⌉] fp32), else None."""
    q = hf.get("quantization_config") or {}
    block = q.get("weight_block_size")
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3" or not block or len(block) != 2 \
            or block[0] != block[1] or q.get("activation_scheme", "dynamic") != "dynamic":
        return None
    return int(block[0])


def architecture_for(hf: dict) -> Architecture:
    """The architecture of a ``config.json`` dict.

    Raises:
        UnsupportedModel: an unknown ``model_type`` or a class other than the causal LM.
    """
    model_type = hf.get("model_type")
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        names = hf.get("architectures") or [model_type]
        raise UnsupportedModel(f"architecture {', '.join(map(str, names))} (model_type {model_type!r}) is not "
                               f"supported; moetrain converts {_supported()}")
    names = hf.get("architectures")
    if names is not None and list(names) != [arch.name]:
        raise UnsupportedModel(f"config.json architectures = {names!r}: moetrain converts {arch.name} only for "
                               f"model_type {model_type!r}")
    return arch


class _Reader:
    """Reads config.json keys with HF's defaults and refuses what cannot be represented."""

    def __init__(self, arch: Architecture, hf: dict):
        self.arch, self.hf = arch, hf

    def refuse(self, key: str, value: Any, why: str) -> UnsupportedModel:
        return UnsupportedModel(f"{self.arch.name}: config.json {key} = {value!r}: {why}; moetrain converts only "
                                f"what it represents exactly")

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self.hf:
            if default is _MISSING:
                raise UnsupportedModel(f"{self.arch.name}: config.json has no {key}, which moetrain needs")
            return default
        return self.hf[key]

    def expect(self, key: str, ok: Callable[[Any], bool], default: Any, why: str) -> Any:
        value = self.get(key, default)
        if not ok(value):
            raise self.refuse(key, value, why)
        return value

    def check_keys(self) -> None:
        unknown = sorted(k for k in self.hf if k not in self.arch.keys and k not in _INERT)
        if unknown:
            raise self.refuse(unknown[0], self.hf[unknown[0]],
                              f"a field moetrain's {self.arch.model_type} mapping does not know"
                              + (f" (also unknown: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""))


def _read_rope(r: _Reader) -> dict:
    """moetrain's RoPE fields from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (transformers 4); as transformers does, a ``rope_scaling`` dict wins and a
    theta inside the parameters wins over the top-level one."""
    field = "rope_scaling" if r.get("rope_scaling", None) else "rope_parameters"
    params = dict(r.get(field, None) or {})
    theta = float(params.pop("rope_theta", r.get("rope_theta", r.arch.default_theta)))
    kind = params.pop("rope_type", params.pop("type", "default"))
    partial = params.pop("partial_rotary_factor", r.get("partial_rotary_factor",
                                                         0.25 if r.arch is QWEN3_5_MOE else 1.0))
    if r.arch is QWEN3_5_MOE:
        # The multimodal RoPE's sections: text tokens carry one position for all three, which makes
        # it the 1D RoPE whatever the sections.
        params.pop("mrope_section", None)
        params.pop("mrope_interleaved", None)
    if partial != 1.0 and r.arch not in (GLM4_MOE, QWEN3_NEXT, QWEN3_5_MOE, MINIMAX_M2):
        raise r.refuse("partial_rotary_factor", partial, f"{r.arch.name} rotates whole heads in moetrain's mapping")
    out: dict[str, Any] = {"rope_theta": theta}
    if partial != 1.0:
        out["partial_rotary_factor"] = float(partial)
    if kind == "default":
        known: tuple = ()
    elif kind == "yarn":
        known = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                 "truncate")
        if "factor" not in params or "original_max_position_embeddings" not in params:
            raise r.refuse(f"{field}.factor", params.get("factor"), "YaRN needs factor and "
                           "original_max_position_embeddings")
        out.update(rope_scaling="yarn", rope_scaling_factor=float(params["factor"]),
                   rope_original_max_positions=int(params["original_max_position_embeddings"]),
                   rope_beta_fast=float(params.get("beta_fast") or 32), rope_beta_slow=float(params.get("beta_slow") or 1),
                   rope_mscale=float(params.get("mscale") or 0), rope_mscale_all_dim=float(params.get("mscale_all_dim") or 0),
                   rope_truncate=bool(params.get("truncate", True)))
    elif kind == "llama3":
        known = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in known if k not in params]
        if missing:
            raise r.refuse(f"{field}.{missing[0]}", None, "llama3 RoPE scaling needs it")
        out.update(rope_scaling="llama3", rope_scaling_factor=float(params["factor"]),
                   rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_max_positions=int(params["original_max_position_embeddings"]))
    else:
        raise r.refuse(f"{field}.rope_type", kind, "only default, llama3 and yarn RoPE are implemented")
    extra = sorted(k for k in params if k not in known)
    if extra:
        raise r.refuse(f"{field}.{extra[0]}", params[extra[0]], f"not a parameter of {kind} RoPE in moetrain")
    return out


def _moe_layer_pattern(r: _Reader, layers: int, num_experts: int) -> dict:
    """moe.every / moe.first_dense reproducing Qwen's dense/MoE pattern: block i is MoE when
    i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    step = r.get("decoder_sparse_step", 1)
    mlp_only = set(r.get("mlp_only_layers", None) or [])
    want = [num_experts > 0 and i not in mlp_only and (i + 1) % step == 0 for i in range(layers)]
    pattern = _every_first_dense(want)
    if pattern is not None:
        return pattern
    raise r.refuse("mlp_only_layers", sorted(mlp_only),
                   f"with decoder_sparse_step={step} the MoE blocks {[i for i in range(layers) if want[i]]} are not "
                   f"a pattern of moe.every / moe.first_dense")


def _every_first_dense(want: list[bool]) -> dict | None:
    """``moe.every`` / ``moe.first_dense`` giving MoE blocks exactly where ``want`` [layers] is
    True, or None when no pair does."""
    layers = len(want)
    for every in range(1, layers + 1):
        for first_dense in range(layers + 1):
            if [i >= first_dense and (i - first_dense) % every == every - 1 for i in range(layers)] == want:
                return {"every": every, "first_dense": first_dense}
    return None


def from_hf(hf: dict, mtp_depth: int = 0) -> tuple[Architecture, dict, dict]:
    """(architecture, moetrain ``model`` section, ``moe`` section) of a ``config.json`` dict.
    ``model.seq_len`` is min(max_position_embeddings, 4096): a training choice to adjust.
    ``mtp_depth``: how many of the checkpoint's multi-token-prediction layers to bring in
    (DeepSeek-V3, GLM-4.5; 0 leaves them out).

    Raises:
        UnsupportedModel: see the module docstring.
    """
    arch = architecture_for(hf)
    r = _Reader(arch, hf)
    r.check_keys()
    quant = hf.get("quantization_config")
    if quant is not None and not (arch is GPT_OSS and quant.get("quant_method") == "mxfp4") \
            and fp8_block_size(hf) is None:
        raise r.refuse("quantization_config", quant, "quantized weights are not read (GPT-OSS's MXFP4 experts and "
                       "DeepSeek-V3's FP8 E4M3 with square weight blocks are)")
    if arch is NEMOTRON_H:
        return (arch, *_read_nemotron_h(r, mtp_depth))
    if arch is QWEN3_5_MOE_VL:  # its text model, read as the text checkpoint's config
        text = {**r.get("text_config"), "model_type": QWEN3_5_MOE.model_type, "architectures": [QWEN3_5_MOE.name],
                "tie_word_embeddings": r.get("tie_word_embeddings", False)}
        return (arch, *from_hf(text, mtp_depth)[1:])
    r.expect("hidden_act", lambda v: v == "silu", "silu", "moetrain's MLPs are SwiGLU (silu)")
    r.expect("attention_dropout", lambda v: not v, 0.0, "attention dropout is not implemented")
    hidden, heads = r.get("hidden_size"), r.get("num_attention_heads")
    head_dim = r.get("head_dim", None)
    model = {"vocab_size": r.get("vocab_size"), "hidden": hidden, "layers": r.get("num_hidden_layers"),
             "heads": heads, "kv_heads": r.get("num_key_value_heads", None) or heads,
             # (Qwen3.5's MoE model has no dense MLP, nor its width: the experts' stands in)
             "ffn_hidden": r.get("intermediate_size", r.get("moe_intermediate_size") if arch is QWEN3_5_MOE else _MISSING),
             "norm_eps": float(r.get("rms_norm_eps")),
             "tie_embeddings": bool(r.get("tie_word_embeddings", False)),
             "init_std": float(r.get("initializer_range", 0.02)),
             "head_dim": None if head_dim is None or (head_dim * heads == hidden) else head_dim,
             "seq_len": min(int(r.get("max_position_embeddings", 4096)), 4096), **_read_rope(r)}
    moe: dict[str, Any] = {"aux_loss_coef": float(r.get("router_aux_loss_coef", 0.001)), "z_loss_coef": 0.0}
    no_bias = "q/k/v/o and MLP biases are not implemented (moetrain has q/k/v bias only, as Qwen2-MoE)"
    if arch is MIXTRAL:
        r.expect("sliding_window", lambda v: v is None, None, "sliding-window attention is not implemented")
        r.expect("router_jitter_noise", lambda v: not v, 0.0, "router jitter noise is not implemented")
        moe.update(num_experts=r.get("num_local_experts"), top_k=r.get("num_experts_per_tok"),
                   ffn_hidden=r.get("intermediate_size"), norm_topk_prob=True, every=1, first_dense=0)
    elif arch is MINIMAX_M2:
        # GQA with q/k RMSNorm over the whole projection, partial RoPE (its legacy rotary_dim), every
        # block MoE with sigmoid scores, a score-correction bias for the choice and the top-k
        # renormalised (transformers' MiniMaxM2TopKRouter)
        r.expect("router_jitter_noise", lambda v: not v, 0.0, "router jitter noise is not implemented")
        r.expect("use_qk_norm", lambda v: v, True, "MiniMax-M2 without its q/k norms is not a layout moetrain maps")
        r.expect("qk_norm_type", lambda v: v == "per_layer", "per_layer",
                 "only the norm over the whole projection (per_layer) is mapped")
        r.expect("scoring_func", lambda v: v == "sigmoid", "sigmoid", "MiniMax-M2's router scores with sigmoids")
        r.expect("use_routing_bias", lambda v: v, True, "MiniMax-M2's router has the score-correction bias")
        r.expect("shared_intermediate_size", lambda v: not v, 0, "MiniMax-M2 with shared experts is not mapped")
        r.expect("attn_type_list", lambda v: v is None or all(t == 1 for t in v), None,
                 "only full-attention blocks (1) are mapped")
        r.expect("sliding_window", lambda v: v is None, None, "sliding-window attention is not mapped for MiniMax-M2")
        if r.get("use_mtp", False):  # its multi-token-prediction modules: not imported
            log.info("MiniMaxM2ForCausalLM: use_mtp (%s modules) — the MTP modules are not imported",
                     r.get("num_mtp_modules", "?"))
        rotary = r.get("rotary_dim", None)
        dh = head_dim or hidden // heads
        if rotary is not None and abs(rotary / dh - model.get("partial_rotary_factor", 1.0)) > 1e-9:
            raise r.refuse("rotary_dim", rotary, f"differs from partial_rotary_factor × head_dim "
                                                 f"({model.get('partial_rotary_factor', 1.0)} × {dh})")
        if head_dim is not None:
            model["head_dim"] = head_dim
        model["qk_norm"] = "projection"
        moe.update(num_experts=r.get("num_local_experts"), top_k=r.get("num_experts_per_tok"),
                   ffn_hidden=r.get("intermediate_size"), norm_topk_prob=True, every=1, first_dense=0,
                   score_function="sigmoid", routing_bias=True)
    elif arch is LLAMA4_TEXT:
        _read_llama4(r, model, moe)
    elif arch in (QWEN3_NEXT, QWEN3_5_MOE):
        _read_qwen3_next(r, model, moe, mtp_depth)
    elif arch is KIMI_LINEAR:
        _read_kimi_linear(r, model, moe)
    elif arch in (QWEN3_MOE, QWEN2_MOE):
        r.expect("use_sliding_window", lambda v: not v, False, "sliding-window attention is not implemented")
        types = r.get("layer_types", None) or []
        if any(t != "full_attention" for t in types):
            raise r.refuse("layer_types", types, "sliding-window attention is not implemented")
        num_experts = r.get("num_experts", None)
        num_experts = r.get("num_local_experts") if num_experts is None else num_experts
        moe.update(num_experts=num_experts, top_k=r.get("num_experts_per_tok"),
                   ffn_hidden=r.get("moe_intermediate_size"), norm_topk_prob=bool(r.get("norm_topk_prob", False)),
                   **_moe_layer_pattern(r, model["layers"], num_experts))
        if arch is QWEN3_MOE:
            r.expect("attention_bias", lambda v: not v, False, no_bias)
            model["qk_norm"] = "head"
        else:
            model["qkv_bias"] = bool(r.get("qkv_bias", True))
            shared = r.expect("shared_expert_intermediate_size", lambda v: v > 0, None,
                              "Qwen2-MoE without a shared expert is not a layout moetrain maps")
            moe.update(shared_experts=1, shared_ffn_hidden=shared, shared_expert_gate=True)
    elif arch is OLMOE:
        r.expect("clip_qkv", lambda v: v is None, None, "clipping q/k/v is not implemented")
        r.expect("attention_bias", lambda v: not v, False, no_bias)
        if model["head_dim"] is not None:  # OLMoE sizes its k norm with hidden / heads
            raise r.refuse("head_dim", head_dim,
                           "OLMoE's q/k norms assume head_dim = hidden_size / num_attention_heads")
        model["qk_norm"] = "projection"
        moe.update(num_experts=r.get("num_experts"), top_k=r.get("num_experts_per_tok"),
                   ffn_hidden=r.get("intermediate_size"), norm_topk_prob=bool(r.get("norm_topk_prob", False)),
                   every=1, first_dense=0)
    elif arch in DSA_ARCHS:
        _read_deepseek_moe(r, model, moe, mtp_depth)
        _read_dsa(r, model, moe)
    elif arch in (DEEPSEEK_V3, GLM4_MOE):
        _read_deepseek_moe(r, model, moe, mtp_depth)
        if arch is DEEPSEEK_V3:
            r.expect("attention_bias", lambda v: not v, False, no_bias)
            q_lora = r.get("q_lora_rank", None)
            model.update(attention="mla", q_lora_rank=q_lora, kv_lora_rank=r.get("kv_lora_rank"),
                         qk_nope_head_dim=r.get("qk_nope_head_dim"), qk_rope_head_dim=r.get("qk_rope_head_dim"),
                         v_head_dim=r.get("v_head_dim"), kv_heads=heads, head_dim=None)
        else:
            model["qkv_bias"] = bool(r.get("attention_bias", False))
            model["qk_norm"] = "head" if r.get("use_qk_norm", False) else "none"
            if head_dim is not None:
                model["head_dim"] = head_dim
    elif arch is GPT_OSS:
        r.expect("attention_bias", lambda v: v, True, "GPT-OSS without q/k/v/o biases is not a layout moetrain maps")
        model.update(qkv_bias=True, attention_out_bias=True, attention_sinks=True)
        if head_dim is not None:
            model["head_dim"] = head_dim
        types = r.get("layer_types", None) or ["full_attention"] * model["layers"]
        window = r.get("sliding_window", None)
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        if any(t not in ("sliding_attention", "full_attention") for t in types) or (sliding and window is None):
            raise r.refuse("layer_types", types, "only sliding_attention and full_attention layers are mapped")
        if sliding:
            every = next((e for e in range(1, len(types) + 1)
                          if sliding == [i for i in range(len(types)) if i % e == 0]), None)
            if every is None:
                raise r.refuse("layer_types", types, "sliding layers must be every n-th block from block 0 "
                                                     "(model.window_every)")
            model.update(sliding_window=int(window), window_every=every)
        moe.update(num_experts=r.get("num_local_experts"), top_k=r.get("num_experts_per_tok"),
                   ffn_hidden=r.get("intermediate_size"), norm_topk_prob=True, every=1, first_dense=0,
                   router_bias=True, expert_biases=True, activation="clamped_swiglu",
                   swiglu_alpha=float(r.get("swiglu_alpha", 1.702)), swiglu_limit=float(r.get("swiglu_limit", 7.0)))
    else:  # LLAMA
        r.expect("attention_bias", lambda v: not v, False, no_bias)
        r.expect("mlp_bias", lambda v: not v, False, no_bias)
        moe = {"num_experts": 0}
    return arch, model, moe


def _read_qwen3_next(r: _Reader, model: dict, moe: dict, mtp_depth: int = 0) -> None:
    """Qwen3-Next: the blocks' token mixers from ``layer_types`` (or every
    ``full_attention_interval``-th block full attention), the gated-DeltaNet shapes, gated
    attention with per-head q/k norm, zero-centred norms, and Qwen2-MoE's gated shared expert;
    its MTP module when asked for (one: with several decoder layers the module shares its fc and
    norms between them, which moetrain's modules do not)."""
    available = int(r.get("mtp_num_hidden_layers", 0) or 0)
    if mtp_depth > available:
        raise r.refuse("mtp_num_hidden_layers", available, f"mtp_depth {mtp_depth} asks for more MTP layers")
    if mtp_depth > 1:
        raise r.refuse("mtp_num_hidden_layers", available, "its MTP layers share one fc and its norms; moetrain maps "
                                                          "one (mtp_depth 1)")
    if mtp_depth:
        r.expect("mtp_use_dedicated_embeddings", lambda v: not v, False,
                 "an MTP module with its own embedding is not mapped (moetrain's share the model's)")
    model["mtp_depth"] = mtp_depth
    r.expect("attention_bias", lambda v: not v, False, "q/k/v/o biases are not part of Qwen3-Next's mapping")
    layers = model["layers"]
    types = r.get("layer_types", None)
    if types is None:
        interval = r.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(types) != layers or any(t not in ("full_attention", "linear_attention") for t in types):
        raise r.refuse("layer_types", types, "needs one full_attention or linear_attention entry per block")
    num_experts = r.get("num_experts")
    shared = r.expect("shared_expert_intermediate_size", lambda v: v > 0, None,
                      "Qwen3-Next without a shared expert is not a layout moetrain maps")
    model.update(layer_types=list(types), linear_num_key_heads=r.get("linear_num_key_heads"),
                 linear_num_value_heads=r.get("linear_num_value_heads"),
                 linear_key_head_dim=r.get("linear_key_head_dim"), linear_value_head_dim=r.get("linear_value_head_dim"),
                 linear_conv_kernel_dim=r.get("linear_conv_kernel_dim"), attention_output_gate=True,
                 zero_centered_norm=True, qk_norm="head")
    if r.get("head_dim", None) is not None:
        model["head_dim"] = r.get("head_dim")
    moe.update(num_experts=num_experts, top_k=r.get("num_experts_per_tok"), ffn_hidden=r.get("moe_intermediate_size"),
               norm_topk_prob=bool(r.get("norm_topk_prob", True)), shared_experts=1, shared_ffn_hidden=shared,
               shared_expert_gate=True, **_moe_layer_pattern(r, layers, num_experts))  # (Qwen3.5: every block)


def _read_llama4(r: _Reader, model: dict, moe: dict) -> None:
    """Llama 4's text model (the defaults are transformers' ``Llama4TextConfig``'s): RoPE and
    NoPE blocks, chunked attention in the RoPE ones, the weightless q/k norm, temperature tuning,
    interleaved dense and MoE blocks with top-1 sigmoid routing on the expert's input and a shared
    expert."""
    layers = model["layers"]
    r.expect("attention_bias", lambda v: not v, False, "q/k/v/o biases are not part of moetrain's Llama 4 mapping")
    r.expect("router_jitter_noise", lambda v: not v, 0.0, "router jitter noise is not implemented")
    r.expect("num_experts_per_tok", lambda v: v == 1, 1, "Llama 4's routing scales the expert's input by its "
                                                         "weight, which moetrain builds for one expert per token")
    no_rope = list(r.get("no_rope_layers", None) or [])
    if not no_rope:  # transformers' default: every no_rope_layer_interval-th block NoPE
        interval = r.get("no_rope_layer_interval", 4)
        no_rope = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(no_rope) != layers or any(v not in (0, 1) for v in no_rope):
        raise r.refuse("no_rope_layers", no_rope, "needs one 0 (NoPE) or 1 (RoPE) per block")
    chunk = r.get("attention_chunk_size", 8192)
    derived = ["chunked_attention" if v and chunk is not None else "full_attention" for v in no_rope]
    types = r.get("layer_types", None)
    if types is not None and list(types) != derived:
        raise r.refuse("layer_types", types, f"moetrain maps chunked attention in the RoPE blocks and full attention "
                                             f"in the NoPE ones ({derived})")
    steps = r.get("interleave_moe_layer_step", 1)
    moe_layers = r.get("moe_layers", None)
    moe_layers = list(range(steps - 1, layers, steps)) if moe_layers is None else list(moe_layers)
    pattern = _every_first_dense([i in moe_layers for i in range(layers)])
    if pattern is None or not moe_layers:
        raise r.refuse("moe_layers", moe_layers, "the MoE blocks are not a pattern of moe.every / moe.first_dense")
    if head_dim := r.get("head_dim", None):
        model["head_dim"] = head_dim
    model.update(ffn_hidden=r.get("intermediate_size_mlp", 16384), no_rope_layers=no_rope,
                 attention_chunk_size=None if chunk is None else int(chunk),
                 qk_norm="l2" if r.get("use_qk_norm", True) else "none",
                 # (no NoPE block: the tuning has nothing to scale)
                 attn_temperature_tuning=bool(r.get("attn_temperature_tuning", True)) and not all(no_rope),
                 floor_scale=int(r.get("floor_scale", 8192)), attn_scale=float(r.get("attn_scale", 0.1)))
    moe.update(num_experts=r.get("num_local_experts", 16), top_k=1, ffn_hidden=r.get("intermediate_size", 8192),
               shared_experts=1, score_function="sigmoid", norm_topk_prob=False, apply_probs_on_input=True,
               **pattern)


def _first(r: _Reader, keys: tuple[str, ...], default: Any) -> Any:
    """The value of the first of ``keys`` that config.json has (a field and its alias), else
    ``default``."""
    return next((r.hf[k] for k in keys if k in r.hf), default)


def _read_kimi_linear(r: _Reader, model: dict, moe: dict) -> None:
    """Kimi Linear: KDA and MLA-without-RoPE blocks, DeepSeek-V3's MoE (the defaults are
    transformers' ``KimiLinearConfig``'s)."""
    r.expect("attention_bias", lambda v: not v, False, "q/k/v/o biases are not part of Kimi Linear's mapping")
    r.expect("mla_use_nope", lambda v: v, True, "moetrain maps Kimi Linear's MLA without RoPE")
    r.expect("moe_router_activation_func", lambda v: v == "sigmoid", "sigmoid", "only sigmoid routing is mapped")
    r.expect("moe_layer_freq", lambda v: v == 1, 1, "every block after the dense ones is MoE in moetrain's mapping")
    r.expect("num_nextn_predict_layers", lambda v: not v, 0, "Kimi Linear's MTP layers are not mapped")
    layers = model["layers"]
    lac = dict(r.get("linear_attn_config", None) or {})
    extra = sorted(set(lac) - {"head_dim", "num_heads", "short_conv_kernel_size", "full_attn_layers", "kda_layers"})
    if extra:
        raise r.refuse(f"linear_attn_config.{extra[0]}", lac[extra[0]], "a field moetrain's kimi_linear mapping does "
                                                                         "not know")
    types = r.get("layer_types", None)
    if types is None and "full_attn_layers" in lac and "kda_layers" in lac:
        types = [None] * layers  # 1-indexed in the checkpoint
        for i in lac["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in lac["kda_layers"]:
            types[i - 1] = "linear_attention"
    elif types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    if len(types) != layers or any(t not in ("full_attention", "linear_attention") for t in types):
        raise r.refuse("layer_types", types, "needs one full_attention or linear_attention (KDA) entry per block")
    heads = lac.get("num_heads", r.get("linear_num_heads", 32))
    head_dim = lac.get("head_dim", r.get("linear_head_dim", 128))
    model.update(layer_types=["kda" if t == "linear_attention" else t for t in types], linear_num_key_heads=heads,
                 linear_num_value_heads=heads, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                 linear_conv_kernel_dim=lac.get("short_conv_kernel_size", r.get("linear_conv_kernel_dim", 4)),
                 rope=False, attention="mla", q_lora_rank=r.get("q_lora_rank", None),
                 kv_lora_rank=r.get("kv_lora_rank", 512), qk_nope_head_dim=r.get("qk_nope_head_dim", 128),
                 qk_rope_head_dim=r.get("qk_rope_head_dim", 64), v_head_dim=r.get("v_head_dim", 128),
                 kv_heads=model["heads"], head_dim=None)
    mlp = r.get("mlp_layer_types", None)
    if mlp is None:
        dense = int(r.get("first_k_dense_replace", 1))
        mlp = ["dense" if i < dense else "sparse" for i in range(layers)]
    first_dense = mlp.count("dense")
    if len(mlp) != layers or mlp != ["dense"] * first_dense + ["sparse"] * (layers - first_dense):
        raise r.refuse("mlp_layer_types", mlp, "only dense first blocks, then MoE blocks (moe.first_dense) are mapped")
    n_group = _first(r, ("num_expert_group", "n_group"), 1)
    grouped = n_group is not None and n_group > 1
    moe.update(num_experts=_first(r, ("num_experts", "num_local_experts"), 256),
               top_k=_first(r, ("num_experts_per_token", "num_experts_per_tok"), 8),
               ffn_hidden=r.get("moe_intermediate_size", 1024),
               shared_experts=int(_first(r, ("num_shared_experts", "n_shared_experts"), 1) or 0),
               first_dense=first_dense, every=1, score_function="sigmoid", routing_bias=True,
               norm_topk_prob=bool(_first(r, ("moe_renormalize", "norm_topk_prob"), True)),
               routed_scaling_factor=float(r.get("routed_scaling_factor", 2.446)),
               n_group=n_group if grouped else None, topk_group=r.get("topk_group", 1) if grouped else None)


_NEMOTRON_SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
                     "moe": "E"}


def _read_nemotron_h(r: _Reader, mtp_depth: int) -> tuple[dict, dict]:
    """Nemotron-H: single-sublayer blocks (``layers_block_type`` or ``hybrid_override_pattern``
    → ``model.hybrid_override_pattern``), Mamba-2 with its shape, attention without RoPE, squared-ReLU
    MLPs and experts, DeepSeek-V3's routing (sigmoid scores, score-correction bias, groups, routed
    scaling), one shared expert of its own width. Latent MoE projections, biases, fp32 residuals
    and its MTP layers are refused."""
    types = r.get("layers_block_type", None)
    if types is not None:
        bad = [t for t in types if t not in _NEMOTRON_SYMBOLS]
        if bad:
            raise r.refuse("layers_block_type", types, f"{bad[0]!r} is not a block moetrain maps")
        pattern = "".join(_NEMOTRON_SYMBOLS[t] for t in types)
    else:
        pattern = r.get("hybrid_override_pattern")
    if mtp_depth:
        raise r.refuse("num_nextn_predict_layers", r.get("num_nextn_predict_layers", 0),
                       "Nemotron's MTP layers (a pattern of their own) are not mapped")
    for key, want, why in (("mlp_hidden_act", "relu2", "its MLPs are squared ReLU"),
                           ("mamba_hidden_act", "silu", "its Mamba-2 convolution is followed by SiLU")):
        r.expect(key, lambda v, want=want: v == want, want, why)
    for key in ("attention_bias", "mlp_bias", "mamba_proj_bias", "use_bias", "residual_in_fp32"):
        r.expect(key, lambda v: not v, False, "not part of moetrain's Nemotron-H mapping")
    r.expect("moe_latent_size", lambda v: v is None, None, "latent MoE projections (Nemotron 3 Super) are not built")
    r.expect("sliding_window", lambda v: v is None, None, "sliding-window attention is not part of Nemotron-H")
    for key in ("attention_dropout", "hidden_dropout"):
        r.expect(key, lambda v: not v, 0.0, "dropout is not implemented")
    heads = r.get("num_attention_heads", 32)
    model = {"vocab_size": r.get("vocab_size"), "hidden": r.get("hidden_size"), "layers": len(pattern),
             "hybrid_override_pattern": pattern, "heads": heads, "kv_heads": r.get("num_key_value_heads", 8),
             "head_dim": r.get("head_dim", 128), "ffn_hidden": r.get("intermediate_size", 21504),
             "norm_eps": float(r.get("layer_norm_epsilon", 1e-5)),
             "tie_embeddings": bool(r.get("tie_word_embeddings", False)),
             "init_std": float(r.get("initializer_range", 0.02)),
             "seq_len": min(int(r.get("max_position_embeddings", 4096)), 4096), "rope": False,
             "mlp_activation": "relu2", "mamba_num_heads": r.get("mamba_num_heads", 128),
             "mamba_head_dim": r.get("mamba_head_dim", 64), "ssm_state_size": r.get("ssm_state_size", 128),
             "n_groups": _first(r, ("n_groups", "mamba_n_groups"), 8),
             "conv_kernel": _first(r, ("conv_kernel", "mamba_d_conv"), 4),
             "use_conv_bias": bool(_first(r, ("use_conv_bias", "mamba_conv_bias"), True)),
             "time_step_min": float(_first(r, ("time_step_min", "mamba_dt_min"), 0.001)),
             "mamba_chunk_size": _first(r, ("chunk_size", "mamba_chunk_size"), 128)}
    moe: dict[str, Any] = {"num_experts": 0, "z_loss_coef": 0.0}
    if "E" in pattern:
        n_group = r.get("n_group", 1)
        grouped = n_group is not None and n_group > 1
        shared = int(r.get("n_shared_experts", 1) or 0)
        moe = {"num_experts": r.get("n_routed_experts", 8), "top_k": r.get("num_experts_per_tok", 2),
               "ffn_hidden": r.get("moe_intermediate_size", 7688), "activation": "relu2",
               "shared_experts": shared, "shared_ffn_hidden": r.get("moe_shared_expert_intermediate_size", 7688)
               if shared else None, "score_function": "sigmoid", "routing_bias": True,
               "norm_topk_prob": bool(r.get("norm_topk_prob", True)),
               "routed_scaling_factor": float(r.get("routed_scaling_factor", 1.0)),
               "n_group": n_group if grouped else None, "topk_group": r.get("topk_group", 1) if grouped else None,
               "aux_loss_coef": float(r.get("router_aux_loss_coef", 0.001)), "z_loss_coef": 0.0}
    return model, moe


def _read_dsa(r: _Reader, model: dict, moe: dict) -> None:
    """DeepSeek-V3.2 / GLM-5: DeepSeek-V3's MLA blocks with the lightning indexer of DeepSeek
    Sparse Attention (``model.dsa``, stage ``sparse``: the released models are past the dense
    warm-up); the dense blocks from ``mlp_layer_types`` (first ones only)."""
    r.expect("attention_bias", lambda v: not v, False, "q/k/v/o biases are not part of MLA in moetrain")
    r.expect("mlp_bias", lambda v: not v, False, "MLP biases are not implemented")
    layers = model["layers"]
    types = r.get("layer_types", None)
    if types is not None and any(t != "indexed_attention" for t in types):
        raise r.refuse("layer_types", types, "every block is DSA (indexed_attention) in moetrain's mapping")
    indexers = r.get("indexer_types", None)
    if indexers is not None and any(t != "full" for t in indexers):
        raise r.refuse("indexer_types", indexers, "a block that reuses another's top-k (shared) is not built: "
                                                  "every block has its own indexer (full)")
    mlp = r.get("mlp_layer_types", None)
    if mlp is not None:
        dense = mlp.count("dense")
        if len(mlp) != layers or list(mlp) != ["dense"] * dense + ["sparse"] * (layers - dense):
            raise r.refuse("mlp_layer_types", mlp, "only dense first blocks, then MoE blocks (moe.first_dense) are "
                                                   "mapped")
        moe["first_dense"] = dense
    q_lora = r.expect("q_lora_rank", lambda v: v is not None, None, "DSA's indexer reads the query latent")
    model.update(attention="mla", q_lora_rank=q_lora, kv_lora_rank=r.get("kv_lora_rank"),
                 qk_nope_head_dim=r.get("qk_nope_head_dim"), qk_rope_head_dim=r.get("qk_rope_head_dim"),
                 v_head_dim=r.get("v_head_dim"), kv_heads=model["heads"], head_dim=None,
                 dsa={"index_topk": int(r.get("index_topk", 2048)), "index_head_dim": int(r.get("index_head_dim", 128)),
                      "index_heads": int(r.get("index_n_heads", 64 if r.arch is DEEPSEEK_V32 else 32)),
                      "stage": "sparse"})


def _read_deepseek_moe(r: _Reader, model: dict, moe: dict, mtp_depth: int) -> None:
    """DeepSeek-V3's (and GLM-4.5's) MoE: sigmoid scores with the score-correction bias,
    group-limited top-k, routed scaling, shared experts of n_shared_experts × the routed width,
    the first first_k_dense_replace blocks dense; MTP modules when asked for."""
    r.expect("topk_method", lambda v: v in ("noaux_tc", None), None, "only DeepSeek-V3's noaux_tc routing is mapped")
    r.expect("scoring_func", lambda v: v in ("sigmoid", None), None, "only sigmoid scores are mapped")
    r.expect("moe_layer_freq", lambda v: v == 1, 1, "every block after the dense ones is MoE in moetrain's mapping")
    available = int(r.get("num_nextn_predict_layers", 0) or 0)
    if mtp_depth > available:
        raise r.refuse("num_nextn_predict_layers", available, f"mtp_depth {mtp_depth} asks for more MTP layers")
    n_group, topk_group = r.get("n_group", None), r.get("topk_group", None)
    grouped = n_group is not None and n_group > 1
    moe.update(num_experts=r.get("n_routed_experts"), top_k=r.get("num_experts_per_tok"),
               ffn_hidden=r.get("moe_intermediate_size"), shared_experts=int(r.get("n_shared_experts", 0) or 0),
               first_dense=int(r.get("first_k_dense_replace", 0) or 0), every=1, score_function="sigmoid",
               routing_bias=True, norm_topk_prob=bool(r.get("norm_topk_prob", True)),
               routed_scaling_factor=float(r.get("routed_scaling_factor", 1.0)),
               n_group=n_group if grouped else None, topk_group=topk_group if grouped else None)
    model["mtp_depth"] = mtp_depth


def choose_architecture(cfg: Config) -> Architecture:
    """The architecture a moetrain model exports to when none is asked for: single-sublayer blocks
    (``model.hybrid_override_pattern``) → Nemotron-H; DSA (``model.dsa``) → DeepSeek-V3.2;
    Llama 4's options (NoPE blocks, attention
    chunks, the l2 q/k norm, temperature tuning, probabilities on the expert's input) → Llama 4;
    KDA → Kimi Linear;
    gated DeltaNet, gated attention or zero-centred norms → Qwen3-Next; MLA → DeepSeek-V3;
    sinks or expert biases → GPT-OSS; a routing bias, fixed expert groups or partial rotary →
    GLM-4.5; dense → Llama;
    per-head q/k norm → Qwen3-MoE; projection q/k norm → OLMoE; gated shared experts or q/k/v bias
    → Qwen2-MoE; otherwise Mixtral."""
    m, moe = cfg.model, cfg.moe
    if m.hybrid_override_pattern:
        return NEMOTRON_H
    if m.dsa.enabled:
        return DEEPSEEK_V32
    if (m.no_rope_layers or m.attention_chunk_size is not None or m.qk_norm == "l2" or m.attn_temperature_tuning
            or moe.apply_probs_on_input):
        return LLAMA4_TEXT
    if m.kda:
        return KIMI_LINEAR
    if m.linear_attention or m.attention_output_gate or m.zero_centered_norm:
        return QWEN3_NEXT
    if m.attention == "mla":
        return DEEPSEEK_V3
    if m.attention_sinks or moe.expert_biases:
        return GPT_OSS
    if moe.routing_bias and m.qk_norm == "projection" and moe.n_group is None and not moe.shared_experts:
        return MINIMAX_M2
    if moe.routing_bias or moe.n_group is not None or m.partial_rotary_factor != 1.0:
        return GLM4_MOE
    if moe.num_experts == 0:
        return LLAMA
    if m.qk_norm == "head":
        return QWEN3_MOE
    if m.qk_norm == "projection":
        return OLMOE
    if moe.shared_expert_gate or m.qkv_bias:
        return QWEN2_MOE
    return MIXTRAL


def _refuse_ours(arch: Architecture, field: str, value: Any, why: str) -> UnsupportedModel:
    return UnsupportedModel(f"{field} = {value!r}: {arch.name} {why}. Fix: export to another architecture "
                            f"(--arch) or train without it")


def _needs(arch: Architecture) -> Callable[[str, Any, bool, str], None]:
    """``need(field, value, ok, why)``: refuses moetrain field ``field`` = ``value`` for ``arch``
    (:func:`_refuse_ours`) unless ``ok``."""
    def need(field: str, value: Any, ok: bool, why: str) -> None:
        if not ok:
            raise _refuse_ours(arch, field, value, why)
    return need


def to_hf(cfg: Config, arch: Architecture, base: dict | None = None, dtype: str = "float32",
          eos_token_id: int | None = None) -> dict:
    """The ``config.json`` of moetrain model ``cfg`` as ``arch``. ``base``: the config.json the
    weights were imported from; its other keys (token ids, max_position_embeddings, ...) are kept
    when it is the same architecture. ``dtype``: the weights' dtype name ("float32", "bfloat16").

    Raises:
        UnsupportedModel: ``cfg`` has something ``arch`` cannot hold (naming the moetrain field).
    """
    m, moe = cfg.model, cfg.moe
    out = dict(base) if base and base.get("model_type") == arch.model_type else {}

    need = _needs(arch)

    if arch is NEMOTRON_H:
        return _nemotron_h_to_hf(cfg, out, dtype, eos_token_id)
    if arch is LLAMA4_TEXT:
        return _llama4_to_hf(cfg, out, dtype, eos_token_id)
    for field, value, default in (("model.no_rope_layers", list(m.no_rope_layers), []),
                                  ("model.attention_chunk_size", m.attention_chunk_size, None),
                                  ("model.attn_temperature_tuning", m.attn_temperature_tuning, False),
                                  ("moe.apply_probs_on_input", moe.apply_probs_on_input, False)):
        need(field, value, value == default, "is Llama 4's (export with --arch llama4_text)")
    if arch is QWEN3_5_MOE_VL:
        raise UnsupportedModel(f"{arch.name}: moetrain trains and exports its text model only (the vision tower is "
                               f"not imported). Fix: export with --arch {QWEN3_5_MOE.model_type}")
    need("model.hybrid_override_pattern", m.hybrid_override_pattern, not m.hybrid_override_pattern,
         "has a token mixer and an MLP in every block (single-sublayer blocks are Nemotron-H's)")
    need("model.mlp_activation", m.mlp_activation, m.mlp_activation == "swiglu", "has SwiGLU MLPs")
    need("moe.activation", moe.activation, moe.activation != "relu2", "has gated experts")
    dsa = arch in DSA_ARCHS
    deepseek_like, gpt_oss, next_ = (arch in (DEEPSEEK_V3, GLM4_MOE, KIMI_LINEAR, *DSA_ARCHS), arch is GPT_OSS,
                                     arch in (QWEN3_NEXT, QWEN3_5_MOE))
    kimi = arch is KIMI_LINEAR
    gdn = "linear_attention" in m.layer_types
    need("model.layer_types", list(m.layer_types), not gdn or next_, "has no gated-DeltaNet layers")
    need("model.layer_types", list(m.layer_types), not m.kda or kimi, "has no Kimi Delta Attention layers")
    need("model.layer_types", list(m.layer_types), not m.mamba,
         "has no Mamba-2 layers (Nemotron-H has them, in blocks of one sublayer each: "
         "model.hybrid_override_pattern)")
    need("model.dsa.index_topk", m.dsa.index_topk, m.dsa.enabled == dsa,
         "has DeepSeek Sparse Attention's indexer" if dsa else "has no sparse-attention indexer (DeepSeek-V3.2 and "
                                                              "GLM-5 have: --arch deepseek_v32)")
    need("model.rope", m.rope, m.rope != kimi, "has no positional encoding in its MLA layers" if kimi
         else "rotates its queries and keys (RoPE)")
    need("model.attention_output_gate", m.attention_output_gate, m.attention_output_gate == next_,
         "gates its attention output" if next_ else "has no attention output gate")
    need("model.zero_centered_norm", m.zero_centered_norm, m.zero_centered_norm == next_,
         "scales its norms by 1 + weight" if next_ else "scales its norms by their weight")
    mla_arch = arch in (DEEPSEEK_V3, KIMI_LINEAR, *DSA_ARCHS)
    need("model.attention", m.attention, (m.attention == "mla") == mla_arch,
         "has multi-head latent attention" if mla_arch
         else "has grouped-query attention, not MLA")
    need("model.qkv_bias", m.qkv_bias, m.qkv_bias if gpt_oss else not m.qkv_bias or arch in (QWEN2_MOE, GLM4_MOE),
         "has q/k/v biases" if gpt_oss else "has no q/k/v biases")
    need("model.attention_out_bias", m.attention_out_bias, m.attention_out_bias == gpt_oss,
         "has an output-projection bias" if gpt_oss else "has no output-projection bias")
    need("model.attention_sinks", m.attention_sinks, m.attention_sinks == gpt_oss,
         "has attention sinks" if gpt_oss else "has no attention sinks")
    need("model.sliding_window", m.sliding_window, m.sliding_window is None or gpt_oss, "has no sliding window")
    need("model.partial_rotary_factor", m.partial_rotary_factor,
         m.partial_rotary_factor == 1.0 or arch in (GLM4_MOE, QWEN3_NEXT, QWEN3_5_MOE, MINIMAX_M2),
         "rotates whole heads")
    need("model.mtp_depth", m.mtp_depth, m.mtp_depth == 0 or deepseek_like and not kimi or next_ and m.mtp_depth == 1,
         "maps one MTP module (its layers share one fc and norms)" if next_ else
         "has no multi-token prediction (leave it out: export with model.mtp_depth=0 in the config)")
    need("moe.router_bias", moe.router_bias, moe.router_bias == gpt_oss and moe.expert_biases == gpt_oss,
         "has router and expert biases" if gpt_oss else "has no router or expert biases")
    need("moe.activation", moe.activation, (moe.activation == "clamped_swiglu") == gpt_oss,
         "has the clamped SwiGLU" if gpt_oss else "has SwiGLU experts")
    routing_bias = moe.routing_bias or moe.bias_update_rate > 0
    minimax = arch is MINIMAX_M2
    biased = deepseek_like or minimax
    need("moe.routing_bias", routing_bias, routing_bias == biased or not moe.num_experts,
         "routes with a score-correction bias (sigmoid scores)" if biased else
         "has no score-correction bias (export a model trained without moe.bias_update_rate / routing_bias)")
    need("moe.n_group", moe.n_group, moe.n_group is None or deepseek_like, "has no group-limited routing")
    if minimax:
        need("moe.score_function", moe.score_function, moe.score_function == "sigmoid", "scores with sigmoids")
        need("moe.norm_topk_prob", moe.norm_topk_prob, moe.norm_topk_prob, "renormalises the top-k scores")
        need("moe.routed_scaling_factor", moe.routed_scaling_factor, moe.routed_scaling_factor == 1.0,
             "does not scale the routed output")
    elif deepseek_like:
        need("moe.score_function", moe.score_function, moe.score_function == "sigmoid", "scores with sigmoids")
        need("moe.every", moe.every, moe.every == 1, "has an MoE in every block after the dense ones")
        need("moe.shared_expert_gate", moe.shared_expert_gate, not moe.shared_expert_gate, "has ungated shared experts")
        need("moe.shared_ffn_hidden", moe.shared_ffn_hidden, moe.shared_ffn_hidden is None,
             "sizes its shared experts as n_shared_experts × moe_intermediate_size")
    elif moe.num_experts:
        need("moe.score_function", moe.score_function, moe.score_function == "softmax", "scores with a softmax")
        need("moe.routed_scaling_factor", moe.routed_scaling_factor, moe.routed_scaling_factor == 1.0,
             "does not scale the routed output")
    qk = {QWEN3_MOE: "head", OLMOE: "projection", QWEN3_NEXT: "head", QWEN3_5_MOE: "head",
          MINIMAX_M2: "projection"}.get(arch, "none")
    if arch is GLM4_MOE:
        need("model.qk_norm", m.qk_norm, m.qk_norm in ("none", "head"), "has q/k norm 'head' or none")
    else:
        need("model.qk_norm", m.qk_norm, m.qk_norm == qk, f"has q/k norm {qk!r}")
    if arch is LLAMA:
        need("moe.num_experts", moe.num_experts, moe.num_experts == 0, "is dense")
    else:
        need("moe.num_experts", moe.num_experts, moe.num_experts > 0, "is a mixture of experts")
        if arch in (QWEN2_MOE, QWEN3_NEXT, QWEN3_5_MOE):
            need("moe.shared_experts", moe.shared_experts, moe.shared_experts > 0 and moe.shared_expert_gate,
                 "has one shared expert with a sigmoid gate (set moe.shared_expert_gate)")
        elif not deepseek_like:
            need("moe.shared_experts", moe.shared_experts, moe.shared_experts == 0, "has no shared experts")
        if arch in (MIXTRAL, OLMOE, GPT_OSS, QWEN3_5_MOE, MINIMAX_M2):
            dense = [i for i in range(m.layers) if not moe.is_moe_layer(i)]
            need("moe.every", moe.every, not dense, f"has an MoE in every block (blocks {dense} are dense)")
        if arch in (MIXTRAL, GPT_OSS):
            need("moe.norm_topk_prob", moe.norm_topk_prob, moe.norm_topk_prob,
                 "renormalises the top-k probabilities")
    if arch is OLMOE:
        need("model.head_dim", m.head_dim, m.head_dim in (None, m.hidden // m.heads), "assumes hidden / heads")

    out.update(architectures=[arch.name], model_type=arch.model_type, vocab_size=m.vocab_size, hidden_size=m.hidden,
               num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
               intermediate_size=m.ffn_hidden, rms_norm_eps=m.norm_eps, hidden_act="silu",
               attention_dropout=0.0, tie_word_embeddings=m.tie_embeddings, initializer_range=m.init_std,
               rope_theta=m.rope_theta, torch_dtype=dtype)
    out.pop("rope_parameters", None)  # written the transformers-4 way below, which 5 reads too
    out.pop("dtype", None)
    out.pop("partial_rotary_factor", None)
    if m.rope_scaling == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3", "factor": m.rope_scaling_factor, "low_freq_factor": m.rope_low_freq_factor,
            "high_freq_factor": m.rope_high_freq_factor,
            "original_max_position_embeddings": m.rope_original_max_positions}
    elif m.rope_scaling == "yarn":
        out["rope_scaling"] = {
            "rope_type": "yarn", "factor": m.rope_scaling_factor, "beta_fast": m.rope_beta_fast,
            "beta_slow": m.rope_beta_slow, "original_max_position_embeddings": m.rope_original_max_positions,
            "truncate": m.rope_truncate, **({"mscale": m.rope_mscale, "mscale_all_dim": m.rope_mscale_all_dim}
                                             if m.rope_mscale and m.rope_mscale_all_dim else {})}
    else:
        out["rope_scaling"] = None
    if m.partial_rotary_factor != 1.0:
        out["rope_scaling"] = {**(out["rope_scaling"] or {"rope_type": "default"}),
                               "partial_rotary_factor": m.partial_rotary_factor}
    out.setdefault("max_position_embeddings", m.seq_len)
    if eos_token_id is not None and "eos_token_id" not in out:
        out["eos_token_id"] = eos_token_id
    if m.head_dim is not None or "head_dim" in out:
        out["head_dim"] = m.resolved_head_dim
    if moe.num_experts:
        out.update(num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coef)
    if arch is MIXTRAL:
        out.update(num_local_experts=moe.num_experts, intermediate_size=moe.ffn_hidden, sliding_window=None,
                   router_jitter_noise=0.0)
    elif minimax:
        out.update(num_local_experts=moe.num_experts, intermediate_size=moe.ffn_hidden, router_jitter_noise=0.0)
        out.pop("rotary_dim", None)  # the partial rotary is rope_scaling's partial_rotary_factor (above)
    elif arch is OLMOE:
        out.update(num_experts=moe.num_experts, intermediate_size=moe.ffn_hidden, norm_topk_prob=moe.norm_topk_prob,
                   clip_qkv=None, attention_bias=False)
    elif arch in (QWEN3_MOE, QWEN2_MOE, QWEN3_NEXT, QWEN3_5_MOE):
        out.pop("num_local_experts", None)
        out.update(num_experts=moe.num_experts, moe_intermediate_size=moe.ffn_hidden,
                   norm_topk_prob=moe.norm_topk_prob)
        if next_:
            out.update(layer_types=[m.layer_type(i) for i in range(m.layers)], head_dim=m.resolved_head_dim,
                       linear_num_key_heads=m.linear_num_key_heads, linear_num_value_heads=m.linear_num_value_heads,
                       linear_key_head_dim=m.linear_key_head_dim, linear_value_head_dim=m.linear_value_head_dim,
                       linear_conv_kernel_dim=m.linear_conv_kernel_dim, attention_bias=False,
                       shared_expert_intermediate_size=moe.shared_hidden)
            out.pop("full_attention_interval", None)
            out["mtp_num_hidden_layers"] = m.mtp_depth
            out.setdefault("mtp_use_dedicated_embeddings", False)
        else:
            out["use_sliding_window"] = False
            out.pop("layer_types", None)
        if arch is QWEN3_5_MOE:  # every block MoE, the partial rotary a key of its own
            need("model.rope_scaling", m.rope_scaling, m.rope_scaling == "none", "has the default RoPE")
            for key in ("rope_scaling", "rope_theta", "intermediate_size", "decoder_sparse_step", "mlp_only_layers"):
                out.pop(key, None)
            out.update(rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta,
                                        "partial_rotary_factor": m.partial_rotary_factor})
            return out
        # Keep the base's dense/MoE keys when they give the same blocks; else spell the dense ones out.
        out.setdefault("decoder_sparse_step", 1)
        out.setdefault("mlp_only_layers", [])
        if _moe_blocks(out, m.layers) != {i for i in range(m.layers) if moe.is_moe_layer(i)}:
            out.update(decoder_sparse_step=1, mlp_only_layers=[i for i in range(m.layers) if not moe.is_moe_layer(i)])
        if arch is QWEN3_MOE:
            out["attention_bias"] = False
        elif arch is QWEN2_MOE:
            out.update(qkv_bias=m.qkv_bias, shared_expert_intermediate_size=moe.shared_hidden)
    elif kimi:
        for k in ("rope_theta", "rope_scaling", "linear_attn_config", "first_k_dense_replace", "num_local_experts",
                  "num_experts_per_tok", "n_shared_experts", "norm_topk_prob", "n_group", "head_dim", "qk_head_dim"):
            out.pop(k, None)  # the names transformers writes instead, below
        out.update(attention_bias=False, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                   qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                   v_head_dim=m.v_head_dim, num_key_value_heads=m.heads,
                   layer_types=["linear_attention" if m.layer_type(i) == "kda" else "full_attention"
                                for i in range(m.layers)],
                   mlp_layer_types=["sparse" if moe.is_moe_layer(i) else "dense" for i in range(m.layers)],
                   linear_num_heads=m.linear_num_key_heads, linear_head_dim=m.linear_key_head_dim,
                   linear_conv_kernel_dim=m.linear_conv_kernel_dim, num_experts=moe.num_experts,
                   num_experts_per_token=moe.top_k, moe_intermediate_size=moe.ffn_hidden,
                   num_shared_experts=moe.shared_experts, routed_scaling_factor=moe.routed_scaling_factor,
                   moe_renormalize=moe.norm_topk_prob, num_expert_group=moe.n_group or 1, topk_group=moe.topk_group or 1)
    elif deepseek_like:
        for k in ("num_local_experts", "num_experts"):
            out.pop(k, None)
        out.update(n_routed_experts=moe.num_experts, moe_intermediate_size=moe.ffn_hidden,
                   n_shared_experts=moe.shared_experts, first_k_dense_replace=moe.first_dense,
                   routed_scaling_factor=moe.routed_scaling_factor, norm_topk_prob=moe.norm_topk_prob,
                   n_group=moe.n_group or 1, topk_group=moe.topk_group or 1, num_nextn_predict_layers=m.mtp_depth)
        if dsa:
            out.update(attention_bias=False, mlp_bias=False, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                       qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                       v_head_dim=m.v_head_dim, num_key_value_heads=m.heads, index_topk=m.dsa.index_topk,
                       index_head_dim=m.dsa.index_head_dim, index_n_heads=m.dsa.index_heads,
                       layer_types=["indexed_attention"] * m.layers,
                       mlp_layer_types=["sparse" if moe.is_moe_layer(i) else "dense" for i in range(m.layers)])
            out.pop("num_nextn_predict_layers", None)  # (refused beside DSA: no MTP)
            for key in ("head_dim", "qk_head_dim", "rope_interleave"):
                out.pop(key, None)
            if arch is GLM_MOE_DSA:
                out["indexer_types"] = ["full"] * m.layers
        elif arch is DEEPSEEK_V3:
            out.update(attention_bias=False, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                       qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                       v_head_dim=m.v_head_dim, num_key_value_heads=m.heads)
            out.setdefault("rope_interleave", True)
            out.pop("head_dim", None)
            out.pop("qk_head_dim", None)
        else:
            out.update(attention_bias=m.qkv_bias, use_qk_norm=m.qk_norm == "head", head_dim=m.resolved_head_dim)
    elif gpt_oss:
        out.update(num_local_experts=moe.num_experts, intermediate_size=moe.ffn_hidden, attention_bias=True,
                   head_dim=m.resolved_head_dim, swiglu_alpha=moe.swiglu_alpha, swiglu_limit=moe.swiglu_limit,
                   sliding_window=m.sliding_window,
                   layer_types=["sliding_attention" if m.window_of(i) is not None else "full_attention"
                                for i in range(m.layers)])
        out.pop("quantization_config", None)  # export writes bf16 / fp32 experts
    else:
        out.update(attention_bias=False, mlp_bias=False)
    out.pop("quantization_config", None)  # export writes bf16 / fp32 weights (an FP8 import's dequantized)
    return out


def _llama4_to_hf(cfg: Config, out: dict, dtype: str, eos_token_id: int | None) -> dict:
    """:func:`to_hf` for Llama 4's text model (``out``: the base config.json's keys when it was one)."""
    m, moe = cfg.model, cfg.moe

    need = _needs(LLAMA4_TEXT)

    need("model.attention", m.attention, m.attention == "gqa", "has grouped-query attention, not MLA")
    need("model.qk_norm", m.qk_norm, m.qk_norm in ("l2", "none"), "has the weightless q/k norm (l2) or none")
    for kind, what in (("mamba", "Mamba-2"), ("kda", "Kimi Delta Attention"), ("linear_attention", "gated-DeltaNet")):
        need("model.layer_types", list(m.layer_types), kind not in m.layer_types, f"has no {what} layers")
    for field, value, default in (("hybrid_override_pattern", m.hybrid_override_pattern, ""),
                                  ("layer_types", list(m.layer_types), []),
                                  ("mlp_activation", m.mlp_activation, "swiglu"), ("qkv_bias", m.qkv_bias, False),
                                  ("attention_out_bias", m.attention_out_bias, False),
                                  ("attention_sinks", m.attention_sinks, False),
                                  ("sliding_window", m.sliding_window, None),
                                  ("attention_output_gate", m.attention_output_gate, False),
                                  ("zero_centered_norm", m.zero_centered_norm, False),
                                  ("partial_rotary_factor", m.partial_rotary_factor, 1.0), ("rope", m.rope, True),
                                  ("mtp_depth", m.mtp_depth, 0)):
        need(f"model.{field}", value, value == default, f"needs {default!r} (Llama 4's blocks have no other)")
    need("moe.num_experts", moe.num_experts, moe.num_experts > 0, "is a mixture of experts")
    for field, value, default in (("apply_probs_on_input", moe.apply_probs_on_input, True), ("top_k", moe.top_k, 1),
                                  ("score_function", moe.score_function, "sigmoid"),
                                  ("norm_topk_prob", moe.norm_topk_prob, False),
                                  ("routed_scaling_factor", moe.routed_scaling_factor, 1.0),
                                  ("shared_experts", moe.shared_experts, 1),
                                  ("shared_expert_gate", moe.shared_expert_gate, False),
                                  ("routing_bias", moe.routing_bias or moe.bias_update_rate > 0, False),
                                  ("n_group", moe.n_group, None), ("router_bias", moe.router_bias, False),
                                  ("expert_biases", moe.expert_biases, False), ("activation", moe.activation, "swiglu")):
        need(f"moe.{field}", value, value == default, f"needs {default!r} (it routes each token to one expert by "
                                                       f"a sigmoid, on the expert's input, beside one ungated shared "
                                                       f"expert; SwiGLU experts)")
    need("moe.shared_ffn_hidden", moe.shared_hidden, moe.shared_hidden == moe.ffn_hidden,
         "sizes its shared expert as the routed ones (intermediate_size)")
    for key in ("rope_theta", "rope_scaling", "rope_parameters", "dtype", "partial_rotary_factor"):
        out.pop(key, None)
    no_rope = list(m.no_rope_layers) or [1] * m.layers
    chunk = m.attention_chunk_size
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=m.rope_scaling_factor, low_freq_factor=m.rope_low_freq_factor,
                    high_freq_factor=m.rope_high_freq_factor,
                    original_max_position_embeddings=m.rope_original_max_positions)
    else:
        need("model.rope_scaling", m.rope_scaling, m.rope_scaling == "none", "has the default or llama3 RoPE")
    out.update(architectures=[LLAMA4_TEXT.name], model_type=LLAMA4_TEXT.model_type, vocab_size=m.vocab_size,
               hidden_size=m.hidden, num_hidden_layers=m.layers, num_attention_heads=m.heads,
               num_key_value_heads=m.kv_heads, head_dim=m.resolved_head_dim, intermediate_size=moe.ffn_hidden,
               intermediate_size_mlp=m.ffn_hidden, rms_norm_eps=m.norm_eps, hidden_act="silu", attention_dropout=0.0,
               tie_word_embeddings=m.tie_embeddings, initializer_range=m.init_std, rope_parameters=rope,
               num_local_experts=moe.num_experts, num_experts_per_tok=1,
               moe_layers=[i for i in range(m.layers) if moe.is_moe_layer(i)], router_jitter_noise=0.0,
               router_aux_loss_coef=moe.aux_loss_coef, no_rope_layers=no_rope, attention_chunk_size=chunk,
               layer_types=["chunked_attention" if v and chunk is not None else "full_attention" for v in no_rope],
               use_qk_norm=m.qk_norm == "l2", attn_temperature_tuning=m.attn_temperature_tuning,
               floor_scale=m.floor_scale, attn_scale=m.attn_scale, attention_bias=False, torch_dtype=dtype)
    out.setdefault("max_position_embeddings", m.seq_len)
    if eos_token_id is not None and "eos_token_id" not in out:
        out["eos_token_id"] = eos_token_id
    return out


def _nemotron_h_to_hf(cfg: Config, out: dict, dtype: str, eos_token_id: int | None) -> dict:
    """:func:`to_hf` for Nemotron-H (``out``: the base config.json's keys when it was one)."""
    m, moe = cfg.model, cfg.moe

    need = _needs(NEMOTRON_H)

    need("model.hybrid_override_pattern", m.hybrid_override_pattern, bool(m.hybrid_override_pattern)
         and set(m.hybrid_override_pattern) <= set("M*-E"),
         "has blocks of one sublayer each: Mamba-2 (M), attention (*), MLP (-) and MoE (E)")
    need("model.rope", m.rope, not m.rope, "has no positional encoding")
    need("model.mlp_activation", m.mlp_activation, m.mlp_activation == "relu2", "has squared-ReLU MLPs")
    need("model.attention", m.attention, m.attention == "gqa", "has grouped-query attention, not MLA")
    for field, value, default in (("qk_norm", m.qk_norm, "none"), ("qkv_bias", m.qkv_bias, False),
                                  ("attention_out_bias", m.attention_out_bias, False),
                                  ("attention_sinks", m.attention_sinks, False), ("sliding_window", m.sliding_window, None),
                                  ("attention_output_gate", m.attention_output_gate, False),
                                  ("zero_centered_norm", m.zero_centered_norm, False),
                                  ("partial_rotary_factor", m.partial_rotary_factor, 1.0),
                                  ("no_rope_layers", list(m.no_rope_layers), []),
                                  ("attention_chunk_size", m.attention_chunk_size, None),
                                  ("attn_temperature_tuning", m.attn_temperature_tuning, False)):
        need(f"model.{field}", value, value == default, "is not part of Nemotron-H")
    if moe.num_experts:
        need("moe.activation", moe.activation, moe.activation == "relu2", "has squared-ReLU experts")
        need("moe.score_function", moe.score_function, moe.score_function == "sigmoid", "scores with sigmoids")
        routing_bias = moe.routing_bias or moe.bias_update_rate > 0
        need("moe.routing_bias", routing_bias, routing_bias, "routes with a score-correction bias")
        need("moe.shared_experts", moe.shared_experts, moe.shared_experts <= 1 and not moe.shared_expert_gate,
             "has one ungated shared expert")
        need("moe.router_bias", moe.router_bias, not moe.router_bias and not moe.expert_biases, "has no biases")
    symbols = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
    for key in ("hybrid_override_pattern", "num_hidden_layers", "mamba_n_groups", "mamba_d_conv", "mamba_dt_min",
                "mamba_conv_bias", "mamba_chunk_size", "rope_theta", "rope_scaling", "rope_parameters"):
        out.pop(key, None)  # written under transformers' current names below
    out.update(architectures=[NEMOTRON_H.name], model_type=NEMOTRON_H.model_type, vocab_size=m.vocab_size,
               hidden_size=m.hidden, layers_block_type=[symbols[c] for c in m.hybrid_override_pattern],
               num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, head_dim=m.resolved_head_dim,
               intermediate_size=m.ffn_hidden, mlp_hidden_act="relu2", mlp_bias=False, attention_bias=False,
               attention_dropout=0.0, hidden_dropout=0.0, layer_norm_epsilon=m.norm_eps,
               tie_word_embeddings=m.tie_embeddings, initializer_range=m.init_std, mamba_num_heads=m.mamba_num_heads,
               mamba_head_dim=m.mamba_head_dim, ssm_state_size=m.ssm_state_size, n_groups=m.n_groups,
               conv_kernel=m.conv_kernel, use_conv_bias=m.use_conv_bias, time_step_min=m.time_step_min,
               chunk_size=m.mamba_chunk_size, mamba_hidden_act="silu", mamba_proj_bias=False, use_bias=False,
               residual_in_fp32=False, moe_latent_size=None, num_nextn_predict_layers=0, torch_dtype=dtype)
    out.pop("dtype", None)
    if moe.num_experts:
        out.update(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.ffn_hidden, n_shared_experts=moe.shared_experts,
                   moe_shared_expert_intermediate_size=moe.shared_hidden or moe.ffn_hidden,
                   routed_scaling_factor=moe.routed_scaling_factor, norm_topk_prob=moe.norm_topk_prob,
                   n_group=moe.n_group or 1, topk_group=moe.topk_group or 1, router_aux_loss_coef=moe.aux_loss_coef)
    out.setdefault("max_position_embeddings", m.seq_len)
    if eos_token_id is not None and "eos_token_id" not in out:
        out["eos_token_id"] = eos_token_id
    return out


def _moe_blocks(hf: dict, layers: int) -> set[int]:
    step, mlp_only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    return {i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0}
