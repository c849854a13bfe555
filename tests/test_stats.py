"""poslens.engine.stats: grouped sums, jackknife and bootstrap intervals, persistence and combination."""

from __future__ import annotations

import math

import pytest
import torch

from poslens.engine.stats import GroupedSums, t_quantile
from poslens.errors import UsageError

# Student t quantiles from printed tables (Abramowitz & Stegun 26.7), 5-6 significant digits
T_TABLE = [(0.975, 1, 12.7062), (0.975, 2, 4.30265), (0.975, 4, 2.77645), (0.975, 9, 2.26216),
           (0.975, 19, 2.09302), (0.95, 30, 1.69726), (0.995, 5, 4.03214), (0.975, 120, 1.97993)]


@pytest.mark.parametrize("p,df,want", T_TABLE)
def test_t_quantile_matches_tables(p, df, want):
    assert t_quantile(p, df) == pytest.approx(want, abs=6e-5)
    assert t_quantile(1 - p, df) == pytest.approx(-want, abs=6e-5)


def _fill(values: torch.Tensor, groups: int) -> GroupedSums:
    """One value per sequence, sequence s in group s mod G (one sequence per batch)."""
    s = GroupedSums(groups)
    for i, v in enumerate(values):
        s.add("x", i, v, 1)
    return s


def test_pooled_mean_and_leave_one_out_are_exact():
    vals = torch.arange(12, dtype=torch.float64)
    s = _fill(vals, 4)
    assert s.mean("x").item() == pytest.approx(vals.mean().item(), abs=1e-12)
    # for the plain mean the jackknife standard error equals the usual SE of the group means (equal sizes)
    est = s.estimate(lambda m: m["x"])
    group_means = torch.stack([vals[g::4].mean() for g in range(4)])
    assert est.se.item() == pytest.approx((group_means.std() / 2).item(), rel=1e-10)
    assert est.groups == 4


def test_leave_one_out_means_are_computed_only_when_read():
    """`estimate` hands its function lazy means: each name is computed on first read, from totals shared by the
    replicates; the values equal the means computed from the group sums directly."""
    gen = torch.Generator().manual_seed(3)
    s = GroupedSums(4)
    for g in range(4):
        s.add("a", g, torch.randn(3, generator=gen, dtype=torch.float64) * (g + 1), 2)
        s.add("b", g, torch.randn(5, 5, generator=gen, dtype=torch.float64), 3)
    seen = []

    def fn(m):
        seen.append(m)
        return m["a"].sum()

    est = s.estimate(fn)
    assert est.groups == 4 and len(seen) == 5  # the value and four leave-one-out replicates
    assert all(set(m._done) == {"a"} for m in seen)  # "b" was never computed
    totals = s._totals()
    for drop in range(4):
        m = s._means(drop=drop, totals=totals)
        assert sorted(m) == ["a", "b"] and len(m) == 2
        keep = [g for g in range(4) if g != drop]
        for name in ("a", "b"):
            want = s.sums[name][keep].sum(0) / s.counts[name][keep].sum(0)
            torch.testing.assert_close(m[name], want, rtol=1e-12, atol=0)
        assert set(m._done) == {"a", "b"}
    with pytest.raises(KeyError):
        s._means()["c"]


def test_totals_are_computed_only_for_the_names_read():
    """`evaluate`'s totals are lazy: a function of "a" never sums "b" (a large model's per-head maps are GBs)."""
    s = GroupedSums(3)
    for g in range(3):
        s.add("a", g, torch.tensor([1.0, 2.0]) * (g + 1), 1)
        s.add("b", g, torch.ones(4, 4), 1)
    totals = s._totals()
    s.evaluate(lambda m: m["a"].sum())
    assert dict(totals) == {}
    m = s._means(drop=1, totals=totals)
    assert m["a"].tolist() == [2.0, 4.0] and set(totals) == {"a"}


