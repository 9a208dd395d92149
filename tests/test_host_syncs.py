"""Device → host reads per optimizer step stay at the documented count (moetrain.train.trainer).

Counted with :class:`moetrain.train.host_sync.HostReadCounter` over one loop iteration of the
trainer (``train_step`` + the stop-flag agreement), after a warm-up step:

* every layout: 2 — the step's metrics vector (one ``tolist``) and the stop flag (a CPU tensor by
  design: gloo on GPU clusters, so no device sync there);
* ep = 1, ``grouped_mm`` experts: nothing else;
* ep = 1, ``loop`` experts: + one per MoE layer per micro-batch (the loop's split sizes);
* ep > 1, any backend: + one per MoE layer per micro-batch (the all-to-all split sizes), which the
  loop reuses;
* the same with packed fine-tuning data, whose padding the MoE layers do not route (its rows stay
  out of the grouped GEMM and the all-to-all without a read of how many there are).
"""

from __future__ import annotations

import pytest

from moetrain.train.host_sync import HostReadCounter
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed
import test_finetune_data

chat_data = test_finetune_data.chat_data  # the packed fine-tuning data (a fixture)

PER_STEP = 2
MOE_LAYERS = 2  # the tiny model: every block is MoE


def count_reads(rank: int, world: int, data: str, run_dir: str, parallel: dict, moe: dict,
                packed: bool = False) -> dict:
    sections = {"model": {"seq_len": 64, "vocab_size": 408}, "data": {"loss_mask": True, "document_mask": True}}
    cfg = tiny_config(data, run_dir, parallel=parallel, moe=moe, **(sections if packed else {}))
    trainer = Trainer(cfg, write_files=False)
    trainer.train_step()  # warm-up: lazy initialisation (optimizer state, DTensor caches)
    trainer._stop_agreed()
    counts, stacks = [], []
    for _ in range(2):
        with HostReadCounter("cpu", keep_stacks=True) as counter:
            trainer.train_step()
            trainer._stop_agreed()
        counts.append(counter.count)
        stacks = counter.stacks
    padding = sum(int(mb.padding.sum()) for mb in trainer.loader.next_batch() if mb.padding is not None)
    return {"counts": counts, "micro_batches": cfg.grad_accum_steps, "stacks": stacks, "padding": padding}


CASES = [
    # (parallel, moe, expected reads beyond PER_STEP per MoE layer per micro-batch)
    ({}, {"expert_backend": "grouped_mm"}, 0),
    ({}, {"expert_backend": "loop"}, 1),
    ({"dp": 2, "ep": 2}, {"expert_backend": "loop"}, 1),
    ({"dp": 2, "ep": 2}, {"expert_backend": "grouped_mm"}, 1),
]


@pytest.mark.parametrize("parallel, moe, per_layer", CASES,
                         ids=["1proc-grouped_mm", "1proc-loop", "dp2-ep2-loop", "dp2-ep2-grouped_mm"])
@pytest.mark.parametrize("data", ["pretraining", "packed"])
def test_host_reads_per_step(parallel, moe, per_layer, data, tiny_shards, chat_data, tmp_path):
    world = parallel.get("dp", 1)
    packed = data == "packed"
    results = run_distributed(count_reads, world, str(chat_data["shards"] if packed else tiny_shards), str(tmp_path),
                              parallel, moe, packed)
    for rank, r in enumerate(results):
        assert (r["padding"] > 0) == packed, "the packed data's batches must hold padding the MoE does not route"
        expected = PER_STEP + per_layer * MOE_LAYERS * r["micro_batches"]
        assert r["counts"] == [expected, expected], (
            f"rank {rank}: {r['counts']} host reads per step, expected {expected}; last step's reads:\n"
            + "\n----\n".join(r["stacks"]))


def test_counter_sees_every_kind_of_read():
    import numpy as np
    import torch

    t = torch.tensor([1.5])
    with HostReadCounter("cpu") as c:
        float(t), int(t), bool(t), t.item(), t.tolist(), t.cpu(), np.asarray(t), t.numpy()
        t + 1, t.to("cpu")  # not reads (the second keeps the device)
    assert c.count == 8, c.kinds
    with HostReadCounter("cuda") as c:
        t.item()  # a host tensor: no device read
    assert c.count == 0
