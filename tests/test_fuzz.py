"""Hostile input through the real command line (issues 8 and 15): every case ends in exit status 2 (130 for an
interruption) with exactly one line on stderr, no traceback, and the directory tree unchanged (nothing written,
nothing deleted).

`CASES` is one table of rows (argv, setup, words[, code]): `setup(work, monkeypatch)` prepares the working
directory (runs, user files, bad models, the environment, a fault to inject) and `words` must be in the one
line. Every row goes through `refused`, the one assertion, with `poslens.cli.main` in-process (capfd sees file
descriptor 2, so a library that writes to stderr behind Python's back is caught too). Families of inputs that
share one rule are Hypothesis property tests, derandomized (the same draws every run): the numeric arguments of
`simulate` and `gramflow`, any foreign file anywhere in a run directory, any nesting of --out and an input. Cases
that need a process of their own (a lock held by another process, killed or building a cache entry; the exit
hook) run real processes, as light as they can be.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from test_cli import tiny_model_dir  # noqa: F401 (a fixture)
from test_rundir import FullDisk, FullFile, light_process, tensors_full, tree

import poslens
from poslens.cli import main
from poslens.errors import one_line
from poslens.io import checkpoint, lock, manifest, results, rundir, writing
from poslens.io.results import run_directory, write_run

STACK = ["--n", "6", "--d", "8", "--layers", "2"]  # small, so that a case that wrongly runs stays fast


def run_main(argv: list[str], capfd) -> tuple[int, str]:
    """main(argv) in-process; then what the process's exit would do: remove the parent directories created for a
    run that failed (an atexit hook in poslens.io.rundir; `test_failed_run_leaves_no_parents` checks it for real)."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse exits from the parser
        code = e.code
    rundir.remove_empty_parents()
    return code, capfd.readouterr().err


def refused(argv: list[str], words: str, root: Path, capfd, code: int = 2, busy: str = "\0") -> str:
    """The one assertion of this file: `poslens ARGV` exits with `code`, prints exactly one line on stderr holding
    `words` and no traceback, and leaves everything under `root` as it was (but for paths starting with `busy`,
    where another process is writing). Returns the line."""
    def unchanged() -> dict:
        return {k: v for k, v in tree(root).items() if not k.startswith(busy)}

    before = unchanged()
    got, err = run_main(argv, capfd)
    assert got == code, err
    assert "Traceback" not in err, err
    assert len(err.strip("\n").splitlines()) == 1 and err.endswith("\n"), err
    assert words in err, err
    assert unchanged() == before
    return err


# ---------------------------------------------------------------- what a row sets up

Setup = Callable[[Path, pytest.MonkeyPatch], None]


def run(name: str, kind: str = "gramflow", tensors: dict | None = None, **meta) -> Setup:
    """A run directory `name` written by poslens (with its manifest)."""
    def setup(work: Path, monkeypatch) -> None:
        with run_directory(work / name) as tmp:
            write_run(tmp, tensors if tensors is not None else {"a": torch.zeros(2)}, {"kind": kind, **meta})
    return setup


def files(contents: dict[str, str]) -> Setup:
    """Files of the user's, by path relative to the working directory (folders created)."""
    def setup(work: Path, monkeypatch) -> None:
        for rel, text in contents.items():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).write_text(text)
    return setup


def model(name: str, **change) -> Setup:
    """A random-model config directory `name` (a tiny Llama) with `change` applied."""
    base = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
            "bos_token_id": 1, "eos_token_id": 2}
    return files({f"{name}/config.json": json.dumps(base | change)})


def byte_tokenizer_in(name: str) -> Setup:
    def setup(work: Path, monkeypatch) -> None:
        from test_data import byte_tokenizer

        byte_tokenizer().save_pretrained(work / name)
    return setup


def cut_gguf(name: str) -> Setup:
    """The embedded GGUF file cut short after 100,000 bytes."""
    def setup(work: Path, monkeypatch) -> None:
        from poslens.engine.models import _alias_gguf

        with open(_alias_gguf("smollm2-135m"), "rb") as f:
            (work / name).write_bytes(f.read(100_000))
    return setup


