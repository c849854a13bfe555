"""Benchmark: `poslens leakage MODEL` with default settings (every metric, the BOS intervention, the predecessor's
null) against plain forwards over the same sequences (run by hand, not a test).

    .venv/bin/python benchmarks/leakage.py                       # smollm2-135m, defaults
    .venv/bin/python benchmarks/leakage.py --model smollm2-135m --seq-len 256

Prints the leakage wall time, the time of one plain forward (`model(ids)`, SDPA, logits) over every batch of the
same sequences, and their ratio; writes the run to a temporary directory (deleted afterwards). Both are measured in
one process, plain forwards first, so the ratio is meaningful on a loaded machine where absolute times are not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch


def main() -> None:
    from poslens.analyses.leakage.run import LeakageConfig, run_leakage
    from poslens.engine.data import iter_documents, make_sequences
    from poslens.engine.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seq-len", type=int, default=None)
    args = ap.parse_args()
    cfg = LeakageConfig(model=args.model)
    if args.seq_len:
        cfg.seq_len = args.seq_len
    model, tok = load_model(cfg.model)
    ids, _ = make_sequences(tok, iter_documents(None), cfg.seq_len, cfg.num_sequences, bos=cfg.bos)
    started = time.perf_counter()
    with torch.no_grad():
        for batch in torch.split(ids, cfg.batch_size):
            model(input_ids=batch, use_cache=False)
    plain = time.perf_counter() - started
    out = tempfile.mkdtemp(prefix="leakage-bench-")
    try:
        started = time.perf_counter()
        path = run_leakage(cfg, os.path.join(out, "run"), progress=False)
        wall = time.perf_counter() - started
        metrics = json.loads((path / "run.json").read_text())["metrics"]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    passes = 1 + len(cfg.interventions) + int(cfg.predecessor)
    print(json.dumps({"model": cfg.model, "seq_len": cfg.seq_len, "sequences": cfg.num_sequences,
                      "batch_size": cfg.batch_size, "passes": passes, "threads": torch.get_num_threads(),
                      "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                      "plain_forward_s": round(plain, 2), "leakage_s": round(wall, 2),
                      "ratio": round(wall / plain, 2), "ratio_per_pass": round(wall / plain / passes, 2),
                      "removed_mean": metrics["interventions"]["mean"]["removed_all_layers"]}, indent=1))


if __name__ == "__main__":
    main()
