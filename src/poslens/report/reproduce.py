"""`poslens reproduce`: every result of the papers poslens reproduces, in one command, as a claim ledger.

It walks the section registry (`poslens.report.section.registry()`, the modules of `poslens/report/sections/`),
builds each section with its quick or full sizes, and writes report.html, report.md, figures, tensors and run.json
(configuration, provenance, timings, and every claim with its paper, verdict and tests). Finished work (Monte
Carlo settings, model sums, trained models' measurements) is kept in a sibling directory `.<out>.parts` until the
report is written, so an interrupted reproduce resumes; a finished report with the same settings is reported up to
date instead of being recomputed. Layers are numbered from 1 in everything a person reads.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from poslens.errors import UsageError, check_duration, check_int
from poslens.io.results import check_output, cpu_name, run_directory, source_revision, write_run
from poslens.report.claims import VERDICTS, ledgers
from poslens.report.context import Context
from poslens.report.render import headlines, on_models, write_report
from poslens.report.robustness import robustness_line
from poslens.report.section import SectionSpec, registry
from poslens.report.sweep import planned_sweeps, train_sweeps

TITLE = "poslens: reproduction report"


def cpu_with_workers() -> float:
    """CPU seconds of this process and of its finished worker processes (the sweep's training parts, the length runs
    side by side: `time.process_time` alone leaves them out, which made a section that trains look cheap)."""
    from poslens.engine import workers

    return workers.process_seconds() + workers.cpu_seconds()


def provenance(command: str | None, seed: int) -> dict[str, str]:
    """What the report header says about how it was made (inputs, total time and verdicts are added at the end)."""
    import transformers

    from poslens import __version__

    return {"command": command or "poslens.report.reproduce.reproduce(...)",
            "source": source_revision(),
            "versions": f"poslens {__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
                        f"numpy {np.__version__}, Python {platform.python_version()}",
            "seed": str(seed),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.node()}, {platform.machine()}, {cpu_name()} (torch's CPU kernels: "
                       f"{torch.backends.cpu.get_cpu_capability()}), {platform.platform(terse=True)}, "
                       f"{torch.get_num_threads()} torch threads"
                       + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "")}



def plan(quick: bool, models: bool, sizes: Mapping | None) -> list[tuple[SectionSpec, dict]]:
    """The sections to build and their sizes; unknown sections or sizes are refused before any work."""
    specs = registry()
    names = {s.name for s in specs}
    for name in sizes or {}:
        if name not in names:
            raise UsageError(f"sizes: no report section named {name!r}; sections: {', '.join(sorted(names))}")
        if not models and next(s for s in specs if s.name == name).models:
            raise UsageError(f"sizes: section {name} runs models and is skipped here (--no-models); drop its sizes "
                             "or run the models")
    return [(s, s.size(quick, (sizes or {}).get(s.name))) for s in specs if models or not s.models]


def sweep_tokens(sizes: Mapping | None) -> list[str]:
    """Token directories the sections' sweeps read (`sweep_train` "tokens=DIR+..."): inputs --out may not be."""
    from poslens.train.sweep import parse_fields

    found = []
    for size in (sizes or {}).values():
        train = size.get("sweep_train") if isinstance(size, Mapping) else None
        if isinstance(train, str) and parse_fields(train, "sweep_train").get("tokens"):
            found.append(parse_fields(train, "sweep_train")["tokens"])
    return found


def check_time(samples: int, steps: list[tuple[SectionSpec, dict]]) -> None:
    """Refuse, before any work, Monte Carlo sizes that would run for more than a week even at a generous rate
    (`poslens.errors.check_duration`): the run's samples per setting of the paper's stack, the convergence
    section's samples at its widest d, the leakage section's stack samples."""
    from poslens.analyses.leakage.command import StackLeakageOptions
    from poslens.stack.config import StackConfig

    check_duration(StackConfig().operations(samples), f"one Monte Carlo setting of {samples:,} samples", "lower "
                   "--samples")
    for spec, size in steps:
        if spec.name == "convergence":
            d = max(size["widths"])
            check_duration(StackConfig(n=24, layers=3, d=d).operations(size["samples"]), f"the convergence "
                           f"section's {size['samples']:,} samples at d = {d}", "lower convergence.samples")
        if spec.name == "leakage" and size.get("stack_samples"):
            o = StackLeakageOptions()
            check_duration(3 * StackConfig(n=o.n, d=o.d, layers=o.layers).operations(size["stack_samples"]),
                           f"the leakage section's {size['stack_samples']:,} stack samples", "lower "
                           "leakage.stack_samples")


