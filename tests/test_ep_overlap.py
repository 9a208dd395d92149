"""``parallel.ep_overlap``: the forward of micro-batch i+1 merged with the backward of micro-batch
i, taking turns at their token all-to-alls (moetrain/parallel/ep_overlap.py).

Each layout is trained 5 steps with and without the overlap (fp32, CPU, gloo): the losses, the
gradient norms, the first step's gradients and the parameters after the 5 steps must be
**equal bit for bit** — the overlap changes when each micro-batch's work runs, not what it
computes nor the order gradients accumulate in. The layouts: dp × ep with ZeRO 0, 1 and 2, tp2
with sequence parallelism, the hierarchical dispatcher over two domains, context parallelism,
expert-tensor parallelism and the fp8 wire. Speed is not asserted here (benchmarks/).
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
from torch.distributed.tensor import DTensor

from moetrain.config import ConfigError
from moetrain.parallel.ep_overlap import BACKWARD, FORWARD, MergedPair, Slot, TurnTaking
from moetrain.parallel.pipeline import OVERLAP_F_B
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from lockstep import Recorder, compare_in_lockstep, envelope, expert_loads, merge_ranks
from multiproc import run_distributed
from test_equivalence import steps_with_first_grads

# The overlapped step must equal the plain one bit for bit: a difference shows at the first step it
# is made, so 5 steps (what a step carries to the next included: AdamW's moments, ZeRO's shards,
# the delayed weight gradients' buffers) prove what 20 would. The split micro-batches differ in
# the last bits by design and are compared over 20 steps, where rounding differences grow.
EXACT_STEPS = 5
STEPS = 20


@contextmanager
def turn_events() -> Iterator[list[tuple[str, str]]]:
    """The merged pairs' turn-taking in order, (side, what), as ``moetrain.ep_overlap`` logs it
    at DEBUG level while the block runs."""
    events: list[tuple[str, str]] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            events.append((record.side, record.what))

    log = logging.getLogger("moetrain.parallel.ep_overlap")
    handler, level, propagate = Collect(logging.DEBUG), log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        yield events
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def overlap_capture(rank: int, world: int, data: str, run_dir: str, parallel: dict, moe: dict, overlap: bool,
                    domains: list[int] | None = None, model: dict | None = None) -> dict:
    # micro_batch_size 1: 8 / (1 · data-parallel ranks) = 2-8 micro-batches per step to merge.
    if not overlap:  # the plain step to compare with: no overlap, hence no delayed weight gradients
        parallel = {k: v for k, v in parallel.items() if k != "delay_wgrad_compute"}
    cfg = tiny_config(data, run_dir, parallel={**parallel, "ep_overlap": overlap}, moe=moe,
                      model={"vocab_size": 260, **(model or {})},  # a multiple of tp
                      train={"steps": EXACT_STEPS, "micro_batch_size": 1, "grad_clip": 1.0})
    kwargs = {"mesh_ranks": torch.arange(world).reshape(1, world, 1, 1).tolist(), "rank_domains": domains
              } if domains else {}
    trainer = Trainer(cfg, write_files=False, **kwargs)
    with turn_events() as events:
        results, grads = steps_with_first_grads(trainer, EXACT_STEPS)
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for part in trainer.model_parts for n, p in part.named_parameters()}
    pairs = cfg.grad_accum_steps - 1  # F0 | B0+F1 | ... | B(n-1) on one stage
    if cfg.parallel.pp > 1:  # the pairs of this rank's merged 1F1B order
        order = trainer.runner.schedule.pipeline_order[trainer.ps.coord("pp")] if overlap else []
        pairs = sum(a.computation_type == OVERLAP_F_B for a in order)
    moe_layers = sum(len(part.moe_layers()) for part in trainer.model_parts)
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results], "grads": grads,
            "params": params, "events": events, "micro_batches": cfg.grad_accum_steps, "pairs": pairs,
            "moe_layers": moe_layers}


def assert_identical(on: dict, off: dict) -> None:
    assert on["losses"] == off["losses"], (on["losses"], off["losses"])
    assert on["norms"] == off["norms"]
    for kind in ("grads", "params"):
        assert on[kind].keys() == off[kind].keys()
        for name, t in on[kind].items():
            assert torch.equal(t, off[kind][name]), f"{kind} {name}: max diff {(t - off[kind][name]).abs().max()}"


def turns_per_pair(events: list) -> list[list]:
    """The events split at each pair's end (both sides 'done')."""
    pairs, cur = [], []
    for e in events:
        cur.append(e)
        if sum(1 for x in cur if x[1] == "done") == 2:
            pairs.append(cur)
            cur = []
    assert not cur, cur
    return pairs


