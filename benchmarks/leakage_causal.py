"""Measurement: the causal leakage pieces on a real model (run by hand, not a test; docs/leakage.md, "Measured").

    .venv/bin/python benchmarks/leakage_causal.py --out runs/leakage-causal        # SmolLM2-135M, 64 x 128
    .venv/bin/python benchmarks/leakage_causal.py --out runs/leakage-causal --summarise-only
    .venv/bin/python benchmarks/leakage_causal.py --out runs/leakage-causal --position0-only  # one batch

Passes over the same 64 documents (batches of 8, group = batch index, 8 groups), each one hooked forward per batch:
plain forwards with logits (the cost unit), the original (LeakageMaps + the predecessor's per-sequence Delta R^2),
the offset null (windows starting at a random offset >= 128 tokens inside the same documents), the circular null
(LeakageMaps + Delta R^2), and the interventions (BOS embedding -> mean embedding; position 0's state from a
mid-document window at layers 0, 4 and 15; the first 33 positions' states -> their batch mean at layer 4). Each
pass's sums are saved under --out (`passes.pt`), so the summary can be redone without the forwards; the summary
(`summary.json`) holds every estimate with its 95% jackknife interval, the predecessor test with its power, and each
piece's cost as a ratio to the plain forwards measured beside it in the same process (with the load average);
`headline.json` is the same without the per-layer lists.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from poslens.analyses.leakage import interventions as iv
from poslens.analyses.leakage import nulls
from poslens.analyses.leakage import predecessor as pr
from poslens.analyses.leakage.causal import ENERGIES, METRICS, VARIANTS, Domains, LeakageMaps
from poslens.analyses.leakage.contrast import contrast, excludes_zero

INTERVENTIONS = ("mean", "patch:inside:1@0", "patch:inside:1@4", "patch:inside:1@15", "patch:mean:33@4")
HEADLINE = ("scores/energy", "attn/e_total", "attn/mask_only", "attn/residual", "scores/trf", "log_probs/trf")


def run_passes(args) -> dict:
    """Every pass's statistics (state dicts) and timings."""
    from poslens.engine.data import document_windows, iter_documents
    from poslens.engine.hooks import HookedModel
    from poslens.engine.models import load_model

    model, tok = load_model(args.model)
    start, inside, data = document_windows(tok, iter_documents(None), args.seq_len, args.num_sequences,
                                           min_offset=args.min_offset, seed=args.seed, bos="always")
    iv.check(list(INTERVENTIONS), model, args.seq_len, args.batch_size)
    hm = HookedModel(model)
    batches = list(zip(torch.split(start, args.batch_size), torch.split(inside, args.batch_size)))
    hm.run(batches[0][0], logits=True)  # warm-up, not timed
    timings, plain, hooks_s = {}, {}, {}
    state, rows = {}, {}
    for name in ("orig", "offset", "circular", *INTERVENTIONS):
        maps = LeakageMaps(groups=args.groups, domains=Domains(early_queries=args.early_queries))
        stats = [maps] + ([pr.DeltaR2Rows(seed=args.seed)] if name in ("orig", "circular") else [])
        spent = {type(s).__name__: 0.0 for s in stats}
        timings[name] = plain[name] = 0.0
        for b, (ids, window) in enumerate(batches):
            t0 = time.perf_counter()
            hm.run(ids, logits=True)  # the cost unit, measured beside each batch of the pass (load drifts)
            t1 = time.perf_counter()
            if name == "orig":
                run_ids, hooks, pos = ids, {}, None
            elif name in nulls.NULLS:
                run_ids, hooks, pos = nulls.prepare(name, ids, inside=window, batch_index=b, seed=args.seed)
            else:
                run_ids, hooks, pos = iv.prepare(name, model, hm, ids, seed=args.seed, inside=window)
            maps.group = b
            merged = {k: [v] for k, v in hooks.items()}  # interventions write first, the readers see the result
            for stat in stats:
                for k, v in stat.hooks(hm).items():
                    merged.setdefault(k, []).append(_timed(v, spent, type(stat).__name__))
            hm.run(run_ids, hooks=merged, position_ids=pos)
            plain[name] += t1 - t0
            timings[name] += time.perf_counter() - t1
        state[name] = {"sums": maps.state_dict(), "windows": maps.windows}
        hooks_s[name] = spent
        if len(stats) > 1:
            rows[name] = stats[1].values()
        print(f"{name}: {timings[name]:.1f} s ({timings[name] / plain[name]:.2f} x plain), in hooks {spent}",
              flush=True)
    return {"state": state, "rows": rows, "timings": timings, "plain": plain, "hooks": hooks_s, "data": data,
            "load_average": os.getloadavg(), "threads": torch.get_num_threads(), "args": vars(args)}


