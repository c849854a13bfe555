"""Averages over sequences with confidence intervals: sums kept for G independent groups of sequences.

Every statistic poslens reports is a function f of means over sequences (a mean map, a ratio of two means, the
Toeplitz residual of a mean map, ...). The engine assigns batch b to group b mod G and keeps, for every named
quantity x, the sums S_g = sum of x over the sequences of group g and the counts C_g (how many sequences reached
each entry). Then

    pooled mean        m = sum_g S_g / sum_g C_g
    leave-one-out      m_(g) = (S - S_g) / (C - C_g)
    jackknife          theta = f(m),  se^2 = (G' - 1)/G' * sum_g (f(m_(g)) - mean_g f(m_(g)))^2
    interval           theta -/+ t_{G'-1, (1+level)/2} * se

over the G' groups that hold data (delete-a-group jackknife; Efron & Tibshirani 1993, ch. 11). A bootstrap over
groups (percentile interval) is available too. A quantity with a range it cannot leave (a share: [0, 1]; a mean
square: [0, inf)) declares it as `support=` where it is estimated: the estimate and its interval are cut to that
range, and run.json records it (`Estimate.support`). Sums are float64 unless asked otherwise; maps use float32 sums
(the capture accumulates in float32 on the device) and are finished in float64.

`GroupedSums` is the storage; `Rows` keeps per-sequence values that are gathered rather than summed (one row per
sequence, e.g. a per-head statistic whose test needs every sequence); `Statistic` is the protocol every analysis
implements on top of them (hooks to read, `state_dict`/`load_state_dict` to resume, `merge` and `all_reduce` to
combine shards, `result` to finalise).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from poslens.errors import UsageError, check_choice, check_float, check_int

DEFAULT_GROUPS = 20
NONNEGATIVE = (0.0, math.inf)  # the range of a mean square, an energy, a loss, an error (`Estimate.support`)
SHARE = (0.0, 1.0)  # the range of a share or a fraction
METHODS = ("jackknife", "bootstrap")


def t_quantile(p: float, df: int) -> float:
    """Quantile of Student's t distribution with `df` degrees of freedom (numerical CDF inversion, |error| < 1e-9)."""
    check_float("p", p, 0.0, 1.0, lo_open=True, hi_open=True)
    check_int("df", df, 1)
    return _t_quantile(float(p), int(df))


@functools.lru_cache(maxsize=1024)
def _t_quantile(p: float, df: int) -> float:  # the same few (p, df) recur for every interval of a run: once each
    if p < 0.5:
        return -_t_quantile(1.0 - p, df)
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:  # 0.5 + integral_0^x of the density, Simpson's rule on 4,000 intervals
        t = np.linspace(0.0, x, 4001)
        f = np.exp(log_c - (df + 1) / 2 * np.log1p(t * t / df))
        h = x / 4000
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def jackknife(value: torch.Tensor, reps: torch.Tensor, level: float = 0.95, keep: bool = False,
              support: tuple[float, float] | None = None) -> Estimate:
    """The delete-one-group jackknife of `value` = f(all groups) from its replicates [k, ...] (f without group g):
    standard error sqrt((k - 1) / k sum_g (r_g - mean r)^2), a t-interval on k - 1 degrees of freedom, the
    bias-corrected value. Of a difference f(A) - f(B) of two statistics on the same groups of the same sequences,
    the replicates are the differences of theirs: that is the paired interval. keep: the replicates kept.
    support: the range f cannot leave (`Estimate.support`)."""
    k = int(reps.shape[0])
    kept = reps.clone() if keep else None
    centre = reps.mean(0)
    debiased = k * value - (k - 1) * centre
    se = torch.sqrt((k - 1) / k * reps.sub_(centre).pow_(2).sum(0))  # in place: the replicates are GBs for maps
    t = t_quantile((1 + level) / 2, k - 1)
    return Estimate(value, value - t * se, value + t * se, se, k, level, "jackknife", debiased, kept, support)


