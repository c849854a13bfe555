"""One driver for every analysis of a real model: a config in, one run directory out.

    path = run_analysis(MyAnalysis(), MyConfig(model="smollm2-135m"), "runs/mine")

`run_analysis`, step by step:

 1. validate the config: every bound and choice, the groups rule (`poslens.engine.config`); nothing is loaded
 2. join torchrun's process group, if any (`poslens.engine.distributed`)
 3. take --out's lock for the whole job (rank 0; the other ranks learn the outcome), refusing an --out that is
    one of the run's inputs (model directory, --data, tokenizer)
 4. load the model; the analysis settles what depends on it (`configure`); the memory estimate of the batch and
    of the analysis's sums (a UsageError with the estimate when it does not fit); the model's window (the
    analysis's `window`); the analysis's own checks
 5. cut the sequences (the analysis's `sequences`); the groups rule again with the true number of batches;
    this rank's shard
 6. the analysis's passes of statistics (`poslens.engine.runner.run_passes`): one hooked forward per pass and
    batch, checkpointed in --out's work directory every `checkpoint_every` units, resumed bit-identically
 7. sums all-reduced and per-sequence rows gathered over ranks
 8. rank 0: the analysis finishes (tensors, metrics), draws its figures, and the run directory is written with
    the full config, the data, the groups, one model record and the versions

An analysis (subclass `Analysis`) says what is specific to it: `configure`, `window`, `check`, `memory`,
`sequences`, `passes`, `finish`, `figures`.
The driver owns everything else, so every analysis gets the same guarantees (lock, resume, shards, intervals).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from poslens.engine.config import DEFAULT_SEQUENCES, ModelData, groups_used
from poslens.engine.distributed import Dist, setup
from poslens.engine.runner import Pass, run_passes, unique
from poslens.errors import UsageError, available_memory, gib
from poslens.options import option_fields

__all__ = ["Analysis", "Job", "Output", "Pass", "checkpoint_path", "documents", "inputs_of", "report_lines",
           "run_analysis"]


@dataclass
class Job:
    """What an analysis sees of the run in progress."""

    config: ModelData
    dist: Dist
    out: Path  # where the run directory goes
    model: Any = None
    tokenizer: Any = None
    hm: Any = None  # the model's HookedModel
    sequences: torch.Tensor | None = None  # every sequence of the run [N, seq_len] (each rank holds them all)
    data: dict = field(default_factory=dict)  # how the sequences were cut (make_sequences' stats, the source)
    groups: int = 0  # groups of sequences kept (the groups rule)
    inputs: dict = field(default_factory=dict)  # other per-sequence tensors cut with the sequences (rows aligned)
    started: float = field(default_factory=time.perf_counter)

    def batch_rows(self, index: int) -> slice:
        """The rows of `sequences` (and of each `inputs` tensor) in batch `index` of the run: the run-wide batch
        index a Pass's `prepare` gets, the same under torchrun as in one process."""
        n, size = len(self.sequences), self.config.batch_size
        if not 0 <= index < sum(self.dist.batches(n, size)):
            raise IndexError("batch index past the run's batches")
        return slice(index * size, min((index + 1) * size, n))  # ranks take whole batches (`Dist.batches`)

    @property
    def label(self) -> str:
        """The model's name for figure titles: a local directory's last part, "(RoPE removed)" when loaded so."""
        from poslens.engine.models import load_info

        spec = self.config.model
        name = Path(spec).name if Path(spec).expanduser().is_dir() else spec
        return name + (" (RoPE removed)" if load_info(self.model).get("pe") == "none" else "")


@dataclass
class Output:
    """What an analysis finishes with: tensors to save, metrics for run.json, other run.json fields."""

    tensors: dict[str, torch.Tensor]
    metrics: dict
    meta: dict = field(default_factory=dict)


