"""Paired comparison of two passes over the same sequences: an intervention against the original, the original
against a null (docs/leakage.md, "Nulls" and "Interventions").

Both passes keep their sums in the same groups of the same sequences, so a function of the two is re-evaluated
on each leave-one-group-out pair of means: the jackknife interval of a difference or a ratio is paired.

    pass        = metric(other)                                    every metric, [V, M, L] (or [V, M, L, H])
    difference  = metric(other) - metric(base)
    removed     = 1 - E(other) / E(base)                           the energies (causal.ENERGIES), per layer
    removed_all = 1 - sum_l E(other) / sum_l E(base)               over all layers (and heads)
    removed_by_head                                                `removed` per head, the energies alone
    sink_attention                                                 alpha_0 of the base's sink-reading heads
                                                                   in both passes and its change (heads chosen
                                                                   on one half of the groups, measured on the
                                                                   other: `by_parity`)
    sink_heads_removed                                             `removed` of the residual term in those
                                                                   heads, chosen and measured the same way
    pass_over_layers, difference_over_layers                       [V, M]: `causal.over_layers` of the two
                                                                   (energies summed, other metrics averaged)

A difference is called non-zero when its interval excludes 0 (`excludes_zero`); that is the whole rule.
"""

from __future__ import annotations

import math

import torch

from poslens.analyses.leakage.causal import (
    ENERGIES,
    METRICS,
    VARIANTS,
    LeakageMaps,
    alpha0,
    joint,
    over_layers,
)
from poslens.engine.stats import Estimate, GroupedSums, Means, combine


def contrast(base: LeakageMaps, other: LeakageMaps, level: float = 0.95, heads: bool = False) -> dict[str, Estimate]:
    """`pass`, `difference`, `removed`, `removed_all`, `pass_over_layers`, `difference_over_layers` of `other`
    against `base` (see the module docstring), head-mean maps per layer or (heads=True) per layer and head."""
    energy = [METRICS.index(k) for k in ENERGIES]
    shapes: list[tuple[int, ...]] = []
    kind = "heads" if heads else "layers"

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ea, eb = a[:, energy], b[:, energy]
        oa, ob = over_layers(a), over_layers(b)
        parts = [b, b - a, 1.0 - eb / ea, 1.0 - eb.flatten(2).sum(-1) / ea.flatten(2).sum(-1), ob, ob - oa]
        shapes[:] = [tuple(p.shape) for p in parts]
        return torch.cat([p.reshape(-1) for p in parts])

    est = combine(fn, [base.evaluated(kind), other.evaluated(kind)], level)
    return dict(zip(("pass", "difference", "removed", "removed_all", "pass_over_layers", "difference_over_layers"),
                    unflatten(est, shapes)))


def removed_by_head(base: LeakageMaps, other: LeakageMaps, level: float = 0.95) -> Estimate:
    """`removed` = 1 - E(other) / E(base) of every energy per variant, layer and head [V, E, L, H], paired
    jackknife; only the energies are evaluated on each replicate, not every metric of `contrast(heads=True)`."""
    return combine(lambda a, b: 1.0 - b / a, [base.evaluated("energies"), other.evaluated("energies")], level)


HALVES = (0, 1)  # groups split by parity: heads chosen on one half of the sequences, measured on the other


def by_parity(sums: GroupedSums, names: tuple[str, ...]) -> GroupedSums:
    """`sums` with each quantity of `names` also split by group parity: `0:NAME` pooled over the even groups, `1:NAME`
    over the odd ones (the other half's groups read as 0: `GroupedSums.share`, no copy), so a jackknife over every
    group re-evaluates both halves, each from its own groups. The unsplit quantities are kept too, first:
    `GroupedSums.filled` reads the groups that hold data from the first quantity's counts, which for a half would be
    that half's groups alone."""
    out = GroupedSums(sums.groups)
    for name in names:
        out.share(name, sums.sums[name], sums.counts[name])
    for name in names:
        for h in HALVES:  # the same storage, read over one half's groups (no copy of the maps' sums)
            out.share(f"{h}:{name}", sums.sums[name], sums.counts[name], range(h, sums.groups, 2))
    return out


