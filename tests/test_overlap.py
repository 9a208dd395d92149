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


def prefetch_targets(rank: int, world: int, data: str, run_dir: str) -> list[int]:
    cfg = tiny_config(data, run_dir, parallel={"dp": 2, "zero_stage": 3})
    trainer = Trainer(cfg, write_files=False)
    part = trainer.model_parts[0]
    blocks = list(part.layers.values())
    # Block 0 prefetches block 1's groups in forward; block 1 prefetches block 0's in backward.
    fwd = blocks[0]._get_fsdp_state()._states_to_forward_prefetch
    bwd = blocks[1]._get_fsdp_state()._states_to_backward_prefetch
    return [len(fwd), len(bwd)]


def test_fsdp_prefetches_one_block_ahead(tiny_shards, tmp_path):
    for counts in run_distributed(prefetch_targets, 2, str(tiny_shards), str(tmp_path)):
        assert counts == [2, 2]  # the next block's experts and the rest of it
