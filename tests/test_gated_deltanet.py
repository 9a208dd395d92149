"""Gated DeltaNet (moetrain/model/gated_deltanet.py): the chunked delta rule against the
recurrent form it computes and against transformers' own torch paths; the layer against
Qwen3-Next's; packed documents against each document alone; and a hybrid model (gated DeltaNet and
gated attention blocks, Qwen3-Next's) trained in dp × ep, pp × dp × ep, ZeRO-3 with full
recomputation, HSDP, context parallel, tensor + sequence parallel and expert-tensor parallel
(with and without documents) equal to one process over 20 steps (tests/test_architectures.py's
tolerances). Layouts whose tp or cp does not divide the key heads are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.model.attention import DocumentMask
from moetrain.model.gated_deltanet import (GatedDeltaNet, chunk_gated_delta_rule, conv_channels_in_hf_order,
                                          recurrent_gated_delta_rule)

from conftest import tiny_config
from multiproc import run_distributed
from test_equivalence import assert_layout_matches, layout_world, train_layout

B, S, HK, HV, DK, DV = 2, 37, 2, 4, 8, 6  # S not a multiple of the chunk: the last chunk is short


def _inputs(seed: int = 0, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(B, S, HK, DK, generator=g), torch.randn(B, S, HK, DK, generator=g),
         torch.randn(B, S, HV, DV, generator=g), -2 * torch.rand(B, S, HV, generator=g),
         torch.rand(B, S, HV, generator=g), torch.randn(B, HV, DK, DV, generator=g)]
    return [t.requires_grad_(requires_grad) for t in x]


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_the_chunked_rule_is_the_recurrence(chunk):
    q, k, v, g, beta, s0 = _inputs(requires_grad=True)
    runs = []
    for rule in (recurrent_gated_delta_rule, lambda *a: chunk_gated_delta_rule(*a[:5], chunk, a[5])):
        o, state = rule(q, k, v, g, beta, s0)
        (o.pow(2).sum() + state.pow(2).sum()).backward()
        runs.append([o.detach(), state.detach()] + [t.grad.clone() for t in (q, k, v, g, beta, s0)])
        for t in (q, k, v, g, beta, s0):
            t.grad = None
    for name, a, b in zip(["o", "state", "dq", "dk", "dv", "dg", "dbeta", "ds0"], *runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_the_rules_equal_transformers_torch_paths():
    tf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, s0 = _inputs(1)
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, 16, s0)
    for fn, kw in ((tf.torch_chunk_gated_delta_rule, {"chunk_size": 16}), (tf.torch_recurrent_gated_delta_rule, {})):
        o_hf, s_hf = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
        torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state, s_hf, rtol=1e-5, atol=1e-5)


def _layer() -> GatedDeltaNet:
    layer = GatedDeltaNet(32, HK, HV, DK, DV, conv_kernel=4, norm_eps=1e-6, chunk_size=16)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


def test_the_layer_equals_qwen3_nexts():
    tf = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    cfg = tf.Qwen3NextConfig(hidden_size=32, linear_num_key_heads=HK, linear_num_value_heads=HV,
                             linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=4,
                             num_hidden_layers=1, layer_types=["linear_attention"])
    ours = _layer()
    theirs = Qwen3NextGatedDeltaNet(cfg, 0)
    state = ours.state_dict()  # the same names and shapes; the convolution's channels in HF's order
    state["conv1d.weight"] = state["conv1d.weight"][torch.argsort(conv_channels_in_hf_order(HK, HV, DK, DV))]
    theirs.load_state_dict(state)
    x = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_documents_restart_the_state_and_the_convolution():
    layer = _layer()
    x = torch.randn(2, S, 32, generator=torch.Generator().manual_seed(4))
    docs = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [0] * S])
    together = layer(x, DocumentMask(docs, torch.arange(S)))
    alone = torch.cat([layer(x[:1, :10]), layer(x[:1, 10:30]), layer(x[:1, 30:])], dim=1)
    torch.testing.assert_close(together[:1], alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(together[1:], layer(x[1:]), rtol=0, atol=0)
    # Without the document ids the later documents read the earlier ones' state.
    assert (layer(x[:1]) - alone).abs().max() > 1e-3


# -- a Qwen3-Next-like hybrid in every layout it takes ------------------------------------------

HYBRID = {
    "model": {"layers": 2, "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
              "linear_chunk_size": 8, "attention_output_gate": True, "zero_centered_norm": True, "qk_norm": "head",
              "partial_rotary_factor": 0.5, "vocab_size": 260},
    "moe": {"num_experts": 4, "top_k": 2, "shared_experts": 1, "shared_expert_gate": True},
}




HYBRID_LAYOUTS = {
    "dp2-ep2": ({"dp": 2, "ep": 2}, False),
    "pp2-dp2-ep2-docs": ({"pp": 2, "dp": 2, "ep": 2}, True),
    "dp2-ep2-zero3-full-recompute": ({"dp": 2, "ep": 2, "zero_stage": 3, "activation_checkpointing": "full"}, False),
    # Context parallel: each cp rank runs the whole sequence of one of the two key heads.
    "cp2-ep2": ({"cp": 2, "ep": 2}, False),
    "cp2-dp2-ep2-docs": ({"cp": 2, "dp": 2, "ep": 2}, True),
    # Tensor parallel: each tp rank holds one of the two key heads (with SP: the whole sequence
    # gathered into the layer); with ZeRO-2 over dp.
    "dp2-tp2-sp-ep2": ({"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True}, False),
    "tp2-dp2-zero2-docs": ({"tp": 2, "dp": 2, "zero_stage": 2}, True),
    # Expert-tensor parallelism on the MoE blocks beside it; HSDP (ZeRO-3 within pairs of ranks).
    "dp2-tp2-ep2-etp2": ({"dp": 2, "tp": 2, "ep": 2, "etp": 2}, False),
    "dp4-ep2-hsdp2": ({"dp": 4, "ep": 2, "zero_stage": 3, "dp_shard": 2}, False),
}
_REFERENCES: dict = {}


@pytest.mark.slow(fast=["dp2-ep2"])
@pytest.mark.parametrize("layout", list(HYBRID_LAYOUTS))
def test_a_hybrid_model_trains_as_in_one_process(layout, tiny_shards, short_doc_shards, tmp_path):
    parallel, docs = HYBRID_LAYOUTS[layout]
    shards, data_section = (short_doc_shards, {"document_mask": True}) if docs else (tiny_shards, {})
    if docs not in _REFERENCES:
        _REFERENCES[docs] = run_distributed(train_layout, 1, str(shards), str(tmp_path / "ref"), {}, HYBRID["model"], HYBRID["moe"],
                                            data_section)[0]
    ref = _REFERENCES[docs]
    assert ref["losses"][-1] < ref["losses"][0] - 0.5, "the reference must learn"
    assert max(ref["norms"]) > 0.5, "the test must clip"
    assert any(".attention.A_log" in n for n in ref["grads"]), "a gated-DeltaNet block must train"
    results = run_distributed(train_layout, layout_world(parallel), str(shards), str(tmp_path / "run"), parallel,
                              HYBRID["model"], HYBRID["moe"], data_section)
    assert_layout_matches(results, ref)


@pytest.mark.slow
def test_qwen3_next_mtp_trains_as_in_one_process_across_pipeline_stages(tiny_shards, tmp_path):
    """The hybrid with Qwen3-Next's MTP module (a full-attention block, zero-centred norms) on the
    last of two pipeline stages, dp2 × ep2 on each: equal to one process over 20 steps, the
    module's weights included."""
    model = {**HYBRID["model"], "mtp_depth": 1}
    ref = run_distributed(train_layout, 1, str(tiny_shards), str(tmp_path / "ref"), {}, model, HYBRID["moe"], {})[0]
    assert any(n.startswith("mtp.") for n in ref["grads"]), "the MTP module must train"
    results = run_distributed(train_layout, 4, str(tiny_shards), str(tmp_path / "run"),
                              {"pp": 2, "dp": 2, "ep": 2}, model, HYBRID["moe"], {})
    assert_layout_matches(results, ref, norms=False)


