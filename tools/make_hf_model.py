#!/usr/bin/env python
"""Build a random Hugging Face model of a moetrain config's shape, locally (nothing downloaded).

    python tools/make_hf_model.py --config configs/finetune-qwen3-moe.yaml --out data/hf/qwen3-moe-small

A stand-in for a model from the Hub when trying ``python -m moetrain.hf import`` and
``checkpoint.init_from`` offline: transformers builds the architecture (``--arch``, default the one
``python -m moetrain.hf export`` would choose) from the config.json that moetrain's export would
write for this config, initialises it at random (transformers' own initialisation, ``--seed``)
and saves it with ``save_pretrained``. The run's tokenizer (from the config's data manifest, when
there) goes with it. ``model.vocab_size: null`` is resolved from the data manifest, as a run does.
Needs transformers.
"""

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from moetrain.config import ConfigError, load_config  # noqa: E402
from moetrain.hf.arch import UnsupportedModel, choose_architecture, to_hf  # noqa: E402
from moetrain.hf.convert import arch_by_name, write_tokenizer_config, run_tokenizer  # noqa: E402


def make_hf_model(cfg, out: Path, arch_name: str | None = None, seed: int = 0) -> Path:
    """Save a random HF model of ``cfg``'s shape into ``out``; returns ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.model.vocab_size is None:
        from moetrain.launch.preflight import resolve_vocab

        cfg = resolve_vocab(cfg)
    arch = arch_by_name(arch_name) if arch_name else choose_architecture(cfg)
    found = run_tokenizer(cfg)
    hf = to_hf(cfg, arch, eos_token_id=found[1] if found else None)
    for key in ("architectures", "torch_dtype"):
        hf.pop(key)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf), dtype=torch.float32)
    model.save_pretrained(out)
    if found is not None and found[0] != "gpt2":
        shutil.copy2(found[0], out / "tokenizer.json")
        write_tokenizer_config(out, cfg)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="moetrain YAML config whose model / moe shape to build")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--arch", help="model_type (mixtral, qwen3_moe, qwen2_moe, olmoe, llama, deepseek_v3, glm4_moe, gpt_oss); default: chosen")
    parser.add_argument("--out", required=True, help="directory to write (config.json, model.safetensors, tokenizer)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if importlib.util.find_spec("transformers") is None:
        sys.exit("make_hf_model: needs transformers, which builds the model: pip install -e '.[hf]'")
    try:
        out = make_hf_model(load_config(args.config, args.overrides), Path(args.out), args.arch, args.seed)
    except (ConfigError, UnsupportedModel) as e:
        sys.exit(f"make_hf_model: {e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
