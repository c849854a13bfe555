"""Mean attention maps of a Hugging Face causal LM, captured inside its own forward: a `Statistic`.

`Capture` reads the hook point `attn.hook_attn_scores` of each captured layer from its factors
(`poslens.engine.hooks.from_factors`): the query and key states after RoPE and any q/k norm as the attention
kernel receives them, with the layer's `scaling`, `window` and `softcap`, i.e. exactly what the softmax sees. No
[B, H, T, T] tensor is formed for the head means. It adds the batch to float32 sums of its group of sequences on
the device (a `GroupedSums`, the base class's `sums`; batch b -> group b mod G) and leaves the forward alone: the
model's own attention runs, so hidden states and logits are bit-identical to a plain forward. `result` finishes
each map with `GroupedSums.estimate` (the mean, and with two or more groups the delete-a-group jackknife standard
error of every entry); `estimate` gives any function of a mean map its interval the same way. In a pass of
`poslens.engine.runner` it is one statistic among others; `update` / `forward` run a batch on their own.

Maps (entry [i, j] = query position i, key position j):

* `scores`: mean over sequences and heads of s_ij = scaling * q_i . k_j (after softcap for Gemma-2).
  Linear in q and k, so the query heads sharing a key head are summed first and batch and heads are folded
  into one contraction: one GEMM per query block into a [T, T] accumulator, keys beyond the block skipped.
  The GEMM runs in float32 (keep TF32 off, PyTorch's default) or, for bfloat16 models on CUDA, as one
  bfloat16 tensor-core GEMM over a doubled contraction (the float32 group-summed queries split into hi + lo
  bfloat16 parts: [hi | lo] @ [k ; k]^T) accumulating straight into the float32 sums (`gemm` option).
* `scores_per_head`: the same per head (one batched GEMM per block, the batch folded).
* `probs`, `log_probs`, `log_partition`: mean of softmax_j(s_ij), of its log, and of logsumexp_j s_ij over
  the keys the model attends to; computed in float32 from per-head score blocks (chunked).
* `hidden_cosine`: mean cosine similarity of the residual-stream vectors entering each captured layer.

Conventions:

* Positions are token indices within a sequence: index 0 is its first real token. `attention_mask` rows must
  be one run of ones (right or left padding). Left-padded rows are shifted to the left before accumulation,
  so they land on the same map entries as the unpadded sequence. The forward itself is the model's own
  (default `position_ids` = tensor index); RoPE depends only on i - j, so the scores of a left-padded
  sequence equal the unpadded ones up to rounding. Padded queries and keys never enter a mean: `count[i]` is
  the number of sequences reaching position i, and every entry (i, j <= i) is a mean over count[i]
  sequences (times heads).
* Entries the softmax never sees are NaN: above the diagonal, positions no sequence reached, and, on
  sliding-window layers, keys with i - j >= window (`poslens.masks`). `sliding_window` records the window per
  layer (0 = none).
* `hidden_cosine` is symmetric; only j <= i is stored (NaN above), like the other maps.
* `update()` runs the base model without the LM head and ends the forward inside the deepest captured
  layer's attention; `forward()` runs the whole model and returns its output. Both run under no_grad; put
  the model in eval mode (attention dropout is the model's own).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from poslens.engine.families import check_supported
from poslens.engine.hooks import HookedModel, from_factors
from poslens.engine.models import max_positions
from poslens.engine.stats import Estimate, GroupedSums, Statistic, t_quantile
from poslens.errors import UsageError, check_choice, check_int
from poslens.masks import visible

MAP_KEYS = ("scores", "probs", "log_probs", "hidden_cosine")
GEMM_MODES = ("auto", "float32", "split-bf16")


@dataclass
class _Batch:
    """Per-forward state: which tokens are real, how to align left-padded rows, where to stop."""

    valid: torch.Tensor  # [B, T] bool, after alignment: True for the first lengths[b] positions
    shift: torch.Tensor | None  # [B] leading pad tokens per row; None when there are none
    full: bool  # no padding at all

    def on(self, device: torch.device) -> _Batch:
        if self.valid.device == device:
            return self
        shift = None if self.shift is None else self.shift.to(device)
        return _Batch(self.valid.to(device), shift, self.full)


def _align(x: torch.Tensor, batch: _Batch, seq_dim: int) -> torch.Tensor:
    """Shift each row of x [B, ..., T, ...] so its first real token is at index 0; zero the padded positions."""
    if batch.full:
        return x
    batch = batch.on(x.device)
    n = x.shape[seq_dim]
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[seq_dim] = n
    if batch.shift is not None:
        idx = (torch.arange(n, device=x.device)[None] + batch.shift[:, None]).clamp(max=n - 1)
        x = x.gather(seq_dim, idx.view(shape).expand(x.shape))
    return torch.where(batch.valid.view(shape), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _blocks(n: int, block: int, window: int) -> Iterator[tuple[int, int, int]]:
    """Query blocks [s, e) and the first key k0 any of them sees (0, or the window's start)."""
    for s in range(0, n, block):
        yield s, min(n, s + block), max(0, s - window + 1) if window else 0


CPU_BLOCK_ROWS = 64  # query rows per block of per-head scores on the CPU (BENCHMARKS.md, "Length section against the
# previous release": 64 rows were the fastest of 16-1,024 at four shapes)


def chunk_rows(memory_rows: int, n: int, device: torch.device) -> int:
    """Query rows per block of per-head scores [B, H, rows, keys] for n queries: `memory_rows` (what the memory
    allows), at most CPU_BLOCK_ROWS on the CPU. Small blocks keep a block in the cache while it is masked, reduced
    and summed, and skip the keys above the diagonal (a block reads keys up to its last query only): one block of
    512 queries took 3x the time of 64-row blocks at the length maps' shape. A GPU keeps the large blocks."""
    rows = max(1, min(n, memory_rows))
    return min(rows, CPU_BLOCK_ROWS) if device.type == "cpu" else rows


def _in_place(acc: torch.Tensor, x: torch.Tensor) -> bool:
    """A GEMM of x's blocks adds straight into acc on a GPU (same device; `_add_matmul` / `_addmm_bf16_exact`)."""
    return acc.device == x.device and x.is_cuda


def _add_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """out += alpha * a @ b (out may live on another device than a and b)."""
    if out.device == a.device and a.dim() == 2:
        out.addmm_(a, b, alpha=alpha)
    else:
        out.add_(torch.matmul(a, b).to(out.device), alpha=alpha)


_FUSED_ADDMM = True  # False once torch.addmm(..., out_dtype=) has failed in this process (older torch)


def _addmm_bf16_exact(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """out += alpha * a @ b for bfloat16 a, b and a float32 out (a strided view is fine): exact products,
    float32 accumulation, no temporary.

    CUDA: one tensor-core GEMM accumulating into `out` (`torch.addmm(..., out_dtype=torch.float32)`, torch >= 2.8);
    elsewhere, or where that kernel is missing, the same numbers by upcasting first (bfloat16 products are exact
    in float32).
    """
    global _FUSED_ADDMM
    if a.is_cuda and _FUSED_ADDMM:
        try:
            if out.device == a.device:
                torch.addmm(out, a, b, alpha=alpha, out_dtype=torch.float32, out=out)
            else:  # sums kept on another device (Capture(device=...))
                out.add_(torch.mm(a, b, out_dtype=torch.float32).to(out.device), alpha=alpha)
            return
        except (TypeError, RuntimeError, NotImplementedError):  # torch without the out_dtype GEMM
            _FUSED_ADDMM = False
    _add_matmul(out, a.float(), b.float(), alpha)


@contextmanager
def _exact_cuda_matmul(on_cuda: bool):
    """No reduced-precision reductions in bfloat16 GEMMs while capturing (global flag, restored).

    TF32 is left as the user set it (PyTorch's default is off): its flags raise when old and new APIs are
    mixed, so they are not toggled here. With TF32 on, the float32 GEMMs carry ~1e-3 relative error.
    """
    if not on_cuda:
        yield
        return
    m = torch.backends.cuda.matmul
    saved = m.allow_bf16_reduced_precision_reduction
    m.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        m.allow_bf16_reduced_precision_reduction = saved


_STAGE_ELEMENTS = 1 << 24  # elements per page-locked staging buffer (64 MiB of float32; two, kept for reuse)
_STAGES: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}


def _to_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst (ordinary host memory) <- src (a GPU), through two page-locked staging buffers: the copy of one
    chunk from the device overlaps the host copy of the previous one. Unlike page-locking the whole result
    (torch caches such memory: gigabytes stay locked), this locks 128 MiB, and a process's first call avoids
    the slow page-locked allocation of the whole result."""
    flat, out = src.reshape(-1), dst.view(-1)
    key = (src.device, src.dtype)
    stages = _STAGES.get(key)
    if stages is None:
        stages = _STAGES[key] = [torch.empty(_STAGE_ELEMENTS, dtype=src.dtype, pin_memory=True) for _ in range(2)]
    pending: list[tuple[torch.cuda.Event, torch.Tensor, int, int]] = []

    def land() -> None:
        event, stage, s, e = pending.pop(0)
        event.synchronize()
        out[s:e].copy_(stage[: e - s])

    with torch.cuda.device(src.device):
        for i, s in enumerate(range(0, flat.numel(), _STAGE_ELEMENTS)):
            e = min(flat.numel(), s + _STAGE_ELEMENTS)
            if len(pending) == 2:
                land()  # frees the staging buffer this chunk goes to
            stage = stages[i % 2]
            stage[: e - s].copy_(flat[s:e], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            pending.append((event, stage, s, e))
        while pending:
            land()


def _put(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src for a finished map (float32; src may be float64 or live on a GPU)."""
    src = src.to(dst.dtype)
    if src.is_cuda and dst.device.type == "cpu":
        _to_host(src, dst)
    else:
        dst.copy_(src)


def _pad_square(t: torch.Tensor, n: int, dims: int) -> torch.Tensor:
    """Zero-pad the last `dims` dimensions of t (each of the same size) to n."""
    m = t.shape[-1]
    if m == n:
        return t
    return F.pad(t, [0, n - m] * dims)


class Capture(Statistic):
    """Mean attention maps as a `Statistic`: sums per group of sequences, finished with intervals from
    `GroupedSums.estimate`; see the module docstring for the conventions.

    ```
    cap = Capture(model, layers=[0, 1, 2], probs=True, groups=4)
    for ids, mask in batches:
        cap.update(ids, mask)           # base model only, stops after layer 2; batches go round-robin over groups
    maps = cap.result()                 # {"scores": [3, T, T], "scores_se": ..., "probs": ..., "count": [T], ...}
    ```
    In a pass of the pipeline (`poslens.engine.runner`) the runner runs the forward with `hooks(hm)` between
    `begin_batch` and `end_batch`, as for any statistic; `update` and `forward` run it with the capture's own
    HookedModel. Options: `layers` (indices, None = all; sorted, negatives count from the end), `per_head`
    (per-head maps besides the head means), `scores`, `probs`, `log_probs` (with `log_partition`), `hidden_cosine`,
    `device` (where the sums live; None = each layer's own device), `query_block` (rows per GEMM; default:
    see `block_rows`), `chunk_bytes` (memory for one block of per-head scores in the chunked path; on the CPU at most
    CPU_BLOCK_ROWS queries a block, `chunk_rows`), `gemm`
    (the head-mean score GEMM: "float32" upcasts q and k; "split-bf16" keeps bfloat16 keys and writes the
    float32 group-summed queries as hi + lo bfloat16 parts, one GEMM [hi | lo] @ [k ; k]^T with exact products
    and float32 accumulation, relative error ~2^-17, on tensor cores; only for bfloat16 keys, else float32;
    "auto" = split-bf16 for bfloat16 models on CUDA, else float32), `groups` (groups of sequences: intervals need
    at least two that hold data).
    """

    name = "attention_maps"

    def __init__(
        self,
        model: PreTrainedModel,
        layers: list[int] | None = None,
        *,
        per_head: bool = False,
        scores: bool = True,
        probs: bool = False,
        log_probs: bool = False,
        hidden_cosine: bool = False,
        device: str | torch.device | None = None,
        query_block: int | None = None,
        chunk_bytes: int = 1 << 28,
        gemm: str = "auto",
        groups: int = 1,
    ) -> None:
        check_supported(model.config)
        check_choice("gemm", gemm, GEMM_MODES)
        self.model = model
        self.base = model.base_model
        self.hm = HookedModel(model)
        n_layers = len(self.hm.layers)
        if layers is None:
            layers = list(range(n_layers))
        for l in layers:
            check_int("layers", l, -n_layers, n_layers - 1)  # whole numbers only: 1.7 is not a layer
        self.layers = sorted({int(l) % n_layers for l in layers})
        if not self.layers:
            raise UsageError("layers must name at least one layer (or be None for all)")
        if not (scores or probs or log_probs or hidden_cosine):
            raise UsageError("nothing to capture: enable scores, probs, log_probs or hidden_cosine")
        self.per_head = per_head
        self.wanted = {"scores": scores, "probs": probs, "log_probs": log_probs, "hidden_cosine": hidden_cosine}
        if device is not None:
            from poslens.engine.models import check_device

            check_device(str(device))
        self.device = None if device is None else torch.device(device)
        self._query_block = None if query_block is None else max(1, int(query_block))
        self.chunk_bytes = int(chunk_bytes)
        self.gemm = gemm
        self.num_heads = model.config.num_attention_heads
        self._slot = {l: k for k, l in enumerate(self.layers)}
        self.groups = check_int("groups", groups, 1)
        super().__init__(self.groups, self.device)  # sums "<key>/<layer>" -> [G, ...]; counts in _count, per row
        self._n = 0  # map size (longest sequence so far)
        self._count = torch.zeros(self.groups, 0, dtype=torch.int64)  # sequences reaching each position, per group
        self._window = torch.zeros(len(self.layers), dtype=torch.int64)
        self._batch: _Batch | None = None

    # ---- hook points read ----------------------------------------------------------------------------

    def hooks(self, hm: HookedModel | None = None) -> dict:
        """The hook points this capture reads: the attention scores of each captured layer, as their factors (the
        post-RoPE ctx.rot_q and ctx.rot_k; no [B, H, T, T] tensor is formed for the head means), and the residual
        stream for `hidden_cosine` (the same for any HookedModel `hm` of the model)."""
        out = {}
        if self.wanted["scores"] or self.wanted["probs"] or self.wanted["log_probs"]:
            for l in self.layers:
                out[f"blocks.{l}.attn.hook_attn_scores"] = from_factors(self._observe)
        if self.wanted["hidden_cosine"]:
            for l in self.layers:
                out[f"blocks.{l}.hook_resid_pre"] = self._hidden
        return out

    # ---- running batches -----------------------------------------------------------------------------

    @torch.no_grad()
    def update(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               group: int | None = None) -> None:
        """Run one batch [B, T] through the base model (no LM head), stopping inside the deepest captured layer.

        `group`: the group of sequences this batch belongs to (default: batches go round-robin over the groups)."""
        ids, mask, batch = self._prepare(input_ids, attention_mask)
        with self._running(batch, group):
            self.hm.run(ids, mask, hooks=self.hooks())
        self._commit(batch)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, group: int | None = None,
                **kwargs):
        """Run the whole model (LM head included) on one batch while capturing; returns the model's output."""
        ids, mask, batch = self._prepare(input_ids, attention_mask)
        with self._running(batch, group):
            out = self.hm.run(ids, mask, hooks=self.hooks(), logits=True, **kwargs)
        self._commit(batch)
        return out

    def begin_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    group: int | None = None) -> None:
        """For a driver that runs the forward itself with `hooks()` (poslens.engine.runner, which sets `self.group` to
        the batch's index): take the batch about to run (checked and aligned as `update` does) into `group` (default
        `self.group`) mod G; `end_batch()` after the forward counts it."""
        _, _, batch = self._prepare(input_ids, attention_mask)
        self.group = check_int("group", self.group if group is None else group, 0) % self.groups  # the runner's
        self._grow(batch.valid.shape[1])
        self._batch = batch

    def end_batch(self) -> None:
        """Count the batch taken by `begin_batch` into its group."""
        batch, self._batch = self._batch, None
        self._commit(batch)

    def _prepare(self, input_ids, attention_mask):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            raise UsageError("input_ids must be an integer tensor of token ids [batch, seq_len]")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
            attention_mask = None if attention_mask is None else attention_mask.reshape(1, -1)
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise UsageError(f"input_ids must have shape [batch, seq_len], got {tuple(input_ids.shape)}")
        device = self.model.get_input_embeddings().weight.device
        vocab = self.model.get_input_embeddings().weight.shape[0]
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab:
            raise UsageError(f"input_ids: token id {lo if lo < 0 else hi} is outside the model's vocabulary "
                             f"[0, {vocab}); use the model's own tokenizer")
        limit = max_positions(self.model)
        if input_ids.shape[-1] > limit:
            raise UsageError(f"input_ids: {input_ids.shape[-1]} tokens are beyond the model's window of {limit} "
                             "positions; use shorter sequences")
        ids = input_ids.to(device)
        b, n = ids.shape
        if attention_mask is not None and tuple(attention_mask.shape) != (b, n):
            raise UsageError(f"attention_mask must have the shape of input_ids {(b, n)}, got "
                             f"{tuple(attention_mask.shape)}")
        if attention_mask is None or bool(attention_mask.bool().all()):
            valid = torch.ones(b, n, dtype=torch.bool, device=device)
            return ids, None, _Batch(valid, None, True)
        m = attention_mask.to(device).bool()
        lengths = m.sum(1)
        if bool((lengths == 0).any()):
            raise UsageError("attention_mask: every row needs at least one real token (a row is all zeros)")
        shift = m.int().argmax(1)  # leading pads
        pos = torch.arange(n, device=device)[None]
        if not torch.equal(m, (pos >= shift[:, None]) & (pos < (shift + lengths)[:, None])):
            raise UsageError("attention_mask rows must be one run of ones (left or right padding), not holes")
        valid = pos < lengths[:, None]
        batch = _Batch(valid, shift if bool(shift.any()) else None, False)
        return ids, attention_mask.to(device), batch

    @contextmanager
    def _running(self, batch: _Batch, group: int | None):
        if group is not None:
            self.group = check_int("group", group, 0) % self.groups
        self._grow(batch.valid.shape[1])
        self._batch = batch
        try:
            yield
        finally:
            self._batch = None

    def _commit(self, batch: _Batch) -> None:
        """Count the batch's sequences per position into its group, then move to the next group."""
        counts = batch.valid.sum(0).cpu()
        self._count[self.group, : counts.shape[0]] += counts
        self.group = (self.group + 1) % self.groups

    # ---- accumulation (called from inside the forward) -----------------------------------------------

    def keys(self) -> list[str]:
        """The maps this capture keeps, in `result`'s order ("log_partition" with `log_probs`)."""
        keys = [k for k in MAP_KEYS if self.wanted[k]]
        return keys + (["log_partition"] if self.wanted["log_probs"] else [])

    def _shape(self, key: str) -> tuple[int, ...]:
        n = self._n
        if key == "hidden_cosine":
            return (n, n)
        heads = (self.num_heads,) if self.per_head else ()
        return heads + ((n,) if key == "log_partition" else (n, n))

    def _dtype(self, key: str) -> torch.dtype:
        return torch.float64 if key == "log_partition" else torch.float32

    def _grow(self, n: int) -> None:
        if n > self._n:
            self._n = n
            self._count = F.pad(self._count, (0, n - self._count.shape[1]))

    def _name(self, key: str, slot: int) -> str:
        return f"{key}/{self.layers[slot]}"

    def _acc(self, key: str, slot: int, device: torch.device) -> torch.Tensor:
        """The sum tensor of (key, layer slot) for the current group: allocated or grown to the map size."""
        return self.sums.buffer(self._name(key, slot), self.group, self._shape(key), dtype=self._dtype(key),
                                device=self.device or device)

    def _observe(self, _, ctx) -> None:
        """Reader of `attn.hook_attn_scores` from its factors: the queries and keys after q/k norm and RoPE, as the
        attention kernel reads them (ctx.rot_q [B, H, T, D], ctx.rot_k [B, K, T, D]; see `hooks`)."""
        batch, query, key, scaling, softcap = self._batch, ctx.rot_q, ctx.rot_k, ctx.scaling, ctx.softcap
        slot = self._slot[ctx.layer]
        window = int(ctx.window or 0)
        self._window[slot] = max(int(self._window[slot]), window)
        with _exact_cuda_matmul(query.is_cuda):
            if self.wanted["scores"] and softcap is None:
                if self.per_head:
                    self._scores_per_head(slot, query, key, scaling, window, batch)
                else:
                    self._scores_gemm(slot, query, key, scaling, window, batch)
            if self.wanted["probs"] or self.wanted["log_probs"] or (self.wanted["scores"] and softcap is not None):
                self._chunked(slot, query, key, scaling, window, softcap, batch)

    def block_rows(self, n: int, in_place: bool = False) -> int:
        """Query rows per GEMM block for sequences of n tokens.

        `in_place`: the block's GEMM accumulates straight into the sums on a GPU (no temporary). Then few large
        blocks win: n/8 rows (at least 1,024) spend 1/16 of the square above the diagonal for nothing and, at
        8,192 tokens on an H100, cost 0.35x an SDPA call of the same layer against 0.72x with 512-row blocks
        (benchmarks/capture_kernels.py). Otherwise 128 rows (512 from 4,096 tokens) bound the temporaries.
        """
        if self._query_block is not None:
            return self._query_block
        if in_place:
            return max(1024, n // 8)
        return 512 if n >= 4096 else 128

    def _scores_gemm(self, slot, query, key, scaling, window, batch) -> None:
        """Sum over sequences and heads of q_i . k_j: group-summed queries, batch and heads in one contraction."""
        b, h, n, d = query.shape
        hkv = key.shape[1]
        qs = query.unflatten(1, (hkv, h // hkv)).sum(2, dtype=torch.float32)  # [B, Hkv, T, D]
        qs = _align(qs, batch, 2).permute(2, 0, 1, 3).reshape(n, b * hkv * d)
        acc = self._acc("scores", slot, query.device)
        split = key.dtype == torch.bfloat16 and (self.gemm == "split-bf16" or (self.gemm == "auto" and query.is_cuda))
        if not split:
            ks = _align(key.float(), batch, 2).permute(2, 0, 1, 3).reshape(n, b * hkv * d)
            for s, e, k0 in _blocks(n, self.block_rows(n, _in_place(acc, query)), window):
                _add_matmul(acc[s:e, k0:e], qs[s:e], ks[k0:e].T, scaling)
            return
        # keys are bfloat16 already (exact); the float32 head sums become hi + lo, both bfloat16, and
        # q.k = hi.k + lo.k is one GEMM over the doubled contraction [hi | lo] @ [k ; k]^T
        ks = _align(key, batch, 2).permute(2, 0, 1, 3).reshape(n, b * hkv * d)
        hi = qs.to(torch.bfloat16)
        hilo = torch.cat([hi, (qs - hi.float()).to(torch.bfloat16)], 1)
        kk = torch.cat([ks, ks], 1)
        for s, e, k0 in _blocks(n, self.block_rows(n, _in_place(acc, query)), window):
            _addmm_bf16_exact(acc[s:e, k0:e], hilo[s:e], kk[k0:e].T, scaling)

    def _scores_per_head(self, slot, query, key, scaling, window, batch) -> None:
        """Per-head sums over sequences of q_i . k_j: the batch folded into the contraction, one bmm per block."""
        b, h, n, d = query.shape
        hkv = key.shape[1]
        qh = _align(query.float(), batch, 2).permute(1, 2, 0, 3).reshape(hkv, h // hkv, n, b * d)
        kh = _align(key.float(), batch, 2).permute(1, 2, 0, 3).reshape(hkv, 1, n, b * d)
        acc = self._acc("scores", slot, query.device).view(hkv, h // hkv, self._n, self._n)
        for s, e, k0 in _blocks(n, self.block_rows(n), window):
            _add_matmul(acc[..., s:e, k0:e], qh[..., s:e, :], kh[..., k0:e, :].transpose(-1, -2), scaling)

    def _chunked(self, slot, query, key, scaling, window, softcap, batch) -> None:
        """Per-head score blocks [B, H, bq, K]: softcapped scores, probabilities, log-probabilities, log-partition."""
        b, h, n, d = query.shape
        hkv = key.shape[1]
        q = _align(query.float(), batch, 2).unflatten(1, (hkv, h // hkv))  # [B, Hkv, G, T, D]
        k = _align(key.float(), batch, 2)[:, :, None]  # [B, Hkv, 1, T, D]
        valid = batch.on(query.device).valid
        seen = visible(n, window, device=query.device)
        rows = chunk_rows(self.chunk_bytes // (16 * b * h * n), n, query.device)
        red = (0,) if self.per_head else (0, 1, 2)

        def add(key_: str, s: int, e: int, k0: int, x: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
            acc = self._acc(key_, slot, query.device)
            x = x.sum(red)
            if hidden is not None:  # entries no sequence sees: 0 in the sum
                x = x.masked_fill_(hidden, 0.0)
            if self.per_head:
                x = x.reshape(h, *x.shape[2:])
            if key_ == "log_partition":
                acc[..., s:e] += x.to(acc.device, acc.dtype)
            else:
                acc[..., s:e, k0:e] += x.to(acc.device)

        def add_seen(key_: str, s: int, e: int, k0: int, x: torch.Tensor, allowed: torch.Tensor) -> None:
            """Add x [B, Hkv, G, bq, K] where the sequence's query sees the key, 0 elsewhere. Unpadded, every
            sequence hides the same entries: summed first, then those zeroed (one pass over the sum, not the block)."""
            if batch.full:
                add(key_, s, e, k0, x, ~allowed)
            else:
                add(key_, s, e, k0, torch.where((valid[:, s:e, None] & allowed)[:, None, None], x, 0.0))

        for s, e, k0 in _blocks(n, rows, window):
            sc = torch.matmul(q[..., s:e, :], k[..., k0:e, :].transpose(-1, -2)) * scaling
            if softcap is not None:
                sc = torch.tanh(sc / softcap) * softcap
            allowed = seen[s:e, k0:e]
            self._block(slot, s, e, k0, sc, allowed)
            if self.wanted["scores"] and softcap is not None:
                add_seen("scores", s, e, k0, sc, allowed)
            if self.wanted["probs"] or self.wanted["log_probs"]:
                hide = torch.zeros(allowed.shape, device=sc.device).masked_fill_(~allowed, -math.inf)  # [bq, K]
                logits = sc.add_(hide)  # -inf where hidden: one vectorised pass over the block, sc not read again
                logp = torch.log_softmax(logits, -1)  # log p_ij = s_ij - log Z_i, one fused pass
                # log Z_i = s_ii - log p_ii: query i always sees key i, at column i - k0 of the block
                lse = logits.diagonal(s - k0, -2, -1) - logp.diagonal(s - k0, -2, -1)  # [B, Hkv, G, bq]
                if self.wanted["probs"]:
                    add_seen("probs", s, e, k0, logp.exp(), allowed)
                if self.wanted["log_probs"]:
                    add_seen("log_probs", s, e, k0, logp, allowed)
                    add("log_partition", s, e, k0,
                        lse if batch.full else torch.where(valid[:, None, None, s:e], lse, 0.0))

    def _block(self, slot: int, s: int, e: int, k0: int, scores: torch.Tensor, allowed: torch.Tensor) -> None:
        """Sees each block of per-head scores of the chunked path, [B, Hkv, G, e - s, e - k0] (queries s .. e - 1,
        keys k0 .. e - 1; `allowed` [e - s, e - k0]: the entries the softmax sees): a subclass's reader of what the
        head means lose (poslens.analyses.length.maps's per-sequence lag fit). Nothing here."""

    def _hidden(self, x: torch.Tensor, ctx) -> None:
        """Reader of `hook_resid_pre`: sums of the cosine similarity of the residual-stream vectors."""
        b, n, _ = x.shape
        xn = _align(F.normalize(x.float(), dim=-1), self._batch, 1).transpose(0, 1).reshape(n, -1)
        acc = self._acc("hidden_cosine", self._slot[ctx.layer], x.device)
        for s, e, _ in _blocks(n, self.block_rows(n, _in_place(acc, x)), 0):
            _add_matmul(acc[s:e, :e], xn[s:e], xn[:e].T, 1.0)

    # ---- results and persistence ---------------------------------------------------------------------

    def _full(self, key: str, slot: int) -> torch.Tensor:
        """The [G, ...] sums of (key, layer slot) at the current map size (zeros where nothing was added)."""
        name = self._name(key, slot)
        if name not in self.sums:
            dev = self.device or next(self.hm.layers[self.layers[slot]].parameters()).device
            return torch.zeros(self.groups, *self._shape(key), dtype=self._dtype(key), device=dev)
        return _pad_square(self.sums.sums[name], self._n, 1 if key == "log_partition" else 2)

    def _stacked(self, key: str) -> torch.Tensor:
        """The sums of every layer as one host tensor [n_layers, G, ...]."""
        out = torch.zeros(len(self.layers), self.groups, *self._shape(key), dtype=self._dtype(key))
        for slot in range(len(self.layers)):
            if self._name(key, slot) in self.sums:
                _put(out[slot], self._full(key, slot))
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Sums (per group) and counts on the CPU (for poslens.io.checkpoint.save_partial); resume with
        load_state_dict()."""
        state = {f"{k}_sum": self._stacked(k) for k in self.keys()}
        state["count"] = self._count.clone()
        state["sliding_window"] = self._window.clone()
        state["layers"] = torch.tensor(self.layers, dtype=torch.int64)
        state["group"] = torch.tensor([self.group], dtype=torch.int64)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the sums written by state_dict() of a Capture with the same layers, options and groups."""
        expected = {f"{k}_sum" for k in self.keys()} | {"count", "sliding_window", "layers", "group"}
        if set(state) != expected or state["layers"].tolist() != self.layers or \
                state["count"].dim() != 2 or state["count"].shape[0] != self.groups:
            raise UsageError("checkpoint was written by a capture with other layers, options or groups; "
                             "delete it or rerun with the same options")
        self._n = state["count"].shape[1]
        self._count = state["count"].to(torch.int64).clone()
        self._window = state["sliding_window"].to(torch.int64).clone()
        self.group = int(state["group"][0]) % self.groups
        self.sums = GroupedSums(self.groups, self.device)
        for k in self.keys():
            t = state[f"{k}_sum"]
            if tuple(t.shape) != (len(self.layers), self.groups, *self._shape(k)):
                raise UsageError(f"checkpoint {k}_sum has shape {tuple(t.shape)}, expected "
                                 f"{(len(self.layers), self.groups, *self._shape(k))}; per_head differs?")
            for slot, l in enumerate(self.layers):
                dev = self.device or next(self.hm.layers[l].parameters()).device
                self.sums.sums[self._name(k, slot)] = t[slot].to(dev, self._dtype(k)).clone()
                self.sums.counts[self._name(k, slot)] = torch.zeros(self.groups, dtype=torch.float64, device=dev)

    def merge(self, other: Capture) -> None:
        """Add the sums of another Capture of the same model, layers, options and groups (a shard)."""
        if other.layers != self.layers or other.keys() != self.keys() or other.groups != self.groups \
                or other.per_head != self.per_head:
            raise UsageError("merge: the captures differ in layers, options or groups")
        self._grow(other._n)
        self.sums.merge(other.sums)
        self._count[:, : other._n] += other._count
        self._window = torch.maximum(self._window, other._window)

    def all_reduce(self, group=None) -> None:
        """Sum the accumulators over torch.distributed ranks (no-op unless a process group is initialised)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        nccl = "nccl" in str(dist.get_backend(group))
        comm = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        n = torch.tensor([self._n], device=comm)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
        self._grow(int(n.item()))
        for k in self.keys():  # every rank holds every sum, at the agreed size (a rank may have had no batch)
            for slot in range(len(self.layers)):
                full = self._full(k, slot)
                self.sums.sums[self._name(k, slot)] = full
                self.sums.counts.setdefault(self._name(k, slot),
                                            torch.zeros(self.groups, dtype=torch.float64, device=full.device))
        self.sums.all_reduce(group)
        for attr, op in (("_count", dist.ReduceOp.SUM), ("_window", dist.ReduceOp.MAX)):
            x = getattr(self, attr).to(comm)
            dist.all_reduce(x, op=op, group=group)
            setattr(self, attr, x.cpu())

    def _heads(self, key: str) -> int:
        """How many maps a sequence adds to one entry of `key`'s head mean (1 for the residual stream's)."""
        return 1 if key == "hidden_cosine" else self.num_heads

    def _layer_sums(self, key: str, sums: torch.Tensor, count: torch.Tensor) -> GroupedSums:
        """One layer's [G, (H,) ...] sums of `key` as a GroupedSums "m" of head means: head sums (float64 if per
        head, else the float32 sums as kept), counts = sequences reaching each row times heads."""
        gs = GroupedSums(self.groups)
        per_head = self.per_head and key != "hidden_cosine"
        gs.sums["m"] = sums.sum(1, dtype=torch.float64) if per_head else sums
        gs.counts["m"] = count.to(sums.device, torch.float64) * self._heads(key)
        return gs

    def grouped(self, state: dict[str, torch.Tensor] | None = None) -> GroupedSums:
        """The per-group sums (a `state_dict`, default this capture's) as one GroupedSums of head-mean maps named
        `KEY/LAYER`, every one's counts the sequences times heads reaching each query row: what a function of
        several maps (e.g. poslens.analyses.length.maps's leakage metrics) takes its intervals from."""
        state = self.state_dict() if state is None else state
        gs = GroupedSums(self.groups)
        for key in self.keys():
            for slot, layer in enumerate(self.layers):
                one = self._layer_sums(key, state[f"{key}_sum"][slot], state["count"])
                gs.sums[f"{key}/{layer}"], gs.counts[f"{key}/{layer}"] = one.sums["m"], one.counts["m"]
        return gs

    def result(self, level: float = 0.95, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        """Means on the CPU (or `device`): maps [n_layers, (H,) T, T] with NaN where undefined, plus counts and
        windows. Each layer is finished where its sums live (`GroupedSums.estimate` of its head means), then copied
        once (from a GPU through small page-locked staging buffers); `device="cuda"` leaves the maps on the GPU.

        Keys: "scores", "probs", "log_probs", "hidden_cosine" (when enabled), their "<key>_per_head" with
        per_head=True (not hidden_cosine), "log_partition" [n_layers, T] (and "_per_head" [n_layers, H, T]),
        "count" [T] (sequences reaching each position), "layers", "sliding_window" (0 = none), "num_heads",
        "groups" (groups that hold data). With two or more such groups, every head-mean map also has "<key>_se":
        the delete-a-group jackknife standard error of each entry; an interval at `level` is the mean -/+
        "t_quantile" (stored) times the SE.
        """
        n, count_g = self._n, self._count
        count = count_g.sum(0)
        reached = count > 0
        k = sum(int(count_g[g].sum()) > 0 for g in range(self.groups))
        out: dict[str, torch.Tensor] = {}
        target = torch.device("cpu") if device is None else torch.device(device)
        masks: dict[tuple, torch.Tensor] = {}  # (device, window, vector) -> where the mean is defined

        def defined(dev: torch.device, window: int, vector: bool) -> torch.Tensor:
            if (dev, window, vector) not in masks:
                hit = reached.to(dev)
                masks[dev, window, vector] = hit if vector else visible(n, window, device=dev) & hit[:, None]
            return masks[dev, window, vector]

        for key in self.keys():
            vector = key == "log_partition"
            per_head = self.per_head and key != "hidden_cosine"
            shape = (n,) if vector else (n, n)
            mean = torch.empty(len(self.layers), *shape, device=target)
            se = torch.empty(len(self.layers), *shape, device=target) if k >= 2 else None
            each = torch.empty(len(self.layers), self.num_heads, *shape, device=target) if per_head else None
            for slot in range(len(self.layers)):  # one layer at a time: no float64 copy of every map
                window = int(self._window[slot]) if key != "hidden_cosine" else 0
                sums = self._full(key, slot)  # [G, (H,) *shape]
                ok = defined(sums.device, window, vector)  # finish where the sums live (a GPU), one copy per layer
                est = self._layer_sums(key, sums, count_g).estimate(lambda m, ok=ok: torch.where(ok, m["m"], math.nan),
                                                                    level)
                _put(mean[slot], est.value)
                if se is not None:
                    _put(se[slot], est.se)
                if per_head:
                    c = count.to(sums.device, torch.float64).view(n, *([] if vector else [1]))
                    _put(each[slot], torch.where(ok, sums.sum(0, dtype=torch.float64) / c, math.nan))
                del est
            out[key] = mean
            if se is not None:
                out[f"{key}_se"] = se
            if per_head:
                out[f"{key}_per_head"] = each
        out["count"] = count.clone()
        out["layers"] = torch.tensor(self.layers, dtype=torch.int64)
        out["sliding_window"] = self._window.clone()
        out["num_heads"] = torch.full((len(self.layers),), self.num_heads, dtype=torch.int64)
        out["groups"] = torch.tensor([k], dtype=torch.int64)
        if k >= 2:
            out["t_quantile"] = torch.tensor([t_quantile((1 + level) / 2, k - 1)], dtype=torch.float64)
        return out

    def estimate(self, fn, key: str = "scores", level: float = 0.95, keep_replicates: bool = False,
                 support: tuple[float, float] | None = None) -> list[Estimate]:
        """fn(mean map) per captured layer, with a delete-a-group jackknife interval (`GroupedSums.estimate`).

        `fn` takes a float64 [T, T] head-mean map on the CPU (NaN where undefined, as in `result`) and returns a
        tensor or a float (e.g. the size of the diagonal-normalised pattern). Needs all-reduced sums under torchrun.
        keep_replicates: each Estimate keeps its leave-one-group-out values (for paired differences); support: the
        range fn cannot leave (`Estimate.support`).
        """
        if key not in self.keys() or key == "log_partition":
            raise UsageError(f"estimate: key must be one of the captured maps {self.keys()}; got {key!r}")
        reached = self._count.sum(0) > 0
        out = []
        for slot in range(len(self.layers)):
            window = int(self._window[slot]) if key != "hidden_cosine" else 0
            ok = visible(self._n, window) & reached[:, None]
            gs = self._layer_sums(key, self._full(key, slot).cpu(), self._count)
            out.append(gs.estimate(lambda m, ok=ok: fn(torch.where(ok, m["m"], math.nan)), level=level,
                                   keep_replicates=keep_replicates, support=support))
        return out

    def reset(self) -> None:
        """Forget everything accumulated so far."""
        self._n = 0
        self._count = torch.zeros(self.groups, 0, dtype=torch.int64)
        self._window.zero_()
        self.sums = GroupedSums(self.groups, self.device)
        self.group = 0


# ---- one-call helper ------------------------------------------------------------------------------------


def attention_scores(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    layers: list[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    batch_size: int | None = None,
) -> torch.Tensor:
    """Mean pre-softmax scores [n_layers, T, T] (float32 on the CPU, NaN above the diagonal) of a batch.

    `batch_size` splits input_ids into batches of that many sequences (all at once when None).
    """
    cap = Capture(model, layers)
    step = input_ids.shape[0] if batch_size is None else check_int("batch_size", batch_size, 1)
    for s in range(0, input_ids.shape[0], step):
        mask = None if attention_mask is None else attention_mask[s : s + step]
        cap.update(input_ids[s : s + step], mask)
    return cap.result()["scores"]
