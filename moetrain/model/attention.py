"""Core-attention kernels, the masks of packed sequences and sliding windows, attention sinks.

Shape legend: B batch, H query heads, G key/value heads (H % G == 0, grouped-query attention),
S the tokens this rank's attention sees, Dk query/key head dim, Dv value head dim (Dk under GQA;
MLA's differ), S_full the whole sample.

A kernel maps (q [B, H, S, Dk], k [B, G, S, Dk], v [B, G, S, Dv], doc; scale, window, sinks, chunk) →
[B, H, S, Dv]: causal attention, restricted to each token's own document when ``doc`` (a
:class:`DocumentMask`) is given, to the last ``window`` keys (the query's own included) with a
sliding window, to the keys of the query's own ``chunk`` of positions (Llama 4's chunked
attention: :func:`within_chunk`), with softmax scale ``scale`` (default Dk^-1/2), and with ``sinks`` ([H], one
logit per head that joins every row's softmax with a zero value: GPT-OSS; Xiao et al. 2023,
"Efficient Streaming Language Models with Attention Sinks"). ``model.attention_backend`` chooses
it (:func:`attention_kernel`):

* ``sdpa`` — ``F.scaled_dot_product_attention``: ``is_causal`` without documents or a window, an
  explicit boolean mask [B, 1, S, S] (causal ∧ same document ∧ window ∧ chunk) with them. With sinks, the
  blockwise kernels below over one block (:class:`SinkAttention`). The reference path; every
  device.
* ``flex`` — ``torch.nn.attention.flex_attention`` with a block mask built from the same rule
  (``mask_mod``), compiled on CUDA, where fully masked blocks are skipped. torch 2.13 has no flex
  backward on CPU: there it serves forward-only use (validation, tests). No sinks.
* ``flash`` — flash-attn (Dao 2023): ``flash_attn_func`` (causal, ``window_size``) without
  documents, ``flash_attn_varlen_func`` over the packed documents (``cu_seqlens``) with them.
  CUDA, bf16 / fp16. The document boundaries are read to the host once per micro-batch (the
  varlen kernel takes ``max_seqlen`` as an integer). No sinks, no chunks.

Under context parallelism :mod:`moetrain.parallel.context` replaces the kernel with ring
attention, which runs the same blockwise kernels and takes the same arguments.

Document masking (Megatron's ``--reset-attention-mask``; the "intra-document" masking of
Llama 3 §3.2 and torchtitan): a token attends to earlier tokens of its own document only, so a
packed sample trains like its documents one by one; with ``data.reset_position_ids`` RoPE
positions also restart at every document (:func:`positions_in_document`).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("sdpa", "flex", "flash")
Kernel = Literal["auto", "cpu_flash", "flash_attn", "math"]


@dataclass
class DocumentMask:
    """Which keys each query may see in a packed sample: the same document, not later.

    Attributes:
        doc_ids: [B, S_full] int64, the document index of every token of the whole sample
            (non-decreasing along a row; values only compared for equality). Whole samples on
            every rank, also under context parallelism, where a rank needs the documents of
            the keys it receives from the others.
        positions: [S] int64, the positions (in 0..S_full-1) of the tokens this rank's attention
            sees (their queries and keys).

    Derived masks are built once per forward and reused by every layer (``cache``).
    """

    doc_ids: torch.Tensor
    positions: torch.Tensor
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    def same_document(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[B, Sq, Sk] bool: query at sample position q_pos[i] and key at k_pos[j] share a document."""
        return self.doc_ids[:, q_pos, None] == self.doc_ids[:, None, k_pos]

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[B, Sq, Sk] bool: same document and not later (causal in sample positions)."""
        return self.same_document(q_pos, k_pos) & (k_pos[None, None, :] <= q_pos[None, :, None])

    def local_mask(self, window: int | None = None, chunk: int | None = None) -> torch.Tensor:
        """[B, 1, S, S] bool over the tokens this rank sees (SDPA's ``attn_mask``: True = attend),
        within ``window`` keys and inside the query's ``chunk`` when given."""
        key = ("sdpa", window, chunk)
        if key not in self.cache:
            mask = self.visible(self.positions, self.positions)
            if window is not None:
                mask = mask & within_window(self.positions, self.positions, window)
            if chunk is not None:
                mask = mask & within_chunk(self.positions, self.positions, chunk)
            self.cache[key] = mask[:, None]
        return self.cache[key]


def within_window(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[1, Sq, Sk] bool: key at position k_pos[j] is one of the last ``window`` positions up to
    q_pos[i] (q − k < window; combine with the causal mask)."""
    return (q_pos[:, None] - k_pos[None, :] < window)[None]


def within_chunk(q_pos: torch.Tensor, k_pos: torch.Tensor, chunk: int) -> torch.Tensor:
    """[1, Sq, Sk] bool: key at position k_pos[j] lies in the same chunk of ``chunk`` positions
    as the query at q_pos[i] (q // chunk == k // chunk; Llama 4's chunked attention; combine
    with the causal mask)."""
    return (q_pos[:, None] // chunk == k_pos[None, :] // chunk)[None]


def causal_mask(S: int, device: torch.device, window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """[1, 1, S, S] bool: causal, within ``window`` keys and inside the query's ``chunk`` when
    given."""
    pos = torch.arange(S, device=device)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask = mask & within_window(pos, pos, window)[0]
    if chunk is not None:
        mask = mask & within_chunk(pos, pos, chunk)[0]
    return mask[None, None]


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, scale: float, doc: DocumentMask | None = None,
                    window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """The largest attention logit scale·q·k of each query head over the pairs the attention
    sees (causal, inside the document and the window): q [B, H, S, Dk], k [B, G, S, Dk] (G key
    heads, each shared by H / G query heads) → [H] float32. One key head's query heads at a
    time, so the scores held at once are [B, H/G, S, S]. What MuonClip watches (Kimi K2, §2.1)."""
    B, H, S, _ = q.shape
    G = k.shape[1]
    mask = doc.local_mask(window, chunk) if doc is not None else causal_mask(S, q.device, window, chunk)
    out = []
    for g, q_g in enumerate(q.view(B, G, H // G, S, -1).unbind(1)):
        scores = (q_g.float() @ k[:, g, None].float().mT) * scale  # [B, H/G, S, S]
        out.append(scores.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3)))
    return torch.cat(out)


def positions_in_document(doc_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document: doc_ids [B, S] → [B, S] int64 (0 at every
    document start and at the start of the sample), computed on the device."""
    S = doc_ids.shape[1]
    idx = torch.arange(S, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


# ---------------------------------------------------------------------------------------------
# Blockwise kernels: (out, lse) forward; backward given the *global* out and lse. Ring attention
# (moetrain.parallel.context) runs them over K/V blocks; attention sinks over one block.
# ---------------------------------------------------------------------------------------------
# Why the backward takes the global out/lse: with P_blk = exp(S_blk·scale − lse_global) the
# block's probabilities are exactly its slice of the full softmax, and
# dS = P ∘ (dP − rowsum(dO ∘ O_global)), so each block's dq/dk/dv is its exact share of the full
# gradient (FlashAttention-2 backward, Dao 2023, Algorithm 2). No per-block statistics are kept.


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@functools.cache
def _cpu_flash_native_gqa() -> bool:
    """Whether the CPU flash op takes fewer K/V heads than Q heads (it does on torch 2.13; older
    releases may not). Probed once on tiny tensors, without touching the global RNG."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 8, generator=gen)
    k, v = torch.randn(2, 1, 1, 4, 8, generator=gen)
    try:
        fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = fwd(q, k, v, 0.0, False)
        ref, _ = fwd(q, k.expand(1, 2, 4, 8).contiguous(), v.expand(1, 2, 4, 8).contiguous(), 0.0, False)
        _, dk, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            torch.ones_like(out), q, k, v, out, lse, 0.0, False)
    except RuntimeError:
        return False
    return bool(torch.allclose(out, ref)) and dk.shape == k.shape


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, S, D] → [B, Hkv·groups, S, D], query head h reading K/V head h // groups (the
    convention of SDPA's ``enable_gqa``)."""
    return t.repeat_interleave(groups, dim=1)


def _reduce_kv_grad(g: torch.Tensor, groups: int) -> torch.Tensor:
    b, h, s, d = g.shape
    return g.view(b, h // groups, groups, s, d).sum(dim=2)


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _cpu_flash_fwd(q, k, v, causal, scale):
    # The CPU flash op wants one head size: values narrower than the keys (MLA) are padded with
    # zeros, which adds zero columns to the output.
    dv = v.shape[-1]
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not _cpu_flash_native_gqa():
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, _pad_last(v, q.shape[-1]), 0.0,
                                                                         causal, scale=scale)
    return out[..., :dv], lse


def _cpu_flash_bwd(dout, q, k, v, out, lse, causal, scale):
    dv_width, d = v.shape[-1], q.shape[-1]
    groups = q.shape[1] // k.shape[1]
    expand = groups > 1 and not _cpu_flash_native_gqa()
    if expand:
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _pad_last(dout, d), q, k, _pad_last(v, d), _pad_last(out, d), lse, 0.0, causal, scale=scale)
    if expand:
        dk, dv = _reduce_kv_grad(dk, groups), _reduce_kv_grad(dv, groups)
    return dq, dk, dv[..., :dv_width]


def _math_scores(q, k, causal, scale, mask=None):
    """Scores as [B, Hkv, G, Sq, Sk] in the accumulation dtype; GQA by broadcasting (no copy of
    K/V per query head). The causal mask is top-left aligned, as in the flash kernels; ``mask``
    ([B, Sq, Sk] bool, True = visible; e.g. a document mask) applies on top."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    acc = _acc_dtype(q.dtype)
    q5 = q.to(acc).reshape(b, hkv, hq // hkv, sq, d)
    s = (q5 @ k.to(acc).unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~visible, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    return q5, s


def _math_fwd(q, k, v, causal, scale, mask=None):
    b, hq, sq, _ = q.shape
    _, s = _math_scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    # A row with no visible key in this block (a document mask can do that) has lse = -inf: its
    # output is 0 and its lse stays -inf, which the log-sum-exp merge then ignores.
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    out = p @ v.to(s.dtype).unsqueeze(2)
    return out.reshape(b, hq, sq, v.shape[-1]).to(q.dtype), lse.reshape(b, hq, sq)


def _math_bwd(dout, q, k, v, out, lse, causal, scale, mask=None):
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    q5, s = _math_scores(q, k, causal, scale, mask)
    acc = s.dtype
    shape5 = (b, hkv, hq // hkv, sq, v.shape[-1])
    do5, o5 = dout.to(acc).reshape(shape5), out.to(acc).reshape(shape5)
    k5, v5 = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
    # Rows that see no key (lse = -inf) have p = 0.
    p = torch.exp(s - lse.to(acc).reshape(shape5[:-1]).unsqueeze(-1)).nan_to_num(0.0)
    dv = (p.transpose(-1, -2) @ do5).sum(dim=2)
    dp = do5 @ v5.transpose(-1, -2)
    ds = p * (dp - (do5 * o5).sum(dim=-1, keepdim=True)) * scale
    dq = (ds @ k5).reshape(b, hq, sq, d)
    dk = (ds.transpose(-1, -2) @ q5).sum(dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _flash_attn_fwd(q, k, v, causal, scale):
    """CUDA only, when the optional ``flash-attn`` package is importable: its public
    ``flash_attn_func`` returns the log-sum-exp with ``return_attn_probs=True``; layout
    [B, S, H, D], GQA native. Not covered by the CPU test suite. Its causal mask is
    bottom-right aligned when Sq != Sk; the ring only asks for causal blocks with Sq == Sk."""
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), _pad_last(v, q.shape[-1]).transpose(1, 2),
                                  softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out.transpose(1, 2)[..., :v.shape[-1]], lse


# kernel name → (forward, backward). flash-attn exposes no public backward that takes a given
# (global) lse, so its blocks use the math backward, which is exact with any forward.
_KERNELS = {
    "cpu_flash": (_cpu_flash_fwd, _cpu_flash_bwd),
    "math": (_math_fwd, _math_bwd),
    "flash_attn": (_flash_attn_fwd, _math_bwd),
}


def pick_kernel(kernel: Kernel, q: torch.Tensor) -> str:
    if kernel != "auto":
        if kernel not in _KERNELS:
            raise ValueError(f"kernel={kernel!r}: choose one of 'auto', {', '.join(map(repr, _KERNELS))}")
        return kernel
    if q.device.type == "cpu" and q.dtype in _CPU_FLASH_DTYPES:
        return "cpu_flash"
    if (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and importlib.util.find_spec("flash_attn") is not None):
        return "flash_attn"
    return "math"


def block_forward(kernel, q, k, v, causal, scale, mask=None):
    """Attention of queries ``q`` [B, Hq, Sq, D] over one K/V block [B, Hkv, Sk, D].
    Returns ``out`` [B, Hq, Sq, D] (input dtype) and ``lse`` [B, Hq, Sq] (accumulation dtype).
    With a ``mask`` ([B, Sq, Sk] bool) the math kernel runs (the flash kernels take none)."""
    if mask is not None:
        return _math_fwd(q, k, v, causal, scale, mask)
    out, lse = _KERNELS[kernel][0](q, k, v, causal, scale)
    return out, lse.to(_acc_dtype(q.dtype))


def block_backward(kernel, dout, q, k, v, out, lse, causal, scale, mask=None):
    """Gradients of one block given the global ``out`` and ``lse`` of these query rows."""
    if mask is not None:
        return _math_bwd(dout, q, k, v, out, lse, causal, scale, mask)
    return _KERNELS[kernel][1](dout, q, k, v, out, lse, causal, scale)




# ---------------------------------------------------------------------------------------------
# Attention sinks
# ---------------------------------------------------------------------------------------------


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold per-head sink logits into a finished attention: the sink is one more key with score
    ``sinks[h]`` and a zero value, so lse' = log(e^lse + e^sink) and out' = out · e^(lse − lse').
    out [B, H, S, Dv], lse [B, H, S] (fp32), sinks [H] → (out', lse')."""
    new_lse = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    return (out.to(lse.dtype) * torch.exp(lse - new_lse).unsqueeze(-1)).to(out.dtype), new_lse


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [H] given the final out and lse (with the sinks merged): the sink's
    probability exp(sink − lse) times dS = −rowsum(dO ∘ O) (its value is zero), summed over the
    batch and the rows (FlashAttention-2's backward, Dao 2023, Alg. 2, for one extra key)."""
    acc = lse.dtype
    p_sink = torch.exp(sinks.to(acc)[None, :, None] - lse)
    return -(p_sink * (dout.to(acc) * out.to(acc)).sum(-1)).sum((0, 2)).to(sinks.dtype)


class SinkAttention(torch.autograd.Function):
    """Attention of one block with per-head sinks. Forward: (out, lse) of the blockwise kernel
    (``mask`` [B or 1, S, S] bool, or the plain causal mask), then :func:`merge_sinks`. Backward:
    the kernel's backward given the final out and lse — whose probabilities already leave the
    sinks their share — and :func:`sink_grad` for the sinks."""

    @staticmethod
    def forward(ctx: Any, q, k, v, sinks, mask, scale, kernel):
        out, lse = block_forward(kernel, q, k, v, mask is None, scale, mask)
        out, lse = merge_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.mask, ctx.scale, ctx.kernel = mask, scale, kernel
        return out

    @staticmethod
    def backward(ctx: Any, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = block_backward(ctx.kernel, dout, q, k, v, out, lse, ctx.mask is None, ctx.scale, ctx.mask)
        return dq, dk, dv, sink_grad(dout, out, lse, sinks), None, None, None


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: DocumentMask | None = None, *,
                   scale: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None,
                   chunk: int | None = None, select: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention through ``F.scaled_dot_product_attention`` with GQA (kv heads broadcast);
    with ``doc``, ``window``, ``chunk`` or ``select`` ([B, S, S] bool, the keys each query may
    see besides the causal rule: DSA's top-k, :mod:`moetrain.model.dsa`), the explicit mask;
    with ``sinks``, :class:`SinkAttention`."""
    gqa = q.shape[1] != k.shape[1]
    mask = doc.local_mask(window, chunk) if doc is not None else (
        causal_mask(q.shape[2], q.device, window, chunk)
        if window is not None or chunk is not None or select is not None else None)
    if select is not None:
        mask = mask & select[:, None]
    if sinks is not None:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        block_mask = mask[:, 0] if mask is not None else None
        return SinkAttention.apply(q, k, v, sinks, block_mask, scale, pick_kernel("auto", q))
    if mask is None:
        # Values narrower than the keys (MLA) are padded with zeros to the keys' width, which adds
        # zero columns to the output: the flash kernels take one head size (without, SDPA falls
        # back to the math kernel, which holds the [S, S] scores of every head).
        dv = v.shape[-1]
        out = F.scaled_dot_product_attention(q, k, _pad_last(v, q.shape[-1]), is_causal=True, scale=scale,
                                             enable_gqa=gqa)
        return out if dv == q.shape[-1] else out[..., :dv]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class FlexAttention:
    """``flex_attention`` with a causal (∧ same document) block mask; compiled on CUDA (eager
    flex materialises the scores), eager elsewhere (forward only on CPU in torch 2.13)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: DocumentMask | None = None, *,
                 scale: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None,
                 chunk: int | None = None) -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_block_mask

        if sinks is not None:
            raise NotImplementedError("attention sinks with the flex backend (moetrain.config refuses it)")
        B, S = q.shape[0], q.shape[2]
        key = ("flex", q.device, window, chunk)
        block_mask = doc.cache.get(key) if doc is not None else _causal_block_mask(S, str(q.device), window, chunk)
        if block_mask is None:
            ids, pos = doc.doc_ids, doc.positions

            def mask_mod(b, h, qi, ki):
                visible = (ids[b, pos[qi]] == ids[b, pos[ki]]) & (pos[ki] <= pos[qi])
                if window is not None:
                    visible = visible & (pos[qi] - pos[ki] < window)
                return visible if chunk is None else visible & (pos[qi] // chunk == pos[ki] // chunk)

            block_mask = doc.cache[key] = create_block_mask(mask_mod, B, None, S, S, device=q.device)
        return _flex(q.device.type)(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@functools.lru_cache(maxsize=8)
def _causal_block_mask(S: int, device: str, window: int | None = None, chunk: int | None = None):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, qi, ki):
        visible = (ki <= qi) if window is None else (ki <= qi) & (qi - ki < window)
        return visible if chunk is None else visible & (qi // chunk == ki // chunk)

    return create_block_mask(mask_mod, None, None, S, S, device=device)


@functools.lru_cache(maxsize=2)
def _flex(device_type: str) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if device_type == "cuda" else flex_attention


class FlashAttention:
    """flash-attn's kernels (CUDA, bf16 / fp16): ``flash_attn_func`` causal, or
    ``flash_attn_varlen_func`` over the documents of the packed sample with ``doc``."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: DocumentMask | None = None, *,
                 scale: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None,
                 chunk: int | None = None) -> torch.Tensor:
        from flash_attn import flash_attn_func, flash_attn_varlen_func

        if sinks is not None or chunk is not None:
            raise NotImplementedError("attention sinks or chunks with the flash backend (moetrain.config refuses "
                                      "them)")
        # flash-attn's layout is [B, S, heads, D]; GQA is native; values padded to the key width.
        dv = v.shape[-1]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, _pad_last(v, q.shape[-1])))
        sliding = (window - 1, 0) if window is not None else (-1, -1)
        if doc is None:
            out = flash_attn_func(qt, kt, vt, softmax_scale=scale, causal=True, window_size=sliding)
            return out.transpose(1, 2)[..., :dv]
        B, S, H, D = qt.shape
        cu_seqlens, max_len = _cu_seqlens(doc)
        out = flash_attn_varlen_func(qt.reshape(B * S, H, D), kt.reshape(B * S, -1, D), vt.reshape(B * S, -1, D),
                                     cu_seqlens, cu_seqlens, max_len, max_len, softmax_scale=scale, causal=True,
                                     window_size=sliding)
        return out.view(B, S, H, D).transpose(1, 2)[..., :dv]


def _cu_seqlens(doc: DocumentMask) -> tuple[torch.Tensor, int]:
    """Cumulative document lengths over the flattened [B·S] tokens (int32) and the longest
    document: the varlen kernel's inputs. One host read per micro-batch (cached in ``doc``)."""
    if "cu_seqlens" not in doc.cache:
        ids = doc.doc_ids[:, doc.positions]
        B, S = ids.shape
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        begin = starts.flatten().nonzero().flatten()  # the host read
        cu = torch.cat([begin, begin.new_tensor([B * S])]).to(torch.int32)
        doc.cache["cu_seqlens"] = (cu, int((cu[1:] - cu[:-1]).max()))
    return doc.cache["cu_seqlens"]


def attention_kernel(backend: str) -> Callable:
    """The kernel of ``model.attention_backend``.

    Raises:
        ValueError: an unknown backend.
    """
    if backend == "sdpa":
        return sdpa_attention
    if backend == "flex":
        return FlexAttention()
    if backend == "flash":
        return FlashAttention()
    raise ValueError(f"attention backend {backend!r}: expected one of {', '.join(ATTENTION_BACKENDS)}")

