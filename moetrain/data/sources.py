"""The sources of a run's data, read and checked against each other before any process starts.

Every source of a blend (``data.blend``, or ``data.path`` as a blend of one) must have been
tokenized alike: the same tokenizer (its identity's sha256), hence the same vocabulary, BOS and
EOS, and the same token dtype — a model cannot learn from ids that mean different things in
different sources. Packed fine-tuning data must have been packed for the model's sequence
length. Only manifests are read: no shard is opened.
"""

from __future__ import annotations

import logging

from moetrain.config import Config, ConfigError, DataConfig, field_error, padded_vocab
from moetrain.data.format import ShardError, read_manifest
from moetrain.data.reader import samples_per_shard

__all__ = ["check_sources", "resolve_vocab", "vocab_for_planning"]

log = logging.getLogger("moetrain")

# What must be equal across the sources of a blend: (what, how it reads in a message, its value
# in a manifest). The tokenizer is compared by its sha256: its name is that of its directory.
_SHARED = (("vocab_size", "vocabulary size", lambda m: m.get("vocab_size")),
           ("dtype", "token dtype", lambda m: m.get("dtype")),
           ("tokenizer", "tokenizer", lambda m: (m.get("tokenizer") or {}).get("sha256")),
           ("eos_id", "EOS id", lambda m: m.get("eos_id")),
           ("bos_id", "BOS id", lambda m: m.get("bos_id")))


def _where(data: DataConfig, i: int) -> str:
    return f"data.blend[{i}]" if data.blend else "data.path"


def _shown(key: str, manifest: dict, value) -> str:
    if key == "tokenizer":
        return f"{(manifest.get('tokenizer') or {}).get('name')!r} (sha256 {str(value)[:12]}…)"
    return repr(value)


def _samples(manifest: dict, seq_len: int) -> int:
    """Training samples of ``seq_len + 1`` tokens in the manifest's train split."""
    tokens = [sh["tokens"] for sh in manifest["splits"].get("train", {}).get("shards", [])]
    return int(samples_per_shard(tokens, seq_len, bool(manifest.get("packed"))).sum())


def check_sources(data: DataConfig, seq_len: int) -> dict:
    """Read every source's manifest and check that they agree; returns the first one's.

    Args:
        data: the data section. seq_len: the model's sequence length (packed data must match).

    Returns:
        The first source's manifest (the vocabulary, tokenizer, EOS / BOS of all of them).

    Raises:
        ConfigError: naming the source (``data.path`` or ``data.blend[i]`` and its name) and the
            field: no data set, a manifest missing or unreadable, a vocabulary, token dtype,
            tokenizer, EOS or BOS that differs from the first source's, packed data of another
            sequence length, a source without one training sample of ``seq_len + 1`` tokens, or
            ``data.loss_mask`` with no source carrying a loss mask.
    """
    sources = data.sources()
    manifests = []
    for i, src in enumerate(sources):
        try:
            manifests.append(read_manifest(src.path))
        except ShardError as e:
            raise field_error(f"{_where(data, i)}.path" if data.blend else "data.path", src.path, str(e),
                              "point it at a directory written by tools/tokenize_corpus.py") from None
    first = manifests[0]
    for i, (src, m) in enumerate(zip(sources, manifests)):
        if i:
            for key, what, value in _SHARED:
                if value(m) != value(first):
                    raise field_error(
                        f"{_where(data, i)}.path", src.path,
                        f"source {src.resolved_name!r} has {what} {_shown(key, m, value(m))}, but "
                        f"{_where(data, 0)} ({sources[0].resolved_name!r}) has {_shown(key, first, value(first))}: "
                        f"the sources of a blend must be tokenized alike",
                        "tokenize every source with the same tokenizer (tools/tokenize_corpus.py --tokenizer SPEC) "
                        "or remove this one from the blend")
        packed = (m.get("packed") or {}).get("seq_len")
        if packed is not None and packed != seq_len:
            raise field_error("model.seq_len", seq_len, f"{_where(data, i)} ({src.resolved_name!r}, {src.path}) is "
                              f"packed for sequences of {packed} tokens",
                              f"set model.seq_len={packed}, or re-tokenize it with --seq-len {seq_len}")
        if _samples(m, seq_len) == 0:
            raise field_error(f"{_where(data, i)}.path" if data.blend else "data.path", src.path,
                              f"source {src.resolved_name!r} has no training sample of {seq_len + 1} tokens "
                              f"(its train split holds {m['splits'].get('train', {}).get('tokens', 0):,} tokens)",
                              "give it more data, a shorter model.seq_len, or remove it")
    packed = [src.resolved_name for src, m in zip(sources, manifests) if m.get("packed")]
    if packed and not data.document_mask:
        log.warning("data source%s %s holds records packed into sequences, and data.document_mask=false lets each "
                    "record attend to the ones before it and to the padding; set data.document_mask=true",
                    "s" if len(packed) > 1 else "", ", ".join(repr(n) for n in packed))
    masked = [src.resolved_name for src, m in zip(sources, manifests) if m.get("loss_mask")]
    if data.loss_mask and not masked:
        raise field_error("data.loss_mask", True, "no source carries a loss mask: every token would be trained",
                          "tokenize fine-tuning data with tools/tokenize_corpus.py --chat, or set "
                          "data.loss_mask=false")
    if masked and not data.loss_mask:
        log.warning("data source%s %s carr%s a loss mask that data.loss_mask=false ignores: prompts and padding are "
                    "trained too; set data.loss_mask=true to train only the masked tokens",
                    "s" if len(masked) > 1 else "", ", ".join(repr(n) for n in masked),
                    "y" if len(masked) > 1 else "ies")
    return first


def resolve_vocab(cfg: Config) -> Config:
    """Check the data's sources against each other (:func:`check_sources`) and fill
    ``model.vocab_size`` from their manifest (padded for tp), or check the given one.

    Raises:
        ConfigError: no data, a data directory or manifest missing/invalid, sources that were not
            tokenized alike, or vocab_size smaller than the tokenizer's vocabulary.
    """
    manifest = check_sources(cfg.data, cfg.model.seq_len)
    vocab = int(manifest["vocab_size"])
    if cfg.model.vocab_size is None:
        return cfg.replace(model={"vocab_size": padded_vocab(vocab, cfg.model.vocab_multiple, cfg.parallel.tp)})
    if cfg.model.vocab_size < vocab:
        where = cfg.data.path if cfg.data.path is not None else "the data"
        raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size}: smaller than the tokenizer's vocabulary "
                          f"({vocab}) in {where}. Fix: set model.vocab_size: null (auto) or >= {vocab}")
    return cfg


def vocab_for_planning(cfg: Config) -> tuple[Config, str | None]:
    """``cfg`` with the vocabulary the run will train with, for a tool that models the run
    without starting it (``moetrain.plan``, ``moetrain.calibrate``): where ``model.vocab_size``
    is null, the data's (:func:`resolve_vocab`) when the data can be read here. The embedding
    and head of a small model are much of its parameters, gradient traffic and compute, so a
    guessed vocabulary makes a wrong plan.

    Returns:
        (the config, None) when the vocabulary is known; (``cfg`` unchanged, why it is not) when
        it is null and the data cannot be read here (the caller says what it assumes instead).
    """
    if cfg.model.vocab_size is not None:
        return cfg, None
    try:
        return resolve_vocab(cfg), None
    except ConfigError as e:
        return cfg, f"model.vocab_size is null and the data gives none here ({e})"
