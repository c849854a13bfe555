"""`LazyCopies` on its own (poslens.engine.lazy_copies): copies of a tensor that are a view of it until written.

Exact checks (torch.equal): reading (reductions, clone, comparisons) leaves it a view, stride 0 over the copies, with
the base's values (a product of it: within float32 rounding, 1e-6, since a kernel may order its sums differently on a
stride-0 layout); every way of writing it (in-place methods, indexed assignment and augmented
assignment, `out=`, a view taken first, the memory handed out) makes it real copies first, so the base is never
written; `written()` tells a write from a view that was only read. The engine's uses are tests/test_hooks_views.py's."""

from __future__ import annotations

import numpy as np
import torch

from poslens.engine.lazy_copies import LazyCopies, plain


def _base() -> torch.Tensor:
    return torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_reading_keeps_a_view_with_the_base_values():
    x = _base()
    c = LazyCopies.of(x, 5)
    assert c.shape == (2, 3, 5, 4) and c.stride(2) == 0
    repeated = x.unsqueeze(2).repeat(1, 1, 5, 1)
    assert torch.equal(c.sum(2), repeated.sum(2)) and torch.equal(c.clone(), repeated)
    assert bool((c == repeated).all())
    # a product's kernel may order a sum differently on a stride-0 layout: the same values in, float32 rounding out
    w = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(c @ w, repeated @ w, rtol=1e-6, atol=1e-6)
    assert c.stride(2) == 0 and not c.written()
    assert type(c.sum()) is torch.Tensor and type(plain(c)) is torch.Tensor


@torch.no_grad()
def test_every_write_makes_copies_first_and_never_reaches_the_base():
    def set_item(c):
        c[:, :, 1] = 0

    def augmented(c):
        c[:, :, 1] += 1

    def through_a_view(c):
        c[:, :, 1].zero_()

    def method(c):
        c.add_(1)

    def out(c):
        torch.add(c, 1, out=c)

    def memory(c):
        c.numpy()[:, :, 1] = 0  # the array is the copies' memory, not the base's (torch sees no write: below)

    for write in (set_item, augmented, through_a_view, method, out, memory):
        x = _base()
        before = x.clone()
        c = LazyCopies.of(x, 5)
        write(c)
        assert torch.equal(x, before), write.__name__
        assert c.stride(2) != 0, write.__name__
        # a write through numpy's memory moves no version counter (as before LazyCopies: the engine never saw it)
        assert c.written() == (write is not memory), write.__name__
        if write is not method and write is not out:  # one copy written, the others still the base's values
            assert torch.equal(c[:, :, 0], before) and not torch.equal(c[:, :, 1], before), write.__name__


@torch.no_grad()
def test_a_view_that_is_only_read_is_not_a_write():
    x = _base()
    c = LazyCopies.of(x, 3)
    head = c[:, :, 2]  # a view: the copies are made first, so the view is of them
    assert torch.equal(head, x) and not c.written()
    head.mul_(2)  # then written through the view: a write, of that copy only
    assert c.written() and torch.equal(c[:, :, 0], x) and torch.equal(x, _base())


@torch.no_grad()
def test_one_copy_without_heads():
    x = _base()
    c = LazyCopies.of(x)
    assert c.shape == x.shape and torch.equal(c, x) and not c.written()
    c[0] = 0
    assert torch.equal(x, _base()) and c.written() and bool((c[0] == 0).all())
    assert isinstance(np.asarray(plain(c)), np.ndarray)
