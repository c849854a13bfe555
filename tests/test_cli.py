"""The command line: runs write complete run directories; bad input is one line, exit 2, nothing written."""

import json
import os
import sys

import numpy as np
import pytest
import torch
from test_pipeline import saved_tiny_llama

import poslens
from poslens import cli
from poslens.analyses.scores import noise_text
from poslens.cli import COMMANDS, main
from poslens.errors import UsageError
from poslens.stack.config import StackConfig
from poslens.stack.gramflow import gram_flow


def test_gramflow_command_matches_library(tmp_path):
    out = tmp_path / "gf"
    assert main(["gramflow", "--alpha", "0.2", "--seq-len", "12", "--layers", "3", "--out", str(out)]) == 0
    run = poslens.load(out)
    ref = gram_flow(StackConfig(n=12, alpha=0.2, layers=3)).scores
    assert np.allclose(run["scores"].numpy(), ref, equal_nan=True, rtol=0, atol=0)
    assert run.config["alpha"] == 0.2 and run.meta["kind"] == "gramflow"
    assert run.metrics["layers"][1]["rows_increasing"] == {"holding": 11, "checked": 11}
    assert (out / "figures" / "scores.png").exists() and (out / "figures" / "scores.pdf").exists()


def test_simulate_command_writes_maps_with_errors(tmp_path):
    out = tmp_path / "mc"
    args = ["simulate", "--seq-len", "10", "--d", "16", "--samples", "300", "--pe", "rope", "--mask", "none",
            "--quiet", "--out", str(out)]
    assert main(args) == 0
    run = poslens.load(out)
    assert run["scores_mean"].shape == (4, 10, 10) and run["cosine_mean"].shape == (5, 10, 10)
    assert run["scores_se"].min() >= 0 and run.meta["samples"] == 300
    assert (out / "figures" / "scores_normalised.png").exists()  # RoPE: normalised maps too
    assert main(args) == 2  # exists: needs --force
    assert main([*args, "--force", "--maps", "scores"]) == 0
    only = poslens.load(out)
    assert set(only.tensors) == {"scores_mean", "scores_se"}
    # the same draws: bit-identical scores whichever maps are computed
    assert np.allclose(only["scores_mean"], run["scores_mean"], equal_nan=True, rtol=0, atol=0)
    assert main([*args, "--force", "--maps", "probs"]) == 0  # no scores: tensors only, no score figures
    probs = poslens.load(out)
    assert set(probs.tensors) == {"probs_mean", "probs_se"} and probs.metrics == {"layers": []}
    assert np.allclose(probs["probs_mean"], run["probs_mean"], equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("args, words", [
    (["simulate", "--alpha", "1.0"], "alpha must be in [0, 1)"),
    (["simulate", "--alpha", "-0.1"], "alpha"),
    (["simulate", "--pe", "rope", "--d", "63"], "d must be even"),
    (["simulate", "--seq-len", "1"], "--seq-len must be >= 2"),  # StackConfig's n, shown as its flag
    (["simulate", "--samples", "0"], "samples"),
    (["simulate", "--mask", "sliding"], "window"),
    (["simulate", "--mask", "sliding", "--window", "0"], "window"),
    (["simulate", "--window", "4"], "window"),
    (["simulate", "--norm", "batchnorm"], "argument --norm: invalid choice: 'batchnorm'"),
    (["simulate", "--device", "cuda"], "cuda"),
    (["gramflow", "--layers", "0"], "layers"),
    (["gramflow", "--rope-scaling", "0.5", "--pe", "rope"], "--rope-scaling must be >= 1"),
    (["reproduce", "--samples", "0"], "samples"),
    (["reproduce", "--sizes", "nope"], "--sizes: 'nope' is not SECTION.KEY=VALUE"),
    (["reproduce", "--no-models", "--sizes", "nope.bogus=3"], "--sizes: section nope has no size 'bogus'"),
    (["reproduce", "--no-models", "--sizes", "nowhere.samples=3"], "no report section named 'nowhere'"),
    (["reproduce", "--no-models", "--sizes", "nope.samples=abc"],
     "nope's samples takes a value like 100000, not 'abc'"),
    (["simulate", "--alpha", "abc"], "invalid float"),
    (["simulate", "--maps", "scores,logits"], "--maps"),
])
def test_bad_input(tmp_path, capsys, args, words):
    out = tmp_path / "out"
    try:
        code = main([*args, "--out", str(out)])
    except SystemExit as e:  # argparse type errors exit from the parser
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and words in err, err
    assert list(tmp_path.iterdir()) == []


def test_unwritable_output_is_one_line(tmp_path, capsys):
    if os.geteuid() == 0:  # root ignores permissions: nothing to test
        pytest.skip("running as root: directory permissions are not enforced")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code = main(["gramflow", "--out", str(locked / "sub" / "run")])
    finally:
        locked.chmod(0o700)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "writable" in err


def test_output_path_is_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["gramflow", "--out", str(f / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("sub", [[], *([name] for name in COMMANDS), ["stat", "activation_norm"]])
def test_help_everywhere(sub, capsys):
    """Every command's --help (in-process: the subprocess version paid a torch import per command)."""
    with pytest.raises(SystemExit) as e:
        main([*sub, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: poslens"), out


def test_every_writing_command_gets_the_same_out_force_quiet():
    """--out/--force/--quiet come from one place, with one meaning of --force, for every command that writes."""
    from poslens.options import Parser, add_output_args

    reference = Parser(prog="r")
    add_output_args(reference, "x")
    force_help = next(a.help for a in reference._actions if a.dest == "force")
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in list(sub.choices.items()) + [(f"stat {n}", q) for n, q in
                                                 next(a for a in sub.choices["stat"]._actions
                                                      if a.dest == "statistic").choices.items()]:
        if name == "stat":
            continue
        helps = {a.dest: a.help for a in p._actions}
        assert helps["force"] == force_help and helps["out"].startswith("run directory to write"), name


def test_row_check_printed_only_where_it_can_mean_something(tmp_path, capsys):
    out = tmp_path / "gf"
    assert main(["gramflow", "--seq-len", "8", "--alpha", "0.3", "--layers", "3", "--no-figures",
                 "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # layer 1 scores are the input Gram: 1 on the diagonal, alpha everywhere below it, so no row can increase
    first = poslens.load(out)["scores"][0].numpy()
    below = first[np.tril_indices(8, -1)]
    assert np.allclose(below, 0.3, rtol=0, atol=1e-12) and np.allclose(np.diag(first), 1.0, rtol=0, atol=1e-12)
    assert lines[0].startswith("layer 1:") and "rows increasing" not in lines[0]
    assert "rows increasing in j: 7/7" in lines[1] and "rows increasing in j: 7/7" in lines[2]
    assert lines[-1] == f"wrote {out}"
    # with RoPE, layer 1 is the rotated Gram (position dependent): the check is printed
    assert main(["gramflow", "--seq-len", "8", "--pe", "rope", "--layers", "2", "--no-figures", "--out",
                 str(tmp_path / "rope")]) == 0
    assert "rows increasing" in capsys.readouterr().out.splitlines()[0]


def failing_command(exc):
    def run(args):
        from tqdm import tqdm

        bar = tqdm(total=10, file=sys.stderr)
        bar.update(3)  # a bar left mid-line, as when a run fails part-way
        raise exc
    return run


@pytest.mark.parametrize("exc, code, line", [
    (UsageError("layers must be >= 1, got 0", param="layers"), 2,
     "poslens gramflow: error: --layers must be >= 1, got 0"),
    (KeyboardInterrupt(), 130, "poslens gramflow: interrupted; nothing was written to --out (rerun the same "
     "command; runs with checkpoints resume where they stopped)"),
])
def test_messages_after_a_progress_bar_start_on_their_own_line(monkeypatch, capsys, exc, code, line):
    monkeypatch.setattr(cli, "cmd_gramflow", failing_command(exc))
    assert main(["gramflow"]) == code
    err = capsys.readouterr().err
    assert "3/10" in err  # the bar was drawn
    assert err.split("\n")[-2:] == [line, ""]  # the message is a whole line of its own (tqdm redraws with \r)


def test_noise_text_prefers_an_interval():
    m = {"normalised_rms": 0.0421, "normalised_noise_rms": 0.0036,
         "normalised_rms_ci": {"value": 0.0421, "lo": 0.0398, "hi": 0.0447, "level": 0.95}}
    assert noise_text(m) == "rms 0.042, 95% interval [0.040, 0.045], noise rms 0.004"
    del m["normalised_noise_rms"]
    assert noise_text(m) == "rms 0.042, 95% interval [0.040, 0.045]"
    m["normalised_noise_rms"] = 0.0036
    del m["normalised_rms_ci"]
    assert noise_text(m) == "rms 0.042, noise rms 0.004"
    assert noise_text({"normalised_rms": 0.5}) == "rms 0.500, no noise estimate (one batch)"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a byte-level tokenizer, saved as a local model directory."""
    return saved_tiny_llama(tmp_path_factory.mktemp("tiny-llama-cli") / "model")


def test_scores_prints_noise_beside_the_pattern_and_compare_prints_what_it_wrote(tiny_model_dir, tmp_path, capsys):
    common = ["--seq-len", "48", "--num-sequences", "8", "--batch-size", "2", "--mode", "pack", "--quiet"]
    assert main(["scores", str(tiny_model_dir), *common, "--out", str(tmp_path / "a")]) == 0
    lines = capsys.readouterr().out.splitlines()
    meta = poslens.load(tmp_path / "a", tensors=False).meta
    metrics = meta["metrics"]["layers"]
    # 8 sequences in batches of 2: 4 batches, so 4 of the 20 groups asked for (the groups rule), said before "wrote"
    assert lines[len(metrics):] == [meta["groups"]["note"], f"wrote {tmp_path / 'a'}"]
    assert meta["groups"]["used"] == 4 == meta["metrics"]["groups"]
    for line, m in zip(lines, metrics):
        nlo, nhi = m["normalised_q01_q99"]
        assert line.startswith(f"layer {m['layer']}: ")
        assert f"non-relative pattern [{nlo:+.3f}, {nhi:+.3f}] ({noise_text(m)})" in line
        assert f"noise rms {m['normalised_noise_rms']:.3f}" in line  # 8 sequences in 4 batches: a noise figure
        if "normalised_rms_ci" in m:  # the engine's interval, printed when the run carries one
            ci = m["normalised_rms_ci"]
            assert f"interval [{ci['lo']:.3f}, {ci['hi']:.3f}]" in line and ci["lo"] <= ci["value"] <= ci["hi"]
    assert main(["scores", str(tiny_model_dir), *common, "--no-rope", "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    out = tmp_path / "fig5"
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--first", "2", "--labels", "RoPE", "NoPE",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    written = sorted(str(p) for p in (out / "figures").iterdir())
    assert written and printed == [f"wrote {p}" for p in written] + [f"wrote {out}"]
    assert poslens.load(out, tensors=False).config["labels"] == ["RoPE", "NoPE"]


def readme_commands():
    """Every `poslens ...` line in the README's and docs' shell blocks, as argv after `poslens`."""
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():  # join backslash-continued lines
                for part in line.split("&&"):
                    words = shlex.split(part, comments=True)
                    at = next((k for k, w in enumerate(words) if w == "poslens" or w.endswith("bin/poslens")), None)
                    if at is not None and at + 1 < len(words):
                        found.append((doc.name, words[at + 1:]))
    return found


def test_readme_commands_parse():
    """The documented command lines are the contract: each parses (nothing runs)."""
    from poslens.cli import build_parser

    commands = readme_commands()
    assert {argv[0] for _, argv in commands} >= {"simulate", "gramflow", "scores", "compare", "reproduce"}
    for doc, argv in commands:
        args = build_parser(argv[0]).parse_args(argv)
        assert args.command == argv[0], (doc, argv)


def test_warnings_during_a_progress_bar_get_their_own_line(monkeypatch, capsys):
    import warnings

    def warns(args):
        from tqdm import tqdm

        with tqdm(total=10, file=sys.stderr) as bar:
            bar.update(3)
            warnings.warn("something to know", UserWarning, stacklevel=1)
            bar.update(7)

    monkeypatch.setattr(cli, "cmd_gramflow", warns)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(["gramflow"]) == 0
    lines = on_screen(capsys.readouterr().err)
    warned = [x for x in lines if "UserWarning: something to know" in x]
    assert len(warned) == 1 and "3/10" not in warned[0], lines  # not drawn over (or after) the bar
    assert "10/10" in lines[-1]  # the bar was redrawn below the warning and finished


def on_screen(text):
    """The lines a terminal shows for `text`: within a line, each carriage return writes over from column 0."""
    lines = []
    for raw in text.split("\n"):
        shown = ""
        for piece in raw.split("\r"):
            shown = piece + shown[len(piece):]
        lines.append(shown.rstrip())
    return [x for x in lines if x]


@pytest.mark.parametrize("argv", [["simulate"], ["reproduce"], ["leakage-stack"], ["scores", "m"],
                                  ["intermediates", "m"], ["leakage", "m"], ["stat", "activation_norm", "m"]])
def test_seed_has_one_rule_everywhere(argv, tmp_path, capsys):
    """--seed >= 0 in every command that takes one, declared on the field and checked before any work."""
    assert main([*argv, "--seed", "-1", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"poslens {argv[0]}: error: --seed must be >= 0, got -1\n"
    assert list(tmp_path.iterdir()) == []


def test_sizes_are_read_as_json_values_per_section():
    from poslens.cli import parse_sizes

    assert parse_sizes(["leakage.sequences=64", "leakage.sweep=pe", "real-model.sequences=512", "nope.samples=1e3"]) \
        == {"leakage": {"sequences": 64, "sweep": "pe"}, "real-model": {"sequences": 512}, "nope": {"samples": 1000.0}}
    assert parse_sizes(None) == {}


def test_sizes_take_a_list_value_beside_others():
    """A JSON list in --sizes (e.g. the sweep's seeds) stays one value: commas inside brackets do not split entries."""
    from poslens.cli import build_parser, parse_sizes

    argv = ["reproduce", "--sizes", "trained.sweep_seeds=[0,1,2],leakage.sequences=8"]
    args = build_parser("reproduce").parse_args(argv)
    assert parse_sizes(args.sizes) == {"trained": {"sweep_seeds": [0, 1, 2]}, "leakage": {"sequences": 8}}


def test_quiet_silences_the_libraries_bars_too(tmp_path, capsys, monkeypatch):
    """--quiet: no progress bars from transformers or huggingface_hub either (the embedded model's first load and
    conversion draw "Loading weights" and "Writing model shards" outside the analyses' own switch); without it
    such a bar is drawn (so the check can fail); the libraries' bars come back after the command."""
    from transformers.utils import logging as tf_logging

    import poslens.cli as cli
    from poslens.io.bars import library_bars

    def draw():
        for _ in tf_logging.tqdm(range(3), desc="Loading weights"):
            pass
        return capsys.readouterr().err

    assert "Loading weights" in draw()
    with library_bars(False):
        assert draw() == ""
    assert "Loading weights" in draw() and tf_logging.is_progress_bar_enabled()
    calls = []
    monkeypatch.setattr(cli, "library_bars", lambda enabled: calls.append(enabled) or library_bars(enabled))
    args = ["simulate", "--seq-len", "6", "--d", "8", "--samples", "50", "--out", str(tmp_path / "mc")]
    assert main([*args, "--quiet"]) == 0 and calls == [False]
    assert main([*args, "--force"]) == 0 and calls == [False, True]
    assert "Loading weights" in draw()


def test_every_command_runs_with_subnormals_flushed_and_the_mode_is_restored(monkeypatch):
    """`main` runs a command with float32 subnormals read and written as 0 on the CPU (the dense soft-max of a model
    with sinks underflows through them; an x86 core is about a hundred times slower on each), and leaves the thread's
    mode as it found it, after a success and after an error."""
    from poslens.subnormals import flushing_subnormals

    seen = []

    def records(args):
        seen.append(flushing_subnormals())
        seen.append(torch.tensor([1e-39]).mul(1.0).item())  # a subnormal read inside: 0

    monkeypatch.setattr(cli, "cmd_gramflow", records)
    assert not flushing_subnormals()
    assert main(["gramflow"]) == 0
    assert seen == [True, 0.0] and not flushing_subnormals()
    monkeypatch.setattr(cli, "cmd_gramflow", failing_command(UsageError("layers must be >= 1, got 0", param="layers")))
    assert main(["gramflow"]) == 2 and not flushing_subnormals()


def test_ctrl_c_while_the_command_starts_is_one_line_and_exit_130(monkeypatch, capsys):
    """Ctrl-C in the first seconds (building the parser imports torch) gets the interrupt's one line, not a
    traceback from inside the import."""
    from poslens import cli

    def interrupted(command=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["scores", "smollm2-135m"]) == 130
    err = capsys.readouterr().err
    assert err == "poslens scores: interrupted while starting; nothing was written\n"


def test_an_unknown_option_names_its_command(capsys):
    """argparse says "poslens: error:" for an option the sub-command lacks; poslens says which command."""
    assert main(["gramflow", "--samples", "10"]) == 2
    assert capsys.readouterr().err == "poslens gramflow: error: unrecognized arguments: --samples 10 (see --help)\n"


def test_the_fixes_a_message_names_are_spelled_as_flags():
    """A library message names parameters; the command line shows the flags wherever a fix names one (after lower,
    raise, use or give, or before a bound), and leaves prose alone."""
    from poslens.cli import flag_message

    names = {"samples": "--samples", "groups": "--groups", "mode": "--mode", "nulls": "--nulls", "layer": "--layer"}
    assert flag_message("samples 256 fill 2 block(s), fewer than groups (8); use samples >= 1024 or groups <= 2",
                        "samples", names) == \
        "--samples 256 fill 2 block(s), fewer than groups (8); use --samples >= 1024 or --groups <= 2"
    assert flag_message("mode pack: no windows; use mode first, or give nulls circular", "mode", names) == \
        "--mode pack: no windows; use --mode first, or give --nulls circular"
    assert flag_message("layer 30 has no next layer: use layer 0..28", "layer", names) == \
        "--layer 30 has no next layer: use --layer 0..28"
    assert flag_message("the run would need 9 GiB; lower groups", "groups", names).endswith("; lower --groups")
    assert flag_message("use the embedded text or give a file", None, names) == "use the embedded text or give a file"


def test_a_run_that_never_imports_transformers_records_its_version(tmp_path):
    """run.json's environment names the installed transformers even where the command did not import it."""
    import importlib.metadata

    assert main(["gramflow", "--alpha", "0.2", "--layers", "2", "--n", "8", "--out",
                 str(tmp_path / "gf")]) == 0
    env = json.loads((tmp_path / "gf" / "run.json").read_text())["environment"]
    assert env["transformers"] == importlib.metadata.version("transformers")
