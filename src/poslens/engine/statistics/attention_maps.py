"""Mean attention maps of every layer (the capture engine, `poslens.engine.capture.Capture`) as a statistic.

What `poslens scores` averages: per layer the mean over sequences and heads of the pre-softmax scores
q_i . k_j * scaling (and, on request, the attention probabilities, their logs and log-partitions, per-head maps
and the hidden-state cosine similarity), with a delete-a-group jackknife standard error of every entry. No
[B, H, T, T] tensor is formed for the head-mean scores (the capture reads q and k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poslens.engine.capture import Capture
from poslens.engine.statistics.spec import Spec
from poslens.engine.stats import DEFAULT_GROUPS, Statistic
from poslens.options import option


class AttentionMaps(Statistic):
    """The capture engine as a `Statistic`: its hooks, its sums, its `result`."""

    name = "attention_maps"

    def __init__(self, model, layers: list[int] | None = None, *, per_head: bool = False, probs: bool = False,
                 log_probs: bool = False, hidden_cosine: bool = False, groups: int = DEFAULT_GROUPS,
                 device: str | torch.device | None = None) -> None:
        super().__init__(groups)
        self.capture = Capture(model, layers=layers, per_head=per_head, probs=probs, log_probs=log_probs,
                               hidden_cosine=hidden_cosine, device=device, groups=groups)

    def hooks(self, hm) -> dict:
        return self.capture.hooks()

    def begin_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        self.capture.begin_batch(input_ids, attention_mask, group=self.group)

    def end_batch(self) -> None:
        self.capture.end_batch()

    def result(self, level: float = 0.95) -> dict[str, torch.Tensor]:
        """`Capture.result`: maps [layers, T, T] with `_se`, counts, layers, windows."""
        return self.capture.result(level=level)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.capture.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.capture.load_state_dict(state)

    def merge(self, other: AttentionMaps) -> None:
        self.capture.merge(other.capture)

    def all_reduce(self, group=None) -> None:
        self.capture.all_reduce(group)


@dataclass
class AttentionMapsOptions:
    """`poslens stat attention_maps`: what to capture besides the head-mean scores."""

    layers: list[int] | None = option(None, help="comma-separated layer indices, negatives from the end (default "
                                      "all)")
    probs: bool = option(False, help="also keep mean attention probabilities")


SPEC = Spec("attention_maps", "mean pre-softmax attention scores of every layer (what `poslens scores` averages)",
            AttentionMapsOptions, lambda hm, o, groups: AttentionMaps(hm.model, o.layers, probs=o.probs, groups=groups))