CASES = {  # world, parallel, moe, rank domains, model
    "dp2-ep2": (2, {"dp": 2, "ep": 2}, {}, None),
    "dp2-ep2-zero1": (2, {"dp": 2, "ep": 2, "zero_stage": 1}, {}, None),
    "dp2-ep2-zero2-fp8wire": (2, {"dp": 2, "ep": 2, "zero_stage": 2}, {"dispatch_dtype": "fp8"}, None),
    "tp2-sp-ep2": (4, {"dp": 2, "tp": 2, "sequence_parallel": True, "ep": 2}, {}, None),
    "tp2-etp2-ep2": (4, {"dp": 2, "tp": 2, "etp": 2, "ep": 2}, {}, None),
    "cp2-ep2": (2, {"cp": 2, "ep": 2}, {}, None),
    "ep4-hierarchical": (4, {"dp": 4, "ep": 4}, {"token_dispatcher": "hierarchical"}, [0, 0, 1, 1]),
    # pipeline parallelism: 1F1B and interleaved 1F1B with each backward merged with the next forward
    "pp2-ep2-1f1b": (4, {"pp": 2, "dp": 2, "ep": 2}, {}, None),
    "pp2-ep2-interleaved-zero1": (4, {"pp": 2, "dp": 2, "ep": 2, "pp_schedule": "interleaved_1f1b",
                                      "virtual_stages": 2, "zero_stage": 1}, {}, None, {"layers": 4}),
    # weight gradients computed after the backward's next all-to-all is issued
    "dp2-ep2-delay-wgrad": (2, {"dp": 2, "ep": 2, "delay_wgrad_compute": True}, {}, None),
    "dp2-ep2-zero2-grouped-mm-delay-wgrad": (2, {"dp": 2, "ep": 2, "zero_stage": 2, "delay_wgrad_compute": True},
                                             {"expert_backend": "grouped_mm"}, None),
    "tp2-sp-ep2-delay-wgrad": (4, {"dp": 2, "tp": 2, "sequence_parallel": True, "ep": 2,
                                   "delay_wgrad_compute": True}, {}, None),
    "pp2-ep2-1f1b-delay-wgrad": (4, {"pp": 2, "dp": 2, "ep": 2, "delay_wgrad_compute": True}, {}, None),
    "ep4-hierarchical-delay-wgrad": (4, {"dp": 4, "ep": 4, "delay_wgrad_compute": True},
                                     {"token_dispatcher": "hierarchical"}, [0, 0, 1, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow(fast=["dp2-ep2"])
def test_overlap_is_the_same_step(case, tiny_shards, tmp_path):
    world, parallel, moe, domains, *model = CASES[case]
    off, on = (run_distributed(overlap_capture, world, str(tiny_shards), str(tmp_path / str(flag)), parallel, moe,
                               flag, domains, *model) for flag in (False, True))
    assert on[0]["micro_batches"] >= 2 and on[-1]["losses"][-1] < on[-1]["losses"][0]
    for r_on, r_off in zip(on, off):
        assert_identical(r_on, r_off)
    # The pairs really took turns: per pair (one per micro-batch after the first on one stage,
    # the merged 1F1B order's pairs with pp; every step), each side issued an all-to-all and
    # handed over at every MoE layer's dispatch and combine (the hierarchical dispatcher
    # exchanges rows twice per direction, over the rail and within the domain), and the other
    # side ran before it resumed.
    for r in (0, world - 1):
        pairs = turns_per_pair(on[r]["events"])
        assert on[r]["pairs"] >= 1 and len(pairs) == EXACT_STEPS * on[r]["pairs"], (len(pairs), on[r]["pairs"])
        # exchanges per direction in a pair's forward: 2 per MoE layer of a stage it runs
        per_layer = 2 if parallel.get("ep") == 4 and moe.get("token_dispatcher") == "hierarchical" else 1
        exchanges = 2 * per_layer * on[r]["moe_layers"] // parallel.get("virtual_stages", 1)
        check_pairs(pairs, exchanges)
        if parallel.get("delay_wgrad_compute"):
            check_weight_grads_flushed(pairs, on[r]["moe_layers"] // parallel.get("virtual_stages", 1))
    assert off[0]["events"] == []


def check_pairs(pairs: list[list], exchanges: int) -> None:
    for pair in pairs:
        issues = {side: sum(1 for s, what in pair if s == side and what == "issue") for side in ("forward", "backward")}
        assert issues["forward"] >= exchanges - 1 and issues["backward"] >= exchanges - 1, (issues, pair)
        for k, (side, what) in enumerate(pair):
            if what == "issue":
                resumed = next((j for j in range(k + 1, len(pair)) if pair[j] == (side, "resume")), None)
                if resumed is not None:
                    assert any(s != side for s, _ in pair[k + 1:resumed]), pair


def check_weight_grads_flushed(pairs: list[list], moe_layers: int) -> None:
    """With delay_wgrad_compute each pair's backward computed its deferred weight gradients
    right after issuing a transfer and before handing over (the experts' at each MoE layer's
    dispatch backward), and once more at its end (what is left: the first layer's attention)."""
    for pair in pairs:
        flushes = [k for k, e in enumerate(pair) if e == ("backward", "wgrad")]
        assert len(flushes) >= moe_layers, pair
        forward_done = pair.index(("forward", "done"))
        for k in flushes:
            if k < forward_done:  # while the partner runs: the hand-over with the transfer in flight comes next
                after = next(e for e in pair[k + 1:] if e[0] == "backward")
                assert after in (("backward", "issue"), ("backward", "done")), pair


# -- the turn-taking itself, without a model ----------------------------------------------------


def test_turns_alternate_and_a_side_with_more_transfers_runs_on_alone():
    log: list[str] = []
    prev, nxt = Slot(), Slot()

    def backward(at_end):
        for k in range(3):
            log.append(f"B{k}")
            prev.while_in_flight()
        at_end()
        log.append("B-end")

    def forward():
        for k in range(5):  # two more than the backward: they run without handing over
            log.append(f"F{k}")
            nxt.while_in_flight()
        return "out"

    with turn_events() as events:
        assert MergedPair(prev, nxt).run(backward, forward) == "out"
    assert events == [("backward", "issue"), ("forward", "issue"), ("backward", "resume"), ("backward", "issue"),
                      ("forward", "resume"), ("forward", "issue"), ("backward", "resume"), ("backward", "issue"),
                      ("forward", "resume"), ("forward", "issue"), ("backward", "resume"),  # B2 | F2
                      ("forward", "resume"), ("forward", "done"), ("backward", "done")], events  # F3, F4 alone
    assert log == ["B0", "F0", "B1", "F1", "B2", "F2", "F3", "F4", "B-end"]
    assert prev.turns is None and nxt.turns is None


def test_an_error_on_either_side_is_raised_and_nothing_hangs():
    def failing_backward(at_end):
        raise RuntimeError("backward broke")

    with pytest.raises(RuntimeError, match="backward broke"):
        MergedPair(Slot(), Slot()).run(failing_backward, lambda: None)

    done = threading.Event()

    def backward(at_end):
        prev.while_in_flight()
        prev.while_in_flight()
        at_end()
        done.set()

    def failing_forward():
        nxt.while_in_flight()
        raise ValueError("forward broke")

    prev, nxt = Slot(), Slot()
    with pytest.raises(ValueError, match="forward broke"):
        MergedPair(prev, nxt).run(backward, failing_forward)
    assert done.is_set()


def test_turn_taking_sides_are_exclusive():
    turns, active, overlaps = TurnTaking(), [0], []

    def side(me: int, n: int) -> None:
        if me == FORWARD:
            turns.wait_turn(FORWARD)
        for _ in range(n):
            active[0] += 1
            overlaps.append(active[0])
            active[0] -= 1
            turns.hand_over(me)
        turns.finish(me)

    t = threading.Thread(target=side, args=(BACKWARD, 50))
    t.start()
    side(FORWARD, 50)
    t.join(10)
    assert not t.is_alive() and max(overlaps) == 1 and len(overlaps) == 100


@pytest.mark.parametrize("sets, match", [
    ({"parallel": {"dp": 2, "ep": 1}}, "no expert all-to-all to hide with ep = 1"),
    ({"parallel": {"dp": 2, "ep": 2, "pp": 2, "pp_schedule": "gpipe"}, "model": {"layers": 2}},
     "pp_schedule='gpipe' is not one"),
    ({"parallel": {"dp": 2, "ep": 2, "zero_stage": 3}}, "does not run with ZeRO-3"),
    ({"parallel": {"dp": 2, "ep": 2, "activation_checkpointing": "full"}}, "activation_checkpointing: full"),
    ({"parallel": {"dp": 2, "ep": 2}, "train": {"compile": True}}, "train.compile"),
])
def test_layouts_the_overlap_cannot_run_are_refused_with_the_fix(sets, match, tmp_path):
    from moetrain.config import validate

    sections = {k: dict(v) for k, v in sets.items()}
    sections["parallel"]["ep_overlap"] = True
    with pytest.raises(ConfigError, match=match) as e:  # refused when the config is read
        validate(tiny_config(tmp_path, tmp_path / "run", **sections), "cpu")
    assert "parallel.ep_overlap" in str(e.value)


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 4])
def test_merged_1f1b_orders_lower_to_a_pipeline_with_every_micro_batch_once(pp, v):
    """The merged orders (each backward with the forward after it) of 1F1B and interleaved 1F1B
    keep each stage's forwards and backwards in micro-batch order, pair two different
    micro-batches, and lower to send/recv actions without a deadlock (torch's lowering raises
    on a cycle) for every number of micro-batches the schedules accept."""
    import types

    from torch.distributed.pipelining.schedules import (
        FORWARD as F,
        FULL_BACKWARD as B,
        ScheduleInterleaved1F1B,
        _add_send_recv,
        generate_stage_to_rank_mapping,
    )

    from moetrain.parallel.pipeline import merge_backward_with_next_forward, one_f_one_b_order

    for n in range(pp, 17):
        if v == 1:
            orders = {r: one_f_one_b_order(r, pp, n) for r in range(pp)}
        else:
            rounds = max(1, n // pp)
            if n % rounds:
                continue
            sched = types.SimpleNamespace(n_local_stages=v, microbatches_per_round=n // rounds, pp_group_size=pp,
                                          _n_microbatches=n)
            orders = {r: ScheduleInterleaved1F1B._calculate_single_rank_operations(sched, r) for r in range(pp)}
        merged = {r: merge_backward_with_next_forward(o) for r, o in orders.items()}
        for r, actions in merged.items():
            flat = [s for a in actions for s in (a.sub_actions[::-1] if a.computation_type == OVERLAP_F_B else (a,))]
            assert flat == [a for a in orders[r] if a is not None]
            for stage in range(r, pp * v, pp):
                for kind in (F, B):
                    assert [a.microbatch_index for a in flat if a.stage_index == stage and a.computation_type == kind
                            ] == list(range(n))
            pairs = [a.sub_actions for a in actions if a.computation_type == OVERLAP_F_B]
            assert all(f.computation_type == F and b.computation_type == B for f, b in pairs)
            assert all((f.stage_index, f.microbatch_index) != (b.stage_index, b.microbatch_index) for f, b in pairs)
            assert pairs or r < pp - 1  # the last stage pairs from its first backward on
        stage_to_rank = generate_stage_to_rank_mapping(pp, pp * v)
        _add_send_recv(merged, stage_to_rank=lambda s: stage_to_rank[s], num_stages=pp * v)


def test_delayed_weight_gradients_without_the_overlap_are_refused(tmp_path):
    from moetrain.config import validate

    with pytest.raises(ConfigError, match="parallel.delay_wgrad_compute.*ep_overlap is off"):
        validate(tiny_config(tmp_path, tmp_path / "run", parallel={"dp": 2, "ep": 2, "delay_wgrad_compute": True}),
                 "cpu")


# -- ep_overlap_split: each micro-batch as two halves that pair up too ------------------------------

SPLIT_CASES = {  # world, parallel, moe
    "dp2-ep2": (2, {"dp": 2, "ep": 2}, {}),
    "dp2-ep2-zero2-delay-wgrad-fp8wire": (2, {"dp": 2, "ep": 2, "zero_stage": 2, "delay_wgrad_compute": True},
                                          {"dispatch_dtype": "fp8"}),
}


def split_capture(rank: int, world: int, data: str, run_dir: str, parallel: dict, moe: dict, overlap: bool) -> dict:
    # micro_batch_size 2, global batch 8 over dp 2: 2 micro-batches per step, which ep_overlap_split
    # "auto" runs as 4 halves (3 pairs instead of 1).
    if not overlap:
        parallel = {k: v for k, v in parallel.items() if k != "delay_wgrad_compute"}
    cfg = tiny_config(data, run_dir, parallel={**parallel, "ep_overlap": overlap}, moe=moe,
                      train={"steps": STEPS, "micro_batch_size": 2, "grad_clip": 1.0})
    trainer = Trainer(cfg, write_files=False)
    recorder = Recorder().install(trainer)
    with turn_events() as events:
        results, grads = steps_with_first_grads(trainer, STEPS)
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for part in trainer.model_parts for n, p in part.named_parameters()}
    return {"losses": [r.loss for r in results], "aux": [r.aux_loss for r in results],
            "norms": [r.grad_norm for r in results], "grads": grads, "params": params,
            "split": getattr(trainer.runner, "split", False), "pairs": len(turns_per_pair(events)),
            "loads": expert_loads(results), "samples": recorder.result()}


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("case", list(SPLIT_CASES))
@pytest.mark.slow
def test_split_micro_batches_are_the_same_step_within_fp32(case, tiny_shards, tmp_path):
    """Halves reorder the sums of the micro-batch's gradients and losses: one more rounding per
    sum split in two, 2u = 1.2e-7 relative at step 1, which the steps after carry on and AdamW
    enlarges where a gradient is near zero (tests/lockstep.py, mechanism 1). Allowed: the losses,
    aux losses and gradient norms within 1e-6 relative (16 u) at every step, the first step's
    gradients within 1e-6 of each tensor's largest entry, the parameters after 20 steps within
    1e-4 (an element whose gradient is near zero moves by a step of its sign, where the rounding
    differences grow); measured on this project's machines: ≤ 9e-8, ≤ 2.2e-7 and ≤ 1.8e-5.

    With the fp8 wire, elements cross E4M3 rounding boundaries one way in one run and the other
    way in the other (mechanism 2): the scalars within 1e-4 while every token goes to the same
    experts in both runs; from a token's first expert flip (mechanism 3) on, the same samples for
    the same steps and finite losses within what the bf16 wire changes, and the parameters are
    compared only when no token flipped. A half that took the mean of its own tokens, or the aux
    loss's full weight, would double its part of the loss."""
    world, parallel, moe = SPLIT_CASES[case]
    off, on = (run_distributed(split_capture, world, str(tiny_shards), str(tmp_path / str(flag)), parallel, moe,
                               flag) for flag in (False, True))
    assert on[0]["split"] and not off[0]["split"]
    assert on[0]["pairs"] == STEPS * 3  # 4 halves per step: B0+F1, B1+F2, B2+F3
    assert on[0]["losses"][-1] < on[0]["losses"][0]
    rel, bound = 1e-6, None
    if moe.get("dispatch_dtype") == "fp8":
        other = run_distributed(split_capture, world, str(tiny_shards), str(tmp_path / "bf16"), parallel,
                                {**moe, "dispatch_dtype": "bf16"}, False)
        rel, bound = 1e-4, envelope(off[0]["losses"], other[0]["losses"])
    k = compare_in_lockstep(case, {**on[0], "samples": merge_ranks([r["samples"] for r in on])},
                            {**off[0], "samples": merge_ranks([r["samples"] for r in off])}, rel=rel, bound=bound)
    for r_on, r_off in zip(on, off):
        for key in ("losses", "aux", "norms"):
            for step, (a, b) in enumerate(zip(r_on[key][:k], r_off[key][:k]), 1):
                assert abs(a - b) <= rel * abs(b), f"{key} at step {step}: {a} vs {b}"
        for kind, tol in (("grads", 1e-6),) + (("params", 1e-4),) * (k == STEPS):
            worst = max(max_rel(t, r_off[kind][n]) for n, t in r_on[kind].items())
            assert worst <= tol, f"{kind}: {worst:.2e}"


def test_split_is_refused_where_halves_would_differ(tiny_shards, tmp_path):
    base = {"dp": 2, "ep": 2, "ep_overlap": True, "ep_overlap_split": "always"}
    with pytest.raises(ConfigError, match="ep_overlap_split.*micro_batch_size = 1"):
        tiny_config(tiny_shards, tmp_path, parallel=base, train={"micro_batch_size": 1})
    with pytest.raises(ConfigError, match="ep_overlap_split.*capacity"):
        tiny_config(tiny_shards, tmp_path, parallel=base, moe={"capacity_factor": 1.0})
    with pytest.raises(ConfigError, match="ep_overlap_split.*ep_overlap, which is off"):
        tiny_config(tiny_shards, tmp_path, parallel={**base, "ep_overlap": False})
    from moetrain.config import overlap_split

    auto = {**base, "ep_overlap_split": "auto"}
    assert overlap_split(tiny_config(tiny_shards, tmp_path, parallel=auto, train={"micro_batch_size": 2}))
    assert not overlap_split(tiny_config(tiny_shards, tmp_path, parallel=auto, train={"micro_batch_size": 1}))
    # 4 micro-batches per rank: pairs are not scarce, auto keeps them whole
    assert not overlap_split(tiny_config(tiny_shards, tmp_path, parallel=auto,
                                         train={"micro_batch_size": 2, "global_batch_size": 16}))
