"""Monte Carlo of the parameter-free stack (paper Eq. 1; Sections 4.1 and 5.1).

Inputs as the paper draws them (Section 4.1): x_i = normalize(g_i + l s) with g_i, s ~ N(0, I_d) and
l = sqrt(alpha / (1 - alpha)), so E<x_i, x_j> = l^2 / (1 + l^2) = alpha for i != j (Eq. 2 in expectation).
One layer (Eq. 1, generalised by `StackConfig`):
    Y = Norm(X);  S = mask(R(Y) R(Y)^T / s);  A = softmax(S);  X' = A Y (+ X)

Reproducibility. Samples are drawn in fixed blocks of BLOCK; block k's draws depend only on (seed, k)
(`draw_inputs`). Each block is summed on its own in the compute dtype (torch's cascade sum over 128
samples: relative error ~1e-7 in float32, far below the Monte Carlo error) and the block sums join float64
accumulators one block at a time, in block order. So on the CPU the result is the same bit for bit for
any `chunk` and any number of threads, and a run resumed from a checkpoint equals an uninterrupted one.
Inside a run directory (`poslens.io.rundir.open_run`) the checkpoint is on by default, so rerunning an
interrupted command resumes. Chunks are generated lazily, so memory does not grow with the sample count;
what a run needs (`memory_estimate`) is checked against the available memory before any work.
(On CUDA a chunk's block sums are added with one float64 sum, equal across chunk sizes to float64
round-off; the draws come from the CUDA generator, so they differ from the CPU's.)

Speed. On the CPU each of torch's intra-op threads becomes a worker that pushes whole chunks of 128
samples (buffers of a few MB, cache-resident) through the stack single-threaded: small batched matmuls
scale better across chunks than inside one, and a busy neighbour core cannot stall a thread team. Per
layer: one baddbmm that also adds the mask and the shift -B and scales by log2(e), giving
T = (S - B) log2(e) (B = the largest possible score, so 2^T <= 1, and the moments of S - B lose little
to cancellation); softmax as 2^T over its row sum (torch's exp2 is several times faster than its exp
or softmax on these rows); one op for both squares, one block sum, one baddbmm for A Y + X. For l2
NoPE with a causal or no mask, S = Y Y^T is also the cosine matrix of the layer's input, so it is not
computed twice. With `maps` a subset, the work that feeds only the maps left out is skipped (the
probabilities' block sums, the cosines, and the last layer's softmax and A Y + X when nothing reads
them); what is computed is computed the same way, so the requested maps equal a full run's bit for bit.
See BENCHMARKS.md for timings and the floor.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from poslens.errors import UsageError, available_memory, check_duration, check_int, check_memory
from poslens.io.checkpoint import Cadence, fingerprint, load_partial
from poslens.io.rundir import current_run
from poslens.stack.config import StackConfig, visible
from poslens.stack.rope import cos_sin, rotate

__all__ = ["BLOCK", "MAPS", "SimResult", "block_seed", "draw_inputs", "memory_estimate", "simulate"]

BLOCK = 128  # samples per block of random draws; fixed, so that results do not depend on `chunk`
TINY = 1e-12  # l2: x / (||x|| + TINY); LayerNorm: eps under the square root
LOG2E = 1 / math.log(2)  # scores are kept as (S - B) log2(e), so that softmax is exp2 (much faster than exp)
CPU_CHUNK = 128  # default samples per chunk on the CPU: fastest on a 2-core EPYC (cache vs. Python overhead)
CUDA_CHUNK = 32768  # default on a GPU: few, large launches
MAPS = ("scores", "probs", "cosine")  # the maps `simulate` can compute; all of them by default


@dataclass
class SimResult:
    """Means over samples and their standard errors; float64 CPU tensors.

    scores_* [L, n, n]: pre-softmax scores per layer (NaN where the mask hides the pair);
    probs_* [L, n, n]: attention probabilities (0 where hidden);
    cosine_* [L+1, n, n]: cosine similarity of the hidden states X^(0) .. X^(L).
    A map not requested with `simulate(..., maps=...)` is None (its mean and its standard error).
    """

    scores_mean: torch.Tensor | None
    scores_se: torch.Tensor | None
    probs_mean: torch.Tensor | None
    probs_se: torch.Tensor | None
    cosine_mean: torch.Tensor | None
    cosine_se: torch.Tensor | None
    samples: int
    seconds: float


def block_seed(seed: int, block: int) -> int:
    """64-bit seed of block `block`: a hash of (seed, block), so blocks are independent streams."""
    digest = hashlib.blake2b(f"poslens.simulate:{seed}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def l2_normalize(x: torch.Tensor, out: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """out = x / (||x|| + TINY) row-wise; `norm` [..., 1] is scratch."""
    torch.linalg.vector_norm(x, dim=-1, keepdim=True, out=norm)
    return torch.div(x, norm.add_(TINY), out=out)


def layer_norm(x: torch.Tensor, out: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """out = (x - mean) / sqrt(var + TINY), population variance, no affine: rows of norm sqrt(d)."""
    torch.sub(x, x.mean(-1, keepdim=True), out=out)
    torch.linalg.vector_norm(out, dim=-1, keepdim=True, out=norm)
    return out.div_(norm.square_().div_(x.shape[-1]).add_(TINY).sqrt_())


def _normals(seed: int, first: int, sizes: list[int], g: torch.Generator, raw: torch.Tensor,
             shared: torch.Tensor) -> None:
    """Blocks first, first+1, ...: g_i into raw [c, n, d] and s into shared [c, 1, d] (float32), block k from
    its own stream seeded with block_seed(seed, k)."""
    start = 0
    for k, b in enumerate(sizes):
        g.manual_seed(block_seed(seed, first + k))
        torch.randn(b, *raw.shape[1:], generator=g, out=raw[start:start + b])
        torch.randn(b, 1, raw.shape[-1], generator=g, out=shared[start:start + b])
        start += b


def _inputs(config: StackConfig, raw: torch.Tensor, shared: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = normalize(g + l s), l = sqrt(alpha / (1 - alpha)) (Sec. 4.1); `raw` is overwritten."""
    if config.alpha > 0:
        raw.add_(shared, alpha=math.sqrt(config.alpha / (1 - config.alpha)))
    if out is not raw:
        out.copy_(raw)
    return out.div_(torch.linalg.vector_norm(out, dim=-1, keepdim=True).add_(TINY))


