"""The analysis pipeline (poslens.engine.pipeline): the composed config and its groups rule, per-sequence rows, the
import graph, and the driver's guarantees for every analysis (the recipes of docs/architecture.md: test_recipes.py)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from tiny_models import build
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import poslens
from poslens.engine.config import SEQUENCES_HELP, ModelData, groups_used
from poslens.engine.distributed import Dist
from poslens.engine.stats import Rows
from poslens.errors import UsageError
from poslens.options import _KEY as KEY

TEXT = "Position is not given to a model without a positional encoding; the causal mask gives it. " * 40


def saved_tiny_llama(directory: Path, family: str = "llama", **overrides) -> Path:
    """A tiny random Llama (3 layers, 128 positions; or another of tests/tiny_models.py's `family`; `overrides` of
    its config) saved with a byte-level tokenizer that has BOS and EOS, and a text file to read: what the
    command-line tests run on without building the embedded corpus."""
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab={**vocab, "<s>": 256, "</s>": 257}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(directory)
    build(family, **{"vocab_size": 258, "max_position_embeddings": 128, **overrides}).save_pretrained(directory)
    (directory.parent / f"{directory.name}.txt").write_text(TEXT)
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_llama(tmp_path_factory.mktemp("pipeline") / "tiny")


def text_of(model_dir: Path) -> str:
    return str(model_dir.parent / f"{model_dir.name}.txt")


# ---------------------------------------------------------------- the composed config


@pytest.mark.parametrize("sequences, batch_size, groups, used", [(64, 8, 20, 8), (64, 8, 4, 4), (16, 8, 20, 2)])
def test_groups_rule_lowers_to_the_batches(sequences, batch_size, groups, used):
    cfg = ModelData(model="m", batch_size=batch_size, groups=groups)
    assert groups_used(cfg, sequences, math.ceil(sequences / batch_size)) == used


@pytest.mark.parametrize("kw, words", [
    (dict(num_sequences=16, batch_size=50), "batch_size 50 puts all 16 sequences in one batch"),
    (dict(num_sequences=1), "num_sequences must be >= 2"),
    (dict(groups=1), "groups must be >= 2, got 1"),
    (dict(seq_len=1), "seq_len must be >= 2, got 1"),
    (dict(seed=-1), "seed must be >= 0, got -1"),
    (dict(level=1.0), "level must be in (0, 1), got 1"),
    (dict(dtype="int8"), "dtype must be one of auto, float32, bfloat16, float16; got 'int8'"),
])
def test_model_data_refuses_before_loading(kw, words):
    with pytest.raises(UsageError) as e:
        ModelData(model="no-such-model-is-ever-loaded", **kw).validate()
    assert str(e.value).startswith(words)


def test_each_analysis_config_composes_the_model_data_fields_once():
    """Every analysis config has the model-and-data fields with their help and bounds from ModelData; only the
    defaults the analysis chose differ."""
    from poslens.analyses.intermediates import IntermediatesConfig
    from poslens.analyses.leakage.run import LeakageConfig
    from poslens.analyses.scores import ScoresConfig
    from poslens.analyses.stat import StatConfig

    base = {f.name: f for f in dataclasses.fields(ModelData)}
    defaults = {}
    for cls in (ScoresConfig, IntermediatesConfig, LeakageConfig, StatConfig):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert list(fields)[:len(base)] == list(base)
        for name, f in base.items():
            meta, mine = f.metadata, dict(fields[name].metadata)
            if name == "num_sequences" and cls is not ScoresConfig:  # its own default, so the help without the base's
                assert mine[KEY].help == SEQUENCES_HELP, cls.__name__
                mine[KEY] = dataclasses.replace(mine[KEY], help=meta[KEY].help)
            assert mine == dict(meta), (cls.__name__, name)
        defaults[cls.__name__] = (fields["seq_len"].default, fields["batch_size"].default, fields["groups"].default)
    assert defaults["ScoresConfig"][0] == 1024 and defaults["IntermediatesConfig"][0] == 50
    assert defaults["LeakageConfig"] == (128, 8, 8)


# ---------------------------------------------------------------- rows and shards


def test_rows_merge_in_shard_order_and_resume():
    a, b = Rows(), Rows()
    a.add("x", torch.arange(6.0).reshape(3, 2))
    b.add("x", torch.arange(6.0, 10.0).reshape(2, 2))
    restored = Rows()
    restored.load_state_dict(a.state_dict())
    restored.merge(b)
    assert torch.equal(restored.get("x"), torch.arange(10.0).reshape(5, 2)) and restored.get("y") is None


@pytest.mark.parametrize("n, world, batch_size", [(64, 1, 8), (64, 2, 8), (10, 3, 2), (7, 2, 3), (12, 2, 4),
                                                   (10, 2, 2), (13, 4, 3)])
def test_shards_are_the_single_processs_batches(n, world, batch_size):
    """Each rank takes whole batches of the single process's batching (12 sequences in batches of 4 on 2 ranks: 3
    batches, not 6 + 6 sequences cut into 4 batches, whose groups and intervals differed from one process's)."""
    ranks = [Dist(r, world, r, torch.device("cpu")) for r in range(world)]
    blocks = [d.bounds(n, batch_size) for d in ranks]
    assert blocks[0][0] == 0 and blocks[-1][1] == n and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    counts = ranks[0].batches(n, batch_size)
    assert sum(counts) == math.ceil(n / batch_size) and max(counts) - min(counts) <= 1 and min(counts) >= 1
    rows = torch.arange(n)
    alone = list(torch.split(rows, batch_size))
    together = [b for d in ranks for b in torch.split(d.shard(rows, batch_size), batch_size)]
    assert len(together) == len(alone) and all(torch.equal(a, b) for a, b in zip(alone, together))
    # Job.batch_rows: run-wide batch index -> the rows that rank cut into that batch (what a Pass's prepare gets)
    from poslens.engine.pipeline import Job

    job = Job(ModelData(model="m", batch_size=batch_size), ranks[0], Path("."), sequences=rows)
    index = 0
    for d in ranks:
        for batch in torch.split(d.shard(rows, batch_size), batch_size):
            assert torch.equal(rows[job.batch_rows(index)], batch)
            index += 1


