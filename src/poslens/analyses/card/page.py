"""The card's page: read the sub-run directories (`run.plan`), write card.md, card.html (self-contained: figures
embedded), figures/ and run.json into OUT/card. Nothing is measured here: every number is read from a run
directory whose command is printed beside it.
"""

from __future__ import annotations

import base64
import html
import math
import time
from pathlib import Path
from typing import Any

from poslens.analyses.card.paired import batches, pairable, paired_rows
from poslens.errors import UsageError

PANELS = {
    "scheme": ("Positional scheme per layer",
               "What the checkpoint's config says each layer does with positions (run.json's model record).",
               "Shows: the scheme the forward pass applies. Cannot show: whether the trained weights use it."),
    "scores": ("Non-relative score pattern (Kim et al. 2025, Section 5.2)",
               "Per layer, the RMS of the diagonal-normalised mean score map over keys j >= 1 (Kim et al., \"Behind "
               "RoPE: How Does Causal Mask Encode Positional Information?\", Section 5.2), beside its noise RMS (the "
               "same statistic of pure sampling noise at this size), and the share of the pattern's energy that one "
               "offset per query explains (`scores/offset_share`, key 0 out): the part a softmax ignores.",
               "Shows: how far the mean scores are from a function of i - j, and how much of that no attention weight "
               "sees. Cannot show: causes (a description of the scores); an RMS at or below its noise RMS is noise."),
    "leakage": ("Absolute-position terms of attention (Ruscio et al. 2026)",
                "Per layer, the gauge-invariant decomposition of the non-relative energy of the attention "
                "log-probabilities (Ruscio, Nanni & Silvestri, \"Where does Absolute Position come from in "
                "decoder-only Transformers?\"; docs/leakage.md): `attn/mask_only` (what the causal mask alone makes "
                "of the scores' lag profile) and `attn/residual` (the scores' own absolute part), with their shares "
                "of `attn/e_total`, key 0 in and out. With the cross term's share they sum to 1, so a share above 1 "
                "comes with a negative cross term (the two terms partly cancel).",
                "Shows: which term of the decomposition holds the absolute-position energy of the attention "
                "weights, and how much of it is the sink column. Cannot show: causes (a decomposition, not an "
                "intervention), or where the residual term comes from upstream (the probe panel reads the stream "
                "itself)."),
    "sinks": ("Sinks and sink-reading heads",
              "Gu et al.'s sink rate ('When Attention Sink Emerges in Language Models: An Empirical View', 2025: the "
              "share of heads whose mean attention on key 0 exceeds the threshold), its bounds from the heads' own "
              "intervals, and the sink-reading heads (from the leakage run): first those whose interval lies above "
              "the threshold, then those above it by the mean only, with their intervals.",
              "Shows: where attention parks on key 0. Cannot show: what those heads write (see `poslens leakage "
              "--interventions`)."),
    "probe": ("Absolute position in the residual stream (linear probe)",
              "Per hidden state (0 = embeddings, l = after layer l) the held-out R^2 of a ridge probe of the "
              "position, each group of sequences scored by a probe fitted on the others; interval: t over the folds. "
              "R^2 = 0 is predicting the mean position; below 0 the probe overfits.",
              "Shows: how linearly decodable absolute position is at each depth. Cannot show: whether the model "
              "uses it, nor nonlinear codes (a low R^2 is not an absence of position)."),
    "length": ("Held-out loss by position past a length L",
               "Next-token loss by target position up to multiple x L on held-out text, and the paired effect of each "
               "length intervention that applies to the scheme past L: its mean loss minus the unchanged model's "
               "(none), in nats per token, over positions L + 1 to N of the same sequences (1-based; below 0: the "
               "intervention lowers the loss).",
               "Shows: how the loss behaves past L and what each intervention does there. Cannot show: a model's "
               "behaviour past its real training length unless L is set to it (length.train_len=N): by default L is "
               "a short nominal length that keeps the card fast."),
}


def _load(path: Path) -> Any:
    from poslens.io.results import load

    return load(path)


def _iv(v: float, lo: float | None = None, hi: float | None = None, digits: int = 3) -> str:
    def f(x):
        return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"

    return f(v) if lo is None else f"{f(v)} [{f(lo)}, {f(hi)}]"


