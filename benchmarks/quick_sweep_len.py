"""Benchmark: the `pe-quick` sweep's training at 64 tokens per block (what `reproduce --quick` trains since
2026-11-28) against 128 (before), side by side. Run by hand, not a test.

Each arm trains the six NoPE and RoPE models of seeds 0-2 as one computation (`poslens.train.sweep.train_models`,
batched, one process, one torch thread: one of the two parts the sweep trains side by side) for --steps steps of
16 sequences, into a fresh cache, so model building, the held-out losses and writing the models are timed too. The
arms alternate (128, 64, 128, ...) --rounds times so that both meet the same load; printed per round: wall and CPU
seconds (user + system, the process and its children) and the ratio 64 / 128 of each.

    POSLENS_CACHE=DIR nice .venv/bin/python benchmarks/quick_sweep_len.py --steps 20 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time


def cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    import torch

    from poslens.train.sweep import SweepConfig, resolve_matrix, train_models
    from poslens.train.tokens import default_tokens

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokens = default_tokens("bpe:2048", progress=False)  # the quick sweep's tokens, built once into POSLENS_CACHE
    res: dict[int, list[tuple[float, float]]] = {128: [], 64: []}
    for r in range(args.rounds):
        for length in res:
            os.environ["POSLENS_CACHE"] = tempfile.mkdtemp(prefix="quick-len-")  # every model trained anew
            m = resolve_matrix(SweepConfig(preset="pe-quick", train=f"seq_len={length}+steps={args.steps}+warmup=2+"
                                                                   f"eval_every={args.steps}+save_every=0+tokens={tokens}"))
            work = [(x.config, f"{x.variant} {x.seed}") for x in m.members if x.variant in ("nope", "rope")]
            wall, c = time.perf_counter(), cpu()
            train_models(work, progress=False, jobs=1, batched=True)
            res[length].append((time.perf_counter() - wall, cpu() - c))
            print(f"round {r}: {length} tokens {res[length][-1][0]:.1f} s wall, {res[length][-1][1]:.1f} s CPU, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    for k, what in ((0, "wall"), (1, "CPU")):
        ratios = [a[k] / b[k] for a, b in zip(res[64], res[128])]
        print(f"{what} 64 / 128 per round: {', '.join(f'{x:.2f}' for x in ratios)}; median "
              f"{statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
