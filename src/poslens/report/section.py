"""What a report section is, and the one registry `poslens reproduce` walks.

A section is a function `build(ctx, size) -> Section` registered with `@section(...)` in a module of
`poslens/report/sections/` (listed in `SECTIONS` below). Its `SectionSpec` says what it needs: whether it
runs models (skipped by `reproduce --no-models`) and its sizes with `--quick` and in the full run; `reproduce`
passes the chosen sizes (with any overrides) as `size`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np

from poslens.errors import UsageError
from poslens.plotting import CMAP
from poslens.report.claims import Claim


@dataclass
class Panel:
    """One heatmap of an interactive figure: values [n, n] (NaN blank), their standard errors, colour limits, and
    the matplotlib colour map both the static image and the HTML draw it with (a diverging one for signed maps)."""

    title: str
    values: np.ndarray
    se: np.ndarray | None = None
    limits: tuple[float, float] | None = None
    cmap: str = CMAP


@dataclass
class Figure:
    """A static image (PNG or JPEG, a PDF of the same name beside it) with its caption.

    panels: the same maps as data, drawn in the HTML report as heatmaps a reader can zoom and hover (value and
    standard error); the static image stays for the PDF and Markdown. wide: show the image at its own size in a
    scrolling box (large grids). warning: shown above the caption (e.g. 'noise only at this size'). title: the
    title drawn on the image, which a claim's `figure` reference may quote (the row then links to the figure)."""

    path: Path
    caption: str
    panels: list[Panel] = field(default_factory=list)
    ncols: int = 4
    wide: bool = False
    warning: str = ""
    title: str = ""

    @property
    def stem(self) -> str:
        return Path(self.path).stem


@dataclass
class Section:
    """A report section: text, claims (each with its tests and verdict), figures, and context.

    context: (what, measured) facts shown beside the claims without a verdict (not counted). scale: one line
    stating the scale of a real-model measurement against the paper's (collected into the report's banner)."""

    title: str
    text: str = ""
    claims: list[Claim] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    context: list[tuple[str, str]] = field(default_factory=list)
    scale: str = ""
    name: str = ""  # the registry name; set by reproduce


Build = Callable[..., Section]


@dataclass(frozen=True)
class SectionSpec:
    """A registered section: `name` (stable key, used in run.json and size overrides), `title` (progress line),
    `build(ctx, size)`, whether it needs `models`, and its `quick` and `full` sizes."""

    name: str
    title: str
    build: Build
    models: bool = False
    quick: Mapping = field(default_factory=dict)
    full: Mapping = field(default_factory=dict)

    def size(self, quick: bool, override: Mapping | None = None) -> dict:
        """The sizes to build with: the quick or full defaults, updated by `override` (unknown keys refused)."""
        base = dict(self.quick if quick else self.full)
        for k, v in (override or {}).items():
            if k not in base:
                raise UsageError(f"sizes: section {self.name} has no size {k!r} (it has {', '.join(base) or 'none'})")
            d = base[k]
            kind = float if isinstance(d, float) else type(d)  # an int is fine where a float is
            if d is not None and not (isinstance(v, kind) and isinstance(v, bool) == isinstance(d, bool)):
                raise UsageError(f"sizes: section {self.name}'s {k} takes a value like {d!r}, not {v!r}")
            base[k] = v
        return base


REGISTRY: list[SectionSpec] = []


def section(name: str, title: str, *, models: bool = False, quick: Mapping | None = None,
            full: Mapping | None = None) -> Callable[[Build], Build]:
    """Register `build(ctx, size) -> Section` as a report section (in registration order)."""

    def register(build: Build) -> Build:
        if any(s.name == name for s in REGISTRY):
            raise ValueError(f"a report section named {name!r} is already registered")
        REGISTRY.append(SectionSpec(name, title, build, models, MappingProxyType(dict(quick or {})),
                                    MappingProxyType(dict(full or {}))))
        return build

    return register


# The modules of poslens/report/sections/ that register a section, in report order (add a new section here).
SECTIONS = ("closed_forms", "nope", "rope", "convergence", "real_model", "trained", "leakage", "length")


def registry() -> list[SectionSpec]:
    """Every registered section, in report order (importing a section's module registers it)."""
    import importlib

    for name in SECTIONS:
        importlib.import_module(f"poslens.report.sections.{name}")
    order = {name: k for k, name in enumerate(SECTIONS)}
    return sorted(REGISTRY, key=lambda s: order.get(s.build.__module__.rsplit(".", 1)[-1], len(order)))


def spec(name: str) -> SectionSpec:
    for s in registry():
        if s.name == name:
            return s
    raise UsageError(f"no report section named {name!r}; sections: {', '.join(s.name for s in registry())}")
