"""Benchmark: what reading `attn.hook_result` costs at W_O, against W_O's own product (run by hand).

A reader of `attn.hook_result` (each head's output after W_O, [B, T, H, d]: TransformerLens's use_attn_result) makes
the hook engine form every head's z_h W_O[h] (`HookedModel._heads_out`: one batched GEMM over the heads) and then
attention's output as their sum, where the plain forward runs W_O once on z. Both products have the same
multiply-adds; the per-head one writes H times as many outputs (each a sum of D products, not H * D) and its sum reads
them again. Timed here at GPT-2 small's body by default (12 heads of 64, 2 x 256 tokens, one thread), from a cold
cache (a 600-MB buffer written before each call, as a forward's other layers evict the tensors between two uses),
alternating: `linear`, W_O on z (the plain forward's); `heads`, the engine's per-head product into a reused buffer
and the sum (the read forward's); `product`, the per-head product alone. Reported: each arm's median and the
geometric mean of the paired ratios heads / linear and product / linear with their 95% t-intervals, and the excess
per layer in ms. The per-head sum is checked against W_O's output first (float32 sums in another order: 1e-5 of its
largest value).

    .venv/bin/python benchmarks/heads_product.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eager_steps import cold_times, shape_args  # noqa: E402 (benchmarks/eager_steps.py)
from train import ratio_interval  # noqa: E402 (benchmarks/train.py)


def main() -> None:
    a = shape_args(__doc__.splitlines()[0])
    n, h, dh = a.batch * a.tokens, a.heads, a.head_dim
    d = h * dh
    w_o = torch.nn.Linear(d, d)  # as OPT's out_proj: weight [d, H*D], applied as z @ weight.T + bias
    z = torch.randn(n, d)
    zh = z.view(n, h, dh).transpose(0, 1)  # [H, N, D] head-strided, as the engine reads z
    wh = w_o.weight.T.unflatten(0, (h, dh))  # [H, D, d] each head's rows of W_O
    buf = torch.empty(h, n, d)  # the engine's reused per-head buffer

    def linear():
        return torch.nn.functional.linear(z, w_o.weight, w_o.bias)

    def product():
        return torch.bmm(zh, wh, out=buf)

    def heads():
        return torch.bmm(zh, wh, out=buf).sum(0).add_(w_o.bias)

    with torch.no_grad():
        ref = linear()
        err = float((heads() - ref).abs().max() / ref.abs().max())
        print(f"per-head sum against W_O's output: {err:.2e} of its largest value")
        if not err <= 1e-5:
            raise SystemExit("the per-head sum is not W_O's output: not timed")
        times = cold_times({"linear": linear, "heads": heads, "product": product}, a.pairs)
    med = {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}
    line = f"B*T={n} H={h} D={dh}, {a.pairs} rounds, cold: " + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items())
    for arm in ("heads", "product"):
        ratio, lo, hi = ratio_interval([x / y for x, y in zip(times[arm], times["linear"])])
        line += f"; {arm} / linear {ratio:.3f} [{lo:.3f}, {hi:.3f}]"
    print(line + f"; excess of heads per layer {med['heads'] - med['linear']:.2f} ms (medians)")


if __name__ == "__main__":
    main()
