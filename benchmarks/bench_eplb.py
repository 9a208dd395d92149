"""EPLB in training (``moe.eplb``) against the plain run on a real SLURM allocation of 2 nodes
(the dev cluster: ``slurm/dev-cluster up``), with a skewed router. Prints JSON.

The demo model in dp2 × ep2 over 2 nodes × 1 task (one rank per core of this machine), its
routers made to favour experts 6 and 7 by a fixed score-correction bias (``moe.routing_bias``,
``--bias`` added to their choice scores; both start on ep rank 1, and EPLB's first placement —
experts in order, then replicas of experts 0 and 1 — holds them once), trained ``--steps``
steps from the same initial weights (``checkpoint.init_from``) twice: without EPLB (the baseline,
in the same invocation) and with ``--redundant`` spare slots re-placed every ``--every`` steps
from the last ``--window`` steps' loads (default ``--every``); ``--lr`` holds the learning rate
constant (late in training, where routing moves slowly). Reported per run, over the steps after the first
re-placement: the busiest ep rank's tokens over the mean (measured:
``expert_load.<layer>.rank_max_over_mean``, the mean over layers, then the median over steps),
the step time (median), the share of experts 6 and 7 in the assignments, and the losses; for
EPLB also each re-placement's slots moved, bytes and seconds, and the ratios to the baseline.

    slurm/dev-cluster up && python tools/prepare_demo.py
    python benchmarks/bench_eplb.py [--steps 30 --every 10 --window 10 --redundant 2 --bias 0.1 --lr 2e-4
                                     --global-batch 64 --aux-loss-coef 0 --keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ["launch.cluster=slurm", "launch.nodes=2", "launch.tasks_per_node=1", "parallel.dp=2", "parallel.ep=2",
          "moe.routing_bias=true", "train.val_every=0", "checkpoint.every=0", "checkpoint.resume=false",
          "launch.time_min=20"]


def skewed_weights(out: Path, bias: float) -> None:
    """The demo's initial weights with ``bias`` on the last two experts of every router's
    choice scores, as a weights directory."""
    sys.path.insert(0, str(ROOT))
    from moetrain.config import load_config
    from moetrain.data.sources import resolve_vocab
    from moetrain.model.init import init_weights
    from moetrain.model.transformer import Transformer
    from moetrain.train.weights import write_weights_dir

    cfg = resolve_vocab(load_config(str(ROOT / "configs/demo-moe.yaml"), LAYOUT))
    model = Transformer.from_config(cfg)
    init_weights(model, cfg.run.seed, cfg.model.init_std, cfg.model.layers)
    for moe in model.moe_layers().values():
        moe.expert_bias.zero_()
        moe.expert_bias[-2:] = bias
    state = model.state_dict()
    write_weights_dir(out, cfg, state.items(), [(n, t.dtype, tuple(t.shape)) for n, t in state.items()],
                      progress=False)


def run(run_dir: Path, steps: int, weights: Path, extra: list[str]) -> list[dict]:
    sets = [*LAYOUT, f"train.steps={steps}", f"run.dir={run_dir}", f"checkpoint.init_from={weights}", *extra]
    cmd = [sys.executable, "-m", "moetrain.submit", "--config", "configs/demo-moe.yaml",
           *sum((["--set", s] for s in sets), [])]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(recs: list[dict], first: int) -> dict:
    after = [r for r in recs if r["step"] > first]
    busiest = [statistics.mean(layer["rank_max_over_mean"] for layer in r["expert_load"].values()) for r in after]
    share = statistics.mean(sum(layer["tokens"][-2:]) / sum(layer["tokens"]) for r in after
                            for layer in r["expert_load"].values())
    return {"busiest_rank_over_mean": round(statistics.median(busiest), 3),
            "step_s": round(statistics.median(r["step_time_s"] for r in after), 3),
            "hot_experts_share": round(share, 3),
            "loss_first_last": [round(recs[0]["loss"], 4), round(recs[-1]["loss"], 4)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--redundant", type=int, default=2)
    ap.add_argument("--window", type=int, default=None, help="steps of loads a placement uses (default: --every)")
    ap.add_argument("--bias", type=float, default=0.1)
    ap.add_argument("--global-batch", type=int, default=None,
                    help="sequences per step (default: the demo's 16); more sequences, less step-to-step "
                         "variation of the experts' loads")
    ap.add_argument("--aux-loss-coef", type=float, default=None,
                    help="moe.aux_loss_coef for both runs (default: the demo's 0.01, which pulls the routers "
                         "back towards balance within a few steps; 0 keeps the bias's skew)")
    ap.add_argument("--keep", type=Path, default=None, help="keep both runs' directories under this one")
    ap.add_argument("--lr", type=float, default=None,
                    help="a constant learning rate (no warm-up) for both runs, e.g. the demo's final 2e-4 as "
                         "late in training, where the routers' loads move slowly; default: the demo's schedule")
    a = ap.parse_args()
    window = a.window or a.every
    both = [] if a.lr is None else [f"train.lr={a.lr}", f"train.min_lr={a.lr}", "train.warmup_steps=0"]
    if a.aux_loss_coef is not None:
        both.append(f"moe.aux_loss_coef={a.aux_loss_coef}")
    if a.global_batch is not None:
        both.append(f"train.global_batch_size={a.global_batch}")
    out: dict = {"layout": "2 nodes x 1 task, dp2 x ep2, 8 experts top-2", "steps": a.steps, "every": a.every,
                 "window": window, "redundant_experts": a.redundant, "bias_on_experts_6_7": a.bias,
                 "lr": a.lr if a.lr is not None else "the demo's schedule", "global_batch": a.global_batch or 16,
                 "aux_loss_coef": a.aux_loss_coef if a.aux_loss_coef is not None else 0.01,
                 "measured_over": f"steps {a.every + 1}-{a.steps}"}
    if a.keep is not None:
        a.keep.mkdir(parents=True, exist_ok=True)
        where = contextlib.nullcontext(tempfile.mkdtemp(dir=a.keep))
    else:
        where = tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None)
    with where as tmp:
        weights = Path(tmp) / "skewed"
        skewed_weights(weights, a.bias)
        plain = run(Path(tmp) / "plain", a.steps, weights, both)
        eplb = run(Path(tmp) / "eplb", a.steps, weights,
                   [*both, f"moe.eplb.every={a.every}", f"moe.eplb.window={window}",
                    f"moe.eplb.redundant_experts={a.redundant}"])
    out["plain"], out["eplb"] = summary(plain, a.every), summary(eplb, a.every)
    out["eplb"]["replacements"] = [{"step": r["step"], "layer": layer, "slots_moved": rec["slots_moved"],
                                    "bytes_sent_rank0": rec["bytes_sent"], "seconds": round(rec["seconds"], 4),
                                    "window_busiest": [round(rec["busiest_over_mean_before"], 3),
                                                       round(rec["busiest_over_mean_after"], 3)]}
                                   for r in eplb for layer, rec in r.get("eplb_replaced", {}).items()]
    out["eplb_over_plain"] = {"busiest_rank_over_mean": round(out["eplb"]["busiest_rank_over_mean"]
                                                              / out["plain"]["busiest_rank_over_mean"], 3),
                              "step_s": round(out["eplb"]["step_s"] / out["plain"]["step_s"], 3)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
