#!/usr/bin/env python
"""Train on existing Megatron-LM data: describe its .bin/.idx files with a shard manifest, in place.

    python tools/import_megatron.py --train /data/pile_text_document --tokenizer gpt2 \\
        --val-last-docs 1000 --out data/pile
    # then, in the run config:  data: {path: data/pile}

Nothing is copied: OUT/manifest.json lists the Megatron files where they are, with their sizes
and sha256 (one read of every file), so training verifies them like any shards. Several --train
prefixes (e.g. the files of a blend) become the shards of the train split, in order. The
validation split is --val PREFIX ... (separate files) or --val-last-docs N (the last N documents
of the last train prefix, where Megatron's --split puts validation too). The tokenizer (any spec
tools/tokenize_corpus.py takes) gives the vocabulary size and the EOS and BOS ids recorded in the
manifest; without one, give --vocab-size and --eos-id (and --bos-id when documents start with one).

The other direction: tools/tokenize_corpus.py --format megatron writes Megatron files.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from moetrain.data.megatron import import_megatron  # noqa: E402
from moetrain.data.tokenizer import load_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", nargs="+", required=True, metavar="PREFIX",
                        help="Megatron dataset prefixes (PREFIX.bin + PREFIX.idx)")
    val = parser.add_mutually_exclusive_group()
    val.add_argument("--val", nargs="+", default=[], metavar="PREFIX", help="validation dataset prefixes")
    val.add_argument("--val-last-docs", type=int, default=0, metavar="N",
                     help="hold out the last N documents of the last --train prefix")
    parser.add_argument("--tokenizer", metavar="SPEC",
                        help="the tokenizer the data was written with: 'gpt2', a tokenizer.json, or a tokenizer or "
                             "model directory (tokenizer.json with tokenizer_config.json / special_tokens_map.json)")
    parser.add_argument("--vocab-size", type=int, help="without --tokenizer: the vocabulary size")
    parser.add_argument("--eos-id", type=int, help="without --tokenizer: the end-of-document id")
    parser.add_argument("--bos-id", type=int, help="without --tokenizer: the id that starts each document, if any")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for manifest.json (created)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()
    if (args.tokenizer is None) == (args.vocab_size is None or args.eos_id is None):
        parser.error("give --tokenizer, or both --vocab-size and --eos-id")
    if args.tokenizer is not None and args.bos_id is not None:
        parser.error("--bos-id goes with --vocab-size and --eos-id; with --tokenizer the tokenizer gives it")
    try:
        if args.tokenizer is not None:
            tok = load_tokenizer(args.tokenizer)
            vocab_size, eos_id, bos_id, identity = tok.vocab_size, tok.eos_id, tok.bos_id, tok.identity
        else:
            vocab_size, eos_id, bos_id = args.vocab_size, args.eos_id, args.bos_id
            identity = {"name": "unknown (imported Megatron data)", "vocab_size": vocab_size, "sha256": "unknown"}
        m = import_megatron(args.train, args.out, vocab_size=vocab_size, eos_id=eos_id, bos_id=bos_id,
                            tokenizer_identity=identity, val=args.val, val_last_docs=args.val_last_docs,
                            progress=not args.quiet)
    except (OSError, ValueError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    for name, split in m["splits"].items():
        print(f"{name:5s}: {split['tokens']:>13,} tokens  {split['documents']:>9,} documents  "
              f"{len(split['shards'])} files")
    print(f"wrote {args.out}/manifest.json ({m['dtype']}, vocab_size {vocab_size}); use it as data.path")


if __name__ == "__main__":
    main()
