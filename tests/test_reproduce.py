"""`poslens reproduce` on small settings: every figure, a ledger of claims with their tests, every row's command
re-measuring its number, resumable, nothing half-written, bad input refused before any work."""

import json
import os
import re
import shlex

import pytest
from test_report import check_report_images

from poslens import cli
from poslens.errors import UsageError
from poslens.report import context, remeasure
from poslens.report import reproduce as rep
from poslens.report.claims import PAPERS, VERDICTS

TINY_SWEEP = "steps=6+warmup=2+layers=2+seq_len=32+eval_every=3+save_every=0"  # one sweep for 4.2, leakage, length
SIZES = {"convergence": {"widths": (16, 256), "samples": 200},
         "real-model": {"seq_len": 16, "sequences": 4, "batch": 1, "groups": 2},
         "trained": {"sweep_train": TINY_SWEEP, "sweep_seeds": [0, 1], "fig3": (40, 20), "loss": 16, "probe": (8, 8)},
         "leakage": {"sequences": 4, "seq_len": 16, "groups": 2, "predecessor": False, "sweep_train": TINY_SWEEP,
                     "sweep_seeds": [0, 1], "sweep_sequences": 4, "sweep_groups": 2},
         "length": {"sweep_train": TINY_SWEEP, "sweep_seeds": [0, 1], "sequences": 4, "groups": 2,
                    "variants": ["nope", "rope"]},
         "card": {"seq_len": 16, "sequences": 8, "batch": 2, "groups": 4, "early_queries": 8, "length_train_len": 8,
                  "length_sequences": 2, "length_batch": 1, "length_groups": 2}}
SAMPLES = 400


@pytest.fixture(scope="module")
def report(tmp_path_factory, smollm2):
    out = tmp_path_factory.mktemp("reproduce") / "report"
    rep.reproduce(out=str(out), quick=True, progress=False, samples=SAMPLES, sizes=SIZES, pdf=False)  # the PDFs:
    # test_interrupted_reproduce_resumes_from_parts
    return out


@pytest.mark.slow
def test_reproduce_writes_every_figure_and_a_ledger(report, monkeypatch, capsys):
    figs = {p.stem for p in (report / "figures").iterdir() if p.suffix in (".png", ".jpg")}
    assert not list((report / "figures").glob("*.pdf")) and "[PDF]" not in (report / "report.md").read_text()
    for stem in ("figure1", "figure2", "figure2_profiles", "figure3", "figure3_profiles", "figure4", "figure5",
                 "figure6", "figure7", "figure8", "figure9", "figure10", "convergence", "appendix_a1_h",
                 "layer2_profiles", "model_pattern_power", "model_key_profile", "model_rope_normalised",
                 "training_curves", "position_probe", "leakage_sources", "leakage_score_offset",
                 "leakage_architectures", "card_probe"):
        assert stem in figs, stem
    check_report_images(report)
    page = (report / "report.html").read_text()
    assert len(page) < 8_000_000
    # the first screen says it is a quick run and what that means, before the ledgers
    assert page.index("<b>Quick run.</b>") < page.index("class='ledgers'")
    assert "real-model sequences" in page and "(full 256)" in page and "appendix_a2_gprime" in figs
    meta = json.loads((report / "run.json").read_text())
    claims = meta["metrics"]["claims"]
    for c in claims:  # every row: a known paper, one of the six verdicts, the tests behind it, a command
        assert c["paper"] in PAPERS and c["verdict"] in VERDICTS and c["test"] and c["command"], c["id"]
        assert all({"statistic", "value", "side", "threshold", "outcome"} <= set(t) for t in c["test"])
        assert f"id='{c['id']}'" in page and f"href='#{c['id']}'" in page  # a row and its summary line
        assert "_" not in (c["figure"] or ""), c["id"]  # a figure named as its title says, not by its file's stem
        row = page[page.index(f"id='{c['id']}'"):]
        assert not c["figure"] or "figure: <a href='#fig-" in row[:row.index("</div>")], c["id"]  # ... and linked
    for caption in re.findall(r"<figcaption>(.*?)</figcaption>", page):  # the page says once how to read a map
        assert caption.lower().count("hover") <= 1, caption
    ledgers = meta["metrics"]["ledgers"]
    assert list(ledgers) == ["kim2025", "ruscio2026", "other", "poslens"]
    assert sum(sum(v.values()) for v in ledgers.values()) == len(claims)
    rows = {c["id"]: c for c in claims}
    # exact, sample-free rows are decided whatever the sample count
    assert rows["kim-s3-layer2-increasing"]["verdict"] == "holds"
    assert rows["kim-a1-h-decreasing"]["verdict"] == "erratum"  # the printed polynomial is wrong, h decreases
    assert rows["kim-41-dips-infinite-width"]["verdict"] == "finding"
    # Figure 3's rows are claims about the paper's 1.5B model: a tiny trained pair cannot contradict them (the rule's
    # scope); the W_O row's two readings predict opposite sides of one statistic (rule 5: scoped, and the failing
    # reading stays contradicted, a contradiction between the paper's wordings)
    fig3 = [c for c in claims if c["id"].startswith("kim-42-") and c["id"] != "kim-42-c-to-d"]
    assert len(fig3) >= 9 and all("1.5B" in c["scope"] and c["verdict"] != "contradicted" for c in fig3)
    assert "1.5B" in rows["kim-42-c-to-d"]["scope"] and rows["kim-42-c-to-d"]["opposite"]
    # Section 4.2 is judged over the sweep's seeds (the spread over seeds is a training effect's error bar)
    assert all("t-interval over 2 seeds" in t["interval"] for c in fig3 for t in c["test"])
    # Ruscio et al.'s rows on causal terms and on the tiny sweep (both seeds of each variant): built, decided
    for rid, n in (("ruscio-both-sources", 6), ("ruscio-bos-replacement", 4), ("ruscio-architectures", 4),
                   ("ruscio-sources-every-architecture", 9)):  # the offset null's paired tests among them
        assert rows[rid]["paper"] == "ruscio2026" and len(rows[rid]["test"]) == n, rid
    assert not any("split/" in t["statistic"] for r in rows.values() if r["paper"] == "ruscio2026" for t in r["test"])
    assert all("2 seeds" in t["interval"] for rid in ("ruscio-bos-replacement", "ruscio-architectures")
               for t in rows[rid]["test"])
    check_card(report, page, meta)
    for key in ("command", "source", "versions", "total time", "inputs"):
        assert meta["provenance"][key], key
    assert "trained now" in meta["provenance"]["inputs"] or "from the cache" in meta["provenance"]["inputs"]
    for word in ("seed 004", "seed-004", "/seeds/"):  # the papers are named by their authors and titles
        assert word not in page and word not in (report / "report.md").read_text()
    assert not any(p.name.startswith(".report") for p in report.parent.iterdir())  # parts removed
    # the same command again: nothing recomputed, the report is up to date
    monkeypatch.setattr(context, "simulate", lambda *a, **k: pytest.fail("recomputed"))
    capsys.readouterr()
    assert rep.reproduce(out=str(report), quick=True, progress=False, samples=SAMPLES, sizes=SIZES, pdf=False) == report
    assert "up to date" in capsys.readouterr().out
    with pytest.raises(UsageError, match="other settings.*--force"):
        rep.reproduce(out=str(report), quick=True, progress=False, samples=SAMPLES + 1, sizes=SIZES, pdf=False)


