"""What is Gemma's own, beyond tests/test_family_tl.py's checks against TransformerLens 3.9 (which run on Gemma,
Gemma-2 and Gemma-3 from tests/reference/tl39_families_gemma.json): the embedding's sqrt(d) scale and the norms'
1 + w gain, each told from its absence by a sizeable fraction."""

from __future__ import annotations

import torch
from tiny_models import build, randomize_norm_gains, token_batch

from poslens.engine.families import embedding_scale, family_of, positional_encoding
from poslens.engine.hooks import HookedModel


@torch.no_grad()
def test_gemma_scales_its_embedding_and_gains_its_norms_by_one_plus_w():
    """hook_embed is the table's rows times sqrt(d) (the scale `embedding_scale` reports); ln1.hook_out is
    hook_normalized * (1 + w); every layer is recorded as rope, the family as Gemma."""
    model = randomize_norm_gains(build("gemma"))
    hm = HookedModel(model)
    ids = token_batch(2, 10, seed=6)
    _, cache = hm.run_with_cache(ids, ["hook_embed", "blocks.1.ln1.hook_normalized", "blocks.1.ln1.hook_out"])
    rows = model.model.embed_tokens.weight[ids]
    assert embedding_scale(model) == float(torch.tensor(64**0.5))
    assert torch.equal(cache["hook_embed"], rows * torch.tensor(64**0.5))
    w = model.model.layers[1].input_layernorm.weight
    want = cache["blocks.1.ln1.hook_normalized"] * (1 + w)
    assert (cache["blocks.1.ln1.hook_out"] - want).abs().max() <= 1e-6 * want.abs().max()
    assert (cache["blocks.1.ln1.hook_out"] - cache["blocks.1.ln1.hook_normalized"] * w).abs().max() > 1e-2
    assert positional_encoding(model) == ["rope"] * 3 and family_of(model.config).name == "Gemma"
