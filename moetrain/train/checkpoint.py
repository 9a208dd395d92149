"""Distributed checkpoints: atomic, verified, resumable under another layout.

Layout on disk (``checkpoint.dir``, default ``<run.dir>/checkpoints``)::

    step_00000100/            a complete checkpoint (only complete ones have this name)
        .metadata, __*.distcp torch.distributed.checkpoint files (model, optimizer, train state)
        rng/rank00000.pt      each rank's RNG state
        manifest.json         step, layout, and size + sha256 of every file above
    step_00000150.tmp-<attempt>/   being written; never read

Writing: every rank writes into the temporary directory with ``torch.distributed.checkpoint``;
after a barrier rank 0 hashes the files, writes ``manifest.json`` (fsync) and renames the
directory to its final name — the rename is the commit point, so a crash leaves either the old
set of checkpoints or the new one. The temporary name carries the attempt (restart) number, so
a process left over from an earlier attempt can never complete a checkpoint of the current one.

Reading: the newest ``step_*`` whose manifest verifies (sizes and sha256) is loaded; a corrupt
one is reported and skipped, never loaded. Expert weights and their optimizer states are saved
as DTensors sharded over the expert axes, so a checkpoint written with one (dp, ep) layout loads
into another: DCP reshards them. Under ZeRO (FSDP) the dense parameters and states are saved as
FSDP's DTensors, and the experts' FSDP shards are gathered to the same expert-axes layout, so
a checkpoint loads into any zero stage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from tqdm import tqdm

from moetrain.model.moe import GroupedExperts
from moetrain.parallel.state import EDP, EP, TP, ParallelState

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing files or its contents do not match its manifest."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / "manifest.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def verify_checkpoint(path: Path, progress: bool = False) -> dict:
    """Check every file listed in ``manifest.json`` (size and sha256); returns the manifest.

    Raises:
        CheckpointError: manifest missing or unreadable, a file missing, truncated or altered.
    """
    mpath = path / "manifest.json"
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{mpath}: cannot read the checkpoint manifest ({e})") from e
    files = manifest.get("files", {})
    total = sum(f["bytes"] for f in files.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"verify {path.name}", disable=not progress)
    for name, rec in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: listed in the manifest but missing")
        size = f.stat().st_size
        if size != rec["bytes"]:
            raise CheckpointError(f"{f}: {size} bytes, manifest says {rec['bytes']} (truncated or replaced)")
        if _sha256(f) != rec["sha256"]:
            raise CheckpointError(f"{f}: sha256 differs from the manifest (the file was altered)")
        bar.update(size)
    bar.close()
    return manifest


class Checkpointer:
    """Saves and restores model, optimizer, train state (step, data position) and RNG.

    ``attempt`` fences writes: it names the temporary directories of this attempt.
    """

    def __init__(self, root: Path, ps: ParallelState, keep: int, attempt: int = 0, fence: Any = None):
        """``fence``: a :class:`moetrain.train.records.Fence`; checked before the commit
        (rename) and before deleting anything, so a stale attempt never does either."""
        self.root, self.ps, self.keep, self.attempt, self.fence = Path(root), ps, keep, attempt, fence
        self._expert_mesh = ps.expert_mesh[(EDP, EP, TP)]

    # -- state dict with layout-independent expert tensors ------------------------------------

    def _state_dicts(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer] | None,
                     for_load: bool = False
                     ) -> tuple[dict, dict, list[tuple[set, set]], dict[str, Callable[[DTensor], torch.Tensor]]]:
        """Merged model and optimizer state dicts of all model parts (their keys are the full
        model's names, so they do not collide), each part's key sets for loading back, and for
        every expert tensor the function that turns its loaded global-layout DTensor back into
        what the model or optimizer holds.

        Expert tensors — this rank's [El, ...] experts — become DTensors on the expert mesh
        (edp, ep, tp) with placements (Replicate, Shard(0), Replicate): global [E, ...], whatever
        the layout. Under ZeRO (FSDP) the expert tensor is itself a DTensor holding a shard of
        the [El, ...] tensor over ``edp_tp``: it is all-gathered to [El, ...] for saving (for
        loading only its shape matters) and cut back to this rank's shard after loading, without
        communication (the edp_tp ranks are replicas on the expert mesh, so each holds all of
        [El, ...]). ``for_load``: skip that all-gather. ``optimizers=None``: the model only (the
        optimizer state dict is empty; a fresh optimizer is left untouched, whereas
        ``get_state_dict`` would initialise its states with a step).
        """
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        msd, osd, keys = {}, {}, []
        for i, part in enumerate(parts):
            if optimizers is None:
                m, o = get_model_state_dict(part), {}
            else:
                m, o = get_state_dict(part, optimizers[i], options=opts)
            keys.append((set(m), set(o)))
            msd.update(m)
            osd.update(o)
        expert_names = {f"{n}.{p}" for part in parts for n, m in part.named_modules()
                        if isinstance(m, GroupedExperts) for p in ("w1", "w2", "w3")}
        placements = (Replicate(), Shard(0), Replicate())
        unwrap: dict[str, Callable[[DTensor], torch.Tensor]] = {}

        def to_global(key: str, value: torch.Tensor) -> DTensor:
            if isinstance(value, DTensor):  # FSDP shard of [El, ...] over edp_tp
                mesh, fsdp_placements = value.device_mesh, value.placements
                local = torch.empty(value.shape, dtype=value.dtype, device=value.device) if for_load \
                    else value.full_tensor()
                unwrap[key] = lambda t: distribute_tensor(t.to_local(), mesh, fsdp_placements, src_data_rank=None)
            else:
                local = value
                unwrap[key] = lambda t: t.to_local()
            return DTensor.from_local(local, self._expert_mesh, placements, run_check=False)

        for key, value in list(msd.items()):
            if key in expert_names:
                msd[key] = to_global(key, value)
        for key, value in list(osd.items()):
            # Flattened optimizer keys look like "state.<param fqn>.exp_avg".
            if key.startswith("state.") and isinstance(value, torch.Tensor) and value.ndim > 0:
                fqn = key[len("state."):].rsplit(".", 1)[0]
                if fqn in expert_names:
                    osd[key] = to_global(key, value)
        return msd, osd, keys, unwrap

    @staticmethod
    def _unwrap(sd: dict, unwrap: dict[str, Callable[[DTensor], torch.Tensor]]) -> dict:
        return {k: (unwrap[k](v) if k in unwrap else v) for k, v in sd.items()}

    # -- save ---------------------------------------------------------------------------------

    def save(self, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
             train_state: dict, layout: dict) -> Path:
        """Write checkpoint ``step`` atomically (collective: every rank calls it)."""
        t0 = time.time()
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp-{self.attempt}"
        if self.fence is not None:  # every rank, so a stale attempt stops before any collective
            self.fence.check()
        if self.ps.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        msd, osd, _, _ = self._state_dicts(parts, optimizers)
        dcp.save({"model": msd, "optim": osd, "train": dict(train_state)}, checkpoint_id=str(tmp))
        torch.save({"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
                   tmp / "rng" / f"rank{self.ps.rank:05d}.pt")
        dist.barrier()
        if self.ps.rank == 0:
            files = {}
            for f in sorted(tmp.rglob("*")):
                if f.is_file():
                    files[str(f.relative_to(tmp))] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
            manifest = {"step": step, "world_size": self.ps.world_size, "layout": layout,
                        "train_state": train_state, "attempt": self.attempt, "time": time.time(), "files": files}
            mtmp = tmp / "manifest.json.tmp"
            with open(mtmp, "w") as fh:
                json.dump(manifest, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(mtmp, tmp / "manifest.json")
            if self.fence is not None:
                self.fence.check()
            if final.exists():  # the same step saved by an earlier attempt
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            self._prune()
            log.info("checkpoint step %d saved to %s in %.1f s", step, final, time.time() - t0)
        dist.barrier()
        return final

    def _prune(self) -> None:
        complete = list_checkpoints(self.root)
        for _, path in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(path, ignore_errors=True)
        # Temporary directories of earlier attempts can never complete: remove them.
        for p in self.root.iterdir():
            if ".tmp-" in p.name and not p.name.endswith(f".tmp-{self.attempt}"):
                shutil.rmtree(p, ignore_errors=True)

    # -- load ---------------------------------------------------------------------------------

    def latest_valid(self) -> tuple[int, Path] | None:
        """Newest checkpoint that verifies, agreed by all ranks (rank 0 checks, then broadcasts)."""
        choice: list[Any] = [None]
        if self.ps.rank == 0:
            for step, path in reversed(list_checkpoints(self.root)):
                try:
                    verify_checkpoint(path, progress=True)
                except CheckpointError as e:
                    log.error("skipping corrupt checkpoint %s: %s", path, e)
                    continue
                choice[0] = (step, str(path))
                break
        dist.broadcast_object_list(choice, src=0)
        return None if choice[0] is None else (choice[0][0], Path(choice[0][1]))

    def load(self, path: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
        """Load ``path`` into the model parts and optimizers in place; returns the train state."""
        t0 = time.time()
        msd, osd, keys, unwrap = self._state_dicts(parts, optimizers, for_load=True)
        manifest = json.loads((path / "manifest.json").read_text())
        train_state = {k: v for k, v in manifest["train_state"].items()}
        state = {"model": msd, "optim": osd, "train": dict(train_state)}
        dcp.load(state, checkpoint_id=str(path))
        loaded_m, loaded_o = self._unwrap(state["model"], unwrap), self._unwrap(state["optim"], unwrap)
        for part, opt, (mkeys, okeys) in zip(parts, optimizers, keys):
            set_state_dict(part, opt, model_state_dict={k: loaded_m[k] for k in mkeys},
                           optim_state_dict={k: loaded_o[k] for k in okeys},
                           options=StateDictOptions(flatten_optimizer_state_dict=True))
        rng = path / "rng" / f"rank{self.ps.rank:05d}.pt"
        if manifest["world_size"] == self.ps.world_size and rng.is_file():
            r = torch.load(rng, weights_only=False)
            torch.set_rng_state(r["cpu"])
            if r["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(r["cuda"])
        log.info("loaded checkpoint %s (step %d) in %.1f s", path, manifest["step"], time.time() - t0)
        return state["train"]

    def load_weights(self, path: Path, parts: list[nn.Module]) -> None:
        """Load only the model weights of checkpoint ``path`` (any layout) into the model parts;
        optimizers, train state and RNG are not read or touched (``checkpoint.init_from``)."""
        t0 = time.time()
        msd, _, keys, unwrap = self._state_dicts(parts, None, for_load=True)
        state = {"model": msd}
        dcp.load(state, checkpoint_id=str(path))
        loaded = self._unwrap(state["model"], unwrap)
        for part, (mkeys, _) in zip(parts, keys):
            set_model_state_dict(part, {k: loaded[k] for k in mkeys})
        log.info("loaded the weights of checkpoint %s in %.1f s", path, time.time() - t0)
