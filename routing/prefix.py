"""Prefix-cache hits as the router sees them (DESIGN.md, "Prefix reuse"; issue 14).

A query's prefix is a chain of block hashes (``schemas.prefix``): hash ``i`` names its
first ``i + 1`` blocks, each ``block_tokens`` tokens. An instance's cache is a set of such
hashes. Then, for query ``q`` on instance ``j``:

    hit_tokens(q, j) = min(L * block_tokens_q, prompt_q - 1),
    L = length of the leading run of q's hashes that j holds

(vLLM always recomputes at least the last prompt token). Within one window, query ``r``
shares ``S_r`` leading blocks with an earlier query ``parent_r`` (the longest such prefix);
if both go to the same instance, ``r`` finds those blocks cached once the parent's prefill
is done: the first query warms the cache for the next.

:class:`LruPrefixModel` is the bounded model of one instance's cache that the router keeps
(in the simulator here; in Redis with the same rules, ``state/``): blocks are touched when a
query is routed there and again when it finishes (tail first, so a query's first block is
its most recent: vLLM frees a request's blocks in reverse order, so a prompt's tail is
evicted before the head that later prompts share), and the least recently touched go first
once the blocks' tokens exceed the capacity.

All of it is vectorised over the window's queries (numpy), one call per instance.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

from schemas import Query
from schemas.prefix import full_blocks, reconciled_capacity

__all__ = [
    "ColumnPrefix",
    "LruPrefixModel",
    "WindowPrefixes",
    "routed_hit_tokens",
    "full_blocks",
    "query_block_hashes",
    "reconciled_capacity",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
HashArray = npt.NDArray[np.uint64]

_EMPTY_HASHES: HashArray = np.zeros(0, dtype=np.uint64)


def query_block_hashes(q: Query) -> tuple[HashArray, float]:
    """A query's prefix block hashes (``Query.prefix_blocks``) as an array, and tokens per
    block."""
    hashes, block = q.prefix_identity  # once per query, not copied (``Query.prefix_blocks``)
    return (np.asarray(hashes, dtype=np.uint64) if hashes else _EMPTY_HASHES), block


@dataclass(frozen=True)
class ColumnPrefix:
    """Prefix-cache facts about some queries (in order) on one instance, for SFS:
    ``hit_tokens[a]`` of query a's prompt are cached there; ``shared_tokens[a, b]`` (b < a,
    or None) it shares with query b; ``block_tokens[a]`` is its cache granularity."""

    hit_tokens: IntArray
    shared_tokens: IntArray | None
    block_tokens: FloatArray


@dataclass(frozen=True)
class WindowPrefixes:
    """The block hashes of a window's queries, concatenated (row ``i`` owns
    ``hashes[starts[i]:starts[i + 1]]``)."""

    hashes: HashArray  # [total]
    starts: IntArray  # [n + 1]
    block_tokens: FloatArray  # [n]
    prompt_tokens: IntArray  # [n]

    @property
    def n(self) -> int:
        return int(self.block_tokens.size)

    @property
    def n_blocks(self) -> IntArray:
        out: IntArray = np.diff(self.starts)
        return out

    @classmethod
    def build(
        cls,
        blocks: Sequence[tuple[HashArray, float]],
        prompt_tokens: IntArray,
    ) -> WindowPrefixes:
        sizes = np.fromiter((h.size for h, _ in blocks), np.int64, len(blocks))
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        hashes = (
            np.concatenate([h for h, _ in blocks]).astype(np.uint64)
            if sizes.sum()
            else _EMPTY_HASHES
        )
        tokens = np.fromiter((b for _, b in blocks), np.float64, len(blocks))
        return cls(hashes, starts, tokens, np.asarray(prompt_tokens, dtype=np.int64))

    @classmethod
    def of_queries(cls, queries: Sequence[Query], prompt_tokens: IntArray) -> WindowPrefixes:
        return cls.build([query_block_hashes(q) for q in queries], prompt_tokens)

    def _tokens(self, blocks: IntArray) -> IntArray:
        t = np.floor(blocks * self.block_tokens + 1e-9).astype(np.int64)
        out: IntArray = np.clip(np.minimum(t, self.prompt_tokens - 1), 0, None)
        return out

    def leading_blocks(self, cached: HashArray) -> IntArray:
        """Per query, how many of its leading blocks ``cached`` (sorted, unique) holds."""
        n = self.n
        if n == 0 or self.hashes.size == 0 or cached.size == 0:
            return np.zeros(n, dtype=np.int64)
        pos = np.searchsorted(cached, self.hashes)
        present = cached[np.minimum(pos, cached.size - 1)] == self.hashes
        return self._leading_run(present)

    @cached_property
    def _offset(self) -> IntArray:
        """Each block's position within its row."""
        idx = np.arange(self.hashes.size, dtype=np.int64)
        out: IntArray = idx - np.repeat(self.starts[:-1], self.n_blocks)
        return out

    def _leading_run(self, flags: npt.NDArray[np.bool_]) -> IntArray:
        """Per row, the length of the leading run of True in its slice of ``flags``."""
        n = self.n
        total = self.hashes.size
        # first miss of each row (its block count when every block is present)
        miss = np.where(flags, total + 1, self._offset)
        nb = self.n_blocks
        out = nb.copy()
        has = nb > 0
        if has.any():
            first = np.minimum.reduceat(miss, self.starts[:-1][has])
            out[has] = np.minimum(first, nb[has])
        return out.astype(np.int64) if n else np.zeros(0, dtype=np.int64)

    def hit_tokens(self, cached: HashArray) -> IntArray:
        """Per query, prompt tokens an instance holding ``cached`` need not prefill."""
        return self._tokens(self.leading_blocks(cached))

    @cached_property
    def _shared_all(self) -> IntArray:
        """``[n, n]``: tokens of query a's prompt that query b shares (any order)."""
        n = self.n
        nb = self.n_blocks
        if n < 2 or not nb.any():
            return np.zeros((n, n), dtype=np.int64)
        _, inv = np.unique(self.hashes, return_inverse=True)
        owner = np.repeat(np.arange(n), nb)
        inc = np.zeros((n, int(inv.max()) + 1), dtype=np.float64)
        inc[owner, inv] = 1.0
        common = np.rint(inc @ inc.T).astype(np.int64)  # [a, b] hashes in common
        whole = np.floor(self.prompt_tokens / self.block_tokens + 1e-9).astype(np.int64)
        blocks = np.minimum(common, np.minimum(whole, nb)[None, :])
        tokens = np.floor(blocks * self.block_tokens[:, None] + 1e-9).astype(np.int64)
        out: IntArray = np.maximum(np.minimum(tokens, (self.prompt_tokens - 1)[:, None]), 0)
        return out

    @cached_property
    def shares_any(self) -> bool:
        """Whether any two queries of the window hold a block hash in common; when not,
        every ``shared_matrix`` is zero (so SFS need not be given one)."""
        h = self.hashes
        return self.n >= 2 and h.size >= 2 and bool(np.unique(h).size < h.size)

    def shared_matrix(self, rows: IntArray) -> IntArray:
        """``[m, m]`` tokens of query ``rows[a]``'s prompt that ``rows[b]`` (b < a) shares:
        their common leading blocks (for chained hashes, the number of a's hashes that b
        holds), at most b's whole blocks (all it will cache), capped one token short. The
        window's whole matrix is built once (one BLAS product) and sliced."""
        r = np.asarray(rows, dtype=np.int64)
        if r.size < 2:
            return np.zeros((r.size, r.size), dtype=np.int64)
        out: IntArray = np.tril(self._shared_all[np.ix_(r, r)], -1)
        return out

    def sharing(self) -> tuple[IntArray, IntArray]:
        """``(parent, shared_tokens)`` per query: the earlier query of the window sharing
        the longest prefix with it (-1: none) and the tokens of that shared prefix (its
        own block size)."""
        n = self.n
        parent = np.full(n, -1, dtype=np.int64)
        if n < 2 or self.hashes.size == 0:
            return parent, np.zeros(n, dtype=np.int64)
        row = np.repeat(np.arange(n, dtype=np.int64), self.n_blocks)
        _, first_idx, inverse = np.unique(self.hashes, return_index=True, return_inverse=True)
        owner = row[first_idx][inverse]  # earliest row holding each hash
        earlier = owner < row
        shared = self._leading_run(earlier)
        has = shared > 0
        last = self.starts[:-1] + shared - 1
        parent[has] = owner[last[has]]
        # a parent caches only its whole blocks
        whole = np.floor(self.prompt_tokens / self.block_tokens + 1e-9).astype(np.int64)
        shared = np.where(has, np.minimum(shared, whole[np.maximum(parent, 0)]), 0)
        has = shared > 0
        parent[~has] = -1
        tokens = np.where(has, self._tokens(shared), 0).astype(np.int64)
        return parent, tokens


