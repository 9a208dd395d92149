"""One DeepSeek-Sparse-Attention layer's training step against the same layer with dense MLA, on
this machine, at sequence lengths where the sparse one should and should not win; the planner's
attention FLOPs beside each. Prints JSON.

The layer is ``moetrain.model.mla.MLAttention`` (fp32, one sample, the CPU's own threads):
hidden 512, 8 heads, query rank 192, key-value rank 128, qk 32 + 16 RoPE, v 32; DSA's indexer 4
heads of 32, k = 512 keys per query. A step is its forward and backward (the indexer's loss
included for DSA), median of ``--repeats`` after one warm-up:

* ``dense`` — the layer without an indexer: SDPA's causal kernel (the CPU flash kernel, no S × S
  matrix kept); the baseline;
* ``dsa-gathered`` — ``model.dsa.attention: gathered`` (MLA's absorbed form over each query's
  selected latents, O(S·k)), and its ratio to ``dense``;
* ``dsa-masked`` — the reference path (dense scores masked by the selection), at the lengths its
  S × S masks fit.

Per length also the planner's forward attention FLOPs per token of both layers
(:meth:`moetrain.planner.model.ModelShape.attention_flops`, causal) and their ratio, the
prediction to read the measured ratio against.

    python benchmarks/bench_dsa.py [--lengths 4096 16384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

SHAPE = dict(hidden=512, heads=32, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
             v_head_dim=32)
INDEX = dict(index_heads=4, index_head_dim=32, index_topk=512)
MASKED_MAX = 4096  # the masked path holds [S, S] masks and scores per head


def layer(kind: str):
    import torch

    from moetrain.model.dsa import Indexer
    from moetrain.model.mla import MLAttention

    s = SHAPE
    indexer = None
    if kind != "dense":
        indexer = Indexer(s["hidden"], s["q_lora_rank"], INDEX["index_heads"], INDEX["index_head_dim"],
                          s["qk_rope_head_dim"], INDEX["index_topk"], "sparse", 1.0, gathered=kind == "dsa-gathered")
    mla = MLAttention(s["hidden"], s["heads"], s["q_lora_rank"], s["kv_lora_rank"], s["qk_nope_head_dim"],
                      s["qk_rope_head_dim"], s["v_head_dim"], (s["qk_nope_head_dim"] + s["qk_rope_head_dim"]) ** -0.5,
                      indexer=indexer)
    torch.manual_seed(0)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return mla.train()


def step_time(kind: str, seq: int, repeats: int) -> float:
    import torch

    from moetrain.model.layers import rope_cos_sin

    mla = layer(kind)
    x = torch.randn(1, seq, SHAPE["hidden"], requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(seq), SHAPE["qk_rope_head_dim"], 10000.0)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        out = mla(x, cos, sin)
        out.float().square().mean().backward()
        times.append(time.perf_counter() - t0)
        mla.zero_grad(set_to_none=True)
        x.grad = None
    return statistics.median(times[1:])


def planner_flops(seq: int, dsa: bool) -> float:
    from moetrain.planner.model import ModelShape

    s = SHAPE
    extra = dict(dsa_topk=INDEX["index_topk"], index_heads=INDEX["index_heads"],
                 index_head_dim=INDEX["index_head_dim"]) if dsa else {}
    shape = ModelShape(layers=1, hidden=s["hidden"], heads=s["heads"], kv_heads=s["heads"], ffn=1, vocab=1,
                       seq_len=seq, tie_embeddings=False, num_experts=0, top_k=0, expert_ffn=0, shared_experts=0,
                       moe_layer_flags=(False,), head_dim_override=s["qk_nope_head_dim"] + s["qk_rope_head_dim"],
                       v_head_dim=s["v_head_dim"], q_lora_rank=s["q_lora_rank"], kv_lora_rank=s["kv_lora_rank"],
                       qk_rope_dim=s["qk_rope_head_dim"], **extra)
    return shape.attention_flops(causal=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch

    out = {"machine": {"threads": torch.get_num_threads(), "torch": torch.__version__},
           "shape": {**SHAPE, **INDEX}, "lengths": {}}
    for seq in args.lengths:
        row: dict = {}
        kinds = ["dense", "dsa-gathered"] + (["dsa-masked"] if seq <= MASKED_MAX else [])
        for kind in kinds:
            print(f"S={seq} {kind} ...", file=sys.stderr, flush=True)
            row[kind] = {"step_s": round(step_time(kind, seq, args.repeats), 4)}
        for kind in kinds[1:]:
            row[kind]["vs_dense"] = round(row[kind]["step_s"] / row["dense"]["step_s"], 3)
        dense_f, dsa_f = planner_flops(seq, False), planner_flops(seq, True)
        row["planner"] = {"dense_attention_flops_per_token": dense_f, "dsa_attention_flops_per_token": dsa_f,
                          "dsa_vs_dense": round(dsa_f / dense_f, 3)}
        out["lengths"][str(seq)] = row
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
