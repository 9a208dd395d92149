"""EPLB in training (``moe.eplb``, moetrain.parallel.eplb): redundant expert slots placed by
measured load train as the run without them.

Each layout runs 20 steps with gradient clipping, 2 redundant slots and a re-placement every 5
steps (four, each moving experts between ranks), against one process without EPLB: losses, aux
losses and gradient norms within 1e-5 relative per step — the tolerance of every layout test
(test_equivalence): an expert's tokens are split over its replicas and their gradients summed
over the ep group, which changes fp32 summation order only (measured ≤ 1e-7). The negative
control leaves the replicas' gradients unsummed: the replicas then drift apart, and so do the
losses. Checkpoints hold the experts in logical order: an EPLB run's checkpoint resumes in a
plain run, and a plain run's in an EPLB run, as if never stopped; an EPLB run resumes with the
placement and the window of loads it saved.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.model.moe import SlotMap
from moetrain.monitor import collect, plot, render
from moetrain.parallel.eplb import move_plan
from moetrain.topology.eplb import place_experts
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed

STEPS = 20
EPLB = {"redundant_experts": 2, "every": 5, "window": 5}


def train(rank: int, world: int, data: str, run_dir: str, parallel: dict, eplb: dict | None, steps: int = STEPS,
          save: bool = False, unsummed: bool = False, write_files: bool = False, starve: int | None = None,
          init_from: str | None = None, two_nodes: bool = False) -> dict:
    """``unsummed``: the replicas keep their own share of the gradient (the negative control);
    ``starve``: that rank reports no free memory, so every move is skipped; ``two_nodes``: the
    ranks split over two nodes (NVSwitch domains) and the hierarchical dispatcher."""
    moe = {"eplb": eplb or {}, **({"token_dispatcher": "hierarchical"} if two_nodes else {})}
    cfg = tiny_config(data, run_dir, parallel=parallel, model={"vocab_size": 260}, moe=moe,
                      train={"steps": STEPS, "grad_clip": 0.5},
                      checkpoint={"resume": save, "every": 0, "init_from": init_from})
    if starve == rank:
        import moetrain.parallel.eplb

        moetrain.parallel.eplb.free_bytes = lambda device: 0
    nodes = {"mesh_ranks": torch.arange(world).reshape(1, world, 1, 1).tolist(),
             "rank_domains": [r * 2 // world for r in range(world)]} if two_nodes else {}
    trainer = Trainer(cfg, write_files=write_files, **nodes)
    if unsummed:
        trainer.eplb.sum_replica_grads = lambda: None
    start = trainer.step
    placer = trainer.eplb
    placements = [placer.state_dict() if placer is not None else None]  # after the load, then after each step
    results = []
    for _ in range(steps):
        results.append(trainer.train_step())
        placements.append(placer.state_dict() if placer is not None else None)
    if save:
        trainer.save_checkpoint()
    return {"start": start, "placements": placements, "losses": [r.loss for r in results],
            "aux": [r.aux_loss for r in results],
            "norms": [r.grad_norm for r in results], "loads": [r.extra["expert_load"] for r in results],
            "replaced": [r.extra.get("eplb_replaced", {}) for r in results], "run_dir": str(cfg.run_dir)}


@pytest.fixture(scope="module")
def plain(tiny_shards, tmp_path_factory) -> dict:
    return run_distributed(train, 1, str(tiny_shards), str(tmp_path_factory.mktemp("plain")), {}, None)[0]


def assert_same_run(got: dict, ref: dict, first: int = 1) -> None:
    for key in ("losses", "aux", "norms"):
        for step, (a, b) in enumerate(zip(got[key], ref[key][first - 1:]), first):
            assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {key} {a} with EPLB vs {b} without"


LAYOUTS = {
    "dp2-ep2-zero3": {"dp": 2, "ep": 2, "zero_stage": 3},
    "dp2-tp2-sp-ep2": {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True},
    "pp2-dp2-ep2": {"pp": 2, "dp": 2, "ep": 2},
    "dp2-tp2-ep2-etp2-zero2": {"dp": 2, "tp": 2, "ep": 2, "etp": 2, "zero_stage": 2},
    # the split micro-batches' dispatches in flight beside each other's compute
    "dp2-ep2-overlap": {"dp": 2, "ep": 2, "ep_overlap": True},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eplb_trains_as_the_plain_run(layout, plain, tiny_shards, tmp_path):
    parallel = LAYOUTS[layout]
    world = parallel.get("pp", 1) * parallel.get("dp", 1) * parallel.get("tp", 1)
    results = run_distributed(train, world, str(tiny_shards), str(tmp_path), parallel, EPLB)
    assert plain["losses"][-1] < plain["losses"][0] - 0.5, "the reference must learn"
    assert max(plain["norms"]) > 0.5, "the test must clip"
    assert_same_run(results[0], plain)
    # Every rank re-placed its layers at steps 5, 10, 15, 20; experts changed rank at two at least.
    moving = [step for step in range(STEPS)
              if sum(layer["bytes_sent"] for r in results for layer in r["replaced"][step].values()) > 0]
    assert len(moving) >= 2, f"experts moved at steps {[s + 1 for s in moving]} only"
    assert all(step % 5 == 4 for step in moving)


def test_eplb_over_two_nodes_with_the_hierarchical_dispatcher(plain, tiny_shards, tmp_path):
    """dp4 × ep4 over two nodes of two ranks: the placement packs experts onto nodes, then ranks
    (each node holds half of the experts), and the hierarchical dispatcher sends each token once
    per node over the slots."""
    eplb = {**EPLB, "redundant_experts": 4}  # 8 slots: 2 per rank, 4 per node
    results = run_distributed(train, 4, str(tiny_shards), str(tmp_path), {"dp": 4, "ep": 4}, eplb, STEPS, False,
                              False, False, None, None, True)
    assert_same_run(results[0], plain)
    placements = results[0]["placements"]
    for step in placements[5:]:  # from the first re-placement (the initial slots are 0-3, 0-3)
        for layer in step.values():
            halves = layer["slots"][:4], layer["slots"][4:]
            assert sorted(set(halves[0]) | set(halves[1])) == [0, 1, 2, 3] and not set(halves[0]) & set(halves[1])
    assert any(p != placements[0] for p in placements), "the placement never changed"


def test_unsummed_replica_gradients_change_the_run(plain, tiny_shards, tmp_path):
    # Over two ranks: each rank's tokens go to its own replica, so every replica learns from part
    # of its expert's tokens (in one process the first replica would take them all).
    got = run_distributed(train, 2, str(tiny_shards), str(tmp_path), {"dp": 2, "ep": 2}, EPLB, STEPS, False,
                          True)[0]
    worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], plain["losses"]))
    assert worst > 1e-4, f"losses within {worst:.1e} of the plain run with the replicas' gradients left unsummed"


@pytest.mark.parametrize("first, then", [(EPLB, None), (None, EPLB)], ids=["eplb-then-plain", "plain-then-eplb"])
def test_a_checkpoint_moves_between_eplb_and_plain_runs(first, then, plain, tiny_shards, tmp_path):
    layout = {"dp": 2, "ep": 2, "zero_stage": 2}
    a = run_distributed(train, 2, str(tiny_shards), str(tmp_path), layout, first, 10, True)[0]
    b = run_distributed(train, 2, str(tiny_shards), str(tmp_path), layout, then, 10, True)[0]
    assert (a["start"], b["start"]) == (0, 10)
    assert_same_run(a, plain)
    assert_same_run(b, plain, first=11)


def test_a_resumed_eplb_run_places_its_slots_as_the_saved_run(tiny_shards, tmp_path):
    """The placement and the window of loads are the checkpoint's: resumed at step 10, the run
    holds each expert on the rank it was on, measures the same tokens per ep rank, and re-places
    at step 15 from steps 6-15 (window 10, every 5) as the uninterrupted run does."""
    layout, eplb = {"dp": 2, "ep": 2, "zero_stage": 2}, {**EPLB, "window": 10}
    whole = run_distributed(train, 2, str(tiny_shards), str(tmp_path / "whole"), layout, eplb)[0]
    run_distributed(train, 2, str(tiny_shards), str(tmp_path / "cut"), layout, eplb, 10, True)
    shutil.copytree(tmp_path / "cut", tmp_path / "one")
    resumed = run_distributed(train, 2, str(tiny_shards), str(tmp_path / "cut"), layout, eplb, 10, True)[0]
    assert resumed["start"] == 10
    initial = whole["placements"][0]
    assert any(whole["placements"][10][n]["slots"] != initial[n]["slots"] for n in initial), \
        "the test needs a placement at step 10 that is not the initial one"
    assert resumed["placements"] == whole["placements"][10:]

    def moves(steps):  # the seconds aside
        return [{n: (r["moved"], r["bytes_sent"], r["rank_tokens_after"]) for n, r in step.items()} for step in steps]

    assert moves(resumed["replaced"]) == moves(whole["replaced"][10:])
    for a, b in zip(whole["loads"][10:], resumed["loads"]):
        assert {n: x["rank_tokens"] for n, x in a.items()} == {n: x["rank_tokens"] for n, x in b.items()}
    assert_same_run(resumed, whole, first=11)
    # In one process (ep 1, a re-planned layout) the saved placement does not apply: each layer is
    # placed from the saved window at the load, and the run goes on as the uninterrupted one.
    one = run_distributed(train, 1, str(tiny_shards), str(tmp_path / "one"), {}, eplb, 10, True)[0]
    assert one["start"] == 10
    for name, layer in one["placements"][0].items():
        loads = [sum(col) for col in zip(*whole["placements"][10][name]["window"])]
        assert sorted(layer["slots"]) == sorted(place_experts(loads, 6, 1).slots[0])
    assert_same_run(one, whole, first=11)


def test_weights_of_a_plain_model_load_into_the_slots(plain, tiny_shards, tmp_path):
    """A weights directory (a Hugging Face import's form) holds E experts; an EPLB run's slots take
    their experts' rows, replicas included: from the initial values it trains as the plain run."""
    from moetrain.model.init import init_weights
    from moetrain.model.transformer import Transformer
    from moetrain.train.weights import write_weights_dir

    cfg = tiny_config(tiny_shards, tmp_path / "w", model={"vocab_size": 260})
    model = Transformer.from_config(cfg)
    init_weights(model, cfg.run.seed, cfg.model.init_std, cfg.model.layers)
    state = model.state_dict()
    write_weights_dir(tmp_path / "w", cfg, state.items(), [(n, t.dtype, tuple(t.shape)) for n, t in state.items()],
                      progress=False)
    out = run_distributed(train, 2, str(tiny_shards), str(tmp_path / "run"), {"dp": 2, "ep": 2}, EPLB, 6, False,
                          False, False, None, str(tmp_path / "w"))[0]
    assert_same_run(out, plain)


def test_replacements_are_events_and_the_monitor_shows_them(tiny_shards, tmp_path):
    """Each re-placement is an event naming the moved experts and each ep rank's tokens before
    and after; the metrics carry every ep rank's measured tokens; ``monitor RUN`` shows both."""
    out = run_distributed(train, 2, str(tiny_shards), str(tmp_path), {"dp": 2, "ep": 2}, EPLB, 10, False, False,
                          True)[0]
    for load in out["loads"]:
        for layer in load.values():  # every assignment counted once, at the rank of its slot
            assert len(layer["rank_tokens"]) == 2 and sum(layer["rank_tokens"]) == sum(layer["tokens"])
    text = render(collect(Path(out["run_dir"])))
    assert "expert placement (moe.eplb)" in text
    lines = [line for line in text.splitlines() if line.strip().startswith("layer ")]
    assert [line.split(":")[0].strip() for line in lines] == ["layer 0", "layer 1"]
    assert all("step 10" in line and "busiest" in line and "→" in line for line in lines), text
    # the figure from these steps' records (train_step leaves writing them to the loop)
    records = [{"step": i + 1, "loss": loss, "expert_load": load, "eplb_replaced": replaced}
               for i, (loss, load, replaced) in enumerate(zip(out["losses"], out["loads"], out["replaced"]))]
    (Path(out["run_dir"]) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figure = plot(Path(out["run_dir"]), tmp_path / "load.png")  # the busiest rank's series, re-placements marked
    assert figure.stat().st_size > 0


def test_a_move_short_of_memory_is_skipped_naming_the_rank(plain, tiny_shards, tmp_path):
    out = run_distributed(train, 2, str(tiny_shards), str(tmp_path), {"dp": 2, "ep": 2}, EPLB, 10, False, False,
                          False, 1)[0]
    skipped = [layer for step in out["replaced"] for layer in step.values()]
    assert skipped and all("rank 1 needs" in r["skipped"] and r["bytes_sent"] == 0 for r in skipped)
    assert_same_run(out, plain)


def test_slot_map_sends_each_assignment_to_one_replica_of_its_expert():
    slots = [0, 1, 2, 3, 1, 1]  # expert 1 in three slots
    smap = SlotMap(slots, 4)
    idx = torch.tensor([[1, 0], [1, 2], [1, 3], [3, 1], [4, 1]])  # 4: padding
    phys = smap.physical(idx, padded=True)
    real = idx < 4
    assert torch.equal(torch.tensor(slots)[phys[real]], idx[real])
    assert (phys[~real] == len(slots)).all()
    ones = smap.physical(torch.ones(300, 1, dtype=torch.int64)).flatten()
    assert torch.bincount(ones, minlength=6)[[1, 4, 5]].tolist() == [100, 100, 100]
    # On ep rank 1 of 2 (slots 3-5: experts 3, 1, 1) expert 1's tokens stay on the rank.
    local = SlotMap(slots, 4, rank=1, ranks=2).physical(torch.tensor([[1], [1], [0], [3]]))
    assert local.flatten().tolist() == [4, 4, 0, 3]
    with pytest.raises(ValueError, match="at least once"):
        SlotMap([0, 1, 1, 1], 4)


def test_move_plan_keeps_what_stays_and_takes_each_slot_once():
    old, new = [0, 1, 2, 3, 0, 1], [0, 3, 3, 2, 1, 0]  # 2 ranks of 3 slots
    plan = move_plan(old, new, 2)
    assert plan[0][0] == [(0, 0)]  # expert 0 stays in rank 0's row 0
    received = sorted(n for p in range(2) for _, n in plan[p][1])
    assert received == [0, 1, 2]
    for p in range(2):
        for q in range(2):
            for o, n in plan[p][q]:
                assert old[p * 3 + o] == new[q * 3 + n]


@pytest.mark.parametrize("section, field", [
    ({"moe": {"eplb": {"every": 5, "redundant_experts": 1}}, "parallel": {"dp": 2, "ep": 2}},
     "moe.eplb.redundant_experts"),
    ({"moe": {"eplb": {"redundant_experts": 2}}}, "moe.eplb.redundant_experts"),
    ({"moe": {"eplb": {"every": 5}, "capacity_factor": 1.25}}, "moe.capacity_factor"),
    ({"moe": {"eplb": {"every": 5}}, "train": {"optimizer": "muon"}}, "train.optimizer"),
])
def test_eplb_config_names_the_field_and_the_fix(section, field, tmp_path):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        tiny_config(tmp_path, tmp_path, **section)
