"""The mask-only counterfactual and the residual-stream patches on constructed cases with known answers.

Tolerances: constructed maps are float64 (identities to 1e-10 relative, exact zeros to 1e-9 of the map's energy);
tiny-model maps are float32 sums of float32 scores of magnitude ~3 (rounding ~1e-6 per entry, so a Toeplitz
map's residual energy is below 1e-8 of its mask energy: bound 1e-6).
"""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from tiny_models import build

from poslens.analyses.leakage import interventions as iv
from poslens.analyses.leakage import metrics as lm
from poslens.analyses.leakage.causal import (
    ENERGIES,
    METRICS,
    VARIANTS,
    Domains,
    LeakageMaps,
    alpha0,
    evaluate,
    lag_log_partition,
    two_way_fit,
)
from poslens.analyses.leakage.contrast import contrast
from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: a second intra-op thread only adds synchronisation (and, on a shared machine, waiting)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


T = 32
I, J = torch.arange(T)[:, None], torch.arange(T)[None]
VISIBLE = J <= I
PHI = -0.15 * (I - J).double() + 0.5 * torch.cos(0.7 * (I - J).double())  # a relative profile phi(i - j)


def per_sequence_maps(n: int, noise: float, plant: float, seed: int = 0) -> torch.Tensor:
    """Scores [n, T, T] of n sequences: phi(i - j) + content noise + plant * (-1)^j (an absolute key term, as a
    residual stream that marks every other position would put in), -inf above the diagonal."""
    g = torch.Generator().manual_seed(seed)
    s = PHI + noise * torch.randn(n, T, T, generator=g, dtype=torch.float64) + plant * (1 - 2 * (J % 2)).double()
    return s.masked_fill(~VISIBLE, -math.inf)


def decompose(s: torch.Tensor, domain: lm.Domain | None = None) -> dict:
    """The decomposition (and the scores' descriptions) of the mean maps of per-sequence scores s [n, T, T]."""
    domain = domain or lm.Domain()
    mean = torch.where(VISIBLE, s, 0.0).mean(0).masked_fill(~VISIBLE, math.nan)
    lp, lag = torch.logsumexp(s, -1).mean(0), lag_log_partition(s).mean(0)
    return {**lm.attention_split(mean, lp, lag, domain), **lm.offset_share(mean, domain)}


def design(visible: torch.Tensor) -> torch.Tensor:
    """The one-hot design of the two-way fit (query, then offset) over the visible entries, for least squares."""
    t = visible.shape[-1]
    i, j = visible.nonzero(as_tuple=True)
    x = torch.zeros(len(i), 2 * t, dtype=torch.float64)
    x[torch.arange(len(i)), i] = 1.0
    x[torch.arange(len(i)), t + i - j] = 1.0
    return x


@pytest.mark.parametrize("window", [None, 5])
def test_two_way_fit_and_lag_log_partition_against_least_squares_and_a_loop(window):
    """The fitted values a_i + r(i - j) equal the least-squares fit by pseudo-inverse of the one-hot design (to
    1e-12: float64 sums of ~100 O(1) entries), and L0_i = log sum over the visible keys of exp r(i - j), by a loop."""
    t = 12
    i, j = torch.arange(t)[:, None], torch.arange(t)[None]
    visible = (j <= i) if window is None else (j <= i) & (i - j < window)
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, t, t, generator=g, dtype=torch.float64).masked_fill(~visible, -math.inf)
    a, r = two_way_fit(s)
    lag = lag_log_partition(s)
    x = design(visible)
    qi, kj = visible.nonzero(as_tuple=True)
    for b in range(2):
        fit = x @ (torch.linalg.pinv(x) @ s[b][visible])
        torch.testing.assert_close(a[b][qi] + r[b][qi - kj], fit, rtol=0, atol=1e-12)
        for q in range(t):
            ref = math.log(sum(math.exp(float(r[b, q - k])) for k in range(t) if bool(visible[q, k])))
            assert float(lag[b, q]) == pytest.approx(ref, rel=1e-12)


