"""report.md / report.html: ledgers and the summary block, provenance, embedded images and heatmap data that
decode, figure helpers, and the "add a report section" recipe of docs/architecture.md followed step by step."""

import base64
import io
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import matplotlib
import numpy as np
import pytest
from PIL import Image

from poslens import plotting
from poslens.report.claims import Claim, Test
from poslens.report.render import figure_of, headlines, prose, verdict_rule, write_report
from poslens.report.section import Figure, Panel, Section
from poslens.report.sections.figures import heatmaps, noise_only, profiles

IMG = re.compile(r"<img src='data:(image/(?:png|jpeg));base64,([A-Za-z0-9+/=]+)'[^>]*id='([^']+)'")
HEATMAP = re.compile(r"<script type='application/json'>(.*?)</script>")


def html_images(page: str) -> list[tuple[str, Image.Image]]:
    """(id, decoded image) for every embedded image; raises if one does not decode."""
    out = []
    for mime, data, ident in IMG.findall(page):
        img = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        img.load()  # decodes every pixel, not just the header
        assert img.format == {"image/png": "PNG", "image/jpeg": "JPEG"}[mime]
        out.append((ident, img))
    return out


def heatmap_values(spec: dict, key: str = "v") -> np.ndarray:
    """An interactive heatmap's data as the page's script reads it: float16 entries j <= i, row by row, times the
    power of two they were divided by (vs, ss)."""
    n = spec["n"]
    scale = spec.get({"v": "vs", "se": "ss"}[key], 1.0)
    tri = np.frombuffer(base64.b64decode(spec[key]), dtype="<f2").astype(np.float64) * scale
    out = np.full((n, n), np.nan)
    out[np.tril_indices(n)] = tri
    return out


def check_report_images(directory) -> list[str]:
    """Every <img> in report.html decodes and is embedded once, every heatmap's data decodes to a square map, and
    every figure the Markdown links is there; returns the image ids."""
    page = (directory / "report.html").read_text()
    images = html_images(page)
    assert page.count("<img ") == len(images)
    ids = [i for i, _ in images]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    for i, img in images:
        assert img.width > 50 and img.height > 50, i
    for spec in map(json.loads, HEATMAP.findall(page)):
        assert heatmap_values(spec).shape == (spec["n"], spec["n"]) and spec["lo"] < spec["hi"]
        lut = re.search(rf"class='poslens-cmap' data-name='{spec['cm']}'>([0-9a-f]*)<", page)
        assert lut and len(lut.group(1)) == 256 * 6, spec["cm"]  # the page carries every panel's colour map
    md = (directory / "report.md").read_text()
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md) + re.findall(r"\[PDF\]\(([^)]+)\)", md):
        assert (directory / link).is_file(), link
    return ids


def _ctx(tmp_path):
    fig = tmp_path / "figures"

    def save(f, stem, big=False):
        return plotting.save(f, fig, stem, formats=("jpg", "pdf") if big else ("png", "pdf"))[0]

    return SimpleNamespace(figures=fig, save=save, draw=True)


def test_verdicts_at_this_scale_have_their_own_name_colour_and_count(tmp_path):
    """A scoped row that fails here reads 'fails at this scale' (not 'not resolved'), in its own colour, counted
    apart; the headline counts the rows on trained models (a section that runs models) apart from the rows on exact
    or simulated quantities; the row says what its verdict at this scale covers."""
    exact = Section("E", "", [Claim("kim-e", "kim2025", "S3", "e", (Test("e", 0.5, "<", 1.0),))], name="e")
    down = Test("slope", -0.5, ">", 0.0, -0.8, -0.2, "95% t-interval over 8 seeds")
    models = Section("M", "", [Claim("kim-m", "kim2025", "S4.2", "m", (down,), scope="1.5B models (this: tiny)"),
                               Claim("kim-o", "kim2025", "S4.2", "o", (Test("o", 0.1, ">", 0.0, -0.1, 0.3),))],
                     name="m", models=True)
    write_report(tmp_path, "T", "intro", [exact, models])
    assert headlines([exact, models]) == ["Kim et al. (2025): 3 claims; on exact or simulated quantities 1: 1 holds; "
                                          "on trained models 2: 1 fails at this scale, 1 not resolved"]
    page = (tmp_path / "report.html").read_text()
    colour = re.search(r"\.v-fails-at-this-scale\{color:(#[0-9a-f]+)\}", page).group(1)
    others = re.findall(r"\.v-(?!fails-at-this-scale)[a-z-]+\{color:(#[0-9a-f]+)\}", page)
    assert colour not in others and len(others) == 7  # its own colour, apart from the seven other verdicts'
    assert "<span class='v v-fails-at-this-scale'>fails at this scale</span>" in page
    assert "<b>At this scale:</b> the pattern fails at this scale; the claim is about 1.5B models," in page
    md = (tmp_path / "report.md").read_text()
    assert "- fails at this scale: [m](#kim-m)" in md and "| fails at this scale: the pattern fails" in md


