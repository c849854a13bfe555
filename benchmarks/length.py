"""Benchmark and first measurement: loss against position past the training length, with every intervention.

For each trained model (a `poslens train` directory): held-out sequences of E x L tokens from its token
directory's validation split (consecutive blocks, as training cut them), then passes over the same sequences:

* none, logn, window, freeze at E x L: by causality the loss at target t does not depend on tokens after t, so
  one pass at the longest length gives the curve for every evaluation length T <= E x L;
* ntk and yarn at each T = 2L, 4L, ..., E x L with factor T / L (their frequencies depend on T; at T = L both are
  the identity): one pass per length on the first T tokens of the same sequences;
* the averaged maps (Capture) at E x L and their leakage metrics on the top-left T x T block for each T.

Every pass keeps its sums per group of sequences (batch b -> group b mod G), so each intervention's effect is the
paired difference other - none over the same sequences with a jackknife interval (poslens.analyses.length).
Reported: the loss in [1, L) and in each doubling bucket [T/2, T) past L; each intervention's paired effect on
the loss past L; attention entropy gap and key-0 share per bucket (first and last layer); map metrics per T;
wall and CPU seconds per stage with the load average.

    PYTHONPATH=src python benchmarks/length.py /tmp/len-nope /tmp/len-rope --out /tmp/length.json
    PYTHONPATH=src python benchmarks/length.py --shape cpu:rope --num-sequences 32   # the `cpu` preset's cost
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch

from poslens.analyses.length import (
    AttentionProfile,
    LengthMaps,
    PositionLoss,
    check_eval_length,
    check_eval_memory,
    doubling_edges,
    paired_difference,
    parse,
    run_pass,
)
from poslens.analyses.length.loss import check_spans, span_means
from poslens.engine.hooks import HookedModel
from poslens.engine.models import load_model, max_positions
from poslens.errors import UsageError
from poslens.train.probe import sequences_of
from poslens.train.tokens import open_tokens

SINGLE = ("none", "logn", "window", "freeze")  # one pass at the longest length
PER_LENGTH = ("ntk", "yarn")  # one pass per evaluation length (factor T / L)


class Clock:
    """Wall and CPU seconds (this process, all threads) per named stage."""

    def __init__(self) -> None:
        self.stages: dict[str, dict[str, float]] = {}

    def __call__(self, name: str):
        clock = self

        class _Stage:
            def __enter__(self):
                self.w, self.c = time.perf_counter(), time.process_time()

            def __exit__(self, *exc):
                s = clock.stages.setdefault(name, {"wall_s": 0.0, "cpu_s": 0.0})
                s["wall_s"] += time.perf_counter() - self.w
                s["cpu_s"] += time.process_time() - self.c

        return _Stage()


def _est(e, i=None) -> dict:
    pick = (lambda t: float(t)) if i is None else (lambda t: float(t[i]))
    return {"value": pick(e.value), "lo": pick(e.lo), "hi": pick(e.hi)}


def _shaped(preset: str, pe: str):
    """A randomly initialised model of a training preset's shape and random token ids: for timings only."""
    from poslens.train.config import parse_tokenizer, resolve_config
    from poslens.train.model import build_model

    cfg = resolve_config(preset, pe=pe)
    vocab = parse_tokenizer(cfg.tokenizer)[1] or 49152
    model = build_model(cfg, vocab).eval()
    model.poslens_load = {"positional_encoding": ["rope" if pe == "rope" else "none"] * cfg.layers}
    return model, vocab


