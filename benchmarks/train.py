"""Benchmark: poslens's training step versus a minimal hand-written PyTorch step (run by hand, not a test).

Both drive the same model (the preset's SmolLM3, built twice from the same seed) on the same batches (the
preset's token file, step by step), in the same process, interleaved: each repeat runs `--steps` steps of
one method then of the other, the order alternating between repeats. The hand-written step is what a
reader would write in a few lines: forward, cross-entropy on the shifted tokens, backward, clip, AdamW,
schedule. The poslens step (`poslens.train.loop._step`) adds its accumulation loop, autocast context,
loss bookkeeping and gradient-norm readout. Printed: median seconds per step of each, the ratio
poslens / hand-written (bar: <= 1.05 on the CPU), tokens/s and MFU (6N + attention FLOPs per token against
the datasheet bf16 peak on a known GPU, else against a measured float32 GEMM rate). The two methods' losses
are compared too: same weights, same batches, so they agree to float32 rounding.

    .venv/bin/python benchmarks/train.py --preset cpu --steps 2 --repeats 3
    .venv/bin/python benchmarks/train.py --preset small --device cuda      # on an H100
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from poslens.train.config import resolve_config
from poslens.train.data import train_batches
from poslens.train.loop import Dist, _step, gemm_flops, make_optimizer, make_scheduler, peak_flops
from poslens.train.model import build_model, flops_per_token
from poslens.train.tokens import default_tokens, open_tokens


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--tokens", default=None, help="token directory (default: the preset's embedded-corpus tokens)")
    ap.add_argument("--steps", type=int, default=2, help="steps per method per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--micro-batch", type=int, default=None)
    args = ap.parse_args()
    over = {"device": args.device, **({"micro_batch": args.micro_batch} if args.micro_batch else {})}
    cfg = resolve_config(args.preset, **over)
    tf = open_tokens(args.tokens or default_tokens(cfg.tokenizer))
    device = torch.device(args.device)
    d = Dist(0, 1, 0, device)
    models = {m: build_model(cfg, tf.vocab_size).to(device) for m in ("poslens", "hand")}
    opts = {m: make_optimizer(models[m], cfg) for m in models}
    scheds = {m: make_scheduler(opts[m], cfg) for m in models}
    gpu = device.type == "cuda"
    fpt = flops_per_token(models["poslens"].config, cfg.seq_len)
    peak, label = peak_flops(device)
    if peak is None:
        peak, label = gemm_flops(device), "measured float32 GEMM"
    times: dict[str, list[float]] = {m: [] for m in models}
    losses: dict[str, list[float]] = {m: [] for m in models}
    step = {m: 0 for m in models}
    print(f"preset {cfg.preset}: {cfg.layers} layers, d={cfg.hidden}, vocab {tf.vocab_size}, "
          f"{cfg.batch_size}x{cfg.seq_len} tokens/step, micro-batch {cfg.micro_batch}, {torch.get_num_threads()} "
          f"threads, {device}")
    for rep in range(args.repeats):
        order = ("poslens", "hand") if rep % 2 == 0 else ("hand", "poslens")
        for m in order:
            for _ in range(args.steps):
                s = step[m]
                t0 = time.perf_counter()
                if m == "poslens":
                    loss, _ = _step(models[m], opts[m], scheds[m], tf, cfg, d, s, first=s == 0)
                else:
                    blocks = [b.to(device) for b in train_batches(tf.train, cfg.seq_len, s, cfg.batch_size,
                                                                  cfg.micro_batch, 0, 1, cfg.seed)]
                    loss = hand_step(models[m], opts[m], scheds[m], blocks, cfg.grad_clip, gpu)
                if gpu:
                    torch.cuda.synchronize(device)
                times[m].append(time.perf_counter() - t0)
                losses[m].append(loss)
                step[m] += 1
    tokens = cfg.batch_size * cfg.seq_len
    med = {m: statistics.median(times[m][1:] if len(times[m]) > 1 else times[m]) for m in models}
    for m in models:
        tps = tokens / med[m]
        print(f"{m:8s} median {med[m]:.3f} s/step (min {min(times[m]):.3f}), {tps:,.0f} tokens/s, "
              f"MFU {100 * tps * fpt / peak:.1f}% of {label} ({peak / 1e9:,.0f} GFLOP/s)")
    print(f"ratio poslens / hand-written (median step time): {med['poslens'] / med['hand']:.3f}")
    diff = max(abs(a - b) for a, b in zip(losses["poslens"], losses["hand"]))
    print(f"largest loss difference over {len(losses['hand'])} matched steps: {diff:.2e}")


if __name__ == "__main__":
    main()