def test_a_shared_part_of_the_groups_equals_a_copy_with_the_other_groups_zeroed():
    """`share(..., groups)` reads one part of the groups of sums kept elsewhere, without copying them: its mean, every
    leave-one-group-out mean (a dropped group outside the part leaves it unchanged) and its jackknife and bootstrap
    estimates equal those of an explicit copy whose other groups are zeroed, bit for bit (float32 sums of a few groups
    added in float64 are exact, so the order of the additions cannot matter); the storage is the original's."""
    gen = torch.Generator().manual_seed(5)
    src = GroupedSums(6)
    for g in range(6):
        src.add("m", g, torch.randn(3, 5, 5, generator=gen), torch.full((3,), 2.0 + g))
    keep = torch.tensor([1.0, 0, 1, 0, 1, 0])
    part, copy = GroupedSums(6), GroupedSums(6)
    part.share("whole", src.sums["m"], src.counts["m"])
    part.share("even", src.sums["m"], src.counts["m"], range(0, 6, 2))
    copy.sums["whole"], copy.counts["whole"] = src.sums["m"], src.counts["m"]
    copy.sums["even"] = src.sums["m"] * keep.reshape(-1, 1, 1, 1)
    copy.counts["even"] = src.counts["m"] * keep.double().reshape(-1, 1)
    assert part.sums["even"].data_ptr() == src.sums["m"].data_ptr()
    assert part.filled() == list(range(6))
    fn = lambda m: m["even"].mean((0, 1)) - m["whole"][0].diagonal()  # noqa: E731
    a, b = part.evaluate(fn), copy.evaluate(fn)
    assert torch.equal(a.value, b.value) and torch.equal(a.replicates, b.replicates)
    ta, tb = part._totals(), copy._totals()
    for drop in range(6):
        assert torch.equal(part._means(drop=drop, totals=ta)["even"], copy._means(drop=drop, totals=tb)["even"])
    assert torch.equal(part._totals()["even"][0], ta["even"][0])  # no leave-one-out divided the shared totals in place
    boot = [x.estimate(fn, method="bootstrap", replicates=20, seed=1) for x in (part, copy)]
    assert torch.equal(boot[0].lo, boot[1].lo) and torch.equal(boot[0].hi, boot[1].hi)
    with pytest.raises(UsageError, match="read-only"):
        part.add("even", 0, torch.zeros(3, 5, 5))
    with pytest.raises(UsageError, match="shared from"):
        part.state_dict()
    with pytest.raises(UsageError, match="groups shared"):
        part.share("x", torch.zeros(5, 2), torch.zeros(5))


@pytest.mark.parametrize("method", ["jackknife", "bootstrap"])
def test_intervals_cover_a_known_mean_at_about_the_nominal_rate(method):
    # ratio of means (nonlinear), true value 2.0 / 1.0; 200 repetitions, 20 groups of 5 sequences each
    gen = torch.Generator().manual_seed(0)
    hits, reps = 0, 200 if method == "jackknife" else 60
    for _ in range(reps):
        s = GroupedSums(20)
        for i in range(100):
            s.add("num", i, 2.0 + torch.randn((), generator=gen, dtype=torch.float64), 1)
            s.add("den", i, 1.0 + 0.1 * torch.randn((), generator=gen, dtype=torch.float64), 1)
        e = s.estimate(lambda m: m["num"] / m["den"], method=method, replicates=200)
        hits += bool(e.lo <= 2.0 <= e.hi)
    # 95% nominal; binomial sd at 200 reps is 1.5 points: accept 88%-99.5% (60 reps: looser, 83%-100%)
    lo = 0.88 if reps == 200 else 0.83
    assert lo <= hits / reps <= 1.0


