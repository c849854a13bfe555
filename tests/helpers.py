"""Small assertions shared by the test modules."""

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
