"""Writing token shards: a stream of documents → the train / val shards and manifest of a shard
directory (format: :mod:`moetrain.data.format`), in this process (:func:`write_shards`) or fed by
``moetrain.data.pipeline``'s workers (:class:`ShardWriter`).

Validation split (deterministic, decided per document in stream order, before tokenizing):
``val_fraction=f`` holds out the documents whose 0-based position ``i`` in the input stream
(empty documents are skipped and not counted) has ``i % k == 0`` with ``k = round(1 / f)``, so
document 0 is always held out and ``ceil(n / k)`` of ``n`` documents are; ``val_docs=N`` holds
out the first ``N`` documents. By position, not by hash of an id: inputs need no ids, and the
same inputs in the same order always give the same split.

Fine-tuning data (``loss_mask=True``) carries one mask byte per token, written to
``<split>_NNNNN.mask`` beside each shard (1: trained as a target). With ``pack_seq_len=L`` the
documents of each split are packed into blocks of ``L + 1`` tokens (a sample's inputs and its
shifted targets, :class:`~moetrain.data.reader.TokenShards`): a document goes into the current
block when it fits, else the block is filled with padding (``pad_id``, mask 0, a document of
its own in the index) and the document starts the next; only a document longer than a block is
split over blocks. Shards then hold whole blocks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm import tqdm

from moetrain.data.format import (DEFAULT_SHARD_TOKENS, FORMAT_NAME, FORMAT_VERSION, MANIFEST, MEGATRON_FORMAT_VERSION,
                                  SPLITS, TokenizerLike, token_dtype)
from moetrain.data.megatron import MegatronWriter, megatron_dtype
from moetrain.utils import atomic_write

__all__ = ["Layout", "ShardWriter", "encode_documents", "batch_texts", "write_shards"]

_SHARD_FILE = re.compile(r"^(train|val)(_\d{5})?\.(bin|idx|mask)$")  # both layouts' file names
Layout = Literal["moetrain", "megatron"]


class _SplitWriter:
    """Appends documents to ``<split>_NNNNN.bin`` files of at most ``shard_tokens`` tokens.

    Each shard is written under a temporary name, hashed as it is written, and renamed into
    place when full (or at :meth:`close`).
    """

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int, loss_mask: bool = False):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.loss_mask = loss_mask
        self.shards: list[dict] = []
        self.tokens = 0
        self.trained = 0  # tokens the loss mask trains
        self.documents = 0
        self._file = self._mask_file = None
        self._tmp: Path | None = None
        self._mask_tmp: Path | None = None
        self._hash = self._mask_hash = None
        self._n = 0  # tokens in the open shard
        self._starts: list[np.ndarray] = []  # document starts within the open shard

    def _open(self) -> None:
        name = f"{self.split}_{len(self.shards):05d}"
        self._tmp = self.out_dir / f".{name}.bin.tmp-{os.getpid()}"
        self._file = open(self._tmp, "wb")
        self._hash = hashlib.sha256()
        if self.loss_mask:
            self._mask_tmp = self.out_dir / f".{name}.mask.tmp-{os.getpid()}"
            self._mask_file = open(self._mask_tmp, "wb")
            self._mask_hash = hashlib.sha256()
        self._n = 0
        self._starts = []

    def _finish_shard(self) -> None:
        for f in (self._file, self._mask_file):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())  # the fsync policy of moetrain.utils.atomic_write
                f.close()
        name = f"{self.split}_{len(self.shards):05d}.bin"
        index_name = name[: -len(".bin")] + ".idx"
        starts = np.concatenate(self._starts) if self._starts else np.zeros(0)
        idx = starts.astype("<i8").tobytes()
        atomic_write(self.out_dir / index_name, idx)
        entry = {
            "name": name,
            "tokens": self._n,
            "documents": len(starts),
            "bytes": self._n * self.dtype.itemsize,
            "sha256": self._hash.hexdigest(),
            "index_name": index_name,
            "index_bytes": len(idx),
            "index_sha256": hashlib.sha256(idx).hexdigest(),
        }
        if self.loss_mask:
            mask_name = name[: -len(".bin")] + ".mask"
            os.replace(self._mask_tmp, self.out_dir / mask_name)
            entry.update(mask_name=mask_name, mask_bytes=self._n, mask_sha256=self._mask_hash.hexdigest())
        os.replace(self._tmp, self.out_dir / name)
        self.shards.append(entry)
        self._file = self._tmp = self._mask_file = self._mask_tmp = None

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append documents: ``tokens`` their ids (BOS and EOS included) back to back, ``lengths``
        int ``[documents]``, ``mask`` uint8 ``[tokens]`` with a loss mask (required then, refused
        otherwise). A document runs on into the next shard when this one fills up."""
        if (mask is not None) != self.loss_mask:
            raise ValueError("a loss mask is required with loss_mask=True and refused without")
        if not len(lengths):
            return
        if mask is not None:
            self.trained += int(np.count_nonzero(mask))
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
            if mask is not None:
                mblob = np.ascontiguousarray(mask[pos:pos + take], dtype=np.uint8).tobytes()
                self._mask_file.write(mblob)
                self._mask_hash.update(mblob)
            self._n += take
            self.tokens += take
            pos += take
            if self._n == self.shard_tokens:
                self._finish_shard()

    def close(self) -> dict:
        if self._file is not None:
            self._finish_shard()
        trained = {"trained_tokens": self.trained} if self.loss_mask else {}
        return {"tokens": self.tokens, "documents": self.documents, **trained, "shards": self.shards}

    def abort(self) -> None:
        """Delete what this writer wrote: the open shard's temporary files and the full shards."""
        for f, tmp in ((self._file, self._tmp), (self._mask_file, self._mask_tmp)):
            if f is not None:
                f.close()
                tmp.unlink(missing_ok=True)
        self._file = self._mask_file = None
        for sh in self.shards:
            for name in (sh["name"], sh["index_name"], sh.get("mask_name")):
                if name:
                    (self.out_dir / name).unlink(missing_ok=True)


