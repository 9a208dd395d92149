"""Attention backends and document masking (moetrain.model.attention).

* The document mask is proved against the reference it stands for: a packed sample, with the
  mask and positions restarting per document, gives each document the logits it has when run
  alone (fp32, 1e-5); without position reset, SDPA with the mask equals attention computed one
  query at a time over the visible keys.
* flex_attention (forward only on CPU in torch 2.13) equals SDPA with and without documents.
* Ring attention (cp = 2) with a document mask equals full-sequence SDPA with the same mask,
  outputs and q/k/v gradients (1e-5).
* Attention sinks and sliding windows (GPT-OSS), alone, together, with documents and with values
  narrower than the keys (MLA), equal the masked softmax they are defined as — in the local
  kernels and in ring attention over cp = 2 and 4 with windows that cross the chunks —
  outputs and the q, k, v and sink gradients (1e-5 against a float64 reference).
* Training with ``data.document_mask`` under cp2, tp2 + SP and dp2 × ep2 gives the one-process
  losses and gradients (the test_equivalence tolerances), and the loader's document ids follow
  the shards' document index.
* GPU-only backends and unsupported combinations are refused before launch, naming what is
  missing.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moetrain.config import ConfigError, check_supported
from moetrain.data.reader import TokenShards
from moetrain.model.attention import DocumentMask, FlexAttention, positions_in_document, sdpa_attention
from moetrain.model.init import init_weights
from moetrain.model.transformer import Transformer
from moetrain.parallel.context import cp_gather, cp_positions, cp_shard, ring_attention

from conftest import ByteTokenizer, tiny_config
from multiproc import run_distributed
from test_equivalence import assert_matches, merged, train_and_capture

TOL = 1e-5


def _doc_ids(lengths: list[list[int]]) -> torch.Tensor:
    """[B, S] document ids from per-row document lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


def _qkv(B=2, H=4, G=2, S=24, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, S, D, generator=g) for h in (H, G, G)]


def test_positions_in_document():
    ids = _doc_ids([[3, 5, 2], [10]])
    assert positions_in_document(ids).tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1], list(range(10))]


def test_sdpa_document_mask_equals_per_query_reference():
    q, k, v = _qkv()
    doc = DocumentMask(_doc_ids([[5, 11, 8], [24]]), torch.arange(24))
    out = sdpa_attention(q, k, v, doc)
    ref = torch.empty_like(out)
    groups = q.shape[1] // k.shape[1]
    for b in range(2):
        for i in range(24):
            keys = [j for j in range(i + 1) if doc.doc_ids[b, j] == doc.doc_ids[b, i]]
            kk, vv = k[b, :, keys].repeat_interleave(groups, 0), v[b, :, keys].repeat_interleave(groups, 0)
            w = torch.softmax(q[b, :, i:i + 1] @ kk.transpose(-1, -2) / 8 ** 0.5, dim=-1)
            ref[b, :, i] = (w @ vv)[:, 0]
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
    # The row with one document is plain causal attention; the mask matters for the other.
    torch.testing.assert_close(out[1], F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[1])
    assert (out[0] - sdpa_attention(q, k, v)[0]).abs().max() > 1e-2


def test_packed_documents_equal_each_document_alone():
    """Document mask + positions reset: every document of a packed sample gets the logits it has
    when the model runs it alone."""
    cfg = tiny_config("unused", "unused", data={"document_mask": True, "reset_position_ids": True},
                      model={"seq_len": 32})
    model = Transformer.from_config(cfg)
    init_weights(model, 3, 0.02, cfg.model.layers)
    model.eval()  # MoE aux losses off; routing is per token either way
    lengths = [[7, 13, 12], [32]]
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed = model(tokens, doc_ids=_doc_ids(lengths))
        start = 0
        for n in lengths[0]:
            alone = model(tokens[:1, start:start + n])
            torch.testing.assert_close(packed[:1, start:start + n], alone, rtol=TOL, atol=TOL)
            start += n
        torch.testing.assert_close(packed[1:], model(tokens[1:]), rtol=TOL, atol=TOL)
        # Without the mask the later documents see their predecessors: different logits.
        assert (model(tokens[:1]) - packed[:1]).abs().max() > 1e-3


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("with_doc", [False, True])
def test_flex_forward_equals_sdpa(with_doc):
    q, k, v = _qkv(S=32)
    doc = DocumentMask(_doc_ids([[9, 23], [4, 4, 24]]), torch.arange(32)) if with_doc else None
    with torch.no_grad():
        torch.testing.assert_close(FlexAttention()(q, k, v, doc), sdpa_attention(q, k, v, doc), rtol=TOL, atol=TOL)


