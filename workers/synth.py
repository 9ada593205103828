"""Synthetic output for simulated engines: how many tokens a request generates, and their text.

Lengths come from the request's ``max_tokens`` when given (a simulated model always uses
its whole allowance, so tests can predict it), else from a log-normal draw seeded by the
request's content, so the same request gets the same length on every run and server.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will more can out up about into than them only other time new some could these"
).split()


def seed_of(*parts: str) -> int:
    digest = hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "little")


def output_tokens(
    max_tokens: int | None,
    seed_text: str,
    mean_tokens: float = 128.0,
    sigma: float = 0.8,
    cap_tokens: int = 4096,
) -> int:
    """``max_tokens`` when given, else a seeded log-normal draw with mean ``mean_tokens``."""
    if max_tokens is not None:
        return max(1, int(max_tokens))
    rng = np.random.default_rng(seed_of("len", seed_text))
    mu = math.log(max(mean_tokens, 1.0)) - sigma * sigma / 2.0
    return int(min(cap_tokens, max(1, round(float(rng.lognormal(mu, sigma))))))


def token_text(seed_text: str, index: int) -> str:
    """Text of output token ``index`` (0-based): a word with a leading space."""
    return " " + WORDS[seed_of(seed_text, str(index)) % len(WORDS)]


def tokens_text(seed_text: str, start: int, stop: int) -> str:
    return "".join(token_text(seed_text, i) for i in range(start, stop))
