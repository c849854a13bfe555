"""Profile: where a forward reading every hook point spends its time beyond a plain forward, op by op (run by hand).

One family of `benchmarks/families.py` at its shape (default GPT-2 small's body: 768 wide, 12 layers, 2 x 256
tokens, one thread). `--forwards` forwards of each kind, the order alternating, each under `torch.profiler`; per
operator and input shapes, the self CPU time per forward of the plain forward and of the read one, sorted by the
size of their difference. A profile attributes the excess; the ratio itself, with its interval, is families.py's.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/profile_ops.py --family opt --forwards 6
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import FAMILIES, add_model_args, read, setup  # noqa: E402 (benchmarks/families.py)


def self_times(fn, forwards: int, into: collections.Counter) -> float:
    """Add each (operator, input shapes)'s self CPU ms per forward of one profiled call of fn to `into`; returns
    the call's total self CPU ms per forward."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        fn()
    events = p.key_averages(group_by_input_shape=True)
    for e in events:
        into[(e.key, str(e.input_shapes)[:80])] += e.self_cpu_time_total / 1e3 / forwards
    return sum(e.self_cpu_time_total for e in events) / 1e3 / forwards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=FAMILIES, default="opt")
    add_model_args(p, hidden=768, layers=12)
    p.add_argument("--forwards", type=int, default=6)
    p.add_argument("--top", type=int, default=28)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, hm, ids = setup(args.family, args)
    hooks = {point: read for point in hm.points}
    arms = {"plain": lambda: model(input_ids=ids, use_cache=False),
            "read": lambda: hm.run(ids, hooks=hooks, logits=True)}
    ops = {name: collections.Counter() for name in arms}
    total = collections.Counter()
    with torch.no_grad():
        for fn in arms.values():  # warm-up
            fn()
        for i in range(args.forwards):
            for name in (list(arms) if i % 2 else list(arms)[::-1]):
                total[name] += self_times(arms[name], args.forwards, ops[name])
    print(f"{args.family}: self CPU ms per forward, plain {total['plain']:.1f}, read {total['read']:.1f}")
    keys = sorted(set(ops["plain"]) | set(ops["read"]), key=lambda k: -abs(ops["read"][k] - ops["plain"][k]))
    print(f"{'plain':>8} {'read':>8} {'read-plain':>10}  operator, input shapes")
    for k in keys[:args.top]:
        a, b = ops["plain"][k], ops["read"][k]
        print(f"{a:8.1f} {b:8.1f} {b - a:+10.1f}  {k[0]} {k[1]}")


if __name__ == "__main__":
    main()
