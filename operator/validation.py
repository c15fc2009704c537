"""Offline validation of the rendered children against the Kubernetes API's own schemas.

The spec passes some fields through unchanged (pod env sources, volumes, affinity, peers):
a field the API server would refuse must be caught before any child is applied, or a pass
would apply half a deployment and fail on the rest, forever. kubernetes-validate bundles
the OpenAPI schemas of every Kubernetes release it knows (no network at run time); strict
mode refuses unknown fields, as the API server's strict field validation does. A Deployment
takes ~30 ms to check, so results are cached by the object's content hash.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import kubernetes_validate

from triptych.kube import names

# The oldest Kubernetes release the operator supports: a field it lacks is refused.
SCHEMA_VERSION = "1.33"
UNCHECKED_KINDS = frozenset({"ServiceMonitor"})  # a CRD of its own: not in the bundled schemas
_CACHE_SIZE = 4096
_cache: dict[tuple[str, str, str], str | None] = {}


def _where(path: Iterable[Any]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def object_problem(obj: Mapping[str, Any]) -> str | None:
    """Why the API server would refuse `obj`, or None."""
    meta = obj.get("metadata", {})
    try:
        kubernetes_validate.validate(dict(obj), SCHEMA_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{obj['kind']} {meta.get('name')}: {_where(e.path) or '(root)'}: {e.message}"
    return None


def invalid_objects(objects: Iterable[Mapping[str, Any]]) -> list[str]:
    """One line per rendered object the API server would refuse."""
    problems = []
    for obj in objects:
        if obj["kind"] in UNCHECKED_KINDS:
            continue
        meta = obj.get("metadata", {})
        key = (obj["kind"], meta.get("name", ""), (meta.get("annotations") or {}).get(names.ANNOTATION_SPEC_HASH, ""))
        if not key[2] or key not in _cache:
            result = object_problem(obj)
            if key[2]:
                if len(_cache) >= _CACHE_SIZE:
                    _cache.clear()
                _cache[key] = result
        else:
            result = _cache[key]
        if result is not None:
            problems.append(result)
    return problems
