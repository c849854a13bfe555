"""The finding rows on the per-query offset in score patterns (issue 32, item 2): one test per layer after the
first, a conjunction, so the row can hold (a finding), fail, or stay open."""

import pytest

from poslens.report.sections.leakage import OFFSET_FLOOR, offset_claim
from poslens.report.sweep_leakage import offset_lines


@pytest.mark.parametrize(("layers", "verdict"), [
    ([(0.3, 0.2, 0.4), (0.2, 0.1, 0.3), (0.5, 0.4, 0.6)], "finding"),  # every layer after the first above 5%
    ([(0.0, -0.1, 0.1), (0.2, 0.1, 0.3), (0.02, 0.01, 0.03)], "contradicted"),  # layer 3 below the floor
    ([(0.3, 0.2, 0.4), (0.2, -0.1, 0.5), (0.5, 0.4, 0.6)], "not resolved"),  # layer 2 straddles it
])
def test_offset_row_reads_every_layer_after_the_first(layers, verdict):
    c = offset_claim("offset-share-x", "a pattern", layers, "95% jackknife over 8 groups", "measured")
    assert len(c.tests) == len(layers) - 1 and all(t.threshold == OFFSET_FLOOR for t in c.tests)
    assert c.finding and c.verdict == verdict
    assert c.key.startswith("per layer from 2:")
    if verdict == "not resolved":
        assert "layer 2" in c.resolve


def test_offset_lines_average_seeds_per_variant():
    def run(shares):
        per = {"value": shares, "lo": shares, "hi": shares}
        mean = {"value": sum(shares) / len(shares), "lo": None, "hi": None}
        return {"original": {"per_layer": {"all": {"scores/offset_share": {"key0_out": per}}},
                             "over_layers": {"all": {"scores/offset_share": {"key0_out": mean}}}}}

    metrics = {("rope", 0): run([0.2, 0.4]), ("rope", 1): run([0.4, 0.6]), ("nope", 0): run([0.1, 0.1])}
    lines = offset_lines(metrics, {"rope": "RoPE", "nope": "NoPE", "ntk": "RoPE (ntk:8)"})
    assert len(lines) == 2  # a variant without runs is left out
    assert lines[0].startswith("RoPE 0.4 [") and lines[0].endswith("(per layer, mean over seeds: 0.30, 0.50)")
    assert lines[1].startswith("NoPE 0.1 (no interval)")


def test_kim_offset_row_on_grouped_halves_finds_a_planted_query_offset():
    """Section 5.2's row from grouped sums of two halves (as the real-model section keeps them): maps
    phi(i - j) + g(i) + noise per layer (layer 1 without g) give an offset share near 1 in every later layer, a
    finding; with a key term (-1)^j instead of g the share is 1-2% (what a pattern that is no offset leaks into the
    fit), below the row's 5% floor, and the row is contradicted."""
    from types import SimpleNamespace

    import torch

    from poslens.engine.stats import GroupedSums
    from poslens.report.sections.real_model import offset_row

    n, layers = 16, 3
    i, j = torch.arange(n)[:, None].double(), torch.arange(n)[None].double()
    ctx = SimpleNamespace(remeasure=lambda cid: cid)
    for plant, verdict in ((torch.log1p(i).expand(n, n) ** 2, "finding"), ((1 - 2 * (j % 2)).expand(n, n),
                                                                            "contradicted")):
        g = torch.Generator().manual_seed(3)
        sums = GroupedSums(4)
        for b in range(8):
            maps = torch.stack([torch.cos(i - j) + (plant if layer else 0.0) + 0.01 * torch.randn(
                n, n, generator=g, dtype=torch.float64) for layer in range(layers)])
            sums.add("ab"[b // 4], b % 4, maps, 1)
        row = offset_row(ctx, sums, n, 8)
        assert row.id == "offset-share-kim-52" and len(row.tests) == layers - 1 and row.verdict == verdict
        assert all((t.value > 0.9) if verdict == "finding" else (t.hi < 0.03) for t in row.tests)


def test_kim_control_inside_documents_reads_windows_that_start_inside(tmp_path, monkeypatch):
    """kim-52-every-layer's control: the same pattern power on windows that start at least INSIDE_OFFSET tokens into
    documents (a tiny Llama, byte tokens, documents of 600 bytes): the row names the windows' offsets, each at least
    INSIDE_OFFSET, and a text too short for any window is a row that says it was not measured (nothing raised)."""
    from types import SimpleNamespace

    from test_pipeline import saved_tiny_llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from poslens.engine import corpus
    from poslens.report.sections import real_model as rm

    path = saved_tiny_llama(tmp_path / "tiny")
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    ctx = SimpleNamespace(parts=tmp_path, progress=False)
    size = {"seq_len": 32, "sequences": 4, "batch": 1, "groups": 2}

    def per_layer(v, lo, hi) -> str:
        return "; ".join(f"{k + 1}: {v[k]:.3g} [{lo[k]:.3g}, {hi[k]:.3g}]" for k in range(len(v)))

    monkeypatch.setattr(corpus, "documents", lambda: [f"document {k}: " + "some words of text " * 30 for k in range(6)])
    what, text = rm.inside_control(ctx, model, tok, size, 3, per_layer)
    assert "inside documents" in what and text.startswith("4 windows (offsets ")
    low = int(text.split("offsets ")[1].split(" to ")[0])
    assert low >= rm.INSIDE_OFFSET and "of 2 layers after the first" in text
    monkeypatch.setattr(corpus, "documents", lambda: ["too short"] * 6)
    assert rm.inside_control(ctx, model, tok, size, 3, per_layer)[1].startswith("not measured: ")