def env(name: str, relative: str) -> Setup:
    """Environment variable `name` set to a path in the working directory."""
    def setup(work: Path, monkeypatch) -> None:
        monkeypatch.setenv(name, str(work / relative))
    return setup


def patch(target, attr: str, value) -> Setup:
    """A fault injected into the library (monkeypatched for the row only)."""
    def setup(work: Path, monkeypatch) -> None:
        monkeypatch.setattr(target, attr, value)
    return setup


def both(*setups: Setup) -> Setup:
    def setup(work: Path, monkeypatch) -> None:
        for s in setups:
            s(work, monkeypatch)
    return setup


def interrupted(*args, **kwargs):
    raise KeyboardInterrupt


class Case(NamedTuple):
    argv: list[str]
    setup: Setup | None
    words: str
    code: int = 2


SCORES = {"scores": torch.randn(2, 4, 4)}
SHARES = {"per_layer_all": {"attn/share_mask_only": {"value": [0.1, 0.2]},
                            "attn/share_residual": {"value": [0.9, 0.8]}}}
# two batches of one sequence: an interval needs 2 groups
TINY = ["--seq-len", "8", "--num-sequences", "2", "--batch-size", "1", "--quiet"]

CASES = [
    # data loss: --force on what poslens did not write, on the working directory and what contains it
    Case(["gramflow", *STACK, "--out", "d", "--force"], None, "replaces only a run directory written by poslens"),
    Case(["gramflow", *STACK, "--out", ".", "--force"], None, "it is the current directory"),
    Case(["gramflow", *STACK, "--out", "", "--force"], None, "--out is empty"),
    Case(["gramflow", *STACK, "--out", "..", "--force"], None, "parent of the current directory"),
    Case(["gramflow", *STACK, "--out", "~", "--force"], None, "poslens never writes over it"),
    Case(["gramflow", *STACK, "--out", "/", "--force"], None, "root directory"),
    Case(["simulate", *STACK, "--samples", "10", "--out", "d", "--force"], None, "replaces only a run directory"),
    Case(["gramflow", *STACK, "--out", "notes.txt", "--force"], None, "is not a directory"),
    Case(["gramflow", *STACK, "--out", "notes.txt/run"], None, "is not a directory"),
    Case(["gramflow", *STACK, "--out", "d"], None, "already exists"),
    Case(["gramflow", *STACK, "--out", "n" * 250], None, "--out name is 250 bytes long"),
    # --force replaces only what a run's manifest lists (issue 15; any name anywhere: the property test below)
    Case(["gramflow", "--seq-len", "8", "--out", "o", "--force"], both(run("o"), files({"o/notes.txt": "mine"})),
         "o/notes.txt was not written by poslens"),
    Case(["gramflow", "--seq-len", "8", "--out", "o", "--force"], both(run("o"), files({"o/mydata/a": "mine"})),
         "o/mydata was not written by poslens"),
    # a run never writes over its inputs (any nesting: the property test below)
    Case(["compare", "r", "--out", "r", "--force"], run("r", "scores", SCORES), "is this run's input r;"),
    Case(["compare", "runs/r", "--out", "runs", "--force"], run("runs/r", "scores", SCORES),
         "contains this run's input runs/r;"),
    Case(["leakage-compare", "l", "--out", "l", "--force"], run("l", "leakage-stack", metrics=SHARES),
         "is this run's input l;"),
    # non-finite and non-numeric numbers
    Case(["simulate", "--alpha", "nan"], None, "must be a finite number"),
    Case(["simulate", "--alpha", "inf"], None, "must be a finite number"),
    Case(["gramflow", "--rope-theta", "inf", "--pe", "rope"], None, "must be a finite number"),
    Case(["gramflow", "--rope-theta", "nan"], None, "must be a finite number"),
    Case(["simulate", "--rope-scaling", "inf", "--pe", "rope"], None, "must be a finite number"),
    Case(["simulate", "--rope-scaling=-inf"], None, "must be a finite number"),
    Case(["gramflow", "--pe", "rope", "--d", "2", "--rope-scaling", "2"], None, "needs --d >= 4"),
    Case(["gramflow", "--pe", "rope", "--rope-theta", "1e300", "--rope-scaling", "1e10"], None, "infinite RoPE base"),
    Case(["simulate", "--samples", "1e12"], None, "samples"),
    Case(["simulate", "--samples", "-3"], None, "samples"),
    Case(["simulate", "--seed", "-1"], None, "--seed must be >= 0"),
    Case(["simulate", "--chunk", "0"], None, "chunk"),
    # windows, groups and seeds (issue 15)
    Case(["simulate", "--mask", "sliding", "--window", "51"], None, "--window must be at most the sequence length"),
    Case(["gramflow", "--n", "8", "--mask", "sliding", "--window", "9"], None, "--window must be at most the sequence"),
    Case(["leakage-stack", "--n", "8", "--window", "9"], None, "--window must be at most the sequence length n = 8"),
    Case(["leakage-stack", "--window", "0"], None, "--window must be >= 1, got 0"),
    Case(["leakage-stack", "--groups", "1"], None, "--groups must be >= 2, got 1"),
    Case(["leakage-stack", "--samples", "300"], None, "--samples 300 fill 3 block(s) of 128, fewer than groups (8)"),
    Case(["leakage-stack", "--samples", "100", "--groups", "2"], None, "groups <= 1 (at least 2)"),
    Case(["leakage-stack", "--seed", "-1"], None, "--seed must be >= 0"),
    Case(["leakage-stack", "--ntk-scaling", "0.5"], None, "--ntk-scaling must be in [1, inf)"),
    # sizes that cannot fit: refused up front with the estimate
    Case(["gramflow", "--n", "1000000"], None, "of memory but"),
    Case(["simulate", "--n", "1000000", "--samples", "10"], None, "of memory but"),
    Case(["simulate", "--d", "1000000000000", "--n", "2", "--samples", "10"], None, "of memory but"),
    Case(["simulate", "--layers", "1000000000000", "--n", "2", "--samples", "10"], None, "of memory but"),
    Case(["gramflow", "--layers", "1000000000000", "--n", "2"], None, "of memory but"),
    Case(["leakage-stack", "--n", "100000"], None, "of memory but"),
    Case(["leakage-stack", "--n", "100000", "--samples", "0"], None, "of memory but"),
    # runs that are not runs, or not the runs a command needs
    Case(["compare", "d"], None, "is not a poslens run directory"),
    Case(["compare", "r"], both(run("r", "scores"), files({"r/run.json": "[]"})),
         "corrupt run directory (run.json is not a JSON object)"),
    Case(["compare", "r"], run("r", "scores"), "the run has no tensor 'scores'"),
    Case(["compare", "r"], both(run("r"), files({"r/run.json": '{"kind": ' + "[" * 100_000})), "corrupt run directory"),
    Case(["compare", "r"], run("r", "scores", {"scores": torch.zeros(5)}), "its scores have shape (5,), not [layers"),
    Case(["compare", "r", "--first", "2"], run("r", "scores", {"scores": torch.full((3, 4, 4), math.nan)}),
         "the scores of layer 1 are all NaN or infinite, nothing to draw"),
    Case(["leakage-compare", "r"], run("r", "leakage"), "has no per-layer decomposition (metrics.per_layer_all"),
    Case(["leakage-compare", "r"], run("r", "scores", SCORES), "leakage-compare needs runs of `poslens leakage`"),
    # a leakage run beside a scores run of the same model: the kind is named, not the labels
    Case(["leakage-compare", "r", "s"], both(run("r", "leakage-stack", metrics=SHARES), run("s", "scores", SCORES)),
         "s is a 'scores' run; leakage-compare needs runs"),
    Case(["leakage-compare", "r", "s"], both(run("r", "leakage-stack", metrics=SHARES),
                                             run("s", "leakage-stack", metrics=SHARES)), "would both be labelled"),
    # model and data inputs
    Case(["scores", "short.gguf", *TINY], cut_gguf("short.gguf"), "cannot load the GGUF metadata"),
    Case(["scores", "random:m", *TINY], model("m", num_attention_heads=5, num_key_value_heads=5),
         "cannot build the config"),
    Case(["scores", "random:m", *TINY], model("m", num_key_value_heads=3),
         "num_key_value_heads 3 does not divide num_attention_heads 4"),
    Case(["scores", "random:m", *TINY], both(model("m", vocab_size=10), byte_tokenizer_in("m")),
         "vocab_size 10 is smaller than the tokenizer's"),
    Case(["scores", "random:m", *TINY], both(model("m"), files({"m/tokenizer.json": "{garbage"})),
         "cannot load the tokenizer files"),
    Case(["scores", "random:m", "--data", "deep.jsonl", *TINY],
         both(model("m"), files({"deep.jsonl": '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"})),
         "JSON nested too deeply"),
    # the shared cache: POSLENS_CACHE must be a writable directory (for the corpus: its own test below)
    Case(["scores", "smollm2-135m", *TINY], both(files({"cachefile": "x"}), env("POSLENS_CACHE", "cachefile")),
         "point POSLENS_CACHE at a writable directory"),
    # a full disk, in the results writer, the lock file and a checkpoint; an interruption
    Case(["gramflow", *STACK, "--out", "o", "--no-figures"], patch(writing, "os", FullFile("tensors.safetensors")),
         "no space left on the device to write"),
    Case(["gramflow", *STACK, "--out", "o", "--no-figures"], patch(lock, "os", FullDisk()), ".o.lock (it needs"),
    Case(["simulate", *STACK, "--samples", "200", "--quiet", "--out", "o"],
         patch(checkpoint, "write_tensors", tensors_full), ".o.partial/simulate-"),
    Case(["gramflow", *STACK, "--out", "o", "--no-figures"], patch(results, "write_tensors", interrupted),
         "interrupted; nothing was written to --out", 130),
]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A working directory with a user's files in it, as the current directory; HOME is its parent."""
    work = tmp_path / "home" / "work"
    (work / "d").mkdir(parents=True)
    (work / "d" / "notes.txt").write_text("the user's notes\n")
    (work / "notes.txt").write_text("more notes\n")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return work


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c.argv[0]}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_and_changes_nothing(home, tmp_path, monkeypatch, capfd, case):
    if case.setup is not None:
        case.setup(home, monkeypatch)
    refused(case.argv, case.words, tmp_path, capfd, case.code)


def test_force_replaces_a_poslens_run(home, capfd):
    assert main(["gramflow", *STACK, "--out", "r", "--no-figures"]) == 0
    assert main(["gramflow", *STACK, "--alpha", "0.5", "--out", "r", "--force"]) == 0
    assert poslens.load(home / "r").config["alpha"] == 0.5
    assert manifest.read_manifest(home / "r") == manifest.entries(home / "r") | {manifest.NAME: {"type": "file"}}
    assert sorted(p.name for p in home.iterdir()) == ["d", "notes.txt", "r"]


# ---------------------------------------------------------------- property tests: --force and --out

NAMES = st.one_of(st.sampled_from(["run.json", "tensors.safetensors", "figures", "scores.png", manifest.NAME, "a"]),
                  st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=12)
                  .filter(lambda s: s not in (".", "..") and len(s.encode()) < 200))


@pytest.fixture(scope="module")
def gramflow_run(tmp_path_factory) -> Path:
    """One finished `gramflow --seq-len 8` run with figures, copied by each example."""
    out = tmp_path_factory.mktemp("gramflow") / "o"
    assert main(["gramflow", "--seq-len", "8", "--out", str(out)]) == 0
    return out


@settings(max_examples=30, deadline=None, derandomize=True,  # the same draws every run: reproducible
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(folders=st.lists(NAMES, max_size=2), name=NAMES, kind=st.sampled_from(["file", "folder", "link"]))
def test_force_refuses_a_run_holding_anything_poslens_did_not_write(gramflow_run, capfd, folders, name, kind):
    # Anything of the user's, anywhere in a run directory (a file, a folder, a link; at the top, in figures/, in
    # new folders; named like poslens's own files), makes --force refuse, naming the first foreign entry; a file
    # poslens wrote and the user changed counts as the user's.
    listed = manifest.read_manifest(gramflow_run)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        out = root / "o"
        shutil.copytree(gramflow_run, out, symlinks=True)
        rel = "/".join([*folders, name])
        first = next((rel.rsplit("/", k)[0] for k in range(rel.count("/"), -1, -1)
                      if rel.rsplit("/", k)[0] not in listed), None)
        path = out / rel
        if first is None and listed[rel]["type"] == "file":  # one of poslens's files: the user changes it
            with open(path, "ab") as f:
                f.write(b"mine")
            first, words = rel, "was changed after poslens wrote it"
        elif first is None:  # one of poslens's folders: the user adds to it
            first = f"{rel}/mine"
            (path / "mine").write_text("mine")
            words = "was not written by poslens"
        else:
            if not (out / first).parent.is_dir() or (out / first).parent.is_symlink():
                return  # a path through one of poslens's files: nothing can be put there
            path.parent.mkdir(parents=True, exist_ok=True)
            {"file": lambda: path.write_text("mine"), "folder": lambda: path.mkdir(),
             "link": lambda: path.symlink_to(root)}[kind]()
            words = "was not written by poslens"
        event(words)
        refused(["gramflow", "--seq-len", "8", "--out", str(out), "--force"], one_line(f"{out / first} {words}"), root,
                capfd)  # a name with a line break or an unprintable character is shown escaped, on the one line


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(1, 3), up=st.integers(0, 3), via_link=st.booleans(), force=st.booleans(),
       command=st.sampled_from(["compare", "leakage-compare"]), others=st.integers(0, 2))
def test_a_run_never_writes_over_its_inputs(capfd, depth, up, via_link, force, command, others):
    # --out equal to one of the runs a command reads, or any folder above it, written directly or through a
    # symbolic link, is refused with or without --force, naming the input; nothing changes.
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        kind, meta = ("scores", {}) if command == "compare" else ("leakage-stack", {"metrics": SHARES})
        inputs = [root / "data" / Path(*[f"level{k}" for k in range(depth)])] + [root / f"other{k}" for k in
                                                                                range(others)]
        for p in inputs:
            run(str(p), kind, SCORES, **meta)(root, None)
        (root / "alias").symlink_to(root / "data")
        out = inputs[0].parents[min(up, depth - 1)] if up else inputs[0]
        if via_link:
            out = root / "alias" / out.relative_to(root / "data")
        how = "is" if up == 0 else "contains"
        event(f"--out {how} the input")
        labels = ["--labels", *(f"run {k}" for k in range(len(inputs)))] if command == "leakage-compare" else []
        refused([command, *map(str, reversed(inputs)), *labels, "--out", str(out), *(["--force"] if force else [])],
                f"{how} this run's input {inputs[0]};", root, capfd)


# ---------------------------------------------------------------- property tests: numeric arguments

BAD_INT = st.sampled_from(["", "x", "1.5", "1e3", "nan", "-1", "0"])
# Sizes refused because they cannot fit in memory on any machine (or, d without RoPE in gramflow, cost nothing).
# Not 1e6 layers: that fits, and runs for hours, as asked.
HUGE = st.sampled_from(["1000000000000", "99999999999999999999"])
BAD_FLOAT = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr),
                      st.sampled_from(["nan", "inf", "-inf", "1e400", "-1", "x", ""]))


