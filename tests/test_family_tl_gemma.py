"""Gemma (1), Gemma-2 and Gemma-3 against TransformerLens 3.9 itself, with tests/test_family_tl.py's checks run on
tests/reference/tl39_families_gemma.json (made once by tests/reference/make_tl_family_reference_gemma.py, 20 tokens:
the windows of 12 keys hide some): exactly TransformerLens's names (the norms after the sublayers, Gemma-3's q/k
norms), shapes and values (`hook_embed` after the sqrt(d) scale, norms with the gain 1 + w, Gemma-2's softcapped
scores, the windows hiding the same keys, Gemma-3's local RoPE base);
logits bit-identical to the eager forward with a reader on every point (to the plain one without the scores, the
pattern and the per-head results); `hook_resid_pre` equal to Hugging Face's hidden states and `attn.hook_pattern` to
its eager attentions. And what is Gemma's own: the embedding's scale and the norms' 1 + w gain.

Tolerances: as tests/test_family_tl.py (2e-5 of each point's largest |value|: TransformerLens's logits on this model
are within 1.5e-6 of Hugging Face's, as the reference records; a gain w where the model has 1 + w, or an unscaled
embedding, is off by a sizeable fraction)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_family_tl as tl_checks
import torch
from tiny_models import build, randomize_norm_gains, token_batch

from poslens.engine.families import embedding_scale, family_of, positional_encoding
from poslens.engine.hooks import HookedModel

REFERENCE = json.loads((Path(__file__).parent / "reference" / "tl39_families_gemma.json").read_text())
FAMILIES = sorted(REFERENCE["families"])


@pytest.mark.parametrize("family", FAMILIES)
def test_points_have_transformer_lens_names_shapes_and_values(family, monkeypatch):
    monkeypatch.setattr(tl_checks, "REFERENCE", REFERENCE)
    tl_checks.test_points_have_transformer_lens_names_shapes_and_values(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_hooked_forward_equals_hugging_face(family):
    tl_checks.test_hooked_forward_equals_hugging_face(family)


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