def test_fewer_batches_than_processes_is_refused():
    with pytest.raises(UsageError, match="5 sequences make 2 batches of 3, fewer than the 3 processes"):
        Dist(0, 3, 0, torch.device("cpu")).batches(5, 3)


# ---------------------------------------------------------------- layering (docs/architecture.md, "Import rules")

LAYERS = [("errors", "options"), ("maps", "masks", "plotting", "io", "subnormals"), ("stack",), ("engine", "utils"),
          ("train",), ("analyses",), ("report",), ("cli", "__main__")]
ALLOWED: dict[tuple[str, str], str] = {}  # imports that break the rules, each with the change that removes it


def test_imports_follow_the_layers():
    """Every import in src/poslens (module level or inside a function) goes to the importer's layer or a lower one;
    so the package graph has no cycle and the analyses never import the report or the command line."""
    import ast

    root = Path(poslens.__file__).parent
    level = {name: k for k, names in enumerate(LAYERS) for name in names}
    broken = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join(("poslens", *parts)).removesuffix(".__init__")
        if len(parts) < 1 or parts[0] not in level:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                target = name.split(".")
                if target[0] == "poslens" and len(target) > 1 and target[1] in level and \
                        level[target[1]] > level[parts[0]] and (module, name) not in ALLOWED:
                    broken.append(f"{module} imports {name}")
    assert broken == []


