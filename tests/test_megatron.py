"""Megatron-LM interop (moetrain/data/megatron.py): a dataset written byte by byte from the
format's documented layout is read as training data, what we write with --format megatron
follows that layout, the trainer trains on it as on shards; damaged pairs are refused by name."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenize_helpers import tree, write_corpus

from conftest import ByteTokenizer, _documents, tiny_config
from moetrain.data.corpus import iter_documents
from moetrain.data.format import ShardError, read_manifest
from moetrain.data.megatron import MegatronFormatError, import_megatron, read_index
from moetrain.data.pipeline import TokenizeJob
from moetrain.data.reader import TokenShards
from moetrain.data.verify import verify_shards
from moetrain.data.writer import write_shards
from multiproc import run_distributed

REPO = Path(__file__).resolve().parents[1]
CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}


def _write_by_the_layout(prefix: Path, documents: list[list[list[int]]], dtype) -> None:
    """A Megatron dataset from its documented layout, independently of moetrain's writer:
    documents as lists of sequences (``--split-sentences`` gives several per document)."""
    dtype = np.dtype(dtype)
    sequences = [s for doc in documents for s in doc]
    lengths = [len(s) for s in sequences]
    pointers = list(np.cumsum([0] + lengths[:-1]) * dtype.itemsize)
    doc_idx = list(np.cumsum([0] + [len(doc) for doc in documents]))
    prefix.with_suffix(".bin").write_bytes(b"".join(np.asarray(s, dtype=dtype).tobytes() for s in sequences))
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def _parse_by_the_layout(idx: Path) -> dict:
    raw = idx.read_bytes()
    magic, version, code, n_seq, n_doc = struct.unpack_from("<9sQBQQ", raw)
    at = 34
    lengths = struct.unpack_from(f"<{n_seq}i", raw, at)
    pointers = struct.unpack_from(f"<{n_seq}q", raw, at + 4 * n_seq)
    docs = struct.unpack_from(f"<{n_doc}q", raw, at + 12 * n_seq)
    assert len(raw) == at + 12 * n_seq + 8 * n_doc
    return {"magic": magic, "version": version, "code": code, "lengths": list(lengths), "pointers": list(pointers),
            "documents": list(docs)}


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_reads_megatron_data_as_training_data(tmp_path, dtype):
    rng = np.random.default_rng(1)
    eos, vocab = 50_000, 50_001
    # 30 documents of 1-3 sequences (sentences); EOD ends each document, as --append-eod does.
    documents = []
    for _ in range(30):
        sentences = [list(rng.integers(0, 40_000, size=int(rng.integers(1, 40)))) for _ in range(int(rng.integers(1, 4)))]
        sentences[-1].append(eos)
        documents.append(sentences)
    _write_by_the_layout(tmp_path / "corpus_text_document", documents, dtype)
    stream = np.concatenate([np.concatenate(d) for d in documents])

    out = tmp_path / "imported"
    identity = {"name": "test", "vocab_size": vocab, "sha256": "x"}
    manifest = import_megatron([tmp_path / "corpus_text_document"], out, vocab_size=vocab, eos_id=eos,
                               tokenizer_identity=identity, val_last_docs=4, progress=False)
    assert read_manifest(out)["vocab_size"] == vocab  # what the trainer's preflight reads
    assert manifest["dtype"] == np.dtype(dtype).name and manifest["splits"]["val"]["documents"] == 4
    train, val = TokenShards(out, "train"), TokenShards(out, "val")
    cut = sum(len(s) for d in documents[:-4] for s in d)
    np.testing.assert_array_equal(np.asarray(train.shard_tokens(0)), stream[:cut])
    np.testing.assert_array_equal(np.asarray(val.shard_tokens(0)), stream[cut:])
    seq_len = 16
    assert train.num_samples(seq_len) == (cut - 1) // seq_len
    np.testing.assert_array_equal(train.sample(3, seq_len), stream[48:65])
    doc_starts = np.cumsum([0] + [sum(map(len, d)) for d in documents])
    np.testing.assert_array_equal(train.document_starts(0), doc_starts[:26])
    np.testing.assert_array_equal(val.document_starts(0), doc_starts[26:30] - cut)
    shard = verify_shards(out, "sha256")["splits"]["train"]["shards"][0]
    assert shard["name"] == (tmp_path / "corpus_text_document.bin").resolve().as_posix()  # outside: absolute


def test_megatron_output_follows_the_layout_and_reads_back(tmp_path):
    corpus = write_corpus(tmp_path, files=4)
    runs = {}
    for workers in (0, 2):
        job = TokenizeJob([corpus], ByteTokenizer(), tmp_path / f"meg{workers}", layout="megatron",
                          val_fraction=0.1, unit_bytes=4000)
        job.run(workers=workers, progress=False)
        job.merge(progress=False)
        runs[workers] = tree(tmp_path / f"meg{workers}")
    assert runs[0] == runs[2]
    assert sorted(runs[0]) == ["manifest.json", "train.bin", "train.idx", "val.bin", "val.idx"]

    docs = [d for d in iter_documents(corpus) if d]
    train_docs = [d for i, d in enumerate(docs) if i % 10]
    ids = [list(d.encode()) + [ByteTokenizer.eos_id] for d in train_docs]
    idx = _parse_by_the_layout(tmp_path / "meg0" / "train.idx")
    assert (idx["magic"], idx["version"], idx["code"]) == (b"MMIDIDX\x00\x00", 1, 8)  # uint16
    assert idx["lengths"] == [len(x) for x in ids]
    assert idx["pointers"] == list(2 * np.cumsum([0] + idx["lengths"][:-1]))
    assert idx["documents"] == list(range(len(ids) + 1))
    assert runs[0]["train.bin"] == np.concatenate(ids).astype("<u2").tobytes()

    # The same samples as the moetrain layout of the same documents (one shard each).
    native = write_shards(iter_documents(corpus), ByteTokenizer(), tmp_path / "native", val_fraction=0.1,
                          progress=False)
    assert native["splits"]["train"]["tokens"] == sum(idx["lengths"])
    a, b = TokenShards(tmp_path / "meg0"), TokenShards(tmp_path / "native")
    np.testing.assert_array_equal(a.samples(range(a.num_samples(64)), 64), b.samples(range(b.num_samples(64)), 64))
    np.testing.assert_array_equal(a.document_starts(0), b.document_starts(0))
    m = json.loads(runs[0]["manifest.json"])
    assert (m["format_version"], m["index_format"], m["dtype"]) == (2, "megatron", "uint16")


def test_damaged_megatron_files_are_refused_by_name(tmp_path):
    _write_by_the_layout(tmp_path / "d", [[[1, 2, 3]], [[4, 5]]], np.uint16)
    good = read_index(tmp_path / "d.idx", bin_bytes=10)
    assert good.num_documents == 2 and good.num_tokens == 5
    with pytest.raises(MegatronFormatError, match=r"d\.bin: 8 bytes, but d\.idx describes 10"):
        read_index(tmp_path / "d.idx", bin_bytes=8)
    raw = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.idx").write_bytes(raw[:-8])
    with pytest.raises(MegatronFormatError, match=r"d\.idx: .*truncated"):
        read_index(tmp_path / "d.idx")
    (tmp_path / "d.idx").write_bytes(b"NOTANIDX" + raw[8:])
    with pytest.raises(MegatronFormatError, match=r"d\.idx: not a Megatron index"):
        read_index(tmp_path / "d.idx")
    # A raw prefix as data.path: told how to describe it, not just "does not exist".
    with pytest.raises(ShardError, match=r"a Megatron-LM dataset.*tools/import_megatron\.py --train .*/d "):
        TokenShards(tmp_path / "d")


def test_import_tool_and_cli_megatron_round_trip(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=REPO, capture_output=True, text=True,  # noqa: E731
                                    timeout=300, env=env)
    corpus = write_corpus(tmp_path, files=2)
    out = tmp_path / "meg"
    r = run("tools/tokenize_corpus.py", "--input", str(corpus), "--tokenizer", "gpt2", "--out", str(out),
            "--format", "megatron", "--quiet", "--workers", "1")
    assert r.returncode == 0, r.stderr
    # Megatron files written here, described again by the import tool, are the same training data.
    r = run("tools/import_megatron.py", "--train", str(out / "train"), "--val", str(out / "val.idx"),
            "--tokenizer", "gpt2", "--out", str(tmp_path / "again"), "--quiet")
    assert r.returncode == 0, r.stderr
    a, b = TokenShards(out), TokenShards(tmp_path / "again")
    assert read_manifest(out)["splits"]["train"]["shards"][0]["sha256"] == \
        read_manifest(tmp_path / "again")["splits"]["train"]["shards"][0]["sha256"]
    np.testing.assert_array_equal(a.samples(range(20), 32), b.samples(range(20), 32))
    bad = run("tools/import_megatron.py", "--train", str(out / "train"), "--vocab-size", "100", "--eos-id", "0",
              "--out", str(tmp_path / "wrong"), "--quiet")
    assert bad.returncode == 1 and "is not below the vocabulary size 100" in bad.stderr and "Traceback" not in bad.stderr


def _train_losses(rank: int, world: int, paths: dict, run_dir: str) -> dict:
    from moetrain.train.trainer import Trainer

    losses = {}
    for name, path in paths.items():
        trainer = Trainer(tiny_config(path, f"{run_dir}/{name}", train={"steps": 3}), write_files=False)
        losses[name] = [trainer.train_step().loss for _ in range(3)]
    return losses


def test_trainer_trains_on_megatron_data_as_on_shards(tmp_path):
    # One shard per split in both layouts: the same samples, so the same losses, bit for bit.
    docs = _documents(200)
    write_shards(docs, ByteTokenizer(), tmp_path / "native", shard_tokens=10**7, val_docs=10, progress=False)
    write_shards(docs, ByteTokenizer(), tmp_path / "megatron", val_docs=10, layout="megatron", progress=False)
    paths = {name: str(tmp_path / name) for name in ("native", "megatron")}
    losses = run_distributed(_train_losses, 1, paths, str(tmp_path / "runs"))[0]
    assert losses["native"] == losses["megatron"] and len(set(losses["native"])) == 3
