"""Prefix identity: the block hashes that say which part of a prompt an engine may have cached.

An engine with prefix caching (vLLM's automatic prefix caching, SGLang's radix cache) keeps
the KV blocks of prompts it has served; a later prompt that starts with the same tokens
reuses them and prefills only the rest. The router names a prompt's prefix by a chain of
block hashes: hash ``i`` identifies the prompt's first ``i + 1`` blocks (the whole prefix up
to and including block ``i``, as vLLM's block hashes and the Mooncake trace's ``hash_ids``
do), so two prompts share a cached prefix of exactly as many blocks as their leading
hashes agree.

A query may carry them (``Query.prefix_hashes``, with ``prefix_block_tokens`` tokens per
block, default 512 as in the Mooncake trace); otherwise ``Query.prefix_blocks`` derives them
from the prompt text by :func:`text_block_hashes`:

* the text the model reads (``Query.text()``: chat messages joined by newlines, so turn
  ``t + 1`` of a conversation starts with turn ``t``'s text) as UTF-8;
* cut into blocks of :data:`TEXT_BLOCK_BYTES` bytes; only whole blocks count (a partial
  last block is never a cache hit, as in vLLM);
* hash ``i`` = the first 8 bytes of BLAKE2b over bytes ``[0, (i + 1) * TEXT_BLOCK_BYTES)``,
  little-endian (computed incrementally, one pass over the text);
* a block counts as ``TEXT_BLOCK_BYTES / 4`` tokens (the 4-bytes-per-token rule of
  ``Query.estimated_prompt_tokens``), scaled by the producer's ``prompt_tokens`` when given.

There is no session or conversation id field: a chat query carries its conversation in its
messages, so the text-derived chain already links turn ``t + 1`` to turn ``t``, while an id
alone cannot say how many tokens two queries share.

Cost: one BLAKE2b pass over the text plus one 8-byte digest per 1 KiB block: ≈ 2.6 µs per
block here, 153 µs for a 15k-token prompt (``bench/prefix.py``). The routers and workers
call the same function, so the hashes agree across processes; no tokenizer is needed.
"""

from __future__ import annotations

import hashlib

TEXT_BLOCK_BYTES = 1024
"""Bytes of prompt text per derived block (≈ 256 tokens)."""

BYTES_PER_TOKEN = 4
MAX_PREFIX_BLOCKS = 65_536
"""Most block hashes one query may carry (65,536 blocks of 512 tokens is 32M tokens)."""

_PERSON = b"swy-prefix-v1"  # keeps derived hashes apart from any other use of BLAKE2b


def text_block_hashes(text: str | bytes) -> list[int]:
    """Chained hashes of the text's whole :data:`TEXT_BLOCK_BYTES` blocks (module docstring)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    n = min(len(data) // TEXT_BLOCK_BYTES, MAX_PREFIX_BLOCKS)
    if n == 0:
        return []
    view = memoryview(data)
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    out = [0] * n
    for i in range(n):
        h.update(view[i * TEXT_BLOCK_BYTES : (i + 1) * TEXT_BLOCK_BYTES])
        out[i] = int.from_bytes(h.copy().digest(), "little")
    return out


def text_block_tokens(text_bytes: int, prompt_tokens: int | None) -> float:
    """Tokens one derived block stands for: 256, or the producer's own tokens per byte."""
    nominal = TEXT_BLOCK_BYTES / BYTES_PER_TOKEN
    if prompt_tokens is None or text_bytes <= 0:
        return nominal
    return TEXT_BLOCK_BYTES * prompt_tokens / text_bytes


def reconciled_capacity(
    capacity_tokens: float,
    max_tokens: float,
    predicted_hit_tokens: float,
    engine_hit_tokens: float,
    min_evidence_tokens: float = 4096.0,
) -> float:
    """The model's capacity after comparing its hits with the engine's own count.

    Over the same requests, the model predicted ``predicted_hit_tokens`` cached tokens and
    the engine found ``engine_hit_tokens`` (vLLM: ``prefix_cache_hits_total``). A model that
    predicts more hits than the engine finds keeps blocks the engine has evicted (other
    traffic, a smaller cache than configured, prefix caching off): its capacity shrinks by
    that ratio (at most halved per call); one that predicts fewer grows back (at most
    doubled), never beyond ``max_tokens`` (the KV cache) nor under 1% of it. Too little
    evidence (under ``min_evidence_tokens`` either way) changes nothing.
    """
    if max(predicted_hit_tokens, engine_hit_tokens) < min_evidence_tokens:
        return capacity_tokens
    ratio = engine_hit_tokens / max(predicted_hit_tokens, 1.0)
    if abs(ratio - 1.0) <= 0.1:
        return capacity_tokens
    new = capacity_tokens * min(max(ratio, 0.5), 2.0)
    return float(min(max(new, 0.01 * max_tokens), max_tokens))


def full_blocks(n_hashes: int, prompt_tokens: int, block_tokens: float) -> int:
    """Blocks of a prompt an engine caches once it is prefilled: only whole ones."""
    return min(n_hashes, int(prompt_tokens / block_tokens + 1e-9))
