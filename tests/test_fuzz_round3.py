"""Hostile input, round three (issue 37, and issue 34's training and sweep cases): every case ends in exit status 2
with one line on stderr, no traceback, and the directory tree unchanged (`test_fuzz.refused`, the one assertion).

Covered: every input of a command, and the poslens cache's own entries, refused as --out (any nesting, with or
without --force: a Hypothesis property test over commands and relations); --force refusing a run whose files
poslens wrote were changed by content at the same size; sweeps and training on token directories that are files,
missing, corrupt or without a BOS id; matrices of the wrong JSON types; `reproduce --sizes` checked before any
work, with time estimates for Monte Carlo sizes beyond reason; `remeasure` on malformed reports; settings that
would do nothing; and a write cut short by a file-size limit (RLIMIT_FSIZE in a real process).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_cli import tiny_model_dir  # noqa: F401 (a fixture)
from test_fuzz import SHARES, STACK, Case, both, files, home, refused, run  # noqa: F401 (home: a fixture)
from test_rundir import tree

from poslens.cli import main
from poslens.errors import UsageError
from poslens.io import manifest
from poslens.io.results import run_directory, write_run
from poslens.report import remeasure

DOCS = "\n".join(json.dumps({"text": f"document {i}: " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(60))})
                 for i in range(120)) + "\n"
TRAIN = ["--steps", "2", "--warmup", "1", "--seq-len", "16", "--batch-size", "2", "--micro-batch", "2", "--layers", "1",
         "--hidden", "16", "--intermediate", "16", "--heads", "2", "--kv-heads", "1", "--quiet"]
SWEEP_TRAIN = "steps=2+warmup=1+seq_len=16+layers=1+hidden=16+intermediate=16+heads=2+kv_heads=1+batch_size=2"
SWEEP = ["sweep", "--preset", "pe-quick", "--seeds", "0", "--variants", "a:pe=none", "--quiet"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    """A token directory written by `poslens tokenize` (byte-level BPE of 300 entries on 120 documents)."""
    root = tmp_path_factory.mktemp("tokens")
    (root / "docs.jsonl").write_text(DOCS)
    assert main(["tokenize", str(root / "docs.jsonl"), "--tokenizer", "bpe:300", "--out", str(root / "tok"),
                 "--quiet"]) == 0
    return root / "tok"


def copy_tokens(name: str, change=None):
    """The module's token directory copied to `name` in the working directory, `change(header)` applied."""
    def setup(work: Path, monkeypatch) -> None:
        src = Path(os.environ["POSLENS_ROUND3_TOKENS"])
        shutil.copytree(src, work / name)
        if change is not None:
            header = json.loads((work / name / "header.json").read_text())
            change(header)
            (work / name / "header.json").write_text(json.dumps(header))
    return setup


