"""Weights-only checkpoints: the weights directory, offline reading of any checkpoint, and
``checkpoint.init_from``.

A **weights directory** holds a model's parameters and nothing else — what
``python -m moetrain.hf import`` writes::

    CKPT_DIR/
        manifest.json                        format, the model and moe config sections, and for
                                             every tensor its file, dtype and global shape; size
                                             and sha256 of every file
        weights-00001-of-00002.safetensors   tensors in moetrain's names and single-process
        weights-00002-of-00002.safetensors   (global) layout, e.g. layers.0.moe.experts.w1 [E, D, F]
        ...                                  whatever the writer adds (moetrain.hf: the source's
                                             config.json and tokenizer files under hf/)

Why not a ``torch.distributed.checkpoint`` directory: DCP is written collectively from a state
dict held in memory, so an importer would need the whole model at once. A safetensors file can
be written tensor by tensor — and a stacked expert tensor expert by expert, its rows being
contiguous — (:mod:`moetrain.train.safetensors_stream`), and read lazily: each rank reads only its piece of a
tensor (``safe_open(...).get_slice``), located by :func:`moetrain.model.init.local_piece` from
its placements (tensor, expert and FSDP shards), the same rule that initialises
parameters layout-independently. So a weights directory loads into any layout, as a DCP
checkpoint does.

``checkpoint.init_from`` (:func:`load_initial_weights`) takes a weights directory, a training
checkpoint ``step_XXXXXXXX`` or a directory of them (its newest complete one); training
checkpoints go through :meth:`moetrain.train.checkpoint.Checkpointer.load_weights` (DCP,
resharded). Only parameters are loaded: the optimizer starts fresh, the step and the data
position at 0. :func:`check_init_from` compares names and global shapes with the configured
model before launch.

:class:`CheckpointReader` reads whole tensors of either kind offline, in one process, one group of
tensors at a time (``python -m moetrain.hf export``): DCP in no-dist mode into preallocated
global-shape tensors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from moetrain.config import Config, ConfigError
from moetrain.model.fp8 import E4M3, dequantize_blocks, quantize_blocks
from moetrain.model.init import local_piece
from moetrain.model.lora import is_adapter
from moetrain.model.moe import GroupedExperts, SlotMap
from moetrain.train.checkpoint import CheckpointError, Checkpointer, list_checkpoints, verify_checkpoint
from moetrain.train.safetensors_stream import ShardedWriter, WeightsError, dtype_name, plan_shards, torch_dtype
from moetrain.utils import atomic_write, fsync_dir, sha256_file

log = logging.getLogger(__name__)

FORMAT = "moetrain-weights"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Names of the wrappers torch puts between a module and its children (compile, checkpoint_wrapper).
_WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def weights_file_name(i: int, n: int) -> str:
    """``weights-00001-of-00003.safetensors`` for i = 0, n = 3."""
    return f"weights-{i + 1:05d}-of-{n:05d}.safetensors"


def write_weights_dir(out_dir: str | os.PathLike, cfg: Config, tensors: Iterable[tuple[str, torch.Tensor]],
                      entries: list[tuple[str, torch.dtype, tuple[int, ...]]], extra: dict | None = None,
                      max_shard_bytes: int = 5 * 2**30, progress: bool = True,
                      add_files=None) -> Path:
    """Write a weights directory atomically (into ``<out_dir>.tmp-<pid>``, renamed at the end).

    Args:
        out_dir: the directory to create; it must not exist yet.
        cfg: the model the weights are for (its model and moe sections go to the manifest).
        tensors: (name, piece) in the order of ``entries``; a tensor may come in row blocks.
        entries: (name, dtype, global shape) of every tensor.
        extra: more manifest fields (e.g. the source of an import).
        max_shard_bytes: largest safetensors file (a bigger tensor gets its own file).
        add_files: called with the temporary directory before the manifest is written, to add
            files (they are hashed into the manifest too).

    Raises:
        WeightsError: ``out_dir`` exists, or the tensors do not match ``entries``.
    """
    from moetrain.config import to_dict

    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        groups = plan_shards(entries, max_shard_bytes)
        writer = ShardedWriter(tmp, groups, weights_file_name, {"format": "pt"}, progress, desc=f"write {out.name}")
        for name, piece in tensors:
            writer.write(name, piece)
        writer.close()
        if add_files is not None:
            add_files(tmp)
        files = dict(writer.files)
        for f in sorted(tmp.rglob("*")):
            rel = str(f.relative_to(tmp))
            if f.is_file() and rel not in files:
                files[rel] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": 0,
                    "model": to_dict(cfg.model), "moe": to_dict(cfg.moe),
                    "tensors": {name: {"file": writer.weight_map[name], "dtype": dtype_name(dtype),
                                       "shape": list(shape)} for name, dtype, shape in entries},
                    **(extra or {}), "files": files}
        atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=1))
    return out


@contextlib.contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """A fresh ``<out>.tmp-<pid>`` directory to write into, renamed to ``out`` when the block
    completes and removed when it raises: ``out`` appears whole or not at all.

    Raises:
        WeightsError: ``out`` exists already.
    """
    if out.exists():
        raise WeightsError(f"{out}: already exists; remove it or choose another --out")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, out)
    fsync_dir(out.parent)


# ---------------------------------------------------------------------------------------------
# Recognising and reading checkpoints
# ---------------------------------------------------------------------------------------------


def is_weights_dir(path: Path) -> bool:
    """True when ``path`` holds a weights directory's manifest."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def resolve_checkpoint(path: str | os.PathLike) -> tuple[str, Path]:
    """What ``path`` is: ``("weights", dir)``, ``("dcp", step_dir)`` for a training checkpoint,
    or ``("dcp", newest complete step_dir)`` for a directory of them. Read-only; the newest
    checkpoint is not verified here (loading verifies).

    Raises:
        WeightsError: nothing loadable at ``path``.
    """
    p = Path(path)
    if not p.is_dir():
        raise WeightsError(f"{p}: no such directory")
    if is_weights_dir(p):
        return "weights", p
    if (p / MANIFEST).is_file() and (p / ".metadata").is_file():
        return "dcp", p
    found = list_checkpoints(p)
    if found:
        return "dcp", found[-1][1]
    raise WeightsError(f"{p}: neither a weights directory (python -m moetrain.hf import), a training checkpoint "
                       f"step_XXXXXXXX nor a directory of them")


