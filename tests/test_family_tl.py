"""The hook points of the families added after Llama (OLMo-2, ...) against TransformerLens 3.9 itself: the same tiny
random model run through TransformerLens's own converter and HookedTransformer (tests/reference/, made once by
tests/reference/make_tl_family_reference.py) has exactly poslens's TransformerLens names, with the same shapes and
values; the hooked forward's logits equal a plain forward's bit for bit, `hook_resid_pre` equals Hugging Face's hidden
states and `attn.hook_pattern` its eager attentions.

Tolerance of the values: within 2e-5 of each point's largest |value| (TransformerLens's logits on this model are
within 4.5e-7 of Hugging Face's, as the reference records: two float32 implementations of the same model differ by
rounding only, ~1e-6 relative after three layers); a wrong meaning (a norm before attention where OLMo-2 has none,
a per-head q-norm for a whole-projection one, a point before the gain for after it) is off by a sizeable fraction.
Eager attentions: within 1e-5 (probabilities in [0, 1] from float32 softmaxes of the same scores)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import build, config, heads_summed_twin, randomize_norm_gains, token_batch

from poslens import cli
from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError

REFERENCE = json.loads((Path(__file__).parent / "reference" / "tl39_families.json").read_text())
# the same method's other references (tests/reference/make_tl_family_reference_*.py): the learned-table and ALiBi
# families; Gemma, Gemma-2 and Gemma-3; Qwen2, Qwen3 and Mistral (their TransformerLens configs read by its own
# convert_hf_model_config from the tiny config.json), these at 20 tokens so that the windows of 12 keys hide keys;
# Mixtral and OLMoE, the mixtures of experts TransformerLens has
for _name in ("alibi", "gemma", "llama_like", "gpt_neo", "moe"):
    _more = json.loads((Path(__file__).parent / "reference" / f"tl39_families_{_name}.json").read_text())
    assert _more["transformer_lens"] == REFERENCE["transformer_lens"]
    REFERENCE["families"].update(_more["families"])
FAMILIES = sorted(REFERENCE["families"])
TOLERANCE = 2e-5


def _model(family):
    return randomize_norm_gains(build(family))


def reference_model(family, ref):
    """`family`'s tiny model with random norm gains, checked to be the one the TransformerLens reference `ref` was
    made on (the sum of its weights' absolute values to 1e-6)."""
    model = _model(family)
    assert abs(sum(float(p.double().abs().sum()) for p in model.parameters()) - ref["weights_abs_sum"]) < 1e-6 * \
        ref["weights_abs_sum"], "not the model the reference was made on"
    return model


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_points_have_transformer_lens_names_shapes_and_values(family):
    ref = REFERENCE["families"][family]
    assert REFERENCE["transformer_lens"].startswith("3.9")
    model = reference_model(family, ref)
    hm = HookedModel(model)
    hm.set_use_attn_result(True)
    hm.set_use_hook_mlp_in(True)
    ids = torch.tensor(ref["ids"])
    _, cache = hm.run_with_cache(ids)
    assert list(cache) == hm.tl_points
    assert set(hm.tl_points) == set(ref["points"]), (
        f"only poslens: {sorted(set(hm.tl_points) - set(ref['points']))}; "
        f"only TransformerLens: {sorted(set(ref['points']) - set(hm.tl_points))}")
    for name, r in ref["points"].items():
        assert_matches_summary(cache[name], r, name)


def assert_matches_summary(x: torch.Tensor, r: dict, name: str) -> None:
    """x has the shape of TransformerLens's summary r (make_tl_family_reference.summary), its sum and largest |x| over
    finite entries and its values at r's five places, within TOLERANCE of the largest |value| (-inf exactly)."""
    x = x.double()
    assert list(x.shape) == r["shape"], f"{name}: shape {list(x.shape)}, TransformerLens {r['shape']}"
    flat = x.reshape(-1)
    finite = torch.isfinite(flat)
    scale = r["abs_max"]
    assert abs(float(flat[finite].abs().sum()) - r["abs_sum"]) <= TOLERANCE * scale * flat.numel(), name
    assert abs(float(flat[finite].abs().max()) - scale) <= TOLERANCE * scale, name
    for i, v in zip(r["at"], r["values"]):
        if isinstance(v, str):
            assert float(flat[i]) == float(v), f"{name}[{i}]: {float(flat[i])}, TransformerLens {v}"
        else:
            assert abs(float(flat[i]) - v) <= TOLERANCE * scale, f"{name}[{i}]: {float(flat[i])}, TL {v}"


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_hooked_forward_equals_hugging_face(family):
    """A reader on every point: logits bit-identical to the eager forward's with W_O's output the per-head results'
    sum (attention's output computed from the pattern read, as eager attention computes it; W_O's output from the
    results read, as TransformerLens computes it), resid_pre = its hidden states; without a reader of the scores, the
    pattern or the results, bit-identical to the plain (SDPA) forward; pattern = eager attentions."""
    model = _model(family)
    hm = HookedModel(model)
    ids = token_batch(2, 16, seed=3)
    plain = model(input_ids=ids, use_cache=False)
    reference = heads_summed_twin(model)(input_ids=ids, use_cache=False, output_hidden_states=True)
    logits, cache = hm.run_with_cache(ids, hm.points)
    assert torch.equal(logits, reference.logits)
    no_pattern = [p for p in hm.points if not p.endswith(("attn.hook_attn_scores", "attn.hook_pattern",
                                                              "attn.hook_result"))]
    assert torch.equal(hm.run_with_cache(ids, no_pattern)[0], plain.logits)
    for l in range(hm.n_layers):
        assert torch.equal(cache[f"blocks.{l}.hook_resid_pre"], reference.hidden_states[l])
    saved = model.config._attn_implementation  # BLOOM: eager only
    model.set_attn_implementation("eager")
    try:
        eager = model(input_ids=ids, use_cache=False, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(saved)
    for l in range(hm.n_layers):
        assert (cache[f"blocks.{l}.attn.hook_pattern"] - eager[l]).abs().max() < 1e-5


@torch.no_grad()
def test_gpt2_position_table_is_hook_pos_embed_and_writes_act_downstream():
    """GPT-2: hook_pos_embed is W_pos's rows at the positions; zeros written there give the logits of the same model
    with its table zeroed (Hugging Face's own forward); a value written at ln1.hook_normalized reaches the queries
    times the gain plus the bias, as TransformerLens's LayerNorm (x - mean) / scale * w + b."""
    model = _model("gpt2")
    hm = HookedModel(model)
    ids = token_batch(2, 12, seed=4)
    _, cache = hm.run_with_cache(ids, ["hook_pos_embed", "hook_embed", "blocks.0.hook_resid_pre"])
    assert torch.equal(cache["hook_pos_embed"], hm.W_pos[:12].expand(2, -1, -1))
    assert torch.equal(cache["blocks.0.hook_resid_pre"], cache["hook_embed"] + cache["hook_pos_embed"])
    assert_zeros_at_hook_pos_embed_are_the_table_zeroed(model, hm, ids, model.transformer.wpe.weight)
    written = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(5))
    kept = {}
    hm.run(ids, hooks={"blocks.1.ln1.hook_normalized": lambda x, ctx: written,
                       "blocks.1.attn.hook_q": lambda x, ctx: kept.setdefault("q", x.clone())})
    ln = model.transformer.h[1].ln_1
    q = (written * ln.weight + ln.bias) @ hm.W_Q[1].transpose(0, 1).flatten(1) + hm.b_Q[1].flatten()
    assert (kept["q"].flatten(-2) - q).abs().max() <= 1e-5 * q.abs().max()
    # TransformerLens's decompose_resid: embed, pos_embed, then each layer's outputs, summing to the stream
    _, full = hm.run_with_cache(ids)
    parts, labels = full.decompose_resid(layer=2, return_labels=True)
    assert labels == ["embed", "pos_embed", "0_attn_out", "0_mlp_out", "1_attn_out", "1_mlp_out"]
    resid = full["resid_pre", 2]
    assert (parts.sum(0) - resid).abs().max() <= 1e-5 * resid.abs().max()  # float32 sums in another order


def assert_zeros_at_hook_pos_embed_are_the_table_zeroed(model, hm, ids, rows) -> None:
    """Zeros written at hook_pos_embed give Hugging Face's logits with the table's `rows` (a view) zeroed (float32
    rounding of the same operations: 1e-6 of the largest logit); the table matters (> 1e-2)."""
    zeroed = hm.run(ids, hooks={"hook_pos_embed": lambda x, ctx: torch.zeros_like(x)}, logits=True).logits
    saved = rows.clone()
    rows.zero_()
    try:
        reference = model(input_ids=ids).logits
    finally:
        rows.copy_(saved)
    assert (zeroed - reference).abs().max() <= 1e-6 * reference.abs().max()
    assert (zeroed - model(input_ids=ids).logits).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["gpt2", "olmo2"])
