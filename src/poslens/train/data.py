"""Which token blocks each optimizer step, rank and micro-batch reads: a pure function of the step.

The training stream is cut into blocks of ``seq_len + 1`` tokens overlapping by one (block b is
``tokens[b*T : b*T + T + 1]``: inputs are its first T tokens, targets its last T). With a BOS id (`bos`,
``poslens train --bos``) every block starts with it and carries T - 1 tokens of the stream after it
(block b is ``[BOS] + tokens[b*(T-1) : b*(T-1) + T]``): the model always sees BOS at position 0 and the
first target is the token after it. Epoch e visits the blocks in a seeded random order; step s reads the
global samples ``[s*B, (s+1)*B)`` of that endless sequence, rank r of W the contiguous part
``[r*B/W, (r+1)*B/W)``. The data position of a run is therefore its step count: resuming needs nothing
else, and W ranks read exactly what one process reads.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from poslens.errors import require


def num_blocks(tokens: np.ndarray, seq_len: int, bos: int | None = None) -> int:
    """How many blocks of seq_len + 1 tokens (overlapping by one; with `bos`, BOS and seq_len stream tokens) the
    stream holds."""
    return max(0, (len(tokens) - 1) // (seq_len - (bos is not None)))


@functools.lru_cache(maxsize=4)
def _order(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def blocks(tokens: np.ndarray, seq_len: int, index: torch.Tensor, bos: int | None = None) -> torch.Tensor:
    """Blocks number `index` as a LongTensor [len(index), seq_len + 1] (with `bos`: BOS, then seq_len tokens)."""
    body = seq_len - (bos is not None)
    rows = [np.asarray(tokens[b * body: b * body + body + 1], dtype=np.int64) for b in index.tolist()]
    out = torch.from_numpy(np.stack(rows))
    if bos is not None:
        out = torch.cat([torch.full((out.shape[0], 1), bos, dtype=torch.long), out], dim=1)
    return out


def step_samples(step: int, batch_size: int, rank: int, world: int, n: int, seed: int) -> torch.Tensor:
    """Block indices that `rank` reads at optimizer step `step` (B / W of them, in order)."""
    per_rank = batch_size // world
    first = step * batch_size + rank * per_rank
    k = torch.arange(first, first + per_rank)
    epochs = (k // n).tolist()
    out = torch.empty_like(k)
    for e in sorted(set(epochs)):
        sel = k // n == e
        out[sel] = _order(n, seed, e)[k[sel] % n]
    return out


def train_batches(tokens: np.ndarray, seq_len: int, step: int, batch_size: int, micro_batch: int,
                  rank: int, world: int, seed: int, bos: int | None = None) -> list[torch.Tensor]:
    """The micro-batches ([micro_batch, seq_len + 1] each) that `rank` processes at `step`."""
    n = num_blocks(tokens, seq_len, bos)
    require(n >= batch_size, f"the training tokens hold {n} sequences of seq_len {seq_len}, fewer than one batch "
                             f"(batch_size {batch_size}); use more text, a shorter --seq-len or a smaller --batch-size")
    idx = step_samples(step, batch_size, rank, world, n, seed)
    return [blocks(tokens, seq_len, chunk, bos) for chunk in idx.split(micro_batch)]


def eval_batches(tokens: np.ndarray, seq_len: int, count: int, micro_batch: int, rank: int,
                 world: int, bos: int | None = None) -> list[torch.Tensor]:
    """Held-out micro-batches of `rank`: the first `count` validation blocks (fewer if the file is
    shorter), rows r, r + W, ... of them."""
    n = min(num_blocks(tokens, seq_len, bos), count)
    require(n >= 1, f"the validation tokens ({len(tokens)}) are shorter than one sequence of seq_len {seq_len}; "
                    "tokenize with a larger --val-fraction or use a shorter --seq-len")
    idx = torch.arange(rank, n, world)
    return [blocks(tokens, seq_len, chunk, bos) for chunk in idx.split(micro_batch)]
