"""Planner terms for MoE and small models: expert GEMMs by tokens per expert, short-K GEMMs,
all-to-all volume (top-k, capacity, node-limited routing), all-to-all overlap, expert-tensor
parallelism, and the config fields read before they exist (precision, etp, max_nodes_per_token)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

from moetrain.config import load_config
from moetrain.planner.layout import Layout, parse_layout_spec
from moetrain.planner.memory import MemoryAssumptions, memory_per_gpu
from moetrain.planner.model import ModelShape
from moetrain.planner.published import fms_recomputed_layers, model_shape
from moetrain.planner.search import Planner
from moetrain.planner.timing import (
    K_REF,
    _Compute,
    TimingAssumptions,
    ep_exposed,
    gemm_pass_time,
    k_efficiency,
    step_time,
)
from moetrain.planner.traffic import (
    AxisPlace,
    a2a_network_share,
    ep_all_to_all,
    microbatch_buffers,
    step_collectives,
)
from moetrain.topology import load_profile

H100 = load_profile("h100-superpod")
RATE = H100.peak_tflops * 1e12 * H100.gemm_efficiency
HBM = H100.hbm_bandwidth()


def _moe(**kw) -> ModelShape:
    """A Mixtral-like MoE of 8 layers: d 4096, 64 experts of 1408, top-4."""
    arch = dict(layers=8, hidden=4096, heads=32, vocab=32000, seq_len=4096, kv_heads=8, ffn=14336, experts=64,
                top_k=4, expert_ffn=1408)
    arch.update(kw)
    return model_shape(arch.pop("layers"), arch.pop("hidden"), arch.pop("heads"), arch.pop("vocab"),
                       arch.pop("seq_len"), **arch)


def _places(**axes: AxisPlace) -> dict[str, AxisPlace]:
    none = AxisPlace(1, "none", 1)
    out = {a: none for a in ("tp", "cp", "pp", "dp_cp", "ep", "edp", "edp_tp")}
    out.update(axes)
    return out


# ---------------------------------------------------------------------------------------------
# GEMMs: short K, roofline, tokens per expert
# ---------------------------------------------------------------------------------------------


def test_k_efficiency_exact_and_monotonic():
    assert k_efficiency(K_REF, 640) == pytest.approx(1.0)
    assert k_efficiency(4 * K_REF, 640) == 1.0                       # never above 1
    assert k_efficiency(768, 640) == pytest.approx(768 / 1408 * (K_REF + 640) / K_REF)
    ks = [64, 128, 256, 512, 768, 1024, 2048, 4096]
    effs = [k_efficiency(k, 640) for k in ks]
    assert effs == sorted(effs) and effs[0] < 0.15
    assert k_efficiency(768, 1e-9) == pytest.approx(1.0)             # no short-K loss when k0 → 0


def test_gemm_pass_is_the_roofline_of_compute_and_memory():
    # a large square GEMM is compute-bound: FLOPs at rate × wave × k-efficiency (all 1 here)
    t = gemm_pass_time(8192, 8192, 8192, 1, RATE, HBM, 132, (128, 256), 640)
    flops = 2 * 8192 ** 3
    waves = math.ceil(64 * 32 / 132)
    assert t == pytest.approx(flops / (RATE * (64 * 32) / (waves * 132)))
    # one row per group: reading each group's weights dominates (memory-bound), by hand
    m, n, k, g = 1, 2816, 4096, 16
    t = gemm_pass_time(m, n, k, g, RATE, HBM, 132, (128, 256), 640)
    assert t == pytest.approx(g * 2 * (m * k + k * n + m * n) / HBM)


def test_expert_gemm_efficiency_grows_with_tokens_per_expert():
    """FLOP/s of one grouped expert GEMM (forward + backward) as the tokens per expert grow: rising,
    memory-bound at a few tokens (weights read for little work), near the large-GEMM rate at many."""
    from moetrain.planner.timing import _Compute

    shape = _moe()
    rates = []
    for tokens_per_expert in (16, 64, 256, 1024, 4096, 16384):
        c = _Compute(shape, Layout(ep=1), H100, TimingAssumptions(), 2)
        f, b = c.gemm(tokens_per_expert, 2 * 1408, 4096, count=8)
        rates.append(3 * 2 * tokens_per_expert * 2 * 1408 * 4096 * 8 / (f + b))
    assert rates == sorted(rates)
    assert rates[0] < 0.1 * RATE and rates[-1] > 0.85 * RATE


def test_more_experts_per_token_split_costs_more_time_at_equal_flops():
    """Same active FLOPs (top-k × width constant), finer experts: fewer tokens per expert, slower."""
    lay = Layout(tp=1, pp=1, dp=8, ep=8, mbs=1)
    places = _places(ep=AxisPlace(8, "nvlink", 8), dp_cp=AxisPlace(8, "nvlink", 8), edp_tp=AxisPlace(1, "none", 1))
    coarse = _moe(experts=8, top_k=2, expert_ffn=5632)
    fine = _moe(experts=256, top_k=8, expert_ffn=1408)
    assert coarse.model_flops_per_token() == pytest.approx(fine.model_flops_per_token(), rel=0.01)
    t_coarse = step_time(coarse, lay, 64, H100, places).breakdown["compute"]
    t_fine = step_time(fine, lay, 64, H100, places).breakdown["compute"]
    assert t_fine > 1.02 * t_coarse


def test_small_gemm_term_lowers_small_models_more_than_large_ones():
    """MFU with the short-K loss over MFU without it: smaller for a 768-wide model than a
    4096-wide one (the correction that keeps small models from being over-predicted)."""
    def mfu_ratio(hidden: int, heads: int) -> float:
        shape = model_shape(12, hidden, heads, 50368, 2048, ffn=4 * hidden, tie=True, mlp_matrices=2)
        lay = Layout(tp=1, pp=1, dp=8, zero=3, mbs=8)
        places = _places(dp_cp=AxisPlace(8, "nvlink", 8), edp_tp=AxisPlace(8, "nvlink", 8))
        with_k = step_time(shape, lay, 64, H100, places, ta=TimingAssumptions()).step
        without = step_time(shape, lay, 64, H100, places, ta=TimingAssumptions(gemm_k0=1e-9)).step
        return without / with_k

    small, large = mfu_ratio(768, 12), mfu_ratio(4096, 32)
    assert small < 0.93 and large > 0.98


# ---------------------------------------------------------------------------------------------
# All-to-all volume: top-k, capacity, node-limited routing
# ---------------------------------------------------------------------------------------------


def test_dispatch_buffer_is_tokens_times_topk_times_hidden():
    shape = _moe()
    lay = Layout(tp=2, pp=1, dp=8, ep=8, mbs=2, sp=True)
    sz = microbatch_buffers(shape, lay, act_bytes=2, moe_imbalance=1.0)
    tm = 2 * 4096 / 2                     # each tp rank routes half of the micro-batch's tokens
    assert sz["ep"] == pytest.approx(tm * 4 * 4096 * 2)
    assert sz["etp"] == 0.0
    assert microbatch_buffers(shape, lay, 2, 1.25)["ep"] == pytest.approx(1.25 * sz["ep"])


def test_capacity_factor_caps_the_busiest_rank():
    free = _moe()
    capped = dataclasses.replace(free, capacity_factor=1.1)
    assert free.expert_copies(1.5) == pytest.approx(4 * 1.5)
    assert capped.expert_copies(1.5) == pytest.approx(4 * 1.1)      # no expert above 1.1 × mean
    assert capped.expert_copies(1.0) == pytest.approx(4.0)          # a cap above the load changes nothing
    assert dataclasses.replace(free, capacity_factor=0.5).dispatched_copies() == pytest.approx(2.0)
    lay = Layout(tp=1, pp=1, dp=16, ep=16, mbs=1)
    places = _places(ep=AxisPlace(16, "spine", 8), dp_cp=AxisPlace(16, "spine", 8))
    ta = TimingAssumptions(moe_imbalance=1.5)
    ep_free = step_time(free, lay, 64, H100, places, ta=ta).breakdown["ep_comm"]
    ep_capped = step_time(capped, lay, 64, H100, places, ta=ta).breakdown["ep_comm"]
    assert ep_capped == pytest.approx(ep_free * 1.1 / 1.5, rel=0.02)


def test_node_limited_routing_reduces_network_bytes_exactly():
    # 64 ranks, 8 per node (8 nodes), top-8: without a limit 56/64 of every copy leaves the node
    net, nv = a2a_network_share(8, 64, 8, None)
    assert (net, nv) == (pytest.approx(56 / 64), pytest.approx(7 / 64))
    # M = 4 nodes (DeepSeek-V3): a token crosses the network 4 · 7/8 times for its 8 copies
    net4, nv4 = a2a_network_share(8, 64, 8, 4)
    assert net4 == pytest.approx(4 * 7 / 8 / 8)
    assert nv4 == pytest.approx(7 / 64 + 56 / 64 * 7 / 8)          # arrivals fan out over NVLink
    shares = [a2a_network_share(8, 64, 8, m)[0] for m in (1, 2, 4, 8, 16)]
    assert shares == sorted(shares) and shares[0] == pytest.approx(7 / 64)
    assert shares[-1] == pytest.approx(net)                          # M ≥ nodes: no saving, never more
    # top-2 over 8 nodes with M = 4: two copies never need more than two sends
    assert a2a_network_share(2, 64, 8, 4)[0] == pytest.approx(56 / 64)
    # all on NVLink: nothing to save
    assert a2a_network_share(8, 8, 8, 1) == (0.0, pytest.approx(7 / 8))
    with pytest.raises(ValueError):
        a2a_network_share(8, 64, 8, 0)


def test_node_limited_routing_shortens_the_exposed_all_to_all():
    shape = _moe(experts=64, top_k=8)
    limited = dataclasses.replace(shape, max_nodes_per_token=2, dispatch_dedup=True)
    place = AxisPlace(64, "spine", 8)
    t_plain, tiers_plain = ep_all_to_all(1e9, place, H100, 8.0)
    t_lim, tiers_lim = ep_all_to_all(1e9, place, H100, 8.0, max_nodes=2)
    assert tiers_lim["spine"] == pytest.approx(0.25 * tiers_plain["spine"])  # 2·7/8 sends instead of 8·7/8
    assert t_lim < 0.3 * t_plain
    lay = Layout(tp=1, pp=1, dp=64, ep=64, mbs=1)
    places = _places(ep=place, dp_cp=place)
    a = step_time(shape, lay, 64, H100, places).breakdown["ep_comm"]
    b = step_time(limited, lay, 64, H100, places).breakdown["ep_comm"]
    assert b < 0.5 * a
    vols = {v.op: v for v in step_collectives(limited, lay, 64, places, H100)}
    assert vols["all_to_all"].tier_bytes["spine"] == pytest.approx(0.25 * {v.op: v for v in step_collectives(
        shape, lay, 64, places, H100)}["all_to_all"].tier_bytes["spine"])
    # moetrain's own dispatcher sends every routed copy: the limit alone saves no bytes
    own = dataclasses.replace(shape, max_nodes_per_token=2)
    assert step_time(own, lay, 64, H100, places).breakdown["ep_comm"] == pytest.approx(a)


def test_gradient_reduction_does_not_hide_behind_all_to_alls_on_its_own_link():
    # dp = ep = 16 over 2 nodes of 8, a slow network. The gradient all-reduce (across the nodes)
    # hides behind a micro-batch's backward less its all-to-alls where they cross the same link:
    # with the ep groups inside a node (nvlink) that is nearly the whole backward; with them across
    # the nodes, the backward grows by its network all-to-alls (a2a_b) and the hidden part does not.
    shape = _moe(layers=4, hidden=1024, heads=8, kv_heads=8, ffn=4096, experts=16, top_k=2, expert_ffn=512,
                 seq_len=1024)
    lay = Layout(tp=1, pp=1, dp=16, ep=16, mbs=1)
    profile = dataclasses.replace(H100, rail_gb_s=0.05, spine_gb_s=0.05)
    net, node = AxisPlace(16, "rail", 8), AxisPlace(16, "nvlink", 8)
    inside = step_time(shape, lay, 16, profile, _places(dp_cp=net, edp_tp=net, ep=node))
    across = step_time(shape, lay, 16, profile, _places(dp_cp=net, edp_tp=net, ep=net))
    exposed_inside, exposed_across = inside.breakdown["dp_comm_exposed"], across.breakdown["dp_comm_exposed"]
    assert exposed_inside > 0  # the reduction outlasts the window, so the window's size shows
    a2a_b = across.t_b - inside.t_b  # the network all-to-alls less the nvlink ones, per backward
    assert a2a_b > 0.1 * across.t_b
    # Hidden behind them (a window of the whole backward), the exposed part would shrink by a2a_b.
    assert exposed_inside <= exposed_across <= exposed_inside + 0.05 * a2a_b


def test_fp8_dispatch_sends_the_forward_dispatch_in_a_bit_over_half_the_bytes():
    shape = _moe(experts=64, top_k=8)
    fp8 = dataclasses.replace(shape, dispatch_fp8=True)
    assert fp8.dispatch_ratio() == pytest.approx((4096 + 32) / (2 * 4096))  # int8 exponent per 128 values
    place = AxisPlace(64, "spine", 8)
    lay = Layout(tp=1, pp=1, dp=64, ep=64, mbs=1)
    places = _places(ep=place, dp_cp=place)
    plain = [v for v in step_collectives(shape, lay, 64, places, H100) if v.op == "all_to_all"]
    low = [v for v in step_collectives(fp8, lay, 64, places, H100) if v.op == "all_to_all"]
    total = sum(v.bytes_per_call * v.calls_per_step for v in plain)
    # 4 all-to-alls per layer and micro-batch, one of them (the forward's dispatch) in fp8
    assert sum(v.bytes_per_call * v.calls_per_step for v in low) == pytest.approx(
        total * (3 + fp8.dispatch_ratio()) / 4)
    a = step_time(shape, lay, 64, H100, places).breakdown["ep_comm"]
    b = step_time(fp8, lay, 64, H100, places).breakdown["ep_comm"]
    assert 0.7 * a < b < 0.9 * a
    cfg = load_config("configs/deepseek-v3-like.yaml", ["moe.dispatch_dtype=fp8"])
    assert ModelShape.from_config(cfg).dispatch_fp8
    assert not ModelShape.from_config(load_config("configs/deepseek-v3-like.yaml")).dispatch_fp8


def test_fp8_gemms_run_at_the_fp8_peak_after_their_casts():
    """train.precision: fp8 — the linears' and experts' GEMMs at H100's FP8 peak (2× bf16) on
    1-byte operands, plus the quantization of each GEMM's operands at HBM speed; the router and
    the head stay bf16; a profile without FP8 tensor cores refuses it."""
    shape = _moe(experts=64, top_k=8)
    fp8 = dataclasses.replace(shape, fp8_gemms=True)
    lay = Layout(tp=1, pp=1, dp=64, ep=64, mbs=1)
    place = AxisPlace(64, "spine", 8)
    places = _places(ep=place, dp_cp=place)
    a, b = step_time(shape, lay, 64, H100, places), step_time(fp8, lay, 64, H100, places)
    assert 0.5 * a.breakdown["compute"] < b.breakdown["compute"] < 0.8 * a.breakdown["compute"]
    assert b.breakdown["ep_comm"] == pytest.approx(a.breakdown["ep_comm"])  # the dispatch is its own setting
    # one large GEMM: half the compute time, plus 5 bytes per operand element at HBM speed
    c = _Compute(fp8, Layout(tp=1, pp=1, dp=1, mbs=1), H100, TimingAssumptions(), 2)
    m = n = k = 8192
    f16, _ = c.gemm(m, n, k, fp8=False)
    f8, _ = c.gemm(m, n, k)
    assert f8 == pytest.approx(f16 / 2 + 5.0 * (m * k + k * n) / H100.hbm_bandwidth(), rel=1e-4)  # 1978.9 vs 2 × 989.4
    cfg = load_config("configs/deepseek-v3-like.yaml", ["train.precision=fp8"])
    assert ModelShape.from_config(cfg).fp8_gemms and ModelShape.from_config(cfg).dispatch_fp8
    with pytest.raises(ValueError, match="fp8_peak_tflops"):
        step_time(fp8, lay, 64, load_profile("a100-superpod"), places)
    # published FP8 / MXFP8 rows compute their GEMMs in fp8; two H100 rows are held
    from moetrain.planner.published import PUBLISHED

    rows = [e for e in PUBLISHED if e.precision in ("fp8", "mxfp8")]
    assert len(rows) == 6 and all(e.shape.fp8_gemms for e in rows)
    assert sum(e.held for e in rows if e.profile == "h100-superpod") == 2


# ---------------------------------------------------------------------------------------------
# Overlap of the all-to-all with computation
# ---------------------------------------------------------------------------------------------


def test_ep_overlap_by_schedule():
    plain = Layout(pp=4, dp=8, ep=8, schedule="1f1b")
    inter = Layout(pp=4, dp=8, ep=8, vpp=2, schedule="interleaved_1f1b")
    flat = Layout(pp=1, dp=8, ep=8)
    args = (2.0, 3.0, 10.0, 20.0, 0.5, 1.0)                 # a2a f/b, compute f/b, shared f/b
    assert ep_exposed(*args, "none", flat, 8) == (2.0, 3.0, 0.0)
    assert ep_exposed(*args, "shared_expert", plain, 8) == (1.5, 2.0, 1.5)
    # combined 1F1B: nothing with plain 1F1B over stages, 7/8 of it with pp = 1 or virtual stages
    assert ep_exposed(*args, "combined_1f1b", plain, 8) == (2.0, 3.0, 0.0)
    for lay in (inter, flat):
        f, b, hidden = ep_exposed(*args, "combined_1f1b", lay, 8)
        assert (f, b, hidden) == (pytest.approx(2.0 / 8), pytest.approx(3.0 / 8), pytest.approx(5.0 * 7 / 8))
    # a long all-to-all hides only as much as the other direction computes
    assert ep_exposed(30.0, 30.0, 10.0, 20.0, 0.0, 0.0, "combined_1f1b", flat, 2)[:2] == (20.0, 25.0)
    with pytest.raises(ValueError, match="ep_overlap"):
        TimingAssumptions(ep_overlap="dualpipe")


def test_merged_pairs_hide_each_transfer_behind_the_partner_piece_in_flight_with_it():
    """parallel.ep_overlap's turns: the forward's dispatch under the backward's expert piece, its
    combine under the attention backward; the backward's combine gradient under the forward's
    attention, its dispatch gradient under the forward's experts. A transfer longer than its
    piece shows the rest; the profile's measured efficiency scales what is hidden."""
    from moetrain.planner.timing import merged_pair_hidden

    # transfers: dispatch f, combine f, combine b, dispatch b; pieces: attn f, moe f, attn b, moe b
    assert merged_pair_hidden(1.0, 1.0, 1.0, 1.0, 0.5, 0.25, 2.0, 3.0) == (2.0, 0.75)
    assert merged_pair_hidden(1.0, 4.0, 1.0, 1.0, 0.5, 0.25, 2.0, 3.0) == (3.0, 0.75)
    flat = Layout(pp=1, dp=8, ep=8)
    seg = (1.0, 1.0, 1.0, 1.0, 0.5, 0.25, 2.0, 3.0)
    full = ep_exposed(2.0, 2.0, 0.75, 5.0, 0.0, 0.0, "merged_pairs", flat, 4, seg)
    assert full == (pytest.approx(2.0 - 0.75 * 2.0), pytest.approx(2.0 - 0.75 * 0.75), pytest.approx(0.75 * 2.75))
    half = ep_exposed(2.0, 2.0, 0.75, 5.0, 0.0, 0.0, "merged_pairs", flat, 4, seg, efficiency=0.5)
    assert half[2] == pytest.approx(full[2] / 2)
    # delayed weight gradients: the backward's own weight GEMMs join the cover of its transfers
    # (the layer above's projections under the combine gradient, the experts' under the dispatch
    # gradient); the forward's transfers keep their pieces
    assert merged_pair_hidden(1.0, 1.0, 1.0, 1.0, 0.5, 0.25, 2.0, 3.0, 0.25, 0.5) == (2.0, 0.75 + 0.75)
    assert merged_pair_hidden(1.0, 1.0, 1.0, 1.0, 0.5, 0.25, 2.0, 3.0, 1.0, 1.0) == (2.0, 2.0)


