"""The SLURM side of ``python -m moetrain.submit``: config → submitit executor, checked first.

Three steps, in the order ``submit`` runs them:

1. **map** — :func:`slurm_executor_params` turns the ``launch`` section into the keyword
   arguments of submitit's ``AutoExecutor.update_parameters``; every string that ends up in the
   batch script (partition, account, qos, constraint, exclude, job name) must match a strict
   pattern first (:func:`~moetrain.utils.check_sbatch_safe`), so a config can never inject shell
   text into ``#SBATCH`` lines. The site settings go through submitit's own parameters:
   ``launch.env`` as ``export NAME='value'`` lines (quoted, never interpreted) and
   ``launch.setup`` as they are (shell by design) in ``setup``, ``launch.srun_args`` and pyxis'
   flags in ``srun_args``, ``launch.sbatch_args`` in ``additional_parameters``, and the
   container runtime's command in ``python`` (:mod:`moetrain.launch.container`).
2. **check** — :func:`check_launch` (no cluster needed: strings and the cluster profile's GPUs per
   node) and :func:`check_against_cluster` (a live :class:`ClusterInfo` from
   :func:`query_cluster`: the partition exists, its nodes offer the GPUs and CPUs asked for);
   :func:`validate_slurm` runs both, then asks ``sbatch --test-only`` about the script itself
   (a submission needs SLURM to answer; a ``--dry-run`` runs the second only when it does, and
   says so).
3. **build** — :func:`make_slurm_executor` (runs both checks, then builds the executor) or, for
   ``--dry-run``, :func:`render_batch_script`: the exact sbatch script submitit would submit.

Every bad value raises :class:`~moetrain.config.ConfigError` naming the field, the value and the
fix; a cluster that does not answer raises :class:`SlurmUnavailableError` (a ``ConfigError`` naming
``launch.cluster`` from :func:`validate_slurm`).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit
import yaml
from submitit.slurm.slurm import SlurmExecutor

from moetrain.config import Config, field_error
from moetrain.launch.container import task_launch
from moetrain.utils import check_sbatch_safe

__all__ = [
    "ClusterInfo",
    "NodeInfo",
    "SlurmUnavailableError",
    "check_against_cluster",
    "check_launch",
    "make_slurm_executor",
    "parse_gres_gpus",
    "profile_gpus_per_node",
    "query_cluster",
    "render_batch_script",
    "site_setup_lines",
    "check_test_only",
    "slurm_executor_params",
    "validate_slurm",
]


class SlurmUnavailableError(RuntimeError):
    """SLURM's commands are missing, or slurmctld does not answer."""


# ---------------------------------------------------------------------------------------------
# 1. Mapping and offline checks
# ---------------------------------------------------------------------------------------------


def slurm_executor_params(cfg: Config, *, job_name: str) -> dict[str, Any]:
    """Keyword arguments for ``submitit.AutoExecutor.update_parameters`` from ``cfg.launch``.

    Generic keys (``nodes``, ``tasks_per_node``, ``cpus_per_task``, ``timeout_min`` in minutes,
    ``mem_gb`` in GiB, ``gpus_per_node``, ``name``) and ``slurm_*`` keys (``partition``,
    ``account``, ``qos``, ``constraint``, ``exclude``, ``signal_delay_s`` in seconds,
    ``additional_parameters``). Unset optional fields are left out (SLURM's defaults apply);
    ``gpus_per_node: 0`` requests no GPUs. ``launch.max_restarts`` is not here: submitit takes it in
    the ``AutoExecutor`` constructor (see :func:`make_slurm_executor`).

    Raises:
        ConfigError: a string field (or ``job_name``) contains characters outside its safe pattern.
    """
    ln = cfg.launch
    check_sbatch_safe("job_name", "run.name" if job_name == cfg.run.name else "job_name", job_name)
    params: dict[str, Any] = {
        "name": job_name,
        "nodes": ln.nodes,
        "tasks_per_node": ln.resolved_tasks_per_node(cfg.world_size),
        "timeout_min": ln.time_min,
        "slurm_signal_delay_s": ln.signal_delay_s,
        # Preempted or failed-node jobs come back (and resume from their checkpoint) even on
        # clusters whose JobRequeue default is 0; submitit's own requeue needs it too.
        "slurm_additional_parameters": {"requeue": True},
    }
    if ln.cpus_per_task is not None:
        params["cpus_per_task"] = ln.cpus_per_task
    if ln.gpus_per_node:
        params["gpus_per_node"] = ln.gpus_per_node
    if ln.mem_gb is not None:
        params["mem_gb"] = ln.mem_gb
    for key in ("partition", "account", "qos", "constraint", "exclude"):
        value = getattr(ln, key)
        if value is not None:
            check_sbatch_safe(key, f"launch.{key}", value)
            params[f"slurm_{key}"] = value
    setup = site_setup_lines(cfg)
    if setup:
        params["slurm_setup"] = setup
    srun_args = [*task_launch(cfg).srun_args, *ln.srun_args]
    if srun_args:
        params["slurm_srun_args"] = srun_args
    if ln.elastic is not None and ln.elastic.min_nodes < ln.nodes:
        # SLURM starts the job on as many nodes of the range as it can give without delay.
        params["slurm_additional_parameters"]["nodes"] = f"{ln.elastic.min_nodes}-{ln.nodes}"
    for arg in ln.sbatch_args:
        key, _, value = arg[2:].partition("=")
        params["slurm_additional_parameters"][key.replace("-", "_")] = value if "=" in arg else True
    return params


