"""Reading token shards: one split of a shard directory, verified, memory-mapped when read,
cut into training samples.

Training samples (:class:`TokenShards`): sample ``j`` of a shard with ``T`` tokens is tokens
``[j * L, j * L + L + 1)`` (``L`` = seq_len: ``L`` inputs and the ``L`` next-token targets,
shifted by one). A sample never crosses a shard boundary, so a shard holds ``(T - 1) // L``
samples; global sample indices run over the shards in manifest order. Packed fine-tuning data
(a manifest with ``packed``, :mod:`moetrain.data.format`) is cut into blocks of ``L + 1``
tokens that never share a token: sample ``j`` is ``[j (L + 1), (j + 1)(L + 1))``, ``T // (L + 1)``
per shard, and ``L`` must be the length it was packed for.

Memory: a file (token shard, loss mask, document index) is memory-mapped when a sample first
needs it, and a :class:`MapCache` keeps at most ``limit`` files mapped, least recently used out
first. One cache serves every split and source of a process (the trainer makes one per rank):
each mapping also holds a file descriptor (Python's ``mmap`` keeps a duplicate), and a 20T-token
corpus is ~18,600 files at 2^30 tokens each, ~149,000 at the default 2^27 — above Linux's
default ``vm.max_map_count`` (65,530) and most ``ulimit -n``. Document indexes are searched
where they are mapped (a binary search reads a few pages), never loaded whole. Opening a split
reads its manifest only.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from moetrain.data.format import is_megatron
from moetrain.data.megatron import read_index
from moetrain.data.verify import VerifyMode, verify_shards

__all__ = ["TokenShards", "MapCache", "DEFAULT_MAX_OPEN_MAPS", "samples_per_shard"]

DEFAULT_MAX_OPEN_MAPS = 256


def trailing_padding(tokens: np.ndarray, loss_mask: np.ndarray, pad_id: int | None) -> np.ndarray:
    """The run of ``pad_id`` tokens outside ``loss_mask`` that ends each row: tokens, loss_mask
    [..., L] → bool [..., L] (all False when ``pad_id`` is None: data that is not packed). A
    position is padding when it and every position after it are such filler."""
    if pad_id is None:
        return np.zeros(tokens.shape, dtype=bool)
    filler = (tokens == pad_id) & ~loss_mask
    return np.logical_and.accumulate(filler[..., ::-1], axis=-1)[..., ::-1].copy()


def samples_per_shard(tokens: np.ndarray, seq_len: int, packed: bool) -> np.ndarray:
    """int64 [shards]: training samples of ``seq_len + 1`` tokens in shards of ``tokens`` tokens —
    ``(T - 1) // seq_len`` (samples share their boundary token), or ``T // (seq_len + 1)`` for
    packed data (whole blocks)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    return tokens // (seq_len + 1) if packed else np.maximum(tokens - 1, 0) // seq_len


class MapCache:
    """The memory-mapped files of a process, at most ``limit`` at a time (least recently used
    first out). Keys are ``(path, kind)``; a mapping evicted while a caller still holds it stays
    valid until the caller drops it (it is then not counted).

    Raises:
        ValueError: ``limit`` < 1.
    """

    def __init__(self, limit: int = DEFAULT_MAX_OPEN_MAPS):
        if limit < 1:
            raise ValueError(f"max_open_maps={limit}: must be >= 1")
        self.limit = limit
        self._entries: OrderedDict = OrderedDict()

    def get(self, key, make: Callable[[], np.ndarray]) -> np.ndarray:
        value = self._entries.get(key)
        if value is None:
            value = self._entries[key] = make()
            if len(self._entries) > self.limit:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return value

    def __len__(self) -> int:
        return len(self._entries)