def test_the_planner_counts_delayed_weight_gradients_only_where_moetrain_defers_them(tmp_path):
    """The step with ``delay_wgrad_compute`` hides more of the backward's all-to-all; under tp
    only the experts' weight gradients are deferred (tensor-parallel linears compute theirs at
    once), so the gain is smaller there."""
    from moetrain.planner.search import Planner
    from moetrain.planner.timing import TimingAssumptions
    from moetrain.topology.cluster import load_profile

    cfg = load_config("configs/deepseek-v3-like.yaml")
    prof = load_profile("h100-superpod")
    hidden = {}
    for lay in (Layout(tp=1, pp=1, dp=1024, ep=64, zero=2), Layout(tp=2, pp=1, dp=512, ep=64, zero=2)):
        for delay in (False, True):
            planner = Planner(ModelShape.from_config(cfg), prof, 128, 4096,
                              timing=TimingAssumptions(ep_overlap="merged_pairs", delay_wgrad=delay))
            hidden[lay.tp, delay] = planner.evaluate(lay).time.ep_hidden
    assert hidden[1, True] > hidden[1, False] and hidden[2, True] > hidden[2, False]
    assert hidden[1, True] / hidden[1, False] > hidden[2, True] / hidden[2, False]


def test_merged_pairs_hide_the_share_of_backwards_paired_on_the_first_pipeline_rank():
    """moetrain's ``parallel.ep_overlap``: at pp = 1 as combined 1F1B; with pp > 1 the share of
    the first pp rank's backwards that have a forward after them (its merged 1F1B order)."""
    from moetrain.parallel.pipeline import OVERLAP_F_B, merge_backward_with_next_forward, one_f_one_b_order
    from moetrain.planner.timing import merged_pair_share

    for pp in (2, 4):
        for m in (pp, 2 * pp, 16):
            pairs = sum(a.computation_type == OVERLAP_F_B
                        for a in merge_backward_with_next_forward(one_f_one_b_order(0, pp, m)))
            assert merged_pair_share(pp, 1, m) == pairs / m
    assert merged_pair_share(1, 1, 8) == 7 / 8 and merged_pair_share(4, 1, 4) == 0.0
    assert merged_pair_share(4, 2, 8) == (16 - (4 + 6) - 1) / 16  # (v-1)·m/round + 2(pp-1) warm-up
    args = (2.0, 3.0, 10.0, 20.0, 0.5, 1.0)
    flat, plain = Layout(pp=1, dp=8, ep=8), Layout(pp=4, dp=8, ep=8, schedule="1f1b")
    assert ep_exposed(*args, "merged_pairs", flat, 8) == ep_exposed(*args, "combined_1f1b", flat, 8)
    f, b, hidden = ep_exposed(*args, "merged_pairs", plain, 8)  # F0..F2, then 4 of 8 backwards paired
    assert (f, b, hidden) == (pytest.approx(2.0 / 2), pytest.approx(3.0 / 2), pytest.approx(5.0 / 2))


