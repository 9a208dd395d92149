"""The architectures of 2025-26 — DeepSeek-V3 (MLA, multi-token prediction, group-limited
routing with a score-correction bias), GLM-4.5 (partial RoPE, q/k norm, attention biases),
GPT-OSS (attention sinks, alternating sliding windows, router and expert biases, clamped SwiGLU,
YaRN), Llama 4 (NoPE blocks with temperature tuning, chunked attention, the l2 q/k norm, top-1
routing on the expert's input) and MiniMax-M2 (q/k norms over the whole projection, partial RoPE,
sigmoid routing with a score-correction bias) — train in every layout as in one process.

Each layout runs 20 steps with gradient clipping against one process: losses (and the MTP loss)
within 1e-5 relative per step, gradient norms within 1e-5 relative, and the first step's
gradients within the test_equivalence tolerance. 20 steps let a small error (a wrong scale on one
rank's heads, a lost gradient on the last stage's copy of the embedding) grow visible.
"""

from __future__ import annotations

import pytest

from moetrain.train.trainer import Trainer

from conftest import tiny_config
from multiproc import run_distributed
from test_equivalence import assert_matches, steps_with_first_grads

STEPS = 20

DEEPSEEK_V3 = {
    "model": {"layers": 3, "attention": "mla", "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8,
              "qk_rope_head_dim": 4, "v_head_dim": 6, "rope_scaling": "yarn", "rope_scaling_factor": 4.0,
              "rope_original_max_positions": 8, "rope_mscale": 1.0, "rope_mscale_all_dim": 1.0, "mtp_depth": 1,
              "mtp_loss_coef": 0.3},
    "moe": {"num_experts": 8, "top_k": 2, "first_dense": 1, "shared_experts": 1, "score_function": "sigmoid",
            "n_group": 4, "topk_group": 2, "routing_bias": True, "bias_update_rate": 0.001,
            "routed_scaling_factor": 2.5},
}
GLM4_MOE = {
    "model": {"layers": 2, "partial_rotary_factor": 0.5, "qk_norm": "head", "qkv_bias": True},
    "moe": {"num_experts": 4, "top_k": 2, "first_dense": 0, "shared_experts": 1, "score_function": "sigmoid",
            "n_group": 2, "topk_group": 1, "routing_bias": True, "routed_scaling_factor": 1.5},
}
GPT_OSS = {
    "model": {"layers": 2, "attention_sinks": True, "sliding_window": 5, "window_every": 2, "qkv_bias": True,
              "attention_out_bias": True, "rope_scaling": "yarn", "rope_scaling_factor": 4.0,
              "rope_original_max_positions": 8},
    "moe": {"num_experts": 4, "top_k": 2, "shared_experts": 0, "router_bias": True, "expert_biases": True,
            "activation": "clamped_swiglu", "swiglu_limit": 0.05},
}
# Llama 4: block 0 rotates, attends within chunks of 8 positions (a 16-token sample holds two;
# under cp2 each rank's two quarters meet keys of both chunks) and normalises q/k after RoPE; block
# 1 is NoPE with temperature tuning (floor_scale 4: the scale steps every 4 positions) and the MoE:
# top-1 sigmoid routing on the expert's input and a shared expert.
LLAMA4 = {
    "model": {"layers": 2, "no_rope_layers": [1, 0], "attention_chunk_size": 8, "qk_norm": "l2",
              "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.1},
    "moe": {"num_experts": 4, "top_k": 1, "every": 2, "shared_experts": 1, "score_function": "sigmoid",
            "norm_topk_prob": False, "apply_probs_on_input": True},
}
# MiniMax-M2: q/k norms over the whole projection (their statistic summed over tp), half of each
# head rotated, sigmoid routing with a score-correction bias, the top-k renormalised.
MINIMAX_M2 = {
    "model": {"layers": 2, "qk_norm": "projection", "partial_rotary_factor": 0.5},
    "moe": {"num_experts": 4, "top_k": 2, "shared_experts": 0, "score_function": "sigmoid", "routing_bias": True,
            "bias_update_rate": 0.001, "norm_topk_prob": True},
}
ARCHS = {"deepseek_v3": DEEPSEEK_V3, "glm4_moe": GLM4_MOE, "gpt_oss": GPT_OSS, "llama4_text": LLAMA4,
         "minimax_m2": MINIMAX_M2}


def train(rank: int, world: int, data: str, run_dir: str, arch: str, parallel: dict, data_section: dict) -> dict:
    spec = ARCHS[arch]
    # A vocabulary that tp = 2 splits.
    cfg = tiny_config(data, run_dir, parallel=parallel, model={"vocab_size": 260, **spec["model"]}, moe=spec["moe"],
                      data=data_section, train={"steps": STEPS, "grad_clip": 0.5})
    results, grads = steps_with_first_grads(Trainer(cfg, write_files=False), STEPS)
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "mtp": [r.extra.get("mtp_loss") for r in results], "grads": grads}


def world_of(parallel: dict) -> int:
    return parallel.get("pp", 1) * parallel.get("dp", 1) * parallel.get("cp", 1) * parallel.get("tp", 1)


REFERENCES: dict = {}  # one-process runs, shared by the layouts of an architecture


def reference(arch: str, data_section: dict, shards, tmp_path) -> dict:
    key = (arch, str(shards), tuple(sorted(data_section.items())))
    if key not in REFERENCES:
        REFERENCES[key] = run_distributed(train, 1, str(shards), str(tmp_path / "ref"), arch, {}, data_section)[0]
    return REFERENCES[key]


