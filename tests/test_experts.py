"""Expert backends (moe.expert_backend, moetrain.model.moe.GroupedExperts) against the ``loop``
reference: forward and gradients, with empty experts; and in training, in every expert-parallel
layout and with capacity drops, the one-process ``loop`` losses and gradients (the
test_equivalence tolerances: 1e-5 relative losses, gradients 1e-5 of each tensor's largest entry).
"""

from __future__ import annotations

import pytest
import torch

from moetrain.model.moe import GroupedExperts, resolve_expert_backend

from multiproc import run_distributed
from test_equivalence import assert_matches, merged, train_and_capture


def _experts(backend: str, activation: str = "swiglu") -> GroupedExperts:
    ex = GroupedExperts(16, 24, 4, backend=backend, activation=activation)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in (ex.w1, ex.w3, ex.w2):
            if w is not None:
                w.copy_(torch.randn(w.shape, generator=g) * 0.2)
    return ex


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
@pytest.mark.parametrize("counts", [[3, 0, 9, 4], [0, 0, 16, 0], [4, 4, 4, 4]], ids=["one-empty", "one-busy", "even"])
def test_grouped_mm_equals_loop(counts, activation):
    x = torch.randn(sum(counts), 16, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(sum(counts), 16, generator=torch.Generator().manual_seed(2))
    results = {}
    for backend in ("loop", "grouped_mm"):
        ex, xi = _experts(backend, activation), x.clone().requires_grad_()
        y = ex(xi, torch.tensor(counts))
        y.backward(dy)
        results[backend] = [y, xi.grad, ex.w1.grad, ex.w3.grad if ex.w3 is not None else None, ex.w2.grad]
    for name, a, b in zip(["y", "dx", "dw1", "dw3", "dw2"], results["grouped_mm"], results["loop"]):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    if activation == "relu2":  # non-gated: relu(x w1_e)² w2_e per expert, and no w3 at all
        ex = _experts("loop", "relu2")
        assert ex.w3 is None
        want = torch.cat([torch.relu(xe @ ex.w1[e]).square() @ ex.w2[e]
                          for e, xe in enumerate(torch.split(x, counts))])
        torch.testing.assert_close(results["loop"][0], want, rtol=1e-6, atol=1e-6)
    # An empty expert gets a zero gradient from both (FSDP and the optimizer need one).
    for e, n in enumerate(counts):
        if n == 0:
            assert results["grouped_mm"][2][e].abs().sum() == 0


def test_auto_resolves_per_device():
    assert resolve_expert_backend("auto", torch.device("cpu"), torch.bfloat16) == "loop"
    assert resolve_expert_backend("auto", torch.device("cuda"), torch.bfloat16) == "grouped_mm"
    assert resolve_expert_backend("auto", torch.device("cuda"), torch.float32) == "loop"
    with pytest.raises(ValueError, match="expert backend"):
        resolve_expert_backend("cutlass", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def loop_reference(tiny_shards, tmp_path_factory):
    return run_distributed(train_and_capture, 1, str(tiny_shards), str(tmp_path_factory.mktemp("loop")), {}, {},
                           {"expert_backend": "loop"})[0]


@pytest.fixture(scope="module")
def loop_capacity_reference(tiny_shards, tmp_path_factory):
    return run_distributed(train_and_capture, 1, str(tiny_shards), str(tmp_path_factory.mktemp("loop-cap")), {}, {},
                           {"expert_backend": "loop", "capacity_factor": 0.5})[0]


CASES = [({}, 1), ({"dp": 2, "ep": 2}, 2), ({"dp": 4, "ep": 4}, 4)]


@pytest.mark.parametrize("parallel, world", CASES, ids=["1proc", "dp2-ep2", "dp4-ep4"])
def test_grouped_mm_training_matches_loop(parallel, world, loop_reference, tiny_shards, tmp_path):
    results = run_distributed(train_and_capture, world, str(tiny_shards), str(tmp_path), parallel, {},
                              {"expert_backend": "grouped_mm"})
    assert_matches(merged(results), loop_reference)


def test_grouped_mm_with_capacity_drops_matches_loop(loop_capacity_reference, tiny_shards, tmp_path):
    results = run_distributed(train_and_capture, 2, str(tiny_shards), str(tmp_path), {"dp": 2, "ep": 2}, {},
                              {"expert_backend": "grouped_mm", "capacity_factor": 0.5})
    assert_matches(merged(results), loop_capacity_reference)


# -- padding is not routed ------------------------------------------------------------------------

PADDED_MOE = {
    "plain": {},
    "capacity": {"capacity_factor": 1.0},
    "gpt-oss": {"expert_biases": True, "router_bias": True, "activation": "clamped_swiglu"},
    "sigmoid-bias": {"score_function": "sigmoid", "bias_update_rate": 0.001, "shared_experts": 0},
    "relu2": {"activation": "relu2"},  # non-gated experts and shared experts (Nemotron-H's)
}


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("moe", list(PADDED_MOE))
def test_a_padded_sequence_routes_as_the_sequence_without_its_padding(backend, moe, tmp_path):
    """One process, every expert here: a micro-batch of one sequence whose last 5 tokens are
    padding gives the loss, gradients, aux and z losses, expert loads and dropped fraction of the
    sequence cut before them; the routed experts compute the real rows only (``loop``: the rows
    they receive) and give the padding 0."""
    import torch.nn.functional as F

    import moetrain.model.moe as moe_module
    from moetrain.model.init import init_weights
    from moetrain.model.transformer import Transformer

    from conftest import tiny_config

    cfg = tiny_config(tmp_path, tmp_path, model={"vocab_size": 64, "seq_len": 16},
                      moe={"expert_backend": backend, **PADDED_MOE[moe]})
    model = Transformer(cfg.model, cfg.moe).train()
    init_weights(model, 0, 0.02, cfg.model.layers)
    for layer in model.moe_layers().values():
        layer.experts.backend = backend
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(3))
    real = 11
    padding = torch.arange(16).unsqueeze(0) >= real
    rows: list[int] = []
    loop = moe_module._loop_experts

    def counting(x_ND, *args, **kwargs):
        rows.append(x_ND.shape[0])
        return loop(x_ND, *args, **kwargs)

    runs = []
    for inputs, pad in [(tokens, padding), (tokens[:, :real], None)]:
        model.zero_grad()
        rows.clear()
        for layer in model.moe_layers().values():
            layer.begin_step(1)
        moe_module._loop_experts = counting
        try:
            logits = model(inputs, padding=pad)
        finally:
            moe_module._loop_experts = loop
        loss = F.cross_entropy(logits[0, :real - 1], tokens[0, 1:real])
        loss.backward()
        runs.append({"loss": loss.detach(), "rows": list(rows),
                     "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                     "stats": {k: layer.take_statistics()[0] for k, layer in model.moe_layers().items()}})
    padded, cut = runs
    torch.testing.assert_close(padded["loss"], cut["loss"], rtol=1e-6, atol=0)
    assert padded["grads"].keys() == cut["grads"].keys()
    for name, g in padded["grads"].items():
        torch.testing.assert_close(g, cut["grads"][name], rtol=1e-5, atol=1e-7, msg=name)
    for layer, stats in padded["stats"].items():
        for key, value in stats.items():
            torch.testing.assert_close(value, cut["stats"][layer][key], rtol=1e-6, atol=0, msg=f"{layer} {key}")
    assert sum(cut["stats"]["0"]["tokens_per_expert"]) <= real * cfg.moe.top_k
    if backend == "loop":
        assert padded["rows"] == cut["rows"], "the experts must compute the real rows only"
