"""The environment of every attempt of a run, recorded in its directory so that a regression
can be traced to what changed (a package upgrade, a new driver, an uncommitted edit, an NCCL
variable) and the attempt reproduced.

Files, under ``<run_dir>/environment/`` (written atomically; see :mod:`moetrain.train.records`):

* ``attempt<N>.json`` — rank 0, once per attempt: :func:`collect_environment` (the moetrain
  source tree's git commit and whether it is dirty, Python, package versions, CUDA / NCCL /
  cuDNN, GPU models and driver, host, SLURM job and nodes) plus the attempt number and time.
* ``attempt<N>.diff`` — rank 0, when the source tree is dirty: ``git diff HEAD`` (tracked files
  only; untracked ones are listed in the JSON record), cut at :data:`DIFF_CAP_BYTES` with a note.
* ``attempt<N>/rank00000.json`` — every rank: :func:`rank_environment` (host, pid, local rank,
  the communication / threading / launch variables it saw, torch's thread count).

Rank 0 compares each attempt's versions (:func:`versions`) with the most recent earlier
attempt's record; a difference is logged as one WARNING and appended to ``events.jsonl`` as
``environment_changed`` with ``changed={name: [before, after]}``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import moetrain
from moetrain.topology.mapper import slurm_nodelist
from moetrain.train.records import Fence, append_event, atomic_write_json, node_name, read_json
from moetrain.utils import atomic_write

log = logging.getLogger(__name__)

__all__ = ["collect_environment", "rank_environment", "record_environment", "read_environment",
           "read_rank_environments", "summarize_environment", "versions", "environment_changes",
           "describe_changes"]

# Packages whose versions are recorded when installed (read from their metadata, never imported).
PACKAGES = ("torch", "numpy", "submitit", "transformers", "tokenizers", "safetensors", "torchao")

# A rank records the variables whose names start with one of these (communication libraries,
# CUDA, threading, rendezvous) ...
VARIABLE_PREFIXES = ("NCCL_", "CUDA_", "UCX_", "NVTE_", "TORCH_", "PYTORCH_", "OMP_", "MASTER_", "GLOO_", "FI_")
# ... these launch variables ...
VARIABLE_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_JOB_ID", "SLURM_PROCID",
                  "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_ID", "SLURM_JOB_NODELIST", "SLURM_RESTART_COUNT")
# ... and the names the caller adds (``launch.env``). Values of names that look like secrets are
# not written: a run directory is often shared more widely than the job's environment.
SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "API_KEY", "CREDENTIAL", "AUTH")
REDACTED = "<redacted>"
# Variables that name the rank itself: they differ between ranks by design, so rank-to-rank
# comparisons (``python -m moetrain.monitor RUN --environment``) leave them out.
RANK_IDENTITY = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")

GIT_TIMEOUT_S = 10.0
NVIDIA_SMI_TIMEOUT_S = 10.0
DIFF_CAP_BYTES = 4 * 2**20


# -- collecting -------------------------------------------------------------------------------

def _git(source_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """``git -C source_dir args`` without taking optional locks (``git status`` would otherwise
    rewrite the index, racing a user's own git command in the same tree).

    Raises:
        OSError: git is not installed.
        subprocess.TimeoutExpired: it ran longer than :data:`GIT_TIMEOUT_S`.
    """
    return subprocess.run(["git", "--no-optional-locks", "-C", str(source_dir), *args], capture_output=True,
                          text=True, timeout=GIT_TIMEOUT_S)


def _git_diff(source_dir: Path, cap: int) -> tuple[str, int, bool]:
    """``git diff HEAD`` read up to ``cap`` bytes: (text, bytes kept, whether it was cut). The
    rest is not read, so a diff of large tracked files costs no memory.

    Raises:
        OSError: git is not installed.
        subprocess.TimeoutExpired: it ran longer than :data:`GIT_TIMEOUT_S`.
    """
    proc = subprocess.Popen(["git", "--no-optional-locks", "-C", str(source_dir), "diff", "HEAD"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    # The read blocks until git closes its output: a timer ends a git that hangs (a stuck
    # network file system), which closes it.
    timer = threading.Timer(GIT_TIMEOUT_S, proc.kill)
    timer.start()
    try:
        data = proc.stdout.read(cap + 1)
    finally:
        timed_out = not timer.is_alive()
        timer.cancel()
        proc.kill()  # past the cap: the rest is not wanted
        proc.stdout.close()
        proc.wait()
    if timed_out:
        raise subprocess.TimeoutExpired(proc.args, GIT_TIMEOUT_S)
    cut = len(data) > cap
    data = data[:cap]
    return data.decode("utf-8", errors="replace"), len(data), cut


def git_state(source_dir: Path) -> dict:
    """The git state of the tree holding the ``moetrain`` package in ``source_dir``:
    ``{"commit", "dirty", "status", "diff", "diff_bytes", "diff_cut", "diff_sha256", "reason"}``.

    ``commit`` is None (and ``reason`` says why) when git is missing, times out, or the package
    is not tracked by a git work tree there (an installed copy, or a copy inside an unrelated
    repository). ``dirty``: ``git status --porcelain`` lists anything, untracked files included
    (their names are in ``status``, at most 100 lines). ``diff``: ``git diff HEAD`` when dirty,
    at most :data:`DIFF_CAP_BYTES` (``diff_cut`` says whether it was cut; ``diff_sha256`` is of
    the kept text, so two attempts' diffs can be compared without reading them).
    """
    out: dict = {"source_dir": str(source_dir), "commit": None, "dirty": None, "status": [], "diff": "",
                 "diff_bytes": 0, "diff_cut": False, "diff_sha256": None, "reason": None}
    if shutil.which("git") is None:
        out["reason"] = "git is not installed"
        return out
    try:
        head = _git(source_dir, "rev-parse", "HEAD")
        if head.returncode != 0:
            out["reason"] = "not a git work tree: " + (head.stderr.strip().splitlines() or ["git rev-parse failed"])[-1]
            return out
        # A package installed inside some other repository (a virtualenv in a project) would
        # otherwise take that repository's commit.
        tracked = _git(source_dir, "ls-files", "--error-unmatch", "--", "moetrain")
        if tracked.returncode != 0:
            out["reason"] = f"the moetrain package in {source_dir} is not tracked by the git repository there"
            return out
        out["commit"] = head.stdout.strip()
        status = _git(source_dir, "status", "--porcelain")
        if status.returncode != 0:
            out["reason"] = "git status failed: " + (status.stderr.strip().splitlines() or [""])[-1]
            return out
        lines = status.stdout.splitlines()
        out["dirty"] = bool(lines)
        out["status"] = lines[:100] + ([f"... {len(lines) - 100} more"] if len(lines) > 100 else [])
        if out["dirty"]:
            diff, size, cut = _git_diff(source_dir, DIFF_CAP_BYTES)
            out.update(diff=diff, diff_bytes=size, diff_cut=cut,
                       diff_sha256=hashlib.sha256(diff.encode()).hexdigest() if diff else None)
    except subprocess.TimeoutExpired as e:
        out["reason"] = f"git timed out after {e.timeout:.0f} s"
    except OSError as e:
        out["reason"] = f"git could not run: {e}"
    return out


def _package_versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _driver_version() -> str | None:
    """The NVIDIA driver version (``nvidia-smi``; the first GPU's), None without nvidia-smi or
    when it fails or times out."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (subprocess.SubprocessError, OSError):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def collect_environment(source_dir: Path | None = None) -> dict:
    """Host-wide facts of this process's software and hardware (cheap: a few git calls and one
    ``nvidia-smi``, each with a time-out; no collective).

    Args:
        source_dir: the directory holding the ``moetrain`` package whose git state is recorded;
            default the directory above the imported package.

    Returns:
        ``{"git": git_state(...), "moetrain", "python", "python_executable", "packages":
        {name: version}, "cuda", "nccl", "cudnn", "gpus": [name per device], "driver", "host",
        "slurm_job_id", "slurm_nodes"}``; a fact that does not apply (no CUDA, no SLURM) is None.
    """
    import torch

    source_dir = Path(source_dir) if source_dir is not None else Path(moetrain.__file__).resolve().parent.parent
    cuda = torch.cuda.is_available()
    nccl = None
    if cuda:
        import torch.cuda.nccl

        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError):  # a build without NCCL (Windows, some ROCm)
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "git": git_state(source_dir),
        "moetrain": moetrain.__version__,
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "packages": _package_versions(),
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "cudnn": str(cudnn) if cudnn is not None else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "driver": _driver_version(),
        "host": node_name(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_nodes": slurm_nodelist(),  # the step's nodes where it uses fewer than its job
    }


def _is_secret(name: str) -> bool:
    return any(marker in name.upper() for marker in SECRET_MARKERS)


def rank_environment(rank: int, extra_names: Iterable[str] = ()) -> dict:
    """What this rank's process saw: ``{"rank", "host", "pid", "local_rank", "torch_threads",
    "gpu", "variables": {name: value}}``.

    ``variables``: those set whose names start with :data:`VARIABLE_PREFIXES`, the launch
    variables :data:`VARIABLE_NAMES`, and ``extra_names`` (the keys of ``launch.env``); values of
    names that look like secrets are :data:`REDACTED`. ``local_rank``: ``LOCAL_RANK``, else
    ``SLURM_LOCALID``, else None. ``gpu``: the name of this process's current CUDA device (None
    without CUDA).
    """
    import torch

    wanted = set(VARIABLE_NAMES) | set(extra_names)
    variables = {k: (REDACTED if _is_secret(k) else v) for k, v in sorted(os.environ.items())
                 if k in wanted or k.startswith(VARIABLE_PREFIXES)}
    local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID"))
    gpu = torch.cuda.get_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else None
    return {"rank": rank, "host": node_name(), "pid": os.getpid(),
            "local_rank": int(local) if local is not None and local.isdigit() else None,
            "torch_threads": torch.get_num_threads(), "gpu": gpu, "variables": variables}


# -- comparing --------------------------------------------------------------------------------

def versions(rec: dict) -> dict[str, str | None]:
    """The facts of an attempt record whose change can explain a regression, flat, each as a
    string or None: ``commit``, ``dirty``, ``diff`` (sha256 of the uncommitted diff, 12 digits),
    ``moetrain``, ``python``, every recorded package, ``cuda``, ``nccl``, ``cudnn``, ``gpu`` (the
    models of rank 0's node, counted), ``driver``."""
    git = rec.get("git") or {}
    dirty = git.get("dirty")
    flat: dict[str, str | None] = {
        "commit": git.get("commit"),
        "dirty": None if dirty is None else str(dirty).lower(),
        "diff": (git.get("diff_sha256") or "")[:12] or None,
        "moetrain": rec.get("moetrain"),
        "python": rec.get("python"),
    }
    flat.update(rec.get("packages") or {})
    flat.update({"cuda": rec.get("cuda"), "nccl": rec.get("nccl"), "cudnn": rec.get("cudnn"),
                 "gpu": _gpu_models(rec.get("gpus") or []) or None, "driver": rec.get("driver")})
    return flat


def environment_changes(before: dict, after: dict) -> dict[str, list]:
    """``{name: [before, after]}`` for each fact of :func:`versions` that differs between two
    attempt records (a package that appeared or went away is None on the side it is missing)."""
    a, b = versions(before), versions(after)
    return {k: [a.get(k), b.get(k)] for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)}


def _show(name: str, value: str | None) -> str:
    if value is None:
        return "-"
    return value[:12] if name == "commit" else value


def describe_changes(changed: dict[str, list]) -> str:
    """``torch 2.12.0 → 2.13.0, commit abc123def456 → 0123456789ab`` (missing: ``-``)."""
    return ", ".join(f"{k} {_show(k, a)} → {_show(k, b)}" for k, (a, b) in changed.items())


def _gpu_models(gpus: list[str]) -> str:
    return ", ".join(f"{n} × {name}" for name, n in Counter(gpus).items())


# -- recording and reading --------------------------------------------------------------------

def environment_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "environment"


def _attempts(run_dir: Path) -> list[int]:
    """The attempts with a rank-0 record, ascending."""
    d = environment_dir(run_dir)
    if not d.is_dir():
        return []
    found = (p.name[len("attempt"):-len(".json")] for p in d.glob("attempt*.json"))
    return sorted(int(n) for n in found if n.isdigit())


def record_environment(run_dir: Path, attempt: int, rank: int, *, extra_names: Iterable[str] = (),
                       fence: Fence | None = None, source_dir: Path | None = None) -> dict | None:
    """Record this rank's environment for ``attempt`` (files in the module docstring); rank 0
    also records the host-wide one and compares it with the most recent earlier attempt's,
    warning and appending an ``environment_changed`` event when they differ.

    Args:
        run_dir: the run directory.
        attempt: the attempt's sequence number (the fence's ``seq``).
        rank: this process's global rank.
        extra_names: more variable names to record (the keys of ``launch.env``).
        fence: the attempt's fence, for the event (:func:`~moetrain.train.records.append_event`).
        source_dir: passed to :func:`collect_environment`.

    Returns:
        Rank 0's attempt record (without the diff text), None on other ranks or when it could
        not be written. An OSError while writing is logged as a warning, never raised: a full
        or read-only disk must not end the run here.

    Raises:
        StaleAttemptError: rank 0 found a newer attempt owning the run directory (from the fence).
    """
    d = environment_dir(run_dir)
    rank_rec = {"attempt": attempt, "time": time.time(), **rank_environment(rank, extra_names)}
    try:
        atomic_write_json(d / f"attempt{attempt}" / f"rank{rank:05d}.json", rank_rec, fsync=False)
    except OSError as e:
        log.warning("could not record rank %d's environment in %s: %s", rank, d, e)
    if rank != 0:
        return None

    rec = {"attempt": attempt, "time": time.time(), **collect_environment(source_dir)}
    git = rec["git"]
    diff = git.pop("diff")
    git["diff_file"] = None
    try:
        if diff:
            git["diff_file"] = f"environment/attempt{attempt}.diff"
            note = (f"\n# moetrain: diff cut at {DIFF_CAP_BYTES // 2**20} MiB; the tree's full diff is longer\n"
                    if git["diff_cut"] else "")
            d.mkdir(parents=True, exist_ok=True)
            atomic_write(d / f"attempt{attempt}.diff", diff + note)
        atomic_write_json(d / f"attempt{attempt}.json", rec)
    except OSError as e:
        log.warning("could not record the environment of attempt %d in %s: %s", attempt, d, e)
        return None

    earlier = [a for a in _attempts(run_dir) if a < attempt]
    previous = read_environment(run_dir, earlier[-1]) if earlier else None
    if previous is not None:
        changed = environment_changes(previous, rec)
        if changed:
            log.warning("environment changed since attempt %d: %s", earlier[-1], describe_changes(changed))
            try:
                append_event(run_dir, fence, "environment_changed", attempt=attempt, previous_attempt=earlier[-1],
                             changed=changed)
            except OSError as e:
                log.warning("could not append the environment_changed event to %s: %s", run_dir, e)
    return rec


def read_environment(run_dir: Path, attempt: int | None = None) -> dict | None:
    """Rank 0's environment record of ``attempt`` (None: the latest recorded); None when there
    is none or it cannot be read."""
    if attempt is None:
        found = _attempts(run_dir)
        if not found:
            return None
        attempt = found[-1]
    rec = read_json(environment_dir(run_dir) / f"attempt{attempt}.json")
    return rec if isinstance(rec, dict) else None


def read_rank_environments(run_dir: Path, attempt: int) -> list[dict]:
    """Every rank's record of ``attempt`` (:func:`rank_environment` plus attempt and time), by
    rank; [] when none was written."""
    d = environment_dir(run_dir) / f"attempt{attempt}"
    recs = [read_json(p) for p in sorted(d.glob("rank*.json"))] if d.is_dir() else []
    return [r for r in recs if isinstance(r, dict)]


def summarize_environment(rec: dict) -> list[str]:
    """A few lines for people: the code (version, commit, dirty), Python and torch with CUDA and
    NCCL, the nodes and GPUs. ``rec``: an attempt record (:func:`read_environment`)."""
    git = rec.get("git") or {}
    if git.get("commit") is None:
        code = f"commit unknown ({git.get('reason') or 'not recorded'})"
    else:
        if git.get("dirty") is None:
            state = f"dirty: unknown, {git.get('reason')}"
        elif not git.get("dirty"):
            state = "clean"
        elif git.get("diff_file"):
            state = f"dirty: diff in {git['diff_file']}" + (", cut" if git.get("diff_cut") else "")
        elif git.get("diff"):
            state = "dirty: diff not written"  # a record from collect_environment, not yet recorded
        else:
            untracked = sum(line.startswith("??") for line in git.get("status") or [])
            state = f"dirty: {untracked} untracked path(s) only, listed in the record"
        code = f"commit {git['commit'][:12]} ({state})"
    packages = rec.get("packages") or {}
    cudnn = f", cuDNN {rec['cudnn']}" if rec.get("cudnn") else ""
    gpus = rec.get("gpus") or []
    nodes = f"nodes: {rec['slurm_nodes']}" if rec.get("slurm_nodes") else f"host: {rec.get('host')}"
    if rec.get("slurm_job_id"):
        nodes += f" (job {rec['slurm_job_id']})"
    hw = (f"GPUs on {rec.get('host')}: {_gpu_models(gpus)}, driver {rec.get('driver') or '-'}" if gpus
          else "GPUs: none")
    return [f"code: moetrain {rec.get('moetrain')}, {code}",
            f"python {rec.get('python')}, torch {packages.get('torch', '-')} "
            f"(CUDA {rec.get('cuda') or '-'}, NCCL {rec.get('nccl') or '-'}{cudnn})",
            f"{nodes}; {hw}"]
