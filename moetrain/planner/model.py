"""Parameter counts and FLOPs of the decoder that moetrain trains, from a Config.

Symbols (per layer unless stated): h hidden, a heads, d = h/a head dim (or a stated one),
h_q = a·d query width, h_kv = kv_heads·d, h_v = a·d_v value width, F dense MLP width, E experts,
k top-k, f expert SwiGLU width, S shared experts, V vocabulary, s sequence length, L layers.

moetrain's own configs give a Llama/Mixtral-like decoder (SwiGLU). Published runs of other
models need a few more facts, which only the planner knows (they are never read
from a moetrain config): a two-matrix GELU MLP (GPT-3, MPT). moetrain's own configs also give
a stated head dim (Qwen3, GPT-OSS), multi-head latent attention with its low-rank projections
and separate value head dim (DeepSeek-V3), sliding-window layers (GPT-OSS), multi-token
prediction modules (DeepSeek-V3), gated-DeltaNet blocks (Qwen3-Next: ``linear_layers`` of the
L, their projections, convolution and chunked delta rule counted per token, :meth:`linear_flops`),
Kimi Delta Attention blocks (Kimi Linear: ``kda_layers``, :attr:`kda_params`, :meth:`kda_flops`)
and Mamba-2 blocks (``mamba_layers``: :attr:`mamba_params`, :meth:`mamba_flops`),
which the published runs state the same way. Where a quantity is per layer (the token mixer's
parameters and FLOPs), it is the mean over the layers of their kinds; context parallelism's
traffic is the ring's for the attention layers and the head exchange's for the others
(:meth:`head_exchange_width`); their activation memory is :mod:`moetrain.planner.memory`'s, and
their tp traffic is taken as attention's (the same all-gather into and reduce-scatter out of the
layer under SP).

FLOP convention (the one MFU is reported in, as Megatron-LM eq. 3 of Narayanan et al. 2021 and
PaLM appendix B): a matmul of m×k by k×n costs 2mkn; backward costs twice forward; attention
counts the full s×s score matrix (4·s·h_q per token forward for QKᵀ and AV), causal or not;
recomputation is not model FLOPs. The time model separately counts what the GPU executes
(causal flash attention skips the upper triangle; recomputation runs the forward again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moetrain.model.fp8 import E4M3, dispatch_wire, row_bytes

if TYPE_CHECKING:  # pragma: no cover
    from moetrain.config import Config

__all__ = ["LoraShape", "ModelShape", "DEFAULT_VOCAB", "lora_shape", "newton_schulz_flops"]

DEFAULT_VOCAB = 32000
"""Vocabulary assumed when the config leaves ``model.vocab_size`` to the tokenizer."""


def newton_schulz_flops(m: int, n: int, steps: int = 5) -> int:
    """FLOPs of ``steps`` quintic Newton–Schulz iterations on one [m, n] matrix (Muon; Jordan et
    al. 2024): per step X·Xᵀ (2·a²·b), S·S (2·a³) and (b·S + c·S²)·X (2·a²·b), with
    a = min(m, n), b = max(m, n)."""
    a, b = min(m, n), max(m, n)
    return steps * (4 * a * a * b + 2 * a ** 3)


@dataclass(frozen=True)
class LoraShape:
    """What ``train.lora`` trains of a model: the low-rank adapters (and the routers when
    targeted), counted exactly on the meta-device model (:func:`lora_shape`); the rest is a
    frozen base of ``base_bytes`` per parameter as stored (``train.lora.base_dtype``: null, fp32
    master weights, 4; bf16 2; fp8 1 + the fp32 scale of each B × B block, 4 / B², with the
    embedding and head in bf16, ``embedding_bytes``, and the norms counted at 1). Per layer,
    the mean over the layers of the kind: ``dense_layer`` of a layer without routed experts,
    ``moe_layer`` of a MoE layer outside its routed experts (attention, shared experts, router),
    ``expert_layer`` its routed experts' adapters (E pairs per matrix, or one pair with
    ``experts_shared``)."""

    rank: int
    dense_layer: float
    moe_layer: float
    expert_layer: float
    experts_shared: bool = False
    base_bytes: float = 4.0
    # bytes per base parameter that ZeRO's all-gathers move: None, the compute copy's (a base in
    # the master dtype is cast by FSDP's policy), else the stored bytes (bf16 / fp8 are gathered
    # as stored)
    gather_bytes: float | None = None
    # bytes per embedding / head parameter as stored (an FP8 base keeps them in bf16)
    embedding_bytes: float = 4.0
    # an FP8 base dequantizes each weight at its GEMM, and autograd keeps that copy for the
    # input gradient until the layer's backward (one layer's under full recomputation)
    dequantized_copies: bool = False


def lora_shape(cfg: "Config") -> LoraShape:
    """The adapters ``cfg.train.lora`` adds, counted on the meta-device model (no memory)."""
    import dataclasses

    import torch

    from moetrain.model.lora import add_adapters
    from moetrain.model.transformer import Transformer

    if cfg.model.vocab_size is None:  # the adapters never touch the embedding or the head
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=DEFAULT_VOCAB))
    with torch.device("meta"):
        model = Transformer.from_config(cfg)
    add_adapters(model, cfg.train.lora)
    dense, moe, expert = [], [], []
    for block in model.layers.values():
        experts = block.moe.experts if block.moe is not None else None
        in_experts = {id(p) for p in experts.parameters()} if experts is not None else set()
        trained = [p for p in block.parameters() if p.requires_grad]
        outside = sum(p.numel() for p in trained if id(p) not in in_experts)
        if experts is None:
            dense.append(outside)
        else:
            moe.append(outside)
            expert.append(sum(p.numel() for p in trained if id(p) in in_experts))

    def mean(xs: list[int]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    base = {None: 4.0, "bf16": 2.0, "fp8": 1.0 + 4.0 / cfg.train.fp8_block ** 2}[cfg.train.lora.base_dtype]
    return LoraShape(cfg.train.lora.r, mean(dense), mean(moe), mean(expert), cfg.train.lora.experts == "shared", base,
                     None if cfg.train.lora.base_dtype is None else base, 2.0 if cfg.train.lora.base_dtype else base,
                     cfg.train.lora.base_dtype == "fp8")


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    tie_embeddings: bool
    num_experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int
    moe_layer_flags: tuple[bool, ...]
    vocab_assumed: bool = False
    capacity_factor: float | None = None      # moe.capacity_factor: None = dropless
    max_nodes_per_token: int | None = None    # moe.max_nodes_per_token: node-limited routing (DeepSeek-V3 §2.1.2)
    # moe.eplb's spare expert slots per MoE layer: each ep rank holds (E + them) / ep experts' weights,
    # gradients and optimizer states (moetrain.parallel.eplb)
    redundant_experts: int = 0
    # moe.eplb.every: steps between re-placements, whose moves the step time amortises (0: none)
    eplb_every: int = 0
    # whether the EP dispatch sends a token once per destination node and forwards it over NVLink
    # (DeepSeek-V3 §3.2.2, DeepEP; moe.token_dispatcher: hierarchical), else every routed copy
    dispatch_dedup: bool = False
    # the dispatch's rows in float8 E4M3 with 1 × 128 power-of-two scales (moe.dispatch_dtype:
    # fp8, DeepSeek-V3 §3.3); the combine and the backward's two all-to-alls stay bf16
    dispatch_fp8: bool = False
    # the GEMMs of the dense linears and the experts in fp8 (train.precision: fp8); the router,
    # the output head and the attention core stay bf16
    fp8_gemms: bool = False
    # planner-only architecture facts (see the module doc)
    head_dim_override: int | None = None      # query/key width per head when not hidden/heads
    v_head_dim: int | None = None             # value width per head when not the query/key one
    attn_params_override: int | None = None   # attention projection parameters per layer (MLA)
    mlp_matrices: int = 3                     # dense MLP: 3 = SwiGLU, 2 = GELU or squared ReLU
    expert_matrices: int = 3                  # each routed / shared expert: 3 = SwiGLU, 2 = squared ReLU
    window: int | None = None                 # sliding-window span (tokens) of ``window_layers`` layers
    window_layers: int = 0
    chunk: int | None = None                  # attention chunk (tokens) of ``chunk_layers`` layers (Llama 4)
    chunk_layers: int = 0
    # DeepSeek Sparse Attention (model.dsa) on every MLA layer: keys per query (0: off), the
    # indexer's heads and head dim, and the dense warm-up (the attention stays dense)
    dsa_topk: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    dsa_dense: bool = False
    # multi-head latent attention (DeepSeek-V2 §2.1): set kv_lora_rank; head_dim_override is then
    # the query/key width d_n + d_r, v_head_dim d_v, qk_rope_dim d_r; q_lora_rank None: one
    # query projection
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_dim: int = 0
    mtp_depth: int = 0                        # multi-token prediction modules (DeepSeek-V3 §2.2)
    # gated-DeltaNet blocks (model.layer_types linear_attention) and their shape: key / value
    # heads, widths per head, convolution width, chunk length of the chunked delta rule
    linear_layers: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv: int = 0
    linear_chunk: int = 64
    # Kimi Delta Attention blocks (model.layer_types kda): linear_k_heads heads of linear_k_dim,
    # linear_conv and linear_chunk as gated DeltaNet's
    kda_layers: int = 0
    gate_width: int = 0                       # extra query-projection outputs of a gated attention
    # Mamba-2 blocks (model.layer_types mamba): heads, head dim, state size, groups, convolution
    # width, chunk length
    mamba_layers: int = 0
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 1
    mamba_conv: int = 0
    mamba_chunk: int = 128
    # single-sublayer blocks (model.hybrid_override_pattern): blocks without a token mixer (MLP /
    # MoE blocks) and without a feed-forward sublayer (Mamba-2 / attention blocks)
    mixer_none: int = 0
    ffn_none: int = 0
    lora: LoraShape | None = None             # train.lora: adapters on a frozen base

    @classmethod
    def from_config(cls, cfg: "Config") -> "ModelShape":
        m, moe = cfg.model, cfg.moe
        vocab = m.vocab_size
        assumed = vocab is None
        if vocab is None:
            vocab = DEFAULT_VOCAB
        q = m.vocab_multiple
        vocab = -(-vocab // q) * q
        mixers = [m.layer_type(i) for i in range(m.layers)]
        ffns = [m.ffn_type(i, moe) for i in range(m.layers)]
        flags = tuple(f == "moe" for f in ffns)
        windowed = sum(1 for i in range(m.layers) if m.window_of(i) is not None)
        chunked = sum(1 for i in range(m.layers) if m.chunk_of(i) is not None)
        mla = m.attention == "mla"
        attn: dict = dict(head_dim_override=m.head_dim)
        if mla:
            attn = dict(head_dim_override=m.qk_nope_head_dim + m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                        q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_rope_dim=m.qk_rope_head_dim)
        if m.linear_attention:
            attn.update(linear_layers=mixers.count("linear_attention"), kda_layers=mixers.count("kda"),
                        linear_k_heads=m.linear_num_key_heads,
                        linear_v_heads=m.linear_num_value_heads, linear_k_dim=m.linear_key_head_dim,
                        linear_v_dim=m.linear_value_head_dim, linear_conv=m.linear_conv_kernel_dim,
                        linear_chunk=m.linear_chunk_size)
        if m.mamba:
            attn.update(mamba_layers=mixers.count("mamba"), mamba_heads=m.mamba_num_heads,
                        mamba_head_dim=m.mamba_head_dim, mamba_state=m.ssm_state_size, mamba_groups=m.n_groups,
                        mamba_conv=m.conv_kernel, mamba_chunk=m.mamba_chunk_size)
        if m.dsa.enabled:
            attn.update(dsa_topk=m.dsa.index_topk, index_heads=m.dsa.index_heads, index_head_dim=m.dsa.index_head_dim,
                        dsa_dense=m.dsa.stage == "dense_warmup")
        if m.attention_output_gate:  # the gate's half of the query projection
            attn["gate_width"] = m.heads * m.resolved_head_dim
        return cls(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.heads if mla else m.kv_heads,
                   ffn=m.ffn_hidden, vocab=vocab, seq_len=m.seq_len, tie_embeddings=m.tie_embeddings,
                   num_experts=moe.num_experts, top_k=moe.top_k if moe.num_experts else 0,
                   expert_ffn=moe.ffn_hidden, shared_experts=moe.shared_experts if moe.num_experts else 0,
                   moe_layer_flags=flags, vocab_assumed=assumed,
                   capacity_factor=moe.capacity_factor if moe.num_experts else None,
                   max_nodes_per_token=moe.max_nodes_per_token if moe.num_experts else None,
                   redundant_experts=moe.num_slots - moe.num_experts,
                   eplb_every=moe.eplb.every if moe.num_experts else 0,
                   dispatch_dedup=moe.token_dispatcher == "hierarchical",
                   dispatch_fp8=dispatch_wire(moe.dispatch_dtype, cfg.train.precision) == E4M3,
                   fp8_gemms=cfg.train.precision == "fp8",
                   window=m.sliding_window if windowed else None, window_layers=windowed,
                   chunk=m.attention_chunk_size if chunked else None, chunk_layers=chunked,
                   mlp_matrices=2 if m.mlp_activation == "relu2" else 3,
                   expert_matrices=2 if moe.activation == "relu2" else 3, mtp_depth=m.mtp_depth,
                   mixer_none=mixers.count("none"), ffn_none=ffns.count("none"),
                   lora=lora_shape(cfg) if cfg.train.lora.r else None, **attn)

    # -- widths ------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.heads

    @property
    def h_q(self) -> int:
        return self.heads * self.head_dim

    @property
    def h_kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def h_v(self) -> int:
        """Attention output width (the out-projection's input): a·d_v."""
        return self.heads * (self.v_head_dim or self.head_dim)

    @property
    def h_kv_v(self) -> int:
        """Value projection width: kv_heads·d_v."""
        return self.kv_heads * (self.v_head_dim or self.head_dim)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> int:
        return sum(self.moe_layer_flags)

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    # -- parameters (counts) -----------------------------------------------------------------
    @property
    def attn_params(self) -> int:
        """QKV and output projections (no biases) of one layer; with MLA (DeepSeek-V2 §2.1,
        eq. 9-18) the query compression h × r_q and up-projection r_q × a·d (or one h × a·d),
        the key-value compression h × r_kv, the RoPE key h × d_r, the key-value up-projection
        r_kv × a·(d_n + d_v) and the output a·d_v × h."""
        if self.attn_params_override is not None:
            return self.attn_params_override
        full = self.full_attn_params
        if not self.linear_layers and not self.kda_layers and not self.mamba_layers and not self.mixer_none:
            return full
        # the mean over the layers of the token mixers (rounded: a count)
        return round((full * self.attention_layers + self.linear_params * self.linear_layers
                      + self.kda_params * self.kda_layers + self.mamba_params * self.mamba_layers) / self.layers)

    @property
    def full_attn_params(self) -> int:
        """One attention layer's projections (GQA or MLA, as :attr:`attn_params` describes), what
        a hybrid's attention blocks and every MTP module's block hold."""
        h = self.hidden
        if self.is_mla:
            q = h * self.q_lora_rank + self.q_lora_rank * self.h_q if self.q_lora_rank else h * self.h_q
            return q + h * (self.kv_lora_rank + self.qk_rope_dim) + self.up_kv_params + self.h_v * h \
                + self.indexer_params
        return h * (self.h_q + self.gate_width + self.h_kv + self.h_kv_v) + self.h_v * h

    @property
    def indexer_params(self) -> int:
        """DSA's indexer of one layer (0 without): its query projection from the query latent
        r_q × H_I·D_I, its key h × D_I with the key norm's weight and bias 2·D_I, its head weights
        h × H_I."""
        if not self.dsa_topk:
            return 0
        Hi, Di = self.index_heads, self.index_head_dim
        return (self.q_lora_rank or self.hidden) * Hi * Di + self.hidden * Di + 2 * Di + self.hidden * Hi

    def dsa_attention_flops(self, causal: bool = False) -> float:
        """Forward FLOPs per token of one DSA layer's attention core (DeepSeek-V3.2-Exp §2.1):
        the indexer's scores against every visible key, 2·s·H_I·D_I plus the head weighting
        2·s·H_I (half of both when causal), and the main attention over the selected keys only,
        in MLA's absorbed form as the sparse kernels run it (every head attends to the selected
        latents: scores 2·(r_kv + d_r), values 2·r_kv per head and key), 2·k̄·a·(2·r_kv + d_r) with
        k̄ the keys a query attends to on average — k' = min(k, s), or causally
        (k'(k' + 1)/2 + (s − k')·k') / s: O(s·k) per sequence instead of O(s²) (the absorption's own
        GEMMs cost what the key-value up-projection costs, counted with the parameters). In the
        dense warm-up the main attention stays dense, and its probabilities are computed once
        more, without gradient, for the indexer's loss (2·s·h_q, half when causal)."""
        s, k, half = self.seq_len, self.dsa_topk, 0.5 if causal else 1.0
        indexer = 2.0 * s * self.index_heads * (self.index_head_dim + 1) * half
        if self.dsa_dense:
            return indexer + 2.0 * s * (self.h_q + self.h_v) * half + 2.0 * s * self.h_q * half
        k = min(k, s)
        kbar = (k * (k + 1) / 2 + (s - k) * k) / s if causal else k
        return indexer + 2.0 * kbar * self.heads * (2 * self.kv_lora_rank + self.qk_rope_dim)

    @property
    def attention_layers(self) -> int:
        """The layers whose token mixer is attention (not gated DeltaNet, KDA, Mamba-2 or none)."""
        return self.layers - self.linear_layers - self.kda_layers - self.mamba_layers - self.mixer_none

    @property
    def kda_params(self) -> int:
        """One KDA block's token mixer (H heads of d_k): the q, k, v projections h × 3·H·d_k and
        their convolutions, b h × H, the decay's and the output gate's bottlenecks h × d_k + d_k ×
        H·d_k each, A_log (H), dt_bias (H·d_k), the gated norm's d_k and the output H·d_k × h."""
        if not self.kda_layers:
            return 0
        H, Dk = self.linear_k_heads, self.linear_k_dim
        w = H * Dk
        return (self.hidden * (3 * w + H) + 3 * w * self.linear_conv + 2 * (self.hidden * Dk + Dk * w)
                + H + w + Dk + w * self.hidden)

    def kda_flops(self) -> float:
        """Forward FLOPs per token of one KDA block's chunked delta rule (its projections are
        matmul parameters): per head, inside its chunk of C tokens the decay-weighted q·kᵀ and
        k·kᵀ channel by channel (3·C·d_k each: two products and a sum per channel, and the decay
        C·d_k), the scores times the corrections (2·C·d_k) and the triangular solve (2·C·d_k);
        across chunks the state read by the queries and the keys, and its update (3 × 2·d_k²);
        the three convolutions 2·width per channel."""
        C, Dk, H = self.linear_chunk, self.linear_k_dim, self.linear_k_heads
        return float(H * (11 * C * Dk + 6 * Dk * Dk) + 2 * self.linear_conv * 3 * H * Dk)

    @property
    def mamba_params(self) -> int:
        """One Mamba-2 block's token mixer: ``in_proj`` h × (2·H·P + 2·G·N + H), the convolution
        (weights and bias) over H·P + 2·G·N channels, dt_bias, A_log, D, the gated norm's H·P and
        ``out_proj`` H·P × h."""
        if not self.mamba_layers:
            return 0
        inner = self.mamba_heads * self.mamba_head_dim
        channels = inner + 2 * self.mamba_groups * self.mamba_state
        return (self.hidden * (inner + channels + self.mamba_heads) + channels * (self.mamba_conv + 1)
                + 3 * self.mamba_heads + inner + inner * self.hidden)

    @property
    def attention_share(self) -> float:
        """The share of the layers whose token mixer is attention (not gated DeltaNet, KDA or Mamba-2)."""
        return self.attention_layers / self.layers

    def head_exchange_width(self) -> float:
        """Values per token (summed over heads) that context parallelism's head all-to-all moves
        in one forward of a gated-DeltaNet, KDA or Mamba-2 layer, the mean over those layers: into the
        recurrence what it reads (q, k, v, b, a; or x, B, C, dt) and back its output
        (:class:`moetrain.parallel.context.HeadAllToAll`); 0 without such layers."""
        n = self.linear_layers + self.kda_layers + self.mamba_layers
        if not n:
            return 0.0
        kda = self.linear_k_heads * (5 * self.linear_k_dim + 1)  # q, k, v, f, b in; o back
        r = self.linear_v_heads // max(1, self.linear_k_heads)
        gdn = (self.linear_k_heads * (2 * self.linear_k_dim + r * self.linear_v_dim + 2 * r)
               + self.linear_v_heads * self.linear_v_dim)
        inner = self.mamba_heads * self.mamba_head_dim
        mamba = inner + 2 * self.mamba_groups * self.mamba_state + self.mamba_heads + inner
        return (gdn * self.linear_layers + kda * self.kda_layers + mamba * self.mamba_layers) / n

    def mamba_flops(self) -> float:
        """Forward FLOPs per token of one Mamba-2 block's chunked scan (its projections are matmul
        parameters): per head, inside its chunk of C tokens the C·Bᵀ scores (2·C·N) and their
        product with Δx (2·C·P); across chunks the state read (2·N·P) and update (2·P·N); the
        convolution 2·width per channel."""
        C, N, P = self.mamba_chunk, self.mamba_state, self.mamba_head_dim
        channels = self.mamba_heads * P + 2 * self.mamba_groups * N
        return float(self.mamba_heads * (2 * C * (N + P) + 4 * N * P) + 2 * self.mamba_conv * channels)

    @property
    def linear_params(self) -> int:
        """One gated-DeltaNet block's token mixer: q, k, v, z, b, a projections h × (2·Hk·Dk +
        2·Hv·Dv + 2·Hv), the output Hv·Dv × h, the depthwise convolution, A_log, dt_bias and the
        gated norm's weight."""
        if not self.linear_layers:
            return 0
        kd, vd = self.linear_k_heads * self.linear_k_dim, self.linear_v_heads * self.linear_v_dim
        return (self.hidden * (2 * kd + 2 * vd + 2 * self.linear_v_heads) + vd * self.hidden
                + (2 * kd + vd) * self.linear_conv + 2 * self.linear_v_heads + self.linear_v_dim)

    def linear_flops(self) -> float:
        """Forward FLOPs per token of one gated-DeltaNet block's chunked delta rule (its
        projections are matmul parameters): per value head, inside its chunk of C tokens q·kᵀ,
        k·kᵀ (2·C·Dk each), the scores times the corrections (2·C·Dv), the triangular solve for
        the corrections and the decayed keys (C·(Dv + Dk)); across chunks the state read by the
        queries and the keys, and its update (3 × 2·Dk·Dv); the convolution 2·width per channel."""
        C, Dk, Dv = self.linear_chunk, self.linear_k_dim, self.linear_v_dim
        rule = self.linear_v_heads * (2 * C * (2 * Dk + Dv) + C * (Dv + Dk) + 6 * Dk * Dv)
        conv = 2 * self.linear_conv * (2 * self.linear_k_heads * Dk + self.linear_v_heads * Dv)
        return float(rule + conv)

    @property
    def up_kv_params(self) -> int:
        """MLA's key-value up-projection r_kv × a·(d_n + d_v) (0 without MLA)."""
        if not self.is_mla:
            return 0
        return self.kv_lora_rank * self.heads * (self.head_dim - self.qk_rope_dim + (self.v_head_dim or self.head_dim))

    @property
    def up_proj_params(self) -> int:
        """What Megatron-Core's ``mla_up_proj`` recomputation runs again, as parameters: MLA's
        up-projections r_q × a·d (or h × a·d without a query bottleneck) and r_kv × a·(d_n + d_v);
        without MLA every input projection."""
        if not self.is_mla:
            return self.attn_params - self.attn_out_params
        q = self.q_lora_rank * self.h_q if self.q_lora_rank else self.hidden * self.h_q
        return q + self.up_kv_params

    @property
    def mla_latent_width(self) -> int:
        """Per token, the compressed query and key-value latents and the RoPE key, r_q + r_kv +
        d_r: what MLA keeps of its attention input when the up-projections are recomputed."""
        if not self.is_mla:
            return 0
        return (self.q_lora_rank or 0) + self.kv_lora_rank + self.qk_rope_dim

    @property
    def attn_out_params(self) -> int:
        """The output projection's share of :attr:`attn_params` (h_v × h)."""
        return self.h_v * self.hidden

    @property
    def norm_params(self) -> int:
        """A layer's norms: two, or one in a single-sublayer block (the mean over the layers)."""
        return round((2 * self.layers - self.mixer_none - self.ffn_none) * self.hidden / self.layers)

    @property
    def mlp_params(self) -> int:
        """Dense MLP of one layer: SwiGLU w1, w3 (h×F) and w2 (F×h); GELU or squared ReLU w1 and
        w2 — the mean over the non-MoE layers where some have no MLP (single-sublayer blocks)."""
        full = self.mlp_matrices * self.hidden * self.ffn
        if not self.ffn_none:
            return full
        non_moe = self.layers - sum(self.moe_layer_flags)
        return round(full * (non_moe - self.ffn_none) / max(1, non_moe))

    @property
    def expert_params(self) -> int:
        """All routed experts of one MoE layer."""
        return self.num_experts * self.expert_matrices * self.hidden * self.expert_ffn

    @property
    def router_params(self) -> int:
        return self.hidden * self.num_experts

    @property
    def shared_params(self) -> int:
        return self.shared_experts * self.expert_matrices * self.hidden * self.expert_ffn

    @property
    def embedding_params(self) -> int:
        """Input embedding plus output head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    def muon_matrices(self, moe: bool) -> list[tuple[int, int, int]]:
        """(rows, columns, count) of the matrices ``train.optimizer: muon`` orthogonalizes in one
        layer (:func:`moetrain.train.optim.uses_muon`): the attention projections (MLA's low-rank
        pairs as two), the dense MLP's or the shared experts' (one [S·f, h] per matrix) and each
        routed expert's three. A published run's attention of stated parameters only is taken
        as four square h × h matrices' worth (its split is not known)."""
        h = self.hidden
        if self.attn_params_override is not None:
            out = [(h, h, max(1, round(self.attn_params_override / (h * h))))]
        elif self.is_mla:
            q = [(self.q_lora_rank, h, 1), (self.h_q, self.q_lora_rank, 1)] if self.q_lora_rank else [(self.h_q, h, 1)]
            out = q + [(self.kv_lora_rank + self.qk_rope_dim, h, 1),
                       (self.up_kv_params // self.kv_lora_rank, self.kv_lora_rank, 1), (h, self.h_v, 1)]
        else:
            out = [(self.h_q, h, 1), (self.h_kv, h, 1), (self.h_kv_v, h, 1), (h, self.h_v, 1)]
        if not moe:
            return out + [(self.ffn, h, self.mlp_matrices)]
        if self.shared_experts:
            out.append((self.shared_experts * self.expert_ffn, h, 3))
        return out + [(self.expert_ffn, h, 3 * self.num_experts)]

    def muon_ns_flops(self, moe: bool, steps: int = 5) -> float:
        """Newton–Schulz FLOPs of one layer's :meth:`muon_matrices`, each orthogonalized once."""
        return float(sum(c * newton_schulz_flops(m, n, steps) for m, n, c in self.muon_matrices(moe)))

    def layer_params(self, moe: bool) -> tuple[int, int]:
        """(dense, expert) parameters of one layer; dense includes norms, router, shared experts."""
        dense = self.attn_params + self.norm_params
        if moe:
            return dense + self.router_params + self.shared_params, self.expert_params
        return dense + self.mlp_params, 0

    def trained_layer_params(self, moe: bool) -> tuple[float, float]:
        """(dense, expert) parameters of one layer that train: :meth:`layer_params`, or under
        ``train.lora`` the adapters (and trained routers) only."""
        if self.lora is None:
            return self.layer_params(moe)
        return (self.lora.moe_layer, self.lora.expert_layer) if moe else (self.lora.dense_layer, 0.0)

    @property
    def mtp_moe(self) -> bool:
        """Whether the MTP modules' blocks are MoE (they are of the model's last block's kind)."""
        return bool(self.moe_layer_flags) and self.moe_layer_flags[-1]

    def mtp_params(self) -> tuple[int, int]:
        """(dense, expert) parameters of the ``mtp_depth`` MTP modules: each a block, the
        projection W [h × 2h] and three norms (DeepSeek-V3 §2.2); embedding and head shared. Their
        blocks are attention in a hybrid too (Qwen3-Next's MTP layer)."""
        d, e = self.layer_params(self.mtp_moe)
        if self.attn_params_override is None:
            d += self.full_attn_params - self.attn_params
        return self.mtp_depth * (d + 2 * self.hidden * self.hidden + 3 * self.hidden), self.mtp_depth * e

    @property
    def total_params(self) -> int:
        n = self.embedding_params + self.hidden + sum(self.mtp_params())  # final norm, MTP
        if self.mixer_none or self.ffn_none:  # single-sublayer blocks: each kind counted exactly
            full = self.attn_params_override if self.attn_params_override is not None else self.full_attn_params
            moe = sum(self.moe_layer_flags)
            return (n + full * self.attention_layers + self.linear_params * self.linear_layers
                    + self.kda_params * self.kda_layers + self.mamba_params * self.mamba_layers
                    + self.mlp_matrices * self.hidden * self.ffn * (self.layers - moe - self.ffn_none)
                    + moe * (self.router_params + self.shared_params + self.expert_params)
                    + (2 * self.layers - self.mixer_none - self.ffn_none) * self.hidden)
        for flag in self.moe_layer_flags:
            d, e = self.layer_params(flag)
            n += d + e
        return n

    @property
    def active_params(self) -> int:
        """Parameters one token touches (routed experts: top_k of them), the MTP modules' too."""
        n = self.embedding_params + self.hidden
        for flag in (*self.moe_layer_flags, *(self.mtp_moe,) * self.mtp_depth):
            d, e = self.layer_params(flag)
            n += d + (e * self.top_k // self.num_experts if flag else 0)
        return n + self.mtp_depth * (2 * self.hidden * self.hidden + 3 * self.hidden)

    # -- FLOPs per token, forward ------------------------------------------------------------
    def layer_matmul_flops(self, moe: bool) -> float:
        """Forward matmul FLOPs per token of one layer (2 per multiply-add)."""
        f = 2.0 * self.attn_params
        if moe:
            f += 2.0 * self.router_params + 2.0 * self.expert_matrices * self.hidden * self.expert_ffn * (
                self.top_k + self.shared_experts)
        else:
            f += 2.0 * self.mlp_params
        return f

    def attention_flops(self, causal: bool = False) -> float:
        """Forward QKᵀ and AV FLOPs per token of one layer, averaged over the layers:
        2·s·(h_q + h_v) (= 4·s·h_q when d_v = d), half with a causal mask; a sliding-window
        layer attends to ``window`` keys (all of them, causal or not); a chunked layer (Llama 4)
        to the keys of its chunk, as full attention over min(chunk, s) tokens; a gated-DeltaNet
        block its delta rule (:meth:`linear_flops`, independent of s)."""
        if self.dsa_topk:  # every layer MLA with DSA (model.dsa refuses hybrids and windows)
            return self.dsa_attention_flops(causal)
        full = 2.0 * self.seq_len * (self.h_q + self.h_v) * (0.5 if causal else 1.0)
        if self.linear_layers or self.kda_layers or self.mamba_layers:
            return (full * self.attention_layers + self.linear_flops() * self.linear_layers
                    + self.kda_flops() * self.kda_layers + self.mamba_flops() * self.mamba_layers) / self.layers
        windows = self.window_layers if self.window else 0
        chunks = self.chunk_layers if self.chunk else 0
        if not windows and not chunks:
            return full
        windowed = 2.0 * min(self.window or 0, self.seq_len) * (self.h_q + self.h_v)
        chunked = 2.0 * min(self.chunk or 0, self.seq_len) * (self.h_q + self.h_v) * (0.5 if causal else 1.0)
        return (full * (self.layers - windows - chunks) + windowed * windows + chunked * chunks) / self.layers

    @property
    def logits_flops(self) -> float:
        return 2.0 * self.hidden * self.vocab

    def mtp_flops(self, causal: bool = False) -> float:
        """Forward FLOPs per token of the MTP modules: each its block (full attention), the
        projection W (2·2h·h) and the shared head (as Megatron-LM counts ``mtp_num_layers``)."""
        attn = 2.0 * self.seq_len * (self.h_q + self.h_v) * (0.5 if causal else 1.0)
        per = self.layer_matmul_flops(self.mtp_moe) + attn + 2.0 * 2 * self.hidden * self.hidden + self.logits_flops
        return self.mtp_depth * per

    def model_flops_per_token(self, causal: bool = False) -> float:
        """Forward + backward model FLOPs per token (the MFU numerator), see module doc (under
        ``train.lora`` without the frozen weights' gradient GEMMs);
        ``causal``: attention scores counted as half (what a causal kernel computes)."""
        fwd = sum(self.layer_matmul_flops(flag) + self.attention_flops(causal) for flag in self.moe_layer_flags)
        if self.lora is None:
            return 3.0 * (fwd + self.logits_flops + self.mtp_flops(causal))
        # train.lora: the frozen weights have no weight gradient (backward = the input gradients,
        # once the forward); the attention scores' backward is all input gradients (twice); the
        # adapters' rank-r GEMMs are left out (r ≪ the widths)
        scores = sum(self.attention_flops(causal) for _ in self.moe_layer_flags)
        return 2.0 * (fwd + self.logits_flops + self.mtp_flops(causal)) + scores

    def recompute_flops_per_token(self, checkpointing: str, modules: tuple[str, ...] = ("core_attn",),
                                  share: float = 1.0) -> float:
        """Extra forward FLOPs per token that activation checkpointing executes (same convention).
        ``modules``: what selective checkpointing recomputes (layout.RECOMPUTE_MODULES):
        ``core_attn`` the attention core, ``mla_up_proj`` the core and MLA's up-projections
        (:attr:`up_proj_params`; not the compressions, whose outputs it keeps), ``mlp`` the dense
        MLPs; ``layernorm`` and ``moe_act`` recompute elementwise kernels only (no matmul FLOPs).
        Full recomputation runs the MTP modules' blocks again too; ``share``: the share of the
        layers it recomputes (``Layout.recompute_num_layers``), 1 for all."""
        if checkpointing == "full":
            blocks = sum(self.layer_matmul_flops(flag) + self.attention_flops() for flag in self.moe_layer_flags)
            return share * (blocks + self.mtp_depth * (self.layer_matmul_flops(self.mtp_moe)
                                                       + 2.0 * self.seq_len * (self.h_q + self.h_v)))
        if checkpointing != "selective":
            return 0.0
        f = 0.0
        if "core_attn" in modules or "mla_up_proj" in modules:
            f += self.layers * self.attention_flops()
        if "mla_up_proj" in modules:
            f += self.layers * 2.0 * self.up_proj_params
        if "mlp" in modules:
            f += self.dense_layers * 2.0 * self.mlp_params
        return f

    def dispatch_ratio(self, act_bytes: int = 2) -> float:
        """Bytes of a dispatched row over those of an activation row of ``act_bytes`` per value:
        (D + D / tile) / (act_bytes · D) with fp8 dispatch (the int8 scale exponents counted,
        :func:`moetrain.model.fp8.row_bytes`), else 1."""
        if not self.dispatch_fp8:
            return 1.0
        return row_bytes(self.hidden, E4M3) / (act_bytes * self.hidden)

    def dedup_args(self) -> tuple[int | None, tuple[int, int] | None]:
        """(max_nodes, spread) for traffic.ep_all_to_all: a de-duplicating dispatcher sends a token
        once per destination domain, limited to ``max_nodes_per_token`` or, without a limit, to
        the domains its top-k experts fall into; the flat dispatcher sends every copy (None, None)."""
        if not self.dispatch_dedup:
            return None, None
        if self.max_nodes_per_token is not None:
            return self.max_nodes_per_token, None
        return None, (self.num_experts, self.top_k)

    def expert_copies(self, imbalance: float = 1.0) -> float:
        """Routed copies of one token that the busiest expert rank computes and receives, in
        units of a token: top_k × the load of the busiest expert over the mean, capped by the
        capacity factor (moetrain drops an expert's assignments beyond
        ⌈capacity_factor·T·k/E⌉ before dispatch, Switch Transformer §2.2, so no expert ever
        gets more than capacity_factor × the mean)."""
        load = imbalance if self.capacity_factor is None else min(imbalance, self.capacity_factor)
        return self.top_k * load

    def dispatched_copies(self) -> float:
        """Routed copies of one token that are dispatched at all: top_k, fewer when a
        capacity factor below 1 forces drops."""
        return self.top_k * (1.0 if self.capacity_factor is None else min(1.0, self.capacity_factor))
