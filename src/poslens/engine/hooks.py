"""Hook points on every supported model: read or replace any intermediate, named as TransformerLens names them.

    hm = HookedModel(model)
    hm.run(input_ids, hooks={"blocks.0.hook_resid_pre": read, "blocks.3.attn.hook_z": patch})

A hook is `fn(x, ctx)`: return None to read, or a tensor of x's shape to replace x for the rest of the forward.
`ctx` (a HookContext) names the point and layer and, at attention points, holds q, k, v (after RoPE and any q/k
norm), `scaling`, `window` and `softcap`. The run ends after the last hooked point (no LM head) unless
`logits=True`; with read-only hooks the model's outputs are bit-identical to a plain SDPA forward, and nothing a
hook does not ask for is computed (the [B, H, T, T] scores exist only if a hook at `attn.hook_attn_scores` or
`attn.hook_pattern` reads them as a tensor; a reader marked with `from_factors` gets None and works from ctx.q and
ctx.k, e.g. a head-summed GEMM).

How: while a run is active, each decoder layer's forward is poslens's block forward below (the two residual lines,
with a hook on every intermediate), and attention goes through a registered transformers attention function that
fires the attention points and then calls the model's own attention (SDPA, or the family's eager function).

Points (l = layer index from 0, as transformers and TransformerLens count; shapes for batch B, tokens T):

    hook_embed                          [B, T, d]      token embeddings (Gemma: after its sqrt(d) scale)
    blocks.{l}.hook_resid_pre           [B, T, d]      the residual stream entering layer l
    blocks.{l}.ln1.hook_normalized      [B, T, d]      input norm
    blocks.{l}.attn.hook_q              [B, H, T, D]   queries after q-norm and RoPE
    blocks.{l}.attn.hook_k              [B, Hkv, T, D] keys after k-norm and RoPE (not repeated for GQA)
    blocks.{l}.attn.hook_v              [B, Hkv, T, D]
    blocks.{l}.attn.hook_attn_scores    [B, H, T, T]   q.k * scaling (Gemma-2: after the softcap), -inf if masked
    blocks.{l}.attn.hook_pattern        [B, H, T, T]   softmax of the scores (0 on rows with no visible key)
    blocks.{l}.attn.hook_z              [B, T, H, D]   per-head attention output, before W_O
    blocks.{l}.hook_attn_out            [B, T, d]      after W_O
    blocks.{l}.ln1_post.hook_normalized [B, T, d]      Gemma only: the norm after attention (what is added)
    blocks.{l}.hook_resid_mid           [B, T, d]      after the attention residual
    blocks.{l}.ln2.hook_normalized      [B, T, d]      norm before the MLP (Gemma: pre_feedforward_layernorm)
    blocks.{l}.hook_mlp_out             [B, T, d]      MLP output
    blocks.{l}.ln2_post.hook_normalized [B, T, d]      Gemma only: the norm after the MLP (what is added)
    blocks.{l}.hook_resid_post          [B, T, d]      the residual stream leaving layer l
    ln_final.hook_normalized            [B, T, d]      the final norm (before the LM head)
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import types
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import eager_mask, sdpa_mask

from poslens.engine.families import decoder_layers, family_of
from poslens.errors import UsageError

ATTN_SDPA = "poslens_hooks"
ATTN_EAGER = "poslens_hooks_eager"
_OWNER = "_poslens_hooked"  # attribute on the attention modules and layers of a model with a run in progress

# forward order of the points inside one block (attention points are prefixed "attn.")
BLOCK_POINTS = ("hook_resid_pre", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v",
                "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "hook_attn_out",
                "ln1_post.hook_normalized", "hook_resid_mid", "ln2.hook_normalized", "hook_mlp_out",
                "ln2_post.hook_normalized", "hook_resid_post")
SANDWICH_ONLY = ("ln1_post.hook_normalized", "ln2_post.hook_normalized")

HookFn = Callable[[Any, "HookContext"], Any]


def from_factors(fn: HookFn) -> HookFn:
    """Mark a reader of `attn.hook_attn_scores` that works from ctx.q and ctx.k: it gets None, no scores are formed."""
    def reader(x, ctx):
        return fn(x, ctx)

    reader.poslens_from_factors = True
    return reader


@dataclass
class HookContext:
    """What a hook sees besides the value: the point, the layer, the batch and (attention points) q, k, v."""

    name: str
    layer: int | None
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # [B, T] as passed to run() (1 = real token), or None
    position_ids: torch.Tensor | None
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    scaling: float | None = None
    window: int = 0  # sliding window of this layer (0 = none)
    softcap: float | None = None
    module: Any = None


class _Stop(Exception):
    """Raised after the last hooked point to end a forward early."""


@dataclass
class _Run:
    """One forward in progress: the hooks by point, where to stop, the batch."""

    by_point: dict[str, list[HookFn]]
    last: tuple[int, int] | None  # (layer, point index) after which the forward ends; None = run to the end
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    per_layer: dict[int, dict[str, list[HookFn]]] = field(default_factory=dict)


def _point_order(name: str, n_layers: int) -> tuple[int, int]:
    """(layer, index) of a point in forward order; hook_embed first, ln_final last."""
    if name == "hook_embed":
        return (-1, 0)
    if name == "ln_final.hook_normalized":
        return (n_layers, 0)
    layer, point = _split(name)
    return (layer, BLOCK_POINTS.index(point))


def _split(name: str) -> tuple[int, str]:
    parts = name.split(".", 2)
    return int(parts[1]), parts[2]


class HookedModel:
    """A supported Hugging Face causal LM with named hook points (see the module docstring)."""

    def __init__(self, model) -> None:
        self.model = model
        self.family = family_of(model.config)
        self.layers = decoder_layers(model)
        self.n_layers = len(self.layers)
        names = [p for p in BLOCK_POINTS if self.family.layout == "sandwich" or p not in SANDWICH_ONLY]
        self.points = ["hook_embed"] + [f"blocks.{l}.{p}" for l in range(self.n_layers) for p in names] + \
            ["ln_final.hook_normalized"]
        self._known = set(self.points)
        self._run: _Run | None = None

    # ---- running ------------------------------------------------------------------------------------------

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            hooks: dict[str, HookFn | list[HookFn]] | None = None, *, logits: bool = False,
            position_ids: torch.Tensor | None = None, **model_kwargs):
        """One forward under no_grad with `hooks` (point name -> function or list of functions).

        Returns the model's output (logits) when `logits=True`; otherwise the forward stops after the last hooked
        point and returns None. `model_kwargs` go to the model's forward (e.g. output_hidden_states=True).
        """
        by_point = self._check_hooks(hooks or {})
        last = None if logits or not by_point else max(_point_order(n, self.n_layers) for n in by_point)
        if last is not None and last[0] >= self.n_layers:
            last = None  # ln_final is hooked: run the base model to its end
        run = _Run(by_point, last, input_ids, attention_mask, position_ids)
        for name, fns in by_point.items():
            if name.startswith("blocks."):
                layer, point = _split(name)
                run.per_layer.setdefault(layer, {})[point] = fns
        with torch.no_grad(), self._installed(run):
            kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False, **model_kwargs)
            if logits:
                return self.model(**kwargs)
            try:
                self.model.base_model(**kwargs)
            except _Stop:
                pass
        return None

    def _check_hooks(self, hooks: dict) -> dict[str, list[HookFn]]:
        out = {}
        for name, fns in hooks.items():
            if name not in self._known:
                hint = "e.g. blocks.0.hook_resid_pre, blocks.0.attn.hook_q; see HookedModel.points"
                if name.startswith("blocks.") and name.split(".")[1].isdigit() and \
                        int(name.split(".")[1]) >= self.n_layers:
                    hint = f"the model has {self.n_layers} layers (0-{self.n_layers - 1})"
                raise UsageError(f"hooks: no hook point {name!r} on this {self.family.name} model ({hint})")
            fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
            if not all(callable(f) for f in fns):
                raise UsageError(f"hooks: the hook at {name!r} is not callable")
            out[name] = fns
        return out

    @contextmanager
    def _installed(self, run: _Run):
        if self._run is not None:
            raise UsageError("this HookedModel is already running a forward (hooks cannot nest)")
        _register()
        saved = self.model.config._attn_implementation
        self.model.set_attn_implementation(ATTN_EAGER if self.family.eager_output else ATTN_SDPA)
        handles = []
        base = self.model.base_model
        if "hook_embed" in run.by_point:
            handles.append(base.embed_tokens.register_forward_hook(self._module_hook("hook_embed", None)))
        if "ln_final.hook_normalized" in run.by_point:
            handles.append(base.norm.register_forward_hook(self._module_hook("ln_final.hook_normalized", None)))
        for layer in self.layers:
            setattr(layer, _OWNER, self)
            setattr(layer.self_attn, _OWNER, self)
            layer.forward = types.MethodType(_block_forward, layer)
        self._run = run
        try:
            yield
        finally:
            self._run = None
            for layer in self.layers:
                del layer.forward  # back to the class's forward
                delattr(layer, _OWNER)
                delattr(layer.self_attn, _OWNER)
            for h in handles:
                h.remove()
            self.model.set_attn_implementation(saved)

    def _module_hook(self, name: str, layer: int | None):
        def hook(module, args, output):
            return self._fire(name, layer, output, self._run.by_point[name])

        return hook

    # ---- firing -------------------------------------------------------------------------------------------

    def _ctx(self, name: str, layer: int | None, **attn) -> HookContext:
        run = self._run
        return HookContext(name, layer, run.input_ids, run.attention_mask, run.position_ids, **attn)

    def _fire(self, name: str, layer: int | None, x, fns: list[HookFn] | None, ctx: HookContext | None = None):
        """Call the hooks of one point in order; a returned tensor replaces x. Then stop if this is the last."""
        if fns:
            ctx = ctx or self._ctx(name, layer)
            for fn in fns:
                out = fn(x, ctx)
                if out is not None:
                    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
                        raise UsageError(f"hook at {name}: a replacement must be a tensor of shape "
                                         f"{tuple(x.shape)}, got {getattr(out, 'shape', type(out).__name__)}")
                    x = out.to(x.dtype)
            if self._run.last is not None and _point_order(name, self.n_layers) == self._run.last:
                raise _Stop
        return x

    def _block(self, layer_mod, l: int, hidden_states: torch.Tensor, attn_kwargs: dict) -> torch.Tensor:
        """The decoder block with a hook on every intermediate (the model's own modules, in the model's order)."""
        pts = self._run.per_layer.get(l, {})

        def fire(point: str, x):
            fns = pts.get(point)
            return self._fire(f"blocks.{l}.{point}", l, x, fns) if fns else x

        fam = self.family
        x = fire("hook_resid_pre", hidden_states)
        h = fire("ln1.hook_normalized", getattr(layer_mod, fam.ln1)(x))
        a, _ = layer_mod.self_attn(hidden_states=h, **attn_kwargs)
        a = fire("hook_attn_out", a)
        if fam.layout == "sandwich":  # Gemma: x + norm(attn(norm(x))), x + norm(mlp(norm(x)))
            a = fire("ln1_post.hook_normalized", getattr(layer_mod, fam.ln1_post)(a))
            x = fire("hook_resid_mid", x + a)
            m = fire("hook_mlp_out", layer_mod.mlp(fire("ln2.hook_normalized", getattr(layer_mod, fam.ln2_pre)(x))))
            m = fire("ln2_post.hook_normalized", getattr(layer_mod, fam.ln2_post)(m))
            return fire("hook_resid_post", x + m)
        # pre-norm (Llama): x + attn(norm(x)), then x + mlp(norm(x)); Phi-3's residual dropouts are identities in eval
        drop_attn = getattr(layer_mod, "resid_attn_dropout", None)
        drop_mlp = getattr(layer_mod, "resid_mlp_dropout", None)
        x = fire("hook_resid_mid", x + (drop_attn(a) if drop_attn is not None else a))
        m = fire("hook_mlp_out", layer_mod.mlp(fire("ln2.hook_normalized", getattr(layer_mod, fam.ln2)(x))))
        return fire("hook_resid_post", x + (drop_mlp(m) if drop_mlp is not None else m))

    def _attention(self, module, inner, query, key, value, attention_mask, dropout, scaling, kwargs):
        """Fire the attention points of one layer, then compute its output (the model's own function unless a
        hook replaced the scores or the pattern)."""
        l = module.layer_idx
        pts = self._run.per_layer.get(l, {})
        if not any(p.startswith("attn.") for p in pts):
            return inner(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if scaling is None:
            scaling = module.head_dim**-0.5
        ctx = self._ctx("", l, q=query, k=key, v=value, scaling=scaling, window=int(kwargs.get("sliding_window") or 0),
                        softcap=kwargs.get("softcap"), module=module)

        def fire(point: str, x, fns=None):
            fns = pts.get(point) if fns is None else fns
            if not fns:
                return x
            ctx.name = f"blocks.{l}.{point}"
            return self._fire(ctx.name, l, x, fns, ctx)

        query = ctx.q = fire("attn.hook_q", query)
        key = ctx.k = fire("attn.hook_k", key)
        value = ctx.v = fire("attn.hook_v", value)
        score_fns = pts.get("attn.hook_attn_scores", [])
        factored = [f for f in score_fns if getattr(f, "poslens_from_factors", False)]
        dense = [f for f in score_fns if not getattr(f, "poslens_from_factors", False)]
        pattern_fns = pts.get("attn.hook_pattern", [])
        if factored:
            ctx.name = f"blocks.{l}.attn.hook_attn_scores"
            for fn in factored:
                fn(None, ctx)
            if not dense and self._run.last == (l, BLOCK_POINTS.index("attn.hook_attn_scores")):
                raise _Stop
        replaced = False
        if dense or pattern_fns:
            scores = _dense_scores(query, key, scaling, ctx.softcap, attention_mask, ctx.window)
            new = fire("attn.hook_attn_scores", scores, dense)
            replaced |= new is not scores
            pattern = torch.softmax(new, dim=-1, dtype=torch.float32).nan_to_num(0.0).to(query.dtype)
            new_pattern = fire("attn.hook_pattern", pattern, pattern_fns)
            replaced |= new_pattern is not pattern
        if replaced:  # a hook changed the scores or the pattern: the output follows from the pattern
            groups = query.shape[1] // value.shape[1]
            out = torch.matmul(new_pattern, repeat_kv(value, groups)).transpose(1, 2).contiguous()
        else:
            out, _ = inner(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return fire("attn.hook_z", out), None


def _dense_scores(q, k, scaling, softcap, attention_mask, window: int) -> torch.Tensor:
    """[B, H, Tq, Tk] scores q.k * scaling (softcapped), -inf where the model's mask hides a key."""
    groups = q.shape[1] // k.shape[1]
    s = torch.matmul(q, repeat_kv(k, groups).transpose(-1, -2)) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    n, m = s.shape[-2:]
    if attention_mask is None:  # SDPA's implicit causal mask (and the window, when there is one)
        i = torch.arange(n, device=s.device)[:, None] + (m - n)
        j = torch.arange(m, device=s.device)[None]
        allowed = (j <= i) & ((i - j < window) if window else True)
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask[..., :m]
    else:  # eager masks are additive: 0 where attended, the dtype's minimum elsewhere
        allowed = attention_mask[..., :m] == 0
    return s.masked_fill(~allowed, -math.inf)


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


