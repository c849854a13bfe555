"""HookedModel's TransformerLens 3.9 model surface on tiny models of every family: cfg, the weight views in
TransformerLens's layouts (each checked by recomputing a hook point's value from it), calling the model, hooks added
to it, generate, tokenization with TransformerLens's BOS rule, backward hooks, and one-line refusals of bad input.

Tolerances: a hook point recomputed from the weight views in float64 against the model's float32 forward agrees
within 2e-5 of the point's largest |value| (float32 rounding over contractions of at most 128 terms); anything in a
wrong layout (heads transposed, K not expanded, gate and up swapped) is off by the value's own size."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, build, randomize_norm_gains, token_batch

from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError


def _close(got: torch.Tensor, ref: torch.Tensor, what: str, tol: float = 2e-5) -> None:
    got, ref = got.double(), ref.double()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < tol, f"{what}: relative deviation {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_cfg_and_weight_views_reproduce_the_hook_points(family):
    model = randomize_norm_gains(build(family))
    if family == "qwen2":  # q/k/v biases: initialised to 0, given values so that a misplaced bias shows
        g = torch.Generator().manual_seed(3)
        for layer in model.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.copy_(torch.randn(p.bias.shape, generator=g))
    hm = HookedModel(model)
    c, mc = hm.cfg, model.config
    assert (c.n_layers, c.d_model, c.n_heads, c.d_head, c.d_vocab, c.d_mlp, c.n_key_value_heads) == \
        (mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads, 16, mc.vocab_size, mc.intermediate_size,
         mc.num_key_value_heads)
    assert c.positional_embedding_type == "rotary" and c.n_ctx == mc.max_position_embeddings
    assert c.rotary_dim == {"phi3": 8, "stablelm": 4}.get(family, 16)  # partial rotary: half, a quarter
    ids = token_batch(2, 9, seed=2)
    logits, cache = hm.run_with_cache(ids, names_filter=lambda n: True)
    fam = hm.family  # what the projections read: the norms' outputs (OLMo-2, post-norm: the residual stream)
    _, own = hm.run_with_cache(ids, [f"blocks.{l}.{p}" for l in range(hm.n_layers)
                                     for p in (fam.attn_input, fam.mlp_input, "attn.hook_out", "mlp.hook_out")])
    n, d, h, k = c.n_layers, c.d_model, c.n_heads, c.n_key_value_heads
    gated = c.gated_mlp  # (Starcoder2: one up projection, W_in, read at mlp.hook_pre)
    W = {w: getattr(hm, w).double() for w in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O",
                                              *(["W_gate"] if gated else []), "W_in", "W_out", "b_in", "b_out")}
    assert W["W_Q"].shape == W["W_K"].shape == W["W_V"].shape == (n, h, d, 16)
    assert W["W_O"].shape == (n, h, 16, d) and W["W_in"].shape == W.get("W_gate", W["W_in"]).shape == (n, d, c.d_mlp)
    if family == "qwen2":
        assert W["b_Q"].abs().max() > 0  # the biases are read, not zeros
    for l in range(n):
        x = own[f"blocks.{l}.{fam.attn_input}"].double()
        q = torch.einsum("btd,hde->bthe", x, W["W_Q"][l]) + W["b_Q"][l]
        _close(q, cache["q", l], f"L{l} q")
        for name in ("k", "v"):  # query head h reads key head h // (h / k): every (h / k)-th expanded head is one
            got = torch.einsum("btd,hde->bthe", x, W[f"W_{name.upper()}"][l]) + W[f"b_{name.upper()}"][l]
            _close(got[:, :, :: h // k], cache[name, l], f"L{l} {name}")
        out = torch.einsum("bthe,hed->btd", cache["z", l].double(), W["W_O"][l]) + W["b_O"][l]
        _close(out, own[f"blocks.{l}.attn.hook_out"], f"L{l} attn out")
        y = own[f"blocks.{l}.{fam.mlp_input}"].double()
        if gated:
            _close(y @ W["W_gate"][l], cache["pre", l], f"L{l} mlp pre")
        _close(y @ W["W_in"][l] + W["b_in"][l], cache["pre_linear" if gated else "pre", l], f"L{l} mlp in")
        _close(cache["post", l].double() @ W["W_out"][l] + W["b_out"][l],
               own[f"blocks.{l}.mlp.hook_out"], f"L{l} mlp out")
    _close(hm.W_E[ids], cache["hook_embed"], "W_E")
    _close(hm.unembed(hm.ln_final(cache["resid_post", -1])), cache["unembed.hook_out"], "unembed(ln_final)")
    _close(cache["unembed.hook_in"].double() @ hm.W_U.double() + hm.b_U.double(), cache["unembed.hook_out"], "W_U")
    with pytest.raises(UsageError, match="no positional embedding matrix"):
        _ = hm.W_pos


@torch.no_grad()
def test_calling_the_model_returns_logits_loss_both_or_nothing():
    model = build("llama")
    hm = HookedModel(model)
    ids = token_batch(2, 10, seed=8)
    plain = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(hm(ids), plain)
    ref = torch.nn.functional.cross_entropy(plain[:, :-1].reshape(-1, plain.shape[-1]), ids[:, 1:].reshape(-1))
    loss = hm(ids, return_type="loss")
    assert torch.allclose(loss, ref, rtol=1e-6)
    logits, both = hm(ids, return_type="both")
    assert torch.equal(logits, plain) and torch.equal(both, loss)
    assert hm(ids, return_type=None) is None
    per_token = hm(ids, return_type="loss", loss_per_token=True)
    assert per_token.shape == (2, 9) and torch.allclose(per_token.mean(), ref, rtol=1e-6)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row: its first next-token losses are not counted
    masked = hm(ids, return_type="loss", loss_per_token=True, attention_mask=mask)
    assert torch.equal(masked[1, :4], torch.zeros(4)) and masked[1, 4:].abs().min() > 0


@torch.no_grad()
def test_added_hooks_act_until_reset_and_the_hooks_context_removes_its_own():
    model = build("qwen3")
    hm = HookedModel(model)
    ids = token_batch(1, 8, seed=9)
    plain = hm(ids)

    def ablate(z, hook):
        z[:, :, 0] = 0

    hm.add_hook("blocks.1.attn.hook_z", ablate)
    edited = hm(ids)
    assert not torch.equal(edited, plain)
    assert torch.equal(hm.run_with_hooks(ids), edited)  # added hooks act on every call of the surface
    assert torch.equal(hm.run(ids, logits=True).logits, plain)  # ... but not on poslens's own run
    hm.add_hook(lambda name: name.endswith("hook_resid_post"), lambda x, hook: x * 1.0, is_permanent=True)
    hm.reset_hooks()
    assert torch.equal(hm(ids), plain) and len(hm._added) == 1  # the permanent one stays
    hm.reset_hooks(including_permanent=True)
    with hm.hooks(fwd_hooks=[("blocks.1.attn.hook_z", ablate)]):
        assert torch.equal(hm(ids), edited)
    assert torch.equal(hm(ids), plain) and hm._added == []


@torch.no_grad()
def test_greedy_generate_equals_transformers_greedy_generate():
    model = build("mistral")
    hm = HookedModel(model)
    ids = token_batch(1, 6, seed=10)
    ours = hm.generate(ids, max_new_tokens=6, do_sample=False, stop_at_eos=False, verbose=False)
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6, pad_token_id=0)
    assert torch.equal(ours, ref)
    torch.manual_seed(0)
    sampled = hm.generate(ids, max_new_tokens=4, top_k=5, temperature=0.7, stop_at_eos=False)
    assert sampled.shape == (1, 10) and torch.equal(sampled[:, :6], ids)


def test_to_tokens_prepends_the_bos_by_transformer_lens_rule(smollm2):
    """SmolLM2's tokenizer adds no BOS by itself (encode('') is empty): TransformerLens prepends it, so the text's
    tokens come after one BOS id; prepend_bos=False gives the tokenizer's own ids."""
    _, tok, _ = smollm2
    hm = HookedModel(build("llama", vocab_size=len(tok)), tok)
    text = "The causal mask encodes position."
    own = tok(text)["input_ids"]
    assert hm.cfg.tokenizer_prepends_bos is False and hm.cfg.default_prepend_bos is True
    assert hm.to_tokens(text)[0].tolist() == [tok.bos_token_id, *own]
    assert hm.to_tokens(text, prepend_bos=False)[0].tolist() == own
    assert hm.to_string(hm.to_tokens(text, prepend_bos=False)[0]) == text
    assert hm.to_str_tokens(text)[0] == tok.bos_token and "".join(hm.to_str_tokens(text)[1:]) == text
    assert hm.to_single_token(" mask") == tok(" mask")["input_ids"][0]
    batch = hm.to_tokens(["A b", "A much longer text here"], padding_side="left")
    _, mask = hm._tokens_and_mask(["A b", "A much longer text here"], None, "left")
    assert batch.shape[0] == 2 and mask[0, 0] == 0 and mask[1].all()
    with torch.no_grad():  # the left-padded short row as the TransformerLens surface runs it: as if alone
        logits = hm(["A b", "A much longer text here"], padding_side="left")
        alone = hm("A b")
    assert (logits[0, -alone.shape[1]:] - alone[0]).abs().max() <= 1e-5 * alone.abs().max()
    with pytest.raises(UsageError, match="not one"):
        hm.to_single_token(" causal mask")