@dataclass
class Estimate:
    """A point estimate with its confidence interval. Tensors share the estimate's shape (NaN where undefined)."""

    value: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    se: torch.Tensor
    groups: int  # groups that held data (G')
    level: float
    method: str
    # jackknife only: the bias-corrected point estimate G' f(all) - (G' - 1) mean_g f(all but g); for a quadratic
    # function of the group means (an energy ||P mean||^2) with equal groups it is the unbiased U-statistic
    # sum_{g != h} <P m_g, P m_h> / (G' (G' - 1)): the plug-in's noise term tr(P Sigma P) / N removed
    debiased: torch.Tensor | None = None
    # jackknife with keep_replicates only: f(all but g) for each group g that held data, [groups, *value.shape];
    # two estimates on the same groups of the same sequences pair through them (`jackknife`: f(A) - f(B))
    replicates: torch.Tensor | None = None
    # the range [low, high] the quantity cannot leave (a share: (0, 1); a mean square: (0, inf)), or None: value, lo
    # and hi are cut to it as the estimate is made (`within`), and `item` records it; se, debiased and the
    # replicates are kept as they are
    support: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.support is None:
            return
        low, high = (-math.inf if self.support[0] is None else float(self.support[0]),  # None: run.json's inf
                     math.inf if self.support[1] is None else float(self.support[1]))
        self.support = (low, high)
        self.value, self.lo, self.hi = (t.clamp(min=low, max=high) for t in (self.value, self.lo, self.hi))

    def __getitem__(self, index) -> Estimate:
        """Element `index` of every tensor (e.g. one statistic of an estimate of several)."""
        index = index if isinstance(index, tuple) else (index,)
        return Estimate(self.value[index], self.lo[index], self.hi[index], self.se[index], self.groups, self.level,
                        self.method, None if self.debiased is None else self.debiased[index],
                        None if self.replicates is None else self.replicates[(slice(None), *index)], self.support)

    def within(self, low: float = -math.inf, high: float = math.inf) -> Estimate:
        """The estimate and its interval cut to [low, high], the range the quantity cannot leave (a mean square:
        [0, inf); a share: [0, 1]), recorded as its `support` (within the support it had). The true value lies
        inside the range, so the cut interval keeps its coverage; the point estimate is cut too, so it stays inside
        its interval. The bias-corrected value (`debiased`) is kept as it is: an unbiased estimate may fall outside
        the range, and its mean over models must not be biased by cutting each one."""
        if self.support is not None:
            low, high = max(low, self.support[0]), min(high, self.support[1])
        return Estimate(self.value, self.lo, self.hi, self.se, self.groups, self.level, self.method, self.debiased,
                        support=(low, high))

    def as_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """Tensors named `prefix`, `prefix_lo`, `prefix_hi`, `prefix_se` (the results format)."""
        return {prefix: self.value, f"{prefix}_lo": self.lo, f"{prefix}_hi": self.hi, f"{prefix}_se": self.se}

    def item(self) -> dict[str, float | int | str]:
        """A scalar estimate as plain numbers for run.json."""
        return {"value": float(self.value), "lo": float(self.lo), "hi": float(self.hi), "se": float(self.se),
                "level": self.level, "groups": self.groups, "method": self.method} | (
            {"support": list(self.support)} if self.support is not None else {})


def over_seeds(values: Sequence[torch.Tensor | float], level: float = 0.95,
               support: tuple[float, float] | None = None,
               shared: Sequence[torch.Tensor | float] | None = None) -> Estimate:
    """The mean of one estimate over m models (seeds) with a t-interval over them: mean -/+ t_{m-1} sd / sqrt(m)
    (NaN interval for m < 2; a NaN value makes the mean and its interval NaN). `support`: the range the quantity
    cannot leave (a share: (0, 1); an entropy gap: (0, inf)); the mean and its interval are cut to it
    (`Estimate.within`). `shared`: each model's interval half-width over a sample of text that every model read:
    that sample's error is common to all seeds, so the spread over seeds does not show it and more seeds do not
    shrink it; the half-width is then sqrt(h_seeds^2 + mean_s h_s^2), the root-mean-square of the models' own
    half-widths added in quadrature (conservative: it counts the part of their noise that differs between seeds
    twice)."""
    check_float("level", level, 0.0, 1.0, lo_open=True, hi_open=True)
    x = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in values])
    m = x.shape[0]
    mean = x.mean(0)
    if m < 2:
        nan = torch.full_like(mean, math.nan)
        return Estimate(mean, nan, nan.clone(), nan.clone(), m, level, "t over seeds", support=support)
    t = t_quantile((1 + level) / 2, m - 1)
    half = t * x.std(0, correction=1) / math.sqrt(m)
    if shared is not None:
        h = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in shared])
        half = torch.sqrt(half ** 2 + (h ** 2).mean(0))
    return Estimate(mean, mean - half, mean + half, half / t, m, level, "t over seeds", support=support)


