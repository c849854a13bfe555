"""Command-line wiring of `poslens train`, `poslens sweep` and `poslens tokenize`: ``add_command(sub)`` adds them.

Flags come from the config dataclasses (`TrainConfig`, `TokenizeConfig`). For `train`, a flag that
is not given leaves the preset's value in place: only the flags on the command line override it.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from poslens.errors import UsageError
from poslens.options import add_options, from_args, option
from poslens.train.config import FIELDS, TrainConfig, resolve_config
from poslens.train.sweep import SweepConfig


@dataclass
class TokenizeConfig:
    """What `poslens tokenize` reads and how it splits it."""

    data: str | None = option(None, help="text to tokenize: a file or directory the data layer reads "
                                         "(default: the embedded corpus)", positional=True)
    tokenizer: str = option("smollm2", help="smollm2 (the embedded SmolLM2 tokenizer) or bpe:VOCAB_SIZE "
                                            "(byte-level BPE trained on the training documents)")
    val_fraction: float = option(0.05, help="share of documents held out for validation (whole documents)")
    seed: int = option(0, help="seed of the document split")
    text_field: str = option("text", help="field or column holding the text (.jsonl, .parquet, datasets)")


def _output_args(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--out", default=default, help=f"directory to write (default {default or 'see above'})")
    p.add_argument("--force", action="store_true",
                   help="replace --out if it is a run directory poslens wrote (anything else is refused)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_command(sub: argparse._SubParsersAction) -> None:
    """Add the `train`, `sweep` and `tokenize` subcommands to `sub` (an argparse subparsers object)."""
    p = sub.add_parser("train", help="train a NoPE or RoPE Llama-style decoder (SmolLM3) from scratch",
                       description="Train a decoder (RMSNorm, SwiGLU, GQA) saved as a stock transformers "
                       "SmolLM3, so from_pretrained reloads its positional encoding. Start from a preset "
                       "(tiny, cpu, small, paper-1.5b) and override any field with its flag. Under torchrun: "
                       "DDP (gloo on CPU, NCCL on GPU) or FSDP2. The defaults shown are the tiny preset's. "
                       "See docs/training.md.")
    add_options(p, TrainConfig)
    for action in p._actions:  # unset flags must not override the preset
        if action.dest in FIELDS:
            action.default = argparse.SUPPRESS
    _output_args(p, None)
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after N steps, keeping the checkpoint (rerun the same command to resume)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sweep", help="train variants x seeds on identical data; held-out losses with between-seed "
                                     "intervals",
                       description="Train a matrix of positional-encoding variants x seeds (a preset, a .json file, "
                       "or flags) on identical tokens, batches and steps; every model is cached by its full "
                       "configuration (an interrupted sweep resumes). Writes the held-out loss of each variant with a "
                       "t-interval over seeds, the paired difference of every two variants (paired by seed) and a "
                       "figure. See docs/training.md, \"Sweeps\".")
    add_options(p, SweepConfig)
    _output_args(p, "runs/sweep")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("tokenize", help="write a memory-mapped token file with a document-level train/val split",
                       description="Tokenize text into train.bin/val.bin (uint16 or uint32) plus header.json "
                       "and the tokenizer, for `poslens train --tokens DIR`.")
    add_options(p, TokenizeConfig)
    _output_args(p, "runs/tokens")
    p.set_defaults(func=cmd_tokenize)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The preset named by --preset (default tiny) with every given flag on top."""
    given = {k: getattr(args, k) for k in FIELDS if hasattr(args, k)}
    cfg = resolve_config(given.pop("preset", "tiny"), **given)
    if "rope_theta" in given and not any(cfg.positional_encoding().flags):  # a preset's own theta is not asked for
        raise UsageError("--rope-theta has no effect: no layer of this model has RoPE (--pe none); give --pe rope "
                         "or a --pe-layers pattern with a 1, or leave --rope-theta out")
    return cfg


def default_out(cfg: TrainConfig) -> str:
    """``runs/train-SLUG`` (`poslens.train.cache.slug`): runs/train-tiny-none, runs/train-cpu-rope-ntk-8."""
    from poslens.train.cache import slug

    return f"runs/train-{slug(cfg)}"


