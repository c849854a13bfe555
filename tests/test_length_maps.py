"""The length section's leakage terms are `poslens leakage`'s gauge-invariant decomposition: the same numbers as the
leakage statistic at every evaluation length, from one capture, and unchanged by a constant per query.

Tolerances: both statistics read float32 scores (the capture's by blocks of per-head scores, the leakage statistic's
from the dense hook point) and sum them in float32, so the two paths' maps differ by float32 rounding (~1e-7
relative per entry); energies are sums of squared residuals of such maps, so 1e-5 relative is far above rounding and
far below any change of definition (the descriptive split's terms differ from these by order one).
"""

import math

import pytest
import torch
from test_leakage_causal import (
    key_bias_pair,
    one_thread,  # noqa: F401 (autouse: one intra-op thread for small tensors)
)
from tiny_models import build, token_batch

from poslens.analyses.leakage.causal import HEAD_MEAN_ONLY, METRICS, SUPPORT, LeakageMaps
from poslens.analyses.leakage.metrics import ATTENTION_TERMS, LEAN
from poslens.analyses.length.maps import LengthMaps
from poslens.engine.hooks import HookedModel


def length_terms(model, ids: torch.Tensor, lengths: list[int], rows: int = 5) -> dict[int, dict]:
    """LengthMaps's LEAN metrics at each length from one capture of ids (two groups), per-head score blocks of
    `rows` queries (so that blocks straddle the shorter lengths)."""
    maps = LengthMaps(model, groups=2, probs=False, lengths=lengths)
    maps.chunk_bytes = 16 * (ids.shape[0] // 2) * model.config.num_attention_heads * ids.shape[1] * rows
    half = ids.shape[0] // 2
    for g in range(2):
        maps.update(ids[g * half:(g + 1) * half], group=g)
    return maps.metrics_at(lengths, names=LEAN)


def leakage_terms(model, ids: torch.Tensor) -> torch.Tensor:
    """`poslens leakage`'s head-mean metrics [M, layers] on the domain every query, key 0 in (variant "all"), the
    same two groups."""
    hm = HookedModel(model)
    stat = LeakageMaps(groups=2)
    half = ids.shape[0] // 2
    for g in range(2):
        stat.group = g
        hm.run(ids[g * half:(g + 1) * half], hooks=stat.hooks(hm))
    return stat.layer_metrics({k: stat.sums.mean(k) for k in stat.KEYS})[0]


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_length_terms_are_the_leakage_commands_at_every_length(family):
    """On a RoPE model and a sliding-window one (window 12 below the lengths): the length section's terms at 16 and
    32 tokens, from one capture at 32, equal the leakage statistic's on the first 16 and on all 32 tokens (value and
    jackknife standard error), and the decomposition's three energies add up to its total."""
    model = build(family, num_hidden_layers=2)
    ids = token_batch(4, 32, seed=11)
    got = length_terms(model, ids, [16, 32])
    names = METRICS + HEAD_MEAN_ONLY
    for t in (16, 32):
        ref = leakage_terms(model, ids[:, :t])
        for name in LEAN:
            torch.testing.assert_close(got[t][name].value, ref[names.index(name)], rtol=1e-5, atol=0, msg=name)
        parts = sum(got[t][f"attn/{k}"].value for k in ("mask_only", "residual", "cross"))
        torch.testing.assert_close(parts, got[t]["attn/e_total"].value, rtol=1e-10, atol=0)
        assert torch.all(got[t]["attn/mask_only"].value > 0) and torch.all(got[t]["attn/residual"].value > 0)
        assert torch.all(got[t]["attn/e_total"].se > 0)
        for name in LEAN:  # each interval within the metric's range (two groups: t_1 = 12.7, raw ones leave it)
            low, high = SUPPORT.get(name, (-math.inf, math.inf))
            est = got[t][name]
            assert est.support == SUPPORT.get(name) and bool((est.lo >= low).all() & (est.hi <= high).all()), name


def test_a_constant_per_query_changes_no_length_term():
    """Two NoPE models whose scores differ by one constant per query, head and layer (a key-projection bias): every
    gauge-invariant term of the length section (the decomposition attn/..., log_probs/trf) at both lengths agrees
    to 1e-6 relative (the signed interaction to 1e-6 of the total), while the scores' own energy and TRF, which are
    descriptions of the scores, differ by over 1% (the test can fail)."""
    ids = torch.randint(3, 200, (8, 24), generator=torch.Generator().manual_seed(7))
    out = {name: length_terms(model, ids, [12, 24]) for name, model in key_bias_pair().items()}
    signed = ("attn/cross", "attn/share_cross")
    for t in (12, 24):
        got, ref = out["biased"][t], out["plain"][t]
        for name in [*ATTENTION_TERMS, "log_probs/trf"]:
            if name in signed:
                continue
            torch.testing.assert_close(got[name].value, ref[name].value, rtol=1e-6, atol=0, msg=name)
            torch.testing.assert_close(got[name].se, ref[name].se, rtol=1e-4, atol=1e-9, msg=name)
        total = ref["attn/e_total"].value
        assert torch.all((got["attn/cross"].value - ref["attn/cross"].value).abs() <= 1e-6 * total)
        assert torch.all((got["attn/share_cross"].value - ref["attn/share_cross"].value).abs() <= 1e-6)
        for name in ("scores/energy", "scores/trf"):
            assert torch.all((got[name].value / ref[name].value - 1).abs() > 0.01), name
