"""Shared fixtures: a tiny token-shard set and a tiny MoE config for fast multi-process tests."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

import timings
from moetrain.config import Config, config_from_dict
from moetrain.data.writer import write_shards

# Every process the tests start (local runs, SLURM jobs) may inject faults (tests/faults.py).
os.environ.setdefault("MOETRAIN_FAULT_HOOK", f"{Path(__file__).resolve().parent / 'faults.py'}:install")


class ByteTokenizer:
    """Bytes as tokens (ids 0-255) plus EOS 256: a real, lossless tokenizer with no files; no BOS."""

    vocab_size = 257
    eos_id = 256
    bos_id = None
    identity = {"name": "bytes", "vocab_size": 257, "sha256": hashlib.sha256(b"bytes-v1").hexdigest()}

    def encode_batch(self, texts):
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ("the king queen lord of and to my in that is not with you it for this be his your "
             "but have he as thou so will what her all no by shall do if are our").split()
    return [" ".join(rng.choice(words, size=int(rng.integers(40, 200)))) + "." for _ in range(n)]


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory) -> Path:
    """About 100k byte tokens of pseudo-English in train/val shards (several shards)."""
    out = tmp_path_factory.mktemp("shards")
    write_shards(_documents(200), ByteTokenizer(), out, shard_tokens=30_000, val_docs=10, progress=False)
    return out


@pytest.fixture(scope="session")
def short_doc_shards(tmp_path_factory) -> Path:
    """Short documents (4-40 bytes + EOS), so a 64-token sample holds several."""
    rng = np.random.default_rng(5)
    words = "the king queen lord of and to my in that is not with you".split()
    docs = [" ".join(rng.choice(words, size=int(rng.integers(1, 8)))) for _ in range(3000)]
    out = tmp_path_factory.mktemp("short-docs")
    write_shards(docs, ByteTokenizer(), out, shard_tokens=20_000, val_docs=20, progress=False)
    return out


def tiny_config(data_path: str | Path, run_dir: str | Path, **sections) -> Config:
    """A 2-layer MoE small enough to train a step in a few ms per rank."""
    base = {
        "run": {"name": "tiny", "dir": str(run_dir), "seed": 7},
        "model": {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn_hidden": 64, "vocab_size": 257,
                  "seq_len": 16},
        "moe": {"num_experts": 4, "top_k": 2, "every": 1, "ffn_hidden": 48, "shared_experts": 1,
                "aux_loss_coef": 0.01, "z_loss_coef": 0.001},
        "data": {"path": str(data_path), "val_batches": 2},
        "train": {"steps": 5, "micro_batch_size": 2, "global_batch_size": 8, "lr": 3e-3, "min_lr": 3e-4,
                  "warmup_steps": 1, "grad_clip": 0.0, "val_every": 0},
        "checkpoint": {"every": 0, "keep": 2, "resume": False},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return config_from_dict(base)


def run_calibrate(cfg: Config, workdir: Path, *args: str, timeout: float = 300, launcher: list[str] | None = None):
    """``python -m moetrain.calibrate`` on ``cfg`` (written to ``workdir/c.yaml``) with ``args``,
    its profile to ``workdir/calibrated.yaml``: (the finished process, the profile's path).
    ``launcher``: what starts the module instead of ``python`` (e.g. torchrun's arguments)."""
    import subprocess
    import sys

    import yaml

    from moetrain.config import to_dict

    path, out = workdir / "c.yaml", workdir / "calibrated.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    res = subprocess.run([*(launcher or [sys.executable]), "-m", "moetrain.calibrate", "--config", str(path),
                          "--out", str(out), *args],
                         capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).resolve().parents[1])
    return res, out


def require_slurm_cluster():
    """For SLURM test modules, at import: the dev cluster's ``ClusterInfo``, or skip the module
    when it is not up — fail instead under ``MOETRAIN_REQUIRE_SLURM=1`` (CI brought it up, so a
    skip would hide a failure)."""
    from moetrain.launch.slurm import SlurmUnavailableError, query_cluster

    try:
        return query_cluster(timeout_s=5)
    except SlurmUnavailableError as e:
        reason = f"SLURM dev cluster is not up: run `slurm/dev-cluster up` ({e})"
        if os.environ.get("MOETRAIN_REQUIRE_SLURM") == "1":
            raise RuntimeError(reason) from e
        pytest.skip(reason, allow_module_level=True)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups from the marks
def pytest_collection_modifyitems(config, items):
    """Work units for ``pytest -n N --dist loadgroup`` (pytest-xdist): the tests that use the SLURM
    dev cluster form one unit, run one after another on one worker (they share its two nodes, and
    one of them kills a node's slurmd), and go first, since they are the longest and mostly wait on
    the scheduler while the other workers take the CPU-bound tests; every other module is one unit,
    so its module fixtures are built once. Without xdist the marks are inert."""
    for item in items:  # slow(fast=[ids]): the cases named stay in the fast loop (-m "not slow")
        mark = item.get_closest_marker("slow")
        callspec = getattr(item, "callspec", None)
        if mark is not None and callspec is not None and callspec.id in mark.kwargs.get("fast", ()):
            item.own_markers[:] = [m for m in item.own_markers if m.name != "slow"]
    slurm = [item for item in items if item.get_closest_marker("slurm")]
    rest = [item for item in items if not item.get_closest_marker("slurm")]
    for item in slurm:
        item.add_marker(pytest.mark.xdist_group("slurm"))
    for item in rest:
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items[:] = slurm + rest


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def pytest_addoption(parser):
    parser.addoption("--timings", metavar="PATH",
                     help="write each test's setup, call and teardown seconds and its kind (slurm, hugging-face, "
                          "multi-process, single-process) to PATH as JSON lines (tests/timings.py); "
                          "`python tools/test_timings.py PATH` tabulates them by file and kind")


def pytest_configure(config):
    if config.getoption("timings"):
        timings.count_process_starts()
        if not hasattr(config, "workerinput"):  # the controller under xdist, or pytest alone
            config.pluginmanager.register(timings.Writer(config.getoption("timings")), "timings-writer")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.config.getoption("timings"):
        timings.mark_start(item)
    config = item.config
    # Under --dist loadgroup pytest-xdist keeps a group on one worker through the group in the node
    # id; with pytest 9.2 it no longer puts it there (pytest-xdist issue 1386), and the SLURM tests
    # would share the dev cluster from two workers at once and fail at random: fail them with the
    # fix instead. (A worker's own "dist" option is "no"; pytest-xdist sets "loadgroup" for it.)
    if (hasattr(config, "workerinput") and getattr(config.option, "loadgroup", False)
            and item.get_closest_marker("slurm") and not item.nodeid.endswith("@slurm")):
        pytest.fail(f"pytest-xdist {_version('pytest-xdist')} with pytest {pytest.__version__} does not keep "
                    f"the SLURM tests on one worker (its --dist loadgroup groups nothing): they would share the "
                    f"dev cluster from several workers at once. Fix: pip install 'pytest<9.2' (pyproject.toml's "
                    f"test extra), or run with -n 0", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown" and item.config.getoption("timings"):
        item.user_properties.extend(timings.properties(item))  # before the teardown report is made
    return (yield)
