"""The `poslens` command line: one registry of commands, each calling one library function.

A command (`Command`) is a name, a line of help, the config dataclasses whose fields are its options
(`poslens.options`: a field `seq_len` is the flag `--seq-len`, with the field's default, bound and help), the
library function that runs it, the function that prints its summary, and its default `--out`. `--out`, `--force`
and `--quiet` are generated once (`poslens.options.add_output_args`). Library functions raise `UsageError` naming
their own parameter; `main` shows it as the flag (one place: `flag_message`). Bad input ends with a one-line error
and exit status 2, an interrupt with exit status 130.

References are "module:attribute" strings, imported only when that command is built or run, so `poslens --help`
loads no model or plotting code. Add a command: one `Command` in `COMMANDS` (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

from poslens.errors import UsageError
from poslens.io.bars import library_bars
from poslens.options import Parser, add_options, add_output_args, check_options, flags, from_args, option, parse_sizes

__all__ = ["COMMANDS", "Command", "Parser", "build_parser", "flag_message", "main"]


@dataclass(frozen=True)
class Command:
    """One `poslens` command (see the module docstring). The standard form runs `run(*configs, out, force=,
    progress=)` -> the run directory (None on torchrun ranks other than 0) and prints `summary(run.json)`, the
    groups note and "wrote PATH"; `handler(args)` replaces that for commands that do more."""

    name: str
    help: str
    description: str
    configs: tuple[str | tuple[str, str], ...] = ()  # "module:Class", or ("module:Class", "help group title")
    run: str | None = None
    summary: str | None = None  # summary(meta: dict) -> list[str]
    out: str | None = None  # default --out; None: the command picks it (or writes none, with no_out)
    quiet: bool = True  # has --quiet (a progress bar to silence)
    handler: str | None = None  # handler(args: argparse.Namespace) -> None
    arguments: str | None = None  # arguments(parser): command-line-only arguments besides the configs
    keep_unset: bool = False  # flags not given leave the config's values alone (train's presets)
    no_out: bool = False  # writes no run directory of its own (its sub-commands do)
    skip: tuple[str, ...] = ()  # config fields that are not options of this command (the analysis settles them)

    def classes(self) -> list[tuple[type, str | None]]:
        """The config dataclasses with their help-group titles."""
        return [(_load(c), None) if isinstance(c, str) else (_load(c[0]), c[1]) for c in self.configs]


# Command-level options that are arguments of a library function rather than fields of a config class. Their
# defaults equal the function's (tests/test_options.py checks that).

@dataclass
class MonteCarloOptions:
    """`simulate`'s sampling knobs: the keyword arguments of `poslens.stack.simulate.simulate`."""

    samples: int = option(100_000, help="number of sampled sequences")
    seed: int = option(0, lo=0, help="random seed")
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
    seed: int = option(0, lo=0, help="random seed")
    models: bool = option(True, help="skip the real-model section")
    sizes: list[str] | None = option(None, metavar="SECTION.KEY=VALUE,...",
                                     help="change a section's size, e.g. leakage.sequences=64,real-model.sequences=512 "
                                     "(the names and defaults: run.json's config.sizes of a report)")
    robustness: bool = option(False, help="retrain the sweep's models with another CPU kernel set (ATen's default "
                              "kernels, MKL's COMPATIBLE path) and say, per row on them, whether its verdict stays")
    pdf: bool = option(True, help="leave out the vector PDF written beside each figure's image (saving a figure "
                       "then takes 0.63-0.75 of its time)")


@dataclass
class CompareOptions:
    """Arguments of `poslens.analyses.compare.compare` (`first` is its `layers`)."""

    runs: list[str] = option(help="run directories written by `poslens scores`", positional=True, metavar="RUN")
    first: int = option(4, help="how many leading layers to show")


# ---------------------------------------------------------------- handlers of the commands that do more


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
              samples=o.samples, sizes=parse_sizes(o.sizes), command=shlex.join(["poslens", *args.argv]),
              robustness=o.robustness, pdf=o.pdf)


