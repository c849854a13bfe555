"""poslens.engine.hooks on tiny random models of every supported family: readers change nothing, writers change
exactly what they should, attention points match an independent float64 recomputation."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, build, token_batch

from poslens.engine.hooks import HookedModel, from_factors
from poslens.errors import UsageError


def _plain_logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_readers_on_every_point_leave_logits_bit_identical(family):
    model = build(family)
    ids = token_batch(2, 24)
    plain = _plain_logits(model, ids)
    hm = HookedModel(model)
    seen: dict[str, tuple] = {}

    def read(x, ctx):
        seen[ctx.name] = tuple(x.shape)

    out = hm.run(ids, hooks={p: read for p in hm.points}, logits=True)
    assert torch.equal(out.logits, plain)
    assert set(seen) == set(hm.points)  # every point fired
    cfg = model.config
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, model.model.layers[0].self_attn.head_dim
    assert seen["blocks.0.attn.hook_q"] == (2, h, 24, d)
    assert seen["blocks.0.attn.hook_k"] == (2, hkv, 24, d)
    assert seen["blocks.0.attn.hook_attn_scores"] == (2, h, 24, 24)
    assert seen["blocks.0.attn.hook_z"] == (2, 24, h, d)
    assert seen["blocks.1.hook_resid_post"] == (2, 24, cfg.hidden_size)
    # the model is left as it was: a plain forward afterwards is unchanged too
    assert torch.equal(_plain_logits(model, ids), plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_resid_points_equal_the_models_hidden_states(family):
    model = build(family)
    ids = token_batch(2, 16, seed=1)
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    hm = HookedModel(model)
    got = {}
    hooks = {f"blocks.{l}.hook_resid_pre": (lambda x, ctx: got.__setitem__(ctx.layer, x.clone()))
             for l in range(hm.n_layers)}
    hm.run(ids, hooks=hooks)
    for l in range(hm.n_layers):
        assert torch.equal(got[l], hidden[l]), f"layer {l}"


@pytest.mark.parametrize("family", FAMILIES)
def test_pattern_matches_float64_recomputation(family):
    model = build(family)
    ids = token_batch(2, 20, seed=2)
    hm = HookedModel(model)
    got = {}

    def keep(x, ctx):
        got[ctx.name.rsplit(".", 1)[-1]] = x.clone()
        got["ctx"] = ctx

    layer = 1 if hm.n_layers > 1 else 0
    hm.run(ids, hooks={f"blocks.{layer}.attn.hook_attn_scores": keep, f"blocks.{layer}.attn.hook_pattern": keep})
    ctx = got["ctx"]
    q, k = ctx.q.double(), ctx.k.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * ctx.scaling
    if ctx.softcap is not None:
        s = torch.tanh(s / ctx.softcap) * ctx.softcap
    i, j = torch.arange(20)[:, None], torch.arange(20)[None]
    ok = (j <= i) & ((i - j < ctx.window) if ctx.window else True)
    s = s.masked_fill(~ok, float("-inf"))
    torch.testing.assert_close(got["hook_attn_scores"].double(), s, rtol=0, atol=1e-5)
    torch.testing.assert_close(got["hook_pattern"].double(), torch.softmax(s, -1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma3", "smollm3"])
def test_patching_a_layer_leaves_earlier_layers_and_changes_later_ones(family):
    extra = {"gemma3": {"layer_types": ["sliding_attention", "full_attention"] * 2},
             "smollm3": {"no_rope_layers": [1, 0, 1, 1]}}.get(family, {})
    model = build(family, num_hidden_layers=4, **extra)
    ids = token_batch(2, 16, seed=3)
    hm = HookedModel(model)

    def trace(hooks_extra):
        out = {}
        hooks = {f"blocks.{l}.hook_resid_post": (lambda x, ctx: out.__setitem__(ctx.layer, x.clone()))
                 for l in range(4)}
        for name, fn in hooks_extra.items():
            hooks[name] = [fn, hooks[name]] if name in hooks else fn
        hm.run(ids, hooks=hooks)
        return out

    clean = trace({})

    def zero_pos0(x, ctx):  # patch position 0 of the residual stream entering layer 2
        x = x.clone()
        x[:, 0] = 0
        return x

    patched = trace({"blocks.2.hook_resid_pre": zero_pos0})
    for l in (0, 1):
        assert torch.equal(patched[l], clean[l])
    for l in (2, 3):
        assert not torch.allclose(patched[l][:, 0], clean[l][:, 0])


def test_writing_the_pattern_changes_the_output_as_the_pattern_says():
    model = build("llama")
    ids = token_batch(1, 12, seed=4)
    hm = HookedModel(model)
    z = {}

    def uniform(p, ctx):  # uniform attention over the visible keys
        return torch.tril(torch.ones_like(p)) / torch.arange(1, p.shape[-1] + 1, dtype=p.dtype)[:, None]

    hm.run(ids, hooks={"blocks.0.attn.hook_pattern": uniform,
                       "blocks.0.attn.hook_z": lambda x, ctx: z.__setitem__("z", (x.clone(), ctx.v.clone()))})
    out, v = z["z"]
    v = v.repeat_interleave(out.shape[2] // v.shape[1], dim=1)  # [B, H, T, D]
    expected = torch.cumsum(v, dim=2) / torch.arange(1, 13)[:, None]
    torch.testing.assert_close(out.transpose(1, 2), expected, rtol=1e-5, atol=1e-6)


def test_factored_readers_get_q_and_k_and_stop_early():
    model = build("llama", num_hidden_layers=3)
    ids = token_batch(2, 10, seed=5)
    hm = HookedModel(model)
    calls = []

    @from_factors
    def reader(x, ctx):
        calls.append((x, ctx.q.shape, ctx.k.shape))

    later = []
    model.model.layers[1].mlp.register_forward_hook(lambda *a: later.append(1))
    try:
        hm.run(ids, hooks={"blocks.1.attn.hook_attn_scores": reader})
    finally:
        model.model.layers[1].mlp._forward_hooks.clear()
    assert calls and calls[0][0] is None
    assert later == []  # the forward ended inside layer 1's attention


def test_bad_hooks_are_usage_errors():
    model = build("llama")
    hm = HookedModel(model)
    ids = token_batch(1, 8)
    with pytest.raises(UsageError, match="no hook point"):
        hm.run(ids, hooks={"blocks.0.hook_nothing": lambda x, c: None})
    with pytest.raises(UsageError, match="layers"):
        hm.run(ids, hooks={"blocks.99.hook_resid_pre": lambda x, c: None})
    with pytest.raises(UsageError, match="replacement"):
        hm.run(ids, hooks={"blocks.0.hook_resid_pre": lambda x, c: x[:, :1]})
    # the failed run left the model usable
    assert torch.equal(_plain_logits(model, ids), hm.run(ids, logits=True).logits)
