"""GPT-Neo (TinyStories, gpt-neo-125m ... 2.7b): a learned position table, layers alternating global and local
attention (a window of `window_size` keys, self included), scores q.k without the 1/sqrt(D) scaling, its attention
inside a wrapper module and run by poslens's copy of the model's own code. TransformerLens 3.9's names and values
are tests/test_family_tl.py's (tests/reference/tl39_families_gpt_neo.json); here what is GPT-Neo's own: the scores'
meaning, the window, the table, the records and the length analysis's mask (the cached step past the window:
tests/test_tl_generate.py)."""

from __future__ import annotations

import math

import pytest
import torch
from test_family_tl import assert_zeros_at_hook_pos_embed_are_the_table_zeroed
from tiny_models import build, randomize_norm_gains, token_batch

from poslens.engine.families import positional_encoding, sliding_windows
from poslens.engine.hooks import HookedModel, from_factors
from poslens.engine.pe import PositionalEncoding
from poslens.masks import hidden

WINDOW = 12  # the tiny config's window_size; layer 1 is the local one


@torch.no_grad()
def test_scores_are_unscaled_qk_with_the_local_layers_window_hidden():
    """attn.hook_attn_scores is q.k (no 1/sqrt(D)) recomputed in float64 from ln1's output and W_Q, W_K (within 1e-5
    of the largest score: float32 rounding of one GEMM), -inf exactly where query i cannot see key j: j > i, and in
    the local layer i - j >= 12; a reader working from the factors sees scaling 1 and the layer's window."""
    model = randomize_norm_gains(build("gpt_neo"))
    hm = HookedModel(model)
    ids = token_batch(2, 20, seed=5)
    seen = {}

    def factors(_, ctx):
        seen[ctx.layer] = (ctx.scaling, ctx.window, ctx.rot_q.shape)

    hooks = {f"blocks.{l}.attn.hook_attn_scores": from_factors(factors) for l in range(3)}
    _, cache = hm.run_with_cache(ids, [f"blocks.{l}.{p}" for l in range(3) for p in ("ln1.hook_out",
                                                                                        "attn.hook_attn_scores")])
    hm.run(ids, hooks=hooks)
    assert seen == {l: (1.0, WINDOW if l == 1 else 0, (2, 4, 20, 16)) for l in range(3)}
    for l in range(3):
        x = cache[f"blocks.{l}.ln1.hook_out"].double()
        q = torch.einsum("btd,hde->bhte", x, hm.W_Q[l].double())
        k = torch.einsum("btd,hde->bhte", x, hm.W_K[l].double())
        expected = (q @ k.transpose(-1, -2)).masked_fill(hidden(20, WINDOW if l == 1 else 0), -math.inf)
        scores = cache[f"blocks.{l}.attn.hook_attn_scores"].double()
        assert torch.equal(torch.isinf(scores), torch.isinf(expected).expand_as(scores))
        finite = torch.isfinite(expected).expand_as(scores)
        assert (scores[finite] - expected.expand_as(scores)[finite]).abs().max() <= 1e-5 * expected[finite].abs().max()
    local = cache["blocks.1.attn.hook_attn_scores"]
    assert torch.isinf(local[..., 19, :8]).all() and torch.isfinite(local[..., 19, 8:]).all()


@torch.no_grad()
def test_hook_pos_embed_is_the_tables_rows_and_zeros_there_are_the_table_zeroed():
    """hook_pos_embed is W_pos's rows at the positions (bit for bit) and resid_pre of layer 0 their sum with
    hook_embed; zeros written there give Hugging Face's logits with the table zeroed (1e-6 of the largest logit:
    float32 rounding of the same operations), which differ from the model's (> 1e-2: the table matters)."""
    model = randomize_norm_gains(build("gpt_neo"))
    hm = HookedModel(model)
    ids = token_batch(2, 16, seed=4)
    _, cache = hm.run_with_cache(ids, ["hook_pos_embed", "hook_embed", "blocks.0.hook_resid_pre"])
    assert torch.equal(hm.W_pos, model.transformer.wpe.weight)
    assert torch.equal(cache["hook_pos_embed"], hm.W_pos[:16].expand(2, -1, -1))
    assert torch.equal(cache["blocks.0.hook_resid_pre"], cache["hook_embed"] + cache["hook_pos_embed"])
    assert_zeros_at_hook_pos_embed_are_the_table_zeroed(model, hm, ids, model.transformer.wpe.weight)


def test_positional_encoding_and_transformer_lens_config_are_recorded():
    """Every layer "learned", the local layer's window (12) and the others' 0, TransformerLens's attn_types and
    use_attn_scale False (GPT-Neo's config and TransformerLens's GPTNeoForCausalLM entry)."""
    model = build("gpt_neo")
    assert positional_encoding(model) == ["learned"] * 3 and sliding_windows(model.config) == [0, WINDOW, 0]
    record = PositionalEncoding.of(model).record()
    assert record["layers"] == ["learned"] * 3 and record["sliding_window"] == [0, WINDOW, 0]
    cfg = HookedModel(model).cfg
    assert cfg.positional_embedding_type == "standard" and not cfg.use_attn_scale
    assert cfg.attn_types == ["global", "local", "global"] and cfg.window_size == WINDOW and cfg.use_local_attn
    assert HookedModel(build("llama")).cfg.use_attn_scale


@pytest.mark.parametrize(("pe", "message"), [("none", "pe none removes RoPE"),
                                             ("rope", "pe rope keeps a model's RoPE")])
def test_rope_choices_are_refused_in_one_line(pe, message):
    """A learned table has no RoPE to remove or keep: `set_positional_encoding` says so in one line."""
    from poslens.engine.families import set_positional_encoding
    from poslens.errors import UsageError

    with pytest.raises(UsageError, match=message) as info:
        set_positional_encoding(build("gpt_neo"), pe)
    assert "\n" not in str(info.value) and "GPT-Neo" in str(info.value)


@torch.no_grad()
def test_the_length_analysis_mask_is_one_mask_and_its_reader_adds_the_local_window():
    """The length analysis's explicit mask (a window of 16 keys) is one mask for every layer, since GPT-Neo's local
    layer hides the keys past its own 12 on top of any mask: the hooked forward with it gives Hugging Face's logits
    with the same mask (bit for bit: the same operations) and differs from the run without it (the window binds on
    the global layers at 20 tokens); the keys a reader counts as seen are the mask's and, at the local layer, its own
    window's."""
    from types import SimpleNamespace

    from poslens.analyses.length.masks import allowed_from, model_mask
    from poslens.masks import visible

    model = randomize_norm_gains(build("gpt_neo"))
    hm = HookedModel(model)
    ids = token_batch(2, 20, seed=6)
    mask = model_mask(model, 20, window=16)
    assert isinstance(mask, torch.Tensor) and mask.shape == (1, 1, 20, 20)
    got = hm.run(ids, mask, logits=True).logits
    assert torch.equal(got, model(input_ids=ids, attention_mask=mask).logits)
    assert (got - model(input_ids=ids).logits).abs().max() > 1e-3
    for layer, window in ((0, 0), (1, WINDOW)):
        ctx = SimpleNamespace(module=hm.attns[layer], layer=layer, window=window)
        assert torch.equal(allowed_from(mask, ctx)[0, 0], visible(20, 16) & visible(20, window))
