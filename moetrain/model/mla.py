"""Multi-head latent attention (MLA): DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1.

Shape legend: B batch, S sequence, D hidden, H heads (those this module holds: H / tp under
tensor parallelism), Cq ``q_lora_rank``, Ckv ``kv_lora_rank``, Dn ``qk_nope_head_dim``, Dr
``qk_rope_head_dim``, Dv ``v_head_dim``.

Phases of :meth:`MLAttention.forward`:

1. compress — queries through the low-rank bottleneck c_q = RMSNorm(x W_qa) [B, S, Cq] (or no
   bottleneck), keys and values into the latent c_kv = RMSNorm(x W_kva) [B, S, Ckv]; the RoPE key
   k_r = x W_kr [B, S, 1, Dr] is computed from x directly and shared by every head (DeepSeek-V2
   eq. 9-19: RoPE cannot be folded into an up-projection);
2. up-project (:meth:`MLAttention.up`) — q = c_q W_qb [B, S, H, Dn + Dr], [k_n; v] = c_kv W_kvb
   [B, S, H, Dn + Dv]; RoPE on q's last Dr dimensions and on k_r; k = [k_n; k_r] per head;
3. attend — the attention kernel with softmax scale (Dn + Dr)^-1/2 (× mscale² under YaRN with
   ``mscale_all_dim``, as DeepSeek-V3's reference code), values of width Dv;
4. project out — [B, S, H·Dv] W_o.

Phase 2 can be recomputed in backward (``mla_up_proj``, as Megatron-Core's recompute module of
that name): only the latents stay in memory.

With DeepSeek Sparse Attention (``model.dsa``, :mod:`moetrain.model.dsa`) an :class:`Indexer`
scores the keys from the block's input and the query latent c_q; in the ``sparse`` stage phase 3
attends to each query's selected keys only, and in training the indexer's loss joins the output's
gradient.

Hugging Face's ``kv_a_proj_with_mqa`` is [Ckv + Dr, D]: moetrain keeps its two parts as two
projections (``wkv_a`` and ``wk_rope``), so that under tensor parallelism the RoPE key's
gradient, which every tp rank computes for its own heads, can be summed over tp on its own
(:mod:`moetrain.parallel.tensor`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.utils.checkpoint
from torch import nn

from moetrain.model.attention import DocumentMask, head_max_logits, sdpa_attention
from moetrain.model.dsa import Indexer, SparseLatentAttention, attention_probabilities, select_topk, visible_keys
from moetrain.model.layers import AttentionKernel, Linear, RMSNorm, apply_rope, local_cast
from moetrain.model.recompute import recompute_context


class MLAttention(nn.Module):
    """Multi-head latent attention (module docstring). ``scale``: the softmax scale.
    ``kernel`` as :class:`moetrain.model.layers.Attention`'s; ``recompute_up``: recompute phase 2
    in backward."""

    def __init__(self, dim: int, heads: int, q_lora_rank: int | None, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scale: float, norm_eps: float = 1e-6,
                 window: int | None = None, sinks: bool = False, indexer: Indexer | None = None):
        super().__init__()
        self.indexer = indexer
        self.heads, self.nope, self.rope, self.v_dim = heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk = qk_nope_head_dim + qk_rope_head_dim
        self.wq: Linear | None = None
        self.wq_a: Linear | None = None
        if q_lora_rank is None:
            self.wq = Linear(dim, heads * qk, bias=False)
        else:
            self.wq_a = Linear(dim, q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(q_lora_rank, norm_eps)
            self.wq_b = Linear(q_lora_rank, heads * qk, bias=False)
        self.wkv_a = Linear(dim, kv_lora_rank, bias=False)
        self.wk_rope = Linear(dim, qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(kv_lora_rank, norm_eps)
        self.wkv_b = Linear(kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = Linear(heads * v_head_dim, dim, bias=False)
        self.scale, self.window = scale, window
        self.sinks = nn.Parameter(torch.empty(heads)) if sinks else None
        self.kernel: AttentionKernel = sdpa_attention
        self.recompute_up = False
        # Under tensor parallelism: the key-value latent as every tp rank's heads read it, its
        # gradient summed over tp (set by moetrain.parallel.tensor; DSA's gathered attention)
        self.latent_to_heads: Callable[[torch.Tensor], torch.Tensor] | None = None
        # [heads on this rank] float32: each head's largest logit since the last reset (track_max_logits)
        self.register_buffer("max_logit", None, persistent=False)

    def track_max_logits(self, heads: int) -> None:
        """As :meth:`moetrain.model.layers.Attention.track_max_logits`."""
        self.max_logit = torch.full((heads,), float("-inf"), device=self.wkv_b.weight.device)

    def up(self, c_q: torch.Tensor, c_kv: torch.Tensor, k_r: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Phase 2: latents → per-head q, k [B, H, S, Dn + Dr] and v [B, H, S, Dv]. c_q: the
        compressed queries (or x without a bottleneck), c_kv [B, S, Ckv], k_r [B, S, Dr]."""
        B, S = c_kv.shape[:2]
        q = (self.wq(c_q) if self.wq is not None else self.wq_b(c_q)).view(B, S, -1, self.nope + self.rope)
        kv = self.wkv_b(c_kv).view(B, S, -1, self.nope + self.v_dim)
        k_n, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q[..., :self.nope], apply_rope(q[..., self.nope:], cos, sin)], dim=-1)
        k_r = apply_rope(k_r.unsqueeze(2), cos, sin).expand(-1, -1, k_n.shape[2], -1)
        k = torch.cat([k_n, k_r], dim=-1)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc: DocumentMask | None = None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        # 1. compress
        c_q = x_BSD if self.wq_a is None else self.q_a_norm(self.wq_a(x_BSD))
        c_kv = self.kv_a_norm(self.wkv_a(x_BSD))
        k_r = self.wk_rope(x_BSD)
        if self.indexer is not None and self.indexer.sparse and self.indexer.gathered:
            return self._gathered_forward(x_BSD, c_q, c_kv, k_r, cos, sin, doc)
        # 2. up-project (recomputed in backward with mla_up_proj)
        if self.recompute_up and torch.is_grad_enabled():
            q, k, v = torch.utils.checkpoint.checkpoint(self.up, c_q, c_kv, k_r, cos, sin, use_reentrant=False,
                                                        context_fn=recompute_context)
        else:
            q, k, v = self.up(c_q, c_kv, k_r, cos, sin)
        # 2b. DSA: score the keys, select each query's top-k (the sparse stage attends to those)
        idx, select = self.indexer, None
        if idx is not None:
            q_pos, k_pos = idx.positions(S, x_BSD.device)
            visible = visible_keys(q_pos, k_pos, doc, B)  # [B, S, T]
            scores = idx.scores(x_BSD, c_q, cos, sin)
            if idx.sparse:
                select = select_topk(scores, visible, idx.topk)
        # 3. attend
        if self.max_logit is not None:
            torch.maximum(self.max_logit, head_max_logits(q, k, self.scale, doc, self.window), out=self.max_logit)
        sinks = local_cast(self.sinks, None) if self.sinks is not None else None
        kw = {"select": select} if select is not None else {}
        out = self.kernel(q, k, v, doc, scale=self.scale, window=self.window, sinks=sinks, **kw)  # [B, H, S, Dv]
        # 4. project out
        out = self.wo(out.transpose(1, 2).reshape(B, S, -1))
        if idx is None or not (self.training and torch.is_grad_enabled()):
            return out
        # 5. the indexer's loss against this attention's probabilities (no gradient to them)
        over = select if select is not None else visible
        par = idx.parallel
        k_all = k.detach()
        if par is not None and par.gather_seq is not None:
            with torch.no_grad():
                k_all = par.gather_seq(k_all.transpose(1, 2)).transpose(1, 2)  # [B, H, T, Dk]
        p = attention_probabilities(q.detach(), k_all, self.scale, over)
        return idx.attach_loss(out, scores, p, over, B * k_pos.numel())

    def _gathered_forward(self, x_BSD: torch.Tensor, c_q: torch.Tensor, c_kv: torch.Tensor, k_r: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, doc: DocumentMask | None) -> torch.Tensor:
        """DSA's sparse stage with ``model.dsa.attention: gathered``: MLA in its absorbed form
        (DeepSeek-V2 §2.1.2) over each query's K selected keys. The key up-projection W_uk is
        folded into the queries, q̃ = [q_n W_ukᵀ; q_r] [B, S, H, Ckv + Dr], so every head attends
        to the same selected latents [c_kv; k_r] (gathered once per query, not per head); the
        value up-projection W_uv follows the weighted sum. One block of ``_BLOCK`` queries at a
        time, recomputed in backward (:class:`~moetrain.model.dsa.SparseLatentAttention`):
        [B, block, K, Ckv + Dr] gathered at once. Equal to the masked path up to fp32 rounding
        (tests/test_dsa.py)."""
        idx = self.indexer
        B, S, _ = x_BSD.shape
        q_pos, k_pos = idx.positions(S, x_BSD.device)
        q_i, k_i, w_i = idx.project(x_BSD, c_q, cos, sin)
        top, valid = idx.topk_indices(q_i, k_i, w_i, q_pos, k_pos, doc)  # [B, S, K]
        q = (self.wq(c_q) if self.wq is not None else self.wq_b(c_q)).view(B, S, -1, self.nope + self.rope)
        H = q.shape[2]
        w = local_cast(self.wkv_b.weight, self.wkv_b.compute_dtype).view(H, self.nope + self.v_dim, -1)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]  # [H, Dn, Ckv], [H, Dv, Ckv]
        q_abs = torch.einsum("bshn,hnc->bshc", q[..., :self.nope], w_uk)
        q_rot = apply_rope(q[..., self.nope:], cos, sin)
        qq = torch.cat([q_abs, q_rot.to(q_abs.dtype)], dim=-1)  # [B, S, H, Ckv + Dr]
        if self.latent_to_heads is not None:
            c_kv = self.latent_to_heads(c_kv)
        latents = torch.cat([c_kv, apply_rope(k_r.unsqueeze(2), cos, sin).squeeze(2).to(c_kv.dtype)], dim=-1)
        training = self.training and torch.is_grad_enabled()
        o_lat, p = SparseLatentAttention.apply(qq, latents, top, valid, self.scale, c_kv.shape[-1], _BLOCK)
        out = torch.einsum("bshc,hvc->bshv", o_lat, w_uv)  # [B, S, H, Dv]
        out = self.wo(out.reshape(B, S, -1))
        if not training:
            return out
        # p [B, S, K]: this rank's heads' probabilities at the selected keys, summed
        return idx.attach_loss(out, idx.score_selected(q_i, k_i, w_i, top), p, valid, B * k_pos.numel())


# Queries per block of the gathered sparse attention: [B, block, K, Ckv + Dr] gathered latents.
_BLOCK = 256
