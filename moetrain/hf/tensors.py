"""Tensor name and layout maps between moetrain's single-process state dict and the Hugging Face
checkpoint of each architecture.

Shape legend: D hidden, F an expert's (or the dense MLP's) inner width, E experts, H query heads,
G kv heads, Dh head dim, V vocabulary.

One :class:`TensorMap` pairs one moetrain tensor with the HF tensor(s) it is made of. Three layouts
occur:

* ``copy`` — the same tensor (norms, embedding, head, v/o projections, router, dense MLP, shared
  expert, shared-expert gate);
* ``rope`` — rows permuted inside each head. moetrain's RoPE rotates interleaved pairs
  (x[2i], x[2i+1]) (:func:`moetrain.model.layers.apply_rope`, as the RoFormer paper and Meta's
  Llama code do); HF's Llama-family code rotates halves (x[i], x[i + Dh/2]) (``rotate_half``). The
  same rotation on permuted coordinates: moetrain row 2i of a head is HF row i, row 2i + 1 is HF
  row i + Dh/2. It applies to every tensor whose rows index the query / key coordinates: the q/k
  projections, their biases and their norm weights (a per-head norm's [Dh] weight is one "head";
  an RMS statistic does not depend on the order of what it sums). Permuting the weights rather than
  adding a second RoPE layout to the model keeps one RoPE path (and the ring attention's) and lets
  the permutation be checked bit-exactly by a round trip;
  Only a head's rotary rows are permuted: all of them, the first ``partial_rotary_factor`` of
  them (GLM-4.5, Qwen3-Next), the last ``qk_rope_head_dim`` of an MLA query head, or the first
  ``qk_rope_head_dim`` of a DSA indexer's query heads and key (and its LayerNorm's weight and bias:
  a LayerNorm's statistics do not depend on the order either); none where the HF checkpoint itself
  rotates interleaved pairs (DeepSeek's ``rope_interleave: true``, Llama 4, GLM-5's indexer). A gated
  query projection (Qwen3-Next: [q_h; gate_h] per head) is a "head" of 2·Dh rows whose rotary
  rows are its query's;
* ``experts`` — moetrain stacks the experts: w1, w3 [E, D, F] and w2 [E, F, D] (x @ w); HF keeps
  one [F, D] (w1/gate_proj, w3/up_proj) or [D, F] (w2/down_proj) matrix per expert (x @ wᵀ): expert
  e of moetrain's tensor is HF's e-th matrix transposed. Expert order is kept: moetrain expert e is
  HF expert e (the router's row e). GPT-OSS stores the experts stacked as moetrain does (x @ w),
  with gate and up columns interleaved in one ``gate_up_proj`` [E, D, 2F];
* ``rows`` — rows reordered by a fixed permutation (gated DeltaNet's convolution channels:
  moetrain groups them by key head, HF by kind; :func:`moetrain.model.gated_deltanet.conv_channels_in_hf_order`);
* a ``part`` — several moetrain tensors make one HF tensor, concatenated along a dim (MLA's
  ``kv_a_proj_with_mqa`` = [latent rows; RoPE-key rows]) or interleaved (GPT-OSS's gate/up
  columns): import selects this tensor's part, export assembles the HF tensor from all parts.

Everything here works on tensors in memory, one tensor (or one expert) at a time; reading and
writing files is :mod:`moetrain.hf.convert`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from moetrain.config import Config
from moetrain.model import mamba2
from moetrain.model.gated_deltanet import conv_channels_in_hf_order


@dataclass(frozen=True)
class Names:
    """The HF tensor names of one architecture family's MoE and attention. ``experts``:
    ``per_expert`` (one matrix per expert: ``{module}.experts.{e}.{w1|w3|w2}.weight``),
    ``fused`` (GPT-OSS: ``gate_up_proj`` [E, D, 2F] interleaved, ``down_proj`` [E, F, D], and
    their biases) or ``fused_cat`` (Llama 4: ``gate_up_proj`` [E, D, 2F] with the gate's F
    columns first, then the up projection's; ``down_proj`` [E, F, D])."""

    module: str
    router: str
    w1: str = "gate_proj"
    w3: str = "up_proj"
    w2: str = "down_proj"
    shared: str = "shared_expert"
    experts: str = "per_expert"
    dense: str = "mlp"  # the dense blocks' MLP
    # the multi-token-prediction modules: "deepseek" (blocks after the last, model.layers.{L}.*,
    # DeepSeek-V3's and GLM-4.5's) or "qwen3_next" (mtp.fc, mtp.pre_fc_norm_*, mtp.layers.{k}.*)
    mtp: str = "deepseek"
    # the model's own names: its prefix, the embedding and the final norm (Nemotron-H: backbone,
    # embeddings, norm_f)
    prefix: str = "model"
    embed: str = "embed_tokens"
    final_norm: str = "norm"
    # gated DeltaNet's input projections: "fused" (Qwen3-Next: in_proj_qkvz and in_proj_ba grouped
    # by key head, as moetrain's) or "split" (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)
    gdn: str = "fused"
    # where the aux-loss-free routing bias lives: "router" ({module}.{router}.e_score_correction_bias,
    # DeepSeek-V3's) or "module" ({module}.e_score_correction_bias, MiniMax-M2's)
    score_bias: str = "router"
    # how DSA's indexer rotates the first qk_rope_head_dim dims of its query and key: "half"
    # (DeepSeek-V3.2: rotate-half, permuted as the ``rope`` layout) or "interleaved" (GLM-5: as moetrain)
    indexer_rope: str = "half"


MIXTRAL_MOE = Names("block_sparse_moe", "gate", "w1", "w3", "w2")
QWEN_MOE = Names("mlp", "gate")
DEEPSEEK_MOE = Names("mlp", "gate", shared="shared_experts")
GPT_OSS_MOE = Names("mlp", "router", experts="fused")
QWEN3_NEXT_NAMES = Names("mlp", "gate", mtp="qwen3_next")
QWEN3_5_NAMES = Names("mlp", "gate", mtp="qwen3_next", gdn="split")
QWEN3_5_VL_NAMES = Names("mlp", "gate", mtp="qwen3_next", gdn="split", prefix="model.language_model")
NEMOTRON_H_NAMES = Names("mixer", "gate", "up_proj", "", "down_proj", shared="shared_experts", dense="mixer",
                         prefix="backbone", embed="embeddings", final_norm="norm_f")
MINIMAX_M2_MOE = Names("block_sparse_moe", "gate", "w1", "w3", "w2", score_bias="module")
GLM_DSA_NAMES = Names("mlp", "gate", shared="shared_experts", indexer_rope="interleaved")
KIMI_MOE = Names("block_sparse_moe", "gate", "w1", "w3", "w2", shared="shared_experts", dense="block_sparse_moe")
LLAMA4_NAMES = Names("feed_forward", "router", experts="fused_cat", dense="feed_forward")


@dataclass(frozen=True)
class Part:
    """This moetrain tensor is member ``index`` of ``members`` (moetrain names, in order) that
    make up one HF tensor along ``dim``: concatenated (``how`` "cat", member i of ``sizes[i]``
    along dim) or interleaved (``how`` "interleave": member i at positions i::len(members))."""

    dim: int
    how: str
    members: tuple[str, ...]
    index: int
    sizes: tuple[int, ...] = ()

    def select(self, t: torch.Tensor) -> torch.Tensor:
        if self.how == "interleave":
            n = len(self.members)
            return t.narrow(self.dim, 0, t.shape[self.dim]).unflatten(self.dim, (-1, n)).select(self.dim + 1, self.index)
        start = sum(self.sizes[:self.index])
        return t.narrow(self.dim, start, self.sizes[self.index])

    def assemble(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if self.how == "interleave":
            return torch.stack(parts, dim=self.dim + 1).flatten(self.dim, self.dim + 1)
        return torch.cat(parts, dim=self.dim)


@dataclass(frozen=True)
class TensorMap:
    """moetrain tensor ``ours`` (global shape ``shape``) ↔ HF tensors ``hf`` (one name; for
    ``experts`` a template with ``{e}``). ``heads``: heads of a ``rope`` tensor (its rows are
    ``heads`` blocks); ``rotary``: (first row, rows) of a head that RoPE rotates (None: all).
    ``part``: this tensor is a part of the HF tensor (:class:`Part`). ``rows`` (layout
    ``rows``): moetrain's row i is HF's row rows[i]. ``hf_view``: the HF tensor's shape when it
    holds the same values in another shape (Kimi Linear's A_log [1, 1, H, 1] for moetrain's [H])."""

    ours: str
    hf: str
    layout: str  # "copy", "rope", "experts" or "rows"
    shape: tuple[int, ...]
    heads: int = 1
    rotary: tuple[int, int] | None = None
    part: Part | None = None
    also: tuple[str, ...] = ()  # HF copies written on export, optional on import (DeepSeek's MTP layers)
    rows: tuple[int, ...] = ()
    hf_view: tuple[int, ...] = ()
    # several HF tensors whose rows, concatenated in this order, are moetrain's (before ``rows``
    # reorders them): (name, rows) pairs (Qwen3.5's split gated-DeltaNet projections)
    hf_cat: tuple[tuple[str, int], ...] = ()

    def hf_names(self) -> list[str]:
        """The HF tensor names, in order (E of them for ``experts``; none for a part that another
        map writes)."""
        if self.layout == "experts":
            return [self.hf.format(e=e) for e in range(self.shape[0])]
        if self.hf_cat:
            return [name for name, _ in self.hf_cat]
        if self.part is not None and self.part.index:
            return []
        return [self.hf, *self.also]

    def hf_shapes(self) -> list[tuple[int, ...]]:
        """The shape of each HF tensor, in :meth:`hf_names` order."""
        if self.hf_cat:
            return [(rows, *self.shape[1:]) for _, rows in self.hf_cat]
        return [self.hf_shape()] * len(self.hf_names())

    def hf_shape(self) -> tuple[int, ...]:
        """Shape of each HF tensor."""
        if self.layout == "experts":
            return (self.shape[2], self.shape[1])
        if self.hf_view:
            return self.hf_view
        if self.part is not None:
            shape = list(self.shape)
            shape[self.part.dim] = (sum(self.part.sizes) if self.part.how == "cat"
                                    else shape[self.part.dim] * len(self.part.members))
            return tuple(shape)
        return self.shape

    def to_ours(self, get_hf: Callable[[str], torch.Tensor]) -> Iterator[torch.Tensor]:
        """moetrain's tensor from HF tensors read by ``get_hf(name)``, as consecutive row
        blocks (one per expert for ``experts``, else the whole tensor), in the HF dtype.

        Raises:
            ValueError: an HF tensor has the wrong shape.
        """
        if self.layout == "experts":
            for name in self.hf_names():
                yield _checked(name, get_hf(name), self.hf_shape()).t().contiguous().unsqueeze(0)
            return
        if self.hf_cat:
            t = torch.cat([_checked(n, get_hf(n), s) for n, s in zip(self.hf_names(), self.hf_shapes())])
        else:
            t = _checked(self.hf, get_hf(self.hf), self.hf_shape())
        if self.hf_view:
            t = t.reshape(self.shape)
        if self.part is not None:
            t = self.part.select(t).contiguous()
        if self.layout == "rows":
            t = t[torch.tensor(self.rows)].contiguous()
        yield rope_to_interleaved(t, self.heads, self.rotary) if self.layout == "rope" else t

    def hf_layout(self, ours: torch.Tensor) -> torch.Tensor:
        """moetrain's whole tensor in the HF row order (the RoPE permutation undone); for a part,
        what it contributes to the HF tensor. Raises ValueError on a wrong shape."""
        ours = _checked(self.ours, ours, self.shape)
        if self.hf_view:
            return ours.reshape(self.hf_view)
        if self.layout == "rows":
            return ours[torch.argsort(torch.tensor(self.rows))].contiguous()
        return interleaved_to_rope(ours, self.heads, self.rotary) if self.layout == "rope" else ours

    def to_hf(self, ours: torch.Tensor, parts: dict[str, torch.Tensor] | None = None
              ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs from moetrain's whole tensor ``ours``, in :meth:`hf_names`
        order; a part's first member assembles the HF tensor from ``parts`` (moetrain name → the
        member's :meth:`hf_layout`). Raises ValueError on a wrong shape."""
        if self.layout == "experts":
            ours = _checked(self.ours, ours, self.shape)
            for e, name in enumerate(self.hf_names()):
                yield name, ours[e].t().contiguous()
        elif self.hf_cat:
            t = self.hf_layout(ours)
            yield from zip(self.hf_names(), t.split([rows for _, rows in self.hf_cat]))
        elif self.part is None:
            t = self.hf_layout(ours)
            for name in (self.hf, *self.also):
                yield name, t
        elif self.part.index == 0:
            yield self.hf, self.part.assemble([parts[m] for m in self.part.members]).contiguous()


def gdn_projection_rows_in_hf_order(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm_qkvz, perm_ba) int64: moetrain's ``in_proj_qkvz`` row i is row perm_qkvz[i] of
    Qwen3.5's [in_proj_qkv; in_proj_z] (all q, all k, all v, then all z), and ``in_proj_ba`` row i
    is row perm_ba[i] of [in_proj_b; in_proj_a]; moetrain groups both by key head."""
    Hk, Hv, Dk, Dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    r = Hv // Hk
    qkv = conv_channels_in_hf_order(Hk, Hv, Dk, Dv).view(Hk, -1)  # per key head: its q, k, v rows
    z0 = 2 * Hk * Dk + Hv * Dv
    qkvz = torch.cat([torch.cat([qkv[h], z0 + torch.arange(h * r * Dv, (h + 1) * r * Dv)]) for h in range(Hk)])
    ba = torch.cat([torch.cat([torch.arange(h * r, (h + 1) * r), Hv + torch.arange(h * r, (h + 1) * r)])
                    for h in range(Hk)])
    return qkvz, ba


def _checked(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"tensor {name} is {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def _half_to_interleaved_index(head_dim: int, rotary: tuple[int, int] | None = None) -> torch.Tensor:
    """perm with moetrain coordinate j = HF coordinate perm[j] inside a head: on the rotary rows
    [a, a + r) perm[a + 2i] = a + i, perm[a + 2i + 1] = a + i + r/2; the others stay."""
    a, r = rotary if rotary is not None else (0, head_dim)
    perm = torch.arange(head_dim)
    half = torch.arange(r // 2)
    perm[a:a + r] = a + torch.stack((half, half + r // 2), dim=1).reshape(-1)
    return perm


def rope_to_interleaved(t: torch.Tensor, heads: int, rotary: tuple[int, int] | None = None) -> torch.Tensor:
    """HF rotate-half rows → moetrain interleaved rows, per head. t: [heads·Dh, ...] (or [Dh])."""
    head_dim = t.shape[0] // heads
    perm = _half_to_interleaved_index(head_dim, rotary)
    return t.reshape(heads, head_dim, *t.shape[1:])[:, perm].reshape(t.shape).contiguous()


def interleaved_to_rope(t: torch.Tensor, heads: int, rotary: tuple[int, int] | None = None) -> torch.Tensor:
    """Inverse of :func:`rope_to_interleaved`."""
    head_dim = t.shape[0] // heads
    inverse = torch.argsort(_half_to_interleaved_index(head_dim, rotary))
    return t.reshape(heads, head_dim, *t.shape[1:])[:, inverse].reshape(t.shape).contiguous()


def tensor_maps(cfg: Config, names: Names, rope_interleaved: bool = False) -> list[TensorMap]:
    """Every tensor of the model ``cfg`` describes, block by block (then the MTP modules, saved by
    DeepSeek-V3's checkpoints as blocks after the last), with its HF counterpart. ``names``: the
    family's (:data:`MIXTRAL_MOE`, :data:`QWEN_MOE`, :data:`DEEPSEEK_MOE`, :data:`GPT_OSS_MOE`);
    ``rope_interleaved``: the HF checkpoint rotates interleaved pairs already (DeepSeek's
    ``rope_interleave``), so its rows are taken as they are, as they are without RoPE
    (``model.rope: false``, Kimi Linear), which leaves the rows' order free."""
    m = cfg.model
    rope_interleaved = rope_interleaved or not m.rope
    mtp = [f"model.layers.{m.layers + k}" for k in range(m.mtp_depth)] if names.mtp == "deepseek" else []
    P = names.prefix
    maps = [TensorMap("tok_embeddings.weight", f"{P}.{names.embed}.weight", "copy", (m.vocab_size, m.hidden),
                      also=tuple(f"{L}.embed_tokens.weight" for L in mtp))]
    for i in range(m.layers):
        block = _single_sublayer_maps if m.hybrid_override_pattern else _block_maps
        maps += block(cfg, f"layers.{i}", f"{P}.layers.{i}", i, names, rope_interleaved)
    maps.append(TensorMap("norm.weight", f"{P}.{names.final_norm}.weight", "copy", (m.hidden,)))
    if not m.tie_embeddings:
        maps.append(TensorMap("output.weight", "lm_head.weight", "copy", (m.vocab_size, m.hidden),
                              also=tuple(f"{L}.shared_head.head.weight" for L in mtp)))
    D = m.hidden
    if names.mtp == "qwen3_next":  # one module: its fc and norms, then its decoder layer
        for k in range(m.mtp_depth):
            ours = f"mtp.{m.layers + k}"
            maps += [TensorMap(f"{ours}.enorm.weight", "mtp.pre_fc_norm_embedding.weight", "copy", (D,)),
                     TensorMap(f"{ours}.hnorm.weight", "mtp.pre_fc_norm_hidden.weight", "copy", (D,)),
                     TensorMap(f"{ours}.eh_proj.weight", "mtp.fc.weight", "copy", (D, 2 * D)),
                     *_block_maps(cfg, f"{ours}.block", f"mtp.layers.{k}", m.layers + k, names, rope_interleaved),
                     TensorMap(f"{ours}.norm.weight", "mtp.norm.weight", "copy", (D,))]
        return maps
    for k in range(m.mtp_depth):
        L = m.layers + k
        ours, hf = f"mtp.{L}", f"model.layers.{L}"
        maps += [TensorMap(f"{ours}.enorm.weight", f"{hf}.enorm.weight", "copy", (D,)),
                 TensorMap(f"{ours}.hnorm.weight", f"{hf}.hnorm.weight", "copy", (D,)),
                 TensorMap(f"{ours}.eh_proj.weight", f"{hf}.eh_proj.weight", "copy", (D, 2 * D)),
                 *_block_maps(cfg, f"{ours}.block", hf, L, names, rope_interleaved),
                 TensorMap(f"{ours}.norm.weight", f"{hf}.shared_head.norm.weight", "copy", (D,))]
    return maps


def _single_sublayer_maps(cfg: Config, ours: str, hf: str, layer: int, names: Names, rope_interleaved: bool
                          ) -> list[TensorMap]:
    """One block of ``model.hybrid_override_pattern`` (Nemotron-H's layers): its norm and its one
    sublayer, ``mixer``: Mamba-2 (``in_proj`` rows and the convolution's channels regrouped by
    group, :mod:`moetrain.model.mamba2`), attention (q/k/v/o), a squared-ReLU MLP (up / down) or an
    MoE (router, score-correction bias, per-expert up / down, shared experts)."""
    m, moe = cfg.model, cfg.moe
    D, mixer, ffn = m.hidden, m.layer_type(layer), m.ffn_type(layer, moe)
    mx = f"{hf}.{names.module}"
    maps = [TensorMap(f"{ours}.{'attention_norm' if mixer != 'none' else 'ffn_norm'}.weight", f"{hf}.norm.weight",
                      "copy", (D,))]
    if mixer == "mamba":
        H, Pd, N, G = m.mamba_num_heads, m.mamba_head_dim, m.ssm_state_size, m.n_groups
        inner, channels = H * Pd, H * Pd + 2 * G * N
        rows = tuple(mamba2.in_proj_rows_in_hf_order(H, Pd, N, G).tolist())
        conv = tuple(mamba2.conv_channels_in_hf_order(H, Pd, N, G).tolist())
        a = f"{ours}.attention"
        maps += [TensorMap(f"{a}.in_proj.weight", f"{mx}.in_proj.weight", "rows", (inner + channels + H, D), rows=rows),
                 TensorMap(f"{a}.conv1d.weight", f"{mx}.conv1d.weight", "rows", (channels, 1, m.conv_kernel), rows=conv)]
        if m.use_conv_bias:
            maps.append(TensorMap(f"{a}.conv1d.bias", f"{mx}.conv1d.bias", "rows", (channels,), rows=conv))
        maps += [TensorMap(f"{a}.{n}", f"{mx}.{n}", "copy", (H,)) for n in ("dt_bias", "A_log", "D")]
        maps += [TensorMap(f"{a}.norm.weight", f"{mx}.norm.weight", "copy", (inner,)),
                 TensorMap(f"{a}.out_proj.weight", f"{mx}.out_proj.weight", "copy", (D, inner))]
    elif mixer == "full_attention":
        H, G, Dh = m.heads, m.kv_heads, m.resolved_head_dim
        rope = "copy" if rope_interleaved else "rope"
        maps += [TensorMap(f"{ours}.attention.wq.weight", f"{mx}.q_proj.weight", rope, (H * Dh, D), H),
                 TensorMap(f"{ours}.attention.wk.weight", f"{mx}.k_proj.weight", rope, (G * Dh, D), G),
                 TensorMap(f"{ours}.attention.wv.weight", f"{mx}.v_proj.weight", "copy", (G * Dh, D)),
                 TensorMap(f"{ours}.attention.wo.weight", f"{mx}.o_proj.weight", "copy", (D, H * Dh))]
    elif ffn == "dense":
        F = m.ffn_hidden
        maps += [TensorMap(f"{ours}.feed_forward.w1.weight", f"{mx}.up_proj.weight", "copy", (F, D)),
                 TensorMap(f"{ours}.feed_forward.w2.weight", f"{mx}.down_proj.weight", "copy", (D, F))]
    else:
        E, F, ex = moe.num_experts, moe.ffn_hidden, f"{ours}.moe.experts"
        maps += [TensorMap(f"{ours}.moe.router.weight", f"{mx}.{names.router}.weight", "copy", (E, D)),
                 TensorMap(f"{ours}.moe.expert_bias", f"{mx}.{names.router}.e_score_correction_bias", "copy", (E,)),
                 TensorMap(f"{ex}.w1", f"{mx}.experts.{{e}}.{names.w1}.weight", "experts", (E, D, F)),
                 TensorMap(f"{ex}.w2", f"{mx}.experts.{{e}}.{names.w2}.weight", "experts", (E, F, D))]
        if moe.shared_hidden:
            S, sh = moe.shared_hidden, f"{mx}.{names.shared}"
            maps += [TensorMap(f"{ours}.moe.shared.w1.weight", f"{sh}.up_proj.weight", "copy", (S, D)),
                     TensorMap(f"{ours}.moe.shared.w2.weight", f"{sh}.down_proj.weight", "copy", (D, S))]
    return maps


def _block_maps(cfg: Config, ours: str, hf: str, layer: int, names: Names, rope_interleaved: bool
                ) -> list[TensorMap]:
    m, moe = cfg.model, cfg.moe
    D, H, G, Dh = m.hidden, m.heads, m.kv_heads, m.resolved_head_dim
    at = f"{hf}.self_attn"
    rope = "copy" if rope_interleaved else "rope"
    maps = [TensorMap(f"{ours}.attention_norm.weight", f"{hf}.input_layernorm.weight", "copy", (D,))]
    if m.layer_type(layer) == "linear_attention":  # gated DeltaNet: the same names and layout
        la, mix = f"{hf}.linear_attn", f"{ours}.attention"
        Hk, Hv, Dk, Dv = m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim
        channels = 2 * Hk * Dk + Hv * Dv
        qkvz, ba = (2 * Hk * Dk + 2 * Hv * Dv, D), (2 * Hv, D)
        if names.gdn == "split":  # Qwen3.5: q, k, v, z, b, a each all heads in order
            qkvz_rows, ba_rows = gdn_projection_rows_in_hf_order(Hk, Hv, Dk, Dv)
            maps += [TensorMap(f"{mix}.in_proj_qkvz.weight", f"{la}.in_proj_qkv.weight", "rows", qkvz,
                               rows=tuple(qkvz_rows.tolist()),
                               hf_cat=((f"{la}.in_proj_qkv.weight", channels), (f"{la}.in_proj_z.weight", Hv * Dv))),
                     TensorMap(f"{mix}.in_proj_ba.weight", f"{la}.in_proj_b.weight", "rows", ba,
                               rows=tuple(ba_rows.tolist()),
                               hf_cat=((f"{la}.in_proj_b.weight", Hv), (f"{la}.in_proj_a.weight", Hv)))]
        else:
            maps += [TensorMap(f"{mix}.in_proj_qkvz.weight", f"{la}.in_proj_qkvz.weight", "copy", qkvz),
                     TensorMap(f"{mix}.in_proj_ba.weight", f"{la}.in_proj_ba.weight", "copy", ba)]
        for name, shape in (("A_log", (Hv,)), ("dt_bias", (Hv,)), ("norm.weight", (Dv,)),
                            ("out_proj.weight", (D, Hv * Dv))):
            maps.append(TensorMap(f"{mix}.{name}", f"{la}.{name}", "copy", shape))
        maps.append(TensorMap(f"{mix}.conv1d.weight", f"{la}.conv1d.weight", "rows",
                              (channels, 1, m.linear_conv_kernel_dim),
                              rows=tuple(conv_channels_in_hf_order(Hk, Hv, Dk, Dv).tolist())))
    elif m.layer_type(layer) == "kda":  # Kimi Delta Attention: the checkpoint's names
        mix, K = f"{ours}.attention", m.linear_conv_kernel_dim
        H, Dh = m.linear_num_key_heads, m.linear_key_head_dim
        w = H * Dh
        for name, shape in (("q_proj.weight", (w, D)), ("k_proj.weight", (w, D)), ("v_proj.weight", (w, D)),
                            ("q_conv1d.weight", (w, 1, K)), ("k_conv1d.weight", (w, 1, K)),
                            ("v_conv1d.weight", (w, 1, K)), ("b_proj.weight", (H, D)), ("f_a_proj.weight", (Dh, D)),
                            ("f_b_proj.weight", (w, Dh)), ("dt_bias", (w,)), ("g_a_proj.weight", (Dh, D)),
                            ("g_b_proj.weight", (w, Dh)), ("o_norm.weight", (Dh,)), ("o_proj.weight", (D, w))):
            maps.append(TensorMap(f"{mix}.{name}", f"{at}.{name}", "copy", shape))
        maps.append(TensorMap(f"{mix}.A_log", f"{at}.A_log", "copy", (H,), hf_view=(1, 1, H, 1)))
    elif m.attention == "mla":
        dn, dr, dv, ckv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        q_rows = (H * (dn + dr), m.q_lora_rank or D)
        if m.q_lora_rank is None:
            maps.append(TensorMap(f"{ours}.attention.wq.weight", f"{at}.q_proj.weight", rope, q_rows, H, (dn, dr)))
        else:
            maps += [TensorMap(f"{ours}.attention.wq_a.weight", f"{at}.q_a_proj.weight", "copy", (m.q_lora_rank, D)),
                     TensorMap(f"{ours}.attention.q_a_norm.weight", f"{at}.q_a_layernorm.weight", "copy",
                               (m.q_lora_rank,)),
                     TensorMap(f"{ours}.attention.wq_b.weight", f"{at}.q_b_proj.weight", rope, q_rows, H, (dn, dr))]
        kv_a = (f"{ours}.attention.wkv_a.weight", f"{ours}.attention.wk_rope.weight")
        maps += [TensorMap(kv_a[0], f"{at}.kv_a_proj_with_mqa.weight", "copy", (ckv, D),
                           part=Part(0, "cat", kv_a, 0, (ckv, dr))),
                 TensorMap(kv_a[1], f"{at}.kv_a_proj_with_mqa.weight", rope, (dr, D), 1,
                           part=Part(0, "cat", kv_a, 1, (ckv, dr))),
                 TensorMap(f"{ours}.attention.kv_a_norm.weight", f"{at}.kv_a_layernorm.weight", "copy", (ckv,)),
                 TensorMap(f"{ours}.attention.wkv_b.weight", f"{at}.kv_b_proj.weight", "copy", (H * (dn + dv), ckv)),
                 TensorMap(f"{ours}.attention.wo.weight", f"{at}.o_proj.weight", "copy", (D, H * dv))]
        if m.dsa.enabled:  # DSA's indexer: RoPE on the first dr dims of its query heads and its key
            d, ix, hx = m.dsa, f"{ours}.attention.indexer", f"{at}.indexer"
            Hi, Di = d.index_heads, d.index_head_dim
            irope = "copy" if names.indexer_rope == "interleaved" else "rope"
            maps += [TensorMap(f"{ix}.wq_b.weight", f"{hx}.wq_b.weight", irope, (Hi * Di, m.q_lora_rank), Hi, (0, dr)),
                     TensorMap(f"{ix}.wk.weight", f"{hx}.wk.weight", irope, (Di, D), 1, (0, dr)),
                     TensorMap(f"{ix}.k_norm.weight", f"{hx}.k_norm.weight", irope, (Di,), 1, (0, dr)),
                     TensorMap(f"{ix}.k_norm.bias", f"{hx}.k_norm.bias", irope, (Di,), 1, (0, dr)),
                     TensorMap(f"{ix}.weights_proj.weight", f"{hx}.weights_proj.weight", "copy", (Hi, D))]
    else:
        rot = (0, m.rotary_dim) if m.rotary_dim != Dh else None
        q_rows = H * Dh * (2 if m.attention_output_gate else 1)
        q_rot = rot if rot is not None or not m.attention_output_gate else (0, Dh)
        maps += [TensorMap(f"{ours}.attention.wq.weight", f"{at}.q_proj.weight", rope, (q_rows, D), H, q_rot),
                 TensorMap(f"{ours}.attention.wk.weight", f"{at}.k_proj.weight", rope, (G * Dh, D), G, rot),
                 TensorMap(f"{ours}.attention.wv.weight", f"{at}.v_proj.weight", "copy", (G * Dh, D))]
        if m.qkv_bias:
            maps += [TensorMap(f"{ours}.attention.wq.bias", f"{at}.q_proj.bias", rope, (H * Dh,), H, rot),
                     TensorMap(f"{ours}.attention.wk.bias", f"{at}.k_proj.bias", rope, (G * Dh,), G, rot),
                     TensorMap(f"{ours}.attention.wv.bias", f"{at}.v_proj.bias", "copy", (G * Dh,))]
        maps.append(TensorMap(f"{ours}.attention.wo.weight", f"{at}.o_proj.weight", "copy", (D, H * Dh)))
        if m.attention_out_bias:
            maps.append(TensorMap(f"{ours}.attention.wo.bias", f"{at}.o_proj.bias", "copy", (D,)))
        if m.qk_norm == "head":
            maps += [TensorMap(f"{ours}.attention.q_norm.weight", f"{at}.q_norm.weight", rope, (Dh,), 1, rot),
                     TensorMap(f"{ours}.attention.k_norm.weight", f"{at}.k_norm.weight", rope, (Dh,), 1, rot)]
        elif m.qk_norm == "projection":
            maps += [TensorMap(f"{ours}.attention.q_norm.weight", f"{at}.q_norm.weight", rope, (H * Dh,), H, rot),
                     TensorMap(f"{ours}.attention.k_norm.weight", f"{at}.k_norm.weight", rope, (G * Dh,), G, rot)]
    if m.attention_sinks:
        maps.append(TensorMap(f"{ours}.attention.sinks", f"{at}.sinks", "copy", (H,)))
    maps.append(TensorMap(f"{ours}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", "copy", (D,)))
    if not moe.is_moe_layer(layer):
        F = m.ffn_hidden
        mlp = f"{hf}.{names.dense}"
        return maps + [TensorMap(f"{ours}.feed_forward.w1.weight", f"{mlp}.gate_proj.weight", "copy", (F, D)),
                       TensorMap(f"{ours}.feed_forward.w3.weight", f"{mlp}.up_proj.weight", "copy", (F, D)),
                       TensorMap(f"{ours}.feed_forward.w2.weight", f"{mlp}.down_proj.weight", "copy", (D, F))]
    E, F, mo, ex = moe.num_experts, moe.ffn_hidden, f"{hf}.{names.module}", f"{ours}.moe.experts"
    maps.append(TensorMap(f"{ours}.moe.router.weight", f"{mo}.{names.router}.weight", "copy", (E, D)))
    if moe.router_bias:
        maps.append(TensorMap(f"{ours}.moe.router.bias", f"{mo}.{names.router}.bias", "copy", (E,)))
    if moe.routing_bias or moe.bias_update_rate > 0:
        bias_at = mo if names.score_bias == "module" else f"{mo}.{names.router}"
        maps.append(TensorMap(f"{ours}.moe.expert_bias", f"{bias_at}.e_score_correction_bias", "copy", (E,)))
    if names.experts in ("fused", "fused_cat"):
        gate_up = (f"{ex}.w1", f"{ex}.w3")
        how, sizes = ("interleave", ()) if names.experts == "fused" else ("cat", (F, F))
        maps += [TensorMap(gate_up[0], f"{mo}.experts.gate_up_proj", "copy", (E, D, F), part=Part(2, how, gate_up, 0, sizes)),
                 TensorMap(gate_up[1], f"{mo}.experts.gate_up_proj", "copy", (E, D, F), part=Part(2, how, gate_up, 1, sizes)),
                 TensorMap(f"{ex}.w2", f"{mo}.experts.down_proj", "copy", (E, F, D))]
        if moe.expert_biases:
            b = (f"{ex}.b1", f"{ex}.b3")
            maps += [TensorMap(b[0], f"{mo}.experts.gate_up_proj_bias", "copy", (E, F), part=Part(1, "interleave", b, 0)),
                     TensorMap(b[1], f"{mo}.experts.gate_up_proj_bias", "copy", (E, F), part=Part(1, "interleave", b, 1)),
                     TensorMap(f"{ex}.b2", f"{mo}.experts.down_proj_bias", "copy", (E, D))]
    else:
        maps += [TensorMap(f"{ex}.w1", f"{mo}.experts.{{e}}.{names.w1}.weight", "experts", (E, D, F)),
                 TensorMap(f"{ex}.w3", f"{mo}.experts.{{e}}.{names.w3}.weight", "experts", (E, D, F)),
                 TensorMap(f"{ex}.w2", f"{mo}.experts.{{e}}.{names.w2}.weight", "experts", (E, F, D))]
    if moe.shared_hidden:
        S, sh = moe.shared_hidden, f"{mo}.{names.shared}"
        maps += [TensorMap(f"{ours}.moe.shared.w1.weight", f"{sh}.gate_proj.weight", "copy", (S, D)),
                 TensorMap(f"{ours}.moe.shared.w3.weight", f"{sh}.up_proj.weight", "copy", (S, D)),
                 TensorMap(f"{ours}.moe.shared.w2.weight", f"{sh}.down_proj.weight", "copy", (D, S))]
        if moe.shared_expert_gate:
            maps.append(TensorMap(f"{ours}.moe.shared_gate.weight", f"{mo}.shared_expert_gate.weight", "copy", (1, D)))
    return maps
