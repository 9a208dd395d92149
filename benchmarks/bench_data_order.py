"""The data path at 1T and 20T tokens: a rank's resident memory and time to its first batch
(moetrain's computed sample order, shards mapped when read) against the order it replaced (a full
in-memory permutation, every shard mapped at open) and Megatron-Core's ``GPTDataset`` index build,
in the same run. Prints JSON.

1. **The corpus**: 4-byte tokens (``uint32``, ``vocab_size`` 128256 as Llama 3's) in *sparse*
   files (``truncate``: nothing written, no disk used), described by a hand-written version-1
   ``manifest.json`` (:mod:`moetrain.data.format`) whose sha256 fields are placeholders of the
   real length (the reader is run with ``--verify size`` or ``none``: the output says which) and
   one document per ``--tokens-per-document`` tokens (sparse ``.idx`` files of the right size;
   document masks are not used). Layouts (``--layouts``): ``2^30`` tokens per shard (~930 files
   at 1T, ~18,600 at 20T), ``multi-TB`` (shards of ``--big-shard-tokens``, 4T tokens = 16 TB:
   one file at 1T, five at 20T) and, optionally, ``2^27`` (the tokenizer's default shard size:
   ~149,000 files at 20T). Corpus sizes ``--corpus`` (default 1T and 20T tokens). All of it
   under a temporary directory (``--tmp``), deleted at the end unless ``--keep``.
2. **moetrain's data path**, per (layout, size) in a fresh process so that its memory is its own:
   VmRSS (``/proc/self/status``) after ``import numpy, moetrain.data.{reader,loader}`` (the
   baseline), after opening the split (``TokenShards``: manifest read and verified), after
   building the ``BatchLoader`` (``--seq-len`` 4096, ``--global-batch`` 1024 over ``--dp-size`` 64
   ranks; this is dp rank 0) and after its first batch; the peak since the imports (VmHWM, reset
   through ``/proc/self/clear_refs``); the time of each phase; the shards mapped (and the
   process's maps and file descriptors); the next batch after resuming at ``--resume-at``
   samples (``load_state_dict``), and the order's lookup of the rank's sample ids there against
   position 0, which must be as fast (a batch also reads tokens: a sparse file's holes read for
   the first time cost page faults, as a real corpus costs disk reads); where the opening's time
   and memory go (the manifest's JSON parsed into Python objects, measured with ``tracemalloc``;
   the ``stat`` of every file; a full garbage collection over what the process holds). The
   order's own state (pickled ``BlendedOrder`` and ``FeistelPermutation``) must not grow from 1T
   to 20T.
3. **Before** (the loader and reader this replaced): ``np.random.default_rng(seed +
   epoch).permutation(num_samples)`` timed at ``--baseline-samples`` (peak memory per sample),
   extrapolated to each corpus, and tried at the 20T size in a process whose address space is
   capped at ``--baseline-cap-gib`` (``RLIMIT_AS``), where it fails at once instead of taking the
   machine down; and every shard of the split ``np.memmap``-ed at open, counting maps and file
   descriptors (each ``mmap`` holds one) against ``vm.max_map_count`` and ``ulimit -n``.
4. **Megatron-Core** (optional: skipped with a note when ``megatron.core`` is not importable;
   moetrain does not depend on it): a Megatron indexed dataset (``.bin`` / ``.idx``, int32
   tokens as Megatron's ``preprocess_data.py`` writes for a vocabulary above 65,500) of
   ``--megatron-tokens`` tokens in documents of log-normal length (mean ~1,000 tokens, sigma 1),
   random token ids written up to ``--megatron-write-max`` tokens and a sparse ``.bin`` above (its
   index build reads only the ``.idx``); then ``BlendedMegatronDatasetBuilder(GPTDataset, ...)``
   with one epoch of ``--seq-len`` samples on CPU, without ``torch.distributed`` (the builder
   then builds in the calling process) — the first build (document_index, sample_index,
   shuffle_index written as ``.npy``: time, peak memory, bytes) and, in a fresh process, the
   cached load each rank does — extrapolated linearly in tokens to 1T and 20T.

    python benchmarks/bench_data_order.py       # ~1.5 min: 1T and 20T; Megatron at 1e8 and 1e9 tokens
    python benchmarks/bench_data_order.py --megatron-tokens 1e8,1e9,1e10 --layouts 2^30,multi-TB,2^27  # ~6 min
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import pickle
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

VOCAB_SIZE = 128256  # Llama 3's: above 65,536, so 4-byte tokens
LAYOUTS = {"2^30": 2**30, "2^27": 2**27}  # shard sizes in tokens; "multi-TB" takes --big-shard-tokens
GOAL_MIB, GOAL_S = 256, 5.0  # issue 28, part 3: per rank at 20T tokens
SEED = 1234


def parse_count(text: str) -> int:
    """``"1T"`` → 10**12, ``"20T"``, ``"500G"``, ``"1e9"``, ``"2^30"`` → ints.

    Raises:
        ValueError: anything else.
    """
    t = text.strip()
    units = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9, "T": 10**12}
    if t and t[-1].upper() in units:
        return int(round(float(t[:-1]) * units[t[-1].upper()]))
    if "^" in t:
        base, exp = t.split("^")
        return int(base) ** int(exp)
    return int(float(t))


def tokens_label(n: int) -> str:
    """10**12 → ``"1T"``, 2 * 10**10 → ``"20B"``, 10**8 → ``"100M"``."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return str(n)