def test_overlap_shortens_the_step_only_where_the_schedule_allows():
    shape = _moe()
    places = _places(ep=AxisPlace(16, "spine", 8), dp_cp=AxisPlace(16, "spine", 8), pp=AxisPlace(2, "rail", 1))
    on = TimingAssumptions(ep_overlap="combined_1f1b")
    flat = Layout(pp=1, dp=32, ep=16, mbs=1)
    places_flat = dict(places, pp=AxisPlace(1, "none", 1))
    assert step_time(shape, flat, 64, H100, places_flat, ta=on).step < step_time(shape, flat, 64, H100,
                                                                                  places_flat).step
    plain = Layout(pp=2, dp=16, ep=16, mbs=1, schedule="1f1b")
    assert step_time(shape, plain, 64, H100, places, ta=on).step == pytest.approx(
        step_time(shape, plain, 64, H100, places).step)


# ---------------------------------------------------------------------------------------------
# Expert-tensor parallelism
# ---------------------------------------------------------------------------------------------


def test_etp_divides_expert_memory_and_keeps_sharded_states():
    shape = _moe()
    whole = Layout(tp=4, pp=1, dp=8, ep=4, zero=0, mbs=1, sp=True)
    split = dataclasses.replace(whole, etp=4)
    m_whole, m_split = memory_per_gpu(shape, whole, 32), memory_per_gpu(shape, split, 32)
    assert m_split.detail["expert_params"] == pytest.approx(m_whole.detail["expert_params"] / 4)
    assert whole.expert_shard == 8 and split.expert_shard == 2        # edp × tp vs edp
    # with ZeRO-1 the expert optimizer states per GPU are the same either way
    z1w, z1s = (memory_per_gpu(shape, dataclasses.replace(x, zero=1), 32) for x in (whole, split))
    assert (z1s.optimizer - 12 * z1s.detail["dense_params"] / 8) == pytest.approx(
        z1w.optimizer - 12 * z1w.detail["dense_params"] / 8)