def test_debiased_energy_is_the_u_statistic_and_unbiased():
    # f = ||P mean||^2 (an energy of a mean map) over G equal groups: the jackknife's bias-corrected value is the
    # U-statistic sum_{g != h} <P m_g, P m_h> / (G (G - 1)) exactly (float64 algebra: 1e-9 relative), whose
    # expectation is ||P mu||^2 without the plug-in's noise term tr(P Sigma P) / G (pure noise: mu = 0)
    G, n, d = 6, 5, 7
    gen = torch.Generator().manual_seed(0)
    P = torch.eye(d, dtype=torch.float64) - 1.0 / d  # centring: a linear projection like the Toeplitz residual
    plug, unbiased = [], []
    for _ in range(400):
        x = torch.randn(G, n, d, generator=gen, dtype=torch.float64)  # mu = 0, Sigma = I
        sums = GroupedSums(G)
        for g in range(G):
            for row in x[g]:
                sums.add("x", g, row)
        est = sums.estimate(lambda m: float(((P @ m["x"]) ** 2).sum()))
        v = P @ x.mean(1).T  # [d, G]: P m_g
        u = ((v.sum(1) ** 2).sum() - (v**2).sum()) / (G * (G - 1))
        assert float(est.debiased) == pytest.approx(float(u), rel=1e-9, abs=1e-12)
        assert float(est.debiased) <= float(est.value)  # the removed noise term is never negative
        plug.append(float(est.value))
        unbiased.append(float(est.debiased))
    noise = (d - 1) / (G * n)  # tr(P Sigma P) / N
    se = torch.tensor(unbiased).std().item() / 20
    assert torch.tensor(plug).mean().item() == pytest.approx(noise, rel=0.15)  # the plug-in carries the noise
    assert abs(torch.tensor(unbiased).mean().item()) < 4 * se  # the debiased value does not


def test_counts_per_entry_and_growing_shapes():
    s = GroupedSums(2)
    s.add("m", 0, torch.ones(2, 2), torch.tensor([1.0, 1.0]))  # rows reached by one sequence
    s.add("m", 1, 3 * torch.ones(3, 3), torch.tensor([1.0, 1.0, 1.0]))  # a longer sequence grows the map
    m = s.mean("m")
    assert m.shape == (3, 3)
    assert m[0, 0].item() == 2.0 and m[2, 2].item() == 3.0


def test_state_dict_merge_and_shards_equal_one_pass():
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 4, generator=gen, dtype=torch.float64) for _ in range(10)]
    whole = GroupedSums(5)
    for b, x in enumerate(data):
        whole.add("m", b, x, 1)
    a, c = GroupedSums(5), GroupedSums(5)
    for b, x in enumerate(data):
        (a if b < 6 else c).add("m", b, x, 1)
    resumed = GroupedSums(5)
    resumed.load_state_dict(a.state_dict())
    resumed.merge(c)
    for k, v in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=0, atol=1e-12)
    assert torch.equal(whole.estimate(lambda m: m["m"]).value, resumed.estimate(lambda m: m["m"]).value)


def test_one_group_gives_no_interval_and_bad_arguments_are_usage_errors():
    s = _fill(torch.ones(3, dtype=torch.float64), 1)
    e = s.estimate(lambda m: m["x"])
    assert e.value.item() == 1.0 and math.isnan(e.lo.item())
    with pytest.raises(UsageError):
        GroupedSums(0)
    with pytest.raises(UsageError):
        s.estimate(lambda m: m["x"], level=1.5)
    other = GroupedSums(2)
    with pytest.raises(UsageError):
        s.merge(other)


def test_runner_resumes_and_shards_to_the_same_numbers(tmp_path):
    """run_statistics: interrupted after 2 batches and rerun == uninterrupted; two shards merged == one pass;
    the example statistic (ActivationNorm) at position 0 equals the norm of the model's own hidden state."""
    from tiny_models import build, token_batch

    from poslens.engine.runner import run_statistics
    from poslens.engine.statistics import ActivationNorm

    model = build("llama")
    batches = [token_batch(2, 12, seed=30 + b) for b in range(5)]
    whole = ActivationNorm(groups=3)
    run_statistics(model, [whole], batches)
    ckpt = tmp_path / "partial.safetensors"

    class Interrupt(Exception):
        pass

    first = ActivationNorm(groups=3)
    original = first._read
    calls = []

    def flaky(x, ctx):
        if len(calls) == 2 * 3 + 1:  # two full batches (3 layers each) done, the third started
            raise Interrupt
        calls.append(1)
        original(x, ctx)

    first._read = flaky
    with pytest.raises(Interrupt):
        run_statistics(model, [first], batches, checkpoint=ckpt, checkpoint_every=1)
    resumed = ActivationNorm(groups=3)
    assert run_statistics(model, [resumed], batches, checkpoint=ckpt, checkpoint_every=1) == 2
    a, b = whole.result(), resumed.result()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert not ckpt.exists()
    shard1, shard2 = ActivationNorm(groups=3), ActivationNorm(groups=3)
    run_statistics(model, [shard1], batches[:3])
    run_statistics(model, [shard2], batches[3:], first_batch=3)
    shard1.merge(shard2)
    for key, v in shard1.result().items():
        torch.testing.assert_close(v, a[key], rtol=1e-12, atol=1e-12, equal_nan=True)
    with torch.no_grad():
        hidden = torch.stack([model(input_ids=x, output_hidden_states=True).hidden_states[1] for x in batches])
    torch.testing.assert_close(a["norm"][1], hidden.double().norm(dim=-1).mean((0, 1)), rtol=1e-6, atol=1e-6)


