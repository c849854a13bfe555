"""Up-front checks of the length analysis and what transformers does past max_position_embeddings; the maps and
leakage metrics at a length through Capture."""

import pytest
import torch
from tiny_models import FAMILIES, build, token_batch
from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

from poslens.analyses.length import LengthMaps, PositionLoss, check_eval_length, check_eval_memory, position_table
from poslens.analyses.length.checks import context_limit_lifted, length_notes, reset_rotary
from poslens.analyses.length.passes import run_pass
from poslens.engine.capture import Capture
from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError


@pytest.mark.parametrize("family", FAMILIES)
def test_supported_families_have_no_position_table(family):
    assert position_table(build(family)) is None


def test_a_learned_position_table_is_found_and_refused_past_its_size():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=64, vocab_size=32))
    assert position_table(gpt2) == ("transformer.wpe", 64)
    check_eval_length(gpt2, 64)
    with pytest.raises(UsageError) as e:
        check_eval_length(gpt2, 65)
    assert "position table transformer.wpe" in str(e.value) and "\n" not in str(e.value)
    opt = OPTForCausalLM(OPTConfig(num_hidden_layers=1, hidden_size=16, ffn_dim=32, num_attention_heads=2,
                                   max_position_embeddings=48, vocab_size=32, word_embed_proj_dim=16))
    assert position_table(opt) == ("model.decoder.embed_positions", 48)  # 50 rows, an offset of 2


def test_memory_estimate_refuses_up_front_with_the_estimate():
    model = build("llama")
    with pytest.raises(UsageError) as e:
        check_eval_memory(model, 8192, 4, available=2**20, groups=8, map_layers=3, map_keys=3)
    msg = str(e.value)
    assert "would need about" in msg and "most of it is maps" in msg and "\n" not in msg
    est = check_eval_memory(model, 64, 1, available=2**40)
    assert est["total"] == sum(v for k, v in est.items() if k != "total")


def _dynamic_llama():
    return build("llama", max_position_embeddings=16,
                 rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})


def test_dynamic_rope_is_reset_before_every_batch():
    # transformers keeps a dynamic base grown by a long batch for later, shorter ones (until one is shorter than
    # max_position_embeddings): a 24-token batch after a 64-token one gets the 64-token base
    ids = token_batch(1, 64, seed=1)
    fresh_model, model = _dynamic_llama(), _dynamic_llama()
    with torch.no_grad():
        fresh = fresh_model(input_ids=ids[:, :24]).logits
        model(input_ids=ids)
        assert not torch.allclose(model(input_ids=ids[:, :24]).logits, fresh, rtol=0, atol=1e-4)
        reset_rotary(model)
        assert torch.equal(model(input_ids=ids[:, :24]).logits, fresh)
        model(input_ids=ids)
    a, b = PositionLoss([1, 24]), PositionLoss([1, 24])
    run_pass(HookedModel(fresh_model), [a], [ids[:, :24]])
    run_pass(HookedModel(model), [b], [ids[:, :24]])
    assert torch.equal(a.curve().value[1:], b.curve().value[1:])
    assert any("recomputes the rotary base" in n for n in length_notes(model, 64))
    assert length_notes(model, 16) == [] and length_notes(build("llama"), 4096) == []


def test_maps_past_max_position_embeddings_are_the_models_own():
    # the same weights with a 32-position and a 1024-position config: maps at 48 tokens agree exactly
    ids = token_batch(2, 48, seed=2)
    short, long = build("llama", max_position_embeddings=32), build("llama")
    with pytest.raises(UsageError, match="beyond the model's window"):
        Capture(short).update(ids)
    maps = LengthMaps(short, groups=2)
    maps.update(ids[:1], group=0)
    maps.update(ids[1:], group=1)
    assert short.config.max_position_embeddings == 32
    ref = Capture(long, probs=True, log_probs=True, groups=2)
    ref.update(ids[:1], group=0)
    ref.update(ids[1:], group=1)
    got, want = maps.result(metrics=False), ref.result()
    for key in ("scores", "probs", "log_probs"):
        torch.testing.assert_close(got[key], want[key], equal_nan=True, rtol=0, atol=0)
    with pytest.raises(UsageError, match="rope_type dynamic"):
        with context_limit_lifted(_dynamic_llama(), 48):
            pass


def test_leakage_metrics_at_a_shorter_length_are_the_top_left_block():
    # causality: a capture at 2T holds the maps at T in its top-left block, so metrics(n=T) of the long capture
    # equal the metrics of a capture at T on the same prefixes (and their jackknife intervals too); the lag fit at T
    # is not the long one's top-left block, and the long capture, told the length, makes it in the same forward
    # (from score blocks of 5 queries: a block straddles T)
    model = build("qwen3", num_hidden_layers=2)
    ids = token_batch(4, 48, seed=3)
    short, long = LengthMaps(model, groups=2), LengthMaps(model, groups=2, lengths=[24, 48])
    long.chunk_bytes = 16 * 2 * model.config.num_attention_heads * 48 * 5
    for g in range(2):
        short.update(ids[2 * g:2 * g + 2, :24], group=g)
        long.update(ids[2 * g:2 * g + 2], group=g)
    a, b = short.metrics(), long.metrics(n=24)
    assert set(a) == set(b) and "attn/mask_only" in a and "scores/trf" in a
    with pytest.raises(UsageError, match=r"lengths \[32\]: the capture fitted the lag profile at \[24, 48\]"):
        long.metrics(n=32)
    for name in a:
        torch.testing.assert_close(a[name].value, b[name].value, equal_nan=True, rtol=2e-4, atol=1e-6)
        torch.testing.assert_close(a[name].se, b[name].se, equal_nan=True, rtol=2e-3, atol=1e-6)
    full = long.result()
    assert full["scores"].shape == (2, 48, 48) and full["metric/scores/trf"].shape == (2,)


def test_ntk_on_two_rotary_dimensions_is_refused_in_one_line_and_skipped_under_all():
    """NTK's base theta * F ** (d / (d - 2)) has no value at d = 2 (a GPT-NeoX head of 16 with rotary_pct 0.125):
    refused by the intervention's check (a ZeroDivisionError before), skipped with its reason when not asked for by
    name; YaRN still runs there. ALiBi's refusal names alibi-scale."""
    from poslens.analyses.length.interventions import RopeScaling

    neox = build("gpt_neox", hidden_size=64, num_attention_heads=4, rotary_pct=0.125)
    with pytest.raises(UsageError, match="more than 2 rotary dimensions"):
        RopeScaling("ntk", 16).check(neox)
    RopeScaling("yarn", 16).check(neox)
    RopeScaling("ntk", 16).check(build("gpt_neox", hidden_size=64, num_attention_heads=4, rotary_pct=0.25))
    with pytest.raises(UsageError, match="alibi-scale"):
        RopeScaling("ntk", 16).check(build("bloom"))
