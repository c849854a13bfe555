"""run.json's metrics and the tensors of a `poslens leakage` run, from its passes (layout: docs/leakage.md,
"run.json layout").

Every estimate is a smooth function of grouped means with a delete-one-group jackknife interval; a function of two
passes (a contrast) is re-evaluated on each leave-one-group-out pair of means, so its interval is paired. Each
metric appears on the four domains of `causal.VARIANTS`, written as scope (all / early queries) x key 0 (in / out),
per layer and over layers (`causal.over_layers`: energies summed, every other metric averaged).
"""

from __future__ import annotations

import math

import torch

from poslens.analyses.leakage import interventions as iv
from poslens.analyses.leakage import nulls as nl
from poslens.analyses.leakage import position0 as p0
from poslens.analyses.leakage import predecessor as pr
from poslens.analyses.leakage.causal import ENERGIES, HEAD_MEAN_ONLY, METRICS, SUPPORT, VARIANTS, alpha0, over_layers
from poslens.analyses.leakage.contrast import contrast, removed_by_head, sink_attention, sink_heads_removed, unflatten
from poslens.engine.pipeline import Job, Output, Pass
from poslens.engine.stats import Estimate, combine

NAMES = METRICS + HEAD_MEAN_ONLY
SCOPES = {"all": "every query", "early": "queries i <= early_queries"}
KEY0 = {"key0_in": "key 0 (the sink column) in the domain", "key0_out": "key 0 left out of the domain"}
# VARIANTS index of (scope, key 0)
VARIANT = {(name.removesuffix("_no_key0"), "key0_in" if first_key else "key0_out"): v
           for v, (name, _, first_key) in enumerate(VARIANTS)}


# the range a change pass - original of a metric cannot leave, and a removed share 1 - E(pass) / E(original)
CHANGE = {name: (low - high, high - low) for name, (low, high) in SUPPORT.items() if math.isfinite(high - low)}
REMOVED = dict.fromkeys(ENERGIES, (-math.inf, 1.0))


def leaf(est: Estimate, index: tuple, energy: bool = False, support: tuple[float, float] | None = None) -> dict:
    """{"value", "lo", "hi"} of an Estimate at `index` (numbers, or lists over the remaining axes), cut to the
    metric's `support` (`Estimate.within`); an `energy` (a squared norm) also carries the jackknife's bias-corrected
    value (without its sampling-noise term; `Estimate.debiased`)."""
    est = est[index] if support is None else est[index].within(*support)
    out = {k: getattr(est, k).tolist() for k in ("value", "lo", "hi")}
    if energy and est.debiased is not None:
        out["debiased"] = est.debiased.tolist()
    return out


def by_domain(est: Estimate, names: tuple[str, ...], energies: bool = True,
              support: dict[str, tuple[float, float]] | None = None) -> dict:
    """{scope: {metric: {"key0_in": EST, "key0_out": EST}}} from an Estimate [V, M, ...] with metrics `names`, each
    cut to its range in `support` (default: the metrics' own, `causal.SUPPORT`, with `energies`, else none); with
    `energies`, the energies among them (ENERGIES) carry their debiased value."""
    support = (SUPPORT if energies else {}) if support is None else support
    return {scope: {name: {k: leaf(est, (VARIANT[scope, k], m), energies and name in ENERGIES, support.get(name))
                           for k in KEY0} for m, name in enumerate(names)} for scope in SCOPES}