def draw_inputs(config: StackConfig, seed: int, block: int, size: int = BLOCK, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """X^(0) of block `block` as `simulate` draws it: [size, n, d], rows normalize(g_i + l s) (Sec. 4.1).

    The normals are float32 whatever the compute dtype (float32 and float64 runs see the same inputs);
    s is drawn even when alpha = 0, so runs that differ only in alpha share their noise.
    """
    raw = torch.empty(size, config.n, config.d, device=device)
    shared = torch.empty(size, 1, config.d, device=device)
    _normals(seed, block, [size], torch.Generator(device), raw, shared)
    return _inputs(config, raw, shared, raw if dtype == torch.float32 else torch.empty_like(raw, dtype=dtype))


def _gram_is_cosine(config: StackConfig) -> bool:
    """l2 NoPE: S = Y Y^T is the cosine matrix of the layer's input X, visible on the lower triangle at least."""
    return config.norm == "l2" and config.positional == "none" and config.mask != "sliding"


def _check_maps(maps) -> tuple[str, ...]:
    """`maps` as a tuple in MAPS order, or a one-line UsageError."""
    if isinstance(maps, str):
        maps = (maps,)
    try:
        names = tuple(maps)
    except TypeError:
        names = None
    if not names or not all(isinstance(m, str) for m in names) or not set(names) <= set(MAPS):
        raise UsageError(f"maps must be a non-empty subset of {', '.join(MAPS)}; got {maps!r}")
    return tuple(m for m in MAPS if m in names)


def _layout(config: StackConfig, maps: tuple[str, ...]) -> tuple[tuple[str, ...], bool]:
    """What a block's sums hold: the per-layer quantities summed (with their squares), and whether the
    cosine rows are there. T (the scores) is also summed for the cosine when S is the cosine (l2 NoPE)."""
    per_layer = tuple(q for q, m in (("T", "scores"), ("A", "probs"))
                      if m in maps or (q == "T" and "cosine" in maps and _gram_is_cosine(config)))
    return per_layer, "cosine" in maps


def _rows(config: StackConfig, maps: tuple[str, ...]) -> int:
    """Rows of a block's sums: (q.., q^2..) per layer for q in the per-layer quantities (T, A for all maps),
    then (C - 1, (C - 1)^2) per X^(l) when the cosine is requested."""
    per_layer, cosine = _layout(config, maps)
    return 2 * len(per_layer) * config.layers + (2 * (config.layers + 1) if cosine else 0)


class _Stack:
    """Constants and buffers for pushing chunks of up to `chunk` samples through the stack (one per worker)."""

    def __init__(self, config: StackConfig, chunk: int, device: torch.device, dtype: torch.dtype,
                 maps: tuple[str, ...] = MAPS):
        self.config, self.device, self.dtype, self.maps = config, device, dtype, maps
        per_layer, self.cosine = _layout(config, maps)
        # Slots of w: the summed quantities, their squares, then T and A when not summed (scratch).
        self.k = len(per_layer)
        slots = {q: i for i, q in enumerate(per_layer)}
        for q in ("T", "A"):
            slots.setdefault(q, len(slots) + self.k)
        self.t, self.a = slots["T"], slots["A"]
        # The last layer's A (and A Y + X) is needed only by the probabilities and the cosine of X^(L).
        self.last_softmax, self.last_update = "probs" in maps or self.cosine, self.cosine
        n, d = config.n, config.d
        # B = ||R(y)||^2 / s, the largest score (the diagonal): 2^T = exp(S - B) <= 1 never overflows.
        shift = config.row_norm**2 / config.score_divisor
        hidden = ~torch.as_tensor(visible(n, config.mask, config.window), device=device)
        self.bias = torch.full((n, n), -shift * LOG2E, device=device, dtype=dtype).masked_fill_(hidden, -math.inf)
        self.cos_bias = torch.full((n, n), -1.0, device=device, dtype=dtype)
        self.gram_is_cosine = _gram_is_cosine(config)
        if config.positional == "rope":
            self.cos, self.sin = cos_sin(n, d, config.rope_theta, config.rope_scaling, dtype=dtype, device=device)
        self.x = torch.empty(chunk, n, d, device=device, dtype=dtype)
        self.raw = self.x if dtype == torch.float32 else torch.empty(chunk, n, d, device=device)
        self.shared_draw = torch.empty(chunk, 1, d, device=device)
        self.y = torch.empty_like(self.x)
        self.u = torch.empty_like(self.x)  # l2-normalised X for the cosine when Y is not that
        self.norm = torch.empty(chunk, n, 1, device=device, dtype=dtype)
        self.rowsum = torch.empty_like(self.norm)
        self.w = torch.empty(self.k + 2, chunk, n, n, device=device, dtype=dtype)  # T, A, T^2, A^2 for all maps
        self.generator = torch.Generator(device)

    @property
    def rows(self) -> int:
        """Rows of a block's sums (`_rows`): (T, A, T^2, A^2) per layer, then (C - 1, (C - 1)^2) per X^(l)."""
        return _rows(self.config, self.maps)

    def run(self, seed: int, first: int, sizes: list[int]) -> torch.Tensor:
        """Blocks first, first+1, ... of the given sizes through the stack: their sums [len(sizes), rows, n, n]."""
        cfg, c, L, k, t, a = self.config, sum(sizes), self.config.layers, self.k, self.t, self.a
        x, y, w, norm, rowsum = self.x[:c], self.y[:c], self.w[:, :c], self.norm[:c], self.rowsum[:c]
        _normals(seed, first, sizes, self.generator, self.raw[:c], self.shared_draw[:c])
        _inputs(cfg, self.raw[:c], self.shared_draw[:c], x)  # X^(0)
        sums = torch.zeros(len(sizes), self.rows, cfg.n, cfg.n, device=self.device, dtype=self.dtype)
        bias = self.bias.expand(c, -1, -1)
        for layer in range(L):
            if self.cosine and not self.gram_is_cosine:
                self._cosine(x, sizes, sums[:, 2 * k * L + 2 * layer:])
            if cfg.norm == "l2":
                l2_normalize(x, y, norm)  # Y = Norm(X)
            else:
                layer_norm(x, y, norm)
            q = rotate(y, self.cos, self.sin) if cfg.positional == "rope" else y
            torch.baddbmm(bias, q, q.mT, alpha=LOG2E / cfg.score_divisor, out=w[t])  # T = (S - B) log2(e), masked
            last = layer == L - 1
            if self.last_softmax or not last:
                torch.exp2(w[t], out=w[a])  # A = softmax(S) = 2^T / sum_j 2^T (Eq. 1): the shift B cancels
                w[a].div_(torch.sum(w[a], dim=-1, keepdim=True, out=rowsum))
            if k:
                torch.mul(w[:k], w[:k], out=w[k:2 * k])
                _block_sums(w[:2 * k], sizes, sums[:, 2 * k * layer:2 * k * (layer + 1)])
            if self.last_update or not last:
                if cfg.residual:
                    x.baddbmm_(w[a], y)  # X' = A Y + X
                else:
                    torch.bmm(w[a], y, out=x)  # X' = A Y
        if self.cosine:
            self._cosine(x, sizes, sums[:, 2 * k * L + 2 * L:])
        return sums

    def _cosine(self, x: torch.Tensor, sizes: list[int], out: torch.Tensor) -> None:
        """Block sums of C - 1 and (C - 1)^2, C = cosine-similarity matrix of the rows of x."""
        c = x.shape[0]
        u, w = l2_normalize(x, self.u[:c], self.norm[:c]), self.w[:2, :c]
        torch.baddbmm(self.cos_bias.expand(c, -1, -1), u, u.mT, out=w[0])
        torch.mul(w[0], w[0], out=w[1])
        _block_sums(w, sizes, out[:, :2])


def _block_sums(w: torch.Tensor, sizes: list[int], out: torch.Tensor) -> None:
    """out[k] = sum of w[:, samples of block k] for w [r, c, n, n]: the same reduction whatever the chunk."""
    full = sum(1 for b in sizes if b == BLOCK)  # only the run's last block can be short, and it comes last
    if full:
        out[:full] = w[:, :full * BLOCK].unflatten(1, (full, BLOCK)).sum(2).transpose(0, 1)
    if full < len(sizes):
        out[full] = w[:, full * BLOCK:].sum(1)


def _ordered_map(pool: ThreadPoolExecutor, fn, items: Iterable, window: int) -> Iterator:
    """fn(item) for each item, computed by the pool at most `window` ahead, yielded in order."""
    queue: deque = deque()
    for item in items:
        queue.append(pool.submit(fn, item))
        if len(queue) > window:
            yield queue.popleft().result()
    while queue:
        yield queue.popleft().result()


def _moments(s1: torch.Tensor, s2: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard error of the mean from sums of x and x^2 (float64)."""
    mean = s1 / n
    if n < 2:
        return mean, torch.full_like(mean, math.nan)
    var = (s2 - s1 * mean).clamp_min_(0) / (n - 1)
    return mean, (var / n).sqrt_()


def _device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"device must be cpu or cuda, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"device must be cpu or cuda, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("device cuda requested but torch sees no GPU; use --device cpu")
    return dev


def memory_estimate(config: StackConfig, chunk: int, workers: int = 1, dtype: torch.dtype = torch.float32,
                    maps: tuple[str, ...] = MAPS) -> int:
    """Bytes `simulate` allocates for `workers` workers pushing chunks of `chunk` samples (a multiple of BLOCK).

    Per worker: the chunk's hidden states (X, Y, the cosine's U, RoPE temporaries), its [k+2, c, n, n] score /
    probability buffers and its block sums; plus the pending results of the ordered pool and the float64
    accumulator and results. The sample count does not enter: chunks are streamed.
    """
    n, d, c, b = config.n, config.d, chunk, -(-chunk // BLOCK)
    e = torch.finfo(dtype).bits // 8
    k = len(_layout(config, maps)[0])
    rows = _rows(config, maps)
    states = c * n * d * (4 + (5 if config.positional == "rope" else 0)) * e + c * d * 4  # X, Y, U, scratch; RoPE
    if dtype != torch.float32:
        states += c * n * d * 4  # float32 normals before the cast
    worker = states + 2 * c * n * e + (k + 2) * c * n * n * e + 2 * n * (n + d) * e
    sums = b * rows * n * n * e
    return workers * worker + (2 * workers + 1) * sums + 5 * rows * n * n * 8 + 2 * n * n


def _fit_workers(config: StackConfig, chunk: int, workers: int, dtype: torch.dtype, maps: tuple[str, ...],
                 dev: torch.device) -> int:
    """The most workers (<= `workers`) whose memory fits; a one-line UsageError with the estimate if none does."""
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0]
        check_memory(memory_estimate(config, chunk, 1, dtype, maps), f"simulate (n={config.n}, d={config.d}, "
                     f"layers={config.layers}, chunks of {chunk} samples) on the GPU",
                     "lower chunk, n, d or layers", available=free)
        return 1
    available = available_memory()
    if available is None:
        return workers
    while workers > 1 and memory_estimate(config, chunk, workers, dtype, maps) > available:
        workers -= 1
    check_memory(memory_estimate(config, chunk, workers, dtype, maps),
                 f"simulate (n={config.n}, d={config.d}, layers={config.layers}, chunks of {chunk} samples)",
                 "lower n, d, layers or chunk", available=available)
    return workers


def _chunks(done: int, nblocks: int, per_chunk: int, samples: int) -> Iterator[tuple[int, list[int]]]:
    """(first block, block sizes) of each chunk from block `done` on, generated lazily (flat memory in samples)."""
    for first in range(done, nblocks, per_chunk):
        yield first, [min(BLOCK, samples - k * BLOCK) for k in range(first, min(first + per_chunk, nblocks))]


def _auto_checkpoint(fp: dict) -> Path | None:
    """The checkpoint of this run inside the run directory being built around the call, if there is one."""
    run = current_run()
    return None if run is None else run.checkpoint(f"simulate-{fingerprint(fp)}")


def simulate(config: StackConfig, samples: int, seed: int = 0, chunk: int | None = None, device: str = "cpu",
             dtype: torch.dtype = torch.float32, progress: bool = False,
             checkpoint: str | os.PathLike | None = "auto", checkpoint_every: int | None = None,
             maps: tuple[str, ...] = MAPS) -> SimResult:
    """Monte Carlo means (and standard errors) of the stack's scores, probabilities and hidden-state cosines.

    `chunk` (rounded up to a multiple of BLOCK) bounds memory; it does not change the result. Memory is
    estimated before any work (`memory_estimate`) and a run that cannot fit is refused.
    `checkpoint`: a file for the partial sums, saved every `checkpoint_every` chunks (None: by time,
    `poslens.io.checkpoint.Cadence`) and at the end; a run with the same config, samples, seed, device type, dtype
    and maps resumes from it bit for bit. "auto" (the default): inside `poslens.io.rundir.open_run` /
    `run_directory`, a file in that run's work directory (so rerunning the same command resumes); elsewhere none.
    `maps`: which of "scores", "probs", "cosine" to compute (any non-empty subset, in any order; all by
    default). Each requested map comes with its standard error and equals a full run's bit for bit (same
    draws, same arithmetic); the fields of the others are None. Asking for fewer skips their work.
    """
    t0 = time.perf_counter()
    if not isinstance(config, StackConfig):
        raise UsageError(f"config must be a StackConfig, got {type(config).__name__}")
    samples = check_int("samples", samples, 1)
    seed = check_int("seed", seed, 0)
    check_duration(config.operations(samples), f"simulate with {samples:,} samples (n={config.n}, d={config.d}, "
                   f"{config.layers} layers)", "lower samples", str(device))
    if checkpoint_every is not None:
        checkpoint_every = check_int("checkpoint_every", checkpoint_every, 1)
    maps = _check_maps(maps)
    if dtype not in (torch.float32, torch.float64):
        raise UsageError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    dev = _device(device)
    if chunk is None:
        chunk = CPU_CHUNK if dev.type == "cpu" else CUDA_CHUNK
    chunk = check_int("chunk", chunk, 1)
    nblocks = -(-samples // BLOCK)
    per_chunk = min(-(-chunk // BLOCK), nblocks)  # blocks per chunk
    threads = torch.get_num_threads()
    workers = max(1, min(threads, -(-nblocks // per_chunk))) if dev.type == "cpu" else 1
    workers = _fit_workers(config, per_chunk * BLOCK, workers, dtype, maps, dev)

    n, rows = config.n, _rows(config, maps)
    fp = {"config": config.to_dict(), "samples": samples, "seed": seed, "block": BLOCK,
          "device": dev.type, "dtype": str(dtype), "what": "poslens.simulate"}
    if maps != MAPS:  # all maps: the fingerprint (and the checkpoint layout) of runs before `maps` existed
        fp["maps"] = list(maps)
    if isinstance(checkpoint, str) and checkpoint == "auto":
        checkpoint = _auto_checkpoint(fp)
    acc, done = torch.zeros(rows, n, n, dtype=torch.float64, device=dev), 0
    if checkpoint is not None and (state := load_partial(checkpoint, fp)) is not None:
        sums, done = state
        if sums.get("sums") is None or sums["sums"].shape != acc.shape or not 0 <= done <= nblocks:
            raise UsageError(f"checkpoint {checkpoint} does not match this run; delete it to start over")
        acc.copy_(sums["sums"])

    local = threading.local()

    def job(item: tuple[int, list[int]]) -> tuple[list[int], torch.Tensor]:
        if not hasattr(local, "stack"):
            local.stack = _Stack(config, per_chunk * BLOCK, dev, dtype, maps)
        return item[1], local.stack.run(seed, *item)

    bar = tqdm(total=samples, initial=min(done * BLOCK, samples), unit="sample", unit_scale=True,
               disable=not progress, desc="simulate")
    cadence = Cadence(checkpoint_every)
    try:
        if dev.type == "cpu":
            torch.set_num_threads(1)  # parallel over chunks, not inside the small matmuls
        with ThreadPoolExecutor(workers) as pool:
            chunks = _chunks(done, nblocks, per_chunk, samples)
            parts = map(job, chunks) if workers == 1 else _ordered_map(pool, job, chunks, 2 * workers)
            for i, (sizes, part) in enumerate(parts):
                if dev.type == "cpu":
                    for p in part:  # block by block, in block order: independent of the chunking
                        acc.add_(p)
                else:
                    acc.add_(part.sum(0, dtype=torch.float64))
                done += len(sizes)
                bar.update(sum(sizes))
                if checkpoint is not None and (cadence.due(i + 1) or done == nblocks):
                    cadence.save(checkpoint, {"sums": acc}, done, fp)
    finally:
        torch.set_num_threads(threads)
        bar.close()
    return _result(config, acc.cpu(), samples, time.perf_counter() - t0, maps)


def _result(config: StackConfig, acc: torch.Tensor, samples: int, seconds: float,
            maps: tuple[str, ...] = MAPS) -> SimResult:
    """Means and standard errors from the float64 sums (rows as in `_rows`); None for maps not requested."""
    L = config.layers
    per_layer, cosine = _layout(config, maps)
    k = len(per_layer)
    shift = config.row_norm**2 / config.score_divisor
    sc = acc[:2 * k * L].unflatten(0, (L, 2 * k)).clone()  # per layer: T, A, T^2, A^2 (those summed)
    if "T" in per_layer:  # T = (S - B) log2(e): now S - B and (S - B)^2
        t = per_layer.index("T")
        sc[:, t] *= math.log(2)
        sc[:, k + t] *= math.log(2) ** 2
    hidden = ~torch.as_tensor(visible(config.n, config.mask, config.window))
    out = dict.fromkeys(("scores_mean", "scores_se", "probs_mean", "probs_se", "cosine_mean", "cosine_se"))
    if "scores" in maps:
        s_mean, s_se = _moments(sc[:, t], sc[:, k + t], samples)
        out["scores_mean"] = (s_mean + shift).masked_fill_(hidden, math.nan)
        out["scores_se"] = s_se.masked_fill_(hidden, math.nan)
    if "probs" in maps:
        a = per_layer.index("A")
        p_mean, p_se = _moments(sc[:, a], sc[:, k + a], samples)
        out["probs_mean"] = p_mean.masked_fill_(hidden, 0.0)
        out["probs_se"] = p_se.masked_fill_(hidden, 0.0)
    if cosine:
        cs = acc[2 * k * L:].unflatten(0, (L + 1, 2)).clone()
        if _gram_is_cosine(config):  # cosine of X^(l-1) = layer l's S: mirror the visible lower triangle
            low = torch.tril(sc[:, t::k])
            cs[:L] = low + torch.tril(low, -1).mT
        c_mean, c_se = _moments(cs[:, 0], cs[:, 1], samples)
        out["cosine_mean"], out["cosine_se"] = c_mean + 1.0, c_se
    return SimResult(**out, samples=samples, seconds=seconds)
