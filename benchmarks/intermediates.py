"""Benchmark: `poslens intermediates` against a plain forward over the same sequences (run by hand, not a test).

Same model, same sequences, same process; the methods alternate within each repeat (order rotating):

* plain:         `model(ids)` with SDPA and logits for every batch, nothing captured (the baseline).
* intermediates: the `Intermediates` statistic over every batch (Figure 3's nine panels of layers L, L+1,
                 every layer's Q K^T * scaling for Figure 8, the float64 block-output check), then `result()`
                 and `summary()` with their jackknife intervals: what `poslens intermediates` computes between
                 loading the model and drawing the figures.

Reported: wall and CPU (process) time per method, median over repeats, and the ratio to plain (bar: <= 2x,
issue 7). With --end-to-end the whole command (`run_intermediates`: model load, tokenising, figures, run
directory) is timed once too.

    .venv/bin/python benchmarks/intermediates.py                      # smollm2-135m, 1,000 x 50 tokens
    .venv/bin/python benchmarks/intermediates.py --num-sequences 200 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch


def _timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=50)
    ap.add_argument("--num-sequences", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--groups", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-all-layers", action="store_true", help="panels only (no Figure 8)")
    ap.add_argument("--end-to-end", action="store_true", help="also time run_intermediates once")
    args = ap.parse_args()

    from poslens.analyses.intermediates import Intermediates, IntermediatesConfig, run_intermediates
    from poslens.engine.data import make_sequences
    from poslens.engine.hooks import HookedModel
    from poslens.engine.models import load_model
    from poslens.engine.pipeline import documents

    model, tok = load_model(args.model)
    docs, source = documents(None, "text")
    ids, _ = make_sequences(tok, docs, args.seq_len, args.num_sequences)
    batches = list(torch.split(ids, args.batch_size))
    hm = HookedModel(model)

    def plain() -> None:
        with torch.no_grad():
            for b in batches:
                model(input_ids=b, use_cache=False)

    def intermediates() -> None:
        st = Intermediates(hm, args.layer, groups=args.groups, all_layers=not args.no_all_layers)
        hooks = st.hooks(hm)
        for g, b in enumerate(batches):
            st.group = g
            hm.run(b, hooks=hooks)
        st.result()
        st.summary()

    with torch.no_grad():  # warm-up (allocator, thread pool): one batch each
        model(input_ids=batches[0], use_cache=False)
        hm.run(batches[0], hooks=Intermediates(hm, args.layer, groups=args.groups).hooks(hm))
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "intermediates": []}
    methods = [("plain", plain), ("intermediates", intermediates)]
    for r in range(args.repeats):
        for name, fn in (methods if r % 2 == 0 else methods[::-1]):
            times[name].append(_timed(fn))
            print(f"repeat {r}: {name:<13} wall {times[name][-1][0]:7.2f} s  cpu {times[name][-1][1]:7.2f} s",
                  flush=True)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    out = {"model": args.model, "sequences": len(ids), "seq_len": args.seq_len, "batch_size": args.batch_size,
           "layer": args.layer, "all_layers": not args.no_all_layers, "threads": torch.get_num_threads(),
           "repeats": args.repeats, "data": source,
           "plain_wall_s": med["plain"][0], "plain_cpu_s": med["plain"][1],
           "intermediates_wall_s": med["intermediates"][0], "intermediates_cpu_s": med["intermediates"][1],
           "ratio_wall": med["intermediates"][0] / med["plain"][0],
           "ratio_cpu": med["intermediates"][1] / med["plain"][1]}
    if args.end_to_end:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = IntermediatesConfig(model=args.model, layer=args.layer, seq_len=args.seq_len,
                                      num_sequences=args.num_sequences, batch_size=args.batch_size,
                                      groups=args.groups, all_layers=not args.no_all_layers)
            out["end_to_end_wall_s"] = _timed(lambda: run_intermediates(cfg, f"{tmp}/run", progress=False))[0]
    print(json.dumps(out, indent=2))
    print(f"intermediates / plain forward: {out['ratio_wall']:.2f}x wall, {out['ratio_cpu']:.2f}x CPU (bar: <= 2x)")


if __name__ == "__main__":
    main()