def read_manifest(path: Path) -> dict:
    """The manifest of weights directory ``path``. Raises :class:`WeightsError` if unreadable."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: cannot read {MANIFEST} ({e})") from e
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise WeightsError(f"{path}: {MANIFEST} is not a {FORMAT} v{FORMAT_VERSION} manifest")
    return manifest


def verify_weights_dir(path: Path, progress: bool = False) -> dict:
    """Check size and sha256 of every file of the manifest; returns the manifest.

    Raises:
        WeightsError: manifest missing, a file missing, truncated or altered.
    """
    try:
        # The same manifest layout ("files": name → bytes, sha256) as a training checkpoint.
        verify_checkpoint(Path(path), progress=progress)
    except CheckpointError as e:
        raise WeightsError(str(e)) from e
    return read_manifest(path)


def dcp_model_shapes(step_dir: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global shape and dtype of every model tensor of DCP checkpoint ``step_dir``, by
    moetrain name (read from its ``.metadata``, no tensor data)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(step_dir)).read_metadata()
    out = {}
    for key, md in meta.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            out[key[len("model."):]] = (tuple(md.size), md.properties.dtype)
    return out


class CheckpointReader:
    """Whole tensors of a weights directory or a training checkpoint, read offline in one
    process (no process group), a group of tensors at a time; FP8 weights with block scales (an
    FP8 import) dequantized to bf16.

    ``shapes``: moetrain name → (global shape, stored dtype). :meth:`read` returns the named
    tensors at their global shape in their stored dtype.
    """

    def __init__(self, path: str | os.PathLike, verify: bool = True, progress: bool = True):
        self.kind, self.path = resolve_checkpoint(path)
        if self.kind == "weights":
            manifest = verify_weights_dir(self.path, progress) if verify else read_manifest(self.path)
            self.manifest = manifest
            tensors = manifest["tensors"]
            # FP8 weights (an FP8 import) read dequantized, in bf16; their scales go with them.
            self.fp8 = {n for n in tensors if f"{n}_scale_inv" in tensors}
            self.shapes = {n: (tuple(t["shape"]), torch.bfloat16 if n in self.fp8 else torch_dtype(t["dtype"]))
                           for n, t in tensors.items()
                           if not (n.endswith("_scale_inv") and n.removesuffix("_scale_inv") in self.fp8)}
            self._handles: dict[str, object] = {}
        else:
            self.manifest = verify_checkpoint(self.path, progress) if verify else json.loads(
                (self.path / MANIFEST).read_text())
            self.shapes = dcp_model_shapes(self.path)
            self.fp8 = set()

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names``, whole. Raises :class:`WeightsError` for an unknown name."""
        missing = [n for n in names if n not in self.shapes]
        if missing:
            raise WeightsError(f"{self.path}: no tensor {missing[0]} in the checkpoint")
        if self.kind == "weights":
            return {n: dequantize_blocks(self._handle(n).get_tensor(n), self._handle(f"{n}_scale_inv").get_tensor(
                f"{n}_scale_inv"), self.manifest["fp8_block"], torch.bfloat16) if n in self.fp8
                else self._handle(n).get_tensor(n) for n in names}
        import torch.distributed.checkpoint as dcp

        out = {n: torch.empty(self.shapes[n][0], dtype=self.shapes[n][1]) for n in names}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": out}, checkpoint_id=str(self.path), no_dist=True)
        return out

    def _handle(self, name: str):
        from safetensors import safe_open

        file = self.manifest["tensors"][name]["file"]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return self._handles[file]


