"""One pass of statistics over batches under an intervention (the analysis driver will run these as its passes).

Batch b goes to group `first_batch + b` of every statistic, whatever the intervention, so two passes over the same
batches are paired group by group (compare.py). Before each batch the rotary modules are reset (checks.reset_rotary),
so a dynamic-RoPE model sees each batch as if it were the first; the intervention's writes fire before the
statistics' readers at a shared point.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from poslens.analyses.length.checks import reset_rotary
from poslens.analyses.length.interventions import Intervention
from poslens.engine.hooks import HookedModel
from poslens.engine.stats import Statistic


def run_pass(hm: HookedModel, statistics: Sequence[Statistic], batches: Sequence[torch.Tensor],
             intervention: Intervention | None = None, first_batch: int = 0) -> None:
    """Run `batches` (token ids [B, T], fixed length) through `hm` under `intervention` with every statistic."""
    intervention = intervention or Intervention()
    intervention.check(hm.model)
    readers = [s.hooks(hm) for s in statistics]
    device = hm.model.get_input_embeddings().weight.device
    for b, ids in enumerate(batches):
        ids = ids.to(device)
        for s in statistics:
            s.group = first_batch + b
            begin = getattr(s, "begin_batch", None)
            if begin is not None:
                begin(ids, None)
        reset_rotary(hm.model)
        with intervention.applied(hm, ids) as p:
            hooks: dict[str, list] = {k: list(v) for k, v in p.hooks.items()}
            for r in readers:
                for name, fn in r.items():
                    hooks.setdefault(name, []).extend(fn if isinstance(fn, (list, tuple)) else [fn])
            hm.run(p.ids, p.attention_mask, hooks=hooks, position_ids=p.position_ids)