def test_backward_hooks_and_the_cache_of_gradients_equal_autograd():
    """A bwd hook at blocks.1.hook_resid_pre gets d(loss)/d(resid_pre of layer 1): the gradient autograd gives for
    the model's own hidden state (same float32 operations: within 1e-5 of the largest entry)."""
    model = build("llama")
    hm = HookedModel(model)
    ids = token_batch(1, 8, seed=11)
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    h1 = out.hidden_states[1]
    h1.retain_grad()
    ref_loss = torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:])
    ref_loss.backward()
    ref = h1.grad
    model.zero_grad()
    got = {}
    loss = hm.run_with_hooks(ids, return_type="loss",
                             bwd_hooks=[("blocks.1.hook_resid_pre", lambda g, hook: got.setdefault(hook.name, g))])
    loss.backward()
    model.zero_grad()
    _close(got["blocks.1.hook_resid_pre"], ref, "bwd hook", 1e-5)
    _, cache = hm.run_with_cache(ids, ["blocks.1.hook_resid_pre"], return_type="loss", incl_bwd=True)
    model.zero_grad()
    _close(cache["blocks.1.hook_resid_pre_grad"], ref, "incl_bwd", 1e-5)
    assert not cache["blocks.1.hook_resid_pre"].requires_grad


@torch.no_grad()
def test_bad_ids_masks_and_hooks_are_refused_in_one_line():
    """Issue #37's library cases: out-of-range, negative, empty and 3-D ids, a mask of the wrong shape, non-callable
    hooks and malformed fwd_hooks: each a one-line UsageError; a mask of the ids' shape is accepted as the plain model
    accepts it (bit-identical logits)."""
    model = build("llama")
    hm = HookedModel(model)
    ids = token_batch(1, 17, seed=12)
    bad = ids.clone()
    bad[0, 3] = 256
    neg = ids.clone()
    neg[0, 0] = -1
    for call, match in [
        (lambda: hm.run(bad, logits=True), "token id 256 is outside the model's vocabulary"),
        (lambda: hm(neg), "token id -1 is outside"),
        (lambda: hm.run_with_cache(torch.zeros(1, 0, dtype=torch.long)), "empty"),
        (lambda: hm.run_with_hooks(ids[None]), r"must be \[batch, pos\]"),
        (lambda: hm.run(ids, torch.ones(1, 3, dtype=torch.long), logits=True), r"attention_mask has shape \(1, 3\)"),
        (lambda: hm(ids, attention_mask=torch.full((1, 17), 2)), "only 0"),
        (lambda: hm.run(ids, hooks={"hook_embed": 3}), "not callable"),
        (lambda: hm.run_with_hooks(ids, fwd_hooks=[("hook_embed",)]), r"\(name, function\) pair"),
        (lambda: hm.run_with_hooks(ids, fwd_hooks=("hook_embed", print)), r"\(name, function\) pair"),
        (lambda: hm.run_with_hooks(ids, fwd_hooks=[("hook_embed", 3)]), "not callable"),
        (lambda: hm.run_with_hooks(ids, fwd_hooks=[(None, print)]), "hook's name"),
        (lambda: hm.add_hook("blocks.0.hook_resid_pre", None), "not callable"),
    ]:
        with pytest.raises(UsageError, match=match) as err:
            call()
        assert "\n" not in str(err.value)
    mask = torch.ones(1, 17, dtype=torch.long)
    plain = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(hm.run(ids, mask, logits=True).logits, plain)
    assert torch.equal(hm.run_with_cache(ids, ["hook_embed"], attention_mask=mask)[0], plain)


