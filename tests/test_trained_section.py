"""The trained NoPE/RoPE pair behind Section 4.2 (`poslens.report.sections.trained`): trained once into the session
cache (the same shortened pair as tests/test_reproduce.py, so it trains once per session), reloaded by stock
transformers with its positional encoding, and read back from the cache the second time."""

from __future__ import annotations

import pytest
from test_reproduce import SHORT

from poslens.report.sections.trained import PE_NAMES, trained_pair


@pytest.mark.slow
def test_trained_pair_reloads_with_its_encoding_and_comes_from_the_cache_the_second_time():
    from transformers import AutoModelForCausalLM

    models = trained_pair("tiny", progress=False, **SHORT)
    for pe in PE_NAMES:  # stock transformers reloads each with its positional encoding
        cfg = AutoModelForCausalLM.from_pretrained(models[pe]).config
        assert set(cfg.no_rope_layers) == {1 if pe == "rope" else 0}
    stamp = {pe: (models[pe] / "model.safetensors").stat().st_mtime_ns for pe in PE_NAMES}
    again = trained_pair("tiny", progress=False, **SHORT)
    assert again["trained"] == [] and {pe: again[pe] for pe in PE_NAMES} == {pe: models[pe] for pe in PE_NAMES}
    assert stamp == {pe: (models[pe] / "model.safetensors").stat().st_mtime_ns for pe in PE_NAMES}