def mostly(valid: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """A value from `valid` seven times in eight, else one from `bad`, as the string a user would type."""
    return st.integers(0, 7).flatmap(lambda k: bad if k == 0 else valid.map(repr))


@st.composite
def stack_args(draw) -> list[str]:
    pe = draw(st.sampled_from(["none", "rope"]))
    mask = draw(st.sampled_from(["causal", "none", "sliding"]))
    d = st.integers(1, 12).map(lambda h: 2 * h) if pe == "rope" else st.integers(1, 24)
    values = {"n": draw(mostly(st.integers(2, 14), st.one_of(BAD_INT, HUGE))),
              "d": draw(mostly(d, st.one_of(BAD_INT, HUGE))),
              "layers": draw(mostly(st.integers(1, 3), st.one_of(BAD_INT, HUGE))),
              "alpha": draw(mostly(st.floats(0, 1, exclude_max=True), BAD_FLOAT)),
              "rope-theta": draw(mostly(st.floats(1, 1e300, exclude_min=True), BAD_FLOAT)),
              "rope-scaling": draw(mostly(st.floats(1, 1e3), BAD_FLOAT)), "pe": pe, "mask": mask,
              "norm": draw(st.sampled_from(["l2", "layernorm-sqrt-d", "layernorm-d"]))}
    if mask == "sliding" or draw(st.integers(0, 7)) == 0:
        values["window"] = draw(mostly(st.integers(1, 14), BAD_INT))
    return [f"--{k}={v}" for k, v in values.items()]


def in_fresh_directory(argv: list[str], capfd) -> None:
    """Either a run poslens can load, with finite probabilities, or a one-line refusal that wrote nothing."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out"
        code, err = run_main([*argv, "--out", str(out), "--no-figures"], capfd)
        assert code in (0, 2) and "Traceback" not in err, err
        if currently_in_test_context():
            event(f"exit status {code}")  # pytest --hypothesis-show-statistics: how many draws ran, how many refused
        if code == 2:
            assert len(err.strip("\n").splitlines()) == 1, err
            assert list(out.parent.iterdir()) == []
        else:
            run = poslens.load(out)
            assert torch.isfinite(run.tensors.get("probs_mean", run.tensors.get("probs"))).all()


@settings(max_examples=40, deadline=None, derandomize=True,  # the same draws every run: reproducible
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stack=stack_args(), samples=mostly(st.integers(1, 300), BAD_INT), seed=mostly(st.integers(0, 2**70), BAD_INT),
       chunk=st.one_of(st.none(), mostly(st.integers(1, 400), BAD_INT)))
def test_simulate_numeric_arguments_run_or_are_refused_in_one_line(capfd, stack, samples, seed, chunk):
    argv = ["simulate", *stack, f"--samples={samples}", f"--seed={seed}", "--quiet"]
    in_fresh_directory(argv + ([f"--chunk={chunk}"] if chunk is not None else []), capfd)


@settings(max_examples=40, deadline=None, derandomize=True,  # the same draws every run: reproducible
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stack=stack_args())
def test_gramflow_numeric_arguments_run_or_are_refused_in_one_line(capfd, stack):
    in_fresh_directory(["gramflow", *stack], capfd)


def test_the_property_tests_reach_both_outcomes(capfd):
    # The strategies above are not vacuous: a valid draw runs and a non-finite one is refused.
    in_fresh_directory(["gramflow", "--n", "5", "--alpha", "0.3", "--pe", "rope", "--rope-theta", "1e300"], capfd)
    with tempfile.TemporaryDirectory() as d:
        refused(["gramflow", "--alpha", repr(math.inf), "--out", os.path.join(d, "o")], "alpha", Path(d), capfd)


@pytest.mark.parametrize("n, d, theta, scaling", [(50, 64, 1e4, 1.0), (7, 2, 1.5, 1.0), (33, 128, 5e5, 4.0)])
def test_gram_flow_rope_kernel_in_linear_memory_equals_the_full_table(n, d, theta, scaling):
    # Found by the property test: the [n, n, d/2] table made gramflow --pe rope --d 1e9 fail with MemoryError.
    # The kernel from the 2n - 1 offsets does the same arithmetic per entry, so it is equal bit for bit.
    from poslens.stack import rope
    from poslens.stack.config import StackConfig
    from poslens.stack.gramflow import position_kernel

    config = StackConfig(n=n, d=d, positional="rope", rope_theta=theta, rope_scaling=scaling)
    assert (position_kernel(config) == rope.kernel(n, d, theta, scaling)).all()


# ---------------------------------------------------------------- the shared cache and locks: real processes


@contextlib.contextmanager
def unprivileged():
    """Run the block without root's power over permissions (as root: effective uid and gid of nobody)."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def test_an_unwritable_cache_directory_is_refused_before_any_work(capfd, monkeypatch):
    # POSLENS_CACHE names a file, then a directory this user cannot write: `scores` on the embedded corpus is
    # refused in one line when it first needs the corpus, before building it (release 0.2 failed after building
    # it for 45 s). The first case also imports everything the command needs: the interpreter's own files may
    # not be readable to the user the second case runs as.
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        work = root / "work"
        both(model("m"), byte_tokenizer_in("m"), files({"cachefile": "x"}))(work, monkeypatch)
        (root / "cache").mkdir(mode=0o555)
        for p in [root, *root.rglob("*")]:
            p.chmod(0o555 if p.name == "cache" else 0o777 if p.is_dir() else 0o666)
        monkeypatch.chdir(work)
        try:
            for cache, why, user in ((work / "cachefile", "Not a directory", contextlib.nullcontext()),
                                     (root / "cache", "Permission denied", unprivileged())):
                monkeypatch.setenv("POSLENS_CACHE", str(cache))
                with user:
                    refused(["scores", "random:m", *TINY], f"cache directory {cache}/corpus cannot be created: {why}; "
                            "point POSLENS_CACHE at a writable directory", root, capfd)
        finally:
            (root / "cache").chmod(0o755)


HAND_OVER = """
import os, sys, time
from poslens.io.lock import CACHE_SUFFIX, FileLock, lock_path

pairs = dict(zip(sys.argv[1::2], sys.argv[2::2]))  # cache entry -> the finished entry to move there
held = {entry: FileLock(lock_path(entry, CACHE_SUFFIX), "") for entry in pairs}
for lock in held.values():
    assert lock.acquire()
print("holding", flush=True)
deadline = time.monotonic() + 120
while held and time.monotonic() < deadline:  # hand an entry over once a process waits for its lock
    waiting = open("/proc/locks").read()
    for entry, lock in list(held.items()):
        if f":{os.fstat(lock.fd).st_ino} " in "".join(l for l in waiting.splitlines(True) if "->" in l):
            os.rename(pairs[entry], entry)
            held.pop(entry).release()
    time.sleep(0.01)
sys.exit(len(held))
"""


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="needs Linux's /proc/locks to see a waiting process")
def test_a_command_waits_for_another_process_building_the_shared_cache_and_uses_it(home, request, monkeypatch,
                                                                                  capfd):
    # Another process is building both entries `scores smollm2-135m` needs: the embedded corpus and the SmolLM2
    # conversion; it finishes each one once a process waits for it. The command waits for each in turn, saying
    # so in one line, then uses what the other process built (a three-document corpus and a tiny model standing
    # in for SmolLM2): nothing fails and nothing is built twice.
    from poslens.engine import corpus, models

    tiny = request.getfixturevalue("tiny_model_dir")  # test_cli's tiny Llama with a byte tokenizer
    monkeypatch.setenv("POSLENS_CACHE", str(home / "cache"))
    entries = {"the smollm2-135m conversion": models.cache_root() / "models" / "smollm2-135m",
               "the embedded corpus": corpus.cache_path()}
    docs = ["the first document of the stand-in corpus", "a second one, long enough", "and a third document"]
    built = {what: home / f"built-{k}" for k, what in enumerate(entries)}
    corpus._write_cache(built["the embedded corpus"], docs, {"documents": len(docs), "sources": []})
    shutil.copytree(tiny, built["the smollm2-135m conversion"])
    stamp = models._source_stamp(models._alias_gguf("smollm2-135m"))
    (built["the smollm2-135m conversion"] / "poslens-source.json").write_text(json.dumps(stamp))
    for path in entries.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    holder = light_process(HAND_OVER, *(str(p) for what in entries for p in (entries[what], built[what])))
    assert holder.stdout.readline() == "holding\n"
    capfd.readouterr()  # what making the tiny model printed
    code, err = run_main(["scores", "smollm2-135m", "--seq-len", "8", "--num-sequences", "2", "--batch-size", "1",
                          "--groups", "2", "--quiet", "--out", "o"], capfd)
    assert holder.wait(timeout=60) == 0 and code == 0, err
    assert err == "".join(f"waiting for another poslens process (pid {holder.pid}) to finish building {what}\n"
                          for what in entries)  # the model first: the pipeline loads it before the data
    run = poslens.load(home / "o", tensors=False)  # on the stand-ins: 2 of the 3 documents, the tiny model's layers
    assert run.meta["data"]["documents_read"] == 2
    assert run.meta["model"]["cache"] == str(entries["the smollm2-135m conversion"])
    assert len(run.meta["model"]["positional_encoding"]) == json.loads((tiny / "config.json").read_text())[
        "num_hidden_layers"]
    assert corpus._read_cache(entries["the embedded corpus"])[0] == tuple(docs)  # not rebuilt


