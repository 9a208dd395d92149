"""Corpora and tokenizers for the corpus-pipeline tests (importable by spawned worker processes,
which unpickle these classes by module name)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import zstandard

from conftest import ByteTokenizer, _documents


class SlowByteTokenizer(ByteTokenizer):
    """ByteTokenizer that takes ``delay_s`` per encode batch, so that a run can be killed midway."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def encode_batch(self, texts):
        time.sleep(self.delay_s)
        return super().encode_batch(texts)


def jsonl(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


def write_corpus(root: Path, files: int = 6, docs_per_file: int = 60, seed: int = 0) -> Path:
    """``files`` corpus files of pseudo-English, alternating ``.jsonl`` and ``.jsonl.zst``, in
    ``root/corpus``; every third file also has a ``.txt`` beside it."""
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    docs = _documents(files * docs_per_file, seed=seed)
    for k in range(files):
        blob = jsonl(docs[k * docs_per_file:(k + 1) * docs_per_file])
        if k % 2:
            (corpus / f"part{k:02d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(blob))
        else:
            (corpus / f"part{k:02d}.jsonl").write_bytes(blob)
        if k % 3 == 0:
            (corpus / f"part{k:02d}b.txt").write_text(docs[k] + " (as a text file)")
    return corpus


def tree(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` except the work directory: name → bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and ".tokenize" not in p.parts}
