"""Token shards: a tokenized corpus on disk, checksummed, memory-mapped for training.

Layout of a shard directory (written by :func:`write_shards` / ``tools/tokenize_corpus.py``)::

    manifest.json        what is there and how to check it (written last)
    train_00000.bin      token ids, flat, little-endian uint16 (vocab_size <= 65536) or uint32
    train_00000.idx      int64 little-endian: offset (in tokens, within this .bin) of every
                         document that starts in this shard, ascending
    train_00001.bin ...
    val_00000.bin / .idx the validation split, same format

Every document is followed by one EOS token. Shards are cut at exactly ``shard_tokens`` tokens
(the last shard of a split is shorter), so a document may run on from one shard into the next;
the ``.idx`` of the next shard then does not list it.

``manifest.json`` (``format_version`` 1)::

    {
      "format": "moetrain-token-shards", "format_version": 1,
      "dtype": "uint16", "vocab_size": 8192, "eos_id": 0,
      "tokenizer": {"name": ..., "vocab_size": ..., "sha256": ...},
      "shard_tokens": 134217728,
      "val_split": {"rule": "every_kth", "k": 100, "description": ...},
      "sources": ["data/demo/corpus"],
      "total_tokens": 1234567, "total_documents": 38,
      "splits": {
        "train": {"tokens": ..., "documents": ..., "shards": [
            {"name": "train_00000.bin", "tokens": ..., "documents": ..., "bytes": ...,
             "sha256": ..., "index_name": "train_00000.idx", "index_bytes": ...,
             "index_sha256": ...}, ...]},
        "val": {...}
      }
    }

Validation split (deterministic, decided per document in stream order, before tokenizing):
``val_fraction=f`` holds out the documents whose 0-based position ``i`` in the input stream
(empty documents are skipped and not counted) has ``i % k == 0`` with ``k = round(1 / f)``, so
document 0 is always held out and ``ceil(n / k)`` of ``n`` documents are; ``val_docs=N`` holds
out the first ``N`` documents. By position, not by hash of an id: inputs need no ids, and the
same inputs in the same order always give the same split.

Training samples (:class:`TokenShards`): sample ``j`` of a shard with ``T`` tokens is tokens
``[j * L, j * L + L + 1)`` (``L`` = seq_len: ``L`` inputs and the ``L`` next-token targets,
shifted by one). A sample never crosses a shard boundary, so a shard holds ``(T - 1) // L``
samples; global sample indices run over the shards in manifest order.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
from tqdm import tqdm

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "DEFAULT_SHARD_TOKENS",
    "SPLITS",
    "ShardError",
    "token_dtype",
    "write_shards",
    "verify_shards",
    "read_manifest",
    "TokenShards",
]

FORMAT_NAME = "moetrain-token-shards"
FORMAT_VERSION = 1
DEFAULT_SHARD_TOKENS = 2**27  # 134M tokens: 256 MiB as uint16
SPLITS = ("train", "val")
MANIFEST = "manifest.json"
# Hashing more than this many bytes shows a progress bar (below it, hashing is near-instant).
_PROGRESS_BYTES = 100 * 2**20
_CHUNK = 8 * 2**20
_SHARD_FILE = re.compile(r"^(train|val)_\d{5}\.(bin|idx)$")

VerifyMode = Literal["sha256", "size", "none"]


class ShardError(ValueError):
    """Shards on disk do not match their manifest (or there is no usable manifest).

    The message names the file, what is wrong, and how to fix it.
    """


class TokenizerLike(Protocol):
    """What :func:`write_shards` needs of a tokenizer (``TextTokenizer`` has it)."""

    vocab_size: int
    eos_id: int
    identity: dict

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (``vocab_size <= 65536``), else ``uint32``; little-endian.

    Raises:
        ValueError: ``vocab_size`` < 1 or > 2**32.
    """
    if not 1 <= vocab_size <= 2**32:
        raise ValueError(f"vocab_size={vocab_size}: must be in [1, 2**32]")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def _fix(directory: Path) -> str:
    return (
        f"Fix: re-create the shards with `python tools/tokenize_corpus.py ... --out {directory}` "
        f"(for the demo data: `python tools/prepare_demo.py`)"
    )


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


