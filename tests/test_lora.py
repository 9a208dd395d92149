"""Low-rank adapters (train.lora; moetrain/model/lora.py, moetrain/parallel/lora.py).

The adapter's term against its formula; the experts' adapters the same on the loop and
grouped_mm backends, per expert and shared; a fine-tune that moves the adapters only (the base
bit for bit unchanged, no optimizer state for it); and the layouts — FSDP2 / ZeRO 1-3, HSDP, tp +
SP, pp, ep, etp, cp — equal to one process over 20 steps: losses, global gradient norms and the
adapters' gradients at the last step (at the first, B = 0 gives A no gradient: a comparison
there could not fail for A)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from moetrain.config import ConfigError, validate
from moetrain.model.layers import Linear
from moetrain.model.moe import GroupedExperts

from conftest import tiny_config
from multiproc import run_distributed
from test_equivalence import assert_matches, layout_world

LORA = {"r": 4, "lora_alpha": 8}


def test_the_adapter_adds_its_low_rank_term():
    torch.manual_seed(0)
    lin = Linear(6, 5, bias=False)
    x = torch.randn(3, 6)
    base = lin(x)
    lin.lora_A = torch.nn.Parameter(torch.randn(2, 6))
    lin.lora_B = torch.nn.Parameter(torch.randn(5, 2))
    lin.lora_scaling = 0.5
    torch.testing.assert_close(lin(x), base + 0.5 * x @ lin.lora_A.T @ lin.lora_B.T)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_expert_adapters_are_the_same_on_both_backends(shared, activation):
    torch.manual_seed(1)
    E, D, F, r = 3, 8, 12, 2  # r = 2: 8-byte rows, which grouped_mm pads
    experts = GroupedExperts(D, F, E, activation=activation)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    stacks = 1 if shared else E
    for i, (d_in, d_out) in (("1", (D, F)), ("3", (D, F)), ("2", (F, D))):
        if i == "3" and activation == "relu2":
            continue
        setattr(experts, f"lora_A{i}", torch.nn.Parameter(torch.randn(stacks, d_in, r)))
        setattr(experts, f"lora_B{i}", torch.nn.Parameter(torch.randn(stacks, r, d_out)))
    experts.lora_scaling, experts.lora_shared = 0.7, shared
    sizes = [4, 0, 3]
    x = torch.randn(sum(sizes), D)
    counts = torch.tensor(sizes)
    # The formula, expert by expert.
    want = []
    for e, rows in enumerate(torch.split(x, sizes)):
        s = 0 if shared else e

        def mat(i, h):
            w = getattr(experts, f"w{i}")[e]
            return h @ w + 0.7 * (h @ getattr(experts, f"lora_A{i}")[s]) @ getattr(experts, f"lora_B{i}")[s]

        gate = mat("1", rows)
        h = torch.nn.functional.silu(gate) * mat("3", rows) if activation == "swiglu" else torch.relu(gate).square()
        want.append(mat("2", h))
    want = torch.cat(want)
    runs = []
    for backend in ("loop", "grouped_mm"):
        experts.backend = backend
        out = experts(x, counts)
        out.pow(2).sum().backward()
        runs.append((out.detach(), {n: p.grad.clone() for n, p in experts.named_parameters()}))
        experts.zero_grad()
    torch.testing.assert_close(runs[0][0], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runs[1][0], want, rtol=1e-5, atol=1e-5)
    for name, g in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][name], g, rtol=1e-5, atol=1e-4, msg=name)


def _cfg(tmp_path, **lora):
    return tiny_config(tmp_path / "data", tmp_path / "run", train={"lora": {**LORA, **lora}})


@pytest.mark.parametrize("lora, field", [
    ({"r": -1}, "train.lora.r"),
    ({"lora_alpha": 0}, "train.lora.lora_alpha"),
    ({"lora_dropout": 1.0}, "train.lora.lora_dropout"),
    ({"target_modules": []}, "train.lora.target_modules"),
])
def test_bad_lora_settings_name_the_field(tmp_path, lora, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(_cfg(tmp_path, **lora))


def test_a_target_that_selects_nothing_is_refused(tmp_path):
    from moetrain.model.lora import adapter_targets
    from moetrain.model.transformer import Transformer

    cfg = _cfg(tmp_path, target_modules=["wq", "q_proj"])
    with torch.device("meta"):
        model = Transformer.from_config(cfg)
    with pytest.raises(ConfigError, match=r"\['q_proj'\] select no weight.*'wq'"):
        adapter_targets(model, cfg.train.lora)
    chosen, routers = adapter_targets(model, _cfg(tmp_path, target_modules=["experts.w2", "router"]).train.lora)
    assert chosen == ["layers.0.moe.experts.w2", "layers.1.moe.experts.w2"]
    assert routers == ["layers.0.moe.router", "layers.1.moe.router"]


def train_lora(rank: int, world: int, data: str, run_dir: str, parallel: dict, lora: dict, model: dict | None = None,
               moe: dict | None = None, data_section: dict | None = None, steps: int = 20) -> dict:
    """``steps`` steps of the tiny model with ``lora``, gradients clipped at 0.2: losses, global
    gradient norms, the last step's gradients (full tensors, by name), which parameters train,
    and whether every frozen one is still bit for bit its initial value."""
    from moetrain.train.trainer import Trainer

    cfg = tiny_config(data, run_dir, parallel=parallel, model={"vocab_size": 260, **(model or {})}, moe=moe or {},
                      data=data_section or {},
                      train={"steps": steps, "grad_clip": 0.2, "fp8_block": 8, "lora": {**LORA, **lora}})
    trainer = Trainer(cfg, write_files=False)

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    def local_bytes(t: torch.Tensor) -> torch.Tensor:  # (an FP8 base's codes: compared as bytes)
        t = (t.to_local() if isinstance(t, DTensor) else t).detach()
        return t.view(torch.uint8).clone() if t.dtype == torch.float8_e4m3fn else t.clone()

    frozen = {n: local_bytes(p) for part in trainer.model_parts for n, p in part.named_parameters()
              if not p.requires_grad}
    captured: dict = {}
    count = [0]

    def hook(opt, args, kwargs):
        count[0] += 1
        if count[0] == steps:
            captured.update({n: whole(p.grad) for part in trainer.model_parts for n, p in part.named_parameters()
                             if p.grad is not None})

    # The dtypes the frozen weights have where a module computes with them (FSDP's gathered
    # copies under ZeRO): an attention projection's and the experts' w1.
    gathered: set[str] = set()

    def record(module, args):
        for w in (getattr(module, "weight", None), getattr(module, "w1", None)):
            if w is not None:
                gathered.add(str((w.to_local() if isinstance(w, DTensor) else w).dtype))

    watched = [h for part in trainer.model_parts for name, m in part.named_modules()
               if name.endswith(("attention.wo", "moe.experts")) for h in [m.register_forward_pre_hook(record)]]
    handle = trainer.optimizers[0].register_step_pre_hook(hook)
    results = [trainer.train_step() for _ in range(steps)]
    handle.remove()
    for h in watched:
        h.remove()
    params = {n: p for part in trainer.model_parts for n, p in part.named_parameters()}
    unchanged = all(torch.equal(local_bytes(params[n]), v) for n, v in frozen.items())
    grads = {n: g for n, g in captured.items() if params[n].requires_grad}
    state = sum(len(s) > 0 for s in trainer.optimizers[0].state.values())
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results], "grads": grads,
            "trainable": sorted(grads), "frozen_unchanged": unchanged, "optimizer_states": state,
            "frozen_grads": [n for n in frozen if params[n].grad is not None], "gathered": sorted(gathered)}


def test_a_fine_tune_moves_the_adapters_only(tiny_shards, tmp_path):
    out = run_distributed(train_lora, 1, str(tiny_shards), str(tmp_path / "run"), {},
                          {"target_modules": ["all-linear", "router"]}, None, None, None, 6)[0]
    assert out["frozen_unchanged"] and not out["frozen_grads"]
    assert out["losses"][-1] < out["losses"][0]
    trainable = out["trainable"]
    assert all("lora_" in n or ".router." in n for n in trainable), trainable
    for name in ("layers.0.attention.wq.lora_A", "layers.0.moe.experts.lora_B2", "layers.1.moe.shared.w3.lora_B",
                 "layers.1.moe.router.weight"):
        assert name in trainable
    assert not any(n.startswith(("output.", "tok_embeddings.")) for n in trainable)
    assert out["optimizer_states"] == len(trainable)
    assert all(out["grads"][n].abs().sum() > 0 for n in trainable), "every adapter must learn by step 6"


_REFS: dict = {}


def _reference(key, shards, tmp_path, lora, model, moe, data_section):
    if key not in _REFS:
        _REFS[key] = run_distributed(train_lora, 1, shards, str(tmp_path / "ref"), {}, lora, model, moe,
                                     data_section)[0]
        ref = _REFS[key]
        assert ref["losses"][-1] < ref["losses"][0], "the reference must learn"
        assert max(ref["norms"]) > 0.2, "the test must clip"
    return _REFS[key]


MLA = {"attention": "mla", "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 8}

# layout → (parallel, lora, model, documents)
LAYOUTS = {
    "dp2-ep2-zero1": ({"dp": 2, "ep": 2, "zero_stage": 1}, {}, {}, False),
    "dp2-ep2-zero3-shared": ({"dp": 2, "ep": 2, "zero_stage": 3}, {"experts": "shared"}, {}, False),
    "hsdp-dp4-shard2-ep2": ({"dp": 4, "dp_shard": 2, "ep": 2, "zero_stage": 2}, {}, {}, False),
    "dp2-tp2-sp-ep2": ({"dp": 2, "tp": 2, "sequence_parallel": True, "ep": 2}, {}, {}, False),
    "dp2-tp2-sp-ep2-mla": ({"dp": 2, "tp": 2, "sequence_parallel": True, "ep": 2}, {"experts": "shared"}, MLA, False),
    "dp2-tp2-ep2-etp2": ({"dp": 2, "tp": 2, "ep": 2, "etp": 2}, {}, {}, False),
    "tp2-etp2-shared": ({"tp": 2, "etp": 2, "dp": 2, "ep": 2}, {"experts": "shared"}, {}, False),
    "pp2-dp2-ep2": ({"pp": 2, "dp": 2, "ep": 2}, {}, {}, False),
    "cp2-ep2-docs": ({"cp": 2, "ep": 2}, {"target_modules": ["all-linear", "router"]}, {}, True),
    # A frozen base stored in bf16, and in FP8 with 8 × 8 block scales placed with the weights.
    "pp2-dp2-ep2-bf16-base": ({"pp": 2, "dp": 2, "ep": 2}, {"base_dtype": "bf16"}, {}, False),
    "dp2-tp2-sp-ep2-fp8-base": ({"dp": 2, "tp": 2, "sequence_parallel": True, "ep": 2, "zero_stage": 3},
                                {"base_dtype": "fp8"}, {}, False),
    "dp2-tp2-ep2-etp2-fp8-base": ({"dp": 2, "tp": 2, "ep": 2, "etp": 2, "zero_stage": 1}, {"base_dtype": "fp8"}, {},
                                  False),
    "cp2-ep2-fp8-base-mla": ({"cp": 2, "ep": 2}, {"base_dtype": "fp8", "experts": "shared"}, MLA, True),
}


@pytest.mark.slow(fast=["dp2-tp2-ep2-etp2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_trains_as_in_one_process(layout, tiny_shards, short_doc_shards, tmp_path):
    parallel, lora, model, docs = LAYOUTS[layout]
    shards, data_section = (short_doc_shards, {"document_mask": True}) if docs else (tiny_shards, {})
    key = (str(sorted(lora.items())), str(sorted(model.items())), docs)
    ref = _reference(key, str(shards), tmp_path, lora, model, {}, data_section)
    results = run_distributed(train_lora, layout_world(parallel), str(shards), str(tmp_path / "run"), parallel, lora,
                              model, {}, data_section)
    got = {"losses": results[-1]["losses"], "grads": {}}
    stored = {"fp8": "torch.float8_e4m3fn", "bf16": "torch.bfloat16"}.get(lora.get("base_dtype"), "torch.float32")
    for r in results:
        assert r["frozen_unchanged"] and not r["frozen_grads"], "the base must stay frozen on every rank"
        # FSDP gathers the base as stored (ZeRO-1/3 in the fp8 layouts): never cast up to fp32
        assert r["gathered"] == [stored], r["gathered"]
        got["grads"].update(r["grads"])
    assert sorted(got["grads"]) == ref["trainable"]
    assert_matches(got, ref)
    for step, (a, b) in enumerate(zip(results[-1]["norms"], ref["norms"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: grad norm {a} vs single-process {b}"


def _run(rank: int, world: int, data: str, run_dir: str, parallel: dict, stop: int, lora: dict | None,
         init_from: str | None, every: int) -> dict:
    """Train a 6-step schedule up to step ``stop`` (resuming when the run has a checkpoint),
    checkpointing every ``every`` steps: the first step's number and the losses."""
    from moetrain.train.trainer import Trainer

    train = {"steps": 6, "lora": {**LORA, **lora}} if lora is not None else {"steps": 6}
    cfg = tiny_config(data, run_dir, parallel=parallel, train=train,
                      checkpoint={"every": every, "resume": True, "init_from": init_from, "async": False})
    trainer = Trainer(cfg, write_files=False)
    first = trainer.step
    losses = []
    while trainer.step < stop:
        losses.append(trainer.train_step().loss)
        if every and trainer.step % every == 0:
            trainer.save_checkpoint()
    trainer.checkpointer.wait()
    return {"first": first, "losses": losses}


