"""Kim et al. (2025), Section 5.1 and Appendix D: the parameter-free stack with RoPE, with and without the mask."""

from __future__ import annotations

import numpy as np

from poslens.maps import diagonal_normalise, quantile_limits, toeplitz_residual
from poslens.report.claims import Claim, Test, num
from poslens.report.context import est_text, joint, setting, test_of
from poslens.report.section import Panel, Section, section
from poslens.report.sections import measures as ms
from poslens.report.sections.figures import heatmaps
from poslens.report.sections.nope import layer1_context, offdiag_note, pattern_limits
from poslens.stack.config import StackConfig

NO_PATTERN = 0.01  # "no such pattern without the mask": under 1% of the masked stack's non-relative power
LEFT = (slice(25, None), slice(0, 5))  # queries i >= 26, keys j <= 5: the "left portion" of Figure 4


def figure(ctx, stem: str, cfg: StackConfig, caption: str):
    """A row of raw maps and a row of diagonal-normalised maps (the paper's Figure 4 layout)."""
    mc, gf = ctx.mc(cfg), ctx.gf(cfg)
    causal = cfg.mask != "none"
    panels = [Panel(f"layer {k + 1}", mc.mean[k], mc.se[k], pattern_limits(mc.mean[k], gf.scores[k], cfg))
              for k in range(cfg.layers)]
    norm = diagonal_normalise(mc.mean, causal=causal)
    panels += [Panel(f"layer {k + 1}, diagonal-normalised", norm[k], mc.se[k], quantile_limits(norm[k]))
               for k in range(cfg.layers)]
    ctx.keep(f"rope/{stem}", {"scores_mean": mc.mean, "scores_se": mc.se})
    name = stem.replace("figure", "Figure ")
    exact = np.nanmax(np.abs(diagonal_normalise(gf.scores, causal=causal)), axis=(1, 2))
    noise = np.nanmedian(mc.se, axis=(1, 2))
    flat = [f"layer {k + 1} (exact limit " + ("exactly 0" if exact[k] == 0 else f"at most {exact[k]:.1e}")
            + f", standard errors about {noise[k]:.1e})"
            for k in range(cfg.layers) if exact[k] < noise[k]]
    low = np.tril_indices(gf.scores.shape[-1], -1)
    constant = any(np.ptp(np.asarray(gf.scores[k])[low]) < 1e-9 for k in range(cfg.layers))  # as pattern_limits
    return heatmaps(ctx, stem, panels, caption + " Top row: the mean scores. " + offdiag_note(False, constant)
                    + " Bottom row: each diagonal minus its mean (a relative map normalises to 0); colour limits at "
                    "its 1% and 99% quantiles"
                    + (", so a panel whose exact limit (Gram flow) is below the Monte Carlo noise shows the noise "
                       "stretched over the whole scale: " + "; ".join(flat) if flat else "")
                    + ".",
                    suptitle=f"{name}: {setting(cfg)}", row_labels=["mean scores", "diagonal-normalised"])


@section("rope", "RoPE: Monte Carlo (Section 5.1, Appendix D)", quick={"samples": 10_000},
         full={"samples": 100_000})
