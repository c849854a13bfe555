"""StableLM (stablelm-2-1.6b, stablelm-3b-4e1t, stablelm-zephyr): Llama's block with LayerNorms (weight and bias) and
RoPE on a quarter of each head. TransformerLens 3.9 has no StableLM; every point is checked against the float64
recomputation of tests/test_hooks.py and the bit-identical forwards of the family-parametrised tests. Here: the
partial rotation, the records, and stablelm-2-12b's form (parallel, per-head q/k LayerNorms)."""

from __future__ import annotations

import torch
from tiny_models import build, heads_summed_twin, randomize_norm_gains, token_batch

from poslens.engine.hooks import HookedModel
from poslens.engine.pe import PositionalEncoding


@torch.no_grad()
def test_rope_turns_the_first_quarter_of_each_head_and_leaves_the_rest():
    """attn.hook_rot_q and hook_rot_k equal hook_q and hook_k (after the bias) in each head's last 12 of 16 dimensions,
    bit for bit, and differ in the first 4 (past position 0, where the rotation is the identity); run.json's record
    says partial-rope with the factor, hm.cfg.rotary_dim 4."""
    model = build("stablelm")
    hm = HookedModel(model)
    _, cache = hm.run_with_cache(token_batch(2, 9, seed=4))
    for l in range(hm.n_layers):
        for part in ("q", "k"):
            plain, rot = cache[f"blocks.{l}.attn.hook_{part}"], cache[f"blocks.{l}.attn.hook_rot_{part}"]
            assert torch.equal(rot[..., 4:], plain[..., 4:])
            assert torch.equal(rot[:, 0], plain[:, 0]) and not torch.allclose(rot[:, 1:, :, :4], plain[:, 1:, :, :4])
    record = PositionalEncoding.of(model).record()
    assert record["layers"] == ["partial-rope"] * 3 and hm.cfg.rotary_dim == 4
    assert hm.cfg.normalization_type == "LN"


def _layer_norm64(x, weight):
    """A LayerNorm over the last dimension in float64, eps 1e-5, gain `weight`, no bias."""
    c = x.double() - x.double().mean(-1, keepdim=True)
    return c / (c.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * weight.double()


@torch.no_grad()
def test_the_12b_form_parallel_with_per_head_q_and_k_layer_norms():
    """stablelm-2-12b's form: a parallel residual summed (x + attn) + mlp, and a LayerNorm of each head's q and k
    (q_layernorm, k_layernorm: one LayerNorm per head, on [B, heads, T, D]; two key/value heads here). Every point read
    keeps the logits (the eager twin with W_O's heads summed, bit for bit); attn.q_norm.* and k_norm.* are
    TransformerLens's flattened [B*T*heads, D] and equal a float64 LayerNorm of hook_q's and hook_k's heads with each
    head's own gain (1e-5 of the largest); hook_resid_post is (resid_pre + attn_out) + mlp_out bit for bit; zeros
    written at layer 1's q_norm.hook_out (twice its hook_normalized) give the logits of the model whose q_layernorm
    there returns zeros (twice its output), within 1e-6 of the largest."""
    model = randomize_norm_gains(build("stablelm", use_parallel_residual=True, qk_layernorm=True))
    g = torch.Generator().manual_seed(5)
    for layer in model.model.layers:  # each head's own gain (a fresh model's are all 1)
        for norm in (layer.self_attn.q_layernorm, layer.self_attn.k_layernorm):
            for n in norm.norms:
                n.weight.copy_(1 + 0.3 * torch.randn(n.weight.shape, generator=g))
    hm = HookedModel(model)
    assert hm.family.layout == "parallel"
    ids = token_batch(2, 11, seed=3)
    logits, cache = hm.run_with_cache(ids, hm.points)
    assert torch.equal(logits, heads_summed_twin(model)(input_ids=ids).logits)
    attn = model.model.layers[1].self_attn
    for part, heads, norm in (("q", 4, attn.q_layernorm), ("k", 2, attn.k_layernorm)):
        x = cache[f"blocks.1.attn.hook_{part}"]  # [B, T, heads, D]
        want = _layer_norm64(x, torch.stack([n.weight for n in norm.norms]))
        got = cache[f"blocks.1.attn.{part}_norm.hook_out"]
        assert got.shape == (2 * 11 * heads, 16)
        assert (got.double() - want.reshape(-1, 16)).abs().max() <= 1e-5 * want.abs().max()
    x = cache["blocks.1.hook_resid_pre"]
    assert torch.equal(cache["blocks.1.hook_resid_post"],
                       (x + cache["blocks.1.hook_attn_out"]) + cache["blocks.1.hook_mlp_out"])
    for point, edit in (("hook_out", torch.zeros_like), ("hook_normalized", lambda t: 2 * t)):
        # (twice the normalized value: twice the output, each head's gain applied to its own rows; no bias)
        got = hm.run(ids, hooks={f"blocks.1.attn.q_norm.{point}": lambda t, ctx, edit=edit: edit(t)},
                     logits=True).logits
        handle = attn.q_layernorm.register_forward_hook(lambda m, a, out, edit=edit: edit(out))
        try:
            want = model(input_ids=ids).logits
        finally:
            handle.remove()
        assert (got - want).abs().max() <= 1e-6 * want.abs().max(), point
        assert (got - logits).abs().max() > 1e-3 * logits.abs().max(), point
