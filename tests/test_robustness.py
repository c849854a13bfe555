"""Robust to the machine (poslens.report.robustness): the alternative CPU kernel set really changes a matmul's
rounding (so a row's robustness line can fail), rows on the sweep's models say whether their verdict stays, and the
check rebuilds those sections on models retrained into a cache of their own."""

import os
from pathlib import Path

import numpy as np

from poslens.report import robustness as rb
from poslens.report.claims import Claim, Test
from poslens.report.render import render_markdown
from poslens.report.section import Section, SectionSpec

SEEDED = Test("effect", -0.2, "<", 0.0, -0.3, -0.1, "95% t-interval over 3 seeds")


def test_the_kernel_switch_changes_the_rounding_of_a_matmul():
    """A fixed float32 matmul (64 x 257 by 257 x 63) in a subprocess on this machine's kernels and on the alternative
    set: ATen reports its lowered capability, the product's bits differ (the switch changes the rounding, so retrained
    models can drift and a verdict can move), and both stay within float32 rounding of the float64 product (a sum of
    257 products of standard normals: 1e-4 is about 40 float32 ulps of its largest terms), so it is rounding, not
    another computation. The float64 products agree to 1e-12 (float64 rounding of such sums: ~1e-14)."""
    native, other = rb.rounding(), rb.rounding(rb.kernel_env())
    assert other["capability"] == "DEFAULT"
    a, b, exact = (np.array(x) for x in (native["matmul"], other["matmul"], native["exact"]))
    assert np.abs(np.array(other["exact"]) - exact).max() < 1e-12  # float64 rounds differently too, at 1e-15
    assert not np.array_equal(a, b), f"the kernel sets {native['capability']} and DEFAULT round alike"
    assert np.abs(a - exact).max() < 1e-4 and np.abs(b - exact).max() < 1e-4


def test_rows_on_the_sweeps_models_carry_a_robustness_line():
    """A row over seeds says 'not checked' until checked, then whether its verdict stays; a row on exact quantities
    has no line; the Markdown row shows it."""
    seeded = Claim("s", "poslens", "here", "c", (SEEDED,))
    exact = Claim("e", "poslens", "here", "c", (Test("x", 1.0, ">"),))
    assert rb.robustness_line(seeded) == rb.NOT_CHECKED and rb.robustness_line(exact) == ""
    assert rb.judged("holds", "holds").startswith("the same verdict (holds)")
    assert rb.judged("holds", "not resolved").startswith("changes with the machine: not resolved (not holds)")
    md = render_markdown("T", "", [Section("S", "", [seeded, exact])], Path("."))
    assert md.count("Robust to the machine: not checked") == 1


def test_the_check_rebuilds_the_seeded_sections_on_the_retrained_models(tmp_path, monkeypatch):
    """`check` retrains once per matrix the seeded sections read (the BOS sweep too; here recorded, not run), links
    every cache entry but the trained models into the alternative cache, rebuilds only the sections with rows over
    seeds with POSLENS_CACHE there, and compares verdicts row by row: a row whose retrained verdict differs says
    so, one that agrees says the same."""
    root = tmp_path / "cache"
    (root / "corpus").mkdir(parents=True)
    (root / "trained").mkdir()
    monkeypatch.setenv("POSLENS_CACHE", str(root))
    retrained, built = [], []
    monkeypatch.setattr(rb, "retrain", lambda size, alt, out, progress=False: retrained.append((size, alt)))

    def build(ctx, size):  # the verdict of row "moves" depends on which cache the models come from
        alt = os.environ["POSLENS_CACHE"].endswith(rb.ALT_CACHE)
        built.append(alt)
        moving = Test("effect", -0.2, "<", 0.0, -0.3, 0.1 if alt else -0.1, "95% t-interval over 3 seeds")
        return Section("S", "", [Claim("moves", "poslens", "h", "c", (moving,)), Claim("stays", "poslens", "h", "c",
                                                                                       (SEEDED,))])

    seeded = SectionSpec("seeded", "seeded", build, models=True)
    plain = SectionSpec("plain", "plain", lambda ctx, size: Section("P", "", [Claim("x", "poslens", "h", "c",
                                                                                    (Test("x", 1.0, ">"),))]))
    sections = [build(None, {}), plain.build(None, {})]
    sections[0].name, sections[1].name = "seeded", "plain"  # as reproduce names them
    built.clear()
    size = {"sweep": "pe-quick", "bos_sweep": "bos-quick", "sweep_seeds": [0, 1, 2]}  # the leakage section's two
    ctx = type("Ctx", (), {"parts": str(tmp_path / "parts")})
    other = rb.check([(seeded, size), (plain, {})], [sections[0], sections[1]], lambda: ctx)
    # one retraining per matrix the section reads, on the section's seeds; one rebuild
    assert sorted((c.preset, c.seeds, alt) for c, alt in retrained) == [
        ("bos-quick", [0, 1, 2], root / rb.ALT_CACHE), ("pe-quick", [0, 1, 2], root / rb.ALT_CACHE)]
    assert built == [True]
    assert (root / rb.ALT_CACHE / "corpus").is_symlink() and not (root / rb.ALT_CACHE / "trained").exists()
    assert other == {"moves": "not resolved", "stays": "holds"}
    moves, stays = sections[0].claims
    assert moves.robustness.startswith("changes with the machine: not resolved (not holds)")
    assert stays.robustness.startswith("the same verdict (holds)") and sections[1].claims[0].robustness == ""
    assert os.environ["POSLENS_CACHE"] == str(root)  # restored
