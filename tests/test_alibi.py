"""ALiBi (BLOOM, MPT) as a length intervention and as an ablation, against Hugging Face's own forward with the slopes
changed where transformers computes them (BLOOM's `_get_alibi_slopes`, MPT's `build_mpt_alibi_tensor`):
`alibi-scale:F` is the model with every slope times F, `--pe none` the model with every slope 0; the interventions that
act on RoPE are refused on ALiBi in one line and alibi-scale on a model without ALiBi. Tolerance: 1e-6 of the largest
logit (the bias slope * F * position is rounded once in float32 by one route, twice by the other; F = 1/2 is
exact)."""

from __future__ import annotations

import json

import pytest
import torch
from test_data import BOS, EOS, byte_tokenizer
from tiny_models import build, config, token_batch
from transformers.models.bloom import modeling_bloom
from transformers.models.mpt import modeling_mpt

from poslens import cli
from poslens.analyses.length.interventions import parse
from poslens.analyses.length.plan import plan_passes
from poslens.analyses.length.run import LengthConfig
from poslens.engine.families import positional_encoding_record, set_positional_encoding
from poslens.engine.hooks import HookedModel

# where transformers computes a family's ALiBi: BLOOM's slopes, MPT's whole bias (slope_h * (j - (T - 1)))
SLOPES_AT = {"bloom": (modeling_bloom, "_get_alibi_slopes"), "mpt": (modeling_mpt, "build_mpt_alibi_tensor")}


def _hugging_face_with_slopes_times(model, ids, factor, monkeypatch):
    """Hugging Face's logits with transformers' function that computes the model's ALiBi (SLOPES_AT) returning its
    values times `factor`."""
    module, name = SLOPES_AT[model.config.model_type]
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, **kwargs: original(*args, **kwargs) * factor)
    try:
        return model(input_ids=ids).logits
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("family", ["bloom", "mpt"])
@pytest.mark.parametrize("factor", [0.5, 0.3, 2.0])
@torch.no_grad()
def test_alibi_scale_is_the_model_with_every_slope_times_the_factor(family, factor, monkeypatch):
    model = build(family)
    hm = HookedModel(model)
    ids = token_batch(2, 16, seed=3)
    iv = parse(f"alibi-scale:{factor}", 8)
    with iv.applied(hm, ids) as p:
        got = hm.run(p.ids, p.attention_mask, hooks=p.hooks, position_ids=p.position_ids, logits=True).logits
    want = _hugging_face_with_slopes_times(model, ids, factor, monkeypatch)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    plain = model(input_ids=ids).logits
    assert (plain - want).abs().max() > 1e-3 * want.abs().max()  # the scaling changed the model
    assert torch.equal(hm.run(ids, logits=True).logits, plain)  # and was undone after the block


@pytest.mark.parametrize("family", ["bloom", "mpt"])
@torch.no_grad()
def test_pe_none_on_alibi_is_the_model_without_alibi_and_is_recorded(family, monkeypatch):
    model = build(family)
    ids = token_batch(2, 16, seed=5)
    want = _hugging_face_with_slopes_times(model, ids, 0.0, monkeypatch)
    set_positional_encoding(model, "none")
    hm = HookedModel(model)
    seen = {}

    def read(x, ctx):
        seen["bias"] = ctx.score_bias

    got = hm.run(ids, hooks={"blocks.0.attn.hook_attn_scores": read}, logits=True).logits
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    assert torch.equal(model(input_ids=ids).logits, got)  # the plain forward too, for the model's lifetime
    assert not seen["bias"].any()
    record = positional_encoding_record(model)
    assert record["layers"] == ["none"] * 3 and "alibi_slopes" not in record


def test_alibi_scale_default_follows_each_length():
    """Without a factor: one pass per evaluation length T past L, slopes times L / T (at most 1)."""
    cfg = LengthConfig(model="x", train_len=16, eval_lens=[16, 32, 64], interventions=["alibi-scale"])
    cfg.settle(build("bloom"))
    passes = [(p.intervention, p.length, p.factor) for p in plan_passes(cfg) if p.intervention != "none"]
    assert passes == [("alibi-scale", 32, 0.5), ("alibi-scale", 64, 0.25)]
    assert parse("alibi-scale", 16).name == "alibi-scale" and parse("alibi-scale:0.25", 16).factor == 0.25


def _saved(family, directory):
    byte_tokenizer().save_pretrained(directory)
    cfg = config(family, vocab_size=300, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None).to_dict()
    (directory / "config.json").write_text(json.dumps(cfg))
    return f"random:{directory}"


@pytest.mark.parametrize(("family", "intervention", "message"), [
    ("bloom", "ntk", "ntk: the model has no RoPE layer"),
    ("bloom", "yarn:2", "yarn:2: the model has no RoPE layer"),
    ("falcon_rw", "ntk", "ntk: the model has no RoPE layer"),
    ("mpt", "yarn:2", "yarn:2: the model has no RoPE layer"),
    ("llama", "alibi-scale:0.5", "alibi-scale:0.5: the model has no ALiBi layer (its positional encoding is rope)"),
])
def test_interventions_of_another_scheme_are_refused_in_one_line(family, intervention, message, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["length", _saved(family, tmp_path / "m"), "--train-len", "16", "--eval-lens", "16,32",
                     "--interventions", intervention, "--num-sequences", "4", "--batch-size", "2", "--quiet",
                     "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"apply_residual_connection_post_layernorm": True},
     "BLOOM with apply_residual_connection_post_layernorm=True is not supported"),
    ({"pretraining_tp": 2, "slow_but_exact": True},
     "BLOOM with slow_but_exact=True and pretraining_tp > 1 is not supported"),
])
def test_bloom_forms_not_built_are_refused_in_one_line(overrides, message, tmp_path, capsys):
    assert_config_refused("bloom", overrides, message, tmp_path, capsys)


