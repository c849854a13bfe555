"""Benchmark: poslens's training step versus a minimal hand-written PyTorch step (run by hand, not a test).

Same model (the preset's SmolLM3, built twice from one seed), same batches, one process. The hand-written
step is forward, cross-entropy, backward, clip, AdamW, schedule; the poslens step (`poslens.train.loop._step`)
adds its accumulation loop, autocast context and loss/gradient-norm readout. Both losses must agree to
float32 rounding (the largest difference is printed).

For a shared, noisy machine the methods run in pairs, the order alternating (P H, H P, P H, ...), the two
steps of a pair on the same batch: each pair gives a ratio t(poslens) / t(hand) of two back-to-back steps. Printed:
median s/step, tokens/s and MFU of each; the geometric mean of the ratios with a 95% t interval on the log
ratios (pairs taken as independent); the 5% bar: shown (upper bound <= 1.05), not shown (lower bound > 1.05)
or not resolved. --json PATH writes every step's time and loss, the ratios and the settings. On 2 shared
cores, --threads 1 steadies the steps (with every core asked for, one preempted OpenMP thread stalls both).

    .venv/bin/python benchmarks/train.py --preset tiny --pairs 30 --json /tmp/train_tiny.json
    .venv/bin/python benchmarks/train.py --preset cpu --pairs 40 --json benchmarks/results/train_cpu.json
    .venv/bin/python benchmarks/train.py --preset small --device cuda --pairs 40      # on an H100
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import transformers

from poslens.engine.distributed import Dist
from poslens.engine.stats import t_quantile
from poslens.train.config import resolve_config
from poslens.train.data import train_batches
from poslens.train.loop import _step, gemm_flops, make_optimizer, make_scheduler, peak_flops
from poslens.train.model import build_model, causal_attention, flops_per_token
from poslens.train.tokens import default_tokens, open_tokens

METHODS = ("poslens", "hand")
BAR = 1.05  # poslens / hand-written step time


def hand_step(model, opt, sched, blocks, clip: float, autocast: bool) -> float:
    """The minimal training step: mean next-token cross-entropy, backward, clip, AdamW, schedule."""
    total = 0.0
    for block in blocks:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=block[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), block[:, 1:].flatten()) / len(blocks)
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return total


def ratio_interval(ratios: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Geometric mean of the paired ratios and its t interval (on the log ratios, exponentiated; one ratio: no
    interval, nan bounds)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = t_quantile((1 + level) / 2, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)) \
        if len(logs) > 1 else math.nan
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def verdict(lo: float, hi: float) -> str:
    """The bar against the 95% interval of poslens / hand-written."""
    if hi <= BAR:
        return f"shown (upper bound <= {BAR})"
    if lo > BAR:
        return f"not shown (lower bound > {BAR}: poslens is more than 5% slower)"
    return f"not resolved (the interval contains {BAR}: more pairs or a quieter machine)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--tokens", default=None, help="token directory (default: the preset's embedded-corpus tokens)")
    ap.add_argument("--pairs", type=int, default=30, help="timed pairs (even: the order alternates)")
    ap.add_argument("--warmup", type=int, default=2, help="pairs run first and left out of the statistics")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--attention", default=None, help="the poslens step's attention kernel (TrainConfig.attention: "
                                                      "auto, flash, cudnn, efficient, math; default the preset's)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write raw times, ratios and settings here")
    ap.add_argument("--compile", choices=("preset", "on", "off"), default="preset",
                    help="torch.compile both models as `poslens train` does when the preset says so (default), "
                         "always, or never")
    ap.add_argument("--profile", action="store_true",
                    help="after the timings, print the 15 costliest kernels of one poslens step (torch.profiler)")
    args = ap.parse_args()
    if args.pairs < 2 or args.pairs % 2:
        ap.error("--pairs must be even and at least 2 (each order, poslens first and hand-written first, "
                 "equally often)")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    over = {"device": args.device, **({"micro_batch": args.micro_batch} if args.micro_batch else {}),
            **({"attention": args.attention} if args.attention else {})}
    cfg = resolve_config(args.preset, **over)
    tf = open_tokens(args.tokens or default_tokens(cfg.tokenizer))
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    d = Dist(0, 1, 0, device)
    models = {m: build_model(cfg, tf.vocab_size).to(device) for m in METHODS}
    compiled = args.compile == "on" or (args.compile == "preset" and cfg.compile)
    if compiled:  # as poslens.train.loop does: both methods step the same compiled module type, poslens's
        causal_attention(models["poslens"])  # without an explicit causal mask (the hand-written step keeps it)
        for m in METHODS:
            models[m].compile()
    opts = {m: make_optimizer(models[m], cfg) for m in METHODS}
    scheds = {m: make_scheduler(opts[m], cfg) for m in METHODS}
    fpt = flops_per_token(models["poslens"].config, cfg.seq_len)
    peak, label = peak_flops(device)
    if peak is None:
        peak, label = gemm_flops(device), "measured float32 GEMM"
    print(f"preset {cfg.preset}: {cfg.layers} layers, d={cfg.hidden}, vocab {tf.vocab_size}, "
          f"{cfg.batch_size}x{cfg.seq_len} tokens/step, micro-batch {cfg.micro_batch}, {torch.get_num_threads()} "
          f"threads, {device}, torch {torch.__version__}, compiled: {compiled}; {args.warmup} + {args.pairs} pairs")

    def run(m: str, s: int) -> tuple[float, float]:
        """Step `s` of method `m`: (seconds, loss)."""
        t0 = time.perf_counter()
        if m == "poslens":
            loss, _ = _step(models[m], opts[m], scheds[m], tf, cfg, d, s, first=s == 0)
        else:
            blocks = [b.to(device) for b in train_batches(tf.train, cfg.seq_len, s, cfg.batch_size,
                                                          cfg.micro_batch, 0, 1, cfg.seed)]
            loss = hand_step(models[m], opts[m], scheds[m], blocks, cfg.grad_clip, gpu)
        if gpu:
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0, loss

    times: dict[str, list[float]] = {m: [] for m in METHODS}
    losses: dict[str, list[float]] = {m: [] for m in METHODS}
    first: list[str] = []
    for s in range(args.warmup + args.pairs):  # pair s: step s of both methods, back to back
        order = METHODS if s % 2 == 0 else METHODS[::-1]
        for m in order:
            dt, loss = run(m, s)
            times[m].append(dt)
            losses[m].append(loss)
        first.append(order[0])
    load_after = os.getloadavg()

    timed = slice(args.warmup, None)
    ratios = [p / h for p, h in zip(times["poslens"][timed], times["hand"][timed])]
    gmean, lo, hi = ratio_interval(ratios)
    med = {m: statistics.median(times[m][timed]) for m in METHODS}
    by_order = {o: math.exp(statistics.fmean(math.log(r) for r, f in zip(ratios, first[timed]) if f == o))
                for o in METHODS}
    tokens = cfg.batch_size * cfg.seq_len
    mfu = {m: tokens / med[m] * fpt / peak for m in METHODS}
    diff = max(abs(a - b) for a, b in zip(losses["poslens"], losses["hand"]))

    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in load_before)} before, "
          f"{', '.join(f'{x:.1f}' for x in load_after)} after")
    for m in METHODS:
        q = statistics.quantiles(times[m][timed], n=4)
        print(f"{m:8s} median {med[m]:.3f} s/step (quartiles {q[0]:.3f}-{q[2]:.3f}), {tokens / med[m]:,.0f} "
              f"tokens/s, MFU {100 * mfu[m]:.1f}% of {label} ({peak / 1e9:,.0f} GFLOP/s)")
    print(f"poslens / hand-written, {len(ratios)} pairs: geometric mean {gmean:.3f}, 95% CI [{lo:.3f}, {hi:.3f}] "
          f"(t interval on the log ratios); ratio of medians {med['poslens'] / med['hand']:.3f}; per pair "
          f"{min(ratios):.3f} to {max(ratios):.3f}")
    print(f"order check (geometric means): poslens first {by_order['poslens']:.3f}, hand-written first "
          f"{by_order['hand']:.3f}")
    print(f"bar, poslens within 5%: {verdict(lo, hi)}")
    print(f"largest loss difference over {len(losses['hand'])} matched steps: {diff:.2e}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with profile(activities=acts) as prof:
            run("poslens", args.warmup + args.pairs)
        print(prof.key_averages().table(sort_by="cuda_time_total" if gpu else "cpu_time_total", row_limit=15,
                                        max_name_column_width=60))

    if args.json:
        out = {
            "settings": {"preset": cfg.preset, "config": dataclasses.asdict(cfg), "device": str(device),
                         "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "torch": torch.__version__,
                         "compiled": compiled,
                         "transformers": transformers.__version__, "python": sys.version.split()[0],
                         "argv": sys.argv, "pairs": args.pairs, "warmup_pairs": args.warmup,
                         "load_average_before": load_before, "load_average_after": load_after,
                         "mfu_reference": label, "mfu_peak_flops": peak, "flops_per_token": fpt,
                         "tokens_per_step": tokens},
            "steps": {"first_in_pair": first, "times_s": times, "losses": losses},  # warm-up pairs included
            "ratios": ratios,  # timed pairs only, poslens / hand-written
            "summary": {"median_s": med, "mfu": mfu, "geometric_mean": gmean, "ci95": [lo, hi],
                        "interval": "t interval on the log ratios", "ratio_of_medians": med["poslens"] / med["hand"],
                        "geometric_mean_by_first": by_order, "bar": BAR, "verdict": verdict(lo, hi),
                        "max_loss_difference": diff},
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
