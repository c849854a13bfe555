"""The claim API: the verdict rule of poslens.report.claims, applied to tests that pass, fail or stay open."""

import json
import math

import pytest

from poslens.report.claims import Claim, Reading, Test, combine, estimate_test, ledgers

UP = Test("slope", 0.5, ">", 0.0, 0.2, 0.8, "95% jackknife")  # whole interval above 0
DOWN = Test("slope", -0.5, ">", 0.0, -0.8, -0.2, "95% jackknife")  # whole interval below 0
OPEN = Test("slope", 0.1, ">", 0.0, -0.2, 0.4, "95% jackknife")  # straddles 0


def claim(**kw) -> Claim:
    return Claim(**{"id": "x", "paper": "kim2025", "where": "Section 3", "claim": "c", **kw})


def test_a_test_passes_fails_or_stays_open_by_its_interval():
    assert (UP.outcome(), DOWN.outcome(), OPEN.outcome()) == ("pass", "fail", "open")
    below = Test("ratio", 0.9, "<", 1.0, 0.8, 0.95)
    assert below.outcome() == "pass" and Test("ratio", 1.1, "<", 1.0, 1.05, 1.2).outcome() == "fail"
    # an exact value decides; an undefined interval (run.json's null) never does
    assert Test("count", 0, "<", 0.5).outcome() == "pass" and Test("count", 3, "<", 0.5).outcome() == "fail"
    assert Test("s", 1.0, ">", 0, None, None).outcome() == "pass"
    assert Test("s", 1.0, ">", 0, math.nan, 2.0).outcome() == "open"
    assert Test("s", math.nan, ">", 0).outcome() == "open"
    with pytest.raises(ValueError, match="side"):
        Test("s", 1.0, ">=")
    with pytest.raises(ValueError, match="both"):
        Test("s", 1.0, ">", 0, 0.5, None)


def test_an_estimate_without_an_interval_reads_so_not_nan():
    t = estimate_test("probe error", {"value": 0.213, "lo": None, "hi": None}, "<", 0.0, "95% jackknife over 2 groups")
    assert t.outcome() == "open" and t.key() == "0.213 (no interval)" and "nan" not in t.text()


def test_tests_are_a_conjunction():
    assert combine((UP, UP)) == "pass" and combine((UP, DOWN)) == "fail" and combine((UP, OPEN)) == "open"
    assert combine((OPEN, DOWN)) == "fail"


def test_the_verdict_rule():
    assert claim(tests=(UP,)).verdict == "holds"
    assert claim(tests=(DOWN,)).verdict == "contradicted"
    assert claim(tests=(OPEN,)).verdict == "not resolved"
    # a measurement below the claim's scale can neither contradict nor confirm it: a verdict at this scale
    assert claim(tests=(DOWN,), scope="1.3B-parameter models").verdict == "fails at this scale"
    assert claim(tests=(UP,), scope="1.3B-parameter models").verdict == "holds at this scale"
    assert claim(tests=(OPEN,), scope="1.3B-parameter models").verdict == "not resolved"  # straddles: no verdict
    assert claim(tests=(UP, DOWN), scope="1.3B-parameter models").verdict == "fails at this scale"  # rule 2 first
    assert claim(tests=(UP,), scope="1.3B-parameter models", finding=True).verdict == "finding"
    # a printed formula that is wrong while the conclusion holds
    assert claim(tests=(UP,), errata=(Test("printed - exact", 3.9, "<", 1e-9),)).verdict == "erratum"
    assert claim(tests=(DOWN,), errata=(Test("printed - exact", 3.9, "<", 1e-9),)).verdict == "contradicted"
    assert claim(tests=(UP,), errata=(Test("printed - exact", 1e-15, "<", 1e-9),)).verdict == "holds"
    # readings that disagree make the row ambiguous; readings that agree give their common verdict
    two = (Reading("ratio rises", (UP,)), Reading("ratio falls", (DOWN,)))
    assert claim(readings=two).verdict == "ambiguous"
    assert claim(readings=(Reading("a", (UP,)), Reading("b", (UP,)))).verdict == "holds"
    # a reading the measurement cannot decide leaves the row unresolved, not ambiguous
    assert claim(readings=(Reading("a", (UP,)), Reading("b", (OPEN,)))).verdict == "not resolved"
    # a finding is reported as one only when its test passes
    assert claim(tests=(UP,), finding=True).verdict == "finding"
    assert claim(tests=(OPEN,), finding=True).verdict == "not resolved"


def test_a_claim_needs_a_known_paper_and_a_test():
    with pytest.raises(ValueError, match="paper"):
        claim(paper="seed004", tests=(UP,))
    with pytest.raises(ValueError, match="needs tests"):
        claim()
    with pytest.raises(ValueError, match="two readings"):
        claim(readings=(Reading("a", (UP,)),))


