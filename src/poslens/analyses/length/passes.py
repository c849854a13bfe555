"""Passes under an intervention on the engine's runner (`poslens.engine.runner`): `prepared`, the per-batch step
both `run_pass` and the length analysis use, and `run_pass`, one pass of statistics over batches.

Batch b goes to group `first_batch + b` of every statistic, whatever the intervention, so two passes over the same
batches are paired group by group (compare.py). Before each batch the rotary modules are reset (checks.reset_rotary),
so a dynamic-RoPE model sees each batch as if it were the first; the intervention's writes fire before the
statistics' readers at a shared point, and its change of the model (`Intervention.changed`: ntk, yarn) holds around
the pass's forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from poslens.analyses.length.checks import reset_rotary
from poslens.analyses.length.interventions import Intervention
from poslens.engine.hooks import HookedModel
from poslens.engine.runner import Pass, run_passes
from poslens.engine.stats import Statistic
from poslens.errors import UsageError


def prepared(hm: HookedModel, intervention: Intervention, length: int | None = None) -> Callable[..., tuple]:
    """A pass's `prepare(ids, index)` under `intervention`: the rotary modules reset, the first `length` tokens
    (all: None), and the intervention's forward (ids, write hooks, position ids, mask)."""

    def prepare(ids: torch.Tensor, index: int) -> tuple:
        reset_rotary(hm.model)
        f = intervention.prepare(hm, ids if length is None else ids[:, :length])
        return f.ids, f.hooks, f.position_ids, f.attention_mask

    return prepare


def run_pass(hm: HookedModel, statistics: Sequence[Statistic], batches: Sequence[torch.Tensor],
             intervention: Intervention | None = None, first_batch: int = 0) -> None:
    """Run `batches` (token ids [B, T], one length T) through `hm` under `intervention` with every statistic."""
    intervention = intervention or Intervention()
    intervention.check(hm.model)
    lengths = sorted({int(ids.shape[1]) for ids in batches})
    if len(lengths) > 1:
        raise UsageError(f"batches must have one length (an intervention may change the model for a length); got "
                         f"lengths {lengths}: run one pass per length")
    length = lengths[0] if lengths else 0
    run_passes(hm, [Pass(intervention.name, list(statistics), prepare=prepared(hm, intervention),
                         context=lambda: intervention.changed(hm, length))], list(batches), first_batch=first_batch)
