"""The command every rank starts with, in the container ``launch.container`` names.

One function per runtime, each following its tool's documented command line:

* pyxis (NVIDIA's SLURM SPANK plugin over enroot): flags on ``srun`` — ``--container-image``,
  ``--container-mounts=SRC:DST[:FLAGS][,...]``, ``--container-workdir`` — and the image's Python
  as the task's command;
* Apptainer: ``apptainer exec [--nv] --bind SRC:DST[:FLAGS][,...] --pwd DIR IMAGE python ...``
  around each task (``--nv`` when the job asks for GPUs); the host environment passes through;
* podman: ``podman run --rm --network=host --ipc=host --env=... --volume=SRC:DST[:FLAGS]
  --workdir=DIR IMAGE python ...`` around each task: the host network (torch.distributed's
  TCP store and NCCL's sockets), the host IPC namespace (NCCL's shared memory), the variables
  SLURM, submitit, torch.distributed and the site need passed in by name (podman passes none by
  default), GPUs through CDI (``--device=nvidia.com/gpu=all``) when the job asks for them.

Besides the config's mounts, the submit directory and the run directory are mounted at their own
paths (unless a mount already covers them), so that relative paths in the config (data, run
directory) and submitit's job folder mean the same inside the container.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from moetrain.config import Config, field_error

__all__ = ["Launch", "task_launch", "check_mounted", "PODMAN_ENV_PATTERNS"]

# Variables a rank needs from the host, passed into a podman container by name (podman's
# --env=NAME* takes every host variable matching the pattern).
PODMAN_ENV_PATTERNS = ("SLURM_*", "SUBMITIT_*", "MOETRAIN_*", "MASTER_*", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                       "LOCAL_WORLD_SIZE", "NCCL_*", "CUDA_*", "UCX_*", "TORCH*", "OMP_*")


@dataclass(frozen=True)
class Launch:
    """How a task starts: ``srun_args`` added to the ``srun`` line (pyxis' flags), and ``python``:
    the argv that stands where the Python interpreter would (the container runtime's command
    ending in the image's Python, or this interpreter without a container)."""

    srun_args: tuple[str, ...]
    python: tuple[str, ...]

    @property
    def python_str(self) -> str:
        """``python`` as one shell word sequence (submitit's ``python`` parameter)."""
        return " ".join(shlex.quote(a) for a in self.python)


def _covered(path: str, mounts: list[str]) -> bool:
    return any(path == dst or path.startswith(dst.rstrip("/") + "/") for dst in (m.split(":")[1] for m in mounts))


def mounts(cfg: Config, cwd: Path) -> list[str]:
    """The config's mounts, then the submit directory and the run directory at their own paths
    where no mount covers them."""
    out = list(cfg.launch.container.mounts)
    for path in (str(cwd.resolve()), str((cwd / cfg.run_dir).resolve())):
        if not _covered(path, out):
            out.append(f"{path}:{path}")
    return out


def task_launch(cfg: Config, cwd: Path | None = None) -> Launch:
    """The task command for ``cfg`` (see the module docstring); without a container, this
    interpreter (``sys.executable``) and no srun flags. ``cwd``: the submit directory (default:
    the current one)."""
    c = cfg.launch.container
    if c is None:
        return Launch((), (sys.executable,))
    cwd = Path.cwd() if cwd is None else cwd
    binds = mounts(cfg, cwd)
    workdir = c.workdir or str(cwd.resolve())
    gpus = cfg.launch.gpus_per_node > 0
    if c.runtime == "pyxis":
        return Launch((f"--container-image={c.image}", f"--container-mounts={','.join(binds)}",
                       f"--container-workdir={workdir}", *c.runtime_args), (c.python,))
    if c.runtime == "apptainer":
        return Launch((), ("apptainer", "exec", *(["--nv"] if gpus else []), "--bind", ",".join(binds), "--pwd",
                           workdir, *c.runtime_args, c.image, c.python))
    env = [f"--env={p}" for p in PODMAN_ENV_PATTERNS] + [f"--env={n}" for n in cfg.launch.env]
    return Launch((), ("podman", "run", "--rm", "--network=host", "--ipc=host", *env,
                       *(["--device=nvidia.com/gpu=all"] if gpus else []), *[f"--volume={m}" for m in binds],
                       f"--workdir={workdir}", *c.runtime_args, c.image, c.python))


def check_mounted(cfg: Config, cwd: Path | None = None) -> None:
    """Every path the ranks read or write outside the image — the data sources, the checkpoint
    directory and ``checkpoint.init_from`` — is under a mount (or the submit or run directory,
    mounted anyway), so that a run does not start only to find its data missing in the container.

    Raises:
        ConfigError: naming ``launch.container.mounts``, the path and the field that names it.
    """
    if cfg.launch.container is None:
        return
    cwd = Path.cwd() if cwd is None else cwd
    binds = mounts(cfg, cwd)
    paths = [(f"data.blend[{i}].path" if cfg.data.blend else "data.path", s.path)
             for i, s in enumerate(cfg.data.sources())]
    if cfg.checkpoint.dir:
        paths.append(("checkpoint.dir", cfg.checkpoint.dir))
    if cfg.checkpoint.init_from:
        paths.append(("checkpoint.init_from", cfg.checkpoint.init_from))
    for field, path in paths:
        where = str((cwd / path).resolve()) if not Path(path).is_absolute() else str(Path(path))
        if not _covered(where, binds):
            raise field_error("launch.container.mounts", list(cfg.launch.container.mounts),
                              f"{field} = {path} is not mounted in the container (mounted: "
                              f"{', '.join(m.split(':')[1] for m in binds)})",
                              f"add {where}:{where} (or a directory above it) to launch.container.mounts")
