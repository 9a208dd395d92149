"""AdamW, Muon and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import torch
from torch import nn
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moetrain.config import TrainConfig
from moetrain.parallel.whole_matrix import WholeMatrices
from moetrain.planner.model import newton_schulz_flops


def lr_at(step: int, tc: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up over
    ``warmup_steps`` to ``lr``, then cosine decay to ``min_lr`` at ``decay_steps`` (default
    ``steps``), ``min_lr`` after it (SGDR, Loshchilov & Hutter 2017, without restarts)."""
    if tc.warmup_steps and step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    span = max(1, tc.resolved_decay_steps - tc.warmup_steps)
    progress = min(1.0, (step - tc.warmup_steps) / span)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * progress))


def uses_muon(name: str, p: nn.Parameter, adamw_patterns: tuple[str, ...]) -> bool:
    """Whether ``train.optimizer: muon`` trains parameter ``name`` with Muon: the 2-D hidden
    matrices and the routed experts' stacks (each expert's matrices separately), not the 1-D
    parameters nor the names matching ``adamw_patterns`` (``train.muon_adamw``: the embedding,
    output head, router and shared-expert gate by default; the Moonlight / Kimi K2 split)."""
    return p.ndim >= 2 and not any(fnmatch.fnmatchcase(name, pat) for pat in adamw_patterns)


