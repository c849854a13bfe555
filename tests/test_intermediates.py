"""`poslens intermediates`: every Figure 3 panel and every Figure 8 map against an independent float64 recomputation
from the layer's weights on tiny models of every family; the block-output check; resume and merge; the pipeline on
the embedded SmolLM2 (with and without RoPE) and on a scaled-down model of the released NoPE checkpoint's shape."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import FAMILIES, build, token_batch

from poslens.analyses.intermediates import (
    GRAM_PANELS,
    PANELS,
    BlockOutputMismatch,
    Intermediates,
    IntermediatesConfig,
    check_tolerance,
    cosine_scores,
    gram_ratio_support,
    offdiag_ratio,
    row_slope,
    row_slopes,
    run_intermediates,
    share_rows_increasing,
    stack_strength,
    summary_lines,
)
from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError

# ---------------------------------------------------------------- an independent float64 forward, from weights


def _norm(x, mod, gemma: bool):
    """RMSNorm: x / sqrt(mean x^2 + eps) * w (Gemma: * (1 + w)); OLMo (1)'s LayerNorm without weight or bias:
    (x - mean) / sqrt(var + 1e-5) (OlmoLayerNorm's eps)."""
    if not hasattr(mod, "weight"):
        x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    if isinstance(mod, torch.nn.LayerNorm):  # StableLM: (x - mean) / sqrt(var + eps) * w + b
        x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mod.eps) * mod.weight.double() + mod.bias.double()
    eps = getattr(mod, "variance_epsilon", None) or mod.eps
    w = mod.weight.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * ((1 + w) if gemma else w)


def _linear(x, lin):
    y = x @ lin.weight.double().T
    return y + lin.bias.double() if lin.bias is not None else y


