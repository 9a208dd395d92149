"""Token shards: a tokenized corpus on disk, checksummed, memory-mapped for training.

Layout of a shard directory (written by :class:`ShardWriter`, through :func:`write_shards` in one
process or ``moetrain.data.pipeline`` / ``tools/tokenize_corpus.py`` in many)::

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

``format_version`` 2 is the Megatron layout (``ShardWriter(layout="megatron")``,
``tools/tokenize_corpus.py --format megatron``, ``tools/import_megatron.py``): the same manifest
plus ``"index_format": "megatron"``; each shard entry is a Megatron-LM ``.bin`` / ``.idx`` pair
(``moetrain.data.megatron``), and may be a token range of it: ``token_offset`` (tokens before
the range), ``first_document`` (documents before it), ``tokens`` and ``documents`` in it, while
``bytes`` / ``sha256`` are those of the whole ``.bin``. ``name`` / ``index_name`` are relative to
the directory or absolute, so a manifest can describe Megatron files where they already are.
``dtype`` is any integer dtype Megatron writes (``uint16``, ``int32``, ...); ``shard_tokens`` is
``null``. Version-1 readers refuse it (they would misread the ``.idx``); this one reads both.
Written by the corpus pipeline, a manifest also has ``"skipped_documents": {"total",
"by_reason", "log"}`` (``log``: ``skipped_documents.jsonl`` beside it, a sample of locations).

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
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
from tqdm import tqdm

from moetrain.data.megatron import MegatronFormatError, MegatronWriter, megatron_dtype, read_index

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "DEFAULT_SHARD_TOKENS",
    "SPLITS",
    "ShardError",
    "token_dtype",
    "ShardWriter",
    "encode_documents",
    "batch_texts",
    "write_shards",
    "verify_shards",
    "split_by_bytes",
    "sha256_file",
    "read_manifest",
    "TokenShards",
]

FORMAT_NAME = "moetrain-token-shards"
FORMAT_VERSION = 1
MEGATRON_FORMAT_VERSION = 2
DEFAULT_SHARD_TOKENS = 2**27  # 134M tokens: 256 MiB as uint16
SPLITS = ("train", "val")
MANIFEST = "manifest.json"
# Hashing more than this many bytes shows a progress bar (below it, hashing is near-instant).
_PROGRESS_BYTES = 100 * 2**20
_CHUNK = 8 * 2**20
_SHARD_FILE = re.compile(r"^(train|val)(_\d{5})?\.(bin|idx)$")  # both layouts' file names
_MEGATRON_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "uint16")

VerifyMode = Literal["sha256", "size", "none"]
Layout = Literal["moetrain", "megatron"]


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
    """Appends documents to ``<split>_NNNNN.bin`` files of at most ``shard_tokens`` tokens.

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
        self._starts: list[np.ndarray] = []  # document starts within the open shard

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
        starts = np.concatenate(self._starts) if self._starts else np.zeros(0)
        idx = starts.astype("<i8").tobytes()
        tmp_idx = self.out_dir / f".{index_name}.tmp-{os.getpid()}"
        tmp_idx.write_bytes(idx)
        os.replace(tmp_idx, self.out_dir / index_name)
        os.replace(self._tmp, self.out_dir / name)
        self.shards.append(
            {
                "name": name,
                "tokens": self._n,
                "documents": len(starts),
                "bytes": self._n * self.dtype.itemsize,
                "sha256": self._hash.hexdigest(),
                "index_name": index_name,
                "index_bytes": len(idx),
                "index_sha256": hashlib.sha256(idx).hexdigest(),
            }
        )
        self._file = self._tmp = None

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: ``tokens`` their ids (EOS included) back to back, ``lengths`` int
        ``[documents]``. A document runs on into the next shard when this one fills up."""
        if not len(lengths):
            return
        # Position of each document's first token within this split (all >= self.tokens).
        starts = self.tokens + np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)])
        self.documents += len(lengths)
        pos = 0
        while pos < len(tokens):
            if self._file is None:
                self._open()
            take = min(len(tokens) - pos, self.shard_tokens - self._n)
            # A document that starts exactly at a shard boundary belongs to the new shard.
            lo, hi = np.searchsorted(starts, [self.tokens, self.tokens + take])
            self._starts.append(starts[lo:hi] - (self.tokens - self._n))
            blob = np.ascontiguousarray(tokens[pos:pos + take], dtype=self.dtype).tobytes()
            self._file.write(blob)
            self._hash.update(blob)
            self._n += take
            self.tokens += take
            pos += take
            if self._n == self.shard_tokens:
                self._finish_shard()

    def close(self) -> dict:
        if self._file is not None:
            self._finish_shard()
        return {"tokens": self.tokens, "documents": self.documents, "shards": self.shards}

    def abort(self) -> None:
        """Delete what this writer wrote: the open shard's temporary file and the full shards."""
        if self._file is not None:
            self._file.close()
            self._tmp.unlink(missing_ok=True)
            self._file = None
        for sh in self.shards:
            for name in (sh["name"], sh["index_name"]):
                (self.out_dir / name).unlink(missing_ok=True)


