"""Pick the routing policy by name; the service itself never routes.

``name`` is a policy registered in ``routing.policies`` (e.g. the default
``batch-ilp-sfs``), or ``package.module:factory`` for a policy outside this repository:
``factory(cluster, **options)`` must return an object with the ``routing.types.Router``
protocol. ``options`` (``--policy-opt key=value``) go to the policy's constructor.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from routing.types import Router
from schemas import ClusterConfig


class PolicyError(ValueError):
    """The policy could not be loaded; the message says which and why."""


def load_router(
    name: str,
    cluster: ClusterConfig,
    predictor: str | Path | None = None,
    options: Mapping[str, Any] | None = None,
) -> Router:
    """The router ``name`` (a registered policy, or ``package.module:factory``) with policy
    ``options`` (``--policy-opt``: keyword arguments of its constructor or factory)."""
    opts = dict(options or {})
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
        if isinstance(factory, Router) or not callable(factory):
            if opts:
                raise PolicyError(f"policy {name!r} is an object, it takes no options {sorted(opts)}")
            router = factory
        else:
            try:
                router = factory(cluster, **opts)
            except TypeError as exc:
                raise PolicyError(f"policy {name!r}: bad options {sorted(opts)}: {exc}") from exc
    else:
        router = _from_registry(name, cluster, predictor, opts)
    if not isinstance(router, Router):
        raise PolicyError(
            f"policy {name!r} gave {type(router).__name__}, which has no decide(...) method"
        )
    return router


def _from_registry(
    name: str, cluster: ClusterConfig, predictor: str | Path | None, options: dict[str, Any]
) -> Router:
    try:
        from loaders.predictor import load_predictor
        from loaders.profiles import profiles_for
        from routing.policies import RouterContext, make_router
        from routing.quality import ArtefactError
    except ImportError as exc:
        raise PolicyError(f"policy {name!r}: routing.policies is not available ({exc})") from exc
    if predictor is None:
        raise PolicyError(
            f"policy {name!r} needs --predictor FILE, a quality predictor artefact "
            "(train one: switchyard train --data data/routing/llmrouter_dc9/scores_long.csv.gz --out FILE)"
        )
    try:
        quality: Any = load_predictor(predictor)
    except ArtefactError as exc:
        raise PolicyError(f"policy {name!r}: {exc}") from exc
    try:
        ctx = RouterContext.build(
            cluster,
            quality,
            length=getattr(quality, "length", None),
            profiles=profiles_for(cluster),
        )
        return make_router(name, ctx, **options)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise PolicyError(f"policy {name!r}: {exc}") from exc
