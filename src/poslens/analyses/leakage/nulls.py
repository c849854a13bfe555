"""The null passes: the same metrics on inputs where token position no longer carries content position.

    offset    windows of the same documents starting at a random offset inside them (engine.data.document_windows):
              in the original pass token position p holds the document's p-th token, here its (o + p)-th; what a
              metric keeps in this pass is what token position gives on its own
    circular  the predecessor's null: each sequence's tokens after the BOS rolled by a random k (seeded per batch),
              so content position and token position are decoupled inside one sequence

Each is one pass of `causal.LeakageMaps` (and, for `circular`, `predecessor.DeltaR2Rows`) over the same groups as
the original; `contrast.contrast(null, original)` gives, per metric, the original's excess over its null with a
paired interval (docs/leakage.md, "Nulls"). `prepare` has the shape of `interventions.prepare`.
"""

from __future__ import annotations

import torch

from poslens.analyses.leakage.predecessor import circular_shift
from poslens.errors import UsageError

NULLS = ("offset", "circular")


def describe(name: str, min_offset: int = 128) -> str:
    """One line on what null `name` changes."""
    if name == "offset":
        return (f"windows of the same documents starting at a random offset of at least {min_offset} tokens inside "
                "them (content position no longer token position)")
    if name == "circular":
        return "each sequence's tokens after the BOS rolled by a random shift (the predecessor's null)"
    raise UsageError(f"nulls: unknown null {name!r}; use {' or '.join(NULLS)}")


def prepare(name: str, ids: torch.Tensor, *, inside: torch.Tensor | None = None, batch_index: int = 0,
            seed: int = 0, bos_prepended: bool = True) -> tuple[torch.Tensor, dict, None]:
    """(input ids, hooks, position ids) of the null pass `name` on a batch `ids` [B, T] (global batch index
    `batch_index` seeds the circular shifts; `inside`: the batch's windows inside the same documents)."""
    if name == "offset":
        if inside is None or inside.shape != ids.shape:
            raise UsageError("the offset null needs windows inside the same documents, one per sequence")
        return inside, {}, None
    if name == "circular":
        keep = int(bos_prepended)
        if ids.shape[1] - keep < 2:
            raise UsageError("the circular null needs at least 2 tokens after the BOS")
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(batch_index))
        shifts = torch.randint(1, ids.shape[1] - keep, (ids.shape[0],), generator=g)
        return circular_shift(ids.cpu(), shifts, keep).to(ids.device), {}, None
    raise UsageError(f"nulls: unknown null {name!r}; use {' or '.join(NULLS)}")
