"""One set of layout rules (moetrain.config.layout_refusal): the planner ranks no layout that
``submit`` refuses, and ``submit`` refuses no layout for a reason the planner did not know.

The property test draws layouts across the search space — every field of a layout moetrain runs
(tp, pp, dp, cp, ep, etp, virtual stages, ZeRO stage, schedule, checkpointing, SP, micro-batch,
HSDP's shard group) with ep_overlap and compile on and off — for each architecture in configs/,
and checks that the planner's verdict (``Planner.check``, which ``moetrain.plan --layout`` and
its search apply) and the config's (``check_supported`` on a GPU, which ``submit --dry-run``
applies before any process starts, the layout put in by the planner's own ``--set`` strings)
agree on each: both accept it, or both refuse it for the same field.
"""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moetrain.config import ConfigError, apply_overrides, check_supported, config_from_dict
from moetrain.topology.cluster import load_profile
from moetrain.planner.layout import Layout
from moetrain.planner.search import Planner

ROOT = Path(__file__).resolve().parents[1]
# The architectures the project ships (the published reproductions, GPT-3 and Megatron 2021, are
# planned as those runs: test_planner.py).
LARGE = ["mixtral-8x7b.yaml", "deepseek-v3-like.yaml", "llama3-70b-like.yaml"]
CONFIGS = LARGE + ["demo-moe.yaml", "finetune-gpt-oss.yaml", "finetune-glm4-moe.yaml", "finetune-qwen3-moe.yaml",
                   "qwen3-next-80b-a3b-like.yaml", "nemotron-3-nano-like.yaml", "llama4-scout-like.yaml",
                   "deepseek-v32-like.yaml"]
DRAWS = {**{name: 350 for name in LARGE}, "demo-moe.yaml": 100, "finetune-gpt-oss.yaml": 100,
         "finetune-glm4-moe.yaml": 100, "finetune-qwen3-moe.yaml": 100,
         "qwen3-next-80b-a3b-like.yaml": 100, "nemotron-3-nano-like.yaml": 100,
         "llama4-scout-like.yaml": 100, "deepseek-v32-like.yaml": 100}  # 1,050 + 800 layouts


def draw_layout(rng: random.Random) -> Layout:
    tp = rng.choice([1, 2, 4, 8])
    pp = rng.choice([1, 1, 2, 3, 4, 8])
    dp_shard = rng.choice([None, None, 1, 2, 4, 8])
    return Layout(tp=tp, pp=pp, dp=rng.choice([1, 2, 4, 8, 16]), cp=rng.choice([1, 1, 2, 4]),
                  ep=rng.choice([1, 2, 4, 8]), etp=rng.choice([1, tp]), vpp=rng.choice([1, 1, 2, 4]),
                  zero=rng.choice([0, 1, 2, 3]), mbs=rng.choice([1, 2, 4, 8]),
                  ac=rng.choice(["none", "selective", "full"]),
                  schedule=rng.choice(["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]),
                  sp=tp > 1 and rng.random() < 0.7, dp_shard=dp_shard)


def config_verdict(data: dict, lay: Layout, extra: list[str]) -> str | None:
    """The config check of ``submit --dry-run`` (a SLURM job on GPUs) with the layout put in by
    the planner's ``--set`` strings, on one node of ``lay.world`` GPUs: the refusal or None."""
    world = lay.world
    overrides = lay.overrides() + extra + ["launch.cluster=slurm", "launch.nodes=1",
                                           f"launch.tasks_per_node={world}", f"launch.gpus_per_node={world}"]
    try:
        cfg = config_from_dict(apply_overrides(copy.deepcopy(data), overrides), validate_config=False)
        check_supported(cfg, "cuda")
    except ConfigError as e:
        return str(e)
    return None


def planner_verdict(data: dict, lay: Layout, extra: list[str]) -> str | None:
    cfg = config_from_dict(apply_overrides(copy.deepcopy(data), extra), validate_config=False)
    planner = Planner.from_config(cfg, load_profile("h100-superpod"), 1, gpus_per_node=lay.world)
    return planner.check(lay)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in LARGE else n for n in CONFIGS])
def test_plan_and_submit_agree_on_every_drawn_layout(name):
    data = yaml.safe_load((ROOT / "configs" / name).read_text())
    rng = random.Random(name)
    moe = bool((data.get("moe") or {}).get("num_experts"))
    seen = {"accepted": 0, "refused": 0}
    fields: set[str] = set()
    for _ in range(DRAWS[name]):
        lay = draw_layout(rng)
        extra = []
        if moe and rng.random() < 0.3:
            extra.append("parallel.ep_overlap=true")
        if rng.random() < 0.2:
            extra.append("train.compile=true")
        by_config, by_planner = config_verdict(data, lay, extra), planner_verdict(data, lay, extra)
        assert (by_config is None) == (by_planner is None), (lay.short(), extra, by_config, by_planner)
        if by_config is not None:
            # the same rule: the planner names the field the config's message starts with
            field = by_config.split(" = ")[0]
            assert by_planner.startswith(field + " = "), (lay.short(), extra, by_config, by_planner)
            fields.add(field)
        seen["accepted" if by_config is None else "refused"] += 1
    # the draws reach both verdicts and several rules
    assert seen["accepted"] >= 1 and seen["refused"] >= 25 and len(fields) >= 5, (seen, fields)


def test_the_planners_first_layout_is_one_submit_accepts(tmp_path, tiny_shards):
    # The user's path: plan with a fixed choice, paste "to use #1" into submit --dry-run.
    plan = subprocess.run([sys.executable, "-m", "moetrain.plan", "--config", "configs/mixtral-8x7b.yaml",
                           "--nodes", "16", "--layout", "dp_shard=8,zero=3", "--top", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    line = next(ln for ln in plan.stdout.splitlines() if ln.startswith("to use #1: "))
    sets = line.removeprefix("to use #1: ").split()
    assert "parallel.zero_stage=3" in sets and "parallel.pp_schedule=zero_bubble" not in sets
    submit = subprocess.run([sys.executable, "-m", "moetrain.submit", "--config", "configs/mixtral-8x7b.yaml", *sets,
                             "--set", "launch.nodes=16", "--set", f"data.path={tiny_shards}",
                             "--set", "model.vocab_size=null", "--set", f"run.dir={tmp_path / 'run'}", "--dry-run"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120,
                            # the 16 nodes are checked as a layout, not against a cluster here (the
                            # dev cluster, up in CI, has 2): no SLURM command on this dry run's PATH
                            env={**os.environ, "PATH": os.path.dirname(sys.executable)})
    assert submit.returncode == 0, submit.stdout + submit.stderr
    assert submit.stdout.startswith("# NOT checked against a cluster"), submit.stdout[:300]
