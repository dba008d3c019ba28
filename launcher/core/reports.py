"""What a rank's `report()` is given, made into the numbers the driver expects (pure).

Under torchrun `report()` does nothing, so a program calls it with whatever it has at hand: a
one-element tensor whose `.item()` was forgotten, a numpy scalar, a string read from a log. None of
that may fail a job that trains well: what can be read as a number is (`.item()`, `float()`), what
cannot is left out and said once per field by the caller (rank/capture.py). A report whose iteration
is not a whole number is left out whole: the driver orders progress by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

WHOLE = ("total", "tokens")  # counts: whole numbers, 0 or more, like the iteration
KEPT_NON_FINITE = ("loss",)  # a diverged loss (nan, inf) is what the user must see; Megatron prints it
FIELDS = ("total", "loss", "tokens", "lr", "flops")


@dataclass(frozen=True)
class Dropped:
    """A value `report()` left out: its field, how it was given (shortened), and why."""

    field: str
    given: str
    why: str

    def describe(self) -> str:
        left = "the report is left out" if self.field == "iteration" else "left out of the progress"
        return f"report(): {self.field}={self.given} {self.why}: {left}"


@dataclass(frozen=True)
class CleanReport:
    """The record to send (None: nothing to send), and what was left out of it."""

    record: dict[str, Any] | None
    dropped: tuple[Dropped, ...]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def as_number(value: Any) -> float | int | None:
    """`value` as a Python int or float, or None where it is not one number: a one-element tensor
    or numpy value through `.item()`, anything else through `float()` (a numeric string too)."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()  # a tensor or array of more than one element raises
        except Exception:
            return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float):
        return value
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None


def _whole(value: Any) -> tuple[int | None, str]:
    number = as_number(value)
    if number is None:
        return None, "is not a number"
    if not math.isfinite(number) or number != int(number) or number < 0:
        return None, "is not a whole number of 0 or more"
    return int(number), ""


def clean_report(iteration: Any, time: float, **fields: Any) -> CleanReport:
    """The record for one `report(iteration, **fields)` made at `time`; fields given as None are
    not reported."""
    step, why = _whole(iteration)
    if step is None:
        return CleanReport(None, (Dropped("iteration", _shown(iteration), why),))
    record: dict[str, Any] = {"iteration": step, "time": time}
    dropped: list[Dropped] = []
    for field in FIELDS:
        value = fields.get(field)
        if value is None:
            continue
        if field in WHOLE:
            number, why = _whole(value)
        else:
            number, why = as_number(value), "is not a number"
            if number is not None and not math.isfinite(number) and field not in KEPT_NON_FINITE:
                number, why = None, "is not a finite number"
        if number is None:
            dropped.append(Dropped(field, _shown(value), why))
        else:
            record[field] = float(number) if field not in WHOLE else number
    return CleanReport(record, tuple(dropped))
