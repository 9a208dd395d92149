"""Tiny random Hugging Face models, built locally by transformers from its own config classes
(nothing downloaded), for the interop tests.

Each architecture's model is built from transformers' config class directly — never through
``moetrain.hf``'s config mapping — so a mapping error cannot cancel out in a comparison. All
parameters are randomised (norm weights around 1, biases non-zero), so a permutation or a
transposition that HF's own initialisation (norms at 1, biases at 0) would hide shows.

What each one exercises beyond the plain block: Mixtral the renormalised top-k; Qwen3-MoE
per-head q/k norm and a head wider than hidden / heads; Qwen2-MoE the gated shared expert of
another width, q/k/v biases, a dense first block (decoder_sparse_step 2) and renormalised top-k;
OLMoE the q/k norm over the whole projection; Llama dense blocks and Llama 3.1 RoPE scaling in all
three of its frequency bands; DeepSeek-V3 MLA, YaRN with mscale, group-limited sigmoid routing
with the score-correction bias (randomised: it is zero in transformers' init), shared experts;
GLM-4.5 partial rotary, q/k/v bias and q/k norm; GPT-OSS sinks, a sliding window, biases, the
clamped SwiGLU and YaRN; Qwen3-Next gated-DeltaNet and gated-attention blocks, zero-centred norms,
partial rotary, a gated shared expert and a dense block; Kimi Linear KDA blocks beside MLA without
RoPE, DeepSeek-V3's group-limited routing and a dense first block; Nemotron-H single-sublayer
blocks (Mamba-2, squared-ReLU MLP, attention without RoPE, MoE with squared-ReLU experts); Llama 4
a RoPE block with chunked attention and the l2 q/k norm beside a NoPE block with temperature
tuning, top-1 sigmoid routing on the expert's input with a shared expert, fused experts;
DeepSeek-V3.2 and GLM-5 DeepSeek Sparse Attention's indexer (top 6 of 16 keys) on MLA, its RoPE
rotating halves (V3.2) or interleaved pairs (GLM-5).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320  # > 257 (the byte tokenizer of tests/conftest.py) and even (tp = 2)
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "llama", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_next",
         "qwen3_5_moe", "kimi_linear", "nemotron_h", "minimax_m2", "llama4_text", "deepseek_v32", "glm_moe_dsa")


def hf_config(arch: str, **over):
    """The transformers config of the tiny ``arch`` model (``over`` replaces fields)."""
    import transformers as tf

    if arch == "mixtral":
        cls, kw = tf.MixtralConfig, dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    elif arch == "qwen3_moe":
        cls, kw = tf.Qwen3MoeConfig, dict(intermediate_size=64, moe_intermediate_size=24, num_experts=4,
                                          num_experts_per_tok=2, head_dim=16, norm_topk_prob=False)
    elif arch == "qwen2_moe":
        cls, kw = tf.Qwen2MoeConfig, dict(intermediate_size=64, moe_intermediate_size=24,
                                          shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                                          decoder_sparse_step=2, norm_topk_prob=True)
    elif arch == "olmoe":
        cls, kw = tf.OlmoeConfig, dict(intermediate_size=24, num_experts=4, num_experts_per_tok=2, eos_token_id=1,
                                       norm_topk_prob=False)
    elif arch == "llama":
        # original_max_position_embeddings 32: with head_dim 8 the wavelengths 6, 63, 628, 6283
        # fall in the kept (< 8), blended (8..32) and divided (> 32) bands.
        cls, kw = tf.LlamaConfig, dict(intermediate_size=64, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    elif arch == "deepseek_v3":
        # MLA with a query bottleneck, YaRN with DeepSeek's mscale (softmax scale × mscale²), 8 experts in
        # 4 groups (2 kept), a shared expert, routed scaling, a dense first block.
        cls, kw = tf.DeepseekV3Config, dict(
            intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, n_shared_experts=1,
            n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
            v_head_dim=6, qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2,
            first_k_dense_replace=1, num_key_value_heads=4,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "beta_fast": 32.0, "beta_slow": 1.0})
    elif arch == "glm4_moe":
        # Partial rotary (half of each head), q/k/v bias, per-head q/k norm, DeepSeek's routing.
        cls, kw = tf.Glm4MoeConfig, dict(
            intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, n_shared_experts=1,
            n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
            head_dim=16, attention_bias=True, use_qk_norm=True, routed_scaling_factor=1.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    elif arch == "gpt_oss":
        # Sinks, a 4-token window on block 0 (of 16 tokens), biases everywhere, clamped SwiGLU, YaRN.
        cls, kw = tf.GptOssConfig, dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                        head_dim=8, sliding_window=4)
    elif arch == "qwen3_next":
        # Blocks: gated DeltaNet (dense MLP), gated attention, gated DeltaNet, gated attention; a
        # quarter of each head rotated; two value heads per key head.
        cls, kw = tf.Qwen3NextConfig, dict(
            num_hidden_layers=4, intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=20,
            num_experts=4, num_experts_per_tok=2, head_dim=16, mlp_only_layers=[0], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=3,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    elif arch == "qwen3_5_moe":
        # Qwen3.5's MoE text model: Qwen3-Next's blocks with gated DeltaNet's projections split,
        # every block MoE, the multimodal RoPE's sections in its parameters (text: plain RoPE).
        cls, kw = tf.Qwen3_5MoeTextConfig, dict(
            num_hidden_layers=4, moe_intermediate_size=24, shared_expert_intermediate_size=20, num_experts=4,
            num_experts_per_tok=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=3,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    elif arch == "kimi_linear":
        # Blocks: KDA (dense MLP), MLA without RoPE (MoE), KDA (MoE); 8 experts in 4 groups (2 kept),
        # a shared expert, routed scaling; token ids none (Kimi's defaults lie outside the vocabulary).
        cls, kw = tf.KimiLinearConfig, dict(
            num_hidden_layers=3, intermediate_size=40, moe_intermediate_size=16, num_local_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5, n_group=4, topk_group=2,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8,
            num_key_value_heads=4, linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"], pad_token_id=None, bos_token_id=None, eos_token_id=None)
    elif arch == "nemotron_h":
        # Single-sublayer blocks: Mamba-2, squared-ReLU MLP, attention without RoPE, MoE (sigmoid
        # routing with the score-correction bias, 8 experts in 2 groups, a shared expert of its own
        # width), then Mamba-2 and MoE again; two Mamba groups of two heads.
        cls, kw = tf.NemotronHConfig, dict(
            layers_block_type=["linear_attention", "mlp", "full_attention", "moe", "linear_attention", "moe"],
            head_dim=8, intermediate_size=40, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
            conv_kernel=3, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            layer_norm_epsilon=1e-6, pad_token_id=None, bos_token_id=None, eos_token_id=None)
        common = {k: v for k, v in COMMON.items() if k not in ("rms_norm_eps", "num_hidden_layers")}
        return cls(**{**common, **kw, **over})
    elif arch == "minimax_m2":
        # q/k RMSNorm over the whole projection, half of each head rotated (its legacy rotary_dim),
        # sigmoid routing with the score-correction bias, every block MoE; token ids none (its
        # defaults lie outside the vocabulary).
        cls, kw = tf.MiniMaxM2Config, dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                           head_dim=16, rotary_dim=8, pad_token_id=None, bos_token_id=None,
                                           eos_token_id=None)
    elif arch == "llama4_text":
        # Block 0 rotates (Llama 3.1's RoPE scaling, the l2 q/k norm) and attends within chunks of 8
        # positions (the 16-token samples hold two); block 1 is NoPE with temperature tuning
        # (floor_scale 4: the scale changes every 4 positions) and the MoE: top-1 sigmoid routing
        # on the expert's input, a shared expert, the experts' width other than the dense MLP's.
        cls, kw = tf.Llama4TextConfig, dict(
            intermediate_size=16, intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1, head_dim=8,
            interleave_moe_layer_step=2, no_rope_layers=[1, 0], attention_chunk_size=8, use_qk_norm=True,
            attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1, pad_token_id=None, bos_token_id=None,
            eos_token_id=None, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 32})
    elif arch in ("deepseek_v32", "glm_moe_dsa"):
        # DeepSeek Sparse Attention on DeepSeek-V3's blocks: each query of a 16-token sample keeps
        # its 6 best-scored keys (8 index heads of 8, RoPE on the first 4 dims: rotate-half in
        # DeepSeek-V3.2's indexer, interleaved in GLM-5's); YaRN with mscale as DeepSeek-V3's; a
        # dense first block, then 4 experts in 2 groups with a shared one.
        cls = tf.DeepseekV32Config if arch == "deepseek_v32" else tf.GlmMoeDsaConfig
        kw = dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                  topk_group=1, n_shared_experts=1, routed_scaling_factor=1.5, q_lora_rank=16, kv_lora_rank=12,
                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, num_key_value_heads=4, index_topk=6,
                  index_head_dim=8, index_n_heads=8, first_k_dense_replace=1, pad_token_id=None, bos_token_id=None,
                  eos_token_id=None,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 1.0,
                                   "beta_fast": 32, "beta_slow": 1})
    else:
        raise ValueError(arch)
    return cls(**{**COMMON, **kw, **over})


@torch.no_grad()
def build_hf_model(arch: str, out: Path, seed: int = 0, **over):
    """A random fp32 ``arch`` model saved with ``save_pretrained`` into ``out``; returns it
    (eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **over), dtype=torch.float32)
    for name, p in model.named_parameters():
        if "norm" in name and arch in ("qwen3_next", "qwen3_5_moe") and "linear_attn.norm" not in name:
            p.copy_(0.3 * torch.randn_like(p))  # zero-centred: the scale is 1 + weight
        elif "norm" in name:
            p.copy_(1.0 + 0.3 * torch.randn_like(p))
        else:
            p.normal_(0.0, 0.15)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zero by default: a mapping error would not show
            b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(out)
    return model.eval()
