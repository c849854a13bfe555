"""Kim et al. (2025), Section 3 and Appendix A: the closed forms of the parameter-free stack, checked exactly.

Every number here is a float64 computation without sampling: the paper's printed formulas against the Gram flow
(the exact hidden-state Gram matrices of inputs whose Gram is exactly Eq. 2) and against exact differences.
"""

from __future__ import annotations

import math

import numpy as np

from poslens import plotting
from poslens.report.claims import Claim, Reading, Test
from poslens.report.section import Figure, Panel, Section, section
from poslens.report.sections.figures import lines, profiles
from poslens.stack import theory
from poslens.stack.config import StackConfig

ALPHAS = tuple(round(a, 2) for a in np.arange(0.0, 1.0, 0.05))  # 0, 0.05, ..., 0.95
N = 50  # the paper's sequence length
LONG = 1000  # positions checked for the monotonicity of h and h'
EXACT = 1e-12  # float64 agreement: a few hundred roundings of numbers of order 1
WHERE = "alpha in {0, 0.05, ..., 0.95}"
PRIME_G, PRIME_H = "g'", "h'2"  # keys of the no-residual errors


def printed_a1(j: np.ndarray, a: float) -> np.ndarray:
    """Appendix A.1's h(j+1)^2 - h(j)^2 exactly as printed."""
    e, b = math.e, math.exp(a)
    den = (e + j * b) ** 2 * (e + (j - 1) * b) ** 2
    return (((a - 1) * b**4 + 2 * (a - 1) * b**3 * e) * j**2
            + ((2 * a - 6) * b * e**3 + 2 * (a - 1) * b**3 * e + (a - 1) * b**4) * j
            + (2 * a - 4) * b * e**3 + (4 - 2 * a) * b**2 * e**2) / den


def printed_a2(i: np.ndarray, a: float) -> np.ndarray:
    """Appendix A.2's h'(i+1)^2 - h'(i)^2 exactly as printed."""
    e, b = math.e, math.exp(a)
    return (a - 1) * b * (2 * e**3 - 2 * e**2 * b * (i - 1) + b**3 * i * (i - 1)) / (
        (e + i * b) ** 2 * (e + (i - 1) * b) ** 2)


def corrected_coefficients(a: float) -> tuple[float, float, float]:
    """Coefficients (j^2, j, 1) of the corrected A.1 numerator (poslens.stack.theory.h_sq_step)."""
    e, b = math.e, math.exp(a)
    return ((a - 1) * (b**4 + 2 * e * b**3), (1 - a) * (b**4 + 2 * e * b**3 - 6 * e**2 * b**2),
            4 * (1 - a) * e**2 * b * (b - e))


def _ranges(mask: np.ndarray, start: int = 1) -> str:
    """'6..10' for the positions (from `start`) where mask is True, comma-separated runs."""
    idx = np.flatnonzero(mask) + start
    if idx.size == 0:
        return "none"
    runs, first, prev = [], idx[0], idx[0]
    for k in idx[1:]:
        if k != prev + 1:
            runs.append((first, prev))
            first = k
        prev = k
    runs.append((first, prev))
    return ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in runs)