def assert_config_refused(family: str, overrides: dict, message: str, tmp_path, capsys) -> None:
    """`scores` on the tiny `family` config with `overrides` exits 2 with one line holding `message`, no run written."""
    directory = tmp_path / "m"
    _saved(family, directory)
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, **overrides}))
    out = tmp_path / "out"
    code = cli.main(["scores", f"random:{directory}", "--seq-len", "16", "--num-sequences", "4", "--batch-size", "2",
                     "--quiet", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_pe_none_on_bloom_runs_and_is_recorded(tmp_path):
    out = tmp_path / "out"
    assert cli.main(["scores", _saved("bloom", tmp_path / "m"), "--pe", "none", "--seq-len", "16", "--num-sequences",
                     "4", "--batch-size", "2", "--quiet", "--no-figures", "--out", str(out)]) == 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["model"]["positional_encoding"] == ["none"] * 3


@torch.no_grad()
def test_bloom_token_replacement_at_hook_embed_is_what_the_model_embeds():
    """BLOOM's hook_embed comes after its embedding LayerNorm (as TransformerLens's): the leakage analysis's `token:ID`
    writes there what the model computes for token ID, so the logits equal a plain forward with token ID at position 0
    (float32 rounding of the same LayerNorm: 1e-6 of the largest logit)."""
    from poslens.analyses.leakage import interventions as leakage

    model = build("bloom")
    hm = HookedModel(model)
    ids = token_batch(3, 10, seed=4)
    _, hooks, _ = leakage.prepare("token:7", model, hm, ids)
    got = hm.run(ids, hooks=hooks, logits=True).logits
    own = ids.clone()
    own[:, 0] = 7
    want = model(input_ids=own).logits
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    assert (model(input_ids=ids).logits - want).abs().max() > 1e-3 * want.abs().max()


@pytest.mark.parametrize("family", ["bloom", "falcon_rw", "mpt"])
@torch.no_grad()
def test_alibi_hooks_see_the_kernels_q_and_k_and_cached_steps_the_same_scores(family):
    """On ALiBi a hook at attn.hook_attn_scores sees ctx.rot_q and ctx.rot_k as the kernel reads them ([B, H, T, D]);
    a reader of the factors (`from_factors`) gets them with the bias's two coordinates ([B, H, T, D + 2]), whose
    product times the scaling is the scores the other hook sees (TransformerLens's form, slope_h (j - i); 1e-5 of the
    largest score: float32 products summed in another order). With the key/value cache (`generate`), the step that
    runs the last token alone sees that token's row of the full forward's scores (1e-5: the same products, another
    GEMM shape)."""
    from poslens.engine.hooks import from_factors

    hm = HookedModel(build(family))
    ids = token_batch(1, 7, seed=2)
    name = "blocks.1.attn.hook_attn_scores"
    seen = {}

    def plain(x, ctx):
        seen.update(scores=x.clone(), q=ctx.rot_q.shape, k=ctx.rot_k.shape)

    def factors(_, ctx):
        seen["product"] = ctx.rot_q @ ctx.rot_k.transpose(-1, -2) * ctx.scaling
        seen["factor_shape"] = ctx.rot_q.shape

    hm.run(ids, hooks={name: [from_factors(factors), plain]})
    d = hm.cfg.d_head
    assert seen["q"] == (1, hm.cfg.n_heads, 7, d) and seen["k"][-1] == d and seen["factor_shape"][-1] == d + 2
    lower = torch.ones(7, 7, dtype=torch.bool).tril()
    scores = seen["scores"]
    assert (seen["product"][..., lower] - scores[..., lower]).abs().max() <= 1e-5 * scores[..., lower].abs().max()
    steps = []
    hm.add_hook(name, lambda x, hook: steps.append(x.clone()))
    hm.generate(ids[:, :6], max_new_tokens=2, do_sample=False, stop_at_eos=False)
    hm.reset_hooks()
    full = hm.run_with_cache(torch.cat([ids[:, :6], hm.generate(ids[:, :6], max_new_tokens=1, do_sample=False,
                                                                stop_at_eos=False)[:, 6:]], 1), [name])[1][name]
    assert steps[1].shape == (1, hm.cfg.n_heads, 1, 7)
    assert (steps[1][..., 0, :] - full[..., 6, :]).abs().max() <= 1e-5 * full[..., 6, :].abs().max()


@pytest.mark.parametrize("family", ["bloom", "falcon_rw", "mpt"])
def test_pe_rope_on_alibi_is_refused_in_one_line(family, tmp_path, capsys):
    """`--pe rope` keeps a model's RoPE: on an ALiBi model, which has none, one line naming where its positions come
    from, exit 2, no run (it was accepted and recorded as pe rope beside an ALiBi model record)."""
    out = tmp_path / "out"
    code = cli.main(["scores", _saved(family, tmp_path / "m"), "--pe", "rope", "--seq-len", "16", "--num-sequences",
                     "4", "--batch-size", "2", "--quiet", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "ALiBi's biases in the scores" in err, err
    assert not out.exists()
