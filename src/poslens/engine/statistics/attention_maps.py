"""Mean attention maps of every layer: the capture engine (`poslens.engine.capture.Capture`), registered as a statistic.

What `poslens scores` averages: per layer the mean over sequences and heads of the pre-softmax scores
q_i . k_j * scaling (and, on request, the attention probabilities, their logs and log-partitions, per-head maps
and the hidden-state cosine similarity), with a delete-a-group jackknife standard error of every entry. No
[B, H, T, T] tensor is formed for the head-mean scores (the capture reads q and k).
"""

from __future__ import annotations

from dataclasses import dataclass

from poslens.engine.capture import Capture
from poslens.engine.statistics.spec import Spec
from poslens.options import option


@dataclass
class AttentionMapsOptions:
    """`poslens stat attention_maps`: what to capture besides the head-mean scores."""

    layers: list[int] | None = option(None, help="comma-separated layer indices, negatives from the end (default "
                                      "all)")
    probs: bool = option(False, help="also keep mean attention probabilities")


SPEC = Spec("attention_maps", "mean pre-softmax attention scores of every layer (what `poslens scores` averages)",
            AttentionMapsOptions, lambda hm, o, groups: Capture(hm.model, o.layers, probs=o.probs, groups=groups))