class _MegatronSplitWriter:
    """One split as one Megatron ``<split>.bin`` / ``<split>.idx`` pair (module docstring)."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype):
        self._writer = MegatronWriter(out_dir / split, dtype)

    @property
    def documents(self) -> int:
        return self._writer.documents

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        self._writer.add_documents(tokens, lengths)

    def close(self) -> dict:
        w = self._writer
        if w.documents == 0:  # an empty split has no files (a zero-byte .bin cannot be mapped)
            w.abort()
            return {"tokens": 0, "documents": 0, "shards": []}
        files = w.close()
        shard = {"name": files["bin"], "tokens": w.tokens, "documents": w.documents, "bytes": files["bytes"],
                 "sha256": files["sha256"], "index_name": files["idx"], "index_bytes": files["index_bytes"],
                 "index_sha256": files["index_sha256"], "token_offset": 0, "first_document": 0}
        return {"tokens": w.tokens, "documents": w.documents, "shards": [shard]}

    def abort(self) -> None:
        self._writer.abort()


def _val_rule(val_fraction: float | None, val_docs: int | None) -> tuple[dict, Callable[[np.ndarray], np.ndarray]]:
    """The rule as recorded in the manifest, and a function of document positions (int64 array)
    to a boolean array: held out or not."""
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
        return {"rule": "none", "description": "no validation split"}, lambda i: np.zeros(len(i), dtype=bool)
    k = max(1, round(1 / val_fraction))
    if k == 1:
        raise ValueError(f"val_fraction={val_fraction}: would hold out every document; use < 0.67")
    rule = {"rule": "every_kth", "k": k,
            "description": f"documents at 0-based stream position i with i % {k} == 0"}
    return rule, lambda i: i % k == 0


class ShardWriter:
    """The train and val splits of a shard directory, being written from a stream of documents.

    Documents arrive in stream order, as token arrays (EOS included); each goes to train or val
    by the validation rule (module docstring), decided on its position in the stream.
    :func:`write_shards` feeds it from text; ``moetrain.data.pipeline`` from the per-input parts
    that its worker processes wrote.

    Args:
        out_dir: created if missing; its manifest is deleted first, so that a directory with a
            manifest always holds a complete set.
        vocab_size, eos_id, tokenizer_identity: recorded in the manifest (``vocab_size`` also
            picks the token dtype).
        shard_tokens: tokens per shard of the ``moetrain`` layout (>= 2).
        val_fraction / val_docs: the validation rule, at most one; neither means 0.01.
        layout: ``"moetrain"`` (format version 1, shards of ``shard_tokens``) or ``"megatron"``
            (format version 2: one Megatron ``<split>.bin`` / ``.idx`` per split).

    Raises:
        ValueError: bad arguments.
    """

    def __init__(self, out_dir: str | os.PathLike, *, vocab_size: int, eos_id: int, tokenizer_identity: dict,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS, val_fraction: float | None = None,
                 val_docs: int | None = None, layout: Layout = "moetrain"):
        self.rule, self._is_val, self.dtype = self.check_args(
            vocab_size=vocab_size, shard_tokens=shard_tokens, val_fraction=val_fraction, val_docs=val_docs,
            layout=layout)
        self.layout = layout
        self.info = {"vocab_size": vocab_size, "eos_id": eos_id, "tokenizer": dict(tokenizer_identity),
                     "shard_tokens": shard_tokens if layout == "moetrain" else None}
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / MANIFEST).unlink(missing_ok=True)
        for stale in self.out.glob(".*.tmp-*"):  # left by a run that crashed
            stale.unlink()
        if layout == "moetrain":
            self.writers = {s: _SplitWriter(self.out, s, self.dtype, shard_tokens) for s in SPLITS}
        else:
            self.writers = {s: _MegatronSplitWriter(self.out, s, self.dtype) for s in SPLITS}
        self.documents = 0
        self.tokens = 0

    @staticmethod
    def check_args(*, vocab_size: int, shard_tokens: int = DEFAULT_SHARD_TOKENS, val_fraction: float | None = None,
                   val_docs: int | None = None, layout: Layout = "moetrain"):
        """Check the settings without writing anything; returns (val rule, its function, token dtype).

        Raises:
            ValueError: a bad setting (the message names it).
        """
        if shard_tokens < 2:
            raise ValueError(f"shard_tokens={shard_tokens}: must be >= 2")
        if layout not in ("moetrain", "megatron"):
            raise ValueError(f"layout={layout!r}: must be 'moetrain' or 'megatron'")
        if val_fraction is None and val_docs is None:
            val_fraction = 0.01
        rule, is_val = _val_rule(val_fraction, val_docs)
        return rule, is_val, token_dtype(vocab_size) if layout == "moetrain" else megatron_dtype(vocab_size)

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append the next documents of the stream: ``tokens`` back to back, ``lengths`` int64
        ``[documents]`` (each >= 1: a document ends with EOS)."""
        held_out = self._is_val(self.documents + np.arange(len(lengths), dtype=np.int64))
        self.documents += len(lengths)
        self.tokens += len(tokens)
        if not held_out.any():  # the common case: no copy
            self.writers["train"].add_documents(tokens, lengths)
            return
        in_val = np.repeat(held_out, lengths)
        self.writers["val"].add_documents(tokens[in_val], lengths[held_out])
        self.writers["train"].add_documents(tokens[~in_val], lengths[~held_out])

    def abort(self) -> None:
        """Delete every file this unfinished write made (temporary and completed shards)."""
        for w in self.writers.values():
            w.abort()

    def finish(self, sources: Sequence[str] = (), extra: dict | None = None) -> dict:
        """Close both splits, delete shard files of an older run that are not listed, write the
        manifest (temp + rename) and return it. ``extra``: more manifest keys.

        Raises:
            ValueError: no documents, or every document fell in the val split.
        """
        # Checked before any split is closed (closing writes its files): a refused write leaves
        # nothing behind.
        problem = None
        if self.documents == 0:
            problem = "no (non-empty) documents in the input"
        elif self.writers["train"].documents == 0:
            problem = (f"all {self.documents} documents fell in the validation split ({self.rule['description']}); "
                       f"give more documents, a smaller val fraction, or fewer val docs")
        if problem:
            self.abort()
            raise ValueError(problem)
        splits = {s: w.close() for s, w in self.writers.items()}
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION if self.layout == "moetrain" else MEGATRON_FORMAT_VERSION,
            **({"index_format": "megatron"} if self.layout == "megatron" else {}),
            "dtype": self.dtype.name,
            **self.info,
            "val_split": self.rule,
            "sources": [str(s) for s in sources],
            "total_tokens": self.tokens,
            "total_documents": self.documents,
            "splits": splits,
            **(extra or {}),
        }
        listed = {f for sp in splits.values() for sh in sp["shards"] for f in (sh["name"], sh["index_name"])}
        for f in self.out.iterdir():
            if _SHARD_FILE.match(f.name) and f.name not in listed:
                f.unlink()
        tmp = self.out / f".{MANIFEST}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, self.out / MANIFEST)
        return manifest