def test_etp_adds_tp_collectives_and_fattens_the_expert_gemms():
    shape = _moe()
    whole = Layout(tp=4, pp=1, dp=8, ep=4, zero=1, mbs=1, sp=True)
    split = dataclasses.replace(whole, etp=4)
    places = _places(tp=AxisPlace(4, "nvlink", 4), ep=AxisPlace(4, "nvlink", 4), dp_cp=AxisPlace(8, "spine", 1),
                     edp=AxisPlace(2, "spine", 1), edp_tp=AxisPlace(8, "spine", 2))
    def what(lay: Layout) -> set[str]:
        return {v.what for v in step_collectives(shape, lay, 32, places, H100)}

    extra = what(split) - what(whole)
    assert any("expert-TP all-gather" in w for w in extra) and any("expert-TP reduce-scatter" in w for w in extra)
    axes = {v.axis for v in step_collectives(shape, split, 32, places, H100) if v.what.startswith("expert gradient")}
    assert axes == {"edp"}
    sz = microbatch_buffers(shape, split, 2, 1.0)
    assert sz["etp"] == pytest.approx(4 * sz["ep"])
    assert step_time(shape, split, 32, H100, places).breakdown["ep_comm"] > \
        step_time(shape, whole, 32, H100, places).breakdown["ep_comm"]


