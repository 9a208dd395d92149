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
from moetrain.hf.arch import ARCHITECTURES, UnsupportedModel, choose_architecture, from_hf, to_hf
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
    model = Transformer(cfg)
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
    arch = ARCHITECTURES[CASES[case][0]]
    maps = tensor_maps(c["cfg"], arch.moe_names, arch.name == "DeepseekV3ForCausalLM")
    for m in maps:
        if m.ours not in grads:  # a buffer (the routing bias): no gradient
            continue
        want = torch.cat(list(m.to_ours(hf_grads.__getitem__)))
        tol = 1e-5 * want.abs().max().item() + 1e-8
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
        load_weights_dir(tmp_path / "w", [Transformer(c["cfg"])])


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


def base_config(arch: str) -> dict:
    from hf_models import hf_config

    return json.loads(hf_config(arch).to_json_string())  # what save_pretrained writes to config.json


REFUSED = [
    ("qwen3_next", {}, "Qwen3NextForCausalLM"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
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
