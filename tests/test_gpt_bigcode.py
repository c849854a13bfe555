"""GPT-BigCode (StarCoder, SantaCoder, starcoderbase): GPT-2's learned table and LayerNorms with Linear projections and
multi-query attention (one key/value head, c_attn [q heads | k | v]), or its multi-head form (each head's [q | k | v]
side by side). Checked here: the key/value head count in the points and weights, W_Q and W_K as views of c_attn whose
edits reach the model, the table (hook_pos_embed, zeros there are the table zeroed), q.k without the 1/sqrt(d)
scaling when scale_attn_weights is off, what the table cannot do refused in one line. The family-parametrised tests
(bit-identical forwards, maps against a float64 reference, padded batches, cached generation, in-place edits, the
per-head inputs against float64 projections, the analyses end to end) run on both forms."""

from __future__ import annotations

import copy

import pytest
import torch
from test_alibi import assert_config_refused
from test_family_runs import _saved
from test_family_tl import assert_zeros_at_hook_pos_embed_are_the_table_zeroed
from tiny_models import build, randomize_norm_gains, token_batch

from poslens import cli
from poslens.engine.hooks import HookedModel


@pytest.mark.parametrize(("family", "kv"), [("gpt_bigcode", 1), ("gpt_bigcode_mha", 4)])
@torch.no_grad()
def test_key_value_heads_in_points_and_weights(family, kv):
    """hook_k and hook_v have one head (multi-query) or one per query head; W_K repeats the key head for every query
    head as TransformerLens's, _W_K keeps it; cfg.n_key_value_heads says which; the table is `standard`."""
    hm = HookedModel(build(family))
    _, cache = hm.run_with_cache(token_batch(2, 9), ["blocks.0.attn.hook_k", "blocks.0.attn.hook_v"])
    assert cache["blocks.0.attn.hook_k"].shape == (2, 9, kv, 16) == cache["blocks.0.attn.hook_v"].shape
    assert hm.cfg.n_key_value_heads == kv and hm.cfg.positional_embedding_type == "standard"
    assert hm.W_K.shape == (3, 4, 64, 16) and hm.blocks[0].attn._W_K.shape == (kv, 64, 16)
    assert torch.equal(hm.W_K[0, 3], hm.blocks[0].attn._W_K[3 if kv == 4 else 0])


@pytest.mark.parametrize("family", ["gpt_bigcode", "gpt_bigcode_mha"])
@torch.no_grad()
def test_w_q_and_w_k_are_views_of_c_attn_whose_edits_reach_the_model(family):
    """Zeroing head 2 of W_Q and the first key head of _W_K moves the logits exactly as zeroing those rows of c_attn
    (their place in the layout written out here) does."""
    model = build(family)
    twin = copy.deepcopy(model)
    hm = HookedModel(model)
    ids = token_batch(2, 7)
    before = model(input_ids=ids).logits
    hm.blocks[1].attn.W_Q[2] = 0
    hm.blocks[1].attn._W_K[0] = 0
    rows = twin.transformer.h[1].attn.c_attn.weight
    if family == "gpt_bigcode":  # [q heads (64) | k (16) | v (16)]
        rows[32:48] = 0
        rows[64:80] = 0
    else:  # each head's [q | k | v]: head h's q at 48 h, its k at 48 h + 16
        rows[96:112] = 0
        rows[16:32] = 0
    assert torch.equal(model.transformer.h[1].attn.c_attn.weight, rows)
    after = hm(ids)
    assert not torch.equal(after, before) and torch.equal(after, twin(input_ids=ids).logits)


@torch.no_grad()
def test_hook_pos_embed_is_the_table_and_zeros_there_are_the_table_zeroed():
    model = randomize_norm_gains(build("gpt_bigcode"))
    hm = HookedModel(model)
    ids = token_batch(2, 12, seed=4)
    _, cache = hm.run_with_cache(ids, ["hook_pos_embed", "hook_embed", "blocks.0.hook_resid_pre"])
    table = model.transformer.wpe.weight
    assert torch.equal(cache["hook_pos_embed"], table[:12].expand(2, 12, -1)) and torch.equal(hm.W_pos, table)
    assert torch.equal(cache["blocks.0.hook_resid_pre"], cache["hook_embed"] + cache["hook_pos_embed"])
    assert_zeros_at_hook_pos_embed_are_the_table_zeroed(model, hm, ids, table)


@torch.no_grad()
def test_unscaled_scores_are_q_dot_k():
    """scale_attn_weights=False: ctx.scaling 1 and the scores q.k from hook_q and hook_k (the key head shared by every
    query head; 1e-5 of the largest: float32 products in another order); the logits stay the model's."""
    model = build("gpt_bigcode", scale_attn_weights=False)
    hm = HookedModel(model)
    ids = token_batch(1, 10, seed=2)
    seen = {}
    hooks = {"blocks.1.attn.hook_q": lambda x, ctx: seen.update(q=x.clone()),
             "blocks.1.attn.hook_k": lambda x, ctx: seen.update(k=x.clone()),
             "blocks.1.attn.hook_attn_scores": lambda x, ctx: seen.update(s=x.clone(), scaling=ctx.scaling)}
    hm.run(ids, hooks=hooks)
    qk = torch.einsum("bihd,bjd->bhij", seen["q"], seen["k"][:, :, 0])
    lower = torch.ones(10, 10, dtype=torch.bool).tril()
    assert seen["scaling"] == 1.0
    assert (seen["s"][..., lower] - qk[..., lower]).abs().max() <= 1e-5 * qk[..., lower].abs().max()


@pytest.mark.parametrize(("args", "message"), [
    (["length", "--train-len", "32", "--eval-lens", "32,128"],
     "--eval-lens: 128 tokens reach past the 64 positions of the model's position table transformer.wpe"),
    (["scores", "--pe", "none", "--seq-len", "16"], "--pe none removes RoPE, and this GPT-BigCode model has none"),
])
def test_what_its_table_cannot_do_is_refused_in_one_line(args, message, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main([args[0], _saved("gpt_bigcode", tmp_path / "m"), *args[1:], "--num-sequences", "4",
                     "--batch-size", "2", "--quiet", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_cross_attention_is_refused_in_one_line(tmp_path, capsys):
    assert_config_refused("gpt_bigcode", {"add_cross_attention": True},
                          "GPT-BigCode with add_cross_attention=True is not supported", tmp_path, capsys)
