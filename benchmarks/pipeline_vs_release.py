"""The analyses on the pipeline against the release before it: the same numbers, and no slower.

Extracts the release's `src/` from git (`git archive REF src`), then runs `poslens scores`, `intermediates` and
`leakage` with the release's code and with this tree's, interleaved (release, current, current, release, ...) as
separate processes on the same machine, each writing a run directory. Reports, per command: every tensor the two
runs share compared exactly (bit for bit, NaN where NaN), every metric of run.json compared, and the wall time of
each process (model loading and the corpus included) and its CPU time (user + system: less disturbed than wall
time by other jobs on a shared machine), as ratios current / release per repeat, and the load average.

    python benchmarks/pipeline_vs_release.py                       # SmolLM2 (sizes: COMMANDS below)
    python benchmarks/pipeline_vs_release.py --tiny --repeats 1    # a random 3-layer Llama: numbers only
    python benchmarks/pipeline_vs_release.py --only leakage --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELEASE = "f934a36"  # release 0.2 (the last commit before the pipeline)
TINY = ('random:{"model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, '
        '"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, '
        '"max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2}')
COMMANDS = {  # name -> arguments after MODEL: leakage at its defaults (64 x 128); the paper-sized defaults of scores
    "scores": ["--seq-len", "256", "--num-sequences", "100"],  # (1,000 x 1,024) and intermediates (1,000 x 50) take
    "intermediates": ["--num-sequences", "200"],  # tens of minutes per run on 2 shared cores
    "leakage": [],
}
TINY_ARGS = {"scores": ["--seq-len", "48", "--num-sequences", "16", "--batch-size", "4", "--groups", "4"],
             "intermediates": ["--seq-len", "16", "--num-sequences", "16", "--batch-size", "4", "--groups", "4"],
             "leakage": ["--seq-len", "32", "--num-sequences", "16", "--batch-size", "4", "--groups", "4",
                         "--early-queries", "10", "--interventions", "mean,shift:50,freeze,nobos"]}


def release_tree(ref: str, where: Path) -> Path:
    """The release's src/ extracted from git into `where`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where / "src"


def run(src: Path, argv: list[str], out: Path) -> tuple[float, float]:
    """One `poslens ...` process with the code in `src`: (wall, CPU) seconds."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "poslens", *argv, "--quiet", "--out", str(out)], env=env,
                         capture_output=True, text=True)
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} with {src} failed:\n{res.stderr[-3000:]}")
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def interleaved(trees: dict[str, Path], argv: list[str], tmp: Path, repeats: int, label: str
                ) -> tuple[dict[str, list[tuple[float, float]]], dict[str, list[float]]]:
    """Run `argv` with each tree `repeats` times, order alternating (release, current, current, release, ...), each
    into tmp/LABEL-VERSION-R; returns (wall, CPU) seconds per version and the current / release ratios per repeat."""
    times: dict[str, list[tuple[float, float]]] = {"release": [], "current": []}
    for r in range(repeats):
        for version in (("release", "current") if r % 2 == 0 else ("current", "release")):
            times[version].append(run(trees[version], argv, tmp / f"{label}-{version}-{r}"))
            wall, cpu = times[version][-1]
            print(f"{label} {version} repeat {r}: wall {wall:.1f} s, CPU {cpu:.1f} s, load {os.getloadavg()[0]:.1f}",
                  file=sys.stderr, flush=True)
    ratios = {kind: [c[i] / r[i] for c, r in zip(times["current"], times["release"])]
              for i, kind in enumerate(("wall", "cpu"))}
    return times, ratios


def compare(a: Path, b: Path) -> dict:
    """Tensors (exact) and metrics (exact) of two run directories."""
    import torch
    from safetensors.torch import load_file

    ta, tb = load_file(str(a / "tensors.safetensors")), load_file(str(b / "tensors.safetensors"))
    differing = {}
    for k in sorted(set(ta) & set(tb)):
        x, y = ta[k].double(), tb[k].double()
        same = x.shape == y.shape and torch.equal(torch.isnan(x), torch.isnan(y)) and \
            torch.equal(torch.nan_to_num(x), torch.nan_to_num(y))
        if not same:
            d = (x - y).abs() if x.shape == y.shape else torch.tensor([math.inf])
            differing[k] = float(d[torch.isfinite(d)].max()) if bool(torch.isfinite(d).any()) else "nan pattern"
    metrics = []

    def walk(x, y, path):
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                if k in x and k in y:
                    walk(x[k], y[k], f"{path}/{k}")
                else:
                    metrics.append(f"{path}/{k} only in the {'release' if k in x else 'current'} run")
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{path}[{i}]")
        elif x != y:
            metrics.append(f"{path}: {x!r} vs {y!r}"[:200])

    ma, mb = (json.loads((p / "run.json").read_text()) for p in (a, b))
    walk(ma.get("metrics", {}), mb.get("metrics", {}), "metrics")
    return {"tensors_compared": len(set(ta) & set(tb)), "tensors_only_release": sorted(set(ta) - set(tb)),
            "tensors_only_current": sorted(set(tb) - set(ta)), "tensors_differing": differing,
            "metrics_differing": metrics}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--release", default=RELEASE, help=f"git ref of the release (default {RELEASE}: 0.2)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tiny", action="store_true", help="a random 3-layer Llama (SmolLM2's tokenizer) instead")
    ap.add_argument("--only", choices=list(COMMANDS), action="append", help="only these commands")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each version per command")
    ap.add_argument("--current", type=Path, default=ROOT / "src", help="the code to compare (default this tree's src)")
    args = ap.parse_args()
    results = {"release": args.release, "model": "tiny random Llama" if args.tiny else args.model,
               "load_average_before": os.getloadavg(), "commands": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        trees = {"release": release_tree(args.release, tmp), "current": args.current}
        for name in args.only or list(COMMANDS):
            model = [TINY, "--tokenizer", "smollm2-135m"] if args.tiny else [args.model]
            argv = [name, *model, *(TINY_ARGS if args.tiny else COMMANDS)[name]]
            times, ratios = interleaved(trees, argv, tmp, args.repeats, name)
            results["commands"][name] = {
                "argv": ["poslens", *argv], "seconds_wall_cpu": times, "ratios_current_over_release": ratios,
                "median_ratio_wall": statistics.median(ratios["wall"]),
                "median_ratio_cpu": statistics.median(ratios["cpu"]),
                **compare(tmp / f"{name}-release-0", tmp / f"{name}-current-0")}
    results["load_average_after"] = os.getloadavg()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
