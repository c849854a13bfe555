"""Intervals of the length analysis cover the truth at their nominal rate on synthetic data with a known answer.

Each repetition draws per-token losses nll[b, t] = mu_t + u_b + e_bt (a per-sequence effect u_b ~ N(0, 0.5^2), so
tokens of one sequence are correlated and only the groups of sequences are independent; e_bt ~ N(0, 1)) into
`PositionLoss.add_nll`, ten groups of four sequences, and checks whether the 95% interval of each bucket holds the
true bucket mean. Over R repetitions the count of hits is Binomial(R, 0.95): with R = 300 its standard deviation is
1.3%, and the tolerance |coverage - 0.95| <= 0.04 (3.2 standard deviations) fails for an interval that ignores
the t quantile (~0.92 at 9 degrees of freedom would pass only by luck at 3 buckets x 300) or the grouping
(intervals from token-level spread cover ~0.6 here).
"""

import math

import torch

from poslens.analyses.length import PositionLoss, over_seeds, paired_difference, seed_paired, seed_summary

EDGES = [1, 8, 16]
GROUPS, BATCH, T = 10, 4, 16
MU = 2.0 + 1.0 / torch.arange(1, T, dtype=torch.float64)  # mean loss at target positions 1..15
DELTA = 0.1 * torch.log(torch.arange(1, T, dtype=torch.float64))  # an intervention's effect, growing with t


