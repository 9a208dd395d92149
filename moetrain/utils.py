"""Small utilities that every layer may import (this module imports nothing from moetrain): file
hashing, the one atomic file write and its fsync policy, byte-balanced work splits, and the
config-error shape with the check that keeps config strings from injecting into sbatch scripts."""

from __future__ import annotations

import hashlib
import os
import re
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "field_error", "sha256_file", "fsync_dir", "atomic_write", "split_by_bytes",
           "check_sbatch_safe"]

_CHUNK = 8 * 2**20


class ConfigError(ValueError):
    """A config field has a wrong name, type or value; the message says which and how to fix it."""


def field_error(field_name: str, value: Any, problem: str, fix: str) -> ConfigError:
    """The one shape of every config message: ``<field> = <value>: <problem>. Fix: <fix>``."""
    return ConfigError(f"{field_name} = {value!r}: {problem}. Fix: {fix}")


def sha256_file(path: Path, bar=None) -> str:
    """Hex sha256 of a file, read in 8 MiB chunks (``bar``, a tqdm bar, advanced by the bytes read)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return h.hexdigest()


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so that the renames and creations in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: bytes | str, *, fsync: bool = True) -> None:
    """Replace ``path`` by a file holding ``data`` (``str``: as UTF-8) atomically: readers see the
    old content or the new, never a part. Written to ``.<name>.tmp-<host>-<pid>`` beside it, then
    renamed over it.

    The fsync policy (the streaming shard writers and the checkpoint commit follow it too): a file
    is fsynced before its rename and its directory after, so once this returns the content
    survives a crash of the node. ``fsync=False`` for files rewritten often whose loss costs
    nothing (heartbeats, caches): atomic, not durable.

    Raises:
        OSError: the write failed; the temporary file is removed and ``path`` is unchanged.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def split_by_bytes(sizes: Sequence[int], parts: int) -> list[int]:
    """The owner (``0 .. parts - 1``) of each item so that every part gets about the same bytes:
    largest item first, each to the part with the fewest bytes so far (LPT; within 4/3 of the
    best split, Graham 1969). Deterministic — ties go to the lower index — so every rank computes
    the same assignment without talking to the others.

    Raises:
        ValueError: ``parts`` < 1.
    """
    if parts < 1:
        raise ValueError(f"parts={parts}: must be at least 1")
    load = [0] * parts
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        p = min(range(parts), key=lambda p: (load[p], p))
        owner[i] = p
        load[p] += sizes[i]
    return owner


# Safe sbatch strings. submitit shlex-quotes #SBATCH values, but a newline would still end the
# comment line and start a command, and sbatch/scontrol parse these values again. So we accept
# only what SLURM names are made of; anything else (spaces, ; $ ` ' " \ newlines, a leading -) is
# refused.
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
# field: (whole-value pattern, its characters, what they are in words, example for the fix)
_SAFE: dict[str, tuple[str, str, str, str]] = {
    "partition": (rf"{_NAME}(,{_NAME})*", r"[A-Za-z0-9_.,-]", "letters, digits, _ . - and commas between names",
                  "a partition name such as gpu, or a list such as gpu,debug"),
    "account": (_NAME, r"[A-Za-z0-9_.-]", "letters, digits and _ . -", "an account name such as proj123"),
    "qos": (_NAME, r"[A-Za-z0-9_.-]", "letters, digits and _ . -", "a QOS name such as normal"),
    # SLURM feature expressions: features joined by & | , with [ ] ( ) grouping and *N counts.
    "constraint": (r"[A-Za-z0-9_\[(][A-Za-z0-9_.&|,*\[\]()-]*", r"[A-Za-z0-9_.&|,*\[\]()-]",
                   "letters, digits, _ . - and the operators & | , * [ ] ( )", "a feature expression such as a100&ib"),
    # Host lists: n1,n2 or gpu[01-04,07].
    "exclude": (r"[A-Za-z0-9_][A-Za-z0-9_.,\[\]-]*", r"[A-Za-z0-9_.,\[\]-]", "letters, digits and _ . - , [ ]",
                "a host list such as gpu[01-03],gpu07"),
    "job_name": (r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", r"[A-Za-z0-9_.+-]", "letters, digits and _ . + -",
                 "a run name such as moe-demo"),
}
_MAX_LEN = 200


def check_sbatch_safe(kind: str, field_name: str, value: str) -> None:
    """Check ``value`` before it is written into an sbatch script as a ``kind`` (a key of ``_SAFE``:
    partition, account, qos, constraint, exclude, job_name): only the characters such SLURM names
    are made of, at most 200 of them.

    Raises:
        ConfigError: naming ``field_name``, the value, the characters found and an example.
    """
    pattern, chars, allowed, example = _SAFE[kind]
    if len(value) <= _MAX_LEN and re.fullmatch(pattern, value):
        return
    if len(value) > _MAX_LEN:
        problem = f"{len(value)} characters, more than {_MAX_LEN}"
    else:
        bad = sorted({c for c in value if not re.fullmatch(chars, c)})
        problem = (f"may only contain {allowed} and must start with a letter, digit or _"
                   + (f"; found {', '.join(repr(c) for c in bad)}" if bad else ""))
    raise field_error(field_name, value, problem + " (it is written into the sbatch script)", f"use {example}")