def summarise(job: Job, passes: list[Pass]) -> Output:
    """Tensors and run.json metrics of the finished passes (rank 0)."""
    cfg = job.config
    level = cfg.level
    stats = {p.name: p.statistics for p in passes}
    orig, *orig_rest = stats["original"]
    tensors: dict[str, torch.Tensor] = {**orig.maps()}
    metrics: dict = {"level": level, "groups": job.groups, "layers": job.hm.n_layers,
                     "domains": {"max_offset": cfg.max_offset, "early_queries": cfg.early_queries,
                                 "early_keys": orig.domains.early_keys},
                     "scopes": SCOPES, "key0": KEY0, "metric_names": list(NAMES), "energies": list(ENERGIES),
                     "over_layers": {n: "sum" if n in ENERGIES else "mean" for n in NAMES},
                     "variants": [v[0] for v in VARIANTS]}

    # the original pass: every metric per layer and over layers, per head, attention on key 0
    shapes: list[tuple[int, ...]] = []

    def layered(x: torch.Tensor) -> torch.Tensor:
        parts = [x, over_layers(x)]
        shapes[:] = [tuple(p.shape) for p in parts]
        return torch.cat([p.reshape(-1) for p in parts])

    per_layer, summed = unflatten(combine(layered, [orig.evaluated("layers")], level, keep=True), shapes)
    ests = {"original/metrics": per_layer, "original/over_layers": summed,
            "original/metrics_heads": combine(lambda x: x, [orig.evaluated("heads")], level),
            "original/alpha0": orig.sums.estimate(lambda m: alpha0(m["key0"], windows=orig.windows), level=level),
            "original/alpha0_64": orig.sums.estimate(lambda m: alpha0(m["key0"], p0.GU_TOKENS, orig.windows),
                                                     level=level)}
    metrics["original"] = {"per_layer": by_domain(per_layer, NAMES), "over_layers": by_domain(summed, NAMES)}

    # every other pass against the original
    metrics["interventions"], metrics["nulls"] = {}, {}
    for p in passes[1:]:
        if "offset_intervention" in p.meta:
            continue  # below, beside the offset null
        c = contrast(orig, p.statistics[0], level=level)
        for key, est in c.items():
            ests[f"{p.name}/{key}"] = est
        kind = "null" if p.name in nl.NULLS else "intervention"
        what = nl.describe(p.name, cfg.min_offset) if kind == "null" else iv.describe(p.name)
        entry = {"kind": kind, "what": what,
                 "per_layer": {"pass": by_domain(c["pass"], NAMES),
                               "difference": by_domain(c["difference"], NAMES, False, CHANGE),
                               "removed": by_domain(c["removed"], ENERGIES, False, REMOVED)},
                 "over_layers": {"pass": by_domain(c["pass_over_layers"], NAMES),
                                 "difference": by_domain(c["difference_over_layers"], NAMES, False, CHANGE),
                                 "removed": by_domain(c["removed_all"], ENERGIES, False, REMOVED)}}
        if kind == "intervention":
            removed_heads = removed_by_head(orig, p.statistics[0], level=level)  # [V, E, L, H]
            ests[f"{p.name}/heads/removed"] = removed_heads
            entry["heads"] = head_record(removed_heads, ests["original/alpha0"].value, cfg.sink_threshold)
            entry["sink_attention"] = sink_attention(orig, p.statistics[0], cfg.sink_threshold, level)
            entry["sink_heads_removed"] = sink_heads_removed(orig, p.statistics[0], cfg.sink_threshold, HEAD_ENERGY,
                                                             HEAD_SCOPE, level)
        metrics["interventions" if kind == "intervention" else "nulls"][p.name] = entry
    offset_interventions(job, passes, metrics, ests)
    for name, est in ests.items():
        tensors.update({k: v.float() for k, v in est.as_dict(name).items()})
    # the original's per-layer metrics without each group [groups, V, M, L]: another model's run on the same groups
    # of the same sequences pairs with this one through them (`poslens card`)
    tensors["original/metrics_replicates"] = per_layer.replicates.float()

    # compatibility with the previous layout (the report section, leakage-compare): key 0 in, per layer
    for scope in SCOPES:
        metrics[f"per_layer_{scope}"] = {n: v["key0_in"] for n, v in metrics["original"]["per_layer"][scope].items()}

    # sinks, position 0, the predecessor
    metrics["sinks"] = sinks(ests["original/alpha0"], ests["original/alpha0_64"].value, cfg.sink_threshold,
                             cfg.seq_len)
    position = next(s for s in orig_rest if s.name == "position0")
    spread = position.spread(level)
    tensors.update({k: v.float() for k, v in spread.as_dict("position0_spread").items()})
    metrics["position0_spread"] = spread.value.tolist()
    metrics["position0_spread_interval"] = {"lo": spread.lo.tolist(), "hi": spread.hi.tolist(), "level": spread.level,
                                            "groups": spread.groups}
    rows = [s for s in orig_rest if s.name == "delta_r2_rows"]
    if rows and "circular" in stats:
        test = pr.paired_test(rows[0].values(), stats["circular"][1].values(), seed=cfg.seed, level=level)
        for k, v in test.as_dict().items():
            if isinstance(v, torch.Tensor):
                tensors[f"predecessor/{k}"] = v.float()
        metrics["predecessor"] = predecessor_record(test)
    return Output(tensors, metrics)