def test_planted_lag_profile_and_residual_are_recovered():
    """s = a_i + r(i - j) + e_ij with e orthogonal to the design (a random map's least-squares residual, by an
    independent pseudo-inverse): the fit returns r and a up to one constant and the residual e (to 1e-12), and the
    decomposition's terms are those of the planted parts: mask_only from r alone, residual from e through the
    numerator and the denominator (each recomputed here from the plant, diagonal by diagonal)."""
    g = torch.Generator().manual_seed(4)
    x = design(VISIBLE)
    noise = torch.randn(3, T, T, generator=g, dtype=torch.float64)[:, VISIBLE]
    e = noise - (x @ (torch.linalg.pinv(x) @ noise.T)).T  # [3, entries]: orthogonal to every row and lag
    planted_r = -0.2 * torch.arange(T, dtype=torch.float64) + torch.sin(torch.arange(T, dtype=torch.float64))
    planted_a = torch.randn(3, T, generator=g, dtype=torch.float64)
    qi, kj = VISIBLE.nonzero(as_tuple=True)
    s = torch.full((3, T, T), -math.inf, dtype=torch.float64)
    s[:, qi, kj] = planted_a[:, qi] + planted_r[qi - kj] + 0.7 * e
    a, r = two_way_fit(s)
    shift = r[0, 0] - planted_r[0]
    torch.testing.assert_close(r, (planted_r + shift).expand(3, T), rtol=0, atol=1e-12)
    torch.testing.assert_close(a, planted_a - shift, rtol=0, atol=1e-12)
    torch.testing.assert_close(s[:, qi, kj] - a[:, qi] - r[:, qi - kj], 0.7 * e, rtol=0, atol=1e-12)
    out = decompose(s)
    dom = lm.Domain()
    lag = torch.logcumsumexp(planted_r, 0)  # L0_i: the visible offsets of query i are 0 .. i
    mean_e = torch.zeros(T, T, dtype=torch.float64)
    mean_e[qi, kj] = 0.7 * e.mean(0)
    partition = torch.logsumexp(s, -1).mean(0) - planted_a.mean(0)  # l_i - a_i: the log-partition of r + e

    def energy(m: torch.Tensor) -> float:
        return float((lm.toeplitz_residual(*lm.values(m.masked_fill(~VISIBLE, math.nan), dom)) ** 2).sum())

    assert float(out["mask_only"]) == pytest.approx(energy(lag[:, None].expand(T, T)), rel=1e-10)
    assert float(out["residual"]) == pytest.approx(energy(mean_e - (partition - lag)[:, None]), rel=1e-10)


def test_relative_scores_plus_any_query_term_have_no_residual_term():
    """Per-sequence scores phi_n(i - j) + g_n(i) (a relative profile and a query term of their own per sequence):
    the residual term is 0 and the mask-only term, the total and every share are those without g (the softmax
    ignores g); the scores' own non-relative energy is not (it holds g), and all of it is a per-query offset."""
    g = torch.Generator().manual_seed(2)
    coef = torch.randn(16, 1, 1, generator=g, dtype=torch.float64)
    rel = (PHI * coef + coef**2 * (I - J)).masked_fill(~VISIBLE, -math.inf)
    query = 0.2 * I.double() + 3 * torch.randn(16, T, 1, generator=g, dtype=torch.float64)
    for dom in (lm.Domain(), lm.Domain(first_key=False, max_query=12)):
        plain, shifted = decompose(rel, dom), decompose(rel + query, dom)
        assert float(shifted["residual"]) == pytest.approx(0.0, abs=1e-9 * float(shifted["e_total"]))
        for key in ("e_total", "mask_only", "share_mask_only"):
            assert float(shifted[key]) == pytest.approx(float(plain[key]), rel=1e-10), key
        assert float(shifted["mask_only"]) == pytest.approx(float(shifted["e_total"]), rel=1e-10)
        assert float(shifted["energy"]) > 1e3 * float(plain["energy"]) + 1.0  # the scores' description moves
        assert float(shifted["offset_share"]) == pytest.approx(1.0, abs=1e-9)


