"""Run directories for the architecture comparison: the parameter-free stack (`leakage-stack`) and a figure of
component shares by depth across any leakage runs (`leakage-compare`)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from poslens.analyses.leakage import flow
from poslens.analyses.leakage.figures import FIGURE_SHARES as SHARES
from poslens.analyses.leakage.figures import architecture_figure
from poslens.errors import UsageError, check_duration, check_int, check_memory
from poslens.io.results import Run, check_complete, load, run_directory, write_run
from poslens.stack.config import StackConfig, check_window
from poslens.stack.simulate import BLOCK


def check_stack_options(o) -> StackConfig:
    """Every option of `leakage-stack` (`StackLeakageOptions`), before any work; returns the base stack.

    window: 1 <= window <= n (None: n // 4). With samples > 0 the Monte Carlo intervals need at least 2 groups,
    each with data: blocks of BLOCK samples go to the groups in turn, so samples must fill one block per group.
    The Monte Carlo's memory (one block of [layers, BLOCK, n, n] float64 scores) must fit."""
    base = StackConfig(n=o.n, d=o.d, alpha=o.alpha, layers=o.layers)
    if o.window is not None:
        check_window(o.window, base.n)
    for name in flow.ARCHITECTURES:  # the RoPE configs (ntk_scaling, an even d) checked before the first is run
        flow.architecture(name, base, o.ntk_scaling, o.window)
    samples = check_int("samples", o.samples, 0)
    check_int("seed", o.seed, 0)
    if samples:
        groups = check_int("groups", o.groups, 2)
        blocks = -(-samples // BLOCK)
        if blocks < groups:
            raise UsageError(f"samples {samples} fill {blocks} block(s) of {BLOCK}, fewer than groups ({groups}): "
                             f"each group needs a block for the intervals; use samples >= {groups * BLOCK} or "
                             f"groups <= {blocks}" + (" (at least 2)" if blocks < 2 else ""), param="samples")
        check_memory((base.layers + 4) * BLOCK * base.n ** 2 * 8, f"the Monte Carlo (n={base.n}, layers="
                     f"{base.layers}, {BLOCK} samples at a time)", "use a smaller n or fewer layers (or samples 0)")
        check_duration(3 * base.operations(samples), f"the Monte Carlo of three architectures with {samples:,} "
                       f"samples (n={base.n}, d={base.d}, {base.layers} layers)", "lower samples")
    return base


def run_stack_leakage(o, out: str, force: bool = False) -> Path:
    """Exact and Monte Carlo splits of the three architectures, figures `architectures_exact` / `_monte_carlo`.
    Every option is checked, and `out` taken (its lock held), before any work."""
    started = time.perf_counter()
    base = check_stack_options(o)
    with run_directory(out, force) as tmp:
        res = flow.compare(base, o.samples, ntk_scaling=o.ntk_scaling, window=o.window, groups=o.groups,
                           seed=o.seed)
        tensors, metrics, exact_fig, mc_fig = _collect(res)
        architecture_figure(exact_fig, tmp / "figures", "architectures_exact", "stack, d -> inf")
        if mc_fig:
            architecture_figure(mc_fig, tmp / "figures", "architectures_monte_carlo",
                                f"stack, d = {o.d}, {o.samples} samples")
        write_run(tmp, {k: torch.as_tensor(v).float() for k, v in tensors.items()},
                  {"kind": "leakage-stack", "config": vars(o) if not hasattr(o, "__dataclass_fields__")
                   else {k: getattr(o, k) for k in o.__dataclass_fields__}, "metrics": metrics,
                   "timings": {"seconds": time.perf_counter() - started}})
    return Path(out).expanduser().absolute()


def stack_summary_lines(metrics: dict) -> list[str]:
    """What `poslens leakage-stack` prints, from its run.json metrics: per architecture and layer (from 1), the shares
    of the non-relative energy, exact (d -> infinity) and, where run, Monte Carlo with its interval."""
    names = {"share_mask_only": "mask-only", "share_residual": "residual", "share_cross": "interaction"}
    lines = []
    for arch, entry in metrics["architectures"].items():
        exact, mc = entry["exact"], entry.get("monte_carlo") or {}
        lines.append(f"{arch}: shares of the non-relative energy per layer (exact, d -> inf"
                     + ("; Monte Carlo with its interval" if mc else "") + ")")
        for layer in range(len(exact["share_mask_only"])):
            parts = []
            for key, name in names.items():
                text = f"{name} {exact[key][layer]:.3g}"
                if key in mc:
                    m = mc[key]
                    text += f" (MC {m['value'][layer]:.3g} [{m['lo'][layer]:.3g}, {m['hi'][layer]:.3g}])"
                parts.append(text)
            lines.append(f"  layer {layer + 1}: " + ", ".join(parts))
    return lines


def _collect(res: dict) -> tuple[dict, dict, dict, dict]:
    """From `flow.compare`'s result: the tensors, the metrics and the two figures' series (exact, Monte Carlo)."""
    tensors, metrics = {}, {"architectures": {}}
    exact_fig, mc_fig = {}, {}
    for arch, r in res.items():
        entry = {"config": r["config"], "exact": {k: v.tolist() for k, v in r["exact"].items()}}
        for k, v in r["exact"].items():
            tensors[f"{arch}/exact/{k}"] = v
        exact_fig[arch] = {k: r["exact"][k] for k in SHARES}
        if "monte_carlo" in r:
            mc = r["monte_carlo"]
            entry["monte_carlo"] = {k: {s: t.tolist() for s, t in v.items()} for k, v in mc.items()}
            mc_fig[arch] = {}
            for k in SHARES:
                v = mc[k]
                mc_fig[arch][k] = v["value"]
                mc_fig[arch][f"{k}_err"] = torch.stack([v["value"] - v["lo"], v["hi"] - v["value"]]).abs()
                for s, t in v.items():
                    tensors[f"{arch}/monte_carlo/{k}_{s}"] = t
        metrics["architectures"][arch] = entry
    # the same per-layer layout as `leakage` runs, for leakage-compare (exact split, all queries)
    metrics["per_layer_all"] = {f"attn/{k}": {"value": res["standard"]["exact"][k].tolist()} for k in SHARES}
    return tensors, metrics, exact_fig, mc_fig


def shares(run: Run) -> dict[str, np.ndarray]:
    """The mask-only and residual shares per layer of a `leakage` or `leakage-stack` run (all queries, key 0 in),
    with their interval half-widths where the run has them; a one-line UsageError when the run holds none."""
    kind = run.meta.get("kind")
    if kind not in ("leakage", "leakage-stack"):
        raise UsageError(f"{run.path} is a {kind!r} run; leakage-compare needs runs of `poslens leakage` or "
                         "`poslens leakage-stack`")
    per = run.metrics.get("per_layer_all")
    entry = {}
    for key in SHARES:
        e = per.get(f"attn/{key}") if isinstance(per, dict) else None
        try:
            value = np.asarray(e["value"], dtype=float)
            bounds = [np.asarray(e[b], dtype=float) for b in ("lo", "hi") if b in e]
        except (TypeError, KeyError, ValueError):
            raise UsageError(f"{run.path}: its {kind} run.json has no per-layer decomposition (metrics.per_layer_all."
                             f"attn/{key}; runs of earlier releases had the gauge-dependent split); rerun "
                             f"`poslens {kind}` on it") from None
        if value.ndim != 1 or any(b.shape != value.shape for b in bounds) or not np.isfinite(value).any():
            raise UsageError(f"{run.path}: metrics.per_layer_all.attn/{key} is not a list of per-layer numbers "
                             f"(shape {value.shape}, {int(np.isfinite(value).sum())} finite); rerun `poslens {kind}`")
        entry[key] = value
        if len(bounds) == 2:
            entry[f"{key}_err"] = np.abs(np.stack([value - bounds[0], bounds[1] - value]))
    return entry


def compare_runs(runs: list[str], out: str, labels: list[str] | None = None, force: bool = False) -> Path:
    """One figure of the mask-only and residual shares by depth of each run (`leakage` or `leakage-stack`)."""
    if not runs:
        raise UsageError("runs: give at least one run directory of `poslens leakage` or `leakage-stack`")
    if labels is not None and len(labels) != len(runs):
        raise UsageError(f"labels: {len(labels)} labels for {len(runs)} runs; give one per run")
    started = time.perf_counter()
    with run_directory(out, force, inputs=runs) as tmp:
        series = {}
        for k, path in enumerate(runs):
            run = load(path, tensors=False)
            check_complete(path)  # its tensors are not read here, but a run cut short is not a run
            entry = shares(run)  # a run of another kind is refused first: no label would make it one
            name = labels[k] if labels else (run.config.get("model") or "stack (standard RoPE, exact)")
            if name in series:
                raise UsageError(f"labels: two runs would both be labelled {name!r} (the second is {path}); give "
                                 "labels, one per run")
            series[name] = entry
        architecture_figure(series, tmp / "figures", "architectures", "all queries")
        listed = {k: {s: v.tolist() for s, v in e.items()} for k, e in series.items()}
        write_run(tmp, {}, {"kind": "leakage-compare",
                            "config": {"runs": [str(Path(r).expanduser().absolute()) for r in runs], "labels": labels},
                            "metrics": {"series": listed}, "timings": {"seconds": time.perf_counter() - started}})
    return Path(out).expanduser().absolute()
