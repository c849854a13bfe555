"""The registry of statistics: every statistic `poslens stat NAME MODEL` can run, by name.

A statistic lives in its own module (one class, see docs/architecture.md, "Add a statistic") together with a
`Spec`: its name, one line of help, a dataclass of its own parameters (`poslens.options.option` fields: they
become the flags of `poslens stat NAME`) and `build(hm, options, groups)` returning the statistic. `REGISTRY`
maps a name to the "module:attribute" holding its spec, imported only when that statistic is asked for (so this
package never imports an analysis: the analyses' statistics are named here, not loaded), or to a `Spec` itself
(`REGISTRY["mine"] = Spec(...)` registers a statistic of your own for this process).
"""

from __future__ import annotations

import importlib

from poslens.engine.statistics.activation_norm import ActivationNorm
from poslens.engine.statistics.spec import NoOptions, Spec
from poslens.errors import UsageError

__all__ = ["REGISTRY", "ActivationNorm", "NoOptions", "Spec", "spec"]

REGISTRY: dict[str, str | Spec] = {
    "activation_norm": "poslens.engine.statistics.activation_norm:SPEC",
    "attention_maps": "poslens.engine.statistics.attention_maps:SPEC",
    "attention_profile": "poslens.analyses.length.attention:SPEC",
    "intermediates": "poslens.analyses.intermediates:SPEC",
    "leakage_maps": "poslens.analyses.leakage.run:MAPS_SPEC",
    "position0": "poslens.analyses.leakage.run:POSITION0_SPEC",
    "position_probe": "poslens.analyses.card.probe:SPEC",
}


def spec(name: str) -> Spec:
    """The registered statistic `name` (a one-line UsageError listing the names for anything else)."""
    if name not in REGISTRY:
        raise UsageError(f"statistic {name!r} is not registered; use one of {', '.join(REGISTRY)}")
    entry = REGISTRY[name]
    if isinstance(entry, Spec):
        return entry
    module, attr = entry.split(":")
    return getattr(importlib.import_module(module), attr)
