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
    stating the scale of a real-model measurement against the paper's (collected into the report's banner). models:
    its rows are measured on trained models, not on exact or simulated quantities (the ledgers count them apart)."""

    title: str
    text: str = ""
    claims: list[Claim] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    context: list[tuple[str, str]] = field(default_factory=list)
    scale: str = ""
    name: str = ""  # the registry name; set by reproduce
    models: bool = False  # its rows are on trained models (its spec's `models`; set by reproduce)


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
        """The sizes to build with: the quick or full defaults, updated by `override`; every override checked
        (`check_size`) before any work."""
        base = dict(self.quick if quick else self.full)
        for k, v in (override or {}).items():
            if k not in base:
                raise UsageError(f"sizes: section {self.name} has no size {k!r} (it has {', '.join(base) or 'none'})")
            base[k] = self.check_size(k, v, base[k])
        return base

    def check_size(self, key: str, value, like):
        """`value` for size `key` (default `like`) checked: the default's kind (an int where a float is; a list of
        positive integers where a pair or list of them is; names where the default is names; the kind in
        `NONE_KINDS` where the default is None), and a count at least 1 (2 for groups; 0 only where a default is 0,
        which means off). Returns the value."""
        what = f"sizes: section {self.name}'s {key}"
        if like is None:
            kind = NONE_KINDS.get(key)
            if value is None or (kind is not None and isinstance(value, kind)
                                 and (kind is not list or all(isinstance(x, (int, str)) for x in value))):
                return value
            raise UsageError(f"{what} takes {NONE_HELP.get(key, 'null')}, not {value!r}")
        if isinstance(like, (tuple, list)) and like and all(isinstance(x, str) for x in like):
            names = isinstance(value, (tuple, list)) and all(isinstance(x, str) and x for x in value)
            if not (names and len(value) >= 1):
                raise UsageError(f"{what} takes a list of names like {list(like)}, not {value!r}")
            return type(like)(value)
        if isinstance(like, (tuple, list)):
            ok = (isinstance(value, (tuple, list)) and len(value) >= 1 and (len(like) != 2 or len(value) == 2)
                  and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in value))
            if not ok:
                raise UsageError(f"{what} takes {'a pair' if len(like) == 2 else 'a list'} of positive integers like "
                                 f"{list(like)}, not {value!r}")
            return type(like)(value)
        kind = float if isinstance(like, float) else type(like)  # an int is fine where a float is
        if not (isinstance(value, kind) and isinstance(value, bool) == isinstance(like, bool)):
            raise UsageError(f"{what} takes a value like {like!r}, not {value!r}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            off = 0 in (self.quick.get(key), self.full.get(key))
            lo = 0 if off else 2 if key == "groups" or key.endswith("_groups") else 1
            if not value >= lo:
                why = " (an interval needs two groups)" if lo == 2 else " (0 means off)" if off else ""
                raise UsageError(f"{what} must be >= {lo}{why}, got {value!r}")
        return value


REGISTRY: list[SectionSpec] = []
# sizes whose default is None (the section's own choice) and what they take instead
NONE_KINDS = {"sweep_train": str, "sweep_seeds": list, "variants": list}
NONE_HELP = {"sweep_train": 'training fields as text, e.g. "steps=300"', "sweep_seeds": "a list of seeds, e.g. [0,1,2]",
             "variants": 'a list of variant names, e.g. ["nope","rope"]'}


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
SECTIONS = ("closed_forms", "nope", "rope", "convergence", "real_model", "trained", "leakage", "card", "length")


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
