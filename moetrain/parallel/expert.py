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

Gloo supports uneven ``all_to_all_single`` but not the list form (../shared/FACTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from moetrain.config import field_error
from moetrain.model.moe import DispatchHandle, ExpertGroups, GroupedExperts, MoE, permute_by_expert, unpermute
from moetrain.parallel.peers import waiting_on_peers
from moetrain.parallel.state import CP, CP_TP, EP, TP, ParallelState


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


class AllToAllDispatcher:
    """Dropless token dispatch over the ep group (see the module docstring for the phases)."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup, domains: list[int] | None = None):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep
        # Rows this rank's dispatches sent to ep ranks in its own NVLink domain and in others
        # (host counts, from the split sizes; the trainer reads and resets them every step).
        me = dist.get_rank(group)
        domains = domains or [0] * self.ep
        self._remote = [d != domains[me] for d in domains]
        self.rows_sent = [0, 0]  # [same domain, other domains]

    def dispatch(self, x_TD: torch.Tensor, expert_idx_TK: torch.Tensor, capacity: int | None
                 ) -> tuple[torch.Tensor, torch.Tensor, AllToAllHandle]:
        """Phases 1-4: x_ND (received rows grouped by local expert), counts_El ([El] int64 on
        the device) and the handle for :meth:`combine`."""
        return self.finish(self.start(x_TD, expert_idx_TK, capacity))

    def start(self, x_TD: torch.Tensor, expert_idx_TK: torch.Tensor, capacity: int | None) -> tuple:
        """Phases 1-3; the rows' all-to-all is left in flight (a functional collective: it is
        waited for where its result is first used, in :meth:`finish`), so the caller can
        compute meanwhile."""
        P, El = self.ep, self.num_local
        # 1. permute by global expert id; rows for ep rank r are contiguous.
        x_sorted, counts_E, local = permute_by_expert(x_TD, expert_idx_TK, self.num_experts, capacity)
        # 2. exchange counts: recv_counts[src, e] = rows src sends to my local expert e. Then the
        #    one host read of this layer: split sizes must be host integers.
        recv_counts = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_counts, counts_E, group=self.group)
        with waiting_on_peers():  # on GPU the read waits for the counts' all-to-all
            host = torch.cat([counts_E, recv_counts]).tolist()
        send_PE = [host[r * El:(r + 1) * El] for r in range(P)]
        recv_PE = [host[(P + r) * El:(P + r + 1) * El] for r in range(P)]
        input_splits = [sum(row) for row in send_PE]
        output_splits = [sum(row) for row in recv_PE]
        inter = sum(n for n, remote in zip(input_splits, self._remote) if remote)
        self.rows_sent[0] += sum(input_splits) - inter
        self.rows_sent[1] += inter
        host_counts = [sum(recv_PE[r][e] for r in range(P)) for e in range(El)]
        # 3. rows to the ranks holding their experts (in flight until used).
        x_recv = all_to_all_single_autograd(x_sorted, output_splits, input_splits, self.group)
        # The regroup permutation (phase 4) needs only the counts: build it while the rows travel.
        seg = torch.arange(P * El, device=x_TD.device).repeat_interleave(recv_counts, output_size=sum(output_splits))
        src, e = seg // El, seg % El
        regroup = torch.argsort(e * P + src, stable=True)
        counts_El = recv_counts.view(P, El).sum(0)
        return x_recv, counts_El, AllToAllHandle(local, input_splits, output_splits, regroup, host_counts)

    def finish(self, pending: tuple) -> tuple[torch.Tensor, torch.Tensor, AllToAllHandle]:
        """Phase 4: wait for the rows and regroup them (source, local expert) → (local expert,
        source)."""
        x_recv, counts_El, handle = pending
        return x_recv[handle.regroup], counts_El, handle

    def combine(self, y_ND: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        # 4'. back to (source, local expert) order.
        y_recv = torch.empty_like(y_ND).index_copy(0, handle.regroup, y_ND)
        # 3'. rows back to the ranks that sent them.
        y_sorted = all_to_all_single_autograd(y_recv, handle.input_splits, handle.output_splits, self.group)
        # 1'. unpermute to assignment order.
        return unpermute(y_sorted, handle.local)


def apply_expert_parallel(moe_layers: dict[str, MoE], ps: ParallelState) -> None:
    """Keep only this rank's El = E / ep experts in every MoE layer and dispatch by all-to-all.

    Call on the meta-device model, before materialisation: the expert weights are re-created
    with the local shape [El, ...] and ``expert_offset = ep_rank · El`` so initialisation and
    checkpoints address them by global expert index.
    """
    ep, ep_rank, group = ps.size(EP), ps.coord(EP), ps.group(EP)
    for moe in moe_layers.values():
        old = moe.experts
        E = old.num_experts
        n_local = E // ep
        dim, hidden = old.w1.shape[1], old.w1.shape[2]
        with torch.device(old.w1.device):
            moe.experts = GroupedExperts(dim, hidden, n_local, expert_offset=ep_rank * n_local, num_experts=E)
        moe.dispatcher = AllToAllDispatcher(E, group, [ps.domains[r] for r in ps.group_ranks(EP)]
                                            if ps.domains is not None else None)


class _SumOverGroup:
    """All-reduce (sum) of a tensor over a group, without autograd: the per-sequence expert
    counts, which carry no gradient."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        out = counts.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out


