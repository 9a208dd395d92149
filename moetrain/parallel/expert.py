"""Expert parallelism: experts split over the ``ep`` axis, tokens moved by all-to-all.

Shape legend: T local tokens, K top-k, D hidden, E global experts, El = E / ep experts per
rank, P = ep ranks, N rows (assignments) on one side of the exchange.

Dispatch, in phases (the combine runs them backwards):

1. permute — sort this rank's T·K assignments by global expert id (optionally dropping beyond
   a capacity); expert e lives on ep rank e // El, so the sorted rows are already grouped by
   destination rank;
2. exchange counts — all-to-all of the per-expert row counts (on the device), so each rank
   knows how many rows it receives from every source for each of its local experts; then the
   layer's one host read: the sent and received counts together, because the split sizes of the
   next all-to-all are host integers (as in Megatron-Core's all-to-all dispatcher);
3. all-to-all the rows with uneven split sizes (``all_to_all_single`` with autograd: the
   backward is the reverse all-to-all);
4. regroup — received rows arrive ordered (source, local expert); reorder them to
   (local expert, source) so each local expert's rows are contiguous for the grouped GEMM. The
   permutation is built on the device.

With ``moe.dispatch_dtype`` bf16 or fp8 the rows of phase 3 travel in that format (fp8: E4M3
values and power-of-two scales per 1 × 128 tile, :mod:`moetrain.model.fp8`) and are decoded on
arrival into the compute dtype; their gradients travel back in the compute dtype (DeepSeek-V3
§3.3.3 sends the dispatch in fp8 and the combine in bf16). The MoE layer already rounds the
tokens it routes to the wire's values (:func:`moetrain.model.fp8.round_trip`), so encoding them
again is exact: the dispatch adds no rounding that one process does not have.

Every transfer of rows (phase 3 and its reverse, both directions of autograd), routing weights
and the hierarchical dispatcher's expert ids goes through the :class:`~moetrain.parallel.exchange.Exchange`
the dispatcher is given; how a transfer waits (left in flight until its rows are needed, or in
turn with the partner micro-batch of a merged pair) is that object's, chosen by
:func:`moetrain.parallel.apply.build_model_parts`. The counts' exchange stays a plain synchronous
collective: its split sizes must reach the host before the rows go, and handing over there
would pair the partner's long piece with a transfer of a few bytes (measured slower:
docs/performance.md §5).

Gloo supports uneven ``all_to_all_single`` but not the list form (``all_to_all`` of tensor lists
of different sizes raises "invalid tensor size" on gloo, torch 2.13), so every exchange here uses
the single-tensor form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from moetrain.config import Config, field_error
from moetrain.model import fp8
from moetrain.model.moe import (DispatchHandle, ExpertGroups, LocalDispatcher, MoE, MoEParallel, expert_counts,
                                permute_by_expert, sort_by_expert, unpermute, weighted_sum)
from moetrain.parallel.exchange import Exchange
from moetrain.parallel.peers import waiting_on_peers
from moetrain.parallel.state import CP, CP_TP, EP, TP, ParallelState
from moetrain.ranges import COMBINE, DISPATCH, WAIT, phase
from moetrain.topology.mapper import ranks_per_domain


@dataclass
class AllToAllHandle:
    local: DispatchHandle  # undoes phase 1
    input_splits: list[int]  # rows sent to each ep rank
    output_splits: list[int]  # rows received from each ep rank
    regroup: torch.Tensor  # [N_recv] phase-4 permutation
    host_counts: list[int]  # rows received per local expert (the expert compute's split sizes)

    @property
    def kept(self) -> torch.Tensor | None:
        return self.local.kept

    @property
    def padding_rows(self) -> bool:
        return False  # padding never travels: the received rows are all real


class AllToAllDispatcher:
    """Dropless token dispatch over the ep group (see the module docstring for the phases);
    rows travel in ``wire`` (None: as computed) through ``exchange`` (bound to ``group``; a
    plain :class:`~moetrain.parallel.exchange.Exchange` when None)."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup, domains: list[int] | None = None,
                 wire: torch.dtype | None = None, exchange: Exchange | None = None):
        self.group, self.wire = group, wire
        self.exchange = exchange if exchange is not None else Exchange(group)
        self.ep = dist.get_world_size(group)
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep
        # Rows this rank's dispatches sent to ep ranks in its own NVLink domain and in others
        # (host counts, from the split sizes; read and reset by take_rows_sent).
        me = dist.get_rank(group)
        domains = domains or [0] * self.ep
        self._remote = [d != domains[me] for d in domains]
        self.rows_sent = [0, 0]  # [same domain, other domains], until take_rows_sent

    def take_rows_sent(self) -> tuple[int, int]:
        sent, self.rows_sent = self.rows_sent, [0, 0]
        return sent[0], sent[1]

    def start(self, x_TD: torch.Tensor, expert_idx_TK: torch.Tensor, capacity: int | torch.Tensor | None,
              padded: bool = False) -> tuple:
        """Phases 1-3; the rows' all-to-all may be left in flight (it is waited for in
        :meth:`finish`), so the caller can compute meanwhile. Padding assignments (id E) sort
        last and are not sent."""
        # 1. permute by global expert id; rows for ep rank r are contiguous.
        return self.send_sorted(*permute_by_expert(x_TD, expert_idx_TK, self.num_experts, capacity, padded))

    def send_sorted(self, x_sorted: torch.Tensor, counts_E: torch.Tensor, local: DispatchHandle) -> tuple:
        """Phases 2-3 for rows already sorted by expert: x_sorted [N', D] whose first N =
        sum(counts_E) rows are sent (the rest, padding, stay), counts_E [E] int64 on the device,
        ``local`` the handle that undoes the sort."""
        P, El = self.ep, self.num_local
        # 2. exchange counts: recv_counts[src, e] = rows src sends to my local expert e. Then the
        #    one host read of this layer: split sizes must be host integers.
        recv_counts = torch.empty_like(counts_E)
        with phase(DISPATCH + "_counts" + WAIT), waiting_on_peers():  # on GPU the read waits for the counts
            dist.all_to_all_single(recv_counts, counts_E, group=self.group)
            host = torch.cat([counts_E, recv_counts]).tolist()
        send_PE = [host[r * El:(r + 1) * El] for r in range(P)]
        recv_PE = [host[(P + r) * El:(P + r + 1) * El] for r in range(P)]
        input_splits = [sum(row) for row in send_PE]
        output_splits = [sum(row) for row in recv_PE]
        inter = sum(n for n, remote in zip(input_splits, self._remote) if remote)
        self.rows_sent[0] += sum(input_splits) - inter
        self.rows_sent[1] += inter
        host_counts = [sum(recv_PE[r][e] for r in range(P)) for e in range(El)]
        if x_sorted.shape[0] > sum(input_splits):  # padding rows, sorted last: they stay here
            x_sorted = x_sorted[:sum(input_splits)]
        # 3. rows to the ranks holding their experts (in flight until used).
        arrive = self.exchange(x_sorted, output_splits, input_splits, self.wire, name=DISPATCH)
        # The regroup permutation (phase 4) needs only the counts: build it while the rows travel.
        seg = torch.arange(P * El, device=x_sorted.device).repeat_interleave(recv_counts, output_size=sum(output_splits))
        src, e = seg // El, seg % El
        regroup = torch.argsort(e * P + src, stable=True)
        counts_El = recv_counts.view(P, El).sum(0)
        return arrive, counts_El, AllToAllHandle(local, input_splits, output_splits, regroup, host_counts)

    def finish(self, pending: tuple) -> tuple[torch.Tensor, torch.Tensor, AllToAllHandle]:
        """Phase 4: wait for the rows and regroup them (source, local expert) → (local expert,
        source)."""
        arrive, counts_El, handle = pending
        return arrive()[handle.regroup], counts_El, handle

    def combine_rows(self, y_ND: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        """The rows back to their source ranks, in assignment order: y_ND → [T·K, D] (zeros for
        assignments the capacity dropped)."""
        # 4'. back to (source, local expert) order.
        y_recv = torch.empty_like(y_ND).index_copy(0, handle.regroup, y_ND)
        # 3'. rows back to the ranks that sent them.
        y_sorted = self.exchange(y_recv, handle.input_splits, handle.output_splits, name=COMBINE)()
        # 1'. unpermute to assignment order.
        return unpermute(y_sorted, handle.local)

    def combine(self, y_ND: torch.Tensor, handle: AllToAllHandle, weights_TK: torch.Tensor) -> torch.Tensor:
        """Phases 5-6: :meth:`combine_rows`, then the weighted sum over k (fp32)."""
        return weighted_sum(self.combine_rows(y_ND, handle).view(*weights_TK.shape, -1), weights_TK)


@dataclass
class HierarchicalHandle:
    inner: AllToAllHandle  # the dispatch within the domain
    token_of_row: torch.Tensor  # [R_send] the source token of each row sent over the rail
    slot_mask: torch.Tensor  # [R_send, K] the row's slots whose expert lies in its domain
    input_splits: list[int]  # rows sent to each rail rank (domain)
    output_splits: list[int]  # rows received from each rail rank
    num_tokens: int  # T
    kept: torch.Tensor | None  # capacity mask of the T·K assignments (stats only)

    @property
    def host_counts(self) -> list[int]:
        return self.inner.host_counts

    @property
    def padding_rows(self) -> bool:
        return False  # padding never travels: the received rows are all real


class HierarchicalDispatcher:
    """Token dispatch that crosses the network once per token and destination node.

    The ep group's P ranks lie in N NVLink domains of m ranks each (from the rank map). Rank j
    of a domain talks across domains only to rank j of every other domain (its *rail* group,
    N ranks) and within its domain to the m ranks there (DeepSeek-V3 §3.2.2; DeepEP's
    inter-node mode):

    1. at the source, drop assignments beyond the capacity exactly as :func:`permute_by_expert`
       does (by position in (token, k) order, per expert), then send each token's row once to
       every domain that holds one of its experts — over the rail, so it lands on the rail peer
       there — with its K slots' expert ids (−1 for slots whose expert lies in another domain);
    2. that peer dispatches the received rows within its domain as :class:`AllToAllDispatcher`
       does, treating every valid slot as an assignment;
    3. the combine returns the expert outputs within the domain, weights them with the routing
       weights (sent over the rail in the combine) and sums them per row, so one row per token and
       domain goes back over the rail, where the source adds its domains' rows.

    With ``moe.max_nodes_per_token`` = M a token's row crosses the network at most M − 1 times
    (M if none of its experts is local) instead of once per remote expert. Two host reads per
    layer and micro-batch (the rail's counts, then the domain's), against one for the flat
    all-to-all. The sums differ from the flat dispatcher's only in order (fp32 rounding).
    """

    def __init__(self, num_experts: int, ep_group_ranks: list[int], domains: list[int], rail: dist.ProcessGroup,
                 domain: dist.ProcessGroup, device: torch.device, wire: torch.dtype | None = None,
                 make_exchange: Callable[..., Exchange] = Exchange):
        self.wire = wire
        # Deferred weight gradients (ep_overlap) are computed while the rail's transfers travel
        # (across nodes), not the domain's (short: they would show).
        self.exchange = make_exchange(rail)
        self.num_experts, self.num_local = num_experts, num_experts // len(ep_group_ranks)
        self.rail, self.domain = rail, domain
        domain_of = dict(zip(ep_group_ranks, domains))
        # My rail peer in each domain, as its rank in the rail group.
        rail_rank_of = {domain_of[r]: dist.get_group_rank(rail, r) for r in dist.get_process_group_ranks(rail)}
        mine = domain_of[dist.get_rank()]
        # Expert e lives on ep index e // El: its domain's index in my rail group and, for the
        # experts of my domain, its id among the domain group's experts.
        rail_of, local_of = [], []
        for e in range(num_experts):
            holder = ep_group_ranks[e // self.num_local]
            rail_of.append(rail_rank_of[domain_of[holder]])
            local_of.append(dist.get_group_rank(domain, holder) * self.num_local + e % self.num_local
                            if domain_of[holder] == mine else -1)
        self.rail_of_expert = torch.tensor(rail_of, dtype=torch.int64, device=device)
        self.num_rail = dist.get_world_size(rail)
        self.my_rail = dist.get_rank(rail)
        self.inner = AllToAllDispatcher(dist.get_world_size(domain) * self.num_local, domain, wire=wire,
                                        exchange=make_exchange(domain, flush_wgrad=False))
        # Domain-local id of expert e, for the rows this rank receives (experts of its domain).
        self.local_of_expert = torch.tensor(local_of, dtype=torch.int64, device=device)
        self.rows_sent = [0, 0]  # [within the domain, across domains], as AllToAllDispatcher

    def take_rows_sent(self) -> tuple[int, int]:
        sent, self.rows_sent = self.rows_sent, [0, 0]
        return sent[0], sent[1]

    def start(self, x_TD: torch.Tensor, expert_idx_TK: torch.Tensor, capacity: int | torch.Tensor | None,
              padded: bool = False) -> tuple:
        T, K = expert_idx_TK.shape
        N, dev = self.num_rail, x_TD.device
        # Padding assignments (id E) are not valid: a token of padding only is sent nowhere.
        valid_TK, kept = (expert_idx_TK < self.num_experts if padded
                          else torch.ones_like(expert_idx_TK, dtype=torch.bool)), None
        if capacity is not None:  # the same drops as permute_by_expert (never a padding one)
            order, _, kept = sort_by_expert(expert_idx_TK.reshape(-1), self.num_experts, capacity)
            valid_TK = torch.empty_like(kept).index_copy_(0, order, kept).view(T, K)
        # 1. one row per (destination domain, token), domain-major, tokens in order.
        dom_TK = self.rail_of_expert[expert_idx_TK.clamp(max=self.num_experts - 1) if padded else expert_idx_TK]
        need_NT = torch.zeros(N, T, dtype=torch.int64, device=dev)
        need_NT.index_put_((dom_TK.reshape(-1), torch.arange(T, device=dev).repeat_interleave(K)),
                           valid_TK.reshape(-1).to(torch.int64), accumulate=True)
        slots_N = need_NT.sum(1)
        need_NT = need_NT > 0
        send = torch.stack([need_NT.sum(1), slots_N], 1).reshape(-1)  # [N·2]: rows, valid slots
        recv = torch.empty_like(send)
        with phase(DISPATCH + "_counts" + WAIT), waiting_on_peers():  # on GPU the read waits for the counts
            dist.all_to_all_single(recv, send, group=self.rail)
            host = torch.cat([send, recv]).tolist()
        input_splits, output_splits = host[0:2 * N:2], host[2 * N::2]
        recv_slots = sum(host[2 * N + 1::2])
        R_send = sum(input_splits)
        rows = torch.argsort((~need_NT).reshape(-1).to(torch.int32), stable=True)[:R_send]
        dom_of_row, token_of_row = rows // T, rows % T
        slot_mask = (dom_TK[token_of_row] == dom_of_row.unsqueeze(1)) & valid_TK[token_of_row]
        ids_send = torch.where(slot_mask, expert_idx_TK[token_of_row], -1)  # global ids; -1: other domains
        inter = R_send - input_splits[self.my_rail]
        self.rows_sent[1] += inter
        arrive = self.exchange(x_TD[token_of_row], output_splits, input_splits, self.wire, name=DISPATCH)
        ids_recv = ids_send.new_empty(sum(output_splits), K)
        self.exchange.ids(ids_recv, ids_send, output_splits, input_splits, name=DISPATCH)
        # 2. within the domain: every valid slot of the received rows is an assignment.
        E_dom = self.inner.num_experts
        key = torch.where(ids_recv >= 0, self.local_of_expert[ids_recv.clamp(min=0)], E_dom).reshape(-1)
        order = torch.argsort(key, stable=True)[:recv_slots]
        counts = expert_counts(key, E_dom)  # key E_dom: another domain's slot
        local = DispatchHandle(order=order, num_assignments=key.numel(), kept=None)
        pending = self.inner.send_sorted(arrive()[order // K], counts, local)
        self.rows_sent[0] += sum(self.inner.take_rows_sent())
        return pending, HierarchicalHandle(pending[2], token_of_row, slot_mask, input_splits, output_splits, T, kept)

    def finish(self, pending: tuple) -> tuple[torch.Tensor, torch.Tensor, HierarchicalHandle]:
        inner_pending, handle = pending
        x_ND, counts_El, _ = self.inner.finish(inner_pending)
        return x_ND, counts_El, handle

    def combine(self, y_ND: torch.Tensor, handle: HierarchicalHandle, weights_TK: torch.Tensor) -> torch.Tensor:
        """y_ND [N, D] (rows grouped by local expert) and the routing weights [T, K] (fp32) →
        y_TD [T, D] = Σ_k weights·expert output, in y_ND's dtype (the weighted sums in fp32,
        phase 3 of the class docstring)."""
        K = weights_TK.shape[1]
        y_VD = self.inner.combine_rows(y_ND, handle.inner)  # [R_recv·K, D], zeros at other domains' slots
        w_send = torch.where(handle.slot_mask, weights_TK[handle.token_of_row], 0.0)
        w_recv = self.exchange(w_send, handle.output_splits, handle.input_splits, name=COMBINE)()
        y_RD = (y_VD.view(-1, K, y_VD.shape[-1]).float() * w_recv.unsqueeze(-1)).sum(1).to(y_ND.dtype)
        y_back = self.exchange(y_RD, handle.input_splits, handle.output_splits, name=COMBINE)()
        out = y_back.new_zeros(handle.num_tokens, y_back.shape[-1], dtype=torch.float32)
        return out.index_add(0, handle.token_of_row, y_back.float()).to(y_ND.dtype)


def hierarchical_groups(ps: ParallelState) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (rail, domain) groups inside its ep group, for :class:`HierarchicalDispatcher`:
    the domain group holds the ep ranks of its NVLink domain (``ps.domains``; all in one when
    None), the rail group the ranks at its position (in ep order) in every domain of the ep group.
    Every rank creates every group, in one order (``new_group`` is collective); cached on ``ps``.

    Raises:
        ConfigError: an ep group's domains hold different numbers of its ranks.
    """
    cached = ps.extra_groups.get("hierarchical")
    if cached is not None:
        return cached  # type: ignore[return-value]
    ep = ps.size(EP)
    ep_groups = ps.expert_mesh.mesh.reshape(-1, ep).tolist()  # [pp, edp, tp, ep]: ep innermost
    mine: dict[str, dist.ProcessGroup] = {}
    for group in ep_groups:
        doms = [ps.domains[r] if ps.domains is not None else 0 for r in group]
        by_domain = ranks_per_domain("moe.token_dispatcher", "hierarchical", group, doms,
                                     "use a layout whose ep groups span whole domains, or token_dispatcher: alltoall")
        rails = [list(col) for col in zip(*by_domain.values())]
        for kind, members in [("domain", v) for v in by_domain.values()] + [("rail", v) for v in rails]:
            pg = dist.new_group(members)
            if ps.rank in members:
                mine[kind] = pg
    ps.extra_groups["hierarchical"] = groups = (mine["rail"], mine["domain"])
    return groups


def apply_expert_parallel(moe_layers: dict[str, MoE], ps: ParallelState, cfg: Config,
                          make_exchange: Callable[..., Exchange] = Exchange) -> None:
    """Spread the MoE layers over the ranks: step 4 of
    :func:`moetrain.parallel.apply.build_model_parts`, on the meta-device model, after tensor
    parallelism. Each layer gets one :class:`~moetrain.model.moe.MoEParallel`:

    1. the experts' placement: with ep > 1 the stacked [E, ...] weights become DTensors Shard(0)
       over ep, so this rank computes El = E / ep of them (TorchTitan's expert parallelism), and
       with expert-tensor parallelism (``parallel.etp`` = tp) also Shard over tp along the ffn
       width F (:func:`_expert_tensor_parallel`);
    2. the dispatcher: :class:`AllToAllDispatcher` (``moe.token_dispatcher: alltoall``) or
       :class:`HierarchicalDispatcher` (``hierarchical``) over ep, else the local one, moving its
       rows through exchanges ``make_exchange(group[, flush_wgrad=False])`` makes (the caller
       chooses how transfers wait: :mod:`moetrain.parallel.exchange`);
    3. a sequence split over cp × tp ranks: :func:`sequence_split`, and under tp without etp
       the rank's piece of the sequence (``token_part``: its piece of the padding mask);
    4. node-limited routing (``moe.max_nodes_per_token``): :func:`node_limited_groups`.

    Raises:
        ConfigError: node-limited routing or the hierarchical dispatcher on ep groups whose NVLink
            domains hold unequal numbers of ranks, or too few experts per domain for top_k.
    """
    ep, etp = ps.size(EP), cfg.parallel.etp > 1
    ep_ranks = ps.group_ranks(EP)
    domains = [ps.domains[r] for r in ep_ranks] if ps.domains is not None else None
    rail_domain = hierarchical_groups(ps) if ep > 1 and cfg.moe.token_dispatcher == "hierarchical" else None
    split = sequence_split(ps)
    # Without expert-tensor parallelism each tp rank routes its own piece of the sequence (the tp
    # plan hands the layer Shard(1) of it): its piece of the real-token mask too.
    token_part = (ps.coord(TP), ps.size(TP)) if ps.size(TP) > 1 and not etp else None
    wire = fp8.dispatch_wire(cfg.moe.dispatch_dtype, cfg.train.precision)
    for moe in moe_layers.values():
        # Under EPLB the dispatch runs over the physical slots (moetrain.parallel.eplb).
        E = moe.experts.w1.shape[0]
        if ep > 1 or etp:
            mesh = ps.expert_mesh[(TP, EP)] if etp and ep > 1 else ps.expert_mesh[TP if etp else EP]
            for name, p in list(moe.experts.named_parameters()):
                # F of w1 / w3 [E, D, F] and of w2 [E, F, D] (expert biases are refused with etp).
                ffn = Shard(1 if name == "w2" else 2)
                placements = ([ffn] if etp else []) + ([Shard(0)] if ep > 1 else [])
                moe.experts.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, placements,
                                                                                  src_data_rank=None)))
        if etp:
            _expert_tensor_parallel(moe, ps)
        if rail_domain is not None:
            dispatcher = HierarchicalDispatcher(E, ep_ranks, domains or [0] * ep, *rail_domain, ps.device, wire,
                                                make_exchange)
        elif ep > 1:
            dispatcher = AllToAllDispatcher(E, ps.group(EP), domains, wire, make_exchange(ps.group(EP)))
        else:
            dispatcher = LocalDispatcher(E)
        groups, max_groups = (None, None)
        if cfg.moe.max_nodes_per_token is not None:
            groups, max_groups = node_limited_groups(moe, ps, cfg.moe.max_nodes_per_token)
        moe.parallel = MoEParallel(dispatcher, *split, expert_groups=groups, max_groups=max_groups,
                                   token_part=token_part)


def _expert_tensor_parallel(moe: MoE, ps: ParallelState) -> None:
    """Expert-tensor parallelism (``parallel.etp`` = tp): each expert's ffn width F split over the
    tp ranks — w1 / w3 [E, D, F/tp] by columns, w2 [E, F/tp, D] by rows, as a dense MLP under tp
    (Megatron-Core's expert-tensor-parallel group = the tp group here).

    Every tp rank routes the whole sequence (the tp plan gives the MoE a replicated input), sends
    the same rows to its ep peers (the ep group lies inside one tp coordinate), computes its
    columns of every expert, and the experts' output is summed over tp before the combine
    (:class:`moetrain.parallel.tensor.ReduceFromTP`; the input's gradient is summed over tp by
    :class:`moetrain.parallel.tensor.CopyToTP`), so routing, combine and losses see whole
    values."""
    from moetrain.parallel.tensor import CopyToTP, ReduceFromTP

    group = ps.group(TP)
    moe.experts.register_forward_pre_hook(lambda mod, args: (CopyToTP.apply(args[0], group), *args[1:]))
    moe.experts.register_forward_hook(lambda mod, args, out: ReduceFromTP.apply(out, group))


class _SumOverGroup:
    """All-reduce (sum) of a tensor over a group, without autograd: the per-sequence expert
    counts, which carry no gradient."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        out = counts.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out


def sequence_split(ps: ParallelState) -> tuple[int, _SumOverGroup | None, float, float]:
    """``(seq_ranks, sum_seq_counts, aux_scale, z_scale)`` of :class:`MoEParallel` that make the
    MoE losses of a sequence split over cp × tp ranks equal the single-process ones.

    The load-balancing loss of a sequence needs the sequence's expert counts: they are summed
    over ``cp_tp``; each rank's part (its tokens' router probabilities × the global counts)
    adds up to the whole. Gradients are averaged over cp (data-parallel reduction) but summed
    over tp (the tp ranks' parts are different tokens of the same sample: the router's gradient
    reduction runs over dp × cp × tp, divided by dp × cp), so the part is scaled by cp; the
    z-loss, a mean over tokens, is scaled by 1/tp for the same reason. With expert-tensor
    parallelism every tp rank routes the whole cp-local sequence: only cp splits it, and each tp
    rank's losses are already whole."""
    etp = ps.parallel.etp > 1
    axis = CP if etp else CP_TP
    if ps.size(axis) == 1:
        return 1, None, 1.0, 1.0
    return ps.size(axis), _SumOverGroup(ps.group(axis)), float(ps.size(CP)), 1.0 if etp else 1.0 / ps.size(TP)


def node_limited_groups(moe: MoE, ps: ParallelState, max_nodes: int) -> tuple[ExpertGroups | None, int | None]:
    """Node-limited routing (``moe.max_nodes_per_token``): group the experts by the NVLink domain
    (node) of the ep rank that holds them — from ``ps.domains``, the rank map's — so each token
    chooses among its ``max_nodes`` best groups only and its dispatch crosses the network to at
    most that many nodes. Returns (groups, max_nodes), or (None, None) when the ep group spans no
    more than ``max_nodes`` domains (nothing to limit).

    Raises:
        ConfigError: the domains hold unequal numbers of experts, or ``max_nodes`` domains hold
            fewer experts than ``moe.top_k``.
    """
    ep_ranks = ps.group_ranks(EP)
    domains = [ps.domains[r] if ps.domains is not None else 0 for r in ep_ranks]
    E = moe.num_experts
    per_rank = E // len(ep_ranks)
    try:
        groups = ExpertGroups.from_list([domains[e // per_rank] for e in range(E)], ps.device)
    except ValueError as e:
        raise field_error("moe.max_nodes_per_token", max_nodes, f"the ep group's NVLink domains hold "
                          f"different numbers of its ranks ({e})",
                          "use a layout whose ep groups span whole domains, or max_nodes_per_token=null") from None
    if groups.num_groups <= max_nodes:
        return None, None
    if max_nodes * (E // groups.num_groups) < moe.top_k:
        raise field_error("moe.max_nodes_per_token", max_nodes, f"{max_nodes} of {groups.num_groups} domains "
                          f"hold {max_nodes * (E // groups.num_groups)} experts, fewer than top_k={moe.top_k}",
                          f"raise max_nodes_per_token to at least {-(-moe.top_k // (E // groups.num_groups))}")
    return groups, max_nodes
