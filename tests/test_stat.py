"""`poslens stat NAME MODEL`: every registered statistic to a run directory with intervals and a figure (the recipe
of docs/architecture.md, "Add a statistic", runs as printed in test_recipes.py)."""

from __future__ import annotations

import pytest
import torch
from test_pipeline import saved_tiny_llama, text_of

import poslens
from poslens.cli import main
from poslens.engine.statistics import REGISTRY

SMALL = ["--seq-len", "32", "--num-sequences", "8", "--batch-size", "2", "--groups", "4", "--mode", "pack", "--quiet"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_llama(tmp_path_factory.mktemp("stat") / "tiny")


def eager_sequences(model_dir, attn_implementation="eager"):
    """The model loaded as transformers runs it (no poslens hook) and the sequences a run of SMALL reads."""
    from poslens.engine.data import iter_documents, make_sequences
    from poslens.engine.models import load_model

    model, tok = load_model(str(model_dir), attn_implementation=attn_implementation)
    ids, _ = make_sequences(tok, iter_documents(text_of(model_dir)), 32, 8, mode="pack")
    return model, ids


# ---------------------------------------------------------------- the registered statistics


def test_activation_norm_equals_an_eager_forward(model_dir, tmp_path, capsys):
    out = tmp_path / "norm"
    assert main(["stat", "activation_norm", str(model_dir), "--data", text_of(model_dir), *SMALL,
                 "--point", "blocks.{l}.hook_resid_pre", "--out", str(out)]) == 0
    run = poslens.load(out)
    model, ids = eager_sequences(model_dir, "sdpa")
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states  # entering each layer, then the final norm
    eager = torch.stack([h.double().norm(dim=-1).mean(0) for h in states[:-1]])
    # the same float32 residual stream (the hooked forward is bit-identical to the plain SDPA one), norms in
    # float64; means over groups summed in another order: 1e-12 relative
    torch.testing.assert_close(run["norm"], eager, rtol=1e-12, atol=0)
    assert run.metrics["groups"] == 4 and run.meta["model"]["model_type"] == "llama"
    assert {"norm.png", "norm.pdf"} <= {p.name for p in (out / "figures").iterdir()}


@pytest.mark.parametrize("name", [n for n in REGISTRY if n != "activation_norm"])
def test_every_registered_statistic_writes_intervals_and_a_figure(name, model_dir, tmp_path, capsys):
    out = tmp_path / name
    assert main(["stat", name, str(model_dir), "--data", text_of(model_dir), *SMALL, "--out", str(out)]) == 0
    run = poslens.load(out)
    estimates = run.metrics["estimates"]
    assert estimates and all(e["widest_half_width"] is not None for e in estimates.values()), estimates
    assert len(list((out / "figures").glob("*.png"))) == len(estimates)
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"wrote {out}"
    # the interval line says how this statistic's intervals are made (the probe's: t over its folds)
    how = "t-interval over 4 folds" if name == "position_probe" else "jackknife over 4 groups of sequences"
    assert run.metrics["intervals"].startswith(how) and f"intervals: 95% {how}" in printed[-2], printed[-2]


def test_an_unknown_statistic_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["stat", "no_such_statistic", "model"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "invalid choice: 'no_such_statistic'" in err


def test_a_point_the_model_lacks_is_one_line_naming_the_option_before_any_text(model_dir, tmp_path, capsys,
                                                                                monkeypatch):
    """`--point blocks.{l}.hook_foo`: one line naming --point, exit 2, nothing written, and no sequence cut (the
    check runs on the loaded model before the text is read)."""
    import poslens.engine.pipeline as pipeline

    def no_text(*args, **kwargs):
        raise AssertionError("the text was cut before the point was checked")

    monkeypatch.setattr(pipeline.Analysis, "sequences", no_text)
    out = tmp_path / "bad"
    code = main(["stat", "activation_norm", str(model_dir), "--data", text_of(model_dir), *SMALL,
                 "--point", "blocks.{l}.hook_foo", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not out.exists()
    assert "--point 'blocks.{l}.hook_foo': no hook point 'blocks.0.hook_foo'" in err, err
    # a layer the model lacks names --layers, not the point
    code = main(["stat", "activation_norm", str(model_dir), "--data", text_of(model_dir), *SMALL,
                 "--layers", "99", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not out.exists() and "--layers must be in [0, " in err, err


@pytest.mark.parametrize("option, words", [(["--ridge", "-1"], "--ridge must be in [0, inf], got -1"),
                                           (["--skip-first", "-2"], "--skip-first must be >= 0, got -2"),
                                           (["--skip-first", "31"], "--skip-first 31 leaves 1 of the 32 positions")])
def test_a_statistics_own_option_out_of_its_bounds_is_refused(model_dir, tmp_path, capsys, option, words):
    """A statistic's options keep their declared bounds (a negative ridge penalty was fitted and reported), and are
    checked against the sequence length before the forward (a skip past the sequence failed after it)."""
    out = tmp_path / "bad"
    code = main(["stat", "position_probe", str(model_dir), "--data", text_of(model_dir), *SMALL, *option,
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and words in err and not out.exists(), err
