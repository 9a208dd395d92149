#!/usr/bin/env python
"""Tokenize a corpus into checksummed train/val token shards with a manifest.json.

    python tools/tokenize_corpus.py --input data/demo/corpus --tokenizer data/demo/tokenizer.json \\
        --out data/demo/shards --val-fraction 0.01

Every document is followed by EOS. Validation split: with --val-fraction F, the documents at
0-based input position i with i % round(1/F) == 0; with --val-docs N, the first N documents.
Format: moetrain/data/shards.py. Check a result with tools/inspect_shards.py.
"""

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import zstandard  # noqa: E402

from moetrain.data.corpus import iter_documents, list_corpus_files  # noqa: E402
from moetrain.data.shards import DEFAULT_SHARD_TOKENS, write_shards  # noqa: E402
from moetrain.data.tokenizer import load_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="corpus files or directories, read in this order")
    parser.add_argument("--tokenizer", required=True, metavar="SPEC", help="'gpt2' or a tokenizer.json")
    parser.add_argument("--out", required=True, metavar="DIR", help="shard directory (created)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help="tokens per shard (default: %(default)s)")
    val = parser.add_mutually_exclusive_group()
    val.add_argument("--val-fraction", type=float, help="hold out every round(1/F)-th document (default: 0.01)")
    val.add_argument("--val-docs", type=int, help="hold out the first N documents")
    parser.add_argument("--text-key", default="text",
                        help="JSON key / parquet column of the text (default: %(default)s)")
    parser.add_argument("--batch-docs", type=int, default=256, help="documents per encode batch (default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()
    try:
        for path in args.input:  # fail on a bad path before any work
            list_corpus_files(path)
        tokenizer = load_tokenizer(args.tokenizer)
        t0 = time.perf_counter()
        docs = itertools.chain.from_iterable(iter_documents(p, args.text_key) for p in args.input)
        manifest = write_shards(
            docs, tokenizer, args.out, shard_tokens=args.shard_tokens, val_fraction=args.val_fraction,
            val_docs=args.val_docs, sources=args.input, batch_docs=args.batch_docs, progress=not args.quiet,
        )
    except (OSError, ValueError, ImportError, zstandard.ZstdError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    seconds = time.perf_counter() - t0
    for name, split in manifest["splits"].items():
        print(f"{name:5s}: {split['tokens']:>13,} tokens  {split['documents']:>9,} documents  "
              f"{len(split['shards'])} shards")
    print(f"wrote {args.out}/manifest.json ({manifest['dtype']}, tokenizer {manifest['tokenizer']['name']}) in "
          f"{seconds:.1f} s, {manifest['total_tokens'] / seconds:,.0f} tokens/s")


if __name__ == "__main__":
    main()
