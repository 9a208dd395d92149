"""Memory per GPU of a layout: parameters, gradients, optimizer states, activations.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, §3 and §5.1): with mixed-precision
Adam each parameter holds 2 bytes of bf16 weights, gradients and K = 12 bytes of optimizer
state (fp32 master weights, momentum, variance); ZeRO-1 shards the optimizer state over the
N_d data-parallel ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights:

    stage 0: (2 + 2 + K)·Ψ        stage 1: (2 + 2)·Ψ + K·Ψ/N_d
    stage 2: 2·Ψ + (2 + K)·Ψ/N_d  stage 3: (2 + 2 + K)·Ψ/N_d

The planner keeps gradients in fp32 (4 bytes; Megatron-LM accumulates and reduces bf16 runs'
gradients in fp32), see :class:`MemoryAssumptions`. Dense parameters are sharded over the
dp × cp ranks; expert parameters over the expert-data-parallel ranks (edp × tp).

Under ``train.lora`` (:class:`~moetrain.planner.model.LoraShape`) only the adapters hold
gradients and optimizer states; the frozen base holds its stored weights (``base_bytes`` per
parameter, sharded from ZeRO-1 on as FSDP2 shards them) and, under ZeRO-1/2, the gathered
compute copies; an FP8 base's weights, dequantized at each GEMM, are kept in the compute dtype for
the input gradient until the layer's backward (``buffers``: every layer of the stage, one under full
recomputation).

Activations follow the per-tensor accounting of Korthikanti et al. 2022 §4 (for moetrain's
layer: RMSNorm, GQA, flash attention keeping O and its log-sum-exp, SwiGLU fused as in
Megatron-Core / torch.compile so that only gate and up are kept — eager PyTorch keeps two
more F-wide tensors, see ``ActivationArch.fused_swiglu``): every tensor a
layer keeps for its backward pass, counted per token, split into those that tensor parallelism
shards and those it replicates unless sequence parallelism (SP) shards them too, and the
attention-core tensors that selective recomputation drops. For the GPT layer of the paper
(LayerNorm, GELU MLP of 4h, dropout, materialised softmax) this reproduces eq. (1)-(5):
sbh(34 + 5as/h) bytes, sbh(10 + 24/t + 5as/(ht)) with TP, sbh(34 + 5as/h)/t with TP + SP,
34·sbh/t with selective recomputation and SP, 2·sbh with full recomputation.
The pipeline keeps several micro-batches in flight: p on the first stage of 1F1B (so L layers'
worth in all, §4.2.3), L(1 + (p−1)/(p·v)) with the interleaved schedule, all m with GPipe.

Hybrid models (:func:`recurrent_terms`): a gated-DeltaNet, KDA or Mamba-2 layer keeps what its
GPU kernel saves for backward (flash-linear-attention's chunked delta rules, mamba-ssm's chunked
scan): its projections' outputs (the convolution's input and the output gate), the convolution's
output, the gates in fp32, the chunk's WY matrix (C values per token and head, fp32; the delta
rules), its output and the gated norm's output; the chunk-boundary states (Dk × Dv, or P × N, per
head and chunk, fp32) are recomputed in backward by both kernels, so they are counted once, for
the layer in flight (:func:`recurrent_state_bytes`). Per layer, the token mixer's tensors are the
mean over the layers of their kinds, as the parameters are (:class:`ModelShape`); blocks of one
sublayer (``model.hybrid_override_pattern``) keep their one sublayer's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from moetrain.planner.layout import Layout
from moetrain.planner.model import ModelShape

__all__ = ["MemoryAssumptions", "MemoryBreakdown", "ActivationArch", "zero_model_state_bytes",
           "korthikanti_layer_bytes", "activation_terms", "attention_terms", "mlp_terms", "layer_activation_bytes", "recomputed",
           "recurrent_terms", "recurrent_state_bytes", "mixer_terms",
           "stage_layers",
           "stage_counts", "memory_per_gpu", "GIB"]

GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryAssumptions:
    """Bytes per parameter for weights, gradients and optimizer states; bytes per activation."""

    param_bytes: int = 2
    grad_bytes: int = 4
    optim_bytes: int = 12
    act_bytes: int = 2

    @classmethod
    def for_precision(cls, precision: str) -> "MemoryAssumptions":
        """``fp32`` / ``float32``: 4-byte weights and activations, no separate master copy;
        ``bf16`` / ``bfloat16`` (and ``fp16`` or ``mixed``, 16-bit mixed precision of either
        kind) and ``fp8`` (fp8 GEMMs with bf16 activations between them and fp32 master weights,
        moetrain.model.fp8_gemm): mixed precision as above.

        Raises:
            ValueError: any other name.
        """
        if precision in ("fp32", "float32"):
            return cls(param_bytes=4, grad_bytes=4, optim_bytes=8, act_bytes=4)
        if precision in ("bf16", "bfloat16", "fp16", "float16", "mixed", "fp8", "mxfp8"):
            return cls()
        raise ValueError(f"precision {precision!r}: use fp32, bf16 or fp8")

    @classmethod
    def for_train(cls, train: Any) -> "MemoryAssumptions":
        """From a config's ``train`` section (``train.precision``: ``fp32`` / ``bf16`` / ``fp8``)."""
        return cls.for_precision(train.precision)