# ---------------------------------------------------------------------------------------------
# checkpoint.init_from
# ---------------------------------------------------------------------------------------------


def canonical_name(name: str) -> str:
    """A parameter's name in the single-process model: wrapper segments (torch.compile's
    ``_orig_mod``, checkpoint wrappers) removed."""
    return ".".join(seg for seg in name.split(".") if seg not in _WRAPPER_SEGMENTS)


def model_parameters(part: nn.Module, buffers: bool = False) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """(single-process name, parameter, single-process shape) of every parameter of ``part``,
    shared (tied) ones once; with ``buffers`` also its persistent buffers (e.g. the MoE routing
    bias). The shape is a DTensor's global one: its placements say where this rank's piece lies
    (:func:`moetrain.model.init.local_piece`)."""
    seen: set[int] = set()
    named = list(part.named_parameters(remove_duplicate=False))
    if buffers:
        persistent = set(part.state_dict(keep_vars=True))
        named += [(n, b) for n, b in part.named_buffers() if n in persistent]
    slots = slot_stacks(part)
    for name, p in named:
        if id(p) not in seen:
            seen.add(id(p))
            # An expert stack of EPLB's slots is, in the single-process model, the E experts'.
            shape = (slots[id(p)].num_experts, *p.shape[1:]) if id(p) in slots else tuple(p.shape)
            yield canonical_name(name), p, shape


def slot_stacks(part: nn.Module) -> dict[int, SlotMap]:
    """The expert stacks of ``part`` that hold EPLB's slots (``moe.eplb``), by ``id``: their
    :class:`~moetrain.model.moe.SlotMap`."""
    return {id(p): m.slot_map for m in part.modules() if isinstance(m, GroupedExperts) and m.slot_map is not None
            for p in m.parameters(recurse=False)}


def expected_shapes(cfg: Config, buffers: bool = True) -> dict[str, tuple[int, ...]]:
    """Global shape of every parameter (and, with ``buffers``, persistent buffer) of the model
    ``cfg`` describes, by name (tied ones once). Built on the meta device: no memory."""
    from moetrain.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer.from_config(cfg)
    return {name: shape for name, _, shape in model_parameters(model, buffers)}


def _verify_on_rank0(check) -> None:
    """Run ``check()`` (hashing every file of a checkpoint) on rank 0 only, and raise its
    :class:`WeightsError` on every rank. Collective when torch.distributed is initialised."""
    distributed = dist.is_available() and dist.is_initialized()
    error: list = [None]
    if not distributed or dist.get_rank() == 0:
        try:
            check()
        except (WeightsError, CheckpointError) as e:
            error[0] = str(e)
    if distributed:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise WeightsError(error[0])


