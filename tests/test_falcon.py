"""Falcon's rotary form (falcon-7b: multi-query, parallel attention and MLP; and its serial and multi-head forms) in
the hook engine, against Hugging Face's own forward of the same tiny random model: the hooked forward's logits equal
the eager forward's bit for bit with a reader on every point (attention's output computed from the pattern read, as
the eager attention computes it, under the model's SDPA and eager implementations: poslens runs its own copy of
Falcon's attention, which is not transformers' attention interface) and the plain forward's without a reader of the
scores or the pattern, `blocks.{l}.hook_resid_pre` equals Hugging Face's hidden states, `attn.hook_pattern` its eager
attentions (within 1e-5: probabilities in [0, 1] from float32 softmaxes of the same scores), and values written
at the points reach the output as the same edit of the weights does in Hugging Face's forward. TransformerLens 3.9
has no Falcon, so there is no TransformerLens reference (docs/families.md)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_within_sdpa_rounding
from test_alibi import assert_config_refused
from tiny_models import build, config, eager_twin, heads_summed_twin, randomize_norm_gains, token_batch
from transformers.models.falcon import modeling_falcon

from poslens.analyses.length.interventions import parse
from poslens.engine.families import (
    attention_implementation,
    family_of,
    positional_encoding,
    positional_encoding_record,
    set_positional_encoding,
)
from poslens.engine.hooks import HookedModel
from poslens.engine.tl_weights import layer_attn_weight
from poslens.errors import UsageError

FORMS = {"falcon-7b": {}, "multi-head": {"multi_query": False}, "serial": {"parallel_attn": False},
         "serial multi-head, biases": {"parallel_attn": False, "multi_query": False, "bias": True}}


@pytest.mark.parametrize("form", sorted(FORMS))
@torch.no_grad()
def test_hooked_forward_equals_hugging_face(form):
    sdpa = randomize_norm_gains(build("falcon", **FORMS[form]))
    eager = eager_twin(sdpa)
    ids = token_batch(2, 16, seed=3)
    # the reference: eager attention, W_O's output the per-head results' sum (as TransformerLens computes it)
    reference = heads_summed_twin(sdpa)(input_ids=ids, use_cache=False, output_hidden_states=True,
                                        output_attentions=True)
    for model in (sdpa, eager):
        hm = HookedModel(model)
        plain = model(input_ids=ids, use_cache=False, output_hidden_states=True)
        # every point read: the patterns are formed and attention's output is computed from them as the model's eager
        # attention computes it, W_O's output from the per-head results read (bit-identical to the reference, under
        # either implementation); without a reader of the scores, the pattern or the results, the model's own
        # kernels: bit-identical to its plain forward
        logits, cache = hm.run_with_cache(ids, hm.points)
        assert torch.equal(logits, reference.logits), model.config._attn_implementation
        no_pattern = [p for p in hm.points if not p.endswith(("attn.hook_attn_scores", "attn.hook_pattern",
                                                                  "attn.hook_result"))]
        assert torch.equal(hm.run_with_cache(ids, no_pattern)[0], plain.logits), model.config._attn_implementation
        for l in range(hm.n_layers):
            assert torch.equal(cache[f"blocks.{l}.hook_resid_pre"], reference.hidden_states[l])
            assert (cache[f"blocks.{l}.attn.hook_pattern"] - reference.attentions[l]).abs().max() < 1e-5
        kv = 1 if model.config.multi_query else 4
        assert cache["blocks.0.attn.hook_q"].shape == (2, 16, 4, 16)
        assert cache["blocks.0.attn.hook_k"].shape == cache["blocks.0.attn.hook_v"].shape == (2, 16, kv, 16)
    assert positional_encoding(sdpa) == ["rope"] * 3
    assert family_of(sdpa.config).layout == ("pre-norm" if "serial" in form else "parallel")


@pytest.mark.parametrize("form", ["falcon-7b", "serial multi-head, biases"])
@torch.no_grad()
def test_writes_act_as_the_same_edit_of_the_weights(form):
    """Zeros written at attn.hook_k of layer 1 are Hugging Face's forward with that layer's key rows of
    query_key_value zeroed (and their biases): every score 0, uniform causal attention; zeros written at attn.hook_z
    of layer 2 are that layer's dense projection zeroed (no bias) or left with its bias only. Within 1e-6 of the
    largest logit (float32 rounding of the same operations); each edit moves the logits by far more (> 1e-2)."""
    model = randomize_norm_gains(build("falcon", **FORMS[form]))
    hm = HookedModel(model)
    ids = token_batch(2, 12, seed=4)
    plain = model(input_ids=ids, use_cache=False).logits
    heads, d = 4, 16
    for point, edit in (("blocks.1.attn.hook_k", _zero_keys), ("blocks.2.attn.hook_z", _zero_dense)):
        written = hm.run(ids, hooks={point: lambda x, ctx: torch.zeros_like(x)}, logits=True).logits
        edited = copy.deepcopy(model)
        edit(edited, heads, d)
        expected = edited(input_ids=ids, use_cache=False).logits
        assert (written - expected).abs().max() <= 1e-6 * expected.abs().max(), point
        assert (written - plain).abs().max() > 1e-2, point


def _zero_keys(model, heads: int, d: int) -> None:
    attn = model.transformer.h[1].self_attention
    rows = attn.query_key_value.weight
    if attn.multi_query:  # [q heads | k | v]
        sl = slice(heads * d, (heads + 1) * d)
        rows[sl] = 0
        if attn.query_key_value.bias is not None:
            attn.query_key_value.bias[sl] = 0
    else:  # [q | k | v] within each head
        rows.unflatten(0, (heads, 3, d))[:, 1] = 0
        if attn.query_key_value.bias is not None:
            attn.query_key_value.bias.unflatten(0, (heads, 3, d))[:, 1] = 0


def _zero_dense(model, heads: int, d: int) -> None:
    model.transformer.h[2].self_attention.dense.weight.zero_()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"new_decoder_architecture": True, "num_kv_heads": 2, "alibi": True},
     "Falcon with new_decoder_architecture=True and alibi=True is not supported"),
])
def test_falcon_forms_not_built_are_refused_in_one_line(overrides, message, tmp_path, capsys):
    """The library raises a one-line UsageError naming the supported forms; the CLI exits 2 with that one line and
    writes no run directory."""
    with pytest.raises(UsageError) as err:
        family_of(config("falcon", **overrides))
    text = str(err.value)
    assert message in text and "\n" not in text
    assert_config_refused("falcon", overrides, message, tmp_path, capsys)


@pytest.mark.parametrize("form", ["falcon-7b", "serial multi-head, biases"])
@torch.no_grad()
def test_weights_in_transformer_lens_layout_give_the_hooked_q_k_v(form):
    """W_Q, W_K, W_V [heads, d_model, D] and their biases are views of the fused query_key_value that give, from
    ln1.hook_out, exactly what attn.hook_q/k/v hold (unexpanded: multi-query's one key/value head; W_K repeats it to
    the query heads as TransformerLens's); cfg.n_key_value_heads says so. Within 1e-5 of the largest |value| (the
    same float32 products summed in another order)."""
    model = randomize_norm_gains(build("falcon", **FORMS[form]))
    hm = HookedModel(model)
    ids = token_batch(2, 10, seed=6)
    _, cache = hm.run_with_cache(ids, [f"blocks.1.{p}" for p in ("ln1.hook_out", "attn.hook_q", "attn.hook_k",
                                                                 "attn.hook_v")])
    kv = 1 if model.config.multi_query else 4
    assert hm.cfg.n_key_value_heads == kv and hm.cfg.d_mlp == 256
    x = cache["blocks.1.ln1.hook_out"]
    for which, point in enumerate("qkv"):
        w, b = (layer_attn_weight(model, 1, which, bias, expand=False) for bias in (False, True))
        got = cache[f"blocks.1.attn.hook_{point}"]
        want = torch.einsum("btm,hmd->bthd", x, w) + b
        assert (got - want).abs().max() <= 1e-5 * got.abs().max(), point
    assert torch.equal(hm.W_K[1], layer_attn_weight(model, 1, 1, expand=False).repeat_interleave(4 // kv, 0))
    assert torch.equal(hm.W_Q[1], layer_attn_weight(model, 1, 0))


# ---- the ALiBi form (falcon-rw: alibi=True, serial, multi-head, biases) ----
# Falcon adds slope_h * j to q.k before the 1/sqrt(D) scaling, so its bias in the scores is slope_h (j - i) / sqrt(D)
# (TransformerLens's relative form, a constant per query away from the model's). transformers' eager Falcon adds the
# bias twice (in the scores and again in the mask; SDPA once, as falcon-rw was trained), so the eager reference below
# is Hugging Face's eager forward with its bias builder halved (exact: a power of 2).


def _builder_times(monkeypatch, factor: float) -> None:
    """Hugging Face's Falcon with its ALiBi tensor times `factor`, where transformers builds it."""
    original = getattr(modeling_falcon, "poslens_build_alibi_tensor", modeling_falcon.build_alibi_tensor)
    monkeypatch.setattr(modeling_falcon, "build_alibi_tensor", lambda *a, **k: original(*a, **k) * factor)


