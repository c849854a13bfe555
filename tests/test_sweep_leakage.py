"""Ruscio et al.'s claims judged on the sweep (`poslens.report.sweep_leakage`): on planted leakage results (the
run.json layout of `poslens leakage`, one per variant and seed) each row holds when the planted numbers say what
the paper says and is contradicted when they say the opposite; the error bar is the t-interval over seeds."""

from pathlib import Path

import pytest
from test_sweep import MICRO

from poslens.report import sweep_leakage as sl
from poslens.report.claims import combine
from poslens.train.sweep import seed_interval

pytest_plugins = ("train_fixtures",)  # the session's token directory (fixture `tokens`)

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


@pytest.mark.parametrize("energies, bos, outcome, verdict", [(AS_CLAIMED, 0.4, "pass", "holds at this scale"),
                                                              (REVERSED, -0.3, "fail", "fails at this scale")])
def test_sweep_rows_pass_or_fail_by_what_is_planted(energies, bos, outcome, verdict):
    """Planted as the paper says, every test passes and the rows hold at this scale; planted the other way, the tests
    fail, and since the claims are about billion-parameter models the tiny sweep reads them fails at this scale (the
    rule's scope), not contradicted."""
    m = sweep(energies, bos)
    claim, context = sl.architecture_claim(m, LABELS, "planted", max_offset=31)
    assert combine(claim.tests) == outcome and claim.verdict == verdict and len(claim.tests) == 4
    assert "Llama-3.2-3B" in claim.scope
    assert all("per seed" in t.statistic and "3 seeds" in t.interval for t in claim.tests)
    # standard minus NTK, summed over layers, seed by seed: the same 0.01 s on both sides cancels exactly
    diff = sum(energies["rope"]) - sum(energies["ntk"])
    assert claim.tests[0].value == pytest.approx(diff) and claim.tests[0].lo == pytest.approx(diff)
    assert "NoPE" in context[0][0] and "control" in context[0][0] and len(context) == 4
    bos_row = sl.bos_claim(with_offset(m, bos), LABELS, "planted")  # inside documents: the planted removal's sign
    assert combine(bos_row.tests) == outcome and bos_row.verdict == verdict and "40%" in bos_row.paper_number
    e = seed_interval([bos + 0.01 * s for s in SEEDS])
    assert (bos_row.tests[0].value, bos_row.tests[0].lo, bos_row.tests[0].hi) == pytest.approx(
        (e["value"], e["lo"], e["hi"]))


def test_one_seed_is_not_resolved():
    m = {k: v for k, v in sweep(AS_CLAIMED, 0.4).items() if k[1] == 0}
    assert sl.bos_claim(m, LABELS, "planted").verdict == "not resolved"
    assert sl.architecture_claim(m, LABELS, "planted", 31)[0].verdict == "not resolved"


def with_sinks(m: dict, change: float | None, half: float = 0.02, missing: tuple | None = None) -> dict:
    """Every model of `m` with sink heads whose alpha_0 changes by `change` (+ 0.01 s) under the BOS replacement,
    each seed's jackknife half-width `half`; None: no sink head anywhere; `missing` (variant, seed): none there."""
    out = {}
    for (v, s), run in m.items():
        run = {**run, "interventions": {"mean": dict(run["interventions"]["mean"])}}
        if change is not None and (v, s) != missing:
            c = change + 0.01 * s
            run["interventions"]["mean"]["sink_attention"] = {
                "heads": 3, "threshold": 0.3, "base": est(0.5), "pass": est(0.5 + c),
                "change": {"value": c, "lo": c - half, "hi": c + half}}
        out[v, s] = run
    return out


@pytest.mark.parametrize("change, outcome, verdict", [(-0.4, "pass", "holds at this scale"),
                                                      (0.05, "fail", "fails at this scale")])
def test_token_anchored_row_on_the_sweep_is_t_over_seeds_with_the_text_half_width_added(change, outcome, verdict):
    """Sinks that collapse under the BOS replacement in every seed pass the test (held: seen at this scale);
    sinks that keep their attention fail it, which for a claim about billion-parameter models reads fails at this
    scale.
    The interval is the t-interval over seeds with each seed's jackknife half-width (0.02) added in quadrature."""
    import math

    m = with_sinks(sweep(AS_CLAIMED, 0.4), change)
    row = sl.anchored_claim(m, LABELS, "planted", elsewhere="SmolLM2 context.")
    assert combine(row.tests) == outcome and row.verdict == verdict and row.id == "ruscio-token-anchored"
    values = [change + 0.01 * s for s in SEEDS]
    mean = sum(values) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in values) / 2)
    t975 = math.sqrt(2 * 0.95 ** 2 / (1 - 0.95 ** 2))  # Student's t, 2 df: F(t) = 1/2 + t / (2 sqrt(2 + t^2))
    half = math.sqrt((t975 * sd / math.sqrt(3)) ** 2 + 0.02 ** 2)
    t = row.tests[0]
    assert (t.value, t.lo, t.hi) == pytest.approx((mean, mean - half, mean + half), rel=1e-12)
    assert "SmolLM2 context." in row.measured and "window seed 2: 3 sink heads" in row.measured


