"""Three figure defects a reader of report.html found: hover values with a digit float16 does not hold, error bars
of several series drawn on top of each other, and a point at the bottom of a symmetric log axis cut by its edge."""

from __future__ import annotations

import base64
import json
import math
import shutil
import subprocess

import numpy as np
import pytest

from poslens import plotting
from poslens.report.render import F16_DIGITS, SCRIPT, _pack, _panel_html, colormap_hex
from poslens.report.section import Panel

# ---------------------------------------------------------------- 1. hover digits against float16 data


def stored(m: np.ndarray) -> np.ndarray:
    """The entries j <= i of a map as the page stores and its script decodes them (float16 times the scale)."""
    b64, scale = _pack(m)
    return np.frombuffer(base64.b64decode(b64), dtype="<f2").astype(np.float64) * scale


def unit(x: float, digits: int) -> float:
    """The unit of the last of `digits` significant digits of x."""
    return 10.0 ** (math.floor(math.log10(abs(x))) - digits + 1)


def tri_map(values) -> np.ndarray:
    """An [n, n] map whose entries j <= i are `values`, row by row (NaN above the diagonal)."""
    n = int((math.isqrt(8 * len(values) + 1) - 1) // 2)
    m = np.full((n, n), np.nan)
    m[np.tril_indices(n)] = values
    return m


def test_figure_1b_entry_prints_no_digit_its_float16_does_not_hold():
    """Figure 1 (b), query 8, key 8: the exact value 0.27970 is stored as float16 0.27979: printed to 4 digits it
    reads 0.2798 (a wrong 4th digit), to the F16_DIGITS = 3 the page prints, 0.280, as the exact value does."""
    m = tri_map(np.linspace(0.1, 0.3, 36))
    m[7, 7] = 0.27970
    got = stored(m)[-1]
    assert F16_DIGITS == 3
    assert float(f"{got:.{F16_DIGITS}g}") == float(f"{0.27970:.{F16_DIGITS}g}")
    assert float(f"{got:.{F16_DIGITS + 1}g}") != float(f"{0.27970:.{F16_DIGITS + 1}g}")  # what the page printed


def test_every_printed_digit_is_held_by_the_stored_value():
    """Over entries from 1e-4 to 1e4 (either sign), the stored value is within half a unit of the last of the
    F16_DIGITS digits printed of the true value; one digit more and it is not, for many entries."""
    rng = np.random.default_rng(0)
    true = rng.choice([-1, 1], 2016) * 10 ** rng.uniform(-4, 4, 2016)
    got = stored(tri_map(true))
    held = [abs(g - t) < unit(g, F16_DIGITS) / 2 for g, t in zip(got, true)]
    one_more = [abs(g - t) < unit(g, F16_DIGITS + 1) / 2 for g, t in zip(got, true)]
    assert all(held) and sum(not h for h in one_more) > 100


def test_small_entries_are_lifted_into_float16s_normal_range():
    """Entries below float16's normal range (2^-14) would keep only a digit or two; the page divides them by a
    power of two below 1 (as far as the largest entry allows), so they keep float16's relative precision."""
    m = tri_map([1.0, 3e-6, 2e-5])
    b64, scale = _pack(m)
    assert scale < 1 and math.log2(scale).is_integer()
    assert np.allclose(stored(m), [1.0, 3e-6, 2e-5], rtol=2.0**-11, atol=0)
    assert _pack(tri_map([1.0, 0.5, 0.0]))[1] == 1.0  # data in the normal range are stored as they are


def test_the_script_prints_float16_digits_only():
    assert f"DIGITS={F16_DIGITS};" in SCRIPT and "__DIGITS__" not in SCRIPT
    assert "toPrecision(4)" not in SCRIPT and "toExponential(3)" not in SCRIPT


HARNESS = """
var texts=[],listeners={},tip={style:{}},W=%(w)d;
function context(){return {createImageData:function(w,h){return {data:new Uint8ClampedArray(4*w*h)};},
 putImageData:function(){},fillRect:function(){},drawImage:function(){},fillText:function(s){texts.push(s);},
 measureText:function(s){return {width:s.length};}};}
var canvas={clientWidth:W,getContext:context,addEventListener:function(t,f){listeners[t]=f;},
 getBoundingClientRect:function(){return {top:0,left:0,width:W,height:W};}};
function quiet(){return {beginPath:function(){},moveTo:function(){},lineTo:function(){},stroke:function(){},
 fillText:function(){}};}
var axis={clientWidth:W,clientHeight:20,getContext:quiet};  // the query/key axes: ticks, not the colour bar's labels
var el={querySelector:function(s){return s==='script'?{textContent:%(spec)s}:
 (s==='canvas.xa'||s==='canvas.ya')?axis:canvas;}};
var cmap={textContent:%(hex)s,dataset:{name:%(cm)s}};
var document={body:{appendChild:function(){}},
 createElement:function(t){return t==='div'?tip:{getContext:context};},
 querySelectorAll:function(s){return s==='.hm'?[el]:[cmap];}};
var window={devicePixelRatio:1,addEventListener:function(){}};
%(script)s
var tips=[],n=%(n)d,c=W/n;
for(var i=0;i<n;i++)for(var j=0;j<=i;j++){listeners.mousemove({clientX:(j+0.5)*c,clientY:(i+0.5)*c});
 tips.push(tip.textContent);}
console.log(JSON.stringify({tips:tips,labels:texts}));
"""


def run_page_script(values: np.ndarray, se: np.ndarray | None, tmp_path) -> dict:
    """Hover every cell of one heatmap with the page's own script (node, a stub DOM): the tips, and the values the
    cells print (drawn 40 px wide, large enough to print)."""
    panel = _panel_html(Panel("t", values, se, (0.0, 1.0)))
    spec = panel.split("<script type='application/json'>")[1].split("</script>")[0]
    n = values.shape[-1]
    js = HARNESS % {"w": 40 * n, "spec": json.dumps(spec), "hex": json.dumps(colormap_hex("magma")),
                    "cm": json.dumps("magma"), "script": SCRIPT, "n": n}
    (tmp_path / "page.js").write_text(js)
    out = subprocess.run(["node", str(tmp_path / "page.js")], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def printed_unit(text: str) -> float:
    """The unit of the last digit of a number as printed ('0.280', '1.23e-7', '1.23e+3')."""
    mantissa, _, exp = text.lstrip("~").partition("e")
    return 10.0 ** (-len(mantissa.partition(".")[2]) + (int(exp) if exp else 0))


node = pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")


@node
def test_page_script_hover_prints_three_digits_of_figure_1b(tmp_path):
    """The page's script itself (not a copy of it): Figure 1 (b)'s query 8, key 8 reads 0.280, not 0.2798."""
    values = tri_map(np.linspace(0.1, 0.3, 36))
    values[7, 7] = 0.27970
    se = np.where(np.isnan(values), np.nan, 0.0012345)
    got = run_page_script(values, se, tmp_path)
    assert got["tips"][-1] == "query i=8, key j=8: 0.280 \u00b1 0.00123 (SE)"
    assert got["labels"][-1] == "0.28"  # a cell's label: the same digits, trailing zeros dropped


@node
def test_page_script_prints_only_held_digits(tmp_path):
    """Hover over entries from 1e-4 to 1e4 and over a map whose range exceeds float16's (1 beside 1e-11, stored
    below its normal range): every digit printed is within half a unit of the stored value, and the stored value
    within half a unit of the true one."""
    rng = np.random.default_rng(1)
    wide = np.array([1.0, 1e-11, 3e-10, 2.5e-9, 7e-12, 0.5])  # 1e-11 to 1: more than float16's normal range
    for true in (rng.choice([-1, 1], 300) * 10 ** rng.uniform(-4, 4, 300), wide):
        values = tri_map(true)
        got, tips = stored(values), run_page_script(values, None, tmp_path)["tips"]
        for g, t, text in zip(got, true, tips):
            shown = text.split(": ")[1]
            u = printed_unit(shown)
            assert abs(float(shown.lstrip("~")) - g) <= u / 2 * (1 + 1e-9), (t, text)
            assert shown.startswith("~") or abs(g - t) < u / 2, (t, g, text)


# ---------------------------------------------------------------- 2. error bars of several series apart


def offsets(fig, xs) -> np.ndarray:
    """[series, x] the x offsets at which each series' points and error bars are drawn."""
    ax = fig.axes[0]
    return np.array([np.asarray(c.lines[0].get_xdata(), dtype=float) for c in ax.containers]) - np.asarray(xs)


@pytest.mark.parametrize("spacing", [1, 10])
def test_series_error_bars_at_one_x_sit_apart_in_proportion_to_the_x_spacing(spacing):
    """Four series at 30 layers (or keys 10 apart): neighbours at one x at least a tenth of the x spacing apart
    (0.06 x-units was about a pixel, all four bars on top of each other), and each x's group within half of it."""
    xs = [spacing * x for x in range(1, 31)]
    series = {f"series {k}": [k + x / spacing for x in xs] for k in range(4)}
    errors = {name: np.full(30, 0.5) for name in series}
    fig = plotting.line_plot(xs, series, "layer", "y", errors=errors)
    d = offsets(fig, xs)
    gaps = np.diff(np.sort(d, axis=0), axis=0)
    assert (gaps >= 0.1 * spacing).all() and (np.ptp(d, axis=0) <= 0.5 * spacing).all()
    assert np.allclose(d.sum(axis=0), 0)  # spread symmetrically about each x
    ax = fig.axes[0]
    fig.canvas.draw()
    px = ax.transData.transform(np.c_[xs[0] + d[:, 0], np.zeros(4)])[:, 0]
    assert np.diff(np.sort(px)).min() >= 2.5  # pixels: the bars are told apart
    plotting.plt.close(fig)


def test_series_on_a_log_x_axis_are_apart_by_a_factor():
    xs = [16, 64, 256, 1024]
    series = {name: [1.0, 0.3, 0.1, 0.05] for name in "abc"}
    fig = plotting.line_plot(xs, series, "d", "dev", logx=True, errors={k: np.full(4, 0.01) for k in series})
    drawn = np.array([c.lines[0].get_xdata() for c in fig.axes[0].containers], dtype=float)
    octaves = np.diff(np.log2(drawn), axis=0)  # neighbours, in octaves of x (the x values are 2 octaves apart)
    assert (octaves >= 0.2).all() and np.ptp(np.log2(drawn), axis=0).max() <= 1.0
    plotting.plt.close(fig)


# ---------------------------------------------------------------- 3. symlog axis: a margin below a 0


def test_a_zero_at_the_bottom_of_a_symlog_axis_is_drawn_whole():
    """The leakage architectures figure: a series at 0 with error bar [0, 4.54] sat on the axes' lower edge, its
    marker and cap half hidden. Its bottom and the top of the highest bar are now inside, a visible margin away."""
    series = {"nope": [0.0, 1.5, 3.0], "rope": [2.0, 5.0, 40.0]}
    errors = {"nope": np.array([[0.0, 0.5, 1.0], [4.54, 0.5, 1.0]]), "rope": np.ones(3)}
    fig = plotting.line_plot([1, 2, 3], series, "layer", "energy", errors=errors, logy=True)
    ax = fig.axes[0]
    assert ax.get_yscale() == "symlog"
    lo, hi = ax.get_ylim()
    assert lo < 0 and hi > 41
    fig.canvas.draw()
    box = ax.get_window_extent()
    y0, y1 = ax.transData.transform([(1, 0.0), (3, 41.0)])[:, 1]
    assert y0 - box.y0 >= 6 and box.y1 - y1 >= 6  # pixels: more than a marker's radius and a cap's width
    plotting.plt.close(fig)


def test_symlog_margin_is_even_on_the_drawn_scale():
    """A margin of the same share of the drawn height below the lowest bar end and above the highest, whatever
    their values (a negative lower end included)."""
    series = {"window": [-0.289, 3.0, 40.0], "rope": [0.5, 6.0, 80.0]}
    fig = plotting.line_plot([1, 2, 3], series, "layer", "energy", logy=True)
    ax = fig.axes[0]
    t = ax.yaxis.get_transform()
    lo, hi = t.transform(np.array(ax.get_ylim()))
    a, b = t.transform(np.array([-0.289, 80.0]))
    assert a - lo == pytest.approx(hi - b) and a - lo > 0.03 * (hi - lo)
    plotting.plt.close(fig)


# ---------------------------------------------------------------- 4. every series told apart


@pytest.mark.parametrize("models, quantities, paired", [(1, 25, False), (7, 4, True), (15, 3, True)])
def test_no_two_series_of_a_figure_are_drawn_alike(models, quantities, paired):
    """A card of 7 models drew 28 series in matplotlib's 10-colour cycle: three of them in one green. Every series now
    has its own (colour, line style, marker); paired, a model keeps one colour and a quantity one style."""
    from matplotlib.colors import to_rgba

    names = [f"q{q}, m{m}" for m in range(models) for q in range(quantities)]
    series = {name: [float(i), i + 1.0, i + 2.0] for i, name in enumerate(names)}
    fig = plotting.line_plot([1, 2, 3], series, "layer", "y", errors={k: np.full(3, 0.1) for k in series},
                             paired=paired)
    lines = {c.get_label(): c.lines[0] for c in fig.axes[0].containers}
    look = {n: (to_rgba(ln.get_color()), str(ln.get_linestyle()), ln.get_marker()) for n, ln in lines.items()}
    assert len(set(look.values())) == len(names)
    if paired:
        for m in range(models):
            assert len({look[f"q{q}, m{m}"][0] for q in range(quantities)}) == 1
        for q in range(quantities):
            assert len({look[f"q{q}, m{m}"][1:] for m in range(models)}) == 1
    plotting.plt.close(fig)