def zero_model_state_bytes(psi: float, nd: int, stage: int, k: int = 12, param_bytes: int = 2,
                           grad_bytes: int = 2) -> float:
    """Model-state bytes per GPU for Ψ parameters over N_d data-parallel ranks (ZeRO §5.1).

    Raises:
        ValueError: stage not in 0..3.
    """
    if stage == 0:
        return (param_bytes + grad_bytes + k) * psi
    if stage == 1:
        return (param_bytes + grad_bytes) * psi + k * psi / nd
    if stage == 2:
        return param_bytes * psi + (grad_bytes + k) * psi / nd
    if stage == 3:
        return (param_bytes + grad_bytes + k) * psi / nd
    raise ValueError(f"ZeRO stage {stage}: use 0, 1, 2 or 3")


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one GPT layer, the closed forms of Korthikanti et al. 2022 §4
    (eq. 1, 2, 4, 5 and §5): the reference the per-tensor accounting is tested against."""
    if recompute == "full":
        return 2.0 * s * b * h / (t if sp else 1)
    core = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if sp:
        return s * b * h * (34.0 + core) / t
    return s * b * h * (10.0 + 24.0 / t + core / t)


@dataclass(frozen=True)
class ActivationArch:
    """What a layer keeps for its backward pass depends on these choices."""

    hidden: int
    heads: int
    h_q: int
    h_kv: int
    ffn: int
    seq_len: int
    mlp: str = "swiglu"            # "swiglu" (3 matrices) or "gelu" (2 matrices)
    attention: str = "flash"       # "flash" (no s×s matrix kept) or "materialised"
    dropout: bool = False
    fused_swiglu: bool = True      # keeps gate and up (4F), recomputes silu·up in backward
    h_v: int | None = None         # attention output width a·d_v (None: h_q)
    h_kv_v: int | None = None      # value width kv_heads·d_v (None: h_kv)
    # MLA (DeepSeek-V2 §2.1): per token the query latent r_q (0: no bottleneck), the key-value
    # latent r_kv and the RoPE key d_r; None: grouped-query attention
    mla: tuple[int, int, int] | None = None
    # DSA (model.dsa): keys per query, index heads, index head dim; None: no indexer
    dsa: tuple[int, int, int] | None = None

    @classmethod
    def gpt(cls, s: int, h: int, a: int) -> "ActivationArch":
        """The layer of Korthikanti et al. 2022: LayerNorm, MHA, 4h GELU MLP, dropout, unfused softmax."""
        return cls(hidden=h, heads=a, h_q=h, h_kv=h, ffn=4 * h, seq_len=s, mlp="gelu",
                   attention="materialised", dropout=True)

    @classmethod
    def of(cls, shape: ModelShape) -> "ActivationArch":
        """moetrain's layer on GPU: RMSNorm, GQA, fused SwiGLU, no dropout, flash attention."""
        mla = (shape.q_lora_rank or 0, shape.kv_lora_rank, shape.qk_rope_dim) if shape.is_mla else None
        dsa = (shape.dsa_topk, shape.index_heads, shape.index_head_dim) if shape.dsa_topk else None
        return cls(hidden=shape.hidden, heads=shape.heads, h_q=shape.h_q, h_kv=shape.h_kv, ffn=shape.ffn,
                   seq_len=shape.seq_len, mlp="swiglu" if shape.mlp_matrices == 3 else "gelu",
                   h_v=shape.h_v, h_kv_v=shape.h_kv_v, mla=mla, dsa=dsa)