def cmd_train(args: argparse.Namespace) -> None:
    from poslens.train.loop import train

    cfg = train_config(args)
    out = args.out or default_out(cfg)
    if cfg.parallel == "fsdp" and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        print("note: --parallel fsdp shards the model over torchrun's processes; one process trains it whole",
              file=sys.stderr)
    metrics = train(cfg, out, force=args.force, progress=not args.quiet, stop_after=args.stop_after)
    if metrics.get("stopped"):
        print(f"stopped after step {metrics['step']}; checkpoint in {metrics['checkpoint']} (rerun to resume)")
        return
    if int(os.environ.get("RANK", "0")) == 0:
        blocks, asked = metrics["eval_blocks"], metrics["eval_blocks_asked"]
        short = (f" (the held-out split holds {blocks} of the {asked} blocks eval_batches x micro_batch asks)"
                 if blocks < asked else "")
        print(f"wrote {out}: held-out loss {metrics['final_eval_loss']:.4f} over {blocks} blocks{short}, "
              f"{metrics['tokens_per_s']:,.0f} "
              f"tokens/s, MFU {100 * metrics['mfu']:.1f}% of {metrics['mfu_reference']}\n"
              f"dissect it on its held-out text: poslens intermediates {out} --data {metrics['tokens_path']} "
              "--mode pack")


def cmd_sweep(args: argparse.Namespace) -> None:
    from poslens.train.sweep import run_sweep

    meta = run_sweep(from_args(SweepConfig, args), args.out, force=args.force, progress=not args.quiet)
    print(sweep_table(meta))
    for m in meta["models"]:
        print(f"  model {m['variant']} seed {m['seed']}: {m['path']}")
    print(f"wrote {args.out} (the models' directories are also in its run.json, \"models\"; figure: "
          "figures/heldout_loss.png)")


def _interval(e: dict) -> str:
    if e["lo"] is None:
        return f"{e['value']:.4f} (one seed)"
    return f"{e['value']:.4f} [{e['lo']:.4f}, {e['hi']:.4f}]"


def sweep_table(meta: dict) -> str:
    """The sweep's held-out losses and paired differences as text (what `poslens sweep` prints)."""
    m = meta["metrics"]
    n = len(meta["config"]["seeds"])
    level = f"{100 * meta['config']['level']:g}%"
    lines = [f"held-out loss, mean over {n} seed(s) with the {level} t-interval over seeds:"]
    for v, e in m["heldout_loss"].items():
        seeds = " ".join(f"{x:.4f}" for x in e["per_seed"])
        lines.append(f"  {v:<12} {meta['labels'][v]:<40} {_interval(e)}   per seed: {seeds}")
    lines.append("paired differences (same seed: same data order and, where shapes agree, initial weights):")
    for k, e in m["differences"].items():
        lines.append(f"  {k:<25} {_interval(e)}   {e['verdict']}")
    return "\n".join(lines)


def cmd_tokenize(args: argparse.Namespace) -> None:
    from poslens.train.tokens import tokenize_corpus

    cfg = from_args(TokenizeConfig, args)
    header = tokenize_corpus(cfg.data, args.out, tokenizer=cfg.tokenizer, val_fraction=cfg.val_fraction,
                             seed=cfg.seed, text_field=cfg.text_field, force=args.force, progress=not args.quiet)
    asked = header.get("vocab_requested")
    short = (f" (of the {asked:,} asked for: the training text has no more pairs to merge)"
             if asked and header["vocab_size"] < asked else "")
    print(f"wrote {args.out}: {header['train']['tokens']:,} training tokens ({header['train']['documents']} "
          f"documents), {header['val']['tokens']:,} held-out tokens ({header['val']['documents']} documents), "
          f"{header['dtype']}, vocabulary {header['vocab_size']:,}{short}")


def main(argv: list[str] | None = None) -> int:
    """``python -m poslens.train train|sweep|tokenize ...`` (the same commands as ``poslens train|sweep|tokenize``)."""
    from poslens.errors import UsageError

    parser = argparse.ArgumentParser(prog="poslens")
    sub = parser.add_subparsers(dest="command", required=True)
    add_command(sub)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except UsageError as e:
        print(f"poslens {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0

