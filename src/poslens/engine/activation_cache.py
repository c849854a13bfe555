"""What `HookedModel.run_with_cache` returns: a mapping hook name -> tensor, read as TransformerLens reads its cache.

    logits, cache = hm.run_with_cache(ids)
    cache["blocks.0.attn.hook_pattern"]; cache["pattern", 0]; cache["k6"]; cache["scale", 2, "ln1"]; cache["embed"]

Keys are full hook names in forward order; TransformerLens's shorthand (a name, a layer, a layer type, as its
`utils.get_act_name` takes them, `poslens.utils.get_act_name`; negative layers count from the end) resolves to them.
`names_filter` takes TransformerLens's forms. TransformerLens's analysis methods for the logit lens and direct logit
attribution (accumulated_resid, decompose_resid, stack_head_results, apply_ln_to_stack, logit_attrs) have its
semantics, with the model's own norms (see apply_ln_to_stack); the others raise a one-line error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping

import torch

from poslens.errors import UsageError


class NoEquivalent(UsageError, AttributeError):
    """A TransformerLens feature poslens does not have (one line; also an AttributeError, so hasattr() says False)."""


# TransformerLens's shorthand (utils.get_act_name): aliases of names, the sublayer of a name, aliases of sublayers
_NAME_ALIAS = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
               "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}
_ATTN_NAMES = {"q", "k", "v", "z", "rot_q", "rot_k", "result", "pattern", "attn_scores"}
_MLP_NAMES = {"pre", "pre_linear", "post", "mid"}
_TYPE_ALIAS = {"a": "attn", "attention": "attn", "m": "mlp", "b": "", "block": "", "blocks": ""}


def get_act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """The full hook name of a TransformerLens shorthand, by TransformerLens's `utils.get_act_name` rules:
    ("resid_pre", 10) -> "blocks.10.hook_resid_pre", ("pattern", 0) -> "blocks.0.attn.hook_pattern", "k6" ->
    "blocks.6.attn.hook_k", "scale4ln1" -> "blocks.4.ln1.hook_scale", "normalized" -> "ln_final.hook_normalized",
    ("embed") -> "hook_embed"; a full name (with a dot, or starting with hook_) is returned as it is."""
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    packed = re.match(r"([a-z]+)(\d+)([a-z]?.*)", name)  # "k6", "scale4ln1": name, layer, layer type
    if packed is not None:
        name, layer, layer_type = packed.group(1), int(packed.group(2)), packed.group(3)
    name = _NAME_ALIAS.get(name, name)
    if name in _ATTN_NAMES:
        layer_type = "attn"
    elif name in _MLP_NAMES:
        layer_type = "mlp"
    elif layer_type in _TYPE_ALIAS:
        layer_type = _TYPE_ALIAS[layer_type]
    full = (f"blocks.{layer}." if layer is not None else "") + (f"{layer_type}." if layer_type else "") + f"hook_{name}"
    return f"ln_final.{full}" if name in ("scale", "normalized") and layer is None else full


act_name = get_act_name  # the name this module used before


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


def _flattened(name: str, value: torch.Tensor) -> bool:
    """Whether a cached value has no batch dimension of its own: a q/k norm's, in TransformerLens's flattened layout
    [B*T*heads, .], or a mixture of experts' router and expert points ([B*T, E], [n_e, M])."""
    return ((".q_norm." in name or ".k_norm." in name) and value.dim() == 2) or ".mlp.experts." in name or \
        ".mlp.hook_expert_" in name


def without_batch(cache: dict[str, torch.Tensor], method: str) -> dict[str, torch.Tensor]:
    """The values of a batch of one without the batch dimension (value[0]); a flattened q/k norm value [T*heads, .]
    stays whole (it holds the one row's positions and heads)."""
    sizes = {v.shape[0] for k, v in cache.items() if not _flattened(k, v)}
    if sizes - {1}:
        raise UsageError(f"{method}: remove_batch_dim needs a batch of 1, got {max(sizes)}; run one sequence "
                         "(tokens[i:i + 1]) or keep the batch dimension")
    return {k: v if _flattened(k, v) else v[0] for k, v in cache.items()}