class _SplitWriter:
    """Appends token arrays to ``<split>_NNNNN.bin`` files of at most ``shard_tokens`` tokens.

    Each shard is written under a temporary name, hashed as it is written, and renamed into
    place when full (or at :meth:`close`).
    """

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self.tokens = 0
        self.documents = 0
        self._file = None
        self._tmp: Path | None = None
        self._hash = None
        self._n = 0  # tokens in the open shard
        self._starts: list[int] = []  # document starts within the open shard

    def _open(self) -> None:
        name = f"{self.split}_{len(self.shards):05d}.bin"
        self._tmp = self.out_dir / f".{name}.tmp-{os.getpid()}"
        self._file = open(self._tmp, "wb")
        self._hash = hashlib.sha256()
        self._n = 0
        self._starts = []

    def _finish_shard(self) -> None:
        self._file.close()
        name = f"{self.split}_{len(self.shards):05d}.bin"
        index_name = name[: -len(".bin")] + ".idx"
        idx = np.asarray(self._starts, dtype="<i8").tobytes()
        tmp_idx = self.out_dir / f".{index_name}.tmp-{os.getpid()}"
        tmp_idx.write_bytes(idx)
        os.replace(tmp_idx, self.out_dir / index_name)
        os.replace(self._tmp, self.out_dir / name)
        self.shards.append(
            {
                "name": name,
                "tokens": self._n,
                "documents": len(self._starts),
                "bytes": self._n * self.dtype.itemsize,
                "sha256": self._hash.hexdigest(),
                "index_name": index_name,
                "index_bytes": len(idx),
                "index_sha256": hashlib.sha256(idx).hexdigest(),
            }
        )
        self._file = self._tmp = None

    def add_document(self, ids: np.ndarray) -> None:
        """Append one document's ids (EOS included), splitting across shards when full."""
        self.documents += 1
        first = True
        while len(ids):
            if self._file is None:
                self._open()
            if first:
                self._starts.append(self._n)
                first = False
            take = min(len(ids), self.shard_tokens - self._n)
            blob = ids[:take].tobytes()
            self._file.write(blob)
            self._hash.update(blob)
            self._n += take
            self.tokens += take
            ids = ids[take:]
            if self._n == self.shard_tokens:
                self._finish_shard()

    def close(self) -> dict:
        if self._file is not None:
            self._finish_shard()
        return {"tokens": self.tokens, "documents": self.documents, "shards": self.shards}

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._tmp.unlink(missing_ok=True)


def _val_rule(val_fraction: float | None, val_docs: int | None) -> tuple[dict, Any]:
    if (val_fraction is None) == (val_docs is None):
        raise ValueError("give exactly one of val_fraction and val_docs")
    if val_docs is not None:
        if val_docs < 0:
            raise ValueError(f"val_docs={val_docs}: must be >= 0")
        rule = {"rule": "first_n", "n": val_docs,
                "description": f"the first {val_docs} documents of the input stream"}
        return rule, lambda i: i < val_docs
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction}: must be in [0, 1)")
    if val_fraction == 0:
        return {"rule": "none", "description": "no validation split"}, lambda i: False
    k = max(1, round(1 / val_fraction))
    if k == 1:
        raise ValueError(f"val_fraction={val_fraction}: would hold out every document; use < 0.67")
    rule = {"rule": "every_kth", "k": k,
            "description": f"documents at 0-based stream position i with i % {k} == 0"}
    return rule, lambda i: i % k == 0