def activation_terms(arch: ActivationArch) -> list[tuple[str, float, str]]:
    """Tensors one dense layer keeps, as (name, bytes per token with 2-byte activations, kind).

    kind: ``repl`` (replicated over TP ranks unless SP), ``shard`` (split over TP ranks),
    ``core`` (split over TP; dropped by selective recomputation). The first term is the
    layer's input, all that full recomputation keeps.
    """
    return attention_terms(arch) + mlp_terms(arch)


def attention_terms(arch: ActivationArch) -> list[tuple[str, float, str]]:
    """The attention block's part of :func:`activation_terms`."""
    h, a, s = arch.hidden, arch.heads, arch.seq_len
    t: list[tuple[str, float, str]] = [
        ("norm1 input", 2.0 * h, "repl"),
        ("QKV input", 2.0 * h, "repl"),
    ]
    if arch.mla is not None:
        # MLA: the compressions keep their input (above); each latent is kept before its norm
        # and after it (the up-projection's input), the RoPE key once; the up-projections give
        # every head its own K (the RoPE part broadcast): Q, K of a·(d_n + d_r) each.
        r_q, r_kv, d_r = arch.mla
        t += [("MLA latents", 2.0 * (2 * r_q + 2 * r_kv + d_r), "repl")]
    if arch.dsa is not None:
        # DSA's indexer (every tp rank scores the whole sequence): its query heads and key, and
        # each query's selected key indices (int32), as a sparse kernel keeps them; the score
        # rows are recomputed blockwise, not kept.
        k, Hi, Di = arch.dsa
        t += [("DSA indexer q, k", 2.0 * (Hi * Di + Di), "repl"), ("DSA top-k indices", 4.0 * min(k, s), "repl")]
    t += [
        ("Q, K", 2.0 * (arch.h_q + arch.h_kv), "shard"),
        ("V", 2.0 * (arch.h_kv_v or arch.h_kv), "shard"),
    ]
    if arch.attention == "materialised":
        t.append(("softmax output", 2.0 * a * s, "core"))
        if arch.dropout:
            t += [("softmax dropout mask", 1.0 * a * s, "core"), ("softmax dropout output", 2.0 * a * s, "core")]
        t.append(("out-projection input", 2.0 * arch.h_q, "shard"))
    else:
        # FlashAttention keeps its output O (the out-projection input) and the fp32 log-sum-exp.
        t += [("attention output O", 2.0 * (arch.h_v or arch.h_q), "shard"), ("log-sum-exp", 4.0 * a, "core")]
    if arch.dropout:
        t.append(("attention dropout mask", 1.0 * h, "repl"))
    return t


def recurrent_terms(shape: ModelShape) -> dict[str, list[tuple[str, float, str]]]:
    """Per recurrent layer kind (``linear_attention``, ``kda``, ``mamba``, those the model has),
    the tensors one layer keeps per token after its input norm, as :func:`activation_terms`
    counts them (the module docstring says which); bytes with 2-byte activations, fp32 where the
    kernels keep fp32."""
    h = shape.hidden
    out: dict[str, list[tuple[str, float, str]]] = {}
    if shape.linear_layers:
        Hk, Hv, Dk, Dv, C = (shape.linear_k_heads, shape.linear_v_heads, shape.linear_k_dim, shape.linear_v_dim,
                             shape.linear_chunk)
        qkv = 2 * Hk * Dk + Hv * Dv
        out["linear_attention"] = [
            ("mixer input", 2.0 * h, "repl"),
            ("q, k, v, z, b, a projections", 2.0 * (qkv + Hv * Dv + 2 * Hv), "shard"),
            ("convolution output", 2.0 * qkv, "shard"),
            ("gates g, β (fp32)", 8.0 * Hv, "shard"),
            ("chunk WY matrix (fp32)", 4.0 * Hv * C, "shard"),
            ("delta-rule output", 2.0 * Hv * Dv, "shard"),
            ("gated-norm output", 2.0 * Hv * Dv, "shard")]
    if shape.kda_layers:
        H, Dh, C = shape.linear_k_heads, shape.linear_k_dim, shape.linear_chunk
        w = H * Dh
        out["kda"] = [
            ("mixer input", 2.0 * h, "repl"),
            ("gate bottleneck latents", 2.0 * 2 * Dh, "repl"),
            ("q, k, v, f, z, b projections", 2.0 * (5 * w + H), "shard"),
            ("convolution outputs", 2.0 * 3 * w, "shard"),
            ("gates g (per channel), β (fp32)", 4.0 * (w + H), "shard"),
            ("chunk WY and score matrices (fp32)", 8.0 * H * C, "shard"),
            ("delta-rule output", 2.0 * w, "shard"),
            ("gated-norm output", 2.0 * w, "shard")]
    if shape.mamba_layers:
        H, P, N, G = shape.mamba_heads, shape.mamba_head_dim, shape.mamba_state, shape.mamba_groups
        xbc = H * P + 2 * G * N
        out["mamba"] = [
            ("mixer input", 2.0 * h, "repl"),
            ("in_proj output (z, xBC, dt)", 2.0 * (H * P + xbc + H), "shard"),
            ("convolution output", 2.0 * xbc, "shard"),
            ("Δ and its cumulative decay (fp32)", 8.0 * H, "shard"),
            ("scan output", 2.0 * H * P, "shard"),
            ("gated-norm output", 2.0 * H * P, "shard")]
    return out