@section("closed-forms", "closed forms (Section 3, Appendix A)")
def build(ctx, size: dict) -> Section:
    s = Section("Closed forms: the causal mask alone makes layer-2 scores position dependent (Kim et al., Section 3 "
                "and Appendix A)",
                "Parameter-free stack of Eq. 1 (l2 normalisation, residual, causal mask, no positional encoding) on "
                "unit inputs with pairwise inner product alpha (Eq. 2). The paper's printed formulas are compared, in "
                "float64, with the Gram flow: the exact Gram matrices of the hidden states of such inputs, computed by "
                "matrix products without any formula of the paper (docs/gramflow.md). No sampling: every test is "
                "exact.")
    s.context.append((
        "statements of the paper that are not rows",
        "its summaries of other work (Section 2 and the introduction: Haviv et al.'s 'resembles absolute positional "
        "encoding', Kazemnejad et al.'s pattern 'closely resemble[s] ... T5's relative positional embeddings', Chi et "
        "al.'s variance growing with position, Zuo et al.'s Figure 1 of hidden states more similar for closer pairs, "
        "with which Section 4.1 says its pattern 'aligns') are attributions to those papers, not results of this one; "
        "poslens tests the results they rest on where it can (Haviv et al.'s and Kazemnejad et al.'s own claims have "
        "rows in the sections on trained models; cosine similarity after l2 normalisation is the stack's score, the "
        "rows of Section 4.1). Section 4.1's explanation of the alpha = 0.2 saturation ('the numerator and "
        "denominator share identical highest-order terms in g(i)') is the mechanism behind kim-41-alpha02-independent-"
        "of-i, which tests its consequence; the closed forms themselves are the rows of this section"))
    p = np.arange(1, N + 1, dtype=np.float64)
    err = {"g": 0.0, "h2": 0.0, "eq4": 0.0, PRIME_G: 0.0, PRIME_H: 0.0}
    low = np.tril(np.ones((N, N), dtype=bool), -1)
    smallest = math.inf
    for a in ALPHAS:
        for residual, gk, hk in ((True, "g", "h2"), (False, PRIME_G, PRIME_H)):
            gram = ctx.gf(StackConfig(n=N, alpha=float(a), layers=2, residual=residual)).gram[1]
            g = theory.g(p, a) if residual else theory.g_prime(p, a)
            h = theory.h(p, a) if residual else theory.h_prime(p, a)
            err[gk] = max(err[gk], float(np.abs(gram - g[:, None])[low].max()))
            err[hk] = max(err[hk], float(np.abs(np.diag(gram) - h**2).max()))
        exact = ctx.gf(StackConfig(n=N, alpha=float(a), layers=2)).scores[1]
        m = theory.layer2_scores(N, a)
        err["eq4"] = max(err["eq4"], float(np.nanmax(np.abs(exact - m))))
        smallest = min(smallest, min(float(np.diff(m[i, : i + 1]).min()) for i in range(1, N)))
    s.claims.append(Claim(
        "kim-s3-eq3-eq4", "kim2025", "Section 3, Eq. 3-4",
        "after layer 1, <x_i, x_j> = g(i) for i > j, ||x_i||^2 = h(i)^2 (Eq. 3), and the layer-2 score is "
        "<y_i, y_j> = g(i) / (h(i) h(j)) (Eq. 4)",
        (Test("largest |g(i) - exact <x_i, x_j>|", err["g"], "<", EXACT),
         Test("largest |h(i)^2 - exact ||x_i||^2|", err["h2"], "<", EXACT),
         Test("largest |Eq. 4 - exact layer-2 score|", err["eq4"], "<", EXACT)),
        measured=f"n = {N}, {WHERE}; exact = the Gram flow in float64. A tolerance of {EXACT:g} allows a few hundred "
                 "float64 roundings.", figure="Figure 1", key=f"{max(err['g'], err['h2'], err['eq4']):.1e}"))
    s.claims.append(Claim(
        "kim-a2-gprime-hprime", "kim2025", "Appendix A.2",
        "without the residual, <x_i, x_j> = g'(i) = (e alpha + e^alpha (1 + alpha (i-2))) / (e + (i-1) e^alpha) "
        "and ||x_i||^2 = h'(i)^2 as printed",
        (Test("largest |g'(i) - exact <x_i, x_j>|", err[PRIME_G], "<", EXACT),
         Test("largest |h'(i)^2 - exact ||x_i||^2|", err[PRIME_H], "<", EXACT)),
        measured=f"n = {N}, {WHERE}, no residual; exact = the Gram flow. (The printed layer "
                 "'Softmax(Causal(YY^T) Y)' is read as Softmax(Causal(YY^T)) Y, the only reading that typechecks.)",
        key=f"{max(err[PRIME_G], err[PRIME_H]):.1e}"))
    s.claims.append(gprime_weak_claim())
    s.claims += appendix_claims()
    s.claims.append(Claim(
        "kim-s3-layer2-increasing", "kim2025", "Section 3",
        "for any fixed query i, the layer-2 score strictly increases with the key j <= i (closer keys score higher; "
        "j = i - 1 included: <y_i, y_{i-1}> < 1)",
        (Test("smallest step s(i, j+1) - s(i, j), j < i", smallest, ">", 0.0),),
        measured=f"Eq. 4 at n = {N}, {WHERE}: every step of every row, the last one to the diagonal included.",
        figure="layer-2 scores against the key", key=f"{smallest:.3g}"))
    if ctx.draw:
        s.figures.append(figure1(ctx))
    xs = np.arange(1, 51)
    s.figures.append(lines(ctx, "appendix_a1_h", xs, {f"alpha={a:g}": theory.h(xs, a) for a in (0.0, 0.2, 0.5, 0.8)},
                           "h(j) = ||x_j^(1)|| of Eq. 3 for several alpha: strictly decreasing in j (Appendix A.1).",
                           "position j", "h(j)", "h(j), NoPE, l2, causal mask"))
    p = np.arange(2, N + 1, dtype=np.float64)
    s.figures.append(lines(ctx, "appendix_a2_gprime", p,
                           {k: v / v.mean() for a in (0.0, 0.2, 0.5) for k, v in (
                               (f"g'(i), alpha={a:g}", theory.g_prime(p, a)),
                               (f"h'(i)^2, alpha={a:g}", theory.h_prime(p, a) ** 2))},
                           "Appendix A.2 without the residual: g'(i), every off-diagonal entry <x_i, x_j> of row i "
                           "(no j in it; solid), beside h'(i)^2, the diagonal ||x_i||^2 (dashed), one colour per "
                           "alpha, for i = 2..50, each divided by its mean over i (exact, log scale): the spread the "
                           "row's coefficients of variation compare. g' varies less than the diagonal but is not flat "
                           "at small alpha (kim-a2-gprime-weak).",
                           "query i", "value / its mean over i", "g'(i) beside h'(i)^2, NoPE, l2, no residual",
                           logy=True, paired=True))
    maps = [theory.layer2_scores(N, a) for a in (0.0, 0.2)]
    s.figures.append(profiles(ctx, "layer2_profiles", maps, None, ["alpha = 0", "alpha = 0.2"],
                              "Layer-2 scores g(i)/(h(i)h(j)) (Eq. 4) against the key j < i for three queries (the "
                              "diagonal, 1, left out). Exact, so no error band.",
                              suptitle="Layer-2 scores against the key (Eq. 4, exact)"))
    return s


