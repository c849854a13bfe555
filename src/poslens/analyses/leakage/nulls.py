"""The null passes: the same metrics on inputs where token position no longer carries content position.

    offset    windows of the same documents starting at a random offset inside them (engine.data.document_windows):
              in the original pass token position p holds the document's p-th token, here its (o + p)-th; what a
              metric keeps in this pass is what token position gives on its own
    circular  the predecessor's null: each sequence's tokens after the BOS rolled by a random k (seeded per batch),
              so content position and token position are decoupled inside one sequence

Each is one pass of `causal.LeakageMaps` (and, for `circular`, `predecessor.DeltaR2Rows`) over the same groups as
the original; `contrast.contrast(null, original)` gives, per metric, the original's excess over its null with a
paired interval (docs/leakage.md, "Nulls"). `prepare` has the shape of `interventions.prepare`.

The offset null also runs every intervention of the run on its windows (`prepare_intervention`: the same
`interventions.prepare`, given the windows inside the documents in place of their starts), one pass each, so that
an intervention's effect at document starts is compared, group by group, with the same intervention's effect on
windows inside the same documents (`paired_with_starts`): the BOS-versus-document-start confound, measured.
"""

from __future__ import annotations

import math

import torch

from poslens.analyses.leakage import interventions as iv
from poslens.analyses.leakage.causal import ENERGIES, METRICS, LeakageMaps, alpha0, joint, over_layers, unprefix
from poslens.analyses.leakage.contrast import unflatten
from poslens.analyses.leakage.predecessor import circular_shift
from poslens.engine.stats import Estimate, combine
from poslens.errors import UsageError

NULLS = ("offset", "circular")
OFFSET_PASS = "offset/"  # the pass of intervention SPEC on the offset null's windows is named "offset/SPEC"


def describe(name: str, min_offset: int = 128) -> str:
    """One line on what null `name` changes."""
    if name == "offset":
        return (f"windows of the same documents starting at a random offset of at least {min_offset} tokens inside "
                "them (content position no longer token position)")
    if name == "circular":
        return "each sequence's tokens after the BOS rolled by a random shift (the predecessor's null)"
    raise UsageError(f"nulls: unknown null {name!r}; use {' or '.join(NULLS)}")


def prepare(name: str, ids: torch.Tensor, *, inside: torch.Tensor | None = None, batch_index: int = 0,
            seed: int = 0, bos_prepended: bool = True) -> tuple[torch.Tensor, dict, None]:
    """(input ids, hooks, position ids) of the null pass `name` on a batch `ids` [B, T] (global batch index
    `batch_index` seeds the circular shifts; `inside`: the batch's windows inside the same documents)."""
    if name == "offset":
        if inside is None or inside.shape != ids.shape:
            raise UsageError("the offset null needs windows inside the same documents, one per sequence")
        return inside, {}, None
    if name == "circular":
        keep = int(bos_prepended)
        if ids.shape[1] - keep < 2:
            raise UsageError("the circular null needs at least 2 tokens after the BOS")
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(batch_index))
        shifts = torch.randint(1, ids.shape[1] - keep, (ids.shape[0],), generator=g)
        return circular_shift(ids.cpu(), shifts, keep).to(ids.device), {}, None
    raise UsageError(f"nulls: unknown null {name!r}; use {' or '.join(NULLS)}")


def prepare_intervention(spec: str, model, hm, ids: torch.Tensor, *, inside: torch.Tensor | None,
                         reference: torch.Tensor | None = None, seed: int = 0,
                         bos_prepended: bool = True) -> tuple:
    """The intervention `spec` on the offset null's windows of a batch: `interventions.prepare` itself (one code
    path), on `inside` (the batch's windows inside the same documents) in place of `ids` (their starts), with the
    starts as the source an `inside` patch copies (the other window of the same document: at a start the source is
    the window inside, here the start, each without its BOS; a `start` patch copies another document's start, as at
    the starts)."""
    if inside is None or inside.shape != ids.shape:
        raise UsageError("the offset null needs windows inside the same documents, one per sequence")
    return iv.prepare(spec, model, hm, inside, reference, seed, inside=ids, bos_prepended=bos_prepended, starts=ids)