def test_a_constant_per_query_head_and_layer_changes_no_term():
    """Scores [sequence, layer, head, T, T] with content noise and an absolute key term, and the same plus a random
    c added per sequence, layer, head and query: every term of the decomposition and of the log-probabilities on
    every domain, per layer and per head, is unchanged to 1e-6 relative (float64 throughout: ~1e-12 seen). The
    raw-score descriptions (`scores/...`) do change: the test could fail."""
    g = torch.Generator().manual_seed(5)
    s = per_sequence_maps(24, 0.5, 0.8).reshape(4, 2, 3, T, T)
    c = 4 * torch.randn(4, 2, 3, T, 1, generator=g, dtype=torch.float64)
    metrics = {}
    for name, maps in (("plain", s), ("gauged", s + c)):
        means = {"scores": torch.where(VISIBLE, maps, 0.0).mean(0).masked_fill(~VISIBLE, math.nan),
                 "log_partition": torch.logsumexp(maps, -1).mean(0),
                 "lag_log_partition": lag_log_partition(maps).mean(0)}
        metrics[name] = evaluate(means, Domains(early_queries=10), [0, 0])  # [V, M, layers, heads]
    invariant = [m for m, name in enumerate(METRICS) if name.split("/")[0] in ("attn", "log_probs")]
    assert len(invariant) == 9
    torch.testing.assert_close(metrics["gauged"][:, invariant], metrics["plain"][:, invariant], rtol=1e-6, atol=0)
    energy = METRICS.index("scores/energy")
    assert torch.all((metrics["gauged"][:, energy] / metrics["plain"][:, energy] - 1).abs() > 0.1)


def test_planted_absolute_key_term_is_found_and_the_mask_term_is_not():
    """s = phi(i - j) + noise + (-1)^j on 64 sequences. The plant's own energy E_h = ||P h||^2 (computed from h
    alone) appears in the residual term (to 3%: the plant also moves l - L0 a little), while the mask-only term
    moves by under 10% (8% seen: the fit leaves the plant a lag profile of size 1/(T - d), the unbalanced
    alternation of (-1)^i over the T - d queries that see lag d, largest at the long lags)."""
    h = (1 - 2 * (J % 2)).double().expand(T, T).masked_fill(~VISIBLE, math.nan)
    energy = float((lm.toeplitz_residual(*lm.values(h, lm.Domain())) ** 2).sum())
    base, planted = decompose(per_sequence_maps(64, 0.3, 0.0)), decompose(per_sequence_maps(64, 0.3, 1.0))
    found = float(planted["residual"] - base["residual"])
    assert found == pytest.approx(energy, rel=0.03)
    assert abs(float(planted["mask_only"] / base["mask_only"]) - 1) < 0.1


def uniform_run(model, ids: torch.Tensor, specs=(), **kw) -> dict[str, LeakageMaps]:
    """LeakageMaps of the original pass and of each intervention; every position's embedding is token 5's
    (a uniform residual stream) except where `first` puts another vector at position 0."""
    hm = HookedModel(model)
    emb = model.get_input_embeddings().weight.detach()
    first = kw.pop("first", None)
    inside = kw.pop("inside", ids)

    def uniform(x, ctx):
        out = emb[5].expand_as(x).clone()
        if first is not None:
            out[:, 0] = emb[first]
        return out

    stats = {}
    for name in ("orig", *specs):
        stat = LeakageMaps(groups=2, domains=Domains(early_queries=8))
        for b, (batch, window) in enumerate(zip(torch.split(ids, 2), torch.split(inside, 2))):
            run_ids, hooks, pos = (batch, {}, None) if name == "orig" else \
                iv.prepare(name, model, hm, batch, inside=window, **kw)
            stat.group = b
            all_hooks = {"hook_embed": [uniform]}
            for point, fn in hooks.items():
                all_hooks.setdefault(point, []).append(fn)  # interventions write after the uniform embedding
            for point, fn in stat.hooks(hm).items():
                all_hooks.setdefault(point, []).append(fn)
            hm.run(run_ids, hooks=all_hooks, position_ids=pos)
        stats[name] = stat
    return stats


def layer_values(stat: LeakageMaps, variant: str, metric: str) -> torch.Tensor:
    means = {k: stat.sums.mean(k) for k in stat.KEYS}
    return stat.layer_metrics(means)[[v[0] for v in VARIANTS].index(variant), METRICS.index(metric)]


def test_uniform_residual_stream_gives_no_absolute_term_on_a_rope_model():
    """Every position holds the same vector: attention averages identical values, so the stream stays uniform at
    every layer, RoPE makes every score map Toeplitz, and the whole non-relative energy of log A is the mask's:
    the residual term and the scores' own energy vanish and the mask-only term is the whole energy."""
    stats = uniform_run(build("llama"), torch.randint(3, 200, (4, 20), generator=torch.Generator().manual_seed(0)))
    orig = stats["orig"]
    for variant in ("all", "early_no_key0"):
        total = layer_values(orig, variant, "attn/e_total")
        assert torch.all(total > 0.1)
        assert torch.all(layer_values(orig, variant, "attn/residual") < 1e-6 * total)
        assert torch.all(layer_values(orig, variant, "scores/energy") < 1e-6 * total)
        torch.testing.assert_close(layer_values(orig, variant, "attn/mask_only"), total, rtol=1e-5, atol=0)