def _reset_peak() -> bool:
    """Set this process's peak RSS (VmHWM) to its RSS now (Linux's ``clear_refs`` 5), so that a
    phase's peak is its own and not the imports'. False where ``/proc/self/clear_refs`` is not
    writable: the peaks reported are then the process's since it started."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _mem() -> dict:
    """This process's memory now, MiB: VmRSS, its anonymous and file-backed parts, and the peak
    VmRSS since :func:`_reset_peak` (VmHWM)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return {"rss_mib": fields["VmRSS"], "anon_mib": fields["RssAnon"], "file_mib": fields["RssFile"],
            "peak_mib": fields["VmHWM"]}


def _process_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _r(x: float, nd: int = 3) -> float:
    return round(float(x), nd)


# -- 1. the sparse corpus -------------------------------------------------------------------------

def write_sparse_corpus(directory: Path, total_tokens: int, shard_tokens: int, tokens_per_document: int = 1000) -> dict:
    """Write a version-1 shard directory of ``total_tokens`` uint32 tokens in shards of
    ``shard_tokens`` (the last one shorter) as sparse files, and its ``manifest.json``.

    Returns:
        ``{"shards", "shard_tokens", "apparent_tib", "disk_mib", "manifest_mib", "write_s"}``.

    Raises:
        ValueError: a shard above ext4's 16 TiB file size limit, or sizes < 1.
    """
    if total_tokens < 1 or shard_tokens < 1:
        raise ValueError(f"total_tokens={total_tokens}, shard_tokens={shard_tokens}: must be >= 1")
    if shard_tokens * 4 > 16 * 2**40:
        raise ValueError(f"shards of {shard_tokens} uint32 tokens exceed ext4's 16 TiB per file")
    t0 = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    shards, left = [], total_tokens
    while left:
        tokens = min(shard_tokens, left)
        left -= tokens
        name = f"train_{len(shards):05d}.bin"
        documents = max(1, tokens // tokens_per_document)
        index_name = name[:-4] + ".idx"
        for fname, size in ((name, 4 * tokens), (index_name, 8 * documents)):
            with open(directory / fname, "wb") as f:
                f.truncate(size)
        # Placeholders of a real digest's length, so that the manifest is as long as a real one.
        fake = hashlib.sha256(name.encode()).hexdigest()
        shards.append({"name": name, "tokens": tokens, "documents": documents, "bytes": 4 * tokens, "sha256": fake,
                       "index_name": index_name, "index_bytes": 8 * documents, "index_sha256": fake[::-1]})
    documents = sum(sh["documents"] for sh in shards)
    manifest = {
        "format": "moetrain-token-shards", "format_version": 1, "dtype": "uint32", "vocab_size": VOCAB_SIZE,
        "eos_id": 128001, "bos_id": 128000,
        "tokenizer": {"name": "synthetic (benchmarks/bench_data_order.py)", "vocab_size": VOCAB_SIZE,
                      "sha256": "0" * 64},
        "shard_tokens": shard_tokens,
        "val_split": {"rule": "none", "description": "synthetic corpus: no validation split"},
        "sources": ["synthetic"], "total_tokens": total_tokens, "total_documents": documents,
        "splits": {"train": {"tokens": total_tokens, "documents": documents, "shards": shards},
                   "val": {"tokens": 0, "documents": 0, "shards": []}},
    }
    text = json.dumps(manifest, indent=2) + "\n"  # as ShardWriter writes it
    (directory / "manifest.json").write_text(text)
    disk = sum(os.stat(directory / f).st_blocks * 512 for f in os.listdir(directory))
    return {"shards": len(shards), "shard_tokens": shard_tokens, "apparent_tib": _r(sum(sh["bytes"] for sh in shards)
                                                                                    / 2**40, 2),
            "disk_mib": _r(disk / 2**20, 1), "manifest_mib": _r(len(text) / 2**20, 2),
            "write_s": _r(time.perf_counter() - t0, 2)}


# -- 2. moetrain's data path (in a fresh process) -----------------------------------------------

def _state_bytes(obj) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def measure_data_path(path: str, seq_len: int = 4096, global_batch: int = 1024, micro_batch: int = 2,
                      dp_size: int = 64, dp_rank: int = 0, verify: str = "size", max_open_maps: int = 256,
                      resume_at: int = 10**9) -> dict:
    """One rank's data path over the split at ``path``: memory (MiB, against the RSS after the
    imports) and seconds of each phase, maps, resume, where the opening's time and memory go."""
    import numpy as np

    from moetrain.data.format import read_manifest
    from moetrain.data.loader import BatchLoader
    from moetrain.data.order import epoch_permutation
    from moetrain.data.reader import MapCache, TokenShards
    from moetrain.data.verify import verify_shards

    gc.collect()
    peak_reset = _reset_peak()
    mem = {"imports": _mem()}
    maps0, fds0 = _process_maps(), _open_fds()
    t0 = time.perf_counter()
    # 1. the split: manifest read + verified
    shards = TokenShards(path, "train", verify=verify, maps=MapCache(max_open_maps))
    t1 = time.perf_counter()
    mem["opened"] = _mem()
    # 2. the loader: samples per shard, the order
    loader = BatchLoader(shards, seq_len, global_batch, micro_batch, dp_rank, dp_size, seed=SEED)
    t2 = time.perf_counter()
    mem["loader"] = _mem()
    # 3. the first batch: this rank's positions → sample ids → shards mapped → tokens
    batch = loader.next_batch()
    t3 = time.perf_counter()
    mem["first_batch"] = _mem()
    maps_after, open_after, fds_first = _process_maps(), len(shards.maps), _open_fds()
    steady_s = []
    for _ in range(5):
        t = time.perf_counter()
        loader.next_batch()
        steady_s.append(time.perf_counter() - t)
    # Resume far away (5 times, 1,000 steps apart): the position is one number, the order is
    # computed there.
    resume_s = []
    for k in range(5):
        state = loader.state_dict()
        state["consumed_samples"] = resume_at + k * 1000 * global_batch
        t = time.perf_counter()
        loader.load_state_dict(state)
        loader.next_batch()
        resume_s.append(time.perf_counter() - t)
    mem["resumed"] = _mem()
    fds_after = _open_fds()
    # The order alone (the batches above also read tokens: first reads of a sparse file's holes
    # fault in fresh page-cache pages, 1-20 ms a sample on this machine): this rank's sample ids
    # at position 0 and at the resume position, from a fresh order (the first call derives the
    # epoch's key).
    per_rank = global_batch // dp_size
    lookups: dict[str, list[float]] = {}
    for name, start in (("resume", resume_at + dp_rank * per_rank),
                        ("position_0", dp_rank * per_rank)):
        positions = np.arange(start, start + per_rank, dtype=np.int64)
        fresh = BatchLoader(shards, seq_len, global_batch, micro_batch, dp_rank, dp_size, seed=SEED).order
        for _ in range(5):
            t = time.perf_counter()
            fresh.locate_many(positions)
            lookups.setdefault(name, []).append(time.perf_counter() - t)
    n = loader.num_samples[loader.sources[0].name]
    perm = epoch_permutation(n, SEED, "synthetic", 0)
    order = {"order_pickled_bytes": _state_bytes(loader.order),
             "feistel_pickled_bytes": _state_bytes(perm),
             "feistel_attributes": sorted(vars(perm)),
             "schedule_period": int(loader.order.schedule.period)}

    # Where the opening goes: the manifest parsed (time, and its Python objects' size) and the
    # stat of every file (verify's time beyond the parse).
    import tracemalloc

    # A full garbage collection traverses every object held, the manifest's too.
    t = time.perf_counter()
    gc.collect()
    gc_s = time.perf_counter() - t
    tracked = len(gc.get_objects())
    t = time.perf_counter()
    read_manifest(path)
    parse_s = time.perf_counter() - t
    gc.collect()
    tracemalloc.start()
    manifest = read_manifest(path)
    held, parse_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del manifest
    t = time.perf_counter()
    verify_shards(path, verify, split="train")
    verify_s = time.perf_counter() - t
    names = [name for sh in shards.shards for name in (sh["name"], sh["index_name"])]
    t = time.perf_counter()
    for name in names:
        os.stat(Path(path) / name)
    stat_s = time.perf_counter() - t

    base = mem["imports"]["rss_mib"]
    return {
        "samples_per_epoch": n, "shards": len(shards.shards),
        "micro_batches": len(batch), "micro_batch_shape": list(batch[0].inputs.shape),
        "rss_over_imports_mib": {k: _r(v["rss_mib"] - base, 1) for k, v in mem.items() if k != "imports"},
        "anon_over_imports_mib": {k: _r(v["anon_mib"] - mem["imports"]["anon_mib"], 1)
                                  for k, v in mem.items() if k != "imports"},
        "peak_over_imports_mib": _r(mem["resumed"]["peak_mib"] - base, 1),
        "imports_rss_mib": _r(base, 1), "peak_since_imports": peak_reset,
        "seconds": {"open_and_verify": _r(t1 - t0), "loader": _r(t2 - t1), "first_batch": _r(t3 - t2),
                    "to_first_batch": _r(t3 - t0), "next_5_batches": [_r(x) for x in steady_s],
                    "next_batch_median": _r(sorted(steady_s)[2]),
                    "resume_next_batch_5_times": [_r(x) for x in resume_s],
                    "resume_next_batch_median": _r(sorted(resume_s)[2])},
        "order_lookup_ms": {"position_0_first_call": _r(lookups["position_0"][0] * 1e3),
                            "position_0_median": _r(sorted(lookups["position_0"])[2] * 1e3),
                            "resume_first_call": _r(lookups["resume"][0] * 1e3),
                            "resume_median": _r(sorted(lookups["resume"])[2] * 1e3), "positions": per_rank},
        "resume_at_samples": resume_at,
        "open_maps_after_first_batch": open_after, "max_open_maps": max_open_maps,
        "process_maps_added": maps_after - maps0, "fds_added": fds_first - fds0,
        "open_maps_after_resume": len(shards.maps), "fds_added_after_resume": fds_after - fds0,
        "order": order,
        "opening_breakdown": {"manifest_parse_s": _r(parse_s), "manifest_python_objects_mib": _r(held / 2**20, 1),
                              "manifest_parse_peak_mib": _r(parse_peak / 2**20, 1),
                              f"verify_{verify}_s": _r(verify_s), "files_checked": len(names),
                              "one_stat_per_file_s": _r(stat_s), "full_gc_with_split_open_s": _r(gc_s),
                              "python_objects_tracked_by_gc": tracked},
    }


# -- 3. before: the full permutation, every shard mapped at open --------------------------------

def old_permutation(num_samples: int, cap_gib: float | None = None) -> dict:
    """The order this change replaced: ``default_rng(seed + epoch).permutation(num_samples)``
    (int64, in memory), timed, with its peak memory; under ``cap_gib`` of address space
    (``RLIMIT_AS``) when given, so that a size that cannot fit fails at once."""
    import numpy as np

    if cap_gib is not None:
        cap = int(cap_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    gc.collect()
    _reset_peak()
    base = _mem()["rss_mib"]
    t0 = time.perf_counter()
    try:
        perm = np.random.default_rng(SEED).permutation(num_samples)
    except MemoryError as e:
        return {"samples": num_samples, "error": f"{type(e).__name__}: {e}",
                "seconds_to_fail": _r(time.perf_counter() - t0), "cap_gib": cap_gib}
    seconds = time.perf_counter() - t0
    peak = _mem()["peak_mib"] - base
    return {"samples": num_samples, "seconds": _r(seconds), "array_gib": _r(perm.nbytes / 2**30),
            "peak_over_start_mib": _r(peak, 1), "bytes_per_sample": _r(peak * 2**20 / num_samples, 2),
            "ns_per_sample": _r(seconds / num_samples * 1e9, 2), "cap_gib": cap_gib}


def old_map_all(path: str) -> dict:
    """The reader this change replaced: every shard of the split ``np.memmap``-ed at open."""
    import numpy as np

    from moetrain.data.format import read_manifest

    manifest = read_manifest(path)
    shards = manifest["splits"]["train"]["shards"]
    gc.collect()
    base, maps0, fds0 = _mem()["rss_mib"], _process_maps(), _open_fds()
    maps, error = [], None
    t0 = time.perf_counter()
    try:
        for sh in shards:
            maps.append(np.memmap(Path(path) / sh["name"], dtype="<u4", mode="r", shape=(sh["tokens"],)))
    except OSError as e:
        error = f"{type(e).__name__} after {len(maps)} of {len(shards)} shards: {e}"
    seconds = time.perf_counter() - t0
    return {"shards": len(shards), "mapped": len(maps), "seconds": _r(seconds),
            "process_maps_added": _process_maps() - maps0, "fds_added": _open_fds() - fds0,
            "rss_over_start_mib": _r(_mem()["rss_mib"] - base, 1), "error": error}


# -- 4. Megatron-Core's GPTDataset index --------------------------------------------------------

class _Tokenizer:
    """What GPTDatasetConfig / GPTDataset read of a tokenizer (Llama 3's sizes)."""

    vocab_size = VOCAB_SIZE
    eod = eos = 128001
    pad = 128004
    unique_identifiers = {"class": "synthetic", "vocab_size": VOCAB_SIZE}


def write_megatron_dataset(prefix: Path, tokens: int, mean_document: float = 1000.0, write_tokens: bool = True,
                           chunk: int = 2**24) -> dict:
    """Write a Megatron indexed dataset (``<prefix>.bin`` / ``.idx``, int32 tokens, one
    sequence per document) of exactly ``tokens`` tokens in documents of log-normal length
    (sigma 1, mean ``mean_document``, 16..131072 tokens). Layout: :mod:`moetrain.data.megatron`'s
    docstring. ``write_tokens``: random ids in the ``.bin``; else a sparse ``.bin`` of the right size.

    Returns:
        ``{"tokens", "documents", "mean_document", "bin": "written"|"sparse", "idx_mib", "write_s"}``.
    """
    import numpy as np

    from moetrain.data.megatron import MAGIC

    t0 = time.perf_counter()
    rng = np.random.default_rng(SEED)
    sigma = 1.0
    mu = np.log(mean_document) - sigma**2 / 2
    parts, total = [], 0
    while total < tokens:
        est = int((tokens - total) / mean_document * 1.05) + 16
        ln = np.clip(rng.lognormal(mu, sigma, est), 16, 2**17).astype(np.int64)
        parts.append(ln)
        total += int(ln.sum())
    lengths = np.concatenate(parts)
    ends = np.cumsum(lengths)
    n_docs = int(np.searchsorted(ends, tokens)) + 1  # the first document that reaches `tokens`
    lengths = lengths[:n_docs]
    lengths[-1] -= int(ends[n_docs - 1]) - tokens  # cut the last one so that the total is exact
    lengths = lengths.astype("<i4")
    bin_path, idx_path = prefix.with_suffix(".bin"), prefix.with_suffix(".idx")
    with open(bin_path, "wb") as f:
        if write_tokens:
            for a in range(0, tokens, chunk):
                f.write(rng.integers(0, VOCAB_SIZE, min(chunk, tokens - a), dtype="<i4").tobytes())
        else:
            f.truncate(4 * tokens)
    with open(idx_path, "wb") as f:
        # magic, version 1, dtype code 4 (int32), sequences, document_indices entries
        f.write(MAGIC + np.array([1], "<u8").tobytes() + bytes([4]) + np.array([n_docs, n_docs + 1], "<u8").tobytes())
        f.write(lengths.tobytes())
        pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * 4]).astype("<i8")
        f.write(pointers.tobytes())
        f.write(np.arange(n_docs + 1, dtype="<i8").tobytes())
    return {"tokens": tokens, "documents": n_docs, "mean_document": _r(tokens / n_docs, 1),
            "bin": "written" if write_tokens else "sparse", "idx_mib": _r(idx_path.stat().st_size / 2**20, 2),
            "write_s": _r(time.perf_counter() - t0, 1)}