def _config(quick: bool, samples: int, seed: int, models: bool, sizes: list, robustness: bool = False,
            pdf: bool = True) -> dict:
    from poslens import __version__

    return {"quick": quick, "samples": samples, "seed": seed, "models": models,
            "sizes": {s.name: size for s, size in sizes}, "poslens": __version__} | (
        {"robustness": True} if robustness else {}) | ({} if pdf else {"pdf": False})


def size_line(quick: bool, steps: list) -> str:
    """The run's size for the first screen: 'full', or the quick sizes against the full run's, and what a quick
    run's rows and maps are expected to show."""
    if not quick:
        return "full (the sizes of the paper where the budget allows; each section's sizes in run.json's config)"
    smaller = [f"{spec.name} {k} {v} (full {spec.full[k]})" for spec, size in steps for k, v in size.items()
               if k in spec.full and spec.full[k] != v and not isinstance(v, (dict, list, tuple))]
    return ("quick: smaller than the full run, so many rows are expected to read not resolved and several maps to "
            "be mostly sampling noise (each says so); `poslens reproduce` without --quick runs the full sizes. "
            "Sizes here (full run's in brackets): " + "; ".join(smaller))


def up_to_date(target: Path, config: dict) -> bool:
    """True when `target` holds a finished reproduce report made with the same settings and poslens version."""
    try:
        meta = json.loads((target / "run.json").read_text())
    except (OSError, ValueError):
        return False
    if meta.get("kind") != "reproduce" or not (target / "report.html").is_file():
        return False
    return meta.get("config") == json.loads(json.dumps(config))


