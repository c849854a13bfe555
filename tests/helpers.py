"""Small assertions shared by the test modules."""

import contextlib
import socket

import torch


def assert_identical(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Bit-identical tensors, NaN where and only where the other has NaN (undefined map entries)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def free_port() -> int:
    """A TCP port free now on this machine, for a torchrun rendezvous (a fixed one collides with another test run,
    or another xdist worker, using it at the same time)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# An output computed from a formed pattern (pattern @ v, transformers' eager attention op for op) against the model's
# SDPA forward: SDPA's fused CPU kernel (a blocked softmax with running maxima) rounds differently from the eager
# operations by a few float32 ulps (1.2e-7) per attention output; through a few layers and the LM head the largest
# difference measured on the tiny models is 1.3e-6 of the largest logit (Gemma-3). 1e-5 leaves about 8x margin, and a
# change of meaning (a missing mask, scaling or bias) moves the logits by more than 1e-2.
SDPA_ROUNDING = 1e-5


def assert_within_sdpa_rounding(actual: torch.Tensor, sdpa: torch.Tensor, what: str = "") -> None:
    """`actual` within SDPA_ROUNDING of `sdpa` relative to its largest |value| (and not bit-identical by chance only
    where the caller says so)."""
    err = float((actual.double() - sdpa.double()).abs().max() / sdpa.double().abs().max())
    assert err <= SDPA_ROUNDING, f"{what}: relative difference to the SDPA forward {err:.2e} > {SDPA_ROUNDING:g}"


@contextlib.contextmanager
def interrupted_at(call: int):
    """Within the block, the hooked forward raises KeyboardInterrupt at its `call`-th call (as Ctrl-C in the middle
    of a run), and the block expects it; the forward is restored after."""
    import pytest

    from poslens.engine import hooks

    original, calls = hooks.HookedModel.run, {"n": 0}

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == call:
            raise KeyboardInterrupt
        return original(self, *a, **k)

    hooks.HookedModel.run = flaky
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        hooks.HookedModel.run = original
