"""Memory per phase of a step (moetrain/train/memory.py) and the range observers it rests on."""

from __future__ import annotations

import torch

from moetrain import ranges
from moetrain.train.memory import PhaseMemory, predicted_memory_gib
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed


def test_observers_see_every_range_and_only_while_observing():
    seen = []
    with ranges.observe(lambda n: seen.append(("enter", n)), lambda n: seen.append(("leave", n))):
        with ranges.phase(ranges.FORWARD):
            with ranges.phase(ranges.DISPATCH + ranges.WAIT):
                pass
    with ranges.phase(ranges.BACKWARD):  # no longer observed
        pass
    assert seen == [("enter", ranges.FORWARD), ("enter", ranges.DISPATCH + ranges.WAIT),
                    ("leave", ranges.DISPATCH + ranges.WAIT), ("leave", ranges.FORWARD)]


def test_phase_memory_on_the_cpu_keeps_each_phase_s_largest_rss():
    meter = PhaseMemory(torch.device("cpu"))
    with ranges.observe(meter.enter, meter.leave):
        with ranges.phase(ranges.FORWARD):
            pass
        big = torch.ones(64, 2**20, dtype=torch.uint8)  # 64 MiB, touched
        with ranges.phase(ranges.FORWARD):
            pass
        with ranges.phase(ranges.OPTIMIZER):
            pass
    step = meter.take()
    assert set(step) == {"forward", "optimizer"} and step["forward"]["rss_gib"] > 0.06
    assert meter.take() == {} and big.sum() > 0


def memory_run(rank: int, world: int, data: str, run_dir: str) -> list[dict]:
    trainer = Trainer(tiny_config(data, run_dir, parallel={"dp": 2, "ep": 2}, train={"steps": 3}), write_files=False)
    return [trainer.train_step().extra["memory_by_phase"] for _ in range(3)]


def test_every_step_reports_its_phases(tiny_shards, tmp_path):
    for steps in run_distributed(memory_run, 2, str(tiny_shards), str(tmp_path / "run")):
        for phases in steps:
            assert set(phases) == {"forward", "backward", "optimizer"}
            assert all(p["rss_gib"] > 0.1 for p in phases.values())  # a torch process holds more than 100 MiB


def test_the_planner_predicts_a_memory_for_the_run_s_layout(tiny_shards, tmp_path):
    small = predicted_memory_gib(tiny_config(tiny_shards, tmp_path, parallel={"dp": 2, "ep": 2}))
    larger = predicted_memory_gib(tiny_config(tiny_shards, tmp_path, parallel={"dp": 2, "ep": 2},
                                              model={"hidden": 64, "ffn_hidden": 128}))
    assert 0 < small < larger
