"""Hugging Face checkpoints in and out: a layer over checkpoints, the model never learns HF names.

``python -m moetrain.hf import HF_DIR --out CKPT_DIR [--config OUT.yaml]`` and
``python -m moetrain.hf export CKPT --out HF_DIR`` (:mod:`moetrain.hf.__main__`).

* :mod:`moetrain.hf.arch` — each supported architecture's ``config.json`` ↔ moetrain config, and
  the refusals;
* :mod:`moetrain.hf.tensors` — the tensor name and layout maps (RoPE row permutation, stacked
  experts);
* :mod:`moetrain.hf.convert` — streaming import into a weights directory
  (:mod:`moetrain.train.weights`) and export from any checkpoint.

Needs ``safetensors`` (the ``hf`` extra); transformers only to load or check the result.
"""

from moetrain.hf.arch import ARCHITECTURES, UnsupportedModel
from moetrain.hf.convert import export_hf, import_hf

__all__ = ["ARCHITECTURES", "UnsupportedModel", "export_hf", "import_hf"]
