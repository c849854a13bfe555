"""Benchmark: this tree's capture against the previous release's, in one process, each against a plain forward.

The bar of issue #7: moving the capture onto the hook engine may not slow the averaged-scores path, i.e.
(poslens / plain) now must stay within 5% of (poslens / plain) in the previous release. All three methods run in
this one process on the same model object and the same batches, interleaved (the order rotates every repeat):

* plain:    `model(ids)` with SDPA and logits;
* now:      `poslens.engine.capture.Capture(model)` (the hook engine), `update()` per batch, then `result()`;
* release:  the previous release's `capture.py`, read from git (`git show REV:src/poslens/capture.py`; from 0.2
            on `engine/capture.py` and the `engine/hooks.py` it runs on) and imported under other module names;
            same calls.

The maps of `now` and `release` are compared too (max |difference|), so the speed is for the same numbers.
On a machine without the git history (a lent GPU machine gets the working tree only), `--release-src DIR` reads
the release's files from an exported tree (`git archive REV src | tar -x -C DIR`); `--shape` replaces the model by
a random one of a real model's shape (benchmarks/capture.py's, on random token ids), built on `--device` in
`--dtype`. On CUDA every timed call ends with a synchronisation.

    .venv/bin/python benchmarks/capture_vs_release.py --release afb3a39 --batch 2 --seq-len 512 --batches 2 \
        --repeats 5 --out benchmarks/results/cpu-2026-11-23-session3/capture_vs_release.json
    python3 benchmarks/capture_vs_release.py --release-src /tmp/rel --shape llama-3.1-8b --device cuda \
        --dtype bfloat16 --batch 4 --seq-len 1024 --batches 4 --repeats 7      # on a GPU
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def release_module(rev: str, path: str, name: str, replace: dict[str, str] | None = None):
    """The file `path` of git revision `rev` (or of the exported tree `rev` when it is a directory), imported under
    the module name `name` (after the text replacements)."""
    if Path(rev).is_dir():
        if not (Path(rev) / path).is_file():
            raise subprocess.CalledProcessError(1, ["read", str(Path(rev) / path)])
        src = (Path(rev) / path).read_text()
    else:
        src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                             text=True).stdout
    for old, new in (replace or {}).items():
        src = src.replace(old, new)
    target = Path(tempfile.mkdtemp(prefix="poslens-release-")) / f"{name}.py"
    target.write_text(src)
    spec = importlib.util.spec_from_file_location(name, target)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def release_capture(rev: str):
    """The previous release's capture module, imported from git under the name `poslens_release_capture`; from 0.2
    on (`engine/capture.py` on the hook engine) together with that release's hook engine (`poslens_release_hooks`)."""
    try:
        release_module(rev, "src/poslens/engine/hooks.py", "poslens_release_hooks")
    except subprocess.CalledProcessError:  # 0.1: a self-contained src/poslens/capture.py
        return release_module(rev, "src/poslens/capture.py", "poslens_release_capture")
    return release_module(rev, "src/poslens/engine/capture.py", "poslens_release_capture",
                          {"from poslens.engine.hooks import": "from poslens_release_hooks import"})


def aten_ops(fn) -> list[str]:
    """The aten operators `fn()` dispatches, in order, with their input shapes: equal lists mean equal tensor work
    (a measure no other job on the machine can disturb)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            ops.append(f"{func} {shapes}")
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--release", default="afb3a39", help="git revision of the previous release")
    p.add_argument("--release-src", default=None, help="an exported tree of the release (instead of git)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--shape", default=None, help="a random model of this shape instead of --model "
                   "(benchmarks/capture.py's SHAPES: smollm2-135m, llama-3.1-8b)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batches", type=int, default=2, help="batches per timed call")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from poslens.engine.capture import Capture
    from poslens.engine.data import iter_documents, make_sequences
    from poslens.engine.models import load_model

    old = release_capture(args.release_src or args.release)
    if args.shape:
        from capture import DTYPES, SHAPES  # benchmarks/capture.py, beside this script

        model = SHAPES[args.shape](DTYPES[args.dtype], args.device)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (args.batch * args.batches, args.seq_len), generator=gen)
    else:
        model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
        ids, _ = make_sequences(tok, iter_documents(None), args.seq_len, args.batch * args.batches, mode="first",
                                bos="auto")
    batches = list(torch.split(ids.to(args.device), args.batch))
    sync = torch.cuda.synchronize if str(args.device).startswith("cuda") else (lambda: None)

    def plain():
        with torch.no_grad():
            for x in batches:
                model(input_ids=x, use_cache=False)
        sync()

    def capture(cls):
        cap = cls(model)
        for x in batches:
            cap.update(x)
        out = cap.result()["scores"]
        sync()
        return out

    methods = {"plain": plain, "now": lambda: capture(Capture), "release": lambda: capture(old.Capture)}
    maps = {k: methods[k]() for k in ("now", "release")}  # warm-up, and the maps to compare
    ops = {k: aten_ops(methods[k]) for k in ("now", "release")}
    plain()
    times: dict[str, list[float]] = {k: [] for k in methods}
    cpu: dict[str, list[float]] = {k: [] for k in methods}  # CPU time of this process: less hit by other jobs
    names = list(methods)
    load = os.getloadavg()
    for r in range(args.repeats):
        for name in names[r % 3:] + names[: r % 3]:
            t, c = time.perf_counter(), time.process_time()
            methods[name]()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    out = {"median_s": med, "times_s": times, "now_over_plain": med["now"] / med["plain"],
           "release_over_plain": med["release"] / med["plain"], "now_over_release": med["now"] / med["release"],
           "median_cpu_s": med_cpu, "cpu_s": cpu, "cpu_now_over_release": med_cpu["now"] / med_cpu["release"],
           "cpu_now_over_plain": med_cpu["now"] / med_cpu["plain"],
           "cpu_release_over_plain": med_cpu["release"] / med_cpu["plain"], "load_average_before": load,
           "aten_ops": {k: len(v) for k, v in ops.items()}, "aten_ops_identical": ops["now"] == ops["release"],
           "max_abs_map_difference": float((maps["now"] - maps["release"]).nan_to_num(0).abs().max()),
           "load_average": os.getloadavg(), "threads": torch.get_num_threads(), "argv": sys.argv,
           "torch": torch.__version__, "device": (torch.cuda.get_device_name() if str(args.device).startswith("cuda")
                                                  else "cpu"), "dtype": args.dtype}
    print(json.dumps(out, indent=1))
    print(f"now / plain {out['now_over_plain']:.3f}, release / plain {out['release_over_plain']:.3f}: "
          f"now / release = {out['now_over_release']:.3f} (bar: <= 1.05); CPU time: now / release = "
          f"{out['cpu_now_over_release']:.3f}; maps differ by at most {out['max_abs_map_difference']:.2e}; aten "
          f"operators: {out['aten_ops']} ({'the same' if out['aten_ops_identical'] else 'different'} sequences)")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
