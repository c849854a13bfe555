"""The positional-encoding type (`poslens.engine.pe`): patterns, every trained variant reloads as a stock
transformers checkpoint with the encoding it was trained with, and nothing changes past the training length."""

from __future__ import annotations

import json
import math

import pytest
import torch

from poslens.engine.pe import PositionalEncoding, Scaling, parse_layer_types, parse_rope_flags
from poslens.errors import UsageError
from poslens.train.config import resolve_config
from poslens.train.model import build_model

SMALL = dict(layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2, seq_len=16, steps=4, warmup=1)
HEAD_DIM = 16  # hidden / heads


def _reload(cfg, tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_model(cfg, 120)
    model.save_pretrained(tmp_path)
    return model, AutoModelForCausalLM.from_pretrained(tmp_path)


def test_patterns_tile_and_refuse_what_does_not_divide():
    assert parse_rope_flags("0,1,1,1", 4) == [0, 1, 1, 1] and parse_rope_flags("10", 6) == [1, 0] * 3
    assert parse_rope_flags([1, 1, 1, 0], 8) == [1, 1, 1, 0] * 2  # SmolLM3's no_rope_layers as a list
    assert parse_layer_types("SF", 4) == ["sliding_attention", "full_attention"] * 2
    assert parse_layer_types("sliding,full_attention,full", 3) == ["sliding_attention"] + ["full_attention"] * 2
    for bad in ("0,2", "011", "abc", ""):
        with pytest.raises(UsageError, match="pe_layers"):
            parse_rope_flags(bad, 4)
    with pytest.raises(UsageError, match="layer_types"):
        parse_layer_types("SSX", 3)
    with pytest.raises(UsageError, match="sliding_window is 0"):
        PositionalEncoding.build(4, pe="rope", layer_types="SF")
    for bad in ("ntk", "ntk:abc", "ntk:1", "ntk:-2", "cubic:2"):
        with pytest.raises(UsageError, match="rope_scaling"):
            Scaling.parse(bad)
    with pytest.raises(UsageError, match="evaluation time"):  # dynamic is not a training variant
        Scaling.parse("dynamic:4")
    with pytest.raises(UsageError, match="needs RoPE"):
        PositionalEncoding.build(2, pe="none", rope_scaling="ntk:4")


def test_labels_and_records():
    pe = PositionalEncoding.build(4, pe="rope", rope_scaling="ntk:8", sliding_window=32, layer_types="SSSF")
    assert pe.label() == "RoPE (ntk:8), window 32 in layers 1,2,3"
    assert pe.windows == (32, 32, 32, 0) and pe.flags == [1, 1, 1, 1]
    assert PositionalEncoding.build(3, pe_layers="011").label() == "RoPE layers 011"
    assert PositionalEncoding.build(2).label() == "NoPE" and PositionalEncoding.build(2).rope_theta is None
    record = pe.record()
    assert json.loads(json.dumps(record)) == record
    assert record["layers"] == ["rope"] * 4 and record["rope_scaling"] == "ntk:8" and record["rope_theta"] == 1e4


@pytest.mark.parametrize("scaling", [None, "ntk:8", "linear:4", "yarn:4"])
def test_variant_reloads_with_the_frequencies_it_was_trained_with(scaling, tmp_path):
    """Plain from_pretrained gives back the model's own frequencies and the same PositionalEncoding; the
    frequencies equal the formula of the scaling, computed here in float64 (tolerance: float32 rounding, 1e-6
    relative):
      none      theta^(-2i/d)
      ntk:F     (theta F^(d/(d-2)))^(-2i/d): the lowest frequency is divided by exactly F, the highest kept
      linear:F  theta^(-2i/d) / F
      yarn:F    frequencies that turn fewer than once over the training length divided by F, those that turn
                more than 32 times kept (YaRN's beta_slow = 1, beta_fast = 32), logits scaled by (0.1 ln F + 1)^2
    """
    seq_len = 512 if scaling == "yarn:4" else SMALL["seq_len"]  # long enough for frequencies on both sides of the ramp
    cfg = resolve_config("tiny", **{**SMALL, "seq_len": seq_len}, pe="rope", rope_theta=500.0, rope_scaling=scaling)
    model, reloaded = _reload(cfg, tmp_path)
    assert PositionalEncoding.of(reloaded) == PositionalEncoding.of(model) == cfg.positional_encoding()
    got = reloaded.model.rotary_emb.inv_freq.double()
    assert torch.equal(got, model.model.rotary_emb.inv_freq.double())
    d = HEAD_DIM
    i = torch.arange(0, d, 2, dtype=torch.float64)
    plain = 500.0 ** (-i / d)
    if scaling is None:
        expect = plain
    elif scaling == "ntk:8":
        expect = (500.0 * 8 ** (d / (d - 2))) ** (-i / d)
        assert math.isclose(float(plain[-1] / got[-1]), 8.0, rel_tol=1e-5) and got[0] == 1.0
    elif scaling == "linear:4":
        expect = plain / 4
    else:
        turns = plain * cfg.seq_len / (2 * math.pi)
        slow, fast = turns < 1, turns > 32
        assert slow.any() and fast.any()
        assert torch.allclose(got[slow], plain[slow] / 4, rtol=1e-6)
        assert torch.allclose(got[fast], plain[fast], rtol=1e-6)
        assert math.isclose(reloaded.model.rotary_emb.attention_scaling, 0.1 * math.log(4) + 1, rel_tol=1e-12)
        return
    assert torch.allclose(got, expect, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scaling", ["ntk:8", "linear:4", "yarn:4"])
def test_nothing_changes_past_the_training_length(scaling, tmp_path):
    """A static scaling computes the same function whatever max_position_embeddings says: at 4x the training
    length the logits of the checkpoint (max_position_embeddings = seq_len) equal, bit for bit, those of the same
    weights reloaded with max_position_embeddings = 64 x seq_len."""
    from transformers import AutoModelForCausalLM

    cfg = resolve_config("tiny", **SMALL, pe="rope", rope_scaling=scaling)
    model, reloaded = _reload(cfg, tmp_path)
    assert reloaded.config.max_position_embeddings == cfg.seq_len
    wide = AutoModelForCausalLM.from_pretrained(tmp_path, max_position_embeddings=64 * cfg.seq_len)
    ids = torch.randint(0, 120, (2, 4 * cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, wide(ids).logits)


def test_sliding_window_receptive_field(tmp_path):
    """Two sliding layers with window 4 (each query sees itself and 3 keys back): position i sees tokens down to
    i - 2 * 3, so changing token 0 leaves the logits from position 7 on unchanged (bit for bit: masked keys get
    exactly zero weight); with full attention in the second layer (layer_types SF) or everywhere they change."""
    ids = torch.randint(1, 120, (1, 24), generator=torch.Generator().manual_seed(1))
    other = ids.clone()
    other[0, 0] = 0
    changes = {}
    for name, fields in {"window": dict(sliding_window=4), "SF": dict(sliding_window=4, layer_types="SF"),
                         "full": {}}.items():
        cfg = resolve_config("tiny", **{**SMALL, "seq_len": 24}, pe="rope", **fields)
        _, reloaded = _reload(cfg, tmp_path / name)
        with torch.no_grad():
            changes[name] = (reloaded(ids).logits - reloaded(other).logits).abs()[0].amax(-1)
    assert PositionalEncoding.of(reloaded).windows == (0, 0)
    assert torch.equal(changes["window"][7:], torch.zeros(17)) and changes["window"][6] > 0
    assert changes["SF"][7:].min() > 0 and changes["full"][7:].min() > 0


def test_an_alibi_model_loaded_without_positions_records_no_rope_parameters():
    """Falcon-RW's config carries transformers' default rope_parameters, which an ALiBi model never uses: loaded with
    pe="none" (NoPE: its bias removed) its record has none; a RoPE model loaded so keeps its config's."""
    import json

    from poslens.engine.models import load_model

    falcon_rw = {"model_type": "falcon", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "alibi": True, "new_decoder_architecture": False, "multi_query": False,
                 "parallel_attn": False, "bias": True}
    model, _ = load_model("random:" + json.dumps(falcon_rw), pe="none")
    record = PositionalEncoding.of(model).record()
    assert record["layers"] == ["none", "none"] and "rope_parameters" not in record
    llama = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}
    model, _ = load_model("random:" + json.dumps(llama), pe="none")
    assert "rope_theta" in PositionalEncoding.of(model).record()["rope_parameters"]