def describe_intervention(spec: str, min_offset: int = 128) -> str:
    """One line on the offset null's pass of intervention `spec`."""
    return f"{iv.describe(spec)}, on the offset null's windows ({describe('offset', min_offset)})"


def paired_with_starts(original: LeakageMaps, start: LeakageMaps, offset: LeakageMaps, inside: LeakageMaps,
                       level: float = 0.95) -> dict[str, Estimate]:
    """An intervention at document starts against the same intervention on windows inside the documents, paired by
    group (the four passes share groups and documents): with E the energies (causal.ENERGIES) and M every metric,

        removed             = (1 - E(start) / E(original)) - (1 - E(inside) / E(offset))        per layer [V, E, L]
        removed_all         = the same with every E summed over layers                          [V, E]
        difference_over_layers = (M(start) - M(original)) - (M(inside) - M(offset)), over layers [V, M']

    each with a paired delete-one-group jackknife interval: > 0 where the intervention removes more at document
    starts than inside documents (an effect of the document start, not of the BOS alone)."""
    energy = [METRICS.index(k) for k in ENERGIES]
    shapes: list[tuple[int, ...]] = []

    def fn(o: torch.Tensor, s: torch.Tensor, f: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        eo, es, ef, ei = (x[:, energy] for x in (o, s, f, i))
        removed = (1.0 - es / eo) - (1.0 - ei / ef)
        removed_all = (1.0 - es.sum(-1) / eo.sum(-1)) - (1.0 - ei.sum(-1) / ef.sum(-1))
        moved = (over_layers(s) - over_layers(o)) - (over_layers(i) - over_layers(f))
        parts = [removed, removed_all, moved]
        shapes[:] = [tuple(p.shape) for p in parts]
        return torch.cat([p.reshape(-1) for p in parts])

    est = combine(fn, [stat.evaluated("layers") for stat in (original, start, offset, inside)], level)
    return dict(zip(("removed", "removed_all", "difference_over_layers"), unflatten(est, shapes)))


def paired_sink_attention(original: LeakageMaps, start: LeakageMaps, offset: LeakageMaps, inside: LeakageMaps,
                          threshold: float, level: float = 0.95) -> dict | None:
    """The change of the sink-reading heads' attention on key 0 under an intervention at document starts
    (start - original) and on windows inside the documents (inside - offset), on the same heads (alpha_0 >
    `threshold` in the original pass, chosen again inside each jackknife replicate), and starts minus inside, each
    {value, lo, hi} with a paired jackknife; None when no head is a sink."""
    heads = alpha0(original.sums.mean("key0"), windows=original.windows) > threshold
    if not bool(heads.any()):
        return None
    sums = joint({"orig": original, "start": start, "offset": offset, "inside": inside})

    def fn(means: dict) -> torch.Tensor:
        a = {name: alpha0(unprefix(means, name)["key0"], windows=stat.windows) for name, stat in
             (("orig", original), ("start", start), ("offset", offset), ("inside", inside))}
        chosen = a["orig"] > threshold
        if not bool(chosen.any()):
            return torch.full((3,), math.nan, dtype=torch.float64)
        at_start = a["start"][chosen].mean() - a["orig"][chosen].mean()
        at_inside = a["inside"][chosen].mean() - a["offset"][chosen].mean()
        return torch.stack([at_start, at_inside, at_start - at_inside])

    est = sums.estimate(fn, level=level)
    cells = [{"value": float(est.value[k]), "lo": float(est.lo[k]), "hi": float(est.hi[k])} for k in range(3)]
    return {"heads": int(heads.sum()), "threshold": threshold, "level": est.level, "groups": est.groups,
            "change_at_starts": cells[0], "change_inside": cells[1], "starts_minus_inside": cells[2]}
