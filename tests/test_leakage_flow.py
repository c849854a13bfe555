"""The decomposition in the parameter-free stack: exact (Gram flow) and Monte Carlo."""

import json

import numpy as np
import pytest
import torch

from poslens.analyses.leakage import flow
from poslens.analyses.leakage.metrics import Domain
from poslens.stack.config import StackConfig, visible
from poslens.stack.gramflow import gram_flow


def test_first_layer_logits_are_relative_for_every_architecture():
    """Layer 1 sees the Toeplitz input Gram (1 - alpha) I + alpha 11^T times the Toeplitz RoPE kernel: its
    scores depend on i - j only, so the scores' energy is 0 and the mask-only term is the whole leak (share 1)."""
    for name, split in flow.compare(StackConfig(n=32, alpha=0.3, layers=2)).items():
        e = split["exact"]
        assert float(e["scores_energy"][0]) == pytest.approx(0.0, abs=1e-20), name
        assert float(e["share_mask_only"][0]) == pytest.approx(1.0, abs=1e-12), name
        assert float(e["scores_energy"][1]) > 0, name  # from layer 2 on, the mask has made the hidden states positional


def test_rope_without_a_mask_leaks_only_a_boundary_term():
    """With no mask the stack commutes with reversing the sequence (the input Gram and the RoPE kernel are
    symmetric Toeplitz), so every absolute-position signal is symmetric: l_i = l_{n-1-i}, S_ij = S_{n-1-j, n-1-i}.
    It is a function of the distance to the sequence's ends, not a trend in position: its whole non-relative
    energy is three orders of magnitude below the causal mask's term, and its scores' energy more."""
    n = 64
    none = StackConfig(n=n, d=64, alpha=0.2, layers=3, positional="rope", mask="none")
    gf = gram_flow(none)
    lp = flow.log_partition(gf.scores, visible(n, "none")).numpy()
    np.testing.assert_allclose(lp, lp[:, ::-1], rtol=0, atol=1e-12)
    np.testing.assert_allclose(gf.scores, gf.scores[:, ::-1, ::-1].transpose(0, 2, 1), rtol=0, atol=1e-12)
    causal = flow.exact_split(StackConfig(n=n, d=64, alpha=0.2, layers=3, positional="rope"))
    unmasked = flow.exact_split(none)
    assert torch.all(unmasked["e_total"] < 1e-3 * causal["mask_only"])
    assert torch.all(unmasked["scores_energy"][1:] < 1e-3 * causal["scores_energy"][1:])


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
    for key in ("e_total", "mask_only", "residual", "share_mask_only"):
        torch.testing.assert_close(sa[key]["value"], sb[key]["value"], rtol=1e-7, atol=1e-12)


def test_monte_carlo_approaches_the_exact_limit_as_width_grows():
    """The Monte Carlo split at d = 512 lies closer to the d -> infinity split than at d = 16 (finite-width
    error shrinks like 1/d)."""
    base = StackConfig(n=16, alpha=0.2, layers=2, positional="rope")
    exact = flow.exact_split(replace_d(base, 512))
    err = {}
    for d in (16, 512):
        mc = flow.mc_split(replace_d(base, d), 256, groups=4, seed=0)
        err[d] = abs(float(mc["share_mask_only"]["value"][1]) - float(exact["share_mask_only"][1]))
    assert err[512] < err[16]


def replace_d(cfg: StackConfig, d: int) -> StackConfig:
    from dataclasses import replace

    return replace(cfg, d=d)


def test_sliding_window_mask_part_stops_at_the_window():
    """Past the window every query sees exactly W keys, so in layer 1 (relative scores) l_i is constant for
    i >= W - 1 and so is the lag profile's L0_i: restricted to those queries there is no mask-only term at all."""
    cfg = flow.architecture("sliding", StackConfig(n=40, alpha=0.2, layers=1), window=8)
    late = flow.exact_split(cfg, Domain(window=8, min_query=7))
    assert float(late["mask_only"][0]) == pytest.approx(0.0, abs=1e-20)
    early = flow.exact_split(cfg, Domain(window=8))
    assert float(early["mask_only"][0]) > 0


def test_leakage_stack_and_compare_commands(tmp_path, capsys):
    """The CLI end to end: exact and Monte Carlo figures per component, then leakage-compare on the run; a bad
    option value is one line on stderr with exit status 2."""
    from poslens import cli

    out = tmp_path / "stack"
    assert cli.main(["leakage-stack", "--n", "16", "--layers", "2", "--samples", "256", "--groups", "2",
                     "--out", str(out)]) == 0
    for stem in ("architectures_exact_mask_only", "architectures_monte_carlo_residual"):
        assert (out / "figures" / f"{stem}.png").exists()
    printed = capsys.readouterr().out  # the shares per architecture and layer, as run.json has them
    arch = json.loads((out / "run.json").read_text())["metrics"]["architectures"]
    for name, entry in arch.items():
        r, mc = entry["exact"]["share_residual"], entry["monte_carlo"]["share_residual"]
        assert f"{name}: shares of the non-relative energy per layer" in printed
        assert f"  layer 2: mask-only {entry['exact']['share_mask_only'][1]:.3g}" in printed
        assert f"residual {r[1]:.3g} (MC {mc['value'][1]:.3g} [{mc['lo'][1]:.3g}, {mc['hi'][1]:.3g}])" in printed
    assert cli.main(["leakage-compare", str(out), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "figures" / "architectures_mask_only.png").exists()
    capsys.readouterr()
    tensors = out / "tensors.safetensors"  # a damaged input run: one line, exit 2, nothing written
    tensors.write_bytes(tensors.read_bytes()[:-64])
    assert cli.main(["leakage-compare", str(out), "--out", str(tmp_path / "cmp2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "corrupt run directory" in err and len(err.splitlines()) == 1 and not (tmp_path / "cmp2").exists()
    assert cli.main(["leakage-stack", "--ntk-scaling", "0.5", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert "ntk_scaling" in err or "--ntk-scaling" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "bad").exists()


def test_decomposition_in_the_stack_layer_one_is_all_mask_and_later_layers_inherit_earlier_masks():
    """Layer 1's scores are relative (Toeplitz input Gram, RoPE): the mask-only term is the whole energy and the
    residual adds nothing (exact, d -> infinity). From layer 2 on the inputs carry the position the earlier
    layers' masks wrote, so the residual term is positive: in the parameter-free stack it is entirely earlier
    masks, which is why it is not called "the residual stream's own" term."""
    for name, res in flow.compare(StackConfig(n=32, alpha=0.3, layers=3)).items():
        e = res["exact"]
        assert float(e["residual"][0]) == pytest.approx(0.0, abs=1e-20), name
        assert float(e["mask_only"][0]) == pytest.approx(float(e["e_total"][0]), rel=1e-12), name
        assert torch.all(e["residual"][1:] > 0), name
