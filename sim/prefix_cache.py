"""The simulated engine's own prefix cache, kept the way vLLM's automatic prefix caching
keeps it (issue 14, "per-instance cache state").

Blocks are named by chained hashes (``schemas.prefix``). A block is either *in use* (held by
requests on the engine: a reference count) or *free*: its KV is still in the cache and can be
reused, but it is evicted, least recently freed first, when the engine needs the room. So:

- a request's leading blocks that the cache holds (in use or free) are hits: it prefills only
  the rest; at admission they become in use;
- as its prefill proceeds, its whole computed prompt blocks are cached (in use);
- when it finishes (or is preempted), its blocks are released: a block whose count drops to 0
  joins the free list at its most recent end;
- the free blocks' tokens never exceed the KV cache's free tokens (``evict_to``).

Differences from vLLM, shared with the router's model: a block is the query's hash block
(512 tokens in the Mooncake trace, 1 KiB of text otherwise), not vLLM's 16 tokens; the
scheduler's admission counts each running request's KV in full (``routing.scheduling``),
blocks it shares with another running request included, though the room left for free
cached blocks counts a shared block once (``shared_tokens``), as vLLM's one copy is.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import numpy.typing as npt

HashArray = npt.NDArray[np.uint64]


class EnginePrefixCache:
    """In-use reference counts and an LRU free list of cached blocks (tokens each)."""

    def __init__(self) -> None:
        self._in_use: dict[int, list[float]] = {}  # hash -> [refcount, tokens]
        self._free: OrderedDict[int, float] = OrderedDict()
        self.free_tokens = 0.0
        self.shared_tokens = 0.0  # tokens of in-use blocks held by more than one request, less one copy
        self.version = 0  # bumped whenever the set of cached hashes changes
        self.queries = 0  # prompt tokens looked up (vLLM: prefix_cache_queries_total)
        self.hits = 0  # of which were hits (vLLM: prefix_cache_hits_total)

    def __contains__(self, h: int) -> bool:
        return h in self._in_use or h in self._free

    def __len__(self) -> int:
        return len(self._in_use) + len(self._free)

    def leading_hits(self, hashes: list[int]) -> int:
        """How many leading blocks of ``hashes`` are cached."""
        n = 0
        for h in hashes:
            if h not in self._in_use and h not in self._free:
                break
            n += 1
        return n

    def acquire(self, hashes: list[int], block_tokens: float) -> None:
        """A request holds these blocks (its hits at admission, or its own once prefilled)."""
        changed = False
        for h in hashes:
            ref = self._in_use.get(h)
            if ref is not None:
                ref[0] += 1
                self.shared_tokens += ref[1]
                continue
            t = self._free.pop(h, None)
            if t is not None:
                self.free_tokens -= t
            else:
                changed = True
            self._in_use[h] = [1.0, block_tokens if t is None else t]
        if changed:
            self.version += 1

    def release(self, hashes: list[int]) -> None:
        """A request lets go of its blocks (finished or preempted): in reverse order, as
        vLLM's ``KVCacheManager.free`` does, so its tail joins the free list first and is
        evicted first — the head, which later prompts share, stays longest."""
        for h in reversed(hashes):
            ref = self._in_use.get(h)
            if ref is None:
                continue
            ref[0] -= 1
            if ref[0] > 0:
                self.shared_tokens -= ref[1]
            else:
                del self._in_use[h]
                self._free[h] = ref[1]
                self.free_tokens += ref[1]

    def evict_to(self, room_tokens: float) -> None:
        """Drop free blocks, least recently freed first, until they fit in ``room_tokens``."""
        if self.free_tokens <= room_tokens + 1e-9 or not self._free:
            return
        while self._free and self.free_tokens > room_tokens + 1e-9:
            _, t = self._free.popitem(last=False)
            self.free_tokens -= t
        if not self._free:
            self.free_tokens = 0.0
        self.version += 1

    def cached(self) -> HashArray:
        """Every cached hash, sorted."""
        keys = list(self._in_use) + list(self._free)
        return np.sort(np.fromiter(keys, np.uint64, len(keys)))

    def count(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.queries += int(prompt_tokens)
        self.hits += int(hit_tokens)