def test_per_head_inputs_are_refused_in_one_line_where_not_built(family):
    """TransformerLens's per-head attention inputs exist on every family but GPT-2 (one fused Conv1D) and OLMo-2
    (post-norm): there hooking one, or asking for them in the cache, is a one-line error that says what to read
    instead, never a silently absent value (tests/test_tl_inputs_fused.py: OPT, BLOOM, GPT-NeoX, Falcon)."""
    from poslens.errors import UsageError

    hm = HookedModel(_model(family))
    assert not any("input" in p.split(".")[-1] and "mlp" not in p for p in hm.points)
    with pytest.raises(UsageError, match="not yet on .*hook_resid_pre") as e:
        hm.run(token_batch(1, 8), hooks={"blocks.0.hook_q_input": lambda x, ctx: None})
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="not yet on"):
        hm.set_use_split_qkv_input(True)


@torch.no_grad()
def test_opt_position_table_offset_is_hook_pos_embed_and_writes_act_downstream():
    """OPT looks position p up at row p + 2 of embed_positions: hook_pos_embed is W_pos's rows at the positions, W_pos
    the table without its first two rows (TransformerLens's convert_opt_weights); zeros written there give Hugging
    Face's logits with those rows zeroed (and the two offset rows left as they are: they are never read); a value
    written at mlp.hook_pre goes through the ReLU and fc2 (to float32 rounding)."""
    model = _model("opt")
    hm = HookedModel(model)
    table = model.model.decoder.embed_positions.weight
    assert torch.equal(hm.W_pos, table[2:]) and hm.W_pos.shape[0] == hm.cfg.n_ctx == 64
    ids = token_batch(2, 12, seed=4)
    _, cache = hm.run_with_cache(ids, ["hook_pos_embed", "hook_embed", "blocks.0.hook_resid_pre"])
    assert torch.equal(cache["hook_pos_embed"], table[2:14].expand(2, -1, -1))
    assert torch.equal(cache["blocks.0.hook_resid_pre"], cache["hook_embed"] + cache["hook_pos_embed"])
    assert_zeros_at_hook_pos_embed_are_the_table_zeroed(model, hm, ids, table[2:])
    written = torch.randn(2, 12, 128, generator=torch.Generator().manual_seed(5))
    kept = {}
    hm.run(ids, hooks={"blocks.1.mlp.hook_pre": lambda x, ctx: written,
                       "blocks.1.mlp.hook_out": lambda x, ctx: kept.setdefault("out", x.clone())})
    out = written.relu() @ hm.W_out[1] + hm.b_out[1]
    assert (kept["out"] - out).abs().max() <= 1e-5 * out.abs().max()


