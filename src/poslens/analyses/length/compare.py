"""Contrasts of position losses: an intervention against none on the same sequences, and models over seeds.

Paired over sequences: two passes over the same batches put each batch in the same group, so the difference of
two means, D = mean_b - mean_a, gets the delete-one-group jackknife interval of D itself (`paired_difference`),
which removes the variation the passes share (the text) instead of adding two intervals.

Over seeds: a training effect varies with the seed, and a model's sequence interval says nothing about that.
With one estimate x_s per model (a bucket's loss, or a paired difference) of m seeds of a variant,

    mean = (1/m) sum_s x_s,   se = sd_s(x) / sqrt(m),   interval mean -/+ t_{m-1, (1+level)/2} se

(`over_seeds`). When every seed is evaluated on the same sequences this interval is for those sequences; the
sequence interval of the seed mean (`seed_summary`, "sequences") is reported beside it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from poslens.analyses.length.loss import LOSS, PositionLoss, check_spans, span_means
from poslens.engine.stats import Estimate, GroupedSums, over_seeds
from poslens.errors import UsageError


def joined(parts: dict[str, GroupedSums]) -> GroupedSums:
    """Sums of several statistics with the same groups in one GroupedSums, names prefixed `LABEL/`."""
    groups = {p.groups for p in parts.values()}
    if len(groups) != 1:
        raise UsageError(f"cannot pair statistics kept in different numbers of groups ({sorted(groups)})")
    out = GroupedSums(groups.pop())
    for label, p in parts.items():
        for name in p.names():
            out.sums[f"{label}/{name}"] = p.sums[name]
            out.counts[f"{label}/{name}"] = p.counts[name]
    return out


def _check_paired(a: PositionLoss, b: PositionLoss, spans: Sequence[tuple[int, int]] | None = None) -> None:
    """Both passes saw the same sequences in the same groups: equal bucket counts (and edges), or, for spans,
    equal per-position counts over each span."""
    if spans is None:
        ca, cb = a.sums.counts.get("bucket"), b.sums.counts.get("bucket")
        ok = ca is not None and cb is not None and ca.shape == cb.shape and torch.equal(ca, cb) and a.edges == b.edges
    else:
        check_spans(a, spans)
        check_spans(b, spans)
        ca, cb = a.sums.counts["nll"], b.sums.counts["nll"]
        ok = all(torch.equal(ca[:, lo:hi], cb[:, lo:hi]) for lo, hi in spans)
    if not ok:
        raise UsageError("the two passes are not paired: they saw different sequences, groups or buckets; run "
                         "both over the same batches with the same edges")


def paired_difference(base: PositionLoss, other: PositionLoss, level: float = 0.95,
                      spans: Sequence[tuple[int, int]] | None = None) -> Estimate:
    """other - base per bucket, or per span [lo, hi) of target positions (the two passes may then differ in length:
    an intervention run at T against none run at 8L, both over the same sequences), paired on the sequences."""
    _check_paired(base, other, spans)
    gs = joined({"a": base.sums, "b": other.sums})
    if spans is None:
        return gs.estimate(lambda m: m["b/bucket"] - m["a/bucket"], level)
    return gs.estimate(lambda m: span_means(m["b/nll"], spans) - span_means(m["a/nll"], spans), level)


def seed_summary(models: Sequence[PositionLoss], level: float = 0.95) -> dict[str, Estimate | list[Estimate]]:
    """Bucket losses of several seeds of one variant: each model's (sequence intervals), their mean with the
    t-interval over seeds ("seeds"), and, when all saw the same sequences, the mean's sequence interval
    ("sequences")."""
    per_model = [s.buckets(level) for s in models]
    out: dict[str, Estimate | list[Estimate]] = {"models": per_model,
                                                 "seeds": over_seeds([e.value for e in per_model], level, LOSS)}
    try:
        for s in models[1:]:
            _check_paired(models[0], s)
    except UsageError:
        return out
    gs = joined({str(k): s.sums for k, s in enumerate(models)})
    out["sequences"] = gs.estimate(lambda m: torch.stack([m[f"{k}/bucket"] for k in range(len(models))]).mean(0),
                                   level, support=LOSS)
    return out


def seed_paired(bases: Sequence[PositionLoss], others: Sequence[PositionLoss], level: float = 0.95) -> dict:
    """An intervention's effect over seeds: per model the paired difference other - base (sequence intervals),
    and their mean with the t-interval over seeds ("seeds")."""
    if len(bases) != len(others):
        raise UsageError(f"seed_paired needs one intervention pass per model: {len(bases)} bases, {len(others)} passes")
    per_model = [paired_difference(b, o, level) for b, o in zip(bases, others)]
    return {"models": per_model, "seeds": over_seeds([e.value for e in per_model], level)}