@pytest.mark.parametrize("parallel, field, why", [
    ({"tp": 4}, "parallel.tp = 4", r"model.linear_num_key_heads=2 over the tp ranks"),
    ({"cp": 4}, "parallel.cp = 4", r"the 2 key heads of a tp rank"),
    ({"tp": 2, "cp": 2}, "parallel.cp = 2", r"the 1 key heads of a tp rank"),
])
def test_layouts_the_layer_cannot_take_are_refused_by_field(parallel, field, why, tmp_path):
    with pytest.raises(ConfigError, match=rf"{field}: the gated-DeltaNet / KDA layers .*{why}"):
        tiny_config(tmp_path, tmp_path, parallel=parallel, model=HYBRID["model"], moe=HYBRID["moe"])


def test_the_planner_counts_the_hybrids_parameters_and_flops(tmp_path):
    """The planner's shape of a hybrid: its parameters are the model's, and a gated-DeltaNet
    block's FLOPs per token do not grow with the sequence as its attention's do."""
    from moetrain.model.transformer import Transformer
    from moetrain.planner.model import ModelShape

    model = {**HYBRID["model"], "layers": 4, "vocab_size": 384, "qk_norm": "none",
             "layer_types": ["linear_attention", "full_attention"] * 2}
    # (the planner leaves out the shared experts' [1, h] gate and the per-head q/k norms)
    cfg = tiny_config(tmp_path, tmp_path, model=model, moe={**HYBRID["moe"], "shared_expert_gate": False})
    shape = ModelShape.from_config(cfg)
    assert shape.total_params == sum(p.numel() for p in Transformer.from_config(cfg).parameters())
    with_mtp = cfg.replace(model={"mtp_depth": 1})  # a full-attention block (not the mean mixer's)
    assert ModelShape.from_config(with_mtp).total_params == sum(
        p.numel() for p in Transformer.from_config(with_mtp).parameters())
    long = ModelShape.from_config(cfg.replace(model={"seq_len": 4096}))
    assert long.linear_flops() == shape.linear_flops()
    all_attention = ModelShape.from_config(cfg.replace(model={"seq_len": 4096, "layer_types": []}))
    assert long.attention_flops(causal=True) < 0.6 * all_attention.attention_flops(causal=True)


