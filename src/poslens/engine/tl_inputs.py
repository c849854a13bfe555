"""TransformerLens 3.9's per-head attention inputs: `blocks.{l}.hook_attn_in` (its use_attn_in) and
`blocks.{l}.hook_q_input`, `hook_k_input`, `hook_v_input` (its use_split_qkv_input).

Each is the residual stream entering the layer (hook_resid_pre, before ln1) copied once per head: [B, T, H, d] for
attn_in and q_input, [B, T, K, d] for k_input and v_input (K key/value heads: TransformerLens does not repeat them
for grouped-query attention). Every head's projection reads its own copy through ln1, so a write to one head's copy
changes only that head's q, k or v. As in TransformerLens, attn_in exists only without grouped-query attention
(K = H), and when any of the split points is hooked the split inputs (copies of resid_pre) feed attention and a write
at attn_in has no effect.

They cost nothing unless hooked, and a hook that only reads them leaves the model's own projections running (logits
bit-identical to a plain forward). A written copy (replaced, or edited in place: its version counter moved) is
normed by ln1 (the model's own norm; ln1's points fire once, on the shared input) and projected head by head with
that head's rows of W_Q, W_K or W_V (and bias): the projection's output is replaced for that part.
"""

from __future__ import annotations

import torch

from poslens.errors import UsageError

SPLIT_POINTS = ("hook_q_input", "hook_k_input", "hook_v_input")
INPUT_POINTS = ("hook_attn_in", *SPLIT_POINTS)
BUILT_ON = "every family but GPT-2 (one fused Conv1D) and OLMo-2 (post-norm)"  # where the points exist
GQA_ATTN_IN = ("TransformerLens has no hook_attn_in with grouped-query attention (n_key_value_heads < n_heads); "
               "hook hook_q_input, hook_k_input and hook_v_input instead")


def input_points(n_heads: int, n_kv_heads: int) -> list[str]:
    """The per-head input points of one block (under blocks.{l}.), in forward order."""
    return list(INPUT_POINTS) if n_heads == n_kv_heads else list(SPLIT_POINTS)


def check_attn_in(n_heads: int, n_kv_heads: int) -> None:
    """Refuse attn_in on a grouped-query model, as TransformerLens does."""
    if n_kv_heads != n_heads:
        raise UsageError(GQA_ATTN_IN)


def fire_inputs(fire, pts: dict, x: torch.Tensor, norm, n_heads: int, n_kv_heads: int) -> dict[str, torch.Tensor]:
    """Fire the hooked input points of one block on copies of the residual stream x [B, T, d]; returns the written
    ones, normed by `norm` (the block's ln1), by part: "q", "k", "v" -> [B, T, heads, d]. `fire(point, value)` calls
    the point's hooks and returns the value or its replacement."""
    if not any(p in pts for p in INPUT_POINTS):
        return {}
    heads = {"q": n_heads, "k": n_kv_heads, "v": n_kv_heads}
    written: dict[str, torch.Tensor] = {}

    def copies(point: str, n: int) -> torch.Tensor | None:
        """The copies after the point's hooks, or None when they only read them."""
        if torch.is_grad_enabled():  # autograd: real copies (a broadcast's storage cannot be swapped under autograd)
            value = x.unsqueeze(2).repeat(1, 1, n, 1)  # one copy per head (a write to one leaves the others)
            seen = value._version
            new = fire(point, value)
            return None if new is value and value._version == seen else new
        value = HeadCopies.of(x, n)
        new = fire(point, value)
        if new is value and not value.written():
            return None
        return new.as_subclass(torch.Tensor) if isinstance(new, HeadCopies) else new

    if "hook_attn_in" in pts:
        new = copies("hook_attn_in", n_heads)
        if new is not None and not any(p in pts for p in SPLIT_POINTS):  # TransformerLens: split inputs win
            written = {part: new for part in heads}
    for part, n in heads.items():
        point = f"hook_{part}_input"
        if point in pts:
            new = copies(point, n)
            if new is not None:
                written[part] = new
    forward = type(norm).forward  # the model's norm, without poslens's points (they fire on the shared input)
    return {part: forward(norm, value) for part, value in written.items()}


_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                               "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                               "__imatmul__"})
_EXPOSE = frozenset({"numpy", "__array__", "data_ptr", "untyped_storage", "storage", "_typed_storage", "__dlpack__",
                     "set_"})  # hand out the memory itself (a write there would reach the residual stream)


