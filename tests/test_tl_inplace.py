"""In-place edits at hook points take effect as in TransformerLens, and a read-only hook changes nothing.

TransformerLens's ablation idiom edits the value it is handed (`pattern[:, h] = 0`, `scores.mul_(2)`), returning it
or not; the same edit on a returned clone must move the logits identically (the same arithmetic, so bit-identical),
at every writable point of every family (that a reader at every point leaves the logits bit-identical is
tests/test_hooks.py's). Masked-entry writes (-inf * 0 = NaN on the scores) give TransformerLens's
zero pattern entries, and left padding offsets rotary positions in the TransformerLens surface only."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ALL_FAMILIES, build, randomize_norm_gains, token_batch

from poslens.engine.hooks import HookedModel


def _edit(x: torch.Tensor) -> None:
    """An in-place edit that changes any point's value (first position and head / row left alone so the early
    positions of the sequence still differ from later ones)."""
    x.mul_(1.5)


def _routed_edit(point: str, x: torch.Tensor) -> None:
    """`_edit`, and at a mixture of experts' router: the chosen experts' slots swapped (each token's weights go to the
    other expert) and the router's probabilities squared (scaled alone, renormalised top-k weights would not move)."""
    if not x.is_floating_point():
        x.copy_(x.flip(-1))
    elif point.endswith("hook_expert_weights"):
        x.pow_(2)
    else:
        _edit(x)


# the families whose points are reached by different code: Qwen3 (the Llama path, plus q/k norms that are views),
# Phi-3 (fused q/k/v and gate/up projections), Gemma-2 (eager attention, softcap), Gemma-3 (sandwich norms, q/k norms
# on a heads-first layout whose TransformerLens view is a copy); Llama, Qwen2, Mistral and SmolLM3 run Qwen3's code
@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma2", "gemma3"])
@torch.no_grad()
def test_in_place_edits_at_every_point_act_as_a_returned_clone(family):
    model = randomize_norm_gains(build(family))
    hm = HookedModel(model)
    ids = token_batch(2, 9, seed=3)
    plain = model(input_ids=ids, use_cache=False).logits
    # every kind of point: those of the middle layer (each layer's are alike) and the model-wide ones; the LM head's
    # output has nothing downstream but the returned logits
    points = [p for p in hm.points if p.startswith("blocks.1.") or not p.startswith(("blocks.", "unembed.hook_out"))]
    for point in points:

        def in_place(x, ctx):
            _edit(x)

        def in_place_returned(x, ctx):
            _edit(x)
            return x

        def clone(x, ctx):
            y = x.clone()
            _edit(y)
            return y

        edit = in_place if "attn" not in point else in_place_returned  # both forms, on different points
        runs = [hm.run(ids, hooks={point: fn}, logits=True).logits for fn in (clone, edit)]
        assert not torch.equal(runs[0], plain), f"{point}: the edit does not change the logits"
        assert torch.equal(runs[1], runs[0]), f"{point}: an in-place edit differs from a returned clone"


@torch.no_grad()
def test_transformer_lens_ablation_idioms_take_effect():
    """pattern[:, h] = 0 and scores.mul_(2) (TransformerLens's own hook functions, fn(value, hook)) change the logits
    exactly as the same edit on a clone; a head's pattern set to 0 leaves that head's hook_z exactly 0."""
    model = build("llama")
    hm = HookedModel(model)
    ids = token_batch(1, 12, seed=4)
    plain = hm.run_with_hooks(ids)

    def zero_head(pattern, hook):
        pattern[:, 1] = 0

    def zero_head_clone(pattern, hook):
        pattern = pattern.clone()
        pattern[:, 1] = 0
        return pattern

    name = "blocks.1.attn.hook_pattern"
    a = hm.run_with_hooks(ids, fwd_hooks=[(name, zero_head)])
    b = hm.run_with_hooks(ids, fwd_hooks=[(name, zero_head_clone)])
    assert torch.equal(a, b) and (a - plain).abs().max() > 1e-3
    z = {}
    hm.run_with_hooks(ids, fwd_hooks=[(name, zero_head), ("blocks.1.attn.hook_z", lambda x, hook: z.setdefault(0, x))],
                      return_type=None)
    assert torch.equal(z[0][:, :, 1], torch.zeros_like(z[0][:, :, 1])) and z[0][:, :, 0].abs().max() > 0
    doubled = hm.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_attn_scores", lambda s, hook: s.mul_(2))])
    cloned = hm.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_attn_scores", lambda s, hook: s * 2)])
    assert torch.equal(doubled, cloned) and (doubled - plain).abs().max() > 1e-3


