"""The `poslens` command line. Each subcommand parses its arguments and calls one library function.

Bad input ends with a one-line error and exit status 2; nothing is written (results go to a temporary
directory that is renamed into place only when complete).
"""

from __future__ import annotations

import argparse
import sys
import time

from poslens.errors import UsageError
from poslens.stack.config import MASKS, NORMS, POSITIONAL, StackConfig


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error message (no usage block) and exit status 2."""

    def error(self, message: str):  # noqa: D102
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_stack_args(p: argparse.ArgumentParser) -> None:
    """Knobs of the parameter-free stack (paper Eq. 1), shared by `simulate` and `gramflow`."""
    g = p.add_argument_group("stack (paper Eq. 1)")
    g.add_argument("--seq-len", "--n", dest="n", type=int, default=50, help="tokens per sequence n (default 50)")
    g.add_argument("--d", "--hidden-size", dest="d", type=int, default=64, help="hidden size d (default 64)")
    g.add_argument("--alpha", type=float, default=0.0, help="expected inner product of inputs, in [0, 1) (default 0)")
    g.add_argument("--layers", type=int, default=4, help="number of layers (default 4)")
    g.add_argument("--norm", default="l2", help=f"normalisation: {', '.join(NORMS)} (default l2)")
    g.add_argument("--no-residual", dest="residual", action="store_false", help="drop the residual connection")
    g.add_argument("--pe", default="none", help=f"positional encoding: {', '.join(POSITIONAL)} (default none)")
    g.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base theta (default 10000)")
    g.add_argument("--rope-scaling", type=float, default=1.0,
                   help="NTK-style RoPE base scaling factor s >= 1: base * s^(d/(d-2)) (default 1: none)")
    g.add_argument("--mask", default="causal", help=f"attention mask: {', '.join(MASKS)} (default causal)")
    g.add_argument("--window", type=int, default=None, help="window W for --mask sliding (keys i-W < j <= i)")


def stack_config(args: argparse.Namespace) -> StackConfig:
    return StackConfig(n=args.n, d=args.d, alpha=args.alpha, layers=args.layers, norm=args.norm,
                       residual=args.residual, positional=args.pe, rope_theta=args.rope_theta,
                       rope_scaling=args.rope_scaling, mask=args.mask, window=args.window)


def add_output_args(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--out", default=default, help=f"run directory to write (default {default})")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")


def cmd_simulate(args: argparse.Namespace) -> None:
    import torch

    from poslens.analyses.stackrun import write_stack_run
    from poslens.errors import check_choice, check_int
    from poslens.io.results import run_directory
    from poslens.stack.simulate import MAPS, simulate

    config = stack_config(args)
    check_int("samples", args.samples, 1)
    maps = tuple(m.strip() for m in args.maps.split(","))
    bad = [m for m in maps if m not in MAPS] or (["(none)"] if not maps else [])
    if bad:
        raise UsageError(f"--maps takes a comma-separated subset of {','.join(MAPS)}; got {args.maps!r}")
    check_choice("dtype", args.dtype, ("float32", "float64"))
    check_choice("device", args.device, ("cpu", "cuda"))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("device cuda requested but torch sees no GPU; use --device cpu")
    started = time.perf_counter()
    with run_directory(args.out, args.force) as tmp:
        res = simulate(config, samples=args.samples, seed=args.seed, chunk=args.chunk, device=args.device,
                       dtype=getattr(torch, args.dtype), progress=not args.quiet, maps=maps)
        tensors = {name: t for name in ("scores_mean", "scores_se", "probs_mean", "probs_se", "cosine_mean",
                                        "cosine_se") if (t := getattr(res, name)) is not None}
        metrics = write_stack_run(tmp, config, tensors, "simulate",
                                  {"samples": args.samples, "seed": args.seed, "device": args.device,
                                   "dtype": args.dtype, "maps": list(maps)}, started, draw=not args.no_figures)
    report_layers(args.out, metrics)


def cmd_gramflow(args: argparse.Namespace) -> None:
    from poslens.analyses.stackrun import write_stack_run
    from poslens.io.results import run_directory
    from poslens.stack.gramflow import gram_flow

    config = stack_config(args)
    started = time.perf_counter()
    with run_directory(args.out, args.force) as tmp:
        res = gram_flow(config)
        tensors = {"scores": res.scores, "probs": res.probs, "gram": res.gram, "cosine": res.cosine}
        metrics = write_stack_run(tmp, config, tensors, "gramflow", {}, started, draw=not args.no_figures)
    report_layers(args.out, metrics)


def report_layers(out: str, metrics: dict) -> None:
    """One line per layer on stdout: score range, rows increasing, non-relative residual."""
    for m in metrics["layers"]:
        rows = m.get("rows_increasing")
        inc = f"rows increasing in j: {rows['holding']}/{rows['checked']}  " if rows else ""
        print(f"layer {m['layer']}: scores in [{m['range'][0]:.4f}, {m['range'][1]:.4f}]  {inc}"
              f"largest diagonal-normalised residual {m['toeplitz_residual']['max_abs']:.3g}")
    print(f"wrote {out}")


def cmd_reproduce(args: argparse.Namespace) -> None:
    from poslens.report.reproduce import reproduce

    reproduce(out=args.out, quick=args.quick, force=args.force, models=not args.no_models,
              progress=not args.quiet, seed=args.seed, samples=args.samples)


def cmd_scores(args: argparse.Namespace) -> None:
    from poslens.analyses.scores import ScoresConfig, run_scores

    layers = None
    if args.layers:
        try:
            layers = sorted({int(x) for x in args.layers.split(",")})
        except ValueError:
            raise UsageError(f"--layers takes comma-separated layer indices such as 0,1,2; got {args.layers!r}") \
                from None
    cfg = ScoresConfig(model=args.model, data=args.data, text_field=args.text_field, seq_len=args.seq_len,
                       num_sequences=args.num_sequences, batch_size=args.batch_size, mode=args.mode, bos=args.bos,
                       layers=layers, per_head=args.per_head, probs=args.probs, log_probs=args.log_probs,
                       hidden_cosine=args.hidden_cosine, no_rope=args.no_rope, dtype=args.dtype,
                       device=args.device, attn_implementation="sdpa", tokenizer=args.tokenizer,
                       checkpoint_every=args.checkpoint_every)
    path = run_scores(cfg, args.out, force=args.force, progress=not args.quiet)
    if path is not None:
        from poslens.io.results import load

        for m in load(path, tensors=False).metrics["layers"]:
            lo, hi = m["score_q01_q99"]
            nlo, nhi = m["normalised_q01_q99"]
            print(f"layer {m['layer']}: scores [{lo:+.2f}, {hi:+.2f}]  non-relative pattern [{nlo:+.3f}, {nhi:+.3f}]")
        print(f"wrote {path}")


def cmd_compare(args: argparse.Namespace) -> None:
    from poslens.analyses.compare import compare

    compare(args.runs, args.out, layers=args.first, labels=args.labels, force=args.force)


def build_parser() -> Parser:
    parser = Parser(prog="poslens", description="Measure, explain and reproduce how decoder-only transformers "
                    "get positional information: causal mask, RoPE, and their interaction.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("simulate", help="Monte Carlo of the parameter-free stack (paper Eq. 1, Section 4.1)",
                       description="Monte Carlo of the parameter-free stack: mean scores, probabilities and "
                       "their standard errors, and hidden-state cosine similarity, per layer.")
    add_stack_args(p)
    g = p.add_argument_group("Monte Carlo")
    g.add_argument("--samples", type=int, default=100_000, help="number of sampled sequences (default 100000)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument("--chunk", type=int, default=None, help="samples per chunk (default: automatic)")
    g.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    g.add_argument("--dtype", default="float32", help="float32 or float64 compute (sums are float64; default float32)")
    g.add_argument("--maps", default="scores,probs,cosine",
                   help="what to compute, each with its standard error: a comma-separated subset of scores, probs, "
                   "cosine (default all; scores alone is about 1.4x faster)")
    add_output_args(p, "runs/simulate")
    p.add_argument("--no-figures", action="store_true", help="write tensors and run.json only")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("gramflow", help="exact infinite-width limit of the stack (deterministic Gram recursion)",
                       description="Exact d -> infinity limit of the parameter-free stack: G' = M G M^T "
                       "(docs/gramflow.md). No sampling, float64.")
    add_stack_args(p)
    add_output_args(p, "runs/gramflow")
    p.add_argument("--no-figures", action="store_true", help="write tensors and run.json only")
    p.set_defaults(func=cmd_gramflow)

    p = sub.add_parser("reproduce", help="regenerate the paper's figures and a report of its claims",
                       description="Regenerate Figures 1, 2, 4, 6, 7, 9, 10 (and the real-model section) and "
                       "write report.md and report.html with each claim and what was measured.")
    p.add_argument("--quick", action="store_true", help="fewer samples and sequences: about 2 minutes on 2 CPU cores")
    add_output_args(p, "poslens-out")
    p.add_argument("--samples", type=int, default=None,
                   help="Monte Carlo samples per setting (default 100000, or 10000 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--no-models", action="store_true", help="skip the real-model section")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_reproduce)

    p = sub.add_parser("scores", help="averaged attention-score maps of a Hugging Face causal LM (Section 5.2)",
                       description="Mean pre-softmax attention scores q_i . k_j * scaling (after RoPE, before the "
                       "mask) per layer, averaged over sequences and heads, at the cost of a plain forward pass. "
                       "Under torchrun the sequences are sharded over ranks.")
    p.add_argument("model", help="hub id, local directory, .gguf file, the alias smollm2-135m, or "
                   "random:<config.json> for a randomly initialised model")
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, help="text file, directory of text files, .jsonl, .parquet, or a "
                   "datasets.save_to_disk directory (default: embedded CPython documentation text)")
    g.add_argument("--text-field", default="text", help="field/column holding the text (default text)")
    g.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence, BOS included (default 1024)")
    g.add_argument("--num-sequences", type=int, default=None,
                   help="sequences to average over; exactly this many or an error (default: as many as the text "
                   "gives, up to 1000)")
    g.add_argument("--mode", default="first", help="first: the first seq-len tokens of each long-enough document "
                   "(the paper); pack: concatenate documents and cut blocks (default first)")
    g.add_argument("--bos", default="auto", help="auto (as the tokenizer does), always, never (default auto)")
    g.add_argument("--tokenizer", default=None, help="tokenizer to use (same forms as MODEL); needed for random: "
                   "configs without tokenizer files")
    g = p.add_argument_group("capture")
    g.add_argument("--layers", default=None, help="comma-separated layer indices (default all)")
    g.add_argument("--per-head", action="store_true", help="also keep one map per head")
    g.add_argument("--probs", action="store_true", help="also keep mean attention probabilities")
    g.add_argument("--log-probs", action="store_true", help="also keep mean log-probabilities and log-partitions")
    g.add_argument("--hidden-cosine", action="store_true", help="also keep hidden-state cosine-similarity maps")
    g.add_argument("--no-rope", action="store_true", help="run the same model with RoPE disabled (ablation)")
    g = p.add_argument_group("execution")
    g.add_argument("--batch-size", type=int, default=20, help="sequences per forward pass (default 20)")
    g.add_argument("--dtype", default="auto", help="auto (float32 on CPU, the checkpoint's dtype on GPU), "
                   "float32, bfloat16, float16")
    g.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    g.add_argument("--checkpoint-every", type=int, default=10,
                   help="save partial sums every N batches; rerunning the same command resumes (default 10)")
    add_output_args(p, "runs/scores")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_scores)

    p = sub.add_parser("compare", help="first layers of several `scores` runs side by side (Figure 5)",
                       description="Diagonal-normalised maps of the first layers of several runs, one row per run.")
    p.add_argument("runs", nargs="+", help="run directories written by `poslens scores`")
    p.add_argument("--first", type=int, default=4, help="how many leading layers to show (default 4)")
    p.add_argument("--labels", nargs="*", default=None, help="row labels (default: the model names)")
    add_output_args(p, "runs/compare")
    p.set_defaults(func=cmd_compare)
    return parser


def _version() -> str:
    from poslens import __version__

    return f"poslens {__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except UsageError as e:
        print(f"poslens {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"poslens {args.command}: interrupted; nothing was written to --out (rerun the same command; "
              "runs with checkpoints resume where they stopped)", file=sys.stderr)
        return 130
    return 0