def build(ctx, size: dict) -> Section:
    s = Section("RoPE: the causal mask makes RoPE's relative pattern non-relative (Kim et al., Section 5.1, "
                "Appendix D)",
                f"Eq. 1 stack with RoPE (theta 10,000, half-split pairs as in Llama; values un-rotated), l2, n = 50, "
                f"d = 64, {ctx.samples:,} samples per setting in 20 seeded sub-runs (95% jackknife intervals over 10 "
                "groups), with the Gram flow (d -> infinity) beside it. 'Diagonal-normalised' maps subtract each "
                "diagonal's mean: a relative (Toeplitz) map normalises to zero. The maps are re-drawn by "
                f"`poslens simulate --pe rope --alpha A --samples {ctx.samples}` (A = 0 for Figure 4, 0.5 for "
                "Figure 9; add `--mask none` for Figure 10).")
    c0, c5, enc = (StackConfig(positional="rope"), StackConfig(positional="rope", alpha=0.5),
                   StackConfig(positional="rope", mask="none"))
    mc, gf = ctx.mc(c0), ctx.gf(c0).scores
    s.context.append(layer1_context(mc, "RoPE, alpha = 0", "Section 5.1, Figure 4, after Barbero et al."))
    rel = mc.pooled(ms.relative_size)
    grow = mc.pooled(lambda m: ms.relative_size(m)[1:3] - ms.relative_size(m)[0:2])
    s.claims.append(Claim(
        "kim-51-relative-emerges", "kim2025", "Section 5.1, Figure 4",
        "from the second layer a vivid relative pattern emerges (the first layer mixes the inputs); by the third "
        "layer it becomes clearer",
        (test_of("relative part's size (std of the diagonal means over the entries j < i), layer 2 - layer 1", grow,
                 ">", index=0),
         test_of("relative part's size, layer 3 - layer 2", grow, ">", index=1)),
        measured="relative part's size by layer: " + ", ".join(f"layer {k + 1} {est_text(rel, k)}"
                                                               for k in range(c0.layers)),
        figure="Figure 4", command=ctx.remeasure("kim-51-relative-emerges")))
    power = mc.estimate(lambda a, b: ms.pattern_power(a, b))
    variance = ms.map_variance(mc.mean)  # per layer: the scale a negligible pattern is measured against
    exact = [toeplitz_residual(gf[k])["max_abs"] for k in range(c0.layers)]
    s.claims.append(Claim(
        "kim-51-non-relative", "kim2025", "Section 5.1, Figure 4",
        "with the causal mask, RoPE's relative pattern becomes non-relative from the second layer on",
        tuple(test_of(f"layer {k + 1}: noise-free mean square of the diagonal-normalised map, E[P(m_a) P(m_b)]",
                      power, ">", index=k, margin=ms.NEGLIGIBLE * float(variance[k])) for k in (1, 2, 3)),
        measured="largest |diagonal-normalised entry| of the exact limit (Gram flow) by layer: "
                 + ", ".join(f"layer {k + 1} {num(x)}" for k, x in enumerate(exact))
                 + ". The product of two independent halves has no noise term, so a lower bound above 0 is a resolved "
                   "pattern.", figure="Figure 4", command=ctx.remeasure("kim-51-non-relative")))
    left = mc.pooled(lambda m: ms.block_mean(m, *LEFT)[1:])
    s.claims.append(Claim(
        "kim-51-left-darker", "kim2025", "Section 5.1, Figure 4",
        "as without positional encoding, the left portion of the maps (distant keys of later queries) is darker",
        tuple(test_of(f"layer {k + 2}: mean diagonal-normalised score over queries i >= 26 and keys j <= 5", left,
                      "<", index=k) for k in range(3)),
        measured="'darker' read as: below 0 in the diagonal-normalised map, i.e. below the mean of the same "
                 "diagonals (each diagonal's mean is subtracted, so 0 is that average); exact limit (Gram flow), "
                 "same block: " + ", ".join(
            f"layer {k + 2} {num(float(ms.block_mean(gf[k + 1], *LEFT)))}" for k in range(3)),
        figure="Figure 4", command=ctx.remeasure("kim-51-left-darker")))
    ratio = joint(lambda r: ms.pattern_power(*r[1])[1:].sum() / ms.pattern_power(*r[0])[1:].sum(), mc,
                  ctx.mc(enc)).within(0.0)  # a ratio of mean squares
    gfe = max(toeplitz_residual(x, causal=False)["max_abs"] for x in ctx.gf(enc).scores)
    s.claims.append(Claim(
        "kim-51-no-mask-stays-relative", "kim2025", "Section 5.1, Appendix D, Figure 10",
        "such patterns do not appear without a causal mask (a Transformer encoder): RoPE stays relative",
        (test_of("noise-free non-relative power, layers 2-4, without the mask / with it", ratio, "<", NO_PATTERN),
         Test("largest |diagonal-normalised entry| without the mask / with it, exact limit", gfe / max(exact), "<",
              NO_PATTERN)),
        measured=f"'no pattern' read as: under {NO_PATTERN:.0%} of the masked stack's. The exact unmasked limit keeps "
                 f"a boundary effect of the finite sequence ({gfe:.1e}).",
        figure="Figure 10", command=ctx.remeasure("kim-51-no-mask-stays-relative")))
    s.figures.append(figure(ctx, "figure4", c0, "Figure 4: RoPE, l2, alpha = 0, causal mask."))
    s.figures.append(figure(ctx, "figure9", c5, "Figure 9: RoPE, l2, alpha = 0.5, causal mask."))
    s.figures.append(figure(ctx, "figure10", enc, "Figure 10: RoPE, l2, alpha = 0, no mask (an encoder): the "
                            "diagonal-normalised maps are noise."))
    return s

