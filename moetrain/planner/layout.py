"""A parallel layout the planner evaluates: sizes, schedule, ZeRO stage, micro-batch, checkpointing."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetrain.config import hsdp_expert_shard

if TYPE_CHECKING:  # pragma: no cover
    from moetrain.config import Config

__all__ = ["Layout", "LayoutError", "hsdp_axes", "parse_layout_spec", "LAYOUT_KEYS", "RECOMPUTE_MODULES"]

RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe_act", "mlp", "mla_up_proj")
"""Modules selective recomputation can re-run in the backward pass (Megatron-Core's
``--recompute-modules``; NVIDIA 2026, "Scalable Training of Mixture-of-Experts Models with
Megatron Core", §4.1.4): ``core_attn`` the attention core (Korthikanti et al. 2022 §5, moetrain's
``selective``), ``layernorm`` the norms (their outputs are not kept), ``moe_act`` the experts'
activation function, ``mlp`` the dense MLP blocks, ``mla_up_proj`` multi-head latent
attention's up-projections with the attention core (only the low-rank latents are kept)."""


class LayoutError(ValueError):
    """A ``--layout`` string is malformed; the message says which key and the fix."""


@dataclass(frozen=True)
class Layout:
    """``vpp``: virtual stages per pipeline rank (interleaved schedule). ``ac``: activation
    checkpointing (``none``, ``selective`` = recompute the attention core as Korthikanti et al.
    2022 §5, ``full`` = keep each layer's input only). ``sp``: Megatron sequence parallelism
    (always on when tp > 1 in the planner's search). ``etp``: expert-tensor-parallel size,
    1 (each rank keeps its experts whole) or tp (each expert's ffn dim split over the tp ranks,
    Megatron-Core's ``--expert-tensor-parallel-size``); the config field ``parallel.etp``.
    ``ep_fold``: the ep groups span tp × dp × cp (Megatron-Core's MoE parallel folding with
    etp = 1: the tp ranks of an attention block are ep ranks of its MoE block; Liu et al. 2025,
    arXiv 2504.14960) instead of dp × cp with whole-expert copies on the tp ranks; planner-only.
    ``dp_shard``: HSDP's shard group (``parallel.dp_shard``; None: ZeRO shards over all of
    dp × cp).
    ``recompute_modules``: what ``ac = "selective"`` recomputes (:data:`RECOMPUTE_MODULES`);
    moetrain's trainer recomputes ``core_attn`` only, the others describe published runs
    (``python -m moetrain.plan --layout recompute_modules=layernorm+moe_act``).
    ``recompute_num_layers``: with ``ac = "full"``, how many layers of each virtual pipeline
    stage are recomputed whole (Megatron-Core's ``--recompute-method block
    --recompute-num-layers``; fms-fsdp's ``selective_checkpointing`` share of the blocks);
    None recomputes every layer. Planner-only: moetrain's trainer recomputes all of them."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    zero: int = 1
    mbs: int = 1
    ac: str = "none"
    schedule: str = "1f1b"
    sp: bool = False
    etp: int = 1
    recompute_modules: tuple[str, ...] = ("core_attn",)
    ep_fold: bool = False
    dp_shard: int | None = None
    recompute_num_layers: int | None = None

    @property
    def runs_in_moetrain(self) -> bool:
        """Whether moetrain's trainer can run this layout: its selective checkpointing recomputes
        core_attn only, its full checkpointing every layer, and its ep groups lie within dp × cp."""
        return ((self.ac != "selective" or self.recompute_modules == ("core_attn",)) and not self.ep_fold
                and self.recompute_num_layers is None)

    def full_recompute_share(self, chunk_layers: float) -> float:
        """Share of a virtual stage's ``chunk_layers`` layers recomputed whole: 0 unless
        ``ac = "full"``; ``min(recompute_num_layers, chunk_layers) / chunk_layers`` when set, else 1."""
        if self.ac != "full":
            return 0.0
        if self.recompute_num_layers is None or chunk_layers <= 0:
            return 1.0
        return min(float(self.recompute_num_layers), chunk_layers) / chunk_layers

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def edp(self) -> int:
        return self.dp * self.cp * (self.tp if self.ep_fold else 1) // self.ep

    @property
    def dense_shard(self) -> int:
        """Ranks ZeRO shards a dense parameter over: dp × cp, or HSDP's ``dp_shard``."""
        return self.dp_shard if self.dp_shard is not None else self.dp * self.cp

    @property
    def expert_shard(self) -> int:
        """Ranks ZeRO shards one expert shard over: its replicas, edp × tp with whole experts (the
        tp ranks hold copies), edp when tp splits the experts (etp = tp) or the ep groups fold the
        tp ranks in (``ep_fold``); under HSDP the replicas inside one shard group."""
        edp = self.edp if self.dp_shard is None else hsdp_expert_shard(self.edp, self.ep, self.dp_shard)
        return edp if self.ep_fold else edp * (self.tp // self.etp)

    def hsdp_axes(self) -> dict[str, int]:
        """Under HSDP, the shard-group size of each replica axis it splits (``dp_cp``, ``edp_tp``,
        ``edp``); empty otherwise."""
        return hsdp_axes(self.dp_shard, self.dp * self.cp, self.ep, self.tp)

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches per pipeline per step (gradient accumulation steps)."""
        return global_batch // (self.mbs * self.dp)

    def short(self) -> str:
        s = f"tp{self.tp} pp{self.pp}"
        if self.vpp > 1:
            s += f"x{self.vpp}"
        s += f" dp{self.dp}"
        if self.cp > 1:
            s += f" cp{self.cp}"
        if self.ep > 1:
            s += f" ep{self.ep}" + ("(tp×dp)" if self.ep_fold else "")
        if self.etp > 1:
            s += f" etp{self.etp}"
        s += f" z{self.zero}" + (f" hsdp{self.dp_shard}" if self.dp_shard is not None else "")
        s += f" mbs{self.mbs} ac={self.ac}"
        if self.ac == "selective" and self.recompute_modules != ("core_attn",):
            s += f"({'+'.join(self.recompute_modules)})"
        if self.ac == "full" and self.recompute_num_layers is not None:
            s += f"({self.recompute_num_layers}/stage)"
        if self.pp > 1:
            s += f" {self.schedule}"
        return s

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["zero_stage"] = d.pop("zero")
        d["virtual_stages"] = d.pop("vpp")
        d["micro_batch_size"] = d.pop("mbs")
        d["activation_checkpointing"] = d.pop("ac")
        d["sequence_parallel"] = d.pop("sp")
        d["recompute_modules"] = list(self.recompute_modules) if self.ac == "selective" else []
        d["recompute_num_layers"] = self.recompute_num_layers if self.ac == "full" else None
        d["edp"] = self.edp
        return d

    @classmethod
    def from_config(cls, cfg: "Config") -> "Layout":
        p = cfg.parallel
        return cls(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, vpp=p.virtual_stages, zero=p.zero_stage,
                   mbs=cfg.train.micro_batch_size, ac=p.activation_checkpointing, schedule=p.pp_schedule,
                   sp=p.sequence_parallel, etp=p.etp, dp_shard=p.dp_shard)

    def overrides(self) -> list[str]:
        """``--set`` strings that put this layout into a config.

        Raises:
            ValueError: the layout recomputes modules other than the attention core, which
                moetrain's trainer does not (``recompute_modules`` describes published runs).
        """
        if self.ep_fold:
            raise ValueError("ep_fold: moetrain's ep groups lie within dp × cp (the tp ranks keep whole-expert "
                             "copies). Fix: leave ep_fold out, or use parallel.etp = tp")
        if self.recompute_num_layers is not None:
            raise ValueError(f"recompute_num_layers={self.recompute_num_layers}: moetrain's full checkpointing "
                             "recomputes every layer. Fix: leave recompute_num_layers out")
        if not self.runs_in_moetrain:
            raise ValueError(f"recompute_modules={'+'.join(self.recompute_modules)}: moetrain's selective "
                             "checkpointing recomputes core_attn only. Fix: leave recompute_modules out, or use ac=full")
        return [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.dp={self.dp}", f"parallel.cp={self.cp}",
                f"parallel.ep={self.ep}", f"parallel.virtual_stages={self.vpp}", f"parallel.zero_stage={self.zero}",
                f"parallel.pp_schedule={self.schedule}", f"parallel.activation_checkpointing={self.ac}",
                f"parallel.sequence_parallel={'true' if self.sp else 'false'}", f"train.micro_batch_size={self.mbs}"] + \
            ([f"parallel.etp={self.etp}"] if self.etp > 1 else []) + \
            ([f"parallel.dp_shard={self.dp_shard}"] if self.dp_shard is not None else [])


def hsdp_axes(dp_shard: int | None, dp_cp: int, ep: int, tp: int) -> dict[str, int]:
    """Shard-group size of each replica axis HSDP splits, as
    :func:`moetrain.parallel.state.hsdp_sizes` splits them: ``dp_cp``, and, when the experts
    are sharded over fewer than all their replicas, both expert axes — ``edp_tp`` (whole experts,
    the tp ranks inside) and ``edp`` (expert-tensor parallelism); the caller reads the one its
    layout reduces expert gradients over. Empty without HSDP."""
    if dp_shard is None or dp_shard >= dp_cp:
        return {}
    edp = dp_cp // ep
    se = hsdp_expert_shard(edp, ep, dp_shard)
    out = {"dp_cp": dp_shard}
    if se < edp:
        out.update({"edp_tp": se * tp, "edp": se})
    return out


_ALIASES = {
    "tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep",
    "vpp": "vpp", "virtual_stages": "vpp", "v": "vpp",
    "zero": "zero", "zero_stage": "zero", "z": "zero",
    "mbs": "mbs", "micro_batch": "mbs", "micro_batch_size": "mbs",
    "ac": "ac", "recompute": "ac", "activation_checkpointing": "ac",
    "schedule": "schedule", "pp_schedule": "schedule",
    "sp": "sp", "sequence_parallel": "sp",
    "etp": "etp", "expert_tensor_parallel": "etp",
    "recompute_modules": "recompute_modules", "modules": "recompute_modules",
    "ep_fold": "ep_fold",
    "dp_shard": "dp_shard", "hsdp": "dp_shard",
    "recompute_num_layers": "recompute_num_layers",
}
LAYOUT_KEYS = tuple(sorted(set(_ALIASES)))
_CHOICES = {"ac": ("none", "selective", "full"), "schedule": ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")}


def parse_layout_spec(text: str) -> dict[str, Any]:
    """``"tp=8,pp=4,zero=1,ac=full"`` → ``{"tp": 8, "pp": 4, "zero": 1, "ac": "full"}``.

    Keys left out are searched by the planner.

    Raises:
        LayoutError: unknown key, or a value of the wrong kind.
    """
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise LayoutError(f"--layout {text!r}: {part!r} is not key=value. Fix: e.g. --layout tp=8,pp=4")
        key, value = (x.strip() for x in part.split("=", 1))
        if key not in _ALIASES:
            raise LayoutError(f"--layout {text!r}: unknown key {key!r}. Fix: use {', '.join(LAYOUT_KEYS)}")
        k = _ALIASES[key]
        if k in _CHOICES:
            if value not in _CHOICES[k]:
                raise LayoutError(f"--layout {key}={value}: choose one of {', '.join(_CHOICES[k])}")
            out[k] = value
        elif k == "recompute_modules":
            mods = tuple(m.strip() for m in value.split("+") if m.strip())
            bad = [m for m in mods if m not in RECOMPUTE_MODULES]
            if not mods or bad:
                raise LayoutError(f"--layout recompute_modules={value}: {', '.join(bad) or 'empty'} unknown. "
                                  f"Fix: '+'-separated names from {', '.join(RECOMPUTE_MODULES)}")
            out[k] = mods
        elif k in ("sp", "ep_fold"):
            if value.lower() not in ("true", "false", "1", "0"):
                raise LayoutError(f"--layout {key}={value}: write true or false")
            out[k] = value.lower() in ("true", "1")
        else:
            try:
                out[k] = int(value)
            except ValueError:
                raise LayoutError(f"--layout {key}={value}: expected a whole number") from None
            if out[k] <= 0 and k != "zero":
                raise LayoutError(f"--layout {key}={value}: must be positive")
            if k == "zero" and out[k] not in (0, 1, 2, 3):
                raise LayoutError(f"--layout zero={value}: use 0, 1, 2 or 3")
    if "recompute_modules" in out:
        if out.setdefault("ac", "selective") != "selective":
            raise LayoutError(f"--layout {text!r}: recompute_modules needs ac=selective, not ac={out['ac']}. "
                              "Fix: drop the ac key or write ac=selective")
    if "recompute_num_layers" in out:
        if out.setdefault("ac", "full") != "full":
            raise LayoutError(f"--layout {text!r}: recompute_num_layers needs ac=full, not ac={out['ac']}. "
                              "Fix: drop the ac key or write ac=full")
    return out