class ActivationCache(Mapping):
    """Hook name -> tensor (see the module docstring). Built as TransformerLens's `ActivationCache(cache_dict, model,
    has_batch_dim=True)` or as poslens's `ActivationCache(cache_dict, n_layers, has_batch_dim, model)`."""

    def __init__(self, cache: dict[str, torch.Tensor], n_layers, has_batch_dim: bool = True,
                 model=None) -> None:
        if not isinstance(n_layers, int):  # TransformerLens's form: the model in second place
            if model is not None or not hasattr(n_layers, "n_layers"):
                raise UsageError(f"ActivationCache: the second argument must be the model (a HookedModel) or its "
                                 f"number of layers, got {type(n_layers).__name__}")
            n_layers, model = n_layers.n_layers, n_layers
        self.cache_dict = cache
        self.n_layers = n_layers
        self.has_batch_dim = has_batch_dim
        self.model = model  # the HookedModel that made it (its weights and final norm, for the analysis methods)

    def _key(self, key) -> str:
        if isinstance(key, str):
            return key if key in self.cache_dict else get_act_name(key)
        if isinstance(key, tuple) and key and isinstance(key[0], str):
            name, layer, *rest = (*key, None) if len(key) == 1 else key
            if isinstance(layer, int) and layer < 0:
                layer += self.n_layers
            return get_act_name(name, layer, *rest[:1])
        raise KeyError(key)

    def __getitem__(self, key) -> torch.Tensor:
        name = self._key(key)
        if name not in self.cache_dict:
            if self.model is not None and name not in self.model.points:  # no such point: say why, not how to select
                try:
                    self.model._check_name(name)
                except UsageError as e:
                    raise KeyError(str(e).replace("hooks: ", "cache: ", 1)) from None
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
        return ActivationCache(without_batch(self.cache_dict, "ActivationCache"), self.n_layers, False, self.model)

    # ---- TransformerLens's analysis methods (logit lens, direct logit attribution) --------------------------

    def _model(self, method: str):
        if self.model is None:
            raise UsageError(f"ActivationCache.{method} needs the model: use the cache HookedModel.run_with_cache "
                             "returns")
        return self.model

    def _final(self, layer: int | None) -> int:
        """TransformerLens's layer argument: None and -1 mean the input to the unembedding (n_layers)."""
        if layer is None or layer == -1:
            return self.n_layers
        if not isinstance(layer, int) or not 0 <= layer <= self.n_layers:
            raise UsageError(f"layer must be in 0-{self.n_layers} (or -1 / None: the unembedding's input), got "
                             f"{layer!r}")
        return layer

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice=None, mlp_input: bool = False, return_labels: bool = False):
        """The residual stream as it accumulates up to the input of `layer` ([components, batch, pos, d]): resid_pre of
        layers 0..layer (and resid_mid of those before it with incl_mid; of `layer` itself with mlp_input), and for
        layer = n_layers (None, -1) the final resid_post. Labels "0_pre", "0_mid", ..., "final_post". apply_ln:
        through the norm that reads them (apply_ln_to_stack) - the logit lens is then `@ model.W_U`. A parallel block
        (GPT-NeoX, GPT-J, Phi) has no resid_mid: its MLP reads resid_pre (incl_mid is refused)."""
        layer = self._final(layer)
        parallel = self._parallel()
        if incl_mid and parallel:
            raise UsageError("accumulated_resid: incl_mid: a parallel block has no resid_mid (attention and the MLP "
                             "both read resid_pre); leave incl_mid out")
        parts, labels = [], []
        for l in range(layer + 1):
            if l == self.n_layers:
                parts.append(self[("resid_post", self.n_layers - 1)])
                labels.append("final_post")
                continue
            parts.append(self[("resid_pre", l)])
            labels.append(f"{l}_pre")
            if (incl_mid and l < layer) or (mlp_input and l == layer and not parallel):
                parts.append(self[("resid_mid", l)])
                labels.append(f"{l}_mid")
        return self._stacked(parts, labels, layer, mlp_input, pos_slice, apply_ln, return_labels)

    def _parallel(self) -> bool:
        """Whether the cache's model has parallel blocks (GPT-NeoX, GPT-J, Phi: the MLP reads resid_pre)."""
        return self.model is not None and self.model.family.layout == "parallel"

    def _stacked(self, parts, labels, layer, mlp_input, pos_slice, apply_ln, return_labels):
        """The components [batch, pos, d] stacked after the position slice, through the norm when apply_ln."""
        stack = torch.stack([_slice(p, pos_slice, -2) for p in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
        return (stack, labels) if return_labels else stack

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice=None, incl_embeds: bool = True, return_labels: bool = False):
        """The residual stream at the input of `layer` as the sum of what wrote to it ([components, batch, pos, d]):
        "embed" (hook_embed) and, on a model with a position table (GPT-2), "pos_embed" (hook_pos_embed, as
        TransformerLens), then each earlier layer's "{l}_attn_out" and
        "{l}_mlp_out" (mode "attn" or "mlp" keeps one kind), and with mlp_input this layer's attention output (not in a
        parallel block, whose MLP reads the stream entering it)."""
        if mode not in ("all", "attn", "mlp"):
            raise UsageError(f"decompose_resid: mode must be 'all', 'attn' or 'mlp', got {mode!r}")
        layer = self._final(layer)
        parts, labels = [], []
        if incl_embeds:
            parts.append(self["hook_embed"])
            labels.append("embed")
            if self.model is not None and "hook_pos_embed" in self.model.points or "hook_pos_embed" in self.cache_dict:
                parts.append(self["hook_pos_embed"])
                labels.append("pos_embed")
        for l in range(layer):
            for kind in ("attn", "mlp"):
                if mode in ("all", kind):
                    parts.append(self[(f"{kind}_out", l)])
                    labels.append(f"{l}_{kind}_out")
        if mlp_input and mode != "mlp" and not self._parallel():
            parts.append(self[("attn_out", layer)])
            labels.append(f"{layer}_attn_out")
        return self._stacked(parts, labels, layer, mlp_input, pos_slice, apply_ln, return_labels)

    def stack_head_results(self, layer: int | None = None, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice=None, apply_ln: bool = False):
        """Each head's output in the residual stream, [layers * heads, batch, pos, d] for the layers before `layer`
        (labels "L{l}H{h}"): attn.hook_result when cached, else hook_z through the head's W_O (TransformerLens's
        compute_head_results). incl_remainder adds the rest of the stream (resid_post of the last layer minus the
        heads). Gemma: a head's result is before the post-attention norm, as in TransformerLens."""
        model = self._model("stack_head_results")
        layer = self._final(layer)
        parts, labels = [], []
        w_o = model.W_O if layer else None
        for l in range(layer):
            name = f"blocks.{l}.attn.hook_result"
            result = self.cache_dict[name] if name in self.cache_dict else _head_results(self[("z", l)], w_o[l])
            result = _slice(result, pos_slice, -3)  # [batch, (pos,) head, d]
            parts.append(result.movedim(-2, 0))
            labels += [f"L{l}H{h}" for h in range(result.shape[-2])]
        return self._by_unit(parts, labels, layer, "heads", incl_remainder, pos_slice, apply_ln, return_labels)

    def _by_unit(self, parts, labels, layer: int, what: str, incl_remainder: bool, pos_slice, apply_ln: bool,
                 return_labels: bool):
        """The per-unit outputs of the layers before `layer` (parts [units, batch, (pos,) d]) as one stack, with the
        rest of the stream after them (incl_remainder), through the norm at `layer` (apply_ln)."""
        if not parts:
            raise UsageError(f"stack_{what[:-1]}_results: layer 0 has no {what} before it; give a layer >= 1")
        stack = torch.cat(parts)
        if incl_remainder:
            rest = _slice(self[("resid_post", layer - 1)], pos_slice, -2) - stack.sum(0)
            stack = torch.cat([stack, rest[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, False, pos_slice)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(self, residual_stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False,
                          pos_slice=None, batch_slice=None, has_batch_dim: bool = True,
                          recompute_ln: bool = False) -> torch.Tensor:
        """Each component of a stack [components, batch, pos, d] as the norm at the input of `layer` (the final norm
        for None, -1, n_layers; ln2 with mlp_input) scales it in this forward: divided by the cached hook_scale of
        the whole stream (centred first for a LayerNorm), times the norm's gain. So the components add up to the
        norm's output (less a LayerNorm's bias): `apply_ln_to_stack(stack) @ model.W_U` are logit contributions, as
        TransformerLens's with its default weight processing (it divides by the scale and folds the gain into W_U;
        poslens keeps the gain in the norm and W_U unprocessed: the products agree). recompute_ln (final layer
        only): each component through the final norm with its own statistics."""
        model = self._model("apply_ln_to_stack")
        layer = self._final(layer)
        if mlp_input and layer == self.n_layers:
            raise UsageError("apply_ln_to_stack: mlp_input needs a layer < n_layers (the unembedding has no MLP)")
        stack = residual_stack if has_batch_dim else residual_stack[:, None]
        if has_batch_dim and batch_slice is not None:
            stack = _slice(stack, batch_slice, 1)
        prefix = "ln_final" if layer == self.n_layers else f"blocks.{layer}.{'ln2' if mlp_input else 'ln1'}"
        norm = model.norm_module(prefix)
        if recompute_ln:
            if layer != self.n_layers:
                raise UsageError("apply_ln_to_stack: recompute_ln applies to the final norm only (layer None or -1)")
            out = torch.stack([norm(c) for c in stack])
            return out if has_batch_dim else out[:, 0]
        if model.family.norm_kind == "layer":  # (OLMo's parameter-free one too)
            stack = stack - stack.mean(-1, keepdim=True)
        scale = _slice(self[f"{prefix}.hook_scale"], pos_slice, -2)
        if not has_batch_dim:
            scale = scale[None]
        elif batch_slice is not None:
            scale = _slice(scale, batch_slice, 0)
        out = stack / scale * model.norm_gain(prefix).to(scale.dtype)
        return out if has_batch_dim else out[:, 0]

    def logit_attrs(self, residual_stack: torch.Tensor, tokens, incorrect_tokens=None, pos_slice=None,
                    batch_slice=None, has_batch_dim: bool = True) -> torch.Tensor:
        """Each component's direct contribution to the logit of `tokens` (minus that of `incorrect_tokens`): the
        stack through the final norm (apply_ln_to_stack) dotted with the tokens' unembedding directions."""
        model = self._model("logit_attrs")
        directions = model.tokens_to_residual_directions(tokens)
        if incorrect_tokens is not None:
            wrong = model.tokens_to_residual_directions(incorrect_tokens)
            if wrong.shape != directions.shape:
                raise UsageError(f"logit_attrs: tokens and incorrect_tokens must have one shape, got "
                                 f"{tuple(directions.shape[:-1])} and {tuple(wrong.shape[:-1])}")
            directions = directions - wrong
        scaled = self.apply_ln_to_stack(residual_stack, -1, False, pos_slice, batch_slice, has_batch_dim)
        return (scaled * directions.to(scaled.dtype)).sum(-1)

    def stack_activation(self, activation_name: str, layer: int = -1, sublayer_type: str | None = None
                         ) -> torch.Tensor:
        """TransformerLens's stack_activation: the activation of that name ("pattern", "resid_pre", ...) of each layer
        before `layer` (-1: every layer), stacked on a new first dimension [layers, ...]."""
        layer = self.n_layers if layer == -1 else layer
        if not 0 < layer <= self.n_layers:
            raise UsageError(f"stack_activation: layer must be -1 or 1..{self.n_layers}, got {layer}")
        return torch.stack([self[(activation_name, l, sublayer_type)] for l in range(layer)])

    def compute_head_results(self) -> None:
        """TransformerLens's compute_head_results: each layer's attn.hook_result [batch, pos, head, d] added to the
        cache from its hook_z and W_O (the layers whose hook_z is cached and whose result is not)."""
        w_o = self._model("compute_head_results").W_O  # [n_layers, heads, d_head, d], formed once
        for l in range(self.n_layers):
            z, name = f"blocks.{l}.attn.hook_z", f"blocks.{l}.attn.hook_result"
            if z in self.cache_dict and name not in self.cache_dict:
                self.cache_dict[name] = _head_results(self.cache_dict[z], w_o[l])

    def get_neuron_results(self, layer: int, neuron_slice=None, pos_slice=None) -> torch.Tensor:
        """TransformerLens's get_neuron_results: each MLP neuron's output in the residual stream, its activation
        (mlp.hook_post) times its row of W_out: [batch, pos, neurons, d]."""
        model = self._model("get_neuron_results")
        layer = layer + self.n_layers if isinstance(layer, int) and layer < 0 else layer
        if not isinstance(layer, int) or not 0 <= layer < self.n_layers:
            raise UsageError(f"get_neuron_results: layer must be a block, 0-{self.n_layers - 1}, got {layer!r}")
        post = _slice(_slice(self[("post", layer)], pos_slice, -2), neuron_slice, -1)
        w_out = _slice(model.W_out[layer], neuron_slice, 0).to(post.dtype)  # [neurons, d]
        return post[..., None] * w_out

    def stack_neuron_results(self, layer: int, pos_slice=None, neuron_slice=None, return_labels: bool = False,
                             incl_remainder: bool = False, apply_ln: bool = False):
        """TransformerLens's stack_neuron_results: every neuron's output of the layers before `layer`, [layers *
        neurons, batch, pos, d] (labels "L{l}N{n}"); incl_remainder adds the rest of the stream."""
        layer = self._final(layer)
        parts, labels = [], []
        for l in range(layer):
            result = self.get_neuron_results(l, neuron_slice, pos_slice)  # [batch, (pos,) neurons, d]
            parts.append(result.movedim(-2, 0))
            kept = torch.arange(self[("post", l)].shape[-1])
            kept = _slice(kept, neuron_slice, 0).reshape(-1)
            labels += [f"L{l}N{int(n)}" for n in kept]
        return self._by_unit(parts, labels, layer, "neurons", incl_remainder, pos_slice, apply_ln, return_labels)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise NoEquivalent(f"ActivationCache.{name}: TransformerLens's {name} has no poslens equivalent; the cache is "
                           "a mapping hook name -> tensor: cache[name], cache[name, layer] and torch.stack over "
                           "layers do most of what is missing (see docs/hooks.md)")


def _head_results(z: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """Each head's output z_h W_O[h] of one layer: z [batch, pos, head, d_head], W_O [head, d_head, d] -> [batch, pos,
    head, d] (TransformerLens's compute_head_results)."""
    return torch.einsum("...hk,hkd->...hd", z, w_o.to(z.dtype))


def _slice(x: torch.Tensor, which, dim: int) -> torch.Tensor:
    """TransformerLens's Slice on one dimension: None keeps all, an int picks one (the dimension goes), a tuple is a
    slice's (start, stop, step), a list or tensor of indices picks those."""
    if which is None:
        return x
    if isinstance(which, int):
        return x.select(dim, which)
    if isinstance(which, tuple):
        return x[(slice(None),) * (dim % x.dim()) + (slice(*which),)]
    if isinstance(which, slice):
        return x[(slice(None),) * (dim % x.dim()) + (which,)]
    index = torch.as_tensor(which, device=x.device)
    if index.dtype == torch.bool or index.is_floating_point() or index.dim() != 1:
        raise UsageError(f"a position or batch slice must be None, an int, a tuple (start, stop, step) or a list of "
                         f"indices, got {which!r}")
    return x.index_select(dim, index)