def _block_forward(self, hidden_states, *args, **kwargs):
    """Replaces a decoder layer's forward while a HookedModel runs (bound to the layer)."""
    hm: HookedModel = getattr(self, _OWNER)
    bound = _signature(type(self)).bind(self, hidden_states, *args, **kwargs)
    attn_kwargs = {k: v for k, v in bound.arguments.items() if k not in ("self", "hidden_states")}
    attn_kwargs.update(attn_kwargs.pop("kwargs", {}))
    return hm._block(self, self.self_attn.layer_idx, hidden_states, attn_kwargs)


def _attention_fn(eager: bool):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if eager:
            inner = importlib.import_module(type(module).__module__).eager_attention_forward
        else:
            inner = sdpa_attention_forward
        hm = getattr(module, _OWNER, None)
        if hm is None or hm._run is None:
            return inner(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return hm._attention(module, inner, query, key, value, attention_mask, dropout, scaling, kwargs)

    return attention


def _register() -> None:
    # Both registries: without a mask function transformers builds no mask at all (no padding, no window).
    AttentionInterface.register(ATTN_SDPA, _attention_fn(eager=False))
    AttentionMaskInterface.register(ATTN_SDPA, sdpa_mask)
    AttentionInterface.register(ATTN_EAGER, _attention_fn(eager=True))
    AttentionMaskInterface.register(ATTN_EAGER, eager_mask)
