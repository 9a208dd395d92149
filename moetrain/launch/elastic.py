"""Elastic training on SLURM (``launch.elastic``): shrink onto the nodes that are left, grow back.

* The job asks for ``min_nodes``-``launch.nodes`` nodes (``#SBATCH --nodes=1-2``); SLURM starts
  it on as many as it can give without delay.
* An attempt with fewer ranks than the config's layout re-plans it before the mesh is built
  (:func:`start_attempt`, :func:`moetrain.planner.elastic.replan`); every rank computes the same
  plan from the same inputs, so they agree without talking. Rank 0 records the ``replanned``
  event, whose message the console shows (``re-planned: 2 nodes → 1 node: ...``).
* After a node failure the surviving rank that requeues the job excludes the failed node
  (:func:`failed_nodes`: a node none of whose ranks left a failure record, i.e. all of them
  died at once), since SLURM may not yet have marked it down; the node is remembered in
  ``<run_dir>/failed_nodes.txt``.
* While shrunk, rank 0 asks SLURM every ``grow_check_s`` seconds whether the missing nodes could
  start now (:class:`GrowWatcher`, ``sbatch --test-only``); when they could, the run stops at the
  next step (checkpoint saved) and the job is requeued with the failed nodes' exclusion lifted.
* ``too_few``: an attempt on which no layout fits ``stop``s, or ``wait``s (the job requeued with
  its minimum raised to a node count that fits).

What never changes across a re-plan: the model, the optimizer and its state, the global batch,
the learning-rate schedule and the data order (docs/operations.md, "Elastic training").
"""

from __future__ import annotations

import logging
import re
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Callable

from moetrain.config import Config
from moetrain.planner.elastic import ElasticError, Replan, replan
from moetrain.topology.cluster import expand_nodelist
from moetrain.train.records import Diagnosis, append_event, read_heartbeats

__all__ = ["start_attempt", "failed_nodes", "record_failed_nodes", "read_failed_nodes", "GrowWatcher",
           "missing_nodes_can_start", "ElasticError"]

log = logging.getLogger(__name__)


def start_attempt(cfg: Config, world: int, local_world: int, rank: int) -> tuple[Config, Replan | None]:
    """The config this attempt trains with: ``cfg`` itself when the launcher started the ranks
    its layout needs, else (``launch.elastic`` set) the layout re-planned for ``world`` ranks on
    ``world ÷ local_world`` nodes. Rank 0 records the re-plan (event ``replanned``) and logs it.

    Raises:
        ElasticError: no layout fits the ranks this attempt has (or too few nodes).
    """
    if world == cfg.world_size or cfg.launch.elastic is None:
        return cfg, None
    nodes = max(1, world // max(1, local_world))
    new, plan = replan(cfg, nodes, world // nodes)
    if plan is not None and rank == 0:
        log.warning("%s", plan.message())
        append_event(cfg.run_dir, None, "replanned", message=plan.message(), **plan.to_dict())
    return new, plan


def failed_nodes(run_dir: Path, why: Diagnosis, attempt: int | None = None) -> list[str]:
    """Nodes whose every rank of the attempt died without a record (``why.dead``, hosts from the
    heartbeats): a node that failed as a whole, rather than one process on a healthy node.
    ``attempt``: the heartbeats' attempt (default the newest)."""
    beats = read_heartbeats(run_dir)
    if not beats:
        return []
    attempt = max(b.get("attempt", -1) for b in beats) if attempt is None else attempt
    by_host: dict[str, set[int]] = {}
    for b in beats:
        if b.get("attempt") == attempt and b.get("host"):
            by_host.setdefault(b["host"], set()).add(int(b["rank"]))
    dead = set(why.dead)
    return sorted(h for h, ranks in by_host.items() if ranks and ranks <= dead)


def read_failed_nodes(run_dir: Path) -> list[str]:
    path = Path(run_dir) / "failed_nodes.txt"
    return sorted({ln.strip() for ln in path.read_text().splitlines() if ln.strip()}) if path.is_file() else []


def record_failed_nodes(run_dir: Path, nodes: list[str]) -> None:
    """Remember ``nodes`` as failed (their exclusion is lifted when the run grows back)."""
    if nodes:
        with open(Path(run_dir) / "failed_nodes.txt", "a") as f:
            f.write("".join(n + "\n" for n in nodes))


def forget_failed_nodes(run_dir: Path) -> list[str]:
    """Drop the failed-node record (the run grows back onto them); returns the nodes it held."""
    nodes = read_failed_nodes(run_dir)
    (Path(run_dir) / "failed_nodes.txt").unlink(missing_ok=True)
    return nodes


_START = re.compile(r"to start at (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)")


def missing_nodes_can_start(cfg: Config, have: list[str], exclude: list[str], *, timeout_s: float = 30.0,
                            slack_s: float = 30.0) -> tuple[bool, str]:
    """Whether SLURM could start the nodes this shrunk job lacks now: ``sbatch --test-only`` for
    ``launch.nodes - len(have)`` nodes of the job's partition, away from the job's own nodes
    ``have`` and the excluded ones. True when it would start within ``slack_s`` seconds. Returns
    the answer and SLURM's line."""
    missing = cfg.launch.nodes - len(have)
    if missing <= 0:
        return False, "no node missing"
    ln = cfg.launch
    cmd = ["sbatch", "--test-only", f"--nodes={missing}",
           f"--ntasks-per-node={ln.resolved_tasks_per_node(cfg.world_size)}", "--time=1", "--wrap=true"]
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(ln, key):
            cmd.append(f"--{key}={getattr(ln, key)}")
    if ln.gpus_per_node:
        cmd.append(f"--gpus-per-node={ln.gpus_per_node}")
    away = sorted(set(have) | set(exclude))
    if away:
        cmd.append(f"--exclude={','.join(away)}")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (subprocess.SubprocessError, OSError) as e:
        return False, str(e)
    text = (out.stderr + out.stdout).strip()
    m = _START.search(text)
    if out.returncode != 0 or m is None:
        return False, text.splitlines()[-1] if text else f"exit status {out.returncode}"
    start = datetime.fromisoformat(m.group(1)).timestamp()
    return start <= time.time() + slack_s, text.splitlines()[-1]


class GrowWatcher:
    """Rank 0's thread while the run is shrunk: every ``launch.elastic.grow_check_s`` seconds it
    asks :func:`missing_nodes_can_start`; the first yes calls ``on_grow(line)`` (which sets the
    stop flag: the loop checkpoints at the next step) and ends the thread."""

    def __init__(self, cfg: Config, have: list[str], exclude: Callable[[], list[str]],
                 on_grow: Callable[[str], None], check: Callable[..., tuple[bool, str]] = missing_nodes_can_start):
        self.cfg, self.have, self.exclude, self.on_grow, self.check = cfg, have, exclude, on_grow, check
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moetrain-grow", daemon=True)

    def start(self) -> "GrowWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        period = self.cfg.launch.elastic.grow_check_s
        while not self._stop.wait(period):
            try:
                ok, line = self.check(self.cfg, self.have, self.exclude())
            except Exception:  # noqa: BLE001 - a failed check must not end the run
                log.exception("grow check failed")
                continue
            if ok:
                log.warning("the missing node(s) can start now (%s): stopping at the next step to grow back", line)
                self.on_grow(line)
                return


def job_nodes(environ: dict) -> list[str]:
    """The nodes of this SLURM job (``SLURM_JOB_NODELIST``), in order; empty outside SLURM."""
    text = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    return expand_nodelist(text) if text else []
