"""Mamba-2 (moetrain/model/mamba2.py): the chunked SSD scan against the recurrence it computes
and against transformers' own torch path; the layer against Nemotron-H's; packed documents
against each document alone; the planner's count of the layer; and a hybrid model (Mamba-2 and
attention blocks with MoE) trained in dp × ep, pp × dp × ep with documents, ZeRO-3 with full
recomputation, tp + SP and context parallel (with documents) equal to one process over 20 steps
(tests/test_architectures.py's tolerances). A tp or cp that does not divide the groups is refused
naming the field."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.model.attention import DocumentMask
from moetrain.model.mamba2 import (Mamba2, chunk_ssd, conv_channels_in_hf_order, in_proj_rows_in_hf_order,
                                   recurrent_ssd)

from conftest import tiny_config
from multiproc import run_distributed
from test_equivalence import assert_layout_matches, layout_world, train_layout

B, S, H, P, G, N = 2, 37, 4, 6, 2, 5  # S not a multiple of the chunk: the last chunk is short


def _inputs(seed: int = 0, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(B, S, H, P, generator=g), 0.5 * torch.rand(B, S, H, generator=g), -torch.rand(H, generator=g),
         torch.randn(B, S, G, N, generator=g), torch.randn(B, S, G, N, generator=g),
         torch.randn(B, H, P, N, generator=g)]
    return [t.requires_grad_(requires_grad) for t in x]


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_the_chunked_scan_is_the_recurrence(chunk):
    x, dt, A, Bm, C, h0 = _inputs(requires_grad=True)
    runs = []
    for scan in (recurrent_ssd, lambda *a: chunk_ssd(*a[:5], chunk, a[5])):
        y, h = scan(x, dt, A, Bm, C, h0)
        (y.pow(2).sum() + h.pow(2).sum()).backward()
        runs.append([y.detach(), h.detach()] + [t.grad.clone() for t in (x, dt, A, Bm, C, h0)])
        for t in (x, dt, A, Bm, C, h0):
            t.grad = None
    for name, a, b in zip(["y", "state", "dx", "ddt", "dA", "dB", "dC", "dh0"], *runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4, msg=name)


def test_the_scan_equals_transformers_torch_path():
    tf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    x, dt, A, Bm, C, h0 = _inputs(1)
    y, h = chunk_ssd(x, dt, A, Bm, C, 16, h0)
    y_hf, h_hf = tf.mamba2_chunk_scan(x, dt, A, Bm, C, chunk_size=16, initial_states=h0, return_final_states=True)
    torch.testing.assert_close(y, y_hf, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(h, h_hf, rtol=1e-5, atol=1e-4)


def _layer(conv_bias: bool = True) -> Mamba2:
    layer = Mamba2(32, H, P, N, G, conv_kernel=4, conv_bias=conv_bias, norm_eps=1e-5, chunk_size=16,
                   time_step_min=0.001)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


def test_the_layer_equals_nemotron_hs():
    tf = pytest.importorskip("transformers")
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    cfg = tf.NemotronHConfig(hidden_size=32, mamba_num_heads=H, mamba_head_dim=P, ssm_state_size=N, n_groups=G,
                             conv_kernel=4, chunk_size=16, num_hidden_layers=1, layers_block_type=["mamba"],
                             time_step_min=0.001)
    ours = _layer(cfg.use_conv_bias)
    theirs = NemotronHMamba2Mixer(cfg, 0)
    state = ours.state_dict()  # the same names and shapes; rows and channels in HF's order
    rows, channels = in_proj_rows_in_hf_order(H, P, N, G), conv_channels_in_hf_order(H, P, N, G)
    state["in_proj.weight"] = state["in_proj.weight"][torch.argsort(rows)]
    for name in ("conv1d.weight", "conv1d.bias"):
        state[name] = state[name][torch.argsort(channels)]
    theirs.load_state_dict(state)
    x = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours(x), theirs.eval()(x), rtol=1e-5, atol=1e-5)


def test_documents_restart_the_state_and_the_convolution():
    layer = _layer()
    x = torch.randn(2, S, 32, generator=torch.Generator().manual_seed(4))
    docs = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [0] * S])
    together = layer(x, DocumentMask(docs, torch.arange(S)))
    alone = torch.cat([layer(x[:1, :10]), layer(x[:1, 10:30]), layer(x[:1, 30:])], dim=1)
    torch.testing.assert_close(together[:1], alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(together[1:], layer(x[1:]), rtol=0, atol=0)
    assert (layer(x[:1]) - alone).abs().max() > 1e-3


# -- a Mamba-2 hybrid in the layouts it takes ----------------------------------------------------

HYBRID = {
    "model": {"layers": 2, "layer_types": ["mamba", "full_attention"], "mamba_num_heads": 4, "mamba_head_dim": 8,
              "ssm_state_size": 8, "n_groups": 2, "mamba_chunk_size": 8, "vocab_size": 260},
    "moe": {"num_experts": 4, "top_k": 2, "shared_experts": 0, "score_function": "sigmoid", "routing_bias": True,
            "routed_scaling_factor": 2.0},
}




HYBRID_LAYOUTS = {
    "dp2-ep2": ({"dp": 2, "ep": 2}, False),
    "pp2-dp2-ep2-docs": ({"pp": 2, "dp": 2, "ep": 2}, True),
    "dp2-ep2-zero3-full-recompute": ({"dp": 2, "ep": 2, "zero_stage": 3, "activation_checkpointing": "full"}, False),
    # Each tp rank holds one of the two groups (and its two heads); each cp rank runs the whole
    # sequence of one.
    "dp2-tp2-sp-ep2": ({"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True}, False),
    "cp2-ep2": ({"cp": 2, "ep": 2}, False),
    "cp2-dp2-ep2-docs": ({"cp": 2, "dp": 2, "ep": 2}, True),
}
_REFERENCES: dict = {}


@pytest.mark.slow(fast=["dp2-ep2"])
@pytest.mark.parametrize("layout", list(HYBRID_LAYOUTS))
def test_a_mamba_hybrid_trains_as_in_one_process(layout, tiny_shards, short_doc_shards, tmp_path):
    parallel, docs = HYBRID_LAYOUTS[layout]
    shards, data_section = (short_doc_shards, {"document_mask": True}) if docs else (tiny_shards, {})
    if docs not in _REFERENCES:
        _REFERENCES[docs] = run_distributed(train_layout, 1, str(shards), str(tmp_path / "ref"), {}, HYBRID["model"], HYBRID["moe"],
                                            data_section)[0]
    ref = _REFERENCES[docs]
    assert ref["losses"][-1] < ref["losses"][0] - 0.5, "the reference must learn"
    assert max(ref["norms"]) > 0.5, "the test must clip"
    assert any(".attention.A_log" in n for n in ref["grads"]), "a Mamba-2 block must train"
    results = run_distributed(train_layout, layout_world(parallel), str(shards), str(tmp_path / "run"), parallel,
                              HYBRID["model"], HYBRID["moe"], data_section)
    assert_layout_matches(results, ref)


@pytest.mark.parametrize("parallel, field, why", [
    ({"tp": 4}, "parallel.tp = 4", r"model.n_groups=2 over the tp ranks"),
    ({"cp": 4}, "parallel.cp = 4", r"the 2 groups of a tp rank"),
])
def test_layouts_that_do_not_divide_the_groups_are_refused_by_field(parallel, field, why, tmp_path):
    with pytest.raises(ConfigError, match=rf"{field}: the Mamba-2 layers .*{why}"):
        tiny_config(tmp_path, tmp_path, parallel=parallel, model=HYBRID["model"], moe=HYBRID["moe"])


def test_the_planner_counts_the_layers_parameters(tmp_path):
    from moetrain.model.transformer import Transformer
    from moetrain.planner.model import ModelShape

    cfg = tiny_config(tmp_path, tmp_path, model={**HYBRID["model"], "vocab_size": 384}, moe=HYBRID["moe"])
    assert ModelShape.from_config(cfg).total_params == sum(p.numel() for p in Transformer.from_config(cfg).parameters())


def test_the_mamba_ssm_backend_is_refused_off_cuda(tmp_path):
    from moetrain.config import check_supported

    cfg = tiny_config(tmp_path, tmp_path, model={**HYBRID["model"], "mamba_backend": "mamba_ssm"}, moe=HYBRID["moe"])
    with pytest.raises(ConfigError, match=r"model.mamba_backend = 'mamba_ssm': mamba-ssm's kernels run on CUDA only"):
        check_supported(cfg, "cpu")


def test_a_mamba_model_is_refused_by_every_export(tmp_path):
    from moetrain.hf.arch import ARCHITECTURES, UnsupportedModel, to_hf

    cfg = tiny_config(tmp_path, tmp_path, model=HYBRID["model"], moe=HYBRID["moe"])
    for arch in ARCHITECTURES.values():
        # (Nemotron-H holds Mamba-2 layers in blocks of one sublayer each, which this model has not;
        # Qwen3.5's multimodal model exports as its text model only)
        why = {"nemotron_h": r"model.hybrid_override_pattern = '': NemotronHForCausalLM has blocks of one sublayer",
               "qwen3_5_moe": r"exports its text model only"}.get(
            arch.model_type, r"model.layer_types = .*has no Mamba-2 layers")
        with pytest.raises(UnsupportedModel, match=why):
            to_hf(cfg, arch)
