"""Distributed checkpoints: asynchronous, sharded, atomic, verified, resumable under another layout.

Layout on disk (``checkpoint.dir``, default ``<run.dir>/checkpoints``)::

    step_00000100/            a complete checkpoint (only complete ones have this name)
        .metadata, __<rank>_*.distcp   torch.distributed.checkpoint files (model, optimizer, train state)
        rng/rank00000.pt      each rank's RNG state
        manifest.json         step, layout, and size + sha256 of every file above
    step_00000150.tmp-<attempt>/   being written; never read
        parts/rank00000.json  each rank's own files with their sizes and sha256 (or its error)

Writing (:meth:`Checkpointer.save`), in this order:

1. **stage** (the training loop waits for this only): the state dicts are copied to host memory
   (``torch.distributed.checkpoint.async_save``'s stager) and the RNG state is taken;
2. **write** (background): every rank writes its own shards with DCP, over a process group of
   its own (gloo), so these collectives never interleave with the training step's;
3. **hash** (background): every rank hashes the files it wrote — no rank reads another's bytes —
   and records them in ``parts/rank<r>.json`` (or the error that stopped it);
4. **commit** (background, rank 0): once every rank's part is there (a file poll, no collective),
   rank 0 assembles ``manifest.json`` (fsync) and renames the directory to its final name — the
   rename is the commit point, so a crash leaves either the old set of checkpoints or the new one.

The next :meth:`Checkpointer.save` (and :meth:`Checkpointer.wait`) waits for the previous
checkpoint first, and raises the error it met (a failed write, e.g. a full disk). With
``checkpoint.async: false`` the save waits for all four phases before it returns. The temporary
name carries the attempt (restart) number and the commit checks the attempt fence, so a process
left over from an earlier attempt can never complete a checkpoint of the current one.

Reading: the newest ``step_*`` whose manifest verifies (sizes and sha256; each rank checks about
1/ranks of the bytes, one collective agrees) is loaded; a corrupt one is reported and skipped,
never loaded. Every parameter and optimizer state is a DTensor of its global shape placed as it
lives (tp, ep, FSDP shards; the experts [experts, ...] Shard(0) over ep), so nothing is gathered
to full tensors, and a checkpoint written with one layout loads into another: DCP reshards.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from tqdm import tqdm

from moetrain.model.lora import is_adapter
from moetrain.parallel.state import ParallelState
from moetrain.utils import atomic_write, fsync_dir, sha256_file, split_by_bytes

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d{8})$")
_POLL_S = 0.05  # rank 0's first poll interval for the other ranks' parts (doubling up to 1 s)


class CheckpointError(RuntimeError):
    """A checkpoint is missing files or its contents do not match its manifest, or it could not
    be written (the message names the rank and its error)."""


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


def verify_checkpoint(path: Path, progress: bool = False, *, rank: int = 0, world: int = 1) -> dict:
    """Check the files listed in ``manifest.json`` (size and sha256); returns the manifest.

    ``rank`` / ``world``: check only this rank's share of the files, about 1/``world`` of the
    bytes (:func:`moetrain.utils.split_by_bytes`; the same split on every rank), so that
    ``world`` ranks together check everything once. Defaults: every file.

    Raises:
        CheckpointError: manifest missing or unreadable, a file missing, truncated or altered.
    """
    mpath = path / "manifest.json"
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{mpath}: cannot read the checkpoint manifest ({e})") from e
    files = manifest.get("files", {})
    names = sorted(files)
    owners = split_by_bytes([files[n]["bytes"] for n in names], world)
    mine = [n for n, owner in zip(names, owners) if owner == rank]
    total = sum(files[n]["bytes"] for n in mine)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"verify {path.name}", disable=not progress) as bar:
        for name in mine:
            rec, f = files[name], path / name
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in the manifest but missing")
            size = f.stat().st_size
            if size != rec["bytes"]:
                raise CheckpointError(f"{f}: {size} bytes, manifest says {rec['bytes']} (truncated or replaced)")
            if sha256_file(f, bar) != rec["sha256"]:
                raise CheckpointError(f"{f}: sha256 differs from the manifest (the file was altered)")
    return manifest


def _run_in_background(fn: Callable[[], Any], name: str) -> Future:
    """``fn()`` in a daemon thread; its result or exception in the returned future. Daemon: a
    checkpoint stuck on a dead peer must not keep the process from exiting."""
    fut: Future = Future()

    def target() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            fut.set_exception(e)

    threading.Thread(target=target, name=name, daemon=True).start()
    return fut


class Checkpointer:
    """Saves and restores model, optimizer, train state (step, data position) and RNG.

    ``attempt`` fences writes: it names the temporary directories of this attempt.
    ``async_save``: the write, the hashing and the commit run in the background (module doc).
    ``timeout_s``: bounds the checkpoint's collectives and rank 0's wait for the other ranks.
    Collective: every rank constructs it (it creates the checkpoint's own process group).
    """

    def __init__(self, root: Path, ps: ParallelState, keep: int, attempt: int = 0, fence: Any = None, *,
                 async_save: bool = True, timeout_s: float = 1800.0, trained_only: bool = False, eplb: Any = None):
        """``fence``: a :class:`moetrain.train.records.Fence`; checked before the commit
        (rename) and before deleting anything, so a stale attempt never does either.
        ``trained_only`` (``train.lora``): checkpoints hold the parameters that train (the
        adapters) and the buffers, not the frozen base, which the run loads from
        ``checkpoint.init_from`` (or draws from ``run.seed``) before it resumes. ``eplb``: the
        run's :class:`moetrain.parallel.eplb.ExpertPlacer` under ``moe.eplb`` (its expert slots are
        saved in logical order and placed back on load), else None."""
        self.root, self.ps, self.keep, self.attempt, self.fence = Path(root), ps, keep, attempt, fence
        self.trained_only = trained_only
        self.async_save, self.timeout_s = async_save, timeout_s
        # DCP's collectives (plan, write results) run in a background thread during training:
        # on a group of their own, so they never interleave with the step's collectives.
        self._pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._pending: Future | None = None
        self.last_stall_s = 0.0  # seconds the last save() kept the caller (staging, or all of it)
        self.last_background_s = 0.0  # seconds from staged to written and hashed (rank 0: committed)
        self.skipped: list[tuple[Path, str]] = []  # corrupt checkpoints the last latest_valid() skipped
        # EPLB's placer (moetrain.parallel.eplb.ExpertPlacer): expert stacks are saved in logical
        # order and placed back into this run's slots on load. None: the stacks are logical.
        self.eplb = eplb

    # -- state dicts ------------------------------------------------------------------------

    def _state_dicts(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer] | None,
                     base_only: bool = False) -> tuple[dict, dict, list[tuple[set, set]]]:
        """Merged model and optimizer state dicts of all model parts (their keys are the full
        model's names, so they do not collide) and each part's key sets for loading back. Every
        tensor is a DTensor of the global shape placed as it lives (tp, ep and FSDP shards,
        replicas), or a plain tensor in one process: DCP saves each piece once and reshards on
        load. ``optimizers=None``: the model only (a fresh optimizer is left untouched, whereas
        ``get_state_dict`` would initialise its states with a step). With ``trained_only`` the
        model's entries are the parameters that train and the buffers; ``base_only``: all but
        the low-rank adapters (the weights of a base, ``checkpoint.init_from``)."""
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        msd, osd, keys = {}, {}, []
        for i, part in enumerate(parts):
            if optimizers is None:
                m, o = get_model_state_dict(part), {}
            else:
                m, o = get_state_dict(part, optimizers[i], options=opts)
            if self.trained_only and not base_only:
                kept = {n for n, p in part.named_parameters() if p.requires_grad} | {n for n, _ in part.named_buffers()}
                m = {k: v for k, v in m.items() if k in kept}
            elif base_only:
                m = {k: v for k, v in m.items() if not is_adapter(k)}
            keys.append((set(m), set(o)))
            msd.update(m)
            osd.update(o)
        return msd, osd, keys

    # -- save ---------------------------------------------------------------------------------

    def save(self, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
             train_state: dict, layout: dict, *, wait: bool | None = None) -> Path:
        """Start checkpoint ``step`` (collective: every rank calls it); returns its final path.

        Waits first for the previous checkpoint (:meth:`wait`). Returns once the state is staged
        in host memory; the write, the hashing and the commit go on in the background, unless
        ``wait`` (default: ``not async_save``), which returns after the commit on every rank.

        Raises:
            StaleAttemptError: a newer attempt owns the run directory.
            CheckpointError, OSError: the previous checkpoint failed (from :meth:`wait`), or this
                one (with ``wait``).
        """
        t0 = time.perf_counter()
        self.wait()
        wait = (not self.async_save) if wait is None else wait
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp-{self.attempt}"
        if self.fence is not None:  # every rank, so a stale attempt stops before any collective
            self.fence.check()
        if self.ps.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
            (tmp / "parts").mkdir()
        dist.barrier()
        msd, osd, _ = self._state_dicts(parts, optimizers)
        if self.eplb is not None:  # logical stacks; each MoE layer's placement and window of loads
            self.eplb.to_logical(msd, osd)
            train_state = {**train_state, "eplb": self.eplb.state_dict()}
        state = {"model": msd, "optim": osd, "train": dict(train_state)}
        rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
        meta = {"step": step, "world_size": self.ps.world_size, "layout": layout, "train_state": train_state,
                "attempt": self.attempt}
        # 1. stage: async_save copies every tensor to host memory before it returns.
        if self.async_save:
            write = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._pg)
        else:
            write = Future()
            try:
                write.set_result(dcp.save(state, checkpoint_id=str(tmp), process_group=self._pg))
            except (Exception, CheckpointException) as e:  # reported by _finish, as in the async case
                write.set_exception(e)
        started = time.time()
        # 2-4. write (DCP's thread), hash, commit: in the background.
        self._pending = _run_in_background(lambda: self._finish(write, tmp, final, rng, meta, started),
                                           f"moetrain-checkpoint-{step}")
        if wait:
            self.wait()
            dist.barrier()  # returns on every rank once the checkpoint is committed
        self.last_stall_s = time.perf_counter() - t0
        return final

    def wait(self) -> Path | None:
        """Wait for the checkpoint in flight, if any: this rank's write and hashes, and on rank 0
        the commit. Returns its final path (``None`` when nothing was in flight).

        Raises:
            CheckpointError, OSError, StaleAttemptError: what stopped that checkpoint.
        """
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def _own_files(self, tmp: Path) -> list[Path]:
        """The files this rank wrote: its DCP shards (DCP names them ``__<rank>_<n>.distcp`` after
        the rank in its process group, here the global rank), its RNG state, and on rank 0 (DCP's
        coordinator) ``.metadata``."""
        r = self.ps.rank
        own = sorted(tmp.glob(f"__{r}_*")) + [tmp / "rng" / f"rank{r:05d}.pt"]
        return own + ([tmp / ".metadata"] if r == 0 else [])

    def _finish(self, write: Future, tmp: Path, final: Path, rng: dict, meta: dict, started: float) -> Path:
        """Background part of a save: wait for the write, hash this rank's files into
        ``parts/rank<r>.json`` (or record the error there), and on rank 0 commit."""
        part_path = tmp / "parts" / f"rank{self.ps.rank:05d}.json"
        try:
            try:
                write.result()  # DCP returns on every rank once all ranks' writes and .metadata are done
            except CheckpointException as e:  # a BaseException: make it an error callers can catch
                failures = "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in e.failures.items())
                raise CheckpointError(f"checkpoint step {meta['step']} not written ({tmp}): {failures}") from None
            torch.save(rng, tmp / "rng" / f"rank{self.ps.rank:05d}.pt")
            files = {str(f.relative_to(tmp)): {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
                     for f in self._own_files(tmp)}
            # A part is a message to rank 0, which deletes the parts directory as soon as it has
            # every rank's (the commit): not fsynced, since fsyncing its directory after the
            # rename could find it gone; the manifest rank 0 writes is the durable record.
            atomic_write(part_path, json.dumps({"rank": self.ps.rank, "files": files}, indent=1), fsync=False)
        except BaseException as e:
            try:
                error = {"rank": self.ps.rank, "error": f"{type(e).__name__}: {e}"}
                atomic_write(part_path, json.dumps(error, indent=1), fsync=False)
            except OSError:
                pass  # rank 0 then times out waiting for this part, and says so
            raise
        if self.ps.rank == 0:
            self._commit(tmp, final, meta, started)
        self.last_background_s = time.time() - started
        return final

    def _commit(self, tmp: Path, final: Path, meta: dict, started: float) -> None:
        """Rank 0: wait for every rank's part, write the manifest, rename (the commit point)."""
        world, step = self.ps.world_size, meta["step"]
        parts_dir, deadline, poll = tmp / "parts", time.time() + self.timeout_s, _POLL_S
        while True:
            found = list(parts_dir.glob("rank*.json"))
            if len(found) >= world:
                break
            if time.time() > deadline:
                have = {int(p.stem[4:]) for p in found}
                missing = [r for r in range(world) if r not in have]
                raise CheckpointError(f"checkpoint step {step} not committed: rank(s) {missing[:8]} did not report "
                                      f"their files within checkpoint.timeout_s={self.timeout_s:g} s ({tmp})")
            time.sleep(poll)
            poll = min(1.0, poll * 2)
        files: dict[str, dict] = {}
        ranks: dict[str, list[str]] = {}
        for p in sorted(found):
            part = json.loads(p.read_text())
            if "error" in part:
                raise CheckpointError(f"checkpoint step {step} not committed: rank {part['rank']} failed: "
                                      f"{part['error']} ({tmp})")
            files.update(part["files"])
            ranks[str(part["rank"])] = sorted(part["files"])
        shutil.rmtree(parts_dir)
        unclaimed = [f for f in tmp.rglob("*") if f.is_file() and str(f.relative_to(tmp)) not in files]
        if unclaimed:
            raise CheckpointError(f"checkpoint step {step} not committed: files no rank reported, "
                                  f"{[str(f) for f in unclaimed[:4]]} (DCP's file names changed?)")
        manifest = {**meta, "time": time.time(), "files": files, "ranks": ranks}
        atomic_write(tmp / "manifest.json", json.dumps(manifest, indent=1))
        if self.fence is not None:
            self.fence.check()
        if final.exists():  # the same step saved by an earlier attempt
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.root)
        self._prune()
        size = sum(f["bytes"] for f in files.values())
        log.info("checkpoint step %d committed to %s: %.2f GB, written and hashed in %.1f s", step, final,
                 size / 1e9, time.time() - started)

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
        """Newest checkpoint that verifies, agreed by all ranks: rank 0 lists the candidates, each
        rank verifies its share of each candidate's files, one collective per candidate agrees.
        Corrupt ones are logged and listed in ``self.skipped`` as (path, reason)."""
        self.skipped = []
        holder: list[Any] = [None]
        if self.ps.rank == 0:
            holder[0] = [str(p) for _, p in reversed(list_checkpoints(self.root))]
        dist.broadcast_object_list(holder, src=0)
        for candidate in map(Path, holder[0]):
            try:
                verify_checkpoint(candidate, progress=self.ps.rank == 0, rank=self.ps.rank, world=self.ps.world_size)
                error = None
            except CheckpointError as e:
                error = str(e)
            errors: list[Any] = [None] * self.ps.world_size
            dist.all_gather_object(errors, error)
            bad = [e for e in errors if e]
            if not bad:
                return int(_STEP_RE.match(candidate.name).group(1)), candidate
            self.skipped.append((candidate, bad[0]))
            if self.ps.rank == 0:
                log.error("skipping corrupt checkpoint %s: %s", candidate, bad[0])
        return None

    def load(self, path: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
        """Load ``path`` into the model parts and optimizers in place; returns the train state."""
        t0 = time.time()
        msd, osd, keys = self._state_dicts(parts, optimizers)
        manifest = json.loads((path / "manifest.json").read_text())
        train_state = {k: v for k, v in manifest["train_state"].items()}
        taken = None
        if self.eplb is not None:  # the saved placement first: the stacks are placed as it says
            replanned = self.eplb.load_state_dict(train_state.get("eplb"))
            if replanned and self.ps.rank == 0:
                log.info("EPLB: the checkpoint's placement of layers %s was for another ep size: placed from its "
                         "window of loads", ", ".join(replanned))
            taken = self.eplb.logical_templates(msd, osd)
        state = {"model": msd, "optim": osd, "train": dict(train_state)}
        dcp.load(state, checkpoint_id=str(path))
        loaded_m, loaded_o = state["model"], state["optim"]
        if taken:
            self.eplb.to_physical(loaded_m, loaded_o, taken)
        for part, opt, (mkeys, okeys) in zip(parts, optimizers, keys):
            set_state_dict(part, opt, model_state_dict={k: loaded_m[k] for k in mkeys},
                           optim_state_dict={k: loaded_o[k] for k in okeys},
                           options=StateDictOptions(flatten_optimizer_state_dict=True, strict=not self.trained_only))
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
        msd, _, keys = self._state_dicts(parts, None, base_only=True)
        taken = self.eplb.logical_templates(msd, {}) if self.eplb is not None else None
        state = {"model": msd}
        dcp.load(state, checkpoint_id=str(path))
        loaded = state["model"]
        if taken:
            self.eplb.to_physical(loaded, {}, taken)
        for part, (mkeys, _) in zip(parts, keys):
            # (the low-rank adapters, which a base has not, keep their initial values)
            set_model_state_dict(part, {k: loaded[k] for k in mkeys}, options=StateDictOptions(strict=False))
        log.info("loaded the weights of checkpoint %s in %.1f s", path, time.time() - t0)