@torch.no_grad()
def test_bloom_scores_minus_the_alibi_bias_are_the_plain_qk_scores_and_removing_it_is_the_model_without_alibi(
        monkeypatch):
    """BLOOM: attn.hook_attn_scores is q.k / sqrt(D) + slope_h * (j - i), -inf above the diagonal (TransformerLens's
    form; the model adds slope_h * j, a constant per query away). Minus the bias built from the slopes run.json records,
    it equals q.k / sqrt(D) recomputed in float64 from ln1's output and W_Q, b_Q, W_K, b_K (within 1e-5 of the largest
    score: float32 rounding of one GEMM). The bias written away at every layer gives the logits of Hugging Face's own
    forward with every slope 0 (within 1e-5 of the largest logit: float32 rounding, softmaxes of the same scores)."""
    from transformers.models.bloom import modeling_bloom

    from poslens.engine.pe import PositionalEncoding

    model = _model("bloom")
    hm = HookedModel(model)
    slopes = torch.tensor(PositionalEncoding.of(model).record()["alibi_slopes"], dtype=torch.float64)
    assert slopes.tolist() == [0.25, 0.0625, 0.015625, 0.00390625]  # 2^(-8/4 * h), h = 1..4
    ids = token_batch(2, 12, seed=4)
    kept = {}
    hm.run(ids, hooks={"blocks.1.ln1.hook_out": lambda x, ctx: kept.setdefault("ln", x.double()),
                       "blocks.1.attn.hook_attn_scores": lambda x, ctx: kept.setdefault("scores", x.double())})
    q = torch.einsum("btd,hde->bhte", kept["ln"], hm.W_Q[1].double()) + hm.b_Q[1].double()[None, :, None]
    k = torch.einsum("btd,hde->bhte", kept["ln"], hm.W_K[1].double()) + hm.b_K[1].double()[None, :, None]
    plain = q @ k.transpose(-1, -2) / hm.cfg.d_head**0.5
    pos = torch.arange(12, dtype=torch.float64)
    bias = slopes[:, None, None] * (pos[None, None, :] - pos[None, :, None])  # [H, i, j]
    lower = torch.ones(12, 12, dtype=torch.bool).tril()
    scores = kept["scores"]
    assert bool(torch.isneginf(scores[..., ~lower]).all())
    assert ((scores - bias)[..., lower] - plain[..., lower]).abs().max() <= 1e-5 * plain.abs().max()
    assert (scores[..., lower] - plain[..., lower]).abs().max() > 0.5  # the bias is there
    unbiased = hm.run(ids, hooks={f"blocks.{l}.attn.hook_attn_scores": lambda x, ctx: x - ctx.score_bias
                                  for l in range(hm.n_layers)}, logits=True).logits
    monkeypatch.setattr(modeling_bloom, "_get_alibi_slopes", lambda heads, device: torch.zeros(heads, device=device))
    reference = model(input_ids=ids).logits
    monkeypatch.undo()
    assert (unbiased - reference).abs().max() <= 1e-5 * reference.abs().max()
    # ALiBi matters on this model: 100 times the tolerance (the tiny model's logits are ~0.3)
    assert (unbiased - model(input_ids=ids).logits).abs().max() > 1e-3 * reference.abs().max()


