"""Drive statistics over batches: one hooked forward per batch, resumable, shardable with torchrun.

    stats = [ActivationNorm(groups=20), MyStatistic(groups=20)]
    run_statistics(model, stats, batches, checkpoint="run/.partial.safetensors", progress="norms")
    for s in stats:
        s.result()

Every statistic's hooks are merged into one `HookedModel.run` per batch (so the forward stops after the deepest
point any of them reads). Batch b of the run goes to group `first_batch + b` (mod each statistic's groups); under
torchrun give each rank its shard and its first global batch index, and the sums are all-reduced at the end.
With `checkpoint`, the sums are saved atomically every `checkpoint_every` batches together with a fingerprint
of `fingerprint`, and a rerun resumes from them to the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from poslens.engine.hooks import HookedModel
from poslens.engine.stats import Statistic
from poslens.errors import check_int
from poslens.io.checkpoint import load_partial, save_partial


def _merged_hooks(hm: HookedModel, statistics: Sequence[Statistic]) -> dict[str, list]:
    hooks: dict[str, list] = {}
    for s in statistics:
        for name, fn in s.hooks(hm).items():
            hooks.setdefault(name, []).extend(fn if isinstance(fn, (list, tuple)) else [fn])
    return hooks


def run_statistics(model, statistics: Sequence[Statistic], batches: Sequence, *, first_batch: int = 0,
                   checkpoint: str | Path | None = None, fingerprint: dict | None = None,
                   checkpoint_every: int = 10, progress: str | None = None, all_reduce: bool = True) -> int:
    """Run `batches` (token-id tensors [B, T], or (input_ids, attention_mask) pairs) once through `model` (a
    HookedModel or a supported causal LM) with every statistic's hooks; returns the batch index it resumed from."""
    hm = model if isinstance(model, HookedModel) else HookedModel(model)
    check_int("checkpoint_every", checkpoint_every, 1)
    check_int("first_batch", first_batch, 0)
    config = {"statistics": [type(s).__name__ for s in statistics], **(fingerprint or {})}
    done = 0
    if checkpoint is not None and (resumed := load_partial(checkpoint, config)) is not None:
        state, done = resumed
        for i, s in enumerate(statistics):
            s.load_state_dict({k.split("/", 1)[1]: v for k, v in state.items() if k.startswith(f"{i}/")})
    hooks = _merged_hooks(hm, statistics)
    device = hm.model.get_input_embeddings().weight.device
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(batches), initial=done, desc=progress, unit="batch")
    for b in range(done, len(batches)):
        ids, mask = batches[b] if isinstance(batches[b], (tuple, list)) else (batches[b], None)
        for s in statistics:
            s.group = first_batch + b
            begin = getattr(s, "begin_batch", None)
            if begin is not None:
                begin(ids, mask)
        hm.run(ids.to(device), None if mask is None else mask.to(device), hooks=hooks)
        if bar is not None:
            bar.update(1)
        if checkpoint is not None and (b + 1) % checkpoint_every == 0 and b + 1 < len(batches):
            state = {f"{i}/{k}": v for i, s in enumerate(statistics) for k, v in s.state_dict().items()}
            save_partial(checkpoint, state, b + 1, config)
    if bar is not None:
        bar.close()
    if all_reduce:
        for s in statistics:
            s.all_reduce()
    if checkpoint is not None:
        Path(checkpoint).unlink(missing_ok=True)
    return done