def reproduce(out: str = "poslens-out", quick: bool = False, force: bool = False, models: bool = True,
              progress: bool = True, seed: int = 0, samples: int | None = None,
              sizes: Mapping[str, Mapping] | None = None, command: str | None = None,
              robustness: bool = False, pdf: bool = True) -> Path:
    """Build every registered section and write the report into `out`; returns its path.

    samples: Monte Carlo samples per setting (default 100,000; 10,000 with quick). sizes: per-section overrides of
    the quick/full sizes, e.g. {"real-model": {"sequences": 48}} (names and keys in each SectionSpec). command: the
    command line to print in the report header (`poslens reproduce` passes its own). When `out` already holds
    a report made with the same settings, nothing is recomputed (force=True recomputes); a report with other
    settings needs force or another `out`. Every argument is checked before any work. robustness: retrain the
    sweep's models with another CPU kernel set and give every row on them a robustness line
    (`poslens.report.robustness`); without it those lines say "not checked". pdf: False writes each figure's
    raster image alone, without its vector PDF (saving a figure takes 0.63-0.75 of its time, BENCHMARKS.md).
    """
    started, cpu0 = time.perf_counter(), cpu_with_workers()
    samples = (10_000 if quick else 100_000) if samples is None else samples
    check_int("samples", samples, 1)
    check_int("seed", seed, 0)
    steps = plan(quick, models, sizes)
    check_time(samples, steps)
    config = _config(quick, samples, seed, models, steps, robustness, pdf)
    target = Path(out).expanduser().absolute()
    if not force and up_to_date(target, config):
        print(f"report is up to date: {target / 'report.html'} (same settings; force=True / --force recomputes)")
        return target
    if not force and (target / "run.json").is_file():
        try:
            kind = json.loads((target / "run.json").read_text()).get("kind")
        except ValueError:
            kind = None
        if kind == "reproduce":
            raise UsageError(f"out: {target} holds a report made with other settings; pass --force to replace it "
                             "or choose another --out")
    inputs = sweep_tokens(sizes)
    target = check_output(out, force, inputs)
    parts = target.parent / f".{target.name}.parts"
    if models:  # the worker processes' server (the sweep's training parts, the length runs) imports beside the work
        from poslens.engine import workers

        workers.start()
    with run_directory(target, force, inputs) as tmp:
        parts.mkdir(exist_ok=True)
        ctx = Context(tmp, target, parts, samples, seed, quick, progress, pdf=pdf)
        sections, timings = [], {}
        t0, c0 = time.perf_counter(), cpu_with_workers()
        train_sweeps(ctx, planned_sweeps(steps))  # every section's trained models as one set, before any reads them
        trained = {"seconds": time.perf_counter() - t0, "cpu_seconds": cpu_with_workers() - c0}
        for k, (spec, size) in enumerate(steps, 1):
            if progress:
                print(f"[{k}/{len(steps)}] {spec.title} (started at {time.perf_counter() - started:.0f} s)", flush=True)
            t0, c0 = time.perf_counter(), cpu_with_workers()
            sec = spec.build(ctx, size)
            sec.name, sec.models = spec.name, spec.models
            for c in sec.claims:  # a row without a stock command is re-measured by its section
                c.command = c.command or ctx.remeasure(c.id)
            sections.append(sec)
            timings[spec.name] = {"seconds": time.perf_counter() - t0, "cpu_seconds": cpu_with_workers() - c0}
            if progress:
                print(f"[{k}/{len(steps)}] {spec.title}: done in {timings[spec.name]['seconds']:.0f} s", flush=True)
        if robustness:
            from poslens.report.robustness import check

            check(steps, sections, lambda: Context(parts / "robustness" / "root", target, parts / "robustness",
                                                   samples, seed, quick, progress, draw=False), progress)
        claims = [c for s in sections for c in s.claims]
        ids = [c.id for c in claims]
        if len(ids) != len(set(ids)):
            raise RuntimeError(f"claim ids must be unique: {sorted({i for i in ids if ids.count(i) > 1})}")
        total, cpu = time.perf_counter() - started, cpu_with_workers() - cpu0
        prov = provenance(command, seed)
        cached = [n for n, i in ctx.inputs.items() if "from the cache" in i["how"] or "converted once" in i["how"]]
        prov["total time"] = f"{total:.0f} s wall, {cpu:.0f} s CPU" + (
            f" (not included: the training or conversion of the inputs read from the cache: {', '.join(cached)})"
            if cached else "")
        prov["size"] = size_line(quick, steps)
        prov["inputs"] = "\n".join(f"{name}: {i['how']}, {i['path']}" + (
            f", sha256 {i['sha256']}" + (" (of the directory's files, in sorted order)" if Path(i["path"]).is_dir()
                                         else "") if i["sha256"] else "")
                                   for name, i in ctx.inputs.items())
        intro = (f"Every claim of Kim et al. (2025), 'Behind RoPE: How Does Causal Mask Encode Positional "
                 f"Information?', of Ruscio, Nanni & Silvestri (2026), 'Where does Absolute Position come from in "
                 f"decoder-only Transformers?', and of the papers they build on that poslens can test, re-measured"
                 f"{' with quick settings' if quick else ''} ({samples:,} Monte Carlo samples per setting). Each "
                 "verdict follows one written rule from the tests shown with it (statistic, threshold, direction): "
                 "holds, contradicted, ambiguous (the paper's wording admits readings the measurement decides "
                 "differently), erratum (a printed formula is wrong, the conclusion stands), not resolved (an "
                 "interval straddles the threshold or its statistic is undefined on these models; the row says what "
                 "would resolve it), finding (a measured fact the paper did not state). A claim about a larger scale "
                 "than the one measured (its row's scope) can be neither contradicted nor confirmed by a smaller "
                 "model: its rows read holds at this scale or fails at this scale, counted apart, meaning only "
                 "that the pattern is, or is not, seen at this scale. Each ledger counts the rows decided on exact or "
                 "simulated quantities apart from the rows on trained models. Layers are numbered from 1, and so "
                 "are positions in maps and figures; where a row says 'position 0' or 'key 0' (the section on "
                 "Ruscio, Nanni & Silvestri), it keeps that paper's numbering: position 0 is the first token.")
        write_report(tmp, TITLE, intro, sections, prov)
        led = ledgers(claims, on_models(sections))
        write_run(tmp, ctx.tensors, {
            "kind": "reproduce", "config": config, "provenance": prov, "inputs": ctx.inputs,
            "metrics": {"claims": [c.to_json(s.title) | {"section_name": s.name, "robustness": robustness_line(c)}
                                   for s in sections for c in s.claims],
                        "ledgers": {k: v.counts for k, v in led.items()},
                        "ledgers_by_basis": {k: v.by_basis for k, v in led.items()}, "verdicts_known": list(VERDICTS),
                        "context": {s.name: [{"what": a, "measured": b} for a, b in s.context] for s in sections}},
            "timings": {"seconds": total, "cpu_seconds": cpu, "sweeps": trained, "sections": timings}})
    shutil.rmtree(parts, ignore_errors=True)
    took = time.perf_counter() - started
    print("\n".join(headlines(sections)) + f"\nreport: {target / 'report.html'} ({took:.0f} s)")
    return target