def check_card(report, page: str, meta: dict) -> None:
    """The card section: after the leakage section, its card's run directories and page in the report and linked,
    each panel's numbers those of the card's run.json (as its page prints them), each with the command that
    re-measures it, and the card's printed command asking for the very card measured."""
    from poslens.analyses.card.page import _iv
    from poslens.analyses.card.run import CardConfig
    from poslens.options import from_args

    assert page.index("id='sec-leakage'") < page.index("id='sec-card'") < page.index("id='sec-length'")
    card = report / "models" / "card"
    assert (card / "card" / "card.html").is_file() and (card / "card" / "card.md").is_file()
    for analysis in ("scores", "leakage", "probe", "length"):
        assert (card / "smollm2-135m" / analysis / "run.json").is_file(), analysis
    assert "<a href='models/card/card/card.html'>" in page
    run = json.loads((card / "card" / "run.json").read_text())
    (m,) = run["models"]  # the quick run: SmolLM2-135M alone
    rows = {r["what"].split(", smollm2-135m")[0]: r for r in meta["metrics"]["context"]["card"]}
    cache = f"POSLENS_CACHE={os.environ['POSLENS_CACHE']}"
    for head, analysis in (("Non-relative score pattern", "scores"), ("Absolute position in the residual", "probe"),
                           ("Held-out loss by position", "length"), ("Absolute-position terms", "leakage")):
        (what, measured), = [(r["what"], r["measured"]) for k, r in rows.items() if k.startswith(head)]
        assert f"`{cache} {m['commands'][analysis]}`" in what, head  # the command that re-measures the panel
        assert f"runs/card/smollm2-135m/{analysis}" in m["commands"][analysis]
        values = {"scores": [r["rms"] for r in m["scores"]] + [r["offset_share"]["key0_out"] for r in m["scores"]],
                  "probe": m["probe"], "length": [b["loss"] for b in m["length"]["bins"]],
                  "leakage": [x for k in ("key0_in", "key0_out") for x in m["leakage"]["attn/share_residual"][k]]}
        for v in values[analysis]:
            assert _iv(*v) in measured, (head, v)
    # the card command printed in the section's text asks for the card that was measured (the same sizes)
    text = (report / "report.md").read_text()
    argv = shlex.split(re.search(r"The card: `POSLENS_CACHE=\S+ (poslens card [^`]+)`", text).group(1))
    cfg = from_args(CardConfig, cli.build_parser().parse_args(argv[1:]))
    assert cfg.models == ["smollm2-135m"] and cfg.size_table() == run["config"]["sizes"]


