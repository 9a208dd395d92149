"""Hugging Face import and export, in one process on CPU (fp32), for every supported architecture.

For each tiny random model of tests/hf_models.py: import → moetrain's logits, LM loss and
gradients equal transformers' (logits and loss within 1e-5 relative; gradients within 1e-5 of
each tensor's largest entry); export → transformers loads it with no missing or unexpected
tensor and gives the original logits; import → export gives back every tensor bit for bit.
Also: unsupported architectures and fields are refused by name, and so are moetrain models an
architecture cannot hold.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import ConfigError, config_from_dict
from moetrain.hf.__main__ import main as hf_main
from moetrain.hf.arch import ARCHITECTURES, UnsupportedModel, architecture_for, choose_architecture, from_hf, to_hf
from moetrain.hf.convert import export_hf, import_hf
from moetrain.hf.tensors import interleaved_to_rope, rope_to_interleaved, tensor_maps
from moetrain.model.loss import lm_loss
from moetrain.model.transformer import Transformer
from moetrain.train.weights import WeightsError, check_init_from, load_weights_dir

from hf_models import ARCHS, VOCAB, build_hf_model

pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.core_model_loading import revert_weight_conversion  # noqa: E402

# The five architectures, plus Qwen3-MoE with tied embeddings (kept out of the pipeline tests:
# moetrain refuses tied embeddings with pp > 1).
CASES = {a: (a, {}) for a in ARCHS} | {"qwen3_moe_tied": ("qwen3_moe", {"tie_word_embeddings": True})}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    """Per case: the HF model, its directory, the imported weights directory, its config and
    the export of that weights directory."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for case, (arch, over) in CASES.items():
        hf_dir, weights, export = root / f"{case}-hf", root / f"{case}-weights", root / f"{case}-export"
        model = build_hf_model(arch, hf_dir, seed=len(out), **over)
        cfg = import_hf(hf_dir, weights, progress=False)
        export_hf(weights, export, progress=False)
        out[case] = {"hf": model, "hf_dir": hf_dir, "weights": weights, "cfg": cfg, "export": export}
    return out


def moetrain_model(cfg, weights: Path) -> Transformer:
    model = Transformer.from_config(cfg)
    load_weights_dir(weights, [model])
    return model.eval()  # eval: no router losses attached to the gradients (transformers has none here)


def tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (2, 17), generator=g)
    return seq[:, :-1], seq[:, 1:]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_gradients_match_transformers(case, converted):
    c = converted[case]
    ours, hf = moetrain_model(c["cfg"], c["weights"]), c["hf"]
    inputs, targets = tokens()
    logits = ours(inputs)
    hf_logits = hf(inputs).logits
    assert rel(logits, hf_logits) <= 1e-5
    loss = lm_loss(logits, targets)
    hf_loss = F.cross_entropy(hf_logits.flatten(0, 1), targets.flatten())
    assert abs(loss.item() - hf_loss.item()) <= 1e-5 * abs(hf_loss.item())
    hf.zero_grad()
    loss.backward()
    hf_loss.backward()
    # transformers' gradients in its checkpoint layout (its own save-time conversion), then ours.
    hf_grads = revert_weight_conversion(hf, {n: p.grad for n, p in hf.named_parameters()})
    grads = dict((n, p.grad) for n, p in ours.named_parameters())
    arch = architecture_for(json.loads((c["hf_dir"] / "config.json").read_text()))
    maps = tensor_maps(c["cfg"], arch.moe_names, arch.rope_interleaved or arch.name == "DeepseekV3ForCausalLM")
    # KDA's chunked rule multiplies each key channel by its own decays, e^(g_i − g_j) over a
    # chunk, so two fp32 orders of the same sums part further than for one decay per head: the
    # layer alone differs from transformers' by 3e-7 in float64 (transformers' own fp32 inside)
    # and 1.6e-6 in fp32, and three blocks carry that to ~1.4e-5 of a gradient's largest entry.
    rel_tol = 1e-4 if c["cfg"].model.kda else 1e-5
    for m in maps:
        if m.ours not in grads:  # a buffer (the routing bias): no gradient
            continue
        if any(hf_grads.get(n) is None for n in m.hf_names()):
            # transformers runs DSA's indexer without gradients (its scores feed a top-k only,
            # and it has no indexer loss): nor does moetrain's in eval mode. The scores are checked
            # against the report's formula in tests/test_dsa.py.
            assert ".indexer." in m.ours and grads[m.ours] is None, m.ours
            continue
        want = torch.cat(list(m.to_ours(hf_grads.__getitem__)))
        tol = rel_tol * want.abs().max().item() + 1e-8
        err = (grads[m.ours] - want).abs().max().item()
        assert err <= tol, f"{m.ours}: gradient error {err:.3e} > {tol:.3e}"
        assert want.abs().sum() > 0 or "experts" in m.ours, f"{m.ours}: zero gradient, the check is empty"


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_transformers_with_the_same_logits(case, converted):
    c = converted[case]
    model, info = AutoModelForCausalLM.from_pretrained(c["export"], dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(model).__name__ == type(c["hf"]).__name__
    inputs, _ = tokens(1)
    with torch.no_grad():
        assert torch.equal(model.eval()(inputs).logits, c["hf"](inputs).logits)


@pytest.mark.parametrize("case", list(CASES))
def test_import_export_round_trip_is_bit_exact(case, converted):
    c = converted[case]

    def tensors(d: Path) -> dict[str, torch.Tensor]:
        out = {}
        for f in d.glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
        return out

    before, after = tensors(c["hf_dir"]), tensors(c["export"])
    if c["cfg"].model.tie_embeddings:
        before.pop("lm_head.weight", None)
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert t.dtype == after[name].dtype and torch.equal(t, after[name]), name
    index = json.loads((c["export"] / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(after)
    config = json.loads((c["export"] / "config.json").read_text())
    original = json.loads((c["hf_dir"] / "config.json").read_text())
    assert config["architectures"] == original["architectures"]


def test_rope_permutation_round_trip():
    t = torch.arange(2 * 8 * 3, dtype=torch.float32).view(16, 3)
    inter = rope_to_interleaved(t, heads=2)
    assert torch.equal(inter[:, 0].view(2, 8)[0], torch.tensor([0., 12, 3, 15, 6, 18, 9, 21]))
    assert torch.equal(interleaved_to_rope(inter, heads=2), t)


def test_export_is_sharded_with_an_index(converted, tmp_path):
    c = converted["mixtral"]
    export_hf(c["weights"], tmp_path / "sharded", max_shard_bytes=20_000, progress=False)
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32).eval()
    inputs, _ = tokens(2)
    with torch.no_grad():
        assert torch.equal(model(inputs).logits, c["hf"](inputs).logits)


def test_cli_import_and_export(converted, tmp_path, capsys):
    c = converted["olmoe"]
    assert hf_main(["import", str(c["hf_dir"]), "--out", str(tmp_path / "w"), "--config", str(tmp_path / "o.yaml"),
                    "--max-shard-size", "50KB"]) == 0
    assert len(list((tmp_path / "w").glob("weights-*.safetensors"))) > 1
    text = (tmp_path / "o.yaml").read_text()
    assert "qk_norm: projection" in text and f"init_from: {tmp_path / 'w'}" in text
    assert hf_main(["export", str(tmp_path / "w"), "--out", str(tmp_path / "e"), "--dtype", "bfloat16"]) == 0
    with safe_open(str(next((tmp_path / "e").glob("*.safetensors"))), framework="pt") as h:
        assert all(h.get_slice(k).get_dtype() == "BF16" for k in h.keys())
    assert json.loads((tmp_path / "e" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # An existing output is refused, not overwritten.
    assert hf_main(["export", str(tmp_path / "w"), "--out", str(tmp_path / "e")]) == 2
    assert "already exists" in capsys.readouterr().err
    # An architecture that cannot hold the model: refused by the moetrain field, nothing written.
    assert hf_main(["export", str(tmp_path / "w"), "--out", str(tmp_path / "q"), "--arch", "llama"]) == 2
    assert "model.qk_norm = 'projection': LlamaForCausalLM has q/k norm 'none'" in capsys.readouterr().err
    assert not list(tmp_path.glob("q*"))


def _tiny_tokenizer(out: Path, eos: str = "<|endoftext|>") -> Path:
    """A word-level tokenizer.json of 40 tokens with ``eos`` at id 0 (a run's own tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {eos: 0, **{f"w{i}": i + 1 for i in range(38)}, '"': 39}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


@pytest.mark.parametrize("case", ["mixtral", "olmoe"])
def test_exported_token_ids_are_those_of_the_shipped_tokenizer(case, converted, tmp_path):
    """Fine-tuned on data of another tokenizer, the export ships that tokenizer, and every
    special token id in config.json and generation_config.json names its tokens (an imported
    Mixtral's eos 2 would be '"' here, an OLMoE's pad 1 a word), or is refused by name."""
    from transformers import AutoTokenizer

    c = converted[case]
    imported = json.loads((c["hf_dir"] / "config.json").read_text())
    assert imported["eos_token_id"] not in (None, 0)  # the import's ids differ from the run tokenizer's
    # As imported, with the imported model's own files, its ids stay.
    kept = json.loads((c["export"] / "config.json").read_text())
    assert all(kept.get(k) == imported.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id"))

    export_hf(c["weights"], tmp_path / "e", tokenizer=_tiny_tokenizer(tmp_path / "tok"), progress=False)
    tok = AutoTokenizer.from_pretrained(tmp_path / "e")
    for f in ("config.json", "generation_config.json"):
        conf = json.loads((tmp_path / "e" / f).read_text())
        assert conf["eos_token_id"] == tok.eos_token_id == 0, f
        assert conf.get("bos_token_id") is None and conf.get("pad_token_id") is None, f
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "e", dtype=torch.float32)
    assert model.generation_config.eos_token_id == 0

    # A tokenizer that does not hold the end-of-text token it is said to use is refused.
    bad = _tiny_tokenizer(tmp_path / "bad", eos="</s>")
    with pytest.raises(WeightsError, match=r"names eos_token '<\|endoftext\|>', which is not in its tokenizer.json"):
        export_hf(c["weights"], tmp_path / "refused", tokenizer=bad, progress=False)
    assert not (tmp_path / "refused").exists()


def test_corrupt_weights_are_refused(converted, tmp_path):
    c = converted["llama"]
    shutil.copytree(c["weights"], tmp_path / "w")
    f = next((tmp_path / "w").glob("weights-*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="sha256"):
        load_weights_dir(tmp_path / "w", [Transformer.from_config(c["cfg"])])


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


def base_config(arch: str) -> dict:
    from hf_models import hf_config

    return json.loads(hf_config(arch).to_json_string())  # what save_pretrained writes to config.json


REFUSED = [
    ("qwen3_next", {}, "Qwen3NextForCausalLM"),
    # DeepSeek-V3's own FP8 format (square blocks) is read (tests/test_lora.py); not other blocks
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}},
     "quantization_config"),
    ("deepseek_v3", {"topk_method": "group_limited_greedy"}, "topk_method = 'group_limited_greedy'"),
    ("gpt_oss", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("mixtral", {"sliding_window": 4096}, "sliding_window = 4096"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise = 0.1"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv = 8.0"),
    ("llama", {"attention_bias": True}, "attention_bias = True"),
    ("llama", {"mlp_bias": True}, "mlp_bias = True"),
    ("llama", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}},
     "rope_parameters.rope_type = 'longrope'"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
    ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window = True"),
    ("qwen3_moe", {"mlp_only_layers": [0], "decoder_sparse_step": 1, "num_hidden_layers": 4}, None),
    ("qwen3_moe", {"mlp_only_layers": [1], "num_hidden_layers": 3}, "mlp_only_layers = [1]"),
    ("qwen2_moe", {"some_new_field": 3}, "some_new_field = 3"),
    ("qwen2_moe", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    # MiniMax-M2's published keys that would change the forward pass
    ("minimax_m2", {"qk_norm_type": "per_head"}, "qk_norm_type = 'per_head'"),
    ("minimax_m2", {"shared_intermediate_size": 64}, "shared_intermediate_size = 64"),
    ("minimax_m2", {"attn_type_list": [0, 1]}, "attn_type_list = [0, 1]"),
    ("minimax_m2", {"rotary_dim": 4}, "rotary_dim = 4"),
    # Llama 4's keys whose values moetrain does not build
    ("llama4_text", {"num_experts_per_tok": 2}, "num_experts_per_tok = 2"),
    ("llama4_text", {"layer_types": ["full_attention", "full_attention"]}, "layer_types = ['full_attention'"),
    ("llama4_text", {"attention_bias": True}, "attention_bias = True"),
    ("llama4_text", {"moe_layers": []}, "moe_layers = []"),
    # DSA: a block sharing another's top-k, blocks other than DSA ones
    ("glm_moe_dsa", {"indexer_types": ["full", "shared"]}, "indexer_types = ['full', 'shared']"),
    ("deepseek_v32", {"layer_types": ["indexed_attention", "full_attention"]}, "layer_types = "),
    ("deepseek_v32", {"mlp_layer_types": ["sparse", "dense"]}, "mlp_layer_types = ['sparse', 'dense']"),
]


@pytest.mark.parametrize("arch, change, message", REFUSED, ids=[f"{a}-{next(iter(c), a)}" for a, c, _ in REFUSED])
def test_unsupported_models_are_refused_by_name(arch, change, message):
    hf = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]} if arch == "qwen3_next" \
        else {**base_config(arch), **change}
    if message is None:  # a pattern moetrain expresses (first_dense = 1): accepted
        _, _, moe = from_hf(hf)
        assert (moe["every"], moe["first_dense"]) == (1, 1)
        return
    with pytest.raises(UnsupportedModel, match=message.replace("[", r"\[").replace("(", r"\(")):
        from_hf(hf)


def test_legacy_rope_fields_are_read():
    hf = base_config("llama")
    hf.pop("rope_parameters")
    hf.update(rope_theta=5e5, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    _, model, _ = from_hf(hf)
    assert model["rope_theta"] == 5e5 and model["rope_scaling"] == "llama3" and model["rope_scaling_factor"] == 32.0


def test_import_refuses_unmapped_tensors(converted, tmp_path):
    c = converted["mixtral"]
    shutil.copytree(c["hf_dir"], tmp_path / "m")
    from safetensors.torch import save_file

    save_file({"model.layers.0.self_attn.o_proj.bias": torch.zeros(32)}, str(tmp_path / "m" / "extra.safetensors"))
    with pytest.raises(WeightsError, match="o_proj.bias"):
        import_hf(tmp_path / "m", tmp_path / "w", progress=False)


def tiny_moetrain(**moe) -> object:
    return config_from_dict({"model": {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab_size": 64},
                             "moe": {"num_experts": 4, "ffn_hidden": 16, **moe}})


def test_export_refuses_what_the_architecture_cannot_hold():
    demo_like = tiny_moetrain(shared_experts=1)  # the demo's ungated shared expert
    assert choose_architecture(demo_like).name == "MixtralForCausalLM"
    with pytest.raises(UnsupportedModel, match=r"moe.shared_experts = 1: MixtralForCausalLM has no shared experts"):
        to_hf(demo_like, choose_architecture(demo_like))
    with pytest.raises(UnsupportedModel, match="moe.shared_experts = 1: Qwen2MoeForCausalLM has one shared expert"):
        to_hf(demo_like, ARCHITECTURES["qwen2_moe"])
    with pytest.raises(UnsupportedModel, match="moe.every = 2: MixtralForCausalLM has an MoE in every block"):
        to_hf(tiny_moetrain(every=2), ARCHITECTURES["mixtral"])
    with pytest.raises(UnsupportedModel, match="moe.num_experts = 4: LlamaForCausalLM is dense"):
        to_hf(tiny_moetrain(), ARCHITECTURES["llama"])
    # Llama 4's routing on the expert's input: no other architecture holds it, and Llama 4 holds
    # nothing but its own routing.
    llama4_like = tiny_moetrain(top_k=1, apply_probs_on_input=True)
    assert choose_architecture(llama4_like).name == "Llama4ForCausalLM"
    with pytest.raises(UnsupportedModel, match="moe.apply_probs_on_input = True: MixtralForCausalLM is Llama 4's"):
        to_hf(llama4_like, ARCHITECTURES["mixtral"])
    with pytest.raises(UnsupportedModel, match="moe.score_function = 'softmax': Llama4ForCausalLM needs 'sigmoid'"):
        to_hf(llama4_like, ARCHITECTURES["llama4_text"])


def test_init_from_is_checked_before_launch(converted, tmp_path):
    c = converted["qwen2_moe"]
    check_init_from(c["cfg"])  # the config the import wrote fits its weights
    wider = c["cfg"].replace(moe={"shared_ffn_hidden": 48})
    with pytest.raises(ConfigError, match=r"checkpoint.init_from = .*layers.1.moe.shared.w1.weight is \(40, 32\), "
                                          r"the model's is \(48, 32\).*Fix:"):
        check_init_from(wider)
    with pytest.raises(ConfigError, match=r"checkpoint.init_from = .*no such directory.*Fix:"):
        check_init_from(c["cfg"].replace(checkpoint={"init_from": str(tmp_path / "nowhere")}))


def test_bf16_model_keeps_its_dtype_and_loads_into_fp32_weights(converted, tmp_path):
    import copy

    c = converted["qwen2_moe"]
    copy.deepcopy(c["hf"]).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    cfg = import_hf(tmp_path / "bf16", tmp_path / "w", progress=False)
    export_hf(tmp_path / "w", tmp_path / "e", progress=False)
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as a, \
            safe_open(str(next((tmp_path / "e").glob("*.safetensors"))), framework="pt") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            assert b.get_slice(k).get_dtype() == "BF16" and torch.equal(a.get_tensor(k), b.get_tensor(k)), k
    ours = moetrain_model(cfg, tmp_path / "w")
    w = ours.layers["1"].moe.experts.w1
    assert w.dtype == torch.float32  # the master weights stay fp32, holding the bf16 values exactly
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as a:
        hf_w1 = a.get_tensor("model.layers.1.mlp.experts.2.gate_proj.weight")
    assert torch.equal(w[2], hf_w1.float().t())


# -- multi-token prediction (DeepSeek-V3's model.layers.{num_hidden_layers}.*) ---------------------


def _read_all(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory) -> dict:
    """A tiny DeepSeek-V3 checkpoint with an MTP layer after its 3 blocks, as the published ones
    carry it: a decoder block (``model.layers.3.self_attn.*``, ``mlp.*``, its norms) and enorm,
    hnorm, eh_proj, shared_head.{norm, head} and a copy of embed_tokens, in a file of its own."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("mtp")
    hf_dir = root / "hf"
    hf = build_hf_model("deepseek_v3", hf_dir, seed=11)
    L, D = hf.config.num_hidden_layers, hf.config.hidden_size
    base = _read_all(hf_dir)
    g = torch.Generator().manual_seed(12)
    mtp = {}
    for name, t in base.items():
        if name.startswith(f"model.layers.{L - 1}."):
            new = name.replace(f"model.layers.{L - 1}.", f"model.layers.{L}.")
            mtp[new] = (1.0 + 0.3 * torch.randn(t.shape, generator=g)) if "norm" in name \
                else 0.15 * torch.randn(t.shape, generator=g)
    P = f"model.layers.{L}."
    mtp |= {P + "enorm.weight": 1.0 + 0.3 * torch.randn(D, generator=g),
            P + "hnorm.weight": 1.0 + 0.3 * torch.randn(D, generator=g),
            P + "eh_proj.weight": 0.15 * torch.randn(D, 2 * D, generator=g),
            P + "shared_head.norm.weight": 1.0 + 0.3 * torch.randn(D, generator=g),
            P + "shared_head.head.weight": base["lm_head.weight"].clone(),
            P + "embed_tokens.weight": base["model.embed_tokens.weight"].clone()}
    save_file(mtp, str(hf_dir / "model-mtp.safetensors"))
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    cfg = import_hf(hf_dir, root / "weights", progress=False, mtp_depth=1)
    export_hf(root / "weights", root / "export", progress=False)
    return {"hf": hf, "hf_dir": hf_dir, "cfg": cfg, "weights": root / "weights", "export": root / "export",
            "mtp": mtp, "root": root}


def test_mtp_layer_imports_and_exports_under_its_names(with_mtp, tmp_path):
    c = with_mtp
    assert c["cfg"].model.mtp_depth == 1
    before, after = _read_all(c["hf_dir"]), _read_all(c["export"])
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert torch.equal(t, after[name]), name
    assert json.loads((c["export"] / "config.json").read_text())["num_nextn_predict_layers"] == 1
    # Without mtp_depth the MTP layer is left behind (and the model is the plain one).
    assert import_hf(c["hf_dir"], tmp_path / "plain", progress=False).model.mtp_depth == 0
    # A different shared head than the model's cannot be held by moetrain's one head: refused.
    from safetensors.torch import save_file

    shutil.copytree(c["hf_dir"], tmp_path / "other-head")
    mtp = dict(c["mtp"])
    mtp["model.layers.3.shared_head.head.weight"] = mtp["model.layers.3.shared_head.head.weight"] + 1
    save_file(mtp, str(tmp_path / "other-head" / "model-mtp.safetensors"))
    with pytest.raises(WeightsError, match="shared_head.head"):
        import_hf(tmp_path / "other-head", tmp_path / "w2", progress=False, mtp_depth=1)


def test_mtp_logits_equal_deepseek_v3s_definition_with_transformers_block(with_mtp):
    """Module 1's logits at position i: the head on shared_head.norm of transformers' own decoder
    block (the checkpoint's layer 3) applied to eh_proj[enorm(Emb(t_{i+1})); hnorm(h_i)], h the
    main model's last block output (DeepSeek-V3 §2.2, eq. 21-23) — within 1e-5."""
    from moetrain.model.transformer import future_tokens

    c, hf = with_mtp, with_mtp["hf"]
    L = hf.config.num_hidden_layers
    ours = moetrain_model(c["cfg"], c["weights"]).train()
    inputs, targets = tokens(3)
    for moe in ours.moe_layers().values():
        moe.begin_step(1)
    logits = ours(inputs, future=future_tokens(targets, 1))
    assert logits.shape == (*inputs.shape, 2, VOCAB)

    # The reference: transformers' decoder block 3 of a 4-block model holding the MTP weights.
    from safetensors.torch import save_file

    big_dir = c["root"] / "big"
    big_dir.mkdir()
    save_file(_read_all(c["hf_dir"]), str(big_dir / "model.safetensors"))  # one file: transformers reads it
    config = json.loads((c["hf_dir"] / "config.json").read_text())
    (big_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": L + 1}))
    big = AutoModelForCausalLM.from_pretrained(big_dir, dtype=torch.float32, attn_implementation="eager").eval()
    captured = {}
    hf.model.layers[L - 1].register_forward_hook(lambda m, a, out: captured.update(h=out[0] if isinstance(out, tuple)
                                                                                     else out))
    w = {k.removeprefix(f"model.layers.{L}."): v for k, v in c["mtp"].items()}
    eps = hf.config.rms_norm_eps
    with torch.no_grad():
        main = hf(inputs).logits
        h = captured["h"]
        e = hf.model.embed_tokens(targets)
        x = F.linear(torch.cat([F.rms_norm(e, (e.shape[-1],), w["enorm.weight"], eps),
                                F.rms_norm(h, (h.shape[-1],), w["hnorm.weight"], eps)], -1), w["eh_proj.weight"])
        S = x.shape[1]
        pos = torch.arange(S)[None]
        mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
        x = big.model.layers[L](x, attention_mask=mask, position_ids=pos,
                                position_embeddings=big.model.rotary_emb(x, pos))
        x = x[0] if isinstance(x, tuple) else x
        ref = F.linear(F.rms_norm(x, (x.shape[-1],), w["shared_head.norm.weight"], eps),
                       w["shared_head.head.weight"])
    assert rel(logits[:, :, 0], main) <= 1e-5
    assert rel(logits[:, :, 1], ref) <= 1e-5
    assert rel(logits[:, :, 1], main) > 1e-2  # the module's prediction is its own


def test_mtp_is_left_out_of_architectures_without_it(tmp_path, caplog):
    """A Mixtral-shaped model trained with MTP exports as Mixtral without the MTP module (said in
    the log), and gives the same main-head logits there."""
    from moetrain.model.init import init_weights
    from moetrain.train.weights import write_weights_dir

    cfg = config_from_dict({"model": {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab_size": VOCAB,
                                      "mtp_depth": 1, "rope_theta": 10000.0},
                            "moe": {"num_experts": 4, "ffn_hidden": 16, "shared_experts": 0}})
    model = Transformer.from_config(cfg)
    init_weights(model, 0, 0.1, cfg.model.layers)
    state = model.state_dict()
    write_weights_dir(tmp_path / "w", cfg, state.items(), [(n, t.dtype, tuple(t.shape)) for n, t in state.items()],
                      progress=False)
    with caplog.at_level("WARNING"):
        export_hf(tmp_path / "w", tmp_path / "e", arch_name="mixtral", progress=False)
    assert "leaves the 1 MTP module(s) out" in caplog.text
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "e", dtype=torch.float32).eval()
    inputs, _ = tokens(4)
    with torch.no_grad():
        assert rel(hf(inputs).logits, model.eval()(inputs)) <= 1e-5


# -- GPT-OSS's MXFP4 experts ----------------------------------------------------------------------


def test_mxfp4_dequantization_equals_transformers():
    """Every FP4 code at scales spanning 2^-10..2^6: the same bf16 tensor, bit for bit, as
    transformers' own dequantization (``convert_moe_packed_tensors``)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from moetrain.hf.convert import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(117, 134, (3, 40, 2), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16)
    assert ours.dtype == theirs.dtype == torch.bfloat16 and ours.shape == theirs.shape == (3, 64, 40)
    assert torch.equal(ours, theirs)


def test_mxfp4_checkpoint_imports_exactly(tmp_path, caplog):
    """A GPT-OSS checkpoint whose experts are stored as MXFP4 (``*_blocks`` / ``*_scales``, as
    the published ones) imports to the dequantized bf16 values, and says so."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    build_hf_model("gpt_oss", tmp_path / "hf", intermediate_size=32)  # widths that blocks of 32 divide
    src = _read_all(tmp_path / "hf")
    g = torch.Generator().manual_seed(1)
    quantized, expected = {}, {}
    for name in [n for n in src if n.endswith(("gate_up_proj", "down_proj")) and ".experts." in n]:
        E, rows_in, cols = src.pop(name).shape  # [E, in, out]: blocks hold [E, out, in / 32, 16]
        blocks = torch.randint(0, 256, (E, cols, rows_in // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(120, 128, (E, cols, rows_in // 32), generator=g, dtype=torch.uint8)
        quantized |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
        expected[name] = convert_moe_packed_tensors(blocks.clone(), scales.clone())
    assert len(expected) == 4  # gate_up_proj and down_proj of both blocks
    d = tmp_path / "mxfp4"
    d.mkdir()
    shutil.copy2(tmp_path / "hf" / "config.json", d / "config.json")
    save_file({**src, **quantized}, str(d / "model.safetensors"))
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router",
                                                                                         "model.embed_tokens",
                                                                                         "lm_head"]}
    (d / "config.json").write_text(json.dumps(config))
    with caplog.at_level("INFO"):
        cfg = import_hf(d, tmp_path / "w", progress=False)
    assert "MXFP4" in caplog.text and "dequantized to bf16" in caplog.text
    export_hf(tmp_path / "w", tmp_path / "e", progress=False)
    after = _read_all(tmp_path / "e")
    for name, want in expected.items():
        assert after[name].dtype == torch.bfloat16 and torch.equal(after[name], want), name
    assert cfg.model.attention_sinks


@pytest.fixture(scope="module")
def qwen3_next_mtp(tmp_path_factory) -> dict:
    """A tiny Qwen3-Next checkpoint with its MTP module as the published ones carry it (transformers
    builds none): ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, one
    full-attention MoE decoder layer ``mtp.layers.0.*`` and ``mtp.norm``, zero-centred norms."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("qwen3-next-mtp")
    hf_dir = root / "hf"
    hf = build_hf_model("qwen3_next", hf_dir, seed=13)
    L, D = hf.config.num_hidden_layers, hf.config.hidden_size
    g = torch.Generator().manual_seed(14)
    mtp = {}
    for name, t in _read_all(hf_dir).items():  # the last block is full attention with an MoE
        if name.startswith(f"model.layers.{L - 1}."):
            mtp[name.replace(f"model.layers.{L - 1}.", "mtp.layers.0.")] = (
                0.3 * torch.randn(t.shape, generator=g) if "norm" in name else 0.15 * torch.randn(t.shape, generator=g))
    mtp |= {f"mtp.{n}.weight": 0.3 * torch.randn(D, generator=g) for n in ("pre_fc_norm_embedding",
                                                                           "pre_fc_norm_hidden", "norm")}
    mtp["mtp.fc.weight"] = 0.15 * torch.randn(D, 2 * D, generator=g)
    save_file(mtp, str(hf_dir / "model-mtp.safetensors"))
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1,
                                                    "mtp_use_dedicated_embeddings": False}))
    cfg = import_hf(hf_dir, root / "weights", progress=False, mtp_depth=1)
    export_hf(root / "weights", root / "export", progress=False)
    return {"hf": hf, "hf_dir": hf_dir, "cfg": cfg, "weights": root / "weights", "export": root / "export",
            "mtp": mtp, "root": root}


def test_qwen3_next_mtp_imports_and_exports_under_its_names(qwen3_next_mtp, tmp_path):
    c = qwen3_next_mtp
    assert c["cfg"].model.mtp_depth == 1
    before, after = _read_all(c["hf_dir"]), _read_all(c["export"])
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert torch.equal(t, after[name]), name
    assert json.loads((c["export"] / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    # Without mtp_depth the module is left behind; two modules' shared fc is refused by name.
    assert import_hf(c["hf_dir"], tmp_path / "plain", progress=False).model.mtp_depth == 0
    with pytest.raises(UnsupportedModel, match="mtp_num_hidden_layers = 1: mtp_depth 2 asks for more"):
        import_hf(c["hf_dir"], tmp_path / "two", progress=False, mtp_depth=2)


def test_qwen3_next_mtp_logits_equal_its_definition_with_transformers_layer(qwen3_next_mtp):
    """The module's logits at position i: the head on mtp.norm of transformers' own full-attention
    decoder layer (holding mtp.layers.0's weights) applied to fc[norm_e(Emb(t_{i+1}));
    norm_h(h_i)], the norms zero-centred, h the main model's last block output — within 1e-5."""
    from moetrain.model.transformer import future_tokens

    c, hf = qwen3_next_mtp, qwen3_next_mtp["hf"]
    L = hf.config.num_hidden_layers
    ours = moetrain_model(c["cfg"], c["weights"]).train()
    inputs, targets = tokens(4)
    for moe in ours.moe_layers().values():
        moe.begin_step(1)
    logits = ours(inputs, future=future_tokens(targets, 1))

    # The reference layer: block L of an (L + 1)-block Qwen3-Next holding the module's layer.
    from safetensors.torch import save_file

    big_dir = c["root"] / "big"
    big_dir.mkdir()
    weights = {k.replace("mtp.layers.0.", f"model.layers.{L}."): v for k, v in _read_all(c["hf_dir"]).items()
               if not k.startswith("mtp.") or k.startswith("mtp.layers.")}
    save_file(weights, str(big_dir / "model.safetensors"))
    config = json.loads((c["hf_dir"] / "config.json").read_text())
    (big_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": L + 1,
                                                     "layer_types": config["layer_types"] + ["full_attention"],
                                                     "mtp_num_hidden_layers": 0}))
    big = AutoModelForCausalLM.from_pretrained(big_dir, dtype=torch.float32, attn_implementation="eager").eval()
    captured = {}
    hf.model.layers[L - 1].register_forward_hook(lambda m, a, out: captured.update(h=out[0] if isinstance(out, tuple)
                                                                                     else out))
    w, eps = c["mtp"], hf.config.rms_norm_eps

    def norm(x, name):  # Qwen3-Next's zero-centred RMSNorm
        return F.rms_norm(x, (x.shape[-1],), 1.0 + w[f"mtp.{name}.weight"], eps)

    with torch.no_grad():
        main = hf(inputs).logits
        h, e = captured["h"], hf.model.embed_tokens(targets)
        x = F.linear(torch.cat([norm(e, "pre_fc_norm_embedding"), norm(h, "pre_fc_norm_hidden")], -1),
                     w["mtp.fc.weight"])
        S = x.shape[1]
        pos = torch.arange(S)[None]
        mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
        x = big.model.layers[L](x, attention_mask=mask, position_ids=pos,
                                position_embeddings=big.model.rotary_emb(x, pos))
        x = x[0] if isinstance(x, tuple) else x
        ref = hf.lm_head(norm(x, "norm"))
    assert rel(logits[:, :, 0], main) <= 1e-5
    assert rel(logits[:, :, 1], ref) <= 1e-5
    assert rel(logits[:, :, 1], main) > 1e-2  # the module's prediction is its own


def test_qwen3_5_multimodal_checkpoint_imports_its_text_model(tmp_path):
    """Qwen3.5's MoE checkpoints are multimodal (Qwen3_5MoeForConditionalGeneration): the text
    model under model.language_model imports (the vision tower left out), gives the multimodal
    model's text logits, and exports as the text model, which transformers loads with the same
    logits and which imports back to the same tensors."""
    import transformers as tf

    from hf_models import hf_config

    text = hf_config("qwen3_5_moe").to_dict()
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
              "patch_size": 4, "num_position_embeddings": 16}
    torch.manual_seed(0)
    hf = tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(0.3 * torch.randn_like(p) + (1.0 if "norm" in name and "linear_attn.norm" in name else 0.0))
    hf.save_pretrained(tmp_path / "hf")
    cfg = import_hf(tmp_path / "hf", tmp_path / "weights", progress=False)
    assert cfg.model.linear_attention and cfg.moe.shared_expert_gate
    inputs, _ = tokens(5)
    with torch.no_grad():
        want = hf(input_ids=inputs).logits
        assert rel(moetrain_model(cfg, tmp_path / "weights")(inputs), want) <= 1e-5
    export_hf(tmp_path / "weights", tmp_path / "export", progress=False)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == ["Qwen3_5MoeForCausalLM"]
    text_only = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel(text_only(inputs).logits, want) <= 1e-5
    back = _read_all(tmp_path / "export")
    for name, t in _read_all(tmp_path / "hf").items():
        if name.startswith("model.language_model."):
            assert torch.equal(back[name.replace("model.language_model.", "model.", 1)], t), name
    with pytest.raises(UnsupportedModel, match="--arch qwen3_5_moe_text"):
        to_hf(cfg, ARCHITECTURES["qwen3_5_moe"])


def test_kimi_linears_published_config_reads_as_transformers_reads_it():
    """Moonshot's own config.json for Kimi Linear (linear_attn_config with 1-indexed layer lists,
    first_k_dense_replace, its MoE spellings and flags) gives the same sections as transformers'
    spelling of the same model; a flag moetrain does not map is refused by name."""
    moonshot = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 320,
                "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 4, "head_dim": 72, "kv_lora_rank": 16, "q_lora_rank": None,
                "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "rms_norm_eps": 1e-5,
                "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None,
                "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_intermediate_size": 16, "num_experts": 8,
                "num_experts_per_token": 2, "num_shared_experts": 1, "moe_renormalize": True,
                "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1,
                "use_grouped_topk": True, "routed_scaling_factor": 2.446, "mla_use_nope": True,
                "num_nextn_predict_layers": 0, "model_max_length": 64, "auto_map": {"AutoConfig": "x.Config"},
                "linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 8,
                                       "num_heads": 2, "short_conv_kernel_size": 4}}
    transformers_way = {k: v for k, v in moonshot.items() if k not in (
        "linear_attn_config", "first_k_dense_replace", "mla_use_nope", "moe_router_activation_func",
        "use_grouped_topk", "moe_layer_freq", "auto_map", "num_nextn_predict_layers")}
    transformers_way |= {"layer_types": ["linear_attention", "full_attention"] * 2, "linear_num_heads": 2,
                         "linear_head_dim": 8, "linear_conv_kernel_dim": 4,
                         "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}
    _, model, moe = from_hf(moonshot)
    assert (model, moe) == from_hf(transformers_way)[1:]
    assert model["layer_types"] == ["kda", "full_attention"] * 2 and not model["rope"] and moe["first_dense"] == 1
    with pytest.raises(UnsupportedModel, match="mla_use_nope = False"):
        from_hf({**moonshot, "mla_use_nope": False})