def _rope(x, theta: float, rot: int):
    """Hugging Face's half-split rotary embedding on the first `rot` dims of x [B, H, T, D], positions 0..T-1."""
    t = x.shape[2]
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    xr, rest = x[..., :rot], x[..., rot:]
    half = torch.cat([-xr[..., rot // 2:], xr[..., : rot // 2]], -1)
    return torch.cat([xr * cos + half * sin, rest], -1)


def _layer_facts(cfg, l: int) -> dict:
    """Scaling, window, softcap and RoPE of layer l, read from the config alone."""
    d = cfg.head_dim
    types = getattr(cfg, "layer_types", None)
    sliding = types[l] == "sliding_attention" if types else cfg.model_type in ("mistral", "starcoder2")
    params = cfg.rope_parameters
    if cfg.model_type == "gemma3_text":
        params = params[types[l]]
    rot = int(d * params.get("partial_rotary_factor", 1.0))
    rope = not (cfg.model_type == "smollm3" and cfg.no_rope_layers[l] == 0)
    scalar = getattr(cfg, "query_pre_attn_scalar", None) if cfg.model_type.startswith("gemma") else None
    return {"scaling": (scalar or d) ** -0.5, "window": cfg.sliding_window if sliding else 0,
            "softcap": getattr(cfg, "attn_logit_softcapping", None), "theta": params["rope_theta"],
            "rot": rot, "rope": rope}


def _attention(model, l: int, y, rope: bool = True):
    """Layer l's attention from its normalised input y [B, T, d]: (head-mean scores [B, T, T], z [B, T, H, D],
    output after W_O, (q [B, H, T, D], k [B, Hkv, T, D]) after norm and RoPE)."""
    cfg, attn = model.config, model.model.layers[l].self_attn
    b, t, _ = y.shape
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gemma = cfg.model_type.startswith("gemma")
    f = _layer_facts(cfg, l)
    if hasattr(attn, "qkv_proj"):  # Phi-3: rows [q | k | v]
        qkv = _linear(y, attn.qkv_proj)
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], -1)
    else:
        q, k, v = _linear(y, attn.q_proj), _linear(y, attn.k_proj), _linear(y, attn.v_proj)
    if cfg.model_type == "olmo2":  # one RMSNorm over all heads of q (of k)
        q, k = _norm(q, attn.q_norm, gemma), _norm(k, attn.k_norm, gemma)
    q, k, v = (x.view(b, t, -1, d).transpose(1, 2) for x in (q, k, v))
    if hasattr(attn, "q_norm") and cfg.model_type != "olmo2":
        q, k = _norm(q, attn.q_norm, gemma), _norm(k, attn.k_norm, gemma)
    if f["rope"] and rope:
        q, k = _rope(q, f["theta"], f["rot"]), _rope(k, f["theta"], f["rot"])
    qk = (q, k)
    k, v = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    s = q @ k.transpose(-1, -2) * f["scaling"]
    logits = torch.tanh(s / f["softcap"]) * f["softcap"] if f["softcap"] else s
    i, j = torch.arange(t)[:, None], torch.arange(t)[None]
    ok = (j <= i) & ((i - j < f["window"]) if f["window"] else True)
    p = torch.softmax(logits.masked_fill(~ok, -math.inf), -1)
    z = (p @ v).transpose(1, 2)  # [B, T, H, D]
    return s.mean(1), z, _linear(z.reshape(b, t, h * d), attn.o_proj), qk


def _mlp(model, l: int, x):
    cfg, mlp = model.config, model.model.layers[l].mlp
    if hasattr(mlp, "gate_up_proj"):  # Phi-3: [gate | up]
        gate, up = _linear(x, mlp.gate_up_proj).chunk(2, -1)
        return _linear(up * F.silu(gate), mlp.down_proj)
    act = (lambda u: F.gelu(u, approximate="tanh")) if cfg.model_type.startswith(("gemma", "starcoder2")) else F.silu
    if hasattr(mlp, "c_fc"):  # Starcoder2: one up projection, no gate
        return _linear(act(_linear(x, mlp.c_fc)), mlp.c_proj)
    return _linear(act(_linear(x, mlp.gate_proj)) * _linear(x, mlp.up_proj), mlp.down_proj)


def reference(model, ids, layer: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Panels (a)-(i) and every layer's head-mean scores, per sequence [B, T, T], from the weights in float64.

    The only thing taken from the model's forward is the residual stream entering each layer
    (output_hidden_states); everything after it is recomputed here."""
    cfg = model.config
    gemma, post_norm = cfg.model_type.startswith("gemma"), cfg.model_type == "olmo2"
    with torch.no_grad():
        hidden = [x.double() for x in model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states]
        blk = model.model.layers[layer]

        def gram(x):
            return x @ x.transpose(-1, -2)

        x = hidden[layer]
        y = x if post_norm else _norm(x, blk.input_layernorm, gemma)  # OLMo-2: attention reads the stream
        s, z, a, _ = _attention(model, layer, y)
        b, t, h, d = z.shape
        zg = torch.einsum("bihd,bjhd->bij", z, z) / h
        if hasattr(blk, "pre_feedforward_layernorm"):  # Gemma-2 and -3's sandwich (Gemma 1: pre-norm, as Llama)
            mid = x + _norm(a, blk.post_attention_layernorm, gemma)
            f = _norm(mid, blk.pre_feedforward_layernorm, gemma)
            post = mid + _norm(_mlp(model, layer, f), blk.post_feedforward_layernorm, gemma)
        elif post_norm:  # OLMo-2: x + norm(attn(x)), then mid + norm(mlp(mid))
            mid = f = x + _norm(a, blk.post_attention_layernorm, gemma)
            post = mid + _norm(_mlp(model, layer, f), blk.post_feedforward_layernorm, gemma)
        else:
            mid = x + a
            f = _norm(mid, blk.post_attention_layernorm, gemma)
            post = mid + _mlp(model, layer, f)
        nxt = post if post_norm else _norm(post, model.model.layers[layer + 1].input_layernorm, gemma)
        s2, _, _, qk2 = _attention(model, layer + 1, nxt)
        panels = {"a": gram(y), "b": s, "c": zg, "d": gram(a), "e": gram(mid), "f": gram(f), "g": gram(post),
                  "h": gram(nxt), "i": s2, "i_qk": qk2}
        scores = [_attention(model, l, hidden[l] if post_norm else
                             _norm(hidden[l], model.model.layers[l].input_layernorm, gemma))[0]
                  for l in range(cfg.num_hidden_layers)]
    return panels, scores


def _run(model, batches, layer, groups, **kw) -> Intermediates:
    hm = HookedModel(model)
    st = Intermediates(hm, layer, groups=groups, **kw)
    hooks = st.hooks(hm)
    for b, ids in enumerate(batches):
        st.group = b
        hm.run(ids, hooks=hooks)
    return st


def _close(got, want, what):
    """Agreement up to float32 rounding: the model runs in float32 (unit roundoff 6e-8) through at most two layers
    with reductions over <= 128 terms, so its intermediates carry relative errors around 1e-6; 1e-4 of the map's
    largest entry leaves a wide margin while any wrong point, scaling, head average or layout is off by O(1)."""
    scale = float(want[torch.isfinite(want)].abs().max())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4 * scale, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def _lower(m, window=0):
    n = m.shape[-1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    ok = (j <= i) & ((i - j < window) if window else True)
    return m.masked_fill(~ok, math.nan)


# every family at layer 0; layer 1 too where it differs in kind: Gemma's full-attention layer after a sliding one
# (different RoPE base, no window), SmolLM3's layer without RoPE, Phi-3's partial RoPE into a second layer
CASES = [(f, 0) for f in FAMILIES] + [("gemma3", 1), ("gemma2", 1), ("smollm3", 1), ("phi3", 1)]


@pytest.mark.parametrize("family,layer", CASES)
def test_every_panel_equals_a_float64_recomputation_from_the_weights(family, layer):
    model = build(family)
    batches = [token_batch(3, 20, seed=s) for s in range(3)]
    st = _run(model, batches, layer, groups=3)
    res = st.result()
    refs = [reference(model, ids, layer) for ids in batches]
    cfg = model.config
    for letter, _, _ in PANELS:
        want = torch.cat([r[0][letter] for r in refs]).mean(0)
        lyr = layer + (letter in "hi")
        window = _layer_facts(cfg, lyr)["window"] if letter in "bi" else 0
        _close(res[f"panel_{letter}"], _lower(want, window), f"{family} layer {layer} panel ({letter})")
    for l in range(cfg.num_hidden_layers):  # Figure 8: every layer's head-mean scores
        want = torch.cat([r[1][l] for r in refs]).mean(0)
        _close(res["scores"][l], _lower(want, _layer_facts(cfg, l)["window"]), f"{family} Figure 8 layer {l}")
    check = st.check_report()
    assert check["max_rel"] <= check_tolerance(torch.float32)
    assert torch.isnan(res["panel_a"][0, 1]) and torch.isfinite(res["panel_a"][1, 0])  # upper triangle blank


def test_block_check_fails_on_a_corrupted_module_and_on_a_wrong_layout():
    model = build("llama")
    hm = HookedModel(model)
    st = Intermediates(hm, 0, groups=2)  # copies layer 0's MLP in float64
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 0.05  # the model now computes something else
    with pytest.raises(BlockOutputMismatch, match="layer 0: the block output"):
        hm.run(token_batch(2, 12), hooks=st.hooks(hm))
    gemma = build("gemma3")
    hm = HookedModel(gemma)
    st = Intermediates(hm, 0, groups=2)
    st._modules.pop("post")  # recompute as if Gemma had no norm after its MLP
    with pytest.raises(BlockOutputMismatch) as e:
        hm.run(token_batch(2, 12), hooks=st.hooks(hm))
    assert "\n" not in str(e.value)


def test_resumed_and_merged_statistics_equal_one_pass_and_intervals_are_the_group_spread():
    model = build("qwen3")
    batches = [token_batch(2, 16, seed=10 + s) for s in range(6)]
    whole = _run(model, batches, 0, groups=3)
    first = _run(model, batches[:3], 0, groups=3)
    resumed = Intermediates(HookedModel(model), 0, groups=3)
    resumed.load_state_dict(first.state_dict())
    hm = HookedModel(model)
    hooks = resumed.hooks(hm)
    for b in range(3, 6):
        resumed.group = b
        hm.run(batches[b], hooks=hooks)
    second = Intermediates(HookedModel(model), 0, groups=3)
    hm2 = HookedModel(model)
    hooks2 = second.hooks(hm2)
    for b in range(3, 6):
        second.group = b
        hm2.run(batches[b], hooks=hooks2)
    merged = _run(model, batches[:3], 0, groups=3)
    merged.merge(second)
    for other in (resumed, merged):
        a, b = whole.state_dict(), other.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-12)
    # a panel is linear in the means: its jackknife standard error is the spread of the 3 group means / sqrt(3)
    res = whole.result()
    group_means = torch.stack([torch.cat([reference(model, batches[b], 0)[0]["a"] for b in (g, g + 3)]).mean(0)
                               for g in range(3)])
    se = _lower(group_means.std(0) / math.sqrt(3))
    torch.testing.assert_close(res["panel_a_se"].double(), se, rtol=1e-3, atol=1e-6, equal_nan=True)


def test_row_slope_reads_the_key_trend():
    n = 12
    i, j = torch.arange(n, dtype=torch.float64)[:, None], torch.arange(n, dtype=torch.float64)[None]
    m = _lower(2.0 * j + 5.0 * i + 100.0 * (j == 0))  # slope 2 in j; the sink column and i do not matter
    assert row_slope(m).item() == pytest.approx(2.0, abs=1e-12)
    assert row_slope(_lower(-0.5 * j)).item() == pytest.approx(-0.5, abs=1e-12)


def test_row_slopes_equal_a_least_squares_fit_per_row():
    """Per-row slopes against numpy's polyfit on the same keys 1 <= j < i (float64; 1e-10)."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    m = _lower(torch.randn(9, 9, generator=g, dtype=torch.float64))
    got = row_slopes(m)
    for i in range(9):
        if i < 3:  # fewer than two keys in 1..i-1
            assert math.isnan(got[i])
            continue
        want = np.polyfit(np.arange(1, i), m[i, 1:i].numpy(), 1)[0]
        assert float(got[i]) == pytest.approx(want, abs=1e-10)
    assert float(share_rows_increasing(m)) == pytest.approx(float((got[3:] > 0).double().mean()))


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.6])
def test_parameter_free_second_layer_increases_in_every_row(alpha):
    """Section 3: in the parameter-free stack the second layer's score increases strictly with j < i for every
    alpha, so every row's slope is positive and the strength is positive; its diagonal is 1 (cosines)."""
    from poslens.stack.config import StackConfig
    from poslens.stack.gramflow import gram_flow

    s2 = torch.from_numpy(gram_flow(StackConfig(n=30, alpha=alpha, layers=2)).scores[1])
    assert float(share_rows_increasing(s2)) == 1.0
    assert torch.allclose(torch.diagonal(s2), torch.ones(30, dtype=torch.float64), atol=1e-12)
    assert float(stack_strength(alpha, 30)) == pytest.approx(float(row_slope(s2)), rel=1e-12)
    assert float(row_slope(s2)) > 0