def _ring_with_docs(rank: int, cp: int) -> dict:
    S = 32
    q, k, v = (t.requires_grad_() for t in _qkv(S=S, seed=1))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    ids = _doc_ids([[3, 10, 19], [16, 16]])  # boundaries inside and across the cp chunks
    full = sdpa_attention(q, k, v, DocumentMask(ids, torch.arange(S)))
    full.backward(dout)
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    local = [cp_shard(t.detach(), rank, cp, 2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, dist.group.WORLD, doc=DocumentMask(ids, cp_positions(S, rank, cp)))
    out.backward(cp_shard(dout, rank, cp, 2))
    errs = {"out": (cp_gather(out.detach(), dist.group.WORLD, 2) - full.detach()).abs().max().item()}
    for name, t, ref in zip("qkv", local, ref_grads):
        errs[name] = (cp_gather(t.grad, dist.group.WORLD, 2) - ref).abs().max().item()
    return errs


def test_ring_attention_with_document_mask():
    for rank, errs in enumerate(run_distributed(_ring_with_docs, 2)):
        assert max(errs.values()) <= TOL, f"rank {rank}: {errs}"


# -- attention sinks and sliding windows ---------------------------------------------------------


def reference_attention(q, k, v, doc_ids=None, window=None, sinks=None, scale=None, chunk=None):
    """Causal attention as its definition: softmax over the visible keys (causal, within the
    window, in the same document, in the query's chunk of positions) and, with sinks, one extra
    logit per head whose value is zero (GPT-OSS; Xiao et al. 2023), computed one matrix at a time
    in float64."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    S = q.shape[2]
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    visible = (j <= i) & ((i - j < window) if window is not None else True)
    visible = visible & ((i // chunk == j // chunk) if chunk is not None else True)
    visible = visible[None, None].expand(q.shape[0], 1, S, S)
    if doc_ids is not None:
        visible = visible & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[None, :, None, None].expand(*scores.shape[:3], 1)], dim=-1)
    weights = torch.softmax(scores, dim=-1)[..., :S]
    return weights @ v


def _qkv_sinks(S=24, Dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 4, S, 8, generator=g), torch.randn(2, 2, S, 8, generator=g)
    v = torch.randn(2, 2, S, Dv, generator=g)
    sinks = torch.randn(4, generator=g)
    return q, k, v, sinks


SINK_CASES = [  # (window, sinks, documents, value width)
    (5, False, False, 8), (None, True, False, 8), (5, True, False, 8), (5, True, True, 8), (7, True, True, 6),
    (1, True, False, 8), (None, True, True, 6),
]


@pytest.mark.parametrize("window, with_sinks, with_docs, dv", SINK_CASES,
                         ids=[f"w{w}-sinks{int(s)}-docs{int(d)}-dv{v}" for w, s, d, v in SINK_CASES])
def test_sinks_and_window_equal_the_masked_softmax(window, with_sinks, with_docs, dv):
    """Outputs and the gradients of q, k, v and the sink logits equal the definition (1e-5)."""
    q, k, v, sinks = (t.requires_grad_() for t in _qkv_sinks(Dv=dv))
    ids = _doc_ids([[5, 11, 8], [24]]) if with_docs else None
    doc = DocumentMask(ids, torch.arange(24)) if with_docs else None
    out = sdpa_attention(q, k, v, doc, window=window, sinks=sinks if with_sinks else None, scale=0.3)
    ref = reference_attention(q, k, v, ids, window, sinks if with_sinks else None, scale=0.3)
    torch.testing.assert_close(out, ref.float(), rtol=TOL, atol=TOL)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    leaves = (q, k, v, sinks) if with_sinks else (q, k, v)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref, leaves, dout.double())
    for name, a, b in zip("qkvs", got, want):
        torch.testing.assert_close(a, b.float(), rtol=TOL, atol=TOL, msg=lambda m: f"d{name}: {m}")
    if window is not None:  # the window matters: full causal attention differs
        assert (out - sdpa_attention(q, k, v, doc, sinks=sinks if with_sinks else None, scale=0.3)).abs().max() > 1e-2


def _ring_sinks_window(rank: int, cp: int, window: int, with_docs: bool) -> dict:
    S = 32
    q, k, v, sinks = _qkv_sinks(S=S, Dv=6, seed=4)
    ids = _doc_ids([[3, 10, 19], [16, 16]]) if with_docs else None
    dout = torch.randn(2, 4, S, 6, generator=torch.Generator().manual_seed(2))
    leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    full = reference_attention(*leaves[:3], ids, window, leaves[3], scale=0.4)
    want = torch.autograd.grad(full, leaves, dout.double())
    local = [cp_shard(t, rank, cp, 2).requires_grad_() for t in (q, k, v)]
    s = sinks.clone().requires_grad_()
    doc = DocumentMask(ids, cp_positions(S, rank, cp)) if with_docs else None
    out = ring_attention(*local, dist.group.WORLD, doc=doc, window=window, sinks=s, scale=0.4)
    out.backward(cp_shard(dout, rank, cp, 2))
    errs = {"out": (cp_gather(out.detach(), dist.group.WORLD, 2).double() - full.detach()).abs().max().item()}
    for name, t, ref in zip("qkv", local, want):
        errs[name] = (cp_gather(t.grad, dist.group.WORLD, 2).double() - ref).abs().max().item()
    # Each rank's sink gradient is its queries' share: the sum over ranks is the whole one.
    dist.all_reduce(s.grad)
    errs["sinks"] = (s.grad.double() - want[3]).abs().max().item()
    return errs


@pytest.mark.parametrize("cp, window, with_docs", [(2, 5, True), (4, 6, False), (2, 40, False)],
                         ids=["cp2-w5-docs", "cp4-w6", "cp2-w40"])
def test_ring_attention_with_sinks_and_window(cp, window, with_docs):
    """Ring attention with sinks, a sliding window that spans chunk boundaries (or all of them),
    documents and values narrower than the keys equals the definition on the whole sequence."""
    for rank, errs in enumerate(run_distributed(_ring_sinks_window, cp, window, with_docs)):
        assert max(errs.values()) <= TOL, f"rank {rank}: {errs}"


# -- Llama 4's chunked attention ---------------------------------------------------------------


@pytest.mark.parametrize("chunk, with_docs", [(8, False), (8, True), (5, True)], ids=["c8", "c8-docs", "c5-docs"])
def test_chunked_attention_equals_the_masked_softmax(chunk, with_docs):
    """SDPA with ``chunk`` (and documents that cross the chunks) equals the definition, outputs
    and gradients; flex's forward equals it; the chunks matter."""
    q, k, v, _ = (t.requires_grad_() for t in _qkv_sinks())
    ids = _doc_ids([[5, 11, 8], [24]]) if with_docs else None
    doc = DocumentMask(ids, torch.arange(24)) if with_docs else None
    out = sdpa_attention(q, k, v, doc, chunk=chunk)
    ref = reference_attention(q, k, v, ids, chunk=chunk)
    torch.testing.assert_close(out, ref.float(), rtol=TOL, atol=TOL)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), dout),
                          torch.autograd.grad(ref, (q, k, v), dout.double())):
        torch.testing.assert_close(a, b.float(), rtol=TOL, atol=TOL, msg=lambda m: f"d{name}: {m}")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex without torch.compile (CPU, forward only)
        flex = FlexAttention()(q.detach(), k.detach(), v.detach(), doc, chunk=chunk)
        torch.testing.assert_close(flex, out.detach(), rtol=TOL, atol=TOL)
    assert (out - sdpa_attention(q, k, v, doc)).abs().max() > 1e-2


