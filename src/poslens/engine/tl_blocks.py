"""TransformerLens 3.9's `model.blocks[l]` on a HookedModel: each layer's weights in its layouts and its hook points.

    hm.blocks[3].attn.W_V            # [n_heads, d_model, d_head]: hm.W_V[3] (GQA: repeated to the query heads)
    hm.blocks[3].attn._W_V           # [n_key_value_heads, d_model, d_head]: not repeated (a view of the parameter)
    hm.blocks[3].attn.OV[1]          # head 1's OV circuit, a FactoredMatrix (W_V @ W_O)
    hm.blocks[3].mlp.W_out, hm.blocks[3].ln1.w
    hm.blocks[3].mlp.experts[5].W_in.weight          # a mixture of experts (Mixtral, OLMoE, ...): TransformerLens's
    hm.blocks[3].mlp.W_gate.weight                   # nn.Linear layouts, [d_mlp, d_model] and the router's [E, d_model]
    hm.blocks[3].attn.hook_pattern.add_hook(fn)      # = hm.add_hook("blocks.3.attn.hook_pattern", fn)

The weights are the model's own parameters seen in TransformerLens's layouts (views: editing one in place edits the
model, as editing TransformerLens's parameter does) except where TransformerLens's own is computed (GQA's repeated
W_K, W_V; the zeros of an absent bias; Gemma's gain 1 + weight). A hook point is an object with TransformerLens's
HookPoint methods `add_hook`, `remove_hooks` and `name`; it acts on the TransformerLens surface's calls (`hm(...)`,
`run_with_hooks`, `run_with_cache`) as `hm.add_hook` does. Anything else fails in one line (NoEquivalent).
"""

from __future__ import annotations

from typing import Any

import torch

from poslens.engine.activation_cache import NoEquivalent
from poslens.engine.factored import FactoredMatrix
from poslens.engine.families import norm_affine, sparse_mlp
from poslens.engine.tl_weights import (
    _bias,
    _down,
    _gate_up,
    _linear_weight,
    _o_proj,
    _up_bias,
    layer_attn_weight,
    layer_w_o,
)
from poslens.errors import UsageError


class HookPoint:
    """TransformerLens's HookPoint of one point name: add_hook / remove_hooks act on the model's added hooks."""

    def __init__(self, owner, name: str) -> None:
        self._owner = owner
        self.name = name

    def __repr__(self) -> str:
        return f"HookPoint({self.name!r})"

    def __call__(self, x):
        """A HookPoint is the identity on its value (TransformerLens's module forward)."""
        return x

    def add_hook(self, hook, dir: str = "fwd", is_permanent: bool = False, level=None, prepend: bool = False) -> None:
        """Add fn(value, hook) at this point, as `model.add_hook(self.name, fn, ...)`."""
        self._owner.add_hook(self.name, hook, dir=dir, is_permanent=is_permanent, prepend=prepend)

    def remove_hooks(self, dir: str = "fwd", including_permanent: bool = False, level=None) -> None:
        """Remove the hooks added at this point (of direction `dir`: "fwd", "bwd" or "both")."""
        if dir not in ("fwd", "bwd", "both"):
            raise UsageError(f"remove_hooks: dir must be 'fwd', 'bwd' or 'both', got {dir!r}")
        self._owner._added[:] = [h for h in self._owner._added
                                 if not (h[0] == self.name and dir in (h[2], "both") and (including_permanent
                                                                                          or not h[3]))]


class _Component:
    """One of a block's components: its hook points by attribute; any other missing attribute fails in one line."""

    _kind = "component"

    def __init__(self, owner, layer: int, prefix: str) -> None:
        self._owner, self._layer, self._prefix = owner, layer, prefix

    @property
    def _module(self):
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        prop = getattr(type(self), name, None)
        if isinstance(prop, property):  # a property that raised NoEquivalent (an AttributeError): its own message
            return prop.fget(self)
        point = f"{self._prefix}{name}"
        if name.startswith("hook_"):
            if point not in self._owner._known:
                raise NoEquivalent(f"{point}: TransformerLens's hook point has no poslens equivalent on this "
                                   f"{self._owner.family.name} model (hm.points lists the points)")
            return HookPoint(self._owner, point)
        raise NoEquivalent(f"{self._prefix}{name}: TransformerLens's {self._kind} attribute {name} has no poslens "
                           "equivalent (see docs/hooks.md, 'Coming from TransformerLens')")

    def __call__(self, *args, **kwargs):
        """The model's own module (TransformerLens's component forward on the same input)."""
        return self._module(*args, **kwargs)