def _timed(fn, spent: dict, key: str):
    def hook(x, ctx):
        t0 = time.perf_counter()
        out = fn(x, ctx)
        spent[key] += time.perf_counter() - t0
        return out

    return hook


def position0_check(args) -> dict:
    """Per layer, the cosine and norms of position 0's state (`blocks.{l}.hook_resid_pre`) when it holds the BOS and
    when it holds a mid-document content token (the first batch's inside windows without their BOS): min and
    max over the batch (a check of how token-specific position 0's state stays, not an estimate)."""
    from poslens.engine.data import document_windows, iter_documents
    from poslens.engine.hooks import HookedModel
    from poslens.engine.models import load_model

    model, tok = load_model(args.model)
    start, inside, _ = document_windows(tok, iter_documents(None), args.seq_len, args.batch_size,
                                       min_offset=args.min_offset, seed=args.seed, bos="always")
    hm = HookedModel(model)
    points = [f"blocks.{l}.hook_resid_pre" for l in range(hm.n_layers)]

    def states(ids: torch.Tensor) -> torch.Tensor:
        got: dict[str, torch.Tensor] = {}
        hm.run(ids, hooks={p: lambda x, ctx: got.__setitem__(ctx.name, x[:, 0].double()) for p in points})
        return torch.stack([got[p] for p in points], 1)  # [B, L, d]

    bos, content = states(start), states(inside[:, 1:])
    cos = torch.nn.functional.cosine_similarity(bos, content, dim=-1)
    return {"layer": list(range(1, hm.n_layers + 1)), "cos_min": cos.min(0).values.tolist(),
            "cos_max": cos.max(0).values.tolist(), "norm_bos_mean": bos.norm(dim=-1).mean(0).tolist(),
            "norm_content_mean": content.norm(dim=-1).mean(0).tolist(), "documents": int(start.shape[0])}


def load_stat(entry: dict, args) -> LeakageMaps:
    stat = LeakageMaps(groups=args["groups"], domains=Domains(early_queries=args["early_queries"]))
    stat.load_state_dict(entry["sums"])
    stat.windows = entry["windows"]
    return stat


def items(est, index) -> dict:
    """value, lo, hi of an Estimate at `index`, as numbers or lists."""
    return {k: getattr(est, k)[index].tolist() for k in ("value", "lo", "hi")}


