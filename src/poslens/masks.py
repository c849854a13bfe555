"""The attention mask of a decoder, in one place: which key j query i may attend.

    visible(i, j) = j <= i                                  causal
                    and (W = 0 or i - j < W or j < S)       a sliding window of W keys (self included), the
                                                            first S keys kept besides (a sink window: S = 1)
                    and (j > 0 or key0)                     key 0 in (default) or out (a domain without the sink)
                    and key j is a real token               padding (`allowed`'s `real`)

Queries are the last n of m positions (m = n unless a cache holds earlier keys), so query row r is position
i = r + m - n. `hidden` is the one definition; `visible` is its complement; `allowed` adds padding in the
[B, 1, n, m] layout attention functions take; `nan_hidden` writes NaN on the hidden entries of a map, as the
paper draws its maps. Used by the stack (`poslens.stack.config.visible`), the hooks' dense scores, the capture,
the intermediates, the leakage domains and the length analysis's explicit masks.
"""

from __future__ import annotations

import math

import torch

from poslens.errors import UsageError


def hidden(n: int, window: int = 0, *, keys: int | None = None, sinks: int = 0, key0: bool = True,
           device: torch.device | str | None = None) -> torch.Tensor:
    """[n, m] bool, True where query i (the last n of m = `keys` positions, default n) cannot see key j:
    j > i, or i - j >= window (window > 0) unless j < sinks, or j = 0 when not `key0`."""
    m = n if keys is None else keys
    if m < n:
        raise UsageError(f"keys must be at least the number of queries {n}, got {m}")
    i = torch.arange(n, device=device)[:, None] + (m - n)
    j = torch.arange(m, device=device)[None]
    if not window:
        out = j > i
    else:
        far = i - j >= window
        out = (j > i) | (far & (j >= sinks) if sinks else far)
    return out if key0 else out | (j == 0)


def visible(n: int, window: int = 0, *, keys: int | None = None, sinks: int = 0, key0: bool = True,
            device: torch.device | str | None = None) -> torch.Tensor:
    """[n, m] bool, True where query i may attend key j: the complement of `hidden`."""
    return ~hidden(n, window, keys=keys, sinks=sinks, key0=key0, device=device)


def allowed(n: int, window: int = 0, real: torch.Tensor | None = None, *, sinks: int = 0,
            device: torch.device | str | None = None) -> torch.Tensor:
    """[B or 1, 1, n, n] bool: `visible`, and key j a real token of row b (`real` [B, n], 1 = a real token)."""
    ok = visible(n, window, sinks=sinks, device=device)[None, None]
    if real is not None:
        if real.dim() != 2 or real.shape[1] != n:
            raise UsageError(f"real must be [batch, {n}] (1 = a real token), got shape {tuple(real.shape)}")
        ok = ok & real.to(device=ok.device, dtype=torch.bool)[:, None, None, :]
    return ok


def additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True where a key is seen) as an eager attention adds it to the scores: 0 where seen, the
    dtype's minimum elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=seen.device)
    return torch.where(seen, zero, torch.finfo(dtype).min)


def nan_hidden(m: torch.Tensor, window: int = 0) -> torch.Tensor:
    """The map(s) m [..., n, n] with NaN where query i cannot see key j (above the diagonal and outside the
    window), as the paper draws them."""
    return m.masked_fill(hidden(m.shape[-1], window, device=m.device), math.nan)
