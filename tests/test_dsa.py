"""DeepSeek Sparse Attention (``model.dsa``, moetrain/model/dsa.py): the indexer's scores and
top-k as the report defines them, the masked attention, the two training stages, and every layout
equal to one process.

* the indexer's scores equal the report's eq. 1 written out per head and key; the selection keeps
  the k best visible keys (all of them when fewer are visible; none from another document);
* the sparse stage with k ≥ the sequence attends as dense MLA: the language-model losses of 20
  steps equal those of the same model without DSA;
* the dense warm-up leaves every main weight bit-identical and lowers the indexer loss; the
  sparse stage trains both;
* dp2 × ep2, dp2 × tp2 + SP × ep2, pp2 × dp2 × ep2 and cp2 × ep2 with documents: losses, the
  indexer loss, gradient norms (20 steps) and the first step's gradients equal one process, in
  both stages.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.model.dsa import Indexer, select_topk, visible_keys
from moetrain.model.attention import DocumentMask
from moetrain.model.layers import rope_cos_sin
from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed
from test_equivalence import assert_matches, steps_with_first_grads

STEPS = 20
MLA = {"vocab_size": 260, "layers": 2, "init_std": 0.1, "attention": "mla", "q_lora_rank": 16, "kv_lora_rank": 12,
       "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}


def dsa(stage: str, topk: int = 6) -> dict:
    return {"index_topk": topk, "index_heads": 4, "index_head_dim": 8, "stage": stage}


# -- the indexer against the report's formula ----------------------------------------------------


def test_scores_and_selection_follow_the_report():
    torch.manual_seed(0)
    B, S, D, Cq, H, Di, Dr = 2, 12, 16, 8, 3, 8, 4
    idx = Indexer(D, Cq, H, Di, Dr, topk=5)
    for p in idx.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x, c_q = torch.randn(B, S, D), torch.randn(B, S, Cq)
    cos, sin = rope_cos_sin(torch.arange(S), Dr, 10000.0)
    got = idx.scores(x, c_q, cos, sin)
    # eq. 1 written out: Σ_j w_tj · ReLU(q_tj · k_s / √Di), w = x W_w / √H, RoPE on the first Dr dims
    q = idx.wq_b(c_q).view(B, S, H, Di)
    k = torch.nn.functional.layer_norm(idx.wk(x), (Di,), idx.k_norm.weight, idx.k_norm.bias, 1e-6)
    rot = torch.zeros(S, Di, Di)
    for t in range(S):
        rot[t] = torch.eye(Di)
        for i in range(Dr // 2):
            c, s = cos[t, i], sin[t, i]
            rot[t, 2 * i:2 * i + 2, 2 * i:2 * i + 2] = torch.tensor([[c, -s], [s, c]])
    q = torch.einsum("tij,bthj->bthi", rot, q)
    k = torch.einsum("tij,btj->bti", rot, k)
    w = idx.weights_proj(x) * H ** -0.5
    want = torch.zeros(B, S, S)
    for b in range(B):
        for t in range(S):
            for s in range(S):
                want[b, t, s] = sum(w[b, t, j] * torch.relu(q[b, t, j] @ k[b, s] / Di ** 0.5) for j in range(H))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    doc = DocumentMask(ids, torch.arange(S))
    visible = visible_keys(torch.arange(S), torch.arange(S), doc, B)
    chosen = select_topk(got, visible, 5)
    for b in range(B):
        for t in range(S):
            seen = visible[b, t].nonzero().flatten()
            picked = chosen[b, t].nonzero().flatten()
            assert set(picked.tolist()) <= set(seen.tolist())  # never a later key or another document's
            assert len(picked) == min(5, len(seen))
            # the k best: none left out scores higher than one kept (ties at ReLU's zeros either way)
            left = sorted(set(seen.tolist()) - set(picked.tolist()))
            if left:
                assert got[b, t, picked].min() >= got[b, t, left].max()


# -- the two stages in one process ---------------------------------------------------------------


def train(rank: int, world: int, data: str, run_dir: str, parallel: dict, model: dict, data_section: dict,
          steps: int = STEPS, clip: float = 0.5) -> dict:
    cfg = tiny_config(data, run_dir, parallel=parallel, model=model, moe={"num_experts": 4, "top_k": 2},
                      data=data_section, train={"steps": steps, "grad_clip": clip})
    trainer = Trainer(cfg, write_files=False)
    before = {n: p.detach().clone() for part in trainer.model_parts for n, p in part.named_parameters()
              if not isinstance(p, torch.distributed.tensor.DTensor)}
    results, grads = steps_with_first_grads(trainer, steps)
    moved = sorted(n for part in trainer.model_parts for n, p in part.named_parameters()
                   if n in before and not torch.equal(before[n], p.detach()))
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "indexer": [r.extra.get("indexer_loss") for r in results], "grads": grads, "moved": moved}


def test_sparse_with_k_over_the_sequence_is_dense_mla(tiny_shards, tmp_path):
    # No clipping: the indexer's gradients would join the clipped norm and change the main model's
    # steps; without it the main model's trajectory is the dense model's.
    plain = run_distributed(train, 1, str(tiny_shards), str(tmp_path / "a"), {}, MLA, {}, STEPS, 0.0)[0]
    dsa_all = run_distributed(train, 1, str(tiny_shards), str(tmp_path / "b"), {},
                              {**MLA, "dsa": dsa("sparse", topk=16)}, {}, STEPS, 0.0)[0]
    assert all(i is not None and i > 0 for i in dsa_all["indexer"])
    for step, (a, b) in enumerate(zip(dsa_all["losses"], plain["losses"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs dense MLA {b}"


def test_dense_warmup_trains_the_indexers_alone(tiny_shards, tmp_path):
    warm = run_distributed(train, 1, str(tiny_shards), str(tmp_path / "w"), {}, {**MLA, "dsa": dsa("dense_warmup")},
                           {})[0]
    indexer = {f"layers.{i}.attention.indexer.{n}" for i in range(2)
               for n in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")}
    assert set(warm["moved"]) == indexer, "only the indexers train in the dense warm-up, all of them"
    first, last = sum(warm["indexer"][:5]) / 5, sum(warm["indexer"][-5:]) / 5
    assert last < 0.8 * first, f"the indexer loss must fall: {first:.4f} → {last:.4f}"
    sparse = run_distributed(train, 1, str(tiny_shards), str(tmp_path / "s"), {}, {**MLA, "dsa": dsa("sparse")},
                             {})[0]
    assert indexer < set(sparse["moved"]), "the sparse stage trains the indexers and the model"
    assert sparse["losses"][-1] < sparse["losses"][0] - 0.5, "the sparse model must learn"


# -- every layout equal to one process, both stages -------------------------------------------------

LAYOUTS = {
    "dp2-ep2-zero3": {"dp": 2, "ep": 2, "zero_stage": 3},
    "dp2-tp2-sp-ep2": {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True},
    "pp2-dp2-ep2": {"pp": 2, "dp": 2, "ep": 2},
    "cp2-ep2-docs": {"cp": 2, "ep": 2},
}
REFERENCES: dict = {}
# Clipping thresholds below the steps' gradient norms (the warm-up's are the indexers' alone).
CLIP = {"dense_warmup": 0.02, "sparse": 0.5}
# Gradient norms' tolerance: fp32 reordering (1e-5 over 20 steps); in the warm-up the whole
# gradient is the indexers', softmax(I) − p per query, a difference of two distributions that
# agree to about 1e-2 (the KL is ~3e-3), so the rounding of each (1e-7 of its O(1/T) entries)
# is up to 1e-4 of the difference.
NORM_TOL = {"dense_warmup": 1e-4, "sparse": 1e-5}


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.slow(fast=["sparse-cp2-ep2-docs"])
def test_layouts_equal_one_process(layout, stage, tiny_shards, short_doc_shards, tmp_path):
    docs = layout.endswith("docs")
    shards, data_section = (short_doc_shards, {"document_mask": True}) if docs else (tiny_shards, {})
    model = {**MLA, "dsa": dsa(stage)}
    clip = CLIP[stage]
    key = (stage, docs)
    if key not in REFERENCES:
        REFERENCES[key] = run_distributed(train, 1, str(shards), str(tmp_path / "ref"), {}, model, data_section,
                                          STEPS, clip)[0]
    ref = REFERENCES[key]
    parallel = LAYOUTS[layout]
    world = parallel.get("pp", 1) * parallel.get("dp", 1) * parallel.get("cp", 1) * parallel.get("tp", 1)
    results = run_distributed(train, world, str(shards), str(tmp_path / "run"), parallel, model, data_section,
                              STEPS, clip)
    got = {"losses": results[0]["losses"], "grads": {}}
    for r in results:
        got["grads"].update(r["grads"])
    assert max(ref["norms"]) > clip, "the test must clip"
    assert_matches(got, ref)
    for step, (a, b, na, nb) in enumerate(zip(results[0]["indexer"], ref["indexer"], results[0]["norms"],
                                              ref["norms"]), 1):
        # The KL is a difference of cross-entropy terms of magnitude ln T ≈ 3: fp32 rounding of
        # those, reordered by the layout, bounds its error (1e-6 of them), not its own small value.
        assert abs(a - b) <= 3e-6, f"step {step}: indexer loss {a} vs single-process {b}"
        assert abs(na - nb) <= NORM_TOL[stage] * abs(nb), f"step {step}: grad norm {na} vs single-process {nb}"


# -- the gathered sparse attention (MLA's absorbed form over the selected latents) ----------------

GATHERED_LAYOUTS = {"one": {}, "dp2-tp2-sp-ep2": {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True},
                    "pp2-dp2-ep2": {"pp": 2, "dp": 2, "ep": 2}}


@pytest.mark.parametrize("layout", list(GATHERED_LAYOUTS))
def test_gathered_attention_equals_the_masked_one(layout, short_doc_shards, tmp_path):
    """``model.dsa.attention: gathered`` trains as the masked reference (the same selections, the
    same losses, indexer losses and gradient norms over 20 steps), with documents; in one process
    against one process, and in tp / pp layouts against the masked path in one process."""
    key = ("sparse", True)
    model = {**MLA, "dsa": dsa("sparse")}
    data_section = {"document_mask": True}
    if key not in REFERENCES:
        REFERENCES[key] = run_distributed(train, 1, str(short_doc_shards), str(tmp_path / "ref"), {}, model,
                                          data_section, STEPS, CLIP["sparse"])[0]
    ref = REFERENCES[key]
    parallel = GATHERED_LAYOUTS[layout]
    world = parallel.get("pp", 1) * parallel.get("dp", 1) * parallel.get("tp", 1)
    gathered = {**MLA, "dsa": {**dsa("sparse"), "attention": "gathered"}}
    results = run_distributed(train, world, str(short_doc_shards), str(tmp_path / "g"), parallel, gathered,
                              data_section, STEPS, CLIP["sparse"])
    got = {"losses": results[0]["losses"], "grads": {}}
    for r in results:
        got["grads"].update(r["grads"])
    assert_matches(got, ref)
    for step, (a, b, na, nb) in enumerate(zip(results[0]["indexer"], ref["indexer"], results[0]["norms"],
                                              ref["norms"]), 1):
        assert abs(a - b) <= 3e-6, f"step {step}: indexer loss {a} vs masked {b}"
        assert abs(na - nb) <= 1e-5 * abs(nb), f"step {step}: grad norm {na} vs masked {nb}"


# -- from the warm-up to the sparse stage -------------------------------------------------------------


def stage_run(rank: int, world: int, data: str, run_dir: str, stage: str, init_from: str | None) -> dict:
    from moetrain.utils import ConfigError

    cfg = tiny_config(data, run_dir, model={**MLA, "dsa": dsa(stage)}, moe={"num_experts": 4, "top_k": 2},
                      train={"steps": 4}, checkpoint={"resume": True, "every": 0, "init_from": init_from})
    try:
        trainer = Trainer(cfg, write_files=False)
    except ConfigError as e:
        return {"refused": str(e)}
    start = trainer.step
    losses = [trainer.train_step().loss for _ in range(2)]
    return {"start": start, "losses": losses, "saved": str(trainer.save_checkpoint())}


def test_the_sparse_stage_starts_from_the_warmups_weights(tiny_shards, tmp_path):
    warm = run_distributed(stage_run, 1, str(tiny_shards), str(tmp_path / "warm"), "dense_warmup", None)[0]
    # resuming the warm-up's run dir in the other stage is refused, naming the fix
    refused = run_distributed(stage_run, 1, str(tiny_shards), str(tmp_path / "warm"), "sparse", None)[0]
    assert "model.dsa.stage = 'dense_warmup'" in refused["refused"] and "checkpoint.init_from" in refused["refused"]
    sparse = run_distributed(stage_run, 1, str(tiny_shards), str(tmp_path / "sparse"), "sparse", warm["saved"])[0]
    assert sparse["start"] == 0 and all(x == x for x in sparse["losses"])