def build_optimizer(model: nn.Module, tc: TrainConfig, group: dist.ProcessGroup | None = None
                    ) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019) with weight decay on matrices only (norm weights and
    other 1-D parameters are not decayed, as in GPT-3 / Megatron), on the fp32 master weights —
    or, with ``train.optimizer: muon``, :class:`Muon` for the hidden matrices
    (:func:`uses_muon`) and the same AdamW for the rest, in one optimizer. ``group``: the ranks
    of this pipeline stage, over which Muon spreads its matrices (None: one process).

    ``fused=True``: one kernel per parameter group, and its step counters live on the device —
    the foreach implementation keeps them on the host and reads each one per step."""
    muon = tc.optimizer == "muon"
    # Keyed by (muon?, decay?, DTensor?): the fused kernels refuse a group that mixes DTensor and
    # plain parameters (tensor parallelism shards the dense layers but leaves the MoE ones plain).
    groups: dict[tuple[bool, bool, bool], list[nn.Parameter]] = {}
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        groups.setdefault((muon and uses_muon(name, p, tc.muon_adamw), p.ndim >= 2, isinstance(p, DTensor)),
                          []).append(p)
    param_groups = [{"params": params, "weight_decay": tc.weight_decay if decay else 0.0, "muon": is_muon}
                    for (is_muon, decay, _), params in sorted(groups.items(),
                                                              key=lambda kv: (kv[0][0], not kv[0][1], kv[0][2]))]
    if muon:
        return Muon(param_groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.adam_eps, momentum=tc.muon_momentum,
                    group=group)
    for g in param_groups:
        del g["muon"]
    return torch.optim.AdamW(param_groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.adam_eps, fused=True)


# Newton–Schulz quintic iteration coefficients (Jordan et al. 2024, "Muon"; Moonlight §2.1).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to each matrix of ``g`` [..., m, n] (U·Vᵀ of its SVD,
    approximately: singular values pushed into about [0.7, 1.2]) by ``steps`` quintic
    Newton–Schulz iterations on X = g / ‖g‖_F, in bf16 on CUDA (as published) and in ``g``'s dtype
    elsewhere; returned in ``g``'s dtype. Cost per matrix:
    :func:`moetrain.planner.model.newton_schulz_flops`."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.bfloat16) if g.is_cuda else g
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return (x.mT if tall else x).to(g.dtype)


class Muon(torch.optim.AdamW):
    """Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025) for the parameter groups marked
    ``muon``, fused AdamW for the others, as one optimizer (one state dict, one checkpoint).

    A Muon matrix W [m, n] with gradient G: momentum M ← μ·M + G; Nesterov U = G + μ·M;
    W ← W·(1 − lr·wd) − lr · 0.2·√max(m, n) · NS(U), where NS is :func:`newton_schulz` and the
    0.2·√max(m, n) scale gives the update the RMS of AdamW's, so that AdamW's learning rate and
    weight decay carry over (Moonlight §2.2). A stack [E, m, n] of routed experts is E matrices.

    Every matrix is orthogonalized whole and once: the matrices of a sharded layout (FSDP2,
    tensor, expert and expert-tensor parallelism: DTensors) are spread over the ranks of the
    pipeline stage (``group``), each gathered to its owner, orthogonalized there and its blocks
    scattered back (:class:`moetrain.parallel.whole_matrix.WholeMatrices`; a routed expert its
    rank holds whole never moves). On CUDA the blocks travel in bf16, the dtype Newton–Schulz
    computes in. Building the plan is collective over ``group`` (one object all-gather).

    The step honours ``found_inf`` (``train.anomaly``): with it set to 1 no parameter or state
    changes.
    """

    takes_found_inf = True  # moetrain.train.anomaly.gated_step

    def __init__(self, param_groups: list[dict[str, Any]], lr: float, betas: tuple[float, float], eps: float,
                 momentum: float = 0.95, ns_steps: int = 5, group: dist.ProcessGroup | None = None):
        super().__init__(param_groups, lr=lr, betas=betas, eps=eps, fused=True)
        for g in self.param_groups:
            g.setdefault("muon", False)
            g.setdefault("momentum", momentum)
        self.ns_steps = ns_steps
        self.whole = WholeMatrices([p for g in self.param_groups if g["muon"] for p in g["params"]], group,
                                   cost=lambda m, n: newton_schulz_flops(m, n, ns_steps))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        found_inf = getattr(self, "found_inf", None)
        every = self.param_groups
        # AdamW's step walks self.param_groups: give it the AdamW groups only.
        self.param_groups = [g for g in every if not g["muon"]]
        try:
            super().step()
        finally:
            self.param_groups = every
        self._muon_step(found_inf)

    def _muon_step(self, found_inf: torch.Tensor | None) -> None:
        # Phases: 1. momentum and the Nesterov direction of each matrix, on this rank's blocks;
        # 2. Newton–Schulz of each whole matrix, once, on its owner; 3. the update.
        members = [(g, p) for g in self.param_groups if g["muon"] for p in g["params"]]
        if not members:
            return
        directions, buffers = [], []
        for g, p in members:
            grad = _local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
                # steps taken, kept as AdamW keeps its own (its state loading expects one per parameter)
                state["step"] = torch.zeros((), dtype=torch.float32,
                                            device=found_inf.device if found_inf is not None else grad.device)
            new_buf = _local(state["momentum_buffer"]) * g["momentum"] + grad
            buffers.append(new_buf)
            directions.append(grad + new_buf * g["momentum"])
        on_cuda = directions[0].is_cuda
        updates = self.whole.apply(directions, lambda u: newton_schulz(u, self.ns_steps),
                                   wire_dtype=torch.bfloat16 if on_cuda else None)
        keep = found_inf.to(torch.bool) if found_inf is not None else None
        for (g, p), new_buf, update in zip(members, buffers, updates):
            if p.grad is None:
                continue
            lr, wd = g["lr"], g["weight_decay"]
            m, n = p.shape[-2:]
            w, buf = _local(p), _local(self.state[p]["momentum_buffer"])
            new_w = w * (1 - lr * wd) - update * (lr * 0.2 * math.sqrt(max(m, n)))
            if keep is not None:  # a skipped step keeps both (a NaN gradient never enters)
                new_buf, new_w = torch.where(keep, buf, new_buf), torch.where(keep, w, new_w)
            buf.copy_(new_buf)
            w.copy_(new_w)
            self.state[p]["step"] += 1 if found_inf is None else 1 - found_inf


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``t`` (the tensor itself under no_grad, so in-place ops reach it)."""
    return t.to_local() if isinstance(t, DTensor) else t


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def schedule_fields(tc: TrainConfig) -> dict:
    """What decides :func:`lr_at` (kept in checkpoints, so that a resumed run can tell when its
    schedule changed)."""
    return {"lr": tc.lr, "min_lr": tc.min_lr, "warmup_steps": tc.warmup_steps, "decay_steps": tc.resolved_decay_steps}
