"""GPT-NeoX (Pythia), GPT-J and Phi against TransformerLens 3.9 itself, as tests/test_family_tl.py checks the families
before them (its checks, run on tests/reference/tl39_families_rotary.json, made once by
tests/reference/make_tl_family_reference_rotary.py): exactly TransformerLens's names (no hook_resid_mid with a parallel
residual), shapes and values; logits bit-identical to the eager forward with a reader on every point (to the plain one
without the scores and the pattern); `hook_resid_pre` equal to Hugging
Face's hidden states and `attn.hook_pattern` to its eager attentions. And what is particular to these families: the
rotation acts on the first rotary dimensions only (GPT-J's in adjacent pairs), the per-head fused q/k/v of GPT-NeoX
split and written back in its layout, a write at the shared norm's ln1 reaching attention only, the serial GPT-NeoX, and
the refusals.

Tolerances: as tests/test_family_tl.py (2e-5 of each point's largest |value|: TransformerLens's logits on these models
are within 4e-7 of Hugging Face's, as the reference records; a wrong rotation - halves for adjacent pairs, all
dimensions for the first quarter - moves q after RoPE by a sizeable fraction); 1e-5 for float32 recomputations of one
linear map or norm (rounding of sums of 64 products)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import test_family_tl as tl_checks
import torch
from tiny_models import build, eager_twin, randomize_norm_gains, token_batch

from poslens.engine.families import positional_encoding
from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError

REFERENCE = json.loads((Path(__file__).parent / "reference" / "tl39_families_rotary.json").read_text())
FAMILIES = sorted(REFERENCE["families"])


@pytest.mark.parametrize("family", FAMILIES)
def test_points_have_transformer_lens_names_shapes_and_values(family, monkeypatch):
    monkeypatch.setattr(tl_checks, "REFERENCE", REFERENCE)
    tl_checks.test_points_have_transformer_lens_names_shapes_and_values(family)
    assert not any(p.endswith("hook_resid_mid") for p in REFERENCE["families"][family]["points"])


@pytest.mark.parametrize("family", [*FAMILIES, "gpt_neox_serial"])
def test_hooked_forward_equals_hugging_face(family, monkeypatch):
    if family == "gpt_neox_serial":  # use_parallel_residual=False: the pre-norm block, with hook_resid_mid
        monkeypatch.setattr(tl_checks, "_model",
                            lambda f: randomize_norm_gains(build("gpt_neox", use_parallel_residual=False)))
        family = "gpt_neox"
    tl_checks.test_hooked_forward_equals_hugging_face(family)


@pytest.mark.parametrize(("family", "rotated"), [("gpt_neox", 4), ("gptj", 8), ("phi", 8)])
@torch.no_grad()
def test_rotation_acts_on_the_first_rotary_dimensions_only(family, rotated):
    """q after RoPE equals q before it past the rotary dimensions, and differs within them (beyond position 0, where
    the rotation is the identity); hm.cfg.rotary_dim says how many; every layer is recorded as partial-rope."""
    model = randomize_norm_gains(build(family))
    hm = HookedModel(model)
    assert hm.cfg.rotary_dim == rotated and hm.cfg.parallel_attn_mlp
    assert positional_encoding(model) == ["partial-rope"] * 3
    _, cache = hm.run_with_cache(token_batch(1, 10, seed=2), ["blocks.1.attn.hook_q", "blocks.1.attn.hook_rot_q"])
    q, rot = cache["blocks.1.attn.hook_q"], cache["blocks.1.attn.hook_rot_q"]
    assert torch.equal(q[..., rotated:], rot[..., rotated:])
    assert torch.allclose(q[:, 0], rot[:, 0], atol=1e-6)
    assert (q[:, 1:, :, :rotated] - rot[:, 1:, :, :rotated]).abs().max() > 0.1 * q.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_weight_views_give_the_points_and_a_write_at_v_takes_effect(family):
    """TransformerLens's weight views in its layouts (GPT-NeoX's per-head fused query_key_value split by head):
    hook_q/k/v are ln1's output times W_Q/W_K/W_V plus b_Q/b_K/b_V, attn.hook_out the heads' z times W_O plus b_O,
    mlp.hook_pre ln2's output times W_in plus b_in, mlp.hook_out hook_post times W_out plus b_out (float32
    recomputations: within 1e-5 of the largest entry). A v written as zeros makes the attention output W_O's bias
    alone."""
    model = randomize_norm_gains(build(family))
    hm = HookedModel(model)
    ids = token_batch(2, 9, seed=6)
    names = ["ln1.hook_out", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z", "attn.hook_out",
             "ln2.hook_out", "mlp.hook_pre", "mlp.hook_post", "mlp.hook_out"]
    _, cache = hm.run_with_cache(ids, [f"blocks.1.{n}" for n in names])
    c = {n: cache[f"blocks.1.{n}"] for n in names}
    x = c["ln1.hook_out"]
    want = {f"attn.hook_{n}": torch.einsum("btd,hde->bthe", x, w[1]) + b[1]
            for n, w, b in (("q", hm.W_Q, hm.b_Q), ("k", hm.W_K, hm.b_K), ("v", hm.W_V, hm.b_V))}
    want["attn.hook_out"] = torch.einsum("bthe,hed->btd", c["attn.hook_z"], hm.W_O[1]) + hm.b_O[1]
    want["mlp.hook_pre"] = c["ln2.hook_out"] @ hm.W_in[1] + hm.b_in[1]
    want["mlp.hook_out"] = c["mlp.hook_post"] @ hm.W_out[1] + hm.b_out[1]
    for name, w in want.items():
        assert (c[name] - w).abs().max() <= 1e-5 * w.abs().max(), name
    kept = {}
    hm.run(ids, hooks={"blocks.1.attn.hook_v": lambda v, ctx: torch.zeros_like(v),
                       "blocks.1.attn.hook_out": lambda a, ctx: kept.setdefault("a", a.clone())})
    assert torch.allclose(kept["a"], hm.b_O[1].expand_as(kept["a"]), atol=1e-6)


@pytest.mark.parametrize("family", ["gptj", "phi"])
@torch.no_grad()
def test_shared_norm_write_at_ln1_reaches_attention_only(family):
    """GPT-J and Phi feed one norm to both sublayers; TransformerLens's ln2 is a copy of ln1. A value written at
    ln1.hook_out changes the attention output and leaves the MLP's input (ln2.hook_out) and output as they were; ln2's
    points show the same values as ln1's when nothing is written."""
    model = randomize_norm_gains(build(family))
    hm = HookedModel(model)
    ids = token_batch(2, 9, seed=7)
    names = ["blocks.1.ln1.hook_out", "blocks.1.ln2.hook_out", "blocks.1.ln2.hook_scale", "blocks.1.ln1.hook_scale",
             "blocks.1.attn.hook_out", "blocks.1.mlp.hook_out"]
    _, plain = hm.run_with_cache(ids, names)
    assert torch.equal(plain["blocks.1.ln1.hook_out"], plain["blocks.1.ln2.hook_out"])
    assert torch.equal(plain["blocks.1.ln1.hook_scale"], plain["blocks.1.ln2.hook_scale"])
    seen = {}
    hm.run(ids, hooks={"blocks.1.ln1.hook_out": lambda x, ctx: torch.zeros_like(x),
                       "blocks.1.attn.hook_out": lambda x, ctx: seen.setdefault("a", x.clone()),
                       "blocks.1.ln2.hook_out": lambda x, ctx: seen.setdefault("h2", x.clone()),
                       "blocks.1.hook_mlp_out": lambda x, ctx: seen.setdefault("m", x.clone())})
    assert torch.equal(seen["h2"], plain["blocks.1.ln2.hook_out"])
    assert torch.equal(seen["m"], plain["blocks.1.mlp.hook_out"])
    assert (seen["a"] - plain["blocks.1.attn.hook_out"]).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_resid_mid_is_refused_in_one_line(family):
    """A parallel block has no hook_resid_mid (as TransformerLens): a one-line error that says what to read."""
    hm = HookedModel(randomize_norm_gains(build(family)))
    with pytest.raises(UsageError, match="no hook point 'blocks.0.hook_resid_mid'.*hook_attn_out") as e:
        hm.run(token_batch(1, 8), hooks={"blocks.0.hook_resid_mid": lambda x, ctx: None})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["gptj", "phi", "gpt_neox"])  # (GPT-NeoX: the MLP reads its own norm of the stream)
