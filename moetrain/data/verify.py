"""Verifying token shards against their manifest: every file's size and sha256 (and a Megatron
index against its ``.bin``), each rank a share of the bytes, with a cache of what was verified."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm import tqdm

from moetrain.data.format import MANIFEST, ShardError, fix_hint, is_megatron, read_manifest
from moetrain.data.megatron import MegatronFormatError, read_index
from moetrain.utils import atomic_write, sha256_file, split_by_bytes

__all__ = ["VerifyMode", "verify_shards"]

# Hashing more than this many bytes shows a progress bar (below it, hashing is near-instant).
_PROGRESS_BYTES = 100 * 2**20

VerifyMode = Literal["sha256", "size", "none"]


def _read_cache(cache: Path | None, manifest_digest: str) -> dict:
    """Verified entries of ``cache`` made for this manifest ({} when absent, unreadable or for
    another manifest)."""
    if cache is None:
        return {}
    try:
        data = json.loads(Path(cache).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("manifest_sha256") != manifest_digest:
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def _write_cache(cache: Path, manifest_digest: str, entries: dict) -> None:
    """Merge ``entries`` into ``cache`` (atomic rename; a reader sees the old or the new file)."""
    merged = {**_read_cache(cache, manifest_digest), **entries}
    try:
        atomic_write(cache, json.dumps({"manifest_sha256": manifest_digest, "files": merged}, indent=0), fsync=False)
    except OSError:  # a cache that cannot be written costs a re-hash next time, nothing else
        pass


def verify_shards(
    path: str | os.PathLike, mode: VerifyMode = "sha256", split: str | None = None, *, rank: int = 0,
    world: int = 1, agree: Callable[[dict], list[dict]] | None = None, cache: str | os.PathLike | None = None,
) -> dict:
    """Check the shards in ``path`` (token, index and loss-mask files) against their manifest;
    return the manifest.

    Args:
        path: the shard directory (holding ``manifest.json``).
        mode: ``"sha256"``: every ``.bin`` / ``.idx`` exists, has the manifest's size and
            sha256 (reads everything not in ``cache``; a tqdm bar when over 100 MB). ``"size"``:
            exists and has the manifest's size (catches truncation, not altered bytes).
            ``"none"``: only the manifest is checked, and that every file exists.
        split: check only this split (``"train"`` / ``"val"``); ``None``: all splits.
        rank, world: this process checks only its share of the files, about 1/``world`` of the
            bytes (:func:`~moetrain.utils.split_by_bytes`), so the cost per process is O(data / world).
        agree: with ``world > 1``, a collective that takes this rank's result (a small dict) and
            returns every rank's in rank order (``torch.distributed.all_gather_object``): every
            rank then raises the same error, or returns having seen all files checked.
        cache: a JSON file recording verified contents (file name → bytes, mtime in ns, sha256)
            for this manifest (keyed by the manifest's own sha256). In ``"sha256"`` mode a file
            whose size and mtime match its verified entry is not read again; rank 0 adds what was
            hashed. A content change that keeps both size and mtime is not seen (as ``make``).

    Returns:
        The manifest dict (:mod:`moetrain.data.format`).

    Raises:
        ShardError: manifest missing / not JSON / unknown version, unknown split, or a shard file
            missing, of the wrong size (truncated or extended), or with a different sha256
            (altered). The message names the file and says to re-run ``tools/tokenize_corpus.py``.
        ValueError: unknown ``mode``, or ``world > 1`` without ``agree``.
    """
    if mode not in ("sha256", "size", "none"):
        raise ValueError(f"verify mode {mode!r}: must be 'sha256', 'size' or 'none'")
    if world > 1 and agree is None:
        raise ValueError(f"world={world}: verifying a share of the files needs `agree` (a collective)")
    directory = Path(path)
    manifest = read_manifest(directory)
    if split is not None and split not in manifest["splits"]:
        raise ShardError(
            f"{directory / MANIFEST}: no split {split!r} (has {sorted(manifest['splits'])}). {fix_hint(directory)}"
        )
    itemsize = np.dtype(manifest["dtype"]).itemsize
    names = [split] if split is not None else list(manifest["splits"])
    files: dict[str, tuple[int, str]] = {}  # name -> (bytes, sha256); a Megatron file may back both splits
    megatron_checks: dict[str, list[dict]] = {}  # .bin name -> shards to check against their .idx
    for s in names:
        for sh in manifest["splits"][s]["shards"]:
            # v1: the shard is the whole file; v2: a token range [token_offset, + tokens) of it.
            end = sh.get("token_offset", 0) + sh["tokens"]
            if (sh["bytes"] != end * itemsize) if not is_megatron(manifest) else (sh["bytes"] < end * itemsize):
                raise ShardError(f"{directory / MANIFEST}: shard {sh['name']} lists {sh['tokens']} "
                                 f"tokens but {sh['bytes']} bytes. {fix_hint(directory)}")
            files[sh["name"]] = (sh["bytes"], sh["sha256"])
            files[sh["index_name"]] = (sh["index_bytes"], sh["index_sha256"])
            if manifest.get("loss_mask") and "mask_name" not in sh:
                raise ShardError(f"{directory / MANIFEST}: the data has a loss mask but shard {sh['name']} lists no "
                                 f"mask file. {fix_hint(directory)}")
            if "mask_name" in sh:  # fine-tuning data: one loss-mask byte per token
                if sh.get("mask_bytes") != sh["tokens"]:
                    raise ShardError(f"{directory / MANIFEST}: shard {sh['name']} lists {sh['tokens']} tokens but a "
                                     f"mask of {sh['mask_bytes']} bytes. {fix_hint(directory)}")
                files[sh["mask_name"]] = (sh["mask_bytes"], sh.get("mask_sha256", ""))
            megatron_checks.setdefault(sh["name"], []).append(sh)

    owners = split_by_bytes([size for size, _ in files.values()], world)
    mine = {name: exp for (name, exp), owner in zip(files.items(), owners) if owner == rank}
    digest = hashlib.sha256((directory / MANIFEST).read_bytes()).hexdigest()
    cached = _read_cache(Path(cache), digest) if cache is not None and mode == "sha256" else {}
    verified: dict[str, dict] = {}
    try:
        _check_files(directory, manifest, mine, mode, cached, verified, megatron_checks)
        error = None
    except ShardError as e:
        error = str(e)
    result = {"rank": rank, "error": error, "verified": verified}
    results = agree(result) if agree is not None else [result]
    for res in results:
        if res["error"]:
            raise ShardError(res["error"])
    if cache is not None and mode == "sha256" and rank == 0:
        new = {k: v for res in results for k, v in res["verified"].items()}
        if new:
            _write_cache(Path(cache), digest, new)
    return manifest


def _check_files(directory: Path, manifest: dict, files: dict[str, tuple[int, str]], mode: VerifyMode,
                 cached: dict, verified: dict, megatron_checks: dict[str, list[dict]]) -> None:
    """Check ``files`` (name -> expected bytes, sha256) as :func:`verify_shards` says; adds the
    files hashed to ``verified`` (name -> bytes, mtime_ns, sha256)."""
    if mode == "none":  # existence only: one listing per directory, not one stat per file
        listed: dict[Path, set[str]] = {}
        for name in files:
            f = directory / name
            if f.parent not in listed:
                listed[f.parent] = set(os.listdir(f.parent)) if f.parent.is_dir() else set()
            if f.name not in listed[f.parent]:
                raise ShardError(f"{f}: shard file missing (listed in {MANIFEST}). {fix_hint(directory)}")
        return
    stats: dict[str, tuple[int, int]] = {}  # name -> (bytes, mtime_ns): one stat per file, nothing more kept
    for name, (size, _) in files.items():
        f = directory / name
        try:
            st = f.stat()
        except FileNotFoundError:
            raise ShardError(f"{f}: shard file missing (listed in {MANIFEST}). {fix_hint(directory)}") from None
        actual = st.st_size
        stats[name] = (actual, st.st_mtime_ns)
        if actual != size:
            what = "truncated" if actual < size else "longer than written (appended to?)"
            raise ShardError(
                f"{f}: size {actual} bytes differs from the manifest's {size} bytes: the file is "
                f"{what}. {fix_hint(directory)}"
            )
    if is_megatron(manifest):
        for name in files:
            for sh in megatron_checks.get(name, []):
                _check_megatron_shard(directory, sh)
    if mode != "sha256":
        return

    def fresh(name: str) -> bool:
        entry, (nbytes, mtime_ns) = cached.get(name), stats[name]
        return (isinstance(entry, dict) and entry.get("sha256") == files[name][1]
                and entry.get("bytes") == nbytes and entry.get("mtime_ns") == mtime_ns)

    todo = [name for name in files if not fresh(name)]
    total = sum(files[name][0] for name in todo)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"verify sha256 {directory}",
              disable=total <= _PROGRESS_BYTES) as bar:
        for name in todo:
            f, expected = directory / name, files[name][1]
            actual = sha256_file(f, bar)
            if actual != expected:
                raise ShardError(
                    f"{f}: sha256 mismatch (manifest {expected[:16]}…, file {actual[:16]}…): "
                    f"the file was altered or corrupted. {fix_hint(directory)}"
                )
            verified[name] = {"bytes": stats[name][0], "mtime_ns": stats[name][1], "sha256": actual}


def _check_megatron_shard(directory: Path, sh: dict) -> None:
    """The .idx is a readable Megatron index matching its .bin, and the shard's document range
    covers exactly its token range."""
    try:
        index = read_index(directory / sh["index_name"], bin_bytes=sh["bytes"])
    except MegatronFormatError as e:
        raise ShardError(f"{e}. {fix_hint(directory)}") from None
    first, n = sh.get("first_document", 0), sh["documents"]
    starts = index.document_token_starts()
    ends = np.append(starts, index.num_tokens)
    if first + n > index.num_documents or (n and (ends[first] != sh.get("token_offset", 0)
                                                  or ends[first + n] != sh.get("token_offset", 0) + sh["tokens"])):
        raise ShardError(f"{directory / sh['index_name']}: documents [{first}, {first + n}) do not span the "
                         f"manifest's tokens of {sh['name']}. {fix_hint(directory)}")
