"""The mask-only counterfactual and the residual-stream patches on constructed cases with known answers.

Tolerances: constructed maps are float64 (identities to 1e-10 relative, exact zeros to 1e-9 of the map's energy);
tiny-model maps are float32 sums of float32 scores of magnitude ~3 (rounding ~1e-6 per entry, so a Toeplitz
map's residual energy is below 1e-8 of its mask energy: bound 1e-6).
"""

import math
from types import SimpleNamespace

import pytest
import torch
from tiny_models import build

from poslens.analyses.leakage import interventions as iv
from poslens.analyses.leakage import metrics as lm
from poslens.analyses.leakage.causal import METRICS, VARIANTS, Domains, LeakageMaps, alpha0, relative_log_partition
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
    """Both splits of the mean maps of per-sequence scores s [n, T, T]."""
    domain = domain or lm.Domain()
    mean = torch.where(VISIBLE, s, 0.0).mean(0).masked_fill(~VISIBLE, math.nan)
    lp, rel = torch.logsumexp(s, -1).mean(0), relative_log_partition(s).mean(0)
    return {**lm.split(mean, lp, domain), **{f"cf/{k}": v for k, v in lm.counterfactual_split(mean, lp, rel,
                                                                                              domain).items()}}


def test_relative_log_partition_against_a_loop():
    """Per map: diagonal means of the visible entries, then log sum exp over the visible keys (sliding window 5)."""
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, 12, 12, generator=g, dtype=torch.float64)
    i, j = torch.arange(12)[:, None], torch.arange(12)[None]
    s = s.masked_fill(~((j <= i) & (i - j < 5)), -math.inf)
    got = relative_log_partition(s)
    for b in range(2):
        mu = [s[b].diagonal(-d)[torch.isfinite(s[b].diagonal(-d))].mean() for d in range(5)]
        for q in range(12):
            ref = math.log(sum(math.exp(mu[q - k]) for k in range(max(0, q - 4), q + 1)))
            assert float(got[b, q]) == pytest.approx(ref, rel=1e-12)


def test_relative_scores_have_no_absolute_term():
    """Per-sequence scores phi_n(i - j) (a different relative profile per sequence): l^rel = l exactly, so the
    mask-only term is this layer's whole log-partition term and the scores add nothing."""
    g = torch.Generator().manual_seed(2)
    coef = torch.randn(16, 1, 1, generator=g, dtype=torch.float64)
    s = (PHI * coef + coef**2 * (I - J)).masked_fill(~VISIBLE, -math.inf)
    torch.testing.assert_close(relative_log_partition(s), torch.logsumexp(s, -1), rtol=1e-12, atol=1e-12)
    for dom in (lm.Domain(), lm.Domain(first_key=False, max_query=12)):
        out = decompose(s, dom)
        assert float(out["cf/absolute_scores"]) == pytest.approx(0.0, abs=1e-9 * float(out["e_total"]))
        assert float(out["e_logit"]) == pytest.approx(0.0, abs=1e-9 * float(out["e_total"]))
        assert float(out["cf/mask_only"]) == pytest.approx(float(out["e_partition"]), rel=1e-10)
        parts = out["cf/mask_only"] + out["cf/absolute_scores"] + out["cf/cross"]
        assert float(parts) == pytest.approx(float(out["e_total"]), rel=1e-10)


def test_planted_absolute_key_term_is_found_and_the_mask_term_is_not():
    """s = phi(i - j) + noise + (-1)^j on 64 sequences. The plant's own energy E_h = ||P h||^2 (computed from h
    alone) appears in the scores' absolute term (to 3%: the plant also moves l - l^rel a little), while the
    mask-only term moves by under 5% (the plant's diagonal means are O(1/T)). The split's log-partition term
    moves by 4 times as much as the mask-only term: it is not the mask's own effect."""
    h = (1 - 2 * (J % 2)).double().expand(T, T).masked_fill(~VISIBLE, math.nan)
    energy = float((lm.toeplitz_residual(*lm.values(h, lm.Domain())) ** 2).sum())
    base, planted = decompose(per_sequence_maps(64, 0.3, 0.0)), decompose(per_sequence_maps(64, 0.3, 1.0))
    found = float(planted["cf/absolute_scores"] - base["cf/absolute_scores"])
    assert found == pytest.approx(energy, rel=0.03)
    mask_move = abs(float(planted["cf/mask_only"] / base["cf/mask_only"]) - 1)
    partition_move = abs(float(planted["e_partition"] / base["e_partition"]) - 1)
    assert mask_move < 0.05
    assert partition_move > 4 * mask_move


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
    the scores' absolute term and the upstream logit term vanish and mask-only = log-partition term."""
    stats = uniform_run(build("llama"), torch.randint(3, 200, (4, 20), generator=torch.Generator().manual_seed(0)))
    orig = stats["orig"]
    for variant in ("all", "early_no_key0"):
        total = layer_values(orig, variant, "split/e_total")
        assert torch.all(total > 0.1)
        assert torch.all(layer_values(orig, variant, "cf/absolute_scores") < 1e-6 * total)
        assert torch.all(layer_values(orig, variant, "split/e_logit") < 1e-6 * total)
        torch.testing.assert_close(layer_values(orig, variant, "cf/mask_only"),
                                   layer_values(orig, variant, "split/e_partition"), rtol=1e-5, atol=0)


def test_position0_patch_finds_a_planted_first_state():
    """A uniform stream except position 0 (another vector, as a BOS). Layer 0's scores are Toeplitz off key 0
    (upstream logit term 0 without key 0), but key 0's score enters every query's denominator, so the scores'
    absolute term is there even without key 0; later layers get an absolute term in the stream through the
    mask (each query averages the first state with weight ~1/(i+1)). Patching position 0 at layer 0 with a
    uniform window's state removes every absolute term (the plant was the only source); patching it at layer 1
    leaves layer 0 exactly as it was."""
    model = build("llama")
    ids = torch.randint(3, 200, (4, 20), generator=torch.Generator().manual_seed(0))
    inside = torch.full_like(ids, 5)  # a window of the uniform token: its states are the uniform stream's
    stats = uniform_run(model, ids, ("patch:inside:1@0", "patch:inside:1@1"), first=9, inside=inside,
                        bos_prepended=False)
    orig, at0, at1 = stats["orig"], stats["patch:inside:1@0"], stats["patch:inside:1@1"]
    total = layer_values(orig, "all_no_key0", "split/e_total")
    assert float(layer_values(orig, "all_no_key0", "split/e_logit")[0]) < 1e-6 * float(total[0])
    assert torch.all(layer_values(orig, "all_no_key0", "cf/absolute_scores") > 1e-3 * total)  # found
    for variant in ("all", "all_no_key0"):
        assert torch.all(layer_values(at0, variant, "cf/absolute_scores") < 1e-6 * total)
    torch.testing.assert_close(at1.sums.sums["scores"][:, 0], orig.sums.sums["scores"][:, 0], rtol=0, atol=0)
    diff = contrast(orig, at0)["difference"]
    k = METRICS.index("cf/absolute_scores")
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
    assert sink_attention(base, other, threshold=0.95) is None