def cv(x: np.ndarray) -> float:
    """Coefficient of variation: standard deviation over |mean|."""
    return float(np.std(x) / abs(np.mean(x)))


FLAT = 0.1  # "weakly dependent" read in itself: varies over positions by less than a tenth of its mean (CV)


def gprime_weak_claim() -> Claim:
    """Section 4.2 / Appendix A.2: g'(i) (the off-diagonal of Figure 3 (c)) is nearly independent of j and only
    weakly dependent on i, next to h'(i)^2 (its diagonal), which decreases. Two readings, both exact: relative to
    the diagonal (as kim-42-c reads (c): a smaller coefficient of variation over i = 2..n), and in itself (a
    coefficient of variation below FLAT)."""
    p = np.arange(2, N + 1, dtype=np.float64)
    ratios = {a: cv(theory.g_prime(p, a)) / cv(theory.h_prime(p, a) ** 2) for a in ALPHAS}
    own = {a: cv(theory.g_prime(p, a)) for a in ALPHAS}
    worst, widest = max(ratios, key=ratios.get), max(own, key=own.get)
    spread = {a: float(theory.g_prime(p, a)[0] / theory.g_prime(p, a)[-1]) for a in (0.0, 0.05, 0.2)}
    return Claim(
        "kim-a2-gprime-weak", "kim2025", "Section 4.2 and Appendix A.2",
        "g'(i) is nearly independent of j and only weakly dependent on i, explaining the uniformity of the "
        "off-diagonal elements of Figure 3 (c), while h'(i) decreases strictly (the decline along the diagonal)",
        readings=(
            Reading("weakly next to the diagonal, the contrast the paper draws (as kim-42-c reads panel (c))",
                    (Test("largest, over alpha, of the coefficient of variation over i = 2..n of g'(i) over that "
                          "of h'(i)^2", ratios[worst], "<", 1.0),)),
            Reading(f"weakly in itself: g'(i) varies over i by less than {FLAT:g} of its mean",
                    (Test("largest, over alpha, of the coefficient of variation of g'(i) over i = 2..n", own[widest],
                          "<", FLAT),))),
        measured=f"n = {N}, {WHERE}, no residual, the closed forms (exact: kim-a2-gprime-hprime). 'Independent of j' "
                 "is exact: g'(i) has no j in it, and the Gram flow agrees with it for every j < i (a test of "
                 f"poslens, not a row). Next to the diagonal: largest ratio {ratios[worst]:.3f} at alpha = "
                 f"{worst:g} ({ratios[0.0]:.3f} at alpha = 0, {ratios[0.2]:.3f} at alpha = 0.2). In itself: "
                 f"coefficient of variation {own[widest]:.3f} at alpha = {widest:g} ({own[0.2]:.3f} at alpha = 0.2); "
                 "g'(2) / g'(n) = " + ", ".join(f"{v:.3g} at alpha = {a:g}" for a, v in spread.items())
                 + ". The first reading passes because the threshold is 'less variable than the diagonal': the ratio "
                 f"is {ratios[0.05]:.2f} at alpha = 0.05 and {ratios[0.2]:.2f} at 0.2 (a trained model's panel (a) "
                 "gives a small alpha: kim-42-a-near-orthogonal) and nears 1 only as alpha -> 1, where both are flat; "
                 "so g' varies less than the diagonal, not little. The "
                 "second reading's threshold is poslens's (the paper gives none), and its failure does not hang on it: "
                 f"any threshold below {own[widest]:.2f} fails at alpha = {widest:g}. That h'(i) decreases strictly "
                 "is kim-a2-hprime-decreasing's row; whether a trained model's panel (c) shows the uniform "
                 "off-diagonal is kim-42-c's.",
        figure="g'(i) beside h'(i)^2",
        key=f"next to the diagonal {ratios[worst]:.3f}; in itself {own[widest]:.3f}")