def _ring_chunks(rank: int, cp: int, chunk: int, with_docs: bool) -> dict:
    S = 32
    q, k, v, _ = _qkv_sinks(S=S, Dv=8, seed=5)
    ids = _doc_ids([[3, 10, 19], [16, 16]]) if with_docs else None
    dout = torch.randn(2, 4, S, 8, generator=torch.Generator().manual_seed(2))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    full = reference_attention(*leaves, ids, scale=0.4, chunk=chunk)
    want = torch.autograd.grad(full, leaves, dout.double())
    local = [cp_shard(t, rank, cp, 2).requires_grad_() for t in (q, k, v)]
    doc = DocumentMask(ids, cp_positions(S, rank, cp)) if with_docs else None
    out = ring_attention(*local, dist.group.WORLD, doc=doc, scale=0.4, chunk=chunk)
    out.backward(cp_shard(dout, rank, cp, 2))
    errs = {"out": (cp_gather(out.detach(), dist.group.WORLD, 2).double() - full.detach()).abs().max().item()}
    for name, t, ref in zip("qkv", local, want):
        errs[name] = (cp_gather(t.grad, dist.group.WORLD, 2).double() - ref).abs().max().item()
    return errs


@pytest.mark.parametrize("cp, chunk, with_docs", [(2, 12, True), (4, 6, False)], ids=["cp2-c12-docs", "cp4-c6"])
def test_ring_attention_with_chunks(cp, chunk, with_docs):
    """Ring attention with chunks that cross the ranks' shards (and documents) equals the
    definition on the whole sequence."""
    for rank, errs in enumerate(run_distributed(_ring_chunks, cp, chunk, with_docs)):
        assert max(errs.values()) <= TOL, f"rank {rank}: {errs}"


