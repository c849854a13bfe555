"""Benchmark: torch's scaled_dot_product_attention kernels, forward and backward, on one shape (run by hand, GPU).

Each kernel torch offers (`torch.nn.attention.sdpa_kernel`: flash, cuDNN, efficient, math) on the same random
bf16 queries, keys and values [B, H, T, D], causal, as `poslens train` calls it (the `small` preset's micro-batch by
default: 32 x 12 heads x 1,024 tokens x 64); a kernel that refuses the shape is reported as such. Per kernel: the
median over --repeats of forward + backward (CUDA events after 3 warm-ups), and the TFLOP/s it reaches counting the
causal half (forward 2 x 2 x B H T^2 D / 2, backward 2.5 x the forward, as `poslens.train.model.flops_per_token`
counts attention); the outputs and gradients of each against the math kernel's in float32 (largest difference).

    python3 benchmarks/sdpa_kernels.py                       # the small preset's shape
    python3 benchmarks/sdpa_kernels.py --shape 16 16 2048 128
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[32, 12, 1024, 64], metavar=("B", "H", "T", "D"))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    b, h, t, d = args.shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, up = (torch.randn(b, h, t, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
    flops = 2 * 2 * b * h * t * t * d / 2 * 3.5  # forward + backward (2.5 x forward), causal half
    results, ref = {}, None
    for name in ("math", "flash", "cudnn", "efficient"):
        x = [a.clone().requires_grad_(True) for a in (q, k, v)]
        try:
            with sdpa_kernel(KERNELS[name]):
                for _ in range(3):
                    out = F.scaled_dot_product_attention(*x, is_causal=True)
                    out.backward(up)
                times = []
                for _ in range(args.repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    for a in x:
                        a.grad = None
                    start.record()
                    out = F.scaled_dot_product_attention(*x, is_causal=True)
                    out.backward(up)
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end))
        except RuntimeError as e:
            results[name] = {"refused": str(e).splitlines()[0][:200]}
            print(f"{name:9s} refused: {results[name]['refused']}")
            continue
        got = [out.float(), *(a.grad.float() for a in x)]
        ref = got if name == "math" else ref
        diff = max((a - r).abs().max().item() for a, r in zip(got, ref))
        ms = statistics.median(times)
        results[name] = {"ms": ms, "tflops": flops / ms / 1e9, "max_diff_vs_math": diff}
        print(f"{name:9s} {ms:8.3f} ms forward + backward, {flops / ms / 1e9:6.1f} TFLOP/s; largest difference "
              f"from math {diff:.3g}")
    print(f"shape {args.shape}, bf16, causal; torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "results": results, "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