def test_token_anchored_row_needs_sinks_in_every_seed():
    """A seed with no sink head has nothing to anchor: no row on the sweep (the report keeps the real model's)."""
    m = with_sinks(sweep(AS_CLAIMED, 0.4), -0.4, missing=("rope", 2))
    assert sl.anchored_claim(m, LABELS, "planted") is None
    assert "rope seed 2: no sink head" in sl.anchored_lines(m) and sl.without_sinks(m) == 1
    assert sl.anchored_claim(with_sinks(sweep(AS_CLAIMED, 0.4), None), LABELS, "planted") is None


def test_more_sequences_is_the_count_at_which_the_half_width_falls_below_the_gap():
    """An open jackknife test with its estimate 0.05 above 0 and a half-width 0.06 at 32 sequences: the half-width
    falls as 1 / sqrt(n), so about ceil(32 x 1.2^2) = 47 sequences would exclude 0; a passing test asks for none."""
    from poslens.report.claims import Test
    from poslens.report.sections.leakage import more_sequences

    open_ = Test("x", 0.05, ">", 0.0, -0.01, 0.11, "95% jackknife over 8 groups")
    assert "about 47 (against 32 here)" in more_sequences((open_,), 32)
    passing = Test("y", 0.5, ">", 0.0, 0.4, 0.6, "95% jackknife over 8 groups")
    assert "about 47" in more_sequences((open_, passing), 32)
    assert "about" not in more_sequences((Test("z", 0.0, ">", 0.0, -0.1, 0.1, "j"),), 32)


def with_offset(m: dict, paired: float) -> dict:
    """Every run of `m` with the offset null's pass of the BOS replacement: its removal at document starts minus
    inside the documents `paired` (+ 0.01 s), key 0 in and out alike."""
    out = {}
    for (v, s), run in m.items():
        cell = {"early": {sl.ENERGY: {k: est(paired + 0.01 * s) for k in ("key0_in", "key0_out")}}}
        out[v, s] = {**run, "nulls": {"offset": {"interventions": {"mean": {
            "paired": {"over_layers": {"removed": cell}}}}}}}
    return out


def test_bos_row_is_judged_on_the_document_start_models_with_the_packed_ones_beside():
    """On the BOS matrix the row's tests read `rope-doc` (document starts, BOS first) alone: planted removals of 0.4
    there and -0.3 in the packed `rope` pass the tests, and so does the offset null's paired difference (starts
    minus inside, 0.25: a test, since nulls are tests); the packed models' numbers are printed beside, not tested. A
    removal no larger at document starts than inside them fails the row; without the offset null those two tests
    are open."""
    labels = {"rope": "RoPE", "rope-doc": "RoPE; document starts, BOS first",
              "rope-doc-nobos": "RoPE; document starts, no BOS"}
    m = {**sweep({"rope-doc": [1.0] * 4}, 0.4), **sweep({"rope": [1.0] * 4}, -0.3)}
    m = with_offset(m, 0.25)
    row = sl.bos_claim(m, labels, "planted", variant=sl.BOS_VARIANT, contrast=sl.PACKED_VARIANT)
    assert combine(row.tests) == "pass" and len(row.tests) == 4
    inside = seed_interval([0.25 + 0.01 * s for s in SEEDS])
    assert "minus on windows inside the documents" in row.tests[2].statistic
    assert (row.tests[2].value, row.tests[2].lo, row.tests[2].hi) == pytest.approx(
        (inside["value"], inside["lo"], inside["hi"]))
    no_larger = {**sweep({"rope-doc": [1.0] * 4}, 0.4), **sweep({"rope": [1.0] * 4}, -0.3)}
    assert combine(sl.bos_claim(with_offset(no_larger, -0.1), labels, "planted", variant=sl.BOS_VARIANT,
                                contrast=sl.PACKED_VARIANT).tests) == "fail"
    unmeasured = sl.bos_claim(no_larger, labels, "planted", variant=sl.BOS_VARIANT, contrast=sl.PACKED_VARIANT)
    assert combine(unmeasured.tests) == "open" and "not measured" in unmeasured.tests[3].statistic
    assert all(t.statistic.startswith("RoPE; document starts, BOS first:") for t in row.tests)
    e = seed_interval([0.4 + 0.01 * s for s in SEEDS])
    assert row.tests[0].value == pytest.approx(e["value"])
    packed = seed_interval([-0.3 + 0.01 * s for s in SEEDS])
    assert "The contrast, RoPE models trained otherwise" in row.measured
    assert f"{packed['value']:.3g}" in row.measured
    assert "document starts minus the same replacement on the offset null's windows inside the same documents" in \
        row.measured
    assert sl.starts_minus_inside(m, "rope-doc").startswith("key 0 in 0.26")
    assert sl.starts_minus_inside(sweep({"rope-doc": [1.0] * 4}, 0.4), "rope-doc") == ""  # no offset null: no text
    flipped = {**sweep({"rope-doc": [1.0] * 4}, -0.3), **sweep({"rope": [1.0] * 4}, 0.4)}
    assert combine(sl.bos_claim(flipped, labels, "planted", variant=sl.BOS_VARIANT,
                                contrast=sl.PACKED_VARIANT).tests) == "fail"


