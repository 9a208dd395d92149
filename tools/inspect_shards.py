#!/usr/bin/env python
"""Summarise a token-shard directory, and optionally decode the start of a shard.

    python tools/inspect_shards.py data/demo/shards
    python tools/inspect_shards.py data/demo/shards --decode 200 --tokenizer data/demo/tokenizer.json
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from moetrain.data.reader import TokenShards  # noqa: E402
from moetrain.data.tokenizer import load_tokenizer  # noqa: E402
from moetrain.data.verify import verify_shards  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", help="shard directory (holding manifest.json)")
    parser.add_argument("--verify", choices=("sha256", "size", "none"), default="size",
                        help="check before reading (default: %(default)s)")
    parser.add_argument("--decode", type=int, metavar="N",
                        help="decode the first N tokens of a shard (needs --tokenizer)")
    parser.add_argument("--tokenizer", metavar="SPEC", help="'gpt2' or a tokenizer.json")
    parser.add_argument("--split", default="train", help="split to decode from (default: %(default)s)")
    parser.add_argument("--shard", type=int, default=0, help="shard to decode from (default: %(default)s)")
    args = parser.parse_args()
    if args.decode is not None and args.tokenizer is None:
        parser.exit(1, f"{parser.prog}: error: --decode needs --tokenizer (the one the shards were written with)\n")
    try:
        m = verify_shards(args.dir, args.verify)
        tok = m["tokenizer"]
        print(f"{args.dir}: format {m['format']} v{m['format_version']}, {m['dtype']}, "
              f"vocab_size {m['vocab_size']}, eos_id {m['eos_id']}")
        print(f"tokenizer: {tok['name']} (vocab {tok['vocab_size']}, sha256 {tok['sha256'][:16]}…)")
        print(f"validation split: {m['val_split']['description']}; sources: {', '.join(m['sources']) or '-'}")
        for name, split in m["splits"].items():
            print(f"{name:5s}: {split['tokens']:>13,} tokens  {split['documents']:>9,} documents  "
                  f"{len(split['shards'])} shards")
            for sh in split["shards"]:
                print(f"    {sh['name']}: {sh['tokens']:>13,} tokens  {sh['documents']:>9,} documents  "
                      f"{sh['bytes']:>13,} bytes  sha256 {sh['sha256'][:16]}…")
        print(f"total: {m['total_tokens']:,} tokens")
        if args.decode is not None:
            tokenizer = load_tokenizer(args.tokenizer)
            if tokenizer.identity["sha256"] != tok["sha256"]:
                print(f"warning: {args.tokenizer} is not the tokenizer these shards were written with", file=sys.stderr)
            shards = TokenShards(args.dir, args.split, verify="none")
            if not 0 <= args.shard < len(shards.shards):
                raise ValueError(f"--shard {args.shard}: split {args.split!r} has {len(shards.shards)} shards")
            ids = shards.shard_tokens(args.shard)[: args.decode]
            print(f"--- first {len(ids)} tokens of {shards.shards[args.shard]['name']} ---")
            print(tokenizer.decode(ids))
    except (OSError, ValueError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
