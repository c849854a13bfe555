"""Drive statistics over batches: one hooked forward per pass and batch, resumable, shardable with torchrun.

    stats = [ActivationNorm(groups=20), MyStatistic(groups=20)]
    run_statistics(model, stats, batches, checkpoint="run/.partial.safetensors", progress="norms")
    for s in stats:
        s.result()

A `Pass` is a name, the statistics it feeds and, optionally, `prepare(input_ids, index)` -> (input_ids, write
hooks, position_ids) or (input_ids, write hooks, position_ids, attention_mask) (an intervention: the batch changed
before the forward, or hooks that replace a value, or moved positions, or an explicit mask for the forward, e.g. a
window; the statistics still see the batch's own padding mask) and `context()`, entered around the pass's forwards
(an ablation such as `ablations.no_rope`).
`run_passes` runs every pass over every batch, pass by pass; one batch through one pass is a unit of work.

Every statistic's hooks are merged into one `HookedModel.run` per unit (writes first, so readers see the result;
the forward stops after the deepest point read). Batch b of the run goes to group `first_batch + b` (mod each
statistic's groups); under torchrun give each rank its shard and the run-wide index of its first batch, and
all-reduce afterwards. With `checkpoint`, the state of every statistic is saved atomically every
`checkpoint_every` units (None: by time, at most a tenth of the run: `poslens.io.checkpoint.Cadence`) together with
a fingerprint of `fingerprint`, and a rerun resumes from it to the same numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from poslens.engine.stats import Statistic
from poslens.errors import UsageError, check_int
from poslens.io.checkpoint import Cadence, load_partial

Prepared = tuple  # (input_ids, write hooks, position_ids[, attention mask for the forward])


@dataclass
class Pass:
    """One forward per batch feeding `statistics`; see the module docstring for `prepare` and `context`."""

    name: str
    statistics: list[Statistic]
    prepare: Callable[[torch.Tensor, int], Prepared] | None = None
    context: Callable[[], contextlib.AbstractContextManager] | None = None
    meta: dict = field(default_factory=dict)  # anything the analysis wants back when it finishes


def merged_hooks(hm, statistics: Sequence[Statistic], writes: dict | None = None) -> dict[str, list]:
    """Point -> hooks: `writes` first (they replace values), then every statistic's readers in order."""
    hooks: dict[str, list] = {}
    for group in [writes or {}] + [s.hooks(hm) for s in statistics]:
        for name, fn in group.items():
            hooks.setdefault(name, []).extend(fn if isinstance(fn, (list, tuple)) else [fn])
    return hooks


def unique(statistics) -> list[Statistic]:
    """Each statistic once (a statistic may be fed by several passes), in first-seen order."""
    seen: dict[int, Statistic] = {}
    for s in statistics:
        seen.setdefault(id(s), s)
    return list(seen.values())


def run_passes(model, passes: Sequence[Pass], batches: Sequence, *, first_batch: int = 0,
               checkpoint: str | Path | None = None, fingerprint: dict | None = None,
               checkpoint_every: int | None = None, progress: str | None = None, replace: bool = False) -> int:
    """Run every pass over `batches` (token-id tensors [B, T], or (input_ids, attention_mask) pairs) through
    `model` (a HookedModel or a supported causal LM); returns how many units were done before (resumed). A
    checkpoint of another `fingerprint` is refused, or with `replace` discarded."""
    from poslens.engine.hooks import HookedModel  # transformers: imported when a run starts, not with a config

    hm = model if isinstance(model, HookedModel) else HookedModel(model)
    if checkpoint_every is not None:
        check_int("checkpoint_every", checkpoint_every, 1)
    check_int("first_batch", first_batch, 0)
    config = {"passes": [[p.name, [type(s).__name__ for s in p.statistics]] for p in passes], **(fingerprint or {})}
    stats = unique(s for p in passes for s in p.statistics)
    done = 0
    if checkpoint is not None and (resumed := load_partial(checkpoint, config, replace)) is not None:
        state, done = resumed
        for i, s in enumerate(stats):
            s.load_state_dict({k.split("/", 1)[1]: v for k, v in state.items() if k.startswith(f"{i}/")})
    units = [(p, b) for p in range(len(passes)) for b in range(len(batches))]
    readers = [merged_hooks(hm, p.statistics) for p in passes]
    device = hm.model.get_input_embeddings().weight.device
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(units), initial=done, desc=progress, unit="batch")
    cadence = Cadence(checkpoint_every)
    with contextlib.ExitStack() as entered:
        current = None
        for u in range(done, len(units)):
            p, b = units[u]
            step = passes[p]
            if p != current:  # a new pass: leave the previous one's context, enter this one's
                entered.close()
                if step.context is not None:
                    entered.enter_context(step.context())
                if bar is not None and len(passes) > 1:
                    bar.set_description_str(f"{progress}: {step.name} ({p + 1}/{len(passes)})")
                current = p
            _run_unit(hm, step, readers[p], batches[b], first_batch + b, device)
            if bar is not None:
                bar.update(1)
            if checkpoint is not None and u + 1 < len(units) and cadence.due(u + 1):
                state = {f"{i}/{k}": v for i, s in enumerate(stats) for k, v in s.state_dict().items()}
                cadence.save(checkpoint, state, u + 1, config)
    if bar is not None:
        bar.close()
    return done


def _run_unit(hm, step: Pass, readers: dict, batch, index: int, device: torch.device) -> None:
    """One batch through one pass: groups set, the batch prepared, one forward, the statistics told it ended."""
    ids, mask = batch if isinstance(batch, (tuple, list)) else (batch, None)
    ids = ids.to(device)
    hooks, positions, run_mask = readers, None, None if mask is None else mask.to(device)
    if step.prepare is not None:
        if mask is not None:
            raise UsageError(f"pass {step.name!r} prepares its batches and needs unpadded ones (attention_mask None)")
        prepared = step.prepare(ids, index)
        ids, writes, positions = prepared[:3]
        run_mask = prepared[3] if len(prepared) > 3 else None
        hooks = {k: list(v) for k, v in readers.items()}
        for name, fn in writes.items():  # the intervention writes before any reader of its point
            hooks[name] = (list(fn) if isinstance(fn, (list, tuple)) else [fn]) + hooks.get(name, [])
    for s in step.statistics:
        s.group = index
        begin = getattr(s, "begin_batch", None)
        if begin is not None:
            begin(ids, mask)
    hm.run(ids, run_mask, hooks=hooks, position_ids=positions)
    for s in step.statistics:
        end = getattr(s, "end_batch", None)
        if end is not None:
            end()


def run_statistics(model, statistics: Sequence[Statistic], batches: Sequence, *, first_batch: int = 0,
                   checkpoint: str | Path | None = None, fingerprint: dict | None = None,
                   checkpoint_every: int | None = None, progress: str | None = None, all_reduce: bool = True) -> int:
    """Run `batches` once through `model` with every statistic's hooks (one pass); returns the batch index it
    resumed from. The checkpoint is removed when the batches are done; `all_reduce` combines torchrun ranks."""
    done = run_passes(model, [Pass("batches", list(statistics))], batches, first_batch=first_batch,
                      checkpoint=checkpoint, fingerprint=fingerprint, checkpoint_every=checkpoint_every,
                      progress=progress)
    if all_reduce:
        for s in unique(statistics):
            s.all_reduce()
    if checkpoint is not None:
        Path(checkpoint).unlink(missing_ok=True)
    return done