def summarise(saved: dict) -> dict:
    """Every number the docs report, each with its interval."""
    args = saved["args"]
    t0 = time.perf_counter()
    stats = {k: load_stat(v, args) for k, v in saved["state"].items()}
    orig = stats["orig"]
    out: dict = {"timings": saved["timings"], "load_average_at_run": saved["load_average"],
                 "data": {k: v for k, v in saved["data"].items() if k != "offsets"}, "args": args}
    out["offsets"] = {"min": min(saved["data"]["offsets"]), "max": max(saved["data"]["offsets"]),
                      "median": sorted(saved["data"]["offsets"])[len(saved["data"]["offsets"]) // 2]}
    variants = [v[0] for v in VARIANTS]
    _, est = orig.estimates()
    layer = est["metrics"]
    out["orig"] = {v: {m: items(layer, (i, METRICS.index(m))) for m in HEADLINE} for i, v in enumerate(variants)}
    ratio = layer.value[:, METRICS.index("attn/share_mask_only")]
    out["share_mask_only_range"] = {v: [float(ratio[i].min()), float(ratio[i].max())] for i, v in enumerate(variants)}
    alpha = est["alpha0"].value
    sink = alpha > 0.3
    out["sink_heads"] = int(sink.sum())
    out["alpha0_64_rate"] = float((est["alpha0_64"].value > 0.3).double().mean())
    energy = [METRICS.index(e) for e in ENERGIES]
    totals = orig.sums.estimate(lambda m: orig.layer_metrics(m)[:, energy].sum(-1))  # [V, E], over layers
    out["orig_totals"] = {v: {e: items(totals, (i, k)) for k, e in enumerate(ENERGIES)} for i, v in enumerate(variants)}
    # every other pass against the original: removed = 1 - E(pass) / E(orig); difference = metric(pass) - orig
    out["contrasts"] = {}
    for name in (*INTERVENTIONS, *nulls.NULLS):
        c = contrast(orig, stats[name])
        nonzero = excludes_zero(c["difference"])
        entry = {"removed_all": {v: {e: items(c["removed_all"], (i, k)) for k, e in enumerate(ENERGIES)}
                                 for i, v in enumerate(variants)},
                 "layers_up_down": {v: {m: [int((nonzero & (c["difference"].lo > 0))[i, METRICS.index(m)].sum()),
                                            int((nonzero & (c["difference"].hi < 0))[i, METRICS.index(m)].sum())]
                                        for m in HEADLINE} for i, v in enumerate(variants)},
                 "difference": {v: {m: items(c["difference"], (i, METRICS.index(m))) for m in HEADLINE}
                                for i, v in enumerate(variants)},
                 "removed_per_layer": {v: {e: items(c["removed"], (i, k)) for k, e in enumerate(ENERGIES)}
                                       for i, v in enumerate(variants)}}
        out["contrasts"][name] = entry
    # per head: the BOS replacement's effect on the residual term of sink-reading heads and the others
    heads = contrast(orig, stats["mean"], heads=True)
    k = ENERGIES.index("attn/residual")
    early = variants.index("early")
    removed = heads["removed"]
    sig = excludes_zero(heads["difference"])[early, METRICS.index("attn/residual")]
    out["heads_mean"] = {"sink_heads_removal_excluding_zero": int(sig[sink].sum()),
                         "other_heads_removal_excluding_zero": int(sig[~sink].sum()),
                         "sink_heads": int(sink.sum()), "other_heads": int((~sink).sum()),
                         "removed_early_sink_mean": float(removed.value[early, k][sink].mean()),
                         "removed_early_other_mean": float(removed.value[early, k][~sink].mean())}
    test = pr.paired_test(saved["rows"]["orig"], saved["rows"]["circular"], seed=args["seed"])
    order = torch.argsort(test.gap.reshape(-1), descending=True)[:5]
    h = test.gap.shape[-1]
    out["predecessor"] = {"power": test.power, "significant": int(test.significant.sum()),
                          "significant_per_layer": test.significant.sum(-1).tolist(),
                          "smallest_p": float(test.p.min()),
                          "top": [{"layer": int(i) // h, "head": int(i) % h, "gap": float(test.gap.reshape(-1)[i]),
                                   "lo": float(test.lo.reshape(-1)[i]), "hi": float(test.hi.reshape(-1)[i]),
                                   "p": float(test.p.reshape(-1)[i])} for i in order]}
    out["summary_seconds"] = time.perf_counter() - t0
    plain = saved["plain"]
    out["cost_ratio_to_plain"] = {k: v / plain[k] for k, v in saved["timings"].items()}
    out["hook_ratio_to_plain"] = {k: {s: t / plain[k] for s, t in v.items()} for k, v in saved["hooks"].items()}
    out["plain_forward_s"] = plain
    out["summary_ratio_to_plain"] = out["summary_seconds"] / (sum(plain.values()) / len(plain))
    out["summary_threads"] = torch.get_num_threads()
    out["load_average_at_summary"] = os.getloadavg()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--num-sequences", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--early-queries", type=int, default=32)
    ap.add_argument("--min-offset", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--summarise-only", action="store_true")
    ap.add_argument("--position0-only", action="store_true", help="only the position-0 check (position0.json)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.position0_only:
        (out / "position0.json").write_text(json.dumps(position0_check(args), indent=1))
        return
    if not args.summarise_only:
        torch.save(run_passes(args), out / "passes.pt")
    torch.set_num_threads(1)  # the summary is many small tensor operations: a second thread only contends
    summary = summarise(torch.load(out / "passes.pt", weights_only=False))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    headline = {k: v for k, v in summary.items() if k != "orig"}  # without the per-layer lists
    headline["contrasts"] = {k: {p: c[p] for p in ("removed_all", "layers_up_down")}
                             for k, c in summary["contrasts"].items()}
    (out / "headline.json").write_text(json.dumps(headline, indent=1))
    print(json.dumps({k: summary[k] for k in ("cost_ratio_to_plain", "hook_ratio_to_plain", "summary_ratio_to_plain",
                                              "share_mask_only_range", "heads_mean", "predecessor")},
                     indent=1))


if __name__ == "__main__":
    main()
