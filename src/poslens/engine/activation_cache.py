"""What `HookedModel.run_with_cache` returns: a mapping hook name -> tensor, read as TransformerLens reads its cache.

    logits, cache = hm.run_with_cache(ids)
    cache["blocks.0.attn.hook_pattern"]; cache["pattern", 0]; cache["k6"]; cache["scale", 2, "ln1"]; cache["embed"]

Keys are full hook names in forward order; TransformerLens's shorthand (a name, a layer, a layer type, as its
`utils.get_act_name` takes them; negative layers count from the end) resolves to them. `names_filter` takes
TransformerLens's forms. TransformerLens's analysis methods on the cache (accumulated_resid, decompose_resid, ...)
have no poslens equivalent and raise a one-line error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping

import torch

from poslens.errors import UsageError


class NoEquivalent(UsageError, AttributeError):
    """A TransformerLens feature poslens does not have (one line; also an AttributeError, so hasattr() says False)."""


# TransformerLens's shorthand: aliases of names, the sublayer of a name, aliases of sublayers
_NAME_ALIAS = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
               "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}
_ATTN_NAMES = {"q", "k", "v", "z", "rot_q", "rot_k", "result", "pattern", "attn_scores"}
_MLP_NAMES = {"pre", "pre_linear", "post", "mid"}
_TYPE_ALIAS = {"a": "attn", "attention": "attn", "m": "mlp", "b": "", "block": "", "blocks": ""}


def act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """The full hook name of a TransformerLens shorthand: act_name("pattern", 0) = "blocks.0.attn.hook_pattern",
    act_name("k6") = "blocks.6.attn.hook_k", act_name("scale4ln1") = "blocks.4.ln1.hook_scale",
    act_name("normalized") = "ln_final.hook_normalized"; a full name is returned as it is."""
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    packed = re.fullmatch(r"([a-z_]+?)(\d+)([a-z_0-9]*)", name)
    if packed is not None:
        name, layer, layer_type = packed.group(1), int(packed.group(2)), packed.group(3) or None
    name = _NAME_ALIAS.get(name, name)
    if name in _ATTN_NAMES:
        layer_type = "attn"
    elif name in _MLP_NAMES:
        layer_type = "mlp"
    elif layer_type is not None:
        layer_type = _TYPE_ALIAS.get(layer_type, layer_type)
    full = f"{layer_type}.hook_{name}" if layer_type else f"hook_{name}"
    if layer is not None:
        return f"blocks.{layer}.{full}"
    return f"ln_final.{full}" if name in ("scale", "normalized", "out") and not layer_type else full


def select_points(names_filter, points: list[str], tl_points: list[str], check: Callable[[str], None]) -> list[str]:
    """The points a TransformerLens `names_filter` selects, in forward order: None = every TransformerLens point; a
    name or a list of names (each checked with `check`, poslens's own `*.hook_out` allowed); a callable on names,
    asked about every TransformerLens point."""
    if names_filter is None:
        return list(tl_points)
    if isinstance(names_filter, str):
        names_filter = [names_filter]
    if isinstance(names_filter, (list, tuple, set)):
        for name in names_filter:
            if not isinstance(name, str):
                raise UsageError(f"names_filter: {name!r} is not a hook name")
            check(name)
        wanted = set(names_filter)
        return [p for p in points if p in wanted]
    if callable(names_filter):
        return [p for p in tl_points if names_filter(p)]
    raise UsageError(f"names_filter must be None, a hook name, a list of hook names or a function of a name; got "
                     f"{type(names_filter).__name__}")


class ActivationCache(Mapping):
    """Hook name -> tensor (see the module docstring)."""

    def __init__(self, cache: dict[str, torch.Tensor], n_layers: int, has_batch_dim: bool = True,
                 model=None) -> None:
        self.cache_dict = cache
        self.n_layers = n_layers
        self.has_batch_dim = has_batch_dim
        self.model = model  # the HookedModel that made it (its weights and final norm, for the analysis methods)

    def _key(self, key) -> str:
        if isinstance(key, str):
            return key if key in self.cache_dict else act_name(key)
        if isinstance(key, tuple) and key and isinstance(key[0], str):
            name, layer, *rest = (*key, None) if len(key) == 1 else key
            if isinstance(layer, int) and layer < 0:
                layer += self.n_layers
            return act_name(name, layer, *rest[:1])
        raise KeyError(key)

    def __getitem__(self, key) -> torch.Tensor:
        name = self._key(key)
        if name not in self.cache_dict:
            raise KeyError(f"{name} is not in this cache (select it with run_with_cache's names_filter)")
        return self.cache_dict[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.cache_dict)

    def __len__(self) -> int:
        return len(self.cache_dict)

    def __repr__(self) -> str:
        return f"ActivationCache with keys {list(self.cache_dict)}"

    def to(self, device: str | torch.device) -> ActivationCache:
        """The cache with every tensor on `device`."""
        return ActivationCache({k: v.to(device) for k, v in self.cache_dict.items()}, self.n_layers,
                               self.has_batch_dim, self.model)

    def remove_batch_dim(self) -> ActivationCache:
        """The cache of a batch of one without its batch dimension."""
        if not self.has_batch_dim:
            return self
        sizes = {v.shape[0] for v in self.cache_dict.values()}
        if sizes - {1}:
            raise UsageError(f"remove_batch_dim needs a batch of 1, got {max(sizes)}")
        return ActivationCache({k: v[0] for k, v in self.cache_dict.items()}, self.n_layers, False, self.model)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise NoEquivalent(f"ActivationCache.{name}: TransformerLens's {name} has no poslens equivalent; the cache is "
                           "a mapping hook name -> tensor (see docs/hooks.md)")
