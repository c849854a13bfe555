"""OLMo (1) (allenai/OLMo-1B-hf, OLMo-7B-hf): Llama's block with LayerNorms that have no weight and no bias
(OlmoLayerNorm, eps 1e-5). TransformerLens 3.9's names and values are tests/test_family_tl.py's (the OLMo entry of
tests/reference/tl39_families.json), the float64 recomputation of every point tests/test_hooks.py's; here what the
parameter-free norm changes: the TransformerLens weights and config, the stack through the final norm, and the
clip_qkv form's clamp."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build, heads_summed_twin, token_batch

from poslens.engine.hooks import HookedModel


@torch.no_grad()
def test_the_norms_are_transformer_lens_layer_norms_with_unit_gain_and_zero_bias():
    """hm.cfg says LN with eps 1e-5 (TransformerLens's OLMo entries); every norm's w is ones and b zeros (what
    TransformerLens's conversion writes for the parameter-free norm), and the gain apply_ln_to_stack multiplies by."""
    hm = HookedModel(build("olmo"))
    assert hm.cfg.normalization_type == "LN" and hm.cfg.eps == 1e-5 and not hm.cfg.final_rms
    d = hm.cfg.d_model
    for norm in (hm.blocks[0].ln1, hm.blocks[2].ln2, hm.ln_final):
        assert torch.equal(norm.w, torch.ones(d)) and torch.equal(norm.b, torch.zeros(d))
    assert torch.equal(hm.norm_gain("ln_final"), torch.ones(d))


@torch.no_grad()
def test_the_residual_stack_through_the_final_norm_sums_to_its_output():
    """apply_ln_to_stack on decompose_resid's components (embedding, each attention and MLP output): centred, divided
    by the cached scale, they sum to the final norm's output, unembed.hook_in (1e-5 of its largest value: float32
    sums in another order). Not centring, as an RMSNorm's stack is not, misses by far more."""
    hm = HookedModel(build("olmo"))
    _, cache = hm.run_with_cache(token_batch(2, 10, seed=3), hm.points)
    stack = cache.decompose_resid(layer=hm.cfg.n_layers)
    out = cache["unembed.hook_in"]
    got = cache.apply_ln_to_stack(stack).sum(0)
    assert (got - out).abs().max() <= 1e-5 * out.abs().max()
    uncentred = (stack / cache["ln_final.hook_scale"]).sum(0)
    assert (uncentred - out).abs().max() > 1e-2 * out.abs().max()


@torch.no_grad()
def test_clip_qkv_is_run_and_the_points_see_and_replace_the_clamped_projections():
    """OLMo with clip_qkv (OLMo-7B-0424-hf's 8.0: q, k and v clamped in place after their projections). With every
    point read the logits equal the model's bit for bit (its eager twin with W_O's heads summed, as they are read) and
    attn.hook_q holds the clamped values (the clamp bites on this model: its logits move by > 1e-3 without it); a hook
    on one layer alone keeps every other layer's clamp (the model's own clamp is off while the hook engine runs, and
    back after); a write at attn.hook_q takes effect as written, not clamped again: the logits of a model whose q
    projection's output is clamped, then multiplied by 10 (1e-6 of the largest logit: the same operations, in another
    order)."""
    clip = 0.3
    model = build("olmo", clip_qkv=clip)
    ids = token_batch(2, 10, seed=6)
    want = model(input_ids=ids).logits
    unclipped = build("olmo")
    assert (unclipped(input_ids=ids).logits - want).abs().max() > 1e-3 * want.abs().max()
    hm = HookedModel(model)
    logits, cache = hm.run_with_cache(ids, hm.points)  # (the pattern read: eager attention, W_O's heads summed)
    assert torch.equal(logits, heads_summed_twin(model)(input_ids=ids, use_cache=False).logits)  # (no cache: its keys'
    # layout, so the same kernels)
    assert model.config.clip_qkv == clip
    q = cache["blocks.0.attn.hook_q"]
    assert q.abs().max() == pytest.approx(clip) and (q.abs() <= clip).all()
    assert torch.equal(hm.run(ids, hooks={"blocks.2.attn.hook_v": lambda x, ctx: None}, logits=True).logits, want)
    got = hm.run(ids, hooks={"blocks.1.attn.hook_q": lambda x, ctx: x * 10}, logits=True).logits
    for l, layer in enumerate(unclipped.model.layers):
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            times = 10 if (l, name) == (1, "q_proj") else 1
            getattr(attn, name).register_forward_hook(lambda m, a, out, times=times: out.clamp(-clip, clip) * times)
    reference = unclipped(input_ids=ids).logits
    assert (got - reference).abs().max() <= 1e-6 * reference.abs().max()
    assert (got - want).abs().max() > 1e-3 * want.abs().max()
