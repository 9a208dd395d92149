"""Import a Hugging Face checkpoint into a weights directory, export any moetrain checkpoint to a
Hugging Face checkpoint; both stream tensor by tensor.

Import (:func:`import_hf`), in phases:

1. read ``config.json`` → architecture, moetrain ``model`` / ``moe`` sections (refusals in
   :mod:`moetrain.hf.arch`);
2. index the ``*.safetensors`` (``model.safetensors.index.json`` or the files' own headers): every
   tensor the map expects must be there, and nothing else;
3. stream: for each moetrain tensor, read its HF tensor(s) one at a time (safetensors' lazy
   ``safe_open``), convert (:mod:`moetrain.hf.tensors`), append to a safetensors file of the
   weights directory (:func:`moetrain.train.weights.write_weights_dir`) — an expert tensor expert
   by expert. Peak memory: one HF tensor plus its converted copy. The HF dtype is kept (a bf16
   model stays bf16 on disk; ``checkpoint.init_from`` loads it into the fp32 master weights);
4. copy ``config.json`` and the tokenizer files into ``CKPT_DIR/hf/`` (export takes them back)
   and write the moetrain config (``--config``), with ``checkpoint.init_from`` set.

Export (:func:`export_hf`), in phases:

1. open the checkpoint — a weights directory, a training checkpoint of any layout or a directory
   of them — and verify its manifest (sizes, sha256); find its moetrain config (the weights
   directory's manifest, or the run's ``config.yaml``);
2. choose the architecture (``--arch``; else the one it was imported from; else
   :func:`moetrain.hf.arch.choose_architecture`) and write its ``config.json``;
3. stream one layer at a time: read the layer's moetrain tensors whole (DCP in no-dist mode into
   global-shape tensors), convert, append to ``model-0000i-of-0000n.safetensors`` files of at
   most ``max_shard_bytes``; then ``model.safetensors.index.json``;
4. the tokenizer: the run's (the one its data manifest names, found beside the data and verified
   by its identity's sha256; with the ``tokenizer_config.json`` / ``special_tokens_map.json`` it
   was loaded with), or the imported one; ``config.json`` (and ``generation_config.json``, when
   the imported model had one) get the run's ``eos_token_id`` / ``bos_token_id`` from the manifest.

Both write into ``<out>.tmp-<pid>`` and rename it when complete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch
import yaml

from moetrain.config import Config, ConfigError, config_from_dict, to_dict
from moetrain.hf.arch import (ARCHITECTURES, DEEPSEEK_V3, GLM4_MOE, QWEN3_5_MOE, QWEN3_5_MOE_VL, QWEN3_NEXT, Architecture, architecture_for, choose_architecture,
                              fp8_block_size, from_hf, to_hf)
from moetrain.hf.tensors import TensorMap, tensor_maps
from moetrain.model.fp8 import E4M3, dequantize_blocks, quantize_blocks
from moetrain.model.lora import adapter_names, fp8_weight_names
from moetrain.model.transformer import Transformer
from moetrain.train.safetensors_stream import ShardedWriter, WeightsError, plan_shards, torch_dtype
from moetrain.train.weights import CheckpointReader, atomic_dir, expected_shapes, is_weights_dir, write_weights_dir

log = logging.getLogger(__name__)

HF_SUBDIR = "hf"
# Files of a HF model directory that travel with the weights (everything but the weights).
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                 "chat_template.jinja", "chat_template.json")
TOKENIZER_FILES = tuple(f for f in HF_SIDE_FILES if f not in ("config.json", "generation_config.json"))
# What a run's tokenizer was loaded from besides tokenizer.json (moetrain.data.tokenizer.CONFIG_FILES),
# and its chat template when kept in a file of its own: shipped with the export.
RUN_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_size(text: str) -> int:
    """Bytes of "5GB", "500MB", "2GiB", "1000" (decimal units as in transformers' max_shard_size).

    Raises:
        ValueError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r} is not a size such as 5GB or 500MB")
    unit = m.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(float(m.group(1)) * scale)


# ---------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------