def test_json_row_carries_paper_verdict_and_every_test():
    c = claim(tests=(UP,), readings=(Reading("a", (UP,)), Reading("b", (DOWN,))), command="poslens simulate")
    row = json.loads(json.dumps(c.to_json("S")))
    assert row["paper"] == "kim2025" and row["verdict"] == "ambiguous" and row["section"] == "S"
    assert [t["role"] for t in row["test"]] == ["claim", "reading 1", "reading 2"]
    both = claim(readings=(Reading("a", (UP,)), Reading("a and b", (UP, DOWN))))
    assert [role for role, _ in both.all_tests()] == ["readings 1, 2", "reading 2"]  # a shared test listed once
    assert {"statistic", "value", "lo", "hi", "side", "threshold", "outcome", "interval"} <= set(row["test"][0])
    assert [r["verdict"] for r in row["readings"]] == ["holds", "contradicted"]
    assert row["key"] == "0.5 [0.2, 0.8]; -0.5 [-0.8, -0.2]"  # ambiguous: each reading's deciding test


def test_ledgers_count_each_paper_apart():
    rows = [claim(tests=(UP,)), claim(tests=(OPEN,)), claim(paper="haviv2022", tests=(UP,)),
            claim(paper="kazemnejad2023", tests=(DOWN,), scope="large models"), claim(paper="poslens", tests=(UP,))]
    led = ledgers(rows)
    assert list(led) == ["kim2025", "other", "poslens"]
    assert led["kim2025"].headline() == "Kim et al. (2025): 2 claims: 1 holds, 1 not resolved"
    assert led["other"].counts["holds"] == 1 and led["other"].counts["fails at this scale"] == 1
    assert led["other"].counts["not resolved"] == 0  # a failure at this scale is counted apart from not resolved


def test_ledgers_count_rows_at_this_scale_and_rows_on_trained_models_apart():
    """A scoped failure and a scoped pass are their own verdicts and counts, apart from the open rows; given the
    rows on trained models, the headline counts them apart from the rows on exact or simulated quantities."""
    scoped = {"scope": "1.5B models"}
    rows = [claim(id="e1", tests=(UP,)), claim(id="e2", tests=(DOWN,)),
            claim(id="m1", tests=(DOWN,), **scoped), claim(id="m2", tests=(DOWN,), **scoped),
            claim(id="m3", tests=(UP,), **scoped), claim(id="m4", tests=(OPEN,), **scoped)]
    led = ledgers(rows, on_models={"m1", "m2", "m3", "m4"})["kim2025"]
    assert led.headline() == ("Kim et al. (2025): 6 claims; on exact or simulated quantities 2: 1 holds, "
                              "1 contradicted; on trained models 4: 1 holds at this scale, 2 fail at this scale, "
                              "1 not resolved")
    assert led.counts["fails at this scale"] == 2 and led.counts["not resolved"] == 1
    assert led.by_basis["models"]["holds at this scale"] == 1 and led.by_basis["exact"]["contradicted"] == 1
    assert ledgers(rows, on_models=set())["kim2025"].headline() == (  # one basis: said once
        "Kim et al. (2025): 6 claims, on exact or simulated quantities: 1 holds, 1 holds at this scale, 1 "
        "contradicted, 2 fail at this scale, 1 not resolved")


def test_a_scoped_claim_is_decided_at_this_scale_and_says_what_that_covers():
    """A claim about a larger scale whose test fails here reads fails at this scale, with a line that says only a
    measurement at the claim's scale decides the claim itself, and no resolve line (more data would only narrow the
    failure). A test that is open with its estimate on the failing side can still resolve either way: the row's own
    line stands, with what a failure would read; without a scope, or on the passing side, the row's own resolve
    line stands alone. An undefined statistic at a scope: only the claim's scale decides it."""
    failed = Test("slope", -0.2, ">", 0.0, -0.5, -0.1, "t")
    against = Test("slope", -0.2, ">", 0.0, -0.5, 0.1, "t")
    toward = Test("slope", 0.2, ">", 0.0, -0.1, 0.5, "t")
    scoped = Claim("x", "kim2025", "S", "c", (failed,), scope="1.5B models (this pair: 0.6M tokens)",
                   resolve="about 7 seeds")
    assert scoped.verdict == "fails at this scale" and scoped.resolve_line() == ""
    assert scoped.scale_line().startswith("the pattern fails at this scale") and "1.5B models," in \
        scoped.scale_line() and "0.6M" not in scoped.scale_line()
    assert scoped.key_number() == failed.key()
    leaning = Claim("w", "kim2025", "S", "c", (against,), scope="1.5B models", resolve="about 7 seeds").resolve_line()
    assert leaning.startswith("about 7 seeds; its estimate lies on the failing side") and "fail at this scale" in \
        leaning and leaning.endswith("(1.5B models)")
    assert Claim("y", "kim2025", "S", "c", (toward,), scope="1.5B models", resolve="about 7 seeds").resolve_line() \
        == "about 7 seeds"
    assert Claim("z", "kim2025", "S", "c", (against,), resolve="about 7 seeds").resolve_line() == "about 7 seeds"
    assert Claim("h", "kim2025", "S", "c", (Test("x", 1.0, ">"),), resolve="r").resolve_line() == ""  # holds
    assert Claim("h", "kim2025", "S", "c", (Test("x", 1.0, ">"),)).scale_line() == ""  # no scope: no line
    undefined = Claim("u", "kim2025", "S", "c", (Test("x", math.nan, ">", 0.0, math.nan, math.nan),), scope="1.5B")
    assert undefined.verdict == "not resolved" and "undefined on these models" in undefined.resolve_line()


