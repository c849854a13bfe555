"""`poslens reproduce` on small settings: every figure, a claims table, resumable, nothing half-written."""

import json

import pytest
from test_report import check_report_images

from poslens.errors import UsageError
from poslens.report import render
from poslens.report import reproduce as rep


@pytest.mark.slow
def test_reproduce_writes_every_figure_and_claim(tmp_path, smollm2, monkeypatch, capsys):
    out = tmp_path / "report"
    rep.reproduce(out=str(out), quick=True, progress=False, samples=400, model_size=(64, 8, 2, 2))
    figs = {p.stem for p in (out / "figures").glob("*.pdf")}
    for stem in ("figure1", "figure2", "figure4", "figure5", "figure6", "figure7", "figure9", "figure10",
                 "convergence", "appendix_a1_h", "model_pattern_share", "model_rope_normalised",
                 "model_norope_normalised"):
        assert stem in figs, stem
    ids = check_report_images(out)
    assert "figure1" in ids and "model_rope_scores" in ids
    html = (out / "report.html").read_text()
    assert len(html) < 8_000_000  # a few MB: PNG at 100 dpi, JPEG for the 30-layer grids
    md = (out / "report.md").read_text()
    assert "| claim | source | measured | verdict | figure | re-measure |" in md
    meta = json.loads((out / "run.json").read_text())
    assert set(meta["provenance"]) == {"command", "versions", "seed", "date", "machine"}
    for value in meta["provenance"].values():
        assert value in html
    claims = meta["metrics"]["claims"]
    assert sum(meta["metrics"]["verdicts"].values()) == len([c for c in claims if c["verdict"] != "context"])
    scored = [c for c in claims if c["verdict"] != render.CONTEXT]
    assert all(c["verdict"] in render.VERDICTS and c["command"] for c in scored)
    exact = {c["claim"]: c["verdict"] for c in claims if c["section"].startswith("Closed forms")}
    # exact, sample-free claims hold whatever the sample count
    assert exact["h(j) is strictly decreasing in j"] == "holds"
    assert exact["Gram flow (infinite width) equals the closed form g(i)/(h(i)h(j)) at layer 2"] == "holds"
    # the printed appendix polynomials are wrong (measured; see docs/gramflow.md) but h still decreases
    assert exact["the printed polynomial for h(j+1)^2 - h(j)^2 is exact"] == "erratum"
    model = [c for c in claims if c["section"].startswith("RoPE LLM") and c["verdict"] != "context"]
    assert len(model) == 1 and model[0]["verdict"] in ("holds", "not resolved")  # RoPE off: a context row
    assert not any(p.name.startswith(".report") for p in tmp_path.iterdir())  # parts cache removed
    # the same command again: nothing recomputed, the report is up to date
    monkeypatch.setattr(rep, "simulate", lambda *a, **k: pytest.fail("recomputed"))
    capsys.readouterr()
    assert rep.reproduce(out=str(out), quick=True, progress=False, samples=400, model_size=(64, 8, 2, 2)) == out
    assert "up to date" in capsys.readouterr().out
    with pytest.raises(UsageError, match="other settings.*--force"):
        rep.reproduce(out=str(out), quick=True, progress=False, samples=401, model_size=(64, 8, 2, 2))


def test_interrupted_reproduce_resumes_from_parts(tmp_path, monkeypatch):
    out = tmp_path / "report"
    calls = {"n": 0}
    real = rep.simulate

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(rep, "simulate", flaky)
    with pytest.raises(KeyboardInterrupt):
        rep.reproduce(out=str(out), quick=True, models=False, progress=False, samples=200)
    assert not out.exists()
    parts = list((tmp_path / ".report.parts").glob("*.safetensors"))
    assert len(parts) == 3  # finished Monte Carlo runs are kept
    calls["n"] = -1000  # no more interruptions; count what is recomputed
    rep.reproduce(out=str(out), quick=True, models=False, progress=False, samples=200)
    assert (out / "report.html").exists()
    assert calls["n"] + 1000 == 18 - 3  # 18 distinct Monte Carlo settings (12 figures + 6 convergence), 3 reused