class LruPrefixModel:
    """The router's bounded model of one instance's prefix cache.

    ``touch`` (a query routed there, or finished there) moves its blocks to the most
    recent end; blocks beyond ``capacity_tokens`` (least recent first) are dropped. The
    same rules run in Redis (``state``) for the service.
    """

    def __init__(self, capacity_tokens: float) -> None:
        if not capacity_tokens > 0:
            raise ValueError(f"capacity_tokens must be > 0, got {capacity_tokens}")
        self.capacity_tokens = float(capacity_tokens)
        self._blocks: OrderedDict[int, float] = OrderedDict()
        self.tokens = 0.0
        self._sorted: HashArray | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def touch(self, hashes: HashArray | Sequence[int], block_tokens: float) -> None:
        """Make a query's blocks the most recent, its head the very most recent (the
        engine frees a request's blocks tail first, so its tail is evicted first)."""
        blocks = self._blocks
        for h in reversed(np.asarray(hashes, dtype=np.uint64).tolist()):
            old = blocks.pop(h, None)
            if old is not None:
                self.tokens -= old
            blocks[h] = block_tokens
            self.tokens += block_tokens
        if hashes is not None and len(hashes):
            self._sorted = None
        while self.tokens > self.capacity_tokens + 1e-9 and blocks:
            _, t = blocks.popitem(last=False)
            self.tokens -= t

    def leading_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of one query the model holds."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def resize(self, capacity_tokens: float) -> None:
        """A new capacity (e.g. reconciled with the engine's own hit counters)."""
        self.capacity_tokens = max(float(capacity_tokens), 1.0)
        self.touch(_EMPTY_HASHES, 0.0)
        self._sorted = None

    def cached(self) -> HashArray:
        """The hashes held, sorted (what ``WindowPrefixes.hit_tokens`` takes)."""
        if self._sorted is None:
            self._sorted = np.sort(np.fromiter(self._blocks.keys(), np.uint64, len(self._blocks)))
        return self._sorted


