"""Benchmark: poslens.stack.simulate versus the paper's published simulation procedure (run by hand, not a test).

The paper's configuration (Section 4.1): 100,000 samples, n = 50, d = 64, 4 layers, l2, causal, one alpha.
"reference" is a straightforward implementation of the published procedure, written here: all samples
materialised at once, then the 4 layers on the whole [B, n, n] / [B, n, d] tensors, keeping the mean
pre-softmax scores. poslens runs in two configurations: "poslens" computes every map (mean and
standard error of the scores, the probabilities and the hidden-state cosines), "poslens-scores"
(`maps=("scores",)`) the mean scores and their standard errors only, i.e. the reference's work plus the
standard errors: the equal-work comparison. Each method runs in its own subprocess (so peak RSS is
measured cleanly), repeats are interleaved (the order rotates every repeat), the two poslens runs'
score maps are checked to be identical (same seed), and poslens's and the reference's mean score maps
are compared (different random draws, so they agree within Monte Carlo noise: the difference is
reported in units of sqrt(2) * poslens's standard error).

    .venv/bin/python benchmarks/simulate.py --samples 100000 --repeats 3
    .venv/bin/python benchmarks/simulate.py --device cuda      # on a GPU machine
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

N, D, LAYERS = 50, 64, 4
METHODS = ("poslens", "poslens-scores", "reference")  # all maps; mean scores + SE only; the published procedure


def reference(samples: int, alpha: float, device: str) -> torch.Tensor:
    """The published procedure: every sample at once, default threads, float32; mean scores [L, n, n]."""
    g = torch.Generator(device).manual_seed(0)
    l = math.sqrt(alpha / (1 - alpha))
    x = torch.randn(samples, N, D, generator=g, device=device) + l * torch.randn(samples, 1, D, generator=g,
                                                                                device=device)
    x = F.normalize(x, dim=-1)
    mask = torch.full((N, N), -math.inf, device=device).triu(1)
    means = []
    for _ in range(LAYERS):
        h = x / (x.norm(dim=-1, keepdim=True) + 1e-12)
        scores = h @ h.mT
        means.append(scores.mean(0))
        attn = torch.softmax(scores + mask, dim=-1)
        x = attn @ h + x
    return torch.stack(means).double().cpu()


def worker(args: argparse.Namespace) -> None:
    """Run one method in this process; write wall seconds, peak memory and the mean maps.

    On a GPU the method runs twice: `seconds_cold` includes CUDA's lazy start-up (cuBLAS handle, kernel
    loading), `seconds` is the second, warm run.
    """
    from poslens.stack.config import StackConfig
    from poslens.stack.simulate import simulate

    cuda = args.device == "cuda"

    def timed():
        if cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        if args.worker == "reference":
            mean, se = reference(args.samples, args.alpha, args.device), None
        else:
            maps = ("scores",) if args.worker == "poslens-scores" else ("scores", "probs", "cosine")
            r = simulate(StackConfig(n=N, d=D, layers=LAYERS, alpha=args.alpha), args.samples, seed=0,
                         device=args.device, maps=maps)
            mean, se = r.scores_mean, r.scores_se
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, time.process_time() - c0, mean, se

    out = {"rss_before_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
           "threads": torch.get_num_threads()}
    if cuda:
        torch.zeros(1, device="cuda")  # CUDA context outside the timings
        out["seconds_cold"] = timed()[0]
        torch.cuda.reset_peak_memory_stats()
    out["seconds"], out["cpu_seconds"], mean, se = timed()
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if cuda:
        out["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 2**30
        out["gpu"] = torch.cuda.get_device_name(0)
    torch.save({"mean": mean, "se": se}, args.result + ".pt")
    Path(args.result).write_text(json.dumps(out))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--alpha", type=float, default=0.2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", help="also write the raw numbers here")
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    runs = {m: [] for m in METHODS}
    maps = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = METHODS[r % 3:] + METHODS[:r % 3]
            for method in order:
                result = os.path.join(tmp, f"{method}-{r}.json")
                cmd = [sys.executable, __file__, "--worker", method, "--result", result, "--samples",
                       str(args.samples), "--alpha", str(args.alpha), "--device", args.device]
                subprocess.run(cmd, check=True)
                runs[method].append(json.loads(Path(result).read_text()))
                maps[method] = torch.load(result + ".pt")
                last = runs[method][-1]
                print(f"repeat {r} {method:14s} {last['seconds']:7.2f} s  (cpu {last['cpu_seconds']:7.2f} s)  "
                      f"peak RSS {last['peak_rss_gb']:.2f} GB", flush=True)
            load.append(os.getloadavg()[0])

    visible = torch.ones(N, N, dtype=torch.bool).tril()
    diff = (maps["poslens"]["mean"] - maps["reference"]["mean"])[:, visible]
    se = maps["poslens"]["se"][:, visible]
    z = diff.abs() / (math.sqrt(2) * se.clamp_min(1e-12))
    offdiag = torch.ones(N, N, dtype=torch.bool).tril(-1)[visible]
    t_pos = [x["seconds"] for x in runs["poslens"]]
    t_sc = [x["seconds"] for x in runs["poslens-scores"]]
    t_ref = [x["seconds"] for x in runs["reference"]]
    same = all(torch.equal(maps["poslens"][k].nan_to_num(), maps["poslens-scores"][k].nan_to_num())
               for k in ("mean", "se"))
    summary = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "torch": torch.__version__,
        "threads": runs["poslens"][0]["threads"],
        "device": args.device,
        "samples": args.samples,
        "alpha": args.alpha,
        "load_average_1min": load,
        "poslens_seconds": t_pos,
        "poslens_scores_seconds": t_sc,
        "reference_seconds": t_ref,
        "poslens_cpu_seconds": [x["cpu_seconds"] for x in runs["poslens"]],
        "poslens_scores_cpu_seconds": [x["cpu_seconds"] for x in runs["poslens-scores"]],
        "reference_cpu_seconds": [x["cpu_seconds"] for x in runs["reference"]],
        "ratio_of_medians": statistics.median(t_ref) / statistics.median(t_pos),
        "ratio_of_minima": min(t_ref) / min(t_pos),
        "scores_ratio_of_medians": statistics.median(t_ref) / statistics.median(t_sc),
        "scores_ratio_of_minima": min(t_ref) / min(t_sc),
        "scores_ratios_per_repeat": [a / b for a, b in zip(t_ref, t_sc)],
        "poslens_peak_rss_gb": max(x["peak_rss_gb"] for x in runs["poslens"]),
        "poslens_scores_peak_rss_gb": max(x["peak_rss_gb"] for x in runs["poslens-scores"]),
        "reference_peak_rss_gb": max(x["peak_rss_gb"] for x in runs["reference"]),
        "scores_only_maps_identical_to_all_maps": same,
        "max_abs_diff_mean_scores": diff.abs().max().item(),
        "max_abs_diff_offdiagonal": diff[:, offdiag].abs().max().item(),
        "max_diff_in_se_units": z[:, offdiag].max().item(),
        "frac_within_3_se": (z[:, offdiag] < 3).double().mean().item(),
    }
    if args.device == "cuda":
        summary["gpu"] = runs["poslens"][0]["gpu"]
        for m in METHODS:
            key = m.replace("-", "_")
            summary[f"{key}_seconds_cold"] = [x["seconds_cold"] for x in runs[m]]
            summary[f"{key}_peak_gpu_gb"] = max(x["peak_gpu_gb"] for x in runs[m])
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