def test_search_and_layout_know_etp():
    cfg = load_config("configs/mixtral-8x7b.yaml")
    planner = Planner.from_config(cfg, H100, 8)
    etps = {lay.etp for lay in planner.enumerate({"tp": 2, "pp": 4, "ac": "full", "zero": 1})}
    assert etps == {1, 2}
    with pytest.raises(ValueError, match="etp = 4"):
        planner.evaluate(Layout(tp=2, pp=4, dp=8, ep=8, etp=4, mbs=1, sp=True))
    plan = planner.evaluate(Layout(tp=2, pp=4, dp=8, ep=8, etp=2, mbs=1, sp=True, ac="full"))
    assert "etp2" in plan.layout.short() and plan.to_dict()["etp"] == 2
    assert "parallel.etp=2" in plan.layout.overrides()
    assert parse_layout_spec("tp=4,etp=4") == {"tp": 4, "etp": 4}
    dense = Planner.from_config(load_config("configs/llama3-70b-like.yaml"), H100, 8)
    assert {lay.etp for lay in dense.enumerate({"tp": 8, "pp": 4, "ac": "full", "zero": 1})} == {1}


# ---------------------------------------------------------------------------------------------
# Config fields that other changes will add
# ---------------------------------------------------------------------------------------------


def test_memory_follows_train_precision():
    assert MemoryAssumptions.for_train(SimpleNamespace(precision="fp32")).act_bytes == 4
    assert MemoryAssumptions.for_train(SimpleNamespace(precision="bf16")) == MemoryAssumptions()
    assert MemoryAssumptions.for_precision("fp8") == MemoryAssumptions()  # fp32 masters, bf16 activations
    with pytest.raises(ValueError, match="precision"):
        MemoryAssumptions.for_precision("int4")
    cfg = load_config("configs/mixtral-8x7b.yaml", ["train.precision=fp32"])
    assert Planner.from_config(cfg, H100, 8).mem.param_bytes == 4


def test_config_fields_reach_the_planner():
    cfg = load_config("configs/mixtral-8x7b.yaml")
    assert ModelShape.from_config(cfg).max_nodes_per_token is None
    assert Layout.from_config(cfg).etp == 1
    limited = load_config("configs/mixtral-8x7b.yaml", ["moe.max_nodes_per_token=2"])
    assert ModelShape.from_config(limited).max_nodes_per_token == 2
    assert not ModelShape.from_config(limited).dispatch_dedup
    assert ModelShape.from_config(load_config("configs/mixtral-8x7b.yaml", ["moe.token_dispatcher=hierarchical"])
                                  ).dispatch_dedup
    # tp 2 with dp halved keeps the world (and the GPUs per node) of the config
    split = load_config("configs/mixtral-8x7b.yaml", ["parallel.tp=2", "parallel.etp=2",
                                                      f"parallel.dp={cfg.parallel.dp // 2}"])
    assert Layout.from_config(split).etp == 2

# ---------------------------------------------------------------------------------------------
# Per-module recomputation (Megatron-Core's --recompute-modules)
# ---------------------------------------------------------------------------------------------


def _kept(terms, ac="selective", modules=("core_attn",), tp=1, sp=False):
    from moetrain.planner.memory import layer_activation_bytes

    return layer_activation_bytes(terms, 1, tp, sp, ac, 1.0, modules)


def test_recompute_modules_drop_exactly_the_tensors_they_recompute():
    from moetrain.planner.memory import ActivationArch, activation_terms

    s = _moe(first_dense=1)
    h, f = s.hidden, s.ffn
    dense = activation_terms(ActivationArch.of(s))
    none = _kept(dense, ac="none")
    core = sum(b for _, b, kind in dense if kind == "core")
    assert none - _kept(dense) == core == 4.0 * s.heads            # the default: the fp32 log-sum-exp
    assert none - _kept(dense, modules=("layernorm",)) == 4.0 * h   # QKV input and MLP input, 2 bytes each
    assert none - _kept(dense, modules=("mlp",)) == 4.0 * f         # the fused SwiGLU's gate and up
    assert none - _kept(dense, modules=("mla_up_proj",)) == 2.0 * (s.h_q + s.h_kv) + 2.0 * s.h_kv + core
    assert _kept(dense, modules=("moe_act",)) == none              # already the planner's expert accounting
    # replicated norm outputs split over tp only with SP; modules combine
    assert _kept(dense, ac="none", tp=2) - _kept(dense, modules=("layernorm",), tp=2) == 4.0 * h
    assert _kept(dense, ac="none", tp=2, sp=True) - _kept(dense, modules=("layernorm",), tp=2, sp=True) == 2.0 * h
    both = _kept(dense, modules=("layernorm", "mlp"))
    assert none - both == 4.0 * h + 4.0 * f


def test_recompute_modules_cost_their_forward_again():
    s = _moe(first_dense=1, layers=4)
    prof = H100
    places = _places()

    def step(ac, mods=("core_attn",)):
        lay = Layout(ep=1, ac=ac, recompute_modules=mods)
        return step_time(s, lay, 8, prof, places)

    base = step("none")
    assert step("selective").breakdown["recompute"] == pytest.approx(8 * s.layers * _core_f(s))
    T, b = s.seq_len, 2
    norms = b * 2 * 2.0 * s.hidden * T / HBM
    act = b * T * 3.0 * s.expert_ffn * s.top_k * 1.1 / HBM        # the default moe_imbalance of 1.1
    assert step("selective", ("layernorm",)).breakdown["recompute"] == pytest.approx(8 * s.layers * norms)
    assert step("selective", ("moe_act",)).breakdown["recompute"] == pytest.approx(8 * s.moe_layers * act)
    mlp = step("selective", ("mlp",)).breakdown["recompute"]
    assert mlp > 0 and step("selective", ("mlp",)).step - base.step == pytest.approx(mlp)
    # hardware FLOPs: matmuls only
    assert s.recompute_flops_per_token("selective", ("layernorm", "moe_act")) == 0.0
    assert s.recompute_flops_per_token("selective", ("mlp",)) == s.dense_layers * 2.0 * s.mlp_params
    assert s.recompute_flops_per_token("selective", ("mla_up_proj",)) == pytest.approx(
        s.layers * (s.attention_flops() + 2.0 * (s.attn_params - s.attn_out_params)))
    assert s.recompute_flops_per_token("selective") == s.layers * s.attention_flops()


