"""Attention's output when a hook forms the pattern (a reader of `attn.hook_attn_scores` or `attn.hook_pattern` as a
tensor): the output is computed from that pattern, pattern @ v, as the model's eager attention computes it, op for op
(transformers' `eager_attention_forward`; BLOOM's baddbmm and bmm; Falcon's q.k / sqrt(D) and broadcast matmuls), so
the pattern a hook reads is the one that weighted the values. Checked on every family with a tiny random model:

* logits bit-identical to the same weights under transformers' eager attention (Falcon's ALiBi form has no eager
  reference: transformers' eager Falcon adds the bias twice), and within SDPA_ROUNDING of the model's SDPA forward
  (tests/helpers.py says why 1e-5);
* no reader of the scores or the pattern (nothing, `attn.hook_z`, or a reader of the factors, `from_factors`): the
  model's own kernel runs and the logits are bit-identical to its plain forward;
* z is bit for bit the pattern read times the values, by the model's own operations;
* a left-padded batch: at the real tokens, bit-identical to the eager model given the same mask.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_within_sdpa_rounding
from tiny_models import ALL_FAMILIES, build, eager_twin, randomize_norm_gains, token_batch
from transformers.models.llama.modeling_llama import repeat_kv

from poslens.engine.hooks import HookedModel, from_factors


def _read(x, ctx):
    return None


def _at(hm: HookedModel, *points: str) -> dict:
    return {f"blocks.{l}.{p}": _read for l in range(hm.n_layers) for p in points}


@pytest.mark.parametrize("family", ALL_FAMILIES)
@torch.no_grad()
def test_a_pattern_reader_gives_the_eager_forward_and_the_sdpa_one_within_rounding(family):
    model = randomize_norm_gains(build(family))
    hm = HookedModel(model)
    ids = token_batch(2, 24, seed=11)
    plain = model(input_ids=ids, use_cache=False).logits
    eager = None if family == "falcon_rw" else eager_twin(model)(input_ids=ids, use_cache=False).logits
    for points in (("attn.hook_pattern",), ("attn.hook_attn_scores",), ("attn.hook_attn_scores", "attn.hook_pattern")):
        got = hm.run(ids, hooks=_at(hm, *points), logits=True).logits
        if eager is not None:
            assert torch.equal(got, eager), points
        assert_within_sdpa_rounding(got, plain, f"{family} {points}")
    # no pattern formed: the model's own kernel, bit-identical to the plain forward
    unformed = {**_at(hm, "attn.hook_z"), **{f"blocks.{l}.attn.hook_attn_scores": from_factors(_read)
                                             for l in range(hm.n_layers)}}
    assert torch.equal(hm.run(ids, hooks=unformed, logits=True).logits, plain)
    if family not in ("gemma2", "bloom", "falcon", "gpt_neo", "mpt"):  # (Gemma-2, BLOOM, GPT-Neo and MPT run eager
        # attention in their plain forward too; Falcon's SDPA with one key/value head for all query heads falls back to
        # the same operations)
        assert not torch.equal(got, plain)  # the SDPA forward rounds differently: the comparison above can fail


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2", "opt", "gpt_neox", "bloom", "falcon"])
@torch.no_grad()
def test_the_pattern_read_is_the_one_that_weighted_the_values(family):
    """z = pattern @ v bit for bit (the values repeated for grouped-query heads, as repeat_kv; Falcon's one key/value
    head broadcast), whatever kernel the plain forward uses."""
    model = build(family)
    hm = HookedModel(model)
    ids = token_batch(2, 20, seed=12)
    _, cache = hm.run_with_cache(ids, [f"blocks.1.attn.hook_{p}" for p in ("v", "pattern", "z")])
    pattern, v, z = (cache[f"blocks.1.attn.hook_{p}"] for p in ("pattern", "v", "z"))  # [B,H,T,T], [B,T,K,D], [B,T,H,D]
    values = v.transpose(1, 2)  # [B, K, T, D]
    heads = pattern.shape[1]
    if family != "falcon":
        values = repeat_kv(values, heads // values.shape[1])
    assert torch.equal(z, (pattern @ values).transpose(1, 2))
    assert float(pattern.sum(-1).sub(1).abs().max()) < 1e-5  # rows of a softmax: the pattern, not the scores


@torch.no_grad()
def test_a_left_padded_batch_gives_the_eager_forward_at_the_real_tokens():
    """Padding hides keys; every real query sees a real key, so at the real tokens the output from the pattern is the
    eager model's bit for bit (a padded query sees no key: its pattern row is 0, as TransformerLens's, where eager
    attention spreads it over the hidden keys; its output is not compared)."""
    model = randomize_norm_gains(build("llama"))
    hm = HookedModel(model)
    ids = token_batch(2, 16, seed=13)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    eager = eager_twin(model)(input_ids=ids, attention_mask=mask, use_cache=False).logits
    got = hm.run(ids, mask, hooks=_at(hm, "attn.hook_pattern"), logits=True).logits
    real = mask.bool()
    assert torch.equal(got[real], eager[real])
    assert_within_sdpa_rounding(got[real], model(input_ids=ids, attention_mask=mask, use_cache=False).logits[real])


@pytest.mark.parametrize("shape", [(2, 256, 12, 12, 64), (3, 37, 8, 2, 16), (2, 33, 6, 3, 80), (1, 300, 4, 4, 128),
                                   (1, 300, 4, 2, 96), (2, 9, 4, 4, 16)])
@torch.no_grad()
def test_the_eager_steps_are_transformers_eager_ops_bit_for_bit(shape):
    """The engine's eager steps on the head-strided q, k, v ([B, T, H, D] projections seen as [B, H, T, D], as the
    models hand them over) are transformers' eager operations (repeat_kv, matmul, the scaling and the mask in one
    pass: the same rounding as the scaling alone, plus 0 or -inf). Same floats, at a transformer's shape (MKL's packed
    kernels) and at small odd ones, grouped heads, and head widths whose scaling is not a power of 2. (2 x 9 tokens of
    4 heads of 16: where one bmm per sequence on the strided views, which the engine ran before, rounded otherwise on
    an AVX-512 CPU.)"""
    from poslens.engine.hooks import _dense_scores, _weigh

    b, t, h, kv, d = shape
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(b * t, h * d, generator=gen).view(b, t, h, d).transpose(1, 2)
    k, v = (torch.randn(b * t, kv * d, generator=gen).view(b, t, kv, d).transpose(1, 2) for _ in range(2))
    scaling = d**-0.5
    mask = torch.zeros(t, t).masked_fill_(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    k_rep, v_rep = repeat_kv(k, h // kv), repeat_kv(v, h // kv)
    eager = torch.matmul(q, k_rep.transpose(2, 3)) * scaling + mask
    assert torch.equal(_dense_scores(q, k, scaling, None, None, 0, {}), eager)
    bias = torch.randn(b, h, 1, t, generator=gen)  # an ALiBi-like per-key bias: added after the GEMM
    alibi = _dense_scores(q, k, scaling, None, None, 0, {}, bias)
    assert torch.equal(alibi, torch.add((bias + mask).expand(b, h, t, t), torch.matmul(q, k_rep.transpose(2, 3)),
                                        alpha=scaling))
    pattern = torch.softmax(eager, dim=-1)
    z = _weigh(pattern, v)
    assert z.is_contiguous() and torch.equal(z, torch.matmul(pattern, v_rep).transpose(1, 2).contiguous())
    with torch.enable_grad():  # autograd through q: the one-batch matmul form, differentiable
        qg = q.clone().requires_grad_()
        _dense_scores(qg, k, scaling, None, None, 0, {}).nan_to_num(0.0).sum().backward()
        assert qg.grad is not None and torch.isfinite(qg.grad).all()


@pytest.mark.parametrize("mask_kind", ["boolean", "additive"])
def test_hidden_keys_are_hidden_as_the_model_hides_them(mask_kind):
    """A hidden score that is NaN or +inf (a key written so by a hook, an overflow) ends as the model's eager steps
    leave it: the models that add their mask (transformers' eager attention, Falcon, BLOOM) keep it in the sum, so its
    query's row of the softmax is NaN in the model and here; the models that write over hidden scores (GPT-Neo's
    torch.where, MPT's masked_fill) hide it, and the row stays finite in both."""
    from poslens.engine.hooks import _hide

    t = 5
    seen = torch.ones(t, t, dtype=torch.bool).tril()[None, None]  # [1, 1, T, T], True where a key is seen
    minimum = torch.finfo(torch.float32).min
    model_mask = seen if mask_kind == "boolean" else torch.zeros(1, 1, t, t).masked_fill_(~seen, minimum)
    s = torch.randn(2, 3, t, t, generator=torch.Generator().manual_seed(1))
    s[0, 1, 1, 3], s[1, 2, 0, 4] = float("nan"), float("inf")  # hidden: key 3 of query 1, key 4 of query 0
    additive = torch.softmax(s + torch.zeros(1, 1, t, t).masked_fill_(~seen, minimum), dim=-1)  # Falcon, BLOOM, eager
    written = torch.softmax(torch.where(seen, s, minimum), dim=-1)  # GPT-Neo, MPT
    assert additive[0, 1, 1].isnan().all() and additive[1, 2, 0].isnan().all() and written.isfinite().all()
    ours = torch.softmax(_hide(s.clone(), model_mask, 0, {}), dim=-1)
    assert torch.equal(ours.isnan(), additive.isnan()) and torch.equal(ours.nan_to_num(), additive.nan_to_num())
    ours = torch.softmax(_hide(s.clone(), model_mask, 0, {}, replace=True), dim=-1)
    assert torch.equal(ours, written)
