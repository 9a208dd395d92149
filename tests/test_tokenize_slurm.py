"""Corpus tokenization on the real SLURM dev cluster (`slurm/dev-cluster up`), driven as a user
drives it: ``tools/tokenize_corpus.py --slurm`` runs the inputs as a 2-task array, one task on
each node (n1, n2), then merges; the shards equal those of a local run of the same command.
About 10 s on 2 shared cores (the cluster already up)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenize_helpers import tree, write_corpus

from moetrain.data.corpus import iter_documents
from moetrain.data.tokenizer import train_bpe
from moetrain.data.verify import verify_shards

from conftest import require_slurm_cluster

pytestmark = pytest.mark.slurm

require_slurm_cluster()

REPO = Path(__file__).resolve().parents[1]


def _tool(*args) -> subprocess.CompletedProcess:
    # The array tasks import moetrain from this checkout: sbatch passes the environment on.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    return subprocess.run([sys.executable, "tools/tokenize_corpus.py", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The corpus, its tokenizer, the common arguments, and the shards of a local run."""
    root = tmp_path_factory.mktemp("tokenize")
    corpus = write_corpus(root, files=6)
    train_bpe(iter_documents(corpus), 400, root / "tokenizer.json")
    common = ["--input", corpus, "--tokenizer", root / "tokenizer.json", "--quiet", "--val-fraction", "0.05",
              "--shard-tokens", "20000", "--unit-mb", "0.01"]
    r = _tool(*common, "--out", root / "local", "--workers", "2")
    assert r.returncode == 0, r.stderr
    return root, common, tree(root / "local")


def _slurm(local, name: str, *extra) -> tuple[Path, subprocess.CompletedProcess]:
    root, common, _ = local
    # 4 CPUs per task on nodes of 4 CPUs: one task per node, both running at once.
    r = _tool(*common, "--out", root / name, "--slurm", "--slurm-tasks", 2, "--slurm-cpus-per-task", 4,
              "--workers", 1, *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "submitted SLURM array" in r.stdout and "2 tasks" in r.stdout
    return root / name, r


def test_two_node_array_gives_the_local_shards(local):
    out, _ = _slurm(local, "slurm", "--keep-parts")
    expected = local[2]
    assert tree(out) == expected
    records = [json.loads(p.read_text()) for p in (out / ".tokenize" / "parts").glob("*.json")]
    assert len(records) > 6 and {rec["node"] for rec in records} == {"n1", "n2"}


def test_detached_array_merges_in_a_dependent_job(local):
    out, r = _slurm(local, "detached", "--detach")
    expected = local[2]
    merge_id = re.search(r"merge job (\d+) runs after the array", r.stdout).group(1)
    deadline = time.monotonic() + 180
    while not (out / "manifest.json").exists():
        assert time.monotonic() < deadline, f"merge job {merge_id} wrote no manifest in 180 s"
        time.sleep(1)
    verify_shards(out)
    assert tree(out) == expected