@torch.no_grad()
def load_weights_dir(path: Path, parts: list[nn.Module], verify: bool = True) -> None:
    """Load weights directory ``path`` into this rank's model parts, each parameter's own
    piece only (see the module docstring). Collective when torch.distributed is initialised
    (rank 0 verifies the files, the others wait for its verdict).

    Raises:
        WeightsError: a file fails verification, or a parameter is missing or shaped otherwise.
    """
    from safetensors import safe_open

    if verify:
        _verify_on_rank0(lambda: verify_weights_dir(path, progress=True))
    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors = read_manifest(path)["tensors"]
    handles: dict[str, object] = {}
    params = [item for part in parts for item in model_parameters(part, buffers=True)]
    by_name = {name: p for name, p, _ in params}
    slots = {k: v for part in parts for k, v in slot_stacks(part).items()}
    # A frozen FP8 base (train.lora.base_dtype: fp8) loaded from unquantized weights: each such
    # weight is read whole and quantized here (one tensor at a time), its block scales with it.
    blocks = {canonical_name(n): m.base_block for part in parts for n, m in part.named_modules()
              if hasattr(m, "base_block")}
    file_block = read_manifest(path).get("fp8_block")
    quantize_here = {name for name, p, _ in params if p.dtype == E4M3 and (
        f"{name}_scale_inv" not in tensors or file_block != blocks[name.rpartition(".")[0]])}
    # FP8 weights (an FP8 import) into a model that is not an FP8 base: dequantized, then sliced.
    dequantize_here = {name for name, p, _ in params if p.dtype != E4M3 and f"{name}_scale_inv" in tensors}

    def whole(name: str, rec: dict) -> torch.Tensor:
        """Tensor ``name`` whole, an FP8 one dequantized (fp32)."""
        t = handles[rec["file"]].get_tensor(name)
        if f"{name}_scale_inv" not in tensors:
            return t
        srec = tensors[f"{name}_scale_inv"]
        if srec["file"] not in handles:
            handles[srec["file"]] = safe_open(str(path / srec["file"]), framework="pt")
        return dequantize_blocks(t, handles[srec["file"]].get_tensor(f"{name}_scale_inv"), file_block, torch.float32)
    for name, p, shape in tqdm(params, desc=f"load {path.name}", disable=rank != 0):
        rec = tensors.get(name)
        if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in quantize_here:
            continue  # a scale made below with its weight
        if rec is None and (not isinstance(p, nn.Parameter) or is_adapter(name)):
            continue  # a buffer the weights do not carry (a routing bias trained from 0), an adapter
        if rec is None:
            raise WeightsError(f"{path}: has no tensor {name}, which the model has (are these the weights of "
                               f"another model config?)")
        if tuple(rec["shape"]) != shape:
            raise WeightsError(f"{path}: tensor {name} is {tuple(rec['shape'])}, the model's is {shape}")
        if rec["file"] not in handles:
            handles[rec["file"]] = safe_open(str(path / rec["file"]), framework="pt")
        local, slices = local_piece(p)
        if id(p) in slots:  # EPLB's slots: row i holds logical expert slots[i]
            rows = torch.tensor(slots[id(p)].slots[slices[0].start:slices[0].stop])
            local.copy_(whole(name, rec)[rows][(slice(None), *slices[1:])].to(local.dtype))
            continue
        if name in dequantize_here:
            local.copy_(whole(name, rec)[slices].to(local.dtype))
            continue
        if name in quantize_here:
            # (the module of "x.wq.weight" is x.wq, of the experts' "x.experts.w1" x.experts)
            codes, scales = quantize_blocks(whole(name, rec), blocks[name.rpartition(".")[0]])
            local.copy_(codes[slices])
            scale_local, scale_slices = local_piece(by_name[f"{name}_scale_inv"])
            scale_local.copy_(scales[scale_slices])
            continue
        local.copy_(handles[rec["file"]].get_slice(name)[slices].to(local.dtype))


