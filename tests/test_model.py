"""Single-process checks of the model pieces: MoE routing maths, capacity, recomputation."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.init import init_weights
from moetrain.model.moe import MoE
from moetrain.model.transformer import Transformer
from moetrain.parallel.activation import apply_activation_checkpointing

from conftest import tiny_config


def small_model(**sections) -> Transformer:
    cfg = tiny_config("unused", "unused", **sections)
    model = Transformer.from_config(cfg)
    init_weights(model, 0, 0.02, cfg.model.layers)
    return model


def test_aux_loss_is_one_for_a_uniform_router():
    moe = MoE(dim=8, hidden=16, num_experts=4, top_k=2)
    logits = torch.zeros(2, 16, 4)
    probs = logits.softmax(-1)
    # Perfectly balanced assignment: every expert gets the same number of tokens.
    idx = torch.arange(16 * 2).remainder(4).view(1, 16, 2).expand(2, 16, 2)
    aux, z, counts = moe.router_losses(logits, probs, idx)
    assert aux.item() == pytest.approx(1.0)
    assert z.item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)
    assert counts.sum().item() == 2 * 16 * 2


def test_capacity_factor_drops_and_reports():
    torch.manual_seed(0)
    moe = MoE(dim=8, hidden=16, num_experts=4, top_k=1, capacity_factor=0.5)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0  # route almost everything to expert 0
    x = torch.randn(1, 32, 8).abs()
    moe.begin_step(1)
    y = moe(x)
    dropped = moe.stats_accum["dropped_fraction"].item()
    # capacity = ceil(0.5 * 32 / 4) = 4 tokens per expert: at least 28 of 32 dropped.
    assert dropped >= 28 / 32
    assert torch.count_nonzero(y.abs().sum(-1)) <= 4
    moe.capacity_factor = None
    moe.begin_step(1)
    moe(x)
    assert moe.stats_accum["dropped_fraction"].item() == 0.0


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_without_double_counting(mode):
    ref, model = small_model(), small_model()
    apply_activation_checkpointing(model, mode)
    calls = {"n": 0}
    target = model.layers["0"] if mode == "full" else model.layers["0"].attention
    if mode == "full":
        target.attention.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    else:
        inner = target.kernel.kernel
        target.kernel.kernel = lambda q, k, v, doc, **kw: (calls.__setitem__("n", calls["n"] + 1), inner(q, k, v, doc, **kw))[1]
    tokens = torch.randint(0, 257, (2, 16))
    for m in (ref, model):
        for moe in m.moe_layers().values():
            moe.begin_step(1)
        m(tokens).sum().backward()
    assert calls["n"] == 2, "the forward was not recomputed in backward"
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    for name, moe in model.moe_layers().items():
        torch.testing.assert_close(moe.stats_accum["tokens_per_expert"],
                                   ref.moe_layers()[name].stats_accum["tokens_per_expert"])


MLA = {"attention": "mla", "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 6}


def test_mla_up_proj_recomputes_the_up_projections_and_the_kernel():
    """Megatron-Core's ``mla_up_proj``: the up-projections (and the attention kernel, as with
    ``selective``) run again in backward; the compressions do not; the gradients are unchanged."""
    ref, model = small_model(model=MLA), small_model(model=MLA)
    apply_activation_checkpointing(model, "mla_up_proj")
    attn = model.layers["0"].attention
    calls = {"wkv_b": 0, "wkv_a": 0}
    for name in calls:
        getattr(attn, name).register_forward_hook(lambda *a, n=name: calls.__setitem__(n, calls[n] + 1))
    tokens = torch.randint(0, 257, (2, 16))
    for m in (ref, model):
        for moe in m.moe_layers().values():
            moe.begin_step(1)
        m(tokens).sum().backward()
    assert calls == {"wkv_b": 2, "wkv_a": 1}, calls
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_meta_construction_has_no_storage():
    cfg = tiny_config("unused", "unused")
    with torch.device("meta"):
        model = Transformer.from_config(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert model.layers["1"].moe.experts.w1.shape == (4, 32, 48)  # [experts, hidden, ffn]
