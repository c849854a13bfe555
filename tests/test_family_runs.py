"""The analyses end to end on a tiny random model of each family added after Llama (OLMo-2, the mixtures of experts,
...), from a config
directory with a byte-level tokenizer (no download): `scores`, `intermediates`, `leakage`, `stat` and `length` exit
0, write their run directories, and record the family and the positional-encoding type of every layer in run.json."""

from __future__ import annotations

import json

import pytest
from test_data import BOS, EOS, byte_tokenizer
from tiny_models import config

from poslens import cli

# family -> the positional encoding per layer run.json must record
EXPECTED = {"olmo2": ("OLMo-2", ["rope", "rope", "rope"]), "gpt2": ("GPT-2", ["learned", "learned", "learned"]),
            "opt": ("OPT", ["learned", "learned", "learned"]), "bloom": ("BLOOM", ["alibi", "alibi", "alibi"]),
            "gpt_neox": ("GPT-NeoX", ["partial-rope"] * 3), "gptj": ("GPT-J", ["partial-rope"] * 3),
            "phi": ("Phi", ["partial-rope"] * 3), "falcon": ("Falcon", ["rope"] * 3),
            "falcon_rw": ("Falcon", ["alibi"] * 3), "gpt_neo": ("GPT-Neo", ["learned"] * 3),
            "mpt": ("MPT", ["alibi"] * 3), "gpt_bigcode": ("GPT-BigCode", ["learned"] * 3),
            "starcoder2": ("Starcoder2", ["rope"] * 3), "cohere": ("Cohere", ["rope"] * 3),
            "cohere2": ("Cohere2", ["rope", "none", "rope"]),
            "olmo": ("OLMo", ["rope"] * 3), "stablelm": ("StableLM", ["partial-rope"] * 3),
            "mixtral": ("Mixtral", ["rope"] * 3), "qwen2_moe": ("Qwen2-MoE", ["rope"] * 3),
            "qwen3_moe": ("Qwen3-MoE", ["rope"] * 3), "olmoe": ("OLMoE", ["rope"] * 3)}
# RoPE families: whether length's NTK and YaRN act (GPT-J's fixed sin/cos table cannot be rescaled: skipped in "all")
ROTATES = {"olmo2": True, "olmo": True, "stablelm": True, "starcoder2": True, "cohere": True, "cohere2": True,
           "gpt_neox": True, "phi": True, "gptj": False, "falcon": True, "mixtral": True, "qwen2_moe": True,
           "qwen3_moe": True, "olmoe": True}
COMMANDS = {"scores": ["scores"], "intermediates": ["intermediates", "--layer", "1"], "leakage": ["leakage"],
            "stat": ["stat", "attention_maps"], "length": ["length", "--train-len", "20", "--eval-lens", "20,40"]}
SIZES = ["--seq-len", "40", "--num-sequences", "6", "--batch-size", "2", "--quiet", "--no-figures"]


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_every_analysis_runs_and_records_the_positional_encoding(family, tmp_path):
    spec = _saved(family, tmp_path / "m")
    name, layers = EXPECTED[family]
    for key, args in COMMANDS.items():
        out = tmp_path / key
        sizes = SIZES[2:] if key == "length" else SIZES  # length cuts its own sequences (--train-len, --eval-lens)
        extra = ["--early-queries", "8"] if key == "leakage" else []
        assert cli.main([*args, spec, *sizes, *extra, "--out", str(out)]) == 0, key
        meta = json.loads((out / "run.json").read_text())
        assert meta["model"]["family"] == name, key
        assert meta["model"]["positional_encoding"] == layers, key
        assert meta["model"]["variant"]["layers"] == layers, key
        if key == "length" and family in ROTATES:  # NTK and YaRN run where the angles come from inv_freq
            ran = "ntk" not in meta["metrics"]["skipped"]
            assert ran == ROTATES[family] and ("ntk" in meta["metrics"]["interventions"]) == ran, meta["metrics"]


def _saved(family: str, directory):
    byte_tokenizer().save_pretrained(directory)
    cfg = config(family, vocab_size=300, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None).to_dict()
    (directory / "config.json").write_text(json.dumps(cfg))
    return f"random:{directory}"


