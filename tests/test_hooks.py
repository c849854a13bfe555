"""poslens.engine.hooks on tiny random models of every supported family: every point means what TransformerLens 3.9
means (checked against a float64 recomputation from the model's own weights), writes act downstream as in
TransformerLens, readers change nothing, and run_with_cache returns TransformerLens's keys and shapes."""

from __future__ import annotations

import inspect

import pytest
import torch
from tiny_models import FAMILIES, build, eager_twin, heads_summed_twin, randomize_norm_gains, token_batch

from poslens.engine.families import sliding_windows
from poslens.engine.hooks import HookedModel, from_factors
from poslens.errors import UsageError

GEMMA = ("gemma2", "gemma3")


def _plain_logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


# ------------------------------------------------------ a float64 recomputation under TransformerLens's meaning


def _rms(prefix, module, x, gemma, ref, flat=False):
    """TransformerLens's RMSNorm points: scale = sqrt(mean(x^2) + eps), normalized = x / scale, then the gain (q/k
    norms: over each head's D entries, TL's [B*T*heads, .]; OLMo-2's over the whole projection, x [B, T, heads*D]).
    A LayerNorm's (StableLM's): x centred first, its bias added after the gain; OLMo (1)'s without weight or bias:
    centred, eps 1e-5 (OlmoLayerNorm's), gain 1."""
    bias = 0.0
    if not hasattr(module, "weight"):  # OLMo (1)
        x, eps, w = x - x.mean(-1, keepdim=True), 1e-5, torch.ones((), dtype=torch.float64)
    else:
        eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
        w = module.weight.double()
        if isinstance(module, torch.nn.LayerNorm):
            x, bias = x - x.mean(-1, keepdim=True), module.bias.double()
    scale = ref.get(f"{prefix}.hook_scale!", (x.pow(2).mean(-1, keepdim=True) + eps).sqrt())  # written, or computed
    normalized = ref.get(f"{prefix}.hook_normalized!", x / scale)
    out = normalized * ((1 + w) if gemma else w) + bias
    for point, t in (("hook_scale", scale), ("hook_normalized", normalized), ("hook_out", out)):
        ref[f"{prefix}.{point}"] = t.reshape(-1, t.shape[-1]) if flat else t  # q/k norms: TL's [B*T*heads, .]
    return out


def _linear(x, layer):
    return x @ layer.weight.double().T + (0 if layer.bias is None else layer.bias.double())


