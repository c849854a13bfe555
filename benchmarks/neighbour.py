"""A neighbour for a benchmark (run by hand): one family's plain forward, in a loop, for a given time.

Started beside `benchmarks/families.py` on a 2-core machine, it keeps the other core busy with the same kind of work
(one thread, the model and tokens of `families.py`'s `setup`), so that a ratio can be read under a known load:

    PYTHONPATH=src:tests .venv/bin/python benchmarks/neighbour.py --family llama --seconds 720 &
    PYTHONPATH=src:tests .venv/bin/python benchmarks/families.py --hidden 768 --layers 12 --repeats 20 --arms read \\
        --families opt falcon_new gpt_bigcode llama --out benchmarks/results/cpu-2026-12-01-additive/neighbour.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import FAMILIES, add_model_args, setup  # noqa: E402 (benchmarks/families.py)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--seconds", type=float, default=600.0)
    add_model_args(p, hidden=768, layers=12)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, _, ids = setup(args.family, args)
    end = time.monotonic() + args.seconds
    with torch.no_grad():
        while time.monotonic() < end:
            model(input_ids=ids, use_cache=False)


if __name__ == "__main__":
    main()