def routed_hit_tokens(
    queries: Sequence[Query],
    instance_ids: Sequence[str],
    cached: Mapping[str, HashArray | None],
) -> list[int | None]:
    """What the prefix model predicts each routed query finds cached where it was sent:
    the leading blocks ``cached[instance]`` (sorted, the window's snapshot) holds, or the
    prefix an earlier query of the same list sent to the same instance shares with it
    (that one's touch puts its blocks in the model first), whichever is longer. None for
    an instance without a model (``cached`` lacks it or holds None: a cloud model, a blind
    window). One vectorised pass per instance."""
    out: list[int | None] = [None] * len(queries)
    rows: dict[str, list[int]] = {}
    for i, iid in enumerate(instance_ids):
        rows.setdefault(iid, []).append(i)
    for iid, idx in rows.items():
        held = cached.get(iid)
        if held is None:
            continue
        qs = [queries[i] for i in idx]
        prompt = np.fromiter((q.estimated_prompt_tokens() for q in qs), np.int64, len(qs))
        wp = WindowPrefixes.of_queries(qs, prompt)
        _, shared = wp.sharing()
        hits = np.maximum(wp.hit_tokens(held), shared)
        for i, h in zip(idx, hits.tolist(), strict=True):
            out[i] = int(h)
    return out
