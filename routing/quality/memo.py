"""A bounded memo of per-text quality predictions, keyed by a hash of the text.

A prediction is a function of the query's text alone (the features are row by row and
the kNN's similarity products have a fixed shape, ``knn.SIM_BLOCK_ROWS``), so a text seen
before can take its rows from here: equal to a recomputation to float32 rounding (bit for
bit where BLAS rounds every row of a block alike; some CPUs' kernels round a row by its
position in the block, ~1e-7 relative). Keys are 16-byte BLAKE2b digests of the
UTF-8 text (the memo holds no prompt text); values sit in preallocated ``[capacity, m]``
arrays, overwritten first in, first out once full.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from routing.types import FloatArray, IntArray


def text_key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class PredictionMemo:
    """``capacity`` texts' (mean, lower, std) rows of ``n_models`` columns each."""

    def __init__(self, capacity: int, n_models: int) -> None:
        if capacity < 1:
            raise ValueError(f"memo capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._slot: dict[bytes, int] = {}
        self._owner: list[bytes | None] = [None] * capacity
        self._next = 0
        self.mean: FloatArray = np.zeros((capacity, n_models))
        self.lower: FloatArray = np.zeros((capacity, n_models))
        self.std: FloatArray = np.zeros((capacity, n_models))
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._slot)

    def lookup(self, keys: Sequence[bytes]) -> IntArray:
        """The slot of each key, -1 where it is not held."""
        get = self._slot.get
        out: IntArray = np.fromiter((get(k, -1) for k in keys), np.int64, len(keys))
        return out

    def store(
        self, keys: Sequence[bytes], mean: FloatArray, lower: FloatArray, std: FloatArray
    ) -> None:
        """Hold rows ``i`` of the arrays under ``keys[i]`` (distinct keys, none held yet); the
        oldest entries make room. Only the last ``capacity`` rows are kept when more come."""
        start = max(0, len(keys) - self.capacity)
        kept = keys[start:]
        slots = (self._next + np.arange(len(kept), dtype=np.int64)) % self.capacity
        owner, slot = self._owner, self._slot
        for key, s in zip(kept, slots.tolist(), strict=True):
            old = owner[s]
            if old is not None:
                del slot[old]
            owner[s] = key
            slot[key] = s
        self.mean[slots] = mean[start:]
        self.lower[slots] = lower[start:]
        self.std[slots] = std[start:]
        self._next = (self._next + len(kept)) % self.capacity