def test_a_lora_checkpoint_holds_the_adapters_and_names_its_base(tiny_shards, tmp_path):
    from moetrain.train.checkpoint import list_checkpoints
    from moetrain.train.weights import dcp_model_shapes

    data, layout = str(tiny_shards), {"dp": 2, "ep": 2}
    for name, steps in (("base", 2), ("other", 3)):  # two bases: 2 and 3 steps of full training
        run_distributed(_run, 2, data, str(tmp_path / name), layout, steps, None, None, steps)
    bases = {n: str(list_checkpoints(tmp_path / n / "checkpoints")[-1][1]) for n in ("base", "other")}
    assert all(bases.values())
    whole = run_distributed(_run, 2, data, str(tmp_path / "whole"), layout, 6, {}, bases["base"], 0)[0]
    part = run_distributed(_run, 2, data, str(tmp_path / "ft"), layout, 3, {}, bases["base"], 3)[0]
    ckpt = list_checkpoints(tmp_path / "ft" / "checkpoints")[-1][1]
    keys = list(dcp_model_shapes(ckpt))
    assert keys and all("lora_" in k or k.endswith("expert_bias") for k in keys), keys
    # The resume loads the base from init_from, then the adapters and their optimizer state.
    rest = run_distributed(_run, 2, data, str(tmp_path / "ft"), layout, 6, {}, bases["base"], 3)[0]
    assert rest["first"] == 3
    assert part["losses"] + rest["losses"] == whole["losses"]
    with pytest.raises(RuntimeError, match=r"trained on the base .*" + bases["base"].split("/")[-1] + r".*this run's base"):
        run_distributed(_run, 2, data, str(tmp_path / "ft"), layout, 6, {}, bases["other"], 3)


