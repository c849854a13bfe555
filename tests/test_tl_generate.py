"""HookedModel.generate with TransformerLens's key/value cache path: each step after the first runs only the new
token against the cached keys and values, and gives exactly the tokens of running the whole sequence every step
(greedy: the same argmax; the logits of the two paths agree to float32 rounding, far from any tie on these seeds).
Its agreement with TransformerLens 3.9's own generate on SmolLM2-135M is tests/test_tl_demo.py's."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import ALL_FAMILIES, build, token_batch

from poslens.engine.hooks import HookedModel


@pytest.mark.parametrize("family", ALL_FAMILIES)  # parallel blocks, ALiBi and poslens's own attention (Falcon) too
def test_cached_generation_equals_full_recomputation_and_hooks_see_the_new_token(family):
    hm = HookedModel(build(family))
    ids = token_batch(2, 6, seed=3)
    cached = hm.generate(ids, max_new_tokens=8, do_sample=False, stop_at_eos=False)
    full = hm.generate(ids, max_new_tokens=8, do_sample=False, stop_at_eos=False, use_past_kv_cache=False)
    assert cached.shape == (2, 14) and torch.equal(cached, full) and torch.equal(cached[:, :6], ids)
    shapes = []
    hm.add_hook("blocks.0.attn.hook_attn_scores", lambda x, hook: shapes.append(tuple(x.shape)))
    hm.add_hook("blocks.0.hook_resid_pre", lambda x, hook: shapes.append(tuple(x.shape)))
    hm.generate(ids, max_new_tokens=3, do_sample=False, stop_at_eos=False)
    hm.reset_hooks()
    d, h = hm.cfg.d_model, hm.cfg.n_heads
    assert shapes == [(2, 6, d), (2, h, 6, 6), (2, 1, d), (2, h, 1, 7), (2, 1, d), (2, h, 1, 8)]


def test_generation_stops_each_row_at_eos():
    """A row that produced the EOS continues with EOS (TransformerLens's padding); all rows done ends the loop."""
    hm = HookedModel(build("llama"))
    ids = token_batch(2, 5, seed=4)
    free = hm.generate(ids, max_new_tokens=6, do_sample=False, stop_at_eos=False)
    eos = int(free[0, 6])  # row 0's second new token, taken as the EOS
    out = hm.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=eos)
    assert torch.equal(out[0, :7], free[0, :7]) and bool((out[0, 7:] == eos).all())
    row1 = free[1, 5:].tolist()
    stop = row1.index(eos) if eos in row1 else len(row1)
    assert out[1, 5:5 + stop + 1].tolist()[: stop] == row1[:stop]


@pytest.mark.parametrize(("family", "layer"), [("mistral", 0), ("gemma2", 0), ("gpt_neo", 1)])
@torch.no_grad()
def test_a_cached_step_past_a_sliding_window_shows_every_key(family, layer):
    """Past its window (12 keys) a sliding-window layer's cache holds the last 12 keys only (GPT-Neo's local layer
    keeps them all and hides the earlier ones itself); a cached step's scores and pattern still span every key, as the
    full sequence's last row does: the keys before the window -inf and 0 (exactly), the window's entries equal to the
    full forward's (float32 rounding, 1e-5), and the tokens those of recomputing the whole sequence, with and without
    a reader of the pattern."""
    hm = HookedModel(build(family))
    ids = token_batch(1, 10, seed=1)
    plain = hm.generate(ids, max_new_tokens=8, do_sample=False, stop_at_eos=False, use_past_kv_cache=False)
    steps, scores = [], []
    hm.add_hook(f"blocks.{layer}.attn.hook_pattern", lambda p, hook: steps.append(p.clone()))
    hm.add_hook(f"blocks.{layer}.attn.hook_attn_scores", lambda s, hook: scores.append(s.clone()))
    out = hm.generate(ids, max_new_tokens=8, do_sample=False, stop_at_eos=False)
    hm.reset_hooks()
    assert torch.equal(out, plain)
    assert torch.equal(hm.generate(ids, max_new_tokens=8, do_sample=False, stop_at_eos=False), plain)
    _, cache = hm.run_with_cache(out[:, :-1], names_filter=lambda n: n.startswith(f"blocks.{layer}.attn.hook_"))
    full = cache["pattern", layer][0, :, -1]  # [H, 17]: the last query's row
    assert steps[-1].shape[-1] == 17 and scores[-1].shape[-1] == 17
    torch.testing.assert_close(steps[-1][0, :, 0], full, rtol=0, atol=1e-5)
    assert torch.equal(steps[-1][0, :, 0, :5], torch.zeros_like(full[:, :5]))
    assert torch.all(scores[-1][0, :, 0, :5] == -math.inf)
    window = cache["attn_scores", layer][0, :, -1, 5:]
    torch.testing.assert_close(scores[-1][0, :, 0, 5:], window, rtol=0, atol=1e-5 * float(window.abs().max()))
