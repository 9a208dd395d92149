"""``train.qk_clip`` (MuonClip's QK-clip, moetrain/train/qk_clip.py): the per-head largest logit
against a brute-force computation, each clipped head's logits landing exactly on τ (grouped-query
attention and MLA), the same clipped training in one process and in sharded layouts over 20
steps, and the settings that cannot compose refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.model.attention import DocumentMask, head_max_logits
from moetrain.model.layers import Attention
from moetrain.model.mla import MLAttention
from moetrain.model.transformer import Transformer
from moetrain.train.qk_clip import QKClip
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed

STEPS = 20
MLA = {"attention": "mla", "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 8}


@pytest.mark.parametrize("window, documents", [(None, False), (5, False), (None, True)])
def test_head_max_logits_is_the_largest_visible_score(window, documents):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 12, 8, generator=g), torch.randn(2, 3, 12, 8, generator=g)  # 6 query heads, 3 key heads
    doc = DocumentMask(torch.tensor([[0] * 5 + [1] * 7, [0] * 12]), torch.arange(12)) if documents else None
    got = head_max_logits(q, k, 0.3, doc, window)
    for h in range(6):
        best = float("-inf")
        for b in range(2):
            for i in range(12):
                for j in range(i + 1):
                    if window is not None and i - j >= window:
                        continue
                    if documents and doc.doc_ids[b, i] != doc.doc_ids[b, j]:
                        continue
                    best = max(best, 0.3 * float(q[b, h, i] @ k[b, h // 2, j]))
        assert got[h].item() == pytest.approx(best, rel=1e-5)


ONE_RANK = SimpleNamespace(size=lambda axis: 1, coord=lambda axis: 0, world_size=1, group=lambda axis: None,
                           device=torch.device("cpu"))


@pytest.mark.parametrize("model", [{"kv_heads": 2, "qkv_bias": True}, MLA], ids=["gqa-bias", "mla"])
def test_each_clipped_head_lands_on_tau(model, tmp_path):
    """The first attention layer's heads, before and after one clip, on the same batch: a head
    over τ now peaks at τ, the others are unchanged (later layers see a changed input)."""
    cfg = tiny_config("x", tmp_path, model=model)
    torch.manual_seed(0)
    net = Transformer.from_config(cfg)
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    clip = QKClip([net], tau=1.0, ps=ONE_RANK)
    first = next(m for m in net.modules() if isinstance(m, (Attention, MLAttention)))
    with torch.no_grad():
        net(tokens)
        before = first.max_logit.clone()
        clip.tau = before.sort().values[1:3].mean().item()  # two heads above τ, two below
        clip.apply()
        net(tokens)
    after = first.max_logit
    assert (before > clip.tau).sum() == 2
    torch.testing.assert_close(after, before.clamp(max=clip.tau), rtol=1e-4, atol=1e-6)


# below the tiny models' largest logits (about 0.05 unclipped; MLA's 0.026), so heads are clipped
TAU = {"gqa": 0.03, "mla": 0.02}


def clip_run(rank: int, world: int, data: str, run_dir: str, parallel: dict, model: str) -> dict:
    cfg = tiny_config(data, run_dir, parallel=parallel, model={"vocab_size": 260, **(MLA if model == "mla" else {})},
                      train={"steps": STEPS, "optimizer": "muon", "grad_clip": 1.0, "qk_clip": TAU[model]})
    trainer = Trainer(cfg, write_files=False)
    results = [trainer.train_step() for _ in range(STEPS)]
    return {"losses": [r.loss for r in results], "max_logit": [r.extra["max_logit"] for r in results]}


@pytest.fixture(scope="module")
def one_process(tiny_shards, tmp_path_factory):
    return {name: run_distributed(clip_run, 1, str(tiny_shards), str(tmp_path_factory.mktemp(name)), {}, name)[0]
            for name in TAU}


@pytest.mark.parametrize("parallel, model", [
    ({"dp": 2, "ep": 2, "zero_stage": 3}, "gqa"), ({"tp": 2, "sequence_parallel": True}, "gqa"),
    ({"pp": 2}, "gqa"), ({"tp": 2}, "mla")], ids=["dp2-ep2-zero3", "tp2-sp", "pp2", "mla-tp2"])
@pytest.mark.slow
def test_clipped_training_is_the_same_in_sharded_layouts(parallel, model, one_process, tiny_shards, tmp_path):
    """20 steps with heads clipped: the largest logit and the loss of each step equal one
    process's within 1e-5 relative (each tp rank clips its own heads' rows, each FSDP rank its
    shard's)."""
    ref = one_process[model]
    outs = run_distributed(clip_run, 2, str(tiny_shards), str(tmp_path), parallel, model)
    for step, (a, b) in enumerate(zip(outs[0]["losses"], ref["losses"]), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs one process {b}"
    assert outs[0]["max_logit"] == outs[-1]["max_logit"]  # every rank reports the model's (pp: both stages')
    for step, (a, b) in enumerate(zip(outs[0]["max_logit"], ref["max_logit"]), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: max logit {a} vs one process {b}"
    assert max(ref["max_logit"][5:]) < 1.2 * TAU[model] < ref["max_logit"][0]  # clipped: it stays near τ


@pytest.mark.parametrize("sections, match", [
    ({"parallel": {"cp": 2, "dp": 1}}, "context parallelism"),
    ({"model": {"qk_norm": "head"}}, "divides out"),
    ({"train": {"compile": True}}, "not proved under train.compile"),
    ({"train": {"qk_clip": -1.0}}, "must be positive"),
])
def test_qk_clip_settings_that_cannot_compose_are_refused(sections, match):
    train = {"qk_clip": 10.0, **sections.pop("train", {})}
    with pytest.raises(ConfigError, match=match) as e:
        tiny_config("x", "y", train=train, **sections)
    assert "train.qk_clip" in str(e.value)
