"""`poslens intermediates MODEL --layer L`: the nine Gram matrices of paper Figure 3 and the maps of Figure 8.

For layers L and L+1 (indices from 0 here; figures and reports number layers from 1, layer 1 = the first
attention layer) the statistic averages over sequences (and over heads where the quantity is per head) the
T x T Gram matrices of the intermediates that turn causally masked attention into position-dependent scores
(Kim et al. 2025, Section 4.2):

    (a) Y Y^T, Y = norm(X)                 blocks.L.ln1.hook_out (the norm's output, with its gain)
    (b) Q K^T * scaling, mean over heads   blocks.L.attn.hook_rot_q / hook_rot_k (after q/k norm and RoPE)
    (c) (AV)(AV)^T, mean over heads        blocks.L.attn.hook_z
    (d) after W_O                          blocks.L.attn.hook_out
    (e) after adding the residual          blocks.L.hook_resid_mid
    (f) after the post-attention norm      blocks.L.ln2.hook_out (the norm in front of the MLP, with its gain)
    (g) after the FFN and residual         blocks.L.hook_resid_post
    (h) next layer's normalised input      blocks.L+1.ln1.hook_out
    (i) next layer's Q K^T * scaling       blocks.L+1.attn.hook_rot_q / hook_rot_k

Gemma's sandwich layout (a norm after each sublayer too) maps as follows: (d) is the o_proj output before
Gemma's `post_attention_layernorm` (hook point ln1_post; hook_attn_out comes after it, as in TransformerLens); (e)
adds that normed output to the residual; (f) is `pre_feedforward_layernorm` (ln2); (g) adds
`post_feedforward_layernorm(mlp(...))`. OLMo-2's post-norm layout has no norm before a sublayer: (a) and (h) are
`hook_resid_pre` (what attention reads), (f) is `hook_resid_mid` (what the MLP reads, the same stream as (e)),
(d) is before the norm after attention (ln1), and (g) adds `post_feedforward_layernorm(mlp(...))` (ln2). A parallel
residual (GPT-NeoX, GPT-J, Phi: x + attn(ln1(x)) + mlp(ln2(x))) has no `hook_resid_mid`: (e) is `hook_resid_pre` +
`hook_attn_out`, (f) the MLP's norm of the stream entering the block, and (g) = (e) + MLP(f) still.
Gemma-2's attention logit softcap is not in (b), (i) or Figure 8: those are Q K^T * scaling as their titles say.

Every per-head Gram is a head-summed GEMM: `sum_h A_h B_h^T = [A_1 .. A_H] [B_1 .. B_H]^T`, and the sum over the
sequences of a batch joins the same inner dimension, so one [T, B*H*D] x [B*H*D, T] product per batch; for
grouped-query attention the query heads sharing a key head are summed first. No [B, H, T, T] tensor is formed.
Entries above the diagonal are NaN as in the paper (and, in a sliding-window layer, keys outside the window in
(b), (i) and Figure 8). Sums are kept per group of sequences (batch b -> group b mod G) in float64, so every map
and every summary has a delete-one-group jackknife interval (poslens.engine.stats).

Block-output check: (g) is recomputed in float64 as (e) + MLP(f) (Gemma: + post_feedforward_layernorm(MLP(f)))
with float64 copies of the layer's own modules and compared with the model's hidden state; the largest
deviation relative to the largest |hidden state| must stay within `CHECK_ULPS` machine epsilons of the model's
dtype (see `check_tolerance`), else `BlockOutputMismatch`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from poslens.engine.config import DEFAULT_SEQUENCES, SEQUENCES_HELP, ModelData
from poslens.engine.pipeline import Analysis, Job, Output, Pass, run_analysis
from poslens.engine.statistics.spec import Spec
from poslens.engine.stats import DEFAULT_GROUPS, NONNEGATIVE, SHARE, Estimate, Statistic, t_quantile
from poslens.errors import UsageError, check_int
from poslens.maps import diagonal_normalised, key_share
from poslens.masks import nan_hidden
from poslens.options import option, option_of

DEFAULT_SEQ_LEN = 50  # the paper's Figure 3: 1,000 sequences of the first 50 tokens of each document
STACK_ALPHAS = tuple(k / 20 for k in range(20))  # alphas searched for the strongest parameter-free pattern
CHECK_ULPS = 64  # block-output check tolerance, in machine epsilons of the model's dtype (see check_tolerance)

# letter, key in the results, what the panel shows (for titles), hook point relative to blocks.{L or L+1}
PANELS: tuple[tuple[str, str, str], ...] = (
    ("a", "input_norm", "Y Y^T after the input norm"),
    ("b", "qk", "Q K^T * scaling"),
    ("c", "z", "(AV)(AV)^T"),
    ("d", "attn_out", "after W_O"),
    ("e", "resid_mid", "after adding the residual"),
    ("f", "post_attn_norm", "after the post-attention norm"),
    ("g", "resid_post", "after the FFN and residual"),
    ("h", "next_input_norm", "next layer's normalised input"),
    ("i", "next_qk", "next layer's Q K^T * scaling"),
)


# the panels whose reading differs in a layout (the docstring's mapping), as their titles say it
LAYOUT_WHAT: dict[str, dict[str, str]] = {
    "post-norm": {"a": "Y Y^T of the stream attention reads (no norm before it)",
                  "d": "after W_O, before the norm after attention",
                  "f": "the stream the MLP reads (no norm before it: = (e))",
                  "h": "next layer's stream attention reads"},
    "parallel": {"e": "the stream entering the block + attention's output",
                 "f": "the MLP's norm of the stream entering the block"},
    "sandwich": {"d": "after W_O, before the norm after attention", "f": "after the norm before the MLP"},
}


def panel_what(letter: str, family=None) -> str:
    """What a panel shows, in the words of `family`'s layout (None: the pre-norm layout's)."""
    what = dict((c, w) for c, _, w in PANELS)[letter]
    return what if family is None else LAYOUT_WHAT.get(family.layout, {}).get(letter, what)


def hidden_points(family) -> dict[str, tuple[str, int]]:
    """Residual-stream-shaped panels: hook point (relative to the block) and which of the two layers. (a), (f) and (h)
    are what attention and the MLP read: the norms' outputs, or (post-norm, OLMo-2) the residual stream itself."""
    points = {"a": (family.attn_input, 0), "d": ("attn.hook_out", 0), "e": ("hook_resid_mid", 0),
              "f": (family.mlp_input, 0), "g": ("hook_resid_post", 0), "h": (family.attn_input, 1)}
    if family.layout == "parallel":  # no resid_mid: (e) is resid_pre + attn_out (Intermediates._parallel_mid)
        del points["e"]
    return points


