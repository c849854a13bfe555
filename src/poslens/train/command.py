"""Command-line wiring of `poslens train` and `poslens tokenize`: ``add_command(sub)`` adds both.

Flags come from the config dataclasses (`TrainConfig`, `TokenizeConfig`). For `train`, a flag that
is not given leaves the preset's value in place: only the flags on the command line override it.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from poslens.options import add_options, from_args, option
from poslens.train.config import FIELDS, TrainConfig, resolve_config


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
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_command(sub: argparse._SubParsersAction) -> None:
    """Add the `train` and `tokenize` subcommands to `sub` (an argparse subparsers object)."""
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

    p = sub.add_parser("tokenize", help="write a memory-mapped token file with a document-level train/val split",
                       description="Tokenize text into train.bin/val.bin (uint16 or uint32) plus header.json "
                       "and the tokenizer, for `poslens train --tokens DIR`.")
    add_options(p, TokenizeConfig)
    _output_args(p, "runs/tokens")
    p.set_defaults(func=cmd_tokenize)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The preset named by --preset (default tiny) with every given flag on top."""
    given = {k: getattr(args, k) for k in FIELDS if hasattr(args, k)}
    return resolve_config(given.pop("preset", "tiny"), **given)


def default_out(cfg: TrainConfig) -> str:
    """``runs/train-PRESET-VARIANT``: the preset's name (a .json preset's file name without the suffix) and the
    variant (none, rope or mixed, then any scaling, window and bos): runs/train-tiny-none, runs/train-cpu-rope-ntk-8."""
    name = Path(cfg.preset).stem if cfg.preset.endswith(".json") else cfg.preset
    parts = [cfg.pe if cfg.pe_layers is None else "mixed"]
    if cfg.rope_scaling:
        parts.append(cfg.rope_scaling.replace(":", "-"))
    if cfg.sliding_window:
        parts.append(f"window-{cfg.sliding_window}")
    if cfg.bos:
        parts.append("bos")
    return f"runs/train-{name}-{'-'.join(parts)}"


def cmd_train(args: argparse.Namespace) -> None:
    from poslens.train.loop import train

    cfg = train_config(args)
    out = args.out or default_out(cfg)
    metrics = train(cfg, out, force=args.force, progress=not args.quiet, stop_after=args.stop_after)
    if metrics.get("stopped"):
        print(f"stopped after step {metrics['step']}; checkpoint in {metrics['checkpoint']} (rerun to resume)")
        return
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote {out}: held-out loss {metrics['final_eval_loss']:.4f}, {metrics['tokens_per_s']:,.0f} "
              f"tokens/s, MFU {100 * metrics['mfu']:.1f}% of {metrics['mfu_reference']}\n"
              f"dissect it on its held-out text: poslens intermediates {out} --data {metrics['tokens_path']} "
              "--mode pack")


def cmd_tokenize(args: argparse.Namespace) -> None:
    from poslens.train.tokens import tokenize_corpus

    cfg = from_args(TokenizeConfig, args)
    header = tokenize_corpus(cfg.data, args.out, tokenizer=cfg.tokenizer, val_fraction=cfg.val_fraction,
                             seed=cfg.seed, text_field=cfg.text_field, force=args.force, progress=not args.quiet)
    print(f"wrote {args.out}: {header['train']['tokens']:,} training tokens ({header['train']['documents']} "
          f"documents), {header['val']['tokens']:,} held-out tokens ({header['val']['documents']} documents), "
          f"{header['dtype']}, vocabulary {header['vocab_size']:,}")


def main(argv: list[str] | None = None) -> int:
    """``python -m poslens.train train|tokenize ...`` (the same commands as ``poslens train|tokenize``)."""
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

