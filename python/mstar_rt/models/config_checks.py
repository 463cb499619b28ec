"""Checks of a settings dataclass's fields at construction: a planner built with a negative
bound or a fractional horizon served wrong plans (a negative clamp pins every action to it) or
failed every request, instead of failing once, where it was configured."""

from __future__ import annotations

import math
from typing import Any, Iterable


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_fields(settings: Any, counts: Iterable[str] = (), positive: Iterable[str] = (),
                 nonnegative: Iterable[str] = (), fractions: Iterable[str] = ()) -> None:
    """ValueError naming every field of ``settings`` that is not: an integer >= 1 (``counts``),
    a finite number > 0 (``positive``) or >= 0 (``nonnegative``), or one in [0, 1]
    (``fractions``)."""
    problems = []
    for name in counts:
        v = getattr(settings, name)
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            problems.append(f"{name}={v!r} (needs an integer >= 1)")
    for name in positive:
        v = getattr(settings, name)
        if not (_number(v) and v > 0):
            problems.append(f"{name}={v!r} (needs a finite number > 0)")
    for name in nonnegative:
        v = getattr(settings, name)
        if not (_number(v) and v >= 0):
            problems.append(f"{name}={v!r} (needs a finite number >= 0)")
    for name in fractions:
        v = getattr(settings, name)
        if not (_number(v) and 0 <= v <= 1):
            problems.append(f"{name}={v!r} (needs a number in [0, 1])")
    if problems:
        raise ValueError(f"{type(settings).__name__}: " + "; ".join(problems))
