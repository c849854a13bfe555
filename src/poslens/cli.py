"""The `poslens` command line. Each subcommand parses its arguments and calls one library function.

Options come from the config dataclasses (`poslens.options`): a field `seq_len` of `ScoresConfig` is the flag
`--seq-len`, with the field's default and help. Library functions raise `UsageError` naming their own parameter;
`main` shows it as the flag (one place: `flag_message`). Bad input ends with a one-line error and exit status 2.

New commands live in their own modules, each with `add_command(sub)`; list them in `COMMAND_MODULES`.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from poslens.errors import UsageError
from poslens.options import add_options, flags, from_args, option

# Modules with `add_command(sub: argparse._SubParsersAction) -> None` (import torch only inside functions).
COMMAND_MODULES: list[str] = [
    "poslens.analyses.intermediates_command",  # intermediates MODEL --layer L (Figure 3)
    "poslens.train.command",  # tokenize, train
    "poslens.analyses.leakage.command",  # leakage MODEL (Ruscio, Nanni & Silvestri 2026)
]


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error message (no usage block) and exit status 2."""

    def error(self, message: str):  # noqa: D102
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# Command-level options that are arguments of a library function rather than fields of a config class. Their
# defaults equal the function's (tests/test_options.py checks that).

@dataclass
class MonteCarloOptions:
    """`simulate`'s sampling knobs: the keyword arguments of `poslens.stack.simulate.simulate`."""

    samples: int = option(100_000, help="number of sampled sequences")
    seed: int = option(0, help="random seed")
    chunk: int | None = option(None, help="samples per chunk (default: automatic; the result does not depend on it)")
    device: str = option("cpu", help="where to compute", choices=("cpu", "cuda"))
    dtype: str = option("float32", help="compute dtype (sums are float64)", choices=("float32", "float64"))
    maps: tuple[str, ...] = option(("scores", "probs", "cosine"), choices=("scores", "probs", "cosine"),
                                   help="what to compute, each with its standard error: a comma-separated subset "
                                   "(default all; scores alone is about 1.4x faster)")


@dataclass
class ReproduceOptions:
    """Arguments of `poslens.report.reproduce.reproduce`."""

    quick: bool = option(False, help="fewer Monte Carlo samples and model sequences")
    samples: int | None = option(None, help="Monte Carlo samples per setting (default 100000, or 10000 with --quick)")
    seed: int = option(0, help="random seed")
    models: bool = option(True, help="skip the real-model section")


@dataclass
class CompareOptions:
    """Arguments of `poslens.analyses.compare.compare` (`first` is its `layers`)."""

    runs: list[str] = option(help="run directories written by `poslens scores`", positional=True, metavar="RUN")
    first: int = option(4, help="how many leading layers to show")


def add_output_args(p: argparse.ArgumentParser, default: str, *, quiet: bool = True) -> None:
    """`--out`, `--force` (and `--quiet` unless quiet=False): CLI-level, not part of any config."""
    p.add_argument("--out", default=default, help=f"run directory to write (default {default})")
    p.add_argument("--force", action="store_true",
                   help="replace --out if it is a run directory poslens wrote (anything else is refused)")
    if quiet:
        p.add_argument("--quiet", action="store_true", help="no progress bar")


def cmd_simulate(args: argparse.Namespace) -> None:
    import torch

    from poslens.analyses.stackrun import write_stack_run
    from poslens.io.results import run_directory
    from poslens.stack.config import StackConfig
    from poslens.stack.simulate import simulate

    config = from_args(StackConfig, args)
    mc = from_args(MonteCarloOptions, args)
    if mc.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("device cuda requested but torch sees no GPU; use --device cpu")
    started = time.perf_counter()
    with run_directory(args.out, args.force) as tmp:
        res = simulate(config, samples=mc.samples, seed=mc.seed, chunk=mc.chunk, device=mc.device,
                       dtype=getattr(torch, mc.dtype), progress=not args.quiet, maps=mc.maps)
        tensors = {name: t for name in ("scores_mean", "scores_se", "probs_mean", "probs_se", "cosine_mean",
                                        "cosine_se") if (t := getattr(res, name)) is not None}
        metrics = write_stack_run(tmp, config, tensors, "simulate",
                                  {"samples": mc.samples, "seed": mc.seed, "device": mc.device,
                                   "dtype": mc.dtype, "maps": list(mc.maps)}, started, draw=not args.no_figures)
    report_layers(args.out, config, metrics)