def test_position0_patch_finds_a_planted_first_state():
    """A uniform stream except position 0 (another vector, as a BOS). Layer 0's scores are Toeplitz off key 0
    (the scores' energy 0 without key 0), but key 0's score enters every query's denominator, so the residual
    term is there even without key 0; later layers get an absolute term in the stream through the
    mask (each query averages the first state with weight ~1/(i+1)). Patching position 0 at layer 0 with a
    uniform window's state removes every absolute term (the plant was the only source); patching it at layer 1
    leaves layer 0 exactly as it was."""
    model = build("llama")
    ids = torch.randint(3, 200, (4, 20), generator=torch.Generator().manual_seed(0))
    inside = torch.full_like(ids, 5)  # a window of the uniform token: its states are the uniform stream's
    stats = uniform_run(model, ids, ("patch:inside:1@0", "patch:inside:1@1"), first=9, inside=inside,
                        bos_prepended=False)
    orig, at0, at1 = stats["orig"], stats["patch:inside:1@0"], stats["patch:inside:1@1"]
    total = layer_values(orig, "all_no_key0", "attn/e_total")
    assert float(layer_values(orig, "all_no_key0", "scores/energy")[0]) < 1e-6 * float(total[0])
    assert torch.all(layer_values(orig, "all_no_key0", "attn/residual") > 1e-3 * total)  # found
    for variant in ("all", "all_no_key0"):
        assert torch.all(layer_values(at0, variant, "attn/residual") < 1e-6 * total)
    torch.testing.assert_close(at1.sums.sums["scores"][:, 0], orig.sums.sums["scores"][:, 0], rtol=0, atol=0)
    diff = contrast(orig, at0)["difference"]
    k = METRICS.index("attn/residual")
    assert torch.all(diff.hi[1, k] < 0)  # the removal is outside its interval (all queries, key 0 out)


def test_prefix_patch_from_another_input_changes_the_scores():
    """The negative control of the no-op tests (test_leakage_position0): with a fixed first token, patching
    positions 0..3 from another sequence carries other tokens' states into layer 1 and changes layer 2's scores,
    and layers before the patch are untouched."""
    model = build("llama")
    hm = HookedModel(model)
    ids = torch.randint(3, 200, (4, 16), generator=torch.Generator().manual_seed(3))
    ids[:, 0] = 1
    plain, patched = {}, {}

    def readers(into: dict) -> dict:
        return {f"blocks.{l}.attn.hook_attn_scores": lambda s, ctx: into.update({ctx.layer: s}) for l in (0, 2)}

    _, hooks, _ = iv.prepare("patch:other:4@1", model, hm, ids)
    hm.run(ids, hooks=readers(plain))
    hm.run(ids, hooks={**hooks, **readers(patched)})
    assert torch.equal(patched[0], plain[0])
    assert float((patched[2] - plain[2]).nan_to_num().abs().max()) > 1e-2


def test_interventions_are_checked_against_the_model_before_any_work():
    """One line naming the intervention and the fix; the check needs the config only (no forward)."""
    cfg = SimpleNamespace(vocab_size=256, max_position_embeddings=1024, num_hidden_layers=3)
    assert [s.name for s in iv.check(["mean", "shift:896", "token:255", "patch:mean:5@2"], cfg, 128, 8)] == \
        ["mean", "shift", "token", "patch"]
    for spec, words in (("shift:1000000000", "outside the model's 1024 positions"), ("shift:897", "K <= 896"),
                        ("shift:-1", "positions"), ("token:256", "vocabulary"), ("token:-3", "vocabulary"),
                        ("patch:inside:1@3", "layer 3"), ("patch:inside:128@0", "seq_len - 1 = 127"),
                        ("patch:other:1@0", "batch_size >= 2"), ("patch:elsewhere:1@0", "SOURCE"),
                        ("patch:mean:1", "SOURCE")):
        with pytest.raises(UsageError, match=words) as e:
            iv.check([spec], cfg, 128, 1 if "other" in spec else 8)
        assert "\n" not in str(e.value) and spec in str(e.value)


