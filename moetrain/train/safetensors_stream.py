"""Writing safetensors files tensor by tensor, and sharding them: what the weights directory
(:mod:`moetrain.train.weights`) and ``python -m moetrain.hf export`` write with.

The safetensors format (https://github.com/huggingface/safetensors, "Format"): an 8-byte
little-endian header length, a JSON header giving each tensor's dtype, shape and byte range, then
the raw row-major little-endian data. When every tensor's dtype and shape are known beforehand the
header can be written first and the data streamed after it: a tensor never has to be in memory
whole (a stacked expert tensor is written expert by expert), and the sha256 of the file is
computed while writing.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch
from tqdm import tqdm


class WeightsError(RuntimeError):
    """A weights directory or checkpoint is missing, altered, or does not fit the model; or tensors
    written do not match what was declared."""


# safetensors' dtype names (https://github.com/huggingface/safetensors, format spec).
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",  # FP8 weights with block scales (DeepSeek-V3's format)
}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of ``dtype`` ("F32", "BF16", ...). Raises KeyError for other dtypes."""
    return _ST_DTYPES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name.

    Raises:
        WeightsError: a dtype moetrain does not read (e.g. FP8 E5M2).
    """
    if name not in _TORCH_DTYPES:
        raise WeightsError(f"tensor dtype {name}: not one moetrain reads ({', '.join(_TORCH_DTYPES)})")
    return _TORCH_DTYPES[name]


# ---------------------------------------------------------------------------------------------
# Writing safetensors tensor by tensor
# ---------------------------------------------------------------------------------------------


class SafetensorsWriter:
    """Writes one safetensors file whose tensors are given in pieces, in order, never whole.

    The format (8-byte little-endian header length, a JSON header of dtype / shape / byte
    offsets per tensor, then the raw row-major little-endian data) lets the header be written
    first when every tensor's dtype and shape are known; the data follow as they come. The
    header is padded with spaces to a multiple of 8 bytes so every tensor starts aligned.

    Args:
        path: the file to write (created or truncated).
        entries: (name, dtype, shape) of every tensor, in the order they will be written.
        metadata: string → string pairs for the header's ``__metadata__``.

    :meth:`write` appends a piece of the current tensor; pieces of one tensor are consecutive
    row blocks (flattened, they concatenate to the tensor). ``sha256`` and ``bytes`` are known
    after :meth:`close`, which raises :class:`WeightsError` if a tensor was left incomplete.
    """

    def __init__(self, path: str | os.PathLike, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict = {"__metadata__": dict(metadata or {})}
        self._sizes: list[tuple[str, torch.dtype, int]] = []
        offset = 0
        for name, dtype, shape in entries:
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._sizes.append((name, dtype, size))
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._hash = hashlib.sha256()
        self._file = open(self.path, "wb")
        self._put(struct.pack("<Q", len(text)) + text)
        self._index, self._written = 0, 0

    def _put(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)

    def write(self, name: str, piece: torch.Tensor) -> None:
        """Append ``piece`` (a row block of tensor ``name``, which must be the current one).

        Raises:
            WeightsError: another tensor was expected, or the piece has the wrong dtype or size.
        """
        if self._index >= len(self._sizes) or self._sizes[self._index][0] != name:
            expected = self._sizes[self._index][0] if self._index < len(self._sizes) else "none"
            raise WeightsError(f"{self.path}: got tensor {name}, expected {expected}")
        _, dtype, size = self._sizes[self._index]
        if piece.dtype != dtype:
            raise WeightsError(f"{self.path}: tensor {name} piece is {piece.dtype}, declared {dtype}")
        data = piece.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        if self._written + data.nbytes > size:
            raise WeightsError(f"{self.path}: tensor {name} got more than its {size} bytes")
        self._put(memoryview(data))
        self._written += data.nbytes
        if self._written == size:
            self._index, self._written = self._index + 1, 0

    @property
    def done(self) -> bool:
        """True when every declared tensor is complete."""
        return self._index == len(self._sizes)

    def close(self) -> dict:
        """Flush and close; returns ``{"bytes": N, "sha256": hex}`` of the file."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if not self.done:
            raise WeightsError(f"{self.path}: closed with tensor {self._sizes[self._index][0]} incomplete")
        return {"bytes": self.path.stat().st_size, "sha256": self._hash.hexdigest()}


def plan_shards(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_bytes: int
                ) -> list[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """Split ``entries`` (in order) into files of at most ``max_shard_bytes`` each (a tensor
    larger than that gets a file of its own). Returns at least one (possibly empty) group."""
    groups: list[list] = [[]]
    size = 0
    for e in entries:
        nbytes = torch.Size(e[2]).numel() * torch.empty((), dtype=e[1]).element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += nbytes
    return groups


class ShardedWriter:
    """Writes tensors given in pieces, in order, into ``len(groups)`` safetensors files named by
    ``file_name(i, n)`` (0-based i) under ``out_dir``. Tensors must come in the order of the
    groups. ``files`` maps file names to ``{"bytes", "sha256"}`` once :meth:`close` returns, and
    ``weight_map`` tensor names to file names."""

    def __init__(self, out_dir: Path, groups: list[list[tuple[str, torch.dtype, tuple[int, ...]]]],
                 file_name, metadata: dict[str, str] | None = None, progress: bool = True, desc: str = "write"):
        self.out_dir, self.groups, self.file_name, self.metadata = out_dir, groups, file_name, metadata
        self.weight_map = {e[0]: file_name(i, len(groups)) for i, g in enumerate(groups) for e in g}
        self.files: dict[str, dict] = {}
        total = sum(torch.Size(e[2]).numel() * torch.empty((), dtype=e[1]).element_size() for g in groups for e in g)
        self._bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress)
        self._group = -1
        self._writer: SafetensorsWriter | None = None
        self._next_file()

    def _next_file(self) -> None:
        if self._writer is not None:
            self.files[self._writer.path.name] = self._writer.close()
        self._group += 1
        self._writer = None
        if self._group < len(self.groups):
            name = self.file_name(self._group, len(self.groups))
            self._writer = SafetensorsWriter(self.out_dir / name, self.groups[self._group], self.metadata)
            if self._writer.done:  # an empty group
                self._next_file()

    def write(self, name: str, piece: torch.Tensor) -> None:
        """Append a row block of tensor ``name`` (see :meth:`SafetensorsWriter.write`)."""
        if self._writer is None:
            raise WeightsError(f"{self.out_dir}: tensor {name} given after the last file was complete")
        self._writer.write(name, piece)
        self._bar.update(piece.numel() * piece.element_size())
        if self._writer.done:
            self._next_file()

    def close(self) -> None:
        """Check that every tensor was written. Raises :class:`WeightsError` otherwise."""
        self._bar.close()
        if self._writer is not None:
            missing = [e[0] for g in self.groups[self._group:] for e in g]
            raise WeightsError(f"{self.out_dir}: {len(missing)} tensors never written, first {missing[0]}")
