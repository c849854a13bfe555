"""Explicit 4-D attention masks on ALiBi models and eager attentions: the length analysis's window interventions on
BLOOM and Falcon-RW equal a float64 recomputation of ALiBi attention with that window, and a boolean 4-D mask means
what it says on every family.

transformers passes a 4-D mask to the attention as given (masking_utils: "If the mask is already 4D, simply return
as-is"), and an eager attention adds it to the scores, so the mask must be in the form of the implementation: additive
(0 where a key is seen) for eager, boolean or additive for SDPA. Hugging Face's BLOOM (eager only) takes no 4-D mask
at all (it builds ALiBi from a [B, T] mask: "too many values to unpack"); poslens's hooked BLOOM takes one (ALiBi
built from the keys), and a boolean one added as given hid nothing (True + 1, False + 0): logits 0.03 from the
causal run on the tiny model, as Gemma-2 (eager) by 0.8. `HookedModel` now makes a boolean 4-D mask additive for the
eager families and refuses the ambiguous forms (integer, float 1/0) in one line.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tiny_models import build, token_batch

from poslens.analyses.length.interventions import parse
from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError


def _causal(t: int, window: int = 0) -> torch.Tensor:
    i, j = torch.arange(t)[:, None], torch.arange(t)[None]
    return ((j <= i) & ((i - j < window) if window else True))[None, None]


def press_bias(heads: int, t: int) -> torch.Tensor:
    """ALiBi's bias slope_h * (j - i) [H, i, j] in float64, slopes 2^(-8 h / H), h = 1..H (Press et al.; H a power of
    2)."""
    assert heads & (heads - 1) == 0, "slopes written for a power of 2"
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads)
    pos = torch.arange(t, dtype=torch.float64)
    return slopes[:, None, None] * (pos[None, :] - pos[:, None])


@torch.no_grad()
def reference_logits(model, ids: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """BLOOM's or Falcon-RW's (serial, multi-head) forward in float64 with ALiBi attention written out here: score =
    q.k / sqrt(D) + bias_scale * slope_h * (j - i) where `seen` [B or 1, 1, T, T] is True, hidden elsewhere; slopes
    2^(-8 h / H), h = 1..H (Press et al.; H a power of 2); bias_scale 1 on BLOOM, 1 / sqrt(D) on Falcon (it adds
    slope * j to q.k before its 1/sqrt(D) scaling). The norms, projections and MLPs are the model's own modules in
    float64. The bias's per-query part (slope * i) is a constant of each softmax row, so this is the models'
    slope * j."""
    m = copy.deepcopy(model).double()
    if model.config.model_type == "mpt":
        return _mpt_reference_logits(m, ids, seen)
    bloom = model.config.model_type == "bloom"
    base = m.transformer
    x = base.word_embeddings(ids)
    if bloom:
        x = base.word_embeddings_layernorm(x)
    b, t, _ = x.shape
    heads = model.config.num_attention_heads
    bias = press_bias(heads, t)  # [H, i, j]
    for layer in base.h:
        attn = layer.self_attention
        d = attn.head_dim
        qkv = attn.query_key_value(layer.input_layernorm(x)).view(b, t, heads, 3, d)
        q, k, v = qkv.unbind(3)
        s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d) + bias * (1.0 if bloom else 1 / math.sqrt(d))
        p = torch.softmax(s.masked_fill(~seen, -math.inf), -1).nan_to_num(0.0)  # a pad query that sees no key
        x = x + attn.dense(torch.einsum("bhij,bjhd->bihd", p, v).reshape(b, t, heads * d))
        mlp = layer.mlp
        act = mlp.gelu_impl if bloom else mlp.act
        x = x + mlp.dense_4h_to_h(act(mlp.dense_h_to_4h(layer.post_attention_layernorm(x))))
    return m.lm_head(base.ln_f(x))


def _mpt_reference_logits(m, ids: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """MPT's forward (float64 `m`) with ALiBi attention written out: score = q.k * softmax_scale + slope_h * (j - i)
    where `seen`, slopes 2^(-8 h / H) (H a power of 2); q, k, v the thirds of Wqkv; x + ffn(norm_2(x)) after
    attention (the model's own norms and projections)."""
    base = m.transformer
    x = base.wte(ids)
    b, t, _ = x.shape
    heads = m.config.num_attention_heads
    bias = press_bias(heads, t)  # [H, i, j]
    for layer in base.blocks:
        attn = layer.attn
        q, k, v = (y.reshape(b, t, heads, -1) for y in attn.Wqkv(layer.norm_1(x)).chunk(3, -1))
        s = torch.einsum("bihd,bjhd->bhij", q, k) * attn.softmax_scale + bias
        p = torch.softmax(s.masked_fill(~seen, -math.inf), -1).nan_to_num(0.0)
        x = x + attn.out_proj(torch.einsum("bhij,bjhd->bihd", p, v).reshape(b, t, -1))
        ffn = layer.ffn
        x = x + ffn.down_proj(ffn.act(ffn.up_proj(layer.norm_2(x))))
    return m.lm_head(base.norm_f(x))


@pytest.mark.parametrize("family", ["bloom", "falcon_rw", "mpt"])
@pytest.mark.parametrize(("spec", "sinks"), [("window:5", 0), ("sink-window:5", 1)])
@pytest.mark.parametrize("padded", [False, True])
@torch.no_grad()
def test_window_interventions_on_alibi_equal_a_float64_recomputation(family, spec, sinks, padded):
    """window:W hides keys W or more back; sink-window:W keeps key 0 besides the last W - 1. Logits at the real tokens
    within 1e-5 of the largest (float32 through three layers of width 64 rounds at ~1e-6; a missing window moves them
    by > 1e-2, checked; a boolean mask added as given, by 3e-2). `padded`: a right-padded row, its pad keys hidden
    too."""
    model = build(family)
    hm = HookedModel(model)
    t, w = 16, 5
    ids = token_batch(2, t, seed=8)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 11:] = 0
    iv = parse(spec, 8)
    with iv.applied(hm, ids, mask if padded else None) as p:
        got = hm.run(p.ids, p.attention_mask, hooks=p.hooks, position_ids=p.position_ids, logits=True).logits
    i, j = torch.arange(t)[:, None], torch.arange(t)[None]
    seen = ((j <= i) & ((i - j < w - sinks) | (j < sinks)))[None, None] & mask.bool()[:, None, None, :]
    want = reference_logits(model, ids, seen)
    real = mask.bool()
    scale = want[real].abs().max()
    assert (got[real].double() - want[real]).abs().max() <= 1e-5 * scale
    causal = reference_logits(model, ids, _causal(t) & mask.bool()[:, None, None, :])
    assert (causal[real] - want[real]).abs().max() > 1e-2 * scale  # the window is seen by this comparison