def _fp8_run(rank: int, world: int, data: str, run_dir: str, parallel: dict, init_from: str | None) -> dict:
    """6 steps on an FP8 base: the losses, and with ``init_from`` (a weights directory) how many
    FP8 tensors this rank holds and whether each one's codes and scales are, bit for bit, its
    piece of the file's tensor quantized whole."""
    from safetensors.torch import load_file

    from moetrain.model.fp8 import E4M3, quantize_blocks
    from moetrain.model.init import local_piece
    from moetrain.train.trainer import Trainer

    cfg = tiny_config(data, run_dir, parallel=parallel, model={"vocab_size": 260},
                      train={"steps": 6, "fp8_block": 8, "lora": {**LORA, "base_dtype": "fp8"}},
                      checkpoint={"init_from": init_from})
    trainer = Trainer(cfg, write_files=False)
    checked, exact = 0, True
    if init_from is not None:
        from pathlib import Path

        file = {k: v for f in sorted(Path(init_from).glob("*.safetensors")) for k, v in load_file(f).items()}
        params = dict(trainer.model_parts[0].named_parameters())
        for name, p in params.items():
            if p.dtype != E4M3:
                continue
            codes, scales = quantize_blocks(file[name], 8)
            local, where = local_piece(p)
            scale_local, scale_where = local_piece(params[f"{name}_scale_inv"])
            exact &= torch.equal(local.view(torch.uint8), codes[where].view(torch.uint8))
            exact &= torch.equal(scale_local, scales[scale_where])
            checked += 1
    return {"losses": [trainer.train_step().loss for _ in range(6)], "checked": checked, "exact": exact}


