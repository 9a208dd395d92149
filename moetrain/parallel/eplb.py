"""Expert placement by measured load during training (EPLB, ``moe.eplb``; DeepSeek-V3 §3.4
"redundant experts", DeepSeek's Expert Parallelism Load Balancer), with the mathematics of the
run without it.

Shape legend: E logical experts, R physical slots (E + redundant), P expert-parallel ranks,
S = R / P slots per rank, El = E / P experts per rank in logical ("home") order.

Each MoE layer's expert stacks hold R slots (:class:`~moetrain.model.moe.SlotMap`: the logical
expert of each), Shard(0) over ep as the experts are without EPLB, and under ZeRO sharded by FSDP
along dim 1 so that every rank keeps a piece of each of its ep rank's slots
(:func:`moetrain.parallel.data_parallel.apply_data_parallel`). Then:

* **dispatch** — the router chooses logical experts; each assignment goes to one replica of its
  expert: the one on its own rank when there is one, else one chosen by token position, on the
  device (:meth:`SlotMap.physical <moetrain.model.moe.SlotMap.physical>`); the dispatchers run
  over the R slots as they run over E experts;
* **one parameter** — the replicas of an expert are one parameter: after the backward their
  gradients are summed over the ep group (:meth:`ExpertPlacer.sum_replica_grads`, an all-reduce
  of the replicated experts' rows only), so every replica holds the one-process gradient and
  AdamW, elementwise, keeps them equal; the gradient norm counts each expert once (each slot's
  square weighted by 1 / its expert's replicas, :meth:`ExpertPlacer.norm_weights`);
* **re-placement** — every ``moe.eplb.every`` steps each layer's placement is recomputed from its
  tokens per expert over the last ``window`` steps (:func:`moetrain.topology.eplb.place_experts`,
  the nodes of the rank map respected) and the weights and AdamW's moments of the experts that
  change rank move there: one ``all_to_all_single`` per tensor within the ep group
  (:func:`move_slots`), whose bytes are counted;
* **checkpoints** — the stacks are saved in logical order, [E, ...] Shard(0) over ep as a run
  without EPLB saves them (:meth:`ExpertPlacer.to_logical`), and a load places them back
  (:meth:`ExpertPlacer.to_physical`): a checkpoint moves between runs with and without EPLB. The
  placement and the window of loads are the checkpoint's train state
  (:meth:`ExpertPlacer.state_dict`), so a resumed run places its slots as the saved run held them.

Every decision is made on host integers that are the same on every rank (the placement, from the
step's global loads), so the ranks agree without a collective; the data moves on the device. The
one exception is the memory check before a move (one small all-gather at a re-placement): a move
that some rank of the ep group has no memory for is skipped by all of them, naming the rank.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.config import Config
from moetrain.internals import local_shape_and_offset
from moetrain.model.moe import GroupedExperts, SlotMap
from moetrain.parallel.state import EP, ParallelState
from moetrain.topology.eplb import Placement, place_experts, rank_loads

__all__ = ["ExpertPlacer", "move_slots", "Replacement"]

STACKS = ("w1", "w3", "w2", "b1", "b3", "b2")


def move_plan(old: list[int], new: list[int], ranks: int) -> list[list[list[tuple[int, int]]]]:
    """Which rows move where when the slots ``old`` (logical expert of each, ranks in order,
    len(old) / ranks per rank) become ``new``: ``plan[p][q]`` lists (row on p in ``old``, row on q
    in ``new``) in the order of q's rows. Each new slot takes its expert from a slot of its own
    rank when one holds it (no transfer), else from the lowest-numbered old slot that does.

    Raises:
        ValueError: an expert of ``new`` is in no slot of ``old``, or a list does not split over
            the ranks.
    """
    if len(old) % ranks or len(new) % ranks:
        raise ValueError(f"{len(old)} and {len(new)} slots must split over {ranks} ranks")
    so, sn = len(old) // ranks, len(new) // ranks
    holders: dict[int, list[int]] = {}
    for slot, e in enumerate(old):
        holders.setdefault(e, []).append(slot)
    plan: list[list[list[tuple[int, int]]]] = [[[] for _ in range(ranks)] for _ in range(ranks)]
    for slot, e in enumerate(new):
        if e not in holders:
            raise ValueError(f"expert {e} of the new slots is in none of the old ones")
        q = slot // sn
        same = [o for o in holders[e] if o // so == q]
        src = same[0] if same else holders[e][0]
        plan[src // so][q].append((src % so, slot % sn))
    return plan


@torch.no_grad()
def move_slots(local: torch.Tensor, old: list[int], new: list[int], group: dist.ProcessGroup | None
               ) -> tuple[torch.Tensor, int]:
    """This rank's rows of a slot-stacked tensor placed as ``old`` → its rows placed as ``new``.

    ``local``: [len(old) / P, ...] (the rank's slots, any trailing piece: FSDP's or expert-tensor
    parallelism's); returns ([len(new) / P, ...], bytes this rank sent). One
    ``all_to_all_single`` over ``group`` (the ep group; every rank calls it, also with nothing to
    send); rows that stay on their rank are copied locally. ``group`` None: one rank.
    """
    ranks = dist.get_world_size(group) if group is not None else 1
    me = dist.get_rank(group) if group is not None else 0
    plan = move_plan(old, new, ranks)
    dev = local.device
    out = local.new_empty((len(new) // ranks, *local.shape[1:]))
    mine = plan[me][me]
    if mine:
        src = torch.tensor([r for r, _ in mine], device=dev)
        dst = torch.tensor([r for _, r in mine], device=dev)
        out.index_copy_(0, dst, local.index_select(0, src))
    if ranks == 1:
        return out, 0
    send_rows = [r for q in range(ranks) if q != me for r, _ in plan[me][q]]
    recv_rows = [r for p in range(ranks) if p != me for _, r in plan[p][me]]
    in_splits = [0 if q == me else len(plan[me][q]) for q in range(ranks)]
    out_splits = [0 if p == me else len(plan[p][me]) for p in range(ranks)]
    flat = local.reshape(local.shape[0], -1)
    send = flat.index_select(0, torch.tensor(send_rows, dtype=torch.int64, device=dev))
    recv = flat.new_empty((len(recv_rows), flat.shape[1]))
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    if recv_rows:
        out.view(out.shape[0], -1).index_copy_(0, torch.tensor(recv_rows, dtype=torch.int64, device=dev), recv)
    return out, send.numel() * send.element_size()


@dataclass
class Replacement:
    """One layer's re-placement: the experts that changed rank, the slots that moved between
    ranks, the bytes this rank sent, and each ep rank's share of the window's tokens before and
    after (a replicated expert's tokens split evenly: :func:`moetrain.topology.eplb.rank_loads`).
    ``skipped``: why the move did not happen (the placement stays), or None."""

    layer: str
    moved: list[int]
    slots_moved: int
    bytes_sent: int
    ranks_before: list[float]
    ranks_after: list[float]
    skipped: str | None = None
    seconds: float = 0.0  # the moves' host time (on CUDA their launch; the copies finish in the next step)

    @property
    def busiest_before(self) -> float:
        return _over_mean(self.ranks_before)

    @property
    def busiest_after(self) -> float:
        return _over_mean(self.ranks_after)

    def as_record(self) -> dict:
        return {"moved": self.moved, "slots_moved": self.slots_moved, "bytes_sent": self.bytes_sent,
                "seconds": self.seconds,
                "busiest_over_mean_before": self.busiest_before, "busiest_over_mean_after": self.busiest_after,
                "rank_tokens_before": self.ranks_before, "rank_tokens_after": self.ranks_after,
                **({"skipped": self.skipped} if self.skipped else {})}


def free_bytes(device: torch.device) -> int:
    """Bytes this rank can still allocate on ``device``: the CUDA allocator's free memory, or
    the host's available physical memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _over_mean(loads: list[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


class ExpertPlacer:
    """EPLB for the MoE layers of this rank's model parts (module docstring). Build after
    :func:`moetrain.parallel.apply.build_model_parts`; the trainer calls
    :meth:`sum_replica_grads` after each backward, :meth:`observe` with each step's loads,
    :meth:`maybe_replace` after each optimizer step, and the checkpointer :meth:`to_logical` and
    :meth:`state_dict` at a save, :meth:`load_state_dict` and :meth:`to_physical` at a load.
    """

    def __init__(self, parts: list[nn.Module], ps: ParallelState, cfg: Config):
        self.ps, self.cfg = ps, cfg
        self.every, self.window = cfg.moe.eplb.every, cfg.moe.eplb.window
        self.num_experts = cfg.moe.num_experts
        # Each local MoE layer's experts: by block index (the trainer's keys) and by the state
        # dict's prefix.
        self.layers: dict[str, GroupedExperts] = {}
        self.prefixes: dict[str, GroupedExperts] = {}
        for part in parts:
            for name, blk in part.blocks().items():
                if blk.moe is not None and blk.moe.experts.slot_map is not None:
                    self.layers[name] = blk.moe.experts
            for fqn, mod in part.named_modules():
                if isinstance(mod, GroupedExperts) and mod.slot_map is not None:
                    self.prefixes[f"{fqn}." if fqn else ""] = mod
        self.group = ps.group(EP) if ps.size(EP) > 1 else None
        self.ranks = ps.size(EP)
        self.me = dist.get_rank(self.group) if self.group is not None else 0
        domains = [ps.domains[r] for r in ps.group_ranks(EP)] if ps.domains is not None else [0] * self.ranks
        nodes = len(set(domains))
        slots = cfg.moe.num_slots
        even = all(domains.count(d) == self.ranks // nodes for d in set(domains))
        # Hierarchical placement over the nodes when the ep group spans whole nodes evenly.
        self.nodes = nodes if even and self.num_experts % nodes == 0 and slots % nodes == 0 else 1
        self.history: dict[str, deque[list[float]]] = {n: deque(maxlen=self.window) for n in self.layers}
        # Per layer, built at each placement so that a step copies nothing from the host:
        # (replicated experts, their local slots, the buffer rows of those slots, each local
        # slot's norm weight).
        self._rows: dict[str, tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for name, experts in self.layers.items():
            self._place(name, experts.slot_map.slots)

    def _place(self, name: str, slots: list[int]) -> None:
        """Layer ``name``'s slots hold ``slots`` from now on: its slot map (this rank's view) and
        the step's index tensors, built once per placement."""
        smap = SlotMap(slots, self.num_experts, self.ps.device, self.me, self.ranks)
        self.layers[name].slot_map = smap
        count = smap.replicas
        row_of = {e: i for i, e in enumerate(e for e, c in enumerate(count) if c > 1)}
        s = smap.num_slots // self.ranks
        local = smap.slots[self.me * s:(self.me + 1) * s]
        pairs = [(slot, row_of[e]) for slot, e in enumerate(local) if e in row_of]
        dev = self.ps.device
        self._rows[name] = (len(row_of), torch.tensor([a for a, _ in pairs], dtype=torch.int64, device=dev),
                            torch.tensor([b for _, b in pairs], dtype=torch.int64, device=dev),
                            torch.tensor([1.0 / count[e] for e in local], dtype=torch.float64, device=dev))

    # -- the step -----------------------------------------------------------------------------

    def _stacks(self, experts: GroupedExperts) -> list[tuple[str, nn.Parameter]]:
        return [(n, getattr(experts, n)) for n in STACKS if getattr(experts, n) is not None]

    @torch.no_grad()
    def sum_replica_grads(self) -> None:
        """Sum the gradients of each replicated expert's slots over the ep group and give every
        replica the sum (the expert's gradient as one process has it). One all-reduce per stack
        of the rows of the replicated experts; nothing when no expert has two slots."""
        for name, experts in self.layers.items():
            replicated, src, dst, _ = self._rows[name]
            if not replicated:
                continue
            for _, p in self._stacks(experts):
                if p.grad is None:
                    continue
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                buf = g.new_zeros((replicated, *g.shape[1:]))
                buf.index_add_(0, dst, g.index_select(0, src))
                if self.group is not None:
                    dist.all_reduce(buf, group=self.group)
                g.index_copy_(0, src, buf.index_select(0, dst))

    def norm_weights(self) -> dict[int, torch.Tensor]:
        """For :func:`moetrain.parallel.data_parallel.global_grad_norm`: each slot stack (by
        ``id``) → the weight of each of this rank's slots' squared gradient, 1 / the replicas of
        its expert ([S] float64 on the device), so each expert counts once."""
        return {id(p): self._rows[name][3] for name, experts in self.layers.items() for _, p in self._stacks(experts)}

    def observe(self, loads: dict[str, list[float]]) -> None:
        """Record a step's tokens per logical expert of each local MoE layer (global, host
        floats: the same on every rank)."""
        for name, row in loads.items():
            if name in self.history:
                self.history[name].append(list(row))

    def maybe_replace(self, step: int, optimizers: list[torch.optim.Optimizer]) -> list[Replacement]:
        """At every ``every``-th step: each layer's placement from its window of loads; the
        experts that change rank move with their AdamW moments. Returns what moved (layers whose
        placement stays are left out)."""
        if step % self.every or not self.layers:
            return []
        states = {id(p): st for opt in optimizers for p, st in opt.state.items()}
        done = []
        for name, experts in self.layers.items():
            if not self.history[name]:
                continue
            old = experts.slot_map.slots
            loads, placement, new = self._from_window(name)
            if new == old:
                continue
            s = len(old) // self.ranks
            moved = sorted({e for r in range(self.ranks) for e in set(new[r * s:(r + 1) * s])
                            - set(old[r * s:(r + 1) * s])})
            plan = move_plan(old, new, self.ranks)
            before = Placement(tuple(tuple(old[r * s:(r + 1) * s]) for r in range(self.ranks)))
            record = Replacement(name, moved, sum(len(plan[p][q]) for p in range(self.ranks)
                                                  for q in range(self.ranks) if p != q), 0,
                                 rank_loads(loads, before), rank_loads(loads, placement))
            tensors = [t for _, p in self._stacks(experts)
                       for t in [p, *(v for v in states.get(id(p), {}).values()
                                      if isinstance(v, torch.Tensor) and v.shape == p.shape)]]
            record.skipped = self._short_of_memory(tensors, plan)
            if record.skipped is None:
                t0 = time.perf_counter()
                for t in tensors:
                    record.bytes_sent += self._move_tensor(t, old, new)
                record.seconds = time.perf_counter() - t0
                self._place(name, new)
            done.append(record)
        return done

    def _from_window(self, name: str) -> tuple[list[float], Placement, list[int]]:
        """Layer ``name``'s tokens per expert summed over its window, the placement they give,
        and that placement as slots (:meth:`_keep_rows`)."""
        loads = [sum(col) for col in zip(*self.history[name])]
        old = self.layers[name].slot_map.slots
        placement = place_experts(loads, len(old), self.ranks, self.nodes)
        return loads, placement, self._keep_rows(old, placement)

    def _short_of_memory(self, tensors: list[torch.Tensor], plan: list[list[list[tuple[int, int]]]]) -> str | None:
        """Whether a move of ``tensors`` would not fit some rank of the ep group: each tensor
        moves in turn, needing a new copy of its rows plus its send and receive buffers; the
        ranks' needs and free memory are gathered (one small all-gather, at re-placements only),
        so every rank decides the same. Returns the reason naming the ranks and bytes, or None."""
        peak = 0
        for t in tensors:
            local = t.to_local() if isinstance(t, DTensor) else t
            row = local[0].numel() * local.element_size() if local.shape[0] else 0
            sent = sum(len(plan[self.me][q]) for q in range(self.ranks) if q != self.me)
            received = sum(len(plan[p][self.me]) for p in range(self.ranks) if p != self.me)
            peak = max(peak, local.numel() * local.element_size() + (sent + received) * row)
        mine = torch.tensor([float(peak), float(free_bytes(self.ps.device))], dtype=torch.float64,
                            device=self.ps.device)
        if self.group is None:
            table = [mine]
        else:
            table = [torch.empty_like(mine) for _ in range(self.ranks)]
            dist.all_gather(table, mine, group=self.group)
        needs = [t.tolist() for t in table]  # the re-placement's host read
        short = [(r, need, free) for r, (need, free) in enumerate(needs) if need > free]
        if not short:
            return None
        ranks = self.ps.group_ranks(EP)
        return "; ".join(f"rank {ranks[r]} needs {need / 2**20:.1f} MiB for the move and has {free / 2**20:.1f} MiB "
                         f"free" for r, need, free in short)

    def _keep_rows(self, old: list[int], placement: Placement) -> list[int]:
        """``placement``'s slots with each rank's experts in the rows they already hold where
        they stay on the rank (fewer local copies; the rows of a rank are interchangeable)."""
        s = len(old) // self.ranks
        out: list[int] = []
        for r, wanted in enumerate(placement.slots):
            rows: list[int | None] = [None] * s
            left = list(wanted)
            for i, e in enumerate(old[r * s:(r + 1) * s]):
                if e in left:
                    rows[i] = e
                    left.remove(e)
            out += [e if e is not None else left.pop(0) for e in rows]
        return out

    @torch.no_grad()
    def _move_tensor(self, t: torch.Tensor, old: list[int], new: list[int]) -> int:
        """Move ``t``'s rows (a stack, or an AdamW moment of one) in place; the bytes sent."""
        local = t.to_local() if isinstance(t, DTensor) else t
        moved, sent = move_slots(local, old, new, self.group)
        local.copy_(moved)
        return sent

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, dict]:
        """What a resumed run needs to go on as this one would (the train state of a checkpoint):
        each MoE layer's placement and its window of loads, by block index, ``{"ranks": P,
        "slots": [R] logical expert of each slot, "window": [[E] tokens per step]}`` — host
        lists, JSON-safe. Collective over the world: under pipeline parallelism each stage holds
        its own layers, so the layers of every rank are gathered (one small object all-gather, at
        checkpoints only)."""
        mine = {name: {"ranks": self.ranks, "slots": list(experts.slot_map.slots),
                       "window": [list(row) for row in self.history[name]]}
                for name, experts in self.layers.items()}
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine
        every: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return {name: layer for part in every for name, layer in (part or {}).items()}

    def load_state_dict(self, state: dict[str, dict] | None) -> list[str]:
        """Restore :meth:`state_dict` before a checkpoint's stacks are placed
        (:meth:`to_physical`, which places them as the slot maps then say): each layer's window,
        and its placement when the checkpoint's run had this run's ep size and slots; a layer
        whose run had another ep size (a re-planned layout) or other slots is placed from its
        window, or keeps the initial placement when the window is empty. ``None`` (a checkpoint
        of a run without EPLB, or of an older version) changes nothing. Returns the layers placed
        from their window."""
        replanned = []
        for name, experts in self.layers.items():
            saved = (state or {}).get(name)
            if saved is None:
                continue
            rows = [list(map(float, row)) for row in saved.get("window", []) if len(row) == self.num_experts]
            self.history[name] = deque(rows, maxlen=self.window)
            R = experts.slot_map.num_slots
            slots = [int(e) for e in saved.get("slots", [])]
            if saved.get("ranks") == self.ranks and len(slots) == R and set(slots) == set(range(self.num_experts)):
                new = slots
            elif rows:
                new = self._from_window(name)[2]
                replanned.append(name)
            else:
                continue
            self._place(name, new)
        return replanned

    def _home(self) -> list[int]:
        return list(range(self.num_experts))

    def _convert(self, value: torch.Tensor, old: list[int], new: list[int]) -> torch.Tensor:
        """``value`` (a stack's DTensor, or a plain tensor in one process) placed as ``old`` →
        a new tensor placed as ``new``, of global dim 0 len(new), with the same placements."""
        if not isinstance(value, DTensor):
            return move_slots(value.detach(), old, new, None)[0]
        local, _ = move_slots(value.to_local().detach(), old, new, self.group)
        shape = (len(new), *value.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=shape,
                                  stride=stride)

    def _entries(self, msd: dict, osd: dict) -> list[tuple[dict, str, GroupedExperts]]:
        out = []
        for prefix, experts in self.prefixes.items():
            for n in STACKS:
                if getattr(experts, n) is None:
                    continue
                key = f"{prefix}{n}"
                if key in msd:
                    out.append((msd, key, experts))
                for k in osd:
                    if k.startswith(f"state.{key}.") and isinstance(osd[k], torch.Tensor) and osd[k].dim() > 0:
                        out.append((osd, k, experts))
        return out

    def to_logical(self, msd: dict, osd: dict) -> None:
        """Replace the slot stacks of the model and optimizer state dicts (``get_state_dict``'s
        flattened form) by [E, ...] tensors in logical order, placed as the stacks are (in place;
        collective over the ep group)."""
        for d, key, experts in self._entries(msd, osd):
            d[key] = self._convert(d[key], experts.slot_map.slots, self._home())

    def logical_templates(self, msd: dict, osd: dict) -> dict[tuple[int, str], tuple[torch.Tensor, GroupedExperts]]:
        """Replace the slot stacks by empty [E, ...] tensors of the logical layout for a
        checkpoint to load into (in place); returns what :meth:`to_physical` needs."""
        taken = {}
        for d, key, experts in self._entries(msd, osd):
            value = d[key]
            taken[(id(d), key)] = (value, experts)
            shape = (self.num_experts, *value.shape[1:])
            if isinstance(value, DTensor):
                local_shape, _ = local_shape_and_offset(shape, value.device_mesh, value.placements)
                local = value.to_local().new_empty(local_shape)
                stride = torch.empty(shape, device="meta").stride()
                d[key] = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=shape,
                                            stride=stride)
            else:
                d[key] = value.new_empty(shape)
        return taken

    def to_physical(self, msd: dict, osd: dict,
                    taken: dict[tuple[int, str], tuple[torch.Tensor, GroupedExperts]]) -> None:
        """After a load into :meth:`logical_templates`' tensors: each stack back in this run's
        slots, as a tensor placed as the stack is (in place; collective over the ep group)."""
        for d in (msd, osd):
            for key in list(d):
                if (id(d), key) in taken:
                    _, experts = taken[(id(d), key)]
                    d[key] = self._convert(d[key], self._home(), experts.slot_map.slots)
