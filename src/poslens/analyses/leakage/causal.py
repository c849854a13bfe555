"""The leakage maps of one pass over sequences, with the decomposition's lag log-partition, as an engine Statistic.

`LeakageMaps` reads the dense scores of every layer (`blocks.{l}.attn.hook_attn_scores`) and adds, per group of
sequences, per layer and head:

    scores             s_ij                              (mean map; float32 sums)
    log_partition      l_i = log sum_{j seen by i} exp s_ij
    lag_log_partition  L0_i = log sum_{j seen by i} exp r(i - j)   (the mask-only counterfactual's log-partition)
    key0               A_i0 (attention on key 0: Gu et al.'s alpha_0 is its mean over queries)
and, over heads, the mean probabilities A_ij. r is the lag profile of that sequence's and head's scores in the
two-way fit s_ij = a_i + r(i - j) + e_ij over the visible entries (`two_way_fit`): any constant per query goes
to a_i, so r and L0 are properties of the attention. Every metric is a smooth function of these means, so
`result` gives each one a delete-one-group jackknife interval, per layer (head-mean maps) and per head, on four
domains: all queries or early ones, key 0 in or out.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from poslens.analyses.leakage.metrics import Domain, energy_metrics, leakage_metrics
from poslens.analyses.leakage.position0 import GU_TOKENS
from poslens.engine.families import sliding_windows
from poslens.engine.stats import (
    DEFAULT_GROUPS,
    NONNEGATIVE,
    SHARE,
    Estimate,
    Evaluations,
    GroupedSums,
    Means,
    Statistic,
)
from poslens.errors import UsageError, check_int
from poslens.masks import visible

# (name, early queries only, key 0 in the domain): every metric is reported on each
VARIANTS = (("all", False, True), ("all_no_key0", False, False), ("early", True, True),
            ("early_no_key0", True, False))
METRICS = ("scores/trf", "scores/drift", "scores/dr2_q", "scores/dr2_k", "scores/dr2_abs", "scores/sink_excess",
           "scores/early_key_slope", "scores/energy", "scores/offset_share", "log_probs/trf", "log_probs/drift",
           "attn/e_total", "attn/mask_only", "attn/residual", "attn/cross", "attn/share_mask_only",
           "attn/share_residual", "attn/share_cross")
HEAD_MEAN_ONLY = ("probs/trf", "probs/drift")  # the probabilities are kept as a head mean only
ENERGIES = ("attn/e_total", "attn/mask_only", "attn/residual", "scores/energy")
# the range each metric cannot leave (a residual fraction, an R^2 increment, a share of a map's own energy: [0, 1];
# an energy and its terms' shares of e_total: [0, inf)); the others are signed. Every interval is cut to it.
SUPPORT = {**dict.fromkeys(("scores/trf", "scores/dr2_q", "scores/dr2_k", "scores/dr2_abs", "scores/offset_share",
                            "log_probs/trf", "probs/trf"), SHARE),
           **dict.fromkeys((*ENERGIES, "attn/share_mask_only", "attn/share_residual"), NONNEGATIVE)}
# metrics of earlier releases: old name -> the name now, or None where it is gone (docs/leakage.md, "Renamed")
RENAMED = {"split/e_total": "attn/e_total", "cf/mask_only": "attn/mask_only", "cf/absolute_scores": "attn/residual",
           "cf/cross": "attn/cross", "cf/share_mask_only": "attn/share_mask_only",
           "cf/share_absolute_scores": "attn/share_residual", "cf/share_cross": "attn/share_cross",
           "split/e_logit": "scores/energy", "split/fraction": "log_probs/trf", "split/e_partition": None,
           "split/cross": None, "split/share_logit": None, "split/share_partition": None, "split/share_cross": None,
           "cf/mask_only_over_partition": None}


def over_layers(values: torch.Tensor, names: tuple[str, ...] = METRICS + HEAD_MEAN_ONLY) -> torch.Tensor:
    """[V, M] from metrics [V, M, L, ...] (M = len(names), or the first len(values[1]) of them): the energies
    (ENERGIES) summed over layers (and heads), every other metric averaged (NaN where a layer's value is)."""
    flat = values.flatten(2)
    summed = torch.tensor([n in ENERGIES for n in names[: values.shape[1]]], device=values.device)
    return torch.where(summed[None], flat.sum(-1), flat.mean(-1))


def two_way_fit(scores: torch.Tensor, visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The least-squares fit s_ij = a_i + r(i - j) + e_ij over the visible entries of score maps [..., T, T]
    (-inf where a key is hidden; `visible`: their isfinite, when the caller has it): (a [..., T], r [..., T]),
    float64, r fixed by sum_d r_d = 0 over the offsets seen and -inf at offsets no query sees.

    A constant c_i added to row i is absorbed by a_i: r and the residual e do not change. The visible offsets of
    query i must be 0 .. k_i - 1 (a causal mask, with or without a sliding window), the same in every map. The
    fit is linear in s (it needs only the row sums and the diagonal sums of s), so the fit of a mean map is the
    mean of the maps' fits. Eliminating a_i = (row_i - sum_{d < k_i} r_d) / k_i leaves M r = b with
    M = diag(n_d) - C^T diag(1/k) C (C_id = 1[d < k_i], n_d = #{i : k_i > d}) and b = diag - C^T (row / k); M
    has the constant as its one null direction (every query sees offset 0), so (M + 1 1^T / D) r = b is solved
    exactly with sum r = 0 (b sums to 0).
    """
    rows, r, keys = _lag_fit(scores, visible)
    t = scores.shape[-1]
    a = (rows - r.cumsum(-1).gather(-1, (keys - 1).expand(*r.shape[:-1], t))) / keys.to(torch.float64)
    r = torch.cat([r, torch.full((*r.shape[:-1], t - r.shape[-1]), -torch.inf, dtype=torch.float64)], -1)
    return a.to(scores.device), r.to(scores.device)


def _lag_fit(scores: torch.Tensor, visible: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row sums [..., T], the lag profile r [..., D] over the offsets seen, k [T]: the keys each query sees), float64
    on the CPU (`two_way_fit`; the mask checked once)."""
    t = scores.shape[-1]
    visible = torch.isfinite(scores) if visible is None else visible
    keys = visible.sum(-1)  # k_i
    offset = torch.arange(t, device=scores.device)[:, None] - torch.arange(t, device=scores.device)
    if not torch.equal(visible, (offset >= 0) & (offset < keys[..., None])):
        raise UsageError(NOT_CAUSAL)
    first = keys.reshape(-1, t)[0]
    if not bool((keys == first).all()):
        raise UsageError("the two-way fit needs one mask for every map of a batch")
    first = first.cpu()
    z = torch.where(visible, scores, 0.0)  # sums in the scores' precision (float32 or better), solved in float64
    rows = z.sum(-1).to(torch.float64).cpu()
    return rows, lag_profile(rows, _diagonal_sums(z).to(torch.float64).cpu(), first), first


NOT_CAUSAL = ("the mask-only counterfactual needs a causal mask (with or without a sliding window): every query must "
              "see the keys at offsets 0 .. k - 1")


def lag_profile(rows: torch.Tensor, diagonals: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The lag profile r [..., D] of the two-way fit (`two_way_fit`) from what it needs of the scores: their row
    sums [..., T] and lower-diagonal sums [..., >= D] over the visible entries (float64, on any device), for the
    mask whose query i sees the keys at offsets 0 .. keys[i] - 1 (`keys` on the CPU; D = max keys: the offsets
    seen). Sums over the top-left T x T block give the fit at length T, so one pass can give the fits at several
    lengths."""
    solve, cover, k = _lag_solver(tuple(keys.tolist()), rows.device)
    b = diagonals[..., : cover.shape[1]] - (rows / k) @ cover
    return b @ solve  # the solver is symmetric


def lag_partition(r: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """L0_i = log sum_{d < keys[i]} exp r_d [..., T] for a lag profile r [..., D] (`lag_log_partition`)."""
    cumulative = torch.logcumsumexp(r, -1)  # log sum_{d' <= d} exp r_d' (every query sees offset 0: k_i >= 1)
    return cumulative.gather(-1, (keys.to(r.device) - 1).expand(*r.shape[:-1], len(keys)))


@functools.lru_cache(maxsize=32)
def _lag_solver(keys: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """((M + 1 1^T / D)^-1 [D, D], C [T, D], k [T]) in float64 on `device` for the mask whose query i sees keys[i]
    offsets (D: the offsets seen); solved on the CPU, copied to the device once."""
    k = torch.tensor(keys, dtype=torch.float64)
    seen = int(max(keys))
    cover = (torch.arange(seen)[None, :] < k[:, None]).to(torch.float64)
    m = torch.diag(cover.sum(0)) - cover.T @ (cover / k[:, None]) + 1.0 / seen
    return torch.linalg.inv(m).to(device), cover.to(device), k.to(device)


@functools.lru_cache(maxsize=32)
def causal_layout(t: int, window: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The implicit mask of a layer for t tokens (`masks.visible`: causal, a sliding window of `window` keys, 0:
    none): (the keys each query sees [T] on the CPU, the same on `device`, the mask [T, T] on `device`), made once."""
    seen = visible(t, window)
    keys = seen.sum(-1)
    return keys, keys.to(device), seen.to(device)


def layer_lag_log_partition(z: torch.Tensor, keys: torch.Tensor, keys_on: torch.Tensor) -> torch.Tensor:
    """L0 [..., T] (float64, on z's device) of scores whose hidden keys are zeroed, z [..., T, T], under the mask
    whose query i sees `keys[i]` keys (`causal_layout`; the caller has checked the mask): `lag_log_partition` without
    a mask check or a copy to the CPU, for a statistic that reads every layer of every batch."""
    rows = z.sum(-1).to(torch.float64)
    return lag_partition(lag_profile(rows, _diagonal_sums(z).to(torch.float64), keys), keys_on)


def lag_log_partition(scores: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
    """L0 [..., T] (float64): the log-partition of the lag profile alone under the causal mask,
    L0_i = log sum over the visible j of exp r(i - j), with r from `two_way_fit` (so invariant, with r - L0, to
    any per-query constant added to the scores). The visible offsets of query i are 0 .. k_i - 1, so
    L0_i = logcumsumexp(r)_{k_i - 1}. Purely relative scores phi(i - j) + g(i) give r - L0 = phi - log sum exp phi:
    the causal softmax of phi (the mask-only counterfactual)."""
    _, r, keys = _lag_fit(scores, visible)
    return lag_partition(r, keys).to(scores.device)


def _diagonal_sums(x: torch.Tensor) -> torch.Tensor:
    """[..., T] sums of x [..., T, T] over each lower diagonal: out_d = sum_k x_{d+k, k}.

    Diagonal d of a row-major T x T block starts at flat index d T and steps by T + 1; past the last row it
    runs into T (T + 1) zeros of padding, so one strided view [T, T] holds every diagonal as a row."""
    t = x.shape[-1]
    flat = x.reshape(-1, t * t)
    padded = torch.nn.functional.pad(flat, (0, t * (t + 1)))
    diagonals = padded.as_strided((flat.shape[0], t, t), (padded.stride(0), t, t + 1))
    return diagonals.sum(-1).reshape(*x.shape[:-2], t)


@dataclass(frozen=True)
class Domains:
    """The domain settings every pass shares: largest offset (None: n // 2) and the early queries (i <= this)."""

    max_offset: int | None = None
    early_queries: int = 32
    early_keys: int = 64

    def __post_init__(self) -> None:
        if self.max_offset is not None:
            check_int("max_offset", self.max_offset, 1)
        check_int("early_queries", self.early_queries, 2)
        check_int("early_keys", self.early_keys, 2)

    def of(self, n: int, early: bool, first_key: bool, window: int = 0) -> Domain:
        """The domain for maps of size n (a sliding-window layer keeps offsets below its window)."""
        top = None if self.max_offset is None else min(self.max_offset, n - 1)
        return Domain(max_offset=top, first_key=first_key, max_query=min(self.early_queries, n - 1) if early else None,
                      window=window or None)


def evaluate(means: dict[str, torch.Tensor], domains: Domains, windows: list[int],
             names: tuple[str, ...] = METRICS, metrics=leakage_metrics) -> torch.Tensor:
    """Metrics `names` of mean maps over the VARIANTS: [V, M, L, ...] float64 (maps [L, ..., n, n]; layer l
    uses windows[l]). `means`: scores, log_partition, lag_log_partition and optionally probs. `metrics`: the
    function that computes them (`metrics.energy_metrics` when only energies are asked for)."""
    n = means["scores"].shape[-1]
    by_window: dict[int, list[int]] = {}
    for l, w in enumerate(windows):
        by_window.setdefault(w, []).append(l)
    out = torch.empty(len(VARIANTS), len(names), *means["scores"].shape[:-2], dtype=torch.float64)
    for w, layers in by_window.items():  # layers that share a window share a domain: one vectorised call
        maps = means if len(by_window) == 1 else {k: x[layers] for k, x in means.items()}
        for v, (_, early, first_key) in enumerate(VARIANTS):
            vals = metrics(maps, domains.of(n, early, first_key, w), domains.early_keys)
            out[v][:, layers] = torch.stack([vals[k] for k in names])
    return out


MEAN_SCORES = "mean_scores"  # the scores' head mean, its own float64 sums [L, T, T] (`LeakageMaps._add_scores`)


def head_mean(means: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-head means [L, H, ...] averaged over heads (the probabilities are already a head mean; the scores'
    head mean is read from its own sums, `MEAN_SCORES`, where they are kept, not from the per-head maps)."""
    own = MEAN_SCORES in means
    out = {k: means[k] if k == "probs" else means[k].mean(1) for k in means
           if k not in ("key0", MEAN_SCORES) and not (own and k == "scores")}
    if own:
        out["scores"] = means[MEAN_SCORES]
    return out


class LeakageMaps(Statistic):
    """Mean maps of one pass (see the module docstring) and every leakage metric with its interval."""

    name = "leakage_maps"
    KEYS = ("scores", MEAN_SCORES, "log_partition", "lag_log_partition", "key0", "probs")
    per_head = True  # the scores' sums per head (per-head metrics); LayerMaps: their head mean alone

    def __init__(self, groups: int = DEFAULT_GROUPS, domains: Domains | None = None) -> None:
        super().__init__(groups)
        self.domains = domains or Domains()
        self.windows: list[int] = []
        self._masks_ok: torch.Tensor | None = None

    def hooks(self, hm) -> dict:
        self.windows = [int(w or 0) for w in sliding_windows(hm.model.config)]
        self._layers = hm.n_layers
        return {f"blocks.{l}.attn.hook_attn_scores": self._read for l in range(hm.n_layers)}

    def _read(self, s: torch.Tensor, ctx) -> None:
        """Add one layer's scores [B, H, T, T] of a batch to the sums, on the scores' device: no copy to the CPU and
        no wait for the device (the mask is checked there, `check_masks` reads the result once)."""
        if ctx.attention_mask is not None:
            raise UsageError("leakage maps need unpadded sequences of one length (no attention mask)")
        b, h, t, _ = s.shape
        s = s.float()
        keys, keys_on, mask = causal_layout(t, int(ctx.window or 0) if (ctx.window or 0) < t else 0, s.device)
        seen = torch.isfinite(s)
        fits = torch.eq(seen, mask).all()  # the implicit mask, every score under it finite (a device flag)
        self._masks_ok = fits if self._masks_ok is None else self._masks_ok & fits
        z = torch.where(seen, s, 0.0)
        logp = torch.log_softmax(s, -1)  # hidden keys (-inf) drop out; one fused pass
        lse = s.diagonal(0, -2, -1) - logp.diagonal(0, -2, -1)  # [B, H, T]: log Z_i = s_ii - log p_ii (i sees i)
        probs = logp.exp_()
        L, l, g, f32, dev = self._layers, ctx.layer, self.group, torch.float32, s.device
        buf = self.sums.buffer
        self._add_scores(z, l, g)
        buf("log_partition", g, (L, h, t), device=dev)[l] += lse.sum(0).double()
        buf("lag_log_partition", g, (L, h, t), device=dev)[l] += layer_lag_log_partition(z, keys, keys_on).sum(0)
        buf("key0", g, (L, h, t), device=dev)[l] += probs[..., 0].sum(0).double()
        buf("probs", g, (L, t, t), dtype=f32, device=dev)[l] += probs.sum((0, 1)) / h
        if l == L - 1:  # the deepest point read: the batch is complete
            for key in self.KEYS:
                self.sums.count_buffer(key, g).add_(b)

    def _add_scores(self, z: torch.Tensor, layer: int, group: int) -> None:
        """The scores' sums: per head [L, H, T, T] in float32 (`per_head`), and their head mean [L, T, T] in float64
        (each batch's float32 sums over its sequences, averaged over heads), which every per-layer metric reads: the
        same numbers in every pass, with or without the per-head maps (`LayerMaps`)."""
        b, h, t, _ = z.shape
        total = z.sum(0)
        if self.per_head:
            self.sums.buffer("scores", group, (self._layers, h, t, t), dtype=torch.float32, device=z.device)[layer] \
                += total
        self.sums.buffer(MEAN_SCORES, group, (self._layers, t, t), device=z.device)[layer] += total.double().sum(0) / h

    @classmethod
    def group_bytes(cls, layers: int, heads: int, tokens: int) -> int:
        """The bytes of one group's sums (without their counts) on a model of `layers` x `heads` at `tokens`:
        the per-head float32 scores (`per_head`), the float64 head-mean scores, the float64 log-partitions, lag
        log-partitions and attention on key 0 per head, the float32 head-mean probabilities."""
        per_head = layers * heads * tokens * tokens * 4 if cls.per_head else 0
        return per_head + layers * tokens * tokens * 8 + 3 * layers * heads * tokens * 8 + layers * tokens * tokens * 4

    def state_dict(self) -> dict[str, torch.Tensor]:
        self.check_masks()  # a checkpoint holds only batches whose mask was checked (a resumed run has no flag)
        return super().state_dict()

    def check_masks(self) -> None:
        """A UsageError if a batch's scores were not finite exactly under the implicit causal (or sliding-window)
        mask: what the lag fit assumes (one wait for the device, when the sums are read)."""
        if self._masks_ok is not None and not bool(self._masks_ok):
            raise UsageError(NOT_CAUSAL)

    def windows_for(self, n_layers: int) -> list[int]:
        return self.windows or [0] * n_layers

    def result(self, level: float = 0.95) -> dict[str, torch.Tensor]:
        """Head-mean metrics `metrics` [V, M, L] (VARIANTS x METRICS + HEAD_MEAN_ONLY), per-head metrics
        `metrics_heads` [V, M, L, H] (METRICS), `alpha0` [L, H] and `alpha0_64` (first 64 queries), each with
        `_lo`/`_hi`/`_se`, and the mean maps (float32)."""
        return {**self.estimates(level)[0], **self.maps()}

    def estimates(self, level: float = 0.95) -> tuple[dict[str, torch.Tensor], dict[str, Estimate]]:
        """(tensors for the results format, the Estimates by name)."""
        self.check_masks()
        ests = {"metrics": self.sums.estimate(self.layer_metrics, level=level),
                **({"metrics_heads": self.sums.estimate(self.head_metrics, level=level)} if self.per_head else {}),
                **self.alpha0_estimates(level)}
        out = {}
        for name, e in ests.items():
            out.update(e.as_dict(name))
        return out, ests

    def alpha0_estimates(self, level: float = 0.95) -> dict[str, Estimate]:
        """Gu et al.'s alpha_0 [L, H] over every query (`alpha0`) and over the first 64 (`alpha0_64`): mean
        attention weights, so their estimates and intervals are cut to [0, 1]."""
        return {"alpha0": self.sums.estimate(lambda m: alpha0(m["key0"], windows=self.windows), level=level,
                                             support=SHARE),
                "alpha0_64": self.sums.estimate(lambda m: alpha0(m["key0"], GU_TOKENS, self.windows), level=level,
                                                support=SHARE)}

    def layer_metrics(self, means: dict[str, torch.Tensor]) -> torch.Tensor:
        """[V, M, L] on head-mean maps: METRICS then HEAD_MEAN_ONLY."""
        maps = head_mean(means)  # the per-head maps are not read
        return evaluate(maps, self.domains, self.windows_for(maps["scores"].shape[0]), METRICS + HEAD_MEAN_ONLY)

    def head_metrics(self, means: dict[str, torch.Tensor], names: tuple[str, ...] = METRICS,
                     metrics=leakage_metrics) -> torch.Tensor:
        """[V, M, L, H] per head (`names`, computed by `metrics`; `causal.evaluate`)."""
        if not self.per_head:
            raise UsageError("per-head metrics need the per-head maps: this pass kept their head mean alone "
                             "(LayerMaps); run it with LeakageMaps")
        m = {k: means[k] for k in ("scores", "log_partition", "lag_log_partition")}
        return evaluate(m, self.domains, self.windows_for(means["scores"].shape[0]), names, metrics)

    def head_energies(self, means: dict[str, torch.Tensor]) -> torch.Tensor:
        """[V, E, L, H] the energies (ENERGIES) per head, and nothing else (the per-head contrasts' cost)."""
        return self.head_metrics(means, ENERGIES, energy_metrics)

    def evaluated(self, name: str) -> Evaluations:
        """`layer_metrics` ("layers"), `head_metrics` ("heads") or `head_energies` ("energies") on the pooled means
        and on every leave-one-group-out means (`GroupedSums.evaluate`), computed once while the sums stay as they
        are: every contrast that reads this pass (`contrast.py`, `nulls.paired_with_starts`) combines these."""
        fn = {"layers": self.layer_metrics, "heads": self.head_metrics, "energies": self.head_energies}[name]
        state = tuple((k, v.data_ptr(), v._version) for store in (self.sums.sums, self.sums.counts)
                      for k, v in store.items())  # a sum added to, replaced or loaded: evaluated again
        if getattr(self, "_evaluated", (None,))[0] != state:
            self.check_masks()
            self._evaluated = (state, {})
        done = self._evaluated[1]
        if name not in done:
            done[name] = self.sums.evaluate(fn)
        return done[name]

    def maps(self) -> dict[str, torch.Tensor]:
        """The head-mean mean maps and per-head attention on key 0, float32."""
        self.check_masks()
        means = {k: self.sums.mean(k) for k in self.KEYS if k != "scores"}
        out = {f"maps/{k}": v.float() for k, v in head_mean(means).items()}
        out["maps/key0"] = means["key0"].float()
        return out


class LayerMaps(LeakageMaps):
    """`LeakageMaps` without the per-head score sums: the scores' head mean alone (`MEAN_SCORES`, [L, T, T] float64),
    for a pass whose per-head metrics nothing reads (the nulls, the interventions on the offset null's windows): 2 / H
    of the memory of the per-head float32 sums, which dominate a large model's (docs/leakage.md, "Where the time and
    the memory go"). Every per-layer metric reads the same head-mean sums as in `LeakageMaps`: the same numbers.
    Log-partitions and the attention on key 0 stay per head."""

    KEYS = tuple(k for k in LeakageMaps.KEYS if k != "scores")
    per_head = False


def alpha0(key0: torch.Tensor, tokens: int | None = None, windows: list[int] | None = None) -> torch.Tensor:
    """Gu et al.'s alpha_0 per layer and head from mean attention on key 0 [L, H, T]: its mean over queries
    (the first `tokens` queries: exactly what sequences of that length give, by causality). A sliding-window layer
    of W keys (`windows[l]`, 0: none) hides key 0 from queries i >= W: its mean is over queries 0 .. W - 1."""
    key0 = key0 if tokens is None else key0[..., :tokens]
    if not windows or not any(windows):
        return key0.mean(-1)
    return torch.stack([key0[l, ..., : (w or key0.shape[-1])].mean(-1) for l, w in enumerate(windows)])


def joint(statistics: dict[str, LeakageMaps]) -> GroupedSums:
    """One GroupedSums over several passes, names prefixed by the pass (`orig/scores`, ...), sharing storage,
    so that a function of two passes gets a paired jackknife (the passes must share groups and sequences)."""
    groups = {s.sums.groups for s in statistics.values()}
    if len(groups) != 1:
        raise UsageError(f"passes with different numbers of groups cannot be compared: {sorted(groups)}")
    out = GroupedSums(groups.pop())
    for prefix, stat in statistics.items():
        for k, v in stat.sums.sums.items():
            out.share(f"{prefix}/{k}", v, stat.sums.counts[k])
    return out


def unprefix(means: Mapping[str, torch.Tensor], prefix: str) -> Means:
    """The means of one pass out of a `joint` dict."""
    p = f"{prefix}/"
    return Means([k[len(p):] for k in means if k.startswith(p)], lambda k: means[p + k])  # lazy as `means` is
