"""Benchmark: `poslens leakage MODEL` at the defaults (every pass: the original, the interventions, the nulls, the
predecessor's rows; the summary with every contrast and the predecessor's test) against plain forwards over the same
sequences (run by hand, not a test; the bar: under 10 minutes for SmolLM2-135M on 2 CPU cores).

    .venv/bin/python benchmarks/leakage.py                                   # smollm2-135m, defaults, the bar
    .venv/bin/python benchmarks/leakage.py --num-sequences 16 --groups 2     # a small check that it works
    .venv/bin/python benchmarks/leakage.py --out benchmarks/results/cpu-DATE-leakage/timing.json
    PYTHONPATH=OTHER/src python benchmarks/leakage.py --model DIR --num-sequences 16 --groups 2 --keep RUN  # one arm
    python3 benchmarks/leakage.py --model DIR --device cuda --dtype bfloat16 --seq-len 512 --num-sequences 128  # GPU

Plain forwards first (`model(ids)`, SDPA, logits; one warm-up batch not timed) over exactly the sequences the
command cuts (windows inside documents when the defaults need them), then the command itself in the same process
(`poslens.cli.main`: loading, passes, summary, figures, run.json, the printed summary). Prints and writes the wall
times, their ratio, the command's own split (passes_s: loading, cutting and the passes; after_passes_s: estimates,
contrasts, tests, figures), the CPU times of both (`ratio_cpu`: the steadier ratio on a shared machine), the load
average and the threads: on a loaded machine only the ratios mean anything. `--keep DIR` keeps the run directory,
so two trees' arms (PYTHONPATH) can be compared number for number.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the `poslens` command sets it (before torch's first allocation)
import torch  # noqa: E402

BAR_SECONDS = 600


def main() -> None:
    from poslens.analyses.leakage.run import LeakageConfig
    from poslens.cli import main as poslens_main
    from poslens.engine.data import document_windows, iter_documents, make_sequences
    from poslens.engine.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-sequences", type=int, default=None, help="default: the command's")
    ap.add_argument("--groups", type=int, default=None, help="default: the command's")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the command's")
    ap.add_argument("--batch-size", type=int, default=None, help="default: the command's")
    ap.add_argument("--device", default=None, help="default: the command's (cpu); on CUDA every timing synchronises")
    ap.add_argument("--dtype", default=None, help="default: the command's (auto)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default torch's)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--keep", default=None, help="keep the command's run directory here (to compare two trees' "
                    "numbers); default: a temporary one, removed")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = LeakageConfig(model=args.model)
    flags = []
    for name in ("seq_len", "batch_size", "device", "dtype"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.num_sequences:
        cfg.num_sequences = args.num_sequences
        flags += ["--num-sequences", str(args.num_sequences)]
    if args.groups:
        cfg.groups = args.groups
        flags += ["--groups", str(args.groups)]
    model, tok = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    sync = torch.cuda.synchronize if cfg.device.startswith("cuda") else (lambda: None)
    if cfg.windows:
        ids, _, _ = document_windows(tok, iter_documents(None), cfg.seq_len, cfg.num_sequences,
                                     min_offset=cfg.min_offset, seed=cfg.seed, bos=cfg.bos)
    else:
        ids, _ = make_sequences(tok, iter_documents(None), cfg.seq_len, cfg.num_sequences, bos=cfg.bos)
    batches = torch.split(ids.to(cfg.device), cfg.batch_size)
    with torch.no_grad():
        model(input_ids=batches[0], use_cache=False)  # warm-up
        sync()
        started, cpu = time.perf_counter(), time.process_time()
        for batch in batches:
            model(input_ids=batch, use_cache=False)
        sync()
    plain, plain_cpu = time.perf_counter() - started, time.process_time() - cpu
    del model
    out = tempfile.mkdtemp(prefix="leakage-bench-")
    run = args.keep or os.path.join(out, "run")
    try:
        printed = io.StringIO()
        started, cpu = time.perf_counter(), time.process_time()
        with contextlib.redirect_stdout(printed):
            code = poslens_main(["leakage", cfg.model, *flags, "--quiet", "--out", run])
        wall, wall_cpu = time.perf_counter() - started, time.process_time() - cpu
        meta = json.loads((Path(run) / "run.json").read_text()) if code == 0 else {}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if code != 0:
        raise SystemExit(f"poslens leakage exited with {code}")
    passes = 1 + len(cfg.specs) + len(cfg.null_passes)
    timings = meta["timings"]
    result = {"model": cfg.model, "device": cfg.device, "dtype": cfg.dtype,
              "gpu": torch.cuda.get_device_name() if cfg.device.startswith("cuda") else None,
              "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cfg.device.startswith("cuda")
              else None, "command": " ".join(["poslens leakage", cfg.model, *flags]),
              "seq_len": cfg.seq_len, "sequences": meta["data"]["sequences"], "batch_size": cfg.batch_size,
              "groups": meta["groups"]["used"], "passes": passes, "interventions": cfg.specs,
              "nulls": cfg.null_passes, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
              "thp_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE"),
              "load_average": os.getloadavg(), "plain_forward_s": round(plain, 2), "leakage_s": round(wall, 2),
              "plain_forward_cpu_s": round(plain_cpu, 2), "leakage_cpu_s": round(wall_cpu, 2),
              "ratio_cpu": round(wall_cpu / plain_cpu, 2),
              "passes_s": round(timings["compute_seconds"], 2),
              "after_passes_s": round(timings["seconds"] - timings["compute_seconds"], 2),
              "ratio": round(wall / plain, 2), "ratio_per_pass": round(wall / plain / passes, 2),
              "under_bar": wall < BAR_SECONDS, "bar_s": BAR_SECONDS,
              "predecessor_power": meta["metrics"].get("predecessor", {}).get("power"),
              "summary_lines": len(printed.getvalue().splitlines())}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