@torch.no_grad()
def test_alibi_form_hooked_forward_equals_hugging_face(monkeypatch):
    model = randomize_norm_gains(build("falcon_rw"))
    hm = HookedModel(model)
    ids = token_batch(2, 16, seed=3)
    plain = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    logits, cache = hm.run_with_cache(ids, hm.points)
    # every point read: attention's output from the pattern (no eager reference: transformers' eager Falcon adds the
    # ALiBi bias twice), W_O's output the per-head results' sum, within rounding of the SDPA forward; without a reader
    # of the scores, the pattern or the results, bit-identical to it
    assert_within_sdpa_rounding(logits, plain.logits, "falcon-rw, every point read")
    no_pattern = [p for p in hm.points if not p.endswith(("attn.hook_attn_scores", "attn.hook_pattern",
                                                          "attn.hook_result"))]
    assert torch.equal(hm.run_with_cache(ids, no_pattern)[0], plain.logits)
    eager = eager_twin(model)
    _builder_times(monkeypatch, 0.5)
    reference = eager(input_ids=ids, use_cache=False, output_attentions=True).attentions
    monkeypatch.undo()
    for l in range(hm.n_layers):
        assert_within_sdpa_rounding(cache[f"blocks.{l}.hook_resid_pre"], plain.hidden_states[l], f"layer {l}")
        assert (cache[f"blocks.{l}.attn.hook_pattern"] - reference[l]).abs().max() < 1e-5
    assert positional_encoding(model) == ["alibi"] * 3
    assert "blocks.0.attn.hook_rot_q" not in hm.points


