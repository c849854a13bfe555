"""More TransformerLens idioms on HookedModel, each as TransformerLens documents it or checked against the Hugging Face
model itself: remove_batch_dim on every family, left padding of token input, hooks kept past run_with_hooks and
hooks(), hook functions that take `hook=` by keyword, greedy temperature 0, per-family default_prepend_bos, the fused
q/k/v weights as views, ln_final and hook_embed on the model, BLOOM's act_fn and embed, ActivationCache(cache, model).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from tiny_models import ALL_FAMILIES, build, randomize_norm_gains, token_batch

from poslens.engine.activation_cache import ActivationCache
from poslens.engine.families import attention_module
from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError

PAD, BOS = 0, 1


def _tokenizer(pad=PAD, bos=BOS, side="right"):
    """What the TransformerLens surface reads of a tokenizer for token input: its pad, BOS and EOS ids, padding side."""
    return SimpleNamespace(pad_token_id=pad, bos_token_id=bos, eos_token_id=2, bos_token=None, padding_side=side,
                           encode=lambda text: [])


# ---- remove_batch_dim ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ALL_FAMILIES)
@torch.no_grad()
def test_remove_batch_dim_takes_row_zero_of_every_value(family):
    """TransformerLens caches value[0] of every point for a batch of one; a q/k norm's flattened [T*heads, .] value
    and a mixture of experts' router and expert values ([T, E], [n_e, M]: no batch dimension of their own) stay whole.
    A batch of two is refused in one line."""
    hm = HookedModel(build(family))
    ids = token_batch(1, 6)
    _, full = hm.run_with_cache(ids)
    _, flat = hm.run_with_cache(ids, remove_batch_dim=True)
    assert list(flat) == list(full)
    for name, value in full.items():
        qk_flat = (".q_norm." in name or ".k_norm." in name) and value.dim() == 2
        routed = ".mlp.experts." in name or ".mlp.hook_expert_" in name
        assert torch.equal(flat[name], value if qk_flat or routed else value[0]), name
    assert all(torch.equal(a, b) for a, b in zip(full.remove_batch_dim().values(), flat.values()))
    with pytest.raises(UsageError, match="batch of 1, got 2"):
        hm.run_with_cache(token_batch(2, 6), remove_batch_dim=True)


# ---- left padding of token input -------------------------------------------------------------------------------------

def _left_padded(ids: torch.Tensor, pads: list[int], pad_id: int) -> torch.Tensor:
    """Rows of ids [B, T] with pads[i] leading pad tokens (the last columns dropped to keep the width)."""
    rows = [torch.cat([torch.full((p,), pad_id), row[: ids.shape[1] - p]]) for row, p in zip(ids, pads)]
    return torch.stack(rows)


# Left padding changes the shapes the attention reduces over (the padded keys are hidden, their softmax weights exactly
# 0, but the matmuls and softmax see longer rows, so they sum in another order): the real tokens' logits agree with the
# unpadded run's to float32 rounding, 1e-5 relative, not bit for bit.
def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("family", ["llama", "gpt2", "bloom"])
@pytest.mark.parametrize("bos_is_pad", [False, True])
@torch.no_grad()
def test_left_padded_tokens_get_the_mask_of_their_leading_pads(family, bos_is_pad):
    """TransformerLens (utils.get_attention_mask): token ids on the left padding side (the argument, or the tokenizer's
    padding_side) hide each row's leading pad tokens; when the pad id is the BOS id, the last of them is the row's
    BOS and stays seen. Each row's logits at its real tokens then equal the row run alone."""
    pad = BOS if bos_is_pad else PAD
    hm = HookedModel(build(family), _tokenizer(pad=pad))
    ids = token_batch(3, 8, seed=5).clamp(min=3)  # no pad, BOS or EOS inside the texts
    ids[:, 0] = BOS
    pads = [3, 0, 1]
    tokens = _left_padded(ids, pads, pad)
    bos = {"prepend_bos": True}  # the rows start with a BOS (BLOOM's default_prepend_bos is False)
    runs = {"forward": hm(tokens, padding_side="left", **bos),
            "run_with_hooks": hm.run_with_hooks(tokens, padding_side="left", **bos),
            "run_with_cache": hm.run_with_cache(tokens, padding_side="left", **bos)[0]}
    hm.tokenizer.padding_side = "left"  # TransformerLens's default padding side: the tokenizer's
    runs["tokenizer.padding_side"] = hm(tokens, **bos)
    for i, p in enumerate(pads):
        alone = hm.model(input_ids=ids[i: i + 1, : ids.shape[1] - p], use_cache=False).logits[0]
        for logits in runs.values():
            _close(logits[i, p:], alone)


