"""Low-rank adapters on a frozen base (LoRA, Hu et al. 2021): which weights get one, and the
adapters themselves.

A targeted weight W [out, in] gains A [r, in] and B [out, r]; the module then computes
W x + (alpha / r) · B A dropout(x) (:class:`~moetrain.model.layers.Linear`). The routed experts'
stacked matrices w [E, in, out] gain A [E, in, r] and B [E, r, out], one pair per expert, or
[1, in, r] and [1, r, out] shared by every expert of the layer
(:class:`~moetrain.model.moe.GroupedExperts`). A is drawn as PEFT draws it (Kaiming-uniform with
a = √5 on [r, in]: uniform in ±1/√in), B starts at zero, so the first forward is the base model's.

Everything but the adapters (and the routers when ``router`` is targeted) is frozen: no gradient,
hence no optimizer state and no gradient reduction. The adapters are added after the layout has
placed the base weights; :mod:`moetrain.parallel.lora` places each adapter as its weight is. The
frozen base may be stored in bf16 or FP8 (:func:`convert_base`).
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.config import ConfigError, LoraConfig
from moetrain.model.fp8 import E4M3
from moetrain.model.layers import Linear
from moetrain.model.moe import GroupedExperts, Router

# The routed experts' stacked matrices, as the model names them.
EXPERT_MATRICES = ("w1", "w3", "w2")
ALL_LINEAR = "all-linear"
ROUTER = "router"


def matches(path: str, key: str) -> bool:
    """PEFT's rule for ``target_modules``: ``path`` (a module's dotted name in the model) is the
    name ``key`` or ends with ``.key``."""
    return path == key or path.endswith("." + key)


def adapter_targets(model: nn.Module, lora: LoraConfig, strict: bool = True) -> tuple[list[str], list[str]]:
    """The weights of ``model`` that ``lora.target_modules`` selects: (paths of the
    :class:`Linear` modules and expert matrices — ``layers.0.moe.experts.w1`` — that get an
    adapter, paths of the routers that train whole). The head (``output``) and the embedding
    never get one.

    Raises:
        ConfigError: with ``strict`` (the whole model; a pipeline part may lack some), a name in
            ``target_modules`` that selects nothing (the message lists names that would).
    """
    keys = list(lora.target_modules)
    candidates: list[str] = []
    routers: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, Router):
            routers.append(name)
        elif isinstance(module, GroupedExperts):
            candidates += [f"{name}.{m}" for m in EXPERT_MATRICES if getattr(module, m) is not None]
        elif isinstance(module, Linear) and name != "output":
            candidates.append(name)
    used = {k: False for k in keys}
    chosen, trained = [], []
    for path in candidates:
        hit = [k for k in keys if k == ALL_LINEAR or matches(path, k)]
        for k in hit:
            used[k] = True
        if hit:
            chosen.append(path)
    for path in routers:
        hit = [k for k in keys if matches(path, k)]
        for k in hit:
            used[k] = True
        if hit:
            trained.append(path)
    unused = [k for k, hit in used.items() if not hit]
    if unused and strict:
        leaves = sorted({p.rsplit(".", 1)[-1] for p in candidates} | ({ROUTER} if routers else set()))
        raise ConfigError(f"train.lora.target_modules: {unused} select no weight of this model. Fix: use "
                          f"{ALL_LINEAR!r} or names among {leaves} (a name selects every module whose path "
                          "ends with it, e.g. experts.w1)")
    return chosen, trained


def add_adapters(model: nn.Module, lora: LoraConfig) -> list[str]:
    """Give the weights that ``lora`` targets their adapters (full single-process shapes, on the
    device of the weights: meta before materialisation) and freeze the rest of ``model`` (the
    routers train when targeted). Returns the paths of the adapted weights.

    Names that select nothing are refused on the whole model first (:func:`adapter_targets`).
    """
    chosen, trained = adapter_targets(model, lora, strict=False)
    for p in model.parameters():
        p.requires_grad_(False)
    for path in trained:
        for p in model.get_submodule(path).parameters():
            p.requires_grad_(True)
    for path in chosen:
        holder, _, leaf = path.rpartition(".")
        module = model.get_submodule(holder if leaf in EXPERT_MATRICES and
                                     isinstance(model.get_submodule(holder), GroupedExperts) else path)
        if isinstance(module, GroupedExperts):
            w = getattr(module, leaf)
            E, d_in, d_out = w.shape
            stacks = 1 if lora.experts == "shared" else E
            i = leaf[1:]
            setattr(module, f"lora_A{i}", nn.Parameter(torch.empty(stacks, d_in, lora.r, device=w.device,
                                                                    dtype=w.dtype)))
            setattr(module, f"lora_B{i}", nn.Parameter(torch.empty(stacks, lora.r, d_out, device=w.device,
                                                                    dtype=w.dtype)))
            module.lora_scaling, module.lora_dropout = lora.scaling, lora.lora_dropout
            module.lora_shared = lora.experts == "shared"
        else:
            w = module.weight
            module.lora_A = nn.Parameter(torch.empty(lora.r, w.shape[1], device=w.device, dtype=w.dtype))
            module.lora_B = nn.Parameter(torch.empty(w.shape[0], lora.r, device=w.device, dtype=w.dtype))
            module.lora_scaling, module.lora_dropout = lora.scaling, lora.lora_dropout
    return chosen


def fp8_weight_names(model: nn.Module) -> set[str]:
    """The parameters an FP8 base stores as E4M3 codes with block scales: every linear of the
    blocks (``….weight``; not the head) and every expert matrix (``…experts.w1`` …)."""
    out = set()
    for path, module in model.named_modules():
        if isinstance(module, Linear) and path != "output":
            out.add(f"{path}.weight")
        elif isinstance(module, GroupedExperts):
            out |= {f"{path}.w{i}" for i in ("1", "3", "2") if getattr(module, f"w{i}") is not None}
    return out


def convert_base(model: nn.Module, base_dtype: str, block: int) -> None:
    """Store the frozen base in ``base_dtype`` (``train.lora.base_dtype``), on the meta-device
    model after :func:`add_adapters`: ``bf16`` — every frozen floating parameter in bf16;
    ``fp8`` — every frozen linear of the blocks and every expert matrix as float8 E4M3 codes with
    fp32 scales per ``block`` × ``block`` block (DeepSeek-V3's checkpoint format: ``weight`` and
    ``weight_scale_inv``; the experts' ``w1`` and ``w1_scale_inv`` [E, ⌈in/B⌉, ⌈out/B⌉]),
    dequantized per GEMM, and the rest (embedding, head, norms, frozen routers) in bf16.
    Parameters keep their placements; a tied parameter stays tied.

    The FP8 base computes by dequantizing each weight to the compute dtype at its GEMM, not
    with fp8 GEMMs: the activations, their gradients and the adapters keep the precision of a
    bf16 base (only the weights are rounded, once, as the checkpoint was), and it runs on any
    device and layout; the weight's bf16 copy lives for one GEMM."""
    fp8 = base_dtype == "fp8"
    replaced: dict[int, nn.Parameter] = {}

    def store(module: nn.Module, name: str, dtype: torch.dtype) -> None:
        p = getattr(module, name)
        if p is None or p.requires_grad or not p.is_floating_point() or p.dtype == E4M3:
            return
        if id(p) not in replaced:
            replaced[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
        setattr(module, name, replaced[id(p)])

    for path, module in model.named_modules():
        if fp8 and isinstance(module, Linear) and path != "output" and not module.weight.requires_grad:
            w = module.weight
            module.weight_scale_inv = nn.Parameter(
                torch.empty(-(-w.shape[0] // block), -(-w.shape[1] // block), device=w.device), requires_grad=False)
            module.base_block = block
            store(module, "weight", E4M3)
        elif fp8 and isinstance(module, GroupedExperts):
            for i in ("1", "3", "2"):
                w = getattr(module, f"w{i}")
                if w is None or w.requires_grad:
                    continue
                E, d_in, d_out = w.shape
                setattr(module, f"w{i}_scale_inv", nn.Parameter(
                    torch.empty(E, -(-d_in // block), -(-d_out // block), device=w.device), requires_grad=False))
                store(module, f"w{i}", E4M3)
            module.base_block = block
        for name in [n for n, _ in module.named_parameters(recurse=False)]:
            if not name.endswith("_scale_inv"):
                store(module, name, torch.bfloat16)


def adapter_names(weight: str) -> tuple[str, str] | None:
    """The (A, B) parameter names of the adapter of weight ``weight`` — a linear's
    ``x.weight`` → ``x.lora_A`` / ``x.lora_B``, an expert matrix ``x.experts.w1`` →
    ``x.experts.lora_A1`` / ``x.experts.lora_B1`` —, or None for a tensor that cannot carry one."""
    holder, _, leaf = weight.rpartition(".")
    if leaf == "weight":
        return f"{holder}.lora_A", f"{holder}.lora_B"
    if leaf in EXPERT_MATRICES:
        return f"{holder}.lora_A{leaf[1:]}", f"{holder}.lora_B{leaf[1:]}"
    return None


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` (dotted) is a low-rank adapter factor."""
    return name.rsplit(".", 1)[-1].startswith(("lora_A", "lora_B"))
