"""Benchmark: the hook engine's eager attention steps against transformers' eager attention ops (run by hand).

When a reader asks for `attn.hook_attn_scores` or `attn.hook_pattern`, the hook engine forms the pattern densely
(`poslens.engine.hooks._dense_scores`, softmax, `_weigh`) with transformers' eager operations: `matmul(q, k^T)`
(which copies the head-strided q and k, a [B, T, H, D] projection seen as [B, H, T, D], into one [B*H, T, D] batch)
and `matmul(pattern, v).transpose(1, 2).contiguous()`. What differs is the scaling and the mask, one pass in place
with the mask made once per forward. (From 2026-11-30 to 2026-12-01 the engine ran one `bmm` per sequence on the
strided views instead, without the copies; on an AVX-512 CPU those kernels rounded otherwise, so the engine went back
to transformers' ops: BENCHMARKS.md.) Timed here at
GPT-2 small's body by default (12 heads of 64, 2 x 256 tokens, the implicit causal mask; one thread): `hf`, the ops
as transformers writes them; `engine`, the engine's functions; both from a cold cache (a 600-MB buffer written before
each call, as a forward's other layers evict the tensors between two uses), alternating, and each pair's ratio;
reported: each arm's median and the geometric mean of the paired ratios engine / hf with its 95% t-interval. The
outputs are checked equal bit for bit first.

    .venv/bin/python benchmarks/eager_steps.py
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import ratio_interval  # noqa: E402 (benchmarks/train.py)

from poslens.engine.hooks import _dense_scores, _weigh  # noqa: E402


def hf_steps(q, k, v, scaling: float, mask: torch.Tensor) -> torch.Tensor:
    """transformers' eager_attention_forward for equal query and key/value heads: z [B, T, H, D]."""
    s = torch.matmul(q, k.transpose(2, 3)) * scaling + mask
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v).transpose(1, 2).contiguous()


def engine_steps(q, k, v, scaling: float, memo: dict) -> torch.Tensor:
    """The hook engine's eager steps (the implicit causal mask), as `HookedModel._attention` runs them."""
    s = _dense_scores(q, k, scaling, None, None, 0, memo)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return _weigh(p, v)


def shape_args(description: str) -> argparse.Namespace:
    """The attention shape and the number of rounds (default GPT-2 small's body: 2 x 256 tokens, 12 heads of 64, 40
    rounds); one thread and a fixed seed set (shared with heads_product.py)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return a


def cold_times(arms: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each arm per round after two warm-up rounds, from a cold cache (a 600-MB buffer written before each
    call, as a forward's other layers evict the tensors between two uses), the order alternating by round."""
    evict = torch.empty(150_000_000)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for i in range(rounds + 2):
        order = list(arms) if i % 2 == 0 else list(arms)[::-1]
        for name in order:
            evict.fill_(i)
            start = time.perf_counter()
            arms[name]()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    a = shape_args(__doc__.splitlines()[0])
    b, t, h, d = a.batch, a.tokens, a.heads, a.head_dim
    q, k, v = (torch.randn(b * t, h * d).view(b, t, h, d).transpose(1, 2) for _ in range(3))  # [B, H, T, D] views
    scaling = d**-0.5
    mask = torch.zeros(t, t).masked_fill_(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    memo: dict = {}
    same = torch.equal(hf_steps(q, k, v, scaling, mask), engine_steps(q, k, v, scaling, memo))
    print(f"z bit-identical: {same}")
    if not same:
        raise SystemExit("the engine's steps differ from transformers' ops: not timed")
    times = cold_times({"hf": lambda: hf_steps(q, k, v, scaling, mask),
                        "engine": lambda: engine_steps(q, k, v, scaling, memo)}, a.pairs)
    med = {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}
    ratio, lo, hi = ratio_interval([e / f for e, f in zip(times["engine"], times["hf"])])
    print(f"B={b} T={t} H={h} D={d}, {a.pairs} pairs, cold: hf {med['hf']:.2f} ms, engine {med['engine']:.2f} ms; "
          f"engine / hf {ratio:.3f} [{lo:.3f}, {hi:.3f}] (geometric mean of the paired ratios, 95%)")


if __name__ == "__main__":
    main()