@pytest.mark.parametrize("family", ["llama", "smollm3"])
def test_cosine_unit_of_panel_i_equals_a_recomputation_and_lies_in_minus_one_one(family):
    """Panel (i) in cosine units, E[q_i . k_j] / sqrt(E|q_i|^2 E|k_j|^2) with the query heads of a key head summed
    (grouped-query attention), against the same from the weights in float64; by Cauchy-Schwarz every entry lies in
    [-1, 1]. Tolerance as `_close` (float32 model, relative 1e-4 of the largest entry)."""
    model = build(family)
    batches = [token_batch(3, 16, seed=s) for s in range(2)]
    st = _run(model, batches, 0, groups=2)
    m = st.sums._means()
    got = cosine_scores(st.panel_map("i", m), m["q_sq/next"], m["k_sq/next"])
    qs, ks, dots = [], [], []
    for ids in batches:
        q, k = reference(model, ids, 0)[0]["i_qk"]  # [B, H, T, D], [B, Hkv, T, D]
        g = q.reshape(q.shape[0], k.shape[1], -1, *q.shape[2:]).sum(2)  # query heads of one key head summed
        dots.append(torch.einsum("bkid,bkjd->bij", g, k))
        qs.append(g.square().sum((1, 3)))
        ks.append(k.square().sum((1, 3)))
    want = torch.cat(dots).mean(0) / torch.sqrt(torch.cat(qs).mean(0)[:, None] * torch.cat(ks).mean(0)[None])
    _close(got, _lower(want), f"{family} panel (i) in cosine units")
    low = torch.isfinite(got)
    assert bool((got[low].abs() <= 1 + 1e-12).all())