def test_the_fla_backend_is_refused_off_cuda(tmp_path):
    from moetrain.config import check_supported

    cfg = tiny_config(tmp_path, tmp_path, model={**HYBRID["model"], "linear_attention_backend": "fla"},
                      moe=HYBRID["moe"])
    with pytest.raises(ConfigError, match=r"model.linear_attention_backend = 'fla': flash-linear-attention's kernels "
                                          r"run on CUDA only"):
        check_supported(cfg, "cpu")


class RecordingExchange:
    """A one-rank HeadExchange that records the values per token each exchange moves."""

    rank, size = 0, 1

    def __init__(self):
        self.per_token = 0

    def to_heads(self, x):
        self.per_token += x.shape[2] * x.shape[3]
        return x

    def to_sequence(self, y):
        self.per_token += y.shape[2] * y.shape[3]
        return y


def test_the_planner_counts_what_the_head_exchange_moves(tmp_path):
    """Context parallelism's bytes in the planner (ModelShape.head_exchange_width) are what the
    layers hand their head exchange, for gated DeltaNet and Mamba-2."""
    from moetrain.model.transformer import Transformer
    from moetrain.planner.model import ModelShape

    for mixer, extra in (("linear_attention", {}), ("mamba", {"mamba_num_heads": 4, "mamba_head_dim": 8,
                                                             "ssm_state_size": 8, "n_groups": 2})):
        model = {**HYBRID["model"], **extra, "layer_types": [mixer, "full_attention"]}
        cfg = tiny_config(tmp_path, tmp_path, model=model, moe=HYBRID["moe"])
        layer = Transformer.from_config(cfg).layers["0"].attention
        layer.context = recorder = RecordingExchange()
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0.0, 0.1)
            layer(torch.randn(1, 16, cfg.model.hidden))
        assert recorder.per_token == ModelShape.from_config(cfg).head_exchange_width(), mixer


def test_multi_token_prediction_blocks_are_full_attention_beside_layer_types(tmp_path):
    from moetrain.model.layers import Attention
    from moetrain.model.transformer import Transformer

    cfg = tiny_config(tmp_path, tmp_path, model={"layer_types": ["full_attention"] * 2, "mtp_depth": 1})
    assert isinstance(Transformer.from_config(cfg).mtp["2"].block.attention, Attention)


def test_the_planner_keeps_what_the_recurrent_kernels_keep(tmp_path):
    """Activation memory of a hybrid (moetrain.planner.memory.recurrent_terms): a gated-DeltaNet
    layer keeps its chunk's WY matrix (C fp32 values per token and value head) and, for the layer
    in flight, its chunk-boundary states (Dk × Dv fp32 per value head and chunk), so a longer
    chunk grows the first and shrinks the second by what those sizes say; an all-attention
    model's plan does not depend on the linear-attention fields."""
    from moetrain.planner.layout import Layout
    from moetrain.planner.memory import memory_per_gpu, recurrent_state_bytes, recurrent_terms
    from moetrain.planner.model import ModelShape

    model = {**HYBRID["model"], "layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    lay = Layout(tp=1, pp=1, dp=1, cp=1, ep=1, mbs=1, ac="none")
    acts = {}
    for C in (8, 16):
        shape = ModelShape.from_config(tiny_config(tmp_path, tmp_path, model={**model, "linear_chunk_size": C},
                                                   moe=HYBRID["moe"]))
        wy = dict((n, b) for n, b, _ in recurrent_terms(shape)["linear_attention"])["chunk WY matrix (fp32)"]
        assert wy == 4.0 * 4 * C  # Hv = 4 value heads
        assert recurrent_state_bytes(shape) == 4.0 * 4 * 8 * 8 / C  # Hv · Dk · Dv / C
        acts[C] = memory_per_gpu(shape, lay, global_batch=8).activations / shape.seq_len
    layers, in_flight = 4, 1  # one micro-batch in flight
    want = in_flight * 3 / 4 * layers * 4.0 * 4 * 8 + 4.0 * 4 * 8 * 8 * (1 / 16 - 1 / 8)
    assert acts[16] - acts[8] == pytest.approx(want)
    plain = {"layers": 4}
    a = ModelShape.from_config(tiny_config(tmp_path, tmp_path, model=plain))
    b = ModelShape.from_config(tiny_config(tmp_path, tmp_path, model={**plain, "linear_chunk_size": 32}))
    assert memory_per_gpu(a, lay, 8).activations == memory_per_gpu(b, lay, 8).activations
