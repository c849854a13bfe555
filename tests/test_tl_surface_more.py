"""TransformerLens idioms a new user's notebook reaches for first, on HookedModel (tiny random models, no downloads):
the identity of logits with a LayerNorm's bias written out (poslens does not fold it into b_U), from_pretrained's
TransformerLens keywords, hook.ctx, stop_at_layer, run_with_cache under torch's grad mode, the ActivationCache's
stacking methods, and torch.nn.Module's everyday calls. Values are checked against the model's own forward or a
sum TransformerLens's definitions make exact (float32: 1e-5 on a 64-wide model's unit-scale activations)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build, token_batch

from poslens.engine.activation_cache import ActivationCache, NoEquivalent
from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError

TOL = 1e-5


@pytest.fixture(scope="module")
def gpt2():
    model = build("gpt2")
    with torch.no_grad():  # nonzero LayerNorm biases, as a trained GPT-2 has
        gen = torch.Generator().manual_seed(3)
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.bias.copy_(torch.randn(module.bias.shape, generator=gen) * 0.3)
    return HookedModel(model)


@torch.no_grad()
def test_logits_from_the_stream_need_the_final_norm_bias_written_out(gpt2):
    """docs/hooks.md, 'Weights': apply_ln_to_stack(stack).sum(0) @ W_U + ln_final.b @ W_U + b_U is the logits; without
    the bias term (TransformerLens's identity after its folding) it is not, on a model whose bias is not 0."""
    ids = token_batch(2, 12, seed=4)
    logits, cache = gpt2.run_with_cache(ids)
    stack = cache.decompose_resid(layer=-1)
    scaled = cache.apply_ln_to_stack(stack).sum(0)
    full = scaled @ gpt2.W_U + gpt2.ln_final.b @ gpt2.W_U + gpt2.b_U
    assert float((full - logits).abs().max()) < TOL
    assert float((scaled @ gpt2.W_U + gpt2.b_U - logits).abs().max()) > 100 * TOL


def test_from_pretrained_takes_transformer_lens_keywords(tmp_path):
    model = build("gpt2")
    model.save_pretrained(tmp_path)
    ids = token_batch(1, 8, seed=5)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        for hm in (HookedModel.from_pretrained(str(tmp_path), fold_ln=True, center_writing_weights=True,
                                               center_unembed=True, torch_dtype=torch.float32, device="cpu"),
                   HookedModel.from_pretrained_no_processing(str(tmp_path)),
                   HookedModel.from_pretrained("unused", hf_model=model, default_prepend_bos=False)):
            assert torch.allclose(hm(ids), plain, atol=TOL, rtol=0)  # nothing processed: the model's own logits
    assert hm.cfg.default_prepend_bos is False
    with pytest.raises(NoEquivalent) as err:
        HookedModel.from_pretrained(str(tmp_path), n_devices=2)
    assert "n_devices" in str(err.value) and "\n" not in str(err.value)


def test_hook_ctx_lasts_across_calls_until_reset(gpt2):
    def count(x, hook):
        hook.ctx["calls"] = hook.ctx.get("calls", 0) + 1

    ids = token_batch(1, 6, seed=6)
    for _ in range(2):
        gpt2.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_pre", count)], return_type=None)
    seen = []
    gpt2.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: seen.append(dict(hook.ctx)))],
                        return_type=None, clear_contexts=True)
    assert seen == [{"calls": 2}]
    gpt2.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: seen.append(dict(hook.ctx)))],
                        return_type=None)
    assert seen[-1] == {}  # cleared by the call before
    gpt2.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_pre", count)], return_type=None)
    gpt2.reset_hooks()
    gpt2.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: seen.append(dict(hook.ctx)))],
                        return_type=None)
    assert seen[-1] == {}


@torch.no_grad()
def test_stop_at_layer_returns_the_stream_entering_that_block(gpt2):
    ids = token_batch(2, 10, seed=7)
    n = gpt2.n_layers
    for stop, point in ((1, "blocks.1.hook_resid_pre"), (-1, f"blocks.{n - 1}.hook_resid_pre"),
                        (n, f"blocks.{n - 1}.hook_resid_post")):
        _, cache = gpt2.run_with_cache(ids, names_filter=point, return_type=None)
        assert torch.equal(gpt2(ids, stop_at_layer=stop), cache[point])
    with pytest.raises(UsageError):
        gpt2(ids, stop_at_layer=n + 1)
    with pytest.raises(NoEquivalent) as err:
        gpt2(ids, start_at_layer=1)
    assert "hook_resid_pre" in str(err.value)  # names what to use instead


def test_run_with_cache_follows_the_grad_mode(gpt2):
    ids = token_batch(1, 6, seed=8)
    logits, cache = gpt2.run_with_cache(ids)
    assert logits.requires_grad and not cache["blocks.0.hook_resid_pre"].requires_grad
    logits[0, -1, 5].backward()  # TransformerLens's idiom: the output keeps its graph
    with torch.no_grad():
        logits, _ = gpt2.run_with_cache(ids)
    assert not logits.requires_grad


@torch.no_grad()
def test_the_caches_stacking_methods_add_up_to_the_stream():
    hm = HookedModel(build("gpt2"))
    ids = token_batch(2, 9, seed=9)
    _, cache = hm.run_with_cache(ids)
    n = hm.n_layers
    assert torch.equal(cache.stack_activation("pattern"), torch.stack([cache["pattern", l] for l in range(n)]))
    assert cache.stack_activation("resid_pre", 1).shape[0] == 1
    bare = ActivationCache({k: v for k, v in cache.items() if "hook_result" not in k}, hm)
    bare.compute_head_results()
    for l in range(n):
        heads = bare[f"blocks.{l}.attn.hook_result"]  # [B, T, H, d]
        assert float((heads.sum(-2) + hm.b_O[l] - cache[f"blocks.{l}.hook_attn_out"]).abs().max()) < TOL
        neurons = cache.get_neuron_results(l)  # [B, T, d_mlp, d]
        assert float((neurons.sum(-2) + hm.b_out[l] - cache[f"blocks.{l}.hook_mlp_out"]).abs().max()) < TOL
    stack, labels = cache.stack_neuron_results(1, neuron_slice=[0, 3], return_labels=True)
    assert labels == ["L0N0", "L0N3"] and stack.shape[0] == 2
    with pytest.raises(UsageError):
        cache.stack_activation("pattern", n + 1)


def test_module_calls_and_names_tell_tl_attributes_from_typos(gpt2):
    assert gpt2.to("cpu") is gpt2 and gpt2.eval() is gpt2 and gpt2.cpu() is gpt2
    assert len(list(gpt2.parameters())) == len(list(gpt2.model.parameters()))
    assert list(gpt2.hook_dict) == gpt2.points and gpt2.hook_points()[0].name == gpt2.points[0]
    with pytest.raises(NoEquivalent) as err:
        _ = gpt2.pos_embed
    assert "W_pos" in str(err.value)
    with pytest.raises(AttributeError) as err:
        _ = gpt2.run_wtih_cache  # a typo: not TransformerLens's either
    assert not isinstance(err.value, NoEquivalent)