def site_setup_lines(cfg: Config) -> list[str]:
    """The shell lines run before the ranks start: ``export NAME=VALUE`` for ``launch.env`` (each
    value quoted: the shell takes it literally), then ``launch.setup`` as written."""
    return [f"export {k}={shlex.quote(v)}" for k, v in cfg.launch.env.items()] + list(cfg.launch.setup)


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def profile_gpus_per_node(profile: str) -> int | None:
    """GPUs per node promised by a cluster profile (``slurm/profiles/<name>.yaml`` or a path).

    Reads the key ``gpus_per_node`` at the top level or one mapping down (e.g. ``node:``);
    returns ``None`` when the profile does not say.

    Raises:
        ConfigError: the profile file is missing or not YAML, or its ``gpus_per_node`` is not a
            positive integer.
    """
    direct = Path(profile).expanduser()
    candidates = [direct] if (direct.suffix in (".yaml", ".yml") or "/" in profile) else []
    for base in (Path.cwd() / "slurm" / "profiles", _repo_root() / "slurm" / "profiles"):
        candidates += [base / f"{profile}.yaml", base / f"{profile}.yml"]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise field_error("launch.profile", profile, "no such cluster profile",
                   f"name a file in slurm/profiles/ (looked for {', '.join(str(c) for c in candidates)})")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise field_error("launch.profile", profile, f"{path} is not valid YAML ({e})", "fix the profile file") from e
    if not isinstance(data, dict):
        return None
    found = data.get("gpus_per_node")
    if found is None:
        nested = [v["gpus_per_node"] for v in data.values() if isinstance(v, dict) and "gpus_per_node" in v]
        found = nested[0] if nested else None
    if found is None:
        return None
    if not isinstance(found, int) or isinstance(found, bool) or found <= 0:
        raise field_error("launch.profile", profile, f"{path} gives gpus_per_node = {found!r}",
                   "write a positive integer in the profile")
    return found


def check_launch(cfg: Config, *, job_name: str) -> None:
    """Checks that need no cluster: safe strings, and GPUs per node within the cluster profile.

    Raises:
        ConfigError: as :func:`slurm_executor_params`; or ``launch.gpus_per_node`` exceeds the
            profile's ``gpus_per_node``.
    """
    slurm_executor_params(cfg, job_name=job_name)
    ln = cfg.launch
    if ln.profile is not None:
        limit = profile_gpus_per_node(ln.profile)
        if limit is not None and ln.gpus_per_node > limit:
            raise field_error("launch.gpus_per_node", ln.gpus_per_node,
                       f"cluster profile {ln.profile!r} has {limit} GPUs per node",
                       f"use launch.gpus_per_node <= {limit} (and fewer tasks per node), or another profile")


# ---------------------------------------------------------------------------------------------
# 2. The live cluster: what sinfo/scontrol say
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeInfo:
    """One node as ``scontrol show node`` reports it. ``gpus``: GPU count from its Gres."""

    name: str
    cpus: int
    gpus: int
    partitions: tuple[str, ...]
    state: str


@dataclass(frozen=True)
class ClusterInfo:
    """Partitions and nodes of the cluster this machine submits to."""

    partitions: tuple[str, ...]
    default_partition: str | None
    nodes: tuple[NodeInfo, ...]

    def nodes_in(self, partitions: list[str]) -> list[NodeInfo]:
        return [n for n in self.nodes if set(n.partitions) & set(partitions)]


def parse_gres_gpus(gres: str) -> int:
    """GPU count of a Gres string: ``gpu:4`` → 4, ``gpu:a100:8(S:0-1),mps:100`` → 8, ``(null)`` → 0."""
    total = 0
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = item.strip().split(":")
        if parts[0] != "gpu":
            continue
        total += int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    return total


