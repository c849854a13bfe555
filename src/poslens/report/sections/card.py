"""Beyond the papers: the position card (`poslens card`, docs/card.md) of the embedded SmolLM2-135M, and of
Gemma-3-270M when it is installed, read from the card's own run directories.

The section measures nothing itself: it runs `poslens.analyses.card.run.run_card` at the section's sizes into the
report's parts (kept by its configuration, so an interrupted reproduce resumes), copies the card's directory into
the report (models/card), rewrites the card's page there with commands that write into `runs/card` (as the other
sections' commands do), and shows each panel's table, read from the card's run.json, beside the command that
re-measures it. The card describes; it judges nothing, so the section has no rows, only context and a figure.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np

from poslens.errors import UsageError
from poslens.report.context import with_cache
from poslens.report.section import Section, section
from poslens.report.sections.figures import interval_errors, lines
from poslens.report.sections.leakage import GEMMA, INSTALL_GEMMA, gemma_installed

MODEL = "smollm2-135m"
RUNS = Path("runs/card")  # where the commands the report prints write the card (relative, as the other sections')
PAGE = Path("models/card/card/card.html")  # the card's page inside the report
# the panels the context shows, and the sub-runs whose commands re-measure them (the card's own pairing)
ANALYSIS_OF = {"scheme": ("scores",), "scores": ("scores", "leakage"), "leakage": ("leakage",), "sinks": ("leakage",),
               "probe": ("probe",), "length": ("length",)}

# The card's sizes (docs/card.md, "Sizes"): scores, leakage and the probe read the same `sequences` of `seq_len`
# tokens in `groups` (one shared forward per batch); the length panel evaluates at L = `length_train_len` and twice
# that. The full run is the card's own defaults but for the probe's groups, 8 as the scores' and leakage's
# (SmolLM2-135M: about 2 minutes on 2 cores, BENCHMARKS.md "Card"); gemma: add Gemma-3-270M to the same card (the
# full run does when it is installed). The quick run halves the
# scores, leakage and probe panels and cuts the length panel hardest (its seven interventions at two lengths were
# most of a quick card's time: 137 of 194 CPU-s with 8 length sequences; 53 of 133 CPU-s with these sizes, both
# under a load of 3-5 on 2 cores).
SIZES_QUICK = {"seq_len": 64, "sequences": 16, "batch": 4, "groups": 4, "early_queries": 16, "length_train_len": 32,
               "length_sequences": 4, "length_batch": 1, "length_groups": 4, "gemma": False}
SIZES_FULL = {"seq_len": 128, "sequences": 32, "batch": 4, "groups": 8, "early_queries": 32, "length_train_len": 64,
              "length_sequences": 12, "length_batch": 2, "length_groups": 6, "gemma": gemma_installed()}


def card_config(size: dict):
    """The CardConfig of the section's sizes: the card's --sizes list holds only what differs from its defaults."""
    from poslens.analyses.card.run import SIZES, CardConfig

    want = {a: {"seq_len": size["seq_len"], "num_sequences": size["sequences"], "batch_size": size["batch"],
                "groups": size["groups"]} for a in ("scores", "leakage", "probe")}
    want["leakage"]["early_queries"] = size["early_queries"]
    want["length"] = {"train_len": size["length_train_len"], "num_sequences": size["length_sequences"],
                      "batch_size": size["length_batch"], "groups": size["length_groups"]}
    sizes = [f"{a}.{k}={v}" for a, kv in want.items() for k, v in kv.items() if SIZES[a][k] != v]
    return CardConfig(models=[MODEL, *([GEMMA] if size["gemma"] else [])], sizes=sizes or None)


def run_card_into(ctx, cfg) -> Path:
    """The card of `cfg`, measured once into the report's parts and copied into the report; its page rewritten there
    with commands into `RUNS`. Returns the card's directory in the report (models/card/card)."""
    from poslens.analyses.card.page import write_card
    from poslens.analyses.card.run import command_line, plan, recorded, run_card
    from poslens.io.checkpoint import fingerprint

    command = command_line("card", cfg, RUNS)
    key = fingerprint(dataclasses.asdict(cfg))[:8]
    cached = Path(ctx.parts) / f"card-{key}"
    if recorded(cached / "card") is None:  # an interrupted card resumes: its finished sub-runs are reused
        run_card(cfg, cached, progress=ctx.progress, command=command)
    dest = Path(ctx.root) / "models" / "card"
    shutil.copytree(cached, dest)
    runs = plan(cfg, dest)
    for sub, printed in zip(runs, plan(cfg, RUNS)):
        sub.command, sub.reused = printed.command, True  # each sub-run's own run.json keeps the time it took
    return write_card(cfg, dest, runs, command=command)