def _pad_to(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Zero-pad the trailing dimensions of t (the leading group axis excluded) up to `shape`."""
    if tuple(t.shape[1:]) == tuple(shape):
        return t
    pad: list[int] = []
    for have, want in zip(reversed(t.shape[1:]), reversed(shape)):
        pad += [0, want - have]
    return F.pad(t, pad)


@dataclass(frozen=True)
class Evaluations:
    """A function of grouped means on the pooled means (`value`) and on each leave-one-group-out means
    (`replicates` [k, ...] over `groups`, the groups that held data; None with fewer than two):
    `GroupedSums.evaluate`."""

    value: torch.Tensor
    replicates: torch.Tensor | None
    groups: tuple[int, ...]


def combine(fn: Callable[..., torch.Tensor], parts: Sequence[Evaluations], level: float = 0.95,
            keep: bool = False, support: tuple[float, float] | None = None) -> Estimate:
    """The jackknife Estimate of fn(a, b, ...) from evaluations of a, b, ... on the same groups of the same sequences
    (each pass's statistics evaluated once, reused by every function of them): fn of the values, and fn of each
    group's replicates, so the interval of a function of several passes is paired. Equal to `GroupedSums.estimate`
    of the same function on the joint sums, number for number. support: the range fn cannot leave
    (`Estimate.support`)."""
    groups = {p.groups for p in parts}
    if len(groups) != 1:
        raise UsageError(f"estimates on different groups of sequences cannot be combined: {sorted(groups)}")
    held = groups.pop()
    value = torch.as_tensor(fn(*(p.value for p in parts)), dtype=torch.float64)
    if len(held) < 2:
        nan = torch.full_like(value, math.nan)
        return Estimate(value, nan, nan.clone(), nan.clone(), len(held), level, "jackknife", support=support)
    reps = torch.stack([torch.as_tensor(fn(*(p.replicates[k] for p in parts)), dtype=torch.float64)
                        for k in range(len(held))])
    return jackknife(value, reps, level, keep, support)


class Means(Mapping):
    """The pooled means of a GroupedSums by name, each computed when first read (a function of a few quantities
    does not pay for the others: maps of long sequences are GBs)."""

    def __init__(self, names: list[str], compute: Callable[[str], torch.Tensor]) -> None:
        self._names, self._compute, self._done = names, compute, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._done:
            if name not in self._names:
                raise KeyError(name)
            self._done[name] = self._compute(name)
        return self._done[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class Totals(dict):
    """(sum over groups, count over groups) by name, computed when first read (`GroupedSums._totals`): a function of
    a few quantities does not pay for the float64 totals of the others."""

    def __init__(self, total: Callable[[str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self._total = total

    def __missing__(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        self[name] = value = self._total(name)
        return value


class GroupedSums:
    """Named sums and counts kept per group of sequences: `add`, then `mean` or `estimate` (see module docstring).

    Trailing shapes may grow (maps grow with the longest sequence seen): a larger value zero-pads what is stored.
    `device`: where sums live (None: the device of the first value added).
    """

    def __init__(self, groups: int = DEFAULT_GROUPS, device: str | torch.device | None = None) -> None:
        self.groups = check_int("groups", groups, 1)
        self.device = None if device is None else torch.device(device)
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}
        self.only: dict[str, tuple[int, ...]] = {}  # names read over some groups alone (`share`)

    def __contains__(self, name: str) -> bool:
        return name in self.sums

    def names(self) -> list[str]:
        return list(self.sums)

    def share(self, name: str, sums: torch.Tensor, counts: torch.Tensor, groups: Sequence[int] | None = None) -> None:
        """Hold sums [G, ...] and counts [G, ...] kept elsewhere under `name`, without copying them (read-only here:
        for estimates over several statistics' sums). `groups`: only these groups' sums and counts count, the
        others' read as 0 (a part of the same sequences, e.g. one half of the groups, with no copy of its sums)."""
        if sums.shape[0] != self.groups or counts.shape[0] != self.groups:
            raise UsageError(f"statistic {name!r}: {sums.shape[0]} groups shared into {self.groups}")
        self.sums[name] = sums
        if groups is None:
            self.counts[name] = counts
            self.only.pop(name, None)
            return
        only = tuple(sorted({check_int("group", int(g), 0, self.groups - 1) for g in groups}))
        self.counts[name] = counts.double() * self._keep(only, counts.device).reshape(-1, *(1,) * (counts.dim() - 1))
        self.only[name] = only

    def _keep(self, only: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """1.0 for the groups in `only`, 0.0 for the others [G] (float64)."""
        keep = torch.zeros(self.groups, dtype=torch.float64, device=device)
        keep[list(only)] = 1.0
        return keep

    def _writable(self, name: str) -> None:
        if name in self.only:
            raise UsageError(f"statistic {name!r} is a read-only part of other sums (`share`); add to the sums it "
                             "was shared from")

    def _whole(self) -> None:
        if self.only:
            raise UsageError("these sums hold parts of other sums (`share` with groups): save, merge or reduce the "
                             "sums they were shared from")

    def buffer(self, name: str, group: int, shape: tuple[int, ...], count_shape: tuple[int, ...] = (),
               dtype: torch.dtype = torch.float64, device: torch.device | None = None) -> torch.Tensor:
        """The sum tensor of (name, group), at least `shape`, for accumulating into in place (e.g. a GEMM); on
        `device` when given (sums restored from a checkpoint on the CPU move there once)."""
        self._writable(name)
        self._ensure(name, shape, count_shape, dtype, device)
        if device is not None and self.device is None and self.sums[name].device != torch.device(device):
            self.sums[name], self.counts[name] = self.sums[name].to(device), self.counts[name].to(device)
        return self.sums[name][group % self.groups]

    def count_buffer(self, name: str, group: int) -> torch.Tensor:
        """The count tensor of (name, group), for adding counts in place after `buffer`."""
        return self.counts[name][group % self.groups]

    def add(self, name: str, group: int, total: torch.Tensor | float, count: torch.Tensor | float = 1) -> None:
        """`S[name][group] += total; C[name][group] += count` (count broadcasts against total)."""
        self._writable(name)
        total = torch.as_tensor(total)
        count = torch.as_tensor(count, dtype=torch.float64)
        dtype = total.dtype if total.dtype in (torch.float32, torch.float64) else torch.float64
        self._ensure(name, tuple(total.shape), tuple(count.shape), dtype, total.device)
        g = group % self.groups
        s = self.sums[name]
        s[g][tuple(slice(0, k) for k in total.shape)] += total.to(s.device, s.dtype)
        c = self.counts[name]
        c[g][tuple(slice(0, k) for k in count.shape)] += count.to(c.device)

    def _ensure(self, name: str, shape: tuple[int, ...], count_shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device | None) -> None:
        if name not in self.sums:
            dev = self.device or device or torch.device("cpu")
            self.sums[name] = torch.zeros(self.groups, *shape, dtype=dtype, device=dev)
            self.counts[name] = torch.zeros(self.groups, *count_shape, dtype=torch.float64, device=dev)
            return
        s, c = self.sums[name], self.counts[name]
        if s.dim() - 1 != len(shape) or c.dim() - 1 != len(count_shape):
            raise UsageError(f"statistic {name!r}: shape {shape} does not match the stored {tuple(s.shape[1:])}")
        self.sums[name] = _pad_to(s, tuple(max(a, b) for a, b in zip(s.shape[1:], shape)))
        self.counts[name] = _pad_to(c, tuple(max(a, b) for a, b in zip(c.shape[1:], count_shape)))

    # ---- finishing ------------------------------------------------------------------------------------

    def _totals(self) -> Totals:
        """(sum over groups in float64, count over groups) by name, each computed when first read: what every
        leave-one-out mean starts from."""
        return Totals(self._total)

    def _total(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        s, c = self.sums[name], self.counts[name]
        only = self.only.get(name)
        if only is None:
            return s.sum(0, dtype=torch.float64), c.sum(0)
        tot = torch.zeros(s.shape[1:], dtype=torch.float64, device=s.device)
        for g in only:  # in group order, as sum(0) over zeroed copies adds (float32 sums in float64: exact)
            tot += s[g]
        return tot, c.sum(0)

    def _means(self, drop: int | None = None, weights: torch.Tensor | None = None,
               totals: Totals | None = None) -> Means:
        """Pooled means in float64 (NaN where no sequence counted), each computed when first read; `drop`: leave
        that group out; `weights`: group multiplicities (bootstrap); `totals`: `_totals()`, when several means are
        taken from the same sums."""
        return Means(list(self.sums), lambda name: self._mean(name, drop, weights, totals))

    def _mean(self, name: str, drop: int | None, weights: torch.Tensor | None, totals: Totals | None) -> torch.Tensor:
        s, c = self.sums[name], self.counts[name]
        only = self.only.get(name)
        own = True  # tot is this call's own tensor (divided in place: maps can be GBs)
        if weights is not None:
            w = weights.to(s.device, torch.float64)
            if only is not None:
                w = w * self._keep(only, s.device)
            tot = (s.double() * w.reshape((-1,) + (1,) * (s.dim() - 1))).sum(0)
            cnt = (c * w.reshape((-1,) + (1,) * (c.dim() - 1))).sum(0)
        else:
            tot, cnt = totals[name] if totals is not None else self._total(name)
            own = totals is None
            if drop is not None and (only is None or drop in only):
                tot, cnt, own = torch.sub(tot, s[drop]), cnt - c[drop], True
        cnt = cnt.reshape(tuple(cnt.shape) + (1,) * (tot.dim() - cnt.dim()))
        if bool((cnt > 0).all()):
            return tot.div_(cnt) if own else tot / cnt
        return torch.where(cnt > 0, tot / cnt.clamp(min=1e-300), math.nan)

    def mean(self, name: str) -> torch.Tensor:
        """Pooled mean of one quantity (float64)."""
        return self._means()[name]

    def filled(self) -> list[int]:
        """Groups that hold at least one counted sequence."""
        if not self.counts:
            return []
        first = next(iter(self.counts.values()))
        return [g for g in range(self.groups) if float(first[g].max() if first[g].numel() else 0) > 0]

    def estimate(self, fn: Callable[[dict[str, torch.Tensor]], torch.Tensor | float], level: float = 0.95,
                 method: str = "jackknife", replicates: int = 1000, seed: int = 0,
                 keep_replicates: bool = False, support: tuple[float, float] | None = None) -> Estimate:
        """f(pooled means) with a confidence interval from the groups (jackknife or bootstrap over groups);
        keep_replicates: the jackknife's leave-one-group-out values kept in the Estimate (`Estimate.replicates`);
        support: the range f cannot leave (a share: (0, 1)), to which the estimate and its interval are cut.

        `fn` takes the dict of pooled float64 means and returns a tensor or float. Fewer than two groups with data:
        the interval is NaN (a single group gives no spread to measure)."""
        check_float("level", level, 0.0, 1.0, lo_open=True, hi_open=True)
        check_choice("method", method, METHODS)
        if method == "jackknife":
            ev = self.evaluate(fn)
            if ev.replicates is None:
                nan = torch.full_like(ev.value, math.nan)
                return Estimate(ev.value, nan, nan.clone(), nan.clone(), len(ev.groups), level, method,
                                support=support)
            return jackknife(ev.value, ev.replicates, level, keep_replicates, support)
        value = torch.as_tensor(fn(self._means()), dtype=torch.float64)
        groups = self.filled()
        nan = torch.full_like(value, math.nan)
        if len(groups) < 2:
            return Estimate(value, nan, nan.clone(), nan.clone(), len(groups), level, method, support=support)
        gen = torch.Generator().manual_seed(seed)
        idx = torch.tensor(groups)
        reps = []
        for _ in range(check_int("replicates", replicates, 10)):
            pick = idx[torch.randint(len(groups), (len(groups),), generator=gen)]
            w = torch.bincount(pick, minlength=self.groups)
            reps.append(torch.as_tensor(fn(self._means(weights=w)), dtype=torch.float64))
        r = torch.stack(reps)
        q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
        lo, hi = torch.nanquantile(r, q[0], dim=0), torch.nanquantile(r, q[1], dim=0)
        return Estimate(value, lo, hi, r.std(0), len(groups), level, method, support=support)

    def evaluate(self, fn: Callable[[dict[str, torch.Tensor]], torch.Tensor | float]) -> Evaluations:
        """fn on the pooled means and, with two or more groups holding data, on each leave-one-group-out means:
        what the jackknife of fn, or of any function of fn and other statistics' evaluations on the same groups
        (`combine`), needs; computed once, however many functions of it are estimated."""
        totals = self._totals()
        value = torch.as_tensor(fn(self._means(totals=totals)), dtype=torch.float64)
        groups = self.filled()
        reps = None if len(groups) < 2 else torch.stack(
            [torch.as_tensor(fn(self._means(drop=g, totals=totals)), dtype=torch.float64) for g in groups])
        return Evaluations(value, reps, tuple(groups))

    # ---- persistence and combination ------------------------------------------------------------------

    def to(self, device: str | torch.device) -> GroupedSums:
        """Every sum and count moved to `device` (in place; returns self): sums kept on an accelerator while a run
        adds to them go to the CPU once, before they are finished."""
        self.sums = {k: v.to(device) for k, v in self.sums.items()}
        self.counts = {k: v.to(device) for k, v in self.counts.items()}
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Sums and counts on the CPU, by name (`sum/NAME`, `count/NAME`)."""
        self._whole()
        out = {f"sum/{k}": v.detach().cpu() for k, v in self.sums.items()}
        out.update({f"count/{k}": v.detach().cpu() for k, v in self.counts.items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` wrote (same number of groups)."""
        sums = {k[4:]: v for k, v in state.items() if k.startswith("sum/")}
        counts = {k[6:]: v for k, v in state.items() if k.startswith("count/")}
        if set(sums) != set(counts) or any(v.shape[0] != self.groups for v in sums.values()):
            raise UsageError(f"saved statistics do not match: expected {self.groups} groups and a count per sum; "
                             "rerun with the same groups or start over")
        dev = self.device
        self.sums = {k: v.clone() if dev is None else v.to(dev) for k, v in sums.items()}
        self.counts = {k: counts[k].double().clone() if dev is None else counts[k].double().to(dev) for k in sums}

    def merge(self, other: GroupedSums) -> None:
        """Add another shard's sums (same groups; shapes may differ and are padded)."""
        if other.groups != self.groups:
            raise UsageError(f"cannot merge statistics with {other.groups} groups into {self.groups} groups")
        self._whole()
        other._whole()
        for name, s in other.sums.items():
            self._ensure(name, tuple(s.shape[1:]), tuple(other.counts[name].shape[1:]), s.dtype, s.device)
            mine = self.sums[name]
            mine[(slice(None), *(slice(0, k) for k in s.shape[1:]))] += s.to(mine.device, mine.dtype)
            c, oc = self.counts[name], other.counts[name]
            c[(slice(None), *(slice(0, k) for k in oc.shape[1:]))] += oc.to(c.device)

    def all_reduce(self, group=None) -> None:
        """Sum over torch.distributed ranks (no-op without a process group). Shapes are first agreed (max)."""
        import torch.distributed as dist

        self._whole()
        if not (dist.is_available() and dist.is_initialized()):
            return
        names: list[list[str]] = [[] for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(names, sorted(self.sums), group=group)
        if any(n != names[0] for n in names):
            raise UsageError("ranks hold different statistics; every rank must run the same analysis")
        nccl = "nccl" in str(dist.get_backend(group))
        comm = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        for name in names[0]:
            for store in (self.sums, self.counts):
                t = store[name]
                shape = torch.tensor(t.shape[1:], dtype=torch.int64, device=comm)
                dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
                x = _pad_to(t, tuple(shape.tolist())).to(comm)
                dist.all_reduce(x, group=group)
                store[name] = x.to(t.device)


class Rows:
    """Per-sequence values, one row per sequence in sequence order: `add(name, rows)` per batch, `get(name)` the
    rows so far. Shards are gathered (rank order is sequence order, since each rank holds a contiguous block), not
    summed. Kept on the device they were computed on until read (`get` gives them on the CPU)."""

    def __init__(self) -> None:
        self.parts: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, rows: torch.Tensor) -> None:
        """Append `rows` [batch, ...] under `name` (kept on their device until read: no wait per batch)."""
        self.parts.setdefault(name, []).append(rows.detach() if rows.device.type == "cpu" else rows.detach().clone())

    def get(self, name: str) -> torch.Tensor | None:
        """All rows of `name` [sequences, ...] on the CPU, or None when there are none."""
        parts = self.parts.get(name)
        return torch.cat([p.cpu() for p in parts]) if parts else None

    def names(self) -> list[str]:
        return list(self.parts)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The rows by name (`rows/NAME`)."""
        return {f"rows/{k}": self.get(k) for k in self.parts if self.parts[k]}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` wrote (other keys are ignored)."""
        self.parts = {k[5:]: [v.clone()] for k, v in state.items() if k.startswith("rows/")}

    def merge(self, other: Rows) -> None:
        """Append another shard's rows (the shard that follows this one)."""
        for k, parts in other.parts.items():
            self.parts.setdefault(k, []).extend(parts)

    def all_gather(self, group=None) -> None:
        """Every rank's rows, in rank order, on every rank (no-op without a process group)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, {k: self.get(k) for k in self.parts}, group=group)
        names = sorted(set().union(*gathered))
        self.parts = {k: [g[k] for g in gathered if g.get(k) is not None] for k in names}


class Statistic:
    """An average over sequences computed from hook points: subclass, declare `hooks`, finish in `result`.

    The runner (`poslens.engine.runner`) sets `self.group` before each batch, calls `begin_batch(input_ids,
    attention_mask)` and `end_batch()` around its forward when the statistic has them, and calls `hooks(hm)` once
    per run; each hook adds to `self.sums` (a GroupedSums) or, for values kept per sequence, to `self.rows` (Rows).
    Persistence and combination come from the sums and rows; a statistic with other state overrides them.
    `intervals` says how `result` makes its intervals (`poslens stat` prints it; {groups}: the groups of sequences).
    """

    name = "statistic"
    intervals = "jackknife over {groups} groups of sequences"

    def __init__(self, groups: int = DEFAULT_GROUPS, device: str | torch.device | None = None) -> None:
        self.sums = GroupedSums(groups, device)
        self.rows = Rows()
        self.group = 0

    def hooks(self, hm) -> dict[str, Callable]:
        """Hook point name -> function(x, ctx) for the points this statistic reads."""
        raise NotImplementedError

    def check_model(self, hm) -> None:
        """Checks that need the loaded model, before any sequence is cut (a one-line UsageError); none by default."""

    def check_length(self, seq_len: int) -> None:
        """Checks of the statistic's options against the sequence length, before any sequence is cut (a one-line
        UsageError); none by default."""

    def result(self, level: float = 0.95) -> dict[str, torch.Tensor]:
        """Finished tensors (means with `_lo`/`_hi`/`_se`), ready for the results format."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**self.sums.state_dict(), **self.rows.state_dict()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.sums.load_state_dict(state)
        self.rows.load_state_dict(state)

    def merge(self, other: Statistic) -> None:
        self.sums.merge(other.sums)
        self.rows.merge(other.rows)

    def all_reduce(self, group=None) -> None:
        """Sum the sums and gather the rows over torch.distributed ranks (no-op without a process group)."""
        self.sums.all_reduce(group)
        self.rows.all_gather(group)
