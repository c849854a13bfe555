"""Section 4.2 pieces: the linear probe of absolute position, and the paired NoPE/RoPE held-out losses."""

from __future__ import annotations

import math

import pytest
import torch

from poslens.errors import UsageError
from poslens.train.config import resolve_config
from poslens.train.model import build_model
from poslens.train.probe import (
    heldout_losses,
    loss_comparison,
    position_probe,
    sequences_of,
)


# the independent reference of the streaming probe: the whole ridge system formed at once
def ridge_fit(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    """Weights w (bias last) minimising |[x 1] w - y|^2 + ridge |w_x|^2, solved in float64 (normal equations)."""
    x = torch.cat([x.double(), torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)
    gram = x.T @ x
    reg = torch.eye(gram.shape[0], dtype=torch.float64) * ridge
    reg[-1, -1] = 0.0  # the bias is not shrunk
    return torch.linalg.solve(gram + reg, x.T @ y.double())


def ridge_predict(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w[:-1] + w[-1]



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
    res = position_probe(model, fit, test, groups=8, batch_size=2)
    mae, chance = res.values(), float(res.chance.value)
    assert len(mae) == 3 and chance == pytest.approx(8.0, abs=0.01)  # E|U - 15.5| on 0..31 = 8
    assert abs(mae[0] - chance) < 0.1 * chance
    assert mae[1] < 0.9 * chance and mae[2] < 0.9 * chance
    # the paired interval of "layer 1 beats the embeddings" excludes 0 here (8 groups of 2 test sequences)
    assert float(res.difference(0, 1).hi) < 0
    # an absolute error cannot be negative: each layer's interval (and chance's) is cut at 0
    assert all(e.support == (0.0, math.inf) and float(e.lo) >= 0 for e in [*res.mae, res.chance])


def test_probe_of_a_rope_model_matches_nope_at_layer_zero():
    """RoPE acts inside attention only: the embeddings (index 0) are the same for NoPE and RoPE models with
    the same seed, so their layer-0 probes agree exactly."""
    g = torch.Generator().manual_seed(2)
    fit, test = torch.randint(0, 300, (32, 24), generator=g), torch.randint(0, 300, (8, 24), generator=g)
    kw = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, seed=3)
    a = position_probe(build_model(resolve_config("tiny", pe="none", **kw), 300), fit, test)
    b = position_probe(build_model(resolve_config("tiny", pe="rope", **kw), 300), fit, test)
    assert a.values()[0] == b.values()[0] and a.values()[-1] != b.values()[-1]


def test_streaming_probe_equals_a_direct_ridge_fit():
    """The probe's normal equations are summed batch by batch inside the forward; fitting the same standardised
    ridge on all hidden states at once (output_hidden_states, ridge_fit, float64) gives the same held-out errors
    (1e-6 tokens: both float64 solves of the same system, the sums taken in different orders)."""
    cfg = resolve_config("tiny", layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, seed=4)
    model = build_model(cfg, 200).eval()
    g = torch.Generator().manual_seed(5)
    fit, test = torch.randint(0, 200, (24, 16), generator=g), torch.randint(0, 200, (8, 16), generator=g)
    res = position_probe(model, fit, test, ridge=1e-2, groups=4, batch_size=3)
    with torch.no_grad():
        hf = model(input_ids=fit, output_hidden_states=True).hidden_states
        ht = model(input_ids=test, output_hidden_states=True).hidden_states
    pos_fit, pos_test = torch.arange(16.0).repeat(24).double(), torch.arange(16.0).repeat(8).double()
    for i in range(len(hf) - 1):  # HF's last entry is after the final norm; the probe reads the residual stream
        xf, xt = hf[i].reshape(-1, 32).double(), ht[i].reshape(-1, 32).double()
        mean, scale = xf.mean(0), xf.std(0, unbiased=False)
        w = ridge_fit((xf - mean) / scale, pos_fit, 1e-2 * xf.shape[0])
        mae = (ridge_predict((xt - mean) / scale, w) - pos_test).abs().mean()
        assert float(res.mae[i].value) == pytest.approx(float(mae), abs=1e-6)


def test_heldout_losses_equal_the_models_own_loss():
    """The paired held-out losses are the mean next-token cross-entropy transformers computes with labels=
    (float32 logits; 1e-5), and the NoPE - RoPE gap of a model with itself is exactly 0 with a zero-width
    interval."""
    cfg = resolve_config("tiny", layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, seed=6)
    model = build_model(cfg, 200).eval()
    blocks = sequences_of(torch.randint(0, 200, (10 * 17,), generator=torch.Generator().manual_seed(7)), 17, 10)
    sums = heldout_losses({"none": model, "rope": model}, blocks, groups=5, batch_size=2)
    with torch.no_grad():
        ref = model(input_ids=blocks, labels=blocks).loss
    cmp = loss_comparison(sums)
    assert cmp["loss_none"]["value"] == pytest.approx(float(ref), abs=1e-5)
    assert cmp["gap"]["value"] == 0.0 and cmp["gap"]["lo"] == 0.0 and cmp["perplexity_ratio"]["value"] == 1.0
    # a loss and a perplexity ratio cannot be negative: their intervals are cut at 0 (the gap has no range)
    assert all(cmp[k]["support"] == [0.0, math.inf] for k in ("loss_none", "loss_rope", "perplexity_ratio"))
    assert "support" not in cmp["gap"]


def test_too_little_held_out_text_is_a_one_line_error():
    with pytest.raises(UsageError, match="fewer than 3 sequences of 10 tokens"):
        sequences_of(torch.arange(25), 10, 3)


def test_held_out_blocks_start_with_the_bos_a_model_was_trained_with():
    """With `bos`, every block is the BOS, then the next seq_len - 1 tokens of the stream, with no token skipped or
    repeated between blocks: the blocks a `--bos` model saw in training (train.data.blocks)."""
    stream = torch.arange(100, 100 + 4 * 9)
    out = sequences_of(stream, 10, 4, offset=0, bos=7)
    assert out.shape == (4, 10) and (out[:, 0] == 7).all()
    assert torch.equal(out[:, 1:].flatten(), stream)
    later = sequences_of(torch.arange(100, 100 + 6 * 9), 10, 2, offset=4, bos=7)
    assert later[0, 1].item() == 100 + 4 * 9
