"""The positional encoding of a decoder, one type for training, loading and run.json: `PositionalEncoding`.

Per layer: whether it rotates queries and keys (``"rope"``, ``"partial-rope"`` where it turns only part of each
head: Phi-3's and Phi's partial rotary factor, Pythia's rotary_pct, GPT-J's rotary_dim; ``"none"``) and how far
back it attends (its sliding window in tokens; 0 = the full causal context).
For the model: the RoPE base ``rope_theta`` and its scaling (`Scaling`: ``ntk:F``, ``linear:F``, ``yarn:F``,
or whatever a loaded config says, such as Llama 3's ``llama3``).

Built two ways, and both give the same object for a checkpoint poslens trained:

* from training fields, `PositionalEncoding.build(layers, pe=..., pe_layers="0111", rope_theta=...,
  rope_scaling="ntk:8", sliding_window=32, layer_types="SF")`, whose `config_fields(head_dim, seq_len)` are
  the transformers SmolLM3 config fields (``no_rope_layers``, ``rope_parameters``, ``use_sliding_window``,
  ``sliding_window``, ``layer_types``);
* from any supported model or config, `PositionalEncoding.of(model)`.

What each scaling means here (every one is static: the frequencies do not depend on the input's length, so a
model computes the same function at and past its training length):

* ``ntk:F``: NTK-aware base scaling, ``rope_theta * F ** (d / (d - 2))`` for rotary dimension d (bloc97's
  static form; Qwen's large bases are this kind of scaling). transformers has no static NTK type (its
  ``dynamic`` type equals no scaling up to ``max_position_embeddings`` and grows the base with the input's
  length past it), so the checkpoint stores ``rope_type: "default"`` with the scaled base, and the factor in
  the config field ``poslens_variant`` so that the label survives a reload;
* ``linear:F``: position interpolation, every frequency divided by F (transformers ``linear``);
* ``yarn:F``: YaRN (transformers ``yarn``) with ``original_max_position_embeddings`` = the training length:
  frequencies that turn fewer than ``beta_slow`` times over it are interpolated by F, those that turn more than
  ``beta_fast`` times are kept, a ramp between; logits are scaled by ``(0.1 ln F + 1) ** 2``.

transformers' ``dynamic`` is refused for training: it is the identity at the training length and changes the
frequencies only past ``max_position_embeddings``, which is a change at evaluation time, not a variant to train.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from poslens.errors import UsageError, check_float, check_int, require

GPTJ_ROTARY_BASE = 10000.0  # transformers' GPT-J computes its sin/cos table with this base (not a config field)
ALIBI = ("bloom", "mpt")  # model types whose every layer adds ALiBi's per-head linear bias to the scores (and Falcon
# with alibi=True)
LEARNED_TABLE = ("gpt2", "opt", "gpt_neo", "gpt_bigcode")  # model types whose positions come from a learned table
# added to the token embeddings
PE_ATTR = "poslens_pe"  # set on a model loaded with pe="none" (the identity rotation is installed)
CONFIG_FIELD = "poslens_variant"  # config field of a checkpoint poslens trained (`variant_record`)
SCALINGS = ("ntk", "linear", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")
_LAYER_TYPE_ALIASES = {"full_attention": "full_attention", "full": "full_attention", "f": "full_attention",
                       "sliding_attention": "sliding_attention", "sliding": "sliding_attention",
                       "s": "sliding_attention"}


# ---------------------------------------------------------------- patterns


def _tiled(items: list[str], layers: int, name: str, example: str) -> list[str]:
    """`items` repeated to `layers` entries when its length divides `layers` (a repeating unit)."""
    require(layers % len(items) == 0, f"{name} has {len(items)} entries, which does not divide layers ({layers}); "
                                      f"give one per layer or a repeating unit such as {example}")
    return items * (layers // len(items))


def _items(spec: str | list | tuple) -> list[str]:
    if isinstance(spec, (list, tuple)):
        return [str(x).strip() for x in spec]
    text = str(spec).replace(" ", "")
    return text.split(",") if "," in text else list(text)


def parse_rope_flags(spec: str | list | tuple, layers: int) -> list[int]:
    """Per-layer RoPE flags (1 = RoPE, 0 = none) from ``0,1,1,1``, ``0111`` or SmolLM3's ``no_rope_layers`` list.

    A unit shorter than `layers` is tiled when its length divides `layers` (``1110`` on 8 layers gives
    1,1,1,0,1,1,1,0, SmolLM3's "no RoPE in every 4th layer").
    """
    layers = check_int("layers", layers, 1)
    items = _items(spec)
    require(bool(items) and all(c in ("0", "1") for c in items),
            f"pe_layers must be 0/1 flags such as 0,1,1,1 or 0111 (1 = RoPE, 0 = NoPE); got {spec!r}")
    return [int(c) for c in _tiled(items, layers, "pe_layers", "0111")]


def parse_layer_types(spec: str | list | tuple, layers: int) -> list[str]:
    """Per-layer attention types as transformers names them (``sliding_attention`` / ``full_attention``) from
    ``sliding_attention,full_attention``, ``sliding,full`` or letters ``SSSF`` (S = sliding, F = full); a unit is
    tiled as in `parse_rope_flags` (``SSSSSF`` = Gemma-3's five local layers per global one)."""
    layers = check_int("layers", layers, 1)
    items = [s.lower() for s in _items(spec)]
    require(bool(items) and all(s in _LAYER_TYPE_ALIASES for s in items),
            f"layer_types must be sliding_attention/full_attention (or sliding/full, or letters S/F) per layer, "
            f"such as SSSF or sliding,full; got {spec!r}")
    return _tiled([_LAYER_TYPE_ALIASES[s] for s in items], layers, "layer_types", "SF")


# ---------------------------------------------------------------- scaling


@dataclass(frozen=True)
class Scaling:
    """A RoPE scaling: `kind` (ntk, linear, yarn; from a loaded config also dynamic, llama3, longrope, ...) and
    its `factor`."""

    kind: str
    factor: float

    @classmethod
    def parse(cls, spec: str | None) -> Scaling | None:
        """``ntk:8`` -> Scaling("ntk", 8.0); None or "" or "none" -> None (one-line error otherwise)."""
        if spec is None or str(spec).strip().lower() in ("", "none"):
            return None
        kind, _, value = str(spec).strip().lower().partition(":")
        if kind == "dynamic":
            raise UsageError("rope_scaling dynamic is the identity up to the training length and changes the "
                             "frequencies only past it: apply it at evaluation time; train with ntk:F, linear:F "
                             "or yarn:F")
        require(kind in SCALINGS, f"rope_scaling must be ntk:F, linear:F or yarn:F (F > 1, e.g. ntk:8); got {spec!r}")
        try:
            factor = float(value)
        except ValueError:
            raise UsageError(f"rope_scaling {spec!r}: the factor after '{kind}:' must be a number, e.g. "
                             f"{kind}:8") from None
        check_float("rope_scaling factor", factor, 1.0, 1e6, lo_open=True)
        return cls(kind, factor)

    def spec(self) -> str:
        """The spelling `parse` reads: ``ntk:8``."""
        return f"{self.kind}:{self.factor:g}"


def ntk_theta(rope_theta: float, factor: float, dim: int) -> float:
    """The NTK-aware scaled base: theta * F ** (d / (d - 2)) for rotary dimension d."""
    require(dim > 2, f"NTK scaling needs a rotary dimension above 2 (head size); got {dim}")
    return float(rope_theta) * float(factor) ** (dim / (dim - 2))


# ---------------------------------------------------------------- the type


@dataclass(frozen=True)
class PositionalEncoding:
    """Per-layer RoPE and sliding windows, the RoPE base and scaling (see the module docstring)."""

    rope: tuple[str, ...]  # per layer: "rope", "partial-rope", "none", "learned" (a position table before layer 1) or
    # "alibi" (a linear bias in the scores)
    windows: tuple[int, ...]  # per layer: sliding window in tokens, 0 = full causal attention
    rope_theta: float | None = None  # base before scaling; None when no layer rotates
    scaling: Scaling | None = None
    rope_parameters: dict | None = field(default=None, compare=False)  # a loaded config's, verbatim
    alibi_slopes: tuple[float, ...] | None = None  # ALiBi: the slope of every head (the bias is -slope * distance)
    # per layer, the RoPE base where a config gives each layer type its own (Gemma-3: 1e4 in the sliding-window
    # layers, 1e6 in the full-attention ones; rope_theta is then the full-attention layers'); None: rope_theta in
    # every rotating layer
    layer_thetas: tuple[float, ...] | None = None
    rotary_fraction: float | None = None  # partial RoPE: the share of each head RoPE turns (GPT-J: rotary_dim)

    def __post_init__(self) -> None:
        require(len(self.rope) == len(self.windows), "rope and windows need one entry per layer")

    # ------------------------------------------------ construction

    @classmethod
    def build(cls, layers: int, pe: str = "none", pe_layers: str | list | None = None, rope_theta: float = 10000.0,
              rope_scaling: str | None = None, sliding_window: int = 0,
              layer_types: str | list | None = None) -> PositionalEncoding:
        """From training fields: `pe` ("none"/"rope") for every layer, or a `pe_layers` pattern (``0111``); a
        `rope_scaling` spec (``ntk:8``); a `sliding_window` (0: none) in every layer or in the layers a
        `layer_types` pattern (``SSSF``) marks sliding."""
        layers = check_int("layers", layers, 1)
        require(pe in ("none", "rope"), f"pe must be none or rope; got {pe!r}")
        require(pe_layers != "", "pe_layers is empty; give a pattern such as 0111 (1 = RoPE) or leave it out")
        flags = [int(pe == "rope")] * layers if pe_layers is None else parse_rope_flags(pe_layers, layers)
        check_float("rope_theta", rope_theta, 1.0, math.inf, hi_open=True)
        scaling = Scaling.parse(rope_scaling)
        require(scaling is None or any(flags), f"rope_scaling {scaling.spec() if scaling else ''} needs RoPE in "
                                               "some layer: pe rope, or a pe_layers pattern with a 1")
        window = check_int("sliding_window", sliding_window, 0)
        if layer_types not in (None, ""):
            require(window > 0, "layer_types marks sliding layers but sliding_window is 0; give the window too")
            types = parse_layer_types(layer_types, layers)
            require("sliding_attention" in types, f"layer_types {layer_types!r} marks no layer sliding, so "
                                                  f"sliding_window {window} would be unused; mark a layer S or drop "
                                                  "the window")
        else:
            types = ["sliding_attention" if window else "full_attention"] * layers
        return cls(rope=tuple("rope" if f else "none" for f in flags),
                   windows=tuple(window if t == "sliding_attention" else 0 for t in types),
                   rope_theta=float(rope_theta) if any(flags) else None, scaling=scaling if any(flags) else None)

    @classmethod
    def of(cls, model_or_config: Any) -> PositionalEncoding:
        """What a loaded model (or its config) computes: a model loaded with pe="none" has no RoPE anywhere."""
        config = getattr(model_or_config, "config", model_or_config)
        n = int(config.num_hidden_layers)
        windows = tuple(_windows(config, n))
        raw = getattr(config, "rope_parameters", None) or {}
        per_type = isinstance(raw, dict) and "rope_type" not in raw and "full_attention" in raw
        params = raw["full_attention"] if per_type else raw  # per-layer-type parameters (Gemma-3): the global layers'
        params = dict(params) if isinstance(params, dict) else {}
        alibi = config.model_type in ALIBI or (config.model_type == "falcon" and getattr(config, "alibi", False))
        if getattr(model_or_config, PE_ATTR, None) == "none":  # the RoPE parameters removed, kept as the config's;
            # an ALiBi model's config carries transformers' default ones, which it never used: not recorded
            return cls(rope=("none",) * n, windows=windows, rope_parameters=None if alibi else params or None)
        if config.model_type in LEARNED_TABLE:  # no rotation: a learned table of max_position_embeddings rows
            return cls(rope=("learned",) * n, windows=windows)
        if alibi:
            return cls(rope=("alibi",) * n, windows=windows,
                       alibi_slopes=alibi_slopes(config.num_attention_heads, config))
        if config.model_type == "smollm3":
            flags = getattr(config, "no_rope_layers", None) or [1] * n
            rope = tuple("rope" if f else "none" for f in flags[:n])
        elif config.model_type == "cohere2":  # RoPE in the sliding-window layers only (Command-R7B's 3 of every 4)
            rope = tuple("rope" if t == "sliding_attention" else "none" for t in list(config.layer_types)[:n])
        else:
            rope = ("partial-rope" if rotary_fraction(config) < 1.0 else "rope",) * n
        if all(r == "none" for r in rope):
            return cls(rope=rope, windows=windows, rope_parameters=params or None)
        theta = params.get("rope_theta", getattr(config, "rope_theta", None))
        if config.model_type == "gptj":  # a fixed sinusoid table of base 10000 (transformers' GPT-J), no parameters
            theta = GPTJ_ROTARY_BASE
        theta = float(theta) if theta is not None else None
        kind = params.get("rope_type", "default")
        scaling = None if kind == "default" else Scaling(kind, float(params.get("factor") or 1.0))
        trained = getattr(config, CONFIG_FIELD, None)
        if kind == "default" and isinstance(trained, dict) and theta is not None:
            scaling, theta = _trained_ntk(trained, theta, _rotary_dim(config, params)) or (None, theta)
        fraction = rotary_fraction(config)
        return cls(rope=rope, windows=windows, rope_theta=theta, scaling=scaling, rope_parameters=params or None,
                   layer_thetas=_layer_thetas(config, raw, n) if per_type else None,
                   rotary_fraction=fraction if fraction < 1.0 else None)

    # ------------------------------------------------ what it is

    @property
    def num_layers(self) -> int:
        return len(self.rope)

    @property
    def flags(self) -> list[int]:
        """SmolLM3's ``no_rope_layers``: 1 where the layer applies RoPE."""
        return [int(r in ("rope", "partial-rope")) for r in self.rope]

    @property
    def layer_types(self) -> list[str]:
        """transformers' ``layer_types``: sliding_attention where a window applies, else full_attention."""
        return ["sliding_attention" if w else "full_attention" for w in self.windows]

    def effective_theta(self, dim: int) -> float | None:
        """The base the frequencies are computed from: rope_theta, NTK-scaled for ``ntk:F``."""
        if self.rope_theta is None:
            return None
        if self.scaling is not None and self.scaling.kind == "ntk":
            return ntk_theta(self.rope_theta, self.scaling.factor, dim)
        return self.rope_theta

    def hf_rope_parameters(self, dim: int, seq_len: int) -> dict[str, Any]:
        """transformers' ``rope_parameters`` for rotary dimension `dim` at training length `seq_len`."""
        theta = self.effective_theta(dim) or 10000.0
        kind = self.scaling.kind if self.scaling is not None else "default"
        if kind in ("default", "ntk"):
            return {"rope_type": "default", "rope_theta": theta}
        if kind == "linear":
            return {"rope_type": "linear", "rope_theta": theta, "factor": self.scaling.factor}
        if kind == "yarn":
            return {"rope_type": "yarn", "rope_theta": theta, "factor": self.scaling.factor,
                    "original_max_position_embeddings": int(seq_len)}
        raise UsageError(f"rope scaling {kind} cannot be trained here; use ntk:F, linear:F or yarn:F")

    def config_fields(self, head_dim: int, seq_len: int) -> dict[str, Any]:
        """The SmolLM3 config fields that give a model this encoding (and keep it through from_pretrained)."""
        window = max(self.windows)
        fields: dict[str, Any] = {
            "no_rope_layers": self.flags, "rope_parameters": self.hf_rope_parameters(head_dim, seq_len),
            "use_sliding_window": window > 0, "sliding_window": window or None, "layer_types": self.layer_types}
        require(len({w for w in self.windows if w}) <= 1, "one sliding window size for all sliding layers")
        fields[CONFIG_FIELD] = {"label": self.label(), "rope_theta": self.rope_theta,
                                "rope_scaling": self.scaling.spec() if self.scaling is not None else None}
        return fields

    def label(self) -> str:
        """Short human name: NoPE, RoPE, RoPE (ntk:8), RoPE layers 0111, "..., window 32 in layers 1-4"."""
        if all(r == "none" for r in self.rope):
            text = "NoPE"
        elif all(r == self.rope[0] for r in self.rope):
            text = {"rope": "RoPE", "partial-rope": "partial RoPE", "learned": "learned absolute",
                    "alibi": "ALiBi"}[self.rope[0]]
        else:
            text = "RoPE layers " + "".join(str(f) for f in self.flags)
        if self.scaling is not None:
            text += f" ({self.scaling.spec()})"
        if any(self.windows):
            window = max(self.windows)
            sliding = [i + 1 for i, w in enumerate(self.windows) if w]
            where = "all layers" if len(sliding) == self.num_layers else "layers " + ",".join(map(str, sliding))
            text += f", window {window} in {where}"
        return text

    def record(self) -> dict[str, Any]:
        """What run.json and the model record keep: per layer (from 1) and the model's RoPE base and scaling."""
        out: dict[str, Any] = {"label": self.label(), "layers": list(self.rope), "sliding_window": list(self.windows),
                               "rope_theta": self.rope_theta,
                               "rope_scaling": self.scaling.spec() if self.scaling is not None else None}
        if self.rope_parameters:
            out["rope_parameters"] = dict(self.rope_parameters)
        if self.layer_thetas is not None:
            out["rope_theta_layers"] = list(self.layer_thetas)
        if self.alibi_slopes is not None:
            out["alibi_slopes"] = list(self.alibi_slopes)
        if self.rotary_fraction is not None:
            out["rotary_fraction"] = self.rotary_fraction
        return out


def rotary_fraction(config: Any) -> float:
    """The share of each head's dimensions that RoPE turns: a partial rotary factor (Phi-3, Phi, GPT-NeoX's rotary_pct,
    kept in rope_parameters), GPT-J's rotary_dim over the head size, else 1."""
    if config.model_type == "gptj":
        head = config.hidden_size // config.num_attention_heads
        return float(config.rotary_dim) / head if getattr(config, "rotary_dim", None) else 1.0
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_type" not in params and "full_attention" in params:
        params = params["full_attention"]
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    return float(factor or getattr(config, "partial_rotary_factor", 1.0) or 1.0)


def alibi_slopes(heads: int, config: Any = None) -> tuple[float, ...]:
    """ALiBi's per-head slopes as the model computes them: transformers' BLOOM function (Press et al.'s geometric
    sequence 2^(-8/n), with the interleaved extension for a head count that is not a power of two), or for an MPT
    `config` its own builder (the same slopes for a power of two), read at key distance 1."""
    import torch

    if getattr(config, "model_type", None) == "mpt":
        from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

        return tuple(float(-x) for x in build_mpt_alibi_tensor(int(heads), 2)[:, 0, 0])  # slope_h * (0 - 1)
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    return tuple(float(x) for x in _get_alibi_slopes(int(heads), torch.device("cpu")))


def _rotary_dim(config: Any, params: dict) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0))