def cmd_compare(args: argparse.Namespace) -> None:
    from poslens.analyses.compare import compare

    o = from_args(CompareOptions, args)
    path = compare(o.runs, args.out, layers=o.first, labels=args.labels, force=args.force)
    for f in sorted((path / "figures").glob("*")):
        print(f"wrote {f}")
    print(f"wrote {path}")


def _no_figures(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-figures", action="store_true", help="write tensors and run.json only")


def _labels(p: argparse.ArgumentParser) -> None:
    # space-separated like the runs (`--labels A B`), so not a comma-separated option field
    p.add_argument("--labels", nargs="*", default=None, help="row labels, one per run (default: the model names)")


def _stop_after(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after N steps, keeping the checkpoint (rerun the same command to resume)")


# ---------------------------------------------------------------- the registry

STACK = ("poslens.stack.config:StackConfig", "stack (paper Eq. 1)")
COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("simulate", "Monte Carlo of the parameter-free stack (paper Eq. 1, Section 4.1)",
            "Monte Carlo of the parameter-free stack: mean scores, probabilities and their standard errors, and "
            "hidden-state cosine similarity, per layer.",
            configs=(STACK, ("poslens.cli:MonteCarloOptions", "Monte Carlo")), out="runs/simulate",
            handler="poslens.cli:cmd_simulate", arguments="poslens.cli:_no_figures"),
    Command("gramflow", "exact infinite-width limit of the stack (deterministic Gram recursion)",
            "Exact d -> infinity limit of the parameter-free stack: G' = M G M^T (docs/gramflow.md). No sampling, "
            "float64.", configs=(STACK,), out="runs/gramflow", quiet=False, handler="poslens.cli:cmd_gramflow",
            arguments="poslens.cli:_no_figures"),
    Command("reproduce", "regenerate the paper's figures and a report of its claims",
            "Regenerate Figures 1, 2, 4, 6, 7, 9, 10 (and the real-model section) and write report.md and "
            "report.html with each claim and what was measured.",
            configs=("poslens.cli:ReproduceOptions",), out="poslens-out", handler="poslens.cli:cmd_reproduce"),
    Command("scores", "averaged attention-score maps of a Hugging Face causal LM (Section 5.2)",
            "Mean pre-softmax attention scores q_i . k_j * scaling (after RoPE, before the mask) per layer, averaged "
            "over sequences and heads, at the cost of a plain forward pass, with jackknife intervals over groups of "
            "sequences. Under torchrun the sequences are sharded over ranks.",
            configs=("poslens.analyses.scores:ScoresConfig",), run="poslens.analyses.scores:run_scores",
            summary="poslens.analyses.scores:summary_lines", out="runs/scores"),
    Command("intermediates", "Figure 3's nine Gram matrices of layers L and L+1, and Figure 8 (every layer's scores) "
            "for any model",
            "Averaged over sequences (and heads): (a) Y Y^T after the input norm, (b) Q K^T * scaling, (c) (AV)(AV)^T, "
            "(d) after W_O, (e) after adding the residual, (f) after the post-attention norm, (g) after the FFN and "
            "residual, (h) the next layer's normalised input, (i) its Q K^T * scaling; each with a jackknife interval "
            "over groups of sequences. The block output is recomputed in float64 and checked against the model's "
            "hidden state. Figure 8: every layer's diagonal-normalised Q K^T * scaling. Paper defaults: 1,000 "
            "sequences of the first 50 tokens. Layers are indexed from 0 here and numbered from 1 in the figures.",
            configs=("poslens.analyses.intermediates:IntermediatesConfig",),
            run="poslens.analyses.intermediates:run_intermediates",
            summary="poslens.analyses.intermediates:summary_lines", out="runs/intermediates"),
    Command("leakage", "absolute-position leakage of a causal LM (Ruscio et al. 2026): both splits with key 0 in "
            "and out, interventions and nulls as paired contrasts, the predecessor's per-head test",
            "Absolute-position leakage in the attention of a causal LM (Ruscio, Nanni & Silvestri 2026, \"Where does "
            "Absolute Position come from in decoder-only Transformers?\"): Toeplitz-residual fractions, Delta R^2, "
            "drift, the sink column, the exact split of the log-probabilities (a descriptive identity) and the "
            "mask-only counterfactual, per layer on all and early queries with key 0 in and out, each with a "
            "jackknife interval; position-0 interventions and residual-stream patches, and the offset and circular "
            "nulls, as paired contrasts with the original; the predecessor's linear Delta R^2 per head against the "
            "circular null with its power (docs/leakage.md).",
            configs=("poslens.analyses.leakage.run:LeakageConfig",), run="poslens.analyses.leakage.run:run_leakage",
            summary="poslens.analyses.leakage.command:summary_lines", out="runs/leakage"),
    Command("length", "a model past its training length: loss by position, attention entropy and key-0 share, maps "
            "and leakage terms, and interventions (log-n scaling, NTK, YaRN, window, window keeping key 1, ALiBi "
            "slope scaling, freezing the first position)",
            "Evaluate a model trained at length L at L, 2L, 4L, 8L (--eval-lens) on held-out text: next-token loss by "
            "position bucket, attention entropy against log(keys seen) and the share on the first key by query, the "
            "averaged maps and their leakage terms at each length, and interventions at evaluation time (per-query "
            "logit scaling by log p / log L at position p, NTK and YaRN base scaling, a sliding window of L, freezing "
            "the first position), "
            "each measured by the loss past L against no intervention on the same sequences, with jackknife "
            "intervals over groups of sequences; with --seed-models, also over seeds (docs/length.md).",
            configs=("poslens.analyses.length.run:LengthConfig",), run="poslens.analyses.length.run:run_length",
            summary="poslens.analyses.length.summary:summary_lines", out="runs/length", skip=("seq_len",)),
    Command("card", "where a model's positional information can be seen, per layer, on one page (several models "
            "side by side)",
            "Run scores, leakage, a residual-stream probe of absolute position (stat position_probe) and length on "
            "each model into sub-run directories of --out (kept: each with the command that re-measures it; a "
            "rerun reuses the finished ones), then write card.md and a self-contained card.html in OUT/card: the "
            "positional scheme per layer, Kim et al.'s non-relative score pattern and its per-query-offset share, "
            "the attention's absolute-position terms with key 0 in and out, sinks and sink-reading heads, the "
            "probe's held-out R^2 per layer, and the held-out loss by position past a length L with the scheme's "
            "length interventions, all with intervals (docs/card.md).",
            configs=("poslens.analyses.card.run:CardConfig",), out="runs/card",
            handler="poslens.analyses.card.run:cmd_card"),
    Command("stat", "any registered statistic of a causal LM over real text, with intervals and a figure",
            "Run one statistic of poslens.engine.statistics.REGISTRY (poslens stat NAME --help lists its options) on "
            "a model over real text: its tensors with jackknife intervals over groups of sequences, a summary and "
            "a default figure.", handler="poslens.analyses.stat:cmd_stat",
            arguments="poslens.analyses.stat:add_statistics", no_out=True),
    Command("compare", "first layers of several `scores` runs side by side (Figure 5)",
            "Diagonal-normalised maps of the first layers of several runs, one row per run.",
            configs=("poslens.cli:CompareOptions",), out="runs/compare", quiet=False,
            handler="poslens.cli:cmd_compare", arguments="poslens.cli:_labels"),
    Command("leakage-stack", "the leakage decomposition in the parameter-free stack for three architectures",
            "Per layer, the non-relative energy of the log-probabilities split into the mask-only term (the causal "
            "softmax of the scores' lag profile), the residual term and their interaction, for standard RoPE, "
            "NTK-scaled RoPE and a sliding window in the parameter-free stack: exact (d -> infinity, Gram flow) and "
            "Monte Carlo.",
            configs=("poslens.analyses.leakage.command:StackLeakageOptions",), out="runs/leakage-stack", quiet=False,
            handler="poslens.analyses.leakage.command:cmd_stack"),
    Command("leakage-compare", "component shares by depth of several leakage runs in one figure",
            "One figure per component: the mask-only and residual shares per layer of each run (docs/leakage.md).",
            configs=("poslens.analyses.leakage.command:LeakageCompareOptions",), out="runs/leakage-compare",
            quiet=False, handler="poslens.analyses.leakage.command:cmd_compare", arguments="poslens.cli:_labels"),
    Command("train", "train a NoPE or RoPE Llama-style decoder (SmolLM3) from scratch",
            "Train a decoder (RMSNorm, SwiGLU, GQA) saved as a stock transformers SmolLM3, so from_pretrained "
            "reloads its positional encoding. Start from a preset (tiny, cpu, small, paper-1.5b) and override any "
            "field with its flag. Under torchrun: DDP (gloo on CPU, NCCL on GPU) or FSDP2. The defaults shown are "
            "the tiny preset's. See docs/training.md.",
            configs=("poslens.train.config:TrainConfig",), handler="poslens.train.command:cmd_train",
            arguments="poslens.cli:_stop_after", keep_unset=True),
    Command("sweep", "train variants x seeds on identical data; held-out losses with between-seed intervals",
            "Train a matrix of positional-encoding variants x seeds (a preset, a .json file, or flags) on identical "
            "tokens, batches and steps; every model is cached by its full configuration (an interrupted sweep "
            "resumes). Writes the held-out loss of each variant with a t-interval over seeds, the paired difference "
            "of every two variants (paired by seed) and a figure. See docs/training.md, \"Sweeps\".",
            configs=("poslens.train.sweep:SweepConfig",), out="runs/sweep", handler="poslens.train.command:cmd_sweep"),
    Command("tokenize", "write a memory-mapped token file with a document-level train/val split",
            "Tokenize text into train.bin/val.bin (uint16 or uint32) plus header.json and the tokenizer, for "
            "`poslens train --tokens DIR`.",
            configs=("poslens.train.command:TokenizeConfig",), out="runs/tokens",
            handler="poslens.train.command:cmd_tokenize"),
)}