def offset_interventions(job: Job, passes: list[Pass], metrics: dict, ests: dict[str, Estimate]) -> None:
    """run.json's `nulls.offset.interventions` (docs/leakage.md, "The offset null under every intervention"): per
    intervention run again on the offset null's windows, its contrast with the offset pass (the layout of an
    intervention's), its sink heads' attention on key 0, and `paired`: the removed shares and changes at document
    starts minus those inside the documents, paired by group (`nulls.paired_with_starts`)."""
    cfg, level = job.config, job.config.level
    stats = {p.name: p.statistics[0] for p in passes}
    records = {}
    for p in passes:
        spec = p.meta.get("offset_intervention")
        if spec is None:
            continue
        base, inside = stats["offset"], p.statistics[0]
        c = contrast(base, inside, level=level)
        paired = nl.paired_with_starts(stats["original"], stats[spec], base, inside, level=level)
        prefix = f"offset/interventions/{spec}"
        ests.update({f"{prefix}/{k}": v for k, v in c.items()})
        ests.update({f"{prefix}/paired/{k}": v for k, v in paired.items()})
        records[spec] = {
            "kind": "intervention", "what": nl.describe_intervention(spec, cfg.min_offset), "base": "offset",
            "per_layer": {"pass": by_domain(c["pass"], NAMES),
                          "difference": by_domain(c["difference"], NAMES, False, CHANGE),
                          "removed": by_domain(c["removed"], ENERGIES, False, REMOVED)},
            "over_layers": {"pass": by_domain(c["pass_over_layers"], NAMES),
                            "difference": by_domain(c["difference_over_layers"], NAMES, False, CHANGE),
                            "removed": by_domain(c["removed_all"], ENERGIES, False, REMOVED)},
            "sink_attention": sink_attention(base, inside, cfg.sink_threshold, level),
            "paired": {"what": "at document starts minus inside the documents, paired by group: removed shares "
                               "(1 - E(pass) / E(its base)) and changes over layers",
                       "per_layer": {"removed": by_domain(paired["removed"], ENERGIES, False)},
                       "over_layers": {"removed": by_domain(paired["removed_all"], ENERGIES, False),
                                       "difference": by_domain(paired["difference_over_layers"], NAMES, False)},
                       "sink_attention": nl.paired_sink_attention(stats["original"], stats[spec], base, inside,
                                                                  cfg.sink_threshold, level)}}
    if records:
        metrics["nulls"]["offset"]["interventions"] = records


def sinks(a0: Estimate, a0_64: torch.Tensor, threshold: float, seq_len: int) -> dict:
    """Gu et al.'s sink rate at seq_len tokens and at 64 (None when seq_len < 64), the sink-reading heads, and the
    rate's bounds from the heads' own intervals: the share of heads whose interval of alpha_0 lies above the
    threshold (`rate_lo`) and the share whose interval reaches above it (`rate_hi`); None without intervals (one
    group of sequences)."""
    rate_64 = float((a0_64 > threshold).double().mean()) if seq_len >= p0.GU_TOKENS else None
    # each head over the threshold by its mean, with its interval: `above` when the whole interval is (None without
    # intervals)
    heads = [{"layer": h["layer"] + 1, "head": h["head"] + 1, "index": [h["layer"], h["head"]], "alpha0": h["alpha0"],
              **_interval_above(a0, h["layer"], h["head"], threshold)} for h in p0.sink_heads(a0.value, threshold)]

    def share(x: torch.Tensor) -> float | None:
        return float((x > threshold).double().mean()) if bool(torch.isfinite(x).all()) else None

    return {"rate": share(a0.value), "rate_lo": share(a0.lo), "rate_hi": share(a0.hi), "level": a0.level,
            "tokens": seq_len, "epsilon": threshold, "rate_64": rate_64, "sink_heads": heads}


