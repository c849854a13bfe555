"""Small assertions shared by the test modules."""

import torch


def assert_identical(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Bit-identical tensors, NaN where and only where the other has NaN (undefined map entries)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")