def _load(ref: str) -> Any:
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


def build(command: Command, p: argparse.ArgumentParser) -> None:
    """Give parser `p` the options of `command`: its configs' fields, its own arguments, --out/--force/--quiet."""
    for cls, title in command.classes():
        add_options(p, cls, group=title, skip=command.skip)
    if command.keep_unset:  # an unset flag must not override the config's own (a preset's) value
        names = {f for cls, _ in command.classes() for f in cls.__dataclass_fields__}
        for action in p._actions:
            if action.dest in names:
                action.default = argparse.SUPPRESS
    if command.arguments:
        _load(command.arguments)(p)
    if not command.no_out:
        add_output_args(p, command.out, quiet=command.quiet)
    p.set_defaults(func=lambda args: dispatch(command, args))


def dispatch(command: Command, args: argparse.Namespace) -> None:
    """Run `command` on its parsed arguments (the standard form, or its handler). The bounds and choices declared on
    the config fields are checked first, for every command (`check_options`), before any work."""
    if command.handler:
        if not command.keep_unset:
            for cls, _ in command.classes():
                check_options(from_args(cls, args))
        _load(command.handler)(args)
        return
    from poslens.engine.pipeline import report_lines

    configs = [from_args(cls, args) for cls, _ in command.classes()]
    path = _load(command.run)(*configs, args.out, force=args.force, progress=not args.quiet)
    if path is not None:
        print("\n".join(report_lines(path, _load(command.summary) if command.summary else None)))