def test_report_has_ledgers_summary_provenance_and_decodable_figures(tmp_path):
    rng = np.random.default_rng(0)
    m = np.tril(rng.random((12, 12)))
    m[np.triu_indices(12, 1)] = np.nan
    static = plotting.save(plotting.line_plot([1, 2, 3], {"a": [1, 2, 3]}, "x", "y"), tmp_path / "figures", "line")[0]
    interactive = heatmaps(_ctx(tmp_path), "maps", [Panel("layer 1", m, m / 100),
                                                    Panel("difference", m - 0.5, None, (-0.5, 0.5), "coolwarm")],
                           "two maps")
    claims = [Claim("kim-x", "kim2025", "Section 3", "x < 1", (Test("x", 0.5, "<", 1.0),), command="poslens x",
                    figure="a line plot, Figure 2", paper_number="printed 0.4"),
              Claim("haviv-y", "haviv2022", "Section 4", "y > 0", (Test("y", 0.1, ">", 0.0, -0.1, 0.3),)),
              Claim("poslens-z", "poslens", "docs", "z", (Test("z", 2.0, ">", 1.0),))]
    sec = Section("S", "text", claims, [Figure(static, "a line", title="A line plot"), interactive],
                  [("context", "measured")], scale="Measured on a small model; the paper's is 8B.", name="s")
    prov = {"command": "poslens reproduce --quick", "source": "git abc", "versions": "poslens 0.2.0",
            "inputs": "model: from the cache\ncorpus: embedded"}
    write_report(tmp_path, "T", "intro", [sec], prov)
    assert check_report_images(tmp_path) == ["line"]
    page = (tmp_path / "report.html").read_text()
    assert headlines([sec]) == ["Kim et al. (2025): 1 claim, on exact or simulated quantities: 1 holds",
                                "other papers (Haviv et al. 2022, Kazemnejad et al. 2023): 1 claim, on exact or "
                                "simulated quantities: 1 not resolved",
                                "poslens's own checks and questions (the software's checks; the questions past the "
                                "training length): 1 claim, on exact or simulated quantities: 1 holds"]
    for text in headlines([sec]) + ["Measured on a small model", "git abc", "model: from the cache<br>corpus"]:
        assert text.replace("'", "&#x27;") in page, text
    for c in claims:  # a summary line linking to the row, and the row
        assert f"href='#{c.id}'" in page and f"id='{c.id}'" in page
    assert page.index("href='#kim-x'") < page.index("id='kim-x'")  # the summary comes first
    # the first screen: the verdict rule (quoted from poslens.report.claims, the one written rule), then the papers'
    # numbers beside ours, before the summary; every summary line names its statistic and threshold
    rule = verdict_rule()
    assert len(rule) == 7 and rule[1] == ("A claim's tests are a conjunction: it passes when all pass, fails when any "
                                          "fails, else it is open.")
    assert page.index("The verdict rule") < page.index("The papers' numbers beside ours") < page.index(
        "class='summary'")
    table = page[page.index("<table class='papers'>"):page.index("class='summary'")]
    assert "printed 0.4" in table and "x = 0.5, needs &lt; 1" in table and "id=" not in table
    assert "(y = 0.1 [-0.1, 0.3], needs &gt; 0)" in page
    assert "figure: <a href='#fig-line'>a line plot, Figure 2</a>" in page  # a row links to the figure it quotes
    assert figure_of("Figure 1", [Figure(static, "Figure 10: x"), Figure(static, "Figure 1 style: y")]).caption \
        == "Figure 1 style: y"
    assert "\u201cBehind RoPE: How Does Causal Mask Encode Positional Information?\u201d" in page  # beside its ledger
    # the interactive maps have axes of query i (left) and key j (bottom), ticked by the page's script; the caption
    # says which is which
    assert page.count("<canvas class='ya'></canvas><canvas class='m'></canvas><span></span><canvas class='xa'>") == 2
    assert "Rows: query i (left axis), columns: key j (bottom axis), both from 1." in page
    spec, diff = map(json.loads, HEATMAP.findall(page))
    assert (spec["cm"], diff["cm"]) == ("magma", "coolwarm")  # each panel in its own colour map
    cool = matplotlib.colormaps["coolwarm"](np.linspace(0, 1, 256))[:, :3]
    lut = re.search(r"data-name='coolwarm'>([0-9a-f]*)<", page).group(1)
    assert np.abs(np.frombuffer(bytes.fromhex(lut), np.uint8).reshape(256, 3) - cool * 255).max() <= 0.5
    low = np.tril(np.ones((12, 12), dtype=bool))
    assert np.allclose(heatmap_values(spec)[low], m[low], rtol=1e-3)  # float16: 3 significant digits
    assert np.allclose(heatmap_values(spec, "se")[low], m[low] / 100, rtol=1e-3)
    assert "http" not in page.split("<body>")[1]  # offline: no link to fetch anything
    md = (tmp_path / "report.md").read_text()
    assert "`poslens x`" in md and "(figures/maps.png)" in md and "(figures/maps.pdf)" in md


