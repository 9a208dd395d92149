"""Attention backends and the document mask: one causal attention (the demo's shape: 8 heads,
4 kv heads, head dim 32, 2 × 1024 tokens), each variant against plain causal SDPA in the same run.
Prints JSON.

* ``sdpa_document_mask`` — SDPA with the boolean causal ∧ same-document mask (documents of ~200
  tokens), forward + backward: what ``data.document_mask`` costs on CPU (the mask takes SDPA off
  its fused causal path).
* ``flex`` — flex_attention with the same block mask, forward only (no CPU backward in torch
  2.13), eager on CPU; on CUDA compiled, forward + backward, where it skips the masked blocks.
* ``flash`` — flash-attn, CUDA only, when installed.

    python benchmarks/bench_attention.py [--repeats 7 --threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from moetrain.model.attention import DocumentMask, FlashAttention, FlexAttention, sdpa_attention  # noqa: E402


def bench(fn, repeats: int, backward: bool, device) -> float:
    times = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if backward:
            out.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    B, H, G, D, S = 2, 8, 4, 32, a.seq
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, generator=g).to(device, dtype).requires_grad_() for h in (H, G, G))
    lengths = torch.randint(50, 350, (64,), generator=g)
    ids = torch.repeat_interleave(torch.arange(64), lengths)[:S]
    doc = lambda: DocumentMask(torch.stack([ids, ids.roll(97)]).to(device), torch.arange(S, device=device))  # noqa: E731
    train = device.type == "cuda"
    base_fwd = bench(lambda: sdpa_attention(q, k, v), a.repeats, False, device)
    base = bench(lambda: sdpa_attention(q, k, v), a.repeats, True, device)
    out = {"device": str(device), "dtype": str(dtype).split(".")[-1], "shape": {"B": B, "H": H, "G": G, "S": S, "Dh": D},
           "sdpa_causal_fwd_bwd_s": round(base, 5), "sdpa_causal_fwd_s": round(base_fwd, 5)}
    t = bench(lambda: sdpa_attention(q, k, v, doc()), a.repeats, True, device)
    out["sdpa_document_mask"] = {"fwd_bwd_s": round(t, 5), "over_sdpa_causal": round(t / base, 3)}
    flex = FlexAttention()
    qf, kf, vf = (t if train else t.detach() for t in (q, k, v))
    for name, d in (("flex", None), ("flex_document_mask", doc)):
        t = bench(lambda: flex(qf, kf, vf, d() if d else None), a.repeats, train, device)
        ref = base if train else base_fwd
        out[name] = {("fwd_bwd_s" if train else "fwd_s"): round(t, 5), "over_sdpa_causal": round(t / ref, 3)}
    if device.type == "cuda" and importlib.util.find_spec("flash_attn"):
        t = bench(lambda: FlashAttention()(q, k, v), a.repeats, True, device)
        out["flash"] = {"fwd_bwd_s": round(t, 5), "over_sdpa_causal": round(t / base, 3)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
