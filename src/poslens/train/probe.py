"""Section 4.2 pieces on trained models: a linear probe of absolute position, and held-out losses compared.

`position_probe` follows Haviv et al. (2022): how well can the absolute position of a token be read from
each layer's hidden states? Here with a linear (ridge) regression fitted on some sequences and scored on
others, as the mean absolute error in tokens. Chance (predicting the mean position) is T/4 for positions
uniform on 0..T-1 (E|U - (T-1)/2| ~ T/4); the embeddings of a model without positional encoding carry no
position, so layer 0 sits at chance, and any causal attention layer can do better (Kazemnejad et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poslens.errors import require


@dataclass
class ProbeResult:
    """Held-out mean absolute error (tokens) per hidden-state index (0 = embeddings, l = after layer l)."""

    mae: list[float]
    chance: float
    seq_len: int


def ridge_fit(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    """Weights w (bias last) minimising |[x 1] w - y|^2 + ridge |w_x|^2, solved in float64 (normal equations)."""
    x = torch.cat([x.double(), torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)
    gram = x.T @ x
    reg = torch.eye(gram.shape[0], dtype=torch.float64) * ridge
    reg[-1, -1] = 0.0  # the bias is not shrunk
    return torch.linalg.solve(gram + reg, x.T @ y.double())


def ridge_predict(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w[:-1] + w[-1]


@torch.no_grad()
def hidden_states(model: torch.nn.Module, blocks: torch.Tensor, batch: int = 8) -> list[torch.Tensor]:
    """Every layer's hidden states of `blocks` [N, T], as float32 [N, T, d] per index 0..L."""
    model.eval()
    out: list[list[torch.Tensor]] = []
    for chunk in blocks.split(batch):
        hs = model(input_ids=chunk, output_hidden_states=True).hidden_states
        if not out:
            out = [[] for _ in hs]
        for i, h in enumerate(hs):
            out[i].append(h.float().cpu())
    return [torch.cat(h) for h in out]


def position_probe(model: torch.nn.Module, fit_blocks: torch.Tensor, test_blocks: torch.Tensor,
                   ridge: float = 1e-2) -> ProbeResult:
    """Fit a ridge probe of the absolute position on `fit_blocks` per hidden-state index; score on `test_blocks`.

    Positions are 0..T-1 within each block (the model sees each block from its first token). The features
    are standardised with the fit set's mean and scale before the ridge, so `ridge` is scale-free.
    """
    require(fit_blocks.dim() == 2 and test_blocks.dim() == 2 and fit_blocks.shape[1] == test_blocks.shape[1],
            "fit_blocks and test_blocks must be [N, T] token tensors of the same T")
    t = fit_blocks.shape[1]
    fit_h, test_h = hidden_states(model, fit_blocks), hidden_states(model, test_blocks)
    pos_fit = torch.arange(t, dtype=torch.float64).repeat(fit_blocks.shape[0])
    pos_test = torch.arange(t, dtype=torch.float64).repeat(test_blocks.shape[0])
    maes = []
    for hf, ht in zip(fit_h, test_h):
        xf, xt = hf.reshape(-1, hf.shape[-1]).double(), ht.reshape(-1, ht.shape[-1]).double()
        mean, scale = xf.mean(0), xf.std(0).clamp_min(1e-12)
        w = ridge_fit((xf - mean) / scale, pos_fit, ridge * xf.shape[0])
        pred = ridge_predict((xt - mean) / scale, w)
        maes.append(float((pred - pos_test).abs().mean()))
    chance = float((pos_test - pos_fit.mean()).abs().mean())
    return ProbeResult(mae=maes, chance=chance, seq_len=t)


def loss_gap(nope_eval: list[float], rope_eval: list[float]) -> dict[str, float]:
    """NoPE's final held-out loss against RoPE's (same data, seed, architecture): both, and NoPE - RoPE."""
    require(bool(nope_eval) and bool(rope_eval), "both runs need at least one held-out loss")
    return {"nope": nope_eval[-1], "rope": rope_eval[-1], "gap": nope_eval[-1] - rope_eval[-1]}