def test_a_panel_of_noise_gets_a_warning(tmp_path):
    rng = np.random.default_rng(1)
    se = np.full((20, 20), 0.1)
    noise = np.tril(rng.normal(0, 0.1, (20, 20)))
    pattern = np.tril(np.arange(20)[None, :] * np.ones((20, 1)))
    assert noise_only(Panel("noise", noise, se, (-0.2, 0.2))) and not noise_only(Panel("p", pattern, se, (0, 19)))
    fig = heatmaps(_ctx(tmp_path), "w", [Panel("layer 1", noise, se), Panel("layer 2", pattern, se)], "c")
    assert "sampling noise" in fig.warning and "layer 1" in fig.warning and "layer 2" not in fig.warning
    rows = profiles(_ctx(tmp_path), "r", [noise, pattern], [se, se], ["(f) noise", "(i) pattern"], "c", first_key=2)
    assert "sampling noise" in rows.warning and "(f) noise" in rows.warning and "(i) pattern" not in rows.warning


def test_line_plots_are_large_and_log_axes_label_each_width_once():
    fig = plotting.line_plot([16, 64, 256, 1024], {"a": [1, 0.3, 0.1, 0.05]}, "d", "dev", logx=True, logy=True)
    w, h = fig.get_size_inches() * plotting.DPI
    assert w >= 700 and h >= 450
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels(minor=True)]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["16", "64", "256", "1024"] and not any(labels)
    plotting.plt.close(fig)


def test_a_log_axis_becomes_symmetric_log_when_an_estimate_or_bound_is_at_or_below_zero():
    """A log axis silently drops a mean at or below 0 (a debiased energy can be): then the axis is a symmetric log
    one, linear within the power of ten at or below the smallest nonzero |value|, and every point is drawn."""
    ys = {"window": [-0.289, 3.0, 40.0], "rope": [0.5, 6.0, 80.0]}
    assert plotting.symlog_threshold({"rope": ys["rope"]}) is None
    assert plotting.symlog_threshold({"rope": ys["rope"]}, {"rope": np.array([[0.6, 1, 1], [1, 1, 1]])}) == 0.1
    t = plotting.symlog_threshold(ys)
    assert t == 0.1
    fig = plotting.line_plot([1, 2, 3], ys, "layer", "energy", logy=True)
    ax = fig.axes[0]
    assert ax.get_yscale() == "symlog" and ax.get_ylim()[0] < -0.289
    plotting.plt.close(fig)


