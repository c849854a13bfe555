"""Benchmark: a forward pass of a trained model with float32 subnormals flushed to 0 against the same forward with
them kept (the analyses run with them kept; only training flushes, `poslens.train.loop.subnormals_flushed`). Run by
hand, not a test.

Loads MODEL (a directory `from_pretrained` reads, e.g. a sweep model in the poslens cache's `trained/`) in float32
with --attn (eager: the dense soft-max, as the hook engine forms it when the pattern is read; sdpa: the plain
forward's kernel), draws --batch x --seq-len token ids (seed 0) and times forwards without gradients on --threads
threads, the modes alternating --rounds times (--repeats forwards each, after one untimed forward). Printed: the
subnormal weights of the model, each mode's median forward, and kept / flushed per round with the geometric mean and
its 95% t-interval over rounds; the largest difference of the logits between the modes.

    .venv/bin/python benchmarks/subnormals_forward.py ~/.cache/poslens/trained/tiny-rope-bos-s0-* --attn eager

--cli "COMMAND ARGS" times a whole `poslens` command instead (in this process, through `poslens.cli.main`, each run
into a fresh --out): "flushed" as the command line runs it, "kept" with the command line's flush switched off;
printed: each arm's wall seconds per round, the ratio kept / flushed with its interval, and whether the two arms'
run.json metrics are identical.

    .venv/bin/python benchmarks/subnormals_forward.py --cli "length MODEL --eval-lens 64,128,256,512 --quiet"
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from poslens.subnormals import flushing_subnormals

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import ratio_interval  # noqa: E402 (benchmarks/train.py)


def timed(model, ids: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor]:
    """The median of `repeats` forwards' wall seconds (after an untimed one) and the last logits."""
    with torch.no_grad():
        model(ids)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            logits = model(ids).logits
            times.append(time.perf_counter() - t0)
    return statistics.median(times), logits


def command(line: str, rounds: int) -> None:
    """Time `poslens LINE` with the command line's flush (flushed) and without it (kept), alternating `rounds` times."""
    import contextlib
    import json
    import shlex
    import tempfile

    import poslens.subnormals as sub
    from poslens.cli import main as poslens

    own = sub.subnormals_flushed
    times: dict[str, list[float]] = {"kept": [], "flushed": []}
    metrics: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="subnormals-cli-") as tmp:
        for r in range(rounds):
            for arm in ("kept", "flushed"):
                sub.subnormals_flushed = (lambda device="cpu": contextlib.nullcontext()) if arm == "kept" else own
                out = Path(tmp) / f"{arm}-{r}"
                t0 = time.perf_counter()
                try:
                    code = poslens([*shlex.split(line), "--out", str(out)])
                finally:
                    sub.subnormals_flushed = own
                times[arm].append(time.perf_counter() - t0)
                if code != 0:
                    raise SystemExit(f"poslens {line} exited {code}")
                metrics.setdefault(arm, json.dumps(json.loads((out / "run.json").read_text())["metrics"],
                                                   sort_keys=True))
            print(f"round {r}: {times['kept'][-1]:.1f} s kept, {times['flushed'][-1]:.1f} s flushed", flush=True)
    ratios = [k / f for k, f in zip(times["kept"], times["flushed"])]
    mean, lo, hi = ratio_interval(ratios)
    print(f"poslens {line}: median {statistics.median(times['kept']):.1f} s kept, "
          f"{statistics.median(times['flushed']):.1f} s flushed; kept / flushed {mean:.3f}x [{lo:.3f}, {hi:.3f}] over "
          f"{rounds} rounds; run.json metrics {'identical' if metrics['kept'] == metrics['flushed'] else 'differ'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--cli", default=None, help="a whole poslens command line to time instead (quoted)")
    ap.add_argument("--attn", choices=("eager", "sdpa"), default="eager")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if args.cli:
        return command(args.cli, args.rounds)
    if args.model is None:
        ap.error("give MODEL, or --cli")
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                 attn_implementation=args.attn).eval()
    tiny = torch.finfo(torch.float32).tiny
    weights = sum(p.numel() for p in model.parameters())
    small = sum(int(((p != 0) & (p.abs() < tiny)).sum()) for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len),
                        generator=torch.Generator().manual_seed(0))
    before = flushing_subnormals()
    ratios, kept_s, flushed_s, diff = [], [], [], 0.0
    try:
        for _ in range(args.rounds):
            torch.set_flush_denormal(False)
            k, kept_logits = timed(model, ids, args.repeats)
            torch.set_flush_denormal(True)
            f, flushed_logits = timed(model, ids, args.repeats)
            kept_s.append(k)
            flushed_s.append(f)
            ratios.append(k / f)
            diff = max(diff, float((kept_logits - flushed_logits).abs().max()))
    finally:
        torch.set_flush_denormal(before)
    mean, lo, hi = ratio_interval(ratios)
    print(f"{args.model}: {small} of {weights} weights subnormal; {args.attn} attention, {args.batch} x "
          f"{args.seq_len} tokens, {args.threads} thread(s): forward {statistics.median(kept_s):.3f} s kept, "
          f"{statistics.median(flushed_s):.3f} s flushed; kept / flushed {mean:.3f}x [{lo:.3f}, {hi:.3f}] over "
          f"{len(ratios)} rounds; largest logit difference between the modes {diff:.3g}")


if __name__ == "__main__":
    main()
