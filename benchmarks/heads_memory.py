"""Benchmark: what TransformerLens's per-head results (`attn.hook_result`, [B, T, H, d]) cost to form, from a warm
cache and from a cold one, against W_O's own product (run by hand).

At GPT-2 small's body (768 wide, 12 heads of 64, 2 x 256 tokens; one thread) one layer's per-head results are
H x (B*T) x d floats, 18.9 MB: twelve times attention's output. `poslens.engine.hooks.HookedModel._heads_out`
forms them with one batched GEMM (`bmm`, K = 64 per head) into a reused buffer and sums them over the heads; a plain
forward runs W_O's one GEMM (`addmm`, K = 768). Timed here, each as the median of `--calls` calls: `warm`, the
operation repeated on the same tensors (everything in cache); `cold`, a 600-MB buffer written before each call, as a
forward's other layers evict the buffer between two uses. Also: writing the 18.9 MB alone (`fill`), and two ways to
sum the results while they are in cache (per head `mm` then an addition; row blocks of `bmm` into the buffer, each
summed at once), each checked bit for bit against bmm + sum before it is timed. glibc is asked to keep freed memory,
as `HookedModel` asks it (`poslens.engine.allocator`).

    .venv/bin/python benchmarks/heads_memory.py
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from poslens.engine.allocator import keep_freed_memory


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """The median of xs and a distribution-free interval for it: the order statistics x_(k) and x_(n+1-k) with the
    largest k for which P(x_(k) <= median <= x_(n+1-k)) = 1 - 2 P(Binomial(n, 1/2) < k) is at least `level`."""
    xs, n = sorted(xs), len(xs)
    below = lambda k: sum(math.comb(n, i) for i in range(k)) / 2**n  # noqa: E731  P(Binomial(n, 1/2) < k)
    k = max((k for k in range(1, n // 2 + 1) if 1 - 2 * below(k) >= level), default=None)
    if k is None:
        raise SystemExit(f"--calls {n}: too few calls for a {level:.0%} interval of the median; give at least 6")
    mid = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
    return mid, xs[k - 1], xs[n - k]


def timed(fn, calls: int, before=None) -> tuple[float, float, float]:
    """Median ms of `calls` calls of fn after one warm-up call, `before()` (untimed) ahead of each, with its 95%
    interval (`median_interval`)."""
    fn()
    out = []
    for _ in range(calls):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - start))
    return median_interval(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--tokens", type=int, default=512, help="B*T")
    p.add_argument("--calls", type=int, default=15)
    p.add_argument("--evict-mb", type=int, default=600)
    args = p.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as HookedModel does: freed blocks reused, not handed back and faulted in again
    n, h, d = args.tokens, args.heads, args.hidden
    dh = d // h
    g = torch.Generator().manual_seed(0)
    z = torch.randn(n, h * dh, generator=g)  # attention's output before W_O, [B*T, H*D]
    weight = torch.randn(d, h * dh, generator=g) * 0.05  # nn.Linear's [out, in]
    bias = torch.randn(d, generator=g)
    zh, wh = z.view(n, h, dh).transpose(0, 1), weight.T.unflatten(0, (h, -1))  # as _heads_out views them
    buf = torch.empty(h, n, d)
    junk = torch.empty(args.evict_mb * 2**20 // 4)

    def evict():
        junk.fill_(1.0)

    def heads_sum():  # HookedModel._heads_out: bmm into the buffer, then the sum over heads
        torch.bmm(zh, wh, out=buf)
        return buf.sum(0)

    def per_head_then_add():
        total = torch.mm(zh[0], wh[0], out=buf[0]).clone()
        for i in range(1, h):
            total.add_(torch.mm(zh[i], wh[i], out=buf[i]))
        return total

    def row_blocks(rows: int):
        def run():
            total = torch.empty(n, d)
            for r in range(0, n, rows):
                block = buf[:, r:r + rows]
                torch.bmm(zh[:, r:r + rows], wh, out=block)
                torch.sum(block, 0, out=total[r:r + rows])
            return total
        return run

    reference, results = heads_sum(), buf.clone()
    arms = {"W_O addmm (plain forward)": lambda: torch.addmm(bias, z, weight.T),
            "per-head bmm": lambda: torch.bmm(zh, wh, out=buf),
            "sum over heads": lambda: buf.sum(0),
            "per-head bmm + sum (poslens)": heads_sum,
            f"fill {h * n * d * 4 / 1e6:.1f} MB": lambda: buf.fill_(0.0)}
    for name, fn in (("per head mm + add", per_head_then_add), *((f"row blocks of {r}", row_blocks(r))
                                                                  for r in (64, 256))):
        same = torch.equal(fn(), reference) and torch.equal(buf, results)
        arms[f"{name} ({'bit-identical' if same else 'NOT bit-identical'})"] = fn
    print(f"{n} tokens, {h} heads of {dh}, {d} wide, one thread; median of {args.calls} calls [95% interval], ms")
    print(f"{'operation':42} {'warm':>21} {'cold':>21}")
    for name, fn in arms.items():
        cells = ("{:6.2f} [{:5.2f}, {:5.2f}]".format(*timed(fn, args.calls, before)) for before in (None, evict))
        print(f"{name:42} {'  '.join(cells)}", flush=True)


if __name__ == "__main__":
    main()