class Norm(_Component):
    """A block's norm (ln1, ln2, ln1_post, ...): `w` (the gain the forward multiplies by), `b` (LayerNorm's bias)."""

    _kind = "norm"

    @property
    def _module(self):
        return self._owner.norm_module(self._prefix[:-1])

    @property
    def w(self) -> torch.Tensor:
        """[d_model]: the gain (Gemma's 1 + weight, computed; else the parameter itself; OLMo's LayerNorm: ones, as
        TransformerLens's conversion writes)."""
        m = self._module
        if norm_affine(m)[0] is None:
            return torch.ones_like(self._owner.model.get_input_embeddings().weight[0])
        return 1.0 + m.weight if self._owner.family.norm_gain == "1+weight" else m.weight

    @property
    def b(self) -> torch.Tensor:
        """[d_model]: LayerNorm's bias; an RMSNorm has none."""
        weight, bias = norm_affine(self._module)
        if bias is None and self._owner.family.norm_kind == "layer":  # OLMo's and MPT's LayerNorms: zeros, as
            # TransformerLens's
            return torch.zeros_like(self._owner.model.get_input_embeddings().weight[0])
        if bias is None:
            raise NoEquivalent(f"{self._prefix}b: an RMSNorm has no bias; TransformerLens's RMSNorm has no b either")
        return bias


class Attention(_Component):
    """A block's attention: W_Q, W_K, W_V [n_heads, d_model, d_head], W_O [n_heads, d_head, d_model], b_*, the
    unrepeated _W_K, _W_V, _b_K, _b_V of grouped-query attention, OV and QK."""

    _kind = "attention"

    @property
    def _module(self):
        return self._owner.attns[self._layer]

    def _w(self, which: int, bias: bool = False, expand: bool = True) -> torch.Tensor:
        return layer_attn_weight(self._owner.model, self._layer, which, bias, expand)

    W_Q = property(lambda self: self._w(0), doc="[n_heads, d_model, d_head]")
    W_K = property(lambda self: self._w(1), doc="[n_heads, d_model, d_head] (GQA: repeated to the query heads)")
    W_V = property(lambda self: self._w(2), doc="[n_heads, d_model, d_head] (GQA: repeated to the query heads)")
    b_Q = property(lambda self: self._w(0, True), doc="[n_heads, d_head]")
    b_K = property(lambda self: self._w(1, True), doc="[n_heads, d_head]")
    b_V = property(lambda self: self._w(2, True), doc="[n_heads, d_head]")
    _W_K = property(lambda self: self._w(1, expand=False), doc="[n_key_value_heads, d_model, d_head]")
    _W_V = property(lambda self: self._w(2, expand=False), doc="[n_key_value_heads, d_model, d_head]")
    _b_K = property(lambda self: self._w(1, True, False), doc="[n_key_value_heads, d_head]")
    _b_V = property(lambda self: self._w(2, True, False), doc="[n_key_value_heads, d_head]")

    @property
    def W_O(self) -> torch.Tensor:
        """[n_heads, d_head, d_model]"""
        return layer_w_o(self._owner.attns[self._layer], self._owner.model.config.num_attention_heads)

    @property
    def b_O(self) -> torch.Tensor:
        """[d_model]"""
        return _bias(_o_proj(self._owner.attns[self._layer]))

    @property
    def OV(self) -> FactoredMatrix:
        """[n_heads] of d_model x d_model: W_V @ W_O"""
        return FactoredMatrix(self.W_V, self.W_O)

    @property
    def QK(self) -> FactoredMatrix:
        """[n_heads] of d_model x d_model: W_Q @ W_K^T"""
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))


class MLP(_Component):
    """A block's MLP: W_in, W_gate [d_model, d_mlp], W_out [d_mlp, d_model], b_in, b_out."""

    _kind = "MLP"

    @property
    def _module(self):
        return self._owner._mlp_of(self._owner.layers[self._layer])  # OPT: the layer itself holds fc1, fc2

    @property
    def W_in(self) -> torch.Tensor:
        """[d_model, d_mlp]: the up projection"""
        return _gate_up(self._module)[1].T

    @property
    def W_gate(self) -> torch.Tensor:
        """[d_model, d_mlp]: the gate projection"""
        gate = _gate_up(self._module)[0]
        if gate is None:
            raise NoEquivalent(f"{self._prefix}W_gate: the {self._owner.family.name} MLP has no gate (one up "
                               "projection: W_in)")
        return gate.T

    @property
    def W_out(self) -> torch.Tensor:
        """[d_mlp, d_model]"""
        return _linear_weight(_down(self._module)).T

    @property
    def b_in(self) -> torch.Tensor:
        return _up_bias(self._module)

    @property
    def b_out(self) -> torch.Tensor:
        return _bias(_down(self._module))


