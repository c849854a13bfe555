"""`poslens leakage MODEL`, `poslens leakage-stack` and `poslens leakage-compare RUN...` (wired by cli.py's
COMMAND_MODULES). Torch is imported only inside the handlers."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from poslens.options import add_options, from_args, option


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
    seed: int = option(0, help="random seed")


@dataclass
class LeakageCompareOptions:
    runs: list[str] = option(help="run directories of `poslens leakage` or `leakage-stack`", positional=True,
                             metavar="RUN")


def _out(p: argparse.ArgumentParser, default: str, quiet: bool = True) -> None:
    p.add_argument("--out", default=default, help=f"run directory to write (default {default})")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    if quiet:
        p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_command(sub) -> None:
    """Add `leakage`, `leakage-stack` and `leakage-compare` to the subparsers `sub`."""
    from poslens.analyses.leakage.run import LeakageConfig

    p = sub.add_parser("leakage", help="absolute-position leakage of a causal LM (Ruscio, Nanni & Silvestri 2026): "
                       "metrics with intervals, BOS interventions, the predecessor's per-head test, sinks",
                       description="Absolute-position leakage in the attention of a causal LM: Toeplitz-residual "
                       "fractions, Delta R^2, the mask / logit split of the log-probabilities, drift, the sink "
                       "column, each with a jackknife interval; position-0 interventions; the predecessor's "
                       "linear Delta R^2 per head with its shifted-token null (docs/leakage.md).")
    add_options(p, LeakageConfig)
    _out(p, "runs/leakage")
    p.set_defaults(func=cmd_leakage)
    p = sub.add_parser("leakage-stack", help="the leakage split in the parameter-free stack for three architectures",
                       description="Mask / logit split per layer for standard RoPE, NTK-scaled RoPE and a sliding "
                       "window in the parameter-free stack: exact (d -> infinity, Gram flow) and Monte Carlo.")
    add_options(p, StackLeakageOptions)
    _out(p, "runs/leakage-stack", quiet=False)
    p.set_defaults(func=cmd_stack)
    p = sub.add_parser("leakage-compare", help="component shares by depth of several leakage runs in one figure",
                       description="One figure: the logit and mask shares per layer of each run.")
    add_options(p, LeakageCompareOptions)
    p.add_argument("--labels", nargs="+", help="one label per run (default: the model names)")
    _out(p, "runs/leakage-compare", quiet=False)
    p.set_defaults(func=cmd_compare)


def cmd_leakage(args: argparse.Namespace) -> None:
    from poslens.analyses.leakage.run import LeakageConfig, run_leakage
    from poslens.io.results import load

    cfg = from_args(LeakageConfig, args)
    path = run_leakage(cfg, args.out, force=args.force, progress=not args.quiet)
    if path is None:
        return
    m = load(path, tensors=False).metrics
    early = m["per_layer_early"]
    for l, (lg, mk) in enumerate(zip(early["split/share_logit"]["value"], early["split/share_mask"]["value"])):
        print(f"layer {l}: early queries: logit share {lg:.3f}, mask share {mk:.3f}")
    for spec, e in m["interventions"].items():
        r = e["removed_all_layers"]
        print(f"intervention {spec}: removes {r['value']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] of the early logit part")
    print(f"sink rate {m['sinks']['rate']:.3f} (eps {m['sinks']['epsilon']}), "
          f"{len(m['sinks']['sink_heads'])} sink-reading heads")
    print(f"wrote {path}")


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
