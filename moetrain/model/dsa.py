"""DeepSeek Sparse Attention (DSA): the lightning indexer and its top-k selection on MLA
(DeepSeek-AI 2025, "DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with DeepSeek Sparse
Attention", §2.1; transformers' ``DeepseekV32Indexer``).

Shape legend: B batch, S the queries this rank holds, T the keys the indexer scores (the whole
sample: every key, also under context parallelism), D hidden, Cq the query latent (MLA's
``q_lora_rank``), Hi index heads, Di index head dim, Dr the RoPE dims (MLA's ``qk_rope_head_dim``).

The indexer (:class:`Indexer`):

* a query per index head from MLA's query latent, q_I = c_q W_q [B, S, Hi, Di], and one key per
  token shared by the heads, k_I = LayerNorm(x W_k) [B, T, Di]; RoPE on the first Dr dims of both
  (moetrain's interleaved pairs: a checkpoint that rotates halves, DeepSeek-V3.2's, is permuted
  on import, :mod:`moetrain.hf.tensors`);
* per-head weights w = x W_w · Hi^-1/2 [B, S, Hi];
* scores I(t, s) = Σ_j w(t, j) · ReLU(q_I(t, j) · k_I(s) · Di^-1/2) (the report's eq. 1), over the
  keys a query sees (causal, its document); each query keeps its ``topk`` best (all of them when
  it sees fewer): the attention then runs over those keys only (:func:`select_topk`).

Its loss (:meth:`Indexer.loss`) is KL(p ‖ softmax(I)) per query, p the main attention's
probabilities summed over its heads and L1-normalised, over every visible key (``dense_warmup``,
eq. 3) or over the selected keys (``sparse``, eq. 4); the mean over the sample's tokens, times
``model.dsa.indexer_loss_coef``, joins the objective as a gradient on the indexer alone
(:class:`~moetrain.model.moe.AttachAuxLoss`): its inputs are detached, and the selection, a
top-k, gives the main model no gradient.

Two attention paths for the sparse stage (``model.dsa.attention``). ``masked``, the reference:
the scores and the selection dense ([B, S, T] per layer), the attention with a boolean mask (the
attention kernels' ``select``): exact, O(S·T) memory, every layout. ``gathered``: the indexer
scores blocks of queries and keeps only their top-k indices (:meth:`Indexer.topk_indices`), MLA
attends in its absorbed form over each query's gathered latents (:class:`SparseLatentAttention`),
and the loss reads the scores and probabilities at the selected keys only: O(S·K) beside the
indexer's O(S·T) scoring. Under context parallelism :mod:`moetrain.parallel.context` sets
:class:`IndexerParallel`: the indexer keys (one head, Di wide) are gathered over the cp ranks with
their gradient, and the main attention's keys without it, for p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.attention import DocumentMask
from moetrain.model.layers import Linear, apply_rope, cast
from moetrain.model.moe import AttachAuxLoss
from moetrain.model.recompute import is_recomputing


@dataclass
class IndexerParallel:
    """How the indexer's keys are spread over ranks, the one object
    :mod:`moetrain.parallel.context` hands an :class:`Indexer` (None: one process).

    * ``gather_seq`` — this rank's [B, S, ...] → the whole sample's [B, T, ...] in sequence
      order, differentiable (its backward sums every rank's gradient of each key);
    * ``positions`` — [S] the sample positions of this rank's queries; ``cp`` the ranks the
      sample is split over (T = cp · S), also the factor on this rank's share of the loss so that
      the gradient reduction (a mean over cp) gives the one-process gradient;
    * ``sum_heads`` — sums a [B, S, T] head sum of the main attention's probabilities over the
      tp ranks, which hold the other heads (no autograd); None without tp.

    Under tensor parallelism the indexer is replicated: every tp rank scores the whole
    (gathered) sequence with the same weights and gets the same selection, loss and gradient, so
    its parameters are reduced over dp × cp only, like the rest of the block."""

    gather_seq: Callable[[torch.Tensor], torch.Tensor] | None = None
    positions: torch.Tensor | None = None
    cp: int = 1
    sum_heads: Callable[[torch.Tensor], torch.Tensor] | None = None


class KeyNorm(nn.Module):
    """LayerNorm (Ba et al. 2016) with a weight and a bias, statistics in fp32: x [..., Di] → the
    same shape and dtype (eps 1e-6, DeepSeek-V3.2's indexer key norm)."""

    compute_dtype: torch.dtype | None = None

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = cast(self.weight, self.compute_dtype).float(), cast(self.bias, self.compute_dtype).float()
        return F.layer_norm(x.float(), (x.shape[-1],), w, b, self.eps).to(x.dtype)


class Indexer(nn.Module):
    """The lightning indexer of one MLA block (module docstring). ``dim`` D, ``q_lora_rank`` Cq,
    ``heads`` Hi, ``head_dim`` Di, ``rope_dim`` Dr, ``topk`` keys per query, ``stage``
    ``dense_warmup`` or ``sparse``, ``loss_coef`` the loss weight, ``gathered`` the sparse stage
    attends over the gathered selected keys (:meth:`moetrain.model.mla.MLAttention`; else masked)."""

    def __init__(self, dim: int, q_lora_rank: int, heads: int, head_dim: int, rope_dim: int, topk: int,
                 stage: str = "sparse", loss_coef: float = 1.0, gathered: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.rope_dim, self.topk = heads, head_dim, rope_dim, topk
        self.stage, self.loss_coef = stage, loss_coef
        # the sparse stage's attention over the gathered selected latents (model.dsa.attention)
        self.gathered = gathered
        self.wq_b = Linear(q_lora_rank, heads * head_dim, bias=False)
        self.wk = Linear(dim, head_dim, bias=False)
        self.k_norm = KeyNorm(head_dim)
        self.weights_proj = Linear(dim, heads, bias=False)
        self.parallel: IndexerParallel | None = None
        # The gradient given to the loss in backward: 1 / forwards of the step (begin_step).
        self.loss_grad_scale = 1.0
        # This step's loss summed over its forwards (float64 on the device; begin_step clears it).
        self.loss_sum: torch.Tensor | None = None

    @property
    def sparse(self) -> bool:
        return self.stage == "sparse"

    def begin_step(self, forwards: int) -> None:
        """A training step of ``forwards`` forward passes starts: the loss's gradient is scaled
        by 1 / forwards (the LM loss is divided the same way) and its sum starts from zero."""
        self.loss_grad_scale = 1.0 / forwards
        self.loss_sum = None

    def take_loss_sum(self) -> torch.Tensor | None:
        """This step's indexer loss summed over its forwards (this rank's share, unscaled;
        float64 scalar on the device), or None before any; starts again from zero."""
        out, self.loss_sum = self.loss_sum, None
        return out

    def positions(self, S: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """([S] the sample positions of this rank's queries, [T] those of the keys, in order)."""
        if self.parallel is None or self.parallel.positions is None:
            pos = torch.arange(S, device=device)
            return pos, pos
        return self.parallel.positions.to(device), torch.arange(S * self.parallel.cp, device=device)

    def project(self, x_BSD: torch.Tensor, c_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer's query [B, S, Hi, Di], key [B, T, Di] (gathered over cp) and head weights
        [B, S, Hi] (fp32, times Hi^-1/2) from the block's normed input ``x_BSD`` and MLA's query
        latent ``c_q`` [B, S, Cq], both detached here."""
        B, S, _ = x_BSD.shape
        x, c_q = x_BSD.detach(), c_q.detach()
        q = self.wq_b(c_q).view(B, S, self.heads, self.head_dim)
        q = apply_rope(q, cos, sin) if self.rope_dim else q  # the first Dr dims rotate
        k = self.k_norm(self.wk(x)).unsqueeze(2)  # [B, S, 1, Di]
        k = (apply_rope(k, cos, sin) if self.rope_dim else k).squeeze(2)
        if self.parallel is not None and self.parallel.gather_seq is not None:
            k = self.parallel.gather_seq(k)  # [B, T, Di]
        return q, k, self.weights_proj(x).float() * self.heads ** -0.5

    def score(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """I [B, S, T] fp32 (eq. 1, before any mask) from :meth:`project`'s q, k, w."""
        qf, kt = q.float(), k.float().transpose(1, 2)  # [B, S, Hi, Di], [B, Di, T]
        scale = self.head_dim ** -0.5
        out = None
        for j in range(self.heads):  # one head's [B, S, T] at a time
            term = w[..., j, None] * F.relu(qf[:, :, j] @ kt * scale)
            out = term if out is None else out + term
        return out

    def score_selected(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, idx_BSK: torch.Tensor) -> torch.Tensor:
        """I at the selected keys only: [B, S, K] fp32, I[b, s, j] = I(s, idx[b, s, j]) — what the
        sparse stage's loss needs, O(S·K·Hi·Di) instead of O(S·T·Hi·Di)."""
        k_sel = gather_rows(k.float(), idx_BSK)  # [B, S, K, Di]
        logits = torch.einsum("bshd,bskd->bshk", q.float(), k_sel) * self.head_dim ** -0.5
        return torch.einsum("bsh,bshk->bsk", w, F.relu(logits))

    def scores(self, x_BSD: torch.Tensor, c_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """I [B, S, T] fp32 (the module docstring's scores, before any mask). ``x_BSD`` the
        block's normed input, ``c_q`` [B, S, Cq] MLA's query latent, both detached here."""
        return self.score(*self.project(x_BSD, c_q, cos, sin))

    @torch.no_grad()
    def topk_indices(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, doc: DocumentMask | None, block: int = 256
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's ``topk`` best visible keys, scored one block of ``block`` queries at a time
        ([B, block, T] at once): (idx [B, S, K] int64, valid [B, S, K] bool — False where a query
        sees fewer than K keys), K = min(topk, T). No gradient."""
        B, S = q.shape[:2]
        K = min(self.topk, k.shape[1])
        idx, valid = [], []
        for s0 in range(0, S, block):
            s1 = min(S, s0 + block)
            scores = self.score(q[:, s0:s1], k, w[:, s0:s1])
            visible = visible_keys(q_pos[s0:s1], k_pos, doc, B)
            top = scores.masked_fill(~visible, float("-inf")).topk(K, dim=-1).indices
            idx.append(top)
            valid.append(visible.gather(-1, top))
        return torch.cat(idx, dim=1), torch.cat(valid, dim=1)

    def loss(self, scores_BST: torch.Tensor, p_BST: torch.Tensor, over_BST: torch.Tensor, tokens: int) -> torch.Tensor:
        """This rank's share of the indexer loss: Σ over its queries of KL(p ‖ softmax(I)) over
        the keys ``over_BST`` (visible, or selected), divided by ``tokens`` (the micro-batch's
        whole sequences' query count, B · T). ``p_BST`` the target distribution (zero outside
        ``over_BST``, rows summing to 1), no gradient. Scalar fp32, differentiable w.r.t. the scores."""
        log_q = torch.log_softmax(scores_BST.masked_fill(~over_BST, float("-inf")), dim=-1)
        kl = torch.xlogy(p_BST, p_BST) - p_BST * log_q.masked_fill(~over_BST, 0.0)
        return kl.sum() / tokens

    def record(self, loss: torch.Tensor) -> None:
        """Add this forward's loss share to the step's sum (not under activation recomputation,
        which would count it twice)."""
        if is_recomputing():
            return
        value = loss.detach().double()
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value

    def attach_loss(self, out: torch.Tensor, scores: torch.Tensor, p: torch.Tensor, over: torch.Tensor,
                    tokens: int) -> torch.Tensor:
        """The attention output ``out`` carrying this forward's indexer loss in backward: ``p``
        this rank's heads' probabilities over the keys ``over`` (summed over the tp ranks here,
        then L1-normalised), ``scores`` the indexer's at the same keys (:meth:`loss`); the share
        recorded for the step's metric and scaled by ``indexer_loss_coef`` and cp for the
        gradient (:class:`~moetrain.model.moe.AttachAuxLoss`)."""
        par = self.parallel
        if par is not None and par.sum_heads is not None:
            p = par.sum_heads(p)
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)  # L1-normalised over the keys
        loss = self.loss(scores, p, over, tokens)
        self.record(loss)
        scale = self.loss_coef * (par.cp if par is not None else 1)
        return AttachAuxLoss.apply(out, loss * scale, self.loss_grad_scale)


def select_topk(scores_BST: torch.Tensor, visible_BST: torch.Tensor, topk: int) -> torch.Tensor:
    """[B, S, T] bool: for each query row the ``topk`` largest ``scores_BST`` among the keys
    ``visible_BST`` marks (all the visible ones when fewer). Ties go to ``torch.topk``'s order,
    which depends only on the row's values and positions, so every layout that scores the same
    keys in the same order selects the same ones."""
    masked = scores_BST.masked_fill(~visible_BST, float("-inf"))
    k = min(topk, masked.shape[-1])
    idx = masked.topk(k, dim=-1).indices
    chosen = torch.zeros_like(visible_BST).scatter_(-1, idx, True)
    return chosen & visible_BST


def gather_rows(x_BTC: torch.Tensor, idx_BSK: torch.Tensor) -> torch.Tensor:
    """Rows of x_BTC [B, T, C] at idx_BSK [B, S, K] (int64 in [0, T)) → [B, S, K, C]: one index per
    row (``index_select`` on the flattened batch; its backward adds rows, not elements)."""
    B, T, C = x_BTC.shape
    S, K = idx_BSK.shape[1:]
    flat = (idx_BSK + torch.arange(B, device=idx_BSK.device).view(B, 1, 1) * T).reshape(-1)
    return x_BTC.reshape(B * T, C).index_select(0, flat).view(B, S, K, C)


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, doc: DocumentMask | None, batch: int) -> torch.Tensor:
    """[B, S, T] bool: the keys at positions ``k_pos`` [T] that the queries at ``q_pos`` [S] see
    (not later, and in the same document when ``doc`` is given)."""
    if doc is not None:
        return doc.visible(q_pos, k_pos)
    return (k_pos[None, None, :] <= q_pos[None, :, None]).expand(batch, -1, -1)


@torch.no_grad()
def attention_probabilities(q: torch.Tensor, k: torch.Tensor, scale: float, allowed_BST: torch.Tensor) -> torch.Tensor:
    """Σ over the heads of softmax(scale · q kᵀ) over the keys ``allowed_BST`` marks: q [B, H, S,
    Dk], k [B, H, T, Dk] → [B, S, T] fp32 (each head's rows sum to 1; the caller L1-normalises
    after summing the heads of every rank). One head's [B, S, T] at a time; no gradient."""
    out = None
    for h in range(q.shape[1]):
        logits = (q[:, h].float() @ k[:, h].float().transpose(1, 2)) * scale
        p = torch.softmax(logits.masked_fill(~allowed_BST, float("-inf")), dim=-1).nan_to_num(0.0)
        out = p if out is None else out + p
    return out


class SparseLatentAttention(torch.autograd.Function):
    """MLA's absorbed attention over each query's selected latents (DSA's sparse stage with
    ``model.dsa.attention: gathered``), one block of queries at a time, forward and backward.

    qq [B, S, H, C] the absorbed queries ([q_n W_ukᵀ; q_r], C = Ckv + Dr), latents [B, T, C]
    ([c_kv; k_r]), top / valid [B, S, K] the selected keys → (o [B, S, H, Ckv] the heads'
    weighted value latents, in qq's dtype; p [B, S, K] fp32 the softmax probabilities summed over
    the heads, no gradient: the indexer loss's target). Scores and softmax in fp32.

    Forward keeps nothing of a block; backward recomputes its scores (FlashAttention-2's
    recomputation, Dao 2023, with the gathered keys in place of a key block): dP = dO·vᵀ,
    dS = P ∘ (dP − rowsum(dO ∘ O)), dq = dS·k, and the selected latents' gradients, summed over
    the heads, added into one [B·T, C] buffer (``index_add_``). Memory: one block's
    [B, block, K, C] gathered latents and [B, block, H, K] scores at a time."""

    @staticmethod
    def forward(ctx, qq: torch.Tensor, latents: torch.Tensor, top: torch.Tensor, valid: torch.Tensor, scale: float,
                ckv: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, H, _ = qq.shape
        outs, probs = [], []
        for s0 in range(0, S, block):
            s1 = min(S, s0 + block)
            g = gather_rows(latents, top[:, s0:s1]).float()  # [B, Sb, K, C]
            p = _block_probs(qq[:, s0:s1], g, valid[:, s0:s1], scale)  # [B, Sb, H, K]
            outs.append(torch.einsum("bshk,bskc->bshc", p, g[..., :ckv]))
            probs.append(p.sum(2))
        o = torch.cat(outs, dim=1)
        ctx.save_for_backward(qq, latents, top, valid, o)
        ctx.scale, ctx.ckv, ctx.block = scale, ckv, block
        p_sum = torch.cat(probs, dim=1)
        ctx.mark_non_differentiable(p_sum)
        return o.to(qq.dtype), p_sum

    @staticmethod
    def backward(ctx, d_o: torch.Tensor, _dp: torch.Tensor | None):
        qq, latents, top, valid, o = ctx.saved_tensors
        scale, ckv, block = ctx.scale, ctx.ckv, ctx.block
        B, S, H, C = qq.shape
        T = latents.shape[1]
        d_qq = torch.empty(qq.shape, dtype=torch.float32, device=qq.device)
        d_lat = torch.zeros(B * T, C, dtype=torch.float32, device=latents.device)
        offsets = torch.arange(B, device=top.device).view(B, 1, 1) * T
        d_o = d_o.float()
        for s0 in range(0, S, block):
            s1 = min(S, s0 + block)
            q_b, do_b = qq[:, s0:s1].float(), d_o[:, s0:s1]
            g = gather_rows(latents, top[:, s0:s1]).float()  # [B, Sb, K, C]
            p = _block_probs(q_b, g, valid[:, s0:s1], scale)
            d_p = torch.einsum("bshc,bskc->bshk", do_b, g[..., :ckv])
            d_s = p * (d_p - (do_b * o[:, s0:s1]).sum(-1, keepdim=True)) * scale
            d_qq[:, s0:s1] = torch.einsum("bshk,bskc->bshc", d_s, g)
            d_g = torch.einsum("bshk,bshc->bskc", d_s, q_b)
            d_g[..., :ckv] += torch.einsum("bshk,bshc->bskc", p, do_b)
            d_lat.index_add_(0, (top[:, s0:s1] + offsets).reshape(-1), d_g.reshape(-1, C))
        return d_qq.to(qq.dtype), d_lat.view(B, T, C).to(latents.dtype), None, None, None, None, None


def _block_probs(q_b: torch.Tensor, g: torch.Tensor, valid_b: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale · q gᵀ) over one block's selected keys: q_b [B, Sb, H, C], g [B, Sb, K, C]
    → [B, Sb, H, K] fp32, 0 at the invalid ones."""
    logits = torch.einsum("bshc,bskc->bshk", q_b.float(), g) * scale
    return torch.softmax(logits.masked_fill(~valid_b[:, :, None], float("-inf")), dim=-1)