def sink_attention(base: LeakageMaps, other: LeakageMaps, threshold: float, level: float = 0.95) -> dict | None:
    """Attention on key 0 of the sink-reading heads (alpha_0 > `threshold` in the base pass, Gu et al.'s test),
    chosen on other sequences than those they are measured on: the groups split by parity, the heads chosen on one
    half's base pass and their mean alpha_0 measured on the other half's base and other pass, and the two directions
    averaged (cross-fitting: choosing and measuring on the same sequences leans the base value up, by regression to
    the mean, and the change below 0). {base, pass, change} as {value, lo, hi} with a paired jackknife over every
    group (each replicate chooses again on its halves), and `per_head`: each head chosen on either half, its change
    measured on the half(s) it was not chosen on, with its own interval. None when no head is a sink on either
    half. A sink anchored to the first token loses attention when that token's embedding is replaced (change < 0);
    one anchored to the first position keeps it."""
    sums = by_parity(joint({"base": base, "other": other}), ("base/key0", "other/key0"))

    def alphas(means: dict) -> dict[tuple[str, int], torch.Tensor]:
        return {(p, h): alpha0(means[f"{h}:{p}/key0"], windows=(base if p == "base" else other).windows)
                for p in ("base", "other") for h in HALVES}

    a = alphas({k: sums.mean(k) for k in sums.names()})
    chosen = {h: a["base", h] > threshold for h in HALVES}  # [L, H] on each half
    if not any(bool(c.any()) for c in chosen.values()):
        return None

    def fn(means: dict) -> torch.Tensor:
        al = alphas(means)
        parts = []
        for pick, measure in ((0, 1), (1, 0)):
            sel = al["base", pick] > threshold
            if bool(sel.any()):
                x, y = al["base", measure][sel].mean(), al["other", measure][sel].mean()
                parts.append(torch.stack([x, y, y - x]))
        return torch.stack(parts).mean(0) if parts else torch.full((3,), math.nan, dtype=torch.float64)

    est = sums.estimate(fn, level=level)
    cell = [{"value": float(est.value[k]), "lo": float(est.lo[k]), "hi": float(est.hi[k])} for k in range(3)]
    heads = (chosen[0] | chosen[1]).nonzero().tolist()

    def per_head(means: dict) -> torch.Tensor:  # each head's change on the half (or halves) it was not chosen on
        al = alphas(means)
        change = {h: al["other", h] - al["base", h] for h in HALVES}
        out = []
        for layer, head in heads:
            on = [change[1 - h][layer, head] for h in HALVES if bool(chosen[h][layer, head])]
            out.append(torch.stack(on).mean())
        return torch.stack(out)

    ph = sums.estimate(per_head, level=level)
    return {"heads": len(heads), "threshold": threshold, "level": est.level, "groups": est.groups,
            "selection": "cross-fitted: chosen on the even groups' sequences and measured on the odd ones', and the "
                         "reverse, averaged",
            "base": cell[0], "pass": cell[1], "change": cell[2],
            "per_head": [{"layer": layer + 1, "head": head + 1, "index": [layer, head],
                          "chosen_on": [h for h in HALVES if bool(chosen[h][layer, head])],
                          "value": float(ph.value[k]), "lo": float(ph.lo[k]), "hi": float(ph.hi[k])}
                         for k, (layer, head) in enumerate(heads)]}


