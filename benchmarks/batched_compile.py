"""Benchmark: the batched trainer's step with each decoder layer compiled (`poslens.train.compiled`, inductor, its
code cached on disk) against the eager step, interleaved in one process. Run by hand, not a test.

One computation of --models `pe-sinks` models (the sweep's chunk on the CPU: four), built from their seeds, each
reading its own blocks of the embedded corpus (BPE 2,048) as the sweep's trainer does; two copies of the same
stacked weights, one trained by the eager step and one by the compiled step (`_Chunk.gradients` and `update`:
forward, the chunked LM head and loss, backward, clipping, fused AdamW). First the compiled copy's first step,
which compiles (or loads from the cache) the forward and backward graphs: its wall and CPU seconds (this process
and any compiler subprocesses) are the compile cost. Then --rounds rounds, each --steps eager steps and --steps
compiled steps, the order alternating; per round the CPU milliseconds per model and step of each arm and their
ratio. Printed: the medians and the geometric mean of the ratios with a 95% t-interval over rounds; the largest
difference of the two copies' losses at the first step (equal code up to float32 rounding), and the seconds a
2,000-step part of --part models would save (per model and step saved x steps x models) against the compile cost.

Run it twice with the same --cache (a fresh directory the first time): the first run compiles cold, the second
loads the compiled code (warm).

    nice -n 19 .venv/bin/python benchmarks/batched_compile.py --cache /tmp/inductor-cold --json /tmp/cold.json
    nice -n 19 .venv/bin/python benchmarks/batched_compile.py --cache /tmp/inductor-cold --json /tmp/warm.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import resource
import statistics
import sys
import time

import torch
from sweep_batched import configs

from poslens.engine.stats import t_quantile


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children (inductor's compile workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def math_attention(q, k, v, attn_mask=None, scale=None, enable_gqa=False):  # noqa: ANN001, ANN201
    """Scaled dot-product attention written out, grouped-query heads by a view of the queries."""
    nb, h, t, hd = q.shape
    kv = k.shape[1]
    q = q.reshape(nb, kv, h // kv, t, hd)
    scores = torch.matmul(q * scale, k[:, :, None].transpose(-1, -2))  # [NB, K, G, T, T]
    scores = scores.masked_fill(~attn_mask[:, :, None], float("-inf"))
    return torch.matmul(scores.softmax(-1), v[:, :, None]).reshape(nb, h, t, hd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=4, help="models in the computation (the sweep's CPU chunk: 4)")
    ap.add_argument("--steps", type=int, default=20, help="steps per arm and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a sweep worker of two: 1)")
    ap.add_argument("--part", type=int, default=16, help="models of the 2,000-step part the saving is worked for")
    ap.add_argument("--cache", default=None, help="inductor's cache directory (default: under the poslens cache)")
    ap.add_argument("--math-attention", action="store_true",
                    help="experiment: the compiled layer with attention written out (scores, mask, soft-max, "
                         "values) instead of torch's SDPA kernel, so inductor fuses it too")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache
    torch.set_num_threads(args.threads)

    from poslens.engine.allocator import keep_freed_memory
    from poslens.train.batched import _Chunk, _Member, decoder_layer
    from poslens.train.compiled import compile_static, use_disk_cache
    from poslens.train.data import train_batches
    from poslens.train.loop import bos_id, document_separator
    from poslens.train.model import build_model
    from poslens.train.tokens import open_tokens

    keep_freed_memory()
    cfgs = configs(2000, args.models)
    tf = open_tokens(cfgs[0].tokens)
    device = torch.device("cpu")

    def chunk(compiled: object) -> _Chunk:
        members = [_Member(c, build_model(c, tf.vocab_size, bos_token_id=tf.header["bos_token_id"],
                                          eos_token_id=tf.header["eos_token_id"]), None, None, 0, None)
                   for c in cfgs]
        return _Chunk(members, slice(0, len(members)), cfgs[0], device, compiled)

    reads = [(c.seed, bos_id(c, tf), document_separator(c, tf)) for c in cfgs]
    cfg = cfgs[0]

    def data(step: int) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        batches = [train_batches(tf.train, cfg.seq_len, step, cfg.batch_size, cfg.micro_batch, 0, 1, *r)
                   for r in reads]
        micro = len(batches[0])
        blocks = [torch.stack([b[j] for b in batches]) for j in range(micro)]
        return blocks, [(torch.ones(len(cfgs)), torch.full((len(cfgs),), float(micro)))] * micro

    eager = chunk(None)
    where = use_disk_cache()
    compiled = chunk(compile_static(functools.partial(decoder_layer, attention=math_attention) if args.math_attention
                                    else decoder_layer))
    blocks, factors = data(0)
    w0, c0 = time.perf_counter(), cpu_seconds()
    first_c = compiled.gradients(blocks, factors)
    compiled.update()
    compile_wall, compile_cpu = time.perf_counter() - w0, cpu_seconds() - c0
    first_e = eager.gradients(blocks, factors)
    eager.update()
    first_diff = (first_c - first_e).abs().max().item()
    print(f"compile (first compiled step, cache {where}): {compile_wall:.1f} s wall, {compile_cpu:.1f} s CPU; "
          f"first-step losses differ by at most {first_diff:.2e}", flush=True)
    rows, step = [], 1
    for r in range(args.rounds):
        times = {}
        for name in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
            c = eager if name == "eager" else compiled
            t0 = time.process_time()
            for s in range(args.steps):
                b, f = data(step + s)
                c.gradients(b, f)
                c.update()
            times[name] = 1000 * (time.process_time() - t0) / args.steps / len(cfgs)
        step += args.steps
        rows.append({"round": r, "eager_ms": times["eager"], "compiled_ms": times["compiled"],
                     "ratio": times["eager"] / times["compiled"], "load": os.getloadavg()[0]})
        print(f"round {r}: CPU ms per model and step, eager {times['eager']:.1f}, compiled {times['compiled']:.1f}: "
              f"{rows[-1]['ratio']:.3f}x (load average {rows[-1]['load']:.1f})", flush=True)
    logs = [math.log(x["ratio"]) for x in rows]
    mean = statistics.fmean(logs)
    half = t_quantile(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0
    eager_ms = statistics.median(x["eager_ms"] for x in rows)
    compiled_ms = statistics.median(x["compiled_ms"] for x in rows)
    saved = (eager_ms - compiled_ms) / 1000 * 2000 * args.part
    print(f"median CPU ms per model and step: eager {eager_ms:.1f}, compiled {compiled_ms:.1f}; eager / compiled "
          f"{math.exp(mean):.3f}x [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}] (95% t over "
          f"{len(rows)} rounds); a 2,000-step part of {args.part} models saves about {saved:.0f} CPU s against "
          f"{compile_cpu:.0f} CPU s of compiling")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "compile_wall_s": compile_wall, "compile_cpu_s": compile_cpu,
                       "first_step_loss_diff": first_diff, "rounds": rows, "ratio": math.exp(mean),
                       "lo": math.exp(mean - half), "hi": math.exp(mean + half), "saved_part_cpu_s": saved,
                       "command": " ".join(sys.argv)}, f, indent=1)


if __name__ == "__main__":
    main()
