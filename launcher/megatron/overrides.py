"""Hydra-style overrides are applied as text: `train.train_iters=abc` sets a string where bridge
declares an int, and nothing complains until training (or the layout check) trips over it. The
value an override left is checked against the field's declared type here, in the driver."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

_PLAIN = (int, float, bool, str, type(None))


def override_type_problem(cfg: Any, key: str) -> str | None:
    """Why the value an override left at `key` (a dotted path) does not fit its field's declared type,
    or None. Only plain declared types are checked (int, float, bool, str, None, Literal and unions of
    them); a field that cannot be found or is declared otherwise is left to bridge."""
    *path, attr = key.split(".")
    parent = cfg
    for part in path:
        parent = getattr(parent, part, None)
        if parent is None:
            return None
    try:
        declared = typing.get_type_hints(type(parent)).get(attr)
    except Exception:
        return None
    if declared is None or not hasattr(parent, attr):
        return None
    allowed = _flatten(declared)
    if allowed is None:
        return None
    value = getattr(parent, attr)
    if value is None or any(_is(value, a) for a in allowed):  # bridge declares many None-able fields `str`
        return None
    names = " or ".join(
        repr(a.value) if isinstance(a, _Literal) else a.__name__.replace("NoneType", "None") for a in allowed
    )
    return f"{attr} takes {names}, got {value!r} ({type(value).__name__})"


@dataclasses.dataclass(frozen=True)
class _Literal:
    value: Any


def _flatten(declared: Any) -> list | None:
    """The plain types and literal values a declaration allows, or None if it allows anything else."""
    origin = typing.get_origin(declared)
    if origin in (typing.Union, types.UnionType):
        parts = [_flatten(a) for a in typing.get_args(declared)]
        return None if any(p is None for p in parts) else [x for p in parts for x in p]
    if origin is typing.Literal:
        return [_Literal(v) for v in typing.get_args(declared)]
    return [declared] if declared in _PLAIN else None


def _is(value: Any, allowed: Any) -> bool:
    if isinstance(allowed, _Literal):
        return value == allowed.value
    if allowed is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if allowed is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, allowed)


def _name(t: type) -> str:
    return "None" if t is type(None) else t.__name__
