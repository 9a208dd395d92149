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

import functools
import importlib.util
import math
from typing import Literal

import torch
import torch.distributed as dist

from moetrain.model.attention import DocumentMask
from moetrain.parallel.peers import waiting_on_peers

__all__ = ["cp_shard", "cp_unshard", "cp_positions", "cp_gather", "ring_attention", "apply_context_parallel"]

Kernel = Literal["auto", "cpu_flash", "flash_attn", "math"]

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


# ---------------------------------------------------------------------------------------------
# 2. Per-block attention kernels: (out, lse) forward; backward given the *global* out and lse
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


def _cpu_flash_fwd(q, k, v, causal, scale):
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not _cpu_flash_native_gqa():
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _cpu_flash_bwd(dout, q, k, v, out, lse, causal, scale):
    groups = q.shape[1] // k.shape[1]
    expand = groups > 1 and not _cpu_flash_native_gqa()
    if expand:
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if expand:
        dk, dv = _reduce_kv_grad(dk, groups), _reduce_kv_grad(dv, groups)
    return dq, dk, dv


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
    b, hq, sq, d = q.shape
    _, s = _math_scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    # A row with no visible key in this block (a document mask can do that) has lse = -inf: its
    # output is 0 and its lse stays -inf, which the log-sum-exp merge then ignores.
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    out = p @ v.to(s.dtype).unsqueeze(2)
    return out.reshape(b, hq, sq, d).to(q.dtype), lse.reshape(b, hq, sq)


