"""The analyses end to end on a tiny random model of each family added after Llama (OLMo-2, ...), from a config
directory with a byte-level tokenizer (no download): `scores`, `intermediates`, `leakage`, `stat` and `length` exit
0, write their run directories, and record the family and the positional-encoding type of every layer in run.json."""

from __future__ import annotations

import json

import pytest
from test_data import BOS, EOS, byte_tokenizer
from tiny_models import config

from poslens import cli

# family -> the positional encoding per layer run.json must record
EXPECTED = {"olmo2": ("OLMo-2", ["rope", "rope", "rope"])}
COMMANDS = {"scores": ["scores"], "intermediates": ["intermediates", "--layer", "1"], "leakage": ["leakage"],
            "stat": ["stat", "attention_maps"], "length": ["length", "--train-len", "20", "--eval-lens", "20,40"]}
SIZES = ["--seq-len", "40", "--num-sequences", "6", "--batch-size", "2", "--quiet", "--no-figures"]


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_every_analysis_runs_and_records_the_positional_encoding(family, tmp_path):
    model_dir = tmp_path / "m"
    byte_tokenizer().save_pretrained(model_dir)
    cfg = config(family, vocab_size=300, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None).to_dict()
    (model_dir / "config.json").write_text(json.dumps(cfg))
    name, layers = EXPECTED[family]
    for key, args in COMMANDS.items():
        out = tmp_path / key
        sizes = SIZES[2:] if key == "length" else SIZES  # length cuts its own sequences (--train-len, --eval-lens)
        extra = ["--early-queries", "8"] if key == "leakage" else []
        assert cli.main([*args, f"random:{model_dir}", *sizes, *extra, "--out", str(out)]) == 0, key
        meta = json.loads((out / "run.json").read_text())
        assert meta["model"]["family"] == name, key
        assert meta["model"]["positional_encoding"] == layers, key
        assert meta["model"]["variant"]["layers"] == layers, key
