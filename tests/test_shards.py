"""Token shards: exact round trip of the token stream, sample arithmetic, the val split, refusal
of damaged files, and the demo-preparation tool end to end."""

from __future__ import annotations

import hashlib
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moetrain.data.corpus import build_demo_corpus, iter_documents
from moetrain.data.format import ShardError, token_dtype
from moetrain.data.reader import TokenShards
from moetrain.data.tokenizer import train_bpe
from moetrain.data.verify import verify_shards
from moetrain.data.writer import write_shards

REPO = Path(__file__).resolve().parents[1]


class CharTokenizer:
    """One id per character (ord + 1), EOS 0: trivially invertible, any vocab size."""

    def __init__(self, vocab_size: int = 300):
        self.vocab_size, self.eos_id, self.bos_id = vocab_size, 0, None
        self.identity = {"name": f"chars-{vocab_size}", "vocab_size": vocab_size,
                         "sha256": hashlib.sha256(f"chars-{vocab_size}".encode()).hexdigest()}

    def encode_batch(self, texts):
        return [[ord(c) + 1 for c in t] for t in texts]


def _docs(n: int) -> list[str]:
    return [f"document {i}: " + "abcdefghij"[: i % 10 + 1] * (i % 7 + 1) for i in range(n)]


def _stream(tokenizer, docs) -> np.ndarray:
    return np.concatenate([np.asarray(ids + [tokenizer.eos_id]) for ids in tokenizer.encode_batch(docs)])


def _split(docs, k):
    return [d for i, d in enumerate(docs) if i % k != 0], [d for i, d in enumerate(docs) if i % k == 0]


@pytest.fixture()
def small(tmp_path):
    """100 documents in shards of 300 tokens, every 10th document held out."""
    docs = _docs(100)
    write_shards(docs, CharTokenizer(), tmp_path, shard_tokens=300, val_fraction=0.1, progress=False)
    return tmp_path, docs


def test_round_trip_with_a_real_bpe(tmp_path):
    corpus = tmp_path / "corpus"
    build_demo_corpus(corpus)
    docs = [d[:8000] for d in iter_documents(corpus)]  # 38 play openings, ~100k tokens
    tok = train_bpe(docs, 1024, tmp_path / "tokenizer.json")
    manifest = write_shards(docs, tok, tmp_path / "shards", shard_tokens=20_000, val_fraction=0.1, progress=False)
    train_docs, val_docs = _split(docs, 10)
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        shards = TokenShards(tmp_path / "shards", split)
        expected = _stream(tok, split_docs)
        got = np.concatenate([np.asarray(shards.shard_tokens(i)) for i in range(len(shards.shards))])
        np.testing.assert_array_equal(got, expected)
        assert tok.decode(got).split("<|endoftext|>")[:-1] == split_docs
        assert shards.num_tokens == len(expected) == manifest["splits"][split]["tokens"]
        assert (shards.vocab_size, shards.eos_id, shards.dtype) == (1024, 0, np.dtype("<u2"))
    assert manifest["tokenizer"] == tok.identity
    assert manifest["total_tokens"] == sum(s["tokens"] for s in manifest["splits"].values())