def test_a_killed_lock_holder_never_blocks_the_next_run(home, capfd):
    # A run holding --out o is killed with SIGKILL (no chance to clean up): the next run of the same command
    # neither waits nor fails, and cleans what the killed one left.
    holder = light_process("import sys, time\nfrom poslens.io.rundir import open_run\n"
                           "with open_run(sys.argv[1]) as run:\n    (run.build / 'half').write_text('half')\n"
                           "    print('holding', flush=True)\n    time.sleep(60)\n", str(home / "o"))
    assert holder.stdout.readline() == "holding\n"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    assert (home / ".o.lock").exists() and (home / ".o.partial" / "build" / "half").exists()
    started = time.monotonic()
    assert run_main(["gramflow", *STACK, "--out", "o", "--no-figures"], capfd) == (0, "")
    assert time.monotonic() - started < 10
    assert sorted(p.name for p in home.iterdir()) == ["d", "notes.txt", "o"]


def test_failed_run_leaves_no_parents(home):
    # A real process, so that the exit hook runs: the output's parents are created when it is checked, and go at
    # exit when the run then fails (as `reproduce --samples 0 --out a/b/c` does).
    before = tree(home)
    res = light_process("import sys\nfrom poslens.io.rundir import check_output\ncheck_output(sys.argv[1])\n"
                        "assert (__import__('pathlib').Path(sys.argv[1]).parent).is_dir()\nsys.exit(2)\n", "a/b/c")
    res.wait(timeout=60)
    assert res.returncode == 2 and tree(home) == before