@torch.no_grad()
def test_optional_points_result_and_mlp_in_as_transformer_lens():
    """attn.hook_result (TransformerLens's use_attn_result) and hook_mlp_in: cached only by name or once switched on;
    zeroing head 1's result equals zeroing its z (W_O is linear, no bias); a write at hook_mlp_in reaches the MLP only,
    not the residual stream (resid_post = resid_mid + mlp_out still holds with the new MLP output)."""
    hm = HookedModel(build("llama"))
    ids = token_batch(1, 8, seed=14)
    _, cache = hm.run_with_cache(ids)
    assert "blocks.0.attn.hook_result" not in cache and "blocks.0.hook_mlp_in" not in cache
    hm.set_use_attn_result(True)
    hm.set_use_hook_mlp_in(True)
    _, cache = hm.run_with_cache(ids, names_filter=lambda n: "result" in n or "mlp_in" in n)
    assert list(cache) == [f"blocks.{l}.{p}" for l in range(3) for p in ("attn.hook_result", "hook_mlp_in")]

    def zero(x, hook):
        x[:, :, 1] = 0

    a = hm.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_result", zero)])
    b = hm.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_z", zero)])
    _close(a, b, "result ablation = z ablation", 1e-6)
    names = ["blocks.0.hook_resid_mid", "blocks.0.hook_mlp_out", "blocks.0.hook_resid_post"]
    _, written = hm.run_with_cache(ids, names)
    with hm.hooks(fwd_hooks=[("blocks.0.hook_mlp_in", lambda x, hook: x * 2)]):
        _, doubled = hm.run_with_cache(ids, names)
    assert torch.equal(doubled["blocks.0.hook_resid_mid"], written["blocks.0.hook_resid_mid"])
    assert not torch.allclose(doubled["blocks.0.hook_mlp_out"], written["blocks.0.hook_mlp_out"])
    _close(doubled["blocks.0.hook_resid_post"], doubled["blocks.0.hook_resid_mid"] + doubled["blocks.0.hook_mlp_out"],
           "resid_post = resid_mid + mlp_out", 1e-6)
