"""Cost of prefix identity per query (issue 14): deriving a prompt's block hashes from its
text (``schemas.prefix.text_block_hashes``), and a window's hits on one instance
(``routing.prefix.WindowPrefixes``).

Prints medians over repeats, the load average, and the ratio to a reference timed in the
same run (one SHA-256 pass over the same bytes: what any content hash must at least pay).

    .venv/bin/python bench/prefix.py
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import numpy as np

from routing.prefix import WindowPrefixes
from schemas.prefix import text_block_hashes


def median_us(fn: object, repeats: int = 50) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(out))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    rng = np.random.default_rng(0)
    print(f"load average {os.getloadavg()}")
    print("prompt tokens | bytes | blocks | hash us | sha256 us | ratio")
    for tokens in (1_000, 15_000, 128_000):
        text = "".join(chr(int(c)) for c in rng.integers(97, 123, tokens * 4))
        data = text.encode()
        n_blocks = len(text_block_hashes(text))
        h = median_us(lambda text=text: text_block_hashes(text))
        ref = median_us(lambda data=data: hashlib.sha256(data).digest())
        print(f"{tokens:>13,} | {len(data):>7,} | {n_blocks:>6} | {h:>7.1f} | {ref:>9.1f} | {h / ref:.1f}")
    # a window of 64 queries of 60 blocks each, against an instance caching 2,000 blocks
    blocks = [(rng.integers(0, 2**63, 60).astype(np.uint64), 256.0) for _ in range(64)]
    cached = np.sort(np.concatenate([b for b, _ in blocks[:32]] + [rng.integers(0, 2**63, 80).astype(np.uint64)]))
    wp = WindowPrefixes.build(blocks, np.full(64, 15_000))
    hit = median_us(lambda: wp.hit_tokens(cached), 200)
    share = median_us(lambda: wp.sharing(), 200)
    mat = median_us(lambda: wp.shared_matrix(np.arange(16)), 200)
    print(f"window of 64 x 60 blocks: hits on one instance {hit:.1f} us, sharing {share:.1f} us, "
          f"16-query shared matrix {mat:.1f} us")  # fmt: skip
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
