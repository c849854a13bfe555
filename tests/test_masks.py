"""poslens.masks (the one attention mask) and poslens.maps's diagonal normalisation against brute-force definitions
written as loops over (query, key) pairs; every comparison is exact (booleans, or the same float64 sums in the same
order), so a tolerance of 0."""

import math

import numpy as np
import pytest
import torch

from poslens.errors import UsageError
from poslens.maps import diagonal_normalise, diagonal_normalised
from poslens.masks import allowed, hidden, nan_hidden, visible


def brute(n: int, window: int = 0, keys: int | None = None, sinks: int = 0, key0: bool = True) -> torch.Tensor:
    """visible(i, j) by the definition: query row r is position i = r + m - n; j <= i, and within the window of
    W keys (self included) unless j is one of the first `sinks` keys; key 0 only when `key0`."""
    m = n if keys is None else keys
    out = torch.zeros(n, m, dtype=torch.bool)
    for r in range(n):
        i = r + m - n
        for j in range(m):
            out[r, j] = j <= i and (window == 0 or i - j < window or j < sinks) and (key0 or j > 0)
    return out


@pytest.mark.parametrize("n", [1, 2, 7, 16])
@pytest.mark.parametrize("window", [0, 1, 3, 16])
@pytest.mark.parametrize("sinks", [0, 1, 2])
@pytest.mark.parametrize("key0", [True, False])
def test_visible_and_hidden_are_the_definition(n, window, sinks, key0):
    want = brute(n, window, sinks=sinks, key0=key0)
    assert torch.equal(visible(n, window, sinks=sinks, key0=key0), want)
    assert torch.equal(hidden(n, window, sinks=sinks, key0=key0), ~want)


@pytest.mark.parametrize("n,m,window", [(1, 9, 0), (3, 9, 0), (3, 9, 4), (5, 5, 2), (4, 12, 5)])
def test_queries_after_cached_keys_are_the_last_positions(n, m, window):
    assert torch.equal(visible(n, window, keys=m), brute(n, window, keys=m))
    assert torch.equal(hidden(n, window, keys=m), ~brute(n, window, keys=m))


def test_fewer_keys_than_queries_is_refused_in_one_line():
    with pytest.raises(UsageError, match="keys must be at least the number of queries 4, got 3"):
        hidden(4, keys=3)


@pytest.mark.parametrize("window,sinks", [(0, 0), (3, 0), (4, 1)])
def test_padding_hides_the_keys_of_padded_positions(window, sinks):
    real = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]])
    got = allowed(6, window, real, sinks=sinks)
    assert got.shape == (3, 1, 6, 6)
    base = brute(6, window, sinks=sinks)
    for b in range(3):
        for i in range(6):
            for j in range(6):
                assert bool(got[b, 0, i, j]) == (bool(base[i, j]) and bool(real[b, j]))
    assert torch.equal(allowed(6, window, sinks=sinks), base[None, None])
    with pytest.raises(UsageError, match=r"real must be \[batch, 6\]"):
        allowed(6, window, real[:, :5])


def test_key0_in_keeps_the_sink_and_key0_out_does_not():
    """With one sink every query sees key 0 and its last W - 1 keys besides; without, a query past the window does
    not see key 0; key 0 out hides it from every query and changes nothing else."""
    w = 3
    keep, drop = visible(10, w, sinks=1), visible(10, w)
    assert bool(keep[:, 0].all()) and not bool(drop[w:, 0].any())
    assert torch.equal(keep[:, 1:], drop[:, 1:])
    out = visible(10, key0=False)
    assert not bool(out[:, 0].any()) and torch.equal(out[:, 1:], visible(10)[:, 1:])


def test_nan_hidden_writes_nan_on_hidden_entries_only():
    m = torch.arange(2 * 25, dtype=torch.float64).reshape(2, 5, 5)
    got = nan_hidden(m, 2)
    ok = brute(5, 2)
    assert torch.equal(torch.isnan(got), ~ok.expand(2, 5, 5))
    assert torch.equal(got[:, ok], m[:, ok])


def brute_normalise(m: np.ndarray, causal: bool) -> np.ndarray:
    """Each diagonal k = i - j minus the mean of its finite entries, summed in row-major order; the upper triangle
    NaN when causal (and not used)."""
    n = m.shape[-1]
    out = np.full_like(m, math.nan)
    for k in range(-(n - 1), n):
        if causal and k < 0:
            continue
        cells = [(i, i - k) for i in range(n) if 0 <= i - k < n]
        total, count = 0.0, 0
        for i, j in cells:
            if math.isfinite(m[i, j]):
                total += m[i, j]
                count += 1
        mean = total / count if count else math.nan
        for i, j in cells:
            out[i, j] = m[i, j] - mean
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_diagonal_normalisation_is_the_definition(causal):
    g = torch.Generator().manual_seed(3)
    m = nan_hidden(torch.randn(3, 12, 12, generator=g, dtype=torch.float64), 5)  # a window hides far keys
    m[1, 6:, 2] = math.inf  # non-finite entries stay out of the means
    want = np.stack([brute_normalise(x, causal) for x in m.numpy()])
    got = diagonal_normalised(m, causal)
    assert got.dtype == torch.float64 and got.shape == m.shape
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(diagonal_normalise(m, causal), want)  # the numpy face: the same numbers
    np.testing.assert_array_equal(diagonal_normalise(m[0].numpy(), causal), want[0])


def test_a_map_of_the_offset_alone_normalises_to_zero():
    """A Toeplitz map (what a purely relative encoding gives) has nothing left after the normalisation."""
    i = torch.arange(20, dtype=torch.float64)
    toeplitz = torch.cos(0.3 * (i[:, None] - i[None])) * 7
    r = diagonal_normalised(toeplitz)
    assert float(r[visible(20)].abs().max()) < 1e-14 and bool(r[hidden(20)].isnan().all())