def apply_expert_tensor_parallel(moe_layers: dict[str, MoE], ps: ParallelState) -> None:
    """Expert-tensor parallelism (``parallel.etp`` = tp): split each expert's ffn width F over the
    tp ranks — w1 / w3 [El, D, F/tp] by columns, w2 [El, F/tp, D] by rows, as a dense MLP under
    tp (Megatron-Core's expert-tensor-parallel group = the tp group here).

    Every tp rank routes the whole sequence (the tp plan gives the MoE a replicated input), sends
    the same rows to its ep peers (the ep group lies inside one tp coordinate), computes its
    columns of every expert, and the experts' output is summed over tp before the combine
    (:class:`moetrain.parallel.tensor.ReduceFromTP`; the input's gradient is summed over tp by
    :class:`moetrain.parallel.tensor.CopyToTP`), so routing, combine and losses see whole
    values. Call on the meta-device model after :func:`apply_expert_parallel`.
    """
    from moetrain.parallel.tensor import CopyToTP, ReduceFromTP

    tp, tp_rank, group = ps.size(TP), ps.coord(TP), ps.group(TP)
    for moe in moe_layers.values():
        old = moe.experts
        F = old.ffn_total
        with torch.device(old.w1.device):
            moe.experts = GroupedExperts(old.w1.shape[1], F // tp, old.num_local, old.expert_offset, old.num_experts,
                                         old.backend)
        moe.experts.ffn_total, moe.experts.ffn_offset = F, tp_rank * (F // tp)
        moe.experts.register_forward_pre_hook(
            lambda mod, args, group=group: (CopyToTP.apply(args[0], group), *args[1:]))
        moe.experts.register_forward_hook(lambda mod, args, out, group=group: ReduceFromTP.apply(out, group))


def configure_sequence_split(moe_layers: dict[str, MoE], ps: ParallelState) -> None:
    """Make the MoE losses of a sequence split over cp × tp ranks equal the single-process ones.

    The load-balancing loss of a sequence needs the sequence's expert counts: they are summed
    over ``cp_tp``; each rank's part (its tokens' router probabilities × the global counts)
    adds up to the whole. Gradients are averaged over cp (data-parallel reduction) but summed
    over tp (the tp ranks' parts are different tokens of the same sample), so the part is scaled
    by cp; the z-loss, a mean over tokens, is scaled by 1/tp for the same reason. Call it only
    when ``cp_tp`` has more than one rank. With expert-tensor parallelism every tp rank routes
    the whole cp-local sequence: only cp splits it, and each tp rank's losses are already whole.
    """
    etp = ps.parallel.etp > 1
    axis = CP if etp else CP_TP
    if ps.size(axis) == 1:
        return
    reducer = _SumOverGroup(ps.group(axis))
    for moe in moe_layers.values():
        moe.seq_count_reducer = reducer
        moe.seq_split_size = ps.size(axis)
        moe.seq_split_scale = float(ps.size(CP))
        moe.token_split_scale = 1.0 if etp else 1.0 / ps.size(TP)


def configure_node_limited(moe_layers: dict[str, MoE], ps: ParallelState, max_nodes: int) -> int:
    """Node-limited routing (``moe.max_nodes_per_token``): group the experts by the NVLink domain
    (node) of the ep rank that holds them — from ``ps.domains``, the rank map's — and let each
    token choose among its ``max_nodes`` best groups only, so its dispatch crosses the network to
    at most that many nodes. Returns the number of domains the ep group spans (with no more than
    ``max_nodes`` of them nothing is limited).

    Raises:
        ConfigError: the domains hold unequal numbers of experts, or ``max_nodes`` domains hold
            fewer experts than ``moe.top_k``.
    """
    ep_ranks = ps.group_ranks(EP)
    domains = [ps.domains[r] if ps.domains is not None else 0 for r in ep_ranks]
    for moe in moe_layers.values():
        E = moe.num_experts
        per_rank = E // len(ep_ranks)
        try:
            groups = ExpertGroups.from_list([domains[e // per_rank] for e in range(E)], ps.device)
        except ValueError as e:
            raise field_error("moe.max_nodes_per_token", max_nodes, f"the ep group's NVLink domains hold "
                              f"different numbers of its ranks ({e})",
                              "use a layout whose ep groups span whole domains, or max_nodes_per_token=null") from None
        if groups.num_groups <= max_nodes:
            moe.expert_groups, moe.max_groups = None, None
            continue
        if max_nodes * (E // groups.num_groups) < moe.top_k:
            raise field_error("moe.max_nodes_per_token", max_nodes, f"{max_nodes} of {groups.num_groups} domains "
                              f"hold {max_nodes * (E // groups.num_groups)} experts, fewer than top_k={moe.top_k}",
                              f"raise max_nodes_per_token to at least {-(-moe.top_k // (E // groups.num_groups))}")
        moe.expert_groups, moe.max_groups = groups, max_nodes
    return len(set(domains))
