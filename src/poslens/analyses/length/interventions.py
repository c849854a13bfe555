"""Interventions at evaluation time for a model trained at length L, each a pass over the same sequences.

    iv = parse("ntk", train_len=128)
    with iv.applied(hm, ids) as p:            # p.ids, p.hooks (writes), p.attention_mask, p.position_ids
        hm.run(p.ids, p.attention_mask, hooks={**p.hooks, **readers}, position_ids=p.position_ids)

`applied` is the two parts of an intervention together: `changed(hm, length)`, a context in which the model itself
is changed for forwards of `length` tokens and restored after (ntk and yarn: the rotary frequencies), and
`prepare(hm, ids)`, a plain function giving one batch's forward (logn: write hooks, window: a mask, freeze: write
hooks and ids); the length analysis enters the first around a pass and calls the second per batch.

Specs (`parse`):

    none        the model as it is
    logn        per-query logit scale lambda_i = max(1, log(i + 1) / log L) (Scalable-Softmax style: the softmax
                denominator of query i sums i + 1 terms; the scale keeps its log growing like the numerator's).
                Applied to the query after any q-norm and RoPE: s_ij = scaling * q_i . k_j is linear in q_i, so
                lambda_i q_i multiplies row i of the scores by lambda_i exactly (masked entries stay masked; the
                rotation is linear, so before or after RoPE is the same, but a q-norm would undo a scale written
                before it; Gemma-2's softcap bends the scaled scores). Positions below L are left alone, so the
                loss there is the model's own.
    logn-all    lambda_i = log(i + 1) / log L at every position (also shrinks the scores below L; lambda_0 = 0)
    ntk[:F]     NTK-aware base scaling theta' = theta F^(d / (d - 2)) (d: rotary dimensions), the frequencies
                computed by the model's own rotary init function; F defaults to T / L for an evaluation length T
    yarn[:F]    YaRN (Peng et al. 2023) by transformers' own yarn init: frequencies blended between interpolation and
                extrapolation by wavelength, and the attention factor 0.1 ln F + 1 on cos and sin; F as ntk
    window[:W]  sliding window: keys W or more positions back are masked (W defaults to L), by an explicit mask
                (masks.py) on top of the model's own windows. It also hides key 0 from every query past W, so on
                a model with sink heads it removes the sink as well as the far context
    sink-window[:W]  the window that keeps the sink (StreamingLLM's and LM-Infinite's masks): key 0 and the last
                W - 1 keys, so a query sees at most W keys, as under window[:W]; set against window[:W], it
                separates "far context hurts" from "the sink is gone"
    alibi-scale[:F]  ALiBi (BLOOM): every head's slope multiplied by F, so the bias on a key d tokens back is
                -F * slope * d (the model's own bias code, times F); F defaults to L / T for an evaluation length
                T > L (at most 1): the bias across the whole evaluated context then spans what it spanned across L
                (interpolation of the distance penalty, as position interpolation does for RoPE); F = 0 removes it
    freeze      position 0's whole trajectory replaced by that of a fixed first token (the leakage analysis's
                `freeze`, reused): every sequence then shows the same key 0 in every layer
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from poslens.analyses.length.checks import rope_types
from poslens.analyses.length.masks import model_mask, right_padded
from poslens.analyses.length.points import query_point
from poslens.engine.families import positional_encoding, rotary_modules, scale_alibi
from poslens.engine.pe import ntk_theta
from poslens.errors import UsageError, check_float, check_int

SPECS = ("none", "logn", "logn-all", "ntk", "yarn", "window", "sink-window", "alibi-scale", "freeze")
# the number after the colon, by spec: (what it is, its least value, whole number, an example)
ARGUMENTS = {"ntk": ("the factor", 1.0, False, "ntk:4"), "yarn": ("the factor", 1.0, False, "yarn:4"),
             "alibi-scale": ("the factor", 0.0, False, "alibi-scale:0.5"),
             "window": ("the window", 1, True, "window:64"), "sink-window": ("the window", 2, True, "sink-window:64")}


@dataclass
class Forward:
    """What one forward of an intervention runs: ids, write hooks (point -> list), and model arguments."""

    ids: torch.Tensor
    hooks: dict[str, list] = field(default_factory=dict)
    attention_mask: torch.Tensor | dict | None = None
    position_ids: torch.Tensor | None = None


class Intervention:
    """Base: the model as it is. Subclasses change `prepare` (one batch's forward) or `changed` (the model, for a
    block); `check` refuses a model they cannot act on."""

    name = "none"

    def check(self, model) -> None:
        """A one-line UsageError when this intervention cannot act on `model` (before any work)."""

    def prepare(self, hm, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Forward:
        """One batch's forward under the intervention: its ids, write hooks, mask and position ids."""
        return Forward(ids, attention_mask=attention_mask)

    def changed(self, hm, length: int) -> AbstractContextManager:
        """A context in which the model is changed for forwards of `length` tokens, restored on exit (none here)."""
        return nullcontext()

    @contextmanager
    def applied(self, hm, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Iterator[Forward]:
        """One forward's `prepare` inside `changed` for its length."""
        with self.changed(hm, ids.shape[1]):
            yield self.prepare(hm, ids, attention_mask)


def log_scale(n: int, train_len: int, clamp: bool = True) -> torch.Tensor:
    """lambda_i = log(i + 1) / log L for i < n (float64), at least 1 when `clamp`."""
    lam = torch.log1p(torch.arange(n, dtype=torch.float64)) / math.log(train_len)
    return lam.clamp(min=1.0) if clamp else lam


@dataclass
class LogScaling(Intervention):
    """Per-query logit scale lambda_i (module docstring, `logn` and `logn-all`)."""

    train_len: int
    clamp: bool = True

    def __post_init__(self) -> None:
        check_int("train_len", self.train_len, 2)
        self.name = "logn" if self.clamp else "logn-all"

    def prepare(self, hm, ids, attention_mask=None):
        lam = log_scale(ids.shape[1], self.train_len, self.clamp)
        hooks = {}
        for l in range(hm.n_layers):
            point, axis = query_point(hm, l)
            shape = [1] * 4
            shape[axis] = -1

            def scale(q, ctx, shape=tuple(shape)):
                return q * lam.to(q.device, q.dtype).view(shape)

            hooks[point] = [scale]
        return Forward(ids, hooks, attention_mask)


@dataclass
class RopeScaling(Intervention):
    """NTK or YaRN scaling of the rotary frequencies at inference (module docstring); factor None = T / L."""

    kind: str
    train_len: int
    factor: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("ntk", "yarn"):
            raise UsageError(f"rope scaling must be ntk or yarn, got {self.kind!r}")
        check_int("train_len", self.train_len, 2)
        if self.factor is not None:
            check_float(f"{self.kind} factor", self.factor, 1.0, math.inf, hi_open=True)
        self.name = self.kind if self.factor is None else f"{self.kind}:{self.factor:g}"

    def check(self, model) -> None:
        types = rope_types(model)
        if not types:
            alibi = "alibi" in positional_encoding(model)
            raise UsageError(f"{self.name}: the model has no RoPE layer, so scaling its frequencies changes nothing"
                             + ("; its ALiBi slopes scale with alibi-scale[:F]" if alibi else ""))
        if types != {"default"}:
            raise UsageError(f"{self.name}: the model's RoPE is already scaled (rope_type {sorted(types)[0]}); "
                             "NTK and YaRN at evaluation act on default RoPE")
        if any(hasattr(m, "embed_positions") for m in rotary_modules(model)):  # GPT-J: a fixed sin/cos table
            raise UsageError(f"{self.name}: the model's rotary angles come from a fixed sin/cos table of base 10000 "
                             "(GPT-J's, which transformers cannot rescale), not from frequencies; NTK and YaRN at "
                             "evaluation act on RoPE computed from inv_freq")
        dims = [2 * b.numel() for m in rotary_modules(model) for n, b in m.named_buffers(recurse=False)
                if n.endswith("inv_freq")]
        if self.kind == "ntk" and dims and min(dims) <= 2:  # theta * F ** (d / (d - 2)) needs d > 2
            raise UsageError(f"{self.name}: NTK scaling needs more than 2 rotary dimensions per head (the base "
                             f"becomes theta * F ** (d / (d - 2))); this model turns {min(dims)}: use yarn")

    def changed(self, hm, length):
        return self.scaled(hm, self.factor if self.factor is not None else max(1.0, length / self.train_len))

    @contextmanager
    def scaled(self, hm, factor: float):
        """The model's rotary frequencies (and attention factor) scaled by `factor` inside the block, restored after."""
        self.check(hm.model)
        saved = []
        try:
            for m in rotary_modules(hm.model):
                types = m.rope_type if isinstance(m.rope_type, dict) else {None: m.rope_type}
                for layer_type in types:
                    prefix = "" if layer_type is None else f"{layer_type}_"
                    old = getattr(m, f"{prefix}inv_freq"), getattr(m, f"{prefix}attention_scaling")
                    inv, att = self.frequencies(m, factor, layer_type)
                    saved.append((m, prefix, old))
                    setattr(m, f"{prefix}inv_freq", inv.to(old[0].device, old[0].dtype))
                    setattr(m, f"{prefix}attention_scaling", att)
            yield
        finally:
            for m, prefix, (inv, att) in saved:
                setattr(m, f"{prefix}inv_freq", inv)
                setattr(m, f"{prefix}attention_scaling", att)

    def frequencies(self, rotary, factor: float, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
        """(inverse frequencies, attention factor) of this scaling for one rotary module, from a copy of its config
        with the scaled rope parameters, by transformers' own init functions."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        config = copy.deepcopy(rotary.config)
        config.standardize_rope_params()
        params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
        current = getattr(rotary, "inv_freq" if layer_type is None else f"{layer_type}_inv_freq")
        device = current.device
        kw = {} if layer_type is None else {"layer_type": layer_type}
        if self.kind == "ntk":
            params["rope_theta"] = ntk_theta(params["rope_theta"], factor, 2 * current.numel())
            return type(rotary).compute_default_rope_parameters(config, device=device, **kw)
        params.update(rope_type="yarn", factor=float(factor), original_max_position_embeddings=self.train_len)
        return ROPE_INIT_FUNCTIONS["yarn"](config, device, **kw)


@dataclass
class AlibiScaling(Intervention):
    """ALiBi's slopes times a factor at inference (module docstring, `alibi-scale`); factor None = min(1, L / T)."""

    train_len: int
    factor: float | None = None

    def __post_init__(self) -> None:
        check_int("train_len", self.train_len, 2)
        if self.factor is not None:
            check_float("alibi-scale factor", self.factor, 0.0, math.inf, hi_open=True)
        self.name = "alibi-scale" if self.factor is None else f"alibi-scale:{self.factor:g}"

    def check(self, model) -> None:
        if "alibi" not in positional_encoding(model):
            raise UsageError(f"{self.name}: the model has no ALiBi layer (its positional encoding is "
                             f"{sorted(set(positional_encoding(model)))[0]}), so there is no slope to scale")

    @contextmanager
    def changed(self, hm, length):
        self.check(hm.model)
        undo = scale_alibi(hm.model, self.factor if self.factor is not None else min(1.0, self.train_len / length))
        try:
            yield
        finally:
            undo()


@dataclass
class Window(Intervention):
    """Keys `window` or more positions back masked, on top of the model's own windows (window None = L); with
    `sinks` (1: the sink window), the first `sinks` keys stay visible besides the last window - sinks."""

    train_len: int
    window: int | None = None
    sinks: int = 0

    def __post_init__(self) -> None:
        check_int("train_len", self.train_len, 2)
        check_int("sinks", self.sinks, 0)
        if self.window is not None:
            check_int("window", self.window, self.sinks + 1)
        kind = "sink-window" if self.sinks else "window"
        self.name = kind if self.window is None else f"{kind}:{self.window}"

    def prepare(self, hm, ids, attention_mask=None):
        keys = None if attention_mask is None else right_padded(attention_mask)
        return Forward(ids, attention_mask=model_mask(hm.model, ids.shape[1], self.window or self.train_len, keys,
                                                  self.sinks))


@dataclass
class Freeze(Intervention):
    """Position 0's trajectory fixed to that of `token` (None: the first token of the first batch seen)."""

    token: int | None = None
    name = "freeze"

    def prepare(self, hm, ids, attention_mask=None):
        from poslens.analyses.leakage.interventions import prepare

        if self.token is None:
            self.token = int(ids[0, 0])
        # position 0 depends on token 0 alone (causality; its rotation is the identity), so one token is the reference
        reference = torch.tensor([self.token], device=ids.device)
        run_ids, hooks, _ = prepare("freeze", hm.model, hm, ids, reference)
        return Forward(run_ids, {k: [v] for k, v in hooks.items()}, attention_mask)


def parse(spec: str, train_len: int) -> Intervention:
    """An intervention from its spec (module docstring), e.g. "ntk", "yarn:4", "window:64"; one-line errors."""
    name, _, arg = str(spec).strip().partition(":")
    if name not in SPECS or (arg and name not in ("ntk", "yarn", "window", "sink-window", "alibi-scale")):
        raise UsageError(f"interventions: unknown intervention {spec!r}; use none, logn, logn-all, ntk[:F], "
                         "yarn[:F], window[:W], sink-window[:W], alibi-scale[:F] or freeze", param="interventions")
    try:
        value = float(arg) if arg else None
    except ValueError:
        raise UsageError(f"interventions: {spec!r} needs a number after the colon, e.g. {name}:4",
                         param="interventions") from None
    if value is not None:
        what, low, whole, example = ARGUMENTS[name]
        if not math.isfinite(value) or value < low or (whole and value != int(value)):
            kind = "a whole number" if whole else "a number"
            raise UsageError(f"interventions: {spec!r}: {what} after the colon must be {kind} >= {low:g}, e.g. "
                             f"{example}", param="interventions")
        value = int(value) if whole else value
    if name == "none":
        return Intervention()
    if name in ("logn", "logn-all"):
        return LogScaling(train_len, clamp=name == "logn")
    if name in ("ntk", "yarn"):
        return RopeScaling(name, train_len, value)
    if name == "window":
        return Window(train_len, value)
    if name == "alibi-scale":
        return AlibiScaling(train_len, value)
    if name == "sink-window":
        return Window(train_len, value, sinks=1)
    return Freeze()