class Analysis:
    """What an analysis adds to the driver. `kind` names it in run.json; override what applies."""

    kind = "analysis"

    def configure(self, job: Job) -> None:
        """Settle config fields that depend on the loaded model (a length read from its config), before the sizes
        are checked; they are then recorded in run.json and the checkpoint's fingerprint as settled."""

    def window(self, job: Job) -> int:
        """The longest seq_len the analysis runs the model at (default: its max_position_embeddings). An analysis
        that evaluates past it (positions computed on the fly) says so and makes its own checks in `configure`."""
        from poslens.engine.models import max_positions

        return max_positions(job.model)

    def check(self, job: Job) -> None:
        """Checks that need the loaded model (a layer index in range, a BOS token), before any sequence is cut."""

    def sequences(self, job: Job, documents: Iterator[str]) -> tuple[torch.Tensor, dict]:
        """Every sequence of the run [N, seq_len] and how they were cut (`make_sequences`' stats); an analysis
        that needs more per sequence (windows inside the same documents) cuts it here and keeps it in
        `job.inputs`, rows aligned with the sequences."""
        from poslens.engine.data import make_sequences

        config = job.config
        return make_sequences(job.tokenizer, documents, config.seq_len, config.num_sequences or DEFAULT_SEQUENCES,
                              mode=config.mode, bos=config.bos,
                              minimum=1 if config.num_sequences is None else None)

    def memory(self, job: Job) -> dict[str, tuple[float, str]]:
        """Bytes the analysis holds besides the model's forward: part -> (bytes, what lowers it)."""
        return {}

    def passes(self, job: Job) -> list[Pass]:
        """The passes of statistics over the batches (`poslens.engine.runner.Pass`)."""
        raise NotImplementedError

    def finish(self, job: Job, passes: list[Pass]) -> Output:
        """Tensors and metrics from the combined statistics (rank 0, after all ranks are reduced)."""
        raise NotImplementedError

    def figures(self, job: Job, output: Output, directory: Path) -> list[Path]:
        """Figures of the finished run, written into `directory` (through poslens.plotting)."""
        return []


# ---------------------------------------------------------------- inputs and outputs


def check_window(seq_len: int, window: int) -> None:
    """Refuse, in one line, sequences longer than the model's window (`Analysis.window`)."""
    if seq_len > window:
        raise UsageError(f"seq_len {seq_len} is beyond the model's window of {window} positions; use "
                         f"seq_len <= {window}", param="seq_len")


def inputs_of(config: ModelData) -> list[str]:
    """The files and directories a run reads (never its --out): a local model, its tokenizer, --data."""
    from poslens.engine.models import resolve, tokenizer_directory

    alone = None if config.tokenizer is None else tokenizer_directory(config.tokenizer)  # tokenizer files alone
    found = [] if alone is None else [str(alone)]
    for spec in (config.model, None if alone else config.tokenizer, *config.more_models()):
        if spec is not None:
            ms = resolve(spec)
            given = Path(str(spec).removeprefix("random:").strip()).expanduser()
            if ms.kind == "random" and given.suffix == ".json" and given.is_file():
                found.append(str(given))  # a config file: the file, not the folder it sits in
            elif ms.kind in ("local", "gguf", "random") and ms.path:
                found.append(ms.path)
    if config.data is not None:
        found.append(config.data)
    return found


