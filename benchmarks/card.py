"""Benchmark: `poslens card MODEL` at the defaults against plain forwards over the same number of tokens (run by
hand, not a test; the bar: at most 10 minutes for SmolLM2-135M on 2 CPU cores).

    .venv/bin/python benchmarks/card.py                      # smollm2-135m, defaults, the bar
    .venv/bin/python benchmarks/card.py --out benchmarks/results/cpu-DATE-card/timing.json

Plain forwards first (`model(ids)`, logits; one warm-up batch not timed): the token blocks the card's sub-runs push
through the model at its default sizes (scores, leakage and the probe: one shared pass over 32 x 128 tokens;
length: one pass per intervention (6 on a RoPE model) and the baseline over 12 x 128), then the command itself in
the same process
(`poslens.cli.main`: four loads, every pass, every summary, figures, the page). Prints and writes both wall times,
their ratio, the command's CPU time, the load average and the threads: on a loaded machine only the ratio means
anything.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import shutil
import tempfile
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the `poslens` command sets it
import torch  # noqa: E402

BAR_SECONDS = 600


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    from poslens.analyses.card.run import SIZES
    from poslens.cli import main as poslens_main
    from poslens.engine.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default torch's)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    blocks = []  # (batch, tokens) of every forward the card makes at its defaults
    s = SIZES["scores"]  # scores, leakage and the probe: one pass (their batches are the same)
    blocks += [(s["batch_size"], s["seq_len"])] * (s["num_sequences"] // s["batch_size"])
    s = SIZES["length"]
    blocks += [(s["batch_size"], s["multiple"] * s["train_len"])] * (s["num_sequences"] // s["batch_size"] * 7)
    with torch.no_grad():
        model(torch.randint(3, vocab, blocks[0], generator=gen))
        start = time.perf_counter()
        for shape in blocks:
            model(torch.randint(3, vocab, shape, generator=gen))
        plain = time.perf_counter() - start
    del model
    out = tempfile.mkdtemp(prefix="poslens-card-bench-")
    try:
        cpu0, start = cpu_seconds(), time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            assert poslens_main(["card", args.model, "--out", f"{out}/card", "--quiet"]) == 0
        wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    finally:
        shutil.rmtree(out, ignore_errors=True)
    result = {"model": args.model, "card_s": wall, "card_cpu_s": cpu, "plain_forwards_s": plain,
              "ratio": wall / plain, "bar_s": BAR_SECONDS, "met": wall <= BAR_SECONDS,
              "load_average": os.getloadavg(), "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    print(json.dumps(result, indent=2))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
