"""`poslens length` end to end on tiny local-directory Llamas trained at no length (random weights, 16 positions):
the run directory past max_position_embeddings, interventions that must be the identity, seeds, resume with
seeds, and bad input as one line with exit status 2 and nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_pipeline import saved_tiny_llama
from tiny_models import build

import poslens
from poslens.analyses.length.run import LengthConfig, run_length
from poslens.cli import main
from poslens.engine.pipeline import checkpoint_path

L = 16


def saved(directory: Path, seed: int = 0, family: str = "llama", **overrides) -> Path:
    """A tiny random Llama (or another family of tests/tiny_models.py) with 16 positions (weights of `seed`) and the
    byte-level tokenizer of the pipeline tests."""
    saved_tiny_llama(directory)
    data = json.loads((directory / "tokenizer.json").read_text())  # byte ids in one order for every model (the
    vocab = data["model"]["vocab"]  # byte-level alphabet comes in an arbitrary order), so the seeds share a tokenizer
    data["model"]["vocab"] = {**{c: i for i, c in enumerate(sorted(c for c in vocab if vocab[c] < 256))},
                              **{c: i for c, i in vocab.items() if i >= 256}}
    (directory / "tokenizer.json").write_text(json.dumps(data))
    build(family, seed=seed, **{"vocab_size": 258, "max_position_embeddings": L, **overrides}).save_pretrained(
        directory)
    return directory


def retokenized(directory: Path, seed: int) -> Path:
    """A tiny model like `saved`'s whose tokenizer has the same size (258) but two bytes' ids swapped: the same text
    is other ids to it."""
    saved(directory, seed=seed)
    data = json.loads((directory / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = list(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (directory / "tokenizer.json").write_text(json.dumps(data))
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-length")
    out = {"a": saved(root / "a"), "b": saved(root / "b", seed=1), "wide": saved(root / "wide", seed=2,
                                                                                num_key_value_heads=4),
           "long": saved(root / "long", seed=3, max_position_embeddings=2 * L), "retok": retokenized(root / "retok", 4)}
    out["copy"] = Path(shutil.copytree(out["b"], root / "copy-of-b"))
    return out


def text(model: Path) -> str:
    return str(model.parent / f"{model.name}.txt")


def args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["length", str(model), "--data", text(model), "--train-len", str(L), "--eval-lens", "16,32,64",
            "--num-sequences", "8", "--batch-size", "2", "--groups", "4", "--out", str(out), "--quiet", *extra]


def test_command_past_max_position_embeddings(models, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(args(models["a"], out, "--interventions", "logn,ntk:1,ntk,window,freeze")) == 0
    printed = capsys.readouterr().out
    assert "effect" in printed and f"wrote {out}" in printed
    run = poslens.load(out)
    m = run.metrics
    assert run.meta["kind"] == "length" and run.config["seq_len"] == 64 and m["edges"] == [1, 16, 32, 64]
    entry = m["models"][0]
    assert len(entry["buckets"]) == 3 and set(entry["rise"]) == {"32", "64"}
    for b in entry["buckets"]:
        assert b["lo"] <= b["value"] <= b["hi"]
    # NTK with factor 1 is the identity: the paired effect is exactly 0 with a zero-width interval
    for t in ("32", "64"):
        e = entry["effects"]["ntk:1"][t]
        assert e["value"] == e["lo"] == e["hi"] == 0.0
    # ntk without a factor: one pass per length past L (factor T / L), each with its own effect
    assert set(entry["effects"]["ntk"]) == {"32", "64"}
    # logn leaves queries below L alone: the loss over [1, L) is bit-identical to none's
    first = run["loss_binned"][:4]
    assert torch.equal(run["loss_binned/logn"][:4], first)
    assert not torch.equal(run["loss_binned/logn"][4:], run["loss_binned"][4:])
    # a tokenizer without BOS: position 0 differs between sequences, so freezing it is a real intervention
    assert entry["effects"]["freeze"]["64"]["value"] != 0.0
    # the maps at each evaluation length, past max_position_embeddings (16)
    assert set(entry["maps"]) == {"16", "32", "64"} and run["maps/scores"].shape == (3, 64, 64)
    assert len(entry["maps"]["64"]["attn/share_mask_only"]["value"]) == 3  # the decomposition of poslens leakage
    assert not any(k.startswith("split/") for k in entry["maps"]["64"])
    # attention on the keys seen: log(i + 1) under the plain causal mask, capped at the window under window
    logk = torch.log1p(torch.arange(64, dtype=torch.float64))
    torch.testing.assert_close(run["profile/none/log_keys"].double(), logk.expand(3, 64), rtol=0, atol=1e-6)
    capped = torch.log(torch.clamp(torch.arange(64, dtype=torch.float64) + 1, max=L))
    torch.testing.assert_close(run["profile/window/log_keys"].double(), capped.expand(3, 64), rtol=0, atol=1e-6)
    for f in ("loss_by_position.png", "attention_gap_by_position.png", "attention_key0_by_position.png",
              "maps_at_longest.jpg"):
        assert (out / "figures" / f).exists()


def test_what_the_report_does_not_read_can_be_left_out_with_the_same_numbers(models, tmp_path):
    """NTK and YaRN at the longest length only (`scaled_at="longest"`) and no attention profile under the
    interventions give the very numbers of the full run where both have them (the same passes on the same batches:
    equal to the last bit): the effects at the longest length, the loss curves, the profile without intervention;
    the shorter lengths' NTK and YaRN effects and the interventions' profiles are then absent."""
    cfg = dict(model=str(models["a"]), data=text(models["a"]), train_len=L, eval_lens=[16, 32, 64], num_sequences=8,
               batch_size=2, groups=4, interventions=["logn", "ntk", "yarn", "window", "sink-window"], maps=False,
               figures=False)
    full = poslens.load(run_length(LengthConfig(**cfg), tmp_path / "full", progress=False))
    lean = poslens.load(run_length(LengthConfig(**cfg, scaled_at="longest", intervention_profiles=False),
                                   tmp_path / "lean", progress=False))
    a, b = full.metrics["models"][0], lean.metrics["models"][0]
    for spec in ("ntk", "yarn"):
        assert set(a["effects"][spec]) == {"32", "64"} and set(b["effects"][spec]) == {"64"}
        assert b["effects"][spec]["64"] == a["effects"][spec]["64"]
    for spec in ("logn", "window", "sink-window"):
        assert b["effects"][spec] == a["effects"][spec]
        assert f"profile/{spec}/gap" in full.tensors and f"profile/{spec}/gap" not in lean.tensors
    assert b["profile"] == a["profile"]
    torch.testing.assert_close(lean["loss"], full["loss"], rtol=0, atol=0, equal_nan=True)  # position 1: no loss


def test_seeds_give_a_t_interval_and_resume_swaps_the_right_weights(models, tmp_path, monkeypatch):
    cfg = dict(model=str(models["a"]), data=text(models["a"]), train_len=L, eval_lens=[16, 32], num_sequences=4,
               batch_size=2, groups=2, interventions=["logn"], seed_models=[str(models["b"])], maps=False,
               checkpoint_every=1, figures=False)
    full = poslens.load(run_length(LengthConfig(**cfg), tmp_path / "full", progress=False))
    s = full.metrics["seeds"]
    per = [m["rise"]["32"]["value"] for m in full.metrics["models"]]
    assert s["rise"]["32"]["per_model"] == per and s["rise"]["32"]["n"] == 2
    assert s["rise"]["32"]["lo"] < s["rise"]["32"]["value"] < s["rise"]["32"]["hi"]
    assert per[0] != per[1]  # two seeds, two models
    # interrupted in the second model's passes, resumed: the same numbers (the swap is redone on resume)
    from poslens.engine import hooks as hooks_mod

    original = hooks_mod.HookedModel.run
    calls = {"n": 0}

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 6:  # units: a/none, a/logn (2 batches each), then b/none's second batch
            raise KeyboardInterrupt
        return original(self, *a, **k)

    monkeypatch.setattr(hooks_mod.HookedModel, "run", flaky)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        run_length(LengthConfig(**cfg), out, progress=False)
    assert checkpoint_path(out).exists()
    monkeypatch.setattr(hooks_mod.HookedModel, "run", original)
    resumed = poslens.load(run_length(LengthConfig(**cfg), out, progress=False))
    assert resumed.meta["resumed_from_unit"] == 5
    assert json.dumps(resumed.metrics) == json.dumps(full.metrics)


@pytest.mark.parametrize("extra, words", [
    (["--eval-lens", "8,16"], "--eval-lens 8,16: the longest must be above --train-len 16"),
    (["--interventions", "shift"], "--interventions: unknown intervention 'shift'"),
    (["--interventions", "ntk:0"], "--interventions: 'ntk:0': the factor after the colon must be a number >= 1"),
    (["--interventions", "window:0"], "--interventions: 'window:0': the window after the colon must be a whole number"),
    (["--profile-every", "0"], "--profile-every must be >= 1"),
    (["--seed-models", "WIDE"], "--seed-models: {WIDE} is not another seed"),
    (["--seed-models", "B", "--out", "B"], "is this run's input"),
    (["--seed-models", "A"], "--seed-models: {A} is the evaluated model again"),
    (["--seed-models", "B,B"], "--seed-models: {B} is seed model {B} again"),
    (["--seed-models", "B,COPY"], "--seed-models: {COPY} has the same weights as {B}"),
    (["--seed-models", "LONG"], "--seed-models: {LONG} was trained at length 32 and {A} at 16"),
    (["--seed-models", "RETOK"], "--seed-models: {RETOK} has another tokenizer than {A}"),
    (["--out", "A/length"], "--out {A}/length is inside this run's input {A};"),
])
def test_bad_input_is_one_line_and_writes_nothing(models, tmp_path, capsys, extra, words):
    """Each refused in one line, exit status 2, nothing written: among them a seed model that is the model again
    (by path or as a copy of its weights), one trained at another length, one with another tokenizer of the same
    size, and an --out inside the model directory."""
    out = tmp_path / "run"
    names = {k.upper(): str(v) for k, v in models.items()}
    line = [",".join(names.get(x, x) for x in arg.split(",")) for arg in extra]
    line = [f"{names['A']}/length" if x == "A/length" else x for x in line]
    argv = args(models["a"], out)
    if "--out" in line:
        out = Path(line[line.index("--out") + 1])
        i = argv.index("--out")
        del argv[i:i + 2]
    if "--eval-lens" in line:
        i = argv.index("--eval-lens")
        del argv[i:i + 2]
    before = {m: sorted(p.name for p in models[m].iterdir()) for m in ("a", "b")}
    assert main(argv + line) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words.format(**names) in err, err
    assert not out.exists() or out == models["b"] and not (out / "run.json").exists()
    assert {m: sorted(p.name for p in models[m].iterdir()) for m in ("a", "b")} == before


@pytest.mark.parametrize("family, field, share, other", [("gptj", "rotary_dim", 0.5, 4),
                                                       ("gpt_neox", "rotary_pct", 0.25, 0.5)])
def test_a_seed_turning_another_share_of_each_head_is_refused(family, field, share, other, tmp_path, capsys):
    """Partial RoPE: two models alike but for the rotary width (GPT-J's rotary_dim, GPT-NeoX's rotary_pct) are not two
    seeds of one variant; each run records the share it turns. Before, GPT-J's were taken as seeds (its rotary width
    has no parameter) and GPT-NeoX's were refused for a 'rope base' that was the same."""
    rows = {"max_position_embeddings": 64}  # GPT-J's sin/cos table: as many rows as the longest length read
    a, b = saved(tmp_path / "a", family=family, **rows), saved(tmp_path / "b", seed=1, family=family, **rows,
                                                                **{field: other})
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(args(a, out, "--seed-models", str(b))) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{b} is not another seed" in err and "share of each head RoPE turns" in err, err
    assert not out.exists()
    assert main(args(a, out, "--interventions", "none")) == 0
    assert poslens.load(out).meta["model"]["variant"]["rotary_fraction"] == share


def test_ntk_on_a_nope_model_and_memory_are_refused_up_front(tmp_path, capsys, monkeypatch):
    nope = saved(tmp_path / "nope")
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(nope).model_type == "llama"
    out = tmp_path / "run"
    # --pe none: the checkpoint read without RoPE; "all" skips NTK and YaRN with a note, naming them is refused
    assert main(args(nope, out, "--pe", "none", "--interventions", "ntk")) == 2
    assert "--interventions: ntk: the model has no RoPE layer" in capsys.readouterr().err
    monkeypatch.setattr("poslens.engine.pipeline.available_memory", lambda: 1 << 20)
    assert main(args(nope, out, "--pe", "none")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "averaged maps at the longest length" in err and "lower --eval-lens" in err
    assert not out.exists()
