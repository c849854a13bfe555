"""The predecessor's method (Ruscio, "Once upon a token"): linear Delta R^2 per head with a shuffled-input null.

Per sequence, layer and head, the post-RoPE scores y_ij = q_i . k_j over the causal pairs j <= i (no 1/sqrt(d):
R^2 is scale-free) are fitted by ordinary least squares with an intercept on
    X_rel  = [1, i - j]            (offset only)
    X_full = [1, i - j, i, j]      (offset plus absolute query and key position; rank 3, since i - j = i - j)
on a random 70% of the pairs, and scored by R^2 on the other 30%: Delta R^2 = R^2_full - R^2_rel.
The null re-runs the model on the same tokens circularly shifted by a random k; per head, the gap is the mean
over sequences of Delta R^2 (real) - Delta R^2 (null), with a percentile bootstrap interval (2,000 resamples),
a one-sided sign-flip permutation p-value (H1: real > null) and Benjamini-Hochberg control of the false
discovery rate over all heads (q = 0.05). The linear design cannot see non-linear absolute terms such as
-log(i + 1); `metrics.delta_r2` is the one-hot generalisation.

Power. With R random sign flips the smallest attainable p is 1/(R + 1), and with N sequences no p falls below
2^-N (there are only 2^N sign vectors; when 2^N <= R they are enumerated and p is exact). Benjamini-Hochberg's
first threshold over m tests is q/m: unless the smallest attainable p is below it, not one test can be
significant, whatever the data. The predecessor's 5,000 flips fail that at m = 270 (1/5,001 > 0.05/270); here
R = `permutations_for(m, q)` = ceil(2 m / q) - 1 (10,799 at m = 270), so the smallest p is half BH's first
threshold, and every result states its power (`power`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from poslens.engine.stats import Statistic
from poslens.errors import UsageError, check_float, check_int

TEST_FRACTION = 0.3
BOOTSTRAP = 2000
FDR = 0.05
MARGIN = 2  # the smallest attainable p is 1/MARGIN of Benjamini-Hochberg's first threshold
CHUNK = 512  # sign vectors or bootstrap resamples evaluated at once


def causal_pairs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(i, j) of every causal pair j <= i of an n-token sequence, row by row."""
    i, j = torch.tril_indices(n, n)
    return i, j


def split_pairs(n: int, test_fraction: float = TEST_FRACTION, seed: int = 0) -> torch.Tensor:
    """[n (n + 1) / 2] bool over `causal_pairs(n)`: True for the held-out (test) pairs, a seeded random share."""
    check_float("test_fraction", test_fraction, 0.0, 1.0, hi_open=True)
    k = n * (n + 1) // 2
    g = torch.Generator().manual_seed(int(seed))
    test = torch.zeros(k, dtype=torch.bool)
    test[torch.randperm(k, generator=g)[: round(test_fraction * k)]] = True
    return test


def _design(i: torch.Tensor, j: torch.Tensor, full: bool) -> torch.Tensor:
    i, j = i.to(torch.float64), j.to(torch.float64)
    cols = [torch.ones_like(i), i - j] + ([i, j] if full else [])
    return torch.stack(cols, 1)


@functools.lru_cache(maxsize=16)
def _solver(n: int, test_fraction: float, seed: int, device: torch.device | None = None) -> tuple:
    """Flat positions (i n + j) of the train and test pairs and, per design (full, rel), the train
    pseudo-inverse and the test design, on `device` (made on the CPU, copied once)."""
    if device is not None and device.type != "cpu":
        train, test, designs = _solver(n, test_fraction, seed)
        return train.to(device), test.to(device), [(p.to(device), x.to(device)) for p, x in designs]
    i, j = causal_pairs(n)
    if test_fraction > 0:
        test = split_pairs(n, test_fraction, seed)
        train = ~test
    else:
        train = test = torch.ones(len(i), dtype=torch.bool)
    if int(train.sum()) < 4 or int(test.sum()) < 2:
        raise UsageError(f"seq_len {n} gives too few causal pairs for the train/test split; use a longer seq_len")
    designs = [_design(i, j, full) for full in (True, False)]
    flat = i * n + j
    return flat[train], flat[test], [(torch.linalg.pinv(x[train]).T, x[test].T) for x in designs]


def _r2(train: torch.Tensor, test: torch.Tensor, pinv_t: torch.Tensor, x_test_t: torch.Tensor) -> torch.Tensor:
    """Out-of-sample R^2 on the test values [..., K'] of the OLS fit of the train values (minimum-norm solve)."""
    coef = train @ pinv_t  # [..., p]
    res = test - coef @ x_test_t
    tot = ((test - test.mean(-1, keepdim=True)) ** 2).sum(-1)
    return 1.0 - (res**2).sum(-1) / tot