@torch.no_grad()
def test_alibi_form_scores_minus_the_bias_are_the_plain_qk_scores(monkeypatch):
    """attn.hook_attn_scores minus ctx.score_bias, slope_h (j - i) / sqrt(D) from the slopes run.json records, is q.k /
    sqrt(D) recomputed in float64 from hook_q and hook_k (within 1e-5 of the largest score: float32 rounding of one
    GEMM); the bias written away at every layer gives Hugging Face's logits with the bias 0 (within 1e-5 of the
    largest logit: softmaxes of the same scores)."""
    model = randomize_norm_gains(build("falcon_rw"))
    hm = HookedModel(model)
    slopes = torch.tensor(positional_encoding_record(model)["alibi_slopes"], dtype=torch.float64)
    ids = token_batch(2, 12, seed=4)
    kept = {}
    hm.run(ids, hooks={"blocks.1.attn.hook_q": lambda x, ctx: kept.setdefault("q", x.double()),
                       "blocks.1.attn.hook_k": lambda x, ctx: kept.setdefault("k", x.double()),
                       "blocks.1.attn.hook_attn_scores": lambda x, ctx: kept.update(
                           scores=x.double(), bias=ctx.score_bias.double())})
    plain = torch.einsum("bihd,bjhd->bhij", kept["q"], kept["k"]) / 16**0.5
    pos = torch.arange(12, dtype=torch.float64)
    bias = slopes[:, None, None] * (pos[None, None, :] - pos[None, :, None]) / 16**0.5
    lower = torch.ones(12, 12, dtype=torch.bool).tril()
    assert (kept["bias"][..., lower] - bias[..., lower]).abs().max() <= 1e-6
    scores = kept["scores"]
    assert bool(torch.isneginf(scores[..., ~lower]).all())
    assert ((scores - bias)[..., lower] - plain[..., lower]).abs().max() <= 1e-5 * plain.abs().max()
    unbiased = hm.run(ids, hooks={f"blocks.{l}.attn.hook_attn_scores": lambda x, ctx: x - ctx.score_bias
                                  for l in range(hm.n_layers)}, logits=True).logits
    _builder_times(monkeypatch, 0.0)
    reference = model(input_ids=ids, use_cache=False).logits
    monkeypatch.undo()
    assert (unbiased - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert (unbiased - model(input_ids=ids, use_cache=False).logits).abs().max() > 1e-3 * reference.abs().max()


@pytest.mark.parametrize("factor", [0.5, 0.0])
@torch.no_grad()
def test_alibi_scale_and_pe_none_are_the_model_with_the_bias_scaled(factor, monkeypatch):
    """length's alibi-scale:F (and --pe none, F = 0, for the model's lifetime) equal Hugging Face's forward with its
    ALiBi tensor times F (within 1e-6 of the largest logit: the same float32 operations, F a power of 2 or 0); the
    scaling is undone after the block."""
    model = build("falcon_rw")
    hm = HookedModel(model)
    ids = token_batch(2, 16, seed=3)
    plain = model(input_ids=ids, use_cache=False).logits
    _builder_times(monkeypatch, factor)
    want = model(input_ids=ids, use_cache=False).logits
    monkeypatch.undo()
    if factor:
        with parse(f"alibi-scale:{factor}", 8).applied(hm, ids) as p:
            got = hm.run(p.ids, p.attention_mask, hooks=p.hooks, position_ids=p.position_ids, logits=True).logits
        assert torch.equal(hm.run(ids, logits=True).logits, plain)
    else:
        set_positional_encoding(model, "none")
        got = hm.run(ids, logits=True).logits
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, got)
        assert positional_encoding(model) == ["none"] * 3
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    assert (plain - want).abs().max() > 1e-3 * want.abs().max()


