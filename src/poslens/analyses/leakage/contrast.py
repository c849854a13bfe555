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
                                                                   in both passes and its change
    pass_over_layers, difference_over_layers                       [V, M]: `causal.over_layers` of the two
                                                                   (energies summed, other metrics averaged)

A difference is called non-zero when its interval excludes 0 (`excludes_zero`); that is the whole rule.
"""

from __future__ import annotations

import math

import torch

from poslens.analyses.leakage.causal import ENERGIES, METRICS, LeakageMaps, alpha0, joint, over_layers, unprefix
from poslens.engine.stats import Estimate


def contrast(base: LeakageMaps, other: LeakageMaps, level: float = 0.95, heads: bool = False) -> dict[str, Estimate]:
    """`pass`, `difference`, `removed`, `removed_all`, `pass_over_layers`, `difference_over_layers` of `other`
    against `base` (see the module docstring), head-mean maps per layer or (heads=True) per layer and head."""
    sums = joint({"base": base, "other": other})
    energy = [METRICS.index(k) for k in ENERGIES]
    shapes: list[tuple[int, ...]] = []

    def metric(stat: LeakageMaps, means: dict) -> torch.Tensor:
        return stat.head_metrics(means) if heads else stat.layer_metrics(means)

    def fn(means: dict) -> torch.Tensor:
        a, b = metric(base, unprefix(means, "base")), metric(other, unprefix(means, "other"))
        ea, eb = a[:, energy], b[:, energy]
        oa, ob = over_layers(a), over_layers(b)
        parts = [b, b - a, 1.0 - eb / ea, 1.0 - eb.flatten(2).sum(-1) / ea.flatten(2).sum(-1), ob, ob - oa]
        shapes[:] = [tuple(p.shape) for p in parts]
        return torch.cat([p.reshape(-1) for p in parts])

    est = sums.estimate(fn, level=level)
    return dict(zip(("pass", "difference", "removed", "removed_all", "pass_over_layers", "difference_over_layers"),
                    unflatten(est, shapes)))


def removed_by_head(base: LeakageMaps, other: LeakageMaps, level: float = 0.95) -> Estimate:
    """`removed` = 1 - E(other) / E(base) of every energy per variant, layer and head [V, E, L, H], paired
    jackknife; only the energies are evaluated on each replicate, not every metric of `contrast(heads=True)`."""
    sums = joint({"base": base, "other": other})

    def fn(means: dict) -> torch.Tensor:
        return 1.0 - other.head_energies(unprefix(means, "other")) / base.head_energies(unprefix(means, "base"))

    return sums.estimate(fn, level=level)


def sink_attention(base: LeakageMaps, other: LeakageMaps, threshold: float, level: float = 0.95) -> dict | None:
    """Attention on key 0 of the sink-reading heads (alpha_0 > `threshold` in the base pass, Gu et al.'s test):
    their mean alpha_0 in the base pass, in the other, and the change other - base, each {value, lo, hi} with a
    paired jackknife. The heads are chosen on the base pass inside each replicate, so the interval carries the
    choice's own variation; choosing and measuring on the same sequences still leans the base value up (regression
    to the mean), which makes the change lean below 0. None when no head is a sink. A sink anchored to the first
    token loses attention when that token's embedding is replaced (change < 0); one anchored to the first position
    keeps it."""
    heads = alpha0(base.sums.mean("key0"), windows=base.windows) > threshold  # [L, H]
    if not bool(heads.any()):
        return None
    sums = joint({"base": base, "other": other})

    def fn(means: dict) -> torch.Tensor:
        a0 = alpha0(unprefix(means, "base")["key0"], windows=base.windows)
        chosen = a0 > threshold
        if not bool(chosen.any()):
            return torch.full((3,), math.nan, dtype=torch.float64)
        a = a0[chosen].mean()
        b = alpha0(unprefix(means, "other")["key0"], windows=other.windows)[chosen].mean()
        return torch.stack([a, b, b - a])

    est = sums.estimate(fn, level=level)
    cell = [{"value": float(est.value[k]), "lo": float(est.lo[k]), "hi": float(est.hi[k])} for k in range(3)]
    return {"heads": int(heads.sum()), "threshold": threshold, "level": est.level, "groups": est.groups,
            "base": cell[0], "pass": cell[1], "change": cell[2]}


def unflatten(est: Estimate, shapes: list[tuple[int, ...]]) -> list[Estimate]:
    """A flat Estimate cut back into estimates of the given shapes."""
    out, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        cut = [getattr(est, k)[start:start + size].reshape(shape) for k in ("value", "lo", "hi", "se")]
        debiased = None if est.debiased is None else est.debiased[start:start + size].reshape(shape)
        out.append(Estimate(*cut, est.groups, est.level, est.method, debiased))
        start += size
    return out


def excludes_zero(est: Estimate) -> torch.Tensor:
    """The decision rule for a difference: its interval lies entirely above or entirely below 0."""
    return (est.lo > 0) | (est.hi < 0)
