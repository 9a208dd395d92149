"""Nemotron-H's blocks (model.hybrid_override_pattern): single-sublayer blocks — Mamba-2 (M),
attention (*), a dense MLP (-) and an MoE (E), each x + sublayer(RMSNorm(x)) — with its squared-ReLU
non-gated MLP and experts (model.mlp_activation / moe.activation relu2), attention without RoPE and
sigmoid routing with a score-correction bias. A Nemotron-H-like model equals one process over 20
steps in dp × ep, tp + SP × ep, pp × dp × ep and cp × ep with documents, and tp × ep with
expert-tensor parallelism (tests/test_architectures.py's tolerances); the pattern is checked by
field."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.model.mamba2 import Mamba2

from conftest import tiny_config
from multiproc import run_distributed
from test_equivalence import assert_layout_matches, layout_world, train_layout

NEMOTRON = {
    "model": {"layers": 4, "hybrid_override_pattern": "M-*E", "mamba_num_heads": 4, "mamba_head_dim": 8,
              "ssm_state_size": 8, "n_groups": 2, "mamba_chunk_size": 8, "rope": False, "mlp_activation": "relu2",
              "vocab_size": 260},
    "moe": {"num_experts": 4, "top_k": 2, "shared_experts": 1, "activation": "relu2", "score_function": "sigmoid",
            "routing_bias": True, "routed_scaling_factor": 2.0},
}


def test_the_pattern_gives_each_block_one_sublayer(tmp_path):
    from moetrain.model.layers import Attention, FeedForward
    from moetrain.model.moe import MoE
    from moetrain.model.transformer import Transformer

    cfg = tiny_config(tmp_path, tmp_path, **NEMOTRON)
    blocks = Transformer.from_config(cfg).layers
    kinds = [(type(b.attention).__name__ if b.attention is not None else None,
              "moe" if b.moe is not None else "mlp" if b.feed_forward is not None else None) for b in blocks.values()]
    assert kinds == [("Mamba2", None), (None, "mlp"), ("Attention", None), (None, "moe")]
    for b in blocks.values():  # one norm per block, the sublayer's
        assert (b.attention_norm is None) == (b.attention is None) and (b.ffn_norm is None) == (b.attention is not None)
    mlp, moe = blocks["1"].feed_forward, blocks["3"].moe
    assert isinstance(mlp, FeedForward) and mlp.w3 is None and isinstance(moe, MoE) and moe.experts.w3 is None
    assert moe.shared.w3 is None and isinstance(blocks["0"].attention, Mamba2)
    assert isinstance(blocks["2"].attention, Attention)
    # relu(x w1)² w2 for the dense MLP
    x = torch.randn(3, cfg.model.hidden)
    torch.testing.assert_close(mlp(x), torch.relu(x @ mlp.w1.weight.T).square() @ mlp.w2.weight.T)


@pytest.mark.parametrize("model, moe, field", [
    ({"hybrid_override_pattern": "M-*X"}, {}, r"model.hybrid_override_pattern = 'M-\*X': has the symbol 'X'"),
    ({"hybrid_override_pattern": "M-*"}, {}, r"gives 3 blocks, model.layers is 4"),
    ({"layer_types": ["mamba"] * 4}, {}, r"model.layer_types = .* is set beside model.hybrid_override_pattern"),
    ({}, {"every": 2}, r"moe.every = 2: does not apply beside model.hybrid_override_pattern"),
    ({"mtp_depth": 1}, {}, r"model.mtp_depth = 1: multi-token prediction is not built for single-sublayer"),
])
def test_a_pattern_it_cannot_take_is_refused_by_field(model, moe, field, tmp_path):
    with pytest.raises(ConfigError, match=field):
        tiny_config(tmp_path, tmp_path, model={**NEMOTRON["model"], **model}, moe={**NEMOTRON["moe"], **moe})


GK = {"hybrid_override_pattern": "GEK-*E", "layers": 6, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
      "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_chunk_size": 8}


def test_gated_deltanet_and_kda_blocks_take_their_symbols(tmp_path):
    """G and K: single-sublayer gated-DeltaNet and KDA blocks beside the others, and a pattern
    that Nemotron-H cannot hold is refused on export by field."""
    from moetrain.hf.arch import NEMOTRON_H, UnsupportedModel, to_hf
    from moetrain.model.gated_deltanet import GatedDeltaNet
    from moetrain.model.kda import KimiDeltaAttention
    from moetrain.model.transformer import Transformer

    cfg = tiny_config(tmp_path, tmp_path, model={**NEMOTRON["model"], **GK}, moe=NEMOTRON["moe"])
    blocks = list(Transformer.from_config(cfg).layers.values())
    assert isinstance(blocks[0].attention, GatedDeltaNet) and isinstance(blocks[2].attention, KimiDeltaAttention)
    assert blocks[0].moe is None and blocks[1].attention is None and blocks[1].moe is not None
    with pytest.raises(UnsupportedModel, match=r"model.hybrid_override_pattern = 'GEK-\*E': NemotronHForCausalLM"):
        to_hf(cfg, NEMOTRON_H)


def test_the_planner_counts_the_single_sublayer_blocks(tmp_path):
    from moetrain.model.transformer import Transformer
    from moetrain.planner.model import ModelShape

    # (the planner leaves out the score-correction bias: a buffer)
    for model in (NEMOTRON["model"], {**NEMOTRON["model"], **GK}):
        cfg = tiny_config(tmp_path, tmp_path, model={**model, "vocab_size": 384}, moe=NEMOTRON["moe"])
        assert ModelShape.from_config(cfg).total_params == sum(
            p.numel() for p in Transformer.from_config(cfg).parameters()), model["hybrid_override_pattern"]




NEMOTRON_LAYOUTS = {
    "dp2-ep2": ({"dp": 2, "ep": 2}, False),
    # each tp rank holds one of the two Mamba groups and two of the four attention heads
    "dp2-tp2-sp-ep2": ({"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True}, False),
    "pp2-dp2-ep2-docs": ({"pp": 2, "dp": 2, "ep": 2}, True),
    "cp2-ep2-docs": ({"cp": 2, "ep": 2}, True),
    # the squared-ReLU experts' width split over tp
    "dp2-tp2-ep2-etp2": ({"dp": 2, "tp": 2, "ep": 2, "etp": 2}, False),
}
_REFERENCES: dict = {}


@pytest.mark.slow(fast=["dp2-tp2-sp-ep2"])
@pytest.mark.parametrize("layout", list(NEMOTRON_LAYOUTS))
def test_a_nemotron_h_like_model_trains_as_in_one_process(layout, tiny_shards, short_doc_shards, tmp_path):
    parallel, docs = NEMOTRON_LAYOUTS[layout]
    shards, data_section = (short_doc_shards, {"document_mask": True}) if docs else (tiny_shards, {})
    if docs not in _REFERENCES:
        _REFERENCES[docs] = run_distributed(train_layout, 1, str(shards), str(tmp_path / "ref"), {}, NEMOTRON["model"], NEMOTRON["moe"],
                                            data_section)[0]
    ref = _REFERENCES[docs]
    assert ref["losses"][-1] < ref["losses"][0] - 0.5, "the reference must learn"
    assert max(ref["norms"]) > 0.5, "the test must clip"
    assert any("layers.1.feed_forward.w1" in n for n in ref["grads"]) and any(
        "layers.0.attention.A_log" in n for n in ref["grads"]), "the MLP and the Mamba-2 blocks must train"
    results = run_distributed(train_layout, layout_world(parallel), str(shards), str(tmp_path / "run"), parallel,
                              NEMOTRON["model"], NEMOTRON["moe"], data_section)
    assert_layout_matches(results, ref)


@pytest.mark.slow
def test_gated_deltanet_and_kda_blocks_train_as_in_one_process_under_tp_and_cp(short_doc_shards, tmp_path):
    """The G and K blocks of a pattern, with documents, in dp2 × tp2 + SP × ep2 and cp2 × ep2."""
    data = {"document_mask": True}
    model = {**NEMOTRON["model"], **GK}
    ref = run_distributed(train_layout, 1, str(short_doc_shards), str(tmp_path / "ref"), {}, model, NEMOTRON["moe"],
                          data)[0]
    assert ref["losses"][-1] < ref["losses"][0] - 0.5, "the reference must learn"
    for name, parallel in (("tp", {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True}), ("cp", {"cp": 2, "ep": 2})):
        results = run_distributed(train_layout, layout_world(parallel), str(short_doc_shards), str(tmp_path / name),
                                  parallel, model, NEMOTRON["moe"], data)
        assert_layout_matches(results, ref, norms=False)
