"""Leakage metrics on constructed maps with known answers (docs/leakage.md).

Tolerances: the metrics run in float64 on maps of at most 64 x 64; sums of a few thousand O(1) terms carry
~1e-13 relative rounding, so exact identities are checked to 1e-10 and exact zeros to 1e-12 absolute.
"""

import math

import numpy as np
import pytest
import torch

from poslens.analyses.leakage import metrics as lm
from poslens.errors import UsageError
from poslens.maps import toeplitz_residual as maps_toeplitz_residual

N = 40


def toeplitz_map(n: int, phi) -> torch.Tensor:
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    d = (i - j).to(torch.float64)
    return torch.where(j <= i, phi(d), torch.tensor(math.nan, dtype=torch.float64))


def causal(m: torch.Tensor) -> torch.Tensor:
    n = m.shape[-1]
    return torch.where(torch.ones(n, n, dtype=torch.bool).tril(), m, torch.tensor(math.nan, dtype=torch.float64))


def uniform_log_probs(n: int) -> torch.Tensor:
    """log A_ij = -log(i + 1): uniform attention over the i + 1 visible keys."""
    i = torch.arange(n, dtype=torch.float64)[:, None]
    return causal(-torch.log1p(i).expand(n, n).clone())


def omega_entries(n: int, dom: lm.Domain) -> list[tuple[int, int]]:
    mask = dom.mask(n).numpy()
    return [(i, j) for i in range(n) for j in range(n) if mask[i, j]]


def test_domain_mask_matches_its_definition():
    dom = lm.Domain(max_offset=7, first_key=False, min_query=3, max_query=20, window=5)
    for i in range(N):
        for j in range(N):
            expected = 0 <= i - j <= 7 and j >= 1 and 3 <= i <= 20 and i - j < 5
            assert bool(dom.mask(N)[i, j]) == expected
    default = lm.Domain().mask(N)
    assert int((torch.arange(N)[:, None] - torch.arange(N)[None, :])[default].max()) == N // 2


@pytest.mark.parametrize("phi", [lambda d: -0.05 * d, lambda d: torch.cos(0.3 * d) + 0.01 * d**2])
def test_toeplitz_map_leaks_nothing(phi):
    m = toeplitz_map(N, phi)
    dom = lm.Domain()
    assert float(lm.toeplitz_fraction(m, dom)) == pytest.approx(0.0, abs=1e-12)
    r2 = lm.delta_r2(m, dom)
    for k in ("dr2_q", "dr2_k", "dr2_abs"):
        assert float(r2[k]) == pytest.approx(0.0, abs=1e-12)
    assert float(r2["r2_d"]) == pytest.approx(1.0, abs=1e-12)
    assert float(lm.drift(m, dom)["slope"]) == pytest.approx(0.0, abs=1e-12)
    assert float(lm.key_profile(m, dom)["sink_excess"]) == pytest.approx(0.0, abs=1e-12)


