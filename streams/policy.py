"""Pick the routing policy by name; the service itself never routes.

``name`` is a policy registered in ``routing.policies`` (e.g. the default
``batch-ilp-sfs``), or ``package.module:factory`` for a policy outside this repository:
``factory(cluster)`` must return an object with the ``routing.types.Router`` protocol.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from routing.types import Router
from schemas import ClusterConfig


class PolicyError(ValueError):
    """The policy could not be loaded; the message says which and why."""


def load_router(name: str, cluster: ClusterConfig, predictor: str | Path | None = None) -> Router:
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise PolicyError(
                f"policy {name!r}: cannot import module {module_name!r}: {exc}"
            ) from exc
        factory = getattr(module, attr, None)
        if factory is None:
            raise PolicyError(f"policy {name!r}: module {module_name!r} has no attribute {attr!r}")
        router = (
            factory(cluster) if callable(factory) and not isinstance(factory, Router) else factory
        )
    else:
        router = _from_registry(name, cluster, predictor)
    if not isinstance(router, Router):
        raise PolicyError(
            f"policy {name!r} gave {type(router).__name__}, which has no decide(...) method"
        )
    return router


def _from_registry(name: str, cluster: ClusterConfig, predictor: str | Path | None) -> Router:
    try:
        policies: Any = importlib.import_module("routing.policies")
    except ImportError as exc:
        raise PolicyError(f"policy {name!r}: routing.policies is not available ({exc})") from exc
    ctx_type = getattr(policies, "RouterContext", None)
    make = getattr(policies, "make_router", None)
    if make is None or ctx_type is None:
        raise PolicyError("routing.policies has no make_router/RouterContext")
    ctx = _context(policies, ctx_type, cluster, predictor)
    try:
        return make(name, ctx)  # type: ignore[no-any-return]
    except KeyError as exc:
        known = getattr(policies, "POLICIES", None) or getattr(policies, "REGISTRY", None)
        hint = f"; known: {sorted(known)}" if known else ""
        raise PolicyError(f"unknown policy {name!r}{hint}") from exc


def _context(
    policies: Any, ctx_type: Any, cluster: ClusterConfig, predictor: str | Path | None
) -> Any:
    """Build ``RouterContext`` with whatever helper ``routing.policies`` offers."""
    for helper in ("context_for", "build_context", "default_context"):
        fn = getattr(policies, helper, None) or getattr(ctx_type, helper, None)
        if fn is not None:
            params = inspect.signature(fn).parameters
            kwargs: dict[str, Any] = {}
            if "predictor" in params:
                kwargs["predictor"] = predictor
            elif "predictor_path" in params:
                kwargs["predictor_path"] = predictor
            return fn(cluster, **kwargs)
    params = inspect.signature(ctx_type).parameters
    kwargs = {}
    if "cluster" in params:
        kwargs["cluster"] = cluster
    if predictor is not None and "quality" in params:
        from routing.quality import load_predictor  # type: ignore[attr-defined]

        kwargs["quality"] = load_predictor(predictor)
    return ctx_type(**kwargs)