def _batches(documents: Iterable[str], max_docs: int, max_chars: int) -> Iterator[list[str]]:
    batch, chars = [], 0
    for text in documents:
        batch.append(text)
        chars += len(text)
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def write_shards(
    documents: Iterable[str],
    tokenizer: TokenizerLike,
    out_dir: str | os.PathLike,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_fraction: float | None = None,
    val_docs: int | None = None,
    sources: Sequence[str] = (),
    batch_docs: int = 256,
    batch_chars: int = 8 * 2**20,
    progress: bool = True,
) -> dict:
    """Tokenize ``documents`` (EOS after each) into train/val shards in ``out_dir``.

    Documents are encoded in batches of up to ``batch_docs`` documents or ``batch_chars``
    characters (the tokenizer parallelises within a batch). Empty documents are skipped. Shards
    and their ``.idx`` are written under temporary names and renamed when complete; the manifest
    is written last (temp + rename), and an existing manifest is deleted first, so a directory
    with a manifest always holds a complete set. Shard files of an older run that the new
    manifest does not list are deleted.

    Args:
        documents: texts in a fixed order (e.g. ``iter_documents(path)``); consumed once.
        tokenizer: a ``TextTokenizer`` (anything with ``encode_batch``, ``vocab_size``,
            ``eos_id``, ``identity``).
        out_dir: created if missing.
        shard_tokens: tokens per shard (the last of a split holds the rest); >= 2.
        val_fraction / val_docs: the validation rule (module docstring), at most one of them;
            neither means ``val_fraction=0.01``. ``0`` for either gives an empty val split.
        sources: recorded in the manifest (e.g. the input paths).
        progress: show a tqdm bar (documents, tokens/s) on stderr.

    Returns:
        The manifest (also written to ``out_dir/manifest.json``).

    Raises:
        ValueError: bad arguments, no documents, or every document fell in the val split.
    """
    if shard_tokens < 2:
        raise ValueError(f"shard_tokens={shard_tokens}: must be >= 2")
    if val_fraction is None and val_docs is None:
        val_fraction = 0.01
    rule, is_val = _val_rule(val_fraction, val_docs)
    dtype = token_dtype(tokenizer.vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    for stale in out.glob(".*.tmp-*"):  # left by a run that crashed
        stale.unlink()

    writers = {s: _SplitWriter(out, s, dtype, shard_tokens) for s in SPLITS}
    eos = np.asarray([tokenizer.eos_id], dtype=dtype)
    bar = tqdm(desc=f"tokenize → {out}", unit=" docs", disable=not progress, dynamic_ncols=True)
    n_docs, n_tokens, t0 = 0, 0, time.perf_counter()
    try:
        for batch in _batches((d for d in documents if d), batch_docs, batch_chars):
            for ids in tokenizer.encode_batch(batch):
                arr = np.concatenate([np.asarray(ids, dtype=dtype), eos])
                writers["val" if is_val(n_docs) else "train"].add_document(arr)
                n_docs += 1
                n_tokens += len(arr)
            bar.update(len(batch))
            bar.set_postfix(tokens=f"{n_tokens:,}", tok_s=f"{n_tokens / (time.perf_counter() - t0):,.0f}")
        splits = {s: w.close() for s, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        bar.close()

    if n_docs == 0:
        raise ValueError("no (non-empty) documents in the input")
    if splits["train"]["documents"] == 0:
        raise ValueError(
            f"all {n_docs} documents fell in the validation split ({rule['description']}); "
            f"give more documents, a smaller val fraction, or fewer val docs"
        )
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "tokenizer": dict(tokenizer.identity),
        "shard_tokens": shard_tokens,
        "val_split": rule,
        "sources": [str(s) for s in sources],
        "total_tokens": n_tokens,
        "total_documents": n_docs,
        "splits": splits,
    }
    listed = {f for sp in splits.values() for sh in sp["shards"] for f in (sh["name"], sh["index_name"])}
    for f in out.iterdir():
        if _SHARD_FILE.match(f.name) and f.name not in listed:
            f.unlink()
    tmp = out / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


# ---------------------------------------------------------------------------------------------
# Verifying
# ---------------------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike) -> dict:
    """Read and check ``<path>/manifest.json`` (format, version, keys); no shard file is opened.

    Raises:
        ShardError: directory or manifest missing, not JSON, or not a known format version.
    """
    directory = Path(path)
    mpath = directory / MANIFEST
    if not directory.is_dir():
        raise ShardError(f"{directory}: shard directory does not exist. {_fix(directory)}")
    if not mpath.is_file():
        raise ShardError(
            f"{mpath}: manifest missing (the shards were never written, or writing was "
            f"interrupted). {_fix(directory)}"
        )
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardError(f"{mpath}: not valid JSON ({e}). {_fix(directory)}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ShardError(f"{mpath}: not a {FORMAT_NAME} manifest. {_fix(directory)}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ShardError(
            f"{mpath}: unknown format version {manifest.get('format_version')!r} "
            f"(this moetrain reads version {FORMAT_VERSION}). {_fix(directory)}"
        )
    missing = [k for k in ("dtype", "vocab_size", "eos_id", "tokenizer", "splits") if k not in manifest]
    if missing or manifest["dtype"] not in ("uint16", "uint32"):
        raise ShardError(f"{mpath}: malformed (missing {missing} or bad dtype). {_fix(directory)}")
    return manifest


def _sha256_file(path: Path, bar: tqdm) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def verify_shards(
    path: str | os.PathLike, mode: VerifyMode = "sha256", split: str | None = None
) -> dict:
    """Check the shards in ``path`` against their manifest; return the manifest.

    Args:
        path: the shard directory (holding ``manifest.json``).
        mode: ``"sha256"``: every ``.bin`` / ``.idx`` exists, has the manifest's size and
            sha256 (reads everything; a tqdm bar when over 100 MB). ``"size"``: exists and has the
            manifest's size (catches truncation, not altered bytes). ``"none"``: only the
            manifest is checked, and that every file exists.
        split: check only this split (``"train"`` / ``"val"``); ``None``: all splits.

    Returns:
        The manifest dict (module docstring).

    Raises:
        ShardError: manifest missing / not JSON / unknown version, unknown split, or a shard file
            missing, of the wrong size (truncated or extended), or with a different sha256
            (altered). The message names the file and says to re-run ``tools/tokenize_corpus.py``.
        ValueError: unknown ``mode``.
    """
    if mode not in ("sha256", "size", "none"):
        raise ValueError(f"verify mode {mode!r}: must be 'sha256', 'size' or 'none'")
    directory = Path(path)
    manifest = read_manifest(directory)
    if split is not None and split not in manifest["splits"]:
        raise ShardError(
            f"{directory / MANIFEST}: no split {split!r} (has {sorted(manifest['splits'])}). {_fix(directory)}"
        )
    itemsize = np.dtype(manifest["dtype"]).itemsize
    names = [split] if split is not None else list(manifest["splits"])
    files = []  # (path, expected bytes, expected sha256)
    for s in names:
        for sh in manifest["splits"][s]["shards"]:
            if sh["bytes"] != sh["tokens"] * itemsize:
                raise ShardError(f"{directory / MANIFEST}: shard {sh['name']} lists {sh['tokens']} "
                                 f"tokens but {sh['bytes']} bytes. {_fix(directory)}")
            files.append((directory / sh["name"], sh["bytes"], sh["sha256"]))
            files.append((directory / sh["index_name"], sh["index_bytes"], sh["index_sha256"]))

    for f, size, _ in files:
        if not f.is_file():
            raise ShardError(f"{f}: shard file missing (listed in {MANIFEST}). {_fix(directory)}")
        if mode == "none":
            continue
        actual = f.stat().st_size
        if actual != size:
            what = "truncated" if actual < size else "longer than written (appended to?)"
            raise ShardError(
                f"{f}: size {actual} bytes differs from the manifest's {size} bytes: the file is "
                f"{what}. {_fix(directory)}"
            )
    if mode == "sha256":
        total = sum(size for _, size, _ in files)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"verify sha256 {directory}",
                  disable=total <= _PROGRESS_BYTES) as bar:
            for f, _, expected in files:
                actual = _sha256_file(f, bar)
                if actual != expected:
                    raise ShardError(
                        f"{f}: sha256 mismatch (manifest {expected[:16]}…, file {actual[:16]}…): "
                        f"the file was altered or corrupted. {_fix(directory)}"
                    )
    return manifest


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


class TokenShards:
    """One split of a shard directory, verified, memory-mapped read-only, cut into samples.

    Args:
        path: the shard directory (holding ``manifest.json``).
        split: ``"train"`` or ``"val"``.
        verify: checked before mapping, see :func:`verify_shards` (``"sha256"`` reads every byte
            once; ``"size"`` is instant; ``"none"`` only checks the files exist).

    Attributes:
        manifest: the manifest dict. ``num_tokens``: tokens in this split. ``vocab_size``,
        ``eos_id``: from the manifest. ``shards``: this split's manifest entries, in order.

    Raises:
        ShardError: see :func:`verify_shards`.

    Pickling reopens the memory maps in the new process without re-verifying.
    """

    def __init__(self, path: str | os.PathLike, split: str = "train", verify: VerifyMode = "sha256"):
        self.path = Path(path)
        self.split = split
        self.manifest: dict = verify_shards(self.path, verify, split=split)
        self.vocab_size: int = self.manifest["vocab_size"]
        self.eos_id: int = self.manifest["eos_id"]
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        self.shards: list[dict] = self.manifest["splits"][split]["shards"]
        self.num_tokens: int = sum(sh["tokens"] for sh in self.shards)
        self._open()

    def _open(self) -> None:
        self._maps = [
            np.memmap(self.path / sh["name"], dtype=self.dtype, mode="r", shape=(sh["tokens"],))
            for sh in self.shards
        ]
        self._cum_cache: dict[int, np.ndarray] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_maps"], state["_cum_cache"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def _cumulative(self, seq_len: int) -> np.ndarray:
        """cum[i] = samples in shards 0..i (inclusive)."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r}: must be a positive int")
        cum = self._cum_cache.get(seq_len)
        if cum is None:
            per_shard = [(sh["tokens"] - 1) // seq_len if sh["tokens"] > 0 else 0 for sh in self.shards]
            cum = np.cumsum(np.asarray(per_shard, dtype=np.int64))
            self._cum_cache[int(seq_len)] = cum
        return cum

    def num_samples(self, seq_len: int) -> int:
        """Number of samples of ``seq_len + 1`` tokens: ``sum((T_shard - 1) // seq_len)``.

        Raises:
            ValueError: ``seq_len`` < 1.
        """
        cum = self._cumulative(seq_len)
        return int(cum[-1]) if len(cum) else 0

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        """Sample ``index`` as int64 ids of shape ``[seq_len + 1]``: inputs ``[:-1]``, targets ``[1:]``.

        Raises:
            IndexError: ``index`` not in ``[0, num_samples(seq_len))``.
            ValueError: ``seq_len`` < 1.
        """
        cum = self._cumulative(seq_len)
        n = int(cum[-1]) if len(cum) else 0
        if not 0 <= index < n:
            raise IndexError(
                f"sample index {index} out of range: split {self.split!r} of {self.path} has {n} "
                f"samples of seq_len {seq_len}"
            )
        shard = int(np.searchsorted(cum, index, side="right"))
        local = int(index) - (int(cum[shard - 1]) if shard else 0)
        start = local * seq_len
        return np.asarray(self._maps[shard][start : start + seq_len + 1], dtype=np.int64)

    def samples(self, indices: Sequence[int], seq_len: int) -> np.ndarray:
        """Several samples stacked: int64 of shape ``[len(indices), seq_len + 1]``."""
        out = np.empty((len(indices), seq_len + 1), dtype=np.int64)
        for row, index in enumerate(indices):
            out[row] = self.sample(index, seq_len)
        return out

    def shard_tokens(self, shard: int) -> np.memmap:
        """The read-only token array of shard ``shard`` (manifest order), shape ``[tokens]``."""
        return self._maps[shard]

    def document_starts(self, shard: int) -> np.ndarray:
        """int64 offsets, within shard ``shard``, of the documents that start in it."""
        return np.fromfile(self.path / self.shards[shard]["index_name"], dtype="<i8")

    def __repr__(self) -> str:
        return (
            f"TokenShards({str(self.path)!r}, split={self.split!r}: {self.num_tokens:,} tokens in "
            f"{len(self.shards)} shards, vocab_size={self.vocab_size})"
        )