def panel_context(models: list[dict], commands: dict[str, dict[str, str]], level: float) -> list[tuple[str, str]]:
    """(what, measured) per panel and model: the card's own table of the panel (`page.tables`), its extra lines,
    and, in `what`, the command that re-measures it (with the cache this run read its models from)."""
    from poslens.analyses.card.page import PANELS, length_effects, sink_line, tables

    tabs = tables(models, level)
    out = []
    for key, (head, _, _) in PANELS.items():
        header, rows = tabs[key]
        cells = ["; ".join(f"{first}: " + ", ".join(f"{h} {c}" for h, c in zip(header[1:], row))
                           for first, row in runs_of(rows))]
        if key == "sinks":
            cells = [f"{m['label']}: {sink_line(m)}" for m in models] + cells
        if key == "length":
            cells += [f"{m['label']}: {line}" for m in models for line in length_effects(m)]
        redo = "; ".join(f"`{with_cache(commands[m['label']][a])}`" for m in models for a in ANALYSIS_OF[key])
        out.append((f"{head}, {', '.join(m['label'] for m in models)} (re-measure: {redo})", "; ".join(cells)))
    return out


def runs_of(rows: list[list[str]]) -> list[tuple[str, list[str]]]:
    """A table's rows with consecutive rows of equal cells joined: ('1-30', cells) for thirty layers alike."""
    out: list[tuple[str, list[str]]] = []
    start = None
    for k, row in enumerate(rows):
        if start is None:
            start = k
        if k + 1 == len(rows) or rows[k + 1][1:] != row[1:]:
            first = rows[start][0] if start == k else f"{rows[start][0]}-{row[0]}"
            out.append((first, row[1:]))
            start = None
    return out


@section("card", "the position card of the embedded models", models=True, quick=SIZES_QUICK, full=SIZES_FULL)
def build(ctx, size: dict) -> Section:
    from poslens.analyses.card.run import command_line, recorded

    if size["gemma"] and not gemma_installed():
        raise UsageError(f"sizes: card.gemma=true needs Gemma-3-270M, which is not installed: {INSTALL_GEMMA}")
    cfg = card_config(size)
    card = run_card_into(ctx, cfg)
    meta = recorded(card)
    models = meta["models"]
    commands = {m["label"]: m["commands"] for m in models}
    command = with_cache(command_line("card", cfg, RUNS))
    context = panel_context(models, commands, cfg.level)
    if not size["gemma"]:
        context.append(("Gemma-3-270M's card beside SmolLM2-135M's", "not run: " + (
            "the quick run leaves it out (the full run adds it when it is installed)" if ctx.quick else
            f"not installed; {INSTALL_GEMMA}, then reproduce again")))
    names = " and ".join("SmolLM2-135M" if m == MODEL else "Gemma-3-270M" for m in cfg.models)
    s = Section(
        f"Beyond the papers: the position card of {names}",
        f"Where {names} {'get their' if size['gemma'] else 'gets its'} positional information, per layer and with "
        f"{100 * cfg.level:g}% intervals, from "
        "one `poslens card` call (docs/card.md): the positional scheme of each layer; Kim et al.'s non-relative score "
        "pattern (\"Behind RoPE: How Does Causal Mask Encode Positional Information?\", Section 5.2) and the share of "
        "it that one offset per query explains (which no softmax sees); the absolute-position terms of the attention "
        "of Ruscio, Nanni & Silvestri (\"Where does Absolute Position come from in decoder-only Transformers?\"), key "
        "0 in and out; sinks and sink-reading heads; a linear probe of absolute position from the residual stream "
        "(held-out R^2); the held-out loss by position past a length L with the scheme's length interventions. The "
        f"card describes and judges nothing, so it has no rows: each panel is below as context with the command "
        f"that re-measures it, and the card's own page, with its figures and what each panel can and cannot show, is "
        f"[{PAGE.as_posix()}]({PAGE.as_posix()}) (its run directories beside it). "
        f"Sizes: {size['sequences']} sequences of {size['seq_len']} tokens of the embedded text in {size['groups']} "
        f"groups for the scores, leakage and probe panels; the length panel at L = {size['length_train_len']} and "
        f"{2 * size['length_train_len']} tokens over {size['length_sequences']} sequences "
        f"(`poslens reproduce --sizes card.KEY=VALUE`). The card: `{command}`.",
        context=context)
    s.figures.append(probe_figure(ctx, models, cfg.level))
    return s


def probe_figure(ctx, models: list[dict], level: float):
    """The probe panel: held-out R^2 of absolute position per hidden state, each model a line with its interval."""
    series, errors = {}, {}
    depth = max(len(m["probe"]) for m in models)
    for m in models:  # a shallower model's line ends at its last layer (NaN past it draws nothing)
        v, lo, hi = (np.array([r[k] for r in m["probe"]] + [np.nan] * (depth - len(m["probe"])), dtype=float)
                     for k in range(3))
        series[m["label"]], errors[m["label"]] = v, interval_errors(v, lo, hi)
    names = ", ".join(m["label"] for m in models)
    return lines(
        ctx, "card_probe", np.arange(depth), series,
        f"The position card ({names}): held-out R^2 of a ridge probe of absolute position from each hidden state "
        f"(0 = the embeddings, l = after layer l), each group of sequences scored by a probe fitted on the others, "
        f"with {100 * level:g}% t-intervals over the folds; 0 is predicting the mean position (docs/card.md).",
        "hidden state", "held-out R^2", "The position card: absolute position in the residual stream",
        errors=errors, hline=0.0)