def test_an_fp8_base_is_quantized_as_it_is_loaded(tiny_shards, tmp_path):
    """Unquantized weights (here 1.25 × the initial values) loaded into an FP8 base under tp are
    quantized whole and sliced, codes and scales by whole blocks with the weights."""
    from moetrain.model.init import init_weights
    from moetrain.model.transformer import Transformer
    from moetrain.train.weights import write_weights_dir

    cfg = tiny_config(tiny_shards, tmp_path / "w", model={"vocab_size": 260})
    model = Transformer.from_config(cfg)
    init_weights(model, cfg.run.seed, cfg.model.init_std, cfg.model.layers)
    state = {n: t * 1.25 for n, t in model.state_dict().items()}
    write_weights_dir(tmp_path / "w", cfg, state.items(), [(n, t.dtype, tuple(t.shape)) for n, t in state.items()],
                      progress=False)
    drawn = run_distributed(_fp8_run, 2, str(tiny_shards), str(tmp_path / "a"), {"tp": 2}, None)[0]
    loaded = run_distributed(_fp8_run, 2, str(tiny_shards), str(tmp_path / "b"), {"tp": 2}, str(tmp_path / "w"))
    for r in loaded:
        assert r["checked"] == 2 * (4 + 3 + 3) and r["exact"]  # per block: wq wk wv wo, shared w1-3, experts w1-3
    assert loaded[0]["losses"] != drawn["losses"]