@torch.no_grad()
def test_per_head_inputs_reach_their_head_only(family):
    """TransformerLens's hook_q_input/k_input/v_input and hook_attn_in on GPT-J and Phi: copies of resid_pre, one per
    head, read with the logits unchanged (bit-identical to the eager forward: the cache reads the patterns too); one
    head's q copy written as zeros gives that head's q = ln1(0) W_Q + b_Q
    (LayerNorm of a zero row is its bias) and leaves the other heads' q (within 1e-5: re-projected in float32) and the
    MLP, which reads the stream entering the block (bit-identical), as they were."""
    model = randomize_norm_gains(build(family))
    hm = HookedModel(model)
    hm.set_use_split_qkv_input(True)
    hm.set_use_attn_in(True)
    ids = token_batch(2, 9, seed=6)
    logits, cache = hm.run_with_cache(ids)  # the cache reads the patterns: the eager forward's logits, bit for bit
    assert torch.equal(logits, eager_twin(model)(input_ids=ids, use_cache=False).logits)
    for point in ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input"):
        x = cache[f"blocks.1.{point}"]
        assert x.shape == (2, 9, 4, 64) and torch.equal(x, cache["blocks.1.hook_resid_pre"][:, :, None].expand_as(x))

    def zero_head0(x, ctx):
        x = x.clone()
        x[:, :, 0] = 0
        return x

    seen = {}
    hm.run(ids, hooks={"blocks.1.hook_q_input": zero_head0,
                       "blocks.1.attn.hook_q": lambda x, ctx: seen.setdefault("q", x.clone()),
                       "blocks.1.hook_mlp_out": lambda x, ctx: seen.setdefault("m", x.clone()),
                       # the patterns read as the cache read them: attention's output computed the same way
                       **{f"blocks.{l}.attn.hook_pattern": lambda x, ctx: None for l in (0, 1)}})
    ln = hm.norm_module("blocks.1.ln1")
    head0 = ln.bias @ hm.W_Q[1, 0] + hm.b_Q[1, 0]
    q, before = seen["q"], cache["blocks.1.attn.hook_q"]
    assert (q[:, :, 0] - head0).abs().max() <= 1e-5 * head0.abs().max()
    assert (q[:, :, 1:] - before[:, :, 1:]).abs().max() <= 1e-5 * before.abs().max()
    assert (q[:, :, 0] - before[:, :, 0]).abs().max() > 0.1 * before.abs().max()
    assert torch.equal(seen["m"], cache["blocks.1.hook_mlp_out"])