def test_alpha0_of_a_sliding_window_layer_is_over_the_queries_that_see_key_0():
    # uniform causal attention: A_i0 = 1 / (i + 1) for a full layer; a window of W keys hides key 0 from i >= W
    T, W = 64, 32
    i = torch.arange(T, dtype=torch.float64)
    full = 1.0 / (i + 1)
    window = torch.where(i < W, full, torch.zeros(()))
    key0 = torch.stack([full, window])[:, None, :]  # [L = 2, H = 1, T]
    harmonic = lambda n: float((1.0 / torch.arange(1, n + 1, dtype=torch.float64)).sum())  # noqa: E731
    a = alpha0(key0, windows=[0, W])
    assert a.shape == (2, 1)
    assert a[0, 0].item() == pytest.approx(harmonic(T) / T, rel=1e-12)  # 0.074 (Gu et al.'s uniform value)
    assert a[1, 0].item() == pytest.approx(harmonic(W) / W, rel=1e-12)  # 0.127, not H_W / T
    assert torch.equal(alpha0(key0), key0.mean(-1))  # no windows: every query
    assert alpha0(key0, 16, [0, W])[1, 0].item() == pytest.approx(harmonic(16) / 16, rel=1e-12)  # W > tokens


def test_alpha0_intervals_stay_within_0_and_1():
    """Gu et al.'s alpha_0 is a mean attention weight: its estimate and interval lie in [0, 1] (`support`), though
    two groups of uneven attention on key 0 (0.95 and 0.35; a jackknife over two groups has t_1 = 12.7) put the
    uncut interval's upper end far above 1 (checked, so the test can fail)."""
    stat = LeakageMaps(groups=2)
    for g, a in enumerate((0.95, 0.35)):
        stat.sums.add("key0", g, torch.full((1, 1, 8), 3 * a, dtype=torch.float64), 3)  # 3 sequences per group
    assert float(stat.sums.estimate(lambda m: alpha0(m["key0"])).hi) > 1.5  # uncut
    for name, est in stat.alpha0_estimates().items():
        assert est.support == (0.0, 1.0), name
        assert float(est.value) == pytest.approx(0.65, abs=1e-12), name  # the pooled mean is not cut
        assert (float(est.lo), float(est.hi)) == (0.0, 1.0), name  # 0.65 -+ 12.7 * 0.3, cut to the range


def _key0_pass(attention: dict[tuple[int, int], float], groups: int = 4) -> LeakageMaps:
    """A pass whose mean attention on key 0 is `attention[(layer, head)]` at every query (1/8 elsewhere), the same
    in every group, as a pass over 2 layers x 2 heads of 8 queries would record it."""
    stat = LeakageMaps(groups=groups)
    for g in range(groups):
        key0 = torch.full((2, 2, 8), 1 / 8, dtype=torch.float64)
        for (layer, head), a in attention.items():
            key0[layer, head] = a
        stat.sums.add("key0", g, 3 * key0, 3)  # 3 sequences per group
    return stat


def test_sink_attention_reads_the_sink_heads_of_the_base_pass_in_both_passes():
    """One head attends 0.9 to key 0 (a sink at threshold 0.3), one 0.6 (a sink), the rest 1/8 (not sinks): after an
    intervention that halves the first and leaves the second, the sinks' mean attention goes from 0.75 to 0.525,
    a change of exactly -0.225 with a zero-width interval (every group agrees); the heads are chosen on the base
    pass only; with no head above the threshold there is nothing to read (None)."""
    from poslens.analyses.leakage.contrast import sink_attention

    base = _key0_pass({(0, 1): 0.9, (1, 0): 0.6})
    other = _key0_pass({(0, 1): 0.45, (1, 0): 0.6, (1, 1): 0.95})  # a new sink in the other pass is not counted
    out = sink_attention(base, other, threshold=0.3)
    assert out["heads"] == 2
    assert out["base"]["value"] == pytest.approx(0.75, abs=1e-12)
    assert out["pass"]["value"] == pytest.approx(0.525, abs=1e-12)
    assert out["change"]["value"] == pytest.approx(-0.225, abs=1e-12)
    assert out["change"]["hi"] - out["change"]["lo"] == pytest.approx(0.0, abs=1e-12)
    assert [(h["layer"], h["head"], round(h["value"], 12)) for h in out["per_head"]] == [(1, 2, -0.45), (2, 1, 0.0)]
    assert all(h["chosen_on"] == [0, 1] for h in out["per_head"])
    assert sink_attention(base, other, threshold=0.95) is None