def test_recompute_num_layers_recomputes_that_share_of_the_layers():
    # Megatron-Core's --recompute-method block --recompute-num-layers k: k of each virtual
    # stage's layers recomputed whole, the others keep all their activations.
    s = model_shape(8, 1024, 8, 32000, 2048, ffn=4096)  # dense, 8 layers
    places = _places()

    def both(**kw):
        lay = Layout(**kw)
        return step_time(s, lay, 8, H100, places), memory_per_gpu(s, lay, 8).activations

    (none, a_none), (full, a_full) = both(ac="none"), both(ac="full")
    all8, a_all8 = both(ac="full", recompute_num_layers=8)
    assert all8.step == full.step and all8.executed_flops == full.executed_flops and a_all8 == a_full
    part, a_part = both(ac="full", recompute_num_layers=2)
    rec_full = full.breakdown["recompute"]
    assert rec_full > 0 and part.breakdown["recompute"] == pytest.approx(rec_full * 2 / 8, rel=1e-12)
    assert part.executed_flops - none.executed_flops == pytest.approx(
        (full.executed_flops - none.executed_flops) * 2 / 8, rel=1e-12)
    # activations: 2 layers keep their input, 6 keep everything, plus one layer recomputed at a time
    layer_none = (a_none - memory_per_gpu(dataclasses.replace(s, layers=4), Layout(ac="none"), 8).activations) / 4
    layer_full_kept = (a_full - memory_per_gpu(dataclasses.replace(s, layers=4), Layout(ac="full"), 8).activations) / 4
    assert a_full < a_part < a_none
    assert a_part == pytest.approx(a_none - 2 * (layer_none - layer_full_kept) + layer_none, rel=1e-9)
    # a pipeline of 2 stages × 2 virtual stages: 1 of each chunk's 2 layers, half of them
    lay = Layout(pp=2, vpp=2, dp=1, ac="full", recompute_num_layers=1, schedule="interleaved_1f1b")
    lay_full = dataclasses.replace(lay, recompute_num_layers=None)
    assert lay.full_recompute_share(2) == 0.5 and lay.full_recompute_share(1) == 1.0
    pl = _places(pp=AxisPlace(2, "nvlink", 2))
    assert step_time(s, lay, 8, H100, pl).breakdown["recompute"] == pytest.approx(
        step_time(s, lay_full, 8, H100, pl).breakdown["recompute"] / 2, rel=1e-12)


def test_recompute_num_layers_in_layout_specs_and_the_planner():
    assert parse_layout_spec("recompute_num_layers=8") == {"recompute_num_layers": 8, "ac": "full"}
    with pytest.raises(ValueError, match="needs ac=full"):
        parse_layout_spec("ac=selective,recompute_num_layers=8")
    lay = Layout(ac="full", recompute_num_layers=8)
    assert "ac=full(8/stage)" in lay.short() and not lay.runs_in_moetrain
    assert lay.to_dict()["recompute_num_layers"] == 8
    with pytest.raises(ValueError, match="recomputes every layer"):
        lay.overrides()
    s = model_shape(8, 1024, 8, 32000, 2048, ffn=4096)
    planner = Planner(s, H100, 1, 64)
    assert "needs ac = full" in planner.check(Layout(dp=8, ac="none", recompute_num_layers=2))
    best = planner.search({"tp": 1, "pp": 1, "ac": "full", "recompute_num_layers": 2}, top=1).ranked[0]
    assert best.layout.recompute_num_layers == 2 and best.to_dict()["recompute_num_layers"] == 2


def test_fms_recomputed_share_comes_from_its_hfu_over_mfu():
    # HFU / MFU = 1 + p/3 for a share p of the blocks recomputed whole (fms-fsdp README)
    assert fms_recomputed_layers("13b", "a100") == round(3 * (0.69 / 0.61 - 1) * 40) == 16
    assert fms_recomputed_layers("13b", "h100") == 8
    assert fms_recomputed_layers("34b", "a100") is None       # 0.74 / 0.55: every block
    with pytest.raises(KeyError):
        fms_recomputed_layers("7b", "a100")                    # HFU = MFU: nothing recomputed


def _core_f(s):
    return s.seq_len * s.attention_flops(causal=True) / (H100.peak_tflops * 1e12 * H100.attention_efficiency)


def test_recompute_modules_in_layout_specs():
    spec = parse_layout_spec("tp=2,recompute_modules=layernorm+moe_act")
    assert spec == {"tp": 2, "ac": "selective", "recompute_modules": ("layernorm", "moe_act")}
    with pytest.raises(ValueError, match="needs ac=selective"):
        parse_layout_spec("ac=full,recompute_modules=layernorm")
    with pytest.raises(ValueError, match="bogus unknown"):
        parse_layout_spec("recompute_modules=layernorm+bogus")
    lay = Layout(ac="selective", recompute_modules=("layernorm", "moe_act"))
    assert "ac=selective(layernorm+moe_act)" in lay.short() and not lay.runs_in_moetrain
    with pytest.raises(ValueError, match="recomputes core_attn only"):
        lay.overrides()
    assert "parallel.activation_checkpointing=selective" in Layout(ac="selective").overrides()


def test_deepseek_v3_memory_against_nvidia_moe_report():
    """NVIDIA 2026 (Megatron-Core MoE report), Table 3: DeepSeek-V3 in BF16 on PP4 × VPP4 × EP64
    (256 GPUs): activations 131.0 GB of 199.5 GB per GPU; Table 4: recomputing the norms saves
    8.2 GB. The planner's memory model, set before these were read, comes within 20 % (in GB of
    10⁹ bytes; within 10 % in GiB), MLA's latents counted. Recomputing MLA's up-projections saves
    41.0 GB there against the report's 30.4 GB (docs/topology.md §5): the planner drops the
    up-projected Q, K and V that the attention kernel keeps."""
    from moetrain.planner.published import PUBLISHED

    shape = next(e.shape for e in PUBLISHED if e.key == "deepseek-v3-gb200-25.11")
    lay = Layout(pp=4, vpp=4, dp=64, ep=64, zero=1, mbs=1, schedule="interleaved_1f1b")
    none = memory_per_gpu(shape, lay, 4096)
    norms = memory_per_gpu(shape, dataclasses.replace(lay, ac="selective", recompute_modules=("layernorm",)), 4096)
    assert none.total / 1e9 == pytest.approx(199.5, rel=0.2)
    assert none.activations / 1e9 == pytest.approx(131.0, rel=0.2)
    assert (none.activations - norms.activations) / 1e9 == pytest.approx(8.2, rel=0.2)
    up = memory_per_gpu(shape, dataclasses.replace(lay, ac="selective", recompute_modules=("mla_up_proj",)), 4096)
    assert (none.activations - up.activations) / 1e9 == pytest.approx(41.0, rel=0.01)