def _interval_above(a0: Estimate, layer: int, head: int, threshold: float) -> dict:
    lo, hi = float(a0.lo[layer, head]), float(a0.hi[layer, head])
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return {"alpha0_lo": None, "alpha0_hi": None, "above": None}
    return {"alpha0_lo": lo, "alpha0_hi": hi, "above": lo > threshold}


def sink_bounds(s: dict) -> str:
    """The sink rate's bounds in words (run.json's "sinks"; empty for runs written before they were recorded)."""
    if s.get("rate_lo") is None:
        return ""
    return (f"{s['rate_lo']:.3f} to {s['rate_hi']:.3f} by the heads' own {100 * s['level']:g}% intervals (the share "
            "of heads whose interval of the attention on key 0 lies above the threshold, and the share whose interval "
            "reaches above it)")


HEAD_ENERGY, HEAD_SCOPE = "attn/residual", "early"  # the residual term, where the BOS claim is made


def head_record(removed: Estimate, a0: torch.Tensor, threshold: float, k: int = 5) -> dict:
    """run.json's per-head entry of an intervention: the share of the early queries' residual term it removes
    in each (layer, head) [L, H] (key 0 in and out), how many heads' intervals lie above or below 0, the k
    largest, and every sink-reading head (alpha_0 > threshold) beside it."""
    e = ENERGIES.index(HEAD_ENERGY)
    out: dict = {"energy": HEAD_ENERGY, "scope": HEAD_SCOPE, "level": removed.level, "groups": removed.groups}
    for key0 in KEY0:
        at = (VARIANT[HEAD_SCOPE, key0], e)
        value, lo, hi = removed.value[at], removed.lo[at], removed.hi[at]  # [L, H]
        order = torch.argsort(value.reshape(-1).nan_to_num(nan=-math.inf), descending=True)[:k]
        width = value.shape[-1]
        out[key0] = {"heads": int(value.numel()), "removed": int((lo > 0).sum()), "added": int((hi < 0).sum()),
                     "largest": [_head_cell(value, lo, hi, int(i) // width, int(i) % width) for i in order],
                     "sink_heads": [{**_head_cell(value, lo, hi, h["layer"], h["head"]), "alpha0": h["alpha0"]}
                                    for h in p0.sink_heads(a0, threshold)]}
    return out


def _head_cell(value: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, l: int, h: int) -> dict:
    return {"layer": l + 1, "head": h + 1, "index": [l, h], "value": float(value[l, h]), "lo": float(lo[l, h]),
            "hi": float(hi[l, h])}


def predecessor_record(test: pr.PairedTest, k: int = 10) -> dict:
    """run.json's predecessor entry: power, significant heads per layer, the k largest gaps."""
    order = torch.argsort(test.gap.reshape(-1).nan_to_num(nan=-math.inf), descending=True)[:k]
    h = test.gap.shape[-1]
    top = [{"layer": int(i) // h + 1, "head": int(i) % h + 1, "index": [int(i) // h, int(i) % h],
            "gap": float(test.gap.reshape(-1)[i]), "lo": float(test.lo.reshape(-1)[i]),
            "hi": float(test.hi.reshape(-1)[i]), "p": float(test.p.reshape(-1)[i]),
            "significant": bool(test.significant.reshape(-1)[i])} for i in order]
    return {"null": "circular", "power": test.power, "significant_heads_per_layer": test.significant.sum(-1).tolist(),
            "significant": int(test.significant.sum()), "heads": int(test.significant.numel()), "fdr": test.fdr,
            "top": top}
