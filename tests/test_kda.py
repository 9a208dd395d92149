"""Kimi Delta Attention (moetrain/model/kda.py): the chunked delta rule with per-channel decays
against its recurrence and transformers' own torch paths; the layer against Kimi Linear's;
packed documents against each document alone; and a Kimi-Linear-like hybrid (KDA blocks beside
MLA without RoPE, DeepSeek-V3's routing) trained in dp × ep, tp + SP × ep, pp × dp × ep and
cp × ep with document masks, equal to one process over 20 steps (tests/test_architectures.py's
tolerances). A decay per channel must not collapse to one per head: the per-channel test fails
if the rule reads only one channel's decay."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.model.attention import DocumentMask
from moetrain.model.gated_deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule
from moetrain.model.kda import KimiDeltaAttention

from conftest import tiny_config
from multiproc import run_distributed
from test_equivalence import assert_layout_matches, layout_world, train_layout

B, S, H, DH, D = 2, 37, 3, 8, 32  # S not a multiple of the chunk: the last chunk is short


def _inputs(seed: int = 0, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(B, S, H, DH, generator=g), torch.randn(B, S, H, DH, generator=g),
         torch.randn(B, S, H, DH, generator=g), -2 * torch.rand(B, S, H, DH, generator=g),
         torch.rand(B, S, H, generator=g), torch.randn(B, H, DH, DH, generator=g)]
    return [t.requires_grad_(requires_grad) for t in x]


@pytest.mark.parametrize("chunk", [1, 8, 64])
def test_the_chunked_rule_with_channel_decays_is_the_recurrence(chunk):
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
    # The channels decay apart: the same run with every channel at its head's mean decay differs.
    o_mean, _ = chunk_gated_delta_rule(q, k, v, g.mean(-1, keepdim=True).expand_as(g), beta, chunk, s0)
    assert (o_mean - runs[0][0]).abs().max() > 1e-2


def test_the_rule_equals_transformers_kda_paths():
    tf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, g, beta, s0 = _inputs(1)
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, 16, s0)
    for fn, kw in ((tf.chunk_kimi_delta_attention, {"chunk_size": 16}), (tf.recurrent_kimi_delta_attention, {})):
        o_hf, s_hf = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                        **kw)
        torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state, s_hf, rtol=1e-5, atol=1e-5)


def _layer() -> KimiDeltaAttention:
    layer = KimiDeltaAttention(D, H, DH, conv_kernel=4, norm_eps=1e-6, chunk_size=16)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


def test_the_layer_equals_kimi_linears():
    tf = pytest.importorskip("transformers")
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    cfg = tf.KimiLinearConfig(hidden_size=D, linear_num_heads=H, linear_head_dim=DH, linear_conv_kernel_dim=4,
                              num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6,
                              pad_token_id=None, bos_token_id=None, eos_token_id=None)
    ours, theirs = _layer(), KimiLinearDeltaAttention(cfg, 0)
    state = ours.state_dict()
    # transformers' module layout: the decay's tensors under forget_gate, one stacked convolution
    gate = {f"forget_gate.{n}": state.pop(n) for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")}
    gate["forget_gate.A_log"] = gate["forget_gate.A_log"].view(1, 1, H, 1)
    conv = torch.cat([state.pop(f"{x}_conv1d.weight") for x in "qkv"])
    theirs.load_state_dict({**state, **gate, "conv1d.weight": conv})
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_documents_restart_the_state_and_the_convolutions():
    layer = _layer()
    x = torch.randn(2, S, D, generator=torch.Generator().manual_seed(4))
    docs = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [0] * S])
    together = layer(x, DocumentMask(docs, torch.arange(S)))
    alone = torch.cat([layer(x[:1, :10]), layer(x[:1, 10:30]), layer(x[:1, 30:])], dim=1)
    torch.testing.assert_close(together[:1], alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(together[1:], layer(x[1:]), rtol=0, atol=0)
    assert (layer(x[:1]) - alone).abs().max() > 1e-3


# -- a Kimi-Linear-like hybrid in the layouts it takes ------------------------------------------

KIMI = {
    "model": {"layers": 2, "layer_types": ["kda", "full_attention"], "linear_num_key_heads": 2,
              "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
              "linear_chunk_size": 8, "attention": "mla", "q_lora_rank": None, "kv_lora_rank": 16,
              "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "rope": False, "vocab_size": 260},
    "moe": {"num_experts": 4, "top_k": 2, "shared_experts": 1, "score_function": "sigmoid", "routing_bias": True,
            "routed_scaling_factor": 2.0},
}




KIMI_LAYOUTS = {
    "dp2-ep2": ({"dp": 2, "ep": 2}, False),
    # each tp rank holds one of the two KDA heads and two of the four MLA heads
    "dp2-tp2-sp-ep2": ({"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True}, False),
    "pp2-dp2-ep2-docs": ({"pp": 2, "dp": 2, "ep": 2}, True),
    # each cp rank runs the whole sequence of one KDA head; MLA as ring attention
    "cp2-ep2-docs": ({"cp": 2, "ep": 2}, True),
}
_REFERENCES: dict = {}


@pytest.mark.slow(fast=["dp2-tp2-sp-ep2"])
@pytest.mark.parametrize("layout", list(KIMI_LAYOUTS))
def test_a_kimi_linear_like_model_trains_as_in_one_process(layout, tiny_shards, short_doc_shards, tmp_path):
    parallel, docs = KIMI_LAYOUTS[layout]
    shards, data_section = (short_doc_shards, {"document_mask": True}) if docs else (tiny_shards, {})
    if docs not in _REFERENCES:
        _REFERENCES[docs] = run_distributed(train_layout, 1, str(shards), str(tmp_path / "ref"), {}, KIMI["model"], KIMI["moe"],
                                            data_section)[0]
    ref = _REFERENCES[docs]
    assert ref["losses"][-1] < ref["losses"][0] - 0.5, "the reference must learn"
    assert max(ref["norms"]) > 0.5, "the test must clip"
    assert any(".attention.f_a_proj" in n for n in ref["grads"]), "a KDA block must train"
    results = run_distributed(train_layout, layout_world(parallel), str(shards), str(tmp_path / "run"), parallel,
                              KIMI["model"], KIMI["moe"], data_section)
    assert_layout_matches(results, ref)


def test_without_rope_attention_ignores_positions(tmp_path):
    """``model.rope: false``: the MLA block's output does not depend on the positions it is given
    (with RoPE it does)."""
    from moetrain.model.transformer import Transformer

    for rope in (False, True):
        model = {**KIMI["model"], "layer_types": [], "rope": rope}
        cfg = tiny_config(tmp_path, tmp_path, model=model, moe=KIMI["moe"])
        net = Transformer.from_config(cfg)
        with torch.no_grad():
            for p in net.parameters():
                p.normal_(0.0, 0.1)
        tokens = torch.randint(0, 260, (1, 8), generator=torch.Generator().manual_seed(0))
        spread = net(tokens, positions=torch.arange(8) * 3)  # other distances between the tokens
        same = torch.equal(net(tokens), spread)
        assert same != rope, f"rope={rope}"


@pytest.mark.parametrize("model, field", [
    ({"linear_num_value_heads": 4}, "model.linear_num_value_heads = 4: must equal model.linear_num_key_heads=2"),
    ({"linear_value_head_dim": 4}, "model.linear_value_head_dim = 4: must equal model.linear_key_head_dim=8"),
])
def test_kda_shapes_it_cannot_take_are_refused_by_field(model, field, tmp_path):
    with pytest.raises(ConfigError, match=field):
        tiny_config(tmp_path, tmp_path, model={**KIMI["model"], **model}, moe=KIMI["moe"])


def test_the_planner_counts_kdas_parameters_and_what_its_exchange_moves(tmp_path):
    from moetrain.model.transformer import Transformer
    from moetrain.planner.model import ModelShape

    from test_gated_deltanet import RecordingExchange

    cfg = tiny_config(tmp_path, tmp_path, model={**KIMI["model"], "layers": 4, "layer_types": ["kda", "full_attention"] * 2},
                      moe=KIMI["moe"])
    shape = ModelShape.from_config(cfg)
    layer = Transformer.from_config(cfg).layers["0"].attention
    assert shape.kda_params == sum(p.numel() for p in layer.parameters())
    layer.context = recorder = RecordingExchange()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1)
        layer(torch.randn(1, 16, cfg.model.hidden))
    assert recorder.per_token == shape.head_exchange_width()
    long = ModelShape.from_config(cfg.replace(model={"seq_len": 4096}))
    assert long.kda_flops() == shape.kda_flops()
