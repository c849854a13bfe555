"""TransformerLens's per-head attention inputs (hook_attn_in, hook_q_input, hook_k_input, hook_v_input) on tiny models
of the families whose projections differ (separate q/k/v, q/k/v biases, Phi-3's fused qkv_proj, Gemma-3's sandwich
norms and q/k norms). Their agreement with TransformerLens 3.9 on SmolLM2-135M is tests/test_tl_demo.py's.

Tolerances: where a written copy equals the shared input, the per-head projection (an einsum over each head's rows
of W) and the model's own linear layer are the same products summed in a possibly different order: 1e-5 of the
largest |value| (float32 rounding through 3 layers; a head's rows misread moves them by tens of percents)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build, token_batch

from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError

FAMILIES = ["llama", "qwen2", "phi3", "gemma3"]


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert (a - b).abs().max() <= 1e-5 * b.abs().max(), f"{what}: {(a - b).abs().max():.3g}"


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_inputs_are_per_head_copies_of_resid_pre_and_reading_them_changes_nothing(family):
    model = build(family)
    hm = HookedModel(model)
    ids = token_batch(2, 9, seed=5)
    plain = model(input_ids=ids, use_cache=False).logits
    names = ["blocks.1.hook_resid_pre", "blocks.1.hook_q_input", "blocks.1.hook_k_input", "blocks.1.hook_v_input"]
    logits, cache = hm.run_with_cache(ids, names)
    assert torch.equal(logits, plain)  # read only: the model's own projections ran
    h, k = model.config.num_attention_heads, model.config.num_key_value_heads
    resid = cache["blocks.1.hook_resid_pre"]
    for name, heads in zip(names[1:], (h, k, k)):
        assert cache[name].shape == (2, 9, heads, model.config.hidden_size)
        assert torch.equal(cache[name], resid[:, :, None].expand(-1, -1, heads, -1))


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_a_write_to_one_heads_copy_changes_only_that_heads_projection(family):
    """Adding a vector to key head 1's copy changes hook_k's head 1 (to the projection of the edited copy through
    ln1) and leaves head 0's equal to the unedited run's; a write at q_input, v_input likewise moves the logits."""
    model = build(family)
    hm = HookedModel(model)
    ids = token_batch(1, 10, seed=6)
    shift = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    before, after = {}, {}

    def edit(x, ctx):
        x[:, :, 1] += shift

    hm.run(ids, hooks={"blocks.1.attn.hook_k": lambda x, ctx: before.setdefault(0, x.clone())})
    hm.run(ids, hooks={"blocks.1.hook_k_input": edit, "blocks.1.attn.hook_k": lambda x, ctx: after.setdefault(0, x)})
    _close(after[0][:, :, 0], before[0][:, :, 0], "the other head")
    assert (after[0][:, :, 1] - before[0][:, :, 1]).abs().max() > 0.1 * before[0].abs().max()
    plain = hm.run(ids, logits=True).logits
    for point in ("hook_q_input", "hook_v_input"):
        moved = hm.run(ids, hooks={f"blocks.1.{point}": edit}, logits=True).logits
        assert (moved - plain).abs().max() > 1e-3, point


@torch.no_grad()
def test_a_copy_written_back_unchanged_reproduces_the_forward():
    """Every copy replaced by a clone (so the per-head projections run): the logits equal a plain forward to
    float32 rounding, at every layer at once."""
    model = build("qwen2")
    hm = HookedModel(model)
    ids = token_batch(2, 8, seed=7)
    plain = model(input_ids=ids, use_cache=False).logits
    hooks = {f"blocks.{l}.{p}": (lambda x, ctx: x.clone()) for l in range(hm.n_layers)
             for p in ("hook_q_input", "hook_k_input", "hook_v_input")}
    _close(hm.run(ids, hooks=hooks, logits=True).logits, plain, "logits")


@torch.no_grad()
def test_attn_in_feeds_q_k_and_v_without_grouped_query_attention():
    """Without GQA (K = H) hook_attn_in exists: a write there equals the same write at all three split inputs; with
    any split input hooked the split inputs win and attn_in's write has no effect (TransformerLens's order)."""
    model = build("llama", num_key_value_heads=4)
    hm = HookedModel(model)
    ids = token_batch(1, 9, seed=8)
    shift = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))

    def edit(x, ctx):
        x[:, :, 2] += shift

    by_attn_in = hm.run(ids, hooks={"blocks.0.hook_attn_in": edit}, logits=True).logits
    by_split = hm.run(ids, hooks={f"blocks.0.hook_{p}_input": edit for p in "qkv"}, logits=True).logits
    plain = hm.run(ids, logits=True).logits
    assert torch.equal(by_attn_in, by_split) and (by_attn_in - plain).abs().max() > 1e-3
    overridden = hm.run(ids, hooks={"blocks.0.hook_attn_in": edit, "blocks.0.hook_q_input": lambda x, ctx: None},
                        logits=True).logits
    assert torch.equal(overridden, plain)
    assert "blocks.0.hook_attn_in" not in hm.run_with_cache(ids)[1]  # optional: not in the default cache
    hm.set_use_attn_in(True)
    assert hm.run_with_cache(ids)[1]["blocks.0.hook_attn_in"].shape == (1, 9, 4, model.config.hidden_size)


def test_attn_in_is_refused_with_grouped_query_attention():
    hm = HookedModel(build("llama"))  # 4 query heads, 2 key/value heads
    with pytest.raises(UsageError, match="grouped-query attention.*hook_q_input"):
        hm.set_use_attn_in(True)
    with pytest.raises(UsageError, match="grouped-query attention.*hook_q_input"):
        hm.run_with_hooks(token_batch(1, 4, seed=0), fwd_hooks=[("blocks.0.hook_attn_in", lambda x, hook: None)])
    hm.set_use_split_qkv_input(True)
    assert "blocks.0.hook_k_input" in hm.tl_points and "blocks.0.hook_attn_in" not in hm.points


@torch.no_grad()
def test_in_place_edit_at_attn_in_acts_as_a_returned_clone():
    """tests/test_tl_inplace.py covers every point of its (grouped-query) families; attn_in exists only without GQA."""
    model = build("llama", num_key_value_heads=4)
    hm = HookedModel(model)
    ids = token_batch(2, 7, seed=9)

    def in_place(x, ctx):
        x[:, :, 1] += 1.0

    def clone(x, ctx):
        y = x.clone()
        y[:, :, 1] += 1.0
        return y

    a, b = (hm.run(ids, hooks={"blocks.1.hook_attn_in": fn}, logits=True).logits for fn in (in_place, clone))
    assert torch.equal(a, b) and (a - hm.run(ids, logits=True).logits).abs().max() > 1e-3