def edited(rel: str, how: str):
    """A poslens run's file changed without changing its size: one byte flipped, or a word swapped."""
    def setup(work: Path, monkeypatch) -> None:
        p = work / rel
        data = bytearray(p.read_bytes())
        if how == "byte":
            data[len(data) // 2] ^= 1
        else:
            data = bytearray(bytes(data).replace(b'"kind"', b'"kinq"', 1))
        p.write_bytes(bytes(data))
    return setup


def gramflow_run(name: str):
    def setup(work: Path, monkeypatch) -> None:
        assert main(["gramflow", *STACK, "--out", str(work / name)]) == 0
    return setup


def trained_like(name: str):
    """A run directory as `train` writes it (run.json, tensors, the Hugging Face config), with its manifest."""
    def setup(work: Path, monkeypatch) -> None:
        with run_directory(work / name) as tmp:
            write_run(tmp, {"eval_loss": torch.ones(2)}, {"kind": "train"})
            (tmp / "config.json").write_text(json.dumps({"model_type": "smollm3", "hidden_size": 16}))
    return setup


def cut_tensors(name: str):
    def setup(work: Path, monkeypatch) -> None:
        run(name, "leakage-stack", {"a": torch.zeros(1000)}, metrics=SHARES)(work, monkeypatch)
        p = work / name / "tensors.safetensors"
        p.write_bytes(p.read_bytes()[:2000])
    return setup


def cache_entry(rel: str):
    """POSLENS_CACHE in the working directory ('cache'), with an entry `rel` in it (a folder holding a file)."""
    def setup(work: Path, monkeypatch) -> None:
        monkeypatch.setenv("POSLENS_CACHE", str(work / "cache"))
        (work / "cache" / rel).mkdir(parents=True)
        (work / "cache" / rel / "model.safetensors").write_text("weights")
    return setup


MATRIX_TRAIN_LIST = {"train": [1], "variants": {"a": {}}, "seeds": [0]}
MATRIX_NO_TOKENS = {"train": {"tokens": "missing", "steps": 2, "warmup": 1}, "variants": {"a": {"pe": "none"}},
                    "seeds": [0]}
CONFIG0 = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 0,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
EXTENDS = both(copy_tokens("tok"), files({  # a matrix extending one in m/: both are the sweep's inputs
    "m/parent.json": json.dumps({"train": {"tokens": "tok", "steps": 2, "warmup": 1}, "seeds": [0]}),
    "child.json": json.dumps({"extends": "m/parent.json", "variants": {"a": {"pe": "none"}}})}))
QUICK = ["reproduce", "--quick", "--out", "o", "--quiet", "--sizes"]
BEYOND = "even at 1e+11 per second on the CPU, more than 7 days"
TINY = ["--seq-len", "8", "--num-sequences", "2", "--batch-size", "1", "--quiet"]

CASES = [
    # inputs and the cache as --out, with --force
    Case([*SWEEP, "--train", f"tokens=tok+{SWEEP_TRAIN}", "--out", "tok", "--force"], copy_tokens("tok"),
         "is this run's input tok;"),
    Case(["train", "--tokens", "tok", *TRAIN, "--out", "tok/sub"], copy_tokens("tok"),
         "is inside this run's input tok;"),
    Case(["train", "--preset", "p/my.json", "--tokens", "tok", *TRAIN, "--out", "p", "--force"],
         both(copy_tokens("tok"), files({"p/my.json": json.dumps({"layers": 1})})),
         "contains this run's input p/my.json"),
    Case(["sweep", "--preset", "m/m.json", "--out", "m", "--force", "--quiet"],
         both(copy_tokens("tok"), files({"m/m.json": json.dumps({"train": {"tokens": "tok", "steps": 2, "warmup": 1},
                                                                 "variants": {"a": {"pe": "none"}}, "seeds": [0]})})),
         "contains this run's input m/m.json"),
    Case(["sweep", "--preset", "child.json", "--out", "m", "--force", "--quiet"], EXTENDS,
         "contains this run's input m/parent.json"),
    Case(["sweep", "--preset", "child.json", "--out", "m/parent.json", "--force", "--quiet"], EXTENDS,
         "is this run's input m/parent.json"),
    Case(["reproduce", "--quick", "--quiet", "--sizes", "trained.sweep_train=tokens=tok+steps=2", "--out", "tok",
          "--force"], copy_tokens("tok"), "is this run's input tok;"),
    Case(["gramflow", *STACK, "--out", "cache/trained/m", "--force"], cache_entry("trained/m"),
         "is inside the poslens cache"),
    Case(["gramflow", *STACK, "--out", "cache/trained/new"], cache_entry("trained/m"), "is inside the poslens cache"),
    Case(["gramflow", *STACK, "--out", "cache", "--force"], cache_entry("trained/m"), "is the poslens cache"),
    # --force: content changed at the same size
    Case(["gramflow", *STACK, "--out", "g", "--force"], both(gramflow_run("g"), edited("g/run.json", "word")),
         "g/run.json was changed after poslens wrote it (its content differs from the SHA-256"),
    Case(["gramflow", *STACK, "--out", "g", "--force"],
         both(gramflow_run("g"), edited("g/tensors.safetensors", "byte")),
         "g/tensors.safetensors was changed after poslens wrote it"),
    Case(["gramflow", *STACK, "--out", "g", "--force"], both(gramflow_run("g"), edited("g/figures/scores.png", "byte")),
         "g/figures/scores.png was changed after poslens wrote it"),
    Case(["train", *TRAIN, "--out", "t", "--force"], both(trained_like("t"), edited("t/config.json", "byte")),
         "t/config.json was changed after poslens wrote it"),
    # sweeps and training on bad token directories and matrices
    Case([*SWEEP, "--train", "tokens=notes.txt", "--out", "o"], None, "notes.txt: not a token directory"),
    Case([*SWEEP, "--train", "tokens=nowhere", "--out", "o"], None, "nowhere: not a token directory"),
    Case([*SWEEP, "--train", "tokens=tok", "--out", "o"], both(copy_tokens("tok"), files({"tok/header.json": "{bad"})),
         "tok: corrupt token directory (header.json: JSONDecodeError)"),
    Case(["sweep", "--preset", "m.json", "--out", "o", "--quiet"], files({"m.json": json.dumps(MATRIX_TRAIN_LIST)}),
         "sweep preset m.json: train must be a JSON object, got list"),
    Case(["sweep", "--preset", "m.json", "--out", "o", "--quiet"], files({"m.json": json.dumps(MATRIX_NO_TOKENS)}),
         "missing: not a token directory"),
    Case(["train", "--tokens", "tok", *TRAIN, "--bos", "--out", "o"],
         copy_tokens("tok", lambda h: h.pop("bos_token_id")), "the token directory has no bos_token_id"),
    # a preset or matrix file's own fields and seeds are named as the file writes them, not as flags (round four)
    Case(["train", *TRAIN, "--preset", "p.json", "--out", "o"], files({"p.json": json.dumps({"kv_head": 1})}),
         "preset p.json: unknown field(s) kv_head; known fields: preset, tokens, tokenizer, layers, hidden, "
         "intermediate, heads, kv_heads, pe, pe_layers,"),
    Case(["sweep", "--preset", "m.json", "--out", "o", "--quiet"],
         files({"m.json": json.dumps({"train": {}, "variants": {"a": {"pe": "none"}}, "seeds": [3, 3]})}),
         "error: sweep preset m.json: seeds must differ from each other, got [3, 3]"),
    Case(["sweep", "--preset", "m.json", "--out", "o", "--quiet"],
         files({"m.json": json.dumps({"train": {}, "variants": {"a": {"pe": "none"}}, "seeds": [True]})}),
         "error: sweep preset m.json: seeds must be a list of one or more integers, got [True]"),
    Case([*SWEEP, "--seeds", "1,1", "--out", "o"], None, "error: --seeds must differ from each other, got [1, 1]"),
    Case(["sweep", "--preset", "m.json", "--out", "o", "--quiet"],
         files({"m.json": json.dumps({"extends": "nosuch", "variants": {"a": {"pe": "none"}}})}),
         "sweep preset m.json: extends nosuch: unknown preset 'nosuch'"),
    # training settings that would do nothing
    Case(["train", *TRAIN, "--pe-layers", "", "--out", "o"], None, "--pe-layers is empty"),
    Case(["train", *TRAIN, "--pe", "rope", "--sliding-window", "8", "--layer-types", "F", "--out", "o"], None,
         "marks no layer sliding"),
    Case(["train", *TRAIN, "--pe", "none", "--rope-theta", "5", "--out", "o"], None, "--rope-theta has no effect"),
    Case(["train", *TRAIN, "--pe", "rope", "--sliding-window", "100", "--out", "o"], None,
         "--sliding-window 100 is longer than --seq-len 16"),
    # reproduce --sizes: every size checked before any section runs
    Case([*QUICK, "real-model.batch=0"], None, "real-model's batch must be >= 1, got 0"),
    Case([*QUICK, "convergence.samples=-5"], None, "convergence's samples must be >= 1, got -5"),
    Case([*QUICK, "convergence.samples=0"], None, "convergence's samples must be >= 1, got 0"),
    Case([*QUICK, "real-model.groups=1"], None, "real-model's groups must be >= 2 (an interval needs two groups)"),
    Case([*QUICK, "real-model.frob=1"], None, "section real-model has no size 'frob'"),
    Case([*QUICK, "real-model.sequences=abc"], None, "real-model's sequences takes a value like 32, not 'abc'"),
    Case([*QUICK, "trained.sweep_seeds=abc"], None, "trained's sweep_seeds takes a list of seeds"),
    Case([*QUICK, "trained.probe=5"], None, "trained's probe takes a pair of positive integers like [48, 48], not 5"),
    Case(["reproduce", "--quick", "--no-models", "--out", "o", "--quiet", "--sizes", "real-model.sequences=8"], None,
         "section real-model runs models and is skipped here (--no-models)"),
    Case([*QUICK, "convergence.samples=1000000000000000"], None, "floating-point operations"),
    Case(["reproduce", "--quick", "--samples", "1000000000000000", "--out", "o", "--quiet"], None,
         "more than 7 days; lower --samples"),
    # Monte Carlo beyond reason, with the estimate
    Case(["simulate", "--samples", "1000000000000", "--out", "o", "--quiet"], None, BEYOND),
    Case(["leakage-stack", "--samples", "1000000000000", "--out", "o"], None, BEYOND),
    # models and runs
    Case(["scores", "random:m", *TINY, "--out", "o"], files({"m/config.json": json.dumps(CONFIG0)}),
         "num_hidden_layers must be an integer >= 1"),
    Case(["leakage-compare", "l", "--out", "o"], cut_tensors("l"), "tensors.safetensors holds 2,000 bytes"),
    # a default that a short --seq-len makes impossible names both flags (round four: it read "--early-queries must
    # be in [2, 15], got 32" to a user who never gave --early-queries)
    Case(["leakage", "random:m", *TINY[2:], "--seq-len", "16", "--out", "o"],
         files({"m/config.json": json.dumps({**CONFIG0, "num_hidden_layers": 1})}),
         "--early-queries (32) must be below --seq-len (16): the early queries are i <= --early-queries; give "
         "--early-queries 15 or less"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c.argv[0]}" for i, c in enumerate(CASES)])
def test_round_three_is_one_line_and_changes_nothing(home, tmp_path, monkeypatch, capfd, tokens, case):  # noqa: F811
    monkeypatch.setenv("POSLENS_ROUND3_TOKENS", str(tokens))
    if case.setup is not None:
        case.setup(home, monkeypatch)
    refused(case.argv, case.words, tmp_path, capfd, case.code)


def test_a_window_that_masks_nothing_is_refused(home, tmp_path, capfd, tiny_model_dir):  # noqa: F811 (fixtures)
    refused(["length", str(tiny_model_dir), "--interventions", "window:100000", "--num-sequences", "2",
             "--batch-size", "1", "--quiet", "--out", "o"], "window:100000 masks nothing", tmp_path, capfd)


@pytest.mark.parametrize("meta, words", [
    ({"kind": "reproduce", "config": {}}, "metrics is not an object"),
    ({"kind": "reproduce", "metrics": {"claims": []}}, "config is not an object"),
    ({"kind": "reproduce", "config": {}, "metrics": {"claims": [[1]]}}, "metrics.claims is not a list of claims"),
    ({"kind": "reproduce", "config": {}, "metrics": {"claims": {"a": 1}}}, "metrics.claims is not a list of claims"),
    ([1], "run.json is not a JSON object"),
    ({"kind": "reproduce", "config": {"samples": 10, "seed": 0, "quick": True, "sizes": {}},
      "metrics": {"claims": [{"id": "x", "section_name": "nope"}]}}, "has no sizes of section nope"),
])
def test_remeasure_on_a_malformed_report_is_one_line(tmp_path, capfd, meta, words):
    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / "run.json").write_text(json.dumps(meta))
    assert remeasure.main([str(tmp_path / "rep"), "x"]) == 2
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err and "Traceback" not in err, err


# ---------------------------------------------------------------- no --out over an input or the cache


def _token_dir(path: Path) -> None:
    """A minimal valid token directory (header, ids, tokenizer folder), as `open_tokens` checks it."""
    path.mkdir(parents=True)
    for split, n in (("train", 64), ("val", 16)):
        (path / f"{split}.bin").write_bytes(bytes(2 * n))
    (path / "tokenizer").mkdir()
    (path / "header.json").write_text(json.dumps({"format": "poslens-tokens", "version": 1, "dtype": "uint16",
                                                  "vocab_size": 10, "separator_token_id": 0, "bos_token_id": 0,
                                                  "eos_token_id": 0, "train": {"tokens": 64}, "val": {"tokens": 16}}))


def _argv(command: str, root: Path, inp: Path) -> list[str]:
    """A command line of `command` reading input `inp` (created here)."""
    if command in ("compare", "leakage-compare"):
        run(str(inp), "scores" if command == "compare" else "leakage-stack", {"scores": torch.randn(2, 4, 4)},
            metrics=SHARES)(root, None)
        return [command, str(inp)]
    if command == "tokenize":
        inp.mkdir(parents=True)
        (inp / "a.txt").write_text("some text\n")
        return [command, str(inp), "--tokenizer", "bpe:300", "--quiet"]
    if command in ("train", "sweep"):
        _token_dir(inp)
        if command == "train":
            return ["train", "--tokens", str(inp), *TRAIN]
        return [*SWEEP, "--train", f"tokens={inp}+{SWEEP_TRAIN}"]
    # gramflow / simulate: no input of their own, but the cache's entries (POSLENS_CACHE is root/data)
    inp.mkdir(parents=True)
    (inp / "model.safetensors").write_text("weights")
    return [command, *STACK, *(["--samples", "200", "--quiet"] if command == "simulate" else [])]


@settings(max_examples=40, deadline=None, derandomize=True,  # the same draws every run: reproducible
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(["compare", "leakage-compare", "tokenize", "train", "sweep", "gramflow", "simulate"]),
       depth=st.integers(1, 3), relation=st.sampled_from(["is", "contains", "inside"]), steps=st.integers(1, 3),
       via_link=st.booleans(), force=st.booleans())
def test_no_out_equals_contains_or_lies_inside_an_input_or_the_cache(capfd, command, depth, relation, steps, via_link,
                                                                       force):
    # Each command's input (for gramflow and simulate: an entry of the poslens cache) is at depth `depth` below
    # root/data; --out is that input, a folder `steps` levels above it, or a path `steps` levels inside it,
    # written directly or through a link to root/data. Always refused, naming the input (or the cache); nothing
    # changes.
    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        root = Path(d)
        cached = command in ("gramflow", "simulate")
        mp.setenv("POSLENS_CACHE", str(root / ("data" if cached else "cache")))
        mp.chdir(root)
        inp = root / "data" / Path(*[f"level{k}" for k in range(depth)])
        argv = _argv(command, root, inp)
        (root / "alias").symlink_to(root / "data")
        if relation == "is":
            out = inp
        elif relation == "contains":
            out = inp.parents[min(steps, depth) - 1]
        else:
            out = inp / Path(*[f"sub{k}" for k in range(steps)])
        if via_link:
            out = root / "alias" / out.relative_to(root / "data")
        words = "the poslens cache" if cached else f"{relation.replace('inside', 'is inside')} this run's input {inp}"
        event(f"{command}: --out {relation} the input")
        refused([*argv, "--out", str(out), *(["--force"] if force else [])], words, root, capfd)


# ---------------------------------------------------------------- a write cut short by a file-size limit


def _limited(limit: int):
    def setup() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as Python itself does: a write past the limit fails (EFBIG)
    return setup


@pytest.mark.parametrize("argv, limit, file", [
    (["tokenize", "docs.jsonl", "--tokenizer", "bpe:300", "--quiet"], 8192, "train.bin"),
    (["gramflow", *STACK], 8192, "scores.png"),
])
def test_a_write_cut_short_by_a_file_size_limit_is_one_line_and_leaves_nothing(tmp_path, argv, limit, file):
    """A real process under RLIMIT_FSIZE (`ulimit -f`): the write that crosses the limit fails with EFBIG ("File
    too large"); the command names the file and the bytes in one line, exits 2, reports nothing as written and
    leaves nothing behind (before this release `tokenize` exited 0 with half of train.bin)."""
    (tmp_path / "docs.jsonl").write_text(DOCS)
    before = tree(tmp_path)
    src = Path(manifest.__file__).parents[2]
    done = subprocess.run([sys.executable, "-m", "poslens", *argv, "--out", "o"], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(src)}, preexec_fn=_limited(limit),
                          timeout=600)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert f"/{file}: the file-size limit (ulimit -f) stops it short of the" in lines[0], lines[0]
    assert "wrote" not in done.stdout
    assert tree(tmp_path) == before


def test_library_errors_name_no_flags_for_sizes():
    """The check of a reproduce size is the library's own (SectionSpec.check_size): a one-line UsageError."""
    from poslens.report.section import spec

    with pytest.raises(UsageError, match="sizes: section convergence's samples must be >= 1, got 0"):
        spec("convergence").size(True, {"samples": 0})
    assert spec("convergence").size(True, {"widths": [16, 32]})["widths"] == (16, 32)
    assert spec("leakage").size(True, {"stack_samples": 0})["stack_samples"] == 0  # 0 means off there