def test_sink_heads_are_chosen_on_other_sequences_than_those_they_are_measured_on():
    """A head above the threshold in the even groups only (0.5 there, 0.1 in the odd ones): it is chosen on the
    even groups' sequences and measured on the odd ones', so its base attention reads 0.1, not the 0.5 that chose
    it (choosing and measuring on the same sequences would report 0.5, or 0.3 over all of them); the other pass
    equals the base, so the change is exactly 0, and its interval comes from every group."""
    from poslens.analyses.leakage.contrast import sink_attention

    def uneven() -> LeakageMaps:
        stat = LeakageMaps(groups=4)
        for g in range(4):
            key0 = torch.full((2, 2, 8), 1 / 8, dtype=torch.float64)
            key0[1, 1] = 0.5 if g % 2 == 0 else 0.1
            stat.sums.add("key0", g, 3 * key0, 3)
        return stat

    out = sink_attention(uneven(), uneven(), threshold=0.3)
    assert out["heads"] == 1 and out["per_head"][0]["chosen_on"] == [0]
    assert out["groups"] == 4  # the jackknife is over every group, not over the first half's groups alone
    assert out["base"]["value"] == pytest.approx(0.1, abs=1e-12)
    assert out["change"]["value"] == pytest.approx(0.0, abs=1e-12)
    assert "cross-fitted" in out["selection"]


def key_bias_pair() -> dict:
    """Two NoPE models (SmolLM3 with RoPE off in every layer, float64) that differ only in the key projection's bias
    ("plain": zero; "biased": random, of size 3): their scores differ by q_i . b, one constant per query, head and
    layer, which no softmax sees."""
    plain = build("smollm3", dtype=torch.float64, no_rope_layers=[0, 0, 0], attention_bias=True)
    biased = copy.deepcopy(plain)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for a, b in zip(plain.model.layers, biased.model.layers):
            a.self_attn.k_proj.bias.zero_()
            b.self_attn.k_proj.bias.copy_(3 * torch.randn(b.self_attn.k_proj.bias.shape, generator=g,
                                                          dtype=torch.float64))
    return {"plain": plain, "biased": biased}


def test_two_nope_models_that_differ_only_in_a_key_bias_give_the_same_terms():
    """Two NoPE models (SmolLM3 with RoPE off in every layer) that differ only in the key projection's bias: their
    scores differ by q_i . b, one constant per query (and head, and layer), which no softmax sees, so their
    attention and log-probabilities agree. Every term of the decomposition and of the log-probabilities, per layer
    and per head, on every domain, agrees to 1e-6 relative (1.2e-7 seen; the statistic reads the scores in
    float32), the signed interaction to 1e-6 of the total (6e-6 of its own size where it is near 0); the scores'
    own energy does not (the control: the models' scores do differ)."""
    ids = torch.randint(3, 200, (8, 24), generator=torch.Generator().manual_seed(7))
    out = {}
    for name, model in key_bias_pair().items():
        hm = HookedModel(model)
        stat = LeakageMaps(groups=2, domains=Domains(early_queries=8))
        for b, batch in enumerate(torch.split(ids, 2)):
            stat.group = b % 2
            hm.run(batch, hooks=stat.hooks(hm))
        means = {k: stat.sums.mean(k) for k in stat.KEYS}
        out[name] = (stat.layer_metrics(means), stat.head_metrics(means))
    invariant = [m for m, name in enumerate(METRICS) if name.split("/")[0] in ("attn", "log_probs")]
    energy = METRICS.index("scores/energy")
    signed = [METRICS.index(k) for k in ("attn/cross", "attn/share_cross")]
    total = METRICS.index("attn/e_total")
    for k in range(2):
        got, ref = out["biased"][k], out["plain"][k]
        unsigned = [m for m in invariant if m not in signed]
        torch.testing.assert_close(got[:, unsigned], ref[:, unsigned], rtol=1e-6, atol=0)
        # the interaction is a signed difference of the energies (near 0 in places): to 1e-6 of the total
        assert torch.all((got[:, signed[0]] - ref[:, signed[0]]).abs() <= 1e-6 * ref[:, total])
        assert torch.all((got[:, signed[1]] - ref[:, signed[1]]).abs() <= 1e-6)
        assert torch.all((out["biased"][k][:, energy] / out["plain"][k][:, energy] - 1).abs() > 0.01)


