"""Framework overhead of one training step: moetrain's trainer vs a bare PyTorch loop over the
same model and batches (and Hugging Face transformers' Mixtral of the same dimensions when
transformers is installed), in one process, measured in the same run. Prints JSON.

* ``moetrain``: the real trainer loop (``Trainer.run``: loader, MoE statistics, gradient norm
  and clipping, one metrics read per step, ``metrics.jsonl``, heartbeats, stop-flag agreement);
  checkpoints and validation off. Time per step between step completions.
* ``bare``: the same ``moetrain.model.Transformer`` (same initial weights), the same AdamW
  (fused, same parameter groups), the same micro-batches prefetched in memory; forward,
  ``loss / accum`` backward per micro-batch, ``clip_grad_norm_``, step, ``loss.item()`` once per
  step — what a hand-written loop does.
* ``hf_mixtral``: ``transformers.MixtralForCausalLM`` built from a config of the same dimensions
  (no shared expert; Mixtral has none), its own router aux loss, same loop as ``bare``.

The rounds alternate between the variants (noisy shared machine); each figure is the median over
rounds of the mean step time of a round. The ratio to watch is ``moetrain_over_bare`` (goal:
≤ 1.05). Threads: the same for every variant (``--threads``, default: all cores).

    python tools/prepare_demo.py   # once: the demo shards
    python benchmarks/bench_step.py [--config configs/demo-moe.yaml --steps 8 --rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from moetrain.config import load_config  # noqa: E402
from moetrain.data.loader import BatchLoader  # noqa: E402
from moetrain.data.reader import TokenShards  # noqa: E402
from moetrain.launch.preflight import resolve_vocab  # noqa: E402
from moetrain.model.init import init_weights  # noqa: E402
from moetrain.model.layers import set_compute_dtype  # noqa: E402
from moetrain.model.transformer import Transformer  # noqa: E402
from moetrain.parallel.precision import compute_dtype  # noqa: E402
from moetrain.train.optim import build_optimizer  # noqa: E402
from multiproc import free_port  # noqa: E402


class _StepClock:
    """Stands in for the launcher's watchdog: the trainer calls ``step_done`` after every step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def step_done(self, step_time_s: float) -> None:
        self.times.append(time.perf_counter())


def _config(a):
    cfg = load_config(a.config, [
        "parallel.dp=1", "parallel.ep=1", "parallel.tp=1", "parallel.pp=1", "parallel.cp=1", "parallel.zero_stage=0",
        f"moe.shared_experts={a.shared_experts}", f"train.precision={a.precision}", "train.val_every=0",
        "checkpoint.every=0", "checkpoint.resume=false", f"moe.expert_backend={a.expert_backend}",
        f"data.path={a.data}", "data.verify=size", f"run.dir={a.run_dir}"])
    return resolve_vocab(cfg)


def _moetrain_round(trainer, steps: int) -> float:
    """Mean seconds per step of ``steps`` steps through ``Trainer.run``."""
    clock = _StepClock()
    trainer.watchdog = clock
    trainer.cfg = trainer.cfg.replace(train={"steps": trainer.step + steps})
    trainer.run()
    return (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1)


def _bare_model(cfg):
    model = Transformer.from_config(cfg)
    init_weights(model, cfg.run.seed, cfg.model.init_std, cfg.model.layers)
    set_compute_dtype(model, compute_dtype(cfg.train.precision))
    return model


def _hf_model(cfg):
    from transformers import MixtralConfig, MixtralForCausalLM

    m, moe = cfg.model, cfg.moe
    hf = MixtralConfig(vocab_size=m.vocab_size, hidden_size=m.hidden, intermediate_size=moe.ffn_hidden,
                       num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                       max_position_embeddings=m.seq_len, rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps,
                       num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                       router_aux_loss_coef=moe.aux_loss_coef, output_router_logits=True, tie_word_embeddings=False)
    hf._attn_implementation = "sdpa"
    model = MixtralForCausalLM(hf)
    if cfg.train.precision == "bf16":
        model.to(torch.bfloat16)  # transformers' own way: the whole model in bf16
    return model


def _loop_round(model, opt, batches, steps: int, hf: bool) -> float:
    """Mean seconds per step of a hand-written loop."""
    params = [p for p in model.parameters() if p.requires_grad]
    t0 = time.perf_counter()
    for s in range(steps):
        mbs = batches[s % len(batches)]
        for mb in mbs:
            if hf:
                loss = model(input_ids=mb.inputs, labels=mb.inputs).loss  # shifts internally
            else:
                logits = model(mb.inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), mb.targets.flatten())
            (loss / len(mbs)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/demo-moe.yaml"))
    ap.add_argument("--data", default=str(ROOT / "data/demo/shards"))
    ap.add_argument("--steps", type=int, default=8, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--shared-experts", type=int, default=0,
                    help="0 (default) keeps the model comparable with Mixtral, which has none")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--expert-backend", default="auto")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' Mixtral")
    a = ap.parse_args()
    if not (Path(a.data) / "manifest.json").is_file():
        sys.exit(f"no token shards in {a.data}: run `python tools/prepare_demo.py` first")
    torch.set_num_threads(a.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")

    from moetrain.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        a.run_dir = run_dir
        cfg = _config(a)
        trainer = Trainer(cfg)
        # The same micro-batches for the hand-written loops: the trainer's loader, prefetched.
        loader = BatchLoader(TokenShards(cfg.data.path, "train", verify="size"), cfg.model.seq_len,
                             cfg.train.global_batch_size, cfg.train.micro_batch_size, 0, 1, cfg.run.seed)
        batches = [loader.next_batch() for _ in range(a.steps)]
        variants = {"moetrain": lambda: _moetrain_round(trainer, a.steps + 1)}
        bare = _bare_model(cfg)
        bare_opt = build_optimizer(bare, cfg.train)
        variants["bare"] = lambda: _loop_round(bare, bare_opt, batches, a.steps, hf=False)
        hf_skipped = None
        if not a.no_hf:
            try:
                hf = _hf_model(cfg)
                hf_opt = build_optimizer(hf, cfg.train)
                variants["hf_mixtral"] = lambda: _loop_round(hf, hf_opt, batches, a.steps, hf=True)
            except ImportError as e:
                hf_skipped = f"transformers not installed ({e}); pip install -e '.[hf]'"
        for fn in variants.values():  # warm-up (allocator, first-step optimizer state)
            fn()
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(a.rounds):
            for name, fn in variants.items():
                times[name].append(fn())
        import torch.distributed as dist

        dist.destroy_process_group()

    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "config": a.config, "precision": a.precision, "threads": a.threads, "shared_experts": a.shared_experts,
        "expert_backend": trainer.model_parts[0].layers["0"].moe.experts.backend if cfg.moe.num_experts else None,
        "tokens_per_step": tokens, "steps_per_round": a.steps, "rounds": a.rounds,
        **{k: {"step_s": round(v, 4), "tokens_per_s": round(tokens / v, 1),
               "step_s_rounds": [round(x, 4) for x in times[k]]} for k, v in med.items()},
        "moetrain_over_bare": round(med["moetrain"] / med["bare"], 3),
    }
    if "hf_mixtral" in med:
        out["hf_mixtral_over_bare"] = round(med["hf_mixtral"] / med["bare"], 3)
    if hf_skipped:
        out["hf_mixtral"] = {"skipped": hf_skipped}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
