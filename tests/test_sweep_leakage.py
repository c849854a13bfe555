"""Ruscio et al.'s claims judged on the sweep (`poslens.report.sweep_leakage`): on planted leakage results (the
run.json layout of `poslens leakage`, one per variant and seed) each row holds when the planted numbers say what
the paper says and is contradicted when they say the opposite; the error bar is the t-interval over seeds."""

import pytest

from poslens.report import sweep_leakage as sl
from poslens.report.claims import combine
from poslens.train.sweep import seed_interval

LABELS = {"nope": "NoPE", "rope": "RoPE", "ntk": "RoPE (ntk:8)", "window": "RoPE, window 32"}
SEEDS = (0, 1, 2)


def est(value):
    return {"value": value, "lo": value, "hi": value}


def planted(energy_by_layer: list[float], bos_removed: float) -> dict:
    """The parts of a leakage run.json the sweep's claims read: the absolute-scores energy per layer (all
    queries) and the BOS replacement's removed share (early queries), key 0 in and out alike."""
    per_layer = {"all": {sl.ENERGY: {k: est(energy_by_layer) for k in ("key0_in", "key0_out")}}}
    removed = {"early": {sl.ENERGY: {k: est(bos_removed) for k in ("key0_in", "key0_out")}}}
    return {"original": {"per_layer": per_layer},
            "interventions": {"mean": {"over_layers": {"removed": removed}}}}


def sweep(energies: dict[str, list[float]], bos_removed: float) -> dict:
    """Every variant x seed; seed s adds 0.01 s (a spread over seeds, so the intervals have width)."""
    return {(v, s): planted([x + 0.01 * s for x in e], bos_removed + 0.01 * s)
            for v, e in energies.items() for s in SEEDS}


AS_CLAIMED = {"nope": [1.0, 1.0, 1.0, 1.0], "rope": [1.0, 1.5, 2.0, 2.5], "ntk": [0.5, 0.7, 0.9, 1.1],
              "window": [1.0, 2.0, 3.0, 4.0]}  # NTK lowest in total, the window growing fastest with depth
REVERSED = {"nope": [1.0] * 4, "rope": [1.0, 1.5, 2.0, 2.5], "ntk": [2.0, 2.5, 3.0, 3.5], "window": [2.0] * 4}


@pytest.mark.parametrize("energies, bos, outcome, verdict", [(AS_CLAIMED, 0.4, "pass", "holds"),
                                                              (REVERSED, -0.3, "fail", "not resolved")])
def test_sweep_rows_pass_or_fail_by_what_is_planted(energies, bos, outcome, verdict):
    """Planted as the paper says, every test passes and the rows hold; planted the other way, the tests fail, and
    since the claims are about 3B-7B models the tiny sweep leaves them not resolved (the rule's scope)."""
    m = sweep(energies, bos)
    claim, context = sl.architecture_claim(m, LABELS, "planted", max_offset=31)
    assert combine(claim.tests) == outcome and claim.verdict == verdict and len(claim.tests) == 4
    assert "3B-7B" in claim.scope
    assert all("per seed" in t.statistic and "3 seeds" in t.interval for t in claim.tests)
    # standard minus NTK, summed over layers, seed by seed: the same 0.01 s on both sides cancels exactly
    diff = sum(energies["rope"]) - sum(energies["ntk"])
    assert claim.tests[0].value == pytest.approx(diff) and claim.tests[0].lo == pytest.approx(diff)
    assert "NoPE" in context[0][0] and "control" in context[0][0] and len(context) == 4
    bos_row = sl.bos_claim(m, LABELS, "planted")
    assert combine(bos_row.tests) == outcome and bos_row.verdict == verdict and "40%" in bos_row.paper_number
    e = seed_interval([bos + 0.01 * s for s in SEEDS])
    assert (bos_row.tests[0].value, bos_row.tests[0].lo, bos_row.tests[0].hi) == pytest.approx(
        (e["value"], e["lo"], e["hi"]))


def test_one_seed_is_not_resolved():
    m = {k: v for k, v in sweep(AS_CLAIMED, 0.4).items() if k[1] == 0}
    assert sl.bos_claim(m, LABELS, "planted").verdict == "not resolved"
    assert sl.architecture_claim(m, LABELS, "planted", 31)[0].verdict == "not resolved"