class BlockOutputMismatch(UsageError):
    """The recomputed block output differs from the model's hidden state (one line; the CLI exits 2)."""


def check_tolerance(dtype: torch.dtype) -> float:
    """Largest accepted max|g_64 - g| / max|g| for a model computing in `dtype`.

    The float64 recomputation differs from the model's own block output only by the model's rounding: the
    residual sum rounds once (half an epsilon of |g|), the MLP's three products and its activation each round
    their outputs and accumulate in float32 or better (a few epsilons of the MLP output, itself at most of
    the order of |g|). Measured in float32: at most 5.6 epsilons on SmolLM2-135M, 3.4 on the tiny families;
    `CHECK_ULPS` = 64 leaves room for longer reductions in larger models, while a wrong module, a wrong
    layout or a missing norm moves the output by a sizeable fraction of |g| (many thousands of epsilons in
    float32, tens in bfloat16)."""
    return CHECK_ULPS * torch.finfo(dtype).eps


# ---------------------------------------------------------------- map arithmetic (float64, the paper's layout)


def gram_sum(x: torch.Tensor) -> torch.Tensor:
    """sum_b X_b X_b^T for x [B, T, d] in float64: one [T, B*d] x [B*d, T] product."""
    b, t, d = x.shape
    flat = x.double().permute(1, 0, 2).reshape(t, b * d)
    return flat @ flat.T