class TokenShards:
    """One split of a shard directory, verified, memory-mapped read-only when read, cut into samples.

    Either layout (:mod:`moetrain.data.format`): moetrain shards, or Megatron-LM ``.bin/.idx`` files (whole
    or token ranges of them) described by a version-2 manifest.

    Args:
        path: the shard directory (holding ``manifest.json``).
        split: ``"train"`` or ``"val"``.
        verify: checked before mapping, see :func:`verify_shards` (``"sha256"`` reads every byte
            once; ``"size"`` is instant; ``"none"`` only checks the files exist).
        maps: the process's :class:`MapCache` (shared by every split and source); None: a cache
            of its own of ``DEFAULT_MAX_OPEN_MAPS`` files.
        manifest: the directory's manifest as :func:`verify_shards` returned it, already
            verified: then nothing is read or checked again (``verify`` is not used).

    Attributes:
        manifest: the manifest dict. ``num_tokens``: tokens in this split. ``vocab_size``,
        ``eos_id``, ``bos_id`` (None when the tokenizer adds none): from the manifest.
        ``shards``: this split's manifest entries, in order. ``has_loss_mask``: the shards carry
        a loss mask (``.mask`` files). ``packed_seq_len``: the sequence length packed data was
        cut for, or None; ``pad_id``: the id it was padded with, or None.

    Raises:
        ShardError: see :func:`verify_shards`.

    Pickling reopens nothing: a new process maps shards as it reads them, without re-verifying.
    """

    def __init__(self, path: str | os.PathLike, split: str = "train", verify: VerifyMode = "sha256",
                 maps: MapCache | None = None, manifest: dict | None = None):
        self.path = Path(path)
        self.split = split
        self.maps = maps if maps is not None else MapCache()
        self.manifest: dict = manifest if manifest is not None else verify_shards(self.path, verify, split=split)
        self.vocab_size: int = self.manifest["vocab_size"]
        self.eos_id: int = self.manifest["eos_id"]
        self.bos_id: int | None = self.manifest.get("bos_id")
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        self.shards: list[dict] = self.manifest["splits"][split]["shards"]
        self.num_tokens: int = sum(sh["tokens"] for sh in self.shards)
        self.has_loss_mask: bool = bool(self.manifest.get("loss_mask"))
        packed = self.manifest.get("packed")
        self.packed_seq_len: int | None = int(packed["seq_len"]) if packed else None
        self.pad_id: int | None = int(packed["pad_id"]) if packed else None
        self._open()

    def _open(self) -> None:
        self._cum_cache: dict[int, np.ndarray] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_cum_cache"]
        state["maps"] = self.maps.limit  # a new process maps its own files
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, maps=MapCache(state["maps"]))
        self._open()

    def _tokens(self, shard: int) -> np.memmap:
        sh = self.shards[shard]
        return self.maps.get((self.path / sh["name"], "tokens", shard, self.split), lambda: np.memmap(
            self.path / sh["name"], dtype=self.dtype, mode="r", shape=(sh["tokens"],),
            offset=sh.get("token_offset", 0) * self.dtype.itemsize))

    def _stride(self, seq_len: int) -> int:
        """Tokens from one sample's start to the next's: ``L`` (samples share their boundary
        token), or ``L + 1`` for packed data (whole blocks).

        Raises:
            ValueError: ``seq_len`` < 1, or packed data and ``seq_len`` is not its length.
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r}: must be a positive int")
        if self.packed_seq_len is None:
            return int(seq_len)
        if seq_len != self.packed_seq_len:
            raise ValueError(f"{self.path}: packed for sequences of {self.packed_seq_len} tokens, not {seq_len}; "
                             f"set model.seq_len={self.packed_seq_len} or re-tokenize with --seq-len {seq_len}")
        return int(seq_len) + 1

    def _cumulative(self, seq_len: int) -> np.ndarray:
        """cum[i] = samples in shards 0..i (inclusive)."""
        self._stride(seq_len)  # checks seq_len
        cum = self._cum_cache.get(seq_len)
        if cum is None:
            tokens = np.fromiter((sh["tokens"] for sh in self.shards), dtype=np.int64, count=len(self.shards))
            cum = np.cumsum(samples_per_shard(tokens, int(seq_len), self.packed_seq_len is not None))
            self._cum_cache[int(seq_len)] = cum
        return cum

    def num_samples(self, seq_len: int) -> int:
        """Number of samples of ``seq_len + 1`` tokens: ``sum((T_shard - 1) // seq_len)``
        (packed data: ``sum(T_shard // (seq_len + 1))``).

        Raises:
            ValueError: ``seq_len`` < 1, or not the packed length.
        """
        cum = self._cumulative(seq_len)
        return int(cum[-1]) if len(cum) else 0

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        """Sample ``index`` as int64 ids of shape ``[seq_len + 1]``: inputs ``[:-1]``, targets ``[1:]``.

        Raises:
            IndexError: ``index`` not in ``[0, num_samples(seq_len))``.
            ValueError: ``seq_len`` < 1, or not the packed length.
        """
        shard, start = self._locate(index, seq_len)
        return np.asarray(self._tokens(shard)[start : start + seq_len + 1], dtype=np.int64)

    def sample_loss_mask(self, index: int, seq_len: int) -> np.ndarray:
        """The loss mask of sample ``index``: bool ``[seq_len + 1]``, True where the token is
        trained as a target (the data's ``.mask`` files; all True for data without one).

        Raises:
            IndexError, ValueError: as :meth:`sample`.
        """
        shard, start = self._locate(index, seq_len)
        if not self.has_loss_mask:
            return np.ones(seq_len + 1, dtype=bool)
        sh = self.shards[shard]
        mask = self.maps.get((self.path / sh["mask_name"], "mask"), lambda: np.memmap(
            self.path / sh["mask_name"], dtype=np.uint8, mode="r", shape=(sh["tokens"],)))
        return np.asarray(mask[start : start + seq_len + 1]) != 0

    def _locate(self, index: int, seq_len: int) -> tuple[int, int]:
        """(shard, first token offset in it) of sample ``index``."""
        cum = self._cumulative(seq_len)
        n = int(cum[-1]) if len(cum) else 0
        if not 0 <= index < n:
            raise IndexError(
                f"sample index {index} out of range: split {self.split!r} of {self.path} has {n} "
                f"samples of seq_len {seq_len}"
            )
        shard = int(np.searchsorted(cum, index, side="right"))
        local = int(index) - (int(cum[shard - 1]) if shard else 0)
        return shard, local * self._stride(seq_len)

    def sample_padding(self, index: int, seq_len: int) -> np.ndarray:
        """The padding of sample ``index``: bool ``[seq_len + 1]``, True on the run of ``pad_id``
        tokens outside the loss mask that ends a packed block (the filler the packer adds after
        its last record, :mod:`moetrain.data.writer`); all False for data that is not packed.
        No target from the run's first token on is trained, so nothing trained depends on it.

        Raises:
            IndexError, ValueError: as :meth:`sample`.
        """
        if self.pad_id is None:
            self._locate(index, seq_len)  # the same errors as the other samplers
            return np.zeros(seq_len + 1, dtype=bool)
        return trailing_padding(self.sample(index, seq_len), self.sample_loss_mask(index, seq_len), self.pad_id)

    def sample_document_ids(self, index: int, seq_len: int) -> np.ndarray:
        """The document of every token of sample ``index``: int64 ``[seq_len + 1]``, 0 for the
        document the sample starts in, one more at every document that starts inside it (from
        the shard's document index, so it holds for data without end-of-document tokens too).

        Raises:
            IndexError, ValueError: as :meth:`sample`.
        """
        shard, start = self._locate(index, seq_len)
        starts = self._document_starts(shard)
        ids = np.searchsorted(starts, np.arange(start, start + seq_len + 1), side="right")
        return (ids - ids[0]).astype(np.int64)

    def _document_starts(self, shard: int) -> np.ndarray:
        """Shard ``shard``'s document starts, ascending, as a mapped array (moetrain layout: the
        ``.idx`` itself) or, for a Megatron token range, computed from its index and cached."""
        sh = self.shards[shard]
        path = self.path / sh["index_name"]
        if not is_megatron(self.manifest):
            if sh["index_bytes"] == 0:  # a shard inside one long document: nothing to map
                return np.zeros(0, dtype=np.int64)
            return self.maps.get((path, "index"), lambda: np.memmap(path, dtype="<i8", mode="r"))
        return self.maps.get((path, "index", shard, self.split), lambda: self.document_starts(shard))

    def samples(self, indices: Sequence[int], seq_len: int) -> np.ndarray:
        """Several samples stacked: int64 of shape ``[len(indices), seq_len + 1]``."""
        out = np.empty((len(indices), seq_len + 1), dtype=np.int64)
        for row, index in enumerate(indices):
            out[row] = self.sample(index, seq_len)
        return out

    def shard_tokens(self, shard: int) -> np.memmap:
        """The read-only token array of shard ``shard`` (manifest order), shape ``[tokens]``."""
        return self._tokens(shard)

    def document_starts(self, shard: int) -> np.ndarray:
        """int64 offsets, within shard ``shard``, of the documents that start in it."""
        sh = self.shards[shard]
        if not is_megatron(self.manifest):
            return np.fromfile(self.path / sh["index_name"], dtype="<i8")
        first = sh.get("first_document", 0)
        starts = read_index(self.path / sh["index_name"]).document_token_starts()
        return starts[first:first + sh["documents"]] - sh.get("token_offset", 0)

    def __repr__(self) -> str:
        return (
            f"TokenShards({str(self.path)!r}, split={self.split!r}: {self.num_tokens:,} tokens in "
            f"{len(self.shards)} shards, vocab_size={self.vocab_size})"
        )
