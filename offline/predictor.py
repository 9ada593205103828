"""The predictor every policy gets when none is given: trained from vendored data, cached.

No generated binary is committed. The default is a *recipe*: which vendored, licensed
routing data (``data/routing/llmrouter_dc9``, MIT; see its README) and which settings
``routing.quality.train_predictor`` is called with. The first ``switchyard router`` (or
``simulate``…) that needs it trains it (~15-30 s, with progress) and caches the artefact
under ``$SWITCHYARD_HOME/predictors/``; later starts load the cached file.

The cache key is the SHA-256 of the recipe, of the data file's bytes and of the source of
the modules that shape the artefact (``routing/quality/``, ``routing/features.py``,
``routing/length.py``, ``routing/datasets.py``, ``offline/datasets.py``): change the estimator, its code, or the
data, and the next start trains anew rather than loading a stale artefact. The mechanism
knows nothing of the estimators: it passes the recipe's names to ``train_predictor``.
Concurrent starts train once (a file lock); the artefact is written atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from loaders.predictor import load_predictor, save_predictor
from routing.features import Featurizer, HashedNgramFeaturizer
from routing.quality import QualityPredictor
from wiring.paths import REPO_ROOT

ROUTING_ROOT = REPO_ROOT / "routing"
VENDORED = REPO_ROOT / "data" / "routing"
# the code whose changes make a cached artefact stale
_FINGERPRINTED = ("quality", "features.py", "length.py", "datasets.py")


@dataclass(frozen=True)
class PredictorRecipe:
    """How the default predictor is trained (``switchyard train`` options by another name)."""

    data: str = "llmrouter_dc9/scores_long.csv.gz"  # under data/routing/
    format: str = "long"
    estimator: str = "knn"
    featurizer: str = "hashed"
    replicates: int = 8
    level: float = 0.9
    seed: int = 0
    # knn only: the training rows clustered into this many prototypes, each query scoring
    # those (0: every training row, exact neighbours); prototype_k 0: as many prototypes as
    # hold k rows on average (routing/quality/knn.py; docs/benchmarks/quality.md)
    prototypes: int = 1024
    prototype_k: int = 0
    # hashed featurizer only (routing/features.py): char 3-grams and words (no 4-grams), the
    # projection summed in float32; routes as well as the featurizer's own defaults (3- and
    # 4-grams, float64) on dc9, ccf20 and nq6, its features ~3.5 µs a query cheaper in the
    # router (docs/benchmarks/quality.md "Cheaper hashed features"; service.md round nine)
    ngram_widths: tuple[int, ...] = (3,)
    feature_rank: int = 64
    projection_dtype: str = "float32"

    @property
    def data_path(self) -> Path:
        return VENDORED / self.data


DEFAULT_RECIPE = PredictorRecipe()

Progress = Callable[[str], None]


def _sha256_file(path: Path, h: hashlib._Hash) -> None:
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)


def code_fingerprint() -> str:
    h = hashlib.sha256()
    for name in _FINGERPRINTED:
        root = ROUTING_ROOT / name
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for f in files:
            h.update(str(f.relative_to(ROUTING_ROOT)).encode())
            _sha256_file(f, h)
    return h.hexdigest()


def cache_key(recipe: PredictorRecipe) -> str:
    """SHA-256 over the recipe, the data's bytes and the training code (first 16 hex digits)."""
    h = hashlib.sha256(json.dumps(asdict(recipe), sort_keys=True).encode())
    _sha256_file(recipe.data_path, h)
    h.update(code_fingerprint().encode())
    return h.hexdigest()[:16]


def cached_path(cache_dir: Path, recipe: PredictorRecipe = DEFAULT_RECIPE) -> Path:
    return cache_dir / f"{recipe.estimator}-{Path(recipe.data).parent.name}-{cache_key(recipe)}.npz"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def train(recipe: PredictorRecipe, progress: Progress | None = None) -> QualityPredictor:
    from loaders.minilm import minilm_source
    from offline.blas import limit_blas_threads
    from offline.datasets import load_routing_data
    from routing.quality import train_predictor

    limit_blas_threads(1)  # spinning BLAS threads slow training several-fold on a shared machine
    say = progress or (lambda _msg: None)
    say(f"reading {recipe.data_path.name} ({recipe.data_path.parent.name})")
    data = load_routing_data(recipe.data_path, recipe.format)
    say(f"training {recipe.estimator} on {data.n} queries × {len(data.models)} models, "
        f"{recipe.replicates} bootstrap replicates")  # fmt: skip
    pred = train_predictor(
        data,
        recipe.estimator,
        featurizer(recipe),
        recipe.replicates,
        recipe.level,
        seed=recipe.seed,
        estimator_kwargs=(
            {"prototypes": recipe.prototypes, "prototype_k": recipe.prototype_k}
            if recipe.estimator == "knn"
            else None
        ),
        minilm=None if recipe.featurizer == "hashed" else minilm_source(),
    )
    pred.meta.update({"recipe": asdict(recipe), "data": recipe.data, "format": recipe.format})
    return pred


def featurizer(recipe: PredictorRecipe) -> str | Featurizer:
    """The recipe's featurizer: its kind, with the recipe's settings when ``hashed``."""
    if recipe.featurizer != "hashed":
        return recipe.featurizer
    return HashedNgramFeaturizer(
        rank=recipe.feature_rank,
        ngram_widths=recipe.ngram_widths,
        projection_dtype=recipe.projection_dtype,
    )


def ensure_default_predictor(
    cache_dir: Path, recipe: PredictorRecipe = DEFAULT_RECIPE, progress: Progress | None = None
) -> Path:
    """The cached artefact for ``recipe``, trained first when missing (once, under a lock)."""
    path = cached_path(cache_dir, recipe)
    if path.exists():
        return path
    with _locked(path):
        if not path.exists():  # another process may have trained it while we waited
            save_predictor(train(recipe, progress), path)
            if progress is not None:
                progress(f"saved {path}")
    return path


def default_predictor(
    cache_dir: Path, recipe: PredictorRecipe = DEFAULT_RECIPE, progress: Progress | None = None
) -> QualityPredictor:
    return load_predictor(ensure_default_predictor(cache_dir, recipe, progress))
