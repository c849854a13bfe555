"""`Spec`: a statistic as `poslens stat` runs it (the registry is `poslens.engine.statistics.REGISTRY`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Spec:
    """`build(hm, options, groups)` -> Statistic, where `options` is an instance of the dataclass `options` (its
    `poslens.options.option` fields are the flags of `poslens stat NAME`)."""

    name: str
    help: str
    options: type
    build: Callable[[Any, Any, int], Any]


@dataclass
class NoOptions:
    """The options of a statistic without parameters of its own."""