def encode_documents(tokenizer: TokenizerLike, texts: Sequence[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``texts`` with EOS after each: ``(tokens [sum of lengths], lengths int64 [len(texts)])``."""
    encoded = tokenizer.encode_batch(texts)
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    end = np.cumsum(lengths)
    tokens[end - 1] = tokenizer.eos_id
    for ids, stop in zip(encoded, end.tolist()):
        tokens[stop - 1 - len(ids):stop - 1] = ids
    return tokens, lengths


def batch_texts(documents: Iterable[str], max_docs: int, max_chars: int) -> Iterator[list[str]]:
    """Lists of up to ``max_docs`` texts or about ``max_chars`` characters (the last text may
    pass the limit): the unit of one ``encode_batch`` call."""
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
    layout: Layout = "moetrain",
) -> dict:
    """Tokenize ``documents`` (EOS after each) into train/val shards in ``out_dir``, in this process.

    Documents are encoded in batches of up to ``batch_docs`` documents or ``batch_chars``
    characters (the tokenizer parallelises within a batch). Empty documents are skipped. Shards
    and their ``.idx`` are written under temporary names and renamed when complete; the manifest
    is written last (temp + rename), and an existing manifest is deleted first, so a directory
    with a manifest always holds a complete set. Shard files of an older run that the new
    manifest does not list are deleted. For corpora, ``moetrain.data.pipeline`` does the same
    in parallel, resumably, with the same result.

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
        layout: ``"moetrain"`` shards or ``"megatron"`` ``.bin/.idx`` (see :class:`ShardWriter`).

    Returns:
        The manifest (also written to ``out_dir/manifest.json``).

    Raises:
        ValueError: bad arguments, no documents, or every document fell in the val split.
    """
    writer = ShardWriter(out_dir, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                         tokenizer_identity=tokenizer.identity, shard_tokens=shard_tokens,
                         val_fraction=val_fraction, val_docs=val_docs, layout=layout)
    bar = tqdm(desc=f"tokenize → {out_dir}", unit=" docs", disable=not progress, dynamic_ncols=True)
    t0 = time.perf_counter()
    try:
        for batch in batch_texts((d for d in documents if d), batch_docs, batch_chars):
            writer.add(*encode_documents(tokenizer, batch, writer.dtype))
            bar.update(len(batch))
            bar.set_postfix(tokens=f"{writer.tokens:,}", tok_s=f"{writer.tokens / (time.perf_counter() - t0):,.0f}")
        return writer.finish(sources)
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()


# ---------------------------------------------------------------------------------------------
# Verifying
# ---------------------------------------------------------------------------------------------


def _megatron_hint(path: Path) -> str | None:
    """A hint when ``path`` is a Megatron dataset prefix (or one of its files), not a directory."""
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    if prefix.with_name(prefix.name + ".idx").is_file():
        return (f"{path}: a Megatron-LM dataset, not a shard directory. Fix: describe it with "
                f"`python tools/import_megatron.py --train {prefix} --tokenizer SPEC --out DIR` and use DIR")
    return None


def read_manifest(path: str | os.PathLike) -> dict:
    """Read and check ``<path>/manifest.json`` (format, version, keys); no shard file is opened.

    Raises:
        ShardError: directory or manifest missing (with a hint when ``path`` is a Megatron
            dataset prefix), not JSON, or not a known format version.
    """
    directory = Path(path)
    mpath = directory / MANIFEST
    if not directory.is_dir():
        raise ShardError(_megatron_hint(directory) or f"{directory}: shard directory does not exist. {_fix(directory)}")
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
    version = manifest.get("format_version")
    if version not in (FORMAT_VERSION, MEGATRON_FORMAT_VERSION):
        raise ShardError(
            f"{mpath}: unknown format version {version!r} "
            f"(this moetrain reads versions {FORMAT_VERSION} and {MEGATRON_FORMAT_VERSION}). {_fix(directory)}"
        )
    dtypes = ("uint16", "uint32") if version == FORMAT_VERSION else _MEGATRON_DTYPES
    missing = [k for k in ("dtype", "vocab_size", "eos_id", "tokenizer", "splits") if k not in manifest]
    if version == MEGATRON_FORMAT_VERSION and manifest.get("index_format") != "megatron":
        missing.append("index_format: megatron")
    if missing or manifest["dtype"] not in dtypes:
        raise ShardError(f"{mpath}: malformed (missing {missing} or bad dtype). {_fix(directory)}")
    return manifest


def _is_megatron(manifest: dict) -> bool:
    return manifest["format_version"] == MEGATRON_FORMAT_VERSION


def sha256_file(path: Path, bar: tqdm | None = None) -> str:
    """Hex sha256 of a file, read in 8 MiB chunks (``bar`` advanced by the bytes read)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return h.hexdigest()


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
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"manifest_sha256": manifest_digest, "files": merged}, indent=0))
        os.replace(tmp, cache)
    except OSError:  # a cache that cannot be written costs a re-hash next time, nothing else
        tmp.unlink(missing_ok=True)


