"""Benchmark: sweep training throughput, models of the `pe-sinks` shape per minute, trained as one computation
(`poslens.train.batched`, the sweep's default) against each model alone, two processes at a time (the sweep before
it). Run by hand, not a test.

Both arms call the sweep's own `poslens.train.sweep.train_models` on the `pe-sinks` matrix's configurations (4
layers, d = 64, 8 heads of 8, 2,000-entry BPE, 8 x 64 tokens per step at lr 0.04), shortened to --steps steps (the
warm-up cut to a tenth), each model into a fresh cache, so everything a sweep does per model is timed: start-up of
the worker processes, the step-0 and final held-out loss, writing the model. Arm "alone": --alone models (the four
variants of the first seeds), two at a time (``batched=False, jobs=2``). Arm "batched": --batched models (the four
variants x --batched / 4 seeds), as one computation in two parts side by side (``jobs=2``). The arms alternate
(alone, batched, alone, ...) --rounds times so that both meet the same load of a shared machine; each round gives
one ratio of models per minute, batched over alone; printed: each arm's median models per minute, the geometric
mean of the ratios with a 95% t-interval over rounds, each arm's CPU seconds per model (user + system of the
process and its workers: what the load of a shared machine inflates least), each arm's MFU in its training steps
(`step_mfu`: the share of a core's float32 GEMM rate; what 4x the alone arm's would be says whether the bar is within
the cores' reach), and the 4x bar: met (lower end >= 4),
not met (upper end < 4) or not resolved. --json PATH writes every timing.

--blocks doc-start times the document-start models instead: the `bos-sinks` matrix's rope-doc and rope-doc-nobos
(every block one document's start, padded, BOS first and not; the same shape and training fields), in both arms
over seeds 0, 1, ...; the alone arm is how the sweep trained them before they were batched (each alone, two
processes at a time).

    nice .venv/bin/python benchmarks/sweep_batched.py --steps 100 --rounds 3 --json /tmp/sweep_batched.json
    nice .venv/bin/python benchmarks/sweep_batched.py --blocks doc-start --steps 100 --rounds 3 --batched 16

--compile on: the batched arm with its layers compiled (`poslens.train.compiled`; the sweep compiles on its own
only in parts of 10,000 model-steps or more); --compile both: a third arm, the batched models compiled, after the
eager batched arm in each round. The compiled code is kept in one fresh inductor cache for the whole run, so round
0 compiles cold (each worker process compiles the same graphs at the same time) and later rounds load it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from poslens.engine.stats import t_quantile
from poslens.train.cache import tokens_of
from poslens.train.sweep import SweepConfig, resolve_matrix, train_models

BAR = 4.0


def configs(steps: int, models: int, blocks: str = "packed", tokens: str | None = None,
            device: str | None = None) -> list:
    """`models` configurations, `steps` steps: of the pe-sinks matrix (its four variants over seeds 0, 1, ...), or
    with `blocks` "doc-start" the bos-sinks matrix's document-start variants (rope-doc, rope-doc-nobos); `tokens`: a
    token directory of the matrix's tokenizer instead of the cache's; `device`: instead of the configs' own (auto)."""
    matrix = resolve_matrix(SweepConfig(preset="pe-sinks" if blocks == "packed" else "bos-sinks",
                                        seeds=list(range(models))))
    tokens = tokens or str(tokens_of(matrix.members[0].config))
    chosen = [m for m in matrix.members if m.config.blocks == blocks]
    members = sorted(chosen, key=lambda m: (m.seed, list(matrix.variants).index(m.variant)))[:models]
    return [dataclasses.replace(m.config, steps=steps, warmup=max(1, steps // 10), tokens=tokens,
                                **({"device": device} if device else {})) for m in members]


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children (the sweep's worker processes)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def step_mfu(cache: str, after: int) -> float:
    """The median over models of each model's median MFU over its steps after `after` (past the compile and warm-up):
    the trainers' own `mfu`, the FLOPs per second of the model's process (a batched part: all its models) over the
    one-thread float32 GEMM rate that process measured (`poslens.train.loop.gemm_flops`), so the share of a core's
    GEMM rate the training step reaches; the ratio of the arms' MFU bounds their throughput ratio from above."""
    per_model = []
    for f in Path(cache, "trained").glob("*/metrics.jsonl"):
        rows = [json.loads(line) for line in f.read_text().splitlines() if '"mfu"' in line]
        values = [r["mfu"] for r in rows if r["step"] > after and r.get("mfu") is not None]
        if values:
            per_model.append(statistics.median(values))
    return statistics.median(per_model) if per_model else float("nan")


def timed(cfgs: list, batched: bool, jobs: int, compile: str = "off") -> tuple[float, float, float]:
    """Wall and CPU seconds to train `cfgs` into an empty model cache with the sweep's trainer (`compile`: the
    batched layers compiled, "on", or eager, "off"), and the models' median MFU per model (`step_mfu`)."""
    with tempfile.TemporaryDirectory(prefix="sweep-batched-") as cache:
        os.environ["POSLENS_CACHE"] = cache
        t0, c0 = time.perf_counter(), cpu_seconds()
        train_models([(c, f"model {i}") for i, c in enumerate(cfgs)], progress=False, jobs=jobs, batched=batched,
                     compile=compile)
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        return wall, cpu, step_mfu(cache, max(5, cfgs[0].steps // 10))


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of `ratios` and its 95% t-interval (over the log ratios)."""
    logs = [math.log(x) for x in ratios]
    mean = statistics.fmean(logs)
    half = t_quantile(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--alone", type=int, default=4, help="models in the two-at-a-time arm")
    ap.add_argument("--batched", type=int, default=32, help="models in the batched arm")
    ap.add_argument("--jobs", type=int, default=2, help="processes side by side in each arm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blocks", choices=("packed", "doc-start"), default="packed",
                    help="packed: the pe-sinks models; doc-start: the bos-sinks document-start models")
    ap.add_argument("--compile", choices=("off", "on", "both"), default="off",
                    help="the batched arm's layers compiled (on), eager (off), or a third arm, the batched models "
                         "compiled beside the eager batched arm (both); compiled code is kept in one fresh inductor "
                         "cache for the whole run: compiled cold in round 0, loaded warm after")
    ap.add_argument("--tokens", default=None, help="the BPE-2,048 token directory (default: the poslens cache's)")
    ap.add_argument("--device", default=None, help="cpu, cuda (default: the configs' auto)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.compile != "off":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="sweep-batched-inductor-")
    own_cache = os.environ.get("POSLENS_CACHE")
    alone = configs(args.steps, args.alone, args.blocks, args.tokens, args.device)
    many = configs(args.steps, args.batched, args.blocks, args.tokens, args.device)
    rows = []
    for r in range(args.rounds):
        a, a_cpu, a_mfu = timed(alone, False, args.jobs)
        b, b_cpu, b_mfu = timed(many, True, args.jobs, "on" if args.compile == "on" else "off")
        rows.append({"round": r, "alone_s": a, "batched_s": b, "alone_per_min": 60 * len(alone) / a,
                     "batched_per_min": 60 * len(many) / b, "alone_cpu_per_model": a_cpu / len(alone),
                     "batched_cpu_per_model": b_cpu / len(many), "alone_mfu": a_mfu, "batched_mfu": b_mfu})
        rows[-1]["ratio"] = rows[-1]["batched_per_min"] / rows[-1]["alone_per_min"]
        print(f"round {r}: alone {len(alone)} models in {a:.1f} s ({rows[-1]['alone_per_min']:.2f}/min), batched "
              f"{'compiled ' if args.compile == 'on' else ''}{len(many)} in {b:.1f} s "
              f"({rows[-1]['batched_per_min']:.2f}/min): {rows[-1]['ratio']:.2f}x; CPU s per "
              f"model {a_cpu / len(alone):.1f} alone, {b_cpu / len(many):.1f} batched; MFU {a_mfu:.1%} alone, "
              f"{b_mfu:.1%} batched", flush=True)
        if args.compile == "both":
            k, k_cpu, k_mfu = timed(many, True, args.jobs, "on")
            rows[-1].update({"compiled_s": k, "compiled_per_min": 60 * len(many) / k,
                             "compiled_cpu_per_model": k_cpu / len(many), "compiled_mfu": k_mfu,
                             "compiled_ratio": a / k * len(many) / len(alone)})
            print(f"round {r}: batched compiled {len(many)} in {k:.1f} s ({rows[-1]['compiled_per_min']:.2f}/min): "
                  f"{rows[-1]['compiled_ratio']:.2f}x alone, {b / k:.2f}x the eager batched arm; CPU s per model "
                  f"{k_cpu / len(many):.1f}; MFU {k_mfu:.1%}; inductor cache {'cold' if r == 0 else 'warm'}",
                  flush=True)
    if own_cache is None:
        os.environ.pop("POSLENS_CACHE", None)
    mean, lo, hi = interval([x["ratio"] for x in rows])
    bar = "met" if lo >= BAR else "not met" if hi < BAR else "not resolved"
    print(f"{args.blocks} blocks; models per minute, median: alone (two at a time) "
          f"{statistics.median(x['alone_per_min'] for x in rows):.2f},"
          f" batched {statistics.median(x['batched_per_min'] for x in rows):.2f}; ratio {mean:.2f}x "
          f"[{lo:.2f}, {hi:.2f}] (95% t over {len(rows)} rounds); the {BAR:g}x bar: {bar}")
    if args.compile == "both":
        k, k_lo, k_hi = interval([x["compiled_ratio"] for x in rows])
        e, e_lo, e_hi = interval([x["batched_s"] / x["compiled_s"] for x in rows])
        print(f"batched compiled: {k:.2f}x [{k_lo:.2f}, {k_hi:.2f}] the alone arm's models per minute, {e:.2f}x "
              f"[{e_lo:.2f}, {e_hi:.2f}] the eager batched arm's (95% t over {len(rows)} rounds; round 0 cold)")
    best = max(statistics.median(x[k] for x in rows) for k in ("batched_mfu", "compiled_mfu") if k in rows[0])
    alone_mfu = statistics.median(x["alone_mfu"] for x in rows)
    print(f"MFU (a process's FLOP rate over one core's float32 GEMM rate), median: alone {alone_mfu:.1%}, batched "
          f"{best:.1%}; {BAR:g}x the alone arm's rate in the training steps is {BAR * alone_mfu:.0%} of the GEMM rate")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rounds": rows, "ratio": mean, "lo": lo, "hi": hi,
                       "bar": bar, "command": " ".join(sys.argv)}, f, indent=1)


if __name__ == "__main__":
    main()
