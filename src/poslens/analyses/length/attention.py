"""Attention entropy and the share on key 0 at every query position, per layer (head means), with intervals.

For query i of one head, with scores s_ij over the keys it sees (the causal mask, the layer's window, an explicit
run mask) and p_ij = softmax_j(s_ij):

    H_i  = -sum_j p_ij log p_ij                                            (nats; 0 log 0 = 0)
    a_i  = p_i0                                                            (the share on key 0, the sink)
    u_i  = log #{j seen by i}                                              (H of uniform attention: log(i + 1)
                                                                            under the plain causal mask)

each averaged over heads and summed over sequences per group. The scores are formed a block of queries at a time
from the queries and keys the attention kernel reads (after any q/k norm, RoPE and any write at the query point,
e.g. the log-n scaling), so no [B, H, T, T] tensor is kept. The gap u_i - H_i >= 0 is how far the layer is from
attending uniformly to everything it sees; attention that fades with length keeps H_i close to log(i + 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from poslens.analyses.length.masks import allowed_from, right_padded
from poslens.analyses.length.points import rotated
from poslens.engine.capture import chunk_rows
from poslens.engine.hooks import from_factors
from poslens.engine.statistics.spec import Spec
from poslens.engine.stats import DEFAULT_GROUPS, NONNEGATIVE, SHARE, Estimate, Statistic
from poslens.errors import check_int
from poslens.masks import allowed
from poslens.options import option

QUANTITIES = ("entropy", "key0", "log_keys")
# the range each quantity (and the gap) cannot leave: an entropy and the gap are >= 0, a_i is a share
SUPPORT = {"entropy": NONNEGATIVE, "key0": SHARE, "log_keys": NONNEGATIVE, "gap": NONNEGATIVE}


class AttentionProfile(Statistic):
    """H_i, a_i and u_i per layer and query position (see the module docstring); `layers`: None = all; `every`: read
    queries i = 0, k, 2k, ... only (the others are NaN), for a k-fold cheaper reader on long sequences."""

    name = "attention_profile"

    def __init__(self, layers: list[int] | None = None, groups: int = DEFAULT_GROUPS, every: int = 1,
                 chunk_bytes: int = 1 << 24) -> None:
        super().__init__(groups)
        self.layers, self.chunk_bytes = layers, check_int("chunk_bytes", chunk_bytes, 1)
        self.every = check_int("every", every, 1)
        self._valid: torch.Tensor | None = None

    def hooks(self, hm) -> dict:
        layers = range(hm.n_layers) if self.layers is None else self.layers
        return {f"blocks.{l}.attn.hook_attn_scores": from_factors(self._read) for l in layers}

    def begin_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Which queries and keys are real tokens (right padding, or none)."""
        self._valid = None if attention_mask is None else right_padded(attention_mask)

    def _read(self, _, ctx) -> None:
        q, k = rotated(ctx)
        b, h, n, d = q.shape
        hkv = k.shape[1]
        qg = q.float().unflatten(1, (hkv, h // hkv))  # [B, K, H/K, T, D]
        kg = k.float()[:, :, None]  # [B, K, 1, T, D]
        valid = None if self._valid is None else self._valid.to(q.device)
        explicit = allowed_from(ctx.attention_mask, ctx)
        queries = torch.arange(0, n, self.every, device=q.device)
        rows = chunk_rows(self.chunk_bytes // (4 * b * h * n), len(queries), q.device)
        sums = {name: torch.zeros(n, dtype=torch.float64, device=q.device) for name in QUANTITIES}
        for block in queries.split(rows):
            e = int(block[-1]) + 1
            sc = torch.matmul(qg[..., block, :], kg[..., :e, :].transpose(-1, -2)) * ctx.scaling  # [B, K, G, r, e]
            if ctx.softcap is not None:
                sc = torch.tanh(sc / ctx.softcap) * ctx.softcap
            if explicit is not None:
                ok = explicit[:, :, block, :e].to(q.device)
            else:
                keys = None if valid is None else valid[:, :e]
                ok = allowed(e, int(ctx.window or 0), keys, device=q.device)[:, :, block]
            ok = ok[:, :, None]  # [B or 1, 1, 1, r, e] against the scores' [B, K, G, r, e]
            sc.masked_fill_(~ok, -math.inf)
            logp = torch.log_softmax(sc, -1)
            p = torch.exp(logp, out=sc)  # the probabilities, in the scores' place
            key0 = p[..., 0].mean((1, 2))
            # H_i = -sum_j p_ij log p_ij; a hidden key's 0 * -inf is NaN, left out of the sum (0 log 0 = 0); a query
            # that sees no key stays NaN, as its probabilities
            entropy = logp.mul_(p).nansum(-1).neg_().where(ok.any(-1), math.nan)
            per = {"entropy": entropy.mean((1, 2)), "key0": key0,
                   "log_keys": torch.log(ok.sum(-1).double()).expand(b, 1, 1, len(block)).mean((1, 2))}
            for name, x in per.items():  # x [B, r]: head means; padded queries leave the sums
                x = x.double() if valid is None else torch.where(valid[:, block], x.double(), 0.0)
                sums[name][block] = x.sum(0)
        count = torch.zeros(n, dtype=torch.float64)
        count[queries.cpu()] = float(b) if valid is None else valid[:, queries].sum(0).double().cpu()
        for name, x in sums.items():
            self.sums.add(f"{name}/{ctx.layer}", self.group, x.cpu(), count)

    def layers_read(self) -> list[int]:
        """The layers (from 0) whose sums this statistic holds."""
        return sorted({int(n.split("/")[1]) for n in self.sums.names()})

    def estimate(self, quantity: str, level: float = 0.95, edges: list[int] | None = None) -> Estimate:
        """[layers, T] means of one quantity: entropy, key0, log_keys, or gap (= log_keys - entropy); with `edges`,
        [layers, buckets]: the mean over the queries read in each bucket [e_k, e_{k+1}) of query indices."""
        layers = self.layers_read()

        def f(m):
            rows = [m[f"log_keys/{l}"] - m[f"entropy/{l}"] if quantity == "gap" else m[f"{quantity}/{l}"]
                    for l in layers]
            if edges is not None:
                rows = [torch.stack([x[a:b].nanmean() for a, b in zip(edges, edges[1:])]) for x in rows]
            return torch.stack(rows)

        return self.sums.estimate(f, level, support=SUPPORT[quantity])

    def result(self, level: float = 0.95) -> dict[str, torch.Tensor]:
        """`entropy`, `gap`, `key0` [layers, T] with `_lo`, `_hi`, `_se`; `log_keys` [layers, T]; `layers`."""
        out = {}
        for q in ("entropy", "gap", "key0"):
            out.update(self.estimate(q, level).as_dict(q))
        out["log_keys"] = self.estimate("log_keys", level).value
        out["layers"] = torch.tensor(self.layers_read())
        return out


@dataclass
class AttentionProfileOptions:
    """`poslens stat attention_profile`: which layers, how many queries."""

    layers: list[int] | None = option(None, help="comma-separated layer indices (default all)")
    every: int = option(1, lo=1, help="read queries 0, k, 2k, ... only (a k-fold cheaper reader; the others are NaN)")


SPEC = Spec("attention_profile", "attention entropy, its gap to uniform attention, and the share on key 0, per "
            "layer and query", AttentionProfileOptions,
            lambda hm, o, groups: AttentionProfile(o.layers, groups, o.every))