def test_amplification_is_model_over_stack_and_skipped_with_rope():
    """On a NoPE model the ratio is the model's strength over the stack's at the measured alpha (exactly, for the
    point estimate); a model whose layers 1-2 rotate with RoPE gets no comparison, with the reason."""
    nope = build("smollm3", no_rope_layers=[0, 0, 0])
    st = _run(nope, [token_batch(4, 12, seed=s) for s in range(4)], 0, groups=4)
    amp = st.summary()["amplification"]
    a = amp["alpha"]["value"]
    assert a == pytest.approx(float(st.summary()["panels"]["a"]["offdiag_ratio"]["value"]), rel=1e-12)
    m = st.sums._means()
    model = float(row_slope(cosine_scores(st.panel_map("i", m), m["q_sq/next"], m["k_sq/next"])))
    assert amp["model_strength"]["value"] == pytest.approx(model, rel=1e-12)
    assert amp["stack_strength"]["value"] == pytest.approx(float(stack_strength(a, 12)), rel=1e-12)
    assert amp["ratio"]["value"] == pytest.approx(model / float(stack_strength(a, 12)), rel=1e-12)
    assert amp["ratio"]["method"] == "jackknife" and amp["ratio"]["groups"] == 4
    rope = _run(build("smollm3", no_rope_layers=[1, 0, 1]), [token_batch(2, 12)], 0, groups=2)
    assert "skipped" in rope.summary()["amplification"] and "rope/none" in rope.summary()["amplification"]["skipped"]


