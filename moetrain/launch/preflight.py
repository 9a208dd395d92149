"""Checks and resolution done once, before any process starts.

``preflight(cfg)`` returns the resolved config (vocabulary size taken from the data manifest)
or raises :class:`moetrain.config.ConfigError` naming the field, the value and the fix. A
``checkpoint.init_from`` must hold weights of the configured model's names and shapes.
"""

from __future__ import annotations

from moetrain.config import Config, ConfigError, padded_vocab
from moetrain.data.shards import ShardError, read_manifest
from moetrain.parallel.support import check_supported
from moetrain.train.weights import check_init_from


def resolve_vocab(cfg: Config) -> Config:
    """Fill ``model.vocab_size`` from the manifest (padded for tp), or check the given one.

    Raises:
        ConfigError: data directory or manifest missing/invalid, or vocab_size smaller than the
            tokenizer's vocabulary.
    """
    try:
        manifest = read_manifest(cfg.data.path)
    except ShardError as e:
        raise ConfigError(f"data.path = {cfg.data.path!r}: {e}") from e
    vocab = int(manifest["vocab_size"])
    if cfg.model.vocab_size is None:
        return cfg.replace(model={"vocab_size": padded_vocab(vocab, cfg.model.vocab_multiple, cfg.parallel.tp)})
    if cfg.model.vocab_size < vocab:
        raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size}: smaller than the tokenizer's vocabulary "
                          f"({vocab}) in {cfg.data.path}. Fix: set model.vocab_size: null (auto) or >= {vocab}")
    return cfg


def preflight(cfg: Config) -> Config:
    """The resolved config, or :class:`ConfigError` for anything wrong with it (see the module
    docstring): what this version supports, the vocabulary, the SLURM request."""
    check_supported(cfg)
    cfg = resolve_vocab(cfg)
    check_init_from(cfg)
    if cfg.launch.cluster == "slurm":
        from moetrain.launch.slurm import validate_slurm

        validate_slurm(cfg)
    return cfg