def linear_delta_r2(scores: torch.Tensor, test_fraction: float = TEST_FRACTION, seed: int = 0) -> torch.Tensor:
    """Delta R^2 = R^2_full - R^2_rel of score maps [..., n, n] (entries j <= i used), over the leading axes, in
    float64 on the maps' device.

    test_fraction 0 fits and scores on all pairs (in-sample; then Delta R^2 >= 0 always).
    """
    scores = torch.as_tensor(scores)
    n = scores.shape[-1]
    check_int("n", n, 3)
    check_float("test_fraction", test_fraction, 0.0, 1.0, hi_open=True)
    train, test, ((pf, xf), (pr_, xr)) = _solver(n, float(test_fraction), int(seed), scores.device)
    flat = scores.reshape(*scores.shape[:-2], n * n)
    y_train, y_test = flat[..., train].to(torch.float64), flat[..., test].to(torch.float64)
    return _r2(y_train, y_test, pf, xf) - _r2(y_train, y_test, pr_, xr)


def circular_shift(ids: torch.Tensor, shift: int | torch.Tensor, keep: int = 0) -> torch.Tensor:
    """Token ids [B, T] rolled by `shift` along the sequence (per row when a tensor [B]); the first `keep`
    positions (an auto-prepended BOS) stay in place. The predecessor's null input."""
    ids = torch.as_tensor(ids)
    body = ids[:, keep:]
    t = body.shape[1]
    shift = torch.as_tensor(shift).expand(ids.shape[0])
    idx = (torch.arange(t)[None, :] - shift[:, None]) % t
    return torch.cat([ids[:, :keep], body.gather(1, idx)], 1)


def permutations_for(tests: int, fdr: float = FDR, margin: int = MARGIN) -> int:
    """The number of sign flips R whose smallest attainable p, 1/(R + 1), is BH's first threshold q/m divided
    by `margin`: R = ceil(margin m / q) - 1."""
    check_int("tests", tests, 1)
    check_float("fdr", fdr, 0.0, 1.0, lo_open=True)
    return math.ceil(check_int("margin", margin, 1) * tests / fdr) - 1


def power(sequences: int, permutations: int, tests: int, fdr: float = FDR) -> dict:
    """What a sign-flip test with these sizes can detect at all: the smallest attainable p (1/(R + 1), or 2^-N
    when the 2^N sign vectors are enumerated), BH's first threshold q/m, and whether the first is at most the
    second (otherwise no test can be significant, whatever the data)."""
    exact = 2.0**sequences <= permutations
    smallest = 2.0**-sequences if exact else 1.0 / (permutations + 1)
    first = fdr / tests
    return {"sequences": sequences, "permutations": permutations, "exact": exact, "tests": tests, "fdr": fdr,
            "smallest_p": smallest, "bh_first_threshold": first, "detectable": smallest <= first}


def sign_flip_p(diff: torch.Tensor, permutations: int, generator: torch.Generator) -> torch.Tensor:
    """One-sided p-values of mean(diff) > 0 per trailing index of diff [N, ...] under sign flips of whole rows.

    2^N <= permutations: every sign vector (the identity included), p = #{mean(s diff) >= mean(diff)} / 2^N,
    exact. Otherwise R random sign vectors, p = (1 + #{...}) / (R + 1) (valid: P(p <= a) <= a under H0).
    """
    n = diff.shape[0]
    flat = diff.reshape(n, -1)
    gap = flat.mean(0)
    exact = 2**n <= permutations
    total = 2**n if exact else permutations
    exceed = torch.zeros_like(gap)
    for start in range(0, total, CHUNK):
        count = min(CHUNK, total - start)
        if exact:
            codes = torch.arange(start, start + count)[:, None]
            bits = (codes >> torch.arange(n)) & 1
        else:
            bits = torch.randint(0, 2, (count, n), generator=generator)
        signs = bits.to(torch.float64) * 2 - 1
        exceed += ((signs @ flat) / n >= gap - 1e-12 * gap.abs()).sum(0)  # ties (the identity) count
    p = exceed / total if exact else (exceed + 1) / (permutations + 1)
    return p.reshape(diff.shape[1:])


