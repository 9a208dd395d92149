#!/usr/bin/env python
"""Train a byte-level BPE tokenizer (HF tokenizers) with an <|endoftext|> EOS; save tokenizer.json.

    python tools/train_tokenizer.py --input data/demo/corpus --vocab-size 8192 --out data/demo/tokenizer.json

Inputs are .jsonl, .jsonl.zst, .txt, .parquet files or directories of them (moetrain/data/corpus.py).
The same inputs give a byte-identical tokenizer.json. Documents tokenized with it end with
<|endoftext|> and have no BOS; to write data for a pretrained model's family, pass that model's
tokenizer directory to tools/tokenize_corpus.py --tokenizer instead (its own BOS / EOS are used).
"""

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import zstandard  # noqa: E402

from moetrain.data.corpus import iter_documents, list_corpus_files  # noqa: E402
from moetrain.data.tokenizer import train_bpe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH", help="corpus files or directories")
    parser.add_argument("--vocab-size", type=int, required=True, help="ids in total, <|endoftext|> included")
    parser.add_argument("--out", required=True, help="where to write tokenizer.json")
    parser.add_argument("--text-key", default="text",
                        help="JSON key / parquet column of the text (default: %(default)s)")
    parser.add_argument("--min-frequency", type=int, default=2,
                        help="least count of a merged pair (default: %(default)s)")
    args = parser.parse_args()
    try:
        for path in args.input:  # fail on a bad path before training starts
            list_corpus_files(path)
        t0 = time.perf_counter()
        docs = itertools.chain.from_iterable(iter_documents(p, args.text_key) for p in args.input)
        tok = train_bpe(docs, args.vocab_size, args.out, min_frequency=args.min_frequency, show_progress=True)
    except (OSError, ValueError, ImportError, zstandard.ZstdError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    print(f"wrote {args.out}: vocab_size {tok.vocab_size}, eos_id {tok.eos_id}, "
          f"sha256 {tok.identity['sha256'][:16]}… in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