def recurrent_state_bytes(shape: ModelShape) -> float:
    """Bytes per token of the chunk-boundary states one recurrent layer computes (fp32: Dk × Dv
    per value head, Dh² per KDA head, P × N per Mamba-2 head, per chunk of C tokens), the
    largest of the model's kinds; 0 without recurrent layers. Both kernels recompute them in
    backward, so they live for the layer in flight only."""
    out = 0.0
    if shape.linear_layers:
        out = max(out, 4.0 * shape.linear_v_heads * shape.linear_k_dim * shape.linear_v_dim / shape.linear_chunk)
    if shape.kda_layers:
        out = max(out, 4.0 * shape.linear_k_heads * shape.linear_k_dim ** 2 / shape.linear_chunk)
    if shape.mamba_layers:
        out = max(out, 4.0 * shape.mamba_heads * shape.mamba_head_dim * shape.mamba_state / shape.mamba_chunk)
    return out


def mixer_terms(shape: ModelShape, arch: ActivationArch) -> list[tuple[str, float, str]]:
    """The token mixer's tensors of one layer: :func:`attention_terms`, or in a hybrid the mean
    over the layers of their kinds (attention's, :func:`recurrent_terms`', none for the MLP / MoE
    blocks of ``model.hybrid_override_pattern``); the block's input first, whole."""
    att = attention_terms(arch)
    kinds = recurrent_terms(shape)
    if not kinds and not shape.mixer_none:
        return att
    L = shape.layers
    counts = {"linear_attention": shape.linear_layers, "kda": shape.kda_layers, "mamba": shape.mamba_layers}
    out = [att[0]] + [(name, b * shape.attention_layers / L, kind) for name, b, kind in att[1:]]
    for kind, terms in kinds.items():
        out += [(f"{kind}: {name}", b * counts[kind] / L, k) for name, b, k in terms]
    return out


def mlp_terms(arch: ActivationArch) -> list[tuple[str, float, str]]:
    """The dense MLP block's part of :func:`activation_terms`."""
    h = arch.hidden
    t: list[tuple[str, float, str]] = [("norm2 input", 2.0 * h, "repl"), ("MLP input", 2.0 * h, "repl")]
    if arch.mlp == "gelu":
        t += [("GELU input", 2.0 * arch.ffn, "shard"), ("GELU output", 2.0 * arch.ffn, "shard")]
    else:
        t.append(("gate and up outputs", 4.0 * arch.ffn, "shard"))
        if not arch.fused_swiglu:
            # eager PyTorch also keeps silu(gate) and the product (the w2 input)
            t += [("silu(gate)", 2.0 * arch.ffn, "shard"), ("SwiGLU output", 2.0 * arch.ffn, "shard")]
    if arch.dropout:
        t.append(("MLP dropout mask", 1.0 * h, "repl"))
    return t