@torch.no_grad()
def test_the_tokenizer_padding_side_is_to_tokens_default():
    """TransformerLens pads on the tokenizer's padding_side unless padding_side= is given."""
    from poslens.engine.models import load_model

    _, tok = load_model("smollm2-135m")
    tok = copy.deepcopy(tok)
    hm = HookedModel(build("llama", vocab_size=49152, pad_token_id=2, bos_token_id=1, eos_token_id=2), tok)
    right = hm.to_tokens(["Hi", "The capital of France is"])
    tok.padding_side = "left"
    left = hm.to_tokens(["Hi", "The capital of France is"])
    n = int((right[0] != tok.pad_token_id).sum())
    assert torch.equal(left[0, -n:], right[0, :n]) and bool((left[0, :-n] == tok.pad_token_id).all())
    assert torch.equal(hm.to_tokens(["Hi", "The capital"], padding_side="right")[0, :n], right[0, :n])


# ---- hooks that stay -------------------------------------------------------------------------------------------------

@torch.no_grad()
def test_run_with_hooks_reset_hooks_end_false_keeps_the_hooks():
    """TransformerLens: with reset_hooks_end=False the hooks stay on the model until reset_hooks()."""
    hm = HookedModel(build("llama"))
    ids = token_batch(1, 6)
    calls = []
    hm.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: calls.append(hook.name))],
                      reset_hooks_end=False)
    hm(ids)
    assert calls == ["blocks.0.hook_resid_pre"] * 2
    with hm.hooks(fwd_hooks=[("blocks.1.hook_resid_pre", lambda x, hook: calls.append(hook.name))],
                  reset_hooks_end=False):
        pass
    calls.clear()
    hm(ids)
    assert calls == ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre"]
    hm.reset_hooks()
    calls.clear()
    hm(ids)
    hm.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: calls.append(hook.name))])
    hm(ids)
    assert calls == ["blocks.0.hook_resid_pre"]


@torch.no_grad()
def test_hooks_context_removes_only_its_own_hooks():
    """TransformerLens's hooks() context removes the hooks it added; add_hook inside it adds hooks that stay."""
    hm = HookedModel(build("llama"))
    ids = token_batch(1, 6)
    calls = []
    with hm.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: calls.append("context"))]):
        hm.add_hook("blocks.1.hook_resid_pre", lambda x, hook: calls.append("added"))
        hm.add_hook("blocks.2.hook_resid_pre", lambda x, hook: calls.append("permanent"), is_permanent=True)
        hm(ids)
    assert calls == ["context", "added", "permanent"]
    calls.clear()
    hm(ids)
    assert calls == ["added", "permanent"]


# ---- how hook functions are called -----------------------------------------------------------------------------------

@torch.no_grad()
def test_hook_functions_get_hook_by_keyword_as_transformer_lens_calls_them():
    """TransformerLens calls fn(value, hook=point): a keyword-only `hook` and **kwargs work, as do poslens's
    positional functions with other names; all three scale the stream alike."""
    hm = HookedModel(build("llama"))
    ids = token_batch(1, 6)
    seen = []

    def keyword_only(x, *, hook):
        seen.append(hook.name)
        return x * 0.5

    def via_kwargs(x, **kwargs):
        seen.append(kwargs["hook"].name)
        return x * 0.5

    def positional(x, ctx):
        seen.append(ctx.name)
        return x * 0.5

    name = "blocks.0.hook_resid_pre"
    out = [hm.run_with_hooks(ids, fwd_hooks=[(name, fn)]) for fn in (keyword_only, via_kwargs, positional)]
    assert seen == [name] * 3
    assert not torch.equal(out[0], hm(ids)) and torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])
    with torch.enable_grad():
        grads = []
        hm.run_with_hooks(ids, bwd_hooks=[(name, lambda g, *, hook: grads.append(hook.name))]).sum().backward()
    assert grads == [name]


@torch.no_grad()
def test_temperature_zero_is_greedy():
    """TransformerLens: temperature 0 samples greedily."""
    hm = HookedModel(build("llama"))
    ids = token_batch(1, 6)
    greedy = hm.generate(ids, max_new_tokens=5, do_sample=False, stop_at_eos=False, verbose=False)
    assert torch.equal(hm.generate(ids, max_new_tokens=5, temperature=0.0, stop_at_eos=False, verbose=False), greedy)
    with pytest.raises(UsageError, match="temperature"):
        hm.generate(ids, max_new_tokens=1, temperature=-1.0, stop_at_eos=False, verbose=False)


# ---- configuration and weights ---------------------------------------------------------------------------------------

def test_default_prepend_bos_follows_transformer_lens_per_family():
    """TransformerLens's loading_from_pretrained sets default_prepend_bos=False for GPT-NeoX, BLOOM, Qwen2, Qwen3 and
    Phi; True (its default) for the others."""
    for family in ALL_FAMILIES:
        expected = family not in ("gpt_neox", "bloom", "qwen2", "qwen3", "phi")
        assert HookedModel(build(family)).cfg.default_prepend_bos is expected, family


def _head_rows(fused: torch.Tensor, heads: int, head: int, which: int):
    """The rows of one head's q, k or v in a fused projection with [q | k | v] within each head."""
    return fused.unflatten(0, (heads, 3, -1))[head, which]