# -- training with document masks -------------------------------------------------------------


def test_loader_document_ids_follow_the_index(short_doc_shards):
    shards = TokenShards(short_doc_shards, "train", verify="size")
    for index in (0, 7, 100):
        tokens, ids = shards.sample(index, 64), shards.sample_document_ids(index, 64)
        assert ids[0] == 0 and ids[-1] > 1
        # Documents end with EOS: a new document starts right after each EOS, nowhere else.
        eos = tokens[:-1] == ByteTokenizer.eos_id
        assert ((ids[1:] - ids[:-1]) == eos).all()


DOC = {"document_mask": True, "reset_position_ids": True}
MODEL = {"seq_len": 64, "vocab_size": 260}


def doc_capture(rank: int, world: int, data: str, run_dir: str, parallel: dict, doc: dict = DOC) -> dict:
    return train_and_capture(rank, world, data, run_dir, parallel, model=MODEL, data_section=doc)


@pytest.fixture(scope="module")
def doc_reference(short_doc_shards, tmp_path_factory):
    return run_distributed(doc_capture, 1, str(short_doc_shards), str(tmp_path_factory.mktemp("doc-ref")), {})[0]


DOC_CASES = [({"cp": 2}, 2), ({"tp": 2, "sequence_parallel": True}, 2), ({"dp": 2, "ep": 2}, 2)]


@pytest.mark.parametrize("parallel, world", DOC_CASES, ids=["cp2", "tp2-sp", "dp2-ep2"])
def test_document_mask_layouts_match_single_process(parallel, world, doc_reference, short_doc_shards, tmp_path):
    results = run_distributed(doc_capture, world, str(short_doc_shards), str(tmp_path), parallel)
    assert_matches(merged(results), doc_reference)


def test_document_mask_changes_training(doc_reference, short_doc_shards, tmp_path):
    """The masked run is not the unmasked one (the comparisons above could not pass by accident):
    the attention projections' gradients differ by far more than the tolerance."""
    plain = run_distributed(doc_capture, 1, str(short_doc_shards), str(tmp_path), {}, {})[0]
    name = "layers.0.attention.wq.weight"
    ref = doc_reference["grads"][name]
    assert (plain["grads"][name] - ref).abs().max() > 0.05 * ref.abs().max()


# -- refusals before launch -------------------------------------------------------------------


@pytest.mark.parametrize("sections, device, field", [
    ({"model": {"attention_backend": "flex"}}, "cpu", "model.attention_backend"),
    ({"model": {"attention_backend": "flash"}}, "cpu", "model.attention_backend"),
    ({"model": {"attention_backend": "flash"}, "train": {"precision": "bf16"}}, "cuda", "flash-attn package"),
    ({"model": {"attention_backend": "flex"}, "parallel": {"cp": 2}}, "cuda", "context parallelism"),
    ({"moe": {"expert_backend": "megablocks"}}, "cpu", "CUDA only"),
    ({"moe": {"expert_backend": "megablocks"}, "train": {"precision": "bf16"}}, "cuda", "not installed"),
    ({"moe": {"expert_backend": "grouped_mm"}}, "cuda", "bf16"),
    # Llama 4's options, each refused with its field
    ({"model": {"attention_chunk_size": 8, "attention_backend": "flash"}}, "cpu", "model.attention_backend"),
    ({"model": {"attention_chunk_size": 8, "sliding_window": 4}}, "cpu", "model.attention_chunk_size"),
    ({"model": {"no_rope_layers": [1]}}, "cpu", "model.no_rope_layers"),
    ({"model": {"no_rope_layers": [1, 2]}}, "cpu", "model.no_rope_layers"),
    ({"model": {"no_rope_layers": [1, 0], "attention": "mla"}}, "cpu", "model.attention"),
    ({"model": {"attn_temperature_tuning": True, "floor_scale": 0}}, "cpu", "model.floor_scale"),
    ({"moe": {"apply_probs_on_input": True}}, "cpu", "moe.apply_probs_on_input"),
])
def test_unsupported_backends_are_refused(sections, device, field, tmp_path):
    # refused when the config is read (a layout rule, flex × cp) or when checked for the device
    with pytest.raises(ConfigError, match=field):
        check_supported(tiny_config(tmp_path, tmp_path, **sections), device)


def test_reset_positions_need_the_mask(tmp_path):
    with pytest.raises(ConfigError, match="data.reset_position_ids"):
        tiny_config(tmp_path, tmp_path, data={"reset_position_ids": True})