def test_samples_are_windows_of_the_stream(small):
    path, docs = small
    train_docs, _ = _split(docs, 10)
    stream = _stream(CharTokenizer(), train_docs)
    shards = TokenShards(path, "train")
    sizes = [sh["tokens"] for sh in shards.shards]
    assert all(s == 300 for s in sizes[:-1]) and 0 < sizes[-1] <= 300 and sum(sizes) == len(stream)
    seq_len = 16
    assert shards.num_samples(seq_len) == sum((s - 1) // seq_len for s in sizes)
    per_shard = (300 - 1) // seq_len  # 18
    for index in [0, 1, per_shard - 1, per_shard, per_shard + 5, shards.num_samples(seq_len) - 1]:
        shard, local = divmod(index, per_shard)
        start = shard * 300 + local * seq_len
        x = shards.sample(index, seq_len)
        assert x.dtype == np.int64 and x.shape == (seq_len + 1,)
        np.testing.assert_array_equal(x, stream[start : start + seq_len + 1])
    batch = shards.samples([3, 0], seq_len)
    assert batch.shape == (2, seq_len + 1)
    np.testing.assert_array_equal(batch[1], shards.sample(0, seq_len))
    for bad in (-1, shards.num_samples(seq_len)):
        with pytest.raises(IndexError, match=f"sample index {bad} out of range"):
            shards.sample(bad, seq_len)
    with pytest.raises(ValueError, match="seq_len"):
        shards.num_samples(0)
    clone = pickle.loads(pickle.dumps(shards))
    np.testing.assert_array_equal(clone.sample(7, seq_len), shards.sample(7, seq_len))


def test_num_samples_arithmetic(tmp_path):
    write_shards(["x" * 249], CharTokenizer(), tmp_path, shard_tokens=100, val_docs=0, progress=False)
    shards = TokenShards(tmp_path, "train")  # 250 tokens: shards of 100, 100, 50
    assert [sh["tokens"] for sh in shards.shards] == [100, 100, 50]
    assert shards.num_samples(10) == 9 + 9 + 4
    assert shards.num_samples(99) == 1 + 1 + 0
    assert shards.num_samples(100) == 0  # 101 tokens never fit in one shard
    assert shards.num_samples(1) == 99 + 99 + 49
    np.testing.assert_array_equal(shards.sample(9, 10), shards.shard_tokens(1)[:11])  # first of shard 1
    assert TokenShards(tmp_path, "val").num_samples(4) == 0


def test_document_index(small):
    path, docs = small
    shards = TokenShards(path, "train")
    starts, total = [], 0
    for i, sh in enumerate(shards.shards):
        s = shards.document_starts(i)
        assert s.dtype == np.int64 and len(s) == sh["documents"]
        tokens = shards.shard_tokens(i)
        assert all(tokens[j - 1] == 0 for j in s if j > 0)  # every document starts right after an EOS
        starts += list(s + total)
        total += sh["tokens"]
    assert len(starts) == 90 == shards.manifest["splits"]["train"]["documents"]


def test_val_split_is_deterministic_nonempty_and_disjoint(small, tmp_path_factory):
    path, docs = small
    manifest = verify_shards(path)
    assert manifest["val_split"]["rule"] == "every_kth" and manifest["val_split"]["k"] == 10
    assert manifest["splits"]["val"]["documents"] == 10 and manifest["splits"]["train"]["documents"] == 90
    decode = lambda shards: "".join(chr(i - 1) if i else "\0" for s in range(len(shards.shards))  # noqa: E731
                                    for i in shards.shard_tokens(s)).split("\0")[:-1]
    train, val = decode(TokenShards(path, "train")), decode(TokenShards(path, "val"))
    assert val == docs[::10] and not set(train) & set(val) and len(train) + len(val) == 100
    again = tmp_path_factory.mktemp("again")
    assert write_shards(docs, CharTokenizer(), again, shard_tokens=300, val_fraction=0.1,
                        progress=False)["splits"] == manifest["splits"]
    first_n = write_shards(docs, CharTokenizer(), again, val_docs=3, progress=False)
    assert first_n["splits"]["val"]["documents"] == 3 and first_n["val_split"]["rule"] == "first_n"
    for layout in ("moetrain", "megatron"):  # a late refusal leaves no shard behind
        late = tmp_path_factory.mktemp(f"late-{layout}")
        with pytest.raises(ValueError, match="all 3 documents fell in the validation split"):
            write_shards(docs[:3], CharTokenizer(), late, val_docs=3, shard_tokens=20, layout=layout, progress=False)
        assert not [f.name for f in late.iterdir()], layout


def test_dtype_follows_vocab_size(tmp_path):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    docs = ["\U0001F600 grin", "plain"]  # ord("😀") + 1 = 128513 needs uint32
    m = write_shards(docs, CharTokenizer(200_000), tmp_path, val_docs=0, progress=False)
    assert m["dtype"] == "uint32"
    sh = m["splits"]["train"]["shards"][0]
    assert (tmp_path / sh["name"]).stat().st_size == 4 * sh["tokens"] == sh["bytes"]
    shards = TokenShards(tmp_path)
    assert shards.sample(0, 2).tolist() == [0x1F601, ord(" ") + 1, ord("g") + 1]


def test_rewrite_removes_stale_shards_and_temp_files(small):
    path, docs = small
    assert len(list(path.glob("train_*.bin"))) > 2
    write_shards(docs, CharTokenizer(), path, val_fraction=0.1, progress=False)  # one shard per split now
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json", "train_00000.bin", "train_00000.idx", "val_00000.bin", "val_00000.idx"]


@pytest.mark.parametrize("damage", ["truncate_bin", "alter_bin", "alter_idx", "delete_bin", "extend_idx"])
def test_damaged_shards_are_refused(small, damage):
    path, _ = small
    target = path / ("train_00001.idx" if "idx" in damage else "train_00001.bin")
    data = target.read_bytes()
    if damage == "truncate_bin":
        target.write_bytes(data[:-2])
        expected = "truncated"
    elif damage.startswith("alter"):
        target.write_bytes(data[:5] + bytes([data[5] ^ 1]) + data[6:])
        expected = "sha256 mismatch"
    elif damage == "extend_idx":
        target.write_bytes(data + b"\0" * 8)
        expected = "longer than written"
    else:
        target.unlink()
        expected = "missing"
    with pytest.raises(ShardError) as err:
        TokenShards(path, "train")
    msg = str(err.value)
    assert str(target) in msg and expected in msg and "tools/tokenize_corpus.py" in msg
    TokenShards(path, "val")  # the other split is untouched and still loads
    if damage.startswith("alter"):
        TokenShards(path, "train", verify="size")  # size cannot see an altered byte (documented)
    else:
        with pytest.raises(ShardError, match=expected):
            verify_shards(path, "size")


def test_bad_manifests_are_refused(small, tmp_path_factory):
    path, _ = small
    manifest = json.loads((path / "manifest.json").read_text())
    with pytest.raises(ShardError, match="no split 'test'"):
        TokenShards(path, "test")
    (path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(ShardError, match="unknown format version 99.*tokenize_corpus"):
        verify_shards(path)
    (path / "manifest.json").write_text("{truncated")
    with pytest.raises(ShardError, match="manifest.json: not valid JSON"):
        verify_shards(path)
    (path / "manifest.json").unlink()
    with pytest.raises(ShardError, match="manifest.json: manifest missing.*tokenize_corpus"):
        TokenShards(path)
    with pytest.raises(ShardError, match="does not exist"):
        verify_shards(tmp_path_factory.mktemp("x") / "nothing")


def _tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_prepare_demo_builds_then_skips(tmp_path):
    root = tmp_path / "demo"
    first = _tool("tools/prepare_demo.py", "--root", str(root))
    assert first.returncode == 0, first.stderr
    assert "built" in first.stdout and "trained" in first.stdout and "wrote" in first.stdout
    manifest = verify_shards(root / "shards")
    assert manifest["vocab_size"] == 8192 and manifest["dtype"] == "uint16"
    assert manifest["total_documents"] == 38 and manifest["splits"]["val"]["documents"] == 1
    assert 0.005 < manifest["splits"]["val"]["tokens"] / manifest["total_tokens"] < 0.05
    assert manifest["total_tokens"] > 1_000_000
    second = _tool("tools/prepare_demo.py", "--root", str(root))
    assert second.returncode == 0, second.stderr
    assert second.stdout.count("skipped") == 3, second.stdout
    info = _tool("tools/inspect_shards.py", str(root / "shards"), "--decode", "20",
                 "--tokenizer", str(root / "tokenizer.json"))
    assert info.returncode == 0 and "train_00000.bin" in info.stdout and "ACT I" in info.stdout, info.stderr


def test_tools_fail_with_one_line_errors(tmp_path):
    (tmp_path / "corpus.csv").write_text("a,b\n")
    bad = _tool("tools/tokenize_corpus.py", "--input", str(tmp_path / "corpus.csv"), "--tokenizer", "gpt2",
                "--out", str(tmp_path / "out"))
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.count("\n") == 1 and "unsupported corpus file type" in bad.stderr
    missing = _tool("tools/inspect_shards.py", str(tmp_path))
    assert missing.returncode == 1 and "manifest missing" in missing.stderr and "Traceback" not in missing.stderr


# -- verification spread over ranks, and cached ------------------------------------------------


def _verify_as_ranks(path, world: int, mode: str = "sha256", cache=None) -> list:
    """Run verify_shards as ``world`` ranks (threads) whose `agree` is an all-gather; returns each
    rank's manifest or exception, and records the files each rank hashed."""
    import threading

    import moetrain.data.verify as verify

    barrier, slots = threading.Barrier(world), [None] * world
    hashed: dict[int, list[str]] = {r: [] for r in range(world)}
    original, local = verify.sha256_file, threading.local()

    def counting(f, bar=None):
        hashed[local.rank].append(Path(f).name)
        return original(f, bar)

    def agree(result):
        slots[result["rank"]] = result
        barrier.wait()
        return list(slots)

    def run(rank, out):
        local.rank = rank
        try:
            out[rank] = verify_shards(path, mode, rank=rank, world=world, agree=agree, cache=cache)
        except ShardError as e:
            out[rank] = e

    out = [None] * world
    verify.sha256_file = counting
    try:
        threads = [threading.Thread(target=run, args=(r, out)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        verify.sha256_file = original
    return out, hashed


def test_verification_is_spread_over_ranks_once_per_content(small, tmp_path_factory):
    path, _ = small
    files = sorted(p.name for p in path.glob("*_*.*"))
    sizes = {p.name: p.stat().st_size for p in path.glob("*_*.*")}
    out, hashed = _verify_as_ranks(path, 3)
    assert all(isinstance(m, dict) for m in out), out
    assert sorted(sum(hashed.values(), [])) == files, "every file hashed exactly once over the ranks"
    loads = [sum(sizes[f] for f in hashed[r]) for r in range(3)]
    assert max(loads) - min(loads) <= max(sizes.values()), f"bytes per rank {loads}"

    # A damaged file is found by its one owner; every rank raises the same error.
    victim = path / "train_00002.bin"
    data = victim.read_bytes()
    victim.write_bytes(data[:3] + bytes([data[3] ^ 1]) + data[4:])
    out, hashed = _verify_as_ranks(path, 3)
    assert all(isinstance(e, ShardError) and "train_00002.bin: sha256 mismatch" in str(e) for e in out), out
    assert sum("train_00002.bin" in h for h in hashed.values()) == 1
    victim.write_bytes(data)

    # The cache: contents verified once are not read again while size and mtime hold.
    cache = tmp_path_factory.mktemp("cache") / "verified.json"
    out, hashed = _verify_as_ranks(path, 2, cache=cache)
    assert sorted(sum(hashed.values(), [])) == files and cache.is_file()
    out, hashed = _verify_as_ranks(path, 2, cache=cache)
    assert all(isinstance(m, dict) for m in out) and sum(hashed.values(), []) == [], "cached contents re-hashed"
    victim.write_bytes(data[:3] + bytes([data[3] ^ 1]) + data[4:])  # same size, new mtime
    out, hashed = _verify_as_ranks(path, 2, cache=cache)
    assert sum(hashed.values(), []) == ["train_00002.bin"], hashed
    assert all(isinstance(e, ShardError) and "sha256 mismatch" in str(e) for e in out), out
    victim.write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "sources": ["elsewhere"]}))
    out, hashed = _verify_as_ranks(path, 2, cache=cache)
    assert sorted(sum(hashed.values(), [])) == files, "a new manifest must not trust the old cache"

    # size mode reads nothing; one process without `agree` checks everything itself.
    out, hashed = _verify_as_ranks(path, 2, mode="size")
    assert sum(hashed.values(), []) == [] and all(isinstance(m, dict) for m in out)
    with pytest.raises(ValueError, match="needs `agree`"):
        verify_shards(path, rank=0, world=2)
