"""What this version can run: layout and backend rules beyond the config's own arithmetic.

:func:`check_supported` is called twice: by ``moetrain.launch.preflight`` before any process
starts (so a refusal names the field before launch) and by
:func:`moetrain.parallel.apply.build_model_parts` in every rank (so a layout built without the
launcher, e.g. in a test, is refused the same way).
"""

from __future__ import annotations

from moetrain.config import Config, ConfigError


def check_supported(cfg: Config) -> None:
    """Refuse what this version cannot run yet.

    Raises:
        ConfigError: naming the field, the value and the fix.
    """
    not_yet = [  # (field, value, requested): one line per feature still missing
        ("moe.expert_backend", cfg.moe.expert_backend, cfg.moe.expert_backend == "megablocks"),
        ("model.attention_backend", cfg.model.attention_backend, cfg.model.attention_backend != "sdpa"),
    ]
    for name, value, requested in not_yet:
        if requested:
            raise ConfigError(f"{name} = {value!r}: not supported by this version of moetrain yet. "
                              f"Fix: use the default for {name}")
    if cfg.parallel.pp > 1:  # what pipeline parallelism does not compose with yet, and its schedules' rules
        from moetrain.parallel.pipeline import check_pipeline_layout

        check_pipeline_layout(cfg)