class _Packer:
    """Packs a split's documents into blocks of ``block`` tokens before its writer (module
    docstring): padding with ``pad_id`` (mask 0), each padding run a document of its own."""

    def __init__(self, writer: _SplitWriter, block: int, pad_id: int):
        self.writer, self.block, self.pad_id = writer, block, pad_id
        self.fill = 0  # tokens in the current block
        self.padding = 0  # padding tokens written
        self.written = 0  # tokens written (a block starts at every multiple of block)

    @property
    def documents(self) -> int:
        return self.writer.documents

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        out_t, out_l, out_m = [], [], []
        pos = 0
        for n in lengths.tolist():
            if self.fill and n > self.block - self.fill:  # does not fit: pad the block, start the next
                pad = self.block - self.fill
                out_t.append(np.full(pad, self.pad_id, dtype=tokens.dtype))
                out_m.append(np.zeros(pad, dtype=np.uint8))
                out_l.append(pad)
                self.padding += pad
                self.fill = 0
            out_t.append(tokens[pos:pos + n])
            out_m.append(mask[pos:pos + n])
            out_l.append(n)
            self.fill = (self.fill + n) % self.block
            pos += n
        if out_l:
            self._emit(np.concatenate(out_t), np.asarray(out_l, dtype=np.int64), np.concatenate(out_m))

    def _emit(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray) -> None:
        # A block's first token is never a target (the sample's inputs start with it): its mask
        # bit is cleared, so that the trained-token counts are the targets the loss sees.
        first = (-self.written) % self.block
        if first < len(mask):
            mask = mask.copy()
            mask[first::self.block] = 0
        self.written += len(tokens)
        self.writer.add_documents(tokens, lengths, mask)

    def close(self) -> dict:
        if self.fill:
            pad = self.block - self.fill
            self._emit(np.full(pad, self.pad_id, dtype=self.writer.dtype), np.array([pad]),
                       np.zeros(pad, dtype=np.uint8))
            self.padding += pad
            self.fill = 0
        return {**self.writer.close(), "padding_tokens": self.padding}

    def abort(self) -> None:
        self.writer.abort()