class HFTensors:
    """The tensors of a HF model directory, read lazily one at a time."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open

        self.dir = hf_dir
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise WeightsError(f"{hf_dir}: no *.safetensors files (only safetensors are read; save the model with "
                               f"transformers' save_pretrained, which writes them)")
        self._handles = {f: safe_open(str(hf_dir / f), framework="pt") for f in files}
        self.where: dict[str, str] = {}
        for f, h in self._handles.items():
            for name in h.keys():
                if weight_map is None or weight_map.get(name) == f:
                    self.where[name] = f

        # MXFP4 experts (GPT-OSS): X_blocks + X_scales stand for X, dequantized on read.
        self.mxfp4 = {n[:-len("_blocks")] for n in self.where if n.endswith("_blocks")
                      and n[:-len("_blocks")] + "_scales" in self.where}
        if self.mxfp4:
            log.info("%s: %d MXFP4 expert tensors, dequantized to bf16 (exact: every FP4 value times a power "
                     "of two is a bf16 value)", hf_dir, len(self.mxfp4))

        # FP8 weights (DeepSeek-V3's format): X.weight float8 E4M3 with X.weight_scale_inv.
        self.fp8 = {n for n in self.where if f"{n}_scale_inv" in self.where}

    def names(self) -> set[str]:
        """The tensor names, MXFP4 pairs as the tensor they stand for, FP8 scales left out (they go
        with their weights)."""
        quantized = {f"{n}_blocks" for n in self.mxfp4} | {f"{n}_scales" for n in self.mxfp4}
        return (set(self.where) - quantized - {f"{n}_scale_inv" for n in self.fp8}) | self.mxfp4

    def scale(self, name: str) -> torch.Tensor:
        """The fp32 block scales of FP8 weight ``name``."""
        return self(f"{name}_scale_inv").float()

    def dequantized(self, name: str, block: int) -> torch.Tensor:
        """Tensor ``name``, an FP8 weight dequantized to bf16 (its codes times its block scales)."""
        if name not in self.fp8:
            return self(name)
        return dequantize_blocks(self(name), self.scale(name), block, torch.bfloat16)

    def dtype(self, name: str) -> torch.dtype:
        if name in self.mxfp4:
            return torch.bfloat16
        return torch_dtype(self._handles[self.where[name]].get_slice(name).get_dtype())

    def __call__(self, name: str) -> torch.Tensor:
        if name in self.mxfp4:
            get = self.__call__
            return dequantize_mxfp4(get(f"{name}_blocks"), get(f"{name}_scales"))
        if name not in self.where:
            raise WeightsError(f"{self.dir}: no tensor {name}")
        return self._handles[self.where[name]].get_tensor(name)


# FP4 (E2M1) values of the 16 codes (OCP Microscaling Formats spec v1.0, §5.3.3).
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's MXFP4 expert tensor → bf16, exactly. blocks [E, R, G, 16] uint8 (two FP4 codes
    per byte, low nibble first), scales [E, R, G] uint8 (E8M0: 2^(s − 127), one per 32 values) →
    [E, G·32, R]: row r of the checkpoint's [E, R, G·32] layout transposed, as Hugging Face lays
    the tensor out (``gate_up_proj`` [E, D, 2F], ``down_proj`` [E, F, D])."""
    lut = torch.tensor(_FP4, dtype=torch.bfloat16)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [E, R, G, 32]
    values = torch.ldexp(lut[codes], (scales.to(torch.int32) - 127).unsqueeze(-1).to(torch.bfloat16))
    return values.flatten(-2).transpose(1, 2).contiguous()


def _check_names(maps: list[TensorMap], hf: HFTensors, cfg: Config, left_out: str | None = None) -> None:
    """Refuse a checkpoint whose tensors are not the maps' (missing, or unexpected unless the
    regular expression ``left_out`` names them: what the import leaves behind on purpose)."""
    want = {n for m in maps for n in m.hf_names()}
    optional = {n for m in maps for n in m.also}
    have = hf.names()
    missing = sorted(want - optional - have)
    # Buffers some older checkpoints carry, a tied head that transformers ignores, and the MTP
    # layers after the last block that model.mtp_depth leaves out.
    mtp_left_out = "|".join(rf"model\.layers\.{i}\..*" for i in range(cfg.model.layers + cfg.model.mtp_depth,
                                                                        cfg.model.layers + 16))
    ignorable = re.compile(r".*rotary_emb\.inv_freq$" + (r"|lm_head\.weight$" if cfg.model.tie_embeddings else "")
                           + (f"|{mtp_left_out}" if mtp_left_out else "")
                           + (r"|mtp\..*" if not cfg.model.mtp_depth else "")  # Qwen3-Next's MTP module
                           + (f"|{left_out}" if left_out else ""))
    unexpected = sorted(n for n in have - want if not ignorable.match(n))
    if missing:
        raise WeightsError(f"{hf.dir}: {len(missing)} tensors of this architecture are missing, e.g. {missing[0]}")
    if unexpected:
        raise WeightsError(f"{hf.dir}: {len(unexpected)} tensors moetrain does not map, e.g. {unexpected[0]} "
                           f"(refused rather than dropped)")


def _maps_for(cfg: Config, arch: Architecture, rope_interleaved: bool = False) -> list[TensorMap]:
    """The tensor maps, checked against the model moetrain builds from ``cfg``."""
    maps = tensor_maps(cfg, arch.moe_names, rope_interleaved)
    ours = {m.ours: m.shape for m in maps}
    model = expected_shapes(cfg)
    if ours != model:  # the map and the model must describe the same tensors
        diff = sorted(set(ours.items()) ^ set(model.items()))
        raise AssertionError(f"{arch.name} map and moetrain model differ: {diff[:3]}")
    return maps