def test_concurrent_runs_with_the_same_out_give_one_result_and_one_clear_error(home, capfd):
    # A first run in its own process holds --out r (it would run for days); a second one in this process, with or
    # without --force, is refused in one line and touches nothing. Interrupted, the first leaves no result and
    # no lock; the next run of the same output cleans up after it and writes the one result.
    args = ["simulate", "--n", "4", "--d", "4", "--layers", "1", "--maps", "scores", "--quiet", "--no-figures"]
    # SIGINT back to its default in the child: a suite started in the background of a shell script inherits it
    # ignored, and Python then never turns it into KeyboardInterrupt.
    endless = subprocess.Popen([sys.executable, "-m", "poslens", *args, "--samples", str(10**12), "--out", "r"],
                               cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not (home / ".r.lock").exists():  # the first run holds the output
            assert endless.poll() is None and time.monotonic() < deadline, endless.stderr.read()
            time.sleep(0.1)
        for extra in ([], ["--force"]):  # all but the first run's own checkpoint, which it saves every few seconds
            refused([*args, "--samples", "100", "--out", "r", *extra], "another poslens run is writing", home.parent,
                    capfd, busy="work/.r.partial")
    finally:
        endless.send_signal(signal.SIGINT)
        try:
            _, err = endless.communicate(timeout=120)
        finally:
            endless.kill()  # never left running, whatever failed above
    assert endless.returncode == 130 and "Traceback" not in err, err
    assert not (home / "r").exists() and not (home / ".r.lock").exists()
    assert main([*args, "--samples", "100", "--out", "r"]) == 0
    assert sorted(p.name for p in home.iterdir()) == ["d", "notes.txt", "r"]
    assert poslens.load(home / "r").meta["samples"] == 100
