"""Checks done once, before any process starts, that need more than the config itself.

The config's rules, what this version runs on the planned device included, are
:func:`moetrain.config.check_supported`'s; here is only what reads something outside it: the data
manifest (vocabulary size), the rank map (node-limited routing, the hierarchical dispatcher), the
``checkpoint.init_from`` weights (the model's names and shapes), the container's mounts (the data
and checkpoints visible inside) and the SLURM cluster.
``preflight(cfg)`` returns the resolved config or raises :class:`moetrain.config.ConfigError`.
"""

from __future__ import annotations

from moetrain.config import Config, check_supported, field_error
from moetrain.data.sources import resolve_vocab


def check_node_limited(cfg: Config) -> None:
    """``moe.max_nodes_per_token`` and ``moe.token_dispatcher: hierarchical``: on the rank map the
    run will get, every ep group's NVLink domains must hold as many of its ranks each, and, with
    the limit, M of them at least ``moe.top_k`` experts (the ranks check the same with their
    real rank map, :mod:`moetrain.parallel.expert`).

    Raises:
        ConfigError: naming moe.max_nodes_per_token or moe.token_dispatcher.
    """
    M, moe = cfg.moe.max_nodes_per_token, cfg.moe
    hierarchical = moe.token_dispatcher == "hierarchical"
    if (M is None and not hierarchical) or not moe.num_experts or cfg.parallel.ep == 1:
        return
    from moetrain.topology import build_rank_map
    from moetrain.topology.mapper import ranks_per_domain

    rank_map = build_rank_map(cfg)
    for group in rank_map.groups("ep"):
        domains = [rank_map.domain_of(r) for r in group]
        if hierarchical:
            ranks_per_domain("moe.token_dispatcher", moe.token_dispatcher, group, domains,
                             "use a layout whose ep groups span whole domains, or token_dispatcher: alltoall")
        if M is None or len(set(domains)) <= M:
            continue  # no limit, or a token can reach every domain of this group anyway
        counts = {d: len(v) for d, v in ranks_per_domain(
            "moe.max_nodes_per_token", M, group, domains,
            "use a layout whose ep groups span whole domains, or max_nodes_per_token: null").items()}
        experts = moe.num_experts // len(group) * next(iter(counts.values()))
        if M * experts < moe.top_k:
            raise field_error("moe.max_nodes_per_token", M, f"the ep group spans {len(counts)} domains of "
                              f"{experts} experts each: {M} of them hold fewer than top_k = {moe.top_k}",
                              f"use max_nodes_per_token >= {-(-moe.top_k // experts)}, a layout with more "
                              f"experts per node, or null")


def preflight(cfg: Config, *, live: bool = True) -> Config:
    """The resolved config, or :class:`ConfigError` for anything wrong with it (see the module
    docstring): the config's rules on the planned device, the rank map, the vocabulary, the
    weights, the SLURM request — against the cluster that answers here when ``live`` (a SLURM run
    cannot be submitted where none does; ``live=False``: a dry run checks what it can offline)."""
    check_supported(cfg)
    check_node_limited(cfg)
    cfg = resolve_vocab(cfg)
    if cfg.checkpoint.init_from is not None:
        from moetrain.train.weights import check_init_from  # imports torch: only a run that needs it

        check_init_from(cfg)
    if cfg.launch.container is not None:
        from moetrain.launch.container import check_mounted

        check_mounted(cfg)
    check_elastic(cfg)
    if cfg.launch.cluster == "slurm":
        from moetrain.launch.slurm import validate_slurm

        validate_slurm(cfg, live=live)
    return cfg


def check_elastic(cfg: Config) -> None:
    """``launch.elastic``: every node count the job may start with has a layout that fits
    (:func:`moetrain.planner.elastic.node_counts_without_layout`).

    Raises:
        ConfigError: naming launch.elastic.min_nodes, the first count without one and why.
    """
    if cfg.launch.elastic is None:
        return
    from moetrain.planner.elastic import node_counts_without_layout

    bad = node_counts_without_layout(cfg)
    if not bad:
        return
    n, why = max(bad.items())
    fix = (f"use min_nodes: {n + 1} (every count from there up has one), or a global batch size / a model that "
           f"{n} node(s) can hold")
    raise field_error("launch.elastic.min_nodes", cfg.launch.elastic.min_nodes,
                      f"the job may start on {n} node(s), where {why}", fix)
