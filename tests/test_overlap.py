"""Communication overlap, structurally (the time it hides is measured by
benchmarks/bench_overlap.py, not asserted here): the data-parallel gradient buckets start during
the last micro-batch's backward, in the same order on every rank; the shared experts compute
while the dispatch all-to-all is in flight; FSDP prefetches one block ahead. Equality with one
process is in test_equivalence (small buckets) and test_zero (prefetch)."""

from __future__ import annotations

from moetrain.parallel.data_parallel import OverlappedGradReducer
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed


def started_early(rank: int, world: int, data: str, run_dir: str) -> dict:
    cfg = tiny_config(data, run_dir, parallel={"dp": 2, "grad_bucket_mb": 0.01})
    trainer = Trainer(cfg, write_files=False)
    seen: list = []
    finish = OverlappedGradReducer.finish

    def recording_finish(self):
        # Buckets whose all-reduce started during the backward, and their order.
        seen.append((self._next, len(self.buckets), [id(b.params[0]) for b in self.buckets[:self._next]]))
        finish(self)

    OverlappedGradReducer.finish = recording_finish
    trainer.train_step()
    names = {id(p): n for part in trainer.model_parts for n, p in part.named_parameters()}
    started, total, order = seen[0]
    return {"started": started, "total": total, "order": [names[i] for i in order]}


def test_gradient_buckets_start_during_backward(tiny_shards, tmp_path):
    results = run_distributed(started_early, 2, str(tiny_shards), str(tmp_path))
    for r in results:
        assert r["total"] >= 4, r
        assert r["started"] >= r["total"] // 2, r  # most buckets were in flight before backward ended
    assert results[0]["order"] == results[1]["order"]  # the collectives pair up


def shared_during_dispatch(rank: int, world: int, data: str, run_dir: str) -> list[str]:
    cfg = tiny_config(data, run_dir, parallel={"dp": 2, "ep": 2})
    trainer = Trainer(cfg, write_files=False)
    moe = next(iter(trainer.moe_layers.values()))
    events: list[str] = []
    start, finish = moe.dispatcher.start, moe.dispatcher.finish
    moe.dispatcher.start = lambda *a: (events.append("start"), start(*a))[1]
    moe.dispatcher.finish = lambda *a: (events.append("finish"), finish(*a))[1]
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