def test_gram_ratio_support_is_attained_and_never_left():
    """offdiag_ratio of a Gram matrix of n vectors lies in [-1/(n-1), 1]: a regular simplex (centred basis vectors,
    summing to zero) reaches the lower end, n equal vectors the upper, random vector sets fall between."""
    n = 7
    low, high = gram_ratio_support(n)
    simplex = torch.eye(n, dtype=torch.float64) - 1.0 / n
    assert float(offdiag_ratio(simplex @ simplex.T)) == pytest.approx(low, rel=1e-12)
    same = torch.randn(1, 5, dtype=torch.float64).expand(n, 5)
    assert float(offdiag_ratio(same @ same.T)) == pytest.approx(high, rel=1e-12)
    g = torch.Generator().manual_seed(0)
    for shift in (0.0, 0.3, 3.0):
        for _ in range(100):
            y = torch.randn(n, 3, generator=g, dtype=torch.float64) * torch.rand(n, 1, generator=g,
                                                                                dtype=torch.float64) + shift
            assert low - 1e-12 <= float(offdiag_ratio(y @ y.T)) <= high + 1e-12


def test_gram_panels_and_alpha_record_their_support():
    """The off-diagonal/diagonal ratios of the Gram panels, and the amplification's alpha (panel (a)'s), carry the
    range they cannot leave (their intervals cut to it); the q.k panels (b) and (i) have none."""
    st = _run(build("smollm3", no_rope_layers=[0, 0, 0]), [token_batch(2, 12, seed=s) for s in range(2)], 0,
              groups=2)
    summary = st.summary()
    want = [pytest.approx(-1 / 11, rel=1e-12), 1.0]
    for letter, p in summary["panels"].items():
        e = p["offdiag_ratio"]
        assert e.get("support") == (want if letter in GRAM_PANELS else None), letter
        if letter in GRAM_PANELS:
            assert -1 / 11 - 1e-12 <= e["lo"] <= e["value"] <= e["hi"] <= 1.0
    assert summary["amplification"]["alpha"]["support"] == want
    assert "support" not in summary["amplification"]["ratio"]


def test_layer_without_a_next_layer_is_a_usage_error():
    hm = HookedModel(build("llama"))
    with pytest.raises(UsageError, match="layer must be in"):
        Intermediates(hm, 2)


# ---------------------------------------------------------------- the pipeline on real and random models


def _small(model: str, **kw) -> IntermediatesConfig:
    return IntermediatesConfig(model=model, seq_len=16, num_sequences=8, batch_size=2, groups=4, **kw)