def read_model(runs: list) -> dict:
    """Everything the page shows of one model, read from its four sub-runs."""
    by = {r.analysis: r for r in runs}
    scores, leakage = _load(by["scores"].path), _load(by["leakage"].path)
    probe, length = _load(by["probe"].path), _load(by["length"].path)
    record = scores.meta["model"]
    variant = record.get("variant") or {}
    schemes = record.get("positional_encoding") or []
    windows = variant.get("sliding_window") or [0] * len(schemes)
    out: dict[str, Any] = {"label": runs[0].label, "model": runs[0].model, "record": record,
                           "commands": {r.analysis: r.command for r in runs},
                           "reused": {r.analysis: r.reused for r in runs}}
    theta = variant.get("rope_theta")
    bases = variant.get("rope_theta_layers") or [theta] * len(schemes)  # per layer where layer types differ (Gemma-3)
    out["scheme"] = {"label": variant.get("label"), "rope_theta": theta,
                     "layers": [{"layer": i + 1, "scheme": s, "window": int(w or 0),
                                 "rope_theta": b if s in ("rope", "partial-rope") else None}
                                for i, (s, w, b) in enumerate(zip(schemes, windows, bases))]}
    per = leakage.meta["metrics"]["original"]["per_layer"]["all"]
    out["scores"] = []
    for i, m in enumerate(scores.meta["metrics"]["layers"]):
        ci = m.get("normalised_rms_ci") or {}
        share = {k: (per["scores/offset_share"][k]["value"][i], per["scores/offset_share"][k]["lo"][i],
                     per["scores/offset_share"][k]["hi"][i]) for k in ("key0_out", "key0_in")}
        out["scores"].append({"layer": m["layer"], "rms": (m["normalised_rms"], ci.get("lo"), ci.get("hi")),
                              "noise": m.get("normalised_noise_rms"), "offset_share": share})
    names = ("attn/e_total", "attn/mask_only", "attn/residual", "attn/share_mask_only", "attn/share_residual")
    out["leakage"] = {n: {k: [tuple(x) for x in zip(per[n][k]["value"], per[n][k]["lo"], per[n][k]["hi"])]
                          for k in ("key0_in", "key0_out")} for n in names}
    out["sinks"] = leakage.meta["metrics"]["sinks"]
    t = probe.tensors
    out["probe"] = [(float(t["r2"][i]), float(t["r2_lo"][i]), float(t["r2_hi"][i])) for i in range(len(t["r2"]))]
    out["probe_folds"] = int(t["folds"].min())
    out["probe_fold_r2"] = t["r2_folds"].tolist() if "r2_folds" in t else None
    out["tokens_checksum"] = t["tokens_checksum"].tolist() if "tokens_checksum" in t else None
    lm = length.meta["metrics"]
    L, lens = lm["train_len"], lm["eval_lens"]
    width = max(1, L // 4)
    lt = length.tensors
    bins = []
    for b in range(len(lt["loss_binned"])):
        bins.append({"from": max(2, b * width + 1), "to": min((b + 1) * width, lens[-1]),  # position 1: no loss
                     "loss": (float(lt["loss_binned"][b]), float(lt["loss_binned_lo"][b]),
                              float(lt["loss_binned_hi"][b]))})
    model0 = lm["models"][0]
    effects = {name: {int(n): (v["value"], v["lo"], v["hi"]) for n, v in per_len.items()}
               for name, per_len in model0.get("effects", {}).items()}
    out["length"] = {"train_len": L, "eval_lens": lens, "bins": bins, "effects": effects,
                     "skipped": lm.get("skipped", {}), "notes": lm.get("notes", [])}
    out["batches"] = {a: batches(run.meta) for a, run in (("scores", scores), ("leakage", leakage),
                                                          ("probe", probe), ("length", length))}
    out["replicates"] = replicates(scores, leakage, length)
    return out


PAIRED_SHARES = ("attn/share_mask_only", "attn/share_residual")  # the leakage panel's paired columns


def replicates(scores, leakage, length) -> dict:
    """The leave-one-group-out values each run kept for paired differences (`paired.py`), per panel and row: scores
    per layer; leakage per share, key 0 in/out and layer (all queries); length per bin. A run written before they
    were kept has none (its panel is then side by side only)."""
    from poslens.analyses.leakage.summary import KEY0, VARIANT

    out: dict[str, Any] = {}
    layers = scores.meta["metrics"]["layers"]
    if layers and all("normalised_rms_replicates" in m for m in layers):
        out["scores"] = [m["normalised_rms_replicates"] for m in layers]
    if "original/metrics_replicates" in leakage.tensors:
        r = leakage.tensors["original/metrics_replicates"].double()  # [groups, V, M, L]
        names = leakage.meta["metrics"]["metric_names"]
        out["leakage"] = {n: {k: r[:, VARIANT["all", k], names.index(n)].T.tolist() for k in KEY0}
                          for n in PAIRED_SHARES}
    if "replicates/loss_binned" in length.tensors:
        out["length"] = length.tensors["replicates/loss_binned"].double().T.tolist()
    return out


def paired_columns(models: list[dict], level: float) -> dict[str, list[tuple[dict, list]]]:
    """Per panel, (other model, rows of {column: (first - other, lo, hi)}) for every other model that read the
    same token ids in the same groups as the first (`paired.paired_rows`)."""
    def scores(m):
        return [{"pattern RMS": (r["rms"][0], x)} for r, x in zip(m["scores"], m["replicates"]["scores"])]

    def leak(m):
        reps = m["replicates"]["leakage"]
        return [{f"{n.split('_', 1)[1].replace('_', '-')} share, key 0 {k[5:]}": (m["leakage"][n][k][i][0],
                                                                              reps[n][k][i])
                 for n in PAIRED_SHARES for k in ("key0_in", "key0_out")} for i in range(len(reps[PAIRED_SHARES[0]][
                     "key0_in"]))]

    def length(m):
        return [{"loss": (b["loss"][0], x)} for b, x in zip(m["length"]["bins"], m["replicates"]["length"])]

    out = {}
    for panel, analysis, values in (("scores", "scores", scores), ("leakage", "leakage", leak),
                                    ("length", "length", length)):
        pairs = [(m, paired_rows(models[0], m, analysis, values, level)) for m in models[1:]]
        out[panel] = [(m, d) for m, d in pairs if d is not None]
    return out


def add_paired(table: tuple[list[str], list[list[str]]], first: str, pairs: list[tuple[dict, list]]) -> None:
    """Append the paired columns (first - other, with its interval) to a panel's (header, rows)."""
    header, rows = table
    for m, diff in pairs:
        for column in (diff[0] if diff else {}):
            header.append(f"{column}, {first} - {m['label']}, paired")
            for i, row in enumerate(rows):
                row.append(_iv(*diff[i][column]) if i < len(diff) else "-")


# ---------------------------------------------------------------- figures


def figures(models: list[dict], directory: Path) -> dict[str, Path]:
    """One figure per panel with a per-layer series, every model a line (through `poslens.plotting`): one model, a
    colour per quantity; several, a colour per model and a line style per quantity."""
    from poslens import plotting

    def draw(stem: str, xs_of, series_of, xlabel: str, ylabel: str, title: str) -> Path:
        series, errors, xs = {}, {}, []
        for m in models:
            xs = max(xs, list(xs_of(m)), key=len)  # the deepest model's layers (or the most bins)
            for name, rows in series_of(m).items():
                key = f"{name}, {m['label']}" if len(models) > 1 else name
                series[key] = [r[0] for r in rows]
                errors[key] = [[r[0] - r[1] if r[1] is not None else 0 for r in rows],
                               [r[2] - r[0] if r[2] is not None else 0 for r in rows]]
        for key, ys in series.items():  # models of different depths: a shallower model's line ends at its last
            pad = len(xs) - len(ys)  # layer (NaN past it draws nothing)
            series[key] = ys + [math.nan] * pad
            errors[key] = [e + [0.0] * pad for e in errors[key]]
        # several models: a colour per model, a line style per quantity
        fig = plotting.line_plot(xs, series, xlabel, ylabel, title, errors=errors, paired=len(models) > 1)
        return plotting.save(fig, directory, stem, formats=("png",))[0]

    def layers(m):
        return [r["layer"] for r in m["scores"]]

    out = {"scores": draw("scores", layers, lambda m: {
        "pattern RMS": [r["rms"] for r in m["scores"]],
        "noise RMS": [(r["noise"] if r["noise"] is not None else math.nan, None, None) for r in m["scores"]],
        "offset share": [r["offset_share"]["key0_out"] for r in m["scores"]]},
        "layer", "RMS / share", "non-relative score pattern (key 0 out) and its per-query-offset share")}
    out["leakage"] = draw("leakage", layers, lambda m: {
        "mask-only share, key 0 in": m["leakage"]["attn/share_mask_only"]["key0_in"],
        "mask-only share, key 0 out": m["leakage"]["attn/share_mask_only"]["key0_out"],
        "residual share, key 0 in": m["leakage"]["attn/share_residual"]["key0_in"],
        "residual share, key 0 out": m["leakage"]["attn/share_residual"]["key0_out"]},
        "layer", "share of attn/e_total", "absolute-position terms of attention")
    out["probe"] = draw("probe", lambda m: list(range(len(m["probe"]))), lambda m: {"held-out R^2": m["probe"]},
                        "hidden state (0 = embeddings, l = after layer l)", "held-out R^2",
                        "linear probe of absolute position")
    out["length"] = draw("length", lambda m: [b["to"] for b in m["length"]["bins"]],
                         lambda m: {"loss": [b["loss"] for b in m["length"]["bins"]]},
                         "target position (end of bin)", "next-token loss", "held-out loss by position")
    return out


# ---------------------------------------------------------------- tables


def tables(models: list[dict], level: float = 0.95) -> dict[str, tuple[list[str], list[list[str]]]]:
    """(header, rows) of every panel; the models side by side (a model without that layer shows a dash)."""
    labels = [m["label"] for m in models]
    multi = len(models) > 1

    def head(*cols: str) -> list[str]:
        return ["layer"] + [f"{c} ({x})" if multi else c for x in labels for c in cols]

    def by_layer(n: int, cells) -> list[list[str]]:
        rows = []
        for i in range(n):
            row = [str(i + 1)]
            for m in models:
                row += cells(m, i)
            rows.append(row)
        return rows

    depth = max(len(m["scores"]) for m in models)
    out = {}

    def scheme(m, i):
        layers = m["scheme"]["layers"]
        if i >= len(layers):
            return ["-", "-", "-"]
        r = layers[i]
        base = r.get("rope_theta")
        return [r["scheme"], f"sliding window {r['window']}" if r["window"] else "full",
                "-" if base is None else f"{base:g}"]

    out["scheme"] = (head("scheme", "attention", "RoPE base"), by_layer(depth, scheme))

    def scores(m, i):
        if i >= len(m["scores"]):
            return ["-"] * 3
        r = m["scores"][i]
        return [_iv(*r["rms"]), _iv(r["noise"]) if r["noise"] is not None else "-",
                _iv(*r["offset_share"]["key0_out"])]

    out["scores"] = (head("pattern RMS", "noise RMS", "offset share"), by_layer(depth, scores))

    def leak(m, i):
        lk = m["leakage"]
        if i >= len(lk["attn/e_total"]["key0_in"]):
            return ["-"] * 4
        return [_iv(*lk["attn/share_mask_only"][k][i]) for k in ("key0_in", "key0_out")] + \
               [_iv(*lk["attn/share_residual"][k][i]) for k in ("key0_in", "key0_out")]

    out["leakage"] = (head("mask-only share, key 0 in", "out", "residual share, key 0 in", "out"),
                      by_layer(depth, leak))

    def sinks(m, i):  # heads whose interval lies above the threshold, then those whose mean alone does
        heads = [h for h in m["sinks"]["sink_heads"] if h["layer"] == i + 1]
        sure = [h for h in heads if h.get("above") is not False]
        cell = ", ".join(f"{h['head']} ({h['alpha0']:.2f})" for h in sure)
        if len(sure) < len(heads):
            cell += ("; " if cell else "") + "by the mean only: " + ", ".join(
                f"{h['head']} ({h['alpha0']:.2f} [{h['alpha0_lo']:.2f}, {h['alpha0_hi']:.2f}])"
                for h in heads if h.get("above") is False)
        return [cell or "-"]

    out["sinks"] = (head("sink-reading heads (attention on key 0; interval above the threshold)"),
                    by_layer(depth, sinks))
    probe_depth = max(len(m["probe"]) for m in models)
    pairs = [(m, paired_probe(models[0], m, level)) for m in models[1:]]
    pairs = [(m, d) for m, d in pairs if d is not None]
    out["probe"] = (["hidden state"] + [f"R^2 ({x})" if multi else "held-out R^2" for x in labels]
                    + [f"{models[0]['label']} - {m['label']}, paired" for m, _ in pairs],
                    [["embeddings" if i == 0 else f"after layer {i}"]
                     + [_iv(*m["probe"][i]) if i < len(m["probe"]) else "-" for m in models]
                     + [_iv(*d[i]) if i < len(d) else "-" for _, d in pairs]
                     for i in range(probe_depth)])
    paired = paired_columns(models, level)
    add_paired(out["scores"], labels[0], paired["scores"])
    add_paired(out["leakage"], labels[0], paired["leakage"])
    nbins = max(len(m["length"]["bins"]) for m in models)
    out["length"] = (["positions"] + [f"loss ({x})" if multi else "loss" for x in labels],
                     [[f"{models[0]['length']['bins'][b]['from']}-{models[0]['length']['bins'][b]['to']}"
                       if b < len(models[0]["length"]["bins"]) else "-"]
                      + [_iv(*m["length"]["bins"][b]["loss"]) if b < len(m["length"]["bins"]) else "-"
                         for m in models] for b in range(nbins)])
    add_paired(out["length"], labels[0], paired["length"])
    return out


def paired_probe(a: dict, b: dict, level: float) -> list[tuple[float, float, float]] | None:
    """R^2(a) - R^2(b) per hidden state both have, as the mean over folds of the per-fold differences with a
    t-interval over folds: only when both probes read the same tokens in the same groups (equal checksums: one
    tokenizer on the same text); None otherwise."""
    from poslens.engine.stats import over_seeds

    if not (a["tokens_checksum"] and a["tokens_checksum"] == b["tokens_checksum"] and a["probe_fold_r2"]
            and b["probe_fold_r2"] and len(a["probe_fold_r2"][0]) == len(b["probe_fold_r2"][0])):
        return None
    out = []
    for fa, fb in zip(a["probe_fold_r2"], b["probe_fold_r2"]):
        est = over_seeds([x - y for x, y in zip(fa, fb)], level)
        out.append((float(est.value), float(est.lo), float(est.hi)))
    return out


def pair_line(a: dict, b: dict, analysis: str) -> str:
    """Whether a panel pairs models a and b, in words."""
    if pairable(a, b, analysis):
        return (f"{a['label']} - {b['label']}: paired (the same token ids in the same groups; interval: the "
                "jackknife of the difference over those groups)")
    return (f"{a['label']} - {b['label']}: side by side only, not paired (they did not read the same token ids in "
            "the same groups: another tokenizer or text, or runs that kept no leave-one-group-out values)")


def rope_bases(scheme: dict) -> str:
    """', RoPE base 1e+05', or, where layers differ (Gemma-3), ', RoPE base 10000 in layers 1-5, 7-11, 13-17 (the
    sliding-window layers) and 1e+06 in layers 6, 12, 18 (the full-attention layers)'; '' without RoPE."""
    by: dict[float, list[dict]] = {}
    for r in scheme["layers"]:
        if r.get("rope_theta") is not None:
            by.setdefault(r["rope_theta"], []).append(r)
    if not by and scheme.get("rope_theta"):  # a record without per-layer bases
        return f", RoPE base {scheme['rope_theta']:g}"
    if len(by) <= 1:
        return "".join(f", RoPE base {b:g}" for b in by)

    def kind(rows: list[dict]) -> str:  # named by attention when a base's layers are exactly one kind's
        these = [r["layer"] for r in rows]
        for words, sliding in (("the sliding-window layers", True), ("the full-attention layers", False)):
            if these == [r["layer"] for r in scheme["layers"] if bool(r["window"]) == sliding]:
                return f" ({words})"
        return ""

    return ", RoPE base " + " and ".join(f"{b:g} in layers {spans([r['layer'] for r in rows])}{kind(rows)}"
                                         for b, rows in by.items())


def spans(layers: list[int]) -> str:
    """'1-5, 7-11, 13' from [1, 2, 3, 4, 5, 7, ..., 13]."""
    out, start = [], None
    for k, x in enumerate(layers):
        start = x if start is None else start
        if k + 1 == len(layers) or layers[k + 1] != x + 1:
            out.append(str(x) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def length_effects(m: dict) -> list[str]:
    """One line per intervention: its paired effect on the loss past L at each longer length."""
    lines = []
    L = m["length"]["train_len"]
    for name, per in m["length"]["effects"].items():
        parts = [f"positions {L + 1}-{n}: {_iv(*v)}" for n, v in sorted(per.items())]
        lines.append(f"{name}: {'; '.join(parts)}")
    for name, why in m["length"]["skipped"].items():
        lines.append(f"{name}: not run ({why})")
    return lines


def sink_line(m: dict) -> str:
    s = m["sinks"]
    rate = "nan" if s.get("rate") is None else f"{s['rate']:.3f}"
    bounds = "" if s.get("rate_lo") is None else f" (bounds {s['rate_lo']:.3f} to {s['rate_hi']:.3f} by the heads' " \
                                                  f"own {100 * s['level']:g}% intervals)"
    heads = s["sink_heads"]
    decided = [h for h in heads if h.get("above")]
    count = (f"{len(heads)} sink-reading heads by their means" if any(h.get("above") is None for h in heads) else
             f"{len(decided)} sink-reading heads (the interval of the attention on key 0 above the threshold; "
             f"{len(heads)} by their means)")
    return f"sink rate at {s['tokens']} tokens {rate}{bounds}, threshold {s['epsilon']}; {count}"


# ---------------------------------------------------------------- rendering


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    def cell(x: str) -> str:
        return str(x).replace("|", "\\|")

    return "\n".join(["| " + " | ".join(map(cell, header)) + " |", "|" + " --- |" * len(header)]
                     + ["| " + " | ".join(map(cell, r)) + " |" for r in rows])


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    e = html.escape
    return ("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows) + "</table>")


CSS = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
       "table{border-collapse:collapse;margin:.5em 0;font-size:.9em}td,th{border:1px solid #ccc;padding:.2em .5em;"
       "text-align:right}th{background:#f3f3f3}td:first-child{text-align:left}code{font-size:.85em;"
       "background:#f6f6f6;padding:.1em .3em;word-break:break-all}img{max-width:100%}.note{color:#555}"
       ".banner{background:#fff6dd;border:1px solid #e8d48a;padding:.5em}")


def render(models: list[dict], figs: dict[str, Path], provenance: dict[str, str],
           level: float = 0.95) -> tuple[str, str]:
    """(markdown, html) of the card."""
    e = html.escape
    tabs = tables(models, level)
    names = ", ".join(m["label"] for m in models)
    title = f"Position card: {names}"
    md = [f"# {title}", ""]
    ht = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{CSS}</style></head>"
          f"<body><h1>{e(title)}</h1>"]
    intro = ("Where each model's positional information can be seen, per layer, with intervals. Every number is read "
             "from a run directory of poslens's own analyses; the command under each panel re-measures it. The "
             "panels describe: a decomposition, a probe or a sink rate locates positional information but does not "
             "show what causes it; the length panel's interventions are the card's only ones (`poslens leakage "
             "--interventions` makes the residual stream's).")
    if len(models) > 1:
        intro += (" The models are shown side by side on the same text, each with its own intervals. Where two models "
                  "read the same token ids in the same groups (one tokenizer), the score, attention-term, probe and "
                  "loss panels also give the paired difference first model - other, with an interval from the same "
                  "groups (the jackknife of the difference; the probe: t over the same folds); where the token ids "
                  "differ, the panels are side by side only, and each panel says which.")
    md += [intro, ""]
    ht.append(f"<p>{e(intro)}</p>")
    for k, v in provenance.items():
        md.append(f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}")
    md.append("")
    ht.append("<ul>" + "".join(f"<li>{e(k)}: <code>{e(v)}</code></li>" if k == "command" else
                               f"<li>{e(k)}: {e(v)}</li>" for k, v in provenance.items()) + "</ul>")
    analysis_of = {"scheme": ("scores",), "scores": ("scores", "leakage"), "leakage": ("leakage",),
                   "sinks": ("leakage",), "probe": ("probe",), "length": ("length",)}
    for key, (head, what, limits) in PANELS.items():
        md += [f"## {head}", "", what, "", f"*{limits}*", ""]
        ht.append(f"<h2 id='{key}'>{e(head)}</h2><p>{e(what)}</p><p class='note'><i>{e(limits)}</i></p>")
        extra = []
        if key == "scheme":
            extra = [f"{m['label']}: {m['scheme']['label']}{rope_bases(m['scheme'])}" for m in models]
        if key == "sinks":
            extra = [f"{m['label']}: {sink_line(m)}" for m in models]
        if key in ("scores", "leakage", "length"):
            extra = [pair_line(models[0], m, key) for m in models[1:]]
        if key == "probe":
            extra = [f"{m['label']}: {m['probe_folds']} folds" for m in models]
            extra += [f"{models[0]['label']} - {m['label']}: " + (
                "paired over the same folds (the same token sequences), layers by index"
                if paired_probe(models[0], m, level) else "not paired (the two read different tokens)")
                for m in models[1:]]
        if key == "length":
            extra += [f"{m['label']}: L = {m['length']['train_len']} tokens, the card's length.train_len (evaluated "
                     f"at {', '.join(map(str, m['length']['eval_lens']))})" for m in models]
            extra += [f"{m['label']}: {line}" for m in models for line in length_effects(m)]
            extra += [f"{m['label']}: {note}" for m in models for note in m["length"]["notes"]]
        md += [f"- {x}" for x in extra] + ([""] if extra else [])
        if extra:
            ht.append("<ul>" + "".join(f"<li>{e(x)}</li>" for x in extra) + "</ul>")
        md += [_md_table(*tabs[key]), ""]
        ht.append(_html_table(*tabs[key]))
        if key in figs:
            md += [f"![{head}](figures/{figs[key].name})", ""]
            data = base64.b64encode(figs[key].read_bytes()).decode()
            ht.append(f"<figure><img src='data:image/png;base64,{data}' alt='{e(head)}'></figure>")
        commands = [f"{m['label']}: {m['commands'][a]}" for m in models for a in analysis_of[key]]
        md += ["Re-measure:", ""] + [f"    {c}" for c in commands] + [""]
        ht.append("<p class='note'>Re-measure:</p><ul>" + "".join(f"<li><code>{e(c)}</code></li>" for c in commands)
                  + "</ul>")
    ht.append("</body></html>")
    return "\n".join(md) + "\n", "\n".join(ht) + "\n"


def write_card(cfg, out: Path, runs: list, command: str | None = None,
               started: tuple[float, float] | None = None) -> Path:
    """Read the finished sub-runs and write OUT/card (card.md, card.html, figures/, run.json, tensors).
    started: (time.perf_counter(), CPU seconds) when the call began: run.json's timings then hold the whole call's."""
    import dataclasses

    import torch

    from poslens.io.results import write_run
    from poslens.io.rundir import run_directory

    page_started = time.perf_counter()
    labels = list(dict.fromkeys(r.label for r in runs))
    models = [read_model([r for r in runs if r.label == label]) for label in labels]
    provenance = {"command": command or "poslens card " + " ".join(cfg.models),
                  "sub-runs": f"{out}/MODEL/ANALYSIS (reused: "
                              f"{sum(r.reused for r in runs)} of {len(runs)}; the rest measured by this call)",
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    target = out / "card"
    if target.exists() and not (target / "poslens-manifest.json").is_file():
        raise UsageError(f"out: {target} exists and was not written by poslens card; move it away", param="out")
    with run_directory(target, force=True) as build:
        figs = figures(models, build / "figures") if _figures_ok(models) else {}
        md, page = render(models, figs, provenance, cfg.level)
        (build / "card.md").write_text(md)
        (build / "card.html").write_text(page)
        tensors = {f"{m['label']}/probe_r2": torch.tensor([r[0] for r in m["probe"]]) for m in models}
        write_run(build, tensors, {
            "kind": "card", "config": {**dataclasses.asdict(cfg), "sizes": cfg.size_table()},
            "runs": [{"model": r.model, "label": r.label, "analysis": r.analysis, "path": str(r.path),
                      "command": r.command, "reused": r.reused, "timing": r.timing()} for r in runs],
            "models": models, "timings": timings(page_started, started)})
    return target


def timings(page_started: float, started: tuple[float, float] | None) -> dict:
    """run.json's timings: the page's wall seconds, and the whole call's wall and CPU seconds when known (each
    sub-run's are in run.json's "runs")."""
    from poslens.analyses.card.run import cpu_seconds

    now = time.perf_counter()
    out = {"page_seconds": now - page_started}
    if started is not None:
        out |= {"seconds": now - started[0], "cpu_seconds": cpu_seconds() - started[1]}
    return out


def _figures_ok(models: list[dict]) -> bool:
    return all(m["scores"] and m["probe"] and m["length"]["bins"] for m in models)