# Every architecture in tp2 + SP with ep, cp2 with ep, and pp2 with ep: 20 steps each.
LAYOUTS = {
    "dp2-tp2-sp-ep2": {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True},
    "cp2-ep2": {"cp": 2, "ep": 2},
    "pp2-dp2-ep2": {"pp": 2, "dp": 2, "ep": 2},
}
CASES = [(arch, layout) for arch in ARCHS for layout in LAYOUTS]


@pytest.mark.parametrize("arch, layout", CASES, ids=[f"{a}-{lay}" for a, lay in CASES])
@pytest.mark.slow(fast=["gpt_oss-pp2-dp2-ep2"])
def test_twenty_steps_equal_one_process(arch, layout, tiny_shards, tmp_path):
    parallel = LAYOUTS[layout]
    if parallel.get("pp", 1) > 1 and ARCHS[arch]["model"]["layers"] % 2:
        parallel = {**parallel, "pp_first_stage_layers": 1}
    assert_layout_matches(arch, parallel, {}, tiny_shards, tmp_path)


def assert_layout_matches(arch: str, parallel: dict, data_section: dict, shards, tmp_path) -> None:
    ref = reference(arch, data_section, shards, tmp_path)
    results = run_distributed(train, world_of(parallel), str(shards), str(tmp_path / "run"), arch, parallel,
                              data_section)
    got = {"losses": results[0]["losses"], "grads": {}}
    for r in results:
        got["grads"].update(r["grads"])
    assert ref["losses"][-1] < ref["losses"][0] - 0.5, "the reference must learn"
    assert max(ref["norms"]) > 0.5, "the test must clip"
    assert_matches(got, ref)
    for step, (a, b) in enumerate(zip(results[0]["norms"], ref["norms"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: grad norm {a} vs single-process {b}"
    if ARCHS[arch]["model"].get("mtp_depth"):
        assert all(m is not None and m > 0 for m in ref["mtp"]), "the MTP loss must be logged"
        for step, (a, b) in enumerate(zip(results[0]["mtp"], ref["mtp"]), 1):
            assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: MTP loss {a} vs single-process {b}"


# Document masks (several short documents per sample) under ring attention and across pipeline
# stages: MLA's narrower
# values and the sliding window with sinks cross the chunk and document boundaries. The
# recomputation options: MLA's up-projections only (Megatron-Core's mla_up_proj) and full.
EXTRA = [
    ("deepseek_v3", {"cp": 2, "ep": 2}, True),
    ("gpt_oss", {"cp": 2, "dp": 2, "ep": 2}, True),
    # Under pipeline parallelism the document ids reach every stage (a keyword argument).
    ("glm4_moe", {"pp": 2, "dp": 2, "ep": 2}, True),
    ("deepseek_v3", {"tp": 2, "sequence_parallel": True, "activation_checkpointing": "mla_up_proj"}, False),
    ("deepseek_v3", {"dp": 2, "ep": 2, "zero_stage": 3, "activation_checkpointing": "full"}, False),
    # Llama 4's chunks and document masks across the cp shards; and plain dp2 × ep2.
    ("llama4_text", {"cp": 2, "ep": 2}, True),
    ("llama4_text", {"dp": 2, "ep": 2}, False),
    ("minimax_m2", {"dp": 2, "ep": 2}, False),
]


@pytest.mark.parametrize("arch, parallel, docs", EXTRA,
                         ids=[f"{a}-" + "-".join(f"{k}{v}" for k, v in p.items()) + ("-docs" if d else "")
                              for a, p, d in EXTRA])
@pytest.mark.slow
def test_documents_and_recomputation_equal_one_process(arch, parallel, docs, tiny_shards, short_doc_shards,
                                                       tmp_path):
    data_section = {"document_mask": True} if docs else {}
    assert_layout_matches(arch, parallel, data_section, short_doc_shards if docs else tiny_shards, tmp_path)


def train_and_save(rank: int, world: int, data: str, run_dir: str, parallel: dict, n_steps: int) -> dict:
    spec = ARCHS["deepseek_v3"]
    cfg = tiny_config(data, run_dir, parallel=parallel, model={"vocab_size": 260, **spec["model"]}, moe=spec["moe"],
                      train={"steps": 8, "grad_clip": 0.5}, checkpoint={"resume": True, "every": 0})
    trainer = Trainer(cfg, write_files=False)
    start = trainer.step
    losses = [trainer.train_step().loss for _ in range(n_steps)]
    trainer.save_checkpoint()
    return {"start": start, "losses": losses}


def test_mtp_checkpoint_from_pp2_resumes_in_one_process(tiny_shards, tmp_path):
    """The last stage's copy of the embedding is saved under the embedding's own name, once: a
    pp2 checkpoint of an MTP model resumes in one process as if never stopped."""
    whole = run_distributed(train_and_save, 1, str(tiny_shards), str(tmp_path / "whole"), {}, 8)[0]
    pp = {"pp": 2, "dp": 2, "ep": 2, "pp_first_stage_layers": 1}
    first = run_distributed(train_and_save, 4, str(tiny_shards), str(tmp_path / "split"), pp, 4)[0]
    second = run_distributed(train_and_save, 1, str(tiny_shards), str(tmp_path / "split"), {}, 4)[0]
    assert second["start"] == 4
    for step, (a, b) in enumerate(zip(first["losses"] + second["losses"], whole["losses"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} across the resume vs {b} uninterrupted"