def test_an_fp8_base_trains_within_one_percent_of_bf16(tiny_shards, tmp_path):
    """50 steps of the tiny model: the FP8 base (8 × 8 blocks) against the bf16 base, loss by loss
    within 1 % (the issue's bound; the demo's 128 × 128 blocks: benchmarks/bench_lora.py)."""
    runs = {}
    for base in ("bf16", "fp8"):
        runs[base] = run_distributed(train_lora, 1, str(tiny_shards), str(tmp_path / base), {}, {"base_dtype": base},
                                     None, None, None, 50)[0]["losses"]
    assert runs["bf16"][-1] < runs["bf16"][0] - 0.1, "the fine-tune must learn"
    worst = max(abs(a - b) / b for a, b in zip(runs["fp8"], runs["bf16"]))
    assert worst < 0.01, f"FP8 base {worst:.2%} off the bf16 base"
    assert runs["fp8"] != runs["bf16"], "the FP8 base must round the weights"


def test_a_merged_export_computes_what_the_lora_run_computes(tiny_shards, tmp_path):
    """``hf export --merge`` of a LoRA run's checkpoint (dp2 × ep2, adapters and a trained router
    on an imported base): transformers' Mixtral from the export gives the logits moetrain's
    adapted model gives (base + adapters, in one process), and without ``--merge`` the export is
    refused."""
    transformers = pytest.importorskip("transformers")
    from moetrain.config import save_config
    from moetrain.hf.__main__ import main as hf_main
    from moetrain.model.init import init_weights
    from moetrain.model.lora import add_adapters
    from moetrain.model.transformer import Transformer
    from moetrain.train.checkpoint import list_checkpoints
    from moetrain.train.weights import CheckpointReader, write_weights_dir

    mixtral = {"moe": {"shared_experts": 0}, "model": {"vocab_size": 260, "rope_theta": 10000.0}}
    cfg = tiny_config(tiny_shards, tmp_path / "w", **mixtral)
    model = Transformer.from_config(cfg)
    init_weights(model, 3, cfg.model.init_std, cfg.model.layers)
    state = model.state_dict()
    write_weights_dir(tmp_path / "w", cfg, state.items(), [(n, t.dtype, tuple(t.shape)) for n, t in state.items()],
                      progress=False)
    run_distributed(_merge_run, 2, str(tiny_shards), str(tmp_path / "run"), str(tmp_path / "w"))
    run_cfg = _merge_config(str(tiny_shards), str(tmp_path / "run"), str(tmp_path / "w"))
    save_config(run_cfg, tmp_path / "run.yaml")
    ckpt = list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1]
    assert hf_main(["export", str(ckpt), "--out", str(tmp_path / "x"), "--config", str(tmp_path / "run.yaml")]) == 2
    assert hf_main(["export", str(ckpt), "--out", str(tmp_path / "hf"), "--config", str(tmp_path / "run.yaml"),
                    "--merge", "--arch", "mixtral"]) == 0

    ours = Transformer.from_config(run_cfg)
    add_adapters(ours, run_cfg.train.lora)
    weights = CheckpointReader(tmp_path / "w", progress=False)
    adapters = CheckpointReader(ckpt, progress=False)
    ours.load_state_dict({**weights.read(list(weights.shapes)), **adapters.read(list(adapters.shapes))}, strict=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ours.eval()(ids), hf(ids).logits
    assert any(adapters.read([n])[n].abs().sum() > 0 for n in adapters.shapes if "lora_B" in n), "adapters must train"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _merge_config(data: str, run_dir: str, base: str):
    return tiny_config(data, run_dir, parallel={"dp": 2, "ep": 2}, moe={"shared_experts": 0},
                       model={"vocab_size": 260, "rope_theta": 10000.0},
                       train={"steps": 4, "lr": 1e-2, "lora": {**LORA, "target_modules": ["all-linear", "router"]}},
                       checkpoint={"init_from": base, "every": 4, "async": False})


def _merge_run(rank: int, world: int, data: str, run_dir: str, base: str) -> None:
    from moetrain.train.trainer import Trainer

    trainer = Trainer(_merge_config(data, run_dir, base), write_files=False)
    for _ in range(4):
        trainer.train_step()
    trainer.save_checkpoint()
    trainer.checkpointer.wait()


def _adapted_run(rank: int, world: int, cfg) -> None:
    from moetrain.train.trainer import Trainer

    trainer = Trainer(cfg, write_files=False)
    for _ in range(cfg.train.steps):
        trainer.train_step()
    trainer.save_checkpoint()
    trainer.checkpointer.wait()


# DeepSeek-V3's dense first block and shared experts call their matrices gate_proj / up_proj /
# down_proj, as its routed experts do: PEFT loads every target of those names into the experts,
# so the export refuses adapters there (below); the fine-tune adapts attention and experts.
PEFT_TARGETS = {"mixtral": ["all-linear"], "qwen3_moe": ["all-linear"], "llama4_text": ["all-linear"],
                "gpt_oss": ["all-linear"],
                "deepseek_v3": ["wq_a", "wq_b", "wkv_a", "wk_rope", "wkv_b", "wo", "experts.w1", "experts.w2",
                                "experts.w3"]}


@pytest.mark.parametrize("arch", list(PEFT_TARGETS))
def test_peft_loads_the_exported_adapters_with_moetrains_logits(arch, tiny_shards, tmp_path, capsys):
    """Import an HF model, fine-tune adapters on its projections and every expert in dp2 × ep2,
    export them with ``--lora``: ``peft.PeftModel.from_pretrained`` on transformers' model gives
    the logits of moetrain's adapted model (fp32, within 1e-5; measured 1.7e-6 of logits up to
    3.5). Llama 4's and GPT-OSS's fused expert parameters take PEFT's LoRA on parameters (w1 and
    w3 at rank 2·r in ``gate_up_proj``, concatenated and interleaved). DeepSeek-V3's adapters on
    its dense MLP are refused, naming the fix."""
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from hf_models import VOCAB, build_hf_model
    from moetrain.config import load_config, save_config
    from moetrain.hf.__main__ import main as hf_main
    from moetrain.model.lora import add_adapters
    from moetrain.model.transformer import Transformer
    from moetrain.train.checkpoint import list_checkpoints
    from moetrain.train.weights import CheckpointReader, load_weights_dir

    build_hf_model(arch, tmp_path / "hf", seed=1)
    assert hf_main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "w"), "--config",
                    str(tmp_path / "import.yaml")]) == 0
    imported = load_config(tmp_path / "import.yaml")
    cfg = imported.replace(run={"dir": str(tmp_path / "run")}, data={"path": str(tiny_shards)},
                           parallel={"dp": 2, "ep": 2}, moe={"bias_update_rate": 0.0},
                           train={"steps": 3, "micro_batch_size": 2, "global_batch_size": 4, "lr": 1e-2,
                                  "warmup_steps": 1, "val_every": 0,
                                  "lora": {**LORA, "lora_alpha": 16, "target_modules": PEFT_TARGETS[arch]}},
                           checkpoint={"every": 0, "async": False})
    cfg = cfg.replace(model={"seq_len": 16})
    if arch == "deepseek_v3":  # the dense block's MLP adapted too: refused, naming the experts
        dense = cfg.replace(run={"dir": str(tmp_path / "dense")},
                            train={"lora": {**LORA, "lora_alpha": 16, "target_modules": ["all-linear"]}})
        run_distributed(_adapted_run, 2, dense)
        save_config(dense, tmp_path / "dense.yaml")
        assert hf_main(["export", str(tmp_path / "dense" / "checkpoints"), "--lora", "--out", str(tmp_path / "x"),
                        "--config", str(tmp_path / "dense.yaml")]) == 2
        assert "model.layers.0.mlp.down_proj" in capsys.readouterr().err
    run_distributed(_adapted_run, 2, cfg)
    save_config(cfg, tmp_path / "run.yaml")
    ckpt = list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1]
    assert hf_main(["export", str(ckpt), "--lora", "--out", str(tmp_path / "adapter"), "--config",
                    str(tmp_path / "run.yaml")]) == 0

    ours = Transformer.from_config(cfg)
    add_adapters(ours, cfg.train.lora)
    load_weights_dir(tmp_path / "w", [ours])
    adapters = CheckpointReader(ckpt, progress=False)
    trained = adapters.read(list(adapters.shapes))
    assert any(v.abs().sum() > 0 for k, v in trained.items() if "lora_B" in k), "the adapters must train"
    ours.load_state_dict(trained, strict=False)
    hf = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32),
                                        tmp_path / "adapter").eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ours.eval()(ids), hf(ids).logits
        base = hf.get_base_model()
        with hf.disable_adapter():
            plain = hf(ids).logits
    assert (plain - want).abs().max() > 1e-3, "the adapters must change the logits"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    del base


