"""Model FLOPs per token, for tokens/s → TFLOP/s and MFU."""

from __future__ import annotations

from moetrain.config import Config


def active_params(cfg: Config) -> dict[str, int]:
    """Parameters touched per token, by part (embedding excluded from compute, as in
    Kaplan et al. 2020 §2.1). MoE layers count top_k routed experts plus the shared ones."""
    m, moe = cfg.model, cfg.moe
    head_dim = m.resolved_head_dim
    attn = m.hidden * head_dim * (m.heads * 2 + m.kv_heads * 2)
    dense_mlp = 3 * m.hidden * m.ffn_hidden
    expert = 3 * m.hidden * moe.ffn_hidden
    blocks = 0
    for layer in range(m.layers):
        blocks += attn
        if moe.is_moe_layer(layer):
            blocks += expert * moe.top_k + 3 * m.hidden * moe.shared_hidden + m.hidden * moe.num_experts
        else:
            blocks += dense_mlp
    head = m.hidden * (m.vocab_size or 0)
    return {"blocks": blocks, "head": head}


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token: 6 · active matmul parameters (forward 2, backward 4) plus
    causal attention scores 6 · layers · seq_len · hidden (the 12·L·H·Q·T term of PaLM,
    Chowdhery et al. 2022 App. B, halved for the causal mask)."""
    p = active_params(cfg)
    m = cfg.model
    return 6.0 * (p["blocks"] + p["head"]) + 6.0 * m.layers * m.seq_len * m.hidden