def _run(args: list[str], timeout_s: float) -> str:
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise SlurmUnavailableError(f"`{' '.join(args)}` did not answer within {timeout_s:g} s") from e
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise SlurmUnavailableError(f"`{' '.join(args)}` failed ({out.returncode}): {last}")
    return out.stdout


def _fields(line: str) -> dict[str, str]:
    # `scontrol -o` prints Key=Value words; values we read hold no spaces.
    return dict(w.split("=", 1) for w in line.split() if "=" in w)


def query_cluster(*, timeout_s: float = 10.0) -> ClusterInfo:
    """Ask slurmctld for its partitions and nodes (``scontrol show partition/node -o``).

    Raises:
        SlurmUnavailableError: ``scontrol`` is not installed, or it fails or hangs.
    """
    if shutil.which("scontrol") is None:
        raise SlurmUnavailableError("`scontrol` is not installed: this machine is not a SLURM submit host")
    partitions, default = [], None
    for line in _run(["scontrol", "show", "partition", "-o"], timeout_s).splitlines():
        f = _fields(line)
        if "PartitionName" in f:
            partitions.append(f["PartitionName"])
            if f.get("Default") == "YES":
                default = f["PartitionName"]
    nodes = []
    for line in _run(["scontrol", "show", "node", "-o"], timeout_s).splitlines():
        f = _fields(line)
        if "NodeName" not in f:
            continue
        parts = f.get("Partitions", "")
        nodes.append(NodeInfo(
            name=f["NodeName"],
            cpus=int(f.get("CPUTot", "0") or 0),
            gpus=parse_gres_gpus(f.get("Gres", "(null)")),
            partitions=tuple(p for p in parts.split(",") if p),
            state=f.get("State", "UNKNOWN"),
        ))
    return ClusterInfo(tuple(partitions), default, tuple(nodes))


def check_against_cluster(cfg: Config, cluster: ClusterInfo) -> None:
    """The partition exists and enough of its nodes offer the GPUs and CPUs asked for.

    Raises:
        ConfigError: unknown partition (or no default one), ``launch.gpus_per_node`` above what
            the partition's nodes have, too few such nodes for ``launch.nodes``, or more CPUs per
            node (tasks_per_node × cpus_per_task) than a node has.
    """
    ln = cfg.launch
    known = ", ".join(cluster.partitions) or "none"
    if ln.partition is None:
        if cluster.default_partition is None:
            raise field_error("launch.partition", None, "this cluster has no default partition",
                       f"set launch.partition to one of {known}")
        wanted = [cluster.default_partition]
    else:
        wanted = ln.partition.split(",")
        for p in wanted:
            if p not in cluster.partitions:
                raise field_error("launch.partition", ln.partition, f"no partition {p!r} on this cluster (it has {known})",
                           f"set launch.partition to one of {known}, or null for the default "
                           f"({cluster.default_partition or 'none'})")
    where = f"partition {','.join(wanted)}"
    nodes = cluster.nodes_in(wanted)
    if ln.nodes > len(nodes):
        raise field_error("launch.nodes", ln.nodes, f"{where} has {len(nodes)} nodes",
                   f"use launch.nodes <= {len(nodes)} or another partition")
    if ln.gpus_per_node:
        most = max((n.gpus for n in nodes), default=0)
        fit = [n for n in nodes if n.gpus >= ln.gpus_per_node]
        if not fit:
            raise field_error("launch.gpus_per_node", ln.gpus_per_node,
                       f"the nodes of {where} have at most {most} GPUs each",
                       f"use launch.gpus_per_node <= {most} (with as many tasks per node), or another partition")
        if len(fit) < ln.nodes:
            raise field_error("launch.nodes", ln.nodes,
                       f"only {len(fit)} nodes of {where} have {ln.gpus_per_node} GPUs",
                       f"use launch.nodes <= {len(fit)}, fewer GPUs per node, or another partition")
    cpus = ln.resolved_tasks_per_node(cfg.world_size) * (ln.cpus_per_task or 1)  # SLURM's default: 1
    most_cpus = max((n.cpus for n in nodes), default=0)
    if cpus > most_cpus:
        raise field_error("launch.cpus_per_task", ln.cpus_per_task,
                   f"tasks_per_node × cpus_per_task = {cpus} CPUs, but the nodes of {where} have at most {most_cpus}",
                   f"use launch.cpus_per_task <= {max(1, most_cpus // ln.resolved_tasks_per_node(cfg.world_size))}")