def _rotate(x, cos, sin):
    """RoPE on x [B, T, heads, D] with the model's cos, sin [B, T, R] (R < D: only the first R dimensions rotate)."""
    r = cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    turned = torch.cat([-xr[..., r // 2:], xr[..., : r // 2]], -1)
    c, s = cos.double()[:, :, None], sin.double()[:, :, None]
    return torch.cat([xr * c + turned * s, rest], -1)


def _cos_sin(model, l, x, pos):
    rotary, attn = model.model.rotary_emb, model.model.layers[l].self_attn
    if not getattr(attn, "use_rope", True):  # SmolLM3's layers without RoPE
        return None
    if "layer_type" in inspect.signature(rotary.forward).parameters:  # Gemma-3: local and global RoPE
        return rotary(x, pos, attn.layer_type)
    return rotary(x, pos)


@torch.no_grad()
def _layer(model, family, l, x, written=None):
    """Every point of layer l in float64 from its input x [B, T, d] and the layer's weights, with TransformerLens's
    meanings; `written` maps a point to a value a hook wrote there (it replaces the computed value downstream)."""
    ref = {f"{k}!": v.double() for k, v in (written or {}).items()}
    blk, cfg, sandwich = model.model.layers[l], model.config, family in GEMMA
    gemma = family.startswith("gemma")  # Gemma's (1 + w) norm gain (Gemma 1: Llama's pre-norm block)
    attn, mlp = blk.self_attn, blk.mlp
    b, t, _ = x.shape
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    post_norm = family == "olmo2"  # post-norm: attention reads x, ln1 and ln2 normalize the sublayers' outputs
    ref["hook_resid_pre"] = x
    if not post_norm:  # the per-head inputs (pre-norm and Gemma families)
        copies = {"hook_q_input": h, "hook_k_input": kv, "hook_v_input": kv, **({"hook_attn_in": h} if h == kv else {})}
        ref.update({p: x[:, :, None].expand(-1, -1, n, -1) for p, n in copies.items()})  # resid_pre once per head
    y = x if post_norm else _rms("ln1", blk.input_layernorm, x, gemma, ref)
    if hasattr(attn, "qkv_proj"):  # Phi-3: rows [q | k | v]
        q, k, v = _linear(y, attn.qkv_proj).split([h * d, kv * d, kv * d], -1)
    else:
        q, k, v = _linear(y, attn.q_proj), _linear(y, attn.k_proj), _linear(y, attn.v_proj)
    q, k, v = (z.unflatten(-1, (-1, d)) for z in (q, k, v))  # [B, T, heads, D]
    q = ref["attn.hook_q"] = ref.get("attn.hook_q!", q)
    ref["attn.hook_k"], ref["attn.hook_v"] = k, v
    if post_norm:  # one RMSNorm over all heads of q (of k)
        q = _rms("attn.q_norm", attn.q_norm, q.flatten(-2), gemma, ref).unflatten(-1, (-1, d))
        k = _rms("attn.k_norm", attn.k_norm, k.flatten(-2), gemma, ref).unflatten(-1, (-1, d))
    elif hasattr(attn, "q_norm"):
        q = _rms("attn.q_norm", attn.q_norm, q, gemma, ref, flat=True)
        k = _rms("attn.k_norm", attn.k_norm, k, gemma, ref, flat=True)
    rope = _cos_sin(model, l, x.float(), torch.arange(t)[None].expand(b, -1))
    if rope is not None:
        q, k = _rotate(q, *rope), _rotate(k, *rope)
    ref["attn.hook_rot_q"], ref["attn.hook_rot_k"] = q, k
    k, v = k.repeat_interleave(h // kv, 2), v.repeat_interleave(h // kv, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * attn.scaling
    if family == "gemma2":
        cap = cfg.attn_logit_softcapping
        s = torch.tanh(s / cap) * cap
    i, j = torch.arange(t)[:, None], torch.arange(t)[None]
    window = sliding_windows(cfg)[l]
    s = s.masked_fill(~((j <= i) & ((i - j < window) if window else True)), float("-inf"))
    ref["attn.hook_attn_scores"] = s
    p = ref["attn.hook_pattern"] = torch.softmax(s, -1)
    z = ref["attn.hook_z"] = torch.einsum("bhij,bjhd->bihd", p, v)
    w_o = attn.o_proj.weight.double().T.unflatten(0, (h, d))  # [H, D, d]: each head's rows of W_O
    ref["attn.hook_result"] = torch.einsum("bihd,hde->bihe", z, w_o)
    a = ref["attn.hook_out"] = _linear(z.flatten(-2), attn.o_proj)
    if sandwich or post_norm:
        a = _rms("ln1" if post_norm else "ln1_post", blk.post_attention_layernorm, a, gemma, ref)
    ref["hook_attn_out"] = a
    mid = ref["hook_resid_mid"] = ref["hook_mlp_in"] = x + a
    ln2 = blk.pre_feedforward_layernorm if sandwich else blk.post_attention_layernorm
    f = mid if post_norm else _rms("ln2", ln2, mid, gemma, ref)
    if hasattr(mlp, "c_fc"):  # Starcoder2: one up projection, no gate
        pre = ref["mlp.hook_pre"] = _linear(f, mlp.c_fc)
        post = ref["mlp.hook_post"] = mlp.act(pre)
    else:
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: rows [gate | up]
            gate, up = _linear(f, mlp.gate_up_proj).chunk(2, -1)
            act = mlp.activation_fn
        else:
            gate, up, act = _linear(f, mlp.gate_proj), _linear(f, mlp.up_proj), mlp.act_fn
        ref["mlp.hook_pre"], ref["mlp.hook_pre_linear"] = gate, up
        post = ref["mlp.hook_post"] = act(gate) * up
    m = ref["mlp.hook_out"] = _linear(post, getattr(mlp, "down_proj", None) or mlp.c_proj)
    if sandwich or post_norm:
        m = _rms("ln2" if post_norm else "ln2_post", blk.post_feedforward_layernorm, m, gemma, ref)
    ref["hook_mlp_out"] = m
    ref["hook_resid_post"] = mid + m
    return {f"blocks.{l}.{k}": v for k, v in ref.items() if not k.endswith("!")}


def _assert_matches(got: dict, ref: dict):
    """Each point within 2e-5 of its largest |value| (masked scores: -inf at the same places). The model computes in
    float32 (epsilon 1.2e-7) from the same layer input: rounding in contractions of at most 128 terms and a few
    chained operations stays near 1e-6; a wrong meaning (no RoPE, no gain, no q-norm, another layout) is off by a
    sizeable fraction of the value."""
    for name, r in ref.items():
        g = got[name].double()
        assert g.shape == r.shape, f"{name}: shape {tuple(g.shape)}, expected {tuple(r.shape)}"
        finite = torch.isfinite(r)
        assert torch.equal(finite, torch.isfinite(g)), name
        err = (g[finite] - r[finite]).abs().max() / r[finite].abs().max()
        assert err < 2e-5, f"{name}: relative deviation {err:.2e}"


def _model(family):
    return randomize_norm_gains(build(family))


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_every_point_equals_a_float64_recomputation_and_readers_leave_logits_bit_identical(family):
    """A reader on every point: the pattern is formed, so attention's output is pattern @ v, as transformers' eager
    attention computes it, and the per-head results are read, so W_O's output is their sum plus b_O, as
    TransformerLens computes it (logits bit-identical to the eager model's with W_O so computed;
    tests/test_hooks_pattern_output.py has the tolerance to the SDPA forward); without a reader of the scores, the
    pattern or the per-head results, bit-identical to SDPA's."""
    model = _model(family)
    hm = HookedModel(model)
    ids = token_batch(2, 16, seed=6)
    plain = _plain_logits(model, ids)
    logits, cache = hm.run_with_cache(ids, hm.points)  # a reader on every point
    assert torch.equal(logits, _plain_logits(heads_summed_twin(model), ids))
    no_pattern = [p for p in hm.points if not p.endswith(("attn.hook_attn_scores", "attn.hook_pattern",
                                                              "attn.hook_result"))]
    assert torch.equal(hm.run_with_cache(ids, no_pattern)[0], plain)
    assert torch.equal(_plain_logits(model, ids), plain)  # the model is left as it was
    assert list(cache) == hm.points  # every point fired, in forward order
    ref = {"hook_embed": model.model.embed_tokens(ids).double()}
    for l in range(hm.n_layers):
        ref.update(_layer(model, family, l, cache[f"blocks.{l}.hook_resid_pre"].double()))
    final = _rms("ln_final", model.model.norm, cache[f"blocks.{hm.n_layers - 1}.hook_resid_post"].double(),
                 family.startswith("gemma"), ref)
    ref["unembed.hook_in"], ref["unembed.hook_out"] = final, _linear(final, model.lm_head)  # Gemma-2: before softcap
    assert set(ref) == set(hm.points)
    _assert_matches(cache, ref)
    # the values after a gain differ from those before it (the test would not see a missing gain otherwise); OLMo
    # (1)'s LayerNorm has no gain
    same = torch.allclose(cache["blocks.1.ln1.hook_out"], cache["blocks.1.ln1.hook_normalized"])
    assert same if family == "olmo" else not same


@pytest.mark.parametrize("family", FAMILIES)
def test_writes_at_q_and_at_the_normalized_input_act_downstream_as_in_transformer_lens(family):
    """A value written at attn.hook_q is q-normed and rotated before the scores; one written at ln1.hook_normalized
    is multiplied by the gain (and projected to k and v); one written at ln2.hook_scale divides the MLP's input."""
    model = _model(family)
    hm = HookedModel(model)
    ids = token_batch(2, 16, seed=7)
    cfg, d = model.config, model.model.layers[1].self_attn.head_dim
    g = torch.Generator().manual_seed(8)
    written = {"ln1.hook_normalized": torch.randn(2, 16, cfg.hidden_size, generator=g),
               "attn.hook_q": 2 * torch.randn(2, 16, cfg.num_attention_heads, d, generator=g),
               "ln2.hook_scale": 0.5 + torch.rand(2, 16, 1, generator=g)}
    cached = {}

    def write(point):
        def hook(x, ctx):
            return written[point]

        return hook

    def keep(x, ctx):
        cached[ctx.name] = x.clone()

    hooks = {f"blocks.1.{p}": [write(p), keep] for p in written}
    later = [p for p in hm.points if p.startswith("blocks.1.") and p.removeprefix("blocks.1.") not in written]
    hooks.update({p: keep for p in later + ["blocks.1.hook_resid_pre"]})
    hm.run(ids, hooks=hooks)
    ref = _layer(model, family, 1, cached["blocks.1.hook_resid_pre"].double(), written)
    _assert_matches(cached, ref)


def test_run_with_cache_has_transformer_lens_keys_and_shapes_on_llama():
    """Keys and shapes written out by hand from TransformerLens 3.9's source (HookedTransformer with a Llama config:
    RMSNorm, rotary, gated MLP, grouped-query attention with K < H, so hook_k/hook_v keep K heads; the points that
    fire in its forward, Unembed's hook_in/hook_out included) for the tiny Llama: batch 2, 8 tokens, d 64, 4 query
    heads, 2 key/value heads, head width 16, MLP width 128, vocabulary 256."""
    b, t, d, h, kv, dh, m = 2, 8, 64, 4, 2, 16, 128
    block = {
        "hook_resid_pre": (b, t, d),
        "ln1.hook_scale": (b, t, 1),
        "ln1.hook_normalized": (b, t, d),
        "attn.hook_q": (b, t, h, dh),
        "attn.hook_k": (b, t, kv, dh),
        "attn.hook_v": (b, t, kv, dh),
        "attn.hook_rot_q": (b, t, h, dh),
        "attn.hook_rot_k": (b, t, kv, dh),
        "attn.hook_attn_scores": (b, h, t, t),
        "attn.hook_pattern": (b, h, t, t),
        "attn.hook_z": (b, t, h, dh),
        "hook_attn_out": (b, t, d),
        "hook_resid_mid": (b, t, d),
        "ln2.hook_scale": (b, t, 1),
        "ln2.hook_normalized": (b, t, d),
        "mlp.hook_pre": (b, t, m),
        "mlp.hook_pre_linear": (b, t, m),
        "mlp.hook_post": (b, t, m),
        "hook_mlp_out": (b, t, d),
        "hook_resid_post": (b, t, d),
    }
    expected = {"hook_embed": (b, t, d), "ln_final.hook_scale": (b, t, 1), "ln_final.hook_normalized": (b, t, d),
                "unembed.hook_in": (b, t, d), "unembed.hook_out": (b, t, 256)}
    expected.update({f"blocks.{l}.{k}": s for l in range(3) for k, s in block.items()})
    model = build("llama")
    hm = HookedModel(model)
    ids = token_batch(b, t, seed=9)
    logits, cache = hm.run_with_cache(ids)
    assert {k: tuple(v.shape) for k, v in cache.items()} == expected
    # logits as TransformerLens returns them; the patterns are read, so as transformers' eager attention computes them
    assert torch.equal(logits, _plain_logits(eager_twin(model), ids))


def test_run_with_cache_filters_and_shorthand_as_transformer_lens():
    hm = HookedModel(build("qwen3"))
    ids = token_batch(1, 6, seed=10)
    logits, cache = hm.run_with_cache(ids, names_filter=lambda n: n.endswith("pattern"), return_type=None)
    assert logits is None and list(cache) == [f"blocks.{l}.attn.hook_pattern" for l in range(3)]
    assert cache["pattern", -1] is cache["blocks.2.attn.hook_pattern"] and cache["attn", 0] is cache["pattern", 0]
    _, one = hm.run_with_cache(ids, "blocks.1.attn.q_norm.hook_scale")
    assert list(one) == ["blocks.1.attn.q_norm.hook_scale"]
    assert one["blocks.1.attn.q_norm.hook_scale"].shape == (6 * 4, 1)  # TransformerLens's [batch * pos * heads, 1]
    _, few = hm.run_with_cache(ids, ["ln_final.hook_normalized", "blocks.0.ln1.hook_out", "hook_embed"],
                               remove_batch_dim=True)
    assert list(few) == ["hook_embed", "blocks.0.ln1.hook_out", "ln_final.hook_normalized"]  # forward order
    assert few["embed"].shape == (6, 64) and few["normalized"] is few["ln_final.hook_normalized"]
    assert few["out", 0, "ln1"] is few["blocks.0.ln1.hook_out"]
    _, cache = hm.run_with_cache(ids, ["blocks.0.attn.hook_q", "blocks.1.ln1.hook_scale"])
    assert cache["q0"] is cache["blocks.0.attn.hook_q"] and cache["scale1ln1"] is cache["blocks.1.ln1.hook_scale"]
    assert "blocks.0.attn.hook_k" not in cache and cache.get("k0") is None


def test_run_with_hooks_calls_transformer_lens_hook_functions():
    """fn(value, hook) with hook.name and hook.layer(), selected by a function of names, as in TransformerLens."""
    model = build("llama")
    hm = HookedModel(model)
    ids = token_batch(2, 8, seed=12)
    seen = []

    def halve_q(q, hook):  # TransformerLens style: [batch, pos, head, d_head], before RoPE
        seen.append((hook.name, hook.layer()))
        return q * 0.5

    logits = hm.run_with_hooks(ids, fwd_hooks=[(lambda n: n.endswith("attn.hook_q"), halve_q)])
    assert seen == [(f"blocks.{l}.attn.hook_q", l) for l in range(3)]
    same = hm.run(ids, hooks={f"blocks.{l}.attn.hook_q": lambda x, ctx: x * 0.5 for l in range(3)}, logits=True)
    assert torch.equal(logits, same.logits) and not torch.equal(logits, _plain_logits(model, ids))


def test_transformer_lens_features_without_an_equivalent_fail_in_one_line():
    hm = HookedModel(build("llama"))
    ids = token_batch(1, 6)
    for call, match in [
        (lambda: hm.run_with_cache(ids, stop_at_layer=2), "stop_at_layer= has no poslens equivalent"),
        (lambda: hm.run_with_cache(ids, return_type="probs"), "return_type must be one of"),
        (lambda: hm.run_with_cache(1.5), "token ids"),
        (lambda: hm.run_with_cache(ids, ["blocks.0.hook_tokens"]), "TransformerLens has it"),
        (lambda: hm.to_tokens("Hello"), "needs a tokenizer"),
        (lambda: hm.W_pos, "no positional embedding matrix; its positional encoding is rotary"),
        (lambda: hm.blocks[0](ids), "no poslens equivalent"),
        (lambda: hm.run_with_cache(ids)[1].get_full_resid_decomposition(), "get_full_resid_decomposition"),
    ]:
        with pytest.raises(UsageError, match=match) as err:
            call()
        assert "\n" not in str(err.value)
    assert not hasattr(hm, "OV_circuit")  # an unknown name: AttributeError, so hasattr() keeps working
    with torch.no_grad(), pytest.raises(UsageError, match="bwd_hooks need gradients"):
        hm.run_with_hooks(ids, bwd_hooks=[("hook_embed", print)])


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


def test_factored_readers_get_rotated_q_and_k_and_stop_early():
    model = build("llama", num_hidden_layers=3)
    ids = token_batch(2, 10, seed=5)
    hm = HookedModel(model)
    calls, rot = [], {}

    @from_factors
    def reader(x, ctx):
        calls.append((x, ctx.rot_q.clone(), ctx.rot_k.clone()))

    def keep(x, ctx):
        rot[ctx.name.rsplit(".", 1)[1]] = x.clone()

    later = []
    model.model.layers[1].mlp.register_forward_hook(lambda *a: later.append(1))
    try:
        hm.run(ids, hooks={"blocks.1.attn.hook_attn_scores": reader, "blocks.1.attn.hook_rot_q": keep,
                           "blocks.1.attn.hook_rot_k": keep})
    finally:
        model.model.layers[1].mlp._forward_hooks.clear()
    (x, q, k), = calls
    assert x is None
    assert torch.equal(q.transpose(1, 2), rot["hook_rot_q"]) and torch.equal(k.transpose(1, 2), rot["hook_rot_k"])
    assert later == []  # the forward ended inside layer 1's attention
    with pytest.raises(UsageError, match="ctx.rot_q"):  # the former name fails loudly instead of changing meaning
        hm.run(ids, hooks={"blocks.0.attn.hook_attn_scores": from_factors(lambda x, ctx: ctx.q)})


def test_bad_hooks_are_usage_errors():
    model = build("llama")
    hm = HookedModel(model)
    ids = token_batch(1, 8)
    with pytest.raises(UsageError, match="no hook point"):
        hm.run(ids, hooks={"blocks.0.hook_nothing": lambda x, c: None})
    with pytest.raises(UsageError, match="no hook point"):  # Gemma's sandwich norms only exist on Gemma
        hm.run(ids, hooks={"blocks.0.ln1_post.hook_normalized": lambda x, c: None})
    with pytest.raises(UsageError, match="layers"):
        hm.run(ids, hooks={"blocks.99.hook_resid_pre": lambda x, c: None})
    with pytest.raises(UsageError, match="replacement"):
        hm.run(ids, hooks={"blocks.0.hook_resid_pre": lambda x, c: x[:, :1]})
    # the failed run left the model usable
    assert torch.equal(_plain_logits(model, ids), hm.run(ids, logits=True).logits)


def test_activation_norm_reads_per_head_points_and_refuses_maps():
    """The worked statistic at attn.hook_q: the norm of each position's query projection, all heads side by side."""
    from poslens.engine.runner import run_statistics
    from poslens.engine.statistics import ActivationNorm

    model = build("llama")
    batches = [token_batch(2, 8, seed=11 + b) for b in range(2)]
    stat = ActivationNorm("blocks.{l}.attn.hook_q", layers=[0], groups=2)
    run_statistics(model, [stat], batches)
    with torch.no_grad():
        q = torch.stack([model.model.layers[0].self_attn.q_proj(model.model.layers[0].input_layernorm(
            model.model.embed_tokens(x))) for x in batches])  # [batches, B, T, H * D]
    torch.testing.assert_close(stat.result()["norm"][0], q.double().norm(dim=-1).mean((0, 1)), rtol=1e-6, atol=0)
    with pytest.raises(UsageError, match="not laid out"):
        ActivationNorm("blocks.{l}.attn.hook_pattern")


@pytest.mark.parametrize("heads,kv_heads,t", [(9, 3, 37), (4, 4, 37), (8, 1, 37), (4, 2, 9), (4, 4, 9)])
def test_grouped_scores_equal_repeated_keys_bit_for_bit(heads, kv_heads, t):
    """The dense scores and the pattern-times-values of a grouped-query model are transformers' eager operations
    (repeat_kv, then matmul), so the result is bit-identical, not only close, on any CPU (4 query heads on 2 key heads
    at 9 tokens: where stacking a key head's query heads into one GEMM rounded differently on an AVX2 CPU; 4 heads at 9
    tokens laid out as the models hand them over: where one bmm per sequence rounded differently on an AVX-512 CPU)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    from poslens.engine.hooks import _kv_matmul, _weigh

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, t, 16, generator=g)
    k = torch.randn(2, kv_heads, t, 16, generator=g)
    p = torch.softmax(torch.randn(2, heads, t, t, generator=g), dim=-1)
    groups = heads // kv_heads
    assert torch.equal(_kv_matmul(q, k, transpose=True), q @ repeat_kv(k, groups).transpose(-1, -2))
    assert torch.equal(_kv_matmul(p, k), p @ repeat_kv(k, groups))
    assert torch.equal(_kv_matmul(q.transpose(1, 2).contiguous().transpose(1, 2), k, transpose=True),
                       q @ repeat_kv(k, groups).transpose(-1, -2))  # a non-contiguous query (a hook's replacement)
    # q, k, v as the models hand them over: [B, T, H, D] storage seen as [B, H, T, D] (one bmm per sequence on these
    # rounded otherwise on an AVX-512 CPU)
    qs, ks, vs = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, torch.randn_like(k)))
    assert torch.equal(_kv_matmul(qs, ks, transpose=True), qs @ repeat_kv(ks, groups).transpose(-1, -2))
    assert torch.equal(_weigh(p, vs), (p @ repeat_kv(vs, groups)).transpose(1, 2).contiguous())