def module_imports(top_level_only: bool) -> dict[str, set[str]]:
    """The import graph of src/poslens by module: module -> the poslens modules it imports (`from P import M` counts
    P and P.M when M is a module). `top_level_only`: only the statements that run when the module is imported
    (those in its body, its `if`/`try` blocks included, `if TYPE_CHECKING:` left out), not those inside functions."""
    import ast

    root = Path(poslens.__file__).parent
    files = {".".join(("poslens", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
             for p in sorted(root.rglob("*.py"))}

    def statements(body):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            yield node
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                yield from statements([*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                                       *(h for handler in getattr(node, "handlers", []) for h in handler.body)])

    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        nodes = statements(tree.body) if top_level_only else ast.walk(tree)
        targets = set()
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_module_import_graph_has_no_cycle():
    """No two modules import each other, directly or through others, at import time (module level), and the
    detector finds a planted cycle (so the test can fail)."""
    assert cycles(module_imports(top_level_only=True)) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_training_modules_import_each_other_nowhere_in_a_cycle():
    """Not even inside functions: the trained-model cache, the loop and the token files (the cache lock they share
    lives in poslens.io.lock)."""
    train = [c for c in cycles(module_imports(top_level_only=False)) if any(m.startswith("poslens.train") for m in c)]
    assert train == []


# ---------------------------------------------------------------- the guarantees, for every analysis on the driver

SMALL = {"scores": ["--seq-len", "32"], "intermediates": ["--seq-len", "16"],
         "leakage": ["--seq-len", "24", "--early-queries", "10", "--interventions", "none", "--nulls", "none",
                     "--no-predecessor"]}


def small(command: str, model_dir: Path) -> list[str]:
    return [command, str(model_dir), "--data", text_of(model_dir), "--mode", "pack", "--num-sequences", "4",
            "--batch-size", "2", "--no-figures", "--quiet", *SMALL[command]]


@pytest.mark.parametrize("command", list(SMALL))
def test_the_lock_is_held_for_the_whole_run(command, model_dir, tmp_path, capsys, monkeypatch):
    """A second run of the same --out while the first one works is refused at once, before it loads anything."""
    from poslens.cli import main
    from poslens.engine import models

    out, seen, original = tmp_path / "out", {}, models.load_model

    def load_while_a_second_run_starts(*a, **k):
        monkeypatch.setattr(models, "load_model", lambda *a, **k: seen.setdefault("loaded", True))
        seen["code"] = main([*small(command, model_dir), "--out", str(out)])
        monkeypatch.setattr(models, "load_model", original)
        return original(*a, **k)

    monkeypatch.setattr(models, "load_model", load_while_a_second_run_starts)
    assert main([*small(command, model_dir), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert seen == {"code": 2} and err.startswith(f"poslens {command}: error: another poslens run is writing")
    assert poslens.load(out, tensors=False).meta["kind"] == command


@pytest.mark.parametrize("command", list(SMALL))
@pytest.mark.parametrize("which", ["model", "data"])
def test_an_out_that_is_an_input_is_refused_even_with_force(command, which, model_dir, tmp_path, capsys):
    from poslens.cli import main

    target = model_dir if which == "model" else Path(text_of(model_dir)).parent
    before = sorted(p.name for p in target.iterdir())
    assert main([*small(command, model_dir), "--out", str(target), "--force"]) == 2
    err = capsys.readouterr().err
    assert "this run's input" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in target.iterdir()) == before


def test_a_run_leaves_the_libraries_progress_bars_as_it_found_them(model_dir, tmp_path):
    """`run_analysis` hides transformers' "Loading weights" bar while it loads the model and switches it back after:
    a library call must not leave a global switch changed (it did: every later model load in the process drew no
    bar, and a test of the switch failed when it ran after one)."""
    from transformers.utils import logging as tf_logging

    from poslens.cli import main

    argv = [a for a in small("scores", model_dir) if a != "--quiet"]  # --quiet switches them off and back itself
    assert tf_logging.is_progress_bar_enabled()
    assert main([*argv, "--out", str(tmp_path / "on")]) == 0
    assert tf_logging.is_progress_bar_enabled()
    tf_logging.disable_progress_bar()
    try:
        assert main([*argv, "--out", str(tmp_path / "off")]) == 0
        assert not tf_logging.is_progress_bar_enabled()  # off stays off
    finally:
        tf_logging.enable_progress_bar()