@torch.no_grad()
def test_zeroing_masked_scores_gives_transformer_lens_zero_pattern_not_nan():
    """scores * 0 makes the masked entries -inf * 0 = NaN: TransformerLens zeroes the NaN pattern entries, so each row
    with a masked key contributes nothing and the last row (no masked key) attends uniformly."""
    model = build("llama")
    hm = HookedModel(model)
    ids = token_batch(1, 8, seed=6)
    name = "blocks.0.attn.hook_attn_scores"
    pattern = {}

    def zero_head0(s, hook):
        s[:, 0] = s[:, 0] * 0

    logits = hm.run_with_hooks(ids, fwd_hooks=[(name, zero_head0), ("blocks.0.attn.hook_pattern",
                                                                    lambda p, hook: pattern.setdefault(0, p.clone()))])
    assert torch.isfinite(logits).all()
    p = pattern[0][0, 0]  # head 0 [T, T]
    assert torch.equal(p[:-1], torch.zeros_like(p[:-1]))
    assert torch.allclose(p[-1], torch.full_like(p[-1], 1 / 8))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@torch.no_grad()
def test_left_padding_offsets_positions_in_the_transformer_lens_surface_only(family):
    """TransformerLens rotates a left-padded row as if it had no padding: its real tokens' rot_q and logits equal
    those of the row alone (float32 rounding: same operations on another batch shape, 1e-5 of the largest value).
    `run` stays a plain Hugging Face forward with the mask: bit-identical to model(ids, attention_mask=mask)."""
    model = build(family)
    hm = HookedModel(model)
    row = token_batch(1, 7, seed=7)
    pad = 3
    ids = torch.cat([torch.zeros(1, pad, dtype=torch.long), row], 1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], 1)
    name = "blocks.1.attn.hook_rot_q"
    alone_logits, alone = hm.run_with_cache(row, [name])
    padded_logits, padded = hm.run_with_cache(ids, [name], attention_mask=mask)
    for got, ref in ((padded[name][:, pad:], alone[name]), (padded_logits[:, pad:], alone_logits)):
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.allclose(hm(ids, attention_mask=mask)[:, pad:], alone_logits, atol=1e-5 * alone_logits.abs().max())
    plain = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    seen = {}
    assert torch.equal(hm.run(ids, mask, hooks={name: lambda x, ctx: seen.setdefault(0, x.clone())},
                              logits=True).logits, plain)
    # without the offset the padded row is rotated by 3 more positions (RoPE's scores, and so the logits, depend
    # only on relative positions: they agree either way)
    assert (seen[0][:, pad:] - alone[name]).abs().max() > 0.1 * alone[name].abs().max()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_in_place_edits_with_gradients_on_act_as_a_returned_clone(family):
    """TransformerLens code runs `run_with_hooks` with autograd on (torch's default) and edits values in place: at
    every point of every family the edit works there too (no autograd error: the q/k/v of a fused projection are
    views a hook may edit) and moves the logits as the same edit on a returned clone, bit for bit."""
    model = randomize_norm_gains(build(family))
    hm = HookedModel(model)
    ids = token_batch(2, 9, seed=3)
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
    points = [p for p in hm.points if p.startswith("blocks.1.") or not p.startswith(("blocks.", "unembed.hook_out"))]
    assert any(p.endswith("attn.hook_q") for p in points)
    for point in points:
        def in_place(x, hook, point=point):
            _routed_edit(point, x)

        def clone(x, hook, point=point):
            y = x.clone()
            _routed_edit(point, y)
            return y

        runs = [hm.run_with_hooks(ids, fwd_hooks=[(point, fn)]).detach() for fn in (clone, in_place)]
        assert not torch.equal(runs[0], plain), f"{point}: the edit does not change the logits"
        assert torch.equal(runs[1], runs[0]), f"{point}: an in-place edit differs from a returned clone"


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_in_place_ablation_of_pattern_and_z_keeps_the_backward_pass(family):
    """TransformerLens's ablation idiom with a loss and its gradient: `pattern[:, 1] = 0` or `z[:, :, 1] = 0` in
    place, then `.backward()`. The softmax and SDPA keep their outputs for the backward pass, so the hooks get a copy
    under autograd; the gradients equal those of the same edit on a returned clone, bit for bit (the same
    arithmetic), on every family."""
    model = build(family)
    hm = HookedModel(model)
    ids = token_batch(1, 7, seed=5)
    for point, index in (("blocks.1.attn.hook_pattern", (slice(None), 1)),
                         ("blocks.1.attn.hook_z", (slice(None), slice(None), 1))):
        def in_place(x, hook, index=index):
            x[index] = 0

        def clone(x, hook, index=index):
            y = x.clone()
            y[index] = 0
            return y

        grads = []
        for fn in (clone, in_place):
            model.zero_grad()
            hm.run_with_hooks(ids, return_type="loss", fwd_hooks=[(point, fn)]).backward()
            grads.append(model.get_input_embeddings().weight.grad.clone())
        assert grads[0].abs().max() > 0, point
        assert torch.equal(grads[1], grads[0]), f"{point}: the in-place edit's gradient differs from a clone's"


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_inference_mode_reads_and_edits_as_no_grad(family):
    """Under `torch.inference_mode()` (whose tensors count no writes, so a hook's in-place edit cannot be seen and
    every hooked value counts as written) `run_with_cache` gives the values of a `no_grad` run to float32 rounding
    (1e-5 of each value's largest magnitude: a norm's output recomputed from its hooked parts instead of the module's,
    the same arithmetic in another order), and an in-place edit of the pattern equals a returned clone's, bit for
    bit."""
    model = build(family)
    hm = HookedModel(model)
    ids = token_batch(1, 7, seed=6)
    with torch.no_grad():
        logits, cache = hm.run_with_cache(ids)
    with torch.inference_mode():
        got_logits, got = hm.run_with_cache(ids)
        point = "blocks.1.attn.hook_pattern"
        edited = [hm.run_with_hooks(ids, fwd_hooks=[(point, fn)]) for fn in (
            lambda x, hook: x.mul_(0.5), lambda x, hook: x.clone().mul_(0.5))]
    for name in cache.keys():
        if cache[name].numel() == 0:  # an expert no token chose: [0, M] in both
            assert got[name].shape == cache[name].shape, name
            continue
        ref, seen = cache[name], torch.isfinite(cache[name])  # the scores' hidden entries: -inf in both
        assert torch.equal(torch.isfinite(got[name]), seen) and torch.equal(got[name][~seen], ref[~seen]), name
        assert (got[name] - ref)[seen].abs().max() <= 1e-5 * ref[seen].abs().max().clamp_min(1e-30), name
    assert (got_logits - logits).abs().max() <= 1e-5 * logits.abs().max()
    assert torch.equal(edited[0], edited[1]) and not torch.equal(edited[0], got_logits)