def test_heatmap_data_beyond_float16_range_are_scaled_not_overflowed():
    """A Gram matrix of large hidden states (entries ~1e6) would overflow float16 (largest 65,504) to inf: the page
    stores them divided by a power of two and the value, decoded as the page's script does, is the entry to float16's
    relative precision (2^-11)."""
    from poslens.report.render import _pack

    m = np.tril(np.full((4, 4), 1.0)) * np.array([1.0, 3e3, 2.5e5, 1.2e6])[:, None]
    m[np.triu_indices(4, 1)] = np.nan
    b64, scale = _pack(m)
    assert scale > 1 and math.log2(scale).is_integer()
    got = heatmap_values({"n": 4, "v": b64, "vs": scale})
    low = np.tril_indices(4)
    assert np.isfinite(got[low]).all() and np.allclose(got[low], m[low], rtol=2.0 ** -11)
    assert _pack(np.tril(np.ones((3, 3))))[1] == 1.0  # data that fit are stored as they are


def test_unordered_categories_leave_points_unjoined():
    """Variants on the x axis are categories: their names on the ticks, no line drawn from one to the next, and two
    series side by side rather than on top of each other."""
    fig = plotting.line_plot([1, 2, 3], {"a": [0.1, 0.2, 0.3], "b": [0.1, 0.2, 0.3]}, "variant", "effect",
                             xticklabels=["nope", "rope", "ntk"], joined=False)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["nope", "rope", "ntk"]
    drawn = [line for line in ax.get_lines() if len(line.get_xdata()) == 3]
    assert len(drawn) == 2 and all(line.get_linestyle() == "None" for line in drawn)
    assert all(a < b for a, b in zip(drawn[0].get_xdata(), drawn[1].get_xdata()))
    plotting.plt.close(fig)


def test_line_plots_tick_from_the_first_value_name_categories_and_keep_the_legend_off_the_data():
    """A layer axis from 1 shows no tick 0; categories are named on the axis, not decoded in a caption; the legend
    sits below the axes, so it hides no line or error bar."""
    layers = list(range(1, 31))
    fig = plotting.line_plot(layers, {f"series {k}": [k + x for x in layers] for k in range(4)}, "layer", "y")
    ax = fig.axes[0]
    fig.canvas.draw()
    assert ax.get_xticks()[0] == 1 and min(ax.get_xticks()) >= 1
    assert not ax.get_legend() and len(fig.legends) == 1
    assert fig.legends[0].get_window_extent().y1 <= ax.get_window_extent().y0
    plotting.plt.close(fig)
    long = {f"the residual term (attn/residual), key 0 {k}": layers for k in ("in", "out", "a")}
    fig = plotting.line_plot(layers, long, "layer", "y")
    fig.canvas.draw()
    box = fig.legends[0].get_window_extent()
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width  # long labels in one column: none cut at the figure's edge
    plotting.plt.close(fig)
    fig = plotting.line_plot([1, 2, 3], {"a": [1, 2, 3]}, "variant", "y", xticklabels=["nope", "rope", "ntk"])
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["nope", "rope", "ntk"]
    plotting.plt.close(fig)


def test_offdiag_limits_ignore_a_constant_diagonal():
    """An l2-normalised map has 1 on the diagonal; its pattern lives off it, so the limits must too."""
    m = np.tril(np.full((6, 6), 0.1) + 0.01 * np.arange(6)[None, :])
    np.fill_diagonal(m, 1.0)
    m[np.triu_indices(6, 1)] = np.nan
    lo, hi = plotting.offdiag_limits(m)
    assert (lo, hi) == pytest.approx((0.1, 0.14))


def test_real_model_maps_flag_layers_where_noise_rivals_the_pattern():
    """Section 5.2's figures warn where the drawn map's noise (from the two halves' difference) is at least half
    the pattern's mean square (from their product): a non-relative pattern with little noise is not flagged, a
    relative map with noise is."""
    import torch

    from poslens.engine.stats import GroupedSums
    from poslens.report.sections.real_model import noise_warning, noisy_layers

    n, rng = 16, np.random.default_rng(0)
    pattern = np.tril(np.add.outer(np.zeros(n), np.linspace(0, 1, n)) ** 2)  # depends on j alone: not relative
    relative = np.tril(np.subtract.outer(np.arange(n), np.arange(n)) * 0.1)
    sums = GroupedSums(2)
    for half in "ab":
        for g in range(2):
            maps = np.stack([pattern + rng.normal(0, 0.01, (n, n)), relative + rng.normal(0, 0.3, (n, n))])
            sums.add(half, g, torch.as_tensor(maps * 4), 4)
    assert noisy_layers(sums) == [2]
    warn = noise_warning([2], sums, 2)
    assert warn.startswith("Layer 2:") and "16 sequences" in warn
    assert noise_warning([1, 2], sums, 2).startswith("Every layer") and noise_warning([], sums) == ""


