"""Featurizer cost on the routing hot path (issue 13, item 2): microseconds per query.

    .venv/bin/python bench/features.py                 # dc9 texts (vendored)
    .venv/bin/python bench/features.py --data ../shared/data/routing/irt_router_ccf20/scores.csv.gz --format irt-wide

Per featurizer (hashed, static, hybrid; minilm — the full transformer — on a few texts
only): the median cost per *new* text when a window of w texts is featurised in one
call (w = 1, 8, 64, 512), and the amortised cost per query behind a ``FeatureCache``
on a replayed stream (queries drawn with replacement from the texts, as the simulator
and retried traffic do; ``--distinct`` sets how many distinct texts the stream has).
One BLAS thread; the load average is printed with the figures. The ratio column is
each featurizer's cost over the hashed featurizer's in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders.minilm import minilm_source  # noqa: E402
from offline.datasets import load_routing_data  # noqa: E402
from routing.features import FeatureCache, make_featurizer  # noqa: E402


def _median_us_per_text(f: Any, texts: list[str], w: int, repeats: int, start: int) -> float:
    ts = []
    for r in range(repeats):
        batch = texts[start + r * w : start + (r + 1) * w]
        if len(batch) < w:
            break
        t = time.perf_counter()
        f.transform(batch)
        ts.append((time.perf_counter() - t) / w)
    return float(np.median(ts) * 1e6) if ts else float("nan")


def _amortised_us(f: Any, texts: list[str], n_queries: int, window: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    stream = [texts[i] for i in rng.integers(0, len(texts), n_queries)]
    cache = FeatureCache(f)
    t = time.perf_counter()
    for s in range(0, n_queries, window):
        cache.transform(stream[s : s + window])
    return (time.perf_counter() - t) / n_queries * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", default="data/routing/llmrouter_dc9/scores_long.csv.gz")
    ap.add_argument("--format", default="long")
    ap.add_argument("--fit-texts", type=int, default=2000)
    ap.add_argument(
        "--distinct", type=int, default=1000, help="distinct texts in the replayed stream"
    )
    ap.add_argument("--queries", type=int, default=20000, help="queries in the replayed stream")
    ap.add_argument("--window", type=int, default=64)
    args = ap.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    texts = load_routing_data(args.data, args.format).texts
    fit, rest = texts[: args.fit_texts], texts[args.fit_texts :]
    minilm = minilm_source()
    kinds = ["hashed"] + (["static", "hybrid"] if minilm is not None else [])
    out: dict[str, Any] = {
        "data": Path(args.data).name,
        "mean_chars": float(np.mean([len(t) for t in rest])),
        "load_avg_before": os.getloadavg(),
        "featurizers": {},
    }
    for kind in kinds:
        f = make_featurizer(kind, minilm=minilm).fit(fit)
        f.transform(rest[:8])  # warm: tables and tokenizer loaded
        row = {
            f"new_us_per_text_w{w}": _median_us_per_text(f, rest, w, max(3, 512 // w), 0)
            for w in (1, 8, 64, 512)
        }
        pool = rest[: args.distinct]
        row["amortised_us_per_query"] = _amortised_us(f, pool, args.queries, args.window, 0)
        out["featurizers"][kind] = row
    if minilm is not None:
        f = make_featurizer("minilm", minilm=minilm).fit(fit)
        f.transform(rest[:2])
        out["featurizers"]["minilm"] = {
            "new_us_per_text_w8": _median_us_per_text(f, rest, 8, 3, 0),
        }
    ref = out["featurizers"]["hashed"]
    for row in out["featurizers"].values():
        for k in list(row):
            if k in ref and not k.startswith("ratio"):
                row["ratio_" + k] = row[k] / ref[k]
    out["load_avg_after"] = os.getloadavg()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
