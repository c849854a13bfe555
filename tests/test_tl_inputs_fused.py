"""TransformerLens's per-head attention inputs (hook_q_input, hook_k_input, hook_v_input, and hook_attn_in without
grouped-query attention) on the families whose q, k and v come from one fused projection or an OPT-style pre-norm:
GPT-NeoX, BLOOM, multi-head Falcon and multi-head GPT-BigCode (each head's [q | k | v] side by side), multi-query
Falcon and GPT-BigCode ([q heads | k | v]), Falcon's new architecture (groups of [q heads of the group | k | v]), MPT
([q | k | v]) and OPT (separate q/k/v with biases).

Against TransformerLens 3.9 where it has the family (GPT-NeoX, BLOOM, OPT: tests/reference/tl39_families_inputs.json,
made by tests/reference/make_tl_family_reference_inputs.py): the same write at each point gives TransformerLens's logits
and written projection within 2e-5 of the largest |value| (two float32 implementations of one model, as in
tests/test_family_tl.py). On every one, against a float64 recomputation from the fused weight's rows: a vector added to
one head's copy makes that head's q, k or v the LayerNorm of the edited copy times the head's rows (plus bias), within
1e-5 of the largest |value| (float32 projection of width 64), leaves the other heads as they were (1e-5: re-projected
per head in float32) and moves the logits exactly as writing that recomputed value at attn.hook_q/k/v does (1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_within_sdpa_rounding
from test_family_tl import assert_matches_summary, reference_model
from tiny_models import build, eager_twin, randomize_norm_gains, token_batch

from poslens.engine.hooks import HookedModel

REFERENCE = json.loads((Path(__file__).parent / "reference" / "tl39_families_inputs.json").read_text())
FAMILIES = ("gpt_neox", "bloom", "opt", "falcon", "falcon_rw", "falcon_new", "gpt_neo", "mpt", "gpt_bigcode",
            "gpt_bigcode_mha")
TOLERANCE = 2e-5


def _model(family):
    return randomize_norm_gains(build(family))


def shift(part: str, width: int) -> torch.Tensor:
    """The reference script's vector for `part` (make_tl_family_reference_inputs.shift)."""
    return torch.randn(width, generator=torch.Generator().manual_seed("qkv".index(part) + 20))


def _write(part: str, head: int, width: int):
    vector = shift(part, width)

    def fn(x, ctx):
        y = x.clone()
        y[:, :, head] += vector
        return y

    return fn


