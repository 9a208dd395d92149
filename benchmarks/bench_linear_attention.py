"""Gated-DeltaNet, KDA and Mamba-2 token mixers against the attention they replace, forward +
backward, on this machine's reference paths (pure PyTorch chunked delta rules and SSD scan; SDPA
causal attention), at long sequences. Prints JSON.

One block's token mixer scaled to a CPU (hidden 512; attention: 8 heads of 64, 2 kv heads, RoPE;
gated DeltaNet: 4 key heads and 8 value heads of 64, convolution 4, chunks of 64; KDA: 8 heads of
64, convolutions 4, chunks of 16 — its reference path holds chunk² × 64 values per head and chunk,
so a shorter chunk keeps 16K tokens in memory; Mamba-2: 16 heads of 64, state 64, 2 groups,
convolution 4, chunks of 128), batch 1, fp32, one thread per core of the process. For each sequence length:
median seconds of forward + backward over ``--rounds`` (after a warm-up), their ratio, and the
planner's forward FLOPs per token of each mixer (moetrain.planner.model.ModelShape: projections
and the attention scores or the delta rule) with their ratio — what the time ratio should follow
where the GEMMs dominate.

    python benchmarks/bench_linear_attention.py [--seq 4096 16384 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moetrain.config import config_from_dict  # noqa: E402
from moetrain.model.gated_deltanet import GatedDeltaNet  # noqa: E402
from moetrain.model.kda import KimiDeltaAttention  # noqa: E402
from moetrain.model.layers import Attention, rope_cos_sin  # noqa: E402
from moetrain.model.mamba2 import Mamba2  # noqa: E402
from moetrain.planner.model import ModelShape  # noqa: E402

D, HEADS, KV, DH = 512, 8, 2, 64
HK, HV, DK, DV, CONV, CHUNK = 4, 8, 64, 64, 4, 64
MH, MP, MN, MG, MCHUNK = 16, 64, 64, 2, 128
KH, KCHUNK = 8, 16
MIXERS = ("gated_deltanet", "kda", "mamba2")


def _time(fn, rounds: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _shape(seq: int, mixer: str) -> ModelShape:
    model = {"layers": 1, "hidden": D, "heads": HEADS, "kv_heads": KV, "ffn_hidden": 1024, "vocab_size": 128,
             "seq_len": seq}
    if mixer == "gated_deltanet":
        model.update(layer_types=["linear_attention"], linear_num_key_heads=HK, linear_num_value_heads=HV,
                     linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=CONV,
                     linear_chunk_size=CHUNK)
    elif mixer == "kda":
        model.update(layer_types=["kda"], linear_num_key_heads=KH, linear_num_value_heads=KH,
                     linear_key_head_dim=DK, linear_value_head_dim=DK, linear_conv_kernel_dim=CONV,
                     linear_chunk_size=KCHUNK)
    elif mixer == "mamba2":
        model.update(layer_types=["mamba"], mamba_num_heads=MH, mamba_head_dim=MP, ssm_state_size=MN, n_groups=MG,
                     conv_kernel=CONV, mamba_chunk_size=MCHUNK)
    cfg = config_from_dict({"run": {"name": "b", "dir": "/tmp/b"}, "model": model, "moe": {"num_experts": 0},
                            "data": {"path": "/tmp"}}, validate_config=False)
    return ModelShape.from_config(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    attention = Attention(D, HEADS, KV, DH)
    gdn = GatedDeltaNet(D, HK, HV, DK, DV, CONV, 1e-6, CHUNK)
    mamba = Mamba2(D, MH, MP, MN, MG, CONV, True, 1e-5, MCHUNK)
    kda = KimiDeltaAttention(D, KH, DK, CONV, 1e-6, KCHUNK)
    with torch.no_grad():
        for module in (attention, gdn, mamba, kda):
            for p in module.parameters():
                p.normal_(0.0, 0.02)
        gdn.A_log.uniform_(0.0, 2.7)
        kda.A_log.uniform_(0.0, 2.7)
        mamba.A_log.copy_(torch.arange(1, MH + 1).log())
    rows = []
    for seq in args.seq:
        x = torch.randn(1, seq, D, requires_grad=True)
        cos, sin = rope_cos_sin(torch.arange(seq), DH, 10000.0)

        def attn_step():
            attention(x, cos, sin).sum().backward()

        def gdn_step():
            gdn(x).sum().backward()

        def mamba_step():
            mamba(x).sum().backward()

        def kda_step():
            kda(x).sum().backward()

        seconds = {"attention": _time(attn_step, args.rounds), "gated_deltanet": _time(gdn_step, args.rounds),
                   "kda": _time(kda_step, args.rounds), "mamba2": _time(mamba_step, args.rounds)}
        flops = {}
        for name in seconds:
            shape = _shape(seq, name)
            flops[name] = 2.0 * shape.attn_params + shape.attention_flops(causal=True)
        rows.append({"seq_len": seq, "seconds": seconds,
                     "over_attention": {n: seconds[n] / seconds["attention"] for n in MIXERS},
                     "planner_fwd_flops_per_token": flops,
                     "planner_over_attention": {n: flops[n] / flops["attention"] for n in MIXERS}})
    print(json.dumps({"bench": "linear_attention", "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "shape": {"hidden": D, "attention": f"{HEADS} heads x {DH}, {KV} kv heads",
                                "gated_deltanet": f"{HK} key / {HV} value heads x {DK}, conv {CONV}, chunk {CHUNK}",
                                "kda": f"{KH} heads x {DK}, conv {CONV}, chunk {KCHUNK}",
                                "mamba2": f"{MH} heads x {MP}, state {MN}, {MG} groups, conv {CONV}, chunk {MCHUNK}"},
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