@pytest.mark.slow
def test_every_row_command_remeasures_its_number(report, tmp_path, monkeypatch, capsys):
    """Each row's command, run as written (in-process: `poslens ...` through the CLI, `python -m
    poslens.report.remeasure ...` through its main), prints the row's key number: the sections are rebuilt from
    scratch with the report's settings (one build per section serves all its rows)."""
    monkeypatch.chdir(tmp_path)  # stock commands write runs/... where they are run
    claims = json.loads((report / "run.json").read_text())["metrics"]["claims"]
    by_command: dict[str, list] = {}
    for c in claims:
        by_command.setdefault(c["command"], []).append(c)
    capsys.readouterr()
    for command, rows in by_command.items():
        argv = shlex.split(command)
        # the command names the cache the report read its models from, so that it runs as printed in any shell
        assert argv[0] == f"POSLENS_CACHE={os.environ['POSLENS_CACHE']}", command
        monkeypatch.setenv("POSLENS_CACHE", argv.pop(0).split("=", 1)[1])
        if argv[:3] == ["python", "-m", "poslens.report.remeasure"]:
            assert remeasure.main(argv[3:]) == 0
        else:
            assert argv[0] == "poslens" and cli.main(argv[1:]) == 0, command
        out = capsys.readouterr().out
        for c in rows:
            assert c["key"] in out, (c["id"], c["key"], out[-800:])


def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys):
    """Issue 15: `reproduce --seed -1` left `.o.parts/`; every argument is checked before anything is written."""
    out = tmp_path / "o"
    for argv, flag in ((["--seed", "-1"], "--seed"), (["--samples", "0"], "--samples")):
        assert cli.main(["reproduce", *argv, "--out", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("poslens reproduce: error:") and flag in err and "\n" not in err
    with pytest.raises(UsageError, match="no report section named"):
        rep.reproduce(out=str(out), sizes={"no-such-section": {}})
    with pytest.raises(UsageError, match="has no size"):
        rep.reproduce(out=str(out), sizes={"real-model": {"tokens": 5}})
    assert list(tmp_path.iterdir()) == []  # no out, no .o.parts, no lock left


def test_interrupted_reproduce_resumes_from_parts(tmp_path, monkeypatch):
    out = tmp_path / "report"
    calls = {"n": 0}
    real = context.simulate
    per_setting = 2 * context.MC_GROUPS  # sub-runs of one Monte Carlo setting

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3 * per_setting + 1:  # in the fourth setting
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(context, "simulate", flaky)
    small = {"convergence": {"widths": (16, 64), "samples": 200}}
    with pytest.raises(KeyboardInterrupt):
        rep.reproduce(out=str(out), quick=True, models=False, progress=False, samples=200, sizes=small)
    assert not out.exists()
    assert len(list((tmp_path / ".report.parts").glob("mc-*.safetensors"))) == 3  # finished settings are kept
    calls["n"] = -10**6  # no more interruptions; count what is recomputed
    rep.reproduce(out=str(out), quick=True, models=False, progress=False, samples=200, sizes=small)
    assert (out / "report.html").exists()
    images = [p for p in (out / "figures").iterdir() if p.suffix in (".png", ".jpg")]
    assert images and all(p.with_suffix(".pdf").read_bytes().startswith(b"%PDF") for p in images)  # one beside each
    assert (out / "report.md").read_text().count("[PDF](") == len(images)
    settings = 9 + 3 + 2 * 2  # NoPE figures, RoPE figures, convergence (2 widths x 2 settings)
    assert calls["n"] + 10**6 == (settings - 3) * per_setting


def test_provenance_quotes_the_command_line_given(tmp_path, monkeypatch):
    """The report header quotes `poslens reproduce ...` as given to the CLI (not the arguments of whatever program
    called it, e.g. pytest's)."""
    seen = {}
    monkeypatch.setattr(rep, "reproduce", lambda **kw: seen.update(kw))
    argv = ["reproduce", "--quick", "--out", str(tmp_path / "o"), "--quiet"]
    assert cli.main(argv) == 0
    assert seen["command"] == shlex.join(["poslens", *argv]) and seen["pdf"] is True
    assert cli.main([*argv, "--no-pdf"]) == 0 and seen["pdf"] is False
    assert rep.provenance(None, 0)["command"] == "poslens.report.reproduce.reproduce(...)"


def test_a_card_of_gemma_without_gemma_is_refused_in_one_line():
    from poslens.report.section import spec
    from poslens.report.sections.leakage import gemma_installed

    if gemma_installed():
        pytest.skip("Gemma-3-270M is installed here")
    card = spec("card")
    with pytest.raises(UsageError, match="card.gemma=true needs Gemma-3-270M.*not installed"):
        card.build(None, card.size(True, {"gemma": True}))


def test_a_sections_cpu_time_counts_its_finished_worker_processes():
    """The sweep trains in worker processes and the length runs side by side in others: a section's CPU time in
    run.json counts them once they have finished (before, `time.process_time` left them out: Section 4.2 read 47 s
    of CPU for 266 s of training). A child that burns about half a second of CPU shows in `cpu_with_workers`, not in
    this process's own time."""
    import subprocess
    import sys
    import time

    own, both = time.process_time(), rep.cpu_with_workers()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: "
                    "pass"], check=True)
    assert rep.cpu_with_workers() - both >= 0.45 and time.process_time() - own < 0.2