class HeadCopies(torch.Tensor):
    """The residual stream x [B, T, d] as n per-head copies [B, T, n, d], held as a broadcast view of x (stride 0 over
    the heads: no copy) until a hook writes it. Before the first operation that writes it (an in-place method,
    `x[:, :, h] = ...`, `out=`), takes a view of it (`x[:, :, h]`, `.view`, `.detach`) or exposes its memory, it is
    materialised in place (`set_`: the same object now holds n real copies, as TransformerLens's repeat), so every
    write reaches one head's copy only and never the residual stream; reading it (reductions, products) costs no copy.
    Results of operations on it are plain tensors."""

    @staticmethod
    def of(x: torch.Tensor, n: int) -> HeadCopies:
        """x [B, T, d] seen as n copies [B, T, n, d] (no copy)."""
        view = x.unsqueeze(2).expand(-1, -1, n, -1).as_subclass(HeadCopies)
        view._poslens_base = x.untyped_storage().data_ptr()  # the residual stream's memory, shared while broadcast
        view._poslens_seen = None  # the version right after materialising (None: still a broadcast)
        return view

    def written(self) -> bool:
        """Whether a hook wrote it (materialised, then changed)."""
        seen = self.__dict__.get("_poslens_seen")
        with torch._C.DisableTorchFunctionSubclass():
            return seen is not None and self._version != seen

    def _materialise(self) -> None:
        if self.__dict__.get("_poslens_seen") is not None:
            return
        with torch._C.DisableTorchFunctionSubclass():
            self.set_(self.clone(memory_format=torch.contiguous_format))  # n real copies in place: its own memory
            self._poslens_seen = self._version

    def _broadcast(self) -> bool:
        return "_poslens_base" in self.__dict__ and self.__dict__.get("_poslens_seen") is None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else None
        if isinstance(target, HeadCopies) and target._broadcast() and (
                name in _IN_PLACE_DUNDERS or name in _EXPOSE or (name.endswith("_") and not name.startswith("__"))):
            target._materialise()
        out_arg = kwargs.get("out")
        if isinstance(out_arg, HeadCopies):
            out_arg._materialise()
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        # a view of a broadcast (x[:, :, h], x.view(...), x.detach(), x.data): materialise first, then take the view
        shared = [a for a in (*args, *kwargs.values()) if isinstance(a, HeadCopies) and a._broadcast()
                  and result is not a and _shares_memory(result, a.__dict__["_poslens_base"])]
        if shared:
            for a in shared:
                a._materialise()
            with torch._C.DisableTorchFunctionSubclass():
                result = func(*args, **kwargs)
        return result


def _shares_memory(result, base: int) -> bool:
    """Whether `result` (a tensor, or a tuple or list of them) is a view of the memory at `base`."""
    if isinstance(result, torch.Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            return result.untyped_storage().data_ptr() == base
    if isinstance(result, (tuple, list)):
        return any(_shares_memory(r, base) for r in result)
    return False


def input_projection_hook(inputs_of, parts: list[tuple[str, int, int]]):
    """A forward hook on a projection whose output holds `parts` side by side (point "attn.hook_q" / "_k" / "_v",
    width, head width): each part with a written input (`inputs_of()`: part -> normed [B, T, heads, d]) is replaced
    by that input projected head by head with the part's rows of the weight (and bias). Registered before the
    attn.hook_q/k/v hooks, so those see the result."""
    widths = [w for _, w, _ in parts]

    def hook(module, args, out):
        inputs = inputs_of()
        if not inputs:
            return None
        pieces = list(out.split(widths, -1))
        weights = module.weight.split(widths, 0)
        biases = module.bias.split(widths, 0) if module.bias is not None else [None] * len(parts)
        changed = False
        for i, (point, _, d) in enumerate(parts):
            value = inputs.get(point[-1])
            if value is None:
                continue
            bias = None if biases[i] is None else biases[i].unflatten(0, (-1, d))
            pieces[i] = _per_head(point, value, weights[i].unflatten(0, (-1, d)), bias).flatten(-2).to(out.dtype)
            changed = True
        return torch.cat(pieces, -1) if changed else None

    return hook


def per_head_input_projection_hook(inputs_of, heads: int, d: int):
    """`input_projection_hook` for a projection whose output holds each head's [q | k | v] side by side ([B, T,
    heads * 3 * D]: GPT-NeoX's, BLOOM's and multi-head Falcon's query_key_value): each written part's D columns of
    every head are that head's copy projected with its rows of the weight (and bias)."""
    def hook(module, args, out):
        inputs = inputs_of()
        if not inputs:
            return None
        new = out.unflatten(-1, (heads, 3, d)).clone()  # [B, T, H, 3, D]
        weight = module.weight.unflatten(0, (heads, 3, d))  # [H, 3, D, d_model]
        bias = None if module.bias is None else module.bias.unflatten(0, (heads, 3, d))
        for i, part in enumerate("qkv"):
            value = inputs.get(part)
            if value is not None:
                b = None if bias is None else bias[:, i]
                new[..., i, :] = _per_head(f"attn.hook_{part}", value, weight[:, i], b).to(out.dtype)
        return new.flatten(-3)

    return hook


def _per_head(point: str, value: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Each head's copy [B, T, heads, d_model] times that head's rows w [heads, D, d_model] (plus b [heads, D]):
    [B, T, heads, D]."""
    if w.shape[0] != value.shape[-2]:
        raise UsageError(f"{point}: {value.shape[-2]} input copies for {w.shape[0]} heads")
    y = torch.einsum("bthm,hdm->bthd", value.to(w.dtype), w)
    return y + b if b is not None else y