@pytest.mark.parametrize("patched, outcome", [(-0.3, "pass"), (0.05, "fail")])
def test_token_anchored_row_also_needs_the_in_distribution_patch(patched, outcome):
    """With the patch from another document's start run, the row has two tests: the mean replacement's change and
    the patch's, each t over seeds; sinks that collapse under the mean embedding but keep their attention with a
    real token at position 0 fail the second test (not anchored to the token: broken by an unseen input)."""
    m = with_sinks(sweep({"rope-doc": [1.0] * 4, "rope": [1.0] * 4}, 0.4), -0.4)
    for (_, s), run in m.items():
        c = patched + 0.01 * s
        run["interventions"][sl.START_PATCH] = {"sink_attention": {
            "heads": 3, "threshold": 0.3, "base": est(0.5), "pass": est(0.5 + c),
            "change": {"value": c, "lo": c - 0.02, "hi": c + 0.02}}}
    labels = {"rope": "RoPE", "rope-doc": "RoPE; document starts, BOS first"}
    row = sl.anchored_claim(m, labels, "planted", variant=sl.BOS_VARIANT, patch=sl.START_PATCH,
                            context_variants=("rope-doc", "rope"))
    assert len(row.tests) == 2 and combine(row.tests[:1]) == "pass" and combine(row.tests[1:]) == outcome
    assert combine(row.tests) == outcome and "another document's start" in row.tests[1].statistic
    assert "from another document's start" in row.key and "rope seed 0" in row.measured
    assert "patch:" not in row.measured
    assert len(sl.anchored_claim(m, labels, "planted", variant=sl.BOS_VARIANT).tests) == 1  # without the patch


def with_mask_share(m: dict, share: float) -> dict:
    """Every run of `m` with its early-query mask-only share (summed over layers) `share`, key 0 in and out."""
    cell = {"attn/share_mask_only": {k: est(share) for k in ("key0_in", "key0_out")}}
    return {k: {**run, "original": {**run["original"], "over_layers": {"early": cell}}} for k, run in m.items()}


@pytest.mark.parametrize("paired, outcome", [(0.25, "pass"), (-0.2, "fail"), (None, "open")])
def test_sources_row_needs_the_removal_at_document_starts_to_exceed_it_inside_documents(paired, outcome):
    """`ruscio-sources-every-architecture`: per RoPE-family variant the mask's term, the BOS replacement's removal
    and that removal at document starts minus inside the documents (the offset null, paired; t over seeds), so a
    removal that is as large inside documents fails the row even where every other test passes; without the offset
    null the third test is open, and says that it was not measured."""
    m = with_mask_share(sweep(AS_CLAIMED, 0.4), 0.2)
    if paired is not None:
        m = with_offset(m, paired)
    row = sl.sources_claim(m, LABELS, "planted")
    assert len(row.tests) == 9 and combine(row.tests) == outcome
    inside = [t for t in row.tests if "document starts minus on windows inside" in t.statistic]
    assert len(inside) == 3 and all(t is row.tests[3 * k + 2] for k, t in enumerate(inside))
    assert combine(tuple(t for t in row.tests if t not in inside)) == "pass"
    if paired is None:
        assert all("not measured" in t.statistic for t in inside)
    else:
        e = seed_interval([paired + 0.01 * s for s in SEEDS])
        assert (inside[0].value, inside[0].lo, inside[0].hi) == pytest.approx((e["value"], e["lo"], e["hi"]))
    assert sl.INSIDE_RULE in row.measured


def _micro_sweep(path, tokens, variants: dict):
    """A micro sweep of one seed trained on the session's real-text tokens (into the test's model cache)."""
    import json

    from poslens.report.sweep import SweepModels
    from poslens.train.cache import tokens_of
    from poslens.train.sweep import SweepConfig, resolve_matrix, train_matrix

    path.write_text(json.dumps({"train": {**MICRO, "tokens": str(tokens)}, "variants": variants, "seeds": [0]}))
    cfg = SweepConfig(preset=str(path), jobs=1)
    matrix = resolve_matrix(cfg)
    paths = train_matrix(matrix, progress=False, jobs=1)
    return SweepModels(cfg, matrix, paths, tokens_of(matrix.members[0].config, False))