def _bucket_means(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([x[lo - 1:hi - 1].mean() for lo, hi in zip(EDGES, EDGES[1:])])


def _passes(gen: torch.Generator) -> tuple[PositionLoss, PositionLoss]:
    base, other = PositionLoss(EDGES, GROUPS), PositionLoss(EDGES, GROUPS)
    for g in range(GROUPS):
        u = 0.5 * torch.randn(BATCH, 1, generator=gen, dtype=torch.float64)
        e = torch.randn(BATCH, T - 1, generator=gen, dtype=torch.float64)
        v = 0.1 * torch.randn(BATCH, 1, generator=gen, dtype=torch.float64)
        base.group = other.group = g
        base.add_nll(MU + u + e)
        other.add_nll(MU + DELTA + u + e + v + 0.1 * torch.randn(BATCH, T - 1, generator=gen, dtype=torch.float64))
    return base, other


def test_bucket_and_paired_intervals_cover_at_the_nominal_rate():
    gen = torch.Generator().manual_seed(0)
    reps = 300
    hit_single = hit_paired = 0
    width_single = width_paired = 0.0
    truth, effect = _bucket_means(MU), _bucket_means(DELTA)
    for _ in range(reps):
        base, other = _passes(gen)
        single = base.buckets()
        diff = paired_difference(base, other)
        hit_single += int(((single.lo <= truth) & (truth <= single.hi)).sum())
        hit_paired += int(((diff.lo <= effect) & (effect <= diff.hi)).sum())
        width_single += float((single.hi - single.lo).mean())
        width_paired += float((diff.hi - diff.lo).mean())
    n = reps * (len(EDGES) - 1)
    assert abs(hit_single / n - 0.95) <= 0.04, hit_single / n
    assert abs(hit_paired / n - 0.95) <= 0.04, hit_paired / n
    # pairing removes the shared u + e: the difference's interval is far narrower than one pass's
    assert width_paired < 0.3 * width_single


def test_seed_t_interval_covers_at_the_nominal_rate():
    # m = 3 normal per-model means: the t-interval with 2 degrees of freedom is exact; 3,000 repetitions give a
    # binomial standard deviation of 0.4%, tolerance 0.015 (3.8 sd). A z-interval (1.96 instead of 4.30) would
    # cover ~0.79.
    gen = torch.Generator().manual_seed(1)
    x = 1.5 + 0.3 * torch.randn(3000, 3, generator=gen, dtype=torch.float64)
    hits = 0
    for row in x:
        est = over_seeds(list(row))
        hits += int(est.lo <= 1.5 <= est.hi)
    assert abs(hits / 3000 - 0.95) <= 0.015
    assert math.isnan(float(over_seeds([1.0]).lo))


def test_a_loss_interval_never_reaches_below_0():
    """A cross-entropy is >= 0. Two groups whose losses differ a lot (0.2 and 4.0 nats: mean 2.1, jackknife se 1.9,
    t_1 = 12.7) give raw intervals far below 0; every loss interval of the analysis (curve, buckets, spans, the
    figure's bins, the seed mean and its sequence interval) comes out cut at 0, its upper end as it was."""
    from poslens.analyses.length.summary import binned

    def loss_of(levels):
        loss = PositionLoss(EDGES, 2)
        for g, level in enumerate(levels):
            loss.group = g
            loss.add_nll(torch.full((BATCH, T - 1), level, dtype=torch.float64))
        return loss

    loss = loss_of((0.2, 4.0))
    raw = loss.sums.estimate(lambda m: m["bucket"])
    assert bool((raw.lo < 0).all())
    summary = seed_summary([loss, loss_of((0.3, 3.0))])
    for est in (loss.buckets(), loss.spans([(1, 8)]), loss.curve(), binned(loss, 8, T, 0.95), summary["sequences"],
                summary["seeds"]):
        finite = torch.isfinite(est.lo)
        assert est.support == (0.0, math.inf) and bool((est.lo[finite] >= 0).all()), est
    torch.testing.assert_close(loss.buckets().hi, raw.hi, rtol=0, atol=0)
    assert bool((loss.buckets().lo == 0).all())


def test_seed_paired_uses_the_spread_over_seeds():
    gen = torch.Generator().manual_seed(2)
    models = [_passes(gen) for _ in range(3)]
    out = seed_paired([b for b, _ in models], [o for _, o in models])
    per_model = torch.stack([e.value for e in out["models"]])
    torch.testing.assert_close(out["seeds"].value, per_model.mean(0))
    torch.testing.assert_close(out["seeds"].se, per_model.std(0) / math.sqrt(3))
    # spans of target positions give the bucket means when every sequence reaches every position
    base, other = models[0]
    spans = list(zip(EDGES, EDGES[1:]))
    torch.testing.assert_close(paired_difference(base, other, spans=spans).value, out["models"][0].value)
    torch.testing.assert_close(base.spans(spans).value, base.buckets().value)


def test_the_length_rows_say_how_many_seeds_would_resolve_them():
    """A row's interval over the sweep's seeds: `seeds_needed` is the smallest seed count at
    which, with the present mean and spread over seeds, the interval excludes the threshold (one fewer does not),
    and `more_seeds` names it with the `poslens sweep` command that trains those seeds; a decided row needs none."""
    from poslens.engine.stats import t_quantile
    from poslens.report.claims import Test
    from poslens.report.sweep import SweepModels, more_seeds, seeds_needed
    from poslens.train.sweep import SweepConfig, resolve_matrix, seed_interval

    e = seed_interval([-0.09, 0.01, -0.05])  # mean -0.0433, open at 3 seeds
    test = Test("effect", e["value"], "<", 0.0, e["lo"], e["hi"], "95% t-interval over 3 seeds")
    m = seeds_needed(test, 3)

    def half(k: int) -> float:
        return t_quantile(0.975, k - 1) * e["sd"] / math.sqrt(k)

    assert test.outcome() == "open" and half(m) < abs(e["value"]) <= half(m - 1)
    cfg = SweepConfig(preset="pe-quick")
    sw = SweepModels(cfg, resolve_matrix(cfg), {}, None)
    assert sw.seeds == [0, 1, 2]
    text = more_seeds(sw, (test,))
    assert f"about {m} " in text and f"--seeds {','.join(map(str, range(m)))}" in text
    assert more_seeds(sw, (Test("effect", -1.0, "<", 0.0, -1.5, -0.5),)) == ""  # decided: nothing to add
    tiny = Test("effect", -0.0065, "<", 0.0, -0.31, 0.30, "95% t-interval over 3 seeds")  # ~1,400 seeds needed
    text = more_seeds(sw, (tiny,))
    assert f"about {seeds_needed(tiny, 3):,} " in text and "--seeds" not in text  # a count, not a seed list
    assert seeds_needed(Test("effect", 0.0, "<", 0.0, -1.0, 1.0), 3) is None  # a mean on the threshold
    assert "against the claim" not in more_seeds(sw, (test,)) or test.against()
    wrong_side = Test("effect", 0.2, "<", 0.0, -0.1, 0.5, "95% t-interval over 3 seeds")
    assert "would decide the row against the claim" in more_seeds(sw, (wrong_side,))  # more seeds: a failure


def test_the_length_section_says_positions_from_1():
    """The report's length section labels 0-based index ranges [a, b) as the positions a + 1 to b; no intervention
    is named by a position counted from 0."""
    from poslens.report.sections.length import NAMES, positions

    assert positions(64, 512) == "positions 65-512" and positions(1, 128) == "positions 2-128"
    assert "0" not in NAMES["freeze"]


def test_a_scoped_row_is_not_said_to_be_decided_against_by_more_seeds():
    """A row about a larger scale (a scope) whose open test leans to failure: more seeds would show a failure, which
    the scope rule reads fails at this scale, so the seed line says nothing of deciding against the claim, and the
    row's resolve line says what such a failure would mean, once."""
    from poslens.report.claims import Claim, Test
    from poslens.report.sweep import SweepModels, more_seeds, resolve_by_seeds
    from poslens.train.sweep import SweepConfig, resolve_matrix

    cfg = SweepConfig(preset="pe-quick")
    sw = SweepModels(cfg, resolve_matrix(cfg), {}, None)
    wrong_side = Test("effect", 0.2, "<", 0.0, -0.1, 0.5, "95% t-interval over 3 seeds")
    assert "against the claim" not in more_seeds(sw, (wrong_side,), scoped=True)
    row = Claim("x", "kim2025", "S", "c", (wrong_side,), scope="1.5B models (this pair: 0.6M tokens)")
    resolve_by_seeds(sw, [row])
    line = row.resolve_line()
    assert line.count("failing side") == 1 and "fail at this scale" in line and "against the claim" not in line


def test_printed_effects_keep_their_digits_when_small():
    """An effect of 2e-05 with its interval is printed with 3 significant digits, not as +0.000 [-0.000, +0.000];
    a loss keeps 3 decimals."""
    from poslens.analyses.length.summary import _ci

    assert _ci({"value": 2e-5, "lo": 1.02e-7, "hi": 3.99e-5}, signed=True) == "+2e-05 [+1.02e-07, +3.99e-05]"
    assert _ci({"value": 5.25, "lo": 4.72, "hi": 5.77}) == "5.250 [4.720, 5.770]"