def verify_shards(
    path: str | os.PathLike, mode: VerifyMode = "sha256", split: str | None = None, *, rank: int = 0,
    world: int = 1, agree: Callable[[dict], list[dict]] | None = None, cache: str | os.PathLike | None = None,
) -> dict:
    """Check the shards in ``path`` against their manifest; return the manifest.

    Args:
        path: the shard directory (holding ``manifest.json``).
        mode: ``"sha256"``: every ``.bin`` / ``.idx`` exists, has the manifest's size and
            sha256 (reads everything not in ``cache``; a tqdm bar when over 100 MB). ``"size"``:
            exists and has the manifest's size (catches truncation, not altered bytes).
            ``"none"``: only the manifest is checked, and that every file exists.
        split: check only this split (``"train"`` / ``"val"``); ``None``: all splits.
        rank, world: this process checks only its share of the files, about 1/``world`` of the
            bytes (:func:`split_by_bytes`), so the cost per process is O(data / world).
        agree: with ``world > 1``, a collective that takes this rank's result (a small dict) and
            returns every rank's in rank order (``torch.distributed.all_gather_object``): every
            rank then raises the same error, or returns having seen all files checked.
        cache: a JSON file recording verified contents (file name → bytes, mtime in ns, sha256)
            for this manifest (keyed by the manifest's own sha256). In ``"sha256"`` mode a file
            whose size and mtime match its verified entry is not read again; rank 0 adds what was
            hashed. A content change that keeps both size and mtime is not seen (as ``make``).

    Returns:
        The manifest dict (module docstring).

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
            f"{directory / MANIFEST}: no split {split!r} (has {sorted(manifest['splits'])}). {_fix(directory)}"
        )
    itemsize = np.dtype(manifest["dtype"]).itemsize
    names = [split] if split is not None else list(manifest["splits"])
    files: dict[str, tuple[int, str]] = {}  # name -> (bytes, sha256); a Megatron file may back both splits
    megatron_checks: dict[str, list[dict]] = {}  # .bin name -> shards to check against their .idx
    for s in names:
        for sh in manifest["splits"][s]["shards"]:
            # v1: the shard is the whole file; v2: a token range [token_offset, + tokens) of it.
            end = sh.get("token_offset", 0) + sh["tokens"]
            if (sh["bytes"] != end * itemsize) if not _is_megatron(manifest) else (sh["bytes"] < end * itemsize):
                raise ShardError(f"{directory / MANIFEST}: shard {sh['name']} lists {sh['tokens']} "
                                 f"tokens but {sh['bytes']} bytes. {_fix(directory)}")
            files[sh["name"]] = (sh["bytes"], sh["sha256"])
            files[sh["index_name"]] = (sh["index_bytes"], sh["index_sha256"])
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
    stats = {}
    for name, (size, _) in files.items():
        f = directory / name
        if not f.is_file():
            raise ShardError(f"{f}: shard file missing (listed in {MANIFEST}). {_fix(directory)}")
        stats[name] = f.stat()
        if mode == "none":
            continue
        actual = stats[name].st_size
        if actual != size:
            what = "truncated" if actual < size else "longer than written (appended to?)"
            raise ShardError(
                f"{f}: size {actual} bytes differs from the manifest's {size} bytes: the file is "
                f"{what}. {_fix(directory)}"
            )
    if mode != "none" and _is_megatron(manifest):
        for name in files:
            for sh in megatron_checks.get(name, []):
                _check_megatron_shard(directory, sh)
    if mode != "sha256":
        return

    def fresh(name: str) -> bool:
        entry, st = cached.get(name), stats[name]
        return (isinstance(entry, dict) and entry.get("sha256") == files[name][1]
                and entry.get("bytes") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns)

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
                    f"the file was altered or corrupted. {_fix(directory)}"
                )
            verified[name] = {"bytes": stats[name].st_size, "mtime_ns": stats[name].st_mtime_ns, "sha256": actual}


def _check_megatron_shard(directory: Path, sh: dict) -> None:
    """The .idx is a readable Megatron index matching its .bin, and the shard's document range
    covers exactly its token range."""
    try:
        index = read_index(directory / sh["index_name"], bin_bytes=sh["bytes"])
    except MegatronFormatError as e:
        raise ShardError(f"{e}. {_fix(directory)}") from None
    first, n = sh.get("first_document", 0), sh["documents"]
    starts = index.document_token_starts()
    ends = np.append(starts, index.num_tokens)
    if first + n > index.num_documents or (n and (ends[first] != sh.get("token_offset", 0)
                                                  or ends[first + n] != sh.get("token_offset", 0) + sh["tokens"])):
        raise ShardError(f"{directory / sh['index_name']}: documents [{first}, {first + n}) do not span the "
                         f"manifest's tokens of {sh['name']}. {_fix(directory)}")


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


class TokenShards:
    """One split of a shard directory, verified, memory-mapped read-only, cut into samples.

    Either layout (module docstring): moetrain shards, or Megatron-LM ``.bin/.idx`` files (whole
    or token ranges of them) described by a version-2 manifest.

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
            np.memmap(self.path / sh["name"], dtype=self.dtype, mode="r", shape=(sh["tokens"],),
                      offset=sh.get("token_offset", 0) * self.dtype.itemsize)
            for sh in self.shards
        ]
        self._cum_cache: dict[int, np.ndarray] = {}
        self._doc_starts: dict[int, np.ndarray] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_maps"], state["_cum_cache"], state["_doc_starts"]
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
        shard, start = self._locate(index, seq_len)
        return np.asarray(self._maps[shard][start : start + seq_len + 1], dtype=np.int64)

    def _locate(self, index: int, seq_len: int) -> tuple[int, int]:
        """(shard, first token offset in it) of sample ``index``."""
        cum = self._cumulative(seq_len)
        n = int(cum[-1]) if len(cum) else 0
        if not 0 <= index < n:
            raise IndexError(
                f"sample index {index} out of range: split {self.split!r} of {self.path} has {n} "
                f"samples of seq_len {seq_len}"
            )
        shard = int(np.searchsorted(cum, index, side="right"))
        local = int(index) - (int(cum[shard - 1]) if shard else 0)
        return shard, local * seq_len

    def sample_document_ids(self, index: int, seq_len: int) -> np.ndarray:
        """The document of every token of sample ``index``: int64 ``[seq_len + 1]``, 0 for the
        document the sample starts in, one more at every document that starts inside it (from
        the shard's document index, so it holds for data without end-of-document tokens too).

        Raises:
            IndexError, ValueError: as :meth:`sample`.
        """
        shard, start = self._locate(index, seq_len)
        starts = self._doc_starts.get(shard)
        if starts is None:
            starts = self._doc_starts[shard] = np.sort(self.document_starts(shard))
        ids = np.searchsorted(starts, np.arange(start, start + seq_len + 1), side="right")
        return (ids - ids[0]).astype(np.int64)

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
        sh = self.shards[shard]
        if not _is_megatron(self.manifest):
            return np.fromfile(self.path / sh["index_name"], dtype="<i8")
        first = sh.get("first_document", 0)
        starts = read_index(self.path / sh["index_name"]).document_token_starts()
        return starts[first:first + sh["documents"]] - sh.get("token_offset", 0)

    def __repr__(self) -> str:
        return (
            f"TokenShards({str(self.path)!r}, split={self.split!r}: {self.num_tokens:,} tokens in "
            f"{len(self.shards)} shards, vocab_size={self.vocab_size})"
        )
