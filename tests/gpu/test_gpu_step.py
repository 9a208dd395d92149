"""GPU-only checks (marker ``gpu``; skipped without CUDA, never in CI): the bf16 step on a CUDA
device reads the host once per step and hides no synchronizing CUDA call, and the expert
backends agree on the device. ``benchmarks/gpu_check.py`` is the longer check with the demo.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from moetrain.train.host_sync import HostReadCounter
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def step_syncs(rank: int, world: int, data: str, run_dir: str, backend: str) -> dict:
    cfg = tiny_config(data, run_dir, train={"precision": "bf16"}, moe={"expert_backend": backend},
                      model={"hidden": 64, "ffn_hidden": 128}, )
    trainer = Trainer(cfg, write_files=False)  # initialises cpu:gloo,cuda:nccl itself
    trainer.train_step()
    with warnings.catch_warnings(record=True) as caught, HostReadCounter("cuda") as reads:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            losses = [trainer.train_step().loss for _ in range(3)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    return {"reads": reads.count, "syncs": syncs, "losses": losses, "device": str(trainer.device)}


def test_bf16_step_reads_the_host_once(tiny_shards, tmp_path):
    r = run_distributed(step_syncs, 1, str(tiny_shards), str(tmp_path), "grouped_mm", init=False)[0]
    assert r["device"].startswith("cuda")
    assert r["reads"] == 3, r  # the metrics vector, once per step
    assert len(r["syncs"]) <= 3, r["syncs"]  # that read's own synchronisation, nothing hidden


def test_expert_backends_agree_on_cuda():
    from moetrain.model.moe import GroupedExperts

    torch.manual_seed(0)
    dev = torch.device("cuda")
    out = {}
    for backend in ("loop", "grouped_mm"):
        torch.manual_seed(0)
        ex = GroupedExperts(64, 128, 4, backend=backend).to(dev)
        for w in (ex.w1, ex.w3, ex.w2):
            torch.nn.init.normal_(w, std=0.05)
        ex.compute_dtype = torch.bfloat16
        x = torch.randn(40, 64, device=dev, requires_grad=True)
        counts = torch.tensor([10, 0, 25, 5], device=dev)
        y = ex(x, counts)
        y.float().pow(2).sum().backward()
        out[backend] = (y.float(), x.grad, ex.w1.grad)
    for a, b in zip(out["loop"], out["grouped_mm"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def _needs(module: str):
    import importlib.util

    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"needs {module}")


@_needs("megablocks")
def test_megablocks_experts_equal_loop():
    from moetrain.model.moe import GroupedExperts

    dev = torch.device("cuda")
    out = {}
    for backend in ("loop", "megablocks"):
        torch.manual_seed(0)
        ex = GroupedExperts(128, 256, 4, backend=backend).to(dev)
        for w in (ex.w1, ex.w3, ex.w2):
            torch.nn.init.normal_(w, std=0.05)
        ex.compute_dtype = torch.bfloat16
        x = torch.randn(64, 128, device=dev, requires_grad=True)
        y = ex(x, torch.tensor([16, 0, 40, 8], device=dev))
        y.float().pow(2).sum().backward()
        out[backend] = (y.float(), x.grad, ex.w1.grad)
    for a, b in zip(out["loop"], out["megablocks"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@_needs("flash_attn")
@pytest.mark.parametrize("with_doc", [False, True])
def test_flash_attention_equals_sdpa(with_doc):
    from moetrain.model.attention import DocumentMask, FlashAttention, sdpa_attention

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(2, h, 256, 64, device=dev, generator=g, dtype=torch.bfloat16, requires_grad=True)
               for h in (8, 4, 4))
    doc = None
    if with_doc:
        ids = torch.repeat_interleave(torch.arange(4, device=dev), torch.tensor([50, 70, 100, 36], device=dev))
        doc = DocumentMask(torch.stack([ids, ids.flip(0)]), torch.arange(256, device=dev))
    outs = []
    for kernel in (FlashAttention(), sdpa_attention):
        out = kernel(q, k, v, doc)
        out.float().sum().backward()
        outs.append((out.float(), q.grad.clone()))
        q.grad = k.grad = v.grad = None
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=5e-2, atol=5e-2)
