"""The claim ledger: what a paper says, the test poslens ran on it, and the verdict one written rule gives.

A `Claim` is one row of the report. Its `tests` say what was computed and how it was decided: a statistic, its
value (with an interval when it is an average), a threshold and the side of it the claim predicts. A verdict is
never typed by hand: `Claim.verdict` applies the rule below to the tests, so a reader sees that every row could
have failed.

The rule (quoted on the first screen of every report, `poslens.report.render.verdict_rule`; explained in
docs/reproduce.md, "What `poslens reproduce` writes"):

1. A `Test` passes when its value (its whole interval, when it has one) lies on the claim's side of the threshold,
   fails when it lies on the other side, and is open otherwise (the interval straddles the threshold, or the
   value or interval is undefined). An exact computation (no interval) passes or fails. A test of a quantity that
   cannot cross its threshold (a mean square tested against 0) carries a `margin`, the size below which the effect
   is negligible: it fails when its whole interval lies on the far side of the margin, so it too can fail.
2. A claim's tests are a conjunction: it passes when all pass, fails when any fails, else it is open.
3. **holds** = passes; **contradicted** = fails; **not resolved** = open (`resolve` says what would decide it,
   only where something could).
4. `scope`: a claim about a larger scale than the measurement (e.g. "1.3B-parameter models") can be neither
   contradicted nor confirmed by it: a pass there is **holds at this scale**, a failure **fails at this scale** (a
   verdict of its own, counted apart from not resolved, where the interval straddles the threshold).
5. **ambiguous**: the paper's wording admits several readings (`readings`, each with its own tests). When the
   readings are decided differently (one holds and another is contradicted; at a scope, one holds at this scale
   and another fails at this scale), the row says each one and its verdict is ambiguous; otherwise an unresolved
   reading makes the row not resolved, and readings that agree give their common verdict. Readings that predict
   opposite sides of one and the same statistic (`opposite`) cannot both hold at any scale: once the statistic is
   resolved one of them fails, a contradiction between the paper's own wordings, so rule 4 is not applied to them
   (they read holds and contradicted; which reading holds is still a statement at this scale).
6. **erratum**: `errata` test a formula or number the paper prints; when one fails while the claim's own tests
   pass (the conclusion stands), the verdict is erratum.
7. **finding**: a measured fact the paper does not state (`finding=True`) reads finding when its tests pass, and
   follows rule 3 otherwise.

Each claim belongs to one paper (`PAPERS`); the report counts every paper's ledger apart. Facts that are true by
construction are tests of poslens (tests/), not claims; measured facts shown beside the claims without a verdict
are a section's `context`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

VERDICTS = ("holds", "holds at this scale", "contradicted", "fails at this scale", "ambiguous", "erratum",
            "not resolved", "finding")
AT_SCALE = {"pass": "holds at this scale", "fail": "fails at this scale"}  # rule 4
SIDES = (">", "<")


@dataclass(frozen=True)
class Paper:
    """A paper a ledger is about: how the report names it (authors, year, title)."""

    authors: str
    year: int
    title: str
    ledger: str  # the ledger its claims are counted in

    @property
    def cite(self) -> str:
        """'Kim et al. (2025), "Behind RoPE: ..."'."""
        return f"{self.authors} ({self.year}), \u201c{self.title}\u201d"


PAPERS: dict[str, Paper] = {
    "kim2025": Paper("Kim et al.", 2025, "Behind RoPE: How Does Causal Mask Encode Positional Information?", "kim2025"),
    "ruscio2026": Paper("Ruscio, Nanni & Silvestri", 2026,
                        "Where does Absolute Position come from in decoder-only Transformers?", "ruscio2026"),
    "haviv2022": Paper("Haviv et al.", 2022, "Transformer Language Models without Positional Encodings Still Learn "
                       "Positional Information", "other"),
    "kazemnejad2023": Paper("Kazemnejad et al.", 2023, "The Impact of Positional Encoding on Length Generalization "
                            "in Transformers", "other"),
    "poslens": Paper("poslens", 2026, "checks of poslens itself", "poslens"),
}
LEDGERS = {"kim2025": "Kim et al. (2025)", "ruscio2026": "Ruscio, Nanni & Silvestri (2026)",
           "other": "other papers (Haviv et al. 2022, Kazemnejad et al. 2023)",
           "poslens": "poslens's own checks and questions (the software's checks; the questions past the training "
                      "length)"}


def num(x: float | None, digits: int = 3) -> str:
    """A number for a row: `digits` significant digits; NaN and None (run.json's null) read 'undefined'."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "undefined"
    return f"{x:.{digits}g}"


def _defined(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


@dataclass(frozen=True)
class Test:
    """One check: `statistic` = `value` [`lo`, `hi`] against `threshold`; the claim predicts `side` ('>' or '<').

    `interval` says how lo/hi were made ("95% jackknife over 20 groups"); leave lo/hi None for an exact value
    (a closed form, a count, a float64 computation): it then passes or fails, never open."""

    __test__ = False  # not a pytest test class
    statistic: str
    value: float
    side: str
    threshold: float = 0.0
    lo: float | None = None
    hi: float | None = None
    interval: str = ""
    digits: int = 3
    margin: float | None = None  # fails when the interval lies wholly past it (the effect shown negligible)
    floor: float | None = None  # the part of the half-width more seeds cannot shrink (text every seed read)

    def __post_init__(self) -> None:
        if self.side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {self.side!r}")
        if (self.lo is None) != (self.hi is None):
            raise ValueError("give both lo and hi, or neither")
        if self.margin is not None and (self.margin - self.threshold) * (1 if self.side == ">" else -1) <= 0:
            raise ValueError("a margin lies on the claim's side of the threshold")

    @property
    def exact(self) -> bool:
        return self.lo is None

    def outcome(self) -> str:
        """'pass', 'fail' or 'open' (rule 1)."""
        t = self.threshold
        if self.exact:
            if not _defined(self.value):
                return "open"
            ok = self.value > t if self.side == ">" else self.value < t
            return "pass" if ok else "fail"
        if not (_defined(self.lo) and _defined(self.hi)):
            return "open"
        far = t if self.margin is None else self.margin  # where the failing side begins
        if self.side == ">":
            return "pass" if self.lo > t else "fail" if self.hi < far else "open"
        return "pass" if self.hi < t else "fail" if self.lo > far else "open"

    def against(self) -> bool:
        """The estimate lies on the failing side of the threshold (or on it): more data would sooner show a failure
        than a pass."""
        if not _defined(self.value):
            return False
        return self.value <= self.threshold if self.side == ">" else self.value >= self.threshold

    def key(self) -> str:
        """The number a summary line quotes: '0.0186 [0.0099, 0.0274]', '3' (exact) or '0.2 (no interval)' (too
        few groups or seeds for one: the test stays open)."""
        d = self.digits
        if self.exact or not _defined(self.value):
            return num(self.value, d)
        if not (_defined(self.lo) and _defined(self.hi)):
            return f"{num(self.value, d)} (no interval)"
        return f"{num(self.value, d)} [{num(self.lo, d)}, {num(self.hi, d)}]"

    def text(self) -> str:
        """'mean row slope = 0.0186 [0.0099, 0.0274] (95% jackknife ...); the claim needs > 0: pass'."""
        how = f" ({self.interval})" if self.interval else "" if not self.exact else " (exact)"
        return f"{self.statistic} = {self.key()}{how}; the claim needs {self.needs()}: {self.outcome()}"

    def needs(self) -> str:
        """'> 0', or with a margin '> 0 and fails below 0.00256, negligible'."""
        fails = "" if self.margin is None else (
            f" and fails {'below' if self.side == '>' else 'above'} {num(self.margin, 3)}, negligible")
        return f"{self.side} {num(self.threshold, 4)}{fails}"

    def to_json(self) -> dict:
        return {"statistic": self.statistic, "value": self.value, "lo": self.lo, "hi": self.hi,
                "interval": self.interval or ("exact" if self.exact else ""), "side": self.side,
                "threshold": self.threshold, "margin": self.margin, "outcome": self.outcome()}


def interval_of(e: dict) -> str:
    """How a run.json estimate's interval was made: '95% jackknife over 20 groups' (an estimate over groups of
    sequences: "groups", "method") or '95% t-interval over 3 seeds' (`poslens.train.sweep.seed_interval`: "n")."""
    level = f"{100 * e.get('level', 0.95):g}%"
    if e.get("method") == "t over seeds":
        return f"{level} t-interval over {e['n']} seeds" + (
            ", with the held-out text's own interval (the same text for every seed) added" if "shared" in e else "")
    return f"{level} {e.get('method', 'jackknife')} over {e.get('groups')} groups"


def estimate_test(statistic: str, e: dict, side: str, threshold: float = 0.0, interval: str = "") -> Test:
    """A Test on a run.json estimate {"value", "lo", "hi", ...}: a null value or bound (too few groups or seeds for
    an interval) leaves the test open, never exact. `interval` defaults to `interval_of(e)`."""
    lo, hi = (math.nan if e.get(k) is None else e[k] for k in ("lo", "hi"))
    return Test(statistic, math.nan if e["value"] is None else e["value"], side, threshold, lo, hi,
                interval or interval_of(e), floor=e.get("shared"))


def interval_text(e: dict, digits: int = 3) -> str:
    """'value [lo, hi]' of a run.json estimate; 'value (no interval)' without bounds; 'undefined' without a value."""
    if not _defined(e["value"]):
        return "undefined"
    if not (_defined(e.get("lo")) and _defined(e.get("hi"))):
        return f"{num(e['value'], digits)} (no interval)"
    return f"{num(e['value'], digits)} [{num(e['lo'], digits)}, {num(e['hi'], digits)}]"


def combine(tests: tuple[Test, ...]) -> str:
    """Rule 2: 'pass' when every test passes, 'fail' when any fails, else 'open'."""
    outcomes = [t.outcome() for t in tests]
    if "fail" in outcomes:
        return "fail"
    return "pass" if outcomes and all(o == "pass" for o in outcomes) else "open"


@dataclass(frozen=True)
class Reading:
    """One reading of ambiguous wording: what it takes the paper to say, and the tests of that reading."""

    text: str
    tests: tuple[Test, ...]


_BY_OUTCOME = {"pass": "holds", "fail": "contradicted", "open": "not resolved"}


@dataclass
class Claim:
    """One row: a claim of `paper` at `where`, the tests that decide it, and how to re-measure it.

    id: a stable anchor, unique within a report ("kim-s3-layer2-increasing"). measured: words on what was measured
    beyond the tests (settings, caveats). paper_number: the number the paper prints, shown beside ours. key: the
    number of the summary line (default: the first test's). figure: the figure that shows it. command: a command
    that re-measures the row and prints its key number. resolve: what would decide a not-resolved row. robustness:
    for a row on the models trained here, whether its verdict stays with the models trained on other CPU kernels
    (`poslens.report.robustness`)."""

    id: str
    paper: str
    where: str
    claim: str
    tests: tuple[Test, ...] = ()
    measured: str = ""
    paper_number: str = ""
    readings: tuple[Reading, ...] = ()
    errata: tuple[Test, ...] = ()
    scope: str = ""
    finding: bool = False
    opposite: bool = False  # rule 5: the readings predict opposite sides of one statistic (rule 4 not applied to them)
    resolve: str = ""
    figure: str = ""
    command: str = ""
    key: str = ""
    robustness: str = ""  # whether the verdict stays with the models trained on other CPU kernels (report.robustness)

    def __post_init__(self) -> None:
        if self.paper not in PAPERS:
            raise ValueError(f"paper must be one of {tuple(PAPERS)}, got {self.paper!r}")
        self.tests = tuple(self.tests)
        self.readings = tuple(self.readings)
        self.errata = tuple(self.errata)
        if not self.tests and not self.readings:
            raise ValueError(f"claim {self.id}: a claim needs tests (or readings, each with tests)")
        if self.readings and len(self.readings) < 2:
            raise ValueError(f"claim {self.id}: ambiguous wording needs at least two readings")

    @staticmethod
    def _verdict(outcome: str, scope: str, finding: bool) -> str:
        if outcome == "pass" and finding:
            return "finding"  # rule 7
        if scope and outcome in AT_SCALE:
            return AT_SCALE[outcome]  # rule 4
        return _BY_OUTCOME[outcome]

    def reading_verdicts(self) -> list[str]:
        scope = "" if self.opposite else self.scope
        return [self._verdict(combine(r.tests), scope, self.finding) for r in self.readings]

    @property
    def verdict(self) -> str:
        """The verdict the rule (module docstring) gives."""
        if self.readings:
            vs = set(self.reading_verdicts())
            if len(vs) > 1:
                decided = vs - {"not resolved"}
                return "ambiguous" if len(decided) > 1 else "not resolved"  # rule 5
            if not self.tests:
                return vs.pop()
        outcome = combine(self.tests)
        if self.errata and outcome == "pass" and combine(self.errata) == "fail":
            return "erratum"  # rule 6
        return self._verdict(outcome, self.scope, self.finding)

    def all_tests(self) -> list[tuple[str, Test]]:
        """(role, test) for every test the verdict used, each once: 'claim', 'printed', 'reading N' (a test that
        several readings share: 'readings 1, 2')."""
        out = [("claim", t) for t in self.tests] + [("printed", t) for t in self.errata]
        shared: dict[Test, list[int]] = {}
        for k, r in enumerate(self.readings, 1):
            for t in r.tests:
                shared.setdefault(t, []).append(k)
        out += [(f"reading{'s' if len(ks) > 1 else ''} {', '.join(map(str, ks))}", t) for t, ks in shared.items()]
        return out

    def resolve_line(self) -> str:
        """What would resolve a not-resolved row. A claim about a larger scale (`scope`) whose statistic is undefined
        on these models cannot be resolved here: only a measurement at the claim's own scale would decide it. A scoped
        test that is open with its estimate on the failing side could still resolve either way: the row's own line
        stands, with what a resolution on the failing side would read (fails at this scale). A row decided at this
        scale (holds or fails at this scale) has no line: `scale_line` says what its verdict covers."""
        if self.verdict != "not resolved":
            return ""
        tests = [t for _, t in self.all_tests()]
        undefined = [t for t in tests if not _defined(t.value)]
        one = len(tests) == 1
        if self.scope and undefined:
            what = ("its statistic is" if one else
                    f"the statistic of {len(undefined)} of its {len(tests)} tests is")
            return (f"not more data at this scale: {what} undefined on these models; only a measurement at the "
                    f"claim's own scale would decide it ({self.claim_scale})")
        leaning = [t for t in tests if t.outcome() == "open" and t.against()]
        if self.scope and leaning:
            lean = ("its estimate lies" if one else f"the estimate{'' if len(leaning) == 1 else 's'} of "
                    f"{len(leaning)} of its {len(tests)} tests lie{'s' if len(leaning) == 1 else ''}")
            first = f"{self.resolve}; " if self.resolve else ""
            return (f"{first}{lean} on the failing side, so if the estimates stayed where they are, that much more "
                    f"data would make the row fail at this scale; only a measurement at the claim's own scale could "
                    f"contradict it ({self.claim_scale})")
        return self.resolve

    def scale_line(self) -> str:
        """What a verdict at this scale (rule 4) covers: '' for any other verdict."""
        if self.verdict not in AT_SCALE.values():
            return ""
        seen = "is seen" if self.verdict == "holds at this scale" else "fails"
        return (f"the pattern {seen} at this scale; the claim is about {self.claim_scale}, and only a measurement at "
                "that scale would confirm or contradict it")

    @property
    def claim_scale(self) -> str:
        """The scale the claim is about: the scope without what it adds about this measurement ('(this ...)')."""
        return re.split(r" \((?:this|these)\b", self.scope, maxsplit=1)[0]

    def key_tests(self) -> list[Test]:
        """The tests the summary quotes (the tests that decide the verdict): for an ambiguous row, each reading's
        first failing test (else its first); for a row not decided in its favour, the first failing test, else the
        first open one; else the first test."""
        if self.readings and self.verdict == "ambiguous":  # each reading's deciding test: its first failing one
            picked = [next((t for t in r.tests if t.outcome() == "fail"), r.tests[0]) for r in self.readings]
            return list(dict.fromkeys(picked))
        undecided = sorted((t for t in self.tests if t.outcome() != "pass"), key=lambda t: t.outcome() != "fail")
        if self.verdict in ("not resolved", "contradicted", "fails at this scale") and undecided:
            return [undecided[0]]
        first = self.tests or self.readings[0].tests
        return [first[0]]

    def key_number(self) -> str:
        """The row's number for the summary: its own `key`, else the value [interval] of each of `key_tests`."""
        if self.key:
            return self.key
        return "; ".join(dict.fromkeys(t.key() for t in self.key_tests()))

    def key_line(self) -> str:
        """The summary's key number with the statistic it is and the threshold the rule compares it with:
        'mean row slope = 0.0186 [0.0099, 0.0274], needs > 0' (a row's own `key`: 'KEY; mean row slope, needs > 0');
        '(1 of 5 tests)' when the row has more tests than the one quoted."""
        tests = self.key_tests()
        n = len(self.all_tests())
        if self.key:
            line = f"{self.key}; " + "; ".join(f"{t.statistic}, needs {t.needs()}" for t in tests)
        else:
            line = "; ".join(f"{t.statistic} = {t.key()}, needs {t.needs()}" for t in tests)
        return line + (f" ({len(tests)} of {n} tests)" if n > len(tests) else "")

    @property
    def ledger(self) -> str:
        return PAPERS[self.paper].ledger

    def to_json(self, section: str = "") -> dict:
        """The row for run.json: `paper`, `verdict` and `test` (every test, with its role) among the rest."""
        return {"id": self.id, "section": section, "paper": self.paper, "where": self.where, "claim": self.claim,
                "verdict": self.verdict, "key": self.key_number(),
                "test": [{"role": role, **t.to_json()} for role, t in self.all_tests()],
                "readings": [{"text": r.text, "verdict": v} for r, v in zip(self.readings, self.reading_verdicts())],
                "measured": self.measured, "paper_number": self.paper_number, "scope": self.scope,
                "finding": self.finding, "opposite": self.opposite,
                "resolve": self.resolve_line(), "figure": self.figure, "command": self.command,
                "robustness": self.robustness}


BASES = {"exact": "on exact or simulated quantities", "models": "on trained models"}


def _counted(counts: dict[str, int]) -> str:
    """'19 hold, 2 errata, 4 not resolved' (zero counts left out)."""
    words = {"holds": ("holds", "hold"), "holds at this scale": ("holds at this scale", "hold at this scale"),
             "fails at this scale": ("fails at this scale", "fail at this scale"), "erratum": ("erratum", "errata"),
             "finding": ("finding", "findings")}
    parts = []
    for v, n in counts.items():
        if n:
            one, many = words.get(v, (v, v))
            parts.append(f"{n} {one if n == 1 else many}")
    return ", ".join(parts)


@dataclass
class LedgerCount:
    """How many claims of one ledger got each verdict, in all and by basis (`BASES`: rows decided on exact or
    simulated quantities, rows on trained models)."""

    name: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(VERDICTS, 0))
    by_basis: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, verdict: str, basis: str | None = None) -> None:
        self.counts[verdict] += 1
        if basis is not None:
            self.by_basis.setdefault(basis, dict.fromkeys(VERDICTS, 0))[verdict] += 1

    def headline(self) -> str:
        """'Kim et al. (2025): 38 claims: 30 hold, 1 ambiguous, 2 errata, 5 not resolved' (zero counts left out);
        with bases, each apart: '...: 41 claims; on exact or simulated quantities 20: 19 hold, 1 erratum; on
        trained models 21: 4 hold at this scale, ...' ('..., on trained models: ...' when all are on one)."""
        head = f"{LEDGERS[self.name]}: {self.total} {'claim' if self.total == 1 else 'claims'}"
        if not self.by_basis:
            return head + (": " + _counted(self.counts) if self.total else "")
        parts = [(b, c) for b in BASES if (c := self.by_basis.get(b)) and sum(c.values())]
        if len(parts) == 1:  # all on one basis: 'Kim et al. (2025): 3 claims, on trained models: 3 hold'
            return f"{head}, {BASES[parts[0][0]]}: {_counted(parts[0][1])}"
        return head + "".join(f"; {BASES[b]} {sum(c.values())}: {_counted(c)}" for b, c in parts)


def ledgers(claims: list[Claim], on_models: set[str] | None = None) -> dict[str, LedgerCount]:
    """Verdict counts per ledger (kim2025, ruscio2026, other, poslens), in that order, empty ledgers left out.
    `on_models`: the ids of the rows measured on trained models (the rest are on exact or simulated quantities);
    given, each ledger also counts the two apart."""
    out = {name: LedgerCount(name) for name in LEDGERS}
    for c in claims:
        basis = None if on_models is None else "models" if c.id in on_models else "exact"
        out[c.ledger].add(c.verdict, basis)
    return {k: v for k, v in out.items() if v.total}