def test_real_model_rows_say_how_many_sequences_would_resolve_them_and_for_which_layer():
    """Section 5.2's open rows estimate the sequences that would resolve them (bounds shrinking as 1/sqrt(sequences)
    at the present estimate): kim-52-every-layer names the layer that estimate is for, which need not be the layer
    with the weakest lower bound; kim-52-first-layer gives its own count against its threshold."""
    import torch

    from poslens.engine.stats import GroupedSums
    from poslens.report.sections import measures as ms
    from poslens.report.sections import real_model as rm

    n, rng, layers = 16, np.random.default_rng(1), 4
    sums = GroupedSums(4)
    for half in "ab":
        for g in range(4):
            maps = np.stack([np.tril(rng.normal(0, 1, (n, n))) for _ in range(layers)])
            sums.add(half, g, torch.as_tensor(maps * 4), 4)
    st = rm.statistics(sums, layers)
    # layer 2: a small estimate, far from resolved; layer 3: the weakest lower bound, but a large estimate
    st["power"] = st["power_uncut"] = tuple(np.array(x) for x in ([0.01, 0.004, 0.06, 0.1],
                                                                  [0.005, -0.05, -0.09, 0.05],
                                                                  [0.015, 0.058, 0.21, 0.15]))
    every, first = rm.claims(SimpleNamespace(remeasure=str), sums, st, sums.mean("a").numpy(), layers, 32)[:2]
    assert "layer 3's" in every.measured and "(layer 3)" in every.key
    need = 32 * ms.need_factor(0.004, -0.05, 0.058)
    assert need == pytest.approx(32 * (0.054 / 0.004) ** 2)
    assert f"about {need:,.0f} for layer 2," in every.resolve and "this run used 32" in every.resolve
    literal, t = first.readings[0].tests[0], first.readings[1].tests[0]
    var = ms.map_variance(sums.mean("a").numpy(), sink=True)  # the literal reading: below a negligible size
    assert literal.side == "<" and literal.threshold == pytest.approx(ms.NEGLIGIBLE * float(var[0]))
    assert first.reading_verdicts()[1] == "not resolved"  # noise maps: the ratio's interval straddles 0.1
    assert first.verdict == "not resolved"
    k = 32 * ms.need_factor(t.value, t.lo, t.hi, rm.FIRST_LAYER)
    assert f"about {k:,.0f} for it to exclude 0.1" in first.resolve
    # at that count the interval's half-width, shrunk as 1/sqrt(sequences), just reaches the threshold
    assert (t.hi - t.lo) / 2 * (32 / k) ** 0.5 == pytest.approx(abs(t.value - rm.FIRST_LAYER))


def test_step_bounds_say_how_many_samples_would_decide_a_strictly_increasing_row():
    """A map with one step below 0: no sample count makes every step positive, but the step furthest below 0 in
    standard errors (-0.1 with SE sqrt(0.2^2 + 0.2^2) = 0.283 at z = 2) needs (2 * 0.283 / 0.1)^2 = 32 times the
    samples for its upper bound to fall under 0; with every step positive the weakest one sets need_factor."""
    from poslens.report.sections import measures as ms

    m, se = np.tril(np.array([[0.0, 0, 0], [1.0, 2.0, 0], [1.0, 0.9, 3.0]])), np.full((3, 3), 0.2)
    b = ms.step_bounds(m, se, 2.0)
    assert b["need_factor"] is None and b["rows_failing"] == 1
    assert b["fail_factor"] == pytest.approx((2 * math.sqrt(0.08) / 0.1) ** 2)
    m[2, 1] = 1.5  # every step positive: the smallest (0.5) decides
    b = ms.step_bounds(m, se, 2.0)
    assert b["fail_factor"] is None and b["need_factor"] == pytest.approx((2 * math.sqrt(0.08) / 0.5) ** 2)


