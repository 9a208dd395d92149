"""The corpus pipeline (moetrain/data/pipeline.py, tools/tokenize_corpus.py): the same shards for
any number of worker processes (and the same as the one-process writer), a run killed midway
resumes to the uninterrupted result, broken documents are skipped and counted or fatal, and a
corrupt file fails by name while the other inputs keep their work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenize_helpers import SlowByteTokenizer, jsonl, tree, write_corpus

from conftest import ByteTokenizer
from moetrain.data.corpus import iter_documents, write_jsonl_zst
from moetrain.data.pipeline import TokenizeJob, UnitsFailed
from moetrain.data.reader import TokenShards
from moetrain.data.writer import write_shards

REPO = Path(__file__).resolve().parents[1]
SETTINGS = dict(shard_tokens=5000, val_fraction=0.05, unit_bytes=4000)


def _job(corpus: Path, out: Path, tokenizer=None, **kw) -> TokenizeJob:
    return TokenizeJob([corpus], tokenizer or ByteTokenizer(), out, **{**SETTINGS, **kw})


def _tool(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "tools/tokenize_corpus.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=env)


def test_same_shards_for_any_number_of_workers(tmp_path):
    corpus = write_corpus(tmp_path)
    results = {}
    for workers in (0, 1, 3):  # 0: in this process
        job = _job(corpus, tmp_path / f"w{workers}")
        assert len(job.units) > 10  # the .jsonl files are cut into byte ranges
        summary = job.run(workers=workers, progress=False)
        assert (summary.tokenized, summary.already_done) == (len(job.units), 0)
        job.merge(progress=False)
        results[workers] = tree(tmp_path / f"w{workers}")
        assert not job.parts.exists()  # parts are deleted once merged
    assert results[0] == results[1] == results[3]
    assert len([n for n in results[0] if n.startswith("train_")]) > 4  # several shards, cut across units

    # ... and the same shards and splits as the one-process writer over the same documents.
    ref = write_shards(iter_documents(corpus), ByteTokenizer(), tmp_path / "ref", sources=[str(corpus)],
                       shard_tokens=5000, val_fraction=0.05, progress=False)
    ref_tree = tree(tmp_path / "ref")
    assert {n: b for n, b in results[0].items() if n != "manifest.json"} == {
        n: b for n, b in ref_tree.items() if n != "manifest.json"}
    manifest = json.loads(results[0]["manifest.json"])
    assert manifest.pop("skipped_documents") == {"total": 0, "by_reason": {}, "log": None}
    assert manifest == ref

    again = _job(corpus, tmp_path / "w1")
    summary = again.run(workers=1, progress=False)
    assert summary.up_to_date and summary.tokenized == 0
    assert again.merge(progress=False) == json.loads(results[1]["manifest.json"])
    assert tree(tmp_path / "w1") == results[1]


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
    corpus = write_corpus(tmp_path, files=8)
    out = tmp_path / "out"
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        f"sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]\n"
        "from tokenize_helpers import SlowByteTokenizer\n"
        "from moetrain.data.pipeline import TokenizeJob\n"
        "if __name__ == '__main__':\n"
        f"    job = TokenizeJob([{str(corpus)!r}], SlowByteTokenizer(0.05), {str(out)!r}, batch_docs=4, **{SETTINGS!r})\n"
        "    job.run(workers=2, progress=False)\n"
        "    job.merge(progress=False)\n")
    # Its own session: the kill takes the workers too, as a preemption or node loss would.
    proc = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    parts = out / ".tokenize" / "parts"
    deadline = time.monotonic() + 120
    while len(list(parts.glob("*.json"))) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    job = _job(corpus, out, SlowByteTokenizer(0.0), batch_docs=4)
    done_before = len(job.units) - len(job.pending())
    assert 3 <= done_before < len(job.units) and not (out / "manifest.json").exists()
    assert list(parts.glob(".*.tmp-*"))  # the killed workers' half-written parts are there, and ignored
    summary = job.run(workers=2, progress=False)
    assert (summary.already_done, summary.tokenized) == (done_before, len(job.units) - done_before)
    job.merge(progress=False)

    clean = _job(corpus, tmp_path / "clean")
    clean.run(workers=0, progress=False)
    clean.merge(progress=False)
    assert tree(out) == tree(tmp_path / "clean")


def _crawl(corpus: Path) -> Path:
    """A file with 2 lines that are not UTF-8 and 1 that is not JSON among 5 good ones."""
    lines = jsonl(["good one", "good two"]).splitlines()
    lines[1:1] = [b'{"text": "\xff\xfe"}', b'{"text": broken', b'{"text": "caf\xc3"}']
    lines += jsonl(["good three", "good four", "good five"]).splitlines()
    path = corpus / "crawl.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.slow
def test_cli_skips_broken_documents_counts_them_and_can_fail_instead(tmp_path):
    corpus = write_corpus(tmp_path, files=2)
    crawl = _crawl(corpus)
    out = tmp_path / "out"
    r = _tool("--input", str(corpus), "--tokenizer", "gpt2", "--out", str(out), "--workers", "2", "--quiet",
              "--val-docs", "1")
    assert r.returncode == 0, r.stderr
    assert "skipped 3 broken documents (invalid_json 1, invalid_utf8 2)" in r.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped_documents"] == {"total": 3, "by_reason": {"invalid_json": 1, "invalid_utf8": 2},
                                             "log": "skipped_documents.jsonl"}
    log = [json.loads(line) for line in (out / "skipped_documents.jsonl").read_text().splitlines()]
    assert [(e["file"], e["where"], e["reason"]) for e in log] == [
        (str(crawl.resolve()), "2", "invalid_utf8"), (str(crawl.resolve()), "3", "invalid_json"),
        (str(crawl.resolve()), "4", "invalid_utf8")]
    decoded = TokenShards(out, "train").shard_tokens(0)
    assert manifest["total_documents"] == 2 * 60 + 1 + 5 and len(decoded) == manifest["splits"]["train"]["tokens"]

    strict = _tool("--input", str(corpus), "--tokenizer", "gpt2", "--out", str(tmp_path / "strict"), "--quiet",
                   "--on-bad-document", "fail", "--workers", "2")
    assert strict.returncode == 1 and "Traceback" not in strict.stderr
    assert f"{crawl.resolve()}:2: invalid UTF-8 at byte 10 of the line" in strict.stderr
    assert not (tmp_path / "strict" / "manifest.json").exists()


def test_cli_corrupt_file_fails_by_name_and_the_rerun_redoes_only_it(tmp_path):
    corpus = write_corpus(tmp_path, files=3)
    zst = corpus / "part01.jsonl.zst"
    intact = zst.read_bytes()
    zst.write_bytes(intact[:-40])  # an interrupted copy
    args = ("--input", str(corpus), "--tokenizer", "gpt2", "--out", str(tmp_path / "out"), "--quiet",
            "--workers", "2", "--unit-mb", "0.01")
    first = _tool(*args)
    assert first.returncode == 1 and "Traceback" not in first.stderr
    assert f"{zst.resolve()}: truncated zstandard data" in first.stderr and "1 of " in first.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()
    units = len(_job(corpus, tmp_path / "out", unit_bytes=int(0.01 * 2**20)).units)

    zst.write_bytes(intact)  # copied again
    second = _tool(*args)
    assert second.returncode == 0, second.stderr
    assert f"resuming: {units - 1} of {units} inputs already tokenized" in second.stdout
    third = _tool(*args)
    assert third.returncode == 0 and "up to date" in third.stdout


def test_cli_refuses_a_bit_flip_in_a_checksummed_zst_and_commits_nothing(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    zst = corpus / "plays.jsonl.zst"
    write_jsonl_zst(zst, [{"text": f"bottom were as deep as the sea {i} " * 30} for i in range(100)])
    damaged = bytearray(zst.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01  # a flip in the middle of the file
    zst.write_bytes(bytes(damaged))
    out = _tool("--input", str(corpus), "--tokenizer", "gpt2", "--out", str(tmp_path / "out"), "--quiet",
                "--workers", "0")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"{zst.resolve()}: corrupt zstandard data in the frame at compressed byte 0" in out.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not list((tmp_path / "out").glob("*.bin"))


def test_units_failed_lists_every_bad_file_after_the_others_finish(tmp_path):
    corpus = write_corpus(tmp_path, files=4)
    for name in ("part01.jsonl.zst", "part03.jsonl.zst"):
        (corpus / name).write_bytes(b"\xff" * 32)
    job = _job(corpus, tmp_path / "out")
    with pytest.raises(UnitsFailed) as err:
        job.run(workers=0, progress=False)
    assert [d.rsplit("/", 1)[-1] for d, _ in err.value.failures] == ["part01.jsonl.zst", "part03.jsonl.zst"]
    assert "Unknown frame descriptor" in str(err.value)
    assert len(job.pending()) == 2  # everything else is recorded as done