def _keeps_fp8_blocks(m: TensorMap, block: int) -> bool:
    """Whether ``m`` moves whole B × B blocks (so FP8 codes and their scales map as they are):
    a copy, the experts' transposes, or a part of rows that starts on a block boundary."""
    if m.hf_cat or m.hf_view or m.layout not in ("copy", "experts"):
        return False
    return m.part is None or (m.part.how == "cat" and m.part.dim == 0
                              and all(size % block == 0 for size in m.part.sizes[:-1]))


def _scales_to_ours(m: TensorMap, scale: Callable[[str], torch.Tensor], block: int) -> Iterator[torch.Tensor]:
    """The block scales of moetrain tensor ``m`` from the HF weights' (``scale(hf name)``), as
    :meth:`TensorMap.to_ours` gives its codes: per expert transposed, a part's block rows."""
    if m.layout == "experts":
        for name in m.hf_names():
            yield scale(name).t().contiguous().unsqueeze(0)
        return
    t = scale(m.hf)
    if m.part is not None:
        start = sum(m.part.sizes[:m.part.index]) // block
        t = t.narrow(0, start, -(-m.part.sizes[m.part.index] // block))
    yield t.contiguous()


def import_hf(hf_dir: str | os.PathLike, out: str | os.PathLike, config_out: str | os.PathLike | None = None,
              max_shard_bytes: int = 5 * 10**9, progress: bool = True, mtp_depth: int = 0,
              base_dtype: str | None = None, fp8_block: int = 128) -> Config:
    """Convert the HF model in ``hf_dir`` (``config.json`` + ``*.safetensors``) into a weights
    directory ``out`` (see :mod:`moetrain.train.weights`); optionally write the moetrain config
    to ``config_out``. Returns that config. ``mtp_depth``: multi-token-prediction layers of a
    DeepSeek-V3-family checkpoint to bring in (``model.layers.{num_hidden_layers + k}.*``).

    FP8: a checkpoint in DeepSeek-V3's FP8 format (:func:`moetrain.hf.arch.fp8_block_size`) is
    imported as it is — each block linear and expert matrix as its E4M3 codes with
    ``{name}_scale_inv`` block scales in moetrain's layout (experts transposed, scales with
    them), not dequantized —, except a tensor whose mapping would cut its blocks (a RoPE row
    permutation), dequantized to bf16 and said so. ``base_dtype: "fp8"`` quantizes the block
    linears and experts of an unquantized checkpoint into that format once, here, with
    ``fp8_block`` × ``fp8_block`` blocks (what ``train.lora.base_dtype: fp8`` stores). A run whose
    model is not an FP8 base dequantizes such weights as it loads them.

    Raises:
        UnsupportedModel: an architecture or config field moetrain cannot represent.
        WeightsError: missing / unexpected tensors, or ``out`` exists.
        moetrain.config.ConfigError: the converted config breaks a moetrain rule.
    """
    hf_dir, out = Path(hf_dir), Path(out)
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise WeightsError(f"{hf_dir}: no config.json (is it a Hugging Face model directory?)")
    hf_config = json.loads(cfg_path.read_text())
    arch, model, moe = from_hf(hf_config, mtp_depth)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", hf_dir.resolve().name) or "hf-model"
    cfg = config_from_dict({"run": {"name": name, "dir": f"runs/{name}"}, "model": model, "moe": moe,
                            "checkpoint": {"init_from": str(out)}})
    maps = _maps_for(cfg, arch, arch.rope_interleaved or bool(hf_config.get("rope_interleave", False)))
    hf = HFTensors(hf_dir)
    vision = r"model\.visual\..*" if arch is QWEN3_5_MOE_VL else None
    if vision:
        log.info("%s: the vision tower (%d tensors) is left out; moetrain trains the text model", arch.name,
                 sum(1 for n in hf.names() if re.match(vision, n)))
    _check_names(maps, hf, cfg, vision)
    block = fp8_block_size(hf_config)
    # FP8 codes kept (an FP8 checkpoint, block-preserving maps), made (base_dtype fp8), or undone
    with torch.device("meta"):
        fp8_names = fp8_weight_names(Transformer.from_config(cfg))
    keep = {m.ours for m in maps if block and m.ours in fp8_names and _keeps_fp8_blocks(m, block)
            and all(n in hf.fp8 for n in m.hf_names() or [m.hf])}
    make = {m.ours for m in maps if base_dtype == "fp8" and m.ours in fp8_names and m.ours not in keep}
    undone = sorted({m.ours for m in maps if any(n in hf.fp8 for n in m.hf_names() or [m.hf])} - keep)
    if undone:
        log.info("%s: %d FP8 tensors dequantized to bf16 (their mapping does not keep whole %d-blocks, e.g. %s)%s",
                 hf_dir, len(undone), block, undone[0], "; quantized again below" if make else "")
    entries = []
    for m in maps:
        dtype = torch.bfloat16 if m.ours in undone else hf.dtype((m.hf_names() or [m.hf])[0])
        entries.append((m.ours, E4M3 if m.ours in keep | make else dtype, m.shape))
        if m.ours in keep | make:
            b = block if m.ours in keep else fp8_block
            entries.append((f"{m.ours}_scale_inv", torch.float32, (*m.shape[:-2], -(-m.shape[-2] // b),
                                                                   -(-m.shape[-1] // b))))
    dtypes = {name: dtype for name, dtype, _ in entries}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for m in maps:
            if m.ours in keep:
                yield from ((m.ours, piece) for piece in m.to_ours(hf))
                yield from ((f"{m.ours}_scale_inv", s) for s in _scales_to_ours(m, hf.scale, block))
                continue
            pieces = m.to_ours(lambda n: hf.dequantized(n, block) if n in hf.fp8 else hf(n))
            for copy in (n for n in m.also if n in hf.where):  # e.g. an MTP layer's embed_tokens
                if not torch.equal(hf(copy), hf(m.hf)):
                    raise WeightsError(f"{hf_dir}: {copy} differs from {m.hf}; moetrain's MTP modules share the "
                                       f"model's embedding and head, so it cannot hold both (refused rather than "
                                       f"dropped)")
            if m.ours not in make:
                yield from ((m.ours, piece.to(dtypes[m.ours])) for piece in pieces)
                continue
            scales = []  # quantized here, piece by piece (an expert at a time): scales after the codes
            for piece in pieces:
                codes, scale = quantize_blocks(piece, fp8_block)
                scales.append(scale)
                yield m.ours, codes
            yield from ((f"{m.ours}_scale_inv", s) for s in scales)

    def side_files(tmp: Path) -> None:
        (tmp / HF_SUBDIR).mkdir()
        for f in HF_SIDE_FILES:
            if (hf_dir / f).is_file():
                shutil.copy2(hf_dir / f, tmp / HF_SUBDIR / f)

    source = {"hf_dir": str(hf_dir.resolve()), "architecture": arch.name, "model_type": arch.model_type}
    extra = {"source": source}
    if keep or make:  # the block edge of the weights stored as FP8 codes with scales
        extra["fp8_block"] = block if keep else fp8_block
        if keep and make and block != fp8_block:
            raise WeightsError(f"{hf_dir}: FP8 in {block}-blocks, and --fp8-block {fp8_block} asks for another; "
                               f"use --fp8-block {block}")
    write_weights_dir(out, cfg, tensors(), entries, extra=extra, max_shard_bytes=max_shard_bytes,
                      progress=progress, add_files=side_files)
    if config_out is not None:
        save_import_config(cfg, Path(config_out), hf_dir, out)
    return cfg


def save_import_config(cfg: Config, path: Path, hf_dir: Path, weights: Path) -> None:
    """Write ``cfg`` as YAML with a header saying where it came from and what to adjust."""
    header = (f"# moetrain config of {hf_dir} (written by python -m moetrain.hf import).\n"
              f"# model and moe: from its config.json; checkpoint.init_from: the imported weights {weights}.\n"
              f"# Set data.path (tokenized with this model's tokenizer), train, parallel and launch for your run.\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(to_dict(cfg), sort_keys=False))


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def find_run_config(step_dir: Path) -> Path | None:
    """The ``config.yaml`` of the run a training checkpoint belongs to: in the checkpoint's
    directory or up to three levels above (``<run.dir>/checkpoints/step_X`` by default)."""
    for d in [step_dir, *list(step_dir.resolve().parents)[:3]]:
        if (d / "config.yaml").is_file():
            return d / "config.yaml"
    return None


def hf_file_name(i: int, n: int) -> str:
    """``model-00001-of-00002.safetensors`` (transformers' naming) for i = 0, n = 2."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _layer_groups(maps: list[TensorMap]) -> list[list[TensorMap]]:
    """The maps grouped by block (top-level tensors alone), in order: what export reads at once."""
    groups: list[list[TensorMap]] = []
    key = None
    for m in maps:
        k = ".".join(m.ours.split(".")[:2]) if m.ours.startswith(("layers.", "mtp.")) else m.ours
        if k != key:
            groups.append([])
            key = k
        groups[-1].append(m)
    return groups


def export_hf(ckpt: str | os.PathLike, out: str | os.PathLike, arch_name: str | None = None, dtype: str = "auto",
              config_path: str | os.PathLike | None = None, tokenizer: str | os.PathLike | None = None,
              max_shard_bytes: int = 5 * 10**9, progress: bool = True, merge: bool = False) -> Path:
    """Write the HF checkpoint of moetrain checkpoint ``ckpt`` into ``out``: ``config.json``,
    ``model-*.safetensors`` with ``model.safetensors.index.json``, and the tokenizer when known.
    A LoRA run's checkpoint (``train.lora``) exports with ``merge``: its base with the adapters
    merged (:class:`MergedLora`).

    Args:
        ckpt: a weights directory, a training checkpoint ``step_XXXXXXXX`` (any layout) or a
            directory of them (its newest).
        arch_name: ``model_type`` or class name; default: as imported, else chosen from the config.
        dtype: ``auto`` (as stored: fp32 for training checkpoints), ``float32``, ``bfloat16``,
            ``float16``.
        config_path: the run's config (default: found next to the checkpoint).
        tokenizer: a ``tokenizer.json`` (or a directory of tokenizer files) to ship instead of
            the run's.

    Raises:
        UnsupportedModel: the model does not fit the architecture (names the moetrain field).
        WeightsError: a checkpoint that fails verification, lacks tensors, or no config found.
    """
    out = Path(out)
    if out.exists():  # before the (possibly long) verification of the checkpoint
        raise WeightsError(f"{out}: already exists; remove it or choose another --out")
    reader = CheckpointReader(ckpt, progress=progress)
    cfg, base, side_dir = _export_sources(reader, config_path)
    if cfg.train.lora.r and reader.kind == "dcp":
        if not merge:
            raise WeightsError(f"{reader.path}: a LoRA run's checkpoint (train.lora.r = {cfg.train.lora.r}) holds the "
                               f"adapters, not the base; pass --merge to write the base with the adapters merged")
        reader = MergedLora(reader, cfg, progress)
    if arch_name is not None:
        arch = arch_by_name(arch_name)
    elif base is not None:
        arch = architecture_for(base)
    else:
        arch = choose_architecture(cfg)
    if arch is QWEN3_5_MOE_VL and arch_name is None:  # imported without its vision tower: the text model
        log.warning("%s was imported without its vision tower: the export is its text model, %s", arch.name,
                    QWEN3_5_MOE.name)
        arch = QWEN3_5_MOE
        base = {**base["text_config"], "model_type": arch.model_type} if base is not None else None
    if cfg.moe.num_experts and cfg.moe.capacity_factor is not None:
        log.warning("moe.capacity_factor = %s: the exported model routes dropless, as inference engines do",
                    cfg.moe.capacity_factor)
    if cfg.model.mtp_depth and arch not in (DEEPSEEK_V3, GLM4_MOE, QWEN3_NEXT, QWEN3_5_MOE):
        # A training aid that inference does not need: left out, as DeepSeek-V3 leaves it out of
        # the models it serves.
        log.warning("model.mtp_depth = %d: %s has no multi-token-prediction layers; the export leaves the %d MTP "
                    "module(s) out", cfg.model.mtp_depth, arch.name, cfg.model.mtp_depth)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp_depth=0))
    # DeepSeek-V3's config says whether its checkpoint rotates interleaved pairs (moetrain's own
    # layout, written unpermuted): kept as imported, true for a new export.
    interleaved = arch.rope_interleaved or (arch.name == "DeepseekV3ForCausalLM"
                                            and bool((base or {}).get("rope_interleave", True)))
    maps = _maps_for(cfg, arch, interleaved)
    have = dict(reader.shapes)
    if cfg.model.tie_embeddings:
        have.pop("output.weight", None)
    missing = [m.ours for m in maps if m.ours not in have]
    if missing:
        raise WeightsError(f"{reader.path}: no tensor {missing[0]} ({len(missing)} missing) for the configured model")
    wrong = [(m.ours, have[m.ours][0], m.shape) for m in maps if tuple(have[m.ours][0]) != m.shape]
    if wrong:
        raise WeightsError(f"{reader.path}: tensor {wrong[0][0]} is {wrong[0][1]}, the config says {wrong[0][2]}")

    def out_dtype(m: TensorMap) -> torch.dtype:
        return have[m.ours][1] if dtype == "auto" else DTYPES[dtype]

    entries = [(name, out_dtype(m), shape) for m in maps for name, shape in zip(m.hf_names(), m.hf_shapes())]
    main_dtype = max({d for _, d, _ in entries}, key=lambda d: sum(1 for e in entries if e[1] == d))
    dtype_name = str(main_dtype).removeprefix("torch.")
    to_hf(cfg, arch, base, dtype_name)  # refuses what the architecture cannot hold, before writing
    with atomic_dir(out) as tmp:
        writer = ShardedWriter(tmp, plan_shards(entries, max_shard_bytes), hf_file_name, {"format": "pt"}, progress,
                               desc=f"export {out.name}")
        for group in _layer_groups(maps):
            tensors = reader.read([m.ours for m in group])
            parts = {m.ours: m.hf_layout(tensors[m.ours]) for m in group if m.part is not None}
            for m in group:
                for name, t in m.to_hf(tensors.pop(m.ours), parts):
                    writer.write(name, t.to(out_dtype(m)))
        writer.close()
        total = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, d, s in entries)
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": writer.weight_map}, indent=2))
        shipped, run_tok = _ship_tokenizer(tmp, cfg, reader, side_dir, tokenizer)
        hf_config = to_hf(cfg, arch, base, dtype_name)
        generation = json.loads((side_dir / "generation_config.json").read_text()) \
            if side_dir is not None and (side_dir / "generation_config.json").is_file() else None
        # The token ids must name tokens of the shipped tokenizer: the imported model's ids are
        # kept only with the imported model's tokenizer.
        if shipped != "imported":
            if (tmp / "tokenizer.json").is_file():
                ids = special_token_ids(tmp, cfg.model.vocab_size)
            else:  # none to read them from: keep those that are at least inside the vocabulary
                ids = {k: v for k in SPECIAL_TOKEN_KEYS if isinstance(v := hf_config.get(k), int)
                       and v < cfg.model.vocab_size}
                dropped = {k: hf_config[k] for k in SPECIAL_TOKEN_KEYS if hf_config.get(k) is not None and k not in ids}
                if dropped:
                    log.warning("no tokenizer.json to check the special token ids against; dropped %s (outside the "
                                "vocabulary of %d)", dropped, cfg.model.vocab_size)
            if run_tok is not None:  # the ids the data was written with, as its manifest records them
                ids["eos_token_id"] = run_tok.eos_id
                if run_tok.bos_id is not None:
                    ids["bos_token_id"] = run_tok.bos_id
            for conf in (hf_config, generation):
                for key in SPECIAL_TOKEN_KEYS:
                    if conf is not None and (key in conf or ids.get(key) is not None):
                        conf[key] = ids.get(key)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        if generation is not None:
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    return out


SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_token_ids(tokenizer_dir: Path, vocab_size: int | None = None) -> dict[str, int | None]:
    """``{"bos_token_id": …, "eos_token_id": …, "pad_token_id": …}`` of the tokenizer in
    ``tokenizer_dir``: the tokens its ``tokenizer_config.json`` (or ``special_tokens_map.json``)
    names, looked up in its ``tokenizer.json``; ``None`` for a role it names no token for.

    Raises:
        WeightsError: a named token is not in ``tokenizer.json``, or its id is not below
            ``vocab_size`` (the exported model could not produce it).
    """
    import tokenizers

    names: dict[str, Any] = {}
    for f in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins
        if (tokenizer_dir / f).is_file():
            names.update({k: v for k, v in json.loads((tokenizer_dir / f).read_text()).items() if k.endswith("_token")})
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    out: dict[str, int | None] = {}
    for key in SPECIAL_TOKEN_KEYS:
        name = names.get(key.removesuffix("_id"))
        if isinstance(name, dict):  # {"content": "</s>", "lstrip": false, ...}
            name = name.get("content")
        if not name:
            out[key] = None
            continue
        token_id = tok.token_to_id(name)
        if token_id is None or (vocab_size is not None and token_id >= vocab_size):
            where = "is not in its tokenizer.json" if token_id is None else \
                f"has id {token_id}, outside the model's vocabulary of {vocab_size}"
            raise WeightsError(f"the tokenizer to ship names {key.removesuffix('_id')} {name!r}, which {where}; pass "
                               f"--tokenizer DIR holding the tokenizer.json the run's data was written with and a "
                               f"tokenizer_config.json that names its special tokens")
        out[key] = token_id
    return out


def arch_by_name(name: str) -> Architecture:
    for a in ARCHITECTURES.values():
        if name in (a.model_type, a.name):
            return a
    from moetrain.hf.arch import UnsupportedModel

    raise UnsupportedModel(f"--arch {name!r}: not one of {', '.join(a.model_type for a in ARCHITECTURES.values())}")


class MergedLora:
    """The weights a LoRA run computes with, whole, read as :class:`CheckpointReader` reads a
    checkpoint: its base (``checkpoint.init_from``, checked against the sha256 its checkpoint
    recorded, or drawn from ``run.seed`` when it had none) stored as the run stored it (bf16, or
    FP8 quantized and dequantized, the rest of a bf16 / FP8 base in bf16), each adapted weight plus
    scaling · B A (the experts' stacked
    [E, in, out] matrices plus scaling · A_e B_e, per expert or the one shared pair), and the
    checkpoint's own trained tensors (routers, routing biases) in place of the base's.

    Raises:
        WeightsError: the base is gone or differs from the one the adapters were trained on.
    """

    def __init__(self, lora: CheckpointReader, cfg: Config, progress: bool = True):
        self.lora, self.cfg, self.kind, self.path, self.manifest = lora, cfg, lora.kind, lora.path, lora.manifest
        recorded = lora.manifest.get("train_state", {}).get("lora_base")
        if recorded is None:
            raise WeightsError(f"{lora.path}: a LoRA checkpoint that does not name its base")
        self.drawn: dict[str, torch.Tensor] | None = None
        if recorded["path"] is None:  # a base drawn from the seed: drawn again, whole
            from moetrain.model.init import init_weights

            model = Transformer.from_config(cfg)
            init_weights(model, recorded["seed"], cfg.model.init_std, cfg.model.layers)
            self.drawn = {k: v.detach() for k, v in model.state_dict().items()}
            self.shapes = {k: (tuple(v.shape), v.dtype) for k, v in self.drawn.items()}
        else:
            from moetrain.utils import sha256_file

            where = Path(recorded["path"])
            if not (where / "manifest.json").is_file() or sha256_file(where / "manifest.json") != recorded["sha256"]:
                raise WeightsError(f"{lora.path}: its adapters were trained on the base {recorded}, which {where} no "
                                   f"longer is (missing, or its manifest differs)")
            self.base = CheckpointReader(where, progress=progress)
            self.shapes = dict(self.base.shapes)
        with torch.device("meta"):
            self.fp8_names = fp8_weight_names(Transformer.from_config(cfg))

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from moetrain.model.fp8 import dequantize_blocks, quantize_blocks

        lo = self.cfg.train.lora
        base = {n: self.drawn[n] for n in names} if self.drawn is not None else self.base.read(names)
        own = [n for n in names if n in self.lora.shapes]  # trained whole: routers, routing biases
        pairs = {n: p for n in names if n not in own and (p := adapter_names(n)) and p[0] in self.lora.shapes}
        # one read of the checkpoint for the group (each read of a DCP checkpoint loads its plan)
        trained = self.lora.read(own + [x for p in pairs.values() for x in p])
        out = {}
        block = self.cfg.train.fp8_block
        for name, w in base.items():
            if name in own:
                out[name] = trained[name]
                continue
            # the base as the run stored it: FP8 block linears and experts, the rest in bf16
            stored = w
            if lo.base_dtype == "fp8" and name in self.fp8_names:
                stored = dequantize_blocks(*quantize_blocks(w, block), block, torch.float32)
            elif lo.base_dtype is not None and w.is_floating_point():
                stored = w.to(torch.bfloat16)
            if name not in pairs:
                out[name] = stored.to(w.dtype) if w.is_floating_point() else w
                continue
            a, b = (trained[x].float() for x in pairs[name])
            delta = b @ a if name.endswith(".weight") else a @ b  # [out, in], or [E or 1, in, out]
            out[name] = (stored.float() + lo.scaling * delta).to(w.dtype)
        return out


def _export_sources(reader: CheckpointReader, config_path: str | os.PathLike | None
                    ) -> tuple[Config, dict | None, Path | None]:
    """(moetrain config, the HF config.json it was imported from or None, the directory holding
    the imported side files or None) of the checkpoint ``reader`` opened."""
    if reader.kind == "weights":
        cfg = config_from_dict({"model": reader.manifest["model"], "moe": reader.manifest["moe"]})
        side = reader.path / HF_SUBDIR
    else:
        path = Path(config_path) if config_path is not None else find_run_config(reader.path)
        if path is None or not path.is_file():
            raise WeightsError(f"{reader.path}: no config.yaml of its run found beside or above it; pass --config "
                               f"RUN_DIR/config.yaml")
        cfg = config_from_dict(yaml.safe_load(path.read_text()))
        init = cfg.checkpoint.init_from
        side = Path(init) / HF_SUBDIR if init and is_weights_dir(Path(init)) else None
    if config_path is not None and reader.kind == "weights":
        cfg = config_from_dict(yaml.safe_load(Path(config_path).read_text()))
    base = None
    if side is not None and (side / "config.json").is_file():
        base = json.loads((side / "config.json").read_text())
    return cfg, base, side if side is not None and side.is_dir() else None


class RunTokenizer(NamedTuple):
    """The tokenizer a run's data was written with: ``source`` its ``tokenizer.json`` (the config
    files it was loaded with lie beside it) or ``"gpt2"``; the manifest's ``eos_id`` and ``bos_id``
    (``None``: no BOS)."""

    source: Path | str
    eos_id: int
    bos_id: int | None
    chat_template: str | None = None  # the template fine-tuning data was rendered with (its manifest's)


def _ship_tokenizer(out: Path, cfg: Config, reader: CheckpointReader, side_dir: Path | None,
                    explicit: str | os.PathLike | None) -> tuple[str | None, RunTokenizer | None]:
    """Copy the tokenizer into ``out``. Order: ``explicit``; the run's (its data manifest's
    tokenizer, found and verified by its identity, with the config files it was loaded with); the
    imported model's files. Returns which — ``"explicit"``, ``"run"``, ``"imported"``, or ``None``
    when there is none — and, for ``"run"``, the :class:`RunTokenizer`."""
    if explicit is not None:
        p = Path(explicit)
        if p.is_dir():
            copies = {p / f: out / f for f in TOKENIZER_FILES if (p / f).is_file()}
        else:
            copies = {p: out / "tokenizer.json"} if p.is_file() else {}
        if not copies:
            raise WeightsError(f"--tokenizer {explicit}: no tokenizer.json (or tokenizer files) there")
        for src, dst in copies.items():
            shutil.copy2(src, dst)
        if not (out / "tokenizer_config.json").is_file():
            write_tokenizer_config(out, cfg)
        return "explicit", None
    if reader.kind == "dcp":
        found = run_tokenizer(cfg)
        if found is not None:
            if found.source == "gpt2":
                from moetrain.data.tokenizer import load_tokenizer

                load_tokenizer("gpt2").hf.save(str(out / "tokenizer.json"))
            else:
                shutil.copy2(found.source, out / "tokenizer.json")
                for f in RUN_TOKENIZER_FILES:
                    if (found.source.parent / f).is_file():
                        shutil.copy2(found.source.parent / f, out / f)
            if not (out / "tokenizer_config.json").is_file():
                import tokenizers

                shipped = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
                write_tokenizer_config(out, cfg, eos_token=shipped.id_to_token(found.eos_id),
                                       bos_token=None if found.bos_id is None else shipped.id_to_token(found.bos_id))
            if found.chat_template is not None:  # the template the fine-tuning data was rendered with
                (out / "chat_template.jinja").write_text(found.chat_template, encoding="utf-8")
                conf_path = out / "tokenizer_config.json"
                conf = json.loads(conf_path.read_text(encoding="utf-8"))
                if "chat_template" in conf:  # one template: tools that read only the config see this one too
                    conf["chat_template"] = found.chat_template
                    conf_path.write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            return "run", found
    if side_dir is not None and any((side_dir / f).is_file() for f in TOKENIZER_FILES):
        for f in TOKENIZER_FILES:
            if (side_dir / f).is_file():
                shutil.copy2(side_dir / f, out / f)
        return "imported", None
    log.warning("no tokenizer found for %s: the export has none and no special token ids (pass --tokenizer)",
                reader.path)
    return None, None


def run_tokenizer(cfg: Config) -> RunTokenizer | None:
    """The tokenizer a run's data was written with. The data manifest (of the first source of
    ``data.path`` / ``data.blend``: a blend's sources share one tokenizer) names it and records
    its identity; the ``tokenizer.json`` is looked for beside the data (the data directory, its
    parents, and the name relative to them) and must, loaded with the config files beside it,
    have the same identity sha256 (which covers its BOS / EOS). None when the data or the file
    cannot be found."""
    from moetrain.data.format import ShardError, read_manifest
    from moetrain.data.tokenizer import TokenizerError, load_tokenizer

    try:
        data_path = cfg.data.sources()[0].path
        manifest = read_manifest(data_path)
    except (ShardError, OSError, ConfigError):
        return None
    ident, eos, bos = manifest["tokenizer"], int(manifest["eos_id"]), manifest["bos_id"]
    chat = (manifest.get("chat") or {}).get("template")
    if ident.get("name") == "gpt2":
        return RunTokenizer("gpt2", eos, bos, chat)
    data = Path(data_path).resolve()
    bases = [data, *list(data.parents)[:3]]
    for cand in [b / "tokenizer.json" for b in bases] + [b / ident.get("name", "") for b in bases]:
        if cand.is_file():
            try:
                if load_tokenizer(cand).identity["sha256"] == ident.get("sha256"):
                    return RunTokenizer(cand, eos, bos, chat)
            except (TokenizerError, OSError):  # not a tokenizer file, or one moetrain refuses: keep looking
                continue
    return None


def write_tokenizer_config(out: Path, cfg: Config, eos_token: str | None = None, bos_token: str | None = None) -> None:
    """A tokenizer_config.json so that ``AutoTokenizer.from_pretrained`` loads tokenizer.json and
    frames text as the run's data: ``eos_token`` (default ``<|endoftext|>``); ``bos_token``, when
    given, named and added before each text (``add_bos_token: true``)."""
    from moetrain.data.tokenizer import EOS_TOKEN

    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token or EOS_TOKEN,
            "model_max_length": cfg.model.seq_len, "clean_up_tokenization_spaces": False}
    if bos_token is not None:
        conf.update(bos_token=bos_token, add_bos_token=True)
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
