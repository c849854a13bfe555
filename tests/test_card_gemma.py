"""`poslens card` on a Gemma-3 (tests/tiny_models.py's tiny `gemma3`: a sliding window of 12 keys in layers 1 and 3,
layer 2 global, RoPE base 1e4 in the sliding layers and 1e6 in the global one, as Gemma-3-270M) at 24 tokens, where
the window binds: the scheme panel names each layer's attention and its own RoPE base (those the model's rotary
module turns by), the sinks panel's attention on key 0 against transformers' eager attention (key 0 hidden from the
queries past the window), and the attention terms unchanged by a constant per query added to a sliding-window
model's scores. No download: the real Gemma-3-270M's card needs the optional extra (bash setup.sh --gemma) and is
run by hand (BENCHMARKS.md, "Card")."""

from __future__ import annotations

import json

import pytest
import torch
from test_card import SIZES
from test_pipeline import saved_tiny_llama, text_of

from poslens.cli import main
from poslens.io.results import load

WINDOW, T = 12, 24  # tiny_models' gemma3 window, and the card's sequences here (the window binds past query 11)


@pytest.fixture(scope="module")
def gemma_card(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma-card")
    model = saved_tiny_llama(root / "gemma", family="gemma3")
    out = root / "out"
    argv = ["card", str(model), "--data", text_of(model), "--mode", "pack", "--sizes", SIZES, "--out", str(out),
            "--quiet"]
    assert main(argv) == 0
    meta = json.loads((out / "card" / "run.json").read_text())
    return {"model": model, "out": out, "meta": meta, "m": meta["models"][0]}


def test_the_scheme_panel_names_the_sliding_window_layers_and_each_layers_own_rope_base(gemma_card):
    # the bases must be those the forward turns by: transformers' rotary module keeps one set of inverse
    # frequencies per layer type, inv_freq[k] = base^(-2k/d), so base = inv_freq[1]^(-d/2) (float32: 1e-4 relative)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma_card["model"])
    rotary = model.model.rotary_emb
    base = {}
    for kind in ("sliding_attention", "full_attention"):
        inv = getattr(rotary, f"{kind}_inv_freq").double()
        base[kind] = float(inv[1] ** (-inv.numel()))
    assert base["sliding_attention"] == pytest.approx(1e4, rel=1e-4)
    assert base["full_attention"] == pytest.approx(1e6, rel=1e-4)
    rows = gemma_card["m"]["scheme"]["layers"]
    kinds = model.config.layer_types
    assert [r["window"] for r in rows] == [WINDOW if k == "sliding_attention" else 0 for k in kinds]
    for r, kind in zip(rows, kinds):
        assert r["rope_theta"] == pytest.approx(base[kind], rel=1e-4), r
    md = (gemma_card["out"] / "card" / "card.md").read_text()
    assert "| 1 | rope | sliding window 12 | 10000 |" in md and "| 2 | rope | full | 1e+06 |" in md
    assert ("RoPE base 10000 in layers 1, 3 (the sliding-window layers) and 1e+06 in layers 2 (the full-attention "
            "layers)") in md


def test_attention_on_key_0_and_the_sinks_are_transformers_eager_attention_within_each_window(gemma_card):
    # the leakage sub-run's mean attention on key 0 per layer, head and query, against transformers' own eager
    # attention (float64) on the very token ids the run read (their digest checked): 1e-5 (the run reads the scores
    # in float32). In the sliding layers key 0 is hidden from queries 12 and on (exactly 0); a head's alpha_0 (the
    # sinks panel's attention on key 0) is its mean over the queries that can see key 0, which differs from the
    # mean over all 24 queries by far more than the tolerance (the test fails if the window were ignored).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from poslens.engine.data import iter_documents, make_sequences
    from poslens.engine.pipeline import tokens_digest

    run = load(gemma_card["out"] / "gemma" / "leakage")
    cfg = run.config
    tok = AutoTokenizer.from_pretrained(gemma_card["model"])
    ids, _ = make_sequences(tok, iter_documents(text_of(gemma_card["model"])), cfg["seq_len"], cfg["num_sequences"],
                            mode="pack", bos="always")
    assert tokens_digest(ids) == run.meta["data"]["tokens_sha256"]
    model = AutoModelForCausalLM.from_pretrained(gemma_card["model"], attn_implementation="eager",
                                                 dtype=torch.float64).eval()
    with torch.no_grad():
        probs = model(ids, output_attentions=True).attentions  # per layer [B, H, T, T]
    ref = torch.stack([p[..., 0].mean(0) for p in probs])  # [L, H, T]
    got = run.tensors["maps/key0"].double()
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    sliding = [l for l, k in enumerate(model.config.layer_types) if k == "sliding_attention"]
    assert sliding == [0, 2] and torch.all(got[sliding, :, WINDOW:] == 0)
    assert torch.all(got[1, :, WINDOW:] > 0)  # the global layer sees key 0 from every query (a softmax over the
    # keys a query sees is positive on each; the sliding layers' exact 0 is what a wrongly applied window gives)
    alpha0 = run.tensors["original/alpha0"].double()  # [L, H]
    for l in range(ref.shape[0]):
        seen = WINDOW if l in sliding else T
        torch.testing.assert_close(alpha0[l], ref[l, :, :seen].mean(-1), rtol=0, atol=1e-5)
    assert torch.all((ref[sliding].mean(-1) - alpha0[sliding]).abs() > 1e-2)
    sinks = gemma_card["m"]["sinks"]  # the panel's heads and rate: those whose windowed alpha_0 passes the threshold
    above = {(l + 1, h + 1) for l in range(alpha0.shape[0]) for h in range(alpha0.shape[1])
             if ref[l, h, :WINDOW if l in sliding else T].mean() > sinks["epsilon"]}
    assert {(h["layer"], h["head"]) for h in sinks["sink_heads"]} == above
    assert sinks["rate"] == pytest.approx(len(above) / alpha0.numel(), abs=1e-12)


def test_the_attention_terms_of_a_sliding_window_model_are_unchanged_by_a_constant_per_query():
    # A real Gemma-3 forward at 24 tokens (its window of 12 binds in layers 1 and 3), read twice: as it is, and with
    # a random constant per sequence, head and query added to every visible score before the statistic reads it
    # (no softmax sees it). Every attention and log-probability term, per layer and per head, agrees to 1e-5
    # relative (the statistic reads float32 scores, to which constants of size 3 add rounding of ~1e-7 relative);
    # the interaction, a signed difference near 0 in places, to 1e-5 of the total; the scores' own energy moves
    # (the control: the constants are there).
    from tiny_models import build

    from poslens.analyses.leakage.causal import METRICS, Domains, LeakageMaps
    from poslens.engine.hooks import HookedModel

    hm = HookedModel(build("gemma3"))
    ids = torch.randint(3, 200, (8, T), generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    out = {}
    for name in ("plain", "gauged"):
        stat = LeakageMaps(groups=2, domains=Domains(early_queries=8))
        hooks = stat.hooks(hm)
        assert stat.windows == [WINDOW, 0, WINDOW]
        if name == "gauged":  # one call per layer and batch: s [B, H, T, T], -inf where hidden (and stays so)
            def shifted(s, ctx, read=stat._read):
                return read(s + 3 * torch.randn(*s.shape[:-1], 1, generator=gen), ctx)

            hooks = {point: shifted for point in hooks}
        for b, batch in enumerate(torch.split(ids, 2)):
            stat.group = b % 2
            hm.run(batch, hooks=hooks)
        means = {k: stat.sums.mean(k) for k in stat.KEYS}
        out[name] = (stat.layer_metrics(means), stat.head_metrics(means))
    invariant = [m for m, n in enumerate(METRICS) if n.split("/")[0] in ("attn", "log_probs")]
    signed = [METRICS.index(k) for k in ("attn/cross", "attn/share_cross")]
    unsigned = [m for m in invariant if m not in signed]
    total, energy = METRICS.index("attn/e_total"), METRICS.index("scores/energy")
    for k in range(2):
        got, ref = out["gauged"][k], out["plain"][k]
        torch.testing.assert_close(got[:, unsigned], ref[:, unsigned], rtol=1e-5, atol=0)
        assert torch.all((got[:, signed[0]] - ref[:, signed[0]]).abs() <= 1e-5 * ref[:, total])
        assert torch.all((got[:, signed[1]] - ref[:, signed[1]]).abs() <= 1e-5)
        assert torch.all((got[:, energy] / ref[:, energy] - 1).abs() > 0.01)


def test_models_of_different_depths_are_drawn_and_tabled_side_by_side(gemma_card, tmp_path):
    # SmolLM2-135M (30 layers) beside Gemma-3-270M (18): every figure puts each model's line on its own layers (a
    # shallower one ends at its last) and every table shows a dash where a model has no such layer. Here the tiny
    # Gemma-3 beside itself cut to its first 2 layers, read as another tokenizer's (not paired).
    from poslens.analyses.card.page import figures, tables

    m = gemma_card["m"]
    cut = shallower(m)
    figs = figures([m, cut], tmp_path)
    assert set(figs) == {"scores", "leakage", "probe", "length"} and all(p.stat().st_size > 0 for p in figs.values())
    header, rows = tables([m, cut])["scores"]
    assert header[4:] == ["pattern RMS (cut)", "noise RMS (cut)", "offset share (cut)"]
    assert rows[1][4] != "-" and rows[2][4:] == ["-"] * 3
    header, rows = tables([m, cut])["scheme"]
    assert rows[2] == ["3", "rope", "sliding window 12", "10000", "-", "-", "-"]


def shallower(m: dict) -> dict:
    """A card's model record cut to its first 2 layers, labelled "cut" and read as another tokenizer's (not paired)."""
    import copy

    cut = copy.deepcopy(m)
    cut.update(label="cut", batches={}, scores=m["scores"][:2], probe=m["probe"][:3],
               leakage={n: {k: v[:2] for k, v in d.items()} for n, d in m["leakage"].items()})
    cut["scheme"]["layers"] = m["scheme"]["layers"][:2]
    return cut


def test_the_reports_card_section_with_gemma_shows_both_models_of_different_depths(gemma_card, tmp_path):
    # The report's card section with Gemma-3-270M installed (report/sections/card.py) runs one card of both embedded
    # models, of different depths: its config names both (the full run), each panel's context
    # row holds both models' numbers (a dash past the shallower model's last layer), and its probe figure draws both
    # lines. The models here: the tiny Gemma-3's card and a copy cut to 2 layers (the real weights: by hand).
    from poslens.analyses.card.page import _iv
    from poslens.report.context import Context
    from poslens.report.sections import card as section

    cfg = section.card_config({**section.SIZES_FULL, "gemma": True})
    assert cfg.models == ["smollm2-135m", "gemma-3-270m"]
    m = gemma_card["m"]
    cut = shallower(m)
    rows = dict(section.panel_context([m, cut], {x["label"]: m["commands"] for x in (m, cut)}, 0.95))
    (what, measured), = [(w, v) for w, v in rows.items() if w.startswith("Non-relative")]
    assert "gemma, cut (re-measure:" in what
    assert f"3: pattern RMS (gemma) {_iv(*m['scores'][2]['rms'])}, " in measured
    assert measured.endswith("pattern RMS (cut) -, noise RMS (cut) -, offset share (cut) -")
    ctx = Context(tmp_path / "root", tmp_path / "target", tmp_path / "parts", samples=1, seed=0, quick=True,
                  progress=False)
    fig = section.probe_figure(ctx, [m, cut], 0.95)
    assert fig.path.is_file() and "gemma, cut" in fig.caption