def megatron_build(prefix: str, cache: str, seq_len: int = 4096) -> dict:
    """Build (or, with the cache present, load) Megatron-Core's GPTDataset over ``prefix``: one
    epoch, split ``1,0,0``, no ``torch.distributed``. Time, memory over the imports, index bytes."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    t = time.perf_counter()
    import numpy as np
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    import_s = time.perf_counter() - t
    cached = any(Path(cache).glob("*shuffle_index.npy")) if Path(cache).is_dir() else False
    config = GPTDatasetConfig(random_seed=SEED, sequence_length=seq_len, blend=([prefix], None), split="1,0,0",
                              path_to_cache=cache, tokenizer=_Tokenizer(), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
    gc.collect()
    _reset_peak()
    base = _mem()
    t0 = time.perf_counter()
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, config).build()
    seconds = time.perf_counter() - t0
    after = _mem()
    arrays = {"document_index": train.document_index, "sample_index": train.sample_index,
              "shuffle_index": train.shuffle_index}
    files = {name: sum(p.stat().st_size for p in Path(cache).glob(f"*-{name}.npy")) for name in arrays}
    sample = train[len(train) - 1]["tokens"]
    return {"cache_hit": cached, "torch_distributed_initialized": dist.is_initialized(),
            "splits_built": [d is not None for d in (train, valid, test)], "samples": len(train),
            "seconds": _r(seconds), "import_s": _r(import_s),
            "rss_over_imports_mib": _r(after["rss_mib"] - base["rss_mib"], 1),
            "anon_over_imports_mib": _r(after["anon_mib"] - base["anon_mib"], 1),
            "peak_over_imports_mib": _r(after["peak_mib"] - base["rss_mib"], 1),
            "index_file_mib": {k: _r(v / 2**20, 2) for k, v in files.items()},
            "index_dtypes": {k: str(v.dtype) for k, v in arrays.items()},
            "index_arrays_mib": {k: _r(v.nbytes / 2**20, 2) for k, v in arrays.items()},
            "index_in_memory": {k: not isinstance(v, np.memmap) for k, v in arrays.items()},
            "last_sample_tokens": int(sample.numel())}


def _extrapolate_megatron(rows: list[dict], corpora: list[int], seq_len: int) -> dict:
    """Linear in tokens from the largest measured size. Past 2**31 - 1 documents one GPTDataset
    cannot hold a corpus (its document ids are int32: ``_build_document_index`` casts to int32 and
    the builder's ``numpy.arange(..., dtype=int32)`` wraps without an error), so such a corpus is
    a blend of several datasets, and the blend adds ``BlendedDataset``'s own index: an int16
    dataset id and an int64 sample id per sample (``blended_dataset.py``), 10 bytes a sample."""
    big = max(rows, key=lambda r: r["tokens"])
    per_token = {"index_bytes": sum(big["build"]["index_file_mib"].values()) * 2**20 / big["tokens"],
                 "build_s": big["build"]["seconds"] / big["tokens"],
                 "build_peak_bytes": big["build"]["peak_over_imports_mib"] * 2**20 / big["tokens"],
                 "idx_bytes": big["dataset"]["idx_mib"] * 2**20 / big["tokens"],
                 "documents": big["dataset"]["documents"] / big["tokens"]}
    out = {"from_tokens": big["tokens"],
           "index_bytes_per_token": _r(per_token["index_bytes"], 5)}
    for n in corpora:
        docs = per_token["documents"] * n
        out[tokens_label(n)] = {
            "index_gib": _r(per_token["index_bytes"] * n / 2**30, 1),
            "build_s": _r(per_token["build_s"] * n, 0),
            "build_peak_rss_gib": _r(per_token["build_peak_bytes"] * n / 2**30, 1),
            "idx_file_gib": _r(per_token["idx_bytes"] * n / 2**30, 1),
            "documents": int(docs),
            "one_dataset_possible": docs < 2**31,
            "datasets_needed": -(-int(docs) // (2**31 - 1)),
            "blended_dataset_index_gib": _r(10 * (n // seq_len) / 2**30, 1) if docs >= 2**31 else 0.0,
        }
    return out


# -- orchestration -------------------------------------------------------------------------------

def _child(name: str, **kwargs) -> dict:
    """Run one of this file's functions in a fresh Python process; its JSON result."""
    r = subprocess.run([sys.executable, __file__, "--child", name, json.dumps(kwargs)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"child {name} {kwargs} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


CHILDREN = {"data_path": measure_data_path, "old_permutation": old_permutation, "old_map_all": old_map_all,
            "megatron_build": megatron_build}


def megatron_available() -> str | None:
    """None when ``megatron.core``'s GPTDataset imports here, else why not."""
    r = subprocess.run([sys.executable, "-c", "import megatron.core.datasets.gpt_dataset"], capture_output=True,
                       text=True)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["import failed"])[-1]


def data_path_rows(args: argparse.Namespace, tmp: Path, call) -> list[dict]:
    """Part 2 (and the map-all-at-open half of part 3): one row per (layout, corpus size)."""
    rows = []
    for layout in args.layouts.split(","):
        shard_tokens = args.big_shard_tokens if layout == "multi-TB" else LAYOUTS[layout]
        for n in (parse_count(c) for c in args.corpus.split(",")):
            d = tmp / f"{layout.replace('^', '')}-{tokens_label(n)}"
            corpus = write_sparse_corpus(d, n, shard_tokens, args.tokens_per_document)
            path = call("data_path", path=str(d), seq_len=args.seq_len, global_batch=args.global_batch,
                        micro_batch=args.micro_batch, dp_size=args.dp_size, verify=args.verify,
                        max_open_maps=args.max_open_maps, resume_at=args.resume_at)
            row = {"layout": layout, "tokens": n, "corpus": corpus, "moetrain": path}
            if layout in args.old_map_all.split(","):
                row["before_map_all_at_open"] = call("old_map_all", path=str(d))
            rows.append(row)
            if not args.keep:
                shutil.rmtree(d)
    return rows


def before_permutation(args: argparse.Namespace, samples_at: dict[str, int], call) -> dict:
    """Part 3: the old permutation measured where it fits, extrapolated to ``samples_at``
    ({corpus: samples}), tried at the largest under the address-space cap."""
    perms = [call("old_permutation", num_samples=parse_count(s)) for s in args.baseline_samples.split(",") if s]
    out: dict = {"measured": perms}
    if perms:
        big = max(perms, key=lambda p: p["samples"])
        out["extrapolated"] = {
            k: {"samples": n, "gib": _r(n * big["bytes_per_sample"] / 2**30, 1),
                "int64_array_gib": _r(n * 8 / 2**30, 1), "seconds": _r(n * big["ns_per_sample"] / 1e9, 1)}
            for k, n in samples_at.items()}
    if samples_at and args.baseline_cap_gib > 0:
        largest = max(samples_at, key=samples_at.get)
        out[f"at_{largest}_capped"] = call("old_permutation", num_samples=samples_at[largest],
                                           cap_gib=args.baseline_cap_gib)
    return out


def megatron_rows(args: argparse.Namespace, tmp: Path) -> dict:
    """Part 4, each build in a fresh process: the first build, then the cached load."""
    why = megatron_available()
    if why is not None:
        return {"skipped": f"megatron.core not importable ({why}); `pip install --no-deps megatron-core` to "
                           f"measure it (moetrain does not need it)"}
    import importlib.metadata

    rows = []
    for s in args.megatron_tokens.split(","):
        n = parse_count(s)
        d = tmp / f"megatron-{tokens_label(n)}"
        d.mkdir()
        dataset = write_megatron_dataset(d / "data", n, args.tokens_per_document,
                                         write_tokens=n <= args.megatron_write_max)
        kw = {"prefix": str(d / "data"), "cache": str(d / "cache"), "seq_len": args.seq_len}
        rows.append({"tokens": n, "dataset": dataset, "build": _child("megatron_build", **kw),
                     "cached_load": _child("megatron_build", **kw)})
        if not args.keep:
            shutil.rmtree(d)
    corpora = [parse_count(c) for c in args.corpus.split(",")]
    return {"version": importlib.metadata.version("megatron-core"), "measured": rows,
            "extrapolated": _extrapolate_megatron(rows, corpora, args.seq_len)}


def run(args: argparse.Namespace, in_process: bool = False) -> dict:
    """The whole benchmark (``in_process``: moetrain's and the old order's measurements in this
    process rather than in fresh ones, for the test).

    Raises:
        ValueError: an unknown layout.
    """
    unknown = [x for x in args.layouts.split(",") if x not in (*LAYOUTS, "multi-TB")]
    if unknown:
        raise ValueError(f"layouts {unknown}: known are {[*LAYOUTS, 'multi-TB']}")
    call = (lambda name, **kw: CHILDREN[name](**kw)) if in_process else _child
    tmp = Path(tempfile.mkdtemp(prefix="moetrain-bench-data-order-", dir=args.tmp))
    import numpy

    report: dict = {
        "machine": {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "numpy": numpy.__version__, "vm_max_map_count": int(Path("/proc/sys/vm/max_map_count").read_text()),
                    "ulimit_nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "tmp": str(tmp)},
        "settings": {"seq_len": args.seq_len, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                     "dp_size": args.dp_size, "dp_rank": 0, "verify": args.verify, "max_open_maps": args.max_open_maps,
                     "token_dtype": "uint32", "vocab_size": VOCAB_SIZE, "files": "sparse (truncate)",
                     "sha256_in_manifest": "placeholders (not checked with verify=size/none)",
                     "tokens_per_document": args.tokens_per_document, "resume_at_samples": args.resume_at},
    }
    try:
        rows = data_path_rows(args, tmp, call)
        report["data_path"] = rows
        first = args.layouts.split(",")[0]
        report["before_permutation"] = before_permutation(
            args, {tokens_label(r["tokens"]): r["moetrain"]["samples_per_epoch"] for r in rows if r["layout"] == first},
            call)
        if args.megatron_tokens:
            report["megatron_core"] = megatron_rows(args, tmp)
        report["goals"] = goals(rows)
    finally:
        if args.keep:
            report["kept"] = str(tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return report


def goals(rows: list[dict]) -> dict:
    """Issue 28's goals at the largest corpus, per layout, and the order's O(1) state."""
    out = {}
    largest = max(r["tokens"] for r in rows)
    smallest = min(r["tokens"] for r in rows)
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mine = {r["tokens"]: r["moetrain"] for r in rows if r["layout"] == layout}
        big, small = mine[largest], mine[smallest]
        tag = f"{layout}_at_{tokens_label(largest)}"
        out[f"data_path_le_{GOAL_MIB}_mib_{tag}"] = big["peak_over_imports_mib"] <= GOAL_MIB
        out[f"first_batch_le_{GOAL_S:g}_s_{tag}"] = big["seconds"]["to_first_batch"] <= GOAL_S
        # A resume that replayed the positions before it would take minutes at 1e9 samples.
        look = big["order_lookup_ms"]
        out[f"order_at_resume_as_fast_as_at_0_{tag}"] = (
            look["resume_first_call"] <= 2 * look["position_0_first_call"] + 1.0)
        out[f"order_state_constant_{layout}_{tokens_label(smallest)}_to_{tokens_label(largest)}"] = (
            big["order"]["order_pickled_bytes"] <= small["order"]["order_pickled_bytes"] + 64
            and big["order"]["feistel_pickled_bytes"] <= small["order"]["feistel_pickled_bytes"] + 64)
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="1T,20T", help="corpus sizes in tokens (default: %(default)s)")
    ap.add_argument("--layouts", default="2^30,multi-TB", help="2^30, multi-TB, 2^27 (default: %(default)s)")
    ap.add_argument("--big-shard-tokens", type=parse_count, default=4 * 10**12,
                    help="tokens per shard of the multi-TB layout (default 4T: 16 TB, under ext4's 16 TiB)")
    ap.add_argument("--tokens-per-document", type=int, default=1000)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--dp-size", type=int, default=64)
    ap.add_argument("--verify", default="size", choices=("size", "none"))
    ap.add_argument("--max-open-maps", type=int, default=256)
    ap.add_argument("--resume-at", type=parse_count, default=10**9, help="samples (default: 1e9)")
    ap.add_argument("--baseline-samples", default="1e7,1e8", help="sizes of the old permutation measured")
    ap.add_argument("--baseline-cap-gib", type=float, default=6.0,
                    help="address space of the attempt at the largest corpus (0: no attempt)")
    ap.add_argument("--old-map-all", default="2^30,2^27", help="layouts where every shard is also mapped at open")
    ap.add_argument("--megatron-tokens", default="1e8,1e9", help="Megatron dataset sizes ('' skips it)")
    ap.add_argument("--megatron-write-max", type=parse_count, default=10**9,
                    help="write random tokens up to this size, a sparse .bin above (default 1e9: 4 GB)")
    ap.add_argument("--tmp", default=None, help="parent of the temporary directory (default: $TMPDIR or /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.child:
        name, kwargs = args.child
        print(json.dumps(CHILDREN[name](**json.loads(kwargs))))
        return
    print(json.dumps(run(args), indent=1))


if __name__ == "__main__":
    main()
