#!/usr/bin/env python3
"""How many sequences, of which length, Section 5.2 of `poslens reproduce` needs: capture SmolLM2-135M's mean score
maps batch by batch (saved, so a rerun resumes), then regroup the first N sequences for several N exactly as the
report does (batch b -> group b mod G, half (b div G) mod 2; Bonferroni-adjusted jackknife bounds of the
noise-free pattern power) and print how many layers after the first are resolved, the weakest one, and the CPU
seconds per sequence.

    python scripts/section52_sizes.py --seq-len 256 --sequences 384 --at 96,152,256,384 --save /tmp/s52-256
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--sequences", type=int, default=384)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--at", default="96,192,384", help="comma-separated sequence counts to evaluate")
    ap.add_argument("--save", type=Path, required=True, help="folder for the per-batch maps")
    a = ap.parse_args()
    from poslens.engine import corpus
    from poslens.engine.capture import Capture
    from poslens.engine.data import make_sequences
    from poslens.engine.models import load_model
    from poslens.engine.stats import GroupedSums
    from poslens.report.sections import real_model

    a.save.mkdir(parents=True, exist_ok=True)
    model, tok = load_model("smollm2-135m")
    ids, _ = make_sequences(tok, corpus.documents(), a.seq_len, a.sequences, mode="first")
    cpu, done = 0.0, 0
    for b, x in enumerate(torch.split(ids, a.batch)):
        path = a.save / f"b{b:04d}.pt"
        if path.exists():
            continue
        c0 = time.process_time()
        cap = Capture(model)
        cap.update(x)
        torch.save({"scores": cap.result()["scores"], "n": x.shape[0]}, path)
        cpu += time.process_time() - c0
        done += x.shape[0]
    if done:
        print(f"captured {done} sequences of {a.seq_len} tokens: {cpu / done:.2f} CPU s per sequence "
              f"(load average {os.getloadavg()[0]:.1f})")
    files = sorted(a.save.glob("b*.pt"))
    for want in (int(n) for n in a.at.split(",")):
        sums, n = GroupedSums(a.groups), 0
        for b, f in enumerate(files):
            d = torch.load(f)
            if n + d["n"] > want:
                break
            sums.add("ab"[(b // a.groups) % 2], b % a.groups, d["scores"] * d["n"], d["n"])
            n += d["n"]
        layers = int(sums.mean("a").shape[0])
        v, lo, hi = real_model.statistics(sums, layers)["power"]
        weak = int(np.argmin(lo[1:])) + 1
        bad = [k + 1 for k in range(1, layers) if not lo[k] > 0]
        print(f"N = {n}: resolved {layers - 1 - len(bad)} of {layers - 1} layers after the first"
              f"{' (not ' + ', '.join(map(str, bad)) + ')' if bad else ''}; weakest: layer {weak + 1} "
              f"{v[weak]:.4f} [{lo[weak]:.4f}, {hi[weak]:.4f}]; layer 1 {v[0]:.4f} [{lo[0]:.4f}, {hi[0]:.4f}]")


if __name__ == "__main__":
    main()