def test_an_estimate_cut_to_its_range_keeps_its_point_inside_its_interval():
    """A mean square estimated without its noise can come out below 0 and its interval reach below 0; cut to
    [0, inf) the value and bounds stay in the range the quantity can take, the bias-corrected value is kept."""
    from poslens.engine.stats import Estimate

    t = lambda *x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    e = Estimate(t(-0.02, 0.5), t(-0.1, 0.3), t(0.06, 1.2), t(0.04, 0.2), 8, 0.95, "jackknife", t(-0.03, 0.4))
    power, share = e[0].within(0.0), e[1].within(0.0, 1.0)
    assert (float(power.value), float(power.lo), float(power.hi)) == (0.0, 0.0, 0.06)
    assert (float(share.lo), float(share.hi)) == (0.3, 1.0) and float(share.value) == 0.5
    assert float(power.debiased) == -0.03 and float(power.se) == 0.04


@pytest.mark.parametrize("method", ["jackknife", "bootstrap"])
def test_an_estimate_with_a_support_has_its_interval_cut_where_it_is_made(method):
    """A share near 1 from four groups: its raw t-interval reaches above 1. Estimated with support (0, 1), the
    interval comes out cut to [0, 1] and run.json records the support; a support it does not cross changes nothing.
    The same cut from `combine`, `over_seeds`, one element of an estimate and a support read back from run.json
    (inf written as null)."""
    from poslens.engine.stats import combine, over_seeds

    sums = GroupedSums(groups=4)
    for g, share in enumerate((0.99, 0.6, 0.97, 0.98)):
        sums.add("x", g, torch.tensor([share, 0.5], dtype=torch.float64), 1)
    kw = {"method": method, "replicates": 200} if method == "bootstrap" else {}
    raw = sums.estimate(lambda m: m["x"][0], **kw)
    if method == "jackknife":
        assert float(raw.hi) > 1.0 and raw.support is None and "support" not in raw.item()
    cut = sums.estimate(lambda m: m["x"][0], support=(0.0, 1.0), **kw)
    assert float(cut.hi) == min(float(raw.hi), 1.0) and float(cut.lo) == float(raw.lo)
    assert float(cut.value) == float(raw.value) and float(cut.se) == float(raw.se)
    assert cut.item()["support"] == [0.0, 1.0] and cut.item()["hi"] <= 1.0
    wide = sums.estimate(lambda m: m["x"][0], support=(-5.0, 5.0), **kw)  # not crossed: unchanged
    assert (float(wide.lo), float(wide.hi), float(wide.value)) == (float(raw.lo), float(raw.hi), float(raw.value))
    if method == "bootstrap":
        return
    ev = sums.evaluate(lambda m: m["x"])
    both = combine(lambda x: x, [ev], support=(0.0, 1.0))
    assert float(both.hi[0]) == 1.0 and both[0].support == (0.0, 1.0)
    assert float(both.hi[1]) == float(combine(lambda x: x, [ev]).hi[1])  # the element inside its range: as it was
    seeds = over_seeds([0.99, 0.6, 0.97, 0.98], support=[0.0, None])  # run.json's [0, inf]
    assert seeds.support == (0.0, math.inf) and float(seeds.hi) > 1.0  # only the lower end is bounded here
    assert float(over_seeds([0.99, 0.6, 0.97, 0.98], support=(0.0, 1.0)).hi) == 1.0
    assert cut.within(0.5, 2.0).support == (0.5, 1.0)  # cut again: within the support it had
