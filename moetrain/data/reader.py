"""Reading token shards: one split of a shard directory, verified, memory-mapped, cut into
training samples.

Training samples (:class:`TokenShards`): sample ``j`` of a shard with ``T`` tokens is tokens
``[j * L, j * L + L + 1)`` (``L`` = seq_len: ``L`` inputs and the ``L`` next-token targets,
shifted by one). A sample never crosses a shard boundary, so a shard holds ``(T - 1) // L``
samples; global sample indices run over the shards in manifest order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moetrain.data.format import is_megatron
from moetrain.data.megatron import read_index
from moetrain.data.verify import VerifyMode, verify_shards

__all__ = ["TokenShards"]


class TokenShards:
    """One split of a shard directory, verified, memory-mapped read-only, cut into samples.

    Either layout (:mod:`moetrain.data.format`): moetrain shards, or Megatron-LM ``.bin/.idx`` files (whole
    or token ranges of them) described by a version-2 manifest.

    Args:
        path: the shard directory (holding ``manifest.json``).
        split: ``"train"`` or ``"val"``.
        verify: checked before mapping, see :func:`verify_shards` (``"sha256"`` reads every byte
            once; ``"size"`` is instant; ``"none"`` only checks the files exist).

    Attributes:
        manifest: the manifest dict. ``num_tokens``: tokens in this split. ``vocab_size``,
        ``eos_id``: from the manifest. ``shards``: this split's manifest entries, in order.

    Raises:
        ShardError: see :func:`verify_shards`.

    Pickling reopens the memory maps in the new process without re-verifying.
    """

    def __init__(self, path: str | os.PathLike, split: str = "train", verify: VerifyMode = "sha256"):
        self.path = Path(path)
        self.split = split
        self.manifest: dict = verify_shards(self.path, verify, split=split)
        self.vocab_size: int = self.manifest["vocab_size"]
        self.eos_id: int = self.manifest["eos_id"]
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        self.shards: list[dict] = self.manifest["splits"][split]["shards"]
        self.num_tokens: int = sum(sh["tokens"] for sh in self.shards)
        self._open()

    def _open(self) -> None:
        self._maps = [
            np.memmap(self.path / sh["name"], dtype=self.dtype, mode="r", shape=(sh["tokens"],),
                      offset=sh.get("token_offset", 0) * self.dtype.itemsize)
            for sh in self.shards
        ]
        self._cum_cache: dict[int, np.ndarray] = {}
        self._doc_starts: dict[int, np.ndarray] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_maps"], state["_cum_cache"], state["_doc_starts"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def _cumulative(self, seq_len: int) -> np.ndarray:
        """cum[i] = samples in shards 0..i (inclusive)."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r}: must be a positive int")
        cum = self._cum_cache.get(seq_len)
        if cum is None:
            per_shard = [(sh["tokens"] - 1) // seq_len if sh["tokens"] > 0 else 0 for sh in self.shards]
            cum = np.cumsum(np.asarray(per_shard, dtype=np.int64))
            self._cum_cache[int(seq_len)] = cum
        return cum

    def num_samples(self, seq_len: int) -> int:
        """Number of samples of ``seq_len + 1`` tokens: ``sum((T_shard - 1) // seq_len)``.

        Raises:
            ValueError: ``seq_len`` < 1.
        """
        cum = self._cumulative(seq_len)
        return int(cum[-1]) if len(cum) else 0

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        """Sample ``index`` as int64 ids of shape ``[seq_len + 1]``: inputs ``[:-1]``, targets ``[1:]``.

        Raises:
            IndexError: ``index`` not in ``[0, num_samples(seq_len))``.
            ValueError: ``seq_len`` < 1.
        """
        shard, start = self._locate(index, seq_len)
        return np.asarray(self._maps[shard][start : start + seq_len + 1], dtype=np.int64)

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
        return shard, local * seq_len

    def sample_document_ids(self, index: int, seq_len: int) -> np.ndarray:
        """The document of every token of sample ``index``: int64 ``[seq_len + 1]``, 0 for the
        document the sample starts in, one more at every document that starts inside it (from
        the shard's document index, so it holds for data without end-of-document tokens too).

        Raises:
            IndexError, ValueError: as :meth:`sample`.
        """
        shard, start = self._locate(index, seq_len)
        starts = self._doc_starts.get(shard)
        if starts is None:
            starts = self._doc_starts[shard] = np.sort(self.document_starts(shard))
        ids = np.searchsorted(starts, np.arange(start, start + seq_len + 1), side="right")
        return (ids - ids[0]).astype(np.int64)

    def samples(self, indices: Sequence[int], seq_len: int) -> np.ndarray:
        """Several samples stacked: int64 of shape ``[len(indices), seq_len + 1]``."""
        out = np.empty((len(indices), seq_len + 1), dtype=np.int64)
        for row, index in enumerate(indices):
            out[row] = self.sample(index, seq_len)
        return out

    def shard_tokens(self, shard: int) -> np.memmap:
        """The read-only token array of shard ``shard`` (manifest order), shape ``[tokens]``."""
        return self._maps[shard]

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