def sink_heads_removed(base: LeakageMaps, other: LeakageMaps, threshold: float, energy: str = "attn/residual",
                       scope: str = "early", level: float = 0.95) -> dict | None:
    """The share of `energy` (at `scope` queries) that `other` removes in the sink-reading heads (alpha_0 > `threshold`
    in the base pass), the heads chosen on other sequences than those they are measured on, as `sink_attention`
    does: groups split by parity, heads chosen on one half's base pass, the removed share 1 - sum E(other) /
    sum E(base) over them measured on the other half, both directions averaged (each replicate of the paired
    jackknife over every group chooses again). Per key 0 in / out: `removed` {value, lo, hi} and `per_head`, each head
    chosen on either half with its own share measured on the half(s) it was not chosen on and its interval (none with
    fewer than two groups per half: a replicate would leave a half without sequences). None when no head is a sink
    on either half. Choosing and measuring on the same sequences would pick heads where this
    text happens to give them large sink attention, and measure them there."""
    names = ("scores", "log_partition", "lag_log_partition", "key0")
    sums = by_parity(joint({"base": base, "other": other}), tuple(f"{p}/{k}" for p in ("base", "other") for k in names))
    e = ENERGIES.index(energy)
    at = {"key0_in" if key0 else "key0_out": v for v, (_, early, key0) in enumerate(VARIANTS)
          if early == (scope == "early")}  # the VARIANTS index of each domain at this scope

    def half(means: dict, p: str, h: int) -> Means:
        return Means(list(names), lambda k: means[f"{h}:{p}/{k}"])

    def chosen_of(means: dict) -> dict[int, torch.Tensor]:
        return {h: alpha0(means[f"{h}:base/key0"], windows=base.windows) > threshold for h in HALVES}  # [L, H]

    chosen = chosen_of({k: sums.mean(k) for k in sums.names() if k.endswith("/key0")})
    if not any(bool(c.any()) for c in chosen.values()):
        return None
    heads = (chosen[0] | chosen[1]).nonzero().tolist()

    def fn(means: dict) -> torch.Tensor:
        if not all(bool(torch.isfinite(means[f"{h}:base/key0"]).all()) for h in HALVES):  # a half without sequences
            return torch.full((2 * (1 + len(heads)),), math.nan, dtype=torch.float64)  # (a replicate of 2 groups)
        pick = chosen_of(means)
        energies = {(p, h): stat.head_energies(half(means, p, h))[:, e]  # [V, L, H]
                    for p, stat in (("base", base), ("other", other)) for h in HALVES}
        out = []
        for key0 in ("key0_in", "key0_out"):
            eb = {h: energies["base", h][at[key0]] for h in HALVES}
            eo = {h: energies["other", h][at[key0]] for h in HALVES}
            sets = [1.0 - eo[1 - h][pick[h]].sum() / eb[1 - h][pick[h]].sum() for h in HALVES if bool(pick[h].any())]
            out.append(torch.stack(sets).mean() if sets else torch.tensor(math.nan, dtype=torch.float64))
            for layer, head in heads:  # on the half (or halves) each head was not chosen on
                on = [1.0 - eo[1 - h][layer, head] / eb[1 - h][layer, head] for h in HALVES
                      if bool(chosen[h][layer, head])]
                out.append(torch.stack(on).mean())
        return torch.stack(out)

    est = sums.estimate(fn, level=level)
    step = 1 + len(heads)

    def cell(k: int) -> dict:
        return {"value": float(est.value[k]), "lo": float(est.lo[k]), "hi": float(est.hi[k])}

    out: dict = {"energy": energy, "scope": scope, "threshold": threshold, "heads": len(heads), "level": est.level,
                 "groups": est.groups, "selection": "cross-fitted: chosen on the even groups' sequences and measured "
                 "on the odd ones', and the reverse, averaged"}
    for k, key0 in enumerate(("key0_in", "key0_out")):
        out[key0] = {"removed": cell(k * step),
                     "per_head": [{"layer": layer + 1, "head": head + 1, "index": [layer, head],
                                   "chosen_on": [h for h in HALVES if bool(chosen[h][layer, head])],
                                   **cell(k * step + 1 + i)} for i, (layer, head) in enumerate(heads)]}
    return out


def unflatten(est: Estimate, shapes: list[tuple[int, ...]]) -> list[Estimate]:
    """A flat Estimate cut back into estimates of the given shapes."""
    out, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        cut = [getattr(est, k)[start:start + size].reshape(shape) for k in ("value", "lo", "hi", "se")]
        debiased = None if est.debiased is None else est.debiased[start:start + size].reshape(shape)
        reps = None if est.replicates is None else est.replicates[:, start:start + size].reshape(-1, *shape)
        out.append(Estimate(*cut, est.groups, est.level, est.method, debiased, reps))
        start += size
    return out


def excludes_zero(est: Estimate) -> torch.Tensor:
    """The decision rule for a difference: its interval lies entirely above or entirely below 0."""
    return (est.lo > 0) | (est.hi < 0)
