"""Cost of sending queries to models (DESIGN.md "Quality, cost and length predictors").

    cost_usd[i, j] = input_usd_per_token[j] * prompt_tokens[i]
                   + output_usd_per_token[j] * output_tokens[i, j]

Prompt tokens are counted by the caller when a tokenizer is at hand; otherwise
``estimate_prompt_tokens`` gives the usual rough heuristic (about 4 characters per
token for Latin script, about one token per CJK character).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from routing.types import FloatArray, IntArray

CHARS_PER_TOKEN = 4.0
"""Characters per token for ASCII text (OpenAI's rule of thumb for English)."""


def cost_usd(
    prompt_tokens: IntArray | FloatArray,
    output_tokens: FloatArray,
    input_usd_per_token: FloatArray,
    output_usd_per_token: FloatArray,
) -> FloatArray:
    """Money for each (query, model): ``[n] x [n, m] x [m] x [m] -> [n, m]``."""
    p = np.asarray(prompt_tokens, dtype=np.float64)
    o = np.asarray(output_tokens, dtype=np.float64)
    pin = np.asarray(input_usd_per_token, dtype=np.float64)
    pout = np.asarray(output_usd_per_token, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"prompt_tokens must be 1-D [n], got shape {p.shape}")
    n, m = p.shape[0], pin.shape[0]
    if pin.shape != (m,) or pout.shape != (m,):
        raise ValueError(
            f"input_usd_per_token and output_usd_per_token must both be [m], got {pin.shape} and {pout.shape}"
        )
    if o.shape != (n, m):
        raise ValueError(f"output_tokens must be [n, m] = [{n}, {m}], got shape {o.shape}")
    out: FloatArray = p[:, None] * pin[None, :] + o * pout[None, :]
    return out


def estimate_prompt_tokens(texts: Sequence[str], extra_chars: IntArray | None = None) -> IntArray:
    """Rough token count per text: ASCII characters / 4 plus one token per other character.

    ``extra_chars`` adds prompt characters that are not in the text (answer options, a
    template) and are counted as ASCII.
    """
    n = len(texts)
    out = np.empty(n, dtype=np.int64)
    for i, t in enumerate(texts):
        ascii_chars = len(t.encode("ascii", "ignore"))
        other = len(t) - ascii_chars
        out[i] = int(np.ceil(ascii_chars / CHARS_PER_TOKEN)) + other
    if extra_chars is not None:
        out = out + np.ceil(np.asarray(extra_chars, dtype=np.float64) / CHARS_PER_TOKEN).astype(
            np.int64
        )
    return np.maximum(out, 1)
