"""Context parallelism: load-balanced causal sequence sharding and ring attention.

The sequence of attention is split over the ``cp`` ranks of a process group. Each rank holds
its queries; key/value blocks travel around the ring, and each rank merges the partial
attention of every block it sees by the blocks' log-sum-exp.

Shape legend: ``B`` batch, ``Hq`` query heads, ``Hkv`` key/value heads (``Hq % Hkv == 0``,
grouped-query attention), ``S`` full sequence, ``Sl = S / cp`` local sequence,
``c = S / (2 cp)`` chunk length, ``D`` head dim.

Layout (Megatron-CP, torchtitan; Brandon et al. 2023 "Striped Attention" §3 for why causal
attention needs balancing): the sequence is cut into ``2 cp`` chunks and cp rank ``r`` holds
chunk ``r`` then chunk ``2 cp - 1 - r``, one early and one late. Under a causal mask every rank
then has the same amount of visible work at every ring step:

* step 0, own K/V: causal attention over the local ``[chunk r | chunk 2cp-1-r]`` sequence is
  exactly the global causal mask restricted to these chunks;
* K/V of rank ``s < r``: all local queries see the first K/V chunk (``s``), none the second;
* K/V of rank ``s > r``: only the second query chunk (``2cp-1-r``) sees them, fully.

Invisible blocks are skipped entirely (no compute). Sources: online softmax, Milakov &
Gimelshein 2018; blockwise merge by log-sum-exp, Dao et al. 2022 (FlashAttention) §3.1; ring
attention, Liu et al. 2023 "Ring Attention with Blockwise Transformers"; zig-zag layout,
zhuzilin/ring-flash-attention.

Public API: :func:`cp_shard`, :func:`cp_unshard`, :func:`cp_positions`, :func:`cp_gather`,
:func:`ring_attention`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from moetrain.model.attention import (DocumentMask, Kernel, _acc_dtype, block_backward, block_forward, merge_sinks,
                                      pick_kernel, sink_grad, within_chunk, within_window)
from moetrain.parallel.peers import waiting_on_peers

__all__ = ["cp_shard", "cp_unshard", "cp_positions", "cp_gather", "ring_attention", "HeadAllToAll",
           "apply_context_parallel"]

# ---------------------------------------------------------------------------------------------
# 1. Load-balanced sharding of the sequence
# ---------------------------------------------------------------------------------------------


def _check_split(seq_len: int, cp_rank: int, cp_size: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must lie in [0, cp_size={cp_size}) and cp_size >= 1")
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2 × cp = {2 * cp_size} "
                         "(the load-balanced layout cuts it into 2·cp chunks)")


def _chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two global chunk indices held by ``cp_rank``: one early, one late."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_shard(x: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int) -> torch.Tensor:
    """This rank's part of ``x`` in the load-balanced layout.

    ``x``: any tensor whose dim ``seq_dim`` has the full length ``S``. Returns a new contiguous
    tensor with ``S / cp`` along ``seq_dim``: chunk ``cp_rank`` then chunk ``2·cp − 1 − cp_rank``
    of ``2·cp`` equal chunks. Raises ``ValueError`` if ``S`` is not divisible by ``2·cp``.
    """
    _check_split(x.shape[seq_dim], cp_rank, cp_size)
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    first, second = _chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=seq_dim)


def cp_unshard(x_ranks: torch.Tensor, cp_size: int, seq_dim: int) -> torch.Tensor:
    """Inverse of :func:`cp_shard` over all ranks: back to the natural sequence order.

    ``x_ranks``: the local parts of ranks ``0 .. cp−1`` concatenated in rank order along
    ``seq_dim`` (length ``S``). Returns the same data in global position order. Raises
    ``ValueError`` if ``S`` is not divisible by ``2·cp``.
    """
    _check_split(x_ranks.shape[seq_dim], 0, cp_size)
    held = x_ranks.chunk(2 * cp_size, dim=seq_dim)  # held[2r], held[2r+1]: rank r's two chunks
    by_position = [None] * (2 * cp_size)
    for r in range(cp_size):
        first, second = _chunk_ids(r, cp_size)
        by_position[first], by_position[second] = held[2 * r], held[2 * r + 1]
    return torch.cat(by_position, dim=seq_dim)


def cp_positions(seq_len: int, cp_rank: int, cp_size: int, device: torch.device | str | None = None
                 ) -> torch.Tensor:
    """Global positions (``LongTensor[S / cp]``) of the tokens this rank holds after
    :func:`cp_shard`; feed them to RoPE. Raises ``ValueError`` if ``seq_len % (2·cp) != 0``."""
    _check_split(seq_len, cp_rank, cp_size)
    c = seq_len // (2 * cp_size)
    first, second = _chunk_ids(cp_rank, cp_size)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def cp_gather(x_local: torch.Tensor, group: dist.ProcessGroup, seq_dim: int) -> torch.Tensor:
    """All-gather every rank's local part over ``group`` and return the full sequence in natural
    order (``S = cp · Sl`` along ``seq_dim``). A collective: every rank of ``group`` must call
    it. No autograd; meant for tests, evaluation and logging."""
    cp_size = dist.get_world_size(group)
    parts = [torch.empty_like(x_local, memory_format=torch.contiguous_format) for _ in range(cp_size)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    return cp_unshard(torch.cat(parts, dim=seq_dim), cp_size, seq_dim)


class _SequenceGather(torch.autograd.Function):
    """Forward: every cp rank's [B, Sl, ...] → the whole sample [B, S, ...] in sequence order
    (all-gather, then the load-balanced layout undone). Backward: this rank's slice of the sum of
    every rank's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return cp_gather(x, group, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # An all-reduce, then this rank's slice (gloo has no reduce-scatter); the tensor is the
        # indexer's one-head keys, small beside the attention's own traffic.
        group = ctx.group
        total = grad.contiguous()
        dist.all_reduce(total, group=group)
        return cp_shard(total, dist.get_rank(group), dist.get_world_size(group), 1).contiguous(), None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole sample from this rank's part, differentiable: x [B, Sl, ...] → [B, cp · Sl,
    ...] in sequence order (its gradient sums every rank's). A collective over ``group``."""
    return _SequenceGather.apply(x, group)


# ---------------------------------------------------------------------------------------------
# 3. Ring communication and block visibility
# ---------------------------------------------------------------------------------------------

_TAG_KV, _TAG_DKV = 0, 1


class _Ring:
    """Neighbours of this rank on the ring of ``group``; data moves rank r → r + 1."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Start sending ``send`` to the next rank and receiving a same-shaped tensor from the
        previous one; returns the receive buffer and the handles to wait on."""
        recv = torch.empty_like(send)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ])
        return recv, works