class _Linear:
    """One of TransformerLens's nn.Linear of a mixture of experts (the router's W_gate, an expert's W_gate, W_in and
    W_out): `weight` [out, in], a view of the model's fused weights, and its product x @ weight.T."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __repr__(self) -> str:
        return f"Linear(in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, bias=False)"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


class Expert(_Component):
    """One expert of a mixture of experts, as TransformerLens's MoEGatedMLP: W_gate, W_in [d_mlp, d_model] and W_out
    [d_model, d_mlp] (views of the rows of the model's gate_up_proj and down_proj), hook_gate, hook_pre, hook_post;
    called on x [n, d_model]: W_out(act(W_gate(x)) * W_in(x))."""

    _kind = "expert"

    def __init__(self, owner, layer: int, expert: int) -> None:
        super().__init__(owner, layer, f"blocks.{layer}.mlp.experts.{expert}.")
        self._e = expert

    @property
    def _module(self):
        return sparse_mlp(self._owner.family, self._owner.layers[self._layer]).experts

    @property
    def W_gate(self) -> _Linear:
        return _Linear(self._module.gate_up_proj[self._e].chunk(2)[0])  # [2 d_mlp, d_model]: rows [gate | up]

    @property
    def W_in(self) -> _Linear:
        return _Linear(self._module.gate_up_proj[self._e].chunk(2)[1])

    @property
    def W_out(self) -> _Linear:
        return _Linear(self._module.down_proj[self._e])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.W_out(self._module.act_fn(self.W_gate(x)) * self.W_in(x))


class MoE(_Component):
    """A mixture-of-experts MLP, as TransformerLens's MoE: W_gate (the router, [n_experts, d_model]), experts[e],
    hook_expert_weights and hook_expert_indices; called, the model's own block."""

    _kind = "MoE"

    @property
    def _module(self):
        return sparse_mlp(self._owner.family, self._owner.layers[self._layer])

    @property
    def W_gate(self) -> _Linear:
        return _Linear(self._module.gate.weight)

    @property
    def experts(self) -> list[Expert]:
        return [Expert(self._owner, self._layer, e) for e in range(self._module.experts.num_experts)]


class Block(_Component):
    """TransformerLens's `model.blocks[l]`: attn, mlp, its norms (ln1, ln2; Gemma's ln1_post, ln2_post) and its
    residual-stream hook points."""

    _kind = "block"

    def __init__(self, owner, layer: int) -> None:
        super().__init__(owner, layer, f"blocks.{layer}.")

    @property
    def _module(self):
        return self._owner.layers[self._layer]

    def __call__(self, *args, **kwargs):
        raise NoEquivalent(f"blocks[{self._layer}](x): calling a block alone has no poslens equivalent (run the model "
                           "with hooks: run_with_hooks)")

    @property
    def attn(self) -> Attention:
        return Attention(self._owner, self._layer, f"{self._prefix}attn.")

    @property
    def mlp(self) -> MLP | MoE:
        sparse = sparse_mlp(self._owner.family, self._owner.layers[self._layer]) is not None
        return (MoE if sparse else MLP)(self._owner, self._layer, f"{self._prefix}mlp.")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("ln") and not name.startswith("_"):
            prefix = f"{self._prefix}{name}"
            if prefix in self._owner._norms:
                return Norm(self._owner, self._layer, prefix + ".")
            raise NoEquivalent(f"{prefix}: this {self._owner.family.name} block has no such norm; TransformerLens's "
                               f"{name} has no poslens equivalent here")
        return super().__getattr__(name)


class Blocks:
    """`model.blocks`: indexable (negative indices too), iterable, with a length."""

    def __init__(self, owner) -> None:
        self._owner = owner

    def __len__(self) -> int:
        return self._owner.n_layers

    def __getitem__(self, l: int) -> Block:
        n = self._owner.n_layers
        if not isinstance(l, int) or not -n <= l < n:
            raise UsageError(f"blocks[{l!r}]: the model has {n} layers (blocks[0] to blocks[{n - 1}])")
        return Block(self._owner, l % n)

    def __iter__(self):
        return (self[l] for l in range(len(self)))
