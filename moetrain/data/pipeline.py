"""Corpus → token shards at pre-training scale: parallel, resumable, tolerant of broken documents.

A :class:`TokenizeJob` runs in three phases:

1. **plan** — the inputs become input units (:func:`moetrain.data.corpus.plan_units`: whole
   files, byte ranges of large ``.jsonl``, row-group ranges of large ``.parquet``). A unit's
   *key* hashes the unit (file, range, size, mtime) and every setting that changes its tokens
   (tokenizer sha256 — which covers the BOS / EOS framing —, EOS and BOS ids, text key,
   ``on_bad_document``, token dtype).
2. **tokenize** — each unit, in any process, on any node, in any order, is read, encoded and
   written to ``<out>/.tokenize/parts/<key>.tokens`` (its documents' ids, each ``[BOS] + text +
   EOS``, back to back) and ``<key>.lengths`` (int64 tokens per document), then its completion record
   ``<key>.json`` (documents, tokens, skipped documents per reason and a sample of where, the
   node, seconds) — written last, so a record means the unit is done. A rerun after a kill or a
   preemption skips the units that have a record and redoes the others.
3. **merge** — once every unit has a record, the parts are read in plan order into a
   :class:`~moetrain.data.writer.ShardWriter` (validation split by stream position, shards of
   ``shard_tokens``, or Megatron ``.bin/.idx``), which writes the manifest; the skipped-document
   sample goes to ``<out>/skipped_documents.jsonl``. Then the parts are deleted (unless
   ``keep_parts``) and ``<out>/.tokenize/complete.json`` records the job's fingerprint, so that
   running a finished job again does nothing.

A unit's tokens depend only on the unit and the settings, and the merge reads the units in plan
order, so the result is the same, byte for byte, for any number of workers, any number of
nodes, and any interruptions; and the same as :func:`~moetrain.data.writer.write_shards` over
:func:`~moetrain.data.corpus.iter_documents` of the inputs when no document is skipped.

Local parallelism (:meth:`TokenizeJob.run`): ``workers`` processes (spawned, so that no thread
state of the caller is forked), each encoding one unit at a time with one thread — the
speed-up comes from processes, which also parallelise reading, decompression and JSON parsing.
Many nodes: ``moetrain.data.slurm_array`` runs groups of units as a SLURM array job.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moetrain.data.corpus import (
    DEFAULT_UNIT_BYTES,
    BadDocument,
    InputUnit,
    OnBad,
    ReadProgress,
    SkipLog,
    plan_units,
    read_unit,
)
from moetrain.data.chat import MASK_RULE, ChatEncoder, ChatError
from moetrain.data.format import DEFAULT_SHARD_TOKENS, ShardError, TokenizerLike, read_manifest, token_dtype
from moetrain.data.verify import verify_shards
from moetrain.data.writer import Layout, ShardWriter, batch_texts, encode_documents
from moetrain.utils import atomic_write

__all__ = ["TokenizeJob", "RunSummary", "UnitsFailed", "IncompleteError", "available_cpus", "WORK_DIR",
           "SKIPPED_LOG"]

WORK_DIR = ".tokenize"
SKIPPED_LOG = "skipped_documents.jsonl"
_SKIP_SAMPLE_PER_UNIT = 20
_SKIP_SAMPLE_TOTAL = 1000
_MERGE_WINDOW_TOKENS = 2**24  # tokens handed to the ShardWriter at once: bounds the merge's memory


class UnitsFailed(RuntimeError):
    """Some units could not be tokenized (a corrupt file, or a bad document under ``fail``).

    ``failures``: ``[(unit description, error message)]``. Finished units keep their records, so
    a rerun after fixing or removing the named files redoes only what is missing.
    """

    def __init__(self, failures: list[tuple[str, str]], total: int, what: str = "inputs"):
        self.failures, self.total, self.what = failures, total, what
        lines = "\n".join(f"  {msg}" for _, msg in failures[:20])
        more = f"\n  ... and {len(failures) - 20} more" if len(failures) > 20 else ""
        super().__init__(f"{len(failures)} of {total} {what} failed (finished inputs are kept; fix or "
                         f"remove the files named here and run again):\n{lines}{more}")

    def __reduce__(self):
        return type(self), (self.failures, self.total, self.what)


class IncompleteError(RuntimeError):
    """:meth:`TokenizeJob.merge` was called before every unit had a completion record."""


class _Stopped(Exception):
    """A worker abandoned its unit because the run is stopping (another unit failed)."""


class _Progress:
    """The run's bar in input bytes (each unit's reports capped at its weight, so that reading
    a little past a byte range does not overshoot), with documents and tokens/s."""

    def __init__(self, units: list[InputUnit], bar: tqdm):
        self.units, self.bar = units, bar
        self.sent: Counter = Counter()
        self.docs = self.tokens = self.skipped = 0
        self.t0 = time.perf_counter()

    def advance(self, i: int, raw: int, docs: int, tokens: int) -> None:
        step = min(raw, self.units[i].weight - self.sent[i])
        self.sent[i] += step
        self.docs += docs
        self.tokens += tokens
        self.bar.update(step)
        self.bar.set_postfix(docs=f"{self.docs:,}", tok_s=f"{self.tokens / (time.perf_counter() - self.t0):,.0f}",
                             skipped=self.skipped, refresh=False)

    def finish(self, i: int) -> None:
        self.advance(i, self.units[i].weight, 0, 0)


@dataclass
class RunSummary:
    """What :meth:`TokenizeJob.run` did: unit counts, and documents/tokens of the units it
    tokenized now (not of those finished before)."""

    units: int
    already_done: int = 0
    tokenized: int = 0
    documents: int = 0
    tokens: int = 0
    skipped: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    up_to_date: bool = False


def available_cpus() -> int:
    """CPUs this process may use: ``SLURM_CPUS_PER_TASK`` inside a SLURM task, else the
    scheduler affinity (what ``taskset`` / cgroups allow), else ``os.cpu_count()``."""
    if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return int(os.environ["SLURM_CPUS_PER_TASK"])
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class TokenizeJob:
    """Tokenize a corpus into a shard directory: plan at construction, then :meth:`run`
    (here, or as a SLURM array) and :meth:`merge` (module docstring).

    Args:
        inputs: corpus files or directories, in stream order.
        tokenizer: a ``TextTokenizer`` (or anything :class:`~moetrain.data.format.TokenizerLike`);
            it is pickled to worker processes and SLURM tasks.
        out_dir: the shard directory; the work files live in ``<out_dir>/.tokenize``.
        text_key: JSON key / parquet column of the text.
        on_bad_document: ``"skip"`` (count per reason in the manifest, a sample in
            ``skipped_documents.jsonl``) or ``"fail"`` (the first bad document stops the run,
            naming its file and line).
        shard_tokens, val_fraction, val_docs, layout: as :class:`~moetrain.data.writer.ShardWriter`.
        unit_bytes: ``.jsonl`` / ``.parquet`` files larger than this (bytes) are split into units.
        batch_docs, batch_chars: encode batches, as :func:`~moetrain.data.writer.write_shards`.
        keep_parts: keep the per-unit parts after the merge (a later run with other shard or
            split settings then re-merges without re-tokenizing).
        chat: fine-tuning records (:mod:`moetrain.data.chat`) encoded with this encoder, with a
            loss mask (a ``<key>.mask`` part per unit, ``.mask`` files beside the shards); None:
            text documents.
        pack_seq_len: with ``chat``, pack the records into sequences of this length
            (:class:`~moetrain.data.writer.ShardWriter`).

    Raises:
        FileNotFoundError, ValueError: bad inputs (see :func:`~moetrain.data.corpus.plan_units`)
            or settings.
    """

    def __init__(self, inputs: Sequence[str | os.PathLike], tokenizer: TokenizerLike, out_dir: str | os.PathLike, *,
                 text_key: str = "text", on_bad_document: OnBad = "skip",
                 shard_tokens: int = DEFAULT_SHARD_TOKENS, val_fraction: float | None = None,
                 val_docs: int | None = None, layout: Layout = "moetrain", unit_bytes: int = DEFAULT_UNIT_BYTES,
                 batch_docs: int = 256, batch_chars: int = 8 * 2**20, keep_parts: bool = False,
                 chat: ChatEncoder | None = None, pack_seq_len: int | None = None):
        if on_bad_document not in ("skip", "fail"):
            raise ValueError(f"on_bad_document={on_bad_document!r}: must be 'skip' or 'fail'")
        self.sources = [str(p) for p in inputs]
        self.tokenizer = tokenizer
        self.chat = chat
        self.out = Path(out_dir).resolve()  # SLURM tasks may start elsewhere
        self.text_key, self.on_bad = text_key, on_bad_document
        self.writer_args = dict(shard_tokens=shard_tokens, val_fraction=val_fraction, val_docs=val_docs, layout=layout)
        if chat is not None:
            self.writer_args.update(loss_mask=True, pack_seq_len=pack_seq_len)
        # Check the shard settings now, not after hours of tokenizing.
        ShardWriter.check_args(vocab_size=tokenizer.vocab_size, **self.writer_args)
        self.batch_docs, self.batch_chars, self.keep_parts = batch_docs, batch_chars, keep_parts
        self.units: list[InputUnit] = plan_units(inputs, unit_bytes)
        self.dtype = token_dtype(tokenizer.vocab_size)  # of the parts; the merge converts for Megatron
        settings = {"tokenizer": tokenizer.identity.get("sha256"), "text_key": text_key,
                    "on_bad_document": on_bad_document, "dtype": self.dtype.str, "eos_id": tokenizer.eos_id}
        if tokenizer.bos_id is not None:  # only then: the keys of parts written before BOS existed stay valid
            settings["bos_id"] = tokenizer.bos_id
        if chat is not None:  # records with masks: another kind of part, keyed by the template too
            settings["chat"] = [chat.template.sha256 if chat.template is not None else "prompt-completion", MASK_RULE]
        self.keys = [hashlib.sha256(json.dumps([u.to_dict(), settings], sort_keys=True).encode()).hexdigest()[:32]
                     for u in self.units]
        self.work = self.out / WORK_DIR
        self.parts = self.work / "parts"

    # -- state on disk -------------------------------------------------------------------------

    def _part(self, i: int, ext: str) -> Path:
        return self.parts / f"{self.keys[i]}.{ext}"

    def record(self, i: int) -> dict | None:
        """Unit ``i``'s completion record, or ``None`` when it is missing, unreadable, or its
        part files do not have the sizes it lists (then the unit is tokenized again)."""
        try:
            rec = json.loads(self._part(i, "json").read_text())
            ok = (rec["key"] == self.keys[i]
                  and self._part(i, "tokens").stat().st_size == rec["tokens"] * self.dtype.itemsize
                  and self._part(i, "lengths").stat().st_size == rec["documents"] * 8
                  and (self.chat is None or self._part(i, "mask").stat().st_size == rec["tokens"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return rec if ok else None

    def pending(self, indices: Sequence[int] | None = None) -> list[int]:
        """Units (of ``indices``, default all) without a valid completion record."""
        return [i for i in (range(len(self.units)) if indices is None else indices) if self.record(i) is None]

    def fingerprint(self) -> str:
        """Hash of everything the result depends on: unit keys, shard settings, sources, tokenizer."""
        what = [self.keys, self.writer_args, self.sources, self.tokenizer.identity, self.tokenizer.vocab_size]
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()

    def is_complete(self) -> bool:
        """Whether ``out_dir`` already holds this job's result (same fingerprint, files present
        with the manifest's sizes)."""
        try:
            done = json.loads((self.work / "complete.json").read_text())
            if done.get("fingerprint") != self.fingerprint():
                return False
            verify_shards(self.out, "size")
        except (OSError, ValueError, ShardError):
            return False
        return True

    def groups(self, n: int) -> list[list[int]]:
        """Unit indices cut into ``n`` groups of about equal bytes (largest unit first to the
        least loaded group), each in plan order. Deterministic: depends on the units only."""
        if n < 1:
            raise ValueError(f"groups: n={n} must be >= 1")
        load, out = [0] * n, [[] for _ in range(n)]
        for i in sorted(range(len(self.units)), key=lambda i: (-self.units[i].weight, i)):
            g = min(range(n), key=lambda g: (load[g], g))
            load[g] += self.units[i].weight
            out[g].append(i)
        return [sorted(g) for g in out]

    # -- phase 2: one unit ------------------------------------------------------------------

    def tokenize_unit(self, i: int, report: Callable[[int, int, int], None] | None = None,
                      should_stop: Callable[[], bool] | None = None) -> dict:
        """Tokenize unit ``i`` into its part files and write its completion record; return it.

        Args:
            report: called after each encode batch with (raw bytes read since the last call,
                documents, tokens) of that batch.
            should_stop: polled between batches; when it returns True the unit is abandoned
                (no record is written).

        Raises:
            BadDocument: a broken document under ``on_bad_document="fail"``.
            CorruptInputError, ValueError, OSError, ImportError: see
                :func:`~moetrain.data.corpus.read_unit`.
        """
        unit, t0 = self.units[i], time.perf_counter()
        self.parts.mkdir(parents=True, exist_ok=True)
        skipped, progress = SkipLog(_SKIP_SAMPLE_PER_UNIT), ReadProgress()
        tag = f".tmp-{socket.gethostname()}-{os.getpid()}"
        tmp = {ext: self.parts / f".{self.keys[i]}.{ext}{tag}"
               for ext in ("tokens", "lengths", *(("mask",) if self.chat is not None else ()))}
        documents = tokens = reported = 0
        try:
            files = {ext: open(path, "wb") for ext, path in tmp.items()}
            try:
                for batch in self._encoded_batches(unit, skipped, progress):
                    if should_stop is not None and should_stop():
                        raise _Stopped()
                    ids, lengths = batch[0], batch[1]
                    files["tokens"].write(ids.tobytes())
                    files["lengths"].write(lengths.astype("<i8").tobytes())
                    if self.chat is not None:
                        files["mask"].write(batch[2].tobytes())
                    documents += len(lengths)
                    tokens += len(ids)
                    if report is not None:
                        report(progress.raw_bytes - reported, len(lengths), len(ids))
                        reported = progress.raw_bytes
                for f in files.values():  # durable before the rename (moetrain.utils.atomic_write)
                    f.flush()
                    os.fsync(f.fileno())
            finally:
                for f in files.values():
                    f.close()
            for ext, path in tmp.items():
                os.replace(path, self._part(i, ext))
        except BaseException:
            for path in tmp.values():
                path.unlink(missing_ok=True)
            raise
        rec = {"key": self.keys[i], "unit": unit.to_dict(), "documents": documents, "tokens": tokens,
               "skipped": dict(sorted(skipped.counts.items())), "skipped_sample": skipped.sample,
               "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
               "seconds": round(time.perf_counter() - t0, 3)}
        atomic_write(self._part(i, "json"), json.dumps(rec, indent=1) + "\n")
        return rec

    def _encoded_batches(self, unit: InputUnit, skipped: SkipLog, progress: ReadProgress):
        """The unit's documents encoded, batch by batch: ``(tokens, lengths)``, or with ``chat``
        ``(tokens, lengths, mask)``. A record the chat template cannot render is a bad document
        (reason ``bad_chat``), skipped or raised as ``on_bad_document`` says."""
        if self.chat is None:
            texts = (t for _, t in read_unit(unit, self.text_key, self.on_bad, skipped, progress) if t)
            for batch in batch_texts(texts, self.batch_docs, self.batch_chars):
                yield encode_documents(self.tokenizer, batch, self.dtype)
            return
        ids, lengths, masks = [], [], []
        for doc_id, record in read_unit(unit, self.text_key, self.on_bad, skipped, progress, chat=True):
            try:
                i, m = self.chat.encode(record)
            except ChatError as e:
                bad = BadDocument(unit.path, doc_id.rpartition(":")[2] or doc_id, "bad_chat", str(e))
                if self.on_bad == "fail":
                    raise bad from None
                skipped.add(bad)
                continue
            ids.append(np.asarray(i, dtype=self.dtype))
            masks.append(np.asarray(m, dtype=np.uint8))
            lengths.append(len(i))
            if len(lengths) >= self.batch_docs:
                yield np.concatenate(ids), np.asarray(lengths, dtype=np.int64), np.concatenate(masks)
                ids, lengths, masks = [], [], []
        if lengths:
            yield np.concatenate(ids), np.asarray(lengths, dtype=np.int64), np.concatenate(masks)

    # -- phase 2: many units ------------------------------------------------------------------

    def run(self, workers: int | None = None, progress: bool = True, group: tuple[int, int] | None = None) -> RunSummary:
        """Tokenize the units that have no completion record yet.

        Args:
            workers: processes; ``None``: :func:`available_cpus`; ``0``: in this process (with
                the tokenizer's own threads; for debugging and tests).
            progress: a tqdm bar on stderr (input bytes, documents, tokens/s).
            group: ``(g, n)``: only the units of group ``g`` of :meth:`groups` ``(n)`` (a SLURM
                array task).

        Returns:
            A :class:`RunSummary`; ``up_to_date`` when the job had been merged already.

        Raises:
            BadDocument: under ``on_bad_document="fail"``, the first one (other units stop).
            UnitsFailed: units that could not be read (corrupt files), after the others finished.
        """
        t0 = time.perf_counter()
        mine = list(range(len(self.units))) if group is None else self.groups(group[1])[group[0]]
        summary = RunSummary(units=len(mine))
        if group is None and self.is_complete():
            summary.up_to_date, summary.already_done = True, len(mine)
            return summary
        todo = self.pending(mine)
        summary.already_done = len(mine) - len(todo)
        workers = available_cpus() if workers is None else workers
        total = sum(self.units[i].weight for i in mine)
        bar = tqdm(total=total, initial=total - sum(self.units[i].weight for i in todo), unit="B",
                   unit_scale=True, dynamic_ncols=True, disable=not progress or not todo,
                   desc=f"tokenize {len(todo)} of {len(mine)} inputs")
        failures: list[tuple[str, str]] = []
        try:
            runner = self._run_here if workers == 0 else self._run_pool
            runner(todo, min(workers, len(todo)), _Progress(self.units, bar), summary, failures)
        finally:
            bar.close()
        summary.seconds = time.perf_counter() - t0
        if failures:
            raise UnitsFailed(failures, len(mine))
        return summary

    def _settle(self, i: int, result: Callable[[], dict], progress: _Progress, summary: RunSummary,
                failures: list) -> None:
        """Account for unit ``i`` once ``result()`` returns its record or raises: a bad
        document under ``fail`` (or a stop) propagates; a file that cannot be read is noted and
        the run goes on with the other units."""
        try:
            rec = result()
        except (BadDocument, _Stopped):
            raise
        except (ValueError, OSError, ImportError) as e:
            failures.append((self.units[i].describe(), str(e)))
            return
        summary.tokenized += 1
        summary.documents += rec["documents"]
        summary.tokens += rec["tokens"]
        summary.skipped.update(rec["skipped"])
        progress.skipped = sum(summary.skipped.values())
        progress.finish(i)

    def _run_here(self, todo, _workers, progress, summary, failures) -> None:
        for i in todo:
            self._settle(i, lambda: self.tokenize_unit(i, partial(progress.advance, i)), progress, summary, failures)

    def _run_pool(self, todo, workers, progress, summary, failures) -> None:
        if not todo:
            return
        ctx = mp.get_context("spawn")
        messages, stop = ctx.Queue(), ctx.Event()
        pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                                   initargs=(self, messages, stop))
        try:
            # Largest first: the long units start early, the small ones fill the gaps at the end.
            order = sorted(todo, key=lambda i: (-self.units[i].weight, i))
            futures: dict[Future, int] = {pool.submit(_worker_unit, i): i for i in order}
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                while True:  # the workers' progress messages
                    try:
                        progress.advance(*messages.get_nowait())
                    except queue.Empty:
                        break
                for f in finished:
                    try:
                        self._settle(futures[f], f.result, progress, summary, failures)
                    except _Stopped:
                        continue
                    except BadDocument:
                        stop.set()
                        raise
        except BaseException:
            stop.set()  # running units give up at their next batch; queued ones are cancelled
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)

    # -- phase 3 ---------------------------------------------------------------------------------

    def merge(self, progress: bool = True) -> dict:
        """Write the shards and the manifest from the parts, in plan order; return the manifest
        (the existing one, untouched, when this job was merged before).

        Raises:
            IncompleteError: a unit has no completion record (names the first few).
            ValueError: no documents, or all of them in the val split (see ``ShardWriter.finish``).
        """
        if self.is_complete():  # merged before, parts gone: the result is there
            return read_manifest(self.out)
        records = [self.record(i) for i in range(len(self.units))]
        missing = [self.units[i].describe() for i, r in enumerate(records) if r is None]
        if missing:
            raise IncompleteError(f"{len(missing)} of {len(self.units)} inputs are not tokenized yet "
                                  f"(e.g. {', '.join(missing[:3])}); run the tokenize step again")
        writer = ShardWriter(self.out, vocab_size=self.tokenizer.vocab_size, eos_id=self.tokenizer.eos_id,
                             bos_id=self.tokenizer.bos_id, tokenizer_identity=self.tokenizer.identity,
                             **self.writer_args)
        skipped, sample = Counter(), []
        bar = tqdm(total=sum(r["tokens"] for r in records), unit=" tokens", unit_scale=True, dynamic_ncols=True,
                   disable=not progress, desc=f"merge → {self.out}")
        try:
            for i, rec in enumerate(records):
                skipped.update(rec["skipped"])
                sample.extend(rec["skipped_sample"][: max(0, _SKIP_SAMPLE_TOTAL - len(sample))])
                if rec["documents"]:
                    self._merge_unit(i, writer, bar)
            total = sum(skipped.values())
            extra = {"skipped_documents": {"total": total, "by_reason": dict(sorted(skipped.items())),
                                           "log": SKIPPED_LOG if total else None}}
            if self.chat is not None and self.chat.template is not None:
                # The export ships it with the model (moetrain.hf): what the fine-tuned model was trained on.
                t = self.chat.template
                extra["chat"] = {"template": t.template, "source": t.source, "sha256": t.sha256}
            manifest = writer.finish(self.sources, extra)
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
        if sample:
            atomic_write(self.out / SKIPPED_LOG, "".join(json.dumps(s) + "\n" for s in sample))
        else:
            (self.out / SKIPPED_LOG).unlink(missing_ok=True)
        if not self.keep_parts:
            shutil.rmtree(self.parts, ignore_errors=True)
        else:  # temporary files of killed workers; nothing else runs once every unit is done
            for stale in self.parts.glob(".*.tmp-*"):
                stale.unlink(missing_ok=True)
        atomic_write(self.work / "complete.json", json.dumps({"fingerprint": self.fingerprint()}))
        return manifest

    def _merge_unit(self, i: int, writer: ShardWriter, bar: tqdm) -> None:
        tokens = np.memmap(self._part(i, "tokens"), dtype=self.dtype, mode="r")
        mask = np.memmap(self._part(i, "mask"), dtype=np.uint8, mode="r") if self.chat is not None else None
        lengths = np.fromfile(self._part(i, "lengths"), dtype="<i8")
        ends = np.cumsum(lengths)
        a = 0
        while a < len(lengths):
            # Documents [a, b): at least one, and at most a window of tokens.
            start = int(ends[a - 1]) if a else 0
            b = max(a + 1, int(np.searchsorted(ends, start + _MERGE_WINDOW_TOKENS, side="right")))
            stop = int(ends[b - 1])
            writer.add(tokens[start:stop], lengths[a:b], *([mask[start:stop]] if mask is not None else []))
            bar.update(stop - start)
            a = b
        del tokens, mask


# -- worker processes ------------------------------------------------------------------------

_JOB: TokenizeJob | None = None
_MESSAGES = None
_STOP = None


def _worker_init(job: TokenizeJob, messages, stop) -> None:
    global _JOB, _MESSAGES, _STOP
    # One encoding thread per worker: the processes are the parallelism; the Rust thread pool
    # on top would oversubscribe the cores (and these are read when encoding, not at import).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    _JOB, _MESSAGES, _STOP = job, messages, stop


def _worker_unit(i: int) -> dict:
    return _JOB.tokenize_unit(i, lambda raw, docs, toks: _MESSAGES.put((i, raw, docs, toks)), _STOP.is_set)
