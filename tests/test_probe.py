"""Section 4.2 pieces: the linear probe of absolute position, and the NoPE/RoPE held-out loss gap."""

from __future__ import annotations

import pytest
import torch

from poslens.errors import UsageError
from poslens.train.config import resolve_config
from poslens.train.model import build_model
from poslens.train.probe import loss_gap, position_probe, ridge_fit, ridge_predict


def test_ridge_matches_least_squares():
    """With ridge -> 0 the fit is ordinary least squares with a bias (torch.linalg.lstsq, float64; 1e-8)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0], dtype=torch.float64) + 7.0 + 0.1 * torch.randn(200, generator=g,
                                                                                                    dtype=torch.float64)
    w = ridge_fit(x, y, 0.0)
    ref = torch.linalg.lstsq(torch.cat([x, torch.ones(200, 1, dtype=torch.float64)], 1), y[:, None]).solution[:, 0]
    assert torch.allclose(w, ref, atol=1e-8)
    assert torch.allclose(ridge_predict(x, w), x @ ref[:-1] + ref[-1], atol=1e-8)


def test_probe_of_a_nope_model_at_initialisation():
    """Embeddings of a NoPE model hold no position: the layer-0 probe is at chance (T/4 within 10%). With a
    BOS token first, causal attention alone puts position into the first layer's output (Kazemnejad et al.
    2023: the BOS share of near-uniform attention is 1/(t+1)), so even at initialisation the probes after
    layers 1 and 2 beat chance by more than 10%."""
    cfg = resolve_config("tiny", layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, seed=1)
    model = build_model(cfg, 300)
    g = torch.Generator().manual_seed(0)
    fit = torch.randint(1, 300, (48, 32), generator=g)
    test = torch.randint(1, 300, (16, 32), generator=g)
    fit[:, 0] = test[:, 0] = 0  # BOS
    res = position_probe(model, fit, test)
    assert len(res.mae) == 3 and res.chance == pytest.approx(8.0, abs=0.01)  # E|U - 15.5| on 0..31 = 8
    assert abs(res.mae[0] - res.chance) < 0.1 * res.chance
    assert res.mae[1] < 0.9 * res.chance and res.mae[2] < 0.9 * res.chance


def test_probe_of_a_rope_model_matches_nope_at_layer_zero():
    """RoPE acts inside attention only: the embeddings (index 0) are the same for NoPE and RoPE models with
    the same seed, so their layer-0 probes agree exactly."""
    g = torch.Generator().manual_seed(2)
    fit, test = torch.randint(0, 300, (32, 24), generator=g), torch.randint(0, 300, (8, 24), generator=g)
    kw = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, seed=3)
    a = position_probe(build_model(resolve_config("tiny", pe="none", **kw), 300), fit, test)
    b = position_probe(build_model(resolve_config("tiny", pe="rope", **kw), 300), fit, test)
    assert a.mae[0] == b.mae[0] and a.mae[-1] != b.mae[-1]


def test_loss_gap():
    assert loss_gap([5.0, 4.2], [5.1, 4.0]) == {"nope": 4.2, "rope": 4.0, "gap": pytest.approx(0.2)}
    with pytest.raises(UsageError):
        loss_gap([], [1.0])