def _wait(works: list) -> None:
    with waiting_on_peers():
        for w in works:
            w.wait()


# Which part of the (local queries × block of rank `src`) product is visible; see module doc.
_ALL, _DIAGONAL, _KV_FIRST, _Q_SECOND = "all", "diagonal", "kv_first", "q_second"


def _visible_part(rank: int, src: int, causal: bool) -> str:
    if not causal:
        return _ALL
    if src == rank:
        return _DIAGONAL
    return _KV_FIRST if src < rank else _Q_SECOND


# ---------------------------------------------------------------------------------------------
# 4. Ring attention: forward and backward passes
# ---------------------------------------------------------------------------------------------


def _merge_(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """In place: fold one block's normalised output and lse into the running ones.
    lse' = log(e^lse + e^lse_blk); out' = out·e^(lse − lse') + out_blk·e^(lse_blk − lse')
    (online softmax, Milakov & Gimelshein 2018, eq. 4; logaddexp keeps it finite)."""
    new_lse = torch.logaddexp(lse, blk_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    out.add_(blk_out.to(out.dtype) * torch.exp(blk_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


class _BlockMasks:
    """Masks of the (query, K/V block) pairs of the ring — document mask, sliding window and
    attention chunks — restricted to the visible part that :func:`_visible_part` selects;
    ``None`` everywhere without any of them."""

    def __init__(self, doc: DocumentMask | None, window: int | None, ring: "_Ring", local_len: int, seq_len: int,
                 device: torch.device, chunk: int | None = None, select: torch.Tensor | None = None):
        self.doc, self.window, self.chunk, self.ring, self.c = doc, window, chunk, ring, local_len // 2
        self.select = select  # [B, Sl, S] bool over the sample's key positions (DSA), or None
        self.seq_len, self.device = seq_len, device
        self.positions: dict[int, torch.Tensor] = {}

    def _pos(self, rank: int) -> torch.Tensor:
        if rank not in self.positions:
            self.positions[rank] = cp_positions(self.seq_len, rank, self.ring.size, self.device)
        return self.positions[rank]

    def __call__(self, src: int, part: str) -> torch.Tensor | None:
        if self.doc is None and self.window is None and self.chunk is None and self.select is None:
            return None
        q_pos, k_pos, c = self._pos(self.ring.rank), self._pos(src), self.c
        if part == _KV_FIRST:
            k_pos = k_pos[:c]
        elif part == _Q_SECOND:
            q_pos = q_pos[c:]
        if self.doc is not None:  # the diagonal block's causal part: the kernel's causal flag applies too
            mask = self.doc.visible(q_pos, k_pos) if part == _DIAGONAL else self.doc.same_document(q_pos, k_pos)
        else:
            mask = (k_pos[None, :] <= q_pos[:, None])[None]
        if self.window is not None:
            mask = mask & within_window(q_pos, k_pos, self.window)
        if self.select is not None:
            rows = self.select[:, c:] if part == _Q_SECOND else self.select
            mask = mask & rows[:, :, k_pos]
        return mask if self.chunk is None else mask & within_chunk(q_pos, k_pos, self.chunk)


def _ring_forward(ring, kernel, q, k, v, causal, scale, masks):
    """Returns ``out`` [B, Hq, Sl, D] in q's dtype and ``lse`` [B, Hq, Sl] (accumulation dtype)."""
    c = q.shape[2] // 2
    kv = torch.stack([k, v])  # one message per step instead of two
    out = lse = None
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        # 1. Start fetching the next K/V block so the transfer overlaps this block's compute.
        if step + 1 < ring.size:
            kv_next, works = ring.exchange(kv, _TAG_KV)
        # 2. Attention over the visible part of this block.
        part = _visible_part(ring.rank, src, causal)
        mask = masks(src, part)
        rows = slice(None)
        if part in (_ALL, _DIAGONAL):
            blk_out, blk_lse = block_forward(kernel, q, kv[0], kv[1], part == _DIAGONAL, scale, mask)
        elif part == _KV_FIRST:
            blk_out, blk_lse = block_forward(kernel, q, kv[0, :, :, :c], kv[1, :, :, :c], False, scale, mask)
        else:  # _Q_SECOND
            rows = slice(c, None)
            blk_out, blk_lse = block_forward(kernel, q[:, :, rows], kv[0], kv[1], False, scale, mask)
        # 3. Merge by lse. Step 0 (own block) covers every row, so it initialises the accumulators.
        if out is None:
            out = blk_out.to(_acc_dtype(q.dtype), copy=True)
            lse = blk_lse.contiguous().clone()
        else:
            _merge_(out[:, :, rows], lse[:, :, rows], blk_out, blk_lse)
        # 4. The next block must have arrived before the next step uses it.
        if step + 1 < ring.size:
            _wait(works)
            kv = kv_next
    return out.to(q.dtype), lse


def _ring_backward(ring, kernel, dout, q, k, v, out, lse, causal, scale, masks):
    """Returns dq, dk, dv for this rank's q, k, v. K/V travel the ring again (as in forward);
    each K/V block's dK/dV accumulator travels one step behind it, collects every rank's
    contribution, and after ``cp`` hops arrives back at the rank that owns the block."""
    c = q.shape[2] // 2
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    dkv_in = dkv_works = None
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        # 1. Start fetching the next K/V block (overlaps this step's compute).
        if step + 1 < ring.size:
            kv_next, kv_works = ring.exchange(kv, _TAG_KV)
        # 2. This rank's contribution to dq and to the current block's dK/dV.
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        part = _visible_part(ring.rank, src, causal)
        mask = masks(src, part)
        if part in (_ALL, _DIAGONAL):
            g = block_backward(kernel, dout, q, kv[0], kv[1], out, lse, part == _DIAGONAL, scale, mask)
            dq += g[0]
            dkv[0] += g[1]
            dkv[1] += g[2]
        elif part == _KV_FIRST:
            g = block_backward(kernel, dout, q, kv[0, :, :, :c], kv[1, :, :, :c], out, lse, False, scale, mask)
            dq += g[0]
            dkv[0, :, :, :c] += g[1]
            dkv[1, :, :, :c] += g[2]
        else:  # _Q_SECOND
            g = block_backward(kernel, dout[:, :, c:], q[:, :, c:], kv[0], kv[1], out[:, :, c:],
                           lse[:, :, c:].contiguous(), False, scale, mask)
            dq[:, :, c:] += g[0]
            dkv[0] += g[1]
            dkv[1] += g[2]
        # 3. Add what the previous ranks accumulated for this block (sent last step), pass it on.
        if ring.size == 1:
            return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        if step > 0:
            _wait(dkv_works)
            dkv += dkv_in
        dkv_in, dkv_works = ring.exchange(dkv, _TAG_DKV)
        # 4. The next K/V block must have arrived before the next step.
        if step + 1 < ring.size:
            _wait(kv_works)
            kv = kv_next
    # 5. After cp hops our own block's accumulator, holding every rank's share, is back.
    _wait(dkv_works)
    return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Forward: K/V blocks go around the ring (cp − 1 point-to-point hops, each overlapped with
    one block's attention); partial outputs are merged by log-sum-exp. Saves q, k, v, the local
    output and its lse.

    Backward: K/V go around the ring again; every rank adds its dq share locally and its
    dK/dV share to the accumulator travelling with each block, which returns to the block's
    owner after cp hops (Liu et al. 2023, §3). No autograd through the communication."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, causal, scale, kernel, doc, window, chunk, select):
        ring = _Ring(group)
        masks = _BlockMasks(doc, window, ring, q.shape[2], q.shape[2] * ring.size, q.device, chunk, select)
        out, lse = _ring_forward(ring, kernel, q, k, v, causal, scale, masks)
        if sinks is not None:  # one more key per head, with a zero value (moetrain.model.attention)
            out, lse = merge_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ring, ctx.kernel, ctx.causal, ctx.scale, ctx.masks = ring, kernel, causal, scale, masks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = _ring_backward(ctx.ring, ctx.kernel, dout, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.masks)
        dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None else None
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, *,
                   causal: bool = True, scale: float | None = None, kernel: Kernel = "auto",
                   doc: DocumentMask | None = None, window: int | None = None,
                   sinks: torch.Tensor | None = None, chunk: int | None = None,
                   select: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention over the sequence split across the ranks of ``group`` (ring attention).

    Args:
        q: [B, Hq, Sl, D], this rank's queries in the load-balanced layout of :func:`cp_shard`
            (after RoPE with :func:`cp_positions`).
        k, v: [B, Hkv, Sl, D] and [B, Hkv, Sl, Dv] (Dv ≤ D: MLA's values are narrower; they travel
            padded with zeros), same layout; ``Hq`` a multiple of ``Hkv`` (grouped-query
            attention: query head h reads K/V head ``h // (Hq / Hkv)``). K/V travel the ring
            un-expanded; the CPU flash kernel takes GQA natively (older torch: the kernel's
            inputs are expanded locally per block, the messages stay small).
        group: the cp process group (e.g. ``ParallelState.group("cp")``); every rank of it must
            call with the same shapes. A group of one rank is plain local attention.
        causal: causal mask over global positions; ``False`` for full attention.
        scale: softmax scale; default ``1 / sqrt(D)``.
        kernel: per-block kernel. ``auto`` picks ``cpu_flash``
            (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) on CPU,
            ``flash_attn`` (flash-attn's ``flash_attn_func`` forward, math backward) on CUDA
            fp16/bf16 when importable, else ``math`` (matmul + logsumexp in fp32).
        doc: a document mask (:class:`moetrain.model.attention.DocumentMask`: document ids of
            the whole samples and this rank's positions, those of :func:`cp_positions`): each
            query sees only keys of its own document. Its blocks run on the ``math`` kernel with
            the mask (the flash kernels take none); rows of a block that see no key there give
            nothing to the merge.
        window: each query sees the last ``window`` positions only (sliding window, over global
            positions; its blocks run on the ``math`` kernel with the mask).
        sinks: [Hq] per-head sink logits joining every row's softmax, merged once after the ring
            (:func:`moetrain.model.attention.merge_sinks`).
        chunk: each query sees the keys of its own chunk of ``chunk`` global positions only
            (Llama 4's chunked attention; the chunks cross the ranks' shards; its blocks run on
            the ``math`` kernel with the mask).
        select: [B, Sl, S] bool, the keys (by sample position) each of this rank's queries may
            see besides the causal rule (DSA's top-k selection, :mod:`moetrain.model.dsa`; its
            blocks run on the ``math`` kernel with the mask).

    Returns:
        out [B, Hq, Sl, Dv] in q's dtype, the same layout; differentiable w.r.t. q, k, v, sinks.

    Communication (every rank sends to rank + 1 and receives from rank − 1 at each hop): forward,
    ``cp − 1`` hops of one K/V block, ``2·B·Hkv·Sl·D`` elements in the input dtype; backward,
    the same ``cp − 1`` K/V hops plus ``cp`` hops of the dK/dV accumulator (same element count,
    fp32). Memory: two K/V blocks in flight; fp32 accumulators for out and lse (forward), dq and
    dK/dV (backward).

    Raises:
        ValueError: ``group`` is None, shapes disagree, ``Hq % Hkv != 0``, or ``causal`` with
            ``cp > 1`` and an odd ``Sl`` (the layout needs two equal chunks), or an unknown
            ``kernel``.
    """
    if group is None:
        raise ValueError("group is None: pass the cp process group explicitly")
    if q.dim() != 4 or k.shape[:3] != v.shape[:3] or k.dim() != 4 or v.shape[3] > k.shape[3]:
        raise ValueError(f"expected q [B, Hq, Sl, D], k [B, Hkv, Sl, D] and v [B, Hkv, Sl, Dv <= D]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, hq, sl, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, sl, d) or hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} disagree: need the same B, Sl, D "
                         "and Hq divisible by Hkv")
    cp_size = dist.get_world_size(group)
    if causal and cp_size > 1 and sl % 2:
        raise ValueError(f"local sequence length {sl} is odd: the causal layout holds two equal chunks "
                         f"(shard with cp_shard; the full length must be divisible by 2 × cp = {2 * cp_size})")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dv = v.shape[3]
    if dv < d:  # K and V travel as one message of one width
        v = torch.nn.functional.pad(v, (0, d - dv))
    out = _RingAttention.apply(q, k, v, sinks, group, causal, scale, pick_kernel(kernel, q), doc, window, chunk,
                               select)
    return out[..., :dv] if dv < d else out


class RingAttentionKernel:
    """The attention kernel of :class:`moetrain.model.layers.Attention` (and MLA) under context
    parallelism: (q [B, Hq, Sl, D], k [B, Hkv, Sl, D], v [B, Hkv, Sl, Dv]) → [B, Hq, Sl, Dv],
    causal; the keyword arguments of :mod:`moetrain.model.attention`'s kernels."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: DocumentMask | None = None, *,
                 scale: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None,
                 chunk: int | None = None, select: torch.Tensor | None = None) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, causal=True, doc=doc, scale=scale, window=window, sinks=sinks,
                              chunk=chunk, select=select)


class HeadAllToAll:
    """A token mixer's tokens exchanged for its heads over the cp ranks of ``group`` (the
    :class:`moetrain.model.gated_deltanet.HeadExchange` of gated DeltaNet): each rank gives every
    other the heads it will hold, for the tokens it holds, so that it holds the whole sequence of
    1/cp of the heads (Ulysses, Jacobs et al. 2023), and back. One autograd all-to-all each way
    (``torch.distributed.nn.functional.all_to_all_single``: its backward is the reverse
    exchange) of equal pieces: (cp − 1)/cp of the tensor leaves the rank."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def _exchange(self, send: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        send = send.contiguous()  # equal pieces along dim 0, each contiguous (so is the output)
        return all_to_all_single(torch.empty_like(send), send, group=self.group)

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, Sl, H, W] this rank's two chunks, every head → [B, S, H/cp, W], the whole
        sequence in position order, heads rank·H/cp …"""
        B, Sl, H, W = x.shape
        cp = self.size
        send = x.reshape(B, Sl, cp, H // cp, W).permute(2, 0, 1, 3, 4)  # piece c: rank c's heads
        recv = self._exchange(send)  # piece r: rank r's tokens of my heads
        return cp_unshard(recv.permute(1, 0, 2, 3, 4).reshape(B, cp * Sl, H // cp, W), cp, seq_dim=1)

    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """y: [B, S, h, W] (this rank's h heads, the whole sequence) → [B, Sl, cp·h, W], this
        rank's tokens of every rank's heads, in head order."""
        B, S, h, W = y.shape
        cp = self.size
        send = torch.stack([cp_shard(y, r, cp, seq_dim=1) for r in range(cp)])  # piece r: rank r's tokens
        recv = self._exchange(send)  # piece c: rank c's heads of my tokens
        return recv.permute(1, 2, 0, 3, 4).reshape(B, S // cp, cp * h, W)


def apply_context_parallel(model: torch.nn.Module, group: dist.ProcessGroup, seq_len: int) -> None:
    """Run every attention of ``model`` (a :class:`moetrain.model.transformer.Transformer`
    or a pipeline part of one) as ring attention over ``group``, every gated-DeltaNet, KDA or Mamba-2
    layer on the whole sequence of some of its heads / groups (:class:`HeadAllToAll`), and give RoPE the global
    positions of this rank's two chunks. The data loader must hand this rank the same chunks
    (:func:`cp_shard` along the sequence)."""
    from moetrain.model.gated_deltanet import GatedDeltaNet
    from moetrain.model.kda import KimiDeltaAttention
    from moetrain.model.layers import Attention
    from moetrain.model.mamba2 import Mamba2
    from moetrain.model.mla import MLAttention

    kernel = RingAttentionKernel(group)
    heads = HeadAllToAll(group)
    for module in model.modules():
        if isinstance(module, (Attention, MLAttention)):
            module.kernel = kernel
        elif isinstance(module, (GatedDeltaNet, KimiDeltaAttention, Mamba2)):
            module.context = heads
    cp_rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
    model.positions = cp_positions(seq_len, cp_rank, cp_size)


def apply_indexer_parallel(model: torch.nn.Module, ps, seq_len: int) -> None:
    """Give every DSA indexer of ``model`` its :class:`~moetrain.model.dsa.IndexerParallel`:
    under cp its keys (and, without gradient, the attention's keys for its loss) gathered over the
    cp ranks, its queries at this rank's positions, its loss share scaled by cp (the gradient
    reduction averages over cp); under tp the attention's probabilities summed over the tp ranks,
    which hold the other heads. ``ps``: the :class:`~moetrain.parallel.state.ParallelState`."""
    from moetrain.model.dsa import Indexer, IndexerParallel
    from moetrain.parallel.state import CP, TP
    from moetrain.parallel.tensor import AllReduceSum

    cp, tp = ps.size(CP), ps.size(TP)
    group, tp_group = ps.group(CP) if cp > 1 else None, ps.group(TP) if tp > 1 else None
    par = IndexerParallel(
        gather_seq=(lambda x: gather_sequence(x, group)) if cp > 1 else None,
        positions=cp_positions(seq_len, dist.get_rank(group), cp) if cp > 1 else None, cp=cp,
        sum_heads=(lambda p: AllReduceSum.apply(p, tp_group)) if tp > 1 else None)
    for module in model.modules():
        if isinstance(module, Indexer):
            module.parallel = par
