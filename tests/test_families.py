"""poslens.engine.families: facts per family, and positional encoding as a property of a loaded model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_data import byte_tokenizer
from tiny_models import FAMILIES, build, config, token_batch
from transformers import SmolLM3Config, SmolLM3ForCausalLM

import poslens.engine.families as families
from poslens.engine.capture import attention_scores
from poslens.engine.families import family_of, positional_encoding, sliding_windows
from poslens.engine.models import load_info, load_model
from poslens.errors import UsageError


def test_every_tiny_family_is_registered_with_its_windows_and_positional_encoding():
    expect_windows = {"mistral": [12, 12, 12], "starcoder2": [12, 12, 12], "gemma3": [12, 0, 12], "gemma2": [12, 0, 12]}
    expect_pe = {"phi3": ["partial-rope"] * 3, "stablelm": ["partial-rope"] * 3, "smollm3": ["rope", "none", "rope"]}
    for fam in FAMILIES:
        cfg = config(fam)
        family_of(cfg)
        assert sliding_windows(cfg) == expect_windows.get(fam, [0, 0, 0]), fam
        assert positional_encoding(cfg) == expect_pe.get(fam, ["rope"] * 3), fam
    assert family_of(config("gemma2")).layout == "sandwich" and family_of(config("llama")).layout == "pre-norm"


def _nope_twin(directory) -> SmolLM3ForCausalLM:
    """The same weights in transformers' own NoPE architecture (SmolLM3 with no_rope_layers all 0): RoPE removed
    by the model code itself, not by poslens."""
    llama = build("llama").config.to_dict()
    keep = {k: llama[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                  "rms_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id",
                                  "tie_word_embeddings", "head_dim")}
    cfg = SmolLM3Config(**keep, no_rope_layers=[0] * keep["num_hidden_layers"])
    return SmolLM3ForCausalLM.from_pretrained(directory, config=cfg, dtype=torch.float32).eval()


def test_pe_none_equals_the_same_weights_in_a_nope_architecture(tmp_path):
    build("llama").save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    ids = token_batch(2, 20, seed=7)
    nope, _ = load_model(str(tmp_path), pe="none")
    rope, _ = load_model(str(tmp_path))
    twin = _nope_twin(tmp_path)
    with torch.no_grad():
        a, b, c = (m(input_ids=ids).logits for m in (nope, twin, rope))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # float32 forwards of the same ops
    assert (a - c).abs().max() > 1e-2  # RoPE changes the logits
    torch.testing.assert_close(attention_scores(nope, ids), attention_scores(twin, ids), rtol=0, atol=1e-5,
                               equal_nan=True)
    assert positional_encoding(nope) == ["none"] * 3 and positional_encoding(rope) == ["rope"] * 3
    assert load_info(nope)["positional_encoding"] == ["none"] * 3


def test_known_nope_checkpoints_are_recognised_and_can_be_overridden(tmp_path, monkeypatch):
    build("llama").save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    monkeypatch.setitem(families.KNOWN_NOPE, str(tmp_path).lower(), "a test checkpoint trained without RoPE")
    auto, _ = load_model(str(tmp_path))
    info = load_info(auto)
    assert info["pe"] == "none" and "known NoPE" in info["pe_reason"]
    forced, _ = load_model(str(tmp_path), pe="rope")
    assert load_info(forced)["positional_encoding"] == ["rope"] * 3
    with pytest.raises(UsageError, match="pe must be one of"):
        load_model(str(tmp_path), pe="alibi")


def test_the_loader_does_not_import_the_analysis_engine():
    code = ("import sys, poslens.engine.models, poslens.engine.families; "
            "bad = [m for m in ('poslens.engine.capture', 'poslens.engine.hooks', 'poslens.analyses') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