def _fp8_checkpoint(hf_dir, out, block: int) -> dict:
    """``hf_dir``'s model saved in DeepSeek-V3's FP8 format into ``out``: every linear of the
    blocks except the router as E4M3 codes with ``weight_scale_inv`` per ``block``² block.
    Returns the FP8 tensors (codes and scales) by name."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from moetrain.model.fp8 import quantize_blocks

    out.mkdir()
    state = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    saved = {}
    for name, t in state.items():
        if ".layers." in name and t.dim() == 2 and "norm" not in name and not name.endswith("mlp.gate.weight"):
            saved[name], saved[f"{name}_scale_inv"] = quantize_blocks(t, block)
        else:
            saved[name] = t
    save_file(saved, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (out / "config.json").write_text(json.dumps(config))
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    return {k: v for k, v in saved.items() if v.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv")}


def test_deepseeks_fp8_checkpoint_imports_as_it_is(tmp_path):
    """A DeepSeek-V3 checkpoint in its FP8 format (8 × 8 blocks here) imports its codes and scales
    bit for bit (experts transposed with their scales, MLA's kv_a split on a block boundary); a
    model that is not an FP8 base dequantizes them: its logits are transformers' on the
    dequantized weights (an FP8 base loading them: the next test)."""
    pytest.importorskip("transformers")
    from hf_models import VOCAB, build_hf_model
    from moetrain.hf.convert import import_hf
    from moetrain.model.fp8 import dequantize_blocks
    from moetrain.model.lora import fp8_weight_names
    from moetrain.model.transformer import Transformer
    from moetrain.train.weights import CheckpointReader, load_weights_dir
    from safetensors.torch import load_file

    hf = build_hf_model("deepseek_v3", tmp_path / "hf", seed=2)
    fp8 = _fp8_checkpoint(tmp_path / "hf", tmp_path / "fp8", 8)
    cfg = import_hf(tmp_path / "fp8", tmp_path / "w", progress=False)
    mine = {k: v for f in sorted((tmp_path / "w").glob("*.safetensors")) for k, v in load_file(f).items()}
    as_bytes = {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v for k, v in mine.items()}
    hf_bytes = {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v for k, v in fp8.items()}
    assert torch.equal(as_bytes["layers.1.moe.experts.w1"][3], hf_bytes["model.layers.1.mlp.experts.3.gate_proj.weight"].t())
    assert torch.equal(as_bytes["layers.1.moe.experts.w1_scale_inv"][3],
                       hf_bytes["model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv"].t())
    kv = hf_bytes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert torch.equal(as_bytes["layers.0.attention.wkv_a.weight"], kv[:16])
    assert torch.equal(as_bytes["layers.0.attention.wk_rope.weight"], kv[16:])
    assert torch.equal(as_bytes["layers.0.attention.wk_rope.weight_scale_inv"],
                       hf_bytes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"][2:])
    with torch.device("meta"):  # every weight an FP8 base stores so, as FP8 codes with scales: nothing dequantized
        want = fp8_weight_names(Transformer.from_config(cfg))
    assert {k for k, v in mine.items() if v.dtype == torch.float8_e4m3fn} == want
    assert {k for k in mine if k.endswith("_scale_inv")} == {f"{k}_scale_inv" for k in want}

    # A model that is not an FP8 base: dequantized as it loads, transformers' logits on the same values.
    ours = Transformer.from_config(cfg)
    load_weights_dir(tmp_path / "w", [ours])
    with torch.no_grad():
        for name, p in hf.named_parameters():
            key = f"{name}_scale_inv"
            if key in fp8:
                p.copy_(dequantize_blocks(fp8[name], fp8[key], 8, torch.float32))
            elif name.endswith(("gate_up_proj", "down_proj")) and ".experts." in name:  # fused in transformers 5
                e = int(name.split("layers.")[1].split(".")[0])
                parts = ["gate_proj", "up_proj"] if name.endswith("gate_up_proj") else ["down_proj"]
                p.copy_(torch.stack([torch.cat([dequantize_blocks(
                    fp8[f"model.layers.{e}.mlp.experts.{x}.{part}.weight"],
                    fp8[f"model.layers.{e}.mlp.experts.{x}.{part}.weight_scale_inv"], 8, torch.float32)
                    for part in parts]) for x in range(p.shape[0])]))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids), hf.eval()(ids).logits, rtol=1e-5, atol=1e-5)
    reader = CheckpointReader(tmp_path / "w", progress=False)
    assert reader.shapes["layers.1.moe.experts.w2"][1] == torch.bfloat16 and \
        "layers.1.moe.experts.w2_scale_inv" not in reader.shapes


def _fp8_base_holds(rank: int, world: int, cfg, weights: str) -> bool:
    """Whether every FP8 parameter (codes and scales) of the FP8 base that ``cfg`` builds holds,
    bit for bit, its piece of the weights directory's tensor."""
    from pathlib import Path

    from safetensors.torch import load_file

    from moetrain.model.init import local_piece
    from moetrain.train.trainer import Trainer

    trainer = Trainer(cfg, write_files=False)
    file = {k: v for f in sorted(Path(weights).glob("*.safetensors")) for k, v in load_file(f).items()}
    params = dict(trainer.model_parts[0].named_parameters())
    checked = 0
    for name, p in params.items():
        if p.dtype != torch.float8_e4m3fn:
            continue
        for n in (name, f"{name}_scale_inv"):
            local, where = local_piece(params[n])
            a, b = local, file[n][where]
            if a.dtype == torch.float8_e4m3fn:
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            if not torch.equal(a, b):
                return False
        checked += 1
    return checked > 0


def test_an_fp8_base_loads_an_fp8_import_as_it_is(tiny_shards, tmp_path):
    """The FP8 base of a LoRA run (dp2 × ep2) holds the codes and scales of
    an FP8 import as they are: DeepSeek-V3's own FP8 checkpoint, and a bf16 one quantized once
    at import (``import --base-dtype fp8``), whose codes are the moetrain-layout tensors
    quantized."""
    pytest.importorskip("transformers")
    from hf_models import build_hf_model
    from moetrain.config import load_config
    from moetrain.hf.__main__ import main as hf_main
    from moetrain.model.fp8 import quantize_blocks
    from safetensors.torch import load_file

    build_hf_model("deepseek_v3", tmp_path / "hf", seed=3)
    _fp8_checkpoint(tmp_path / "hf", tmp_path / "fp8", 8)
    assert hf_main(["import", str(tmp_path / "fp8"), "--out", str(tmp_path / "a"), "--config",
                    str(tmp_path / "a.yaml")]) == 0
    assert hf_main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "b"), "--base-dtype", "fp8",
                    "--fp8-block", "8"]) == 0
    assert hf_main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "plain")]) == 0
    quantized = {k: v for f in sorted((tmp_path / "b").glob("*.safetensors")) for k, v in load_file(f).items()}
    plain = {k: v for f in sorted((tmp_path / "plain").glob("*.safetensors")) for k, v in load_file(f).items()}
    codes, scales = quantize_blocks(plain["layers.1.moe.experts.w3"], 8)
    assert torch.equal(quantized["layers.1.moe.experts.w3"].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(quantized["layers.1.moe.experts.w3_scale_inv"], scales)
    for weights in ("a", "b"):
        cfg = load_config(tmp_path / "a.yaml").replace(
            run={"dir": str(tmp_path / f"run-{weights}")}, parallel={"dp": 2, "ep": 2},
            data={"path": str(tiny_shards)}, checkpoint={"init_from": str(tmp_path / weights)},
            train={"fp8_block": 8, "lora": {**LORA, "base_dtype": "fp8"}})
        assert all(run_distributed(_fp8_base_holds, 2, cfg, str(tmp_path / weights))), weights