def validate_slurm(cfg: Config, *, timeout_s: float = 10.0, live: bool = True) -> ClusterInfo | None:
    """Every check before submission (``moetrain.launch.preflight`` runs it): :func:`check_launch`
    with ``run.name`` as the job name, then, when ``live``, :func:`check_against_cluster` on what
    SLURM answers. Returns the cluster queried (``None`` when not ``live``).

    Raises:
        ConfigError: see :func:`check_launch` and :func:`check_against_cluster`; with ``live``,
            also when SLURM does not answer on this machine (naming ``launch.cluster``).
    """
    check_launch(cfg, job_name=cfg.run.name)
    if not live:
        return None
    try:
        cluster = query_cluster(timeout_s=timeout_s)
    except SlurmUnavailableError as e:
        raise field_error("launch.cluster", cfg.launch.cluster, f"SLURM does not answer on this machine ({e})",
                          "submit from a SLURM login node (or bring up slurm/dev-cluster), or run here with "
                          "--set launch.cluster=local") from None
    check_against_cluster(cfg, cluster)
    check_test_only(cfg, render_batch_script(cfg, cfg.run_dir / "logs"))
    return cluster


def check_test_only(cfg: Config, script: str, *, timeout_s: float = 30.0) -> None:
    """Ask SLURM whether it would take ``script`` (``sbatch --test-only``: checked and scheduled
    in thought, nothing submitted), so that a pass-through option it refuses
    (``launch.sbatch_args``) fails here, before the run exists.

    Raises:
        ConfigError: sbatch refuses the script (naming ``launch.sbatch_args`` when there are any,
            else ``launch``), with sbatch's message.
    """
    if shutil.which("sbatch") is None:
        return
    try:
        out = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return  # a slow controller is not the config's fault; the submission will say more
    if out.returncode == 0:
        return
    msg = " ".join(line.removeprefix("sbatch: error: ").strip() for line in out.stderr.strip().splitlines()
                   if line.strip()) or f"exit status {out.returncode}"
    ln = cfg.launch
    if ln.sbatch_args:
        raise field_error("launch.sbatch_args", list(ln.sbatch_args), f"`sbatch --test-only` refuses the job: {msg}",
                          "fix or drop the option SLURM names (python -m moetrain.submit --dry-run shows the script)")
    raise field_error("launch", f"{ln.nodes} node(s) × {ln.resolved_tasks_per_node(cfg.world_size)} tasks",
                      f"`sbatch --test-only` refuses the job: {msg}",
                      "change the request SLURM names (python -m moetrain.submit --dry-run shows the script)")


# ---------------------------------------------------------------------------------------------
# 3. Executor and dry-run script
# ---------------------------------------------------------------------------------------------


def make_slurm_executor(cfg: Config, folder: str | Path, *, job_name: str | None = None,
                        cluster: ClusterInfo | None = None) -> submitit.AutoExecutor:
    """A submitit executor for ``cfg``, after every check passed. ``folder``: submitit's job
    folder (logs, pickles; may hold ``%j``). ``job_name`` defaults to ``run.name``; ``cluster``
    defaults to :func:`query_cluster` (pass one to reuse an earlier query).

    Raises:
        ConfigError: see :func:`check_launch` and :func:`check_against_cluster`.
        SlurmUnavailableError: SLURM does not answer (use :func:`render_batch_script` offline).
    """
    name = cfg.run.name if job_name is None else job_name
    check_launch(cfg, job_name=name)
    check_against_cluster(cfg, query_cluster() if cluster is None else cluster)
    # max_num_timeout only exists as a constructor argument: update_parameters refuses it.
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=cfg.launch.max_restarts,
                                     slurm_python=task_launch(cfg).python_str)
    executor.update_parameters(**slurm_executor_params(cfg, job_name=name))
    return executor


class _RenderOnlySlurmExecutor(SlurmExecutor):
    """submitit's SlurmExecutor minus its "is srun installed?" check: renders, never submits."""

    @classmethod
    def affinity(cls) -> int:
        return 1


def render_batch_script(cfg: Config, folder: str | Path, *, job_name: str | None = None) -> str:
    """The sbatch script :func:`make_slurm_executor`'s executor submits for one job, for
    ``--dry-run``: built by submitit's own SlurmExecutor, so it is the same text. Needs no
    cluster; checks only what :func:`check_launch` checks.

    Raises:
        ConfigError: see :func:`check_launch`.
    """
    name = cfg.run.name if job_name is None else job_name
    check_launch(cfg, job_name=name)
    params = slurm_executor_params(cfg, job_name=name)
    executor = _RenderOnlySlurmExecutor(folder, max_num_timeout=cfg.launch.max_restarts,
                                        python=task_launch(cfg).python_str)
    from moetrain.internals import render_submission  # imports torch: not at the CLI's start

    return render_submission(executor, params)