def input_stamps(config: ModelData, model: Any = None) -> dict[str, str]:
    """A digest per input a run reads (`inputs_of`: a local model, its tokenizer, seed models, --data) of every file
    under it: its path, size and modification time, so that a changed input tells a resumed or reused run apart
    from the one it would continue (a checkpoint, a card's sub-run); and a hub model's commit (`model`'s config)."""
    import hashlib

    out = {}
    for given in inputs_of(config):
        root = Path(given)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
        h = hashlib.sha256()
        for f in files:
            st = f.stat()
            h.update(f"{f.relative_to(root) if f != root else f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        out[str(root.resolve())] = h.hexdigest()
    commit = getattr(getattr(model, "config", None), "_commit_hash", None)
    if commit:
        out[str(config.model)] = str(commit)
    return out


@contextlib.contextmanager
def _output(config: ModelData, out: str | Path, force: bool, dist: Dist) -> Iterator[Any]:
    """--out's run directory, locked for the whole job by rank 0 (yielded there; None elsewhere). A refusal on
    rank 0 is raised on every rank."""
    from poslens.io.rundir import open_run

    with contextlib.ExitStack() as stack:
        yield dist.first(lambda: stack.enter_context(open_run(out, force, inputs=inputs_of(config))))


def checkpoint_path(out: str | Path, rank: int = 0, world: int = 1) -> Path:
    """Where rank `rank` of `world` keeps the partial state of a run of `out`: in --out's work directory
    (`poslens.io.rundir`), kept when the run stops, removed when it is placed."""
    from poslens.io.rundir import WORK_SUFFIX

    out = Path(os.path.abspath(os.path.expanduser(out)))
    return out.parent / f".{out.name}{WORK_SUFFIX}" / f"pipeline-{rank}-of-{world}.safetensors"


def documents(data: str | None, text_field: str = "text") -> tuple[Iterator[str], str]:
    """(documents, source label) of `data` (poslens.engine.data), or of the embedded corpus when None; a source
    without a single document is refused here, before the model loads."""
    from poslens.engine.data import iter_documents, source_label

    if data is None:
        from poslens.engine import corpus

        return corpus.documents(), corpus.label()
    docs = iter_documents(data, text_field)
    first = next(docs, None)
    if first is None:
        raise UsageError(f"data {data}: no documents found", param="data")
    return itertools.chain([first], docs), source_label(data)


# ---------------------------------------------------------------- sizes


def _batch_bytes(config: ModelData, model) -> float:
    """Memory of one batch's forward: the residual stream, attention and MLP activations of one layer held at
    once, in the model's dtype, plus float32 query/key copies for the readers (an upper estimate)."""
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    d = c.hidden_size
    ffn = getattr(c, "intermediate_size", 4 * d) or 4 * d
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or d // heads
    rows = min(config.batch_size, config.num_sequences or DEFAULT_SEQUENCES) * config.seq_len
    elem = next(model.parameters()).element_size()
    return rows * (elem * (8 * d + 3 * ffn) + 4 * 3 * heads * head_dim)


def dense_score_bytes(config: ModelData, model, copies: int = 6) -> float:
    """Memory of a reader of the dense [B, H, T, T] scores of one layer in float32 (`copies` tensors of that
    size at once: scores, mask, probabilities, ...)."""
    rows = min(config.batch_size, config.num_sequences or DEFAULT_SEQUENCES)
    return copies * rows * model.config.num_attention_heads * config.seq_len ** 2 * 4


def _least(name: str, config: Any) -> float:
    """The lower bound the config's option `name` declares."""
    return next(opt.lo for f, opt, _ in option_fields(type(config)) if f.name == name)


def check_memory(config: ModelData, parts: dict[str, tuple[float, str]], device: torch.device) -> None:
    """Refuse, before any work, a run whose parts (name -> (bytes, the parameter that lowers it)) do not fit in the
    memory free on `device`; the message gives the estimate part by part and names the largest part's parameter."""
    total = sum(b for b, _ in parts.values())
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
    if free is None or total <= free:
        return
    ranked = sorted(parts.items(), key=lambda kv: -kv[1][0])
    param = ranked[0][1][1]
    if param == "groups" and config.groups <= _least("groups", config):  # at its least: the maps' size is T^2
        param = "seq_len"
    listed = ", ".join(f"{name} {gib(b)}" for name, (b, _) in ranked if b >= 2**20)
    raise UsageError(f"{param} {getattr(config, param)}: the run would need about {gib(total)} of memory ({listed}) "
                     f"but {gib(free)} is free on {device}; lower {param}", param=param)


# ---------------------------------------------------------------- the driver


def run_analysis(analysis: Analysis, config: ModelData, out: str | Path, *, force: bool = False,
                 progress: bool = True) -> Path | None:
    """Run `analysis` on `config` into the run directory `out` (the steps in the module docstring); returns its
    path on rank 0, None on the other ranks."""
    from poslens.engine.hooks import HookedModel
    from poslens.engine.models import load_model, model_record
    from poslens.io.bars import library_bars
    from poslens.io.results import write_run

    config.validate()
    dist = setup(config.device)
    with _output(config, out, force, dist) as run:
        target = Path(dist.broadcast(None if run is None else str(run.path)))
        job = Job(config, dist, target)
        docs, source = documents(config.data, config.text_field)
        with library_bars(False):  # no "Loading weights" bar; the libraries' switch restored after the load
            job.model, job.tokenizer = load_model(config.model, dtype=config.dtype, device=str(dist.device),
                                                  tokenizer=config.tokenizer, seed=config.seed, pe=config.pe)
        job.hm = HookedModel(job.model)
        analysis.configure(job)
        check_window(config.seq_len, analysis.window(job))  # before the sizes: past the window, no size would do
        check_memory(config, {"one batch's forward": (_batch_bytes(config, job.model), "batch_size"),
                              **analysis.memory(job)}, dist.device)
        analysis.check(job)
        job.sequences, job.data = analysis.sequences(job, docs)
        job.data["source"] = source
        job.data["tokens_sha256"] = tokens_digest(job.sequences)  # two runs on the same token ids pair by group
        mine = dist.shard(job.sequences, config.batch_size)
        batches = list(torch.split(mine, config.batch_size))
        everyone = dist.batches(len(job.sequences), config.batch_size)
        job.groups = groups_used(config, len(job.sequences), sum(everyone))
        passes = analysis.passes(job)
        inputs = input_stamps(config, job.model)
        # a resumed run reads what the interrupted one read: the options, the token ids, the inputs' files
        done = run_passes(job.hm, passes, batches, first_batch=sum(everyone[:dist.rank]),
                          checkpoint=checkpoint_path(target, dist.rank, dist.world),
                          fingerprint={**config.fingerprint_fields(), "world": dist.world, "rank": dist.rank,
                                       "tokens_sha256": job.data["tokens_sha256"], "inputs": inputs},
                          checkpoint_every=config.checkpoint_every,
                          progress=analysis.kind if progress and dist.main else None, replace=force)
        computed = time.perf_counter() - job.started
        for s in unique(s for p in passes for s in p.statistics):
            s.all_reduce()
        if run is None:
            return None
        if progress and dist.main:  # the statistics (intervals over the groups) can take minutes on long maps
            print(f"{analysis.kind}: statistics and intervals over {job.groups} groups...", file=sys.stderr, flush=True)
        output = analysis.finish(job, passes)
        if progress and dist.main:
            print(f"{analysis.kind}: statistics done in {time.perf_counter() - job.started - computed:.0f} s",
                  file=sys.stderr, flush=True)
        figures = analysis.figures(job, output, run.build / "figures") if config.figures else []
        write_run(run.build, output.tensors, {
            "kind": analysis.kind, "config": asdict(config), "data": job.data,
            "groups": _groups_record(config, job.groups, sum(everyone)), "world_size": dist.world,
            "resumed_from_unit": done, "model": model_record(job.model), "inputs": inputs,
            "metrics": output.metrics, **output.meta,
            "figures": [str(p.relative_to(run.build)) for p in figures],
            "timings": {"compute_seconds": computed, "seconds": time.perf_counter() - job.started}})
    return target


def tokens_digest(ids: torch.Tensor) -> str:
    """SHA-256 of token ids [N, T] as little-endian int64, row by row: equal in two runs that read the same ids."""
    import hashlib

    return hashlib.sha256(ids.to(torch.int64).cpu().contiguous().numpy().astype("<i8").tobytes()).hexdigest()


def report_lines(path: str | Path, summary: Callable[[dict], list[str]] | None = None) -> list[str]:
    """What a command prints after a run: its `summary(run.json)` lines, the groups note when the groups were
    lowered, and "wrote PATH"."""
    from poslens.io.results import load

    meta = load(path, tensors=False).meta
    note = (meta.get("groups") or {}).get("note") if isinstance(meta.get("groups"), dict) else None
    return [*(summary(meta) if summary else []), *([note] if note else []), f"wrote {path}"]


def _groups_record(config: ModelData, used: int, batches: int) -> dict:
    """run.json's "groups": asked, used, and why they differ (the groups rule of poslens.engine.config)."""
    record = {"asked": config.groups, "used": used, "batches": batches}
    if used < config.groups:
        record["note"] = (f"groups lowered from {config.groups} to {used}: the run has {batches} batches and a group "
                          "is one batch or more")
    return record