def _trained_ntk(trained: dict, theta: float, dim: int) -> tuple[Scaling, float] | None:
    """(ntk scaling, base before scaling) from a poslens-trained config's record, if it matches the config's base
    (a base edited by hand after training is read as it is, unscaled)."""
    try:
        scaling = Scaling.parse(trained.get("rope_scaling"))
        base = float(trained["rope_theta"])
    except (UsageError, KeyError, TypeError, ValueError):
        return None
    if scaling is None or scaling.kind != "ntk":
        return None
    if not math.isclose(ntk_theta(base, scaling.factor, dim), theta, rel_tol=1e-9):
        return None
    return scaling, base


def _windows(config: Any, n: int) -> list[int]:
    """Per layer, the sliding window in tokens (0 = full causal attention), as the attention masks use it."""
    if config.model_type == "gpt_neo":  # attention_layers: "global" or "local" (window_size keys, self included)
        return [int(config.window_size) if t == "local" else 0 for t in list(config.attention_layers)[:n]]
    window = getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None)
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return [0] * n
    if types is not None:
        return [int(window) if t == "sliding_attention" else 0 for t in list(types)[:n]]
    return [int(window)] * n


def _layer_thetas(config: Any, params: dict, n: int) -> tuple[float, ...] | None:
    """Per layer, the RoPE base of its layer type's parameters (`rope_parameters` keyed by layer type, as Gemma-3's);
    None when every layer has the same base."""
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)[:n]
    thetas = tuple(float((params.get(t) or params["full_attention"])["rope_theta"]) for t in types)
    return thetas if len(set(thetas)) > 1 else None


def variant_record(model_or_config: Any) -> dict[str, Any]:
    """The model record's "variant": its `PositionalEncoding.record`, and for a checkpoint poslens trained the
    training convention kept in its config (``bos``: every sequence started with the BOS id; ``seq_len``)."""
    config = getattr(model_or_config, "config", model_or_config)
    out = PositionalEncoding.of(model_or_config).record()
    trained = getattr(config, CONFIG_FIELD, None)
    if isinstance(trained, dict):
        out.update({k: trained[k] for k in ("bos", "seq_len") if k in trained})
    return out