@pytest.mark.parametrize("family", ["gpt_neox", "bloom", "falcon_rw"])
@torch.no_grad()
def test_fused_qkv_weights_are_views_whose_edits_reach_the_model(family):
    """blocks[l].attn.W_Q, W_V, b_Q are views of the fused parameter: editing them in place moves the logits exactly
    as editing the Hugging Face parameter's rows of that head does."""
    model = build(family)
    twin = copy.deepcopy(model)
    hm = HookedModel(model)
    ids = token_batch(2, 7)
    heads = model.config.num_attention_heads
    before = model(input_ids=ids, use_cache=False).logits
    attn = hm.blocks[1].attn
    attn.W_Q[2] = 0
    attn.W_V[1].mul_(2)
    attn.b_Q[2].fill_(0.5)
    fused = hm.attns[1].query_key_value
    tw = attention_module(twin, 1)
    _head_rows(tw.query_key_value.weight, heads, 2, 0).zero_()
    _head_rows(tw.query_key_value.weight, heads, 1, 2).mul_(2)
    _head_rows(tw.query_key_value.bias, heads, 2, 0).fill_(0.5)
    assert torch.equal(fused.weight, tw.query_key_value.weight) and torch.equal(fused.bias, tw.query_key_value.bias)
    after = hm(ids)
    assert not torch.equal(after, before)
    assert torch.equal(after, twin(input_ids=ids, use_cache=False).logits)
    assert torch.equal(attn.W_Q, hm.W_Q[1]) and bool((hm.blocks[1].attn.W_Q[2] == 0).all())


# ---- surface ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
@torch.no_grad()
def test_ln_final_and_hook_embed_on_the_model(family):
    """model.ln_final has blocks' ln surface (w, b, hook points); model.hook_embed and GPT-2's hook_pos_embed are
    hook points like blocks' ones."""
    hm = HookedModel(randomize_norm_gains(build(family)))
    ids = token_batch(1, 5)
    final = hm.norm_module("ln_final")
    gain = 1 + final.weight if family == "gemma2" else final.weight
    assert torch.equal(hm.ln_final.w, gain)
    if family == "gpt2":
        assert hm.ln_final.b is final.bias
    last = f"blocks.{hm.n_layers - 1}.hook_resid_post"
    _, cache = hm.run_with_cache(ids, names_filter=["ln_final.hook_normalized", last])
    torch.testing.assert_close(hm.ln_final(cache["resid_post", -1]),
                               hm.model(input_ids=ids, output_hidden_states=True).hidden_states[-1], rtol=0, atol=0)
    seen = {}
    points = [hm.hook_embed, hm.ln_final.hook_normalized] + ([hm.hook_pos_embed] if family == "gpt2" else [])
    for point in points:
        point.add_hook(lambda x, hook: seen.__setitem__(hook.name, x.clone()))
    hm(ids)
    hm.reset_hooks()
    assert set(seen) == {p.name for p in points}
    assert torch.equal(seen["ln_final.hook_normalized"], cache["ln_final.hook_normalized"])
    assert torch.equal(seen["hook_embed"], hm.embed(ids))


@torch.no_grad()
def test_bloom_act_fn_and_embed():
    """BLOOM: TransformerLens's act_fn "gelu_fast" (the tanh GELU BLOOM's MLP computes) and embed(tokens) with the
    embedding LayerNorm TransformerLens's Embed applies, the value at hook_embed."""
    hm = HookedModel(build("bloom"))
    assert hm.cfg.act_fn == "gelu_fast"
    x = torch.linspace(-4, 4, 101)
    gelu_fast = 0.5 * x * (1 + torch.tanh(0.7978845608 * x * (1 + 0.044715 * x * x)))
    torch.testing.assert_close(hm.layers[0].mlp.gelu_impl(x), gelu_fast)
    ids = token_batch(2, 5)
    _, cache = hm.run_with_cache(ids, names_filter="hook_embed")
    assert torch.equal(hm.embed(ids), cache["hook_embed"])


@torch.no_grad()
def test_activation_cache_built_as_transformer_lens_builds_it():
    """TransformerLens's ActivationCache(cache_dict, model, has_batch_dim=True): indexing and analysis work."""
    hm = HookedModel(build("llama"))
    _, cache = hm.run_with_cache(token_batch(1, 5))
    mine = ActivationCache(dict(cache.items()), hm)
    assert mine.n_layers == hm.n_layers and mine.model is hm
    assert torch.equal(mine["pattern", -1], cache["pattern", -1])
    assert torch.equal(mine.accumulated_resid(apply_ln=True), cache.accumulated_resid(apply_ln=True))
    assert torch.equal(ActivationCache(dict(cache.items()), hm, has_batch_dim=True).remove_batch_dim()["k0"],
                       cache["k0"][0])
    with pytest.raises(UsageError, match="second argument"):
        ActivationCache(dict(cache.items()), "llama")