class _MegatronSplitWriter:
    """One split as one Megatron ``<split>.bin`` / ``<split>.idx`` pair (:mod:`moetrain.data.format`)."""

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

    Documents arrive in stream order, as token arrays (BOS and EOS included); each goes to train or val
    by the validation rule (module docstring), decided on its position in the stream.
    :func:`write_shards` feeds it from text; ``moetrain.data.pipeline`` from the per-input parts
    that its worker processes wrote.

    Args:
        out_dir: created if missing; its manifest is deleted first, so that a directory with a
            manifest always holds a complete set.
        vocab_size, eos_id, tokenizer_identity: recorded in the manifest (``vocab_size`` also
            picks the token dtype).
        bos_id: recorded in the manifest: the id that starts every document, ``None`` for none.
        shard_tokens: tokens per shard of the ``moetrain`` layout (>= 2; with packing, rounded down
            to whole blocks of ``pack_seq_len + 1``).
        val_fraction / val_docs: the validation rule, at most one; neither means 0.01.
        layout: ``"moetrain"`` (format version 1, shards of ``shard_tokens``) or ``"megatron"``
            (format version 2: one Megatron ``<split>.bin`` / ``.idx`` per split).
        loss_mask: documents come with a loss mask (:meth:`add`'s ``mask``), written as ``.mask``
            files (``moetrain`` layout only).
        pack_seq_len: pack the documents into blocks of ``pack_seq_len + 1`` tokens for sequences
            of ``pack_seq_len`` (module docstring); needs ``loss_mask``. pad_id: the padding id
            (default: ``eos_id``).

    Raises:
        ValueError: bad arguments.
    """

    def __init__(self, out_dir: str | os.PathLike, *, vocab_size: int, eos_id: int, bos_id: int | None,
                 tokenizer_identity: dict, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                 val_fraction: float | None = None, val_docs: int | None = None, layout: Layout = "moetrain",
                 loss_mask: bool = False, pack_seq_len: int | None = None, pad_id: int | None = None):
        self.rule, self._is_val, self.dtype = self.check_args(
            vocab_size=vocab_size, shard_tokens=shard_tokens, val_fraction=val_fraction, val_docs=val_docs,
            layout=layout, loss_mask=loss_mask, pack_seq_len=pack_seq_len)
        if pack_seq_len is not None:
            shard_tokens = max(1, shard_tokens // (pack_seq_len + 1)) * (pack_seq_len + 1)
        self.layout, self.loss_mask, self.pack_seq_len = layout, loss_mask, pack_seq_len
        self.pad_id = eos_id if pad_id is None else pad_id
        self.info = {"vocab_size": vocab_size, "eos_id": eos_id, "bos_id": bos_id,
                     "tokenizer": dict(tokenizer_identity),
                     "shard_tokens": shard_tokens if layout == "moetrain" else None}
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / MANIFEST).unlink(missing_ok=True)
        for stale in self.out.glob(".*.tmp-*"):  # left by a run that crashed
            stale.unlink()
        if layout == "moetrain":
            self.writers = {s: _SplitWriter(self.out, s, self.dtype, shard_tokens, loss_mask) for s in SPLITS}
            if pack_seq_len is not None:
                self.writers = {s: _Packer(w, pack_seq_len + 1, self.pad_id) for s, w in self.writers.items()}
        else:
            self.writers = {s: _MegatronSplitWriter(self.out, s, self.dtype) for s in SPLITS}
        self.documents = 0
        self.tokens = 0

    @staticmethod
    def check_args(*, vocab_size: int, shard_tokens: int = DEFAULT_SHARD_TOKENS, val_fraction: float | None = None,
                   val_docs: int | None = None, layout: Layout = "moetrain", loss_mask: bool = False,
                   pack_seq_len: int | None = None):
        """Check the settings without writing anything; returns (val rule, its function, token dtype).

        Raises:
            ValueError: a bad setting (the message names it).
        """
        if shard_tokens < 2:
            raise ValueError(f"shard_tokens={shard_tokens}: must be >= 2")
        if layout not in ("moetrain", "megatron"):
            raise ValueError(f"layout={layout!r}: must be 'moetrain' or 'megatron'")
        if loss_mask and layout != "moetrain":
            raise ValueError("a loss mask is written in the moetrain layout only (Megatron's .bin/.idx have no place "
                             "for it); drop --format megatron")
        if pack_seq_len is not None and (pack_seq_len < 1 or not loss_mask):
            raise ValueError(f"pack_seq_len={pack_seq_len}: packing needs a positive length and a loss mask (the "
                             f"padding is masked out)")
        if val_fraction is None and val_docs is None:
            val_fraction = 0.01
        rule, is_val = _val_rule(val_fraction, val_docs)
        return rule, is_val, token_dtype(vocab_size) if layout == "moetrain" else megatron_dtype(vocab_size)

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append the next documents of the stream: ``tokens`` back to back, ``lengths`` int64
        ``[documents]`` (each >= 1), ``mask`` uint8 ``[tokens]`` (1: trained as a target) with
        ``loss_mask``."""
        if (mask is not None) != self.loss_mask:
            raise ValueError("ShardWriter(loss_mask=True) needs a mask with every document, and refuses one otherwise")
        held_out = self._is_val(self.documents + np.arange(len(lengths), dtype=np.int64))
        self.documents += len(lengths)
        self.tokens += len(tokens)
        if not held_out.any():  # the common case: no copy
            self.writers["train"].add_documents(tokens, lengths, *([mask] if self.loss_mask else []))
            return
        in_val = np.repeat(held_out, lengths)
        for split, docs, toks in (("val", held_out, in_val), ("train", ~held_out, ~in_val)):
            self.writers[split].add_documents(tokens[toks], lengths[docs], *([mask[toks]] if self.loss_mask else []))

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
        packing = {}
        if self.pack_seq_len is not None:
            packing = {"packed": {"seq_len": self.pack_seq_len, "pad_id": self.pad_id,
                                  "padding_tokens": {s: sp.pop("padding_tokens") for s, sp in splits.items()}}}
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
            **({"loss_mask": True} if self.loss_mask else {}),
            **packing,
            "splits": splits,
            **(extra or {}),
        }
        listed = {f for sp in splits.values() for sh in sp["shards"]
                  for f in (sh["name"], sh["index_name"], sh.get("mask_name")) if f}
        for f in self.out.iterdir():
            if _SHARD_FILE.match(f.name) and f.name not in listed:
                f.unlink()
        atomic_write(self.out / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        return manifest


def encode_documents(tokenizer: TokenizerLike, texts: Sequence[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``texts`` as documents, each ``[BOS] + ids + EOS`` (BOS when ``tokenizer.bos_id`` is
    not None): ``(tokens [sum of lengths], lengths int64 [len(texts)])``."""
    encoded = tokenizer.encode_batch(texts)
    bos = tokenizer.bos_id
    framing = 1 if bos is None else 2
    lengths = np.fromiter((len(ids) + framing for ids in encoded), dtype=np.int64, count=len(encoded))
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    end = np.cumsum(lengths)
    tokens[end - 1] = tokenizer.eos_id
    if bos is not None:
        tokens[end - lengths] = bos
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
    """Tokenize ``documents`` (each ``[BOS] + text + EOS``) into train/val shards in ``out_dir``, in this process.

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
            ``eos_id``, ``bos_id``, ``identity``).
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
    writer = ShardWriter(out_dir, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id, bos_id=tokenizer.bos_id,
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
