"""A LoRA run's adapters as a PEFT adapter directory (``python -m moetrain.hf export --lora``).

Format: PEFT's ``LoraConfig`` (``adapter_config.json``) and ``adapter_model.safetensors`` with
keys ``base_model.model.{module}.lora_A.weight`` [r, in] and ``….lora_B.weight`` [out, r], under
the module names of the architecture's Hugging Face checkpoint — the routed experts under their
per-expert names (``…experts.{e}.w1`` for Mixtral, ``…experts.{e}.gate_proj`` for Qwen-MoE and
DeepSeek-V3), the format PEFT ≥ 0.18 converts on load into transformers 5's fused expert
parameters (``peft.utils.transformers_weight_conversion``; checked with PEFT 0.21.2 and
transformers 5.24) and the per-expert naming vLLM's MoE LoRA loader takes (vLLM is not installed
here: not checked).

Each moetrain adapter maps as its weight does (:class:`moetrain.hf.tensors.TensorMap`): the
experts' A [in, r] and B [r, out] per expert transposed into PEFT's [r, in] and [out, r] (one
shared pair repeated per expert); a RoPE row permutation or a row reordering applies to B's rows;
a weight split into several HF modules splits B's rows; several moetrain weights concatenated
into one HF module (MLA's ``kv_a_proj_with_mqa``) give it A = [A_1; A_2] and B = diag(B_1, B_2),
rank n·r, declared in ``rank_pattern`` with ``alpha_pattern`` keeping its scale alpha / r (a
member without an adapter contributes zero blocks). So PEFT's B A · alpha / r is exactly the
delta moetrain computes. Fused expert parameters (Llama 4's and GPT-OSS's ``gate_up_proj`` and
``down_proj``, [E, in, out]) take PEFT's LoRA on parameters (``target_parameters``, one
``ParamWrapper`` per parameter; :func:`_fused_adapter`), w1 and w3 together at rank 2·r in
``gate_up_proj``. What an adapter cannot carry is refused, naming ``--merge``: routers
trained whole, routing biases moved by training, a 2-D weight stored as columns or interleaved
parts of one tensor, and adapters on a dense MLP or shared expert whose HF name is the experts' own
(DeepSeek-V3's ``gate_proj``): PEFT 0.21 with transformers 5 moves every target of that name to the
fused expert parameters and would drop them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from moetrain.config import Config
from moetrain.hf.arch import UnsupportedModel, architecture_for, choose_architecture
from moetrain.hf.tensors import TensorMap, interleaved_to_rope
from moetrain.model.lora import adapter_names, is_adapter
from moetrain.train.safetensors_stream import WeightsError
from moetrain.train.weights import CheckpointReader, atomic_dir

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _b_rows_to_hf(m: TensorMap, b: torch.Tensor) -> list[torch.Tensor]:
    """B [out, r] of moetrain weight ``m`` in the HF rows of each HF tensor ``m`` writes."""
    if m.layout == "rows":
        b = b[torch.argsort(torch.tensor(m.rows))]
    elif m.layout == "rope":
        b = interleaved_to_rope(b, m.heads, m.rotary)
    if m.hf_cat:
        return list(b.split([rows for _, rows in m.hf_cat]))
    return [b] * (1 + len(m.also))


def _module(hf_name: str) -> str:
    return hf_name.removesuffix(".weight")


def _fused_adapter(m: TensorMap, maps: dict[str, TensorMap], pairs: dict[str, tuple[str, str]],
                   reader: CheckpointReader, r: int, swapped: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """PEFT's ``lora_A`` and ``lora_B`` weights of the LoRA ``ParamWrapper`` on a fused expert
    parameter (``m.hf``: [E, in, out] with x @ W[e], Llama 4's and GPT-OSS's ``gate_up_proj``
    [E, D, 2F] and ``down_proj`` [E, F, D]), holding the adapters of the moetrain weights it is
    made of (w1 and w3 as parts of ``gate_up_proj``, w2 alone).

    Per expert the delta is L_e R_e · alpha / r' with L_e [in, r'] = [A_1 … A_n] (moetrain's A
    [in, r] of each member) and R_e [r', out] the members' B [r, out] on the block diagonal,
    their columns concatenated or interleaved as the parameter holds the members: rank
    r' = n·r, exact (a member without an adapter contributes zero blocks). PEFT 0.21
    (``ParamWrapper``, checked with transformers 5.24) stores E · r' rows of ``lora_A`` (expert
    e's rank rows at e·r') and E · r' columns of ``lora_B`` (column j·E + e), and reads the delta
    of expert e as A_eᵀ B_eᵀ, or as B_e A_e where the module does not mark its stacks
    ``is_transposed`` (Llama 4's; ``swapped``): then B_e = L_e and A_e = R_e, else A_e = L_eᵀ
    and B_e = R_eᵀ.
    Returns (lora_A [E·r', cols], lora_B [rows, E·r'], r')."""
    members = m.part.members if m.part is not None else (m.ours,)
    E, n = m.shape[0], len(members)
    lefts, rights = [], []
    for i, member in enumerate(members):
        mm = maps[member]
        if member in pairs:
            t = reader.read(list(pairs[member]))
            a, b = (x.float() for x in t.values())  # [E or 1, in, r], [E or 1, r, out]
            a, b = a.expand(E, *a.shape[1:]), b.expand(E, *b.shape[1:])
        else:
            a, b = torch.zeros(E, mm.shape[1], r), torch.zeros(E, r, mm.shape[2])
        lefts.append(a)
        right = torch.zeros(E, n * r, mm.shape[2])
        right[:, i * r:(i + 1) * r] = b
        rights.append(right)
    left = torch.cat(lefts, dim=2)                                       # [E, in, r']
    right = m.part.assemble(rights) if m.part is not None else rights[0]  # [E, r', out]
    a_e, b_e = (right, left) if swapped else (left.transpose(1, 2), right.transpose(1, 2))
    return a_e.flatten(0, 1), b_e.permute(1, 2, 0).flatten(1), n * r


def export_lora(ckpt: str | os.PathLike, out: str | os.PathLike, arch_name: str | None = None,
                config_path: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Write the adapters of LoRA checkpoint ``ckpt`` (a training checkpoint or a directory of
    them: its newest) as a PEFT adapter directory ``out`` for the architecture ``arch_name``
    (default: as imported, else chosen from the config). Returns ``out``.

    Raises:
        WeightsError: ``out`` exists, ``ckpt`` is not a LoRA run's checkpoint, or it holds trained
            tensors an adapter cannot carry.
        UnsupportedModel: an adapter on a weight the architecture stores as columns or
            interleaved parts of one tensor.
    """
    from safetensors.torch import save_file

    from moetrain.hf.convert import _export_sources, _maps_for, arch_by_name

    out = Path(out)
    if out.exists():
        raise WeightsError(f"{out}: already exists; remove it or choose another --out")
    reader = CheckpointReader(ckpt, progress=progress)
    cfg, base, _ = _export_sources(reader, config_path)
    lo = cfg.train.lora
    if reader.kind != "dcp" or not lo.r:
        raise WeightsError(f"{reader.path}: not a LoRA run's checkpoint (train.lora.r = {lo.r}); --lora exports "
                           f"adapters")
    arch = arch_by_name(arch_name) if arch_name else architecture_for(base) if base is not None \
        else choose_architecture(cfg)
    interleaved = arch.rope_interleaved or (arch.name == "DeepseekV3ForCausalLM"
                                            and bool((base or {}).get("rope_interleave", True)))
    maps = {m.ours: m for m in _maps_for(cfg, arch, interleaved)}
    _refuse_trained_base_tensors(reader, cfg)

    # moetrain weight name → its adapter's (A, B) names, for the weights the checkpoint adapted
    pairs = {w: p for w in maps if (p := adapter_names(w)) and p[0] in reader.shapes}
    stray = sorted(n for n in reader.shapes if is_adapter(n) and n not in {x for p in pairs.values() for x in p})
    if stray:
        raise UnsupportedModel(f"{reader.path}: the adapter {stray[0]} adapts a weight {arch.name} does not hold. Fix: "
                               f"export with --merge")
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    leaves: set[str] = set()

    def put(hf_name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        module = _module(hf_name)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
        leaves.add(module.rsplit(".", 1)[-1])
        if a.shape[0] != lo.r:
            ranks[module] = a.shape[0]

    fused: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, int]]] = {}  # module → param → (A, B, rank)
    done: set[str] = set()
    for weight, (a_name, b_name) in sorted(pairs.items()):
        m = maps[weight]
        if m.layout == "copy" and ".moe.experts." in m.ours and len(m.shape) == 3:  # fused [E, in, out]
            if m.hf in done:
                continue
            done.add(m.hf)
            module, param = m.hf.rsplit(".", 1)
            fused.setdefault(module, {})[param] = _fused_adapter(
                m, maps, pairs, reader, lo.r, swapped=arch.moe_names.experts == "fused_cat")
        elif m.layout == "experts":
            t = reader.read([a_name, b_name])
            a, b = t[a_name].float(), t[b_name].float()
            for e, hf_name in enumerate(m.hf_names()):
                s = 0 if a.shape[0] == 1 else e
                put(hf_name, a[s].t(), b[s].t())
        elif m.part is not None:
            if m.part.how != "cat" or m.part.dim != 0:
                raise UnsupportedModel(f"{weight}: {arch.name} stores it as {m.part.how} part {m.part.index} along "
                                       f"dim {m.part.dim} of {m.hf}; a PEFT adapter there is not one low-rank pair. "
                                       f"Fix: export with --merge")
            if m.hf in done:
                continue
            done.add(m.hf)
            a_parts, b_parts = [], []
            for member, rows in zip(m.part.members, m.part.sizes):
                mm = maps[member]
                if member in pairs:
                    t = reader.read(list(pairs[member]))
                    a_m, b_m = (x.float() for x in t.values())
                    b_m = _b_rows_to_hf(mm, b_m)[0]
                else:  # a member without an adapter: zero blocks
                    a_m, b_m = torch.zeros(lo.r, mm.shape[1]), torch.zeros(rows, lo.r)
                a_parts.append(a_m)
                b_parts.append(b_m)
            put(m.hf, torch.cat(a_parts), torch.block_diag(*b_parts))
        else:
            t = reader.read([a_name, b_name])
            a, b = t[a_name].float(), t[b_name].float()
            for hf_name, b_hf in zip(m.hf_names(), _b_rows_to_hf(m, b)):
                put(hf_name, a, b_hf)

    params: set[str] = set()
    for module, by_param in fused.items():
        # PEFT wraps a module's targeted parameters in the order the module defines them, each
        # wrapper the ``base_layer`` of the next: transformers defines gate_up_proj first
        order = [p for p in ("gate_up_proj", "down_proj") if p in by_param]
        for i, param in enumerate(order):
            a, b, rank = by_param[param]
            at = module + ".base_layer" * (len(order) - 1 - i)
            tensors[f"base_model.model.{at}.lora_A.weight"] = a.contiguous()
            tensors[f"base_model.model.{at}.lora_B.weight"] = b.contiguous()
            params.add(f"experts.{param}")
            if rank != lo.r:
                # PEFT 0.21 sets a parameter's rank from the pattern key matching module.param, and
                # then warns that the key "did not match any targeted module and [was] ignored"
                # (its check reads module names only; its own conversion of the per-expert format
                # warns the same): the logits PEFT gives show the rank applied
                ranks[f"{module}.{param}"] = rank
    expert_leaves = {_module(n).rsplit(".", 1)[-1] for m in maps.values() if m.layout == "experts"
                     for n in m.hf_names()[:1]}
    clash = sorted({k.split(".lora_")[0].removeprefix("base_model.model.") for k in tensors
                    if ".experts." not in k and k.split(".lora_")[0].rsplit(".", 1)[-1] in expert_leaves})
    if clash:
        raise WeightsError(f"{reader.path}: adapters on {clash[0]} (and {len(clash) - 1} more) share the name "
                           f"{clash[0].rsplit('.', 1)[-1]!r} with the routed experts' matrices, and PEFT with "
                           f"transformers 5 loads every target of that name into the experts' fused parameters, "
                           f"dropping these. Fix: target the routed experts alone (experts.w1, experts.w2, experts.w3 "
                           f"in train.lora.target_modules, no dense MLP or shared experts), or export with --merge")
    config = {
        # lora_dropout 0: the directory is for inference, where dropout does nothing, and PEFT's LoRA
        # on the fused expert parameters refuses any other value
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lo.r, "lora_alpha": lo.lora_alpha,
        "lora_dropout": 0.0, "target_modules": sorted(leaves), "target_parameters": sorted(params) or None,
        "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None,
        "rank_pattern": ranks, "alpha_pattern": {k: lo.lora_alpha * v / lo.r for k, v in ranks.items()},
        "base_model_name_or_path": (reader.manifest.get("train_state", {}).get("lora_base") or {}).get("path"),
    }
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def _refuse_trained_base_tensors(reader: CheckpointReader, cfg: Config) -> None:
    """A LoRA checkpoint's tensors besides its adapters are routers trained whole and buffers
    (routing biases): refused when they differ from the base's, which an adapter cannot say."""
    others = [n for n in reader.shapes if not n.rpartition(".")[2].startswith(("lora_A", "lora_B"))]
    if not others:
        return
    recorded = reader.manifest.get("train_state", {}).get("lora_base") or {}
    base_path = recorded.get("path")
    if base_path is None:
        raise WeightsError(f"{reader.path}: holds {others[0]} besides the adapters and its base was drawn from the "
                           f"seed; an adapter directory cannot carry it. Fix: export with --merge")
    base = CheckpointReader(base_path, progress=False)
    mine = reader.read(others)
    theirs = base.read([n for n in others if n in base.shapes])
    for n in others:
        if n not in theirs or not torch.equal(mine[n].to(theirs[n].dtype), theirs[n]):
            raise WeightsError(f"{reader.path}: {n} was trained (a router in train.lora.target_modules, or routing "
                               f"biases moved by moe.bias_update_rate); a PEFT adapter cannot carry it. Fix: export "
                               f"with --merge")
