"""A podman image built from this machine's own files (nothing pulled): this interpreter's
installation (its standard library, without site-packages) and the shared libraries it and the
installed packages link against. The packages themselves are mounted read-only at their own
paths when a rank starts (the run's ``launch.container.mounts``), as a site mounts a shared
software tree; moetrain comes from the checkout, which ``submit`` mounts as the submit directory."""

from __future__ import annotations

import hashlib
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

# Flags this machine's podman needs (crun cannot set the rlimits or cgroups it wants inside this
# host's own container; runc with explicit limits can).
RUNTIME_ARGS = ["--runtime=runc", "--ulimit=nofile=20000:20000", "--ulimit=nproc=20000:20000"]


def _site_dirs() -> list[str]:
    dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
    return dirs or [sysconfig.get_paths()["purelib"]]


def mounts() -> list[str]:
    """What a rank needs mounted besides the image: the virtual environment (when this is one),
    else the site-packages directories, read-only at their own paths."""
    if sys.prefix != sys.base_prefix:
        return [f"{sys.prefix}:{sys.prefix}:ro"]
    return [f"{d}:{d}:ro" for d in _site_dirs()]


def _libraries() -> list[str]:
    objects = [str(Path(sys.executable).resolve())]
    roots = [Path(os.__file__).parent / "lib-dynload", *map(Path, _site_dirs())]  # the base's stdlib
    for root in roots:
        objects += [str(p) for p in root.rglob("*.so*") if p.is_file()]
    # Libraries inside the interpreter's tree are in the image already; those inside the mounted
    # trees (the virtual environment, site-packages) come with the mount.
    inside = (sys.base_prefix, sys.prefix, *_site_dirs())
    libs: set[str] = set()
    for i in range(0, len(objects), 200):
        out = subprocess.run(["ldd", *objects[i:i + 200]], capture_output=True, text=True).stdout
        for line in out.splitlines():
            for word in line.split():
                path = os.path.normpath(word)
                if word.startswith("/") and ":" not in word and not path.startswith(inside):
                    libs.add(path)
    libdir = Path(next(iter(sorted(libs))) if libs else "/lib/x86_64-linux-gnu").parent
    libs |= {str(p) for p in libdir.glob("libnss_files*")} | {str(p) for p in libdir.glob("libnss_dns*")}
    return sorted(libs)


class ImageError(RuntimeError):
    """The image is wrong (a file missing, an import failing in it): a defect of this module,
    which a test must report rather than skip."""


def build(tag_prefix: str = "localhost/moetrain-test") -> tuple[str | None, str]:
    """(image tag, "") once podman can run a container from it, or (None, why not) where this
    host cannot run containers (podman missing, its OCI runtime refused).

    Raises:
        ImageError: podman runs, but the image cannot be imported or its Python fails.
    """
    podman = shutil.which("podman")
    if podman is None:
        return None, "podman is not installed"
    libraries = _libraries()
    key = hashlib.sha256("|".join([sys.base_prefix, sys.version, *libraries]).encode()).hexdigest()[:12]
    tag = f"{tag_prefix}:{key}"  # a new image when the interpreter or the libraries it needs change
    if subprocess.run([podman, "image", "exists", tag]).returncode != 0:
        base = sys.base_prefix.lstrip("/")
        with tempfile.TemporaryDirectory() as stage:
            for d in ("tmp", "etc"):
                (Path(stage) / d).mkdir(mode=0o1777 if d == "tmp" else 0o755)
            for f in ("passwd", "group", "nsswitch.conf"):
                if Path("/etc", f).is_file():
                    shutil.copy(Path("/etc", f), Path(stage, "etc", f))
            excludes = [f"--exclude={base}/lib/python{sys.version_info.major}.{sys.version_info.minor}/{d}"
                        for d in ("site-packages", "test", "idlelib", "tkinter")]
            tar = subprocess.Popen(["tar", "-c", "-h", *excludes, "-C", "/", base,
                                    *[p.lstrip("/") for p in libraries], "-C", stage, "tmp", "etc"],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            imported = subprocess.run([podman, "import", "-", tag], stdin=tar.stdout, capture_output=True, text=True)
            tar.wait()
            if imported.returncode != 0:
                raise ImageError(f"podman import failed: {imported.stderr.strip()[-300:]}")
    probe = subprocess.run([podman, "run", "--rm", "--network=host", *RUNTIME_ARGS,
                            *[f"--volume={m}" for m in mounts()], tag, sys.executable, "-c", "import torch, submitit"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        err = probe.stderr.strip()
        if "OCI" in err or "runc" in err or "crun" in err or "cgroup" in err:
            return None, f"podman cannot run a container here: {err[-400:]}"
        raise ImageError(f"the image's Python fails: {err[-600:]}")
    return tag, ""