def test_the_gram_flow_side_by_side_caption_names_the_layer_of_each_number():
    """Figure 2's Monte Carlo beside the Gram flow shows layer 4; its caption gives every layer's largest difference
    with its layer, so a reader sees which is largest."""
    from poslens.report.sections.nope import side_by_side
    from poslens.stack.config import StackConfig

    n, gf = 6, np.zeros((4, 6, 6))
    mc = np.zeros((4, n, n))
    mc[2, 3, 1], mc[3, 4, 2] = -0.014, 0.012  # layer 3's difference is the largest, layer 4's is shown
    ctx = SimpleNamespace(draw=False, figures=Path("figs"), keep=lambda *a: None,
                          mc=lambda c: SimpleNamespace(mean=mc, se=np.full_like(mc, 1e-3)),
                          gf=lambda c: SimpleNamespace(scores=gf))
    caption = side_by_side(ctx, StackConfig(n=n, alpha=0.2)).caption
    assert "by layer: layer 2 0.000, layer 3 0.014, layer 4 0.012 (layer 1 0.0e+00)" in caption
    mc[3, 4, 2] = 0.02
    assert "layer 3 0.014, layer 4 0.020" in side_by_side(ctx, StackConfig(n=n, alpha=0.2)).caption


def test_convergence_ratio_has_a_jackknife_interval_over_the_monte_carlo_groups():
    """The convergence rows' ratio (largest |Monte Carlo - Gram flow| at the narrowest width over that at the widest)
    is a Monte Carlo statistic, so it carries a jackknife interval over the groups, never '(exact)': without noise
    the interval is the value itself, with noise it brackets the value."""
    import torch

    from poslens.engine.stats import GroupedSums
    from poslens.report.context import MC_GROUPS
    from poslens.report.sections.convergence import shrinkage

    n, rng, vis = 4, np.random.default_rng(0), np.tril(np.ones((4, 4), dtype=bool))

    def run(bias: float, noise: float) -> SimpleNamespace:
        sums = GroupedSums(MC_GROUPS)
        for half in "ab":
            for g in range(MC_GROUPS):
                sums.add(half, g, torch.as_tensor((bias + rng.normal(0, noise, (1, n, n))) * 10), 10)
        return SimpleNamespace(sums=sums)

    gf = np.zeros((1, n, n))
    exact = shrinkage(run(0.5, 0.0), gf, run(0.05, 0.0), gf, vis)
    assert float(exact.value) == pytest.approx(10.0) and float(exact.hi - exact.lo) == pytest.approx(0.0, abs=1e-9)
    noisy = shrinkage(run(0.5, 0.01), gf, run(0.05, 0.01), gf, vis)
    assert float(noisy.lo) < float(noisy.value) < float(noisy.hi) and noisy.groups == MC_GROUPS


def test_code_spans_of_the_text_are_code_in_html():
    # the sections' texts name commands in backticks (Markdown); in HTML they are <code>, everything else escaped
    want = "run <code>poslens sweep --out a&lt;b</code> then &lt;x&gt;"
    assert prose("run `poslens sweep --out a<b` then <x>") == want
    assert prose("no code here") == "no code here"


def test_panels_compared_with_each_other_share_one_colour_scale():
    """share_limits gives every panel the same limits: the 1% and 99% quantiles of all panels' off-diagonal entries
    together (numpy's quantile on the pooled entries, an independent computation), values and errors unchanged."""
    from poslens.report.sections.figures import share_limits

    rng = np.random.default_rng(1)
    maps = [np.tril(rng.normal(k, 1.0 + k, (10, 10))) for k in range(3)]
    for m in maps:
        m[np.triu_indices(10, 1)] = np.nan
        np.fill_diagonal(m, 100.0)  # a large diagonal, left out of the limits
    panels = share_limits([Panel(f"p{k}", m, m / 10, (0.0, 1.0)) for k, m in enumerate(maps)])
    off = np.concatenate([m[np.tril_indices(10, -1)] for m in maps])
    want = tuple(np.quantile(off, (0.01, 0.99)))
    assert all(np.allclose(p.limits, want, rtol=1e-12) for p in panels)
    assert all(p.values is m and np.array_equal(p.se, m / 10, equal_nan=True) for p, m in zip(panels, maps))