def _rows(model, layer: int, part: str, head: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W [D, d_model], b [D] or None) of one head's q, k or v, read from the model's own projection layout."""
    cfg, i = model.config, "qkv".index(part)
    h = cfg.num_attention_heads
    d = cfg.hidden_size // h
    if cfg.model_type in ("opt", "gpt_neo"):  # separate q, k, v (GPT-Neo's without biases, inside a wrapper)
        attn = model.model.decoder.layers[layer].self_attn if cfg.model_type == "opt" else \
            model.transformer.h[layer].attn.attention
        lin = getattr(attn, f"{part}_proj")
        return lin.weight.view(h, d, -1)[head], None if lin.bias is None else lin.bias.view(h, d)[head]
    if cfg.model_type == "mpt":  # Wqkv: [q | k | v], whole projections, no biases
        return model.transformer.blocks[layer].attn.Wqkv.weight.view(3, h, d, -1)[i, head], None
    blocks = model.gpt_neox.layers if cfg.model_type == "gpt_neox" else \
        model.transformer.blocks if cfg.model_type == "mpt" else model.transformer.h
    attn = blocks[layer].attention if cfg.model_type == "gpt_neox" else getattr(blocks[layer], "self_attention", None) \
        or blocks[layer].attn
    fused = getattr(attn, "query_key_value", None) or attn.c_attn  # GPT-BigCode: c_attn
    w, b = fused.weight, fused.bias
    if getattr(cfg, "new_decoder_architecture", False):  # Falcon-40b: K groups of (H/K query heads, k, v), no biases
        g = h // cfg.num_kv_heads
        grouped = w.view(cfg.num_kv_heads, g + 2, d, -1)
        return (grouped[head // g, head % g] if part == "q" else grouped[head, g + i - 1]), None
    if getattr(cfg, "multi_query", False):  # Falcon, GPT-BigCode: [q heads | k | v]
        start = head * d if part == "q" else (h + i - 1) * d
        return w[start:start + d], None if b is None else b[start:start + d]
    return w.view(h, 3, d, -1)[head, i], None if b is None else b.view(h, 3, d)[head, i]


def _layer_norm64(module, x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    y = (x - mean) / (var + module.eps).sqrt() * module.weight.double()
    return y if module.bias is None else y + module.bias.double()  # (MPT's: no bias)


def _heads(hm, part: str) -> int:
    return hm.model.config.num_attention_heads if part == "q" else hm._heads[1]


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_inputs_are_per_head_copies_and_reading_them_changes_nothing(family):
    model = _model(family)
    hm = HookedModel(model)
    hm.set_use_split_qkv_input(True)
    h, kv = hm._heads
    if h == kv:
        hm.set_use_attn_in(True)
    ids = token_batch(2, 9, seed=5)
    logits, cache = hm.run_with_cache(ids)  # the cache holds the pattern: the output from it, as eager attention
    if getattr(model.config, "alibi", False):  # transformers' eager Falcon adds ALiBi twice: SDPA's, within rounding
        assert_within_sdpa_rounding(logits, model(input_ids=ids, use_cache=False).logits, family)
    else:
        assert torch.equal(logits, eager_twin(model)(input_ids=ids, use_cache=False).logits)
    points = ["hook_q_input", "hook_k_input", "hook_v_input"] + (["hook_attn_in"] if h == kv else [])
    for point in points:
        x = cache[f"blocks.1.{point}"]
        heads = kv if point in ("hook_k_input", "hook_v_input") else h
        assert x.shape == (2, 9, heads, model.config.hidden_size), point
        assert torch.equal(x, cache["blocks.1.hook_resid_pre"][:, :, None].expand_as(x)), point


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("part", ["q", "k", "v"])
@torch.no_grad()
def test_a_write_to_one_heads_copy_is_that_heads_projection_in_float64(family, part):
    model = _model(family)
    hm = HookedModel(model)
    ids = token_batch(2, 10, seed=6)
    head = min({"q": 2, "k": 1, "v": 0}[part], _heads(hm, part) - 1)
    point = f"blocks.1.attn.hook_{part}"
    seen = {}
    keep = lambda key: lambda x, ctx: seen.setdefault(key, x.clone())  # noqa: E731
    plain = hm.run(ids, hooks={point: keep("before"), "blocks.1.hook_resid_pre": keep("resid")}, logits=True).logits
    got = hm.run(ids, hooks={f"blocks.1.hook_{part}_input": _write(part, head, model.config.hidden_size),
                             point: keep("after")}, logits=True).logits
    w, b = _rows(model, 1, part, head)
    copy = seen["resid"].double() + shift(part, model.config.hidden_size).double()
    want = _layer_norm64(hm.norm_module("blocks.1.ln1"), copy) @ w.double().T + (0 if b is None else b.double())
    after, before = seen["after"].double(), seen["before"].double()
    assert (after[:, :, head] - want).abs().max() <= 1e-5 * want.abs().max()
    others = [i for i in range(after.shape[2]) if i != head]  # (none: multi-query Falcon's one key/value head)
    if others:
        assert (after[:, :, others] - before[:, :, others]).abs().max() <= 1e-5 * before.abs().max()
    assert (got - plain).abs().max() > 1e-4 * plain.abs().max()  # the write moved the logits (10 x the tolerance)

    def put(x, ctx):
        y = x.clone()
        y[:, :, head] = want.to(y.dtype)
        return y

    same = hm.run(ids, hooks={point: put}, logits=True).logits
    assert (got - same).abs().max() <= 1e-5 * same.abs().max()


@pytest.mark.parametrize("family", sorted(REFERENCE["families"]))
@torch.no_grad()
def test_writes_give_transformer_lens_logits_and_projections(family):
    ref = REFERENCE["families"][family]
    assert REFERENCE["transformer_lens"].startswith("3.9")
    model = reference_model(family, ref)
    hm = HookedModel(model)
    hm.set_use_split_qkv_input(True)
    ids = torch.tensor(ref["ids"])
    layer = ref["write_layer"]
    logits, cache = hm.run_with_cache(ids)
    assert_matches_summary(logits, ref["logits"], "logits")
    for part, shape in ref["shapes"].items():
        assert list(cache[f"blocks.{layer}.hook_{part}_input"].shape) == shape
    for part, written in ref["writes"].items():
        point, seen = f"blocks.{layer}.attn.hook_{part}", {}
        got = hm.run(ids, hooks={f"blocks.{layer}.hook_{part}_input": _write(part, ref["heads"][part],
                                                                             model.config.hidden_size),
                                 point: lambda x, ctx, seen=seen: seen.setdefault("x", x.clone())},
                     logits=True).logits
        assert_matches_summary(got, written["logits"], f"{part}_input: logits")
        assert_matches_summary(seen["x"], written[point], f"{part}_input: {point}")
        # the write moved every logit as it moved TransformerLens's, by far more than the tolerance
        scale = ref["logits"]["abs_max"]
        assert abs(float((got - logits).abs().max()) - written["max_logit_change"]) <= 2 * TOLERANCE * scale
        assert written["max_logit_change"] > 30 * TOLERANCE * scale


@pytest.mark.parametrize("family", ["gpt_neox", "bloom", "opt", "falcon"])
@torch.no_grad()
def test_an_in_place_edit_of_a_copy_acts_as_the_returned_clone(family):
    """TransformerLens's in-place idiom (x[:, :, h] += v, nothing returned) at each input point gives the logits of the
    same edit on a returned clone, bit for bit (the same copy reaches the same projection), and moves them."""
    model = _model(family)
    hm = HookedModel(model)
    ids = token_batch(2, 8, seed=9)
    plain = hm.run(ids, logits=True).logits
    for part in "qkv":
        head = min(1, _heads(hm, part) - 1)
        vector = shift(part, model.config.hidden_size)

        def in_place(x, ctx, head=head, vector=vector):
            x[:, :, head] += vector

        point = f"blocks.0.hook_{part}_input"
        a = hm.run(ids, hooks={point: in_place}, logits=True).logits
        b = hm.run(ids, hooks={point: _write(part, head, model.config.hidden_size)}, logits=True).logits
        assert torch.equal(a, b) and (a - plain).abs().max() > 1e-4 * plain.abs().max(), part
