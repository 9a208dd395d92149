"""The token-shard format: the files of a shard directory, its manifest, and reading the manifest.

Layout of a shard directory (written by :class:`~moetrain.data.writer.ShardWriter`, through
:func:`~moetrain.data.writer.write_shards` in one process or ``moetrain.data.pipeline`` /
``tools/tokenize_corpus.py`` in many; read by :class:`~moetrain.data.reader.TokenShards`)::

    manifest.json        what is there and how to check it (written last)
    train_00000.bin      token ids, flat, little-endian uint16 (vocab_size <= 65536) or uint32
    train_00000.idx      int64 little-endian: offset (in tokens, within this .bin) of every
                         document that starts in this shard, ascending
    train_00001.bin ...
    val_00000.bin / .idx the validation split, same format

Every document is ``[BOS] + text + EOS``: one EOS token after it and, when the tokenizer's family
starts documents with one (``bos_id`` not null: Llama 3, Mixtral, DeepSeek-V3), one BOS token
before it (:mod:`moetrain.data.tokenizer` says how both are chosen). Shards are cut at exactly
``shard_tokens`` tokens (the last shard of a split is shorter), so a document may run on from
one shard into the next; the ``.idx`` of the next shard then does not list it.

``manifest.json`` (``format_version`` 1)::

    {
      "format": "moetrain-token-shards", "format_version": 1,
      "dtype": "uint16", "vocab_size": 8192, "eos_id": 0, "bos_id": null,
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
``bos_id`` is absent from manifests written before it was recorded; :func:`read_manifest` reads
those as ``null`` (they never had a BOS). Written by the corpus pipeline, a manifest also has
``"skipped_documents": {"total", "by_reason", "log"}`` (``log``: ``skipped_documents.jsonl``
beside it, a sample of locations).

Fine-tuning data (``tools/tokenize_corpus.py --chat``, :mod:`moetrain.data.chat`) adds, in the
version-1 layout only::

    "loss_mask": true,                   every shard has a train_NNNNN.mask: one uint8 per token,
                                         1 where the token is trained as a target
    "packed": {"seq_len": 4096, "pad_id": 2, "padding_tokens": {"train": ..., "val": ...}},
    shard entries: ..., "mask_name": "train_00000.mask", "mask_bytes": ..., "mask_sha256": ...

``packed``: the records were packed into blocks of ``seq_len + 1`` tokens, padded with
``pad_id`` (masked out, each padding run a document of its own in the ``.idx`` and in the
documents counts), and shards hold whole blocks: such data trains at that ``model.seq_len`` only
(``moetrain.data.sources`` refuses another before launch).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MEGATRON_FORMAT_VERSION", "DEFAULT_SHARD_TOKENS", "SPLITS", "MANIFEST",
           "ShardError", "TokenizerLike", "token_dtype", "fix_hint", "read_manifest", "is_megatron"]

FORMAT_NAME = "moetrain-token-shards"
FORMAT_VERSION = 1
MEGATRON_FORMAT_VERSION = 2
DEFAULT_SHARD_TOKENS = 2**27  # 134M tokens: 256 MiB as uint16
SPLITS = ("train", "val")
MANIFEST = "manifest.json"
_MEGATRON_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "uint16")


class ShardError(ValueError):
    """Shards on disk do not match their manifest (or there is no usable manifest).

    The message names the file, what is wrong, and how to fix it.
    """


class TokenizerLike(Protocol):
    """What :func:`~moetrain.data.writer.write_shards` needs of a tokenizer (``TextTokenizer`` has it).

    ``eos_id`` ends every document; ``bos_id`` starts every document, ``None`` for no BOS;
    ``identity`` is ``{"name", "vocab_size", "sha256"}``, where ``sha256`` changes whenever the
    ids of a document would (BOS / EOS included); ``encode_batch`` gives each text's ids without
    BOS or EOS.
    """

    vocab_size: int
    eos_id: int
    bos_id: int | None
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


def fix_hint(directory: Path) -> str:
    """The "Fix:" sentence that ends every :class:`ShardError` message."""
    return (
        f"Fix: re-create the shards with `python tools/tokenize_corpus.py ... --out {directory}` "
        f"(for the demo data: `python tools/prepare_demo.py`)"
    )


def _megatron_hint(path: Path) -> str | None:
    """A hint when ``path`` is a Megatron dataset prefix (or one of its files), not a directory."""
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    if prefix.with_name(prefix.name + ".idx").is_file():
        return (f"{path}: a Megatron-LM dataset, not a shard directory. Fix: describe it with "
                f"`python tools/import_megatron.py --train {prefix} --tokenizer SPEC --out DIR` and use DIR")
    return None


def read_manifest(path: str | os.PathLike) -> dict:
    """Read and check ``<path>/manifest.json`` (format, version, keys); no shard file is opened.
    A manifest without ``bos_id`` (written before it was recorded) gets ``"bos_id": None``.

    Raises:
        ShardError: directory or manifest missing (with a hint when ``path`` is a Megatron
            dataset prefix), not JSON, or not a known format version.
    """
    directory = Path(path)
    mpath = directory / MANIFEST
    if not directory.is_dir():
        raise ShardError(_megatron_hint(directory)
                         or f"{directory}: shard directory does not exist. {fix_hint(directory)}")
    if not mpath.is_file():
        raise ShardError(
            f"{mpath}: manifest missing (the shards were never written, or writing was "
            f"interrupted). {fix_hint(directory)}"
        )
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardError(f"{mpath}: not valid JSON ({e}). {fix_hint(directory)}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ShardError(f"{mpath}: not a {FORMAT_NAME} manifest. {fix_hint(directory)}")
    version = manifest.get("format_version")
    if version not in (FORMAT_VERSION, MEGATRON_FORMAT_VERSION):
        raise ShardError(
            f"{mpath}: unknown format version {version!r} "
            f"(this moetrain reads versions {FORMAT_VERSION} and {MEGATRON_FORMAT_VERSION}). {fix_hint(directory)}"
        )
    dtypes = ("uint16", "uint32") if version == FORMAT_VERSION else _MEGATRON_DTYPES
    missing = [k for k in ("dtype", "vocab_size", "eos_id", "tokenizer", "splits") if k not in manifest]
    if version == MEGATRON_FORMAT_VERSION and manifest.get("index_format") != "megatron":
        missing.append("index_format: megatron")
    if missing or manifest["dtype"] not in dtypes:
        raise ShardError(f"{mpath}: malformed (missing {missing} or bad dtype). {fix_hint(directory)}")
    manifest.setdefault("bos_id", None)
    return manifest


def is_megatron(manifest: dict) -> bool:
    """A format-version-2 manifest: Megatron ``.bin`` / ``.idx`` files, or token ranges of them."""
    return manifest["format_version"] == MEGATRON_FORMAT_VERSION
