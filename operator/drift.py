"""Drift: where a live child object no longer says what the operator would apply. Pure.

The spec hash (desired.py) catches changes of the spec; this catches changes made to a child
by hand (kubectl edit/scale/patch) - every reconcile pass compares each desired object with
its live copy and re-applies the ones that drifted, so the timer undoes a hand edit within
one interval. The comparison asks "would our server-side apply change something?":

  - mappings: every key we set must be there with the same value; keys we do not set (API
    server defaults, other managers' labels) are not drift;
  - lists of named items (containers, env, ports, volumes...): each item we set must match
    the live item of the same name; items others added survive an apply, so they are not drift;
  - other lists (args, ingress rules, tolerations) are atomic: same length, item by item;
  - resource quantities compare by value: the API server rewrites "1024Mi" as "1Gi".
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))([KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?$")
_BINARY = {f"{p}i": Decimal(1024) ** (i + 1) for i, p in enumerate("KMGTPE")}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
            "P": Decimal("1e15"), "E": Decimal("1e18")}
_QUANTITY_PARENTS = frozenset({"requests", "limits"})
_QUANTITY_KEYS = frozenset({"sizeLimit"})


def quantity(value: Any) -> Decimal | None:
    """The value of a Kubernetes resource quantity ("500m", "4Gi", 2), or None."""
    match = _QUANTITY.match(str(value).strip())
    if match is None:
        return None
    number, suffix = match.group(1), match.group(2) or ""
    try:
        if suffix[:1] in ("e", "E") and len(suffix) > 1:
            return Decimal(number) * Decimal(10) ** int(suffix[1:])
        return Decimal(number) * (_BINARY.get(suffix) or _DECIMAL[suffix])
    except (InvalidOperation, KeyError):
        return None


def differences(want: Any, have: Any) -> list[str]:
    """Paths where `have` (live) does not hold what `want` (desired) sets; empty: no drift."""
    return list(_diff(want, have, "", quantities=False))


def _diff(want: Any, have: Any, path: str, *, quantities: bool) -> Iterator[str]:
    if isinstance(want, Mapping):
        if not isinstance(have, Mapping):
            yield path or "."
            return
        quantity_map = path.rpartition(".")[2] in _QUANTITY_PARENTS  # resources.requests/limits
        for key, value in want.items():
            sub = f"{path}.{key}" if path else str(key)
            if key not in have:
                yield sub
            else:
                yield from _diff(value, have[key], sub, quantities=quantity_map or key in _QUANTITY_KEYS)
    elif isinstance(want, list):
        yield from _diff_list(want, have, path)
    elif want != have and not (quantities and _same_quantity(want, have)):
        yield path


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(i, Mapping) and "name" in i for i in items)


def _diff_list(want: list[Any], have: Any, path: str) -> Iterator[str]:
    if not isinstance(have, list):
        yield path
    elif _named(want) and all(isinstance(i, Mapping) for i in have):
        live = {i.get("name"): i for i in have}
        for item in want:
            sub = f"{path}[{item['name']}]"
            if item["name"] not in live:
                yield sub
            else:
                yield from _diff(item, live[item["name"]], sub, quantities=False)
    elif len(want) != len(have):
        yield path
    else:
        for i, (w, h) in enumerate(zip(want, have, strict=True)):
            yield from _diff(w, h, f"{path}[{i}]", quantities=False)


def _same_quantity(a: Any, b: Any) -> bool:
    qa, qb = quantity(a), quantity(b)
    return qa is not None and qa == qb