def test_smollm2_with_and_without_rope(smollm2, tmp_path):
    runs = {}
    for pe in ("auto", "none"):
        path = run_intermediates(_small("smollm2-135m", pe=pe, figures=pe == "none"), str(tmp_path / pe),
                                 progress=False)
        meta = json.loads((path / "run.json").read_text())
        from poslens.io.results import load

        runs[pe] = (load(path), meta)
        check = meta["metrics"]["block_output_check"]
        assert check["max_rel"] <= check["tolerance"]
        panels = meta["metrics"]["panels"]  # Section 4.2's readings in the run directory, each with its interval
        for c, key in (("b", "first_column"), ("b", "first_column_signed"), ("c", "diagonal_slope"),
                       ("c", "uniformity"), ("e", "correlation_with_d"), ("i", "key_share")):
            assert {"value", "lo", "hi"} <= set(panels[c][key]) and panels[c][key]["groups"] >= 2, (c, key)
        assert (path / "figures" / "figure3.png").is_file() == (pe == "none")
        assert (path / "figures" / "figure8.png").is_file() == (pe == "none")
        assert runs[pe][0]["scores"].shape == (30, 16, 16)
    assert set(runs["none"][1]["model"]["positional_encoding"]) == {"none"}
    assert set(runs["auto"][1]["model"]["positional_encoding"]) == {"rope"}
    on, off = runs["auto"][0], runs["none"][0]
    # the input norm precedes RoPE: panel (a) cannot depend on it; Q K^T (b) and everything after it does.
    # (a) is the same arithmetic on the same values; 1e-12 relative allows only for a BLAS that sums in another
    # order for differently aligned buffers
    torch.testing.assert_close(on["panel_a"], off["panel_a"], rtol=1e-12, atol=0, equal_nan=True)
    assert not torch.allclose(on["panel_b"], off["panel_b"], equal_nan=True)


NOPE_SHAPE = dict(model_type="llama", num_hidden_layers=22, hidden_size=2048, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=64, intermediate_size=5632, vocab_size=49152)