def test_alibi_form_under_eager_attention_is_refused_in_one_line():
    with pytest.raises(UsageError, match="transformers' eager Falcon adds the ALiBi bias twice") as err:
        HookedModel(eager_twin(build("falcon_rw")))
    assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match="use sdpa"):
        attention_implementation(config("falcon_rw"), "eager")
    assert attention_implementation(config("falcon_rw"), "sdpa") == "sdpa"


@pytest.mark.parametrize("lns", [2, 1])
@torch.no_grad()
def test_the_new_architecture_grouped_heads_and_its_norms(lns):
    """Falcon's new decoder architecture (falcon-40b, falcon-180b: two norms, ln_attn and ln_mlp; falcon-11B: one,
    num_ln_in_parallel_attn=1): the fused rows are K groups of (H/K query heads, one key, one value); hook_k and
    hook_v keep the K heads (TransformerLens's grouped-query convention) and hold those rows' projections, hook_q the
    query heads in order (1e-5 of the largest, against the rows read here from the weight); _W_K is a view of the key
    rows whose edit reaches the model as editing the parameter does, bit for bit; ln1 and ln2 are the two norms, or
    the one norm twice; every point read keeps the logits (the eager twin with W_O's heads summed)."""
    model = randomize_norm_gains(build("falcon_new", num_ln_in_parallel_attn=lns))
    twin = copy.deepcopy(model)
    hm = HookedModel(model)
    assert (hm.family.ln1, hm.family.ln2) == (("ln_attn", "ln_mlp") if lns == 2 else ("input_layernorm",) * 2)
    ids = token_batch(2, 9, seed=4)
    logits, cache = hm.run_with_cache(ids, hm.points)
    assert torch.equal(logits, heads_summed_twin(model, "eager")(input_ids=ids, use_cache=False).logits)
    rows = model.transformer.h[1].self_attention.query_key_value.weight.view(2, 4, 16, 64)  # [K, q, q, k, v] x D
    x = cache["blocks.1.ln1.hook_out"]
    q = torch.einsum("btm,kgdm->btkgd", x, rows[:, :2]).flatten(2, 3)
    k, v = (torch.einsum("btm,kdm->btkd", x, rows[:, i]) for i in (2, 3))
    for name, want in (("q", q), ("k", k), ("v", v)):
        got = cache[f"blocks.1.attn.hook_{name}"]
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max(), name
    assert torch.equal(hm.blocks[1].attn._W_K[1], rows[1, 2].T) and torch.equal(hm.W_K[1, 3], rows[1, 2].T)
    before = hm(ids)
    hm.blocks[1].attn._W_K[1].zero_()
    twin.transformer.h[1].self_attention.query_key_value.weight.view(2, 4, 16, 64)[1, 2].zero_()
    after = hm(ids)
    assert torch.equal(after, twin(input_ids=ids).logits) and not torch.equal(after, before)
