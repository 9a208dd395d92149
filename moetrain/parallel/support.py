"""What this version can run: layout, backend and device rules beyond the config's own arithmetic.

:func:`check_supported` is called twice: by ``moetrain.launch.preflight`` before any process
starts, with the device the run will get (:func:`planned_device_type`), so a refusal names the
field before launch; and by :func:`moetrain.parallel.apply.build_model_parts` in every rank with
the device it got, so a layout built without the launcher (a test, a notebook) is refused the
same way. GPU-only backends are refused, never replaced silently: the message names what is
missing (CUDA, a package, the precision).
"""

from __future__ import annotations

import importlib.util

from moetrain.config import Config, ConfigError, field_error


def planned_device_type(cfg: Config) -> str:
    """``cuda`` where the ranks will train on GPUs (SLURM with ``launch.gpus_per_node`` > 0, or a
    local run on a machine with CUDA and a backend other than gloo), else ``cpu``."""
    if cfg.launch.cluster == "slurm":
        return "cuda" if cfg.launch.gpus_per_node > 0 else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() and cfg.parallel.backend != "gloo" else "cpu"


def _installed(*modules: str) -> list[str]:
    """The modules of ``modules`` that are not importable."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def check_supported(cfg: Config, device_type: str | None = None) -> None:
    """Refuse what this version cannot run on ``device_type`` (default: :func:`planned_device_type`).

    Raises:
        ConfigError: naming the field, the value and the fix.
    """
    device = device_type or planned_device_type(cfg)
    m, moe, p, prec = cfg.model, cfg.moe, cfg.parallel, cfg.train.precision

    # Expert backends (moetrain.model.moe): megablocks and CUDA's grouped GEMM want CUDA and bf16.
    if moe.num_experts and moe.expert_backend == "megablocks":
        missing = _installed("megablocks", "grouped_gemm")
        if device != "cuda":
            raise field_error("moe.expert_backend", "megablocks", f"megablocks runs on CUDA only and this run is on "
                              f"{device}", "use expert_backend auto, loop or grouped_mm")
        if missing:
            raise field_error("moe.expert_backend", "megablocks", f"{', '.join(missing)} not installed",
                              "install them in an environment that megablocks supports (README: GPU backends), "
                              "or use expert_backend auto")
        if prec != "bf16":
            raise field_error("moe.expert_backend", "megablocks", f"its grouped GEMM takes bf16, train.precision is "
                              f"{prec!r}", "set train.precision=bf16 or use expert_backend loop")
    if moe.num_experts and moe.expert_backend == "grouped_mm" and device == "cuda" and prec != "bf16":
        raise field_error("moe.expert_backend", "grouped_mm", f"torch's CUDA grouped GEMM takes bf16, train.precision "
                          f"is {prec!r}", "set train.precision=bf16 or use expert_backend loop (auto picks it)")

    # Attention backends (moetrain.model.attention).
    if m.attention_backend == "flash":
        if device != "cuda":
            raise field_error("model.attention_backend", "flash", f"flash-attn runs on CUDA only and this run is on "
                              f"{device}", "use attention_backend sdpa")
        if _installed("flash_attn"):
            raise field_error("model.attention_backend", "flash", "the flash-attn package is not installed",
                              "pip install flash-attn (README: GPU backends), or use attention_backend sdpa")
        if prec != "bf16":
            raise field_error("model.attention_backend", "flash", f"flash-attn takes bf16/fp16, train.precision is "
                              f"{prec!r}", "set train.precision=bf16 or use attention_backend sdpa")
    if m.attention_backend == "flex":
        if device != "cuda":
            raise field_error("model.attention_backend", "flex", "flex_attention has no backward on CPU in torch 2.13",
                              "use attention_backend sdpa on CPU (document masks work there too)")
        if p.cp > 1:
            raise field_error("model.attention_backend", "flex", "under context parallelism the ring attention "
                              "computes attention (its kernels are sdpa's and flash-attn's)",
                              "use attention_backend sdpa or flash with cp > 1")

    if cfg.data.document_mask and p.pp > 1:
        raise ConfigError(f"data.document_mask = True: not supported with parallel.pp = {p.pp} yet (the document "
                          f"ids would have to travel between stages). Fix: set document_mask=false or pp=1")
    if p.pp > 1:  # what pipeline parallelism does not compose with yet, and its schedules' rules
        from moetrain.parallel.pipeline import check_pipeline_layout

        check_pipeline_layout(cfg)
