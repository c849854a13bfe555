"""The command-line side of the leakage analyses (registered in `poslens.cli.COMMANDS`): what `poslens leakage`
prints, and the options and handlers of `poslens leakage-stack` and `poslens leakage-compare RUN...`. Torch is
imported only inside the handlers."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from poslens.options import from_args, option


@dataclass
class StackLeakageOptions:
    """`leakage-stack`: the parameter-free comparison of standard RoPE, NTK-scaled RoPE and a sliding window."""

    n: int = option(64, help="tokens per sequence")
    d: int = option(64, help="hidden size of the Monte Carlo (the exact decomposition is d -> infinity)")
    alpha: float = option(0.2, help="mean inner product of the inputs")
    layers: int = option(6, help="layers")
    ntk_scaling: float = option(8.0, help="NTK factor s: base theta * s^(d/(d-2))")
    window: int | None = option(None, help="sliding window (default n // 4)")
    samples: int = option(2048, help="Monte Carlo samples (0: the exact decomposition only)")
    groups: int = option(8, help="groups for the jackknife intervals")
    seed: int = option(0, lo=0, help="random seed")


@dataclass
class LeakageCompareOptions:
    runs: list[str] = option(help="run directories of `poslens leakage` or `leakage-stack`", positional=True,
                             metavar="RUN")


FRACTIONS = ("scores/trf", "log_probs/trf")  # residual fractions of the scores and of log A


def _est(e: dict) -> str:
    v, lo, hi = e["value"], e["lo"], e["hi"]
    if v is None:
        return "undefined"
    return f"{v:.4g} [{lo:.4g}, {hi:.4g}]" if lo is not None else f"{v:.4g}"


def _table(by_scope: dict, names, scopes: dict, indent: str = "  ") -> list[str]:
    """Per scope, one row per metric: key 0 in and key 0 out side by side."""
    width = max(len(n) for n in names) + 2
    lines = []
    for scope, title in scopes.items():
        lines.append(f"{indent}{title:<{width}}  {'key 0 in':<32}  key 0 out")
        for n in names:
            cell = by_scope[scope][n]
            lines.append(f"{indent}  {n:<{width - 2}}  {_est(cell['key0_in']):<32}  {_est(cell['key0_out'])}")
    return lines


def summary_lines(meta: dict) -> list[str]:
    """What `poslens leakage` prints: every metric of the original pass over layers, key 0 in and out side by
    side; for every intervention and null the share of each energy it removes and the change of the fractions;
    the predecessor's test with its power; sinks and position 0."""
    m = meta["metrics"]
    scopes = {"early": f"early queries (i <= {m['domains']['early_queries']})", "all": "all queries"}
    lines = [f"original pass, over layers (energies summed over the {m['layers']} layers, other metrics averaged):"]
    lines += _table(m["original"]["over_layers"], m["metric_names"], scopes)
    for kind in ("interventions", "nulls"):
        for name, c in m[kind].items():
            lines.append(f"{kind[:-1]} {name}: {c['what']}")
            lines.append("  share of each energy removed, 1 - sum over layers E(pass) / E(original):")
            lines += _table(c["over_layers"]["removed"], m["energies"], scopes, "    ")
            lines.append("  change of the residual fractions, pass - original (layer mean):")
            lines += _table(c["over_layers"]["difference"], FRACTIONS, scopes, "    ")
            if "heads" in c:
                lines += _head_lines(c["heads"], scopes)
    for spec, c in m["nulls"].get("offset", {}).get("interventions", {}).items():
        lines.append(f"intervention {spec} on the offset null's windows, paired with it at document starts:")
        lines.append("  share of each energy removed inside the documents, 1 - sum over layers E(pass) / E(offset):")
        lines += _table(c["over_layers"]["removed"], m["energies"], scopes, "    ")
        lines.append("  removed at document starts minus removed inside the documents (paired by group):")
        lines += _table(c["paired"]["over_layers"]["removed"], m["energies"], scopes, "    ")
    pred = m.get("predecessor")
    if pred:
        pw = pred["power"]
        how = "exact" if pw["exact"] else f"{pw['permutations']:,} sign flips"
        lines.append(f"predecessor: {pred['significant']} of {pred['heads']} heads significant at BH {pred['fdr']} "
                     f"against the circular null ({how}, {pw['sequences']} sequences: smallest attainable p "
                     f"{pw['smallest_p']:.2g} vs BH's first threshold {pw['bh_first_threshold']:.2g}, "
                     f"{'detectable' if pw['detectable'] else 'NO head can be significant'})")
    from poslens.analyses.leakage.summary import sink_bounds

    s = m["sinks"]
    short = "" if s.get("rate_64") is None else f", {s['rate_64']:.3f} at 64 tokens"
    lines.append(f"sink rate {s['rate']:.3f} at {s['tokens']} tokens{short} (threshold {s['epsilon']}), "
                 f"{len(s['sink_heads'])} sink-reading heads" + (f"; {bounds}" if (bounds := sink_bounds(s)) else ""))
    spread = max((abs(x) for x in m["position0_spread"] if x is not None), default=float("nan"))
    lines.append(f"position 0's spread across inputs: at most {spread:.2g} over layers (0 by causality with a fixed "
                 "first token: a check, not a finding)")
    lines.append(f"intervals: {100 * m['level']:g}% jackknife over {m['groups']} groups of sequences, paired between "
                 "passes; run.json has every metric per layer")
    return lines


def _head_lines(h: dict, scopes: dict) -> list[str]:
    """An intervention's per-head contrast: heads whose removed share is resolved, the largest, the sink heads."""
    lines = [f"  per head, share of {h['energy']} removed ({scopes[h['scope']]}; an interval above 0 = removed, "
             "below 0 = added):"]
    for key0, title in (("key0_in", "key 0 in"), ("key0_out", "key 0 out")):
        c = h[key0]
        top = ", ".join(f"L{x['layer']}H{x['head']} {_est(x)}" for x in c["largest"][:3])
        lines.append(f"    {title}: {c['removed']} of {c['heads']} heads removed, {c['added']} added; largest {top}")
        if c["sink_heads"]:
            sinks = ", ".join(f"L{x['layer']}H{x['head']} (alpha_0 {x['alpha0']:.2f}) {_est(x)}"
                              for x in c["sink_heads"])
            lines.append(f"      sink heads: {sinks}")
    return lines


def cmd_stack(args: argparse.Namespace) -> None:
    from poslens.analyses.leakage.stackrun import run_stack_leakage, stack_summary_lines
    from poslens.io.results import load

    o = from_args(StackLeakageOptions, args)
    path = run_stack_leakage(o, args.out, force=args.force)
    print("\n".join(stack_summary_lines(load(path, tensors=False).metrics)))
    print(f"wrote {path}")


def cmd_compare(args: argparse.Namespace) -> None:
    from poslens.analyses.leakage.stackrun import compare_runs

    o = from_args(LeakageCompareOptions, args)
    path = compare_runs(o.runs, args.out, labels=args.labels, force=args.force)
    print(f"wrote {path}")
