"""Section 4.2 on models poslens trains (`poslens.train.report`): a shortened NoPE/RoPE pair of the tiny preset
is trained once into the session cache, measured, and read back from the cache the second time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from poslens.report.render import CONTEXT, VERDICTS
from poslens.train.report import PE_NAMES, reproduce_section, trained_pair

SHORT = {"steps": 6, "warmup": 2, "layers": 2, "eval_every": 3, "save_every": 0}  # a pair trained in seconds
SIZE = {"fig3": (40, 20), "loss": 16, "probe": (8, 8)}


def _ctx(root):
    root.mkdir(parents=True, exist_ok=True)
    (root / "parts").mkdir(exist_ok=True)
    return SimpleNamespace(parts=root / "parts", root=root / "report", figures=root / "report" / "figures",
                           progress=False)


@pytest.mark.slow
def test_section_on_a_trained_pair_is_complete_and_cached(tmp_path):
    from transformers import AutoModelForCausalLM

    sec = reproduce_section(_ctx(tmp_path / "a"), preset="tiny", size=SIZE, **SHORT)
    claims = {c.claim: c for c in sec.claims}
    assert all(c.verdict in VERDICTS + (CONTEXT,) for c in sec.claims)
    for start in ("layer-2 Q K^T rows increase", "training amplifies", "a decoder without positional encoding",
                  "the position probe improves with depth"):
        row = next(c for k, c in claims.items() if k.startswith(start))
        assert row.verdict in VERDICTS and "[" in row.measured  # a verdict with an interval
    assert len(sec.figures) == 4 and all(p.is_file() for p, _ in sec.figures)
    models = trained_pair("tiny", progress=False, **SHORT)
    for pe in PE_NAMES:  # stock transformers reloads each with its positional encoding
        cfg = AutoModelForCausalLM.from_pretrained(models[pe]).config
        assert set(cfg.no_rope_layers) == {1 if pe == "rope" else 0}
    stamp = {pe: (models[pe] / "model.safetensors").stat().st_mtime_ns for pe in PE_NAMES}
    ctx = _ctx(tmp_path / "b")
    ctx.parts = tmp_path / "a" / "parts"  # the intermediates run from the parts cache, the models from theirs
    again = reproduce_section(ctx, preset="tiny", size=SIZE, **SHORT)
    assert [c.measured for c in again.claims] == [c.measured for c in sec.claims]
    assert stamp == {pe: (models[pe] / "model.safetensors").stat().st_mtime_ns for pe in PE_NAMES}


def test_verdicts_follow_the_interval_and_an_undefined_interval_decides_nothing():
    from poslens.train.report import _below, _fmt, _sign

    assert _sign({"value": 2.0, "lo": 1.2, "hi": 2.8}, 1.0) == "holds"
    assert _sign({"value": 0.5, "lo": 0.2, "hi": 0.8}, 1.0) == "contradicted"
    assert _sign({"value": 1.1, "lo": 0.9, "hi": 1.3}, 1.0) == "not resolved"
    assert _below({"value": -1.0, "lo": -2.0, "hi": -0.5}) == "holds"
    # run.json keeps NaN as null: an interval undefined in some replicate resolves nothing and still prints
    undefined = {"value": 0.39, "lo": None, "hi": None}
    assert _sign(undefined) == _below(undefined) == "not resolved"
    assert _fmt(undefined) == "0.39 [nan, nan]"
    assert _sign({"value": 1.0, "lo": float("nan"), "hi": 2.0}) == "not resolved"