def measure(model_dir: str, args, clock: Clock) -> dict:
    if args.shape:  # "preset:pe", e.g. cpu:rope: weights and text are random, only the timings mean something
        model, vocab = _shaped(*model_dir.split(":"))
        train_len = args.train_len or max_positions(model)
        longest = train_len * args.mult
        tokens = "random ids (timing only)"
        ids = torch.randint(0, vocab, (args.num_sequences, longest), generator=torch.Generator().manual_seed(0))
    else:
        model, _ = load_model(model_dir)
        run = json.loads((Path(model_dir) / "run.json").read_text())
        train_len = args.train_len or max_positions(model)
        longest = train_len * args.mult
        tokens = args.tokens or run["tokens"]["path"]
        ids = sequences_of(open_tokens(tokens).val, longest, args.num_sequences)
    check_eval_length(model, longest)
    layers = model.config.num_hidden_layers
    check_eval_memory(model, longest, args.batch_size, groups=args.groups, map_layers=layers, map_keys=3)
    hm = HookedModel(model)
    batches = list(ids.split(args.batch_size))
    edges = doubling_edges(train_len, longest)
    lengths = [train_len * 2**k for k in range(len(edges) - 1)]  # L, 2L, ..., E L
    out: dict = {"model": model_dir, "pe": model.poslens_load.get("positional_encoding"), "train_len": train_len,
                 "eval_lens": lengths, "sequences": int(ids.shape[0]), "groups": args.groups,
                 "tokens": str(tokens), "edges": edges, "passes": {}}
    stats: dict[str, PositionLoss] = {}
    # past L against the end of the training range, on the same sequences: loss [T/2, T) - loss [L/2, L)
    ref, later = (train_len // 2, train_len), list(zip(edges[1:-1], edges[2:]))
    for spec in SINGLE:
        iv = parse(spec, train_len)
        loss, prof = PositionLoss(edges, args.groups), AttentionProfile(groups=args.groups, every=args.every)
        with clock(f"pass {spec} @{longest}"):
            run_pass(hm, [loss, prof], batches, iv)
        stats[spec] = loss
        att = prof.result()
        entry = {"buckets": [_est(loss.buckets(), k) for k in range(len(edges) - 1)]}
        check_spans(loss, [ref, *later])
        rise = loss.sums.estimate(lambda m: span_means(m["nll"], later) - span_means(m["nll"], [ref]), 0.95)
        entry["rise_vs_late_train"] = [_est(rise, k) for k in range(len(later))]
        for name in ("gap", "key0"):
            per = []
            for lo, hi in zip(edges, edges[1:]):
                per.append([float(att[name][li, lo:hi].nanmean()) for li in (0, att[name].shape[0] - 1)])
            entry[f"{name}_first_last_layer"] = per
        if spec != "none":
            past = [(train_len, longest)] + list(zip(edges[1:-1], edges[2:]))
            diff = paired_difference(stats["none"], loss, spans=past)
            entry["effect_past_L"] = _est(diff, 0)
            entry["effect_by_bucket"] = [_est(diff, k) for k in range(1, len(past))]
        out["passes"][spec] = entry
    for spec in PER_LENGTH:
        try:
            parse(spec, train_len).check(model)
        except UsageError as e:
            out["passes"][spec] = {"skipped": str(e)}
            continue
        per_t = {}
        for t in lengths[1:]:
            loss = PositionLoss(doubling_edges(train_len, t), args.groups)
            with clock(f"pass {spec} @{t}"):
                run_pass(hm, [loss], [b[:, :t] for b in batches], parse(spec, train_len))
            diff = paired_difference(stats["none"], loss, spans=[(train_len, t), (t // 2, t)])
            per_t[str(t)] = {"loss_past_L": _est(loss.spans([(train_len, t)]), 0),
                             "effect_past_L": _est(diff, 0), "effect_last_bucket": _est(diff, 1)}
        out["passes"][spec] = {"per_length": per_t}
    if args.maps:
        maps = LengthMaps(model, groups=args.groups)
        with clock(f"maps @{longest}"):
            for b, batch in enumerate(batches):
                maps.update(batch, group=b)
        with clock("map metrics"):
            keep = ("scores/trf", "scores/drift", "split/share_mask", "scores/sink_excess")
            out["maps"] = {}
            for t in lengths:
                met = maps.metrics(n=t)
                out["maps"][str(t)] = {k: [_est(met[k], li) for li in range(layers)] for k in keep if k in met}
    return out


def _ci(e: dict, signed: bool = True) -> str:
    f = "+.3f" if signed else ".3f"
    return f"{e['value']:{f}} [{e['lo']:{f}}, {e['hi']:{f}}]"


def summary(results: dict) -> str:
    """Markdown tables of a results dict (what `main` writes)."""
    lines = []
    for r in results["models"]:
        name, edges = r["model"], r["edges"]
        spans = [f"[{a}, {b})" for a, b in zip(edges, edges[1:])]
        lines += [f"### {name} (L = {r['train_len']}, {r['sequences']} sequences, {r['groups']} groups)", "",
                  "| pass | " + " | ".join(f"loss {s}" for s in spans) + " | effect past L (paired) |",
                  "| --- |" + " --- |" * (len(spans) + 1)]
        for spec, p in r["passes"].items():
            if "buckets" in p:
                eff = _ci(p["effect_past_L"]) if "effect_past_L" in p else ""
                lines.append(f"| {spec} | " + " | ".join(_ci(b, False) for b in p["buckets"]) + f" | {eff} |")
                if "rise_vs_late_train" in p:
                    rise = " | ".join(_ci(b) for b in p["rise_vs_late_train"])
                    lines.append(f"| {spec}: rise over [L/2, L) | | {rise} | |")
        for spec in PER_LENGTH:
            p = r["passes"].get(spec, {})
            if "skipped" in p:
                lines.append(f"| {spec} | skipped: {p['skipped']} |")
            for t, q in p.get("per_length", {}).items():
                lines.append(f"| {spec} (F = {int(t) // r['train_len']}) at T = {t} | loss [L, T) "
                             f"{_ci(q['loss_past_L'], False)} | effect [L, T) {_ci(q['effect_past_L'])} | "
                             f"effect [T/2, T) {_ci(q['effect_last_bucket'])} |")
        lines += ["", "| pass | " + " | ".join(f"gap, key0 {s} (layer 1 / last)" for s in spans) + " |",
                  "| --- |" + " --- |" * len(spans)]
        for spec, p in r["passes"].items():
            if "gap_first_last_layer" in p:
                cells = [f"{g[0]:.2f}/{g[1]:.2f}, {k[0]:.3f}/{k[1]:.3f}"
                         for g, k in zip(p["gap_first_last_layer"], p["key0_first_last_layer"])]
                lines.append(f"| {spec} | " + " | ".join(cells) + " |")
        if "maps" in r:
            lines += ["", "| T | " + " | ".join(next(iter(r["maps"].values()))) + " (per layer) |",
                      "| --- |" + " --- |" * len(next(iter(r["maps"].values())))]
            for t, met in r["maps"].items():
                lines.append(f"| {t} | " + " | ".join(", ".join(f"{e['value']:.3f}" for e in v)
                                                         for v in met.values()) + " |")
        lines += ["", "| stage | wall s | CPU s |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v['wall_s']:.1f} | {v['cpu_s']:.1f} |" for k, v in r["timings"].items()]
        lines += [f"| total | {r['total']['wall_s']:.1f} | {r['total']['cpu_s']:.1f} |", ""]
    lines.append(f"load average before {results['load_before']}, after {results['load_after']}; torch threads "
                 f"{results['threads']}; peak RSS {results['max_rss_mib']:.0f} MiB")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", help="poslens train output directories (with --shape: PRESET:PE, e.g. "
                                             "cpu:rope)")
    p.add_argument("--shape", action="store_true", help="time randomly initialised models of a preset's shape on "
                                                         "random ids (the losses mean nothing)")
    p.add_argument("--train-len", type=int, default=None, help="training length L (default: max_position_embeddings)")
    p.add_argument("--mult", type=int, default=8, help="longest evaluation length in units of L (default 8)")
    p.add_argument("--num-sequences", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--every", type=int, default=4, help="attention profile at every k-th query (default 4)")
    p.add_argument("--tokens", default=None, help="token directory (default: the one the model was trained on)")
    p.add_argument("--no-maps", dest="maps", action="store_false")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--summary", default=None, help="print the tables of a results JSON written before, and exit")
    args = p.parse_args()
    if args.summary:
        print(summary(json.loads(Path(args.summary).read_text())))
        return
    if not args.models:
        p.error("give at least one model directory (or --shape PRESET:PE)")
    results = {"load_before": os.getloadavg(), "threads": torch.get_num_threads(), "models": []}
    for d in args.models:
        clock = Clock()
        r = measure(d, args, clock)
        r["timings"] = clock.stages
        r["total"] = {k: sum(s[k] for s in clock.stages.values()) for k in ("wall_s", "cpu_s")}
        results["models"].append(r)
        print(json.dumps({"model": d, "total": r["total"]}))
    results["load_after"] = os.getloadavg()
    results["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(summary(results))


if __name__ == "__main__":
    main()
