"""Benchmark: `poslens length` on one `cpu`-preset model to 8 x its training length with every intervention
(issue 18's bar: at most 10 minutes on 2 CPU cores).

The model: the `cpu` preset's RoPE model (6 layers, d = 256, trained at L = 256 on the embedded corpus), read from
the poslens model cache, or trained into it first (about 4 minutes on a quiet 2-core machine; not timed). Then the
command, in a child process, exactly as a user types it:

    poslens length MODEL --data TOKENS --out OUT --force --quiet

with its defaults: L = max_position_embeddings = 256, evaluation lengths 256, 512, 1024, 2048, every intervention
that applies (logn, ntk and yarn at each length past L, window of L, freeze), the averaged maps with their leakage
terms at each length, 32 held-out sequences in batches of 4, 8 groups. Reported: wall and CPU seconds of the child
(`resource.getrusage(RUSAGE_CHILDREN)`), its peak RSS, the load average before and after, torch's thread count, and
the command's own summary lines; `--json` writes them.

    .venv/bin/python benchmarks/length.py                        # the bar (trains the model first if need be)
    .venv/bin/python benchmarks/length.py --model DIR -- --num-sequences 8 --batch-size 2   # any model, any flags
    python3 benchmarks/length.py --model DIR --data TOKENS --device cuda --plain   # on a GPU, against plain forwards

--plain: after the command, plain forwards (`model(ids)`, SDPA, logits) in this process over the same number of
sequences at each of the command's evaluation lengths (contiguous blocks of the held-out tokens, or of the training
tokens if those are too few; lengths from the run's run.json), on the same device and dtype: the command's wall time
over theirs is the ratio printed (the command's time includes its process start, model load, every intervention
pass, the maps and the summary).

--profile FILE runs the command under cProfile and writes its statistics there (printing the 30 costliest functions by
own time); --limit S interrupts the command (SIGINT, as Ctrl-C) after S seconds, so a run that would not finish in a
step's time still leaves its profile (the result is then marked "cut", no bar and no plain forwards).

    python3 benchmarks/length.py --model DIR --device cuda --plain --profile OUT/length.prof --limit 140

Timings on a machine shared with other jobs are not results: the lead runs the bar on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path


def cpu_model(pe: str = "rope") -> tuple[Path, Path]:
    """(model directory, token directory) of the `cpu` preset's model with positional encoding `pe`, from the cache
    or trained now."""
    from poslens.train.cache import tokens_of, trained_model
    from poslens.train.config import resolve_config

    cfg = resolve_config("cpu", pe=pe)
    tokens = tokens_of(cfg, progress=True)
    return trained_model(cfg, progress=True, tokens=tokens), tokens


def plain_forwards(model: Path, run_json: Path, device: str, dtype: str) -> float:
    """Seconds of plain forwards over the run's number of sequences at each of its evaluation lengths (one warm-up
    batch first, not timed; CUDA synchronised)."""
    import numpy as np
    import torch

    from poslens.engine.models import load_model
    from poslens.io.tokenfile import open_tokens

    run = json.loads(run_json.read_text())
    cfg = run["config"]
    net, _ = load_model(str(model), dtype=dtype, device=device)
    tf = open_tokens(run["data"]["source"], check=())
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    total = 0.0
    with torch.no_grad():
        for i, t in enumerate(cfg["eval_lens"]):
            n = cfg["num_sequences"]
            split = tf.val if len(tf.val) >= n * t else tf.train  # the held-out split unless it is too short
            ids = torch.from_numpy(np.asarray(split[: n * t], dtype=np.int64).reshape(n, t)).to(device)
            batches = torch.split(ids, cfg["batch_size"])
            if i == 0:
                net(input_ids=batches[0], use_cache=False)
            sync()
            start = time.perf_counter()
            for b in batches:
                net(input_ids=b, use_cache=False)
            sync()
            total += time.perf_counter() - start
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory (default: the cpu preset's RoPE model)")
    p.add_argument("--pe", default="rope", choices=("rope", "none"), help="the cpu model's encoding (default rope)")
    p.add_argument("--out", default="/tmp/poslens-bench-length", help="the run directory the command writes")
    p.add_argument("--json", default=None, help="write the measurement here as JSON")
    p.add_argument("--data", default=None, help="token directory (with --model; default: the model's own text)")
    p.add_argument("--device", default=None, help="passed to the command (default its own: cpu)")
    p.add_argument("--dtype", default=None, help="passed to the command (default its own: auto)")
    p.add_argument("--plain", action="store_true", help="time plain forwards over the same lengths after it")
    p.add_argument("--profile", default=None, help="run the command under cProfile and write its statistics here")
    p.add_argument("--limit", type=float, default=None, help="interrupt the command (SIGINT) after this many seconds")
    p.add_argument("extra", nargs="*", help="more `poslens length` flags, after --")
    a = p.parse_args()
    if a.model is None:
        model, tokens = cpu_model(a.pe)
        data = ["--data", str(tokens)]
    else:
        model, data = Path(a.model), (["--data", a.data] if a.data else [])
    on = [*(["--device", a.device] if a.device else []), *(["--dtype", a.dtype] if a.dtype else [])]
    argv = [sys.executable, "-m", "poslens", "length", str(model), *data, "--out", a.out, "--force", "--quiet",
            *on, *a.extra]
    launch = argv if a.profile is None else [sys.executable, "-m", "cProfile", "-o", a.profile, *argv[1:]]
    import torch

    load_before = os.getloadavg()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    child = subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = child.communicate(timeout=a.limit)
        cut = False
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGINT)  # as Ctrl-C: the command stops cleanly and cProfile writes what it saw
        stdout, stderr = child.communicate()
        cut = True
    done = subprocess.CompletedProcess(launch, child.returncode, stdout, stderr)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if a.profile is not None and Path(a.profile).exists():
        pstats.Stats(a.profile).sort_stats("tottime").print_stats(30)
    if cut:
        sys.exit(f"cut after {wall:.0f} s (--limit {a.limit:g}): the command did not finish; "
                 f"{done.stderr.strip()[-500:]}")
    if done.returncode != 0:
        sys.exit(f"the command failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    result = {"command": shlex.join(["poslens", *argv[3:]]), "wall_s": wall,
              "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
              "peak_rss_mib": after.ru_maxrss / 1024, "load_before": load_before, "load_after": os.getloadavg(),
              "torch_threads": torch.get_num_threads(), "bar_s": 600, "summary": done.stdout.strip().splitlines()}
    if a.plain:
        result["plain_s"] = plain_forwards(model, Path(a.out) / "run.json", a.device or "cpu", a.dtype or "auto")
        result["ratio_to_plain"] = wall / result["plain_s"]
    print("\n".join(result["summary"]))
    print(json.dumps({k: v for k, v in result.items() if k != "summary"}, indent=1))
    if a.plain:
        print(f"plain forwards over the same lengths: {result['plain_s']:.2f} s; the command / plain: "
              f"{result['ratio_to_plain']:.1f}x")
    print(f"bar (at most 600 s on 2 cores): {'met' if wall <= 600 else 'NOT met'} ({wall:.0f} s wall, load average "
          f"{load_before[0]:.1f} -> {result['load_after'][0]:.1f})")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
