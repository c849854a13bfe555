"""Benchmark: `poslens sweep` of a preset from an empty model cache (wall and CPU time, load average), and the
attention sinks of every model it trained (run by hand, not a test).

The sweep runs in this process with POSLENS_CACHE pointed at a fresh directory, into which the embedded corpus and
the cached token directory of the preset's tokenizer are copied first (tokenizing the embedded corpus is timed
apart: it happens once per tokenizer, not once per sweep). CPU time is the user + system time of this process and
its worker processes (`resource.getrusage`); models are trained side by side as `poslens sweep` does by default
(`auto_jobs`); on a shared machine wall time measures the load as much as the work, so the load average
is printed at the start and the end.

Sinks (Gu et al. 2025, "When attention sink emerges in language models"): for every model, the mean attention
probability map of each (layer, head) over --sequences held-out sequences of 64 tokens starting with BOS (the
first 63 tokens of consecutive held-out blocks), alpha_0 = mean over queries of the attention on key 0, and the
sink rate = the share of (layer, head) pairs with alpha_0 > 0.3 (`poslens.analyses.leakage.metrics`). Under
uniform causal attention alpha_0 = H_64 / 64 = 0.074. A layer with a sliding window of W < 64 keys hides key 0 from
queries i >= W, so its alpha_0 is the mean over queries 0 .. W - 1 (uniform attention: H_W / W, 0.127 at W = 32).
Per variant: the mean over seeds with a t-interval over seeds.

    .venv/bin/python benchmarks/sweep.py --preset pe --json benchmarks/results/sweep_pe.json
    .venv/bin/python benchmarks/sweep.py --preset pe --threads 1 --json sweep_pe_t1.json   # a shared machine
    .venv/bin/python benchmarks/sweep.py --preset pe --sinks-only --cache ~/.cache/poslens   # models already there
    .venv/bin/python benchmarks/sweep.py --measure runs/train-tiny-rope-bos runs/mine          # any trained models
    python3 benchmarks/sweep.py --preset pe --train steps=6000+batch_size=32+micro_batch=32 --jobs 4 --judge  # a GPU

--judge then runs `poslens leakage` on every model as `poslens reproduce` does (`poslens.report.sweep_leakage`: the
held-out split, the common domain, the BOS replacement, no nulls) and prints Ruscio, Nanni & Silvestri's two
claims judged on these models by the report's rule (verdict, each test's statistic, interval and threshold).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch


def cpu_seconds() -> float:
    """User + system time of this process and of its finished children (the sweep's worker processes)."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                   resource.getrusage(resource.RUSAGE_CHILDREN)))


def alpha0(model_dir: str, tokens: Path, sequences: int, length: int = 64) -> torch.Tensor:
    """alpha_0 [layers, heads]: mean attention on key 0 of `sequences` held-out BOS-led sequences of `length`."""
    import numpy as np

    from poslens.analyses.leakage.causal import alpha0 as alpha0_of
    from poslens.engine.families import sliding_windows
    from poslens.engine.hooks import HookedModel
    from poslens.engine.models import load_model
    from poslens.io.tokenfile import open_tokens

    model, _ = load_model(model_dir, dtype="float32")
    tf = open_tokens(tokens)
    body = np.asarray(tf.val[: sequences * (length - 1)], dtype=np.int64).reshape(sequences, length - 1)
    bos = torch.full((sequences, 1), tf.bos_id("the sink measurement"))
    ids = torch.cat([bos, torch.from_numpy(body)], dim=1)
    hm = HookedModel(model)
    sums: dict[int, torch.Tensor] = {}

    def reader(layer: int):
        def read(pattern, ctx):
            sums[layer] = sums.get(layer, 0) + pattern.double().sum(0)
        return read

    with torch.no_grad():
        for chunk in ids.split(16):
            hm.run(chunk, hooks={f"blocks.{l}.attn.hook_pattern": reader(l) for l in range(hm.n_layers)})
    # alpha_0 of a sliding-window layer of W keys: over the queries that see key 0 (0 .. W - 1; leakage.causal.alpha0)
    key0 = torch.stack([sums[l][:, :, 0] / sequences for l in range(hm.n_layers)])  # [L, H, T]
    return alpha0_of(key0, windows=[int(w or 0) for w in sliding_windows(model.config)])


def judge(cfg, paths: dict, tokens: Path, sequences: int, cache: Path) -> list[dict]:
    """The report's two sweep claims (BOS replacement, architectures) judged on these models: one `poslens
    leakage` run per model as `poslens reproduce` makes it (`poslens.report.sweep_leakage`), then the claims' rows."""
    from types import SimpleNamespace

    from poslens.report import sweep_leakage as sl
    from poslens.report.sweep import SweepModels
    from poslens.train.sweep import resolve_matrix

    sw = SweepModels(cfg, resolve_matrix(cfg), {k: Path(v) for k, v in paths.items()}, tokens)
    ctx = SimpleNamespace(parts=cache / "judge", progress=True)
    ctx.parts.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    metrics = sl.sweep_metrics(sl.sweep_leakage_runs(ctx, sw, {"sweep_sequences": sequences,
                                                                "sweep_groups": min(8, sequences)}))
    claims = [sl.bos_claim(metrics, sw.labels, sw.describe()),
              sl.architecture_claim(metrics, sw.labels, sw.describe(), sl.common_max_offset(sw))[0]]
    print(f"leakage runs on {len(metrics)} models: {time.perf_counter() - t0:.0f} s")
    for c in claims:
        print(f"{c.id}: {c.verdict}")
        for role, t in c.all_tests():
            print(f"  [{role}] {t.text()}")
    return [c.to_json("sweep") for c in claims]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="pe", help="sweep preset or .json matrix (default pe)")
    ap.add_argument("--cache", default=None, help="POSLENS_CACHE to use as it is (default: a fresh one)")
    ap.add_argument("--sinks-only", action="store_true", help="measure the sinks of models already in --cache")
    ap.add_argument("--sequences", type=int, default=64, help="held-out sequences for the sink measurement")
    ap.add_argument("--measure", nargs="+", default=None, metavar="MODEL_DIR",
                    help="only measure the sinks of these trained models (on their own token directories)")
    ap.add_argument("--train", default=None, help="shared training fields on top of the preset's (FIELD=VALUE+...)")
    ap.add_argument("--seeds", default=None, help="seeds instead of the preset's (N,N,...)")
    ap.add_argument("--jobs", type=int, default=0, help="models trained at once (default 0: poslens sweep's auto_jobs)")
    ap.add_argument("--judge", action="store_true", help="judge the sweep claims of the report on the trained models")
    ap.add_argument("--leakage-sequences", type=int, default=32, help="held-out sequences per model for --judge")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default torch's; on a shared machine 1 "
                                                              "keeps one preempted OpenMP thread from stalling both)")
    ap.add_argument("--json", default=None, help="write every number here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure:
        for d in args.measure:
            run = json.loads((Path(d) / "run.json").read_text())
            a = alpha0(d, Path(run["tokens"]["path"]), args.sequences)
            label = run.get("variant", {}).get("label", "?")  # runs of the first 0.3 commits have no variant record
            print(f"{d}: {label}, held-out loss {run['metrics']['final_eval_loss']:.3f}; sink rate "
                  f"{float((a > 0.3).double().mean()):.3f}, mean alpha_0 {float(a.mean()):.3f}, largest "
                  f"{float(a.max()):.3f}; per layer and head {[[round(float(x), 2) for x in row] for row in a]}")
        return

    source = Path(os.environ.get("POSLENS_CACHE", "~/.cache/poslens")).expanduser()
    cache = Path(args.cache).expanduser() if args.cache else Path(tempfile.mkdtemp(prefix="poslens-sweep-bench-"))
    os.environ["POSLENS_CACHE"] = str(cache)

    from poslens.train.cache import tokens_of
    from poslens.train.command import sweep_table
    from poslens.train.sweep import SweepConfig, auto_jobs, resolve_matrix, run_sweep, seed_interval, train_matrix

    cfg = SweepConfig(preset=args.preset, train=args.train, jobs=args.jobs,
                      seeds=[int(x) for x in args.seeds.split(",")] if args.seeds else None)
    matrix = resolve_matrix(cfg)
    first = matrix.members[0].config
    if not args.cache:  # the token directory from the usual cache, timed apart when it is not there
        os.environ["POSLENS_CACHE"] = str(source)
        t0, c0 = time.perf_counter(), cpu_seconds()
        tokens = tokens_of(first, progress=True)
        print(f"token directory {tokens}: {time.perf_counter() - t0:.1f} s wall, {cpu_seconds() - c0:.1f} s CPU")
        os.environ["POSLENS_CACHE"] = str(cache)
        (cache / "tokens").mkdir(parents=True, exist_ok=True)
        shutil.copytree(tokens, cache / "tokens" / tokens.name)
        shutil.copytree(source / "corpus", cache / "corpus")  # the embedded corpus, which names the tokens
    tokens = tokens_of(first)

    load0 = os.getloadavg()
    t0, c0 = time.perf_counter(), cpu_seconds()
    if args.sinks_only:
        paths = train_matrix(matrix, progress=False)
        meta = None
    else:
        out = Path(tempfile.mkdtemp(prefix="poslens-sweep-run-")) / "sweep"
        meta = run_sweep(cfg, out, progress=True)
        paths = {(m["variant"], m["seed"]): m["path"] for m in meta["models"]}
    wall, cpu, load1 = time.perf_counter() - t0, cpu_seconds() - c0, os.getloadavg()
    print(f"sweep {args.preset}: {len(paths)} models, {wall:.0f} s wall ({wall / 60:.1f} min), {cpu:.0f} s CPU "
          f"(user + system), load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end, "
          f"torch threads {torch.get_num_threads()}, cache {cache}")
    if meta is not None:
        print(sweep_table(meta))

    sinks: dict[str, dict] = {}
    for variant in matrix.variants:
        per_seed = {s: alpha0(str(paths[(variant, s)]), tokens, args.sequences) for s in matrix.seeds}
        rates = [float((a > 0.3).double().mean()) for a in per_seed.values()]
        means = [float(a.mean()) for a in per_seed.values()]
        tops = [float(a.max()) for a in per_seed.values()]
        sinks[variant] = {"sink_rate": seed_interval(rates), "mean_alpha0": seed_interval(means),
                          "max_alpha0": seed_interval(tops),
                          "alpha0": {s: a.tolist() for s, a in per_seed.items()}}
        r, m = sinks[variant]["sink_rate"], sinks[variant]["mean_alpha0"]
        print(f"  {variant:<8} sink rate (eps 0.3) {r['value']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]  "
              f"mean alpha_0 {m['value']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]  largest head "
              f"{sinks[variant]['max_alpha0']['value']:.3f}  per seed rates {', '.join(f'{x:.3f}' for x in rates)}")
    judged = judge(cfg, paths, tokens, args.leakage_sequences, cache) if args.judge else None
    if args.json:
        record = {"preset": args.preset, "train": args.train, "judged": judged,
                  "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  "wall_s": wall, "cpu_s": cpu, "load_start": load0, "load_end": load1,
                  "threads": torch.get_num_threads(), "jobs": cfg.jobs or auto_jobs([m.config for m in matrix.members]),
                  "argv": sys.argv, "sinks": sinks,
                  "sweep": meta["metrics"] if meta else None}
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