@pytest.mark.parametrize("family, table", [("gpt2", "position table transformer.wpe"),
                                           ("opt", "position table model.decoder.embed_positions"),
                                           ("gptj", "rotary sin/cos table")])
@torch.no_grad()
def test_positions_past_a_table_are_refused_in_one_line(family, table):
    """A learned position table (GPT-2, OPT) or GPT-J's sin/cos rows bound the positions a model can embed: a longer
    input to any forward of the Python surface, or a generation that would run past them, is a one-line error naming
    the table, where the model itself fails with an IndexError; up to the bound it runs."""
    hm = HookedModel(build(family, max_position_embeddings=64))
    n = hm._limit[1]
    assert n == 64
    hm(token_batch(1, n, seed=1))  # the whole table: fine
    for call in (lambda: hm(token_batch(1, n + 1, seed=1)), lambda: hm.run_with_cache(token_batch(2, n + 6, seed=1)),
                 lambda: hm.run(token_batch(1, n + 1, seed=1)),
                 lambda: hm.generate(token_batch(1, n - 2, seed=1), max_new_tokens=5, do_sample=False,
                                     stop_at_eos=False)):
        with pytest.raises(UsageError, match=f"past the {n} .*{table}") as e:
            call()
        assert "\n" not in str(e.value)
    out = hm.generate(token_batch(1, n - 2, seed=1), max_new_tokens=3, do_sample=False, stop_at_eos=False)
    assert out.shape == (1, n + 1)  # the last forward reads 64 positions; its token needs no position


def test_a_model_without_layers_is_refused_in_one_line(tmp_path, capsys):
    """A config with zero decoder layers: one line naming it, exit status 2, from Python and from the command line."""
    from transformers import GPT2LMHeadModel

    with pytest.raises(UsageError, match="no decoder layers"):
        HookedModel(GPT2LMHeadModel(config("gpt2", num_hidden_layers=0)))
    spec = 'random:{"model_type": "gpt2", "n_embd": 64, "n_layer": 0, "n_head": 4, "vocab_size": 256}'
    code = cli.main(["scores", spec, "--seq-len", "16", "--num-sequences", "4", "--batch-size", "2",
                     "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "no decoder layers" in err and len(err.splitlines()) == 1 and not (tmp_path / "run").exists()


@torch.no_grad()
def test_a_point_the_model_lacks_is_named_for_what_it_is():
    """hook_pos_embed on ALiBi and RoPE models: the message says where their positions act (not "RoPE" on ALiBi); a
    cache lookup of a point the model does not have says so, not how to select a point it has."""
    for family, where in (("bloom", "ALiBi's bias in attn.hook_attn_scores"), ("llama", "RoPE at attn.hook_rot_q")):
        hm = HookedModel(build(family))
        with pytest.raises(UsageError, match="no position embedding to its residual stream") as e:
            hm.run(token_batch(1, 4, seed=0), hooks={"hook_pos_embed": lambda x, ctx: None})
        assert where in str(e.value) and "TransformerLens has it" not in str(e.value)
    hm = HookedModel(build("gpt2"))
    _, cache = hm.run_with_cache(token_batch(1, 4, seed=0), ["blocks.0.hook_resid_pre"])
    with pytest.raises(KeyError, match="no hook point 'blocks.0.attn.hook_rot_q'"):
        cache["rot_q", 0]
    with pytest.raises(KeyError, match="names_filter"):
        cache["resid_post", 0]  # a point it has, not selected