def appendix_claims() -> list[Claim]:
    """The two monotonicity claims with their printed differences (errata where the printed form is wrong)."""
    js = np.arange(1.0, 201.0)
    out = []
    for residual, cid, where, name, fn, printed in (
            (True, "kim-a1-h-decreasing", "Appendix A.1", "h(j)", theory.h, printed_a1),
            (False, "kim-a2-hprime-decreasing", "Appendix A.2", "h'(i)", theory.h_prime, printed_a2)):
        p = np.arange(1, LONG + 1, dtype=np.float64)
        worst_step = max(float(np.diff(fn(p, a)).max()) for a in ALPHAS)
        rel = max(float(np.max(np.abs(printed(js, a) / (fn(js + 1, a) ** 2 - fn(js, a) ** 2) - 1))) for a in ALPHAS)
        fixed = max(float(np.max(np.abs(theory.h_sq_step(js, a, residual=residual)
                                        / (fn(js + 1, a) ** 2 - fn(js, a) ** 2) - 1))) for a in ALPHAS)
        tests = [Test(f"largest step {name[:-3]}({name[-2]}+1) - {name}, {name[-2]} = 1..{LONG}", worst_step, "<", 0.0),
                 Test("largest relative error of the corrected difference (docs/gramflow.md)", fixed,
                      "<", 1e-9)]
        if residual:
            coef = max(max(corrected_coefficients(a)) for a in ALPHAS)
            tests.append(Test("largest coefficient of the corrected numerator (j^2, j, 1)", coef, "<", 0.0))
            wrong = "its j and constant coefficients are off"
            paper = ("printed numerator: ((a-1)e^{4a} + 2(a-1)e^{3a+1}) j^2 + ((2a-6)e^{a+3} + 2(a-1)e^{3a+1} + "
                     "(a-1)e^{4a}) j + (2a-4)e^{a+3} + (4-2a)e^{2a+2}")
        else:
            positive = _ranges(printed(js, 0.0) > 0)
            wrong = (f"the 2e^(2+alpha)(i-1) term has the wrong sign: as printed the difference is positive at "
                     f"alpha = 0 for i = {positive}, which would make h' increase there")
            paper = "printed numerator: (a-1) e^a (2e^3 - 2e^{2+a}(i-1) + e^{3a} i(i-1))"
        out.append(Claim(
            cid, "kim2025", where,
            f"{name} is strictly decreasing, shown by the printed closed form of {name[:-3]}({name[-2]}+1)^2 - "
            f"{name}^2 (negative for 0 <= alpha < 1)",
            tuple(tests), errata=(Test("largest relative error of the printed difference", rel, "<", 1e-9),),
            measured=f"{WHERE}; the printed difference against the exact one for {name[-2]} = 1..200: {wrong}; the "
                     "corrected form (docs/gramflow.md) is exact and negative, so the conclusion stands.",
            paper_number=paper, figure="h(j)" if residual else "", key=f"printed off by {rel:.2f} (relative)"))
    return out