def grouped_queries(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """q [B, H, T, D] -> [B, Hkv, T, D] in float64: the query heads that read one key head summed (repeat_kv)."""
    b, h, t, d = q.shape
    return q.double().reshape(b, hkv, h // hkv, t, d).sum(2)


def head_summed_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """sum_b sum_h Q_bh K_{b,kv(h)}^T for q [B, H, T, D], k [B, Hkv, T, D] (float64, no scaling).

    Query head h reads key head h // (H / Hkv) (transformers' repeat_kv), so the query heads of one key head are
    summed first; then one [T, B*Hkv*D] x [B*Hkv*D, T] product."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    qs = grouped_queries(q, hkv)
    qf = qs.permute(2, 0, 1, 3).reshape(t, b * hkv * d)
    kf = k.double().permute(2, 0, 1, 3).reshape(t, b * hkv * d)
    return qf @ kf.T


def row_slopes(m: torch.Tensor) -> torch.Tensor:
    """Least-squares slope of m[i, j] in j over keys 1 <= j < i (finite entries), one per row i; NaN for rows with
    fewer than two such keys.

    Positive: within a row, later (closer) keys score higher, what the paper reads from Figure 3 (b), (f), (i).
    Key 0 (the attention-sink column) and the diagonal (a token with itself) are left out."""
    n = m.shape[-1]
    i = torch.arange(n, dtype=torch.float64, device=m.device)[:, None]
    j = torch.arange(n, dtype=torch.float64, device=m.device)[None].expand(n, n)
    w = ((j >= 1) & (j < i) & torch.isfinite(m)).double()
    cnt = w.sum(1)
    vals = torch.nan_to_num(m.double(), nan=0.0, posinf=0.0, neginf=0.0)
    jbar = (w * j).sum(1) / cnt.clamp(min=1)
    mbar = (w * vals).sum(1) / cnt.clamp(min=1)
    dj = (j - jbar[:, None]) * w
    slope = (dj * (vals - mbar[:, None])).sum(1) / (dj * dj).sum(1).clamp(min=1e-300)
    return slope.where(cnt >= 2, torch.tensor(math.nan, dtype=torch.float64, device=m.device))


def row_slope(m: torch.Tensor) -> torch.Tensor:
    """Mean of `row_slopes` over the rows that have one (NaN if none)."""
    s = row_slopes(m)
    return s.nanmean() if bool(torch.isfinite(s).any()) else torch.tensor(math.nan, dtype=torch.float64)


def share_rows_increasing(m: torch.Tensor) -> torch.Tensor:
    """Share of rows i (with at least two keys 1 <= j < i) whose least-squares slope in j is positive."""
    s = row_slopes(m)
    ok = torch.isfinite(s)
    return (s[ok] > 0).double().mean() if bool(ok.any()) else torch.tensor(math.nan, dtype=torch.float64)


def pattern_strength(m: torch.Tensor) -> torch.Tensor:
    """Mean row slope over the mean diagonal: how fast scores rise with the key index, in units of a token's score
    with itself (1 in the parameter-free stack with l2 norm, whose scores are cosines). NaN when the mean diagonal
    is not positive (the unit would be meaningless)."""
    diag = torch.diagonal(m.double()).mean()
    return row_slope(m) / diag if bool(diag > 0) else torch.tensor(math.nan, dtype=torch.float64)


def cosine_scores(m: torch.Tensor, q_sq: torch.Tensor, k_sq: torch.Tensor) -> torch.Tensor:
    """Mean scores in cosine units: m[i, j] / sqrt(q_sq[i] k_sq[j]), where m = E[q_i . k_j] and q_sq, k_sq are the
    mean squared norms E|q_i|^2, E|k_j|^2 under the same average (sequences, heads) and scaling. By Cauchy-Schwarz
    every entry lies in [-1, 1]; for the parameter-free stack with l2 norm (q = k = a unit vector) it is the score
    itself. A positive unit for a trained model, whose Q K^T diagonal can be at or below 0."""
    return m.double() / torch.sqrt(q_sq.double()[:, None] * k_sq.double()[None, :])


def stack_strength(alpha: float | torch.Tensor, n: int) -> torch.Tensor:
    """`pattern_strength` of the second-layer scores of the parameter-free stack (d -> infinity Gram flow, l2 norm,
    residual, no positional encoding) started from inputs with pairwise inner product `alpha` (paper Eq. 2); alpha
    is clipped into [0, 0.999] (the stack's domain)."""
    from poslens.stack.config import StackConfig
    from poslens.stack.gramflow import gram_flow

    a = min(max(float(alpha), 0.0), 0.999)
    flow = gram_flow(StackConfig(n=n, alpha=a, layers=2))
    return pattern_strength(torch.from_numpy(flow.scores[1]))


def offdiag_ratio(m: torch.Tensor) -> torch.Tensor:
    """Mean of the strictly lower (finite) entries over the mean of the diagonal: how much tokens look alike
    next to how much each looks like itself (the paper's reading of (a) -> (b) and (c) -> (d)). NaN when the mean
    diagonal is not positive (a token unlike itself: the ratio's sign and size would mean nothing)."""
    n = m.shape[-1]
    low = torch.tril(torch.ones(n, n, dtype=torch.bool, device=m.device), -1) & torch.isfinite(m)
    diag = torch.diagonal(m).mean()
    return m[low].mean() / diag if bool(diag > 0) else torch.full((), math.nan, dtype=m.dtype, device=m.device)


GRAM_PANELS = "acdefgh"  # the panels that are means of Gram matrices x_i . x_j (q.k panels b and i are not)


def gram_ratio_support(n: int) -> tuple[float, float]:
    """The range `offdiag_ratio` cannot leave on a mean of Gram matrices of n vectors (and on every leave-one-group-
    out mean): |sum_i x_i|^2 >= 0 puts the mean lower entry at or above -(mean diagonal) / (n - 1), and
    x_i . x_j <= (|x_i|^2 + |x_j|^2) / 2 puts it at or below the mean diagonal."""
    return (-1.0 / (n - 1), 1.0)


def diagonal_slope(m: torch.Tensor) -> torch.Tensor:
    """Least-squares slope of the diagonal m[i, i] in i over positions i >= 1 (position 0, the sink's, left out),
    over the mean of those diagonal entries: below 0 when a token's Gram with itself falls along the sequence (the
    paper's reading of (c))."""
    diag = torch.diagonal(m.double())[1:]
    i = torch.arange(1, m.shape[-1], dtype=torch.float64, device=m.device)
    return ((i - i.mean()) * (diag - diag.mean())).sum() / ((i - i.mean()) ** 2).sum() / diag.mean()


def offdiag_uniformity(m: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation (SD over mean) of the finite entries 1 <= j < i over that of the diagonal at
    positions i >= 1 (key 0 and position 0, the sink's, left out): below 1 when the off-diagonal entries are more
    uniform than the diagonal (the paper's "nearly uniform" in (c))."""
    m = m.double()
    n = m.shape[-1]
    low = torch.tril(torch.ones(n, n, dtype=torch.bool, device=m.device), -1) & torch.isfinite(m)
    low[:, 0] = False  # key 0, the sink column
    off, diag = m[low], torch.diagonal(m)[1:]
    return (off.std() / off.mean()) / (diag.std() / diag.mean())


def first_column_contrast(m: torch.Tensor) -> torch.Tensor:
    """Mean of the first column below the diagonal (key 0 for queries i >= 1) minus the mean of the other finite
    entries 1 <= j < i, in standard deviations of those entries: the "vivid line at the 0th column" of (b); above 0
    a column of high scores (an attention sink), below 0 a dark one."""
    m = m.double()
    n = m.shape[-1]
    first = m[1:, 0]
    low = torch.tril(torch.ones(n, n, dtype=torch.bool, device=m.device), -1) & torch.isfinite(m)
    low[:, 0] = False
    others = m[low]
    return (first[torch.isfinite(first)].mean() - others.mean()) / others.std()


def offdiag_correlation(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of two maps' entries 1 <= j < i where both are finite (key 0, the sink, left out): how
    alike their trends are (the paper's "(e) almost identical to (d)")."""
    x, y = x.double(), y.double()
    n = x.shape[-1]
    keep = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), -1) & torch.isfinite(x) & torch.isfinite(y)
    keep[:, 0] = False
    a, b = x[keep] - x[keep].mean(), y[keep] - y[keep].mean()
    return (a * b).sum() / torch.sqrt((a * a).sum() * (b * b).sum())


def bias_corrected(est: Estimate) -> dict:
    """A scalar estimate as run.json numbers at the jackknife's bias-corrected value (`Estimate.debiased`), its
    interval moved with it (the same half-widths) and cut to the estimate's support, marked "debiased"; the
    plug-in value where there is none (fewer than 2 groups: no interval either). The value itself is not cut: an
    unbiased estimate may fall outside the range, and its mean over seeds must not be biased by cutting each one
    (`Estimate.within`)."""
    if est.debiased is None:
        return est.item()
    half = t_quantile((1 + est.level) / 2, est.groups - 1) * est.se  # the plug-in interval's, before any cut
    moved = Estimate(est.debiased, est.debiased - half, est.debiased + half, est.se, est.groups, est.level,
                     est.method, support=est.support)
    return moved.item() | {"value": float(est.debiased), "debiased": True}


# ---------------------------------------------------------------- the statistic


class Intermediates(Statistic):
    """Figure 3's nine Gram maps for layers `layer`, `layer` + 1, Figure 8's per-layer scores, the block check.

    `hm`: a poslens.engine.hooks.HookedModel. `all_layers`: also every layer's Q K^T * scaling (Figure 8; the
    forward then runs to the last layer's attention, else it stops in layer L+1's attention). `check`: recompute
    layer L's block output in float64 and compare (see the module docstring). Batches are whole sequences of one
    length (no padding), as `poslens.engine.data.make_sequences` makes them; the runner sets `self.group`."""

    name = "intermediates"

    def __init__(self, hm, layer: int, groups: int = DEFAULT_GROUPS, all_layers: bool = True, check: bool = True,
                 device: str | torch.device | None = None) -> None:
        super().__init__(groups, device)
        from poslens.engine.families import positional_encoding, sliding_windows

        n = hm.n_layers
        if n < 2:
            raise UsageError(f"layer: the model has {n} layer; intermediates needs two consecutive layers")
        self.layer = check_int("layer", layer, 0, n - 2)
        self.n_layers = n
        self.all_layers = all_layers
        self.family = hm.family
        self.windows = sliding_windows(hm.model.config)
        self.pe = positional_encoding(hm.model)
        self.dtype = next(hm.model.parameters()).dtype
        self.check = {"max_abs": 0.0, "max_rel": 0.0} if check else None
        self._modules = self._float64_modules(hm.layers[layer]) if check else None
        self._pending: dict[str, torch.Tensor] = {}

    def _float64_modules(self, block) -> dict:
        from poslens.engine.families import float64_copy, mlp_block

        mods = {"mlp": float64_copy(mlp_block(self.family, block))}
        if self.family.layout in ("sandwich", "post-norm"):  # the norm after the MLP
            post = self.family.ln2_post if self.family.layout == "sandwich" else self.family.ln2
            mods["post"] = float64_copy(getattr(block, post))
        return mods

    def score_layers(self) -> list[int]:
        """Layers whose Q K^T * scaling is averaged: every layer (Figure 8) or just L and L+1."""
        return list(range(self.n_layers)) if self.all_layers else [self.layer, self.layer + 1]

    # ---- reading

    def hooks(self, hm) -> dict:
        from poslens.engine.hooks import from_factors

        L = self.layer
        out: dict[str, list] = {}

        def add(point: str, fn) -> None:
            out.setdefault(point, []).append(fn)

        for letter, (point, step) in hidden_points(self.family).items():
            add(f"blocks.{L + step}.{point}", self._gram_reader(f"panel_{letter}"))
        if self.family.layout == "parallel":
            add(f"blocks.{L}.hook_resid_pre", self._keep("pre"))
            add(f"blocks.{L}.hook_attn_out", self._parallel_mid)
        add(f"blocks.{L}.attn.hook_z", self._z_reader)
        for l in self.score_layers():
            add(f"blocks.{l}.attn.hook_attn_scores", from_factors(self._scores_reader(l)))
        if self.check is not None and self.family.layout != "parallel":
            add(f"blocks.{L}.hook_resid_mid", self._keep("mid"))
        if self.check is not None:
            add(f"blocks.{L}.{self.family.mlp_input}", self._keep("ln2"))
            add(f"blocks.{L}.hook_resid_post", self._check_block)
        return out

    def _gram_reader(self, name: str):
        def read(x, ctx):
            if name == "panel_a" and ctx.attention_mask is not None and not bool(ctx.attention_mask.all()):
                raise UsageError("intermediates averages whole sequences: run it on unpadded batches "
                                 "(attention_mask all ones or None)")
            self.sums.add(name, self.group, gram_sum(x), x.shape[0])

        return read

    def _z_reader(self, z, ctx):  # [B, T, H, D]: per-head Grams summed = the Gram of the heads side by side
        b, t, h, d = z.shape
        self.sums.add("panel_c", self.group, gram_sum(z.reshape(b, t, h * d)) / h, b)

    def _scores_reader(self, layer: int):
        def read(_, ctx):  # ctx.rot_q [B, H, T, D], ctx.rot_k [B, K, T, D]: after q/k norm and RoPE
            b, h = ctx.rot_q.shape[:2]
            c = ctx.scaling / h
            self.sums.add(f"scores/{layer}", self.group, head_summed_scores(ctx.rot_q, ctx.rot_k) * c, b)
            if layer == self.layer + 1:  # panel (i)'s unit for `cosine_scores`: the same sums' squared norms [T]
                qs = grouped_queries(ctx.rot_q, ctx.rot_k.shape[1])  # [B, K, T, D]
                self.sums.add("q_sq/next", self.group, qs.square().sum((0, 1, 3)) * c, b)
                self.sums.add("k_sq/next", self.group, ctx.rot_k.double().square().sum((0, 1, 3)) * c, b)

        return read

    def _parallel_mid(self, a, ctx) -> None:
        """A parallel block's panel (e): the stream entering it plus what attention adds (what a serial block's MLP
        would read; the block's output is it plus the MLP's)."""
        mid = self._pending.pop("pre") + a
        self._gram_reader("panel_e")(mid, ctx)
        if self.check is not None:
            self._pending["mid"] = mid

    def _keep(self, key: str):
        def keep(x, ctx):
            self._pending[key] = x

        return keep

    def _check_block(self, g, ctx) -> None:
        """(g) = (e) + MLP(f) [+ post-FFN norm], in float64 with the layer's own modules, against the model's."""
        mods = self._modules
        m = mods["mlp"](self._pending.pop("ln2").double())
        if "post" in mods:
            m = mods["post"](m)
        g64 = self._pending.pop("mid").double() + m
        dev = float((g64 - g.double()).abs().max())
        scale = float(g.double().abs().max())
        self.check["max_abs"] = max(self.check["max_abs"], dev)
        self.check["max_rel"] = max(self.check["max_rel"], dev / max(scale, 1e-300))
        tol = check_tolerance(self.dtype)
        if not self.check["max_rel"] <= tol:  # NaN fails too
            raise BlockOutputMismatch(
                f"layer {self.layer}: the block output recomputed in float64 as hook_resid_mid + MLP(ln2) differs "
                f"from the model's hook_resid_post by {dev:.3g} ({self.check['max_rel']:.3g} of its largest entry, "
                f"tolerance {tol:.3g}); the {self.family.name} block is not what poslens.engine.families describes")

    # ---- finishing

    def window(self, panel: str) -> int:
        """Sliding window of the layer a panel's scores come from (0 = none, and for every Gram panel)."""
        return {"b": self.windows[self.layer], "i": self.windows[self.layer + 1]}.get(panel, 0)

    def panel_map(self, letter: str, means: dict[str, torch.Tensor]) -> torch.Tensor:
        """Panel `letter`'s mean map [T, T] from pooled means (upper triangle NaN)."""
        name = {"b": f"scores/{self.layer}", "i": f"scores/{self.layer + 1}"}.get(letter, f"panel_{letter}")
        return nan_hidden(means[name], self.window(letter))

    def result(self, level: float = 0.95) -> dict[str, torch.Tensor]:
        """panel_a .. panel_i (each with _lo/_hi/_se), scores [layers, T, T] and scores_normalised (Figure 8)."""
        out: dict[str, torch.Tensor] = {}
        for letter, _, _ in PANELS:
            est = self.sums.estimate(lambda m, c=letter: self.panel_map(c, m), level=level)
            out.update(est.as_dict(f"panel_{letter}"))
        layers = self.score_layers()

        def stack(m, normalise: bool) -> torch.Tensor:
            maps = [nan_hidden(m[f"scores/{l}"], self.windows[l]) for l in layers]
            out = torch.stack(maps)
            return diagonal_normalised(out) if normalise else out

        out.update(self.sums.estimate(lambda m: stack(m, False), level=level).as_dict("scores"))
        out.update(self.sums.estimate(lambda m: stack(m, True), level=level).as_dict("scores_normalised"))
        out["score_layers"] = torch.tensor(layers)
        return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}

    def summary(self, level: float = 0.95) -> dict:
        """Per panel: mean row slope over keys 1 <= j < i and the off-diagonal/diagonal ratio, with intervals;
        the change of that ratio from (a) to (b) (W_Q, W_K) and from (c) to (d) (W_O), with intervals."""
        panels, ratio_range = {}, gram_ratio_support(self.sums.mean("panel_a").shape[-1])
        for letter, key, _ in PANELS:
            panels[letter] = {
                "name": key, "what": panel_what(letter, self.family),
                "row_slope": self.sums.estimate(lambda m, c=letter: row_slope(self.panel_map(c, m)), level).item(),
                "offdiag_ratio": self.sums.estimate(lambda m, c=letter: offdiag_ratio(self.panel_map(c, m)), level,
                                                    support=ratio_range if letter in GRAM_PANELS else None).item(),
            }
        ratio = {c: (lambda m, c=c: offdiag_ratio(self.panel_map(c, m))) for c in "abcd"}
        changes = {f"offdiag_ratio_{y}_minus_{x}": self.sums.estimate(lambda m, x=x, y=y: ratio[y](m) - ratio[x](m),
                                                                      level).item() for x, y in ("ab", "cd")}
        for letter in "fi":  # the two panels the paper reads as "increases with j for fixed i"
            panels[letter]["rows_increasing"] = self.sums.estimate(
                lambda m, c=letter: share_rows_increasing(self.panel_map(c, m)), level, method="bootstrap",
                support=SHARE).item()  # a share
        panels = self._readings(panels, level)
        return {"panels": panels, "changes": changes, "groups": len(self.sums.filled()), "level": level,
                "amplification": self.amplification(level), "block_output_check": self.check_report()}

    def _readings(self, panels: dict, level: float) -> dict:
        """The statistics Section 4.2 reads from single panels besides slopes and ratios, with intervals, added to
        `panels`: (b)'s first column against the rest (its size and its sign), (c)'s diagonal trend and the
        uniformity of its off-diagonal entries, the correlation of (e) with (d), and the share of (i)'s variance
        the key alone explains. Key 0 (the sink) is left out of each; a correlation and a share of variance of
        noisy mean maps are pulled toward 0, so theirs is the jackknife's bias-corrected value."""
        def est(fn, support=None):
            return self.sums.estimate(fn, level, support=support)

        def contrast(m):
            return first_column_contrast(self.panel_map("b", m))

        panels["b"]["first_column"] = est(lambda m: contrast(m).abs(), NONNEGATIVE).item()
        panels["b"]["first_column_signed"] = est(contrast).item()
        panels["c"]["diagonal_slope"] = est(lambda m: diagonal_slope(self.panel_map("c", m))).item()
        panels["c"]["uniformity"] = est(lambda m: offdiag_uniformity(self.panel_map("c", m))).item()
        panels["e"]["correlation_with_d"] = bias_corrected(est(
            lambda m: offdiag_correlation(self.panel_map("d", m), self.panel_map("e", m)), (-1.0, 1.0)))
        panels["i"]["key_share"] = bias_corrected(est(
            lambda m: torch.as_tensor(key_share(self.panel_map("i", m)[1:, 1:])), SHARE))
        return panels

    def amplification(self, level: float = 0.95) -> dict:
        """Section 4.2's "training amplifies the pattern": the strength (`pattern_strength`) of panel (i) against
        that of the parameter-free stack's second layer (Gram flow) started at the alpha read from panel (a) (its
        off-diagonal/diagonal ratio, the stack's alpha by Eq. 2). Each leave-one-group-out replicate re-reads alpha
        and reruns the flow, so the interval of the ratio carries alpha's uncertainty. Only for layers L, L+1
        without positional encoding (the stack has none)."""
        pe = self.pe[self.layer:self.layer + 2]
        if any(p != "none" for p in pe) or any(self.windows[self.layer:self.layer + 2]):
            return {"skipped": f"layers {self.layer + 1}-{self.layer + 2} are {'/'.join(pe)}"
                               f"{' with a sliding window' if any(self.windows[self.layer:self.layer + 2]) else ''}; "
                               "the parameter-free stack compared against has no positional encoding and a full "
                               "causal mask"}
        if "q_sq/next" not in self.sums:
            return {"skipped": "these partial sums were written before panel (i)'s cosine unit was recorded "
                               "by an earlier poslens: run the statistic again into a new directory"}
        n = self.sums.mean("panel_a").shape[-1]

        best_alpha, best = max(((a, float(stack_strength(a, n))) for a in STACK_ALPHAS), key=lambda t: t[1])

        def parts(m) -> torch.Tensor:
            alpha = offdiag_ratio(self.panel_map("a", m))
            model = row_slope(cosine_scores(self.panel_map("i", m), m["q_sq/next"], m["k_sq/next"]))
            stack = stack_strength(alpha, n)
            return torch.stack([alpha, model, stack, model / stack, model / best])

        est = self.sums.estimate(parts, level)
        names = ("alpha", "model_strength", "stack_strength", "ratio", "ratio_to_strongest_stack")
        support = {"alpha": gram_ratio_support(n)}  # panel (a) is a mean of Gram matrices
        out = {k: Estimate(est.value[i], est.lo[i], est.hi[i], est.se[i], est.groups, level, est.method,
                           support=support.get(k)).item() for i, k in enumerate(names)}
        out["definition"] = ("strength = mean row slope over keys 1 <= j < i of the scores in cosine units, "
                             "E[q_i . k_j] / sqrt(E|q_i|^2 E|k_j|^2); model: panel (i); stack: second-layer scores "
                             "of the d -> infinity parameter-free stack (l2 norm, residual, no positional encoding; "
                             "its scores are cosines already, diagonal 1) from inputs with inner product alpha = "
                             "panel (a)'s off-diagonal/diagonal ratio (clipped to [0, 0.999]); ratio = model / stack; "
                             "ratio_to_strongest_stack = model / the stack's largest strength over alpha in "
                             "0, 0.05, ..., 0.95")
        out["strongest_stack"] = {"alpha": best_alpha, "strength": best}
        return out

    def check_report(self) -> dict | None:
        if self.check is None:
            return None
        return {**self.check, "tolerance": check_tolerance(self.dtype), "dtype": str(self.dtype).removeprefix("torch."),
                "layer": self.layer, "recomputed": f"hook_resid_mid + mlp({self.family.mlp_input})"
                + (" through post_feedforward_layernorm" if self.family.layout != "pre-norm" else "")
                + ", float64, vs hook_resid_post"}

    # ---- persistence and combination (sums plus the check's maxima)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = self.sums.state_dict()
        if self.check is not None:
            state.update({f"check/{k}": torch.tensor(v, dtype=torch.float64) for k, v in self.check.items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.sums.load_state_dict({k: v for k, v in state.items() if not k.startswith("check/")})
        if self.check is not None:
            self.check = {k: float(state.get(f"check/{k}", torch.tensor(0.0))) for k in self.check}

    def merge(self, other: Intermediates) -> None:
        self.sums.merge(other.sums)
        if self.check is not None and other.check is not None:
            self.check = {k: max(v, other.check[k]) for k, v in self.check.items()}

    def all_reduce(self, group=None) -> None:
        import torch.distributed as dist

        self.sums.all_reduce(group)
        if self.check is not None and dist.is_available() and dist.is_initialized():
            t = torch.tensor([self.check["max_abs"], self.check["max_rel"]], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            self.check = {"max_abs": float(t[0]), "max_rel": float(t[1])}


# ---------------------------------------------------------------- the analysis


@dataclass
class IntermediatesConfig(ModelData):
    """Everything that determines an `intermediates` run (recorded in run.json and the checkpoint fingerprint)."""

    seq_len: int = option_of(ModelData, "seq_len", DEFAULT_SEQ_LEN)  # the paper: the first 50 tokens
    num_sequences: int | None = option_of(ModelData, "num_sequences", DEFAULT_SEQUENCES, help=SEQUENCES_HELP)
    batch_size: int = option_of(ModelData, "batch_size", 50)
    layer: int = option(0, lo=0, help="the first of the two consecutive layers L, L+1 (index from 0; figures number "
                        "layers from 1, so the default shows the paper's layers 1 and 2)")
    all_layers: bool = option(True, help="skip Figure 8 (every layer's scores); the forward then stops in layer "
                              "L+1's attention")


class IntermediatesAnalysis(Analysis):
    """Figure 3 and Figure 8: one pass of the `Intermediates` statistic."""

    kind = "intermediates"

    def check(self, job: Job) -> None:
        n, layer = job.hm.n_layers, job.config.layer
        if layer > n - 2:
            raise UsageError(f"layer {layer} has no next layer: the model has {n} layers, so use layer 0..{n - 2}",
                             param="layer")

    def memory(self, job: Job) -> dict[str, tuple[float, str]]:
        cfg = job.config
        maps = len(PANELS) - 2 + (job.hm.n_layers if cfg.all_layers else 2)
        return {"grouped sums of the maps": (cfg.groups * maps * cfg.seq_len ** 2 * 8, "groups")}

    def passes(self, job: Job) -> list[Pass]:
        return [Pass("intermediates", [Intermediates(job.hm, job.config.layer, groups=job.groups,
                                                     all_layers=job.config.all_layers)])]

    def finish(self, job: Job, passes: list[Pass]) -> Output:
        stat, cfg, family = passes[0].statistics[0], job.config, job.hm.family
        return Output(stat.result(cfg.level), stat.summary(cfg.level), {
            "layer_numbering": "indices from 0 in config and tensors; figures number layers from 1",
            "panels": {letter: {"what": panel_what(letter, family), "layer": cfg.layer + (letter in "hi"),
                                "hook_point": _hook_point(letter, cfg.layer, family)} for letter, _, _ in PANELS}})

    def figures(self, job: Job, output: Output, directory: Path) -> list[Path]:
        paths = figure3(output.tensors, job.config.layer, directory, job.label, job.hm.family)
        return paths + (figure8(output.tensors, directory, job.label) if job.config.all_layers else [])


INTERMEDIATES = IntermediatesAnalysis()


def run_intermediates(cfg: IntermediatesConfig, out: str | Path, force: bool = False, progress: bool = True) -> Path:
    """Compute the panels and Figure 8, write the run directory `out` (figures in out/figures); returns its path."""
    return run_analysis(INTERMEDIATES, cfg, out, force=force, progress=progress)


@dataclass
class IntermediatesOptions:
    """`poslens stat intermediates`: which pair of layers, and whether every layer's scores too."""

    layer: int = option_of(IntermediatesConfig, "layer", 0)
    all_layers: bool = option_of(IntermediatesConfig, "all_layers", True)


SPEC = Spec("intermediates", "the Gram matrices of Figure 3 for layers L, L+1 and every layer's Q K^T (Figure 8)",
            IntermediatesOptions, lambda hm, o, groups: Intermediates(hm, o.layer, groups, o.all_layers))


def _hook_point(letter: str, layer: int, family) -> str:
    if letter in "bi":
        l = layer + (letter == "i")
        return f"blocks.{l}.attn.hook_rot_q x blocks.{l}.attn.hook_rot_k * scaling"
    if letter == "c":
        return f"blocks.{layer}.attn.hook_z"
    if letter == "e" and family.layout == "parallel":
        return f"blocks.{layer}.hook_resid_pre + blocks.{layer}.hook_attn_out"
    point, step = hidden_points(family)[letter]
    return f"blocks.{layer + step}.{point}"


def _num(x, spec: str) -> str:
    """A number of run.json for a summary line (NaN is kept there as null: an interval undefined in a replicate)."""
    return "nan" if x is None else format(x, spec)


def _interval(e: dict, spec: str) -> str:
    return f"{_num(e['value'], spec)} [{_num(e['lo'], spec)}, {_num(e['hi'], spec)}]"


def summary_lines(meta: dict) -> list[str]:
    """What `poslens intermediates` prints: one line per panel (row slope and off-diagonal/diagonal ratio with
    intervals), the readings of Section 4.2's other rows, the amplification over the parameter-free stack, the
    block check, and the intervals' groups."""
    m = meta["metrics"]
    lines = [f"({letter}) {p['what']:<32} row slope {_interval(p['row_slope'], '+.4g')}  off-diagonal/diagonal "
             f"{_interval(p['offdiag_ratio'], '.3g')}" for letter, p in m["panels"].items()]
    p = m["panels"]
    if "key_share" in p.get("i", {}):  # Section 4.2's other readings (absent from runs of an earlier poslens)
        lines.append(f"(b) first column - the other keys {_interval(p['b']['first_column_signed'], '+.3g')} SDs; "
                     f"(c) diagonal slope / mean {_interval(p['c']['diagonal_slope'], '+.3g')}, off-diagonal/diagonal "
                     f"variation {_interval(p['c']['uniformity'], '.3g')}; (e) vs (d) correlation "
                     f"{_interval(p['e']['correlation_with_d'], '.5g')}; (i) key share "
                     f"{_interval(p['i']['key_share'], '.3g')}")
    if "rows_increasing" in p.get("f", {}) and "rows_increasing" in p.get("i", {}):
        lines.append(f"rows increasing with j (share of rows i whose slope over keys 1 <= j < i is positive): (f) "
                     f"{_interval(p['f']['rows_increasing'], '.3g')}, (i) {_interval(p['i']['rows_increasing'], '.3g')}"
                     f" (bootstrap over groups)")
    amp = m.get("amplification") or {}
    if "ratio" in amp:
        lines.append(f"amplification (Section 4.2): panel (i)'s pattern is {_interval(amp['ratio'], '.3g')} times "
                     f"the parameter-free stack's at alpha {_num(amp['alpha']['value'], '.3g')} from panel (a)")
    elif "skipped" in amp:
        lines.append(f"amplification: not measured ({amp['skipped']})")
    c = m.get("block_output_check")
    if c:
        lines.append(f"block output check (layer index {c['layer']}): max deviation {c['max_abs']:.3g}, "
                     f"{c['max_rel']:.3g} of the largest entry (tolerance {c['tolerance']:.3g}, {c['dtype']})")
    lines.append(f"intervals: {100 * m['level']:g}% jackknife over {m['groups']} groups of sequences")
    return lines


# ---------------------------------------------------------------- figures


def panel_title(letter: str, layer: int, family=None) -> str:
    """Figure 3 panel title, layers numbered from 1 (layer index L is layer L+1), in `family`'s layout's words."""
    return f"({letter}) {panel_what(letter, family)}, layer {layer + 1 + (letter in 'hi')}"


def figure3(result: dict, layer: int, directory: Path, label: str, family=None) -> list[Path]:
    """The 3 x 3 grid of Figure 3: figure3.{png,pdf}. Each panel's colour limits are the 1% and 99% quantiles of
    its off-diagonal entries (the diagonal, a token with itself, is far larger in most panels and saturates)."""
    from poslens import plotting

    maps = [result[f"panel_{c}"] for c, _, _ in PANELS]
    limits = [plotting.offdiag_limits(m, (0.01, 0.99)) for m in maps]
    fig = plotting.map_grid(maps, [panel_title(c, layer, family) for c, _, _ in PANELS], ncols=3, limits=limits,
                            suptitle=f"{label}: Gram matrices of the intermediates of layers {layer + 1} and "
                            f"{layer + 2}, mean over sequences (and heads)", panel_size=3.0)
    return plotting.save(fig, directory, "figure3")


def figure8(result: dict, directory: Path, label: str) -> list[Path]:
    """Every averaged layer's diagonal-normalised Q K^T * scaling: figure8.{png,pdf} (the raw maps are in the run's
    `scores` tensor)."""
    from poslens import plotting

    layers = result["score_layers"].tolist()
    titles = [f"layer {l + 1}" for l in layers]
    ncols = min(6, len(layers))
    paths = plotting.save(plotting.map_grid(list(result["scores_normalised"]), titles, ncols=ncols,
                                            limits="quantile", suptitle=f"{label}: Q K^T * scaling, mean over "
                                            "sequences and heads, diagonal-normalised"), directory, "figure8")
    return paths
