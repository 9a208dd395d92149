"""``python -m moetrain.hf import|export``: Hugging Face checkpoints in and out.

Exit status: 0 done; 2 refused or bad input (an unsupported architecture or field, a checkpoint
that fails verification or does not fit, an existing output); 1 anything else.
"""

from __future__ import annotations

import argparse
import logging
import sys

from moetrain.config import ConfigError
from moetrain.hf.arch import ARCHITECTURES, UnsupportedModel
from moetrain.hf.convert import DTYPES, export_hf, import_hf, parse_size
from moetrain.hf.peft import export_lora
from moetrain.train.weights import WeightsError


def build_parser() -> argparse.ArgumentParser:
    archs = ", ".join(a.model_type for a in ARCHITECTURES.values())
    p = argparse.ArgumentParser(prog="python -m moetrain.hf", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF model directory → moetrain weights directory (+ config)",
                         description=f"Convert a Hugging Face model ({archs}) into a moetrain weights directory that "
                                     f"checkpoint.init_from loads into any layout.")
    imp.add_argument("hf_dir", help="directory with config.json and *.safetensors")
    imp.add_argument("--out", required=True, help="weights directory to create")
    imp.add_argument("--config", help="also write the moetrain config (model, moe, checkpoint.init_from) here")
    imp.add_argument("--max-shard-size", default="5GB", help="largest safetensors file written (default 5GB)")
    imp.add_argument("--base-dtype", choices=["fp8"], help="fp8: store the block linears and experts as FP8 E4M3 "
                     "with block scales (DeepSeek-V3's format), quantized once here, for train.lora.base_dtype: fp8 "
                     "(an FP8 checkpoint is kept as it is without this)")
    imp.add_argument("--fp8-block", type=int, default=128, help="the FP8 block edge (default 128, DeepSeek-V3's)")
    imp.add_argument("--mtp-depth", type=int, default=0,
                     help="multi-token-prediction layers of a DeepSeek-V3 / GLM-4.5 checkpoint to bring in (default 0)")
    exp = sub.add_parser("export", help="moetrain checkpoint → HF model directory",
                         description="Export a weights directory, a training checkpoint (any layout) or a directory "
                                     "of them (its newest) to a Hugging Face model directory.")
    exp.add_argument("checkpoint", help="weights directory, step_XXXXXXXX checkpoint, or checkpoints directory")
    exp.add_argument("--out", required=True, help="HF model directory to create")
    exp.add_argument("--arch", help=f"target architecture ({archs}); default: as imported, else from the config")
    exp.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                     help="weights dtype (auto: as stored; training checkpoints hold float32)")
    exp.add_argument("--config", help="the run's config.yaml (default: found beside the checkpoint)")
    exp.add_argument("--tokenizer", help="tokenizer.json or a directory of tokenizer files to ship (default: the "
                                         "run's, or the imported model's)")
    exp.add_argument("--max-shard-size", default="5GB", help="largest safetensors file written (default 5GB)")
    lora = exp.add_mutually_exclusive_group()
    lora.add_argument("--merge", action="store_true",
                      help="a LoRA run's checkpoint (train.lora): write its base with the adapters merged")
    lora.add_argument("--lora", action="store_true",
                      help="a LoRA run's checkpoint: write its adapters as a PEFT adapter directory")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        shard = parse_size(args.max_shard_size)
        if args.command == "import":
            cfg = import_hf(args.hf_dir, args.out, args.config, max_shard_bytes=shard, mtp_depth=args.mtp_depth,
                            base_dtype=args.base_dtype, fp8_block=args.fp8_block)
            m, moe = cfg.model, cfg.moe
            print(f"imported {args.hf_dir} → {args.out}: {m.layers} blocks, hidden {m.hidden}, "
                  f"{moe.num_experts} experts (top-{moe.top_k})" if moe.num_experts else
                  f"imported {args.hf_dir} → {args.out}: {m.layers} blocks, hidden {m.hidden}, dense")
            if args.config:
                print(f"config: {args.config} (checkpoint.init_from: {args.out})")
        elif args.lora:
            out = export_lora(args.checkpoint, args.out, args.arch, args.config, progress=True)
            print(f"exported the adapters of {args.checkpoint} → {out} (PEFT)")
        else:
            out = export_hf(args.checkpoint, args.out, args.arch, args.dtype, args.config, args.tokenizer,
                            max_shard_bytes=shard, merge=args.merge)
            print(f"exported {args.checkpoint} → {out}")
    except (UnsupportedModel, WeightsError, ConfigError, ValueError) as e:
        print(f"moetrain.hf {args.command}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