def load_initial_weights(path: str | os.PathLike, parts: list[nn.Module], ps, eplb: Any = None) -> Path:
    """``checkpoint.init_from``: load the weights at ``path`` (see :func:`resolve_checkpoint`)
    into this rank's model parts, in any layout; returns what was loaded. Collective.
    ``ps``: the :class:`moetrain.parallel.state.ParallelState`; ``eplb``: the run's
    :class:`moetrain.parallel.eplb.ExpertPlacer` (a checkpoint's logical expert stacks are placed
    into its slots), or None.

    Raises:
        WeightsError: nothing loadable at ``path``, a file fails verification, or the weights
            do not fit the model.
    """
    kind, where = resolve_checkpoint(path)
    if kind == "weights":
        load_weights_dir(where, parts)
        return where
    if any(p.dtype == E4M3 for part in parts for p in part.parameters()):
        raise WeightsError(f"{path}: a training checkpoint, and the FP8 base (train.lora.base_dtype: fp8) is "
                           f"quantized from a weights directory. Fix: export the checkpoint (python -m moetrain.hf "
                           f"export) and import it (python -m moetrain.hf import), then give that directory")
    if where == Path(path):  # one training checkpoint: verify it (rank 0) like a resume does
        checkpointer = Checkpointer(where.parent, ps, keep=1, eplb=eplb)
        _verify_on_rank0(lambda: verify_checkpoint(where, progress=True))
    else:  # a directory of them: its newest one that verifies, as a resume would take
        checkpointer = Checkpointer(Path(path), ps, keep=1, eplb=eplb)
        found = checkpointer.latest_valid()
        if found is None:
            raise WeightsError(f"{path}: no complete checkpoint verifies")
        where = found[1]
    checkpointer.load_weights(where, parts)
    return where


def base_identity(cfg: Config) -> dict:
    """What a LoRA run's frozen base is (``train.lora``), recorded in its checkpoints and
    compared on resume: ``checkpoint.init_from`` resolved (:func:`resolve_checkpoint`) with the
    sha256 of its manifest, or, without it, the seed the base was drawn from.

    Raises:
        WeightsError: ``checkpoint.init_from`` names nothing loadable.
    """
    if cfg.checkpoint.init_from is None:
        return {"path": None, "seed": cfg.run.seed}
    _, where = resolve_checkpoint(cfg.checkpoint.init_from)
    return {"path": str(where.resolve()), "sha256": sha256_file(where / MANIFEST)}


def check_init_from(cfg: Config) -> None:
    """Before launch: ``checkpoint.init_from`` names something loadable whose tensors have the
    names and global shapes of the configured model.

    Raises:
        ConfigError: naming the field, the value, the first differences and the fix.
    """
    value = cfg.checkpoint.init_from
    if value is None:
        return
    try:
        kind, where = resolve_checkpoint(value)
        if kind == "weights":
            tensors = read_manifest(where)["tensors"]
            have = {n: tuple(t["shape"]) for n, t in tensors.items()
                    if not (n.endswith("_scale_inv") and n.removesuffix("_scale_inv") in tensors)}  # FP8 scales
        else:
            have = {n: s for n, (s, _) in dcp_model_shapes(where).items()}
    except WeightsError as e:
        raise ConfigError(f"checkpoint.init_from = {value!r}: {e}. Fix: give a directory written by "
                          f"`python -m moetrain.hf import`, a step_XXXXXXXX checkpoint or a directory of "
                          f"them") from None
    want, allowed = expected_shapes(cfg, buffers=False), expected_shapes(cfg)
    if cfg.model.tie_embeddings:
        have.pop("output.weight", None)  # a training checkpoint lists the tied head too
    problems = [f"missing {n} {s}" for n, s in want.items() if n not in have]
    problems += [f"{n} is {have[n]}, the model's is {s}" for n, s in allowed.items() if n in have and have[n] != s]
    problems += [f"unexpected {n}" for n in have if n not in allowed]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConfigError(f"checkpoint.init_from = {value!r}: its weights do not fit the configured model: "
                          f"{'; '.join(problems[:3])}{more}. Fix: use the model and moe sections written with it "
                          f"(`python -m moetrain.hf import ... --config OUT.yaml`) or the run's own config")