def test_sink_heads_removed_share_is_measured_on_the_half_that_did_not_choose_the_heads():
    """A real tiny model's passes (the original and position 0's token replaced), with head (layer 1, head 2) planted
    as a sink in the even groups only: it is chosen on the even groups' sequences and its removed share of the
    early residual term is measured on the odd groups' alone, equal to that of a statistic holding only the odd
    groups' sums (to 1e-12: the same float64 means); the share over the chosen set is the same number (one head), with
    a paired jackknife interval around it; with no sink on either half there is nothing to report."""
    from poslens.analyses.leakage.contrast import sink_heads_removed

    model = build("llama", num_hidden_layers=2)
    hm = HookedModel(model)
    ids = torch.randint(3, 200, (8, 16), generator=torch.Generator().manual_seed(9))
    swapped = ids.clone()
    swapped[:, 0] = 2
    base, other = LeakageMaps(groups=4, domains=Domains(early_queries=8)), LeakageMaps(groups=4,
                                                                                      domains=Domains(early_queries=8))
    for stat, x in ((base, ids), (other, swapped)):
        for g in range(4):
            stat.group = g
            hm.run(x[2 * g:2 * g + 2], hooks=stat.hooks(hm))
    key0 = base.sums.sums["key0"]
    key0[:] = 0.05 * base.sums.counts["key0"].reshape(4, 1, 1, 1)  # alpha_0 0.05 everywhere: no sink
    assert sink_heads_removed(base, other, threshold=0.3) is None
    key0[0::2, 0, 1] *= 10  # 0.5 on the even groups, 0.05 on the odd
    out = sink_heads_removed(base, other, threshold=0.3)
    assert out["heads"] == 1 and "cross-fitted" in out["selection"] and out["groups"] == 4

    def odd_only(stat: LeakageMaps) -> LeakageMaps:
        part = LeakageMaps(groups=4, domains=stat.domains)
        part.windows = stat.windows
        for name, s in stat.sums.sums.items():
            c = stat.sums.counts[name]
            odd = (torch.arange(4) % 2 == 1).to(torch.float64)
            part.sums.sums[name] = s * odd.reshape(-1, *(1,) * (s.dim() - 1)).to(s.dtype)
            part.sums.counts[name] = c * odd.reshape(-1, *(1,) * (c.dim() - 1))
        return part

    energy = ENERGIES.index("attn/residual")
    names = [v[0] for v in VARIANTS]
    ob, oo = odd_only(base), odd_only(other)
    eb = ob.head_energies({k: ob.sums.mean(k) for k in ob.KEYS})[:, energy, 0, 1]  # [V]: layer 1, head 2
    eo = oo.head_energies({k: oo.sums.mean(k) for k in oo.KEYS})[:, energy, 0, 1]
    for key0, variant in (("key0_in", "early"), ("key0_out", "early_no_key0")):
        expected = float(1 - eo[names.index(variant)] / eb[names.index(variant)])
        head, cell = out[key0]["per_head"][0], out[key0]["removed"]
        assert (head["layer"], head["head"], head["chosen_on"]) == (1, 2, [0])
        assert head["value"] == pytest.approx(expected, rel=1e-12)
        assert cell["value"] == pytest.approx(expected, rel=1e-12)
        assert cell["lo"] < cell["value"] < cell["hi"]
    # two groups: one per half, so a jackknife replicate leaves a half without sequences: a value, no interval
    pair = [LeakageMaps(groups=2, domains=Domains(early_queries=8)) for _ in range(2)]
    for stat, x in zip(pair, (ids, swapped)):
        for g in range(2):
            stat.group = g
            hm.run(x[4 * g:4 * g + 4], hooks=stat.hooks(hm))
    pair[0].sums.sums["key0"][:] = 0.05 * pair[0].sums.counts["key0"].reshape(2, 1, 1, 1)
    pair[0].sums.sums["key0"][0, 0, 1] *= 10
    two = sink_heads_removed(*pair, threshold=0.3)["key0_in"]["removed"]
    assert math.isfinite(two["value"]) and math.isnan(two["lo"]) and math.isnan(two["hi"])
