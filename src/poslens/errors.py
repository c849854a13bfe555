"""User-facing errors: one line, exit status 2, no traceback (the CLI catches `UsageError`)."""

from __future__ import annotations

import math


class UsageError(ValueError):
    """Bad input from the user. The message names the argument and says how to fix it."""


def require(ok: bool, message: str) -> None:
    """Raise `UsageError(message)` unless `ok`."""
    if not ok:
        raise UsageError(message)


def check_int(name: str, value: int, lo: int, hi: int | None = None) -> int:
    """`lo <= value (<= hi)` for an integer argument, else a one-line UsageError."""
    try:
        whole = not isinstance(value, bool) and int(value) == value
    except (TypeError, ValueError, OverflowError):  # None, "abc", nan, inf
        whole = False
    if not whole:
        raise UsageError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise UsageError(f"{name} must be {rng}, got {value}")
    return value


def check_float(name: str, value: float, lo: float, hi: float, hi_open: bool = False, lo_open: bool = False) -> float:
    """Range check for a float argument; the bounds are shown the way the math writes them."""
    value = float(value)
    bad = (
        not math.isfinite(value)
        or (value <= lo if lo_open else value < lo)
        or (value >= hi if hi_open else value > hi)
    )
    if bad:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise UsageError(f"{name} must be in {rng}, got {value:g}")
    return value


def check_choice(name: str, value: str, choices: tuple[str, ...] | list[str]) -> str:
    """`value` must be one of `choices`."""
    if value not in choices:
        raise UsageError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value