def test_trf_agrees_with_the_maps_module():
    """An independent numpy implementation (poslens.maps.toeplitz_residual) on a random causal map."""
    g = torch.Generator().manual_seed(0)
    m = causal(torch.randn(N, N, generator=g, dtype=torch.float64))
    for top in (5, N // 2, N - 1):
        ours = float(lm.toeplitz_fraction(m, lm.Domain(max_offset=top)))
        ref = maps_toeplitz_residual(m.numpy(), max_offset=top)["fraction"]
        assert ours == pytest.approx(ref, rel=1e-10)


def test_delta_r2_matches_explicit_least_squares():
    """One-hot designs built by hand and solved with numpy's lstsq (SVD) on a small random map."""
    n = 14
    g = torch.Generator().manual_seed(1)
    m = causal(torch.randn(n, n, generator=g, dtype=torch.float64))
    dom = lm.Domain(max_offset=9, first_key=False)
    entries = omega_entries(n, dom)
    y = np.array([m[i, j].item() for i, j in entries])
    total = np.sum((y - y.mean()) ** 2)

    def r2(factors):
        cols = []
        for f in factors:
            vals = np.array([{"d": i - j, "q": i, "k": j}[f] for i, j in entries])
            cols += [(vals == v).astype(float) for v in np.unique(vals)]
        x = np.stack(cols, 1)
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        return 1 - np.sum((y - x @ coef) ** 2) / total

    out = lm.delta_r2(m, dom)
    assert float(out["r2_d"]) == pytest.approx(r2("d"), abs=1e-10)
    assert float(out["dr2_q"]) == pytest.approx(r2("dq") - r2("d"), abs=1e-10)
    assert float(out["dr2_k"]) == pytest.approx(r2("dk") - r2("d"), abs=1e-10)
    assert float(out["dr2_abs"]) == pytest.approx(r2("dqk") - r2("d"), abs=1e-10)


def test_planted_query_term_is_explained_by_offset_plus_query():
    """M = phi(i - j) + g(i) with a non-linear g: the offset + query fit is exact, the offset fit is not."""
    i = torch.arange(N, dtype=torch.float64)[:, None]
    m = toeplitz_map(N, lambda d: torch.cos(0.5 * d)) + torch.log1p(i) ** 2
    out = lm.delta_r2(m, lm.Domain())
    assert float(out["r2_dq"]) == pytest.approx(1.0, abs=1e-10)
    assert float(out["dr2_q"]) > 0.01
    assert float(out["dr2_abs"]) == pytest.approx(float(out["dr2_q"]), abs=1e-10)


def test_uniform_attention_split_is_all_mask():
    """Constant scores c: l_i = c + log(i + 1); e_logit = cross = 0 and e_partition is the energy of the Toeplitz
    residual of -log(i + 1), computed here diagonal by diagonal."""
    c = 1.7
    scores = causal(torch.full((N, N), c, dtype=torch.float64))
    lp = c + torch.log1p(torch.arange(N, dtype=torch.float64))
    dom = lm.Domain()
    out = lm.split(scores, lp, dom)
    assert float(out["e_logit"]) == pytest.approx(0.0, abs=1e-12)
    assert float(out["cross"]) == pytest.approx(0.0, abs=1e-12)
    assert float(out["share_partition"]) == pytest.approx(1.0, abs=1e-12)
    expected = 0.0
    for d in range(N // 2 + 1):
        vals = np.array([-math.log(i + 1) for i in range(d, N)])
        expected += np.sum((vals - vals.mean()) ** 2)
    assert float(out["e_partition"]) == pytest.approx(expected, rel=1e-10)
    assert float(out["fraction"]) == pytest.approx(float(lm.toeplitz_fraction(uniform_log_probs(N), dom)), rel=1e-10)


def test_split_identity_and_relative_logits():
    """Purely relative logits phi(i - j): zero logit part; the parts always add up to ||P L||^2."""
    phi = lambda d: -0.3 * d + torch.sin(d)  # noqa: E731
    s = toeplitz_map(N, phi)
    lp = torch.logsumexp(torch.nan_to_num(s, nan=-math.inf), -1)
    out = lm.split(s, lp, lm.Domain(max_query=20))
    assert float(out["e_logit"]) == pytest.approx(0.0, abs=1e-12)
    assert float(out["share_partition"]) == pytest.approx(1.0, abs=1e-12)
    g = torch.Generator().manual_seed(2)
    s2 = causal(torch.randn(3, N, N, generator=g, dtype=torch.float64))
    lp2 = torch.logsumexp(torch.nan_to_num(s2, nan=-math.inf), -1)
    out2 = lm.split(s2, lp2, lm.Domain())
    logp = s2 - lp2[..., None]
    trf = lm.toeplitz_fraction(logp, lm.Domain())
    torch.testing.assert_close(out2["fraction"], trf, rtol=1e-10, atol=0)
    parts = out2["e_logit"] + out2["e_partition"] + out2["cross"]
    torch.testing.assert_close(parts, out2["e_total"], rtol=1e-12, atol=0)
    assert out2["e_total"].shape == (3,)


def test_drift_of_uniform_log_probs_is_minus_one():
    """log A = -log(1 + i) drifts by exactly -1 per e-fold of query position at every offset."""
    m = uniform_log_probs(N)
    for dom in (lm.Domain(), lm.Domain(max_offset=3, min_query=5), lm.Domain(max_query=15)):
        assert float(lm.drift(m, dom)["slope"]) == pytest.approx(-1.0, abs=1e-12)


def test_sink_column_excess_has_its_closed_form():
    """M = phi(d) + c 1[j = 0]: diagonal d holds one sink entry among n_d, so mu_d absorbs c / n_d and
    R_{d,0} = c (1 - 1 / n_d); r_0 is their mean over the queries i = d in Omega."""
    c = 2.0
    m = toeplitz_map(N, lambda d: torch.cos(d)).clone()
    m[:, 0] += c
    dom = lm.Domain()
    top = N // 2
    n_d = np.array([N - d for d in range(top + 1)])
    r0 = np.mean(c * (1 - 1 / n_d))
    ix = dom.index(N)
    y = m.reshape(-1)[ix.flat]
    sd = float(((y - y.mean()) ** 2).mean().sqrt())
    prof = lm.key_profile(m, dom)
    assert float(prof["profile"][0]) == pytest.approx(r0, rel=1e-12)
    assert float(prof["sink_excess"]) == pytest.approx(r0 / sd, rel=1e-10)
    assert math.isnan(float(lm.key_profile(m, lm.Domain(first_key=False))["sink_excess"]))


def test_sink_rate_counts_maps_above_threshold():
    n = 8
    heads = []
    for w in (0.1, 0.5, 0.9, 0.15):  # attention w on key 0, the rest uniform over the other keys
        a = torch.zeros(n, n, dtype=torch.float64)
        a[0, 0] = 1.0
        for i in range(1, n):
            a[i, 0] = w
            a[i, 1 : i + 1] = (1 - w) / i
        heads.append(a)
    probs = torch.stack(heads)
    alpha = lm.first_key_attention(probs)
    expected = torch.tensor([(1 + (n - 1) * w) / n for w in (0.1, 0.5, 0.9, 0.15)], dtype=torch.float64)
    torch.testing.assert_close(alpha, expected, rtol=1e-12, atol=0)
    assert lm.sink_rate(probs, 0.3) == 0.5  # alpha = 0.2125, 0.5625, 0.9125, 0.256


def test_leakage_metrics_collects_everything_over_layers():
    g = torch.Generator().manual_seed(3)
    s = causal(torch.randn(2, 4, N, N, generator=g, dtype=torch.float64))
    lp = torch.logsumexp(torch.nan_to_num(s, nan=-math.inf), -1)
    out = lm.leakage_metrics({"scores": s, "log_partition": lp, "log_probs": s - lp[..., None]}, lm.Domain())
    assert {"scores/trf", "scores/dr2_abs", "split/share_logit", "log_probs/drift", "scores/sink_excess",
            "scores/offset_share", "scores/energy"} <= set(out)
    out = lm.leakage_metrics({"scores": s, "log_partition": lp, "lag_log_partition": lp - 0.1}, lm.Domain())
    assert {"attn/e_total", "attn/mask_only", "attn/residual", "attn/share_cross"} <= set(out)
    assert not any(k.startswith("split/") for k in out)
    assert all(v.shape == (2, 4) for v in out.values())


def test_bad_domains_are_one_line_usage_errors():
    m = toeplitz_map(N, lambda d: d)
    with pytest.raises(UsageError, match="max_offset"):
        lm.toeplitz_fraction(m, lm.Domain(max_offset=0))
    with pytest.raises(UsageError, match="max_query"):
        lm.toeplitz_fraction(m, lm.Domain(max_query=1))
    with pytest.raises(UsageError, match="window"):
        lm.toeplitz_fraction(m, lm.Domain(max_offset=N - 1))  # fine
        lm.toeplitz_fraction(m.masked_fill(torch.ones(N, N, dtype=torch.bool).tril(-10), math.nan), lm.Domain())
    with pytest.raises(UsageError, match="max_offset"):
        lm.Domain(max_offset=-1)


@pytest.mark.parametrize("dom", [lm.Domain(), lm.Domain(first_key=False), lm.Domain(max_query=12),
                                 lm.Domain(max_offset=7, min_query=3), lm.Domain(window=9, first_key=False)],
                         ids=["default", "no-key0", "early", "offsets", "window"])
def test_moments_agree_with_materialised_residuals(dom):
    """Every metric is computed from `Moments` (sums of the Toeplitz residual by row and column, closed forms for
    row terms); here each is recomputed from the materialised residuals R = y - mu_{i-j} of its definition, on
    random maps with random log-partitions: sums of ~500 O(1) float64 terms, so agreement to 1e-10 relative."""
    n = 30
    g = torch.Generator().manual_seed(7)
    s = causal(torch.randn(3, n, n, generator=g, dtype=torch.float64) + torch.arange(n)[:, None] / 10)
    lp = torch.randn(3, n, generator=g, dtype=torch.float64) + torch.log1p(torch.arange(n))
    rel = lp + 0.3 * torch.randn(3, n, generator=g, dtype=torch.float64)
    y, ix = lm.values(s, dom)
    i = ix.i

    def p(v):  # P of a map given on Omega
        return lm.toeplitz_residual(v, ix)

    def energy(v):
        return (p(v) ** 2).sum(-1)

    def centred(v):
        return ((v - v.mean(-1, keepdim=True)) ** 2).sum(-1)

    l_, r_ = lp[..., i], rel[..., i]
    close = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lm.toeplitz_fraction(s, dom), energy(y) / centred(y), **close)
    out = lm.split(s, lp, dom)
    torch.testing.assert_close(out["e_logit"], energy(y), **close)
    torch.testing.assert_close(out["e_partition"], energy(l_), **close)
    torch.testing.assert_close(out["cross"], -2 * (p(y) * p(l_)).sum(-1), **close)
    torch.testing.assert_close(out["fraction"], energy(y - l_) / centred(y - l_), **close)
    cf = lm.attention_split(s, lp, rel, dom)
    torch.testing.assert_close(cf["e_total"], energy(y - l_), **close)
    torch.testing.assert_close(cf["mask_only"], energy(r_), **close)
    torch.testing.assert_close(cf["residual"], energy(y - (l_ - r_)), **close)
    torch.testing.assert_close(cf["cross"], -2 * (p(r_) * p(y - (l_ - r_))).sum(-1), **close)
    # the offset share: 1 - RSS of the lag + query fit / RSS of the lag fit, by least squares on Omega's entries
    x = torch.zeros(ix.size, 2 * n, dtype=torch.float64)
    x[torch.arange(ix.size), ix.d] = 1.0
    x[torch.arange(ix.size), n + i] = 1.0
    fit = x @ (torch.linalg.pinv(x) @ y.T)
    share = lm.offset_share(s, dom)
    torch.testing.assert_close(share["energy"], energy(y), **close)
    torch.testing.assert_close(share["offset_share"], 1 - ((y.T - fit) ** 2).sum(0) / energy(y), rtol=1e-8, atol=1e-10)
    x = torch.log1p(i.to(torch.float64)).expand_as(y)
    torch.testing.assert_close(lm.drift(s, dom)["slope"], (p(x) * p(y)).sum(-1) / (p(x) ** 2).sum(-1), **close)
    prof = lm.key_profile(s, dom)["profile"]
    for j in range(n):
        on = ix.j == j
        expected = p(y)[..., on].mean(-1) if bool(on.any()) else torch.full((3,), math.nan, dtype=torch.float64)
        torch.testing.assert_close(prof[..., j], expected, equal_nan=True, **close)
    logp = lm.leakage_metrics({"scores": s, "log_partition": lp}, dom)
    torch.testing.assert_close(logp["log_probs/trf"], lm.toeplitz_fraction(s - lp[..., None], dom), **close)


def test_offset_power_is_kim_et_al_s_pattern_power_and_finds_a_planted_query_offset():
    """`offset_power`'s pattern term is Kim et al.'s Section 5.2 statistic (measures.pattern_power with the sink
    column left out: the noise-free mean square of the diagonal-normalised map) to 1e-12 on random halves; on halves
    phi(i - j) + g(i) + independent noise of their own the offset share is 1 within its noise, and with a key term
    (-1)^j instead of g it is near 0: the statistic separates what a softmax ignores from what it sees."""
    from poslens.report.sections import measures as ms

    n = 24
    i, j = torch.arange(n)[:, None].double(), torch.arange(n)[None].double()
    g = torch.Generator().manual_seed(11)

    def halves(plant: torch.Tensor, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(causal(0.3 * torch.cos(i - j) + plant + noise * torch.randn(n, n, generator=g,
                                                                                 dtype=torch.float64))
                     for _ in range(2))

    dom = lm.Domain(max_offset=n - 1, first_key=False)
    a, b = halves(torch.zeros(n, n, dtype=torch.float64), 1.0)
    torch.testing.assert_close(lm.offset_power(a, b, dom)["pattern"],
                               ms.pattern_power(a.numpy(), b.numpy(), sink=True), rtol=1e-12, atol=1e-15)
    query = lm.offset_power(*halves(torch.log1p(i).expand(n, n) ** 2, 0.01), dom)
    assert float(query["share"]) == pytest.approx(1.0, abs=0.01)
    key = lm.offset_power(*halves((1 - 2 * (j % 2)).expand(n, n), 0.01), dom)
    assert float(key["share"]) < 0.1
