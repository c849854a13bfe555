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
    d: int = option(64, help="hidden size of the Monte Carlo (the exact split is d -> infinity)")
    alpha: float = option(0.2, help="mean inner product of the inputs")
    layers: int = option(6, help="layers")
    ntk_scaling: float = option(8.0, help="NTK factor s: base theta * s^(d/(d-2))")
    window: int | None = option(None, help="sliding window (default n // 4)")
    samples: int = option(2048, help="Monte Carlo samples (0: exact split only)")
    groups: int = option(8, help="groups for the jackknife intervals")
    seed: int = option(0, lo=0, help="random seed")


@dataclass
class LeakageCompareOptions:
    runs: list[str] = option(help="run directories of `poslens leakage` or `leakage-stack`", positional=True,
                             metavar="RUN")


def summary_lines(meta: dict) -> list[str]:
    """What `poslens leakage` prints: per layer the early-query logit and mask shares, what each intervention
    removes (with its interval), the sink rate."""
    m = meta["metrics"]
    early = m["per_layer_early"]
    lines = [f"layer {l + 1}: early queries: logit share {lg:.3f}, mask share {mk:.3f}" for l, (lg, mk) in
             enumerate(zip(early["split/share_logit"]["value"], early["split/share_partition"]["value"]))]
    for spec, e in m["interventions"].items():
        r = e["removed_all_layers"]
        lines.append(f"intervention {spec}: removes {r['value']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] of the early "
                     "logit part")
    lines.append(f"sink rate {m['sinks']['rate']:.3f} (threshold {m['sinks']['epsilon']}), "
                 f"{len(m['sinks']['sink_heads'])} sink-reading heads")
    lines.append(f"intervals: {100 * m['level']:g}% jackknife over {m['groups']} groups of sequences")
    return lines


def cmd_stack(args: argparse.Namespace) -> None:
    from poslens.analyses.leakage.stackrun import run_stack_leakage

    o = from_args(StackLeakageOptions, args)
    path = run_stack_leakage(o, args.out, force=args.force)
    print(f"wrote {path}")


def cmd_compare(args: argparse.Namespace) -> None:
    from poslens.analyses.leakage.stackrun import compare_runs

    o = from_args(LeakageCompareOptions, args)
    path = compare_runs(o.runs, args.out, labels=args.labels, force=args.force)
    print(f"wrote {path}")