@pytest.mark.parametrize("family", ["bloom", "gemma2", "falcon_rw", "llama", "gpt_neo", "mpt"])
@torch.no_grad()
def test_a_boolean_4d_mask_means_what_it_says_on_every_attention(family):
    """A boolean 4-D window mask gives the logits of the same mask in additive form, bit for bit, and a boolean causal
    mask those of the run without a mask (within 1e-6 of the largest logit: the same operations, the mask added as
    zeros where seen)."""
    model = build(family)
    hm = HookedModel(model)
    t = 12
    ids = token_batch(2, t, seed=1)
    dtype = model.get_input_embeddings().weight.dtype
    for window in (0, 4):
        seen = _causal(t, window).expand(2, 1, t, t)
        additive = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)
        got = hm.run(ids, seen, logits=True).logits
        assert torch.equal(got, hm.run(ids, additive, logits=True).logits)
        if not window:
            plain = hm.run(ids, logits=True).logits
            assert (got - plain).abs().max() <= 1e-6 * plain.abs().max()


def test_hugging_face_bloom_takes_no_4d_mask():
    """The finding's premise: a 4-D mask reaches BLOOM only through poslens (Hugging Face's BLOOM builds ALiBi from a
    [B, T] mask and fails on a 4-D one), so its meaning there is poslens's to define."""
    model = build("bloom")
    ids = token_batch(1, 8, seed=2)
    with pytest.raises(ValueError, match="too many values to unpack"), torch.no_grad():
        model(input_ids=ids, attention_mask=_causal(8))


@pytest.mark.parametrize("family", ["bloom", "llama"])
@pytest.mark.parametrize(("mask", "message"), [
    (_causal(8).long(), "got torch.int64 with values 0 to 1"),
    (_causal(8).float(), "got torch.float32 with values 0 to 1"),
])
def test_ambiguous_4d_masks_are_refused_in_one_line(family, mask, message):
    hm = HookedModel(build(family))
    with pytest.raises(UsageError, match="a 4-D mask is boolean .True where a key is seen. or additive float") as e:
        hm.run(token_batch(1, 8, seed=2), mask, logits=True)
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError, match="a 4-D mask is boolean"):
        hm.run(token_batch(1, 8, seed=2), {"full_attention": mask}, logits=True)
