"""Held-out next-token loss by position, from the final norm's output and the model's own LM head.

For a sequence x_0 .. x_{T-1} and target position t = 1 .. T-1,

    loss_t = -log softmax(z_{t-1})[x_t],   z = cap(s W_U h)   (h: the final norm's output, W_U: the LM head,
                                                               s: Cohere's logit_scale, else 1, cap: Gemma-2's
                                                               final softcap c tanh(z / c), if any)

which is the cross-entropy transformers' `model(ids, labels=ids).loss` averages. The logits are formed a block of
positions at a time in float32 (never a [B, T, V] tensor) and the per-position sums are float64. Per group of
sequences (batch b -> group b mod G) the statistic keeps sum_t loss_t and the count at every t, and the same per
position bucket [e_k, e_{k+1}); curves and buckets are means over tokens with delete-one-group jackknife intervals
over the sequences, and `joined` puts several passes or models side by side for paired contrasts (compare.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from poslens.analyses.length.masks import right_padded
from poslens.analyses.length.points import final_norm_point
from poslens.engine.stats import DEFAULT_GROUPS, NONNEGATIVE, Estimate, Statistic
from poslens.errors import check_int, require

BINS_PER_L = 4  # the loss curve's figure and tensors: bins of L / 4 target positions
LOSS = NONNEGATIVE  # the range a mean cross-entropy cannot leave: every interval of one is cut to it


def doubling_edges(train_len: int, eval_len: int) -> list[int]:
    """Bucket edges [1, L, 2L, 4L, ..., eval_len]: the training range, then each doubling past it."""
    train_len, eval_len = check_int("train_len", train_len, 2), check_int("eval_len", eval_len, 2)
    edges = [1]
    e = train_len
    while e < eval_len:
        edges.append(e)
        e *= 2
    return edges + [eval_len]


def lm_logits(model, h: torch.Tensor) -> torch.Tensor:
    """The model's logits for final-norm outputs h [..., d], in float32 (with Cohere's logit_scale, Gemma-2's final
    softcap)."""
    z = model.get_output_embeddings()(h)
    scale = getattr(model, "logit_scale", None)  # Cohere's LM head output times logit_scale, in the model's dtype
    z = (z * scale if scale is not None else z).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(z / cap) * cap if cap else z


class PositionLoss(Statistic):
    """Next-token loss at every target position and per position bucket (see the module docstring).

    `edges`: bucket edges e_0 < e_1 < ... (target positions t with e_k <= t < e_{k+1}); `chunk_bytes`: memory of one
    block of float32 logits.
    """

    name = "position_loss"

    def __init__(self, edges: Sequence[int], groups: int = DEFAULT_GROUPS, chunk_bytes: int = 1 << 26) -> None:
        super().__init__(groups)
        edges = [check_int("edges", e, 1) for e in edges]
        require(len(edges) >= 2 and all(a < b for a, b in zip(edges, edges[1:])),
                f"edges must be at least two increasing target positions, e.g. [1, 128, 256]; got {edges}")
        self.edges, self.chunk_bytes = edges, check_int("chunk_bytes", chunk_bytes, 1)
        self.model = None
        self._ids: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None

    def hooks(self, hm) -> dict:
        self.model = hm.model
        return {final_norm_point(hm): self._read}

    def begin_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """The batch's token ids (the targets) and which are real tokens (a right-padded mask, or none)."""
        self._ids = input_ids
        self._valid = None if attention_mask is None else right_padded(attention_mask)

    def _read(self, h: torch.Tensor, ctx) -> None:
        ids = self._ids.to(h.device)
        b, n, _ = h.shape
        vocab = self.model.get_output_embeddings().weight.shape[0]
        rows = max(1, self.chunk_bytes // (4 * b * vocab))
        nll = torch.empty(b, n - 1, dtype=torch.float64, device=h.device)
        for s in range(0, n - 1, rows):
            e = min(n - 1, s + rows)
            z = lm_logits(self.model, h[:, s:e])
            target = ids[:, s + 1:e + 1, None]
            nll[:, s:e] = torch.log_softmax(z, -1).gather(-1, target)[..., 0].neg().double()  # one fused pass
        valid = None if self._valid is None else self._valid[:, 1:].to(h.device)
        self.add_nll(nll, valid)

    def add_nll(self, nll: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add per-token losses nll [B, T - 1] (target positions 1 .. T-1; `valid` marks real targets) to the
        current group: the per-position sums and the bucket sums."""
        if valid is None:
            valid = torch.ones_like(nll, dtype=torch.bool)
        n = nll.shape[1] + 1
        x = torch.where(valid, nll.double(), 0.0)
        per_pos = torch.cat([x.new_zeros(1), x.sum(0)]).cpu()  # index = target position t
        count = torch.cat([x.new_zeros(1), valid.sum(0).double()]).cpu()
        self.sums.add("nll", self.group, per_pos, count)
        k = len(self.edges) - 1
        bucket = torch.zeros(k, dtype=torch.float64)
        tokens = torch.zeros(k, dtype=torch.float64)
        for i in range(k):
            lo, hi = self.edges[i], min(self.edges[i + 1], n)
            if lo < hi:
                bucket[i], tokens[i] = per_pos[lo:hi].sum(), count[lo:hi].sum()
        self.sums.add("bucket", self.group, bucket, tokens)

    def curve(self, level: float = 0.95) -> Estimate:
        """Mean loss at every target position t (index t; NaN at t = 0 and where no sequence reached), with
        jackknife intervals over the groups of sequences."""
        return self.sums.estimate(lambda m: m["nll"], level, support=LOSS)

    def buckets(self, level: float = 0.95) -> Estimate:
        """Mean loss per token in each bucket [e_k, e_{k+1}), with jackknife intervals."""
        return self.sums.estimate(lambda m: m["bucket"], level, support=LOSS)

    def spans(self, spans: Sequence[tuple[int, int]], level: float = 0.95) -> Estimate:
        """Mean loss over target positions [lo, hi) for each span, with jackknife intervals (every sequence must
        reach every position of a span, so the mean over positions is the mean over tokens)."""
        check_spans(self, spans)
        return self.sums.estimate(lambda m: span_means(m["nll"], spans), level, support=LOSS)

    def result(self, level: float = 0.95) -> dict[str, torch.Tensor]:
        """`loss` [T] and `bucket_loss` [K], each with `_lo`, `_hi`, `_se`; `edges` [K + 1]."""
        out = {**self.curve(level).as_dict("loss"), **self.buckets(level).as_dict("bucket_loss")}
        out["edges"] = torch.tensor(self.edges)
        return out



def check_spans(stat: PositionLoss, spans: Sequence[tuple[int, int]]) -> None:
    """Every span [lo, hi) lies in 1 .. T-1 and every group counts the same sequences at each of its positions."""
    counts = stat.sums.counts.get("nll")
    require(counts is not None, "no batch has been added to this statistic yet")
    for lo, hi in spans:
        require(1 <= lo < hi <= counts.shape[1], f"span [{lo}, {hi}) must lie in the target positions "
                                                 f"1..{counts.shape[1] - 1}")
        block = counts[:, lo:hi]
        require(bool((block == block[:, :1]).all()), f"span [{lo}, {hi}): not every sequence reaches every "
                                                     "position (padding); use spans the shortest sequence covers")


def bin_spans(train_len: int, n: int) -> list[tuple[int, int]]:
    """The loss curve's bins: target positions [s, s + L/4) from 1 up to n (the figure's points)."""
    width = max(1, train_len // BINS_PER_L)
    return [(max(1, s), min(n, s + width)) for s in range(0, n, width) if min(n, s + width) > max(1, s)]


def span_means(curve: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Means of a per-position curve over each span [lo, hi)."""
    return torch.stack([curve[lo:hi].mean() for lo, hi in spans])
