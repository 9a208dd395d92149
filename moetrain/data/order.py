"""The order in which a source's samples are visited: a keyed pseudo-random permutation of
``[0, n)`` per epoch, computed for one position at a time in O(1) memory.

Why computed rather than stored: an epoch over Llama 3's or DeepSeek-V3's 15T tokens in
4,096-token samples is 3.7 billion samples; a stored permutation (int64) is 29 GB per rank,
rebuilt at every start, and Megatron-LM's index files (``GPTDataset``'s ``shuffle_idx`` and
``sample_idx``, built once and memory-mapped) are the same size on disk. A rank only ever needs
the sample ids of the positions it reads, so moetrain evaluates the permutation there:

:class:`FeistelPermutation` is a balanced Feistel network (Luby & Rackoff 1988) over the
smallest domain ``[0, 4^h)`` that holds ``n``, with a keyed mixing function as its round
function, restricted to ``[0, n)`` by *cycle-walking* (Black & Rogaway 2002, §3): a value that
lands outside ``[0, n)`` is encrypted again until it lands inside. A Feistel network is a
bijection of its domain whatever its round function, and cycle-walking keeps a bijection on the
subset, so the result is a permutation of ``[0, n)``; since ``4^h < 4n``, an evaluation walks
fewer than 4 times on average. Six rounds (with random round functions Luby-Rackoff's 3 give a
pseudo-random permutation and 4 a strong one; two more because the mixing function is fast
rather than cryptographic). ``tests/test_data_order.py`` checks the permutation property and uniformity.

Each epoch of each source has its own key, derived from ``(seed, source name, epoch)`` with
sha256, so the order is the same on every machine, in every layout and after every restart.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["FeistelPermutation", "epoch_permutation"]

_ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele, Lea & Flood 2014): a bijective 64-bit mix in which each
    input bit flips about half the output bits. ``x``: uint64 array (arrays, never numpy
    scalars: their multiplication warns on the intended wrap-around)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """A keyed permutation of ``[0, n)``, evaluated at any index in O(1) memory.

    Args:
        n: the domain size, >= 1.
        key: any bytes; the six 64-bit round keys are its sha256-derived expansion.

    Raises:
        ValueError: ``n`` < 1 or above 2**62.

    ``perm(i)`` for an int, ``perm.map(indices)`` for an int64 array (vectorised).
    """

    def __init__(self, n: int, key: bytes):
        if not 1 <= n <= 2**62:
            raise ValueError(f"n={n}: a permutation needs 1 <= n <= 2**62")
        self.n = int(n)
        # Half-width in bits: the domain is [0, 4**h), the smallest that holds n (h >= 1).
        self.half_bits = max(1, ((self.n - 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self.half_bits) - 1)
        self._shift = np.uint64(self.half_bits)
        digest = hashlib.sha256(b"moetrain-feistel\0" + key).digest() + hashlib.sha256(key).digest()
        self._keys = [np.frombuffer(digest[8 * r:8 * r + 8], dtype="<u8").astype(np.uint64) for r in range(_ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._shift, x & self._mask
        for k in self._keys:
            left, right = right, left ^ (_mix(right ^ k) & self._mask)
        return (left << self._shift) | right

    def map(self, indices: np.ndarray) -> np.ndarray:
        """The images of ``indices`` (int array, every value in ``[0, n)``): int64, same shape.

        Raises:
            IndexError: an index outside ``[0, n)``.
        """
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"index out of range [0, {self.n}): {idx.min()}..{idx.max()}")
        x = self._encrypt(idx.astype(np.uint64).reshape(-1))
        out = x >= np.uint64(self.n)
        while out.any():  # cycle-walking: re-encrypt what left [0, n)
            x[out] = self._encrypt(x[out])
            out = x >= np.uint64(self.n)
        return x.astype(np.int64).reshape(idx.shape)

    def __call__(self, index: int) -> int:
        return int(self.map(np.array([index]))[0])


def epoch_permutation(n: int, seed: int, source: str, epoch: int) -> FeistelPermutation:
    """The order of epoch ``epoch`` (0-based) of a source of ``n`` samples: its key is
    ``(seed, source, epoch)``, so each epoch is reshuffled and each source shuffled on its own."""
    return FeistelPermutation(n, f"{int(seed)}\0{source}\0{int(epoch)}".encode())