def bootstrap_interval(diff: torch.Tensor, resamples: int, level: float,
                       generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Percentile bootstrap interval of mean(diff) over rows (sequences), per trailing index."""
    n = diff.shape[0]
    means = []
    for start in range(0, resamples, CHUNK):
        idx = torch.randint(n, (min(CHUNK, resamples - start), n), generator=generator)
        means.append(diff[idx].mean(1))
    means = torch.cat(means)
    return torch.quantile(means, (1 - level) / 2, dim=0), torch.quantile(means, (1 + level) / 2, dim=0)


@dataclass
class PairedTest:
    """Per head: gap = mean (real - null), its bootstrap interval [lo, hi], the sign-flip p-value and whether
    it survives Benjamini-Hochberg at `fdr` over all heads; `power` says what the test could detect at all."""

    gap: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    p: torch.Tensor
    significant: torch.Tensor
    fdr: float
    level: float
    power: dict

    def as_dict(self) -> dict:
        return {"gap": self.gap, "lo": self.lo, "hi": self.hi, "p": self.p, "significant": self.significant,
                "fdr": self.fdr, "level": self.level, "power": self.power}


def benjamini_hochberg(p: torch.Tensor, q: float = FDR) -> torch.Tensor:
    """Rejections of the Benjamini-Hochberg step-up procedure at false discovery rate q, same shape as p."""
    check_float("fdr", q, 0.0, 1.0, lo_open=True)
    flat = torch.as_tensor(p, dtype=torch.float64).reshape(-1)
    m = flat.numel()
    order = torch.argsort(flat)
    below = flat[order] <= q * torch.arange(1, m + 1, dtype=torch.float64) / m
    k = int(below.nonzero().max()) + 1 if bool(below.any()) else 0  # the largest rank under its line
    reject = torch.zeros(m, dtype=torch.bool)
    reject[order[:k]] = True
    return reject.reshape(torch.as_tensor(p).shape)


def paired_test(real: torch.Tensor, null: torch.Tensor, bootstrap: int = BOOTSTRAP,
                permutations: int | None = None, level: float = 0.95, fdr: float = FDR,
                seed: int = 0) -> PairedTest:
    """Compare per-sequence statistics real [N, ...] with null [N, ...] (paired by sequence), per trailing index.

    permutations None: `permutations_for` the number of tests (trailing indices) at `fdr`."""
    real, null = torch.as_tensor(real, dtype=torch.float64), torch.as_tensor(null, dtype=torch.float64)
    if real.shape != null.shape:
        raise UsageError(f"real and null must have the same shape, got {tuple(real.shape)} and {tuple(null.shape)}")
    n = real.shape[0]
    if n < 2:
        raise UsageError(f"the paired test needs at least 2 sequences, got {n}; raise num_sequences")
    tests = math.prod(real.shape[1:])
    permutations = permutations_for(tests, fdr) if permutations is None else permutations
    check_int("bootstrap", bootstrap, 1)
    check_int("permutations", permutations, 1)
    check_float("level", level, 0.0, 1.0, lo_open=True, hi_open=True)
    g = torch.Generator().manual_seed(int(seed))
    diff = real - null
    lo, hi = bootstrap_interval(diff, bootstrap, level, g)
    p = sign_flip_p(diff, permutations, g)
    return PairedTest(diff.mean(0), lo, hi, p, benjamini_hochberg(p, fdr), fdr, level,
                      power(n, permutations, tests, fdr))


class DeltaR2Rows(Statistic):
    """Per sequence, layer and head, the linear Delta R^2 of the post-RoPE scores (`linear_delta_r2`): rows
    [N, L, H] kept in order (a per-sequence statistic, not a grouped sum; the paired test needs the rows).
    Layers whose sliding window is shorter than the sequence get NaN (the design assumes every causal pair)."""

    name = "delta_r2_rows"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(1)
        self.seed = seed
        self.rows: list[torch.Tensor] = []
        self._layers: list[torch.Tensor] = []

    def hooks(self, hm) -> dict:
        self._n = hm.n_layers
        return {f"blocks.{l}.attn.hook_attn_scores": self._read for l in range(hm.n_layers)}

    def _read(self, s: torch.Tensor, ctx) -> None:
        b, h, t, _ = s.shape
        if ctx.window and ctx.window < t:
            self._layers.append(torch.full((b, h), math.nan, dtype=torch.float64, device=s.device))
        else:  # [B, H] on the scores' device (no copy, no wait); only causal pairs are read
            self._layers.append(linear_delta_r2(s, seed=self.seed))
        if ctx.layer == self._n - 1:
            self.rows.append(torch.stack(self._layers, 1))
            self._layers = []

    def values(self) -> torch.Tensor:
        """[N, L, H] float64, on the CPU (the rows stay on the device they were computed on until read)."""
        return torch.cat([r.cpu() for r in self.rows])

    def result(self, level: float = 0.95) -> dict[str, torch.Tensor]:
        return {"delta_r2": self.values()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"rows": self.values()} if self.rows else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.rows = [state["rows"]] if "rows" in state else []

    def merge(self, other: DeltaR2Rows) -> None:
        self.rows += other.rows

    def all_reduce(self, group=None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, self.values(), group=group)
        self.rows = list(gathered)
