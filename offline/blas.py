"""Process-wide BLAS thread cap for offline training and benchmarks."""

from __future__ import annotations

from pathlib import Path


def limit_blas_threads(n: int) -> None:
    """Cap numpy's OpenBLAS threads (they busy-wait: on a loaded machine the small
    matrices of training run several times slower with them). No-op when absent."""
    import ctypes
    import glob

    import numpy as np

    for lib in glob.glob(
        str(Path(np.__file__).parent.parent / "numpy.libs" / "libscipy_openblas*.so")
    ):
        put = getattr(ctypes.CDLL(lib), "scipy_openblas_set_num_threads64_", None)
        if put is not None:
            put(int(n))
