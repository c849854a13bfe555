"""Float32 subnormals read and written as 0 on the CPU, inside a block (the x86 FTZ/DAZ bits of the calling thread).

An x86 core takes about a hundred times longer per operation on a subnormal (a magnitude below 1.18e-38 in float32).
Models that form attention sinks meet them: in training, inside each step (activations and gradients; a checkpoint
holds none), and in a forward that forms the dense soft-max past the training length (probabilities of keys far
from the sink underflow through the subnormal range). Both trainers step inside `subnormals_flushed`, and every
`poslens` command runs inside it (`poslens.cli.main`); what changes is only the rounding below 1.2e-38 (BENCHMARKS.md
"Subnormal floats in training" and "Subnormal floats in forwards").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def flushing_subnormals() -> bool:
    """Whether this thread reads and writes float32 subnormals as 0 (a subnormal's product with 1 comes out 0)."""
    return torch.tensor([1e-39], dtype=torch.float32).mul(1.0).item() == 0.0


@contextlib.contextmanager
def subnormals_flushed(device: torch.device | str = "cpu") -> Iterator[None]:
    """Inside, on the CPU, float subnormals are read and written as 0 (``torch.set_flush_denormal``: the calling
    thread's FTZ/DAZ bits, which threads it starts meanwhile inherit); the previous mode is restored after. On
    another device nothing changes. A `pe-sinks` computation of nine models stepped 1.55x as long at step 1,000 with
    them (0.359 s against 0.231 s flushed); an eager forward of one such model at 8 x 512 tokens, 1.23-1.26x
    (BENCHMARKS.md).
    Training equals itself flushed (resumes bit for bit), and training without flushing up to float32 rounding, as
    on another processor."""
    if torch.device(device).type != "cpu":
        yield
        return
    before = flushing_subnormals()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)