def _moe_terms(shape: ModelShape, etp: int = 1, imbalance: float = 1.0) -> list[tuple[str, float, str]]:
    """The MoE block's tensors per token. Each TP rank routes its own 1/tp slice of the
    sequence (with or without SP), so the caller splits every term by tp. Routed copies are
    those the busiest expert rank receives (ModelShape.expert_copies). With etp = tp the tp
    ranks gather each other's routed copies and each computes 1/tp of every expert's width:
    the h-wide routed tensors grow by etp, the f-wide ones keep their size."""
    h, f, e = shape.hidden, shape.expert_ffn, shape.num_experts
    k = shape.expert_copies(imbalance)
    return [
        ("norm2 input", 2.0 * h, "repl"),
        ("router input", 2.0 * h, "repl"),
        ("router probabilities (fp32)", 8.0 * e, "repl"),
        ("permuted tokens", 2.0 * h * k * etp, "repl"),
        # the activation's input: gate and up (fused SwiGLU), or the up projection (squared ReLU)
        ("expert gate and up outputs (fused SwiGLU)", 2.0 * (shape.expert_matrices - 1) * f * k, "repl"),
        ("expert outputs", 2.0 * h * k * etp, "repl"),
        ("shared experts", 2.0 * (shape.expert_matrices - 1) * f * shape.shared_experts, "repl"),
    ]


_NORM_OUTPUTS = frozenset({"QKV input", "MLP input", "router input"})
_MLP_INSIDE = frozenset({"GELU input", "GELU output", "gate and up outputs", "silu(gate)", "SwiGLU output",
                         "MLP dropout mask"})


def recomputed(name: str, kind: str, modules: tuple[str, ...]) -> bool:
    """Whether selective recomputation of ``modules`` (layout.RECOMPUTE_MODULES) drops the term
    ``name`` of kind ``kind`` (see :func:`activation_terms`):

    - ``core_attn``: the attention-core tensors (kind ``core``);
    - ``layernorm``: the norms' outputs (QKV input, MLP / router input); their inputs, the
      residual stream, stay;
    - ``mlp``: a dense MLP block's inner tensors (its input stays);
    - ``mla_up_proj``: the up-projected Q, K, V and the attention core: MLA keeps its input and
      its low-rank latents (the "MLA latents" term);
    - ``moe_act``: nothing here: the planner's experts already keep only the activation's input
      (gate and up, the fused SwiGLU) and recompute its output, which is what Megatron-Core's
      ``moe_act`` recomputation does.
    """
    return (("core_attn" in modules and kind == "core")
            or ("layernorm" in modules and name in _NORM_OUTPUTS)
            or ("mlp" in modules and name in _MLP_INSIDE)
            or ("mla_up_proj" in modules and (kind == "core" or name in ("Q, K", "V"))))


def layer_activation_bytes(terms: list[tuple[str, float, str]], tokens: float, tp: int, sp: bool,
                           ac: str, act_scale: float = 1.0, modules: tuple[str, ...] = ("core_attn",)) -> float:
    """Bytes one layer keeps for ``tokens`` tokens of one micro-batch on one rank (``modules``:
    what ``ac = "selective"`` recomputes, :func:`recomputed`)."""
    if ac == "full":
        return terms[0][1] * tokens * act_scale / (tp if sp else 1)  # the layer input
    total = 0.0
    for name, b, kind in terms:
        if ac == "selective" and recomputed(name, kind, modules):
            continue
        total += b / (tp if (kind != "repl" or sp) else 1)
    return total * tokens * act_scale


@functools.lru_cache(maxsize=4096)
def stage_counts(shape: ModelShape, pp: int, vpp: int) -> tuple[tuple[int, int], ...]:
    """(dense layers, MoE layers) held by each pipeline rank (see :func:`stage_layers`)."""
    out = []
    for layers in stage_layers(shape, pp, vpp):
        n_moe = sum(1 for i in layers if shape.moe_layer_flags[i])
        out.append((len(layers) - n_moe, n_moe))
    return tuple(out)


def stage_layers(shape: ModelShape, pp: int, vpp: int) -> list[list[int]]:
    """Layer indices held by each pipeline rank: rank r holds chunks r, r+pp, ... (interleaved);
    with layers not divisible by pp·vpp the first chunks get one layer more."""
    chunks = pp * vpp
    base, extra = divmod(shape.layers, chunks)
    bounds = [0]
    for c in range(chunks):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return [[i for k in range(vpp) for i in range(bounds[r + k * pp], bounds[r + k * pp + 1])] for r in range(pp)]