def build_parser(command: str | None = None) -> Parser:
    """The full parser; with `command`, only that command gets its options (keeps `--help` fast)."""
    parser = Parser(prog="poslens", description="Measure, explain and reproduce how decoder-only transformers "
                    "get positional information: causal mask, RoPE, and their interaction.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, c in COMMANDS.items():
        p = sub.add_parser(name, help=c.help, description=c.description)
        if command is None or command == name:
            build(c, p)
    _flag_names(parser)
    return parser


def _flag_names(parser: argparse.ArgumentParser) -> None:
    """For `flag_message`: every (sub-)command's parameter -> flag, nested sub-commands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                p.set_defaults(flag_names=flags(p))
                _flag_names(p)


def flag_message(message: str, param: str | None, names: dict[str, str]) -> str:
    """A library message shown with flags instead of parameter names: the parameter it starts with
    (`seq_len must be >= 2` -> `--seq-len must be >= 2`; `param` is the name the error says it is about, else the
    first word), and any other parameter whose name has an underscore (never a word of prose: `lower batch_size`
    -> `lower --batch-size`)."""
    first = re.match(r"[A-Za-z_]\w*", message)
    name = param if param in names else (first.group(0) if first else None)
    if name in names and first and first.group(0) == name:
        message = names[name] + message[len(name):]
    # the fix a message names, with any parameter: "lower groups" -> "lower --groups", "groups <= 2" -> "--groups <= 2"
    message = re.sub(r"(?<![\w-])(lower|raise|use|give) ([a-z]+)\b(?![-.(])",
                     lambda m: f"{m.group(1)} {names.get(m.group(2), m.group(2))}", message)
    message = re.sub(r"(?<![\w.-])([a-z]+) (<=|>=|<|>) (?=\d)", lambda m: f"{names.get(m.group(1), m.group(1))} "
                     f"{m.group(2)} ", message)
    return re.sub(r"(?<![\w-])([a-z]+_[a-z_]+)\b", lambda m: names.get(m.group(1), m.group(1)), message)


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
    # PyTorch's CPU allocator backs buffers of 2 MB and more with transparent huge pages when this is set (read at
    # its first allocation, so before torch is imported; a value the user set is kept). Mean maps of long sequences
    # are hundreds of MB, allocated afresh for every jackknife replicate: with 4 KB pages the kernel's page faults
    # took as much time as the arithmetic (Gemma-3-270M leakage at 1,024 tokens, BENCHMARKS.md "Leakage").
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    try:
        parser = build_parser(command)  # imports torch: the first seconds of every command
    except KeyboardInterrupt:
        print(f"poslens {command}: interrupted while starting; nothing was written", file=sys.stderr)
        return 130
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse would say it as "poslens: error:", without the command
        print(f"poslens {args.command}: error: unrecognized arguments: {' '.join(extra)} (see --help)", file=sys.stderr)
        return 2
    args.argv = argv  # the command line as given (a report's provenance quotes it)
    shown, warnings.showwarning = warnings.showwarning, _show_warning
    from poslens.subnormals import subnormals_flushed

    try:
        # float32 subnormals read and written as 0 on the CPU (the mode restored after): the soft-max of a model with
        # attention sinks underflows through them, and an x86 core is about a hundred times slower on each
        with library_bars(not getattr(args, "quiet", False)), subnormals_flushed("cpu"):  # --quiet: library bars too
            args.func(args)
    except UsageError as e:
        _close_progress_bars()
        message = str(e) if getattr(e, "in_file", False) else flag_message(str(e), getattr(e, "param", None),
                                                                            getattr(args, "flag_names", {}))
        print(f"poslens {args.command}: error: {message}", file=sys.stderr)
        return 2
    except Exception as e:  # a full disk or the file-size limit inside a library's own writer: one line too
        from poslens.io.space import write_failure

        line = write_failure(e)
        if line is None:
            raise
        _close_progress_bars()
        print(f"poslens {args.command}: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _close_progress_bars()
        print(f"poslens {args.command}: interrupted; nothing was written to --out (rerun the same command; "
              "runs with checkpoints resume where they stopped)", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = shown
    return 0