def test_phi_with_qk_layernorm_is_refused_in_one_line():
    from tiny_models import config

    from poslens.engine.families import check_supported

    with pytest.raises(UsageError, match="qk_layernorm") as e:
        check_supported(config("phi", qk_layernorm=True))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_pe_none_makes_the_rotation_the_identity(family):
    """--pe none on each (GPT-J's rotary module returns (sin, cos), the others (cos, sin)): q after RoPE is q."""
    from poslens.engine.families import set_positional_encoding

    model = randomize_norm_gains(build(family))
    set_positional_encoding(model, "none")
    assert positional_encoding(model) == ["none"] * 3
    _, cache = HookedModel(model).run_with_cache(token_batch(1, 10, seed=2), ["blocks.1.attn.hook_q",
                                                                              "blocks.1.attn.hook_rot_q"])
    assert torch.equal(cache["blocks.1.attn.hook_q"], cache["blocks.1.attn.hook_rot_q"])


def test_gptj_fixed_table_refuses_scaling_and_lengths_past_it_in_one_line():
    """GPT-J's angles come from a sin/cos table of n_positions rows: no NTK/YaRN, no length past its rows; GPT-NeoX's
    NTK scales the rotary dimensions' frequencies (the exponent uses the rotary width, 4 of 16 here), and YaRN gives
    frequencies for those dimensions with YaRN's attention factor."""
    from poslens.analyses.length.checks import check_eval_length
    from poslens.analyses.length.interventions import RopeScaling

    gptj = build("gptj", max_position_embeddings=64)
    for call, match in ((lambda: check_eval_length(gptj, 65), "past the 64 rows of the model's rotary sin/cos table"),
                        (lambda: RopeScaling("ntk", 16).check(gptj), "fixed sin/cos table")):
        with pytest.raises(UsageError, match=match) as e:
            call()
        assert "\n" not in str(e.value)
    check_eval_length(gptj, 64)
    neox = build("gpt_neox")
    rotary = neox.gpt_neox.rotary_emb
    inv, _ = RopeScaling("ntk", 16).frequencies(rotary, 4.0)
    d, i = 4, torch.arange(2)  # base * F ** (d / (d - 2)): frequency i divided by F ** (2 i / (d - 2))
    assert inv.numel() == 2 and torch.allclose(inv, rotary.inv_freq / 4.0 ** (2 * i / (d - 2)), rtol=1e-6)
    inv, factor = RopeScaling("yarn", 16).frequencies(rotary, 4.0)  # transformers' YaRN on the rotary dimensions
    assert inv.numel() == 2 and factor == pytest.approx(0.1 * math.log(4.0) + 1)


