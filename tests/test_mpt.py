"""MPT (mpt-7b, mpt-30b): ALiBi as transformers' MPT builds it (a bias relative to the last key, for max_seq_len
keys), LayerNorms without biases, a fused Wqkv [q | k | v], optional clip_qkv. Checked here: the slopes against BLOOM's
function (an independent implementation of Press et al.'s sequence), the scores' bias in TransformerLens's form, the
model past max_seq_len (where transformers' own forward fails) against a model whose config allows the length,
clip_qkv, W_Q as a view of Wqkv, the forms transformers' MPT would not run as configured refused in one line. The
family-parametrised tests (maps against a float64 reference, padded batches, cached generation, in-place edits, the
analyses end to end, window masks against a float64 ALiBi forward; slope scaling and `--pe none` against transformers
with its bias builder scaled, in tests/test_alibi.py) run on it too."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_alibi import _saved, assert_config_refused
from tiny_models import build, token_batch
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

from poslens import cli
from poslens.engine.families import positional_encoding_record
from poslens.engine.hooks import HookedModel


@pytest.mark.parametrize("heads", [4, 6])
def test_slopes_are_press_et_al_s_sequence_as_bloom_computes_it(heads):
    """The slopes run.json records for MPT equal BLOOM's function's for the same head count (the interleaved extension
    for 6 heads included) and, for a power of two, 2^(-8 h / H)."""
    model = build("mpt", hidden_size=16 * heads, num_attention_heads=heads)
    slopes = torch.tensor(positional_encoding_record(model)["alibi_slopes"])
    assert torch.equal(slopes, _get_alibi_slopes(heads, torch.device("cpu")).float())
    if heads == 4:
        assert torch.equal(slopes, 2.0 ** (-8.0 * torch.arange(1, 5) / 4))


@torch.no_grad()
def test_scores_carry_the_bias_in_transformer_lens_form_and_minus_it_are_q_dot_k():
    """attn.hook_attn_scores is q.k * softmax_scale + slope_h * (j - i) (ctx.score_bias: zero on the diagonal, the
    model's own bias relative to the last key moved by a constant per query); minus ctx.score_bias it is q.k times
    the scaling from hook_q and hook_k (1e-5 of the largest: float32 products in another order)."""
    hm = HookedModel(build("mpt"))
    ids = token_batch(2, 12, seed=1)
    seen = {}

    def scores(x, ctx):
        seen.update(scores=x.clone(), bias=ctx.score_bias.clone(), scaling=ctx.scaling)

    hm.run(ids, hooks={"blocks.1.attn.hook_q": lambda x, ctx: seen.update(q=x.clone()),
                       "blocks.1.attn.hook_k": lambda x, ctx: seen.update(k=x.clone()),
                       "blocks.1.attn.hook_attn_scores": scores})
    slopes = torch.tensor(positional_encoding_record(hm.model)["alibi_slopes"])
    pos = torch.arange(12.0)
    assert torch.allclose(seen["bias"].expand(2, 4, 12, 12),
                          (slopes[:, None, None] * (pos[None] - pos[:, None])).expand(2, 4, 12, 12), atol=1e-6)
    qk = torch.einsum("bihd,bjhd->bhij", seen["q"], seen["k"]) * seen["scaling"]
    lower = torch.ones(12, 12, dtype=torch.bool).tril()
    got = (seen["scores"] - seen["bias"])[..., lower]
    assert (got - qk[..., lower]).abs().max() <= 1e-5 * qk[..., lower].abs().max()


@torch.no_grad()
def test_past_max_seq_len_the_model_runs_as_with_a_config_that_allows_the_length():
    """transformers' MPT builds its ALiBi tensor for max_seq_len keys and fails past it; the hook engine builds it for
    the keys by the model's own function, the values a config with a larger max_seq_len gives: bit for bit."""
    model = build("mpt")
    ids = token_batch(1, 80, seed=2)
    with pytest.raises(RuntimeError):
        model(input_ids=ids)
    twin = copy.deepcopy(model)
    twin.config.max_seq_len = 80
    want = twin(input_ids=ids).logits
    assert torch.equal(HookedModel(model).run(ids, logits=True).logits, want)
    every = {f"blocks.{l}.attn.hook_pattern": lambda x, ctx: None for l in range(3)}
    assert torch.equal(HookedModel(model).run(ids, hooks=every, logits=True).logits, want)  # the copy's eager steps


@torch.no_grad()
def test_clip_qkv_is_run_and_hook_q_sees_the_clamped_values():
    """With clip_qkv the hooked forward, every attention point read, equals the model's bit for bit; hook_q holds
    values within the clip; the clip changes the model (so the comparison can fail)."""
    clipped = build("mpt", attn_config={"clip_qkv": 0.3})
    model = build("mpt")
    ids = token_batch(2, 10, seed=6)
    want = clipped(input_ids=ids).logits
    assert not torch.allclose(want, model(input_ids=ids).logits, atol=1e-3)
    seen = {}
    hooks = {f"blocks.{l}.attn.{p}": (lambda x, ctx: seen.setdefault(ctx.name, x.clone()))
             for l in range(3) for p in ("hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z")}
    assert torch.equal(HookedModel(clipped).run(ids, hooks=hooks, logits=True).logits, want)
    assert seen["blocks.0.attn.hook_q"].abs().max() <= 0.3
    assert seen["blocks.0.attn.hook_q"].abs().max() == pytest.approx(0.3)  # the clamp bit


@torch.no_grad()
def test_w_q_is_a_view_of_wqkv_whose_edits_reach_the_model():
    """blocks[l].attn.W_Q [heads, d_model, d_head] is a view of the first third of Wqkv: zeroing head 2 in it moves the
    logits exactly as zeroing those rows of the Hugging Face parameter does."""
    model = build("mpt")
    twin = copy.deepcopy(model)
    hm = HookedModel(model)
    ids = token_batch(2, 7)
    before = model(input_ids=ids).logits
    hm.blocks[1].attn.W_Q[2] = 0
    twin.transformer.blocks[1].attn.Wqkv.weight[2 * 16:3 * 16] = 0
    assert torch.equal(model.transformer.blocks[1].attn.Wqkv.weight, twin.transformer.blocks[1].attn.Wqkv.weight)
    after = hm(ids)
    assert not torch.equal(after, before) and torch.equal(after, twin(input_ids=ids).logits)


@pytest.mark.parametrize(("attn_config", "message"), [
    ({"alibi": False}, "MPT with attn_config.alibi=False is not supported"),
    ({"qk_ln": True}, "MPT with attn_config.qk_ln=True is not supported"),
    ({"prefix_lm": True}, "MPT with attn_config.prefix_lm=True is not supported"),
    ({"alibi_bias_max": 16}, "MPT with attn_config.alibi_bias_max=16 is not supported"),
])
def test_forms_transformers_would_not_run_as_configured_are_refused_in_one_line(attn_config, message, tmp_path,
                                                                                capsys):
    assert_config_refused("mpt", {"attn_config": attn_config}, message, tmp_path, capsys)


def test_length_runs_past_max_seq_len(tmp_path):
    """`length` on an MPT whose max_seq_len is 64 evaluates 128 tokens (ALiBi has no table; transformers' forward
    alone would fail there), with slope scaling offered; run.json records the lengths."""
    out = tmp_path / "out"
    assert cli.main(["length", _saved("mpt", tmp_path / "m"), "--train-len", "32", "--eval-lens", "32,128",
                     "--interventions", "alibi-scale", "--num-sequences", "4", "--batch-size", "2", "--quiet",
                     "--no-figures", "--out", str(out)]) == 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["model"]["positional_encoding"] == ["alibi"] * 3
    assert "alibi-scale" in meta["metrics"]["interventions"]


@torch.no_grad()
def test_config_and_weights_read_as_transformer_lens_names_them():
    """hm.cfg: ALiBi, LayerNorms, the exact GELU (MPT's nn.GELU(): the MLP's output equals act_fn's), n_ctx the
    config's max_seq_len, d_mlp W_in's width; a LayerNorm without a bias reads b as zeros (as TransformerLens's)."""
    model = build("mpt")
    hm = HookedModel(model)
    cfg = hm.cfg
    assert (cfg.positional_embedding_type, cfg.normalization_type, cfg.act_fn, cfg.n_ctx) == ("alibi", "LN", "gelu",
                                                                                               64)
    assert hm.W_in.shape == (3, 64, cfg.d_mlp) and cfg.d_mlp == 256
    x = torch.randn(5, cfg.d_mlp)
    assert torch.equal(model.transformer.blocks[0].ffn.act(x), torch.nn.functional.gelu(x))
    assert torch.equal(hm.blocks[0].ln1.b, torch.zeros(64)) and torch.equal(hm.blocks[0].ln1.w,
                                                                             model.transformer.blocks[0].norm_1.weight)