def cmd_gramflow(args: argparse.Namespace) -> None:
    from poslens.analyses.stackrun import write_stack_run
    from poslens.io.results import run_directory
    from poslens.stack.config import StackConfig
    from poslens.stack.gramflow import gram_flow

    config = from_args(StackConfig, args)
    started = time.perf_counter()
    with run_directory(args.out, args.force) as tmp:
        res = gram_flow(config)
        tensors = {"scores": res.scores, "probs": res.probs, "gram": res.gram, "cosine": res.cosine}
        metrics = write_stack_run(tmp, config, tensors, "gramflow", {}, started, draw=not args.no_figures)
    report_layers(args.out, config, metrics)


def row_check_means_something(config, layer: int) -> bool:
    """Whether "rows increasing in j" says anything: not at layer 1 without RoPE, whose scores are the input Gram
    (constant off the diagonal in expectation), nor without a causal mask."""
    return config.mask != "none" and not (layer == 1 and config.positional == "none")


def report_layers(out: str, config, metrics: dict) -> None:
    """One line per layer on stdout: score range, rows increasing (where it means something), non-relative residual."""
    for m in metrics["layers"]:
        rows = m.get("rows_increasing")
        inc = (f"rows increasing in j: {rows['holding']}/{rows['checked']}  "
               if rows and row_check_means_something(config, m["layer"]) else "")
        print(f"layer {m['layer']}: scores in [{m['range'][0]:.4f}, {m['range'][1]:.4f}]  {inc}"
              f"largest diagonal-normalised residual {m['toeplitz_residual']['max_abs']:.3g}")
    print(f"wrote {out}")


def cmd_reproduce(args: argparse.Namespace) -> None:
    from poslens.report.reproduce import reproduce

    o = from_args(ReproduceOptions, args)
    reproduce(out=args.out, quick=o.quick, force=args.force, models=o.models, progress=not args.quiet, seed=o.seed,
              samples=o.samples)


def noise_text(m: dict) -> str:
    """What is printed beside a layer's non-relative pattern: its rms, the confidence interval of that rms when
    the metrics carry one ({"value", "lo", "hi"[, "level"]} under a key starting "normalised_rms"), and the
    noise rms of the normalised map (an rms of pure noise is positive, so the interval alone cannot say that a
    pattern is resolved; the noise level beside it can)."""
    parts = [f"rms {m['normalised_rms']:.3f}"] if "normalised_rms" in m else []
    for key, v in m.items():
        if key.startswith("normalised_rms") and isinstance(v, dict) and {"value", "lo", "hi"} <= v.keys():
            level = f"{100 * v['level']:g}% " if "level" in v else ""
            parts.append(f"{level}interval [{v['lo']:.3f}, {v['hi']:.3f}]")
            break
    if "normalised_noise_rms" in m:
        parts.append(f"noise rms {m['normalised_noise_rms']:.3f}")
    elif len(parts) < 2:
        parts.append("no noise estimate (one batch)")
    return ", ".join(parts)


def cmd_scores(args: argparse.Namespace) -> None:
    from poslens.analyses.scores import ScoresConfig, run_scores

    cfg = from_args(ScoresConfig, args)
    path = run_scores(cfg, args.out, force=args.force, progress=not args.quiet)
    if path is not None:
        from poslens.io.results import load

        for m in load(path, tensors=False).metrics["layers"]:
            lo, hi = m["score_q01_q99"]
            nlo, nhi = m["normalised_q01_q99"]
            print(f"layer {m['layer']}: scores [{lo:+.2f}, {hi:+.2f}]  non-relative pattern [{nlo:+.3f}, {nhi:+.3f}] "
                  f"({noise_text(m)})")
        print(f"wrote {path}")


def cmd_compare(args: argparse.Namespace) -> None:
    from poslens.analyses.compare import compare

    o = from_args(CompareOptions, args)
    path = compare(o.runs, args.out, layers=o.first, labels=args.labels, force=args.force)
    for f in sorted((path / "figures").glob("*")):
        print(f"wrote {f}")
    print(f"wrote {path}")


def _simulate(p: argparse.ArgumentParser) -> None:
    from poslens.stack.config import StackConfig

    add_options(p, StackConfig, group="stack (paper Eq. 1)")
    add_options(p, MonteCarloOptions, group="Monte Carlo")
    add_output_args(p, "runs/simulate")
    p.add_argument("--no-figures", action="store_true", help="write tensors and run.json only")


def _gramflow(p: argparse.ArgumentParser) -> None:
    from poslens.stack.config import StackConfig

    add_options(p, StackConfig, group="stack (paper Eq. 1)")
    add_output_args(p, "runs/gramflow", quiet=False)
    p.add_argument("--no-figures", action="store_true", help="write tensors and run.json only")