def _math_bwd(dout, q, k, v, out, lse, causal, scale, mask=None):
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    q5, s = _math_scores(q, k, causal, scale, mask)
    acc = s.dtype
    shape5 = (b, hkv, hq // hkv, sq, d)
    do5, o5 = dout.to(acc).reshape(shape5), out.to(acc).reshape(shape5)
    k5, v5 = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
    p = torch.exp(s - lse.to(acc).reshape(shape5[:-1]).unsqueeze(-1))
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

    out, lse, _ = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out.transpose(1, 2), lse


# kernel name → (forward, backward). flash-attn exposes no public backward that takes a given
# (global) lse, so its blocks use the math backward, which is exact with any forward.
_KERNELS = {
    "cpu_flash": (_cpu_flash_fwd, _cpu_flash_bwd),
    "math": (_math_fwd, _math_bwd),
    "flash_attn": (_flash_attn_fwd, _math_bwd),
}


def _pick_kernel(kernel: Kernel, q: torch.Tensor) -> str:
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


def _block_fwd(kernel, q, k, v, causal, scale, mask=None):
    """Attention of queries ``q`` [B, Hq, Sq, D] over one K/V block [B, Hkv, Sk, D].
    Returns ``out`` [B, Hq, Sq, D] (input dtype) and ``lse`` [B, Hq, Sq] (accumulation dtype).
    With a ``mask`` ([B, Sq, Sk] bool) the math kernel runs (the flash kernels take none)."""
    if mask is not None:
        return _math_fwd(q, k, v, causal, scale, mask)
    out, lse = _KERNELS[kernel][0](q, k, v, causal, scale)
    return out, lse.to(_acc_dtype(q.dtype))


def _block_bwd(kernel, dout, q, k, v, out, lse, causal, scale, mask=None):
    """Gradients of one block given the global ``out`` and ``lse`` of these query rows."""
    if mask is not None:
        return _math_bwd(dout, q, k, v, out, lse, causal, scale, mask)
    return _KERNELS[kernel][1](dout, q, k, v, out, lse, causal, scale)


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
    """Document masks of the (query, K/V block) pairs of the ring, restricted to the visible part
    that :func:`_visible_part` selects; ``None`` everywhere without a document mask."""

    def __init__(self, doc: DocumentMask | None, ring: "_Ring", local_len: int):
        self.doc, self.ring, self.c = doc, ring, local_len // 2

    def __call__(self, src: int, part: str) -> torch.Tensor | None:
        if self.doc is None:
            return None
        doc, c = self.doc, self.c
        q_pos = doc.positions
        key = ("ring_kv_positions", src)
        if key not in doc.cache:
            doc.cache[key] = cp_positions(doc.doc_ids.shape[1], src, self.ring.size, doc.doc_ids.device)
        k_pos = doc.cache[key]
        if part == _DIAGONAL:  # causal part: the kernel's own causal flag applies too
            return doc.visible(q_pos, k_pos)
        if part == _KV_FIRST:
            return doc.same_document(q_pos, k_pos[:c])
        if part == _Q_SECOND:
            return doc.same_document(q_pos[c:], k_pos)
        return doc.same_document(q_pos, k_pos)


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
            blk_out, blk_lse = _block_fwd(kernel, q, kv[0], kv[1], part == _DIAGONAL, scale, mask)
        elif part == _KV_FIRST:
            blk_out, blk_lse = _block_fwd(kernel, q, kv[0, :, :, :c], kv[1, :, :, :c], False, scale, mask)
        else:  # _Q_SECOND
            rows = slice(c, None)
            blk_out, blk_lse = _block_fwd(kernel, q[:, :, rows], kv[0], kv[1], False, scale, mask)
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
            g = _block_bwd(kernel, dout, q, kv[0], kv[1], out, lse, part == _DIAGONAL, scale, mask)
            dq += g[0]
            dkv[0] += g[1]
            dkv[1] += g[2]
        elif part == _KV_FIRST:
            g = _block_bwd(kernel, dout, q, kv[0, :, :, :c], kv[1, :, :, :c], out, lse, False, scale, mask)
            dq += g[0]
            dkv[0, :, :, :c] += g[1]
            dkv[1, :, :, :c] += g[2]
        else:  # _Q_SECOND
            g = _block_bwd(kernel, dout[:, :, c:], q[:, :, c:], kv[0], kv[1], out[:, :, c:],
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
    def forward(ctx, q, k, v, group, causal, scale, kernel, doc):
        ring = _Ring(group)
        masks = _BlockMasks(doc, ring, q.shape[2])
        out, lse = _ring_forward(ring, kernel, q, k, v, causal, scale, masks)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.kernel, ctx.causal, ctx.scale, ctx.masks = ring, kernel, causal, scale, masks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.ring, ctx.kernel, dout.contiguous(), q, k, v, out, lse,
                                    ctx.causal, ctx.scale, ctx.masks)
        return dq, dk, dv, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, *,
                   causal: bool = True, scale: float | None = None, kernel: Kernel = "auto",
                   doc: DocumentMask | None = None) -> torch.Tensor:
    """Exact attention over the sequence split across the ranks of ``group`` (ring attention).

    Args:
        q: [B, Hq, Sl, D], this rank's queries in the load-balanced layout of :func:`cp_shard`
            (after RoPE with :func:`cp_positions`).
        k, v: [B, Hkv, Sl, D], same layout; ``Hq`` a multiple of ``Hkv`` (grouped-query
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

    Returns:
        out [B, Hq, Sl, D] in q's dtype, the same layout; differentiable w.r.t. q, k, v.

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
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"expected q [B, Hq, Sl, D] and k, v [B, Hkv, Sl, D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, hq, sl, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, sl, d) or hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} disagree: need the same B, Sl, D "
                         "and Hq divisible by Hkv")
    cp_size = dist.get_world_size(group)
    if causal and cp_size > 1 and sl % 2:
        raise ValueError(f"local sequence length {sl} is odd: the causal layout holds two equal chunks "
                         f"(shard with cp_shard; the full length must be divisible by 2 × cp = {2 * cp_size})")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, causal, scale, _pick_kernel(kernel, q), doc)


class RingAttentionKernel:
    """The attention kernel of :class:`moetrain.model.layers.Attention` under context
    parallelism: (q [B, Hq, Sl, D], k/v [B, Hkv, Sl, D]) → [B, Hq, Sl, D], causal."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: DocumentMask | None = None
                 ) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, causal=True, doc=doc)


def apply_context_parallel(model: torch.nn.Module, group: dist.ProcessGroup, seq_len: int) -> None:
    """Run every attention of ``model`` (a :class:`moetrain.model.transformer.Transformer`
    or a pipeline part of one) as ring attention over ``group`` and give RoPE the global
    positions of this rank's two chunks. The data loader must hand this rank the same chunks
    (:func:`cp_shard` along the sequence)."""
    from moetrain.model.layers import Attention

    kernel = RingAttentionKernel(group)
    for module in model.modules():
        if isinstance(module, Attention):
            module.kernel = kernel
    cp_rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
    model.positions = cp_positions(seq_len, cp_rank, cp_size)
