"""Absolute-position leakage of averaged causal maps: pure functions of mean maps (docs/leakage.md).

Every metric here takes mean maps M [..., n, n] (query i on rows, key j on columns; any leading axes, e.g.
layers and heads) and a `Domain` Omega of (i, j) entries, and returns float64 tensors over the leading axes.
They are smooth functions of the means (no medians, no thresholds), so the engine's delete-one-group
jackknife gives each one a confidence interval by re-evaluating it on leave-one-group-out means.

Notation (docs/leakage.md, section "Formulas"): d = i - j; n_d = #{(i, j) in Omega : i - j = d};
mu_d = mean of M over diagonal d in Omega; R_ij = M_ij - mu_{i-j} (the Toeplitz residual); V_tot = sum over
Omega of (M_ij - mean)^2; sd = sqrt(V_tot / |Omega|).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from poslens.errors import UsageError, check_int
from poslens.masks import visible

TERMS = ("d", "q", "k")  # one-hot factors of a fit: offset i - j, query i, key j
MIN_PER_OFFSET = 2  # a diagonal with one entry has no residual: a Toeplitz fit needs at least two


@dataclass(frozen=True)
class Domain:
    """The entries Omega of a causal map that a metric uses.

    max_offset: largest i - j (D_max; None = n // 2, so every diagonal used has at least n / 2 entries);
    first_key: include key j = 0 (the sink column); min_query / max_query: queries i in [min_query, max_query]
    (max_query None = n - 1; "early queries only" is a small max_query); window: keep i - j < window
    (sliding-window layers, whose other entries are undefined).
    """

    max_offset: int | None = None
    first_key: bool = True
    min_query: int = 0
    max_query: int | None = None
    window: int | None = None

    def __post_init__(self) -> None:
        if self.max_offset is not None:
            check_int("max_offset", self.max_offset, 0)
        check_int("min_query", self.min_query, 0)
        if self.max_query is not None:
            check_int("max_query", self.max_query, 0)
        if self.window is not None:
            check_int("window", self.window, 1)

    def mask(self, n: int) -> torch.Tensor:
        """[n, n] bool: True on Omega."""
        i = torch.arange(n)[:, None]
        d = i - torch.arange(n)[None, :]
        top = n // 2 if self.max_offset is None else self.max_offset
        ok = visible(n, self.window or 0, key0=self.first_key) & (d <= top) & (i >= self.min_query)
        if self.max_query is not None:
            ok &= i <= self.max_query
        return ok

    def index(self, n: int) -> _Index:
        """The entries of Omega for maps of size n, with the factor codes the fits need (cached)."""
        return _index(self, check_int("n", n, 2))


class _Index:
    """Flat positions of Omega's entries and, per entry, compact codes of its offset, query and key."""

    def __init__(self, domain: Domain, n: int) -> None:
        ok = domain.mask(n)
        i, j = ok.nonzero(as_tuple=True)
        self.n, self.size = n, int(i.numel())
        self.flat = i * n + j
        self.i, self.j, self.d = i, j, i - j
        self.codes: dict[str, torch.Tensor] = {}
        self.levels: dict[str, torch.Tensor] = {}
        for name, v in (("d", self.d), ("q", i), ("k", j)):
            levels, code = torch.unique(v, return_inverse=True)
            self.levels[name], self.codes[name] = levels, code
        counts = torch.bincount(self.codes["d"])
        usable = int((counts >= MIN_PER_OFFSET).sum()) if self.size else 0
        if usable < 2 or self.size <= len(counts) + 1:
            raise UsageError(f"domain has {self.size} entries on {len(counts)} offsets in a {n} x {n} map; a fit "
                             f"needs at least 2 offsets with {MIN_PER_OFFSET} entries each: raise max_offset or "
                             "max_query, or lower min_query")
        self.counts = {t: torch.bincount(self.codes[t]).to(torch.float64) for t in TERMS}  # entries per level
        self._pinv: dict[tuple[str, ...], torch.Tensor] = {}
        self._cross: dict[tuple[str, str], torch.Tensor] = {}

    def cross(self, a: str, b: str) -> torch.Tensor:
        """[levels of a, levels of b] float64: how many entries of Omega have level u of factor a and level v of b
        (cached; block (a, b) of X^T X)."""
        if (a, b) not in self._cross:
            la, lb = len(self.levels[a]), len(self.levels[b])
            pair = self.codes[a] * lb + self.codes[b]
            self._cross[a, b] = torch.bincount(pair, minlength=la * lb).reshape(la, lb).to(torch.float64)
        return self._cross[a, b]

    def pinv(self, terms: tuple[str, ...]) -> torch.Tensor:
        """(X^T X)^+ of the one-hot design with the given factors (float64, cached; the design depends on Omega
        only, so one pseudo-inverse serves every map and every jackknife replicate)."""
        if terms not in self._pinv:
            xtx = torch.cat([torch.cat([self.cross(a, b) for b in terms], 1) for a in terms], 0)
            self._pinv[terms] = torch.linalg.pinv(xtx, hermitian=True, rtol=1e-10)
        return self._pinv[terms]


@functools.lru_cache(maxsize=32)
def _index(domain: Domain, n: int) -> _Index:
    return _Index(domain, n)


def values(m: torch.Tensor, domain: Domain) -> tuple[torch.Tensor, _Index]:
    """The entries of m [..., n, n] on Omega as float64 [..., |Omega|] (a UsageError if any is not finite)."""
    y, ix = _gather(m, domain)
    if not bool(torch.isfinite(y).all()):
        raise UsageError(NOT_FINITE)
    return y, ix


NOT_FINITE = ("the domain includes undefined (NaN) map entries: set window to the layer's sliding window or lower "
              "max_offset")


def _gather(m: torch.Tensor, domain: Domain) -> tuple[torch.Tensor, _Index]:
    m = torch.as_tensor(m)
    if m.dim() < 2 or m.shape[-1] != m.shape[-2]:
        raise UsageError(f"maps must be square [..., n, n], got shape {tuple(m.shape)}")
    ix = domain.index(m.shape[-1])
    return m.reshape(*m.shape[:-2], -1)[..., ix.flat.to(m.device)].to(torch.float64).cpu(), ix


def _group_sums(y: torch.Tensor, code: torch.Tensor, levels: int) -> torch.Tensor:
    """Sums of y [..., K] over the entries of each level of a factor: [..., levels]."""
    out = torch.zeros(*y.shape[:-1], levels, dtype=y.dtype)
    return out.index_add_(-1, code, y)


def toeplitz_residual(y: torch.Tensor, ix: _Index) -> torch.Tensor:
    """R_ij = M_ij - mu_{i-j} on Omega (mu_d: diagonal means over Omega), materialised (the metrics use `Moments`)."""
    code = ix.codes["d"]
    mu = _group_sums(y, code, len(ix.levels["d"])) / ix.counts["d"]
    return y - mu[..., code]


@dataclass
class Moments:
    """What every metric of this module needs from maps y [..., n, n] on Omega, read in one gather:

        mu      = the diagonal means mu_d (offset levels of Omega)
        res     = ||P y||^2 = sum over Omega of R_ij^2, R_ij = y_ij - mu_{i-j} (the Toeplitz residual)
        q, k    = sums of R over the entries of each query row, each key column of Omega

    Each metric is a quadratic form of these (docs/leakage.md, "Formulas"): V_tot = res + sum_d n_d (mu_d - ybar)^2;
    the residual of a one-hot fit on offset and query and/or key is res - b^T (X^T X)^+ b with b = X^T R (offset
    block 0, then q, k); a row term y - u 1^T (u_i along query row i: the log-partition, log(1 + i)) changes them
    in closed form (`minus_rows`). So a map is read once, whatever is asked of it, and the residual energy is a sum
    of squares of residuals (a Toeplitz map gives 0 to rounding of its entries, not of its size).
    """

    ix: _Index
    mu: torch.Tensor  # [..., offsets]
    res: torch.Tensor  # [...]
    q: torch.Tensor  # [..., queries]
    k: torch.Tensor  # [..., keys]

    @classmethod
    def of(cls, m: torch.Tensor, domain: Domain) -> Moments:
        """The moments of maps m [..., n, n] on `domain` (a UsageError if an entry in it is not finite)."""
        r, ix = _gather(m, domain)  # a copy of the entries: made into the residual in place
        mu = _group_sums(r, ix.codes["d"], len(ix.levels["d"])) / ix.counts["d"]
        r.sub_(mu[..., ix.codes["d"]])
        res = (r[..., None, :] @ r[..., :, None])[..., 0, 0]  # sum of squares without a squared copy
        if not bool(torch.isfinite(res).all()):
            raise UsageError(NOT_FINITE)
        return cls(ix, mu, res, _group_sums(r, ix.codes["q"], len(ix.levels["q"])),
                   _group_sums(r, ix.codes["k"], len(ix.levels["k"])))

    @classmethod
    def rows(cls, u: torch.Tensor, ix: _Index) -> Moments:
        """The moments of the map u 1^T (u_i on every entry of row i) for u [..., n]."""
        u = torch.as_tensor(u)
        shape = tuple(u.shape[:-1])

        def zeros(*levels: int) -> torch.Tensor:
            return torch.zeros((*shape, *levels), dtype=torch.float64)

        empty = cls(ix, zeros(len(ix.levels["d"])), zeros(), zeros(len(ix.levels["q"])), zeros(len(ix.levels["k"])))
        return empty.minus_rows(-u)

    def minus_rows(self, u: torch.Tensor) -> Moments:
        """The moments of y - u 1^T, for u [..., n] indexed by query position (a UsageError if u is not finite on
        Omega's queries). With Pu_ij = u_i - (mean of u over diagonal i - j): R' = R - Pu, and <R, Pu> = sum_i u_i q_i
        because R sums to 0 on every diagonal."""
        ix = self.ix
        u = torch.as_tensor(u).to(torch.float64).cpu()
        if tuple(u.shape) != (*self.res.shape, ix.n):
            raise UsageError(f"log_partition must have shape {(*self.res.shape, ix.n)}, got {tuple(u.shape)}")
        uq = u[..., ix.levels["q"]]
        if not bool(torch.isfinite(uq).all()):
            raise UsageError("log_partition is undefined (NaN) at a query in the domain; lower max_query")
        cq, nd = ix.counts["q"], ix.counts["d"]
        uq = uq - (uq * cq).sum(-1, keepdim=True) / ix.size  # a constant is Toeplitz: centring changes no residual
        ud = uq @ ix.cross("q", "d") / nd  # diagonal means of u 1^T
        pu_ss = (cq * uq * uq).sum(-1) - (nd * ud * ud).sum(-1)  # ||P u||^2
        res = self.res - 2.0 * (uq * self.q).sum(-1) + pu_ss
        q = self.q - (cq * uq - ud @ ix.cross("q", "d").T)
        k = self.k - (uq @ ix.cross("q", "k") - ud @ ix.cross("d", "k"))
        return Moments(ix, self.mu - ud, res.clamp_min(0.0), q, k)

    def total(self) -> torch.Tensor:
        """V_tot = sum over Omega of (y_ij - ybar)^2."""
        nd = self.ix.counts["d"]
        centred = self.mu - (self.mu * nd).sum(-1, keepdim=True) / self.ix.size
        return self.res + (nd * centred * centred).sum(-1)

    def residual(self, terms: tuple[str, ...] = ("d",)) -> torch.Tensor:
        """Residual sum of squares of the least-squares fit on one-hot factors `terms` (("d",): ||P y||^2)."""
        if terms == ("d",):
            return self.res
        if terms[0] != "d":
            raise UsageError(f"fits are on the offset and more: terms must start with 'd', got {terms}")
        zero = torch.zeros_like(self.mu)
        b = torch.cat([zero, *(getattr(self, t) for t in terms[1:])], -1)  # X^T R: R sums to 0 on each diagonal
        return (self.res - ((b @ self.ix.pinv(terms)) * b).sum(-1)).clamp_min(0.0)

    def inner_rows(self, x: torch.Tensor) -> torch.Tensor:
        """<P y, P(x 1^T)> = sum_i x_i q_i for one row term x [n] (the same for every map)."""
        return self.q @ torch.as_tensor(x).to(torch.float64)[self.ix.levels["q"]]

    def sd(self) -> torch.Tensor:
        """sqrt(V_tot / |Omega|)."""
        return (self.total() / self.ix.size).sqrt()

    def key_profile(self) -> torch.Tensor:
        """r_j = mean over the queries i with (i, j) in Omega of R_ij, [..., n] (NaN for keys outside Omega)."""
        ix = self.ix
        out = torch.full((*self.k.shape[:-1], ix.n), math.nan, dtype=torch.float64)
        out[..., ix.levels["k"]] = self.k / ix.counts["k"]
        return out


def toeplitz_fraction(m: torch.Tensor, domain: Domain) -> torch.Tensor:
    """TRF = sum_Omega R_ij^2 / V_tot (notes C1): the share of the map's variance the offset i - j does not
    explain; 0 iff M is Toeplitz on Omega, at most 1. NaN for a constant map (V_tot = 0)."""
    return _trf(Moments.of(m, domain))


def _trf(mo: Moments) -> torch.Tensor:
    return mo.residual() / mo.total()


def delta_r2(m: torch.Tensor, domain: Domain) -> dict[str, torch.Tensor]:
    """Non-parametric R^2 of one-hot fits on Omega (notes C2): offset only (r2_d), offset + query (r2_dq),
    offset + key (r2_dk), offset + query + key (r2_dqk), and the increments dr2_q, dr2_k, dr2_abs over r2_d.

    Because d = i - j, a linear trend moves freely between the three factors: only increments are identified,
    and dr2_q and dr2_k overlap (dr2_abs <= dr2_q + dr2_k need not hold with equality).
    """
    return _delta_r2(Moments.of(m, domain))


def _delta_r2(mo: Moments) -> dict[str, torch.Tensor]:
    total = mo.total()
    r2 = {"".join(t): 1.0 - mo.residual(t) / total for t in (("d",), ("d", "q"), ("d", "k"), ("d", "q", "k"))}
    out = {f"r2_{k}": v for k, v in r2.items()}
    out["dr2_q"] = r2["dq"] - r2["d"]
    out["dr2_k"] = r2["dk"] - r2["d"]
    out["dr2_abs"] = r2["dqk"] - r2["d"]
    return out


def split(scores: torch.Tensor, log_partition: torch.Tensor, domain: Domain) -> dict[str, torch.Tensor]:
    """Exact algebraic split of the non-relative part of the mean log-probabilities (a descriptive identity).

    Mean log-probabilities are L = S - l 1^T exactly (S: mean scores [..., n, n], l: mean log-partition
    [..., n], l_i = mean log sum_{j seen by i} exp s_ij). The Toeplitz residual P is linear, so
    P L = P S - P(l 1^T) and
        e_total     = ||P L||^2 = e_logit + e_partition + cross,
        e_logit     = ||P S||^2            (upstream logit term: the scores this layer reads from the residual
                                            stream are not a function of i - j)
        e_partition = ||P(l 1^T)||^2       (this layer's log-partition term: each query's softmax denominator)
        cross       = -2 <P S, P(l 1^T)>   (negative when the logits partly cancel the denominator).
    Also their shares of e_total and `fraction` = e_total / V_tot(L) (the TRF of L). The terms are not causes:
    a query term g(i) added to the scores moves e_logit and e_partition and cancels in the cross term
    (`attention_split` is the decomposition that is a property of the attention).
    """
    return _split(Moments.of(scores, domain), log_partition)


def _split(mo: Moments, log_partition: torch.Tensor, logp: Moments | None = None) -> dict[str, torch.Tensor]:
    """The split from the scores' moments; `logp`: the moments of L = S - l 1^T when the caller has them."""
    logp = mo.minus_rows(log_partition) if logp is None else logp
    e_logit, e_part, total = mo.residual(), Moments.rows(log_partition, mo.ix).residual(), logp.residual()
    cross = total - e_logit - e_part
    return {"e_total": total, "e_logit": e_logit, "e_partition": e_part, "cross": cross,
            "share_logit": e_logit / total, "share_partition": e_part / total, "share_cross": cross / total,
            "fraction": total / logp.total()}


def attention_split(scores: torch.Tensor, log_partition: torch.Tensor, lag_log_partition: torch.Tensor,
                    domain: Domain) -> dict[str, torch.Tensor]:
    """The non-relative part of the mean log-probabilities split into what the causal mask alone does to the
    scores' lag profile and what the rest of the scores adds (docs/leakage.md, "The decomposition").

    Per sequence the scores are fitted as s_ij = a_i + r(i - j) + e_ij on the causal domain (causal.two_way_fit:
    a per-query offset a_i absorbs any constant the softmax ignores), and with L0_i the log-partition of r alone
    under the causal mask (`lag_log_partition`, its mean over sequences) and l_i that of s (`log_partition`),
        log p_ij = [r(i - j) - L0_i] + e_ij - [(l_i - a_i) - L0_i].
    r is Toeplitz, so with P the diagonal-mean residual on Omega, P L = -P(L0 1^T) + [P S - P((l - L0) 1^T)] and
        e_total  = ||P L||^2 = mask_only + residual + cross,
        mask_only = ||P(L0 1^T)||^2                (the causal softmax of the lag profile alone)
        residual  = ||P S - P((l - L0) 1^T)||^2    (= ||P e - P((l - a - L0) 1^T)||^2: the residual e, through
                                                    the numerator and the denominator)
        cross     = -2 <P(L0 1^T), P S - P((l - L0) 1^T)>,
    with their shares of e_total. Every term is unchanged by any c_i added to row i of the scores (L, L0 and
    P S - P(l 1^T) are), unlike ||P S||^2 (`scores/energy`).
    """
    mo = Moments.of(scores, domain)
    return _attention(mo, log_partition, lag_log_partition)


def _attention(mo: Moments, log_partition: torch.Tensor, lag_log_partition: torch.Tensor,
               logp: Moments | None = None) -> dict[str, torch.Tensor]:
    """The decomposition from the scores' moments (`logp`: the moments of L = S - l 1^T when the caller has them)."""
    lp = torch.as_tensor(log_partition).to(torch.float64).cpu()
    lag = torch.as_tensor(lag_log_partition).to(torch.float64).cpu()
    total = (mo.minus_rows(lp) if logp is None else logp).residual()
    mask = Moments.rows(lag, mo.ix).residual()
    residual = mo.minus_rows(lp - lag).residual()
    cross = total - mask - residual
    return {"e_total": total, "mask_only": mask, "residual": residual, "cross": cross,
            "share_mask_only": mask / total, "share_residual": residual / total, "share_cross": cross / total}


def drift(m: torch.Tensor, domain: Domain) -> dict[str, torch.Tensor]:
    """Drift at fixed offset against log position (notes C4, pooled form ours).

    slope: the within-offset least-squares slope of M_{i, i-d} on log(1 + i), pooled over the offsets d in
    Omega (one slope, offset means removed: sum_d sum_i (x_i - x_d)(M - M_d) / sum_d sum_i (x_i - x_d)^2 with
    x_i = log(1 + i)); scaled: slope / sd (change per e-fold of position in units of the map's spread).
    Uniform attention's log-probabilities -log(1 + i) have slope exactly -1; a Toeplitz map has 0.
    """
    return _drift(Moments.of(m, domain))


def _drift(mo: Moments) -> dict[str, torch.Tensor]:
    x = torch.log1p(torch.arange(mo.ix.n, dtype=torch.float64))
    slope = mo.inner_rows(x) / Moments.rows(x, mo.ix).residual()
    return {"slope": slope, "scaled": slope / mo.sd()}


def key_profile(m: torch.Tensor, domain: Domain, early_keys: int = 64) -> dict[str, torch.Tensor]:
    """Key-column profile of the Toeplitz residual (notes C5).

    profile r_j = mean over the queries i with (i, j) in Omega of R_ij, [..., n] (NaN for keys outside Omega);
    sink_excess = r_0 / sd (key 0 scored above what its offsets predict; NaN when Omega leaves key 0 out);
    early_key_slope = least-squares slope of r_j on log(1 + j) over 1 <= j <= early_keys, over sd.
    """
    return _key_profile(Moments.of(m, domain), check_int("early_keys", early_keys, 2))


def _key_profile(mo: Moments, early_keys: int) -> dict[str, torch.Tensor]:
    profile, sd = mo.key_profile(), mo.sd()
    keys = torch.arange(mo.ix.n)
    use = (keys >= 1) & (keys <= early_keys) & torch.isin(keys, mo.ix.levels["k"])
    if int(use.sum()) >= 2:
        x = torch.log1p(keys[use].to(torch.float64))
        x = x - x.mean()
        p = profile[..., use]
        slope = ((p - p.mean(-1, keepdim=True)) * x).sum(-1) / (x**2).sum()
    else:
        slope = torch.full(profile.shape[:-1], math.nan, dtype=torch.float64)
    return {"profile": profile, "sink_excess": profile[..., 0] / sd, "early_key_slope": slope / sd}


def first_key_attention(probs: torch.Tensor, key: int = 0) -> torch.Tensor:
    """alpha_k = mean over queries i >= k of A_ik (Gu et al. 2025), over the leading axes of probs [..., n, n]."""
    probs = torch.as_tensor(probs).to(torch.float64)
    n = probs.shape[-1]
    key = check_int("key", key, 0, n - 1)
    col = probs[..., key:, key]
    return torch.nanmean(col, dim=-1)


def sink_rate(probs: torch.Tensor, epsilon: float = 0.3, key: int = 0) -> float:
    """Sink^eps_k (Gu et al. 2025): the share of maps (layer, head pairs: every leading index of probs
    [..., n, n]) whose alpha_k exceeds epsilon. Their setting: eps = 0.3, k = 0, 64 tokens."""
    alpha = first_key_attention(probs, key)
    return float((alpha > epsilon).to(torch.float64).mean())


def leakage_metrics(means: dict[str, torch.Tensor], domain: Domain, early_keys: int = 64) -> dict[str, torch.Tensor]:
    """Every smooth metric of this module from a dict of mean maps, flat names -> tensors over leading axes.

    Uses what is there: "scores" (TRF, Delta R^2, drift, key profile, `scores/energy` = ||P S||^2 and
    `scores/offset_share`: the share of it a per-query offset explains, descriptions of the scores, not causes),
    with "log_partition" also the log-probabilities' TRF and drift (of S - l 1^T, unless "log_probs" is given),
    with "lag_log_partition" also the decomposition ("attn/...", `attention_split`; without it the descriptive
    split, "split/..."), and "probs" (TRF and drift). Each map is read once (`Moments`). The engine's jackknife
    evaluates this on each replicate.
    """
    early_keys = check_int("early_keys", early_keys, 2)
    moments = {k: Moments.of(means[k], domain) for k in ("scores", "log_probs", "probs") if k in means}
    logp = None  # L = S - l 1^T from the scores' moments: the split's and, unless given as a map, the TRF's
    if "scores" in moments and "log_partition" in means:
        logp = moments["scores"].minus_rows(means["log_partition"])
        moments.setdefault("log_probs", logp)
    out: dict[str, torch.Tensor] = {}
    for name in ("scores", "log_probs", "probs"):
        if name not in moments:
            continue
        mo = moments[name]
        out[f"{name}/trf"] = _trf(mo)
        out[f"{name}/drift"] = _drift(mo)["scaled"]
        if name == "scores":
            for k, v in _delta_r2(mo).items():
                if k.startswith("dr2"):
                    out[f"scores/{k}"] = v
            prof = _key_profile(mo, early_keys)
            out["scores/sink_excess"] = prof["sink_excess"]
            out["scores/early_key_slope"] = prof["early_key_slope"]
            out.update(_score_energy(mo))
    out.update(_energies(moments.get("scores"), means, logp))
    return out


ATTENTION_TERMS = tuple(f"attn/{k}" for k in ("e_total", "mask_only", "residual", "cross", "share_mask_only",
                                                "share_residual", "share_cross"))
LEAN = ("scores/trf", "log_probs/trf", "scores/energy", *ATTENTION_TERMS)  # diagonal means only: no fit on Omega


def lean_metrics(means: dict[str, torch.Tensor], domain: Domain, early_keys: int = 64) -> dict[str, torch.Tensor]:
    """`leakage_metrics`'s values for the names in LEAN, which need diagonal means only (no pseudo-inverse of a fit
    on Omega, whose size grows with the square of the map's: affordable at tens of thousands of tokens): the TRFs
    of the scores and log-probabilities, `scores/energy` and, with "lag_log_partition", the decomposition
    (`attn/...`). `early_keys` unused, for the same call."""
    mo = Moments.of(means["scores"], domain)
    logp = mo.minus_rows(means["log_partition"])
    out = {"scores/trf": _trf(mo),
           "log_probs/trf": _trf(Moments.of(means["log_probs"], domain) if "log_probs" in means else logp),
           "scores/energy": mo.residual()}
    out.update(_energies(mo, means, logp))
    return out


def offset_share(m: torch.Tensor, domain: Domain) -> dict[str, torch.Tensor]:
    """The non-relative energy of maps m [..., n, n] on Omega, ||P m||^2 (`energy`), and the share of it that
    one offset per query explains (`offset_share` = 1 - RSS(offset + query) / RSS(offset)): the part of a score
    pattern that a softmax removes (a constant per query changes no attention weight). NaN for a Toeplitz map."""
    return _score_energy(Moments.of(m, domain), "")


def offset_power(ma: torch.Tensor, mb: torch.Tensor, domain: Domain) -> dict[str, torch.Tensor]:
    """Noise-free powers of two independent halves' mean maps ma, mb [..., n, n] on Omega (per entry):
    `pattern` = <P m_a, P m_b> / |Omega| (Kim et al.'s Section 5.2 statistic when Omega drops key 0: the mean square
    of the diagonal-normalised map without its noise term), `offset` = <O m_a, O m_b> / |Omega| with
    O = P - H the part of the pattern that one offset per query explains (H: the residual of the lag + query fit;
    O and H are orthogonal, so pattern = offset + the rest in expectation) and `share` = offset / pattern: the
    share of the non-relative pattern that no softmax sees. Each inner product by polarisation,
    <x, y> = (||x + y||^2 - ||x - y||^2) / 4, from the moments of the halves' sum and difference."""
    ma, mb = torch.as_tensor(ma), torch.as_tensor(mb)
    plus, minus = Moments.of(ma + mb, domain), Moments.of(ma - mb, domain)

    def inner(energy) -> torch.Tensor:
        return (energy(plus) - energy(minus)) / (4 * plus.ix.size)

    pattern = inner(lambda mo: mo.residual())
    offset = inner(lambda mo: mo.residual() - mo.residual(("d", "q")))
    return {"pattern": pattern, "offset": offset, "share": offset / pattern}


def _score_energy(mo: Moments, prefix: str = "scores/") -> dict[str, torch.Tensor]:
    energy = mo.residual()
    return {f"{prefix}energy": energy, f"{prefix}offset_share": 1.0 - mo.residual(("d", "q")) / energy}


def energy_metrics(means: dict[str, torch.Tensor], domain: Domain, early_keys: int = 64) -> dict[str, torch.Tensor]:
    """Only the energies (`attn/...` with "lag_log_partition", `scores/energy`): what a removed share needs,
    without the fits of the other metrics (`early_keys` unused, for the same call)."""
    if "scores" not in means or "log_partition" not in means:
        return {}
    mo = Moments.of(means["scores"], domain)
    return {"scores/energy": mo.residual(), **_energies(mo, means)}


def _energies(scores: Moments | None, means: dict[str, torch.Tensor],
              logp: Moments | None = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if scores is None or "log_partition" not in means:
        return out
    if "lag_log_partition" in means:
        parts = _attention(scores, means["log_partition"], means["lag_log_partition"], logp)
        out.update({f"attn/{k}": v for k, v in parts.items()})
    else:
        out.update({f"split/{k}": v for k, v in _split(scores, means["log_partition"], logp).items()})
    return out