@pytest.mark.parametrize(("args", "message"), [
    (["length", "--train-len", "32", "--eval-lens", "32,128"],
     "--eval-lens: 128 tokens reach past the 64 positions of the model's position table transformer.wpe"),
    (["length"],  # train_len defaults to the table's 64 rows: nothing past it; the line says what runs instead
     "and so does every length past --train-len 64: such a model has no position past its table; to compare positions "
     "inside it, set a shorter --train-len, e.g. --train-len 32 with --eval-lens 32,64"),
    (["length", "--eval-lens", "32,64"],  # lengths given, train_len the table's: the same line, not 64,128,256,512
     "such a model has no position past its table; to compare positions inside it, set a shorter --train-len, e.g. "
     "--train-len 32 with --eval-lens 32,64"),
    (["length", "--train-len", "16", "--eval-lens", "16,32", "--interventions", "ntk"],
     "ntk: the model has no RoPE layer"),
    (["scores", "--seq-len", "100"], "--seq-len 100 is beyond the model's window of 64 positions"),
    (["scores", "--pe", "none", "--seq-len", "16"], "--pe none removes RoPE, and this GPT-2 model has none"),
    (["scores", "--pe", "rope", "--seq-len", "16"], "--pe rope keeps a model's RoPE, and this GPT-2 model has none"),
])
def test_gpt2_refuses_what_its_learned_table_cannot_do_in_one_line(args, message, tmp_path, capsys):
    """A learned table of 64 rows: no length past it, no RoPE scaling, no RoPE to remove; one line, exit 2, no run."""
    spec = _saved("gpt2", tmp_path / "m")
    out = tmp_path / "out"
    code = cli.main([args[0], spec, *args[1:], "--num-sequences", "4", "--batch-size", "2", "--quiet", "--out",
                     str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists()


@pytest.mark.parametrize("family", ["gpt_neox", "gptj", "phi"])
def test_card_runs_on_the_partial_rotary_families(family, tmp_path):
    """`poslens card` (every analysis it reads, the probe, length with the interventions the family allows) on a tiny
    model of each, its scheme panel saying partial-rope for every layer."""
    from test_card import SIZES

    spec = _saved(family, tmp_path / "m")
    assert cli.main(["card", spec, "--sizes", SIZES, "--out", str(tmp_path / "out"), "--quiet"]) == 0
    page = (tmp_path / "out" / "card" / "card.md").read_text()
    assert all(f"| {layer} | partial-rope | full |" in page for layer in (1, 2, 3)), page[:2000]


@pytest.mark.parametrize(("args", "overrides", "message"), [
    (["length", "--train-len", "32", "--eval-lens", "32,128"], {},
     "--eval-lens: 128 tokens reach past the 64 positions of the model's position table model.decoder.embed_positions"),
    (["length", "--train-len", "16", "--eval-lens", "16,32", "--interventions", "yarn"], {},
     "yarn: the model has no RoPE layer"),
    (["scores", "--pe", "none", "--seq-len", "16"], {}, "--pe none removes RoPE, and this OPT model has none"),
    (["scores", "--pe", "rope", "--seq-len", "16"], {}, "--pe rope keeps a model's RoPE, and this OPT model has none"),
    (["scores", "--seq-len", "16"], {"do_layer_norm_before": False},
     "OPT with do_layer_norm_before=False (OPT-350m's post-LN form) is not supported"),
    (["scores", "--seq-len", "16"], {"word_embed_proj_dim": 32},
     "OPT with word_embed_proj_dim 32 != hidden_size 64 (project_in/project_out, OPT-350m) is not supported"),
])
def test_opt_refuses_what_it_cannot_do_in_one_line(args, overrides, message, tmp_path, capsys):
    """OPT's table of 64 rows (past its offset of 2): no length past it, no RoPE to scale or remove; the post-LN and
    project_in/out forms refused before any weight is read; one line, exit 2, no run directory."""
    directory = tmp_path / "m"
    _saved("opt", directory)
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, **overrides}))
    out = tmp_path / "out"
    code = cli.main([args[0], f"random:{directory}", *args[1:], "--num-sequences", "4", "--batch-size", "2",
                     "--quiet", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists()