def test_scaled_down_nope_shape_with_pe_none_equals_rope_removed_by_hand(smollm2, tmp_path):
    # the released NoPE checkpoint's shape, scaled down: 4 query heads per key head, head_dim * heads = hidden
    small = {**NOPE_SHAPE, "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 256}
    spec = "random:" + json.dumps(small)
    path = run_intermediates(_small(spec, pe="none", tokenizer="smollm2-135m", layer=2, figures=False),
                             str(tmp_path / "r"), progress=False)
    from poslens.engine.models import load_model
    from poslens.io.results import load

    run = load(path)
    assert run["scores"].shape == (4, 16, 16) and run["panel_i"].shape == (16, 16)
    assert run.meta["panels"]["i"]["layer"] == 3
    # the same weights with RoPE removed by hand: every rotary frequency 0, so every rotation is the identity
    model, tok = load_model(spec, tokenizer="smollm2-135m", pe="rope")
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.zero_()
    from poslens.engine.data import make_sequences
    from poslens.engine.pipeline import documents

    docs, _ = documents(None, "text")
    ids, _ = make_sequences(tok, docs, 16, 8)
    hm = HookedModel(model)
    st = Intermediates(hm, 2, groups=4)
    hooks = st.hooks(hm)
    for b, batch in enumerate(torch.split(ids, 2)):
        st.group = b
        hm.run(batch, hooks=hooks)
    by_hand = st.result()
    for name in ["scores"] + [f"panel_{c}" for c, _, _ in PANELS]:
        # the same arithmetic on the same numbers up to BLAS summation order (float32 forward): 1e-5 relative;
        # leaving RoPE in changes these maps by O(1)
        torch.testing.assert_close(run[name], by_hand[name], rtol=1e-5, atol=1e-6, equal_nan=True)


def test_command_line_bad_layer_is_one_line_exit_2(smollm2, capsys, tmp_path):
    from poslens import cli

    assert cli.COMMANDS["intermediates"].run == "poslens.analyses.intermediates:run_intermediates"
    small = {**NOPE_SHAPE, "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64}
    code = cli.main(["intermediates", "random:" + json.dumps(small), "--tokenizer", "smollm2-135m", "--layer", "1",
                     "--quiet", "--out", str(tmp_path / "unused")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--layer 1 has no next layer" in err and "0..0" in err
    assert list(tmp_path.iterdir()) == []


def test_fewer_sequences_than_a_batch_is_refused_before_loading(tmp_path, capsys):
    """`intermediates smollm2-135m --num-sequences 16`: one batch of 50 would be one group, no interval; refused by
    the groups rule (poslens.engine.config) before the model loads, naming the fix."""
    from poslens import cli

    assert cli.main(["intermediates", "smollm2-135m", "--num-sequences", "16", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err == ("poslens intermediates: error: --batch-size 50 puts all 16 sequences in one batch, and an interval "
                   "needs 2 groups of sequences (a group is one batch or more); lower --batch-size to 8 or raise "
                   "--num-sequences\n")
    assert list(tmp_path.iterdir()) == []


def test_summary_prints_undefined_numbers_as_nan():
    """run.json keeps NaN as null (an interval undefined in some replicate): the summary says nan, never fails."""
    nothing = {"value": None, "lo": None, "hi": None}
    meta = {"metrics": {"panels": {"a": {"what": "Y Y^T", "row_slope": nothing, "offdiag_ratio": nothing}},
                        "amplification": {"ratio": nothing, "alpha": nothing}, "level": 0.95, "groups": 2}}
    lines = summary_lines(meta)
    assert lines[0].endswith("row slope nan [nan, nan]  off-diagonal/diagonal nan [nan, nan]")
    assert "nan [nan, nan] times" in lines[1] and lines[-1] == "intervals: 95% jackknife over 2 groups of sequences"


def test_section_42_readings_equal_an_independent_recomputation_from_the_mean_maps():
    """The statistics Section 4.2's rows read ((b)'s first column, (c)'s diagonal trend and off-diagonal uniformity,
    (e) against (d), (i)'s key share) against numpy on the pooled mean maps: polyfit, corrcoef, a least-squares fit
    on one indicator per key. Same float64 arithmetic in another order: 1e-10 relative. The correlation and the
    share carry the jackknife's bias-corrected value with the plug-in interval's half-widths."""
    import numpy as np

    st = _run(build("smollm3", no_rope_layers=[0, 0, 0]), [token_batch(4, 12, seed=s) for s in range(4)], 0, groups=4)
    p = st.summary()["panels"]

    def maps(m):
        return {c: st.panel_map(c, m).double().numpy() for c in "bcdei"}

    def contrast(mp):
        b = mp["b"]
        others = b[np.tril(np.ones_like(b, dtype=bool), -1) & (np.arange(12) >= 1)[None]]
        return (b[1:, 0].mean() - others.mean()) / others.std(ddof=1)

    def correlation(mp):
        keep = np.tril(np.ones((12, 12), dtype=bool), -1) & (np.arange(12) >= 1)[None]
        return np.corrcoef(mp["d"][keep], mp["e"][keep])[0, 1]

    def share(mp):  # R^2 of the entries 1 <= j < i on one indicator per key j
        i, j = np.nonzero(np.tril(np.ones((12, 12), dtype=bool), -1) & (np.arange(12) >= 1)[None])
        y = mp["i"][i, j]
        x = (j[:, None] == np.unique(j)[None]).astype(float)
        res = y - x @ np.linalg.lstsq(x, y, rcond=None)[0]
        return 1 - (res ** 2).sum() / ((y - y.mean()) ** 2).sum()

    mp = maps(st.sums._means())
    diag = np.diagonal(mp["c"])[1:]
    off = mp["c"][np.tril(np.ones((12, 12), dtype=bool), -1) & (np.arange(12) >= 1)[None]]
    plain = {("b", "first_column_signed"): contrast(mp), ("b", "first_column"): abs(contrast(mp)),
             ("c", "diagonal_slope"): np.polyfit(np.arange(1, 12), diag, 1)[0] / diag.mean(),
             ("c", "uniformity"): (off.std(ddof=1) / off.mean()) / (diag.std(ddof=1) / diag.mean())}
    for (c, key), want in plain.items():
        assert p[c][key]["value"] == pytest.approx(want, rel=1e-10), (c, key)
        assert p[c][key]["lo"] < p[c][key]["value"] < p[c][key]["hi"] and p[c][key]["groups"] == 4
    assert p["b"]["first_column"]["support"] == [0.0, math.inf]
    printed = summary_lines({"metrics": st.summary()})
    assert f"(i) key share {p['i']['key_share']['value']:.3g} [" in "\n".join(printed)
    # docs/commands.md: the share of rows of (f) and (i) that increase with j, printed as run.json has it
    assert f"(f) {p['f']['rows_increasing']['value']:.3g} [" in "\n".join(printed)
    assert f"(i) {p['i']['rows_increasing']['value']:.3g} [" in "\n".join(printed)
    for (c, key), fn, support in ((("e", "correlation_with_d"), correlation, [-1.0, 1.0]),
                                  (("i", "key_share"), share, [0.0, 1.0])):
        est = st.sums.estimate(lambda m, fn=fn: torch.as_tensor(fn(maps(m))))
        got, shift = p[c][key], float(est.debiased) - float(est.value)

        def cut(x, support=support):  # to the range the reading can take (the key share's interval reaches below 0)
            return min(max(x, support[0]), support[1])

        assert est.value.item() == pytest.approx(fn(mp), rel=1e-12)
        assert got["value"] == pytest.approx(cut(float(est.debiased)), rel=1e-10) and got["debiased"], key
        assert got["lo"] == pytest.approx(cut(float(est.lo) + shift), rel=1e-10), key
        assert got["hi"] == pytest.approx(cut(float(est.hi) + shift), rel=1e-10), key
        assert got["support"] == support


def test_readings_with_a_range_are_cut_to_it_in_run_json_and_in_what_is_printed():
    """Two groups of sequences (t_1 = 12.7): the raw intervals of the key share and of the first column's size
    leave the range they can take; recorded and printed, each reading is cut to its support."""
    st = _run(build("llama"), [token_batch(2, 12, seed=s) for s in range(2)], 0, groups=2)
    m = st.summary()
    p = m["panels"]
    ranges = {("b", "first_column"): [0.0, math.inf], ("e", "correlation_with_d"): [-1.0, 1.0],
              ("i", "key_share"): [0.0, 1.0], ("f", "rows_increasing"): [0.0, 1.0],
              ("i", "rows_increasing"): [0.0, 1.0]}
    for (c, key), (low, high) in ranges.items():
        e = p[c][key]
        assert e["support"] == [low, high] and low <= e["lo"] <= e["value"] <= e["hi"] <= high, (c, key, e)
    assert (p["i"]["key_share"]["lo"], p["i"]["key_share"]["hi"], p["b"]["first_column"]["lo"]) == (0.0, 1.0, 0.0)
    assert f"(i) key share {p['i']['key_share']['value']:.3g} [0, 1]" in "\n".join(summary_lines({"metrics": m}))


def test_section_42_readings_see_what_they_name():
    """On constructed maps each reading moves the way its claim reads it: a bright or a dark first column, a
    diagonal that falls with i, off-diagonal entries flat beside a varying diagonal, maps with the same or the
    opposite trend, a map of the key alone."""
    from poslens.analyses.intermediates import (
        diagonal_slope,
        first_column_contrast,
        offdiag_correlation,
        offdiag_uniformity,
    )
    from poslens.maps import key_share

    n = 10
    i, j = torch.arange(n, dtype=torch.float64)[:, None], torch.arange(n, dtype=torch.float64)[None]
    wave = _lower(torch.sin(1.3 * i + 0.7 * j) + 0.1 * j)
    assert float(first_column_contrast(_lower(wave + 50.0 * (j == 0)))) > 10
    assert float(first_column_contrast(_lower(wave - 50.0 * (j == 0)))) < -10
    falling = _lower(torch.where(i == j, 20.0 - i, 1.0 + 0 * i))  # diagonal 20 - i, off-diagonal flat
    assert float(diagonal_slope(falling)) == pytest.approx(-1 / (20 - torch.arange(1.0, n).mean().item()), rel=1e-12)
    assert float(offdiag_uniformity(falling)) == 0.0 and float(offdiag_uniformity(_lower(wave + 5))) > 0
    assert float(offdiag_correlation(wave, 3 * wave + 2)) == pytest.approx(1.0, abs=1e-12)
    assert float(offdiag_correlation(wave, -wave)) == pytest.approx(-1.0, abs=1e-12)
    assert float(key_share(_lower(j ** 2 + 0 * i))) == pytest.approx(1.0, abs=1e-12)
    assert float(key_share(wave)) < 0.9


def test_panel_titles_name_what_each_layout_shows():
    """OLMo-2's post-norm layout has no norm before a sublayer: (a), (f) and (h) are the raw stream there, and their
    titles say so; a pre-norm family keeps the paper's titles; a parallel block's (e) is not a residual sum."""
    from poslens.analyses.intermediates import panel_title, panel_what
    from poslens.engine.families import family_of

    olmo2, llama, neox = (family_of(build(f).config) for f in ("olmo2", "llama", "gpt_neox"))
    assert "after the input norm" in panel_what("a", llama) and "no norm" in panel_what("a", olmo2)
    assert "= (e)" in panel_what("f", olmo2)
    assert panel_title("h", 0, olmo2) == "(h) next layer's stream attention reads, layer 2"
    assert "entering the block" in panel_what("e", neox) and panel_what("g", neox) == panel_what("g", llama)