def test_a_margin_lets_a_test_of_a_quantity_that_cannot_cross_its_threshold_fail():
    """A mean square tested against 0 cannot fail (its interval is cut at 0); with a margin (the size below which it
    is negligible) it fails when its whole interval lies below the margin, passes when above 0, else is open."""
    present = Test("power", 0.05, ">", 0.0, 0.02, 0.08, "j", margin=0.001)
    negligible = Test("power", 0.0002, ">", 0.0, 0.0, 0.0006, "j", margin=0.001)
    unclear = Test("power", 0.001, ">", 0.0, 0.0, 0.004, "j", margin=0.001)
    assert (present.outcome(), negligible.outcome(), unclear.outcome()) == ("pass", "fail", "open")
    assert Test("power", 0.0002, ">", 0.0, 0.0, 0.0006, "j").outcome() == "open"  # without a margin: never fails
    assert "fails below 0.001, negligible" in negligible.text() and negligible.to_json()["margin"] == 0.001
    assert Test("x", -0.5, "<", 0.0, -0.9, -0.1, margin=-0.01).outcome() == "pass"  # the mirror image
    with pytest.raises(ValueError, match="margin"):
        Test("x", 1.0, ">", 0.0, 0.5, 1.5, margin=-0.1)  # a margin on the claim's side makes no sense


def test_the_summary_number_of_an_undecided_row_is_its_failing_test_before_an_open_one():
    """A row with an open test first and a failing test second is decided by the failure: the summary quotes it."""
    open_ = Test("open one", -0.003, ">", 0.0, -0.17, 0.17, "95% t-interval over 3 seeds")
    failing = Test("failing one", -0.038, ">", 0.0, -0.058, -0.018, "95% t-interval over 3 seeds")
    row = Claim("x-row", "ruscio2026", "summary", "claim", (open_, failing), scope="larger models")
    assert row.verdict == "fails at this scale" and row.key_number() == failing.key()
    assert Claim("y-row", "ruscio2026", "summary", "claim", (open_,)).key_number() == open_.key()


def test_readings_of_opposite_sides_are_ambiguous_whatever_the_scope():
    """Rule 5: two readings that predict opposite sides of one statistic cannot both hold; once the statistic is
    resolved the failing one is a contradiction between the paper's wordings, so the scope (rule 4) is not applied:
    the readings read holds and contradicted. Without `opposite` the same scoped readings read holds and fails
    at this scale, still ambiguous; one decided reading and one open one leave the row not resolved; an open
    statistic leaves the row not resolved either way."""
    below = Test("slope", 0.5, "<", 0.0, 0.2, 0.8)  # the same statistic as UP, the other side
    readings = (Reading("rises", (UP,)), Reading("falls", (below,)))
    assert claim(readings=readings, scope="1.5B", opposite=True).verdict == "ambiguous"
    assert claim(readings=readings, scope="1.5B", opposite=True).reading_verdicts() == ["holds", "contradicted"]
    assert claim(readings=readings, scope="1.5B").verdict == "ambiguous"
    assert claim(readings=readings, scope="1.5B").reading_verdicts() == ["holds at this scale", "fails at this scale"]
    assert claim(readings=(Reading("rises", (DOWN,)), Reading("also", (OPEN,))), scope="1.5B").verdict == \
        "not resolved"
    open_below = Test("slope", 0.1, "<", 0.0, -0.2, 0.4)
    assert claim(readings=(Reading("rises", (OPEN,)), Reading("falls", (open_below,))), scope="1.5B",
                 opposite=True).verdict == "not resolved"
    assert json.loads(json.dumps(claim(readings=readings, opposite=True).to_json()))["opposite"] is True


def test_the_summary_key_names_its_statistic_and_threshold():
    """The summary line of a row quotes the test that decides its verdict: statistic, value [interval] and what the
    claim needs; a row's own key keeps its words and still names the statistic and threshold."""
    open_ = Test("ratio", 0.9, ">", 1.0, 0.5, 1.3, "95% jackknife")
    assert claim(tests=(UP,)).key_line() == "slope = 0.5 [0.2, 0.8], needs > 0"
    # contradicted: the failing test decides, and the line says it is one of two
    assert claim(tests=(UP, DOWN)).key_line() == "slope = -0.5 [-0.8, -0.2], needs > 0 (1 of 2 tests)"
    assert claim(tests=(UP, open_)).key_line() == "ratio = 0.9 [0.5, 1.3], needs > 1 (1 of 2 tests)"
    assert claim(tests=(UP,), key="0.5-fold").key_line() == "0.5-fold; slope, needs > 0"
    both = claim(tests=(), readings=(Reading("a", (UP,)), Reading("b", (DOWN,))))
    assert both.verdict == "ambiguous" and both.key_line() == ("slope = 0.5 [0.2, 0.8], needs > 0; "
                                                              "slope = -0.5 [-0.8, -0.2], needs > 0")
