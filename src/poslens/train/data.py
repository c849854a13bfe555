"""Which token blocks each optimizer step, rank and micro-batch reads: a pure function of the step.

The training stream is cut into blocks of ``seq_len + 1`` tokens overlapping by one (block b is
``tokens[b*T : b*T + T + 1]``: inputs are its first T tokens, targets its last T). With a BOS id (`bos`,
``poslens train --bos``) every block starts with it and carries T - 1 tokens of the stream after it
(block b is ``[BOS] + tokens[b*(T-1) : b*(T-1) + T]``): the model always sees BOS at position 0 and the
first target is the token after it. Epoch e visits the blocks in a seeded random order; step s reads the
global samples ``[s*B, (s+1)*B)`` of that endless sequence, rank r of W the contiguous part
``[r*B/W, (r+1)*B/W)``. The data position of a run is therefore its step count: resuming needs nothing
else, and W ranks read exactly what one process reads.

Document-start blocks (`separator` given, ``poslens train --blocks doc-start``): block b is the start of document b
of the stream (documents end with the separator token, `poslens tokenize`'s layout): with `bos`, ``[BOS] +`` its
first seq_len tokens, else its first seq_len + 1; so position 0 is always the BOS (or the document's first token)
and the first target the document's first token. A document shorter than that (its separator included, the last
target: the model learns where a document ends) is padded with `PAD`: a padded target is not counted in the loss
and a padded input comes after every counted target of its row, so no counted prediction sees it (the causal
mask). Documents are never joined: every block holds one document, as the leakage analyses read them (each
document's start with the BOS first). Only the first seq_len tokens of each document are read, so the stream
holds as many blocks as documents (the embedded corpus: 2,449 training documents with `bpe:2048`, none shorter than
64 tokens, with the package versions of docs/corpus.md).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from poslens.errors import require

PAD = -100  # a padded target (torch's cross-entropy ignore_index): never counted in the loss


def num_blocks(tokens: np.ndarray, seq_len: int, bos: int | None = None, separator: int | None = None) -> int:
    """How many blocks of seq_len + 1 tokens (overlapping by one; with `bos`, BOS and seq_len stream tokens) the
    stream holds; with `separator` (document-start blocks), how many documents."""
    if separator is not None:
        return len(document_spans(tokens, separator)[0])
    return max(0, (len(tokens) - 1) // (seq_len - (bos is not None)))


_SPANS: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def document_spans(tokens: np.ndarray, separator: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the stream's non-empty documents: document k is tokens[starts[k]:ends[k]], its separator
    at ends[k] (text after the last separator, which `poslens tokenize` never leaves, is not a document). Kept per
    stream object (a training run asks at every step; the cache holds the stream itself, so its id is not reused)."""
    key = (id(tokens), int(separator))
    entry = _SPANS.get(key)
    if entry is None or entry[0] is not tokens:
        ends = np.flatnonzero(np.asarray(tokens) == separator)
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        keep = ends > starts
        if len(_SPANS) >= 4:
            _SPANS.clear()
        entry = _SPANS[key] = (tokens, starts[keep], ends[keep])
    return entry[1], entry[2]


@functools.lru_cache(maxsize=4)
def _order(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def blocks(tokens: np.ndarray, seq_len: int, index: torch.Tensor, bos: int | None = None,
           separator: int | None = None) -> torch.Tensor:
    """Blocks number `index` as a LongTensor [len(index), seq_len + 1] (with `bos`: BOS, then seq_len tokens); with
    `separator`, document b's start, padded with PAD past its separator (see the module docstring)."""
    body = seq_len - (bos is not None)
    if separator is None:
        rows = [np.asarray(tokens[b * body: b * body + body + 1], dtype=np.int64) for b in index.tolist()]
    else:
        starts, ends = document_spans(tokens, separator)
        rows = []
        for b in index.tolist():
            row = np.full(body + 1, PAD, dtype=np.int64)
            part = np.asarray(tokens[starts[b]: min(ends[b] + 1, starts[b] + body + 1)], dtype=np.int64)
            row[: len(part)] = part
            rows.append(row)
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
                  rank: int, world: int, seed: int, bos: int | None = None,
                  separator: int | None = None) -> list[torch.Tensor]:
    """The micro-batches ([micro_batch, seq_len + 1] each) that `rank` processes at `step` (with `separator`:
    document-start blocks)."""
    n = num_blocks(tokens, seq_len, bos, separator)
    what = "documents" if separator is not None else f"sequences of seq_len {seq_len}"
    require(n >= batch_size, f"the training tokens hold {n} {what}, fewer than one batch "
                             f"(batch_size {batch_size}); use more text, a shorter --seq-len or a smaller --batch-size")
    idx = step_samples(step, batch_size, rank, world, n, seed)
    return [blocks(tokens, seq_len, chunk, bos, separator) for chunk in idx.split(micro_batch)]


def eval_block_count(tokens: np.ndarray, seq_len: int, count: int, bos: int | None = None,
                     separator: int | None = None) -> int:
    """How many held-out blocks `eval_batches` reads: `count`, or all the validation tokens hold if fewer."""
    return min(num_blocks(tokens, seq_len, bos, separator), count)


def eval_batches(tokens: np.ndarray, seq_len: int, count: int, micro_batch: int, rank: int,
                 world: int, bos: int | None = None, separator: int | None = None) -> list[torch.Tensor]:
    """Held-out micro-batches of `rank`: the first `count` validation blocks (with `separator`: the first `count`
    validation documents' starts; fewer if the file is shorter), rows r, r + W, ... of them."""
    n = eval_block_count(tokens, seq_len, count, bos, separator)
    require(n >= 1, f"the validation tokens ({len(tokens)}) are shorter than one sequence of seq_len {seq_len}; "
                    "tokenize with a larger --val-fraction or use a shorter --seq-len")
    idx = torch.arange(rank, n, world)
    return [blocks(tokens, seq_len, chunk, bos, separator) for chunk in idx.split(micro_batch)]


def counted_rows(block: torch.Tensor) -> float:
    """How many rows' worth of targets of `block` [B, T + 1] the loss counts (padded targets not): B without
    padding, exactly."""
    targets = block[:, 1:]
    return float((targets != PAD).sum()) / targets.shape[1]


def loss_shares(micro: list[torch.Tensor]) -> list[float] | None:
    """The weight of each micro-batch's mean loss in the step's mean over counted targets; None when no block is
    padded (then every micro-batch weighs 1 / len(micro), as before document-start blocks existed)."""
    rows = [counted_rows(b) for b in micro]
    if all(r == b.shape[0] for r, b in zip(rows, micro)):
        return None
    total = sum(rows)
    return [r / total for r in rows]
