"""Copies that cost nothing until written: `LazyCopies`, a view of a tensor handed to hooks that becomes a real copy
(in place, the same object) before anything writes it or takes a view of it. Used for TransformerLens's per-head
attention inputs (poslens.engine.tl_inputs) and hook_mlp_in (poslens.engine.hooks)."""

from __future__ import annotations

import torch

_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                               "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                               "__imatmul__"})
_EXPOSE = frozenset({"numpy", "__array__", "data_ptr", "untyped_storage", "storage", "_typed_storage", "__dlpack__",
                     "set_"})  # hand out the memory itself (a write there would reach the residual stream)


class LazyCopies(torch.Tensor):
    """Copies of a tensor x that a hook gets to read or write (TransformerLens's per-head inputs: the residual stream
    [B, T, d] repeated as n copies [B, T, n, d]; hook_mlp_in: one copy [B, T, d]), held as a view of x (stride 0 over
    the heads: no copy) until a hook writes them. Before the first operation that writes it (an in-place method,
    `x[:, :, h] = ...`, `out=`), takes a view of it (`x[:, :, h]`, `.view`, `.detach`) or exposes its memory, it is
    materialised in place (`set_`: the same object now holds real copies, as TransformerLens's repeat or clone), so a
    write reaches its copy only, never x; reading it (reductions, products, clone) costs no copy. Results of operations
    on it are plain tensors. Not for autograd (the storage is swapped in place): callers copy under gradients."""

    @staticmethod
    def of(x: torch.Tensor, n: int | None = None) -> LazyCopies:
        """x [B, T, d] seen as n copies [B, T, n, d] (n None: one copy, x's shape), without copying."""
        view = (x if n is None else x.unsqueeze(2).expand(-1, -1, n, -1)).as_subclass(LazyCopies)
        view._poslens_base = x.untyped_storage().data_ptr()  # x's memory, shared until materialised
        view._poslens_seen = None  # the version right after materialising (None: still a broadcast)
        return view

    def written(self) -> bool:
        """Whether a hook wrote it (materialised, then changed)."""
        seen = self.__dict__.get("_poslens_seen")
        with torch._C.DisableTorchFunctionSubclass():  # an inference tensor counts no writes: materialised = written
            return seen is not None and (self.is_inference() or self._version != seen)

    def _materialise(self) -> None:
        if self.__dict__.get("_poslens_seen") is not None:
            return
        with torch._C.DisableTorchFunctionSubclass():
            self.set_(self.clone(memory_format=torch.contiguous_format))  # real copies in place: its own memory
            self._poslens_seen = -1 if self.is_inference() else self._version

    def _broadcast(self) -> bool:
        return "_poslens_base" in self.__dict__ and self.__dict__.get("_poslens_seen") is None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else None
        if isinstance(target, LazyCopies) and target._broadcast() and (
                name in _IN_PLACE_DUNDERS or name in _EXPOSE or (name.endswith("_") and not name.startswith("__"))):
            target._materialise()
        out_arg = kwargs.get("out")
        if isinstance(out_arg, LazyCopies):
            out_arg._materialise()
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        # a view of a broadcast (x[:, :, h], x.view(...), x.detach(), x.data): materialise first, then take the view
        shared = [a for a in (*args, *kwargs.values()) if isinstance(a, LazyCopies) and a._broadcast()
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


def plain(x):
    """x as a plain tensor (a LazyCopies after its hooks: its copies), anything else unchanged."""
    return x.as_subclass(torch.Tensor) if isinstance(x, LazyCopies) else x

