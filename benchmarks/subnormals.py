"""Benchmark: a training step of a part of `pe-sinks` models with float32 subnormals flushed to 0 (the trainers'
default on the CPU, `poslens.subnormals.subnormals_flushed`) against the same step with them kept (the trainers
before). Run by hand, not a test.

Subnormals appear only as the models train (sinks forming at lr 0.04, from about step 150-200), so a benchmark of
the first steps cannot see them. This one trains the part (--variants x --seeds of the `pe-sinks` matrix, 2,000-step
schedule, compiled as the sweep compiles its parts) to step --at with subnormals kept, as the trainer before did,
and leaves that checkpoint in --work (reused by later runs with the same arguments). Then, --rounds times, arms
alternating so that both meet the same load, it copies the checkpoint and resumes it for --steps steps in each arm:
"kept" (the flush switched off) and "flushed" (as the trainers run). Per arm and round: the median of the steps'
own times (the trainer's `step_s`, after the first --skip steps of a resume, which load the compiled code), and CPU
seconds of the whole resume. Printed: each arm's median step, the ratio kept / flushed per round with the geometric
mean and its 95% t-interval over rounds, and the share of the part's float32 parameter and optimizer entries that
are subnormal in the step-`at` checkpoint (0 on 2026-11-29: the subnormals arise inside the step, in activations and
gradients, not in the state a checkpoint keeps).

    nice .venv/bin/python benchmarks/subnormals.py --at 1000 --steps 60 --rounds 3 --json /tmp/subnormals.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

import poslens.subnormals as sub
from poslens.train import batched
from poslens.train.cache import tokens_of, trained_model_dir
from poslens.train.sweep import SweepConfig, resolve_matrix

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import ratio_interval  # noqa: E402 (benchmarks/train.py)


def part(variants: list[str], seeds: list[int]) -> tuple[list, Path]:
    """The `pe-sinks` configurations of `variants` x `seeds` (the sweep's 2,000-step schedule) and their tokens."""
    matrix = resolve_matrix(SweepConfig(preset="pe-sinks", seeds=seeds))
    members = [m for m in matrix.members if m.variant in variants]
    tokens = tokens_of(members[0].config)
    return [dataclasses.replace(m.config, tokens=str(tokens)) for m in members], tokens


@contextlib.contextmanager
def kept(device: torch.device):
    """The trainers' step context with the flush switched off (subnormals kept, as before the flush)."""
    yield


def partials(root: Path, outs: list[Path]) -> list[Path]:
    """The resumable checkpoint directories the trainer leaves for `outs` under `root`."""
    return [root / f".{o.name}.partial" for o in outs]


MARK = ".poslens-subnormals"  # in every folder this script made, and only there does it delete


def remove_own(path: Path) -> None:
    """Delete `path` if this script made it (it holds MARK); a folder it did not make stops the run in one line."""
    if path.exists():
        if not (path / MARK).is_file():
            print(f"subnormals.py: {path} exists and was not made by this script; choose another --work",
                  file=sys.stderr)
            raise SystemExit(2)
        shutil.rmtree(path)


def build(cfgs: list, tokens: Path, root: Path, at: int) -> list[Path]:
    """Train `cfgs` to step `at` with subnormals kept, into `root` (reused when already there)."""
    outs = [root / trained_model_dir(c, tokens).name for c in cfgs]
    if all(p.is_dir() for p in partials(root, outs)):
        print(f"step-{at} checkpoint reused from {root}", flush=True)
        return outs
    remove_own(root)
    root.mkdir(parents=True)
    (root / MARK).touch()
    t0 = time.perf_counter()
    with switched(False):
        batched.train_batched(cfgs, outs, progress=True, stop_after=at, compile=True)
    print(f"step-{at} checkpoint of {len(cfgs)} models built in {time.perf_counter() - t0:.0f} s", flush=True)
    return outs


@contextlib.contextmanager
def switched(flush: bool):
    """The batched trainer's step context: flushed (its own) or kept."""
    own = sub.subnormals_flushed  # the batched trainer imports it from `poslens.subnormals` when it starts
    if not flush:
        sub.subnormals_flushed = kept
    try:
        yield
    finally:
        sub.subnormals_flushed = own


def subnormal_share(partial: Path) -> float:
    """The share of float32 entries of the model and optimizer state in one checkpoint that are subnormal."""
    tiny = torch.finfo(torch.float32).tiny
    total = small = 0
    for f in sorted(partial.rglob("*")):
        if f.suffix not in (".pt", ".safetensors") or not f.is_file():
            continue
        if f.suffix == ".pt":
            state = torch.load(f, map_location="cpu", weights_only=False)
        else:
            from safetensors.torch import load_file
            state = load_file(f)
        stack = [state]
        while stack:
            x = stack.pop()
            if isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
            elif torch.is_tensor(x) and x.dtype == torch.float32:
                total += x.numel()
                small += int(((x != 0) & (x.abs() < tiny)).sum())
    return small / max(total, 1)


def resume(cfgs: list, outs: list[Path], root: Path, arm: Path, at: int, steps: int, skip: int,
           flush: bool) -> tuple[float, float]:
    """Resume a copy of the step-`at` checkpoint for `steps` steps: the median step time after `skip` steps, and the
    CPU seconds of the resume."""
    remove_own(arm)
    shutil.copytree(root, arm)  # MARK with it
    mine = [arm / o.name for o in outs]
    c0 = time.process_time()
    with switched(flush):
        batched.train_batched(cfgs, mine, progress=False, stop_after=steps, compile=True)
    cpu = time.process_time() - c0
    rows = [json.loads(line) for line in (partials(arm, mine)[0] / "metrics.jsonl").read_text().splitlines()
            if '"step_s"' in line]
    times = [r["step_s"] for r in rows if r["step"] > at + skip]
    remove_own(arm)
    return statistics.median(times), cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="nope,rope,ntk")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--at", type=int, default=1000, help="the step the resumes start from")
    ap.add_argument("--steps", type=int, default=60, help="steps per resume")
    ap.add_argument("--skip", type=int, default=5, help="first steps of a resume left out of its median")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the sweep runs each part on one)")
    ap.add_argument("--work", default="/tmp/poslens-subnormals")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(args.work) / "inductor"))
    cfgs, tokens = part(args.variants.split(","), [int(s) for s in args.seeds.split(",")])
    root = Path(args.work) / f"{args.variants}-{args.seeds}-at{args.at}".replace(",", "_")
    outs = build(cfgs, tokens, root, args.at)
    share = subnormal_share(partials(root, outs)[0])
    print(f"subnormal share of the float32 state at step {args.at} (first model): {share:.3g}", flush=True)
    rows = []
    for r in range(args.rounds):
        row = {"round": r}
        for name, flush in (("kept", False), ("flushed", True)):
            step, cpu = resume(cfgs, outs, root, Path(args.work) / f"arm-{name}", args.at, args.steps, args.skip,
                               flush)
            row[f"{name}_step_s"], row[f"{name}_cpu_s"] = step, cpu
        row["ratio"] = row["kept_step_s"] / row["flushed_step_s"]
        rows.append(row)
        print(f"round {r}: step {row['kept_step_s']:.3f} s kept, {row['flushed_step_s']:.3f} s flushed "
              f"({row['ratio']:.2f}x); CPU s {row['kept_cpu_s']:.1f} / {row['flushed_cpu_s']:.1f}", flush=True)
    mean, lo, hi = ratio_interval([x["ratio"] for x in rows])
    print(f"{len(cfgs)} models ({args.variants} x seeds {args.seeds}), step {args.at}, {args.threads} thread(s): "
          f"median step kept {statistics.median(x['kept_step_s'] for x in rows):.3f} s, flushed "
          f"{statistics.median(x['flushed_step_s'] for x in rows):.3f} s; kept / flushed "
          f"{mean:.2f}x [{lo:.2f}, {hi:.2f}] over {len(rows)} rounds")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "torch": torch.__version__,
                                               "subnormal_share": share, "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
