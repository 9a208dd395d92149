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
three of its frequency bands.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320  # > 257 (the byte tokenizer of tests/conftest.py) and even (tp = 2)
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "llama")


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
        if "norm" in name:
            p.copy_(1.0 + 0.3 * torch.randn_like(p))
        else:
            p.normal_(0.0, 0.15)
    model.save_pretrained(out)
    return model.eval()
