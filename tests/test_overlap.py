"""Communication overlap, structurally (the time it hides is measured by
benchmarks/bench_overlap.py, not asserted here): the shared experts compute while the dispatch
all-to-all is in flight; FSDP prefetches one block ahead. Equality with one process is in
test_zero (prefetch)."""

from __future__ import annotations

from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed


def shared_during_dispatch(rank: int, world: int, data: str, run_dir: str) -> list[str]:
    cfg = tiny_config(data, run_dir, parallel={"dp": 2, "ep": 2})
    trainer = Trainer(cfg, write_files=False)
    moe = next(iter(trainer.moe_layers.values()))
    events: list[str] = []
    dispatcher = moe.parallel.dispatcher
    start, finish = dispatcher.start, dispatcher.finish
    dispatcher.start = lambda *a: (events.append("start"), start(*a))[1]
    dispatcher.finish = lambda *a: (events.append("finish"), finish(*a))[1]
    moe.shared.register_forward_pre_hook(lambda *a: events.append("shared"))
    trainer.train_step()
    return events[:3]


def test_shared_experts_run_while_tokens_travel(tiny_shards, tmp_path):
    for events in run_distributed(shared_during_dispatch, 2, str(tiny_shards), str(tmp_path)):
        assert events == ["start", "shared", "finish"]


def gathers_before_blocks(rank: int, world: int, data: str, run_dir: str, prefetch: bool) -> dict[str, int]:
    """FSDP's all-gathers issued, in the first micro-batch, before block 0's forward and before
    block 0's backward (ZeRO-3, 2 blocks); ``prefetch=False`` turns moetrain's explicit
    prefetching off (the control)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if not prefetch:
        FSDPModule.set_modules_to_forward_prefetch = lambda self, modules: None
        FSDPModule.set_modules_to_backward_prefetch = lambda self, modules: None
    gathers = [0]
    op = next(o for o in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, o))  # (2.13, 2.11)
    gather = getattr(dist, op)
    setattr(dist, op, lambda *a, **k: (gathers.__setitem__(0, gathers[0] + 1), gather(*a, **k))[1])
    cfg = tiny_config(data, run_dir, parallel={"dp": 2, "zero_stage": 3})
    trainer = Trainer(cfg, write_files=False)
    block0 = list(trainer.model_parts[0].layers.values())[0]
    seen: dict[str, int] = {}
    # Registered after fully_shard: they run after FSDP's own hooks, i.e. after its all-gathers.
    block0.register_forward_pre_hook(lambda *a: seen.setdefault("forward", gathers[0]) and None)  # (None: args kept)
    block0.register_full_backward_pre_hook(lambda *a: seen.setdefault("backward", gathers[0]) and None)
    trainer.train_step()
    return seen


def test_fsdp_prefetches_one_block_ahead(tiny_shards, tmp_path):
    """Block 0's forward starts with block 1's two groups (its experts and the rest of it)
    already being gathered, which without the explicit prefetch are gathered only when block 1
    starts; in backward, block 1's backward starts gathering block 0's groups, so more of them
    are in flight when block 0's backward starts than without it."""
    on = run_distributed(gathers_before_blocks, 2, str(tiny_shards), str(tmp_path / "on"), True)
    off = run_distributed(gathers_before_blocks, 2, str(tiny_shards), str(tmp_path / "off"), False)
    for a, b in zip(on, off):
        assert a["forward"] - b["forward"] == 2, (a, b)  # measured: 4 vs 2 (torch 2.13)
        assert a["backward"] - b["backward"] >= 1, (a, b)  # measured: 8 vs 7
