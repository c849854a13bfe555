"""Run directories for the architecture comparison: the parameter-free stack (`leakage-stack`) and a figure of
component shares by depth across any leakage runs (`leakage-compare`)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from poslens.analyses.leakage import flow
from poslens.analyses.leakage.figures import architecture_figure
from poslens.errors import UsageError
from poslens.io.results import load, run_directory, write_run
from poslens.stack.config import StackConfig


def run_stack_leakage(o, out: str, force: bool = False) -> Path:
    """Exact and Monte Carlo splits of the three architectures, figures `architectures_exact` / `_monte_carlo`."""
    started = time.perf_counter()
    base = StackConfig(n=o.n, d=o.d, alpha=o.alpha, layers=o.layers)
    res = flow.compare(base, o.samples, ntk_scaling=o.ntk_scaling, window=o.window, groups=o.groups, seed=o.seed)
    tensors, metrics = {}, {"architectures": {}}
    exact_fig, mc_fig = {}, {}
    for arch, r in res.items():
        entry = {"config": r["config"], "exact": {k: v.tolist() for k, v in r["exact"].items()}}
        for k, v in r["exact"].items():
            tensors[f"{arch}/exact/{k}"] = v
        exact_fig[arch] = {k: r["exact"][k] for k in ("share_logit", "share_partition")}
        if "monte_carlo" in r:
            mc = r["monte_carlo"]
            entry["monte_carlo"] = {k: {s: t.tolist() for s, t in v.items()} for k, v in mc.items()}
            mc_fig[arch] = {}
            for k in ("share_logit", "share_partition"):
                v = mc[k]
                mc_fig[arch][k] = v["value"]
                mc_fig[arch][f"{k}_err"] = torch.stack([v["value"] - v["lo"], v["hi"] - v["value"]]).abs()
                for s, t in v.items():
                    tensors[f"{arch}/monte_carlo/{k}_{s}"] = t
        metrics["architectures"][arch] = entry
    # the same per-layer layout as `leakage` runs, for leakage-compare (exact split, all queries)
    metrics["per_layer_all"] = {f"split/{k}": {"value": res["standard"]["exact"][k].tolist()}
                                for k in ("share_logit", "share_partition")}
    with run_directory(out, force) as tmp:
        architecture_figure(exact_fig, tmp / "figures", "architectures_exact",
                            "stack, d -> inf")
        if mc_fig:
            architecture_figure(mc_fig, tmp / "figures", "architectures_monte_carlo",
                                f"stack, d = {o.d}, {o.samples} samples")
        write_run(tmp, {k: torch.as_tensor(v).float() for k, v in tensors.items()},
                  {"kind": "leakage-stack", "config": vars(o) if not hasattr(o, "__dataclass_fields__")
                   else {k: getattr(o, k) for k in o.__dataclass_fields__}, "metrics": metrics,
                   "timings": {"seconds": time.perf_counter() - started}})
    return Path(out).expanduser().absolute()


def compare_runs(runs: list[str], out: str, labels: list[str] | None = None, force: bool = False) -> Path:
    """One figure of the logit and mask shares by depth of each run (`leakage` or `leakage-stack`)."""
    if labels is not None and len(labels) != len(runs):
        raise UsageError(f"labels: {len(labels)} labels for {len(runs)} runs; give one per run")
    series = {}
    for k, path in enumerate(runs):
        run = load(path, tensors=False)
        if run.meta.get("kind") not in ("leakage", "leakage-stack"):
            raise UsageError(f"{path} is a {run.meta.get('kind')!r} run; leakage-compare needs leakage runs")
        per = run.metrics["per_layer_all"]
        name = labels[k] if labels else (run.config.get("model") or "stack (standard RoPE, exact)")
        entry = {}
        for key in ("share_logit", "share_partition"):
            e = per[f"split/{key}"]
            entry[key] = np.asarray(e["value"], dtype=float)
            if "lo" in e:
                entry[f"{key}_err"] = np.abs(np.stack([entry[key] - np.asarray(e["lo"], dtype=float),
                                                       np.asarray(e["hi"], dtype=float) - entry[key]]))
        series[name] = entry
    with run_directory(out, force) as tmp:
        architecture_figure(series, tmp / "figures", "architectures", "all queries")
        listed = {k: {s: v.tolist() for s, v in e.items()} for k, e in series.items()}
        write_run(tmp, {}, {"kind": "leakage-compare", "config": {"runs": runs, "labels": labels},
                            "metrics": {"series": listed}})
    return Path(out).expanduser().absolute()
