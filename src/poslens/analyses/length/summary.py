"""The numbers of a `poslens length` run from its passes' statistics (run.json `metrics`, the tensors) and the
lines the command prints (docs/length.md lists every number)."""

from __future__ import annotations

import math

import torch

from poslens.analyses.leakage.metrics import LEAN
from poslens.analyses.length.attention import AttentionProfile
from poslens.analyses.length.compare import over_seeds, paired_difference
from poslens.analyses.length.loss import LOSS, PositionLoss, bin_spans, span_means
from poslens.analyses.length.plan import LengthPass, LengthStatistics, edges_of
from poslens.engine.stats import Estimate

MAP_METRICS = LEAN  # the TRFs, scores/energy and the decomposition attn/... (diagonal means only: no fits)


def _item(est: Estimate, i=None) -> dict:
    pick = (lambda t: float(t)) if i is None else (lambda t: float(t[i]))
    return {"value": pick(est.value), "lo": pick(est.lo), "hi": pick(est.hi)}


def summarise_model(cfg, passes: list[tuple[LengthPass, LengthStatistics]], level: float) -> tuple[dict, dict]:
    """One model's numbers (run.json) and tensors from its passes (records and their statistics): loss by bucket
    and its rise past L, each intervention's paired effect on the loss over [L, T) for every evaluation length T,
    the attention profile by bucket, and the map metrics at every evaluation length."""
    L, lens, T = cfg.train_len, cfg.eval_lens, cfg.seq_len
    base = next(stats for p, stats in passes if p.plain)
    loss, profile = base.loss, base.profile
    past = [t for t in lens if t > L]
    edges = edges_of(L, lens)
    bins = binned(loss, L, T, level, keep_replicates=True)
    # replicates/loss_binned: each bin without each group, so another model's run on the same groups of the same
    # sequences pairs with this one (`poslens card`)
    tensors = {**loss.curve(level).as_dict("loss"), **bins.as_dict("loss_binned"),
               "replicates/loss_binned": bins.replicates}
    entry: dict = {"buckets": [_item(loss.buckets(level), i) for i in range(len(edges) - 1)],
                   "loss_past_L": {str(t): _item(loss.spans([(L, t)], level), 0) for t in past},
                   "rise": {str(t): _item(rise(loss, L, t, level)) for t in past}}
    effects: dict = {}
    for p, stats in passes:
        if p.plain:
            continue
        for t in p.effect_lengths(past):
            d = paired_difference(loss, stats.loss, level, spans=[(L, t)])
            effects.setdefault(p.intervention, {})[str(t)] = {**_item(d, 0),
                                                              "loss": _item(stats.loss.spans([(L, t)], level), 0)}
        if p.length == T:
            tensors.update(binned(stats.loss, L, T, level).as_dict(f"loss_binned/{p.intervention}"))
            if stats.profile is not None:
                prof = stats.profile.result(level)
                tensors.update({f"profile/{p.intervention}/{k}": v for k, v in prof.items()})
    entry["effects"] = effects
    prof = profile.result(level)
    tensors.update({f"profile/none/{k}": v for k, v in prof.items()})
    entry["profile"] = profile_buckets(profile, edges, level)
    if base.maps is not None:
        entry["maps"] = {str(t): {k: {"value": e.value.tolist(), "lo": e.lo.tolist(), "hi": e.hi.tolist()}
                                  for k, e in met.items()}
                         for t, met in base.maps.metrics_at(lens, level, MAP_METRICS).items()}
        res = base.maps.result(level=level, metrics=False)
        tensors.update({"maps/scores": res["scores"].float(), "maps/scores_se": res["scores_se"].float(),
                        "maps/layers": torch.as_tensor(base.maps.layers)})
    return entry, tensors