def test_published_layout_is_timed_as_stated_even_where_memory_disagrees():
    from moetrain.planner.published import PUBLISHED, predict

    row = predict(next(e for e in PUBLISHED if e.key == "deepseek-v3-gb200-mcore0.16"))
    assert "ac=selective(mlp)" in row["layout"] and "pp8x4" in row["layout"]
    assert row["fits"] is False and row["memory_gib"] > row["capacity_gib"] and row["error"] is not None
    stated = predict(next(e for e in PUBLISHED if e.key == "qwen3-235b-gb200-25.11"))
    assert "ac=none" in stated["layout"] and stated["fits"]


# ---------------------------------------------------------------------------------------------
# De-duplicating dispatch without a node limit; EP folded over TP (Megatron-Core parallel folding)
# ---------------------------------------------------------------------------------------------


def test_dedup_without_a_limit_is_the_expected_remote_domains():
    from moetrain.planner.traffic import remote_domains

    # 2 domains, 8 experts of which 4 per domain, top-2: 1 − C(4,2)/C(8,2) = 22/28 remote sends
    assert remote_domains(2, 8, 2) == pytest.approx(22 / 28)
    assert remote_domains(1, 8, 2) == 0.0 and remote_domains(4, 128, 8) < 3.0
    assert [remote_domains(4, 128, k) for k in (1, 2, 4, 8)] == sorted(remote_domains(4, 128, k) for k in (1, 2, 4, 8))
    # the demo on the dev SLURM cluster (8 experts, top-2, ep 4 over 2 nodes): the hierarchical
    # dispatcher put 0.775 of the flat all-to-all's bytes on the network (README,
    # benchmarks/bench_node_limited.py); the expectation under balanced routing is 0.786
    flat = a2a_network_share(2, 4, 2, None)[0]
    dedup = a2a_network_share(2, 4, 2, None, (8, 2))[0]
    assert dedup / flat == pytest.approx(0.775, abs=0.02)
    shape = _moe(dispatch_dedup=True)
    assert shape.dedup_args() == (None, (64, 4))
    assert dataclasses.replace(shape, max_nodes_per_token=2).dedup_args() == (2, None)
    assert _moe().dedup_args() == (None, None)


def test_ep_folded_over_tp():
    s = _moe(layers=8)
    lay = Layout(tp=2, dp=16, ep=32, sp=True, ep_fold=True)
    assert lay.edp == 1 and lay.expert_shard == 1 and not lay.runs_in_moetrain and "ep32(tp×dp)" in lay.short()
    with pytest.raises(ValueError, match="ep_fold"):
        lay.overrides()
    assert parse_layout_spec("tp=2,ep=32,ep_fold=true")["ep_fold"] is True
    planner = Planner(s, H100, 4, 64)
    assert planner.check(lay) is None
    assert "ep_fold" in planner.check(dataclasses.replace(lay, tp=1, dp=32))
    assert "ep_fold" in planner.check(dataclasses.replace(lay, ep=8, dp=16, tp=2, etp=2))
    places, _ = planner.places(lay)
    assert places["ep"].size == 32 and places["ep"].per_domain == 8 and places["ep"].tier != "nvlink"
    # the same experts per rank as unfolded ep 32 would give, half of ep 16's
    fold = memory_per_gpu(s, lay, 64)
    flat16 = memory_per_gpu(s, Layout(tp=2, dp=16, ep=16, sp=True), 64)
    assert fold.detail["expert_params"] * 2 == pytest.approx(flat16.detail["expert_params"])
    # the search keeps ep a multiple of tp dividing dp × cp when folding is asked for
    eps = {p.layout.ep for p in planner.search({"tp": 2, "ep_fold": True, "pp": 1}, top=50).ranked}
    assert eps and eps <= {2, 4, 8, 16, 32}   # e = 2·e' with e' | 16


# ---------------------------------------------------------------------------------------------
# The architectures of 2025-26 from moetrain configs: MLA, MTP, sliding windows
# ---------------------------------------------------------------------------------------------


def test_deepseek_v3_config_is_deepseek_v3s_shape():
    """configs/deepseek-v3-like.yaml: MLA's projections (DeepSeek-V2 §2.1: 187.1M per layer), the
    671B / 37B parameters of the report, the MTP module (a block, W of 2h × h, three norms)."""
    cfg = load_config("configs/deepseek-v3-like.yaml")
    s = ModelShape.from_config(cfg)
    h, a = 7168, 128
    mla = h * 1536 + 1536 * a * 192 + h * (512 + 64) + 512 * a * (128 + 128) + a * 128 * h
    assert s.is_mla and s.attn_params == mla == 187_105_280
    assert s.up_proj_params == 1536 * a * 192 + 512 * a * 256
    assert s.mla_latent_width == 1536 + 512 + 64
    assert (s.h_q, s.h_v) == (a * 192, a * 128)
    main = s.total_params - sum(s.mtp_params())
    assert main / 1e9 == pytest.approx(671.0, abs=0.5)
    moe_dense, moe_experts = s.layer_params(True)
    assert s.mtp_params() == (moe_dense + 2 * h * h + 3 * h, moe_experts)
    assert s.active_params / 1e9 == pytest.approx(37.5 + (moe_dense + moe_experts * 8 / 256 + 2 * h * h) / 1e9,
                                                  rel=0.01)
    # the MTP module's FLOPs: its block with full attention, W and the head again
    no_mtp = dataclasses.replace(s, mtp_depth=0)
    attn = 2.0 * s.seq_len * (s.h_q + s.h_v)
    per = s.layer_matmul_flops(True) + attn + 2.0 * 2 * h * h + 2.0 * h * s.vocab
    assert s.model_flops_per_token() - no_mtp.model_flops_per_token() == pytest.approx(3 * per)


def test_mla_up_projection_recomputation_is_the_up_projections():
    """``mla_up_proj`` runs the up-projections and the core again — not the compressions — and
    drops Q, K, V and the core's tensors while keeping the latents."""
    from moetrain.planner.memory import ActivationArch, attention_terms

    s = ModelShape.from_config(load_config("configs/deepseek-v3-like.yaml"))
    assert s.recompute_flops_per_token("selective", ("mla_up_proj",)) == pytest.approx(
        s.layers * (s.attention_flops() + 2.0 * s.up_proj_params))
    terms = attention_terms(ActivationArch.of(s))
    assert dict((n, b) for n, b, _ in terms)["MLA latents"] == 2.0 * (2 * 1536 + 2 * 512 + 64)
    none = _kept(terms, ac="none")
    core = sum(b for _, b, kind in terms if kind == "core")
    assert none - _kept(terms, modules=("mla_up_proj",)) == 2.0 * 128 * (192 + 192) + 2.0 * 128 * 128 + core
    lay = Layout(ep=8, dp=8, ac="selective", recompute_modules=("mla_up_proj",))
    t = step_time(s, lay, 64, H100, _places())
    base = step_time(s, dataclasses.replace(lay, ac="none", recompute_modules=("core_attn",)), 64, H100, _places())
    assert t.breakdown["recompute"] > 0 and t.step > base.step