@torch.no_grad()
def test_residual_decomposition_of_a_parallel_block():
    """The MLP of a parallel block reads the stream entering it: decompose_resid(mlp_input=True) sums to resid_pre
    (no attention output of that layer), and so does accumulated_resid(mlp_input=True)'s last component; every
    layer's resid_post is resid_pre + attn_out + mlp_out (float32 sums in another order: 1e-5 of the largest entry);
    incl_mid is refused in one line."""
    hm = HookedModel(randomize_norm_gains(build("gpt_neox")))
    _, cache = hm.run_with_cache(token_batch(2, 9, seed=8))
    parts, labels = cache.decompose_resid(layer=2, mlp_input=True, return_labels=True)
    assert labels == ["embed", "0_attn_out", "0_mlp_out", "1_attn_out", "1_mlp_out"]
    resid = cache["blocks.2.hook_resid_pre"]
    assert (parts.sum(0) - resid).abs().max() <= 1e-5 * resid.abs().max()
    acc, labels = cache.accumulated_resid(layer=2, mlp_input=True, return_labels=True)
    assert labels == ["0_pre", "1_pre", "2_pre"] and torch.equal(acc[-1], resid)
    for l in range(3):
        total = cache[f"blocks.{l}.hook_resid_pre"] + cache[f"blocks.{l}.hook_attn_out"] + \
            cache[f"blocks.{l}.hook_mlp_out"]
        post = cache[f"blocks.{l}.hook_resid_post"]
        assert (total - post).abs().max() <= 1e-5 * post.abs().max()
    with pytest.raises(UsageError, match="no resid_mid") as e:
        cache.accumulated_resid(layer=2, incl_mid=True)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("family", "overrides"), [("gpt_neox", {"rotary_pct": 1.0}), ("gptj", {"rotary_dim": 16}),
                                                   ("phi", {"rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": 10000.0,
                                                                                "partial_rotary_factor": 1.0}})])
def test_a_whole_head_rotation_is_recorded_as_rope(family, overrides):
    """rotary_pct 1, rotary_dim = the head size, partial_rotary_factor 1: every dimension turns, so every layer is
    "rope"."""
    from tiny_models import config

    from poslens.engine.pe import PositionalEncoding

    pe = PositionalEncoding.of(config(family, **overrides))
    assert pe.rope == ("rope",) * 3 and pe.rope_theta == 10000.0