def _reproduce(p: argparse.ArgumentParser) -> None:
    add_options(p, ReproduceOptions)
    add_output_args(p, "poslens-out")


def _scores(p: argparse.ArgumentParser) -> None:
    from poslens.analyses.scores import ScoresConfig

    # attn_implementation stays at its default: the capture engine picks the kernel it needs while capturing
    add_options(p, ScoresConfig, skip=("attn_implementation",))
    add_output_args(p, "runs/scores")


def _compare(p: argparse.ArgumentParser) -> None:
    add_options(p, CompareOptions)
    # space-separated like the runs (`--labels A B`), so not a comma-separated option field
    p.add_argument("--labels", nargs="*", default=None, help="row labels, one per run (default: the model names)")
    add_output_args(p, "runs/compare", quiet=False)


# name: (one-line help, description, options builder, handler)
COMMANDS: dict[str, tuple[str, str, Callable, Callable]] = {
    "simulate": ("Monte Carlo of the parameter-free stack (paper Eq. 1, Section 4.1)",
                 "Monte Carlo of the parameter-free stack: mean scores, probabilities and their standard errors, and "
                 "hidden-state cosine similarity, per layer.", _simulate, cmd_simulate),
    "gramflow": ("exact infinite-width limit of the stack (deterministic Gram recursion)",
                 "Exact d -> infinity limit of the parameter-free stack: G' = M G M^T (docs/gramflow.md). No sampling, "
                 "float64.", _gramflow, cmd_gramflow),
    "reproduce": ("regenerate the paper's figures and a report of its claims",
                  "Regenerate Figures 1, 2, 4, 6, 7, 9, 10 (and the real-model section) and write report.md and "
                  "report.html with each claim and what was measured.", _reproduce, cmd_reproduce),
    "scores": ("averaged attention-score maps of a Hugging Face causal LM (Section 5.2)",
               "Mean pre-softmax attention scores q_i . k_j * scaling (after RoPE, before the mask) per layer, "
               "averaged over sequences and heads, at the cost of a plain forward pass. Under torchrun the sequences "
               "are sharded over ranks.", _scores, cmd_scores),
    "compare": ("first layers of several `scores` runs side by side (Figure 5)",
                "Diagonal-normalised maps of the first layers of several runs, one row per run.", _compare,
                cmd_compare),
}


def build_parser(command: str | None = None) -> Parser:
    """The full parser; with `command`, only that built-in command gets its options (keeps `--help` fast)."""
    parser = Parser(prog="poslens", description="Measure, explain and reproduce how decoder-only transformers "
                    "get positional information: causal mask, RoPE, and their interaction.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, (help_, description, add, func) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=description)
        if command is None or command == name:
            add(p)
            p.set_defaults(func=func)
    for module in COMMAND_MODULES:
        importlib.import_module(module).add_command(sub)
    for p in sub.choices.values():  # for `flag_message`: each command's parameter -> flag
        p.set_defaults(flag_names=flags(p))
    return parser


def flag_message(message: str, param: str | None, names: dict[str, str]) -> str:
    """A library message that starts with a parameter name (`seq_len must be >= 2`) shown with its flag
    (`--seq-len must be >= 2`); `param` is the name the error says it is about, else the message's first word."""
    first = re.match(r"[A-Za-z_]\w*", message)
    name = param if param in names else (first.group(0) if first else None)
    if name in names and first and first.group(0) == name:
        return names[name] + message[len(name):]
    return message


def _close_progress_bars() -> None:
    """End any open tqdm bar so that the next message starts on its own line."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` that keeps open progress bars intact: the warning gets lines of its own."""
    text = warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n")
    tqdm = sys.modules.get("tqdm")
    if tqdm is not None and getattr(tqdm.tqdm, "_instances", None):
        tqdm.tqdm.write(text, file=file or sys.stderr)
    else:
        print(text, file=file or sys.stderr)


def _version() -> str:
    from poslens import __version__

    return f"poslens {__version__}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    parser = build_parser(command)
    args = parser.parse_args(argv)
    shown, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        args.func(args)
    except UsageError as e:
        _close_progress_bars()
        message = flag_message(str(e), getattr(e, "param", None), getattr(args, "flag_names", {}))
        print(f"poslens {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _close_progress_bars()
        print(f"poslens {args.command}: interrupted; nothing was written to --out (rerun the same command; "
              "runs with checkpoints resume where they stopped)", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = shown
    return 0
