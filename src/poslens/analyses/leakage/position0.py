"""Position 0 and attention sinks (the residual-stream source Ruscio et al. 2026 name; Gu et al. 2025's sink metric).

Position 0 attends only to itself, so its hidden state at every layer is a function of token 0 alone: with a
fixed first token (an auto-prepended BOS) it is the same for every input up to floating-point rounding, and it
varies when token 0 varies. `spread` measures that per layer: D0 = 1 - mean over pairs of inputs n < n' of
cos(h0^(n), h0^(n')) (0 = deterministic). With a fixed first token a spread of 0 is true by causality: it is a
test of the code (tests/test_leakage_position0.py), not evidence about a model.
"""

from __future__ import annotations

import torch

from poslens.analyses.leakage.metrics import first_key_attention
from poslens.errors import UsageError, check_float, check_int

GU_TOKENS = 64  # Gu et al.'s sequence length for the sink rate
GU_EPSILON = 0.3


def spread(states: torch.Tensor) -> torch.Tensor:
    """D0 per layer from position-0 states [N, L, d] of N inputs: 1 - mean pairwise cosine, [L] float64.

    Mean pairwise cosine of unit vectors u_n: (||sum_n u_n||^2 - N) / (N (N - 1)).
    """
    states = torch.as_tensor(states).to(torch.float64)
    n = states.shape[0]
    if n < 2:
        raise UsageError(f"position-0 spread needs at least 2 sequences, got {n}; raise num_sequences")
    u = torch.nn.functional.normalize(states, dim=-1)
    total = u.sum(0)
    return 1.0 - ((total**2).sum(-1) - n) / (n * (n - 1))


def sink_rates(probs_per_head: torch.Tensor, epsilon: float = GU_EPSILON, tokens: int | None = GU_TOKENS) -> dict:
    """Attention on key 0 per layer and head (alpha_0 [L, H], Gu et al.: the mean over queries of A_i0) and
    the sink rate Sink^eps_0 = share of (layer, head) pairs with alpha_0 > eps, over the first `tokens` positions
    of the mean maps (causal: exactly what sequences of that length give) and over the whole length."""
    check_float("epsilon", epsilon, 0.0, 1.0, lo_open=True, hi_open=True)
    probs = torch.as_tensor(probs_per_head).to(torch.float64)
    n = probs.shape[-1]
    out = {"alpha0": first_key_attention(probs), "epsilon": epsilon, "tokens": n}
    out["rate"] = float((out["alpha0"] > epsilon).double().mean())
    if tokens is not None and check_int("tokens", tokens, 2) <= n:
        short = first_key_attention(probs[..., :tokens, :tokens])
        out["alpha0_short"], out["short_tokens"] = short, tokens
        out["rate_short"] = float((short > epsilon).double().mean())
    return out


def sink_heads(alpha0: torch.Tensor, threshold: float = GU_EPSILON) -> list[dict]:
    """The sink-reading heads: every (layer, head) whose mean attention on key 0 exceeds `threshold`, strongest
    first. (Ruscio et al.'s own criterion is not public; this is Gu et al.'s per-head test.)"""
    check_float("threshold", threshold, 0.0, 1.0, lo_open=True, hi_open=True)
    alpha0 = torch.as_tensor(alpha0)
    idx = (alpha0 > threshold).nonzero().tolist()
    heads = [{"layer": int(l), "head": int(h), "alpha0": float(alpha0[l, h])} for l, h in idx]
    return sorted(heads, key=lambda r: -r["alpha0"])


def position0_hooks(n_layers: int, sink: list) -> dict:
    """Read hooks collecting position 0's state after the embedding and after every layer into `sink`
    (one [B, L + 1, d] float32 tensor appended per forward)."""
    parts: dict[int, torch.Tensor] = {}

    def grab(index: int):
        def hook(x, ctx):
            parts[index] = x[:, 0].detach().to(torch.float32, copy=True)  # on the device, until the rows are read
            if index == n_layers:
                sink.append(torch.stack([parts[k] for k in range(n_layers + 1)], 1))
                parts.clear()
            return None

        return hook

    hooks = {"hook_embed": grab(0)}
    for l in range(n_layers):
        hooks[f"blocks.{l}.hook_resid_post"] = grab(l + 1)
    return hooks