def test_a_model_in_two_sweeps_is_measured_once_and_its_numbers_are_those_of_its_own_run(tmp_path, tokens,
                                                                                       monkeypatch):
    """Standard RoPE is in the sweep and in the BOS matrix (one model directory): the leakage section measures it
    once, with the interventions of both (`shared`), and the BOS matrix's call finds that run instead of running its
    passes again. The extra intervention changes none of the numbers the sweep's rows read: the original pass and
    the mean replacement (with its null) are exactly those of a run with the mean replacement alone."""
    from types import SimpleNamespace

    from poslens.analyses.leakage import run as leakage_run
    from poslens.io.results import load

    monkeypatch.setenv("POSLENS_CACHE", str(tmp_path / "cache"))
    sw = _micro_sweep(tmp_path / "a.json", tokens, {"nope": {"pe": "none"}, "rope": {"pe": "rope"}})
    bsw = _micro_sweep(tmp_path / "b.json", tokens, {"rope": {"pe": "rope"},
                                                     "rope-doc": {"pe": "rope", "blocks": "doc-start"}})
    assert sw.path("rope", 0) == bsw.path("rope", 0)  # one configuration, one model
    ran, real = [], leakage_run.run_leakage

    def counted(cfg, out, **kw):
        ran.append((Path(cfg.model).name, tuple(cfg.interventions)))
        return real(cfg, out, **kw)

    monkeypatch.setattr(leakage_run, "run_leakage", counted)
    size = {"sweep_sequences": 4, "sweep_groups": 2}
    ctx = SimpleNamespace(parts=tmp_path / "parts", progress=False)
    first = sl.sweep_leakage_runs(ctx, sw, size, nulls=sl.BOS_NULLS, extra=sl.shared(sw, bsw, sl.BOS_INTERVENTIONS))
    second = sl.sweep_leakage_runs(ctx, bsw, size, sl.BOS_INTERVENTIONS, sl.BOS_NULLS)
    assert first["rope", 0] == second["rope", 0] and len(ran) == 3  # nope, rope (once), rope-doc
    assert (sw.path("rope", 0).name, tuple(sl.BOS_INTERVENTIONS)) in ran
    alone = sl.sweep_leakage_runs(SimpleNamespace(parts=tmp_path / "alone", progress=False), sw, size,
                                  nulls=sl.BOS_NULLS)["rope", 0]
    both, one = load(first["rope", 0], tensors=False).metrics, load(alone, tensors=False).metrics
    assert set(both["interventions"]) == {"mean", sl.START_PATCH} and set(one["interventions"]) == {"mean"}
    assert both["original"] == one["original"] and both["interventions"]["mean"] == one["interventions"]["mean"]


def test_report_parts_leave_out_an_optional_run_that_refuses(tmp_path):
    """The report's leakage parts (`sections.leakage.run_parts`): an optional run (Gemma-3-270M's) refused before any
    work, as its memory check does on a machine too small, is left out with its one-line reason and the other runs
    are kept and copied; the same refusal of a required run stops the report; a finished run is reused by its
    configuration (not made again)."""
    import dataclasses

    from poslens.errors import UsageError
    from poslens.report.sections.leakage import run_parts

    @dataclasses.dataclass
    class Conf:
        size: int

    made = []

    def make(conf, out):
        made.append(out)
        Path(out).mkdir(parents=True)
        (Path(out) / "run.json").write_text("{}")

    def refuse(conf, out):
        raise UsageError("seq_len 1024: the run would need about 25.7 GiB of memory but 20.9 GiB is free on cpu")

    parts, models = tmp_path / "parts", tmp_path / "models"
    jobs = [("leakage", Conf(1), make), ("leakage-gemma", Conf(2), refuse)]
    runs, refused = run_parts(jobs, parts, models, optional={"leakage-gemma"})
    assert list(runs) == ["leakage"] and (models / "leakage" / "run.json").is_file()
    assert refused == {"leakage-gemma": "seq_len 1024: the run would need about 25.7 GiB of memory but 20.9 GiB is "
                                        "free on cpu"}
    assert not any(p.name.startswith("leakage-gemma") for p in parts.iterdir())
    with pytest.raises(UsageError, match="25.7 GiB"):
        run_parts(jobs, parts, tmp_path / "models2")
    run_parts(jobs[:1], parts, tmp_path / "models3")
    assert len(made) == 1  # the part kept by its configuration is reused
