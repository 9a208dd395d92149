"""Core-attention kernels and the document mask of packed sequences.

Shape legend: B batch, H query heads, G key/value heads (H % G == 0, grouped-query attention),
S the tokens this rank's attention sees, Dh head dim, S_full the whole sample.

A kernel maps (q [B, H, S, Dh], k [B, G, S, Dh], v [B, G, S, Dh], doc) → [B, H, S, Dh]: causal
attention, restricted to each token's own document when ``doc`` (a :class:`DocumentMask`) is
given. ``model.attention_backend`` chooses it (:func:`attention_kernel`):

* ``sdpa`` — ``F.scaled_dot_product_attention``: ``is_causal`` without documents, an explicit
  boolean mask [B, 1, S, S] (causal ∧ same document) with them. The reference path; every device.
* ``flex`` — ``torch.nn.attention.flex_attention`` with a block mask built from the same rule
  (``mask_mod``), compiled on CUDA, where fully masked blocks are skipped. torch 2.13 has no flex
  backward on CPU: there it serves forward-only use (validation, tests).
* ``flash`` — flash-attn (Dao 2023): ``flash_attn_func`` (causal) without documents,
  ``flash_attn_varlen_func`` over the packed documents (``cu_seqlens``) with them. CUDA, bf16 /
  fp16. The document boundaries are read to the host once per micro-batch (the varlen kernel
  takes ``max_seqlen`` as an integer).

Under context parallelism :mod:`moetrain.parallel.context` replaces the kernel with ring
attention, which takes the same :class:`DocumentMask`.

Document masking (Megatron's ``--reset-attention-mask``; the "intra-document" masking of
Llama 3 §3.2 and torchtitan): a token attends to earlier tokens of its own document only, so a
packed sample trains like its documents one by one; with ``data.reset_position_ids`` RoPE
positions also restart at every document (:func:`positions_in_document`).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("sdpa", "flex", "flash")


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

    def local_mask(self) -> torch.Tensor:
        """[B, 1, S, S] bool over the tokens this rank sees (SDPA's ``attn_mask``: True = attend)."""
        if "sdpa" not in self.cache:
            self.cache["sdpa"] = self.visible(self.positions, self.positions)[:, None]
        return self.cache["sdpa"]


def positions_in_document(doc_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document: doc_ids [B, S] → [B, S] int64 (0 at every
    document start and at the start of the sample), computed on the device."""
    S = doc_ids.shape[1]
    idx = torch.arange(S, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: DocumentMask | None = None
                   ) -> torch.Tensor:
    """Causal attention through ``F.scaled_dot_product_attention`` with GQA (kv heads broadcast);
    with ``doc``, the explicit causal ∧ same-document mask."""
    gqa = q.shape[1] != k.shape[1]
    if doc is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=doc.local_mask(), enable_gqa=gqa)


class FlexAttention:
    """``flex_attention`` with a causal (∧ same document) block mask; compiled on CUDA (eager
    flex materialises the scores), eager elsewhere (forward only on CPU in torch 2.13)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: DocumentMask | None = None
                 ) -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_block_mask

        B, S = q.shape[0], q.shape[2]
        key = ("flex", q.device)
        block_mask = doc.cache.get(key) if doc is not None else _causal_block_mask(S, str(q.device))
        if block_mask is None:
            ids, pos = doc.doc_ids, doc.positions

            def mask_mod(b, h, qi, ki):
                return (ids[b, pos[qi]] == ids[b, pos[ki]]) & (pos[ki] <= pos[qi])

            block_mask = doc.cache[key] = create_block_mask(mask_mod, B, None, S, S, device=q.device)
        return _flex(q.device.type)(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


@functools.lru_cache(maxsize=8)
def _causal_block_mask(S: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, S, S, device=device)


@functools.lru_cache(maxsize=2)
def _flex(device_type: str) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if device_type == "cuda" else flex_attention


class FlashAttention:
    """flash-attn's kernels (CUDA, bf16 / fp16): ``flash_attn_func`` causal, or
    ``flash_attn_varlen_func`` over the documents of the packed sample with ``doc``."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: DocumentMask | None = None
                 ) -> torch.Tensor:
        from flash_attn import flash_attn_func, flash_attn_varlen_func

        # flash-attn's layout is [B, S, heads, Dh]; GQA is native.
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        if doc is None:
            return flash_attn_func(qt, kt, vt, causal=True).transpose(1, 2)
        B, S, H, Dh = qt.shape
        cu_seqlens, max_len = _cu_seqlens(doc)
        out = flash_attn_varlen_func(qt.reshape(B * S, H, Dh), kt.reshape(B * S, -1, Dh), vt.reshape(B * S, -1, Dh),
                                     cu_seqlens, cu_seqlens, max_len, max_len, causal=True)
        return out.view(B, S, H, Dh).transpose(1, 2)


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


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None