def figure1(ctx):
    """Figure 1 at n = 8: layer-1 scores and attention, <x_i, x_j> after layer 1, layer-2 scores, with values."""
    n = 8
    g = ctx.gf(StackConfig(n=n, alpha=0.0, layers=2))
    low = np.tril(np.ones((n, n))) > 0
    maps = [g.scores[0], np.where(low, g.probs[0], np.nan), np.where(low, g.gram[1], np.nan), g.scores[1]]
    titles = ["(a) layer-1 scores", "(b) layer-1 attention", "(c) <x_i, x_j> after layer 1, before l2",
              "(d) layer-2 scores: closer keys higher"]
    lims = [(0.0, 1.0), (0.0, 1.0), plotting.offdiag_limits(maps[2]), plotting.offdiag_limits(maps[3])]
    fig, axes = plotting.plt.subplots(2, 2, figsize=(11, 10), constrained_layout=True)
    for ax, m, t, (lo, hi) in zip(axes.flat, maps, titles, lims):
        plotting.heatmap(ax, m, lo, hi, title=t, annotate=True, fontsize=9, one_based=True)
        ax.title.set_fontsize(12)
    fig.suptitle("Figure 1: NoPE, l2 norm, alpha = 0, causal mask, n = 8", fontsize=13)
    ctx.keep("figure1", {"layer1_scores": maps[0], "layer1_probs": g.probs[0], "gram1": g.gram[1],
                         "layer2_scores": maps[3]})
    return Figure(ctx.save(fig, "figure1"),
                  "Figure 1: the mechanism for n = 8, alpha = 0 (computed, not typed); positions from 1. In (c) and "
                  "(d) the colour scale spans the off-diagonal entries (the diagonal, h(i)^2 in (c) and 1 in (d), is "
                  "drawn at the top of the scale); the printed numbers are exact.",
                  [Panel(t, m, None, lim) for t, m, lim in zip(titles, maps, lims)], ncols=4)

