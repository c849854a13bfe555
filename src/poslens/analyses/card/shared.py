"""One hooked forward feeding several sub-runs of a card. The scores, leakage and probe sub-runs of a model read the
same sequences in the same batches, and the forward is most of each one's cost (BENCHMARKS.md, "Card"), so their
statistics ride on one pass; each sub-run is still written as the ordinary run directory of its own analysis.

`Shared` is an analysis of the pipeline made of parts (analysis, config, path) whose configs cut the same batches
(`same_batches`) and whose analyses have exactly one pass without a prepare or a context. It loads the model once,
cuts the first part's sequences, runs every part's statistics in one pass (each statistic keeps its own groups:
batch b in group b mod G) and finishes every part with its own `finish` on its own view of the job (its config, its
groups). The first part's run directory is the one `run_analysis` writes; the others are written after it with the
same record (data, model, groups rule, timings). Every one of them says in run.json's `shared_pass` which
directories were measured in the same pass. A part's numbers are those of its own command run alone: the same
forward over the same batches (tests/test_card.py checks it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from pathlib import Path
from typing import Any

from poslens.engine.config import groups_used
from poslens.engine.pipeline import Analysis, Job, Output, Pass, _groups_record, run_analysis
from poslens.errors import UsageError

# the fields of a run config that decide which token ids go into which batch, through which model
BATCH_FIELDS = ("model", "data", "text_field", "mode", "bos", "seq_len", "num_sequences", "batch_size", "dtype",
                "tokenizer", "seed", "pe", "device")


def same_batches(a: Any, b: Any) -> bool:
    """Whether two run configs push the same token ids in the same batches through the same model."""
    return all(getattr(a, f, None) == getattr(b, f, None) for f in BATCH_FIELDS)


class Shared(Analysis):
    """Several one-pass analyses on one model and the same batches, in one pass (module docstring)."""

    def __init__(self, parts: list[tuple[Analysis, Any, Path]]) -> None:
        if len(parts) < 2 or not all(same_batches(parts[0][1], cfg) for _, cfg, _ in parts[1:]):
            raise UsageError("a shared pass needs two or more runs of the same model on the same batches")
        self.parts = parts
        self.kind = parts[0][0].kind
        self.views: list[Job] = []
        self.outputs: list[Output] = []  # of the parts after the first, once finished

    def _view(self, job: Job, config: Any) -> Job:
        view = dataclasses.replace(job, config=config)
        if job.sequences is not None:
            n = len(job.sequences)
            view.groups = groups_used(config, n, sum(job.dist.batches(n, config.batch_size)))
        return view

    def configure(self, job: Job) -> None:
        for analysis, config, _ in self.parts:
            analysis.configure(self._view(job, config))

    def window(self, job: Job) -> int:
        return min(a.window(self._view(job, c)) for a, c, _ in self.parts)

    def check(self, job: Job) -> None:
        for analysis, config, _ in self.parts:
            analysis.check(self._view(job, config))

    def memory(self, job: Job) -> dict[str, tuple[float, str]]:
        return {f"{a.kind}: {k}": v for a, c, _ in self.parts for k, v in a.memory(self._view(job, c)).items()}

    def sequences(self, job: Job, documents):
        return self.parts[0][0].sequences(job, documents)

    def passes(self, job: Job) -> list[Pass]:
        self.views = [self._view(job, config) for _, config, _ in self.parts]
        self.own: list[Pass] = []
        for (analysis, _, _), view in zip(self.parts, self.views):
            passes = analysis.passes(view)
            if len(passes) != 1 or passes[0].prepare is not None or passes[0].context is not None:
                raise UsageError(f"{analysis.kind}: only an analysis of one plain pass can share it")
            self.own.append(passes[0])
        return [Pass(self.own[0].name, [s for p in self.own for s in p.statistics])]

    def finish(self, job: Job, passes: list[Pass]) -> Output:
        self.outputs = [a.finish(view, [own]) for (a, _, _), view, own
                        in zip(self.parts[1:], self.views[1:], self.own[1:])]
        first = self.parts[0][0].finish(self.views[0], [self.own[0]])
        first.meta["shared_pass"] = self.record()
        return first

    def figures(self, job: Job, output: Output, directory: Path) -> list[Path]:
        return self.parts[0][0].figures(self.views[0], output, directory)

    def record(self) -> dict:
        """run.json's `shared_pass` of every part."""
        return {"runs": [{"kind": a.kind, "path": str(p)} for a, _, p in self.parts],
                "note": "measured in one hooked forward per batch with the other runs listed (same model, same "
                        "batches); the numbers are those of each run's own command"}


def run_shared(parts: list[tuple[Analysis, Any, Path]], force: bool = False, progress: bool = True) -> list[Path]:
    """Run the parts in one pass (`Shared`) and write each one's run directory; returns their paths (rank 0)."""
    from poslens.io.results import load, write_run
    from poslens.io.rundir import run_directory

    shared = Shared(parts)
    first = run_analysis(shared, parts[0][1], parts[0][2], force=force, progress=progress)
    if first is None:  # not rank 0
        return []
    meta = load(first, tensors=False).meta
    for (analysis, config, path), view, output in zip(parts[1:], shared.views[1:], shared.outputs):
        batches = sum(view.dist.batches(len(view.sequences), config.batch_size))
        with run_directory(path, force=True) as build:
            figures = analysis.figures(view, output, build / "figures") if config.figures else []
            write_run(build, output.tensors, {
                "kind": analysis.kind, "config": asdict(config), "data": meta["data"],
                "groups": _groups_record(config, view.groups, batches), "world_size": meta["world_size"],
                "resumed_from_unit": meta["resumed_from_unit"], "model": meta["model"], "inputs": meta["inputs"],
                "metrics": output.metrics,
                **output.meta, "figures": [str(p.relative_to(build)) for p in figures], "timings": meta["timings"],
                "shared_pass": meta["shared_pass"]})
    return [Path(p) for _, _, p in parts]