def rise(loss: PositionLoss, L: int, t: int, level: float) -> Estimate:
    """Loss over [t/2, t) minus loss over [L/2, L) on the same sequences (how much worse the last doubling is than
    the end of the training range), with its jackknife interval."""
    spans = [(max(1, L // 2), L), (t // 2, t)]
    return loss.sums.estimate(lambda m: (lambda s: s[1] - s[0])(span_means(m["nll"], spans)), level)


def binned(loss: PositionLoss, L: int, n: int, level: float, keep_replicates: bool = False) -> Estimate:
    """Mean loss in bins of L / 4 target positions (from 1) up to n, with jackknife intervals: the curve's figure
    (keep_replicates: its leave-one-group-out values kept)."""
    spans = bin_spans(L, n)
    return loss.sums.estimate(lambda m: span_means(m["nll"], spans), level, keep_replicates=keep_replicates,
                              support=LOSS)


def profile_buckets(profile: AttentionProfile, edges: list[int], level: float) -> dict:
    """Entropy gap log(keys seen) - H and key-0 share, averaged over the queries of each bucket (queries read),
    per layer, with jackknife intervals."""
    out = {}
    for q in ("gap", "key0", "entropy"):
        e = profile.estimate(q, level, edges)
        out[q] = {"value": e.value.tolist(), "lo": e.lo.tolist(), "hi": e.hi.tolist()}
    return out


def over_models(per_model: list[dict], level: float) -> dict:
    """Each number of the models (loss per bucket and past L, rise, effects, profile) as a mean over the models with a
    t-interval over seeds; the per-model values beside it."""

    def seeds(values: list[float], support: tuple[float, float] | None = None) -> dict:
        e = over_seeds(values, level, support)
        return {"value": float(e.value), "lo": float(e.lo), "hi": float(e.hi), "n": len(values),
                "per_model": list(values)}

    first = per_model[0]
    out: dict = {"buckets": [seeds([m["buckets"][i]["value"] for m in per_model], LOSS)
                             for i in range(len(first["buckets"]))],
                 "loss_past_L": {t: seeds([m["loss_past_L"][t]["value"] for m in per_model], LOSS)
                                 for t in first["loss_past_L"]},
                 "rise": {t: seeds([m["rise"][t]["value"] for m in per_model]) for t in first["rise"]},
                 "effects": {spec: {t: seeds([m["effects"][spec][t]["value"] for m in per_model]) for t in by_t}
                             for spec, by_t in first["effects"].items()}}
    support = {"gap": (0.0, math.inf), "key0": (0.0, 1.0)}  # entropy <= log(keys seen); a share
    out["profile"] = {q: [[seeds([m["profile"][q]["value"][l][b] for m in per_model], support[q])
                           for b in range(len(first["profile"][q]["value"][l]))]
                          for l in range(len(first["profile"][q]["value"]))] for q in ("gap", "key0")}
    return out


def _ci(e: dict, signed: bool = False) -> str:
    """value [lo, hi] to 3 decimals, or to 3 significant digits when every bound is under 0.001 (an effect of 2e-05
    is not printed as +0.000 [-0.000, +0.000])."""
    small = all(abs(e[k]) < 1e-3 for k in ("value", "lo", "hi")
                if isinstance(e.get(k), (int, float)) and math.isfinite(e[k]))
    f = ("+" if signed else "") + (".3g" if small else ".3f")
    if e.get("lo") is None or not math.isfinite(e["lo"]):
        return f"{e['value']:{f}}"
    return f"{e['value']:{f}} [{e['lo']:{f}}, {e['hi']:{f}}]"


def summary_lines(meta: dict) -> list[str]:
    """What `poslens length` prints: the loss per bucket, its rise past L, and each intervention's paired effect on the
    loss past L at the longest length (per model, and over seeds when several)."""
    m = meta["metrics"]
    L, edges, level = m["train_len"], m["edges"], m["level"]
    T = str(m["eval_lens"][-1])
    spans = ", ".join(f"{a + 1}-{b}" for a, b in zip(edges, edges[1:]))  # 0-based [a, b): positions a+1..b
    lines = [f"L = {L}; loss (nats) by target position {spans} (positions from 1), {100 * level:g}% jackknife "
             f"intervals over {m['groups']} groups of sequences"]
    for entry in m["models"]:
        lines.append(f"{entry['model']}: " + ", ".join(_ci(b) for b in entry["buckets"])
                     + f"; rise (positions {int(T) // 2 + 1}-{T}) - (positions {L // 2 + 1}-{L}): "
                       f"{_ci(entry['rise'][T], True)}")
        for spec, by_t in entry["effects"].items():
            if T in by_t:
                lines.append(f"  {spec}: loss over positions {L + 1}-{T} {_ci(by_t[T]['loss'])}, effect "
                             f"{_ci(by_t[T], True)} (paired, against none)")
    if "seeds" in m:
        s = m["seeds"]
        lines.append(f"over {len(m['models'])} seeds (mean, {100 * level:g}% t-interval): rise "
                     f"{_ci(s['rise'][T], True)}; effects "
                     + "; ".join(f"{spec} {_ci(by_t[T], True)}" for spec, by_t in s["effects"].items() if T in by_t))
    lines += [f"skipped {spec}: {why}" for spec, why in m.get("skipped", {}).items()]
    lines += [f"note: {n}" for n in m.get("notes", [])]
    return lines
