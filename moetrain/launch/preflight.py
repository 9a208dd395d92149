"""Checks and resolution done once, before any process starts.

``preflight(cfg)`` returns the resolved config (vocabulary size taken from the data manifest)
or raises :class:`moetrain.config.ConfigError` naming the field, the value and the fix.
"""

from __future__ import annotations

from moetrain.config import Config, ConfigError, padded_vocab
from moetrain.data.shards import ShardError, read_manifest


def supported_now(cfg: Config) -> None:
    """Refuse what this version cannot run yet (before launch, not in the ranks).

    Raises:
        ConfigError: naming the field.
    """
    p = cfg.parallel
    not_yet = [  # (field, value, requested): one line per dimension still missing
        ("moe.expert_backend", cfg.moe.expert_backend, cfg.moe.expert_backend != "grouped"),
        ("model.attention_backend", cfg.model.attention_backend, cfg.model.attention_backend != "sdpa"),
    ]
    for name, value, requested in not_yet:
        if requested:
            raise ConfigError(f"{name} = {value!r}: not supported by this version of moetrain yet. "
                              f"Fix: use the default for {name}")
    if p.pp > 1:  # what pipeline parallelism does not compose with yet, and its schedules' rules
        from moetrain.parallel.pipeline import check_pipeline_layout

        check_pipeline_layout(cfg)


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
    supported_now(cfg)
    cfg = resolve_vocab(cfg)
    if cfg.launch.cluster == "slurm":
        from moetrain.launch.slurm import validate_slurm

        validate_slurm(cfg)
    return cfg