def test_mtp_lives_on_the_last_stage():
    s = ModelShape.from_config(load_config("configs/deepseek-v3-like.yaml"))
    no_mtp = dataclasses.replace(s, mtp_depth=0)
    lay = Layout(pp=1, dp=8, ep=8, mbs=1)
    with_m, without = memory_per_gpu(s, lay, 64), memory_per_gpu(no_mtp, lay, 64)
    dense, experts = s.mtp_params()
    assert with_m.detail["dense_params"] - without.detail["dense_params"] == dense
    assert with_m.detail["expert_params"] - without.detail["expert_params"] == experts / 8
    assert with_m.activations > without.activations
    t_with, t_without = step_time(s, lay, 64, H100, _places()), step_time(no_mtp, lay, 64, H100, _places())
    assert t_with.step > t_without.step


def test_sliding_windows_are_read_from_the_config():
    cfg = load_config("configs/finetune-gpt-oss.yaml")
    s = ModelShape.from_config(cfg)
    assert (s.window, s.window_layers) == (128, 2)
    full = dataclasses.replace(s, window=None, window_layers=0)
    assert s.attention_flops() == pytest.approx((full.attention_flops() * 2 + 2.0 * 128 * (s.h_q + s.h_v) * 2) / 4)


def test_llama4_chunks_are_read_from_the_config():
    """configs/llama4-scout-like.yaml: Llama 4 Scout's text model (107.8B, 17.2B active); at a
    32K context its 36 RoPE blocks attend within 8K chunks, the 12 NoPE blocks over the whole."""
    cfg = load_config("configs/llama4-scout-like.yaml")
    s = ModelShape.from_config(cfg)
    assert s.total_params / 1e9 == pytest.approx(107.77, abs=0.01)
    assert s.active_params / 1e9 == pytest.approx(17.17, abs=0.01)
    long = ModelShape.from_config(cfg.replace(model={"seq_len": 32768}))
    assert (long.chunk, long.chunk_layers) == (8192, 36)
    width = long.h_q + long.h_v
    for causal in (False, True):
        half = 0.5 if causal else 1.0
        want = (2.0 * 32768 * width * half * 12 + 2.0 * 8192 * width * half * 36) / 48
        assert long.attention_flops(causal) == pytest.approx(want)
    full = dataclasses.replace(long, chunk=None, chunk_layers=0)
    assert long.attention_flops(True) < 0.5 * full.attention_flops(True)


def test_dsa_costs_the_indexer_and_the_selected_keys():
    """configs/deepseek-v32-like.yaml at 128K: the indexer's parameters (r_q·H_I·D_I + h·D_I +
    2·D_I + h·H_I per layer), its scores over every key and the main attention over k = 2,048
    keys per query; the planner ranks the sparse model's step well below dense MLA's."""
    cfg = load_config("configs/deepseek-v32-like.yaml")
    s = ModelShape.from_config(cfg)
    dense = ModelShape.from_config(cfg.replace(model={"dsa": {"index_topk": 0}}))
    h, Hi, Di, k, L = 7168, 64, 128, 2048, 131072
    assert s.indexer_params == 1536 * Hi * Di + h * Di + 2 * Di + h * Hi
    assert s.total_params - dense.total_params == 61 * s.indexer_params
    indexer = 2.0 * L * Hi * (Di + 1)
    absorbed = 128 * (2 * 512 + 64)  # every head over the selected latents: scores and values
    assert s.attention_flops() == pytest.approx(indexer + 2.0 * k * absorbed)
    kbar = (k * (k + 1) / 2 + (L - k) * k) / L
    assert s.attention_flops(causal=True) == pytest.approx(indexer / 2 + 2.0 * kbar * absorbed)
    # at 128K the indexer (H_I·(D_I + 1) = 8,256 wide against MLA's a·(d_qk + d_v) = 40,960) is
    # a large part of what is left: about 0.31 of dense MLA's attention FLOPs
    assert s.attention_flops(causal=True) < 0.33 * dense.attention_flops(causal=True)
    # k ≥ the sequence: every visible key, in the absorbed form (plus the indexer)
    short = dataclasses.replace(s, seq_len=1024)
    assert short.attention_flops(causal=True) == pytest.approx(1024 * Hi * (Di + 1) + 2.0 * 512.5 * absorbed)
    warm = dataclasses.replace(s, dsa_dense=True)
    assert warm.attention_flops() > dense.attention_flops()
    prof = load_profile(cfg.launch.profile)
    lay = Layout.from_config(cfg)
    sparse_plan = Planner.from_config(cfg, prof, cfg.launch.nodes).evaluate(lay)
    dense_cfg = cfg.replace(model={"dsa": {"index_topk": 0}})
    dense_plan = Planner.from_config(dense_cfg, prof, cfg.launch.nodes).evaluate(lay)
    assert sparse_plan.fits and sparse_plan.step_s < 0.5 * dense_plan.step_s


@pytest.mark.parametrize("lay, reason", [
    (Layout(tp=1, pp=1, dp=1024, ep=64, zero=3), "does not run with ZeRO-3"),
    (Layout(tp=1, pp=1, dp=1024, ep=64, zero=1, ac="full"), "activation_checkpointing: full"),
    (Layout(tp=1, pp=8, dp=128, ep=64, zero=1, schedule="gpipe"), "pp_schedule='gpipe' is not one"),
])
def test_the_search_refuses_what_the_config_refuses_for_ep_overlap(lay, reason):
    """The planner's search and ``validate`` apply one rule (``config.ep_overlap_blocker``): a
    layout the config would refuse with ep_overlap is not a candidate, for the same reason; the
    same layout without the overlap is one."""
    cfg = load_config("configs/deepseek-v3-like.yaml")
    shape, prof = ModelShape.from_config(cfg), load_profile("h100-superpod")
    on = Planner(shape, prof, 128, 4096, timing=TimingAssumptions(ep_overlap="merged_pairs"))
    off = Planner(shape, prof, 128, 4096, timing=TimingAssumptions(ep_overlap="none"))
    assert reason in (on.check(lay) or "")
    assert off.check(lay) is None
