"""Qwen2, Qwen3 and Mistral against TransformerLens 3.9 itself, with tests/test_family_tl.py's checks run on
tests/reference/tl39_families_llama_like.json (made once by tests/reference/make_tl_family_reference_llama_like.py,
whose HookedTransformer configs TransformerLens's own convert_hf_model_config read from the tiny models' config.json):
exactly TransformerLens's names (Qwen3's attn.q_norm and k_norm points included), shapes and values (Mistral's
sliding window hiding the same keys); logits bit-identical to the eager forward with a reader on every point (to the
plain one without the scores, the pattern and the per-head results); `hook_resid_pre` equal to Hugging Face's hidden
states and `attn.hook_pattern` to its eager attentions.

Tolerances: as tests/test_family_tl.py (2e-5 of each point's largest |value|: TransformerLens's logits on these models
are within 4.8e-7 of Hugging Face's, as the reference records)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_family_tl as tl_checks

REFERENCE = json.loads((Path(__file__).parent / "reference" / "tl39_families_llama_like.json").read_text())
FAMILIES = sorted(REFERENCE["families"])


@pytest.mark.parametrize("family", FAMILIES)
def test_points_have_transformer_lens_names_shapes_and_values(family, monkeypatch):
    monkeypatch.setattr(tl_checks, "REFERENCE", REFERENCE)
    tl_checks.test_points_have_transformer_lens_names_shapes_and_values(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_hooked_forward_equals_hugging_face(family):
    tl_checks.test_hooked_forward_equals_hugging_face(family)