@pytest.mark.parametrize("family", ["gpt2", "opt", "bloom", "gpt_neox", "gptj", "phi", "falcon", "falcon_rw",
                                    "gpt_neo", "mpt", "gpt_bigcode"])
def test_layer_norm_scale_and_normalized_get_their_gradients(family):
    """A LayerNorm's hook_scale and hook_normalized are in the graph under autograd, as in TransformerLens:
    `incl_bwd` caches both gradients, and they satisfy normalized = (x - mean) / scale's chain rule,
    dL/dscale = -sum_i dL/dnormalized_i * normalized_i / scale (float32: 1e-5 of the largest term)."""
    hm = HookedModel(build(family))
    names = ["blocks.1.ln1.hook_scale", "blocks.1.ln1.hook_normalized"]
    _, cache = hm.run_with_cache(token_batch(1, 7, seed=8), names, return_type="loss", incl_bwd=True)
    scale, normalized = cache[names[0]], cache[names[1]]
    g_scale, g_norm = cache[names[0] + "_grad"], cache[names[1] + "_grad"]
    expected = -(g_norm * normalized).sum(-1, keepdim=True) / scale
    assert g_norm.abs().max() > 0
    assert (g_scale - expected).abs().max() <= 1e-5 * (g_norm * normalized).abs().sum(-1).max() / scale.min()