@dataclass
class MemoryBreakdown:
    """Bytes per GPU on the fullest pipeline rank."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    rank: int = 0
    detail: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def gib(self) -> dict[str, float]:
        return {"params": self.params / GIB, "grads": self.grads / GIB, "optimizer": self.optimizer / GIB,
                "activations": self.activations / GIB, "buffers": self.buffers / GIB, "total": self.total / GIB}

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) for k, v in self.gib().items()} | {"pipeline_rank": self.rank}


def _inflight(layout: Layout, m: int, r: int) -> float:
    """Micro-batch·chunks rank r keeps activations for, in units of its whole stage."""
    pp, v = layout.pp, layout.vpp
    if pp == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if v > 1:
        # Megatron's interleaved warm-up: (pp − r − 1)·2 + (v − 1)·pp chunks, plus the running one.
        return min(m * v, (pp - r - 1) * 2 + (v - 1) * pp + 1) / v
    return float(min(pp - r, m))


def memory_per_gpu(shape: ModelShape, layout: Layout, global_batch: int,
                   assumptions: MemoryAssumptions = MemoryAssumptions(), moe_imbalance: float = 1.0) -> MemoryBreakdown:
    """Peak memory per GPU (the fullest pipeline rank) of ``layout`` training ``shape``.

    Expert parameters are split over ep × etp and their states sharded over
    ``layout.expert_shard``; dense ones sharded over ``layout.dense_shard`` (dp × cp, or HSDP's
    shard group). ``moe_imbalance``: routed copies of the busiest expert rank over
    the mean (the activations it keeps).

    Returns a :class:`MemoryBreakdown` in bytes; ``.gib()`` converts.
    """
    A = assumptions
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    dense_shard = layout.dense_shard
    expert_shard = layout.expert_shard
    m = max(1, layout.microbatches(global_batch))
    tokens = layout.mbs * shape.seq_len / cp
    sp = layout.sp and tp > 1
    act_scale = A.act_bytes / 2.0
    arch = ActivationArch.of(shape)
    att_terms = mixer_terms(shape, arch)
    dense_share = 1.0
    if shape.ffn_none:  # blocks of one sublayer: the non-MoE blocks' MLP tensors, their mean
        non_moe = shape.layers - sum(shape.moe_layer_flags)
        dense_share = (non_moe - shape.ffn_none) / max(1, non_moe)
    dense_terms = att_terms + [(n, b * dense_share, k) for n, b, k in mlp_terms(arch)]

    mods = layout.recompute_modules

    def moe_layer(ac: str) -> float:
        # Under tp the MoE block works on a 1/tp slice of the sequence, with or without SP
        # (each tp rank routes its own slice), so its tensors are split by tp in any case.
        if ac == "full":
            return layer_activation_bytes(att_terms, tokens, tp, sp, "full", act_scale)
        return (layer_activation_bytes(att_terms, tokens, tp, sp, ac, act_scale, mods)
                + layer_activation_bytes(_moe_terms(shape, layout.etp, moe_imbalance), tokens, tp, True, ac,
                                         act_scale, mods))

    a_dense = layer_activation_bytes(dense_terms, tokens, tp, sp, layout.ac, act_scale, mods)
    a_moe = moe_layer(layout.ac)
    a_dense_full = layer_activation_bytes(dense_terms, tokens, tp, sp, "none", act_scale)
    a_moe_full = moe_layer("none")

    best = MemoryBreakdown()
    best_total = -1.0
    dense_layer, moe_layer = shape.layer_params(False), shape.layer_params(True)
    for r, (n_dense, n_moe) in enumerate(stage_counts(shape, pp, layout.vpp)):
        dense_p = n_dense * dense_layer[0] + n_moe * moe_layer[0]
        # (EPLB's spare slots hold more copies of the experts: E + redundant per layer)
        expert_p = n_moe * shape.expert_params * (1 + shape.redundant_experts / max(1, shape.num_experts))
        embedding_p = 0.0  # the embedding's and the head's (for a LoRA base's own storage)
        if r == 0:
            dense_p += shape.vocab * shape.hidden
            embedding_p += shape.vocab * shape.hidden / tp
        if r == pp - 1 and (pp > 1 or not shape.tie_embeddings):
            dense_p += shape.vocab * shape.hidden + shape.hidden
            embedding_p += shape.vocab * shape.hidden / tp
        if r == pp - 1 and shape.mtp_depth:  # the MTP modules, and the embedding's copy under pp
            mtp_dense, mtp_expert = shape.mtp_params()
            dense_p += mtp_dense + (shape.vocab * shape.hidden if pp > 1 else 0)
            expert_p += mtp_expert
        dense_p /= tp
        expert_p /= layout.ep * layout.etp
        z = layout.zero
        trained_d, trained_e = dense_p, expert_p
        params = 0.0
        if shape.lora is not None:
            lo = shape.lora
            # The frozen base: stored (sharded from ZeRO-1 on, as FSDP2 shards every stage's
            # parameters), plus under ZeRO-1/2 the compute copies gathered from the first forward
            # to the last backward. It has no gradient and no optimizer state.
            params = (lo.base_bytes * ((dense_p - embedding_p) / (dense_shard if z >= 1 else 1)
                                       + expert_p / (expert_shard if z >= 1 else 1))
                      + lo.embedding_bytes * embedding_p / (dense_shard if z >= 1 else 1))
            if 1 <= z <= 2:
                params += A.param_bytes * (dense_p + expert_p)
            # The adapters: whole on every tp rank (an upper bound: a split weight's adapter has
            # one factor split too), the routed experts' per expert over ep.
            trained_d = n_dense * lo.dense_layer + n_moe * lo.moe_layer
            trained_e = n_moe * lo.expert_layer / (1 if lo.experts_shared else layout.ep)
        params += A.param_bytes * (trained_d / (dense_shard if z >= 3 else 1)
                                   + trained_e / (expert_shard if z >= 3 else 1))
        grads = A.grad_bytes * (trained_d / (dense_shard if z >= 2 else 1) + trained_e / (expert_shard if z >= 2 else 1))
        optim = A.optim_bytes * (trained_d / (dense_shard if z >= 1 else 1) + trained_e / (expert_shard if z >= 1 else 1))
        stage_act = n_dense * a_dense + n_moe * a_moe
        if layout.ac == "full" and layout.recompute_num_layers is not None:
            # only a share of each virtual stage's layers keeps its input alone, the rest all
            share = layout.full_recompute_share((n_dense + n_moe) / layout.vpp)
            stage_act = share * stage_act + (1.0 - share) * (n_dense * a_dense_full + n_moe * a_moe_full)
        acts = _inflight(layout, m, r) * stage_act
        if layout.ac == "full" and n_dense + n_moe:
            acts += a_moe_full if n_moe else a_dense_full  # one layer recomputed at a time
        if n_dense + n_moe:  # a recurrent layer's chunk-boundary states, while it runs
            acts += tokens * recurrent_state_bytes(shape) / tp
        if r == pp - 1:
            acts += tokens * shape.vocab / tp * (2 + 4) * act_scale  # bf16 logits + fp32 loss softmax
        if r == pp - 1 and shape.mtp_depth:
            # Each MTP module: its block, the two norms' inputs and the projection's [2h] input,
            # its final norm's input, and its own logits; in flight like the stage's blocks.
            block = a_moe if shape.mtp_moe else a_dense
            extra = tokens * 2.0 * shape.hidden * (2 + 2 + 1) * act_scale / (tp if sp else 1)
            logits = tokens * shape.vocab / tp * (2 + 4) * act_scale
            acts += shape.mtp_depth * (_inflight(layout, m, r) * (block + extra) + logits)
        buffers = 0.0
        if shape.lora is not None and shape.lora.dequantized_copies and n_dense + n_moe:
            # the compute-dtype copies of an FP8 base's weights that autograd keeps for the input
            # gradients: every layer of the stage's, or under full recomputation the layer's in flight
            if layout.ac == "full":
                buffers += A.param_bytes * max(dense_layer[0] / tp if n_dense else 0.0,
                                               moe_layer[0] / tp + moe_layer[1] / (layout.ep * layout.etp)
                                               if n_moe else 0.0)
            else:
                buffers += A.param_bytes * (dense_p - embedding_p + expert_p)
        if z >= 3 and n_dense + n_moe:
            biggest = max(dense_layer[0] / tp if n_dense else 0.0,
                          moe_layer[0] / tp + moe_layer[1] / (layout.ep * layout.etp) if n_moe else 0.0)
            buffers += 2 * biggest * A.param_bytes  # the gathered layer and the prefetched next one
        mb = MemoryBreakdown(params, grads, optim, acts, buffers, r,
                             {"dense_params": dense_p, "expert_params": expert_p,
                              "layer_activation_bytes_dense": a_dense, "layer_activation_bytes_moe": a_moe})
        if mb.total > best_total:
            best, best_total = mb, mb.total
    return best
