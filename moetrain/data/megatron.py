"""Megatron-LM's indexed dataset (``MMapIndexedDataset``): read and write ``<prefix>.bin`` / ``.idx``.

Layout, as Megatron-LM documents and writes it (``megatron/core/datasets/indexed_dataset.py``)::

    <prefix>.bin   token ids of every sequence, back to back, in the .idx's dtype
    <prefix>.idx   little-endian:
        9 bytes    magic  b"MMIDIDX\\x00\\x00"
        uint64     version, 1
        uint8      dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                   7 float32, 8 uint16
        uint64     S, the number of sequences
        uint64     D, the number of entries of document_indices (documents + 1)
        int32[S]   sequence lengths, in tokens
        int64[S]   sequence pointers: byte offset of each sequence in the .bin
        int64[D]   document_indices: document d is sequences [doc[d], doc[d+1]); doc[0] = 0,
                   doc[D-1] = S
        (int8[S]   sequence modes, multimodal datasets only; ignored here)

``preprocess_data.py`` writes one sequence per document (several with ``--split-sentences``),
EOD appended with ``--append-eod``, dtype ``uint16`` below 65500 ids and ``int32`` above. We
write one sequence per document, the EOS included, in ``uint16`` (vocabulary <= 65536) or
``int32``: Megatron reads any dtype code, and it has no ``uint32`` code.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetrain.data.format import FORMAT_NAME, MANIFEST, MEGATRON_FORMAT_VERSION
from moetrain.utils import atomic_write

__all__ = ["MAGIC", "DTYPE_CODES", "MegatronIndex", "MegatronFormatError", "read_index",
           "megatron_dtype", "MegatronWriter", "import_megatron"]

MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_CODE_OF = {np.dtype(v).newbyteorder("<"): k for k, v in DTYPE_CODES.items()}
_TOKEN_CODES = (1, 2, 3, 4, 5, 8)  # integer dtypes: the float codes cannot hold token ids
_CHUNK = 2**22  # elements per step when streaming index arrays (bounded memory at any size)


class MegatronFormatError(ValueError):
    """A ``.idx`` / ``.bin`` pair is not a Megatron indexed dataset we can read. The message names
    the file and what is wrong."""


def megatron_dtype(vocab_size: int) -> np.dtype:
    """Token dtype we write for ``vocab_size`` ids: ``<u2`` up to 65536, else ``<i4``.

    Raises:
        ValueError: ``vocab_size`` outside ``[1, 2**31]`` (int32 is Megatron's widest token code).
    """
    if not 1 <= vocab_size <= 2**31:
        raise ValueError(f"vocab_size={vocab_size}: a Megatron dataset holds ids below 2**31")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<i4")


@dataclass
class MegatronIndex:
    """A read ``.idx``: ``dtype`` of the tokens; ``sequence_lengths`` int32 ``[S]`` (tokens);
    ``sequence_pointers`` int64 ``[S]`` (bytes into the .bin); ``document_indices`` int64
    ``[documents + 1]``. The arrays are read-only memory maps of the file."""

    path: Path
    dtype: np.dtype
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def document_token_starts(self) -> np.ndarray:
        """int64 ``[documents]``: the token offset in the .bin where each document starts."""
        # Token start of every sequence, plus the end, so that a document with no sequence works.
        starts = np.concatenate([self.sequence_pointers // self.dtype.itemsize, [self.num_tokens]])
        return starts[self.document_indices[:-1]].astype(np.int64)


def read_index(idx_path: str | os.PathLike, bin_bytes: int | None = None) -> MegatronIndex:
    """Read and check a Megatron ``.idx``.

    Args:
        idx_path: the ``.idx`` file.
        bin_bytes: the size of the matching ``.bin``, checked against the index when given.

    Raises:
        MegatronFormatError: wrong magic or version, a non-integer dtype, a file shorter than its
            arrays, document indices that do not run from 0 to S, sequences that are not stored
            back to back from byte 0 (this reader maps token ranges), or a ``.bin`` of another size.
    """
    path = Path(idx_path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size or head[:9] != MAGIC:
        raise MegatronFormatError(f"{path}: not a Megatron index (no {MAGIC!r} header)")
    _, version, code, n_seq, n_doc = _HEADER.unpack(head)
    if version != 1:
        raise MegatronFormatError(f"{path}: index version {version}, this reader knows version 1")
    if code not in _TOKEN_CODES:
        raise MegatronFormatError(f"{path}: dtype code {code} is not an integer token type "
                                  f"(known codes: {sorted(DTYPE_CODES)})")
    need = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if size < need or n_doc < 1:
        raise MegatronFormatError(f"{path}: {size} bytes, but its header announces {n_seq} sequences and "
                                  f"{n_doc} document indices ({need} bytes): truncated or not an index")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    at = _HEADER.size
    lengths = raw[at:at + 4 * n_seq].view("<i4")
    pointers = raw[at + 4 * n_seq:at + 12 * n_seq].view("<i8")
    docs = raw[at + 12 * n_seq:at + 12 * n_seq + 8 * n_doc].view("<i8")
    dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
    if docs[0] != 0 or docs[-1] != n_seq or (n_doc > 1 and np.any(np.diff(docs) < 0)):
        raise MegatronFormatError(f"{path}: document indices must rise from 0 to the sequence count {n_seq}")
    # Contiguity, streamed: pointer[i] == itemsize * (lengths[0] + ... + lengths[i-1]).
    expected = 0
    for a in range(0, n_seq, _CHUNK):
        ln = lengths[a:a + _CHUNK].astype(np.int64)
        if np.any(ln < 0):
            raise MegatronFormatError(f"{path}: negative sequence length")
        ends = expected + np.cumsum(ln) * dtype.itemsize
        starts = np.concatenate([[expected], ends[:-1]])
        if not np.array_equal(starts, pointers[a:a + _CHUNK]):
            raise MegatronFormatError(f"{path}: sequences are not stored back to back in the .bin "
                                      f"(pointer of a sequence in [{a}, {a + len(ln)}) is not the end of "
                                      f"the one before); not supported")
        expected = int(ends[-1]) if len(ends) else expected
    if bin_bytes is not None and bin_bytes != expected:
        raise MegatronFormatError(f"{path.with_suffix('.bin')}: {bin_bytes} bytes, but {path.name} describes "
                                  f"{expected} bytes of {dtype.name} tokens: the pair does not match")
    return MegatronIndex(path, dtype, lengths, pointers, docs)


def _header(dtype: np.dtype, n_seq: int, n_doc_indices: int) -> bytes:
    return _HEADER.pack(MAGIC, 1, _CODE_OF[np.dtype(dtype).newbyteorder("<")], n_seq, n_doc_indices)


class MegatronWriter:
    """Streams documents into ``<prefix>.bin`` and, at :meth:`close`, writes ``<prefix>.idx``.

    Both are written under temporary names and renamed at close. The sequence lengths go to a
    temporary file as they come, so memory stays bounded however many documents there are (the
    ``.idx`` needs 20 bytes per document, written in chunks at close).
    """

    def __init__(self, prefix: Path, dtype: np.dtype):
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        tag = f".tmp-{os.getpid()}"
        self._bin_tmp = self.prefix.with_name(f".{self.prefix.name}.bin{tag}")
        self._len_tmp = self.prefix.with_name(f".{self.prefix.name}.lengths{tag}")
        self._idx_tmp = self.prefix.with_name(f".{self.prefix.name}.idx{tag}")
        self._bin, self._lengths = open(self._bin_tmp, "wb"), open(self._len_tmp, "wb")
        self._hash = hashlib.sha256()
        self.tokens = self.documents = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: ``tokens`` their ids back to back, ``lengths`` int ``[documents]``."""
        if len(lengths) and int(lengths.max()) >= 2**31:
            raise ValueError("a document of 2**31 tokens or more does not fit Megatron's int32 lengths")
        blob = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self._bin.write(blob)
        self._hash.update(blob)
        self._lengths.write(np.asarray(lengths, dtype="<i4").tobytes())
        self.tokens += len(tokens)
        self.documents += len(lengths)

    def close(self) -> dict:
        """Finish both files; returns ``{"bin", "idx", "bytes", "sha256", "index_bytes", "index_sha256"}``."""
        self._bin.flush()
        os.fsync(self._bin.fileno())  # both files durable before their rename (moetrain.utils.atomic_write)
        self._bin.close()
        self._lengths.close()
        n = self.documents
        idx_hash = hashlib.sha256()
        with open(self._idx_tmp, "wb") as out:
            def put(b: bytes) -> None:
                out.write(b)
                idx_hash.update(b)

            put(_header(self.dtype, n, n + 1))
            lengths = np.memmap(self._len_tmp, dtype="<i4", mode="r") if n else np.zeros(0, "<i4")
            for a in range(0, n, _CHUNK):
                put(np.asarray(lengths[a:a + _CHUNK]).tobytes())
            offset = 0
            for a in range(0, n, _CHUNK):
                ends = offset + np.cumsum(lengths[a:a + _CHUNK], dtype=np.int64) * self.dtype.itemsize
                put(np.concatenate([[offset], ends[:-1]]).astype("<i8").tobytes())
                offset = int(ends[-1])
            for a in range(0, n + 1, _CHUNK):
                put(np.arange(a, min(n + 1, a + _CHUNK), dtype="<i8").tobytes())
            del lengths
            out.flush()
            os.fsync(out.fileno())
        self._len_tmp.unlink()
        index_bytes = self._idx_tmp.stat().st_size
        os.replace(self._idx_tmp, self.prefix.with_name(self.prefix.name + ".idx"))
        os.replace(self._bin_tmp, self.prefix.with_name(self.prefix.name + ".bin"))
        return {"bin": self.prefix.name + ".bin", "idx": self.prefix.name + ".idx",
                "bytes": self.tokens * self.dtype.itemsize, "sha256": self._hash.hexdigest(),
                "index_bytes": index_bytes, "index_sha256": idx_hash.hexdigest()}

    def abort(self) -> None:
        for f in (self._bin, self._lengths):
            f.close()
        for p in (self._bin_tmp, self._len_tmp, self._idx_tmp):
            p.unlink(missing_ok=True)


def _prefix(p: str | os.PathLike) -> Path:
    p = Path(p)
    return p.with_suffix("") if p.suffix in (".bin", ".idx") else p


def _scan_bin(path: Path, dtype: np.dtype, bar) -> tuple[str, int]:
    """sha256 of a .bin and its largest token id, in one streaming pass."""
    h, top = hashlib.sha256(), -1
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK * 8):
            h.update(chunk)
            ids = np.frombuffer(chunk[: len(chunk) // dtype.itemsize * dtype.itemsize], dtype=dtype)
            if len(ids):
                top = max(top, int(ids.max()))
            bar.update(len(chunk))
    return h.hexdigest(), top


def import_megatron(train: list[str | os.PathLike], out_dir: str | os.PathLike, *, vocab_size: int, eos_id: int,
                    tokenizer_identity: dict, bos_id: int | None = None, val: list[str | os.PathLike] = (),
                    val_last_docs: int = 0, progress: bool = True) -> dict:
    """Describe existing Megatron-LM datasets with a shard manifest (format version 2), in place.

    No token is copied: ``<out_dir>/manifest.json`` lists the ``.bin/.idx`` files where they are
    (paths relative to ``out_dir`` when they share a root, else absolute), with their sizes and
    sha256, so that ``TokenShards(out_dir)`` and a training config's ``data.path: out_dir`` read them.

    Args:
        train: dataset prefixes (``/data/x_text_document`` for ``x_text_document.bin/.idx``; a
            ``.bin`` or ``.idx`` path works too), one shard each, in this order.
        vocab_size, eos_id, tokenizer_identity: the tokenizer the data was written with (the
            model's vocabulary comes from here; every id must be below ``vocab_size``).
        bos_id: the id that starts each document when the data was written with one (Megatron's
            tokenizers add it for Llama-family models), else ``None``; recorded, not checked.
        val: prefixes of the validation split, or
        val_last_docs: hold out the last N documents of the last train prefix (Megatron's own
            ``--split`` also puts validation after training).

    Returns:
        The manifest (also written).

    Raises:
        MegatronFormatError: a file is not a readable Megatron dataset, or a token id is not
            below ``vocab_size``. ValueError: both ``val`` and ``val_last_docs``, or more
            held-out documents than the dataset has.
    """
    from tqdm import tqdm

    if val and val_last_docs:
        raise ValueError("give validation prefixes or val_last_docs, not both")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def where(p: Path) -> str:
        rel = os.path.relpath(p.resolve(), out.resolve())
        return p.resolve().as_posix() if rel.startswith("..") else rel

    prefixes = [(s, _prefix(p)) for s, ps in (("train", train), ("val", val)) for p in ps]
    bins = [pre.with_name(pre.name + ".bin") for _, pre in prefixes]
    dtypes, splits = set(), {"train": [], "val": []}
    with tqdm(total=sum(b.stat().st_size for b in bins), unit="B", unit_scale=True, disable=not progress,
              desc="sha256 of the Megatron files") as bar:
        for (split, pre), bin_path in zip(prefixes, bins):
            idx_path = pre.with_name(pre.name + ".idx")
            index = read_index(idx_path, bin_bytes=bin_path.stat().st_size)
            sha, top = _scan_bin(bin_path, index.dtype, bar)
            if top >= vocab_size:
                raise MegatronFormatError(f"{bin_path}: token id {top} is not below the vocabulary size "
                                          f"{vocab_size}: written with another tokenizer?")
            dtypes.add(index.dtype.name)
            idx_bytes = idx_path.read_bytes()
            splits[split].append({"name": where(bin_path), "tokens": index.num_tokens, "documents": index.num_documents,
                                  "bytes": bin_path.stat().st_size, "sha256": sha, "index_name": where(idx_path),
                                  "index_bytes": len(idx_bytes), "index_sha256": hashlib.sha256(idx_bytes).hexdigest(),
                                  "token_offset": 0, "first_document": 0, "_starts": index.document_token_starts()})
    if len(dtypes) > 1:
        raise MegatronFormatError(f"the datasets mix token dtypes {sorted(dtypes)}; one manifest holds one dtype")
    if val_last_docs:
        last = splits["train"][-1]
        keep = last["documents"] - val_last_docs
        if keep < 1:
            raise ValueError(f"val_last_docs={val_last_docs}: {last['name']} has only {last['documents']} documents")
        cut = int(last["_starts"][keep])
        held = {**last, "token_offset": cut, "first_document": keep, "tokens": last["tokens"] - cut,
                "documents": val_last_docs}
        last.update(tokens=cut, documents=keep)
        splits["val"].append(held)
    rule = ({"rule": "megatron_last_n", "n": val_last_docs, "description":
             f"the last {val_last_docs} documents of {splits['train'][-1]['name']}"} if val_last_docs else
            {"rule": "separate_files", "description": "the val prefixes"} if val else
            {"rule": "none", "description": "no validation split"})
    for shards in splits.values():
        for sh in shards:
            sh.pop("_starts")
    manifest = {
        "format": FORMAT_NAME, "format_version": MEGATRON_FORMAT_VERSION, "index_format": "megatron",
        "dtype": dtypes.pop(), "vocab_size": vocab_size, "eos_id": eos_id, "bos_id": bos_id,
        "tokenizer": dict(tokenizer_identity),
        "shard_tokens": None, "val_split": rule, "sources": [str(p) for _, p in prefixes],
        "total_tokens": sum(sh["tokens"] for s in splits.values() for sh in s),
        "total_documents": sum(sh["documents"] for s in splits.values() for sh in s),
        "splits": {s: {"tokens": sum(sh["tokens"] for sh in v), "documents": sum(sh["documents"] for sh in v),
                       "shards": v} for s, v in splits.items()},
    }
    atomic_write(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest
