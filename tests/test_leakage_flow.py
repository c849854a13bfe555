"""The mask / logit split in the parameter-free stack: exact (Gram flow) and Monte Carlo."""

import numpy as np
import pytest
import torch

from poslens.analyses.leakage import flow
from poslens.analyses.leakage.metrics import Domain
from poslens.stack.config import StackConfig, visible
from poslens.stack.gramflow import gram_flow


def test_first_layer_logits_are_relative_for_every_architecture():
    """Layer 1 sees the Toeplitz input Gram (1 - alpha) I + alpha 11^T times the Toeplitz RoPE kernel: its
    scores depend on i - j only, so the logit part is 0 and the causal mask is the whole leak (share 1)."""
    for name, split in flow.compare(StackConfig(n=32, alpha=0.3, layers=2)).items():
        e = split["exact"]
        assert float(e["e_logit"][0]) == pytest.approx(0.0, abs=1e-20), name
        assert float(e["share_partition"][0]) == pytest.approx(1.0, abs=1e-12), name
        assert float(e["e_logit"][1]) > 0, name  # from layer 2 on, the mask has made the hidden states positional


def test_rope_without_a_mask_leaks_only_a_boundary_term():
    """With no mask the stack commutes with reversing the sequence (the input Gram and the RoPE kernel are
    symmetric Toeplitz), so every absolute-position signal is symmetric: l_i = l_{n-1-i}, S_ij = S_{n-1-j, n-1-i}.
    It is a function of the distance to the sequence's ends, not a trend in position: its mask part is three
    orders of magnitude below the causal mask's, and its logit part more."""
    n = 64
    none = StackConfig(n=n, d=64, alpha=0.2, layers=3, positional="rope", mask="none")
    gf = gram_flow(none)
    lp = flow.log_partition(gf.scores, visible(n, "none")).numpy()
    np.testing.assert_allclose(lp, lp[:, ::-1], rtol=0, atol=1e-12)
    np.testing.assert_allclose(gf.scores, gf.scores[:, ::-1, ::-1].transpose(0, 2, 1), rtol=0, atol=1e-12)
    causal = flow.exact_split(StackConfig(n=n, d=64, alpha=0.2, layers=3, positional="rope"))
    unmasked = flow.exact_split(none)
    assert torch.all(unmasked["e_partition"] < 1e-3 * causal["e_partition"])
    assert torch.all(unmasked["e_logit"][1:] < 1e-3 * causal["e_logit"][1:])


def test_shifting_every_position_changes_nothing():
    """RoPE scores depend on i - j only, so running the stack at positions 1000 .. 1000 + n - 1 gives the same
    maps (float64; RoPE angles up to 1e3 radians carry ~1e-13 rounding) and the same split."""
    cfg = flow.architecture("standard", StackConfig(n=24, d=32, alpha=0.2, layers=3))
    a = flow.monte_carlo(cfg, 256, groups=4, seed=3)
    b = flow.monte_carlo(cfg, 256, groups=4, seed=3, position_offset=1000)
    for key in ("scores", "log_partition"):
        torch.testing.assert_close(a.mean(key), b.mean(key), rtol=0, atol=1e-9, equal_nan=True)
    sa = flow.mc_split(cfg, 256, groups=4, seed=3)
    sb = flow.mc_split(cfg, 256, groups=4, seed=3, position_offset=1000)
    for key in ("e_logit", "e_partition", "share_logit"):
        torch.testing.assert_close(sa[key]["value"], sb[key]["value"], rtol=1e-7, atol=1e-12)


def test_monte_carlo_approaches_the_exact_limit_as_width_grows():
    """The Monte Carlo split at d = 512 lies closer to the d -> infinity split than at d = 16 (finite-width
    error shrinks like 1/d)."""
    base = StackConfig(n=16, alpha=0.2, layers=2, positional="rope")
    exact = flow.exact_split(replace_d(base, 512))
    err = {}
    for d in (16, 512):
        mc = flow.mc_split(replace_d(base, d), 256, groups=4, seed=0)
        err[d] = abs(float(mc["share_partition"]["value"][1]) - float(exact["share_partition"][1]))
    assert err[512] < err[16]


def replace_d(cfg: StackConfig, d: int) -> StackConfig:
    from dataclasses import replace

    return replace(cfg, d=d)


def test_sliding_window_mask_part_stops_at_the_window():
    """Past the window every query sees exactly W keys, so in layer 1 (relative scores) l_i is constant for
    i >= W - 1: restricted to those queries there is no mask part at all."""
    cfg = flow.architecture("sliding", StackConfig(n=40, alpha=0.2, layers=1), window=8)
    late = flow.exact_split(cfg, Domain(window=8, min_query=7))
    assert float(late["e_partition"][0]) == pytest.approx(0.0, abs=1e-20)
    early = flow.exact_split(cfg, Domain(window=8))
    assert float(early["e_partition"][0]) > 0


def test_leakage_stack_and_compare_commands(tmp_path, capsys):
    """The CLI end to end: exact and Monte Carlo figures per component, then leakage-compare on the run; a bad
    option value is one line on stderr with exit status 2."""
    from poslens import cli

    out = tmp_path / "stack"
    assert cli.main(["leakage-stack", "--n", "16", "--layers", "2", "--samples", "256", "--groups", "2",
                     "--out", str(out)]) == 0
    for stem in ("architectures_exact_logit", "architectures_monte_carlo_partition"):
        assert (out / "figures" / f"{stem}.png").exists()
    assert cli.main(["leakage-compare", str(out), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "figures" / "architectures_logit.png").exists()
    capsys.readouterr()
    assert cli.main(["leakage-stack", "--ntk-scaling", "0.5", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert "ntk_scaling" in err or "--ntk-scaling" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "bad").exists()


def test_counterfactual_in_the_stack_layer_one_is_all_mask_and_later_layers_inherit_earlier_masks():
    """Layer 1's scores are relative (Toeplitz input Gram, RoPE): the mask-only counterfactual is the whole
    log-partition term and the scores add nothing (exact, d -> infinity). From layer 2 on the inputs carry the
    position the earlier layers' masks wrote, so the scores' absolute term is positive: in the parameter-free
    stack it is entirely earlier masks, which is why it is not called "the residual stream's own" term."""
    for name, res in flow.compare(StackConfig(n=32, alpha=0.3, layers=3)).items():
        e = res["exact"]
        assert float(e["cf/absolute_scores"][0]) == pytest.approx(0.0, abs=1e-20), name
        assert float(e["cf/mask_only_over_partition"][0]) == pytest.approx(1.0, rel=1e-12), name
        assert torch.all(e["cf/absolute_scores"][1:] > 0), name
