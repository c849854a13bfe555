"""poslens's own check: the Monte Carlo converges to the Gram flow (the exact d -> infinity limit) as d grows."""

from __future__ import annotations

import numpy as np
import torch

from poslens.report.claims import Claim
from poslens.report.context import joint, test_of
from poslens.report.section import Section, section
from poslens.report.sections import measures as ms
from poslens.report.sections.figures import lines
from poslens.stack.config import StackConfig, visible

SHRINK = 4.0  # a 1/d finite-width bias shrinks 16-fold from d = 16 to 256; more than 4-fold leaves room for noise


def shrinkage(first, gf_first, last, gf_last, vis: np.ndarray):
    """Largest |Monte Carlo - Gram flow| over the visible entries at one width over that at another, with its
    delete-one-group jackknife interval (group g of both widths dropped at once: `joint`)."""
    vis = torch.as_tensor(vis)

    def largest(pair, gf) -> torch.Tensor:
        return ((pair[0] + pair[1]) / 2 - torch.as_tensor(gf, dtype=torch.float64))[:, vis].abs().max()

    return joint(lambda r: largest(r[0], gf_first) / largest(r[1], gf_last), first, last)


@section("convergence", "Monte Carlo -> Gram flow convergence (poslens)",
         quick={"widths": (16, 64, 256), "samples": 2_000}, full={"widths": (16, 64, 256, 1024), "samples": 10_000})
def build(ctx, size: dict) -> Section:
    s = Section("The Monte Carlo converges to the Gram flow as d grows (a check of poslens)",
                "The Gram flow is the exact d -> infinity limit of the stack (docs/gramflow.md). The largest deviation "
                "of the Monte Carlo mean scores from it shrinks as the width grows, down to the Monte Carlo's own "
                f"noise; n = 24, 3 layers, {size['samples']:,} samples per width; error bars: the largest standard "
                "error.")
    ds, rows = tuple(size["widths"]), {}
    for name, base in (("NoPE, alpha 0.2", StackConfig(n=24, layers=3, alpha=0.2)),
                       ("RoPE, alpha 0", StackConfig(n=24, layers=3, alpha=0.0, positional="rope"))):
        vis = visible(base.n, base.mask, base.window)
        devs, ses, runs = [], [], []
        for d in ds:
            cfg = StackConfig(**{**base.to_dict(), "d": d})
            mc, gf = ctx.mc(cfg, size["samples"]), ctx.gf(cfg)
            devs.append(float(np.abs(mc.mean - gf.scores)[:, vis].max()))
            ses.append(float(mc.se[:, vis].max()))
            runs.append((mc, gf.scores))
        rows[name] = (devs, ses)
        test = test_of(f"largest |Monte Carlo - Gram flow| at d = {ds[0]} over that at d = {ds[-1]}",
                       shrinkage(*runs[0], *runs[-1], vis), ">", SHRINK)
        cid = "poslens-convergence-" + ("nope" if base.positional == "none" else "rope")
        resolve = ""
        if test.outcome() == "open" and test.value != SHRINK:
            resolve = (f"more Monte Carlo samples per width (the interval shrinks as 1/sqrt(samples)): about "
                       f"{size['samples'] * ms.need_factor(test.value, test.lo, test.hi, SHRINK):,.0f} for it to "
                       f"exclude {SHRINK:g} at its present estimate; this run used {size['samples']:,}")
        s.claims.append(Claim(
            cid, "poslens", "docs/gramflow.md", f"{name}: the Monte Carlo converges to the Gram flow as d grows",
            (test,),
            measured="largest deviation by d: " + ", ".join(f"d = {d}: {v:.4f}" for d, v in zip(ds, devs))
                     + f" (largest SE at d = {ds[-1]}: {ses[-1]:.1e}). Threshold: a 1/d bias shrinks "
                       f"{ds[-1] // ds[0]}-fold over these widths; {SHRINK:g}-fold leaves room for the noise floor.",
            resolve=resolve, figure="convergence to the infinite-width limit", command=ctx.remeasure(cid),
            key=f"{test.value:.1f}-fold [{test.lo:.1f}, {test.hi:.1f}]"))
    s.figures.append(lines(ctx, "convergence", ds, {k: v[0] for k, v in rows.items()},
                           "Largest deviation of the Monte Carlo maps from the Gram flow (n = 24, 3 layers) against "
                           "the hidden size d; error bars: the largest Monte Carlo standard error.",
                           "hidden size d", "largest |Monte Carlo - Gram flow|",
                           "Convergence to the infinite-width limit (l2, causal mask)", logx=True, logy=True,
                           errors={k: v[1] for k, v in rows.items()}))
    return s
