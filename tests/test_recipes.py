"""The recipes of docs/architecture.md, run as printed: each ```python block is read from the page and run as a
module (so the page cannot drift from the code). The statistic, the analysis and the command are checked against
forwards without poslens's hooks on a tiny model, the report section through `reproduce`, the intervention on the
embedded model."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from test_pipeline import saved_tiny_llama, text_of
from test_stat import eager_sequences

import poslens
from poslens.analyses.stat import StatConfig, run_stat
from poslens.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
SMALL = ["--seq-len", "32", "--num-sequences", "8", "--batch-size", "2", "--groups", "4", "--mode", "pack", "--quiet"]


def snippet(heading: str) -> str:
    """The first ```python block of section `## heading` of docs/architecture.md."""
    text = DOC.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 4)
    match = re.search(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.S)
    assert match, f"no python block under '## {heading}'"
    return match.group(1)


def install(monkeypatch, directory: Path, dotted: str, code: str):
    """Write `code` as module `dotted` (packages created) under `directory`, import it, and forget it afterwards."""
    path = directory.joinpath(*dotted.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    for package in path.relative_to(directory).parents:
        if package != Path("."):
            (directory / package / "__init__.py").touch()
    path.write_text(code)
    monkeypatch.syspath_prepend(str(directory))
    parts = dotted.split(".")
    for k in range(1, len(parts) + 1):  # removed from sys.modules at teardown
        monkeypatch.delitem(sys.modules, ".".join(parts[:k]), raising=False)
    module = importlib.import_module(dotted)
    for k in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:k]), sys.modules[".".join(parts[:k])])
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_llama(tmp_path_factory.mktemp("recipes") / "tiny")


def test_the_page_has_every_recipe():
    for heading in ("Add an intervention", "Add a statistic", "Add an analysis", "Add a command",
                    "Add a report section"):
        compile(snippet(heading), heading, "exec")  # valid Python, as printed


def test_recipe_add_a_statistic(model_dir, tmp_path, capsys, monkeypatch):
    from poslens.engine.statistics import REGISTRY

    monkeypatch.setitem(REGISTRY, "attention_to_key0", None)  # the recipe's registration is undone afterwards
    install(monkeypatch, tmp_path / "code", "mypackage.key0", snippet("Add a statistic"))
    api = poslens.load(run_stat("attention_to_key0", StatConfig(
        model=str(model_dir), data=text_of(model_dir), seq_len=32, num_sequences=8, batch_size=2, groups=4,
        mode="pack"), out=tmp_path / "api", progress=False))
    monkeypatch.setitem(REGISTRY, "attention_to_key0", "mypackage.key0:SPEC")  # the command's registry line
    assert main(["stat", "attention_to_key0", str(model_dir), "--data", text_of(model_dir), *SMALL,
                 "--out", str(tmp_path / "cli")]) == 0
    lines = capsys.readouterr().out.splitlines()
    cli = poslens.load(tmp_path / "cli")
    model, ids = eager_sequences(model_dir)
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions  # the eager softmax, per layer [B, H, T, T]
    eager = torch.stack([a[..., 0].double().mean((0, 1)) for a in attentions])
    # both softmaxes are float32 of the same scores (poslens's from q.k * scaling, eager's own): 1e-6 absolute
    for run in (api, cli):
        torch.testing.assert_close(run["key0"], eager, rtol=0, atol=1e-6)
        assert bool((run["key0_lo"] <= run["key0"]).all() and (run["key0"] <= run["key0_hi"]).all())
    assert torch.equal(api["key0_se"], cli["key0_se"]) and cli.meta["statistic"]["name"] == "attention_to_key0"
    assert lines[0].startswith("key0 [3 x 32]: mean ") and lines[-1] == f"wrote {tmp_path / 'cli'}"
    assert (tmp_path / "cli" / "figures" / "key0.png").is_file()


def test_recipe_add_an_analysis(model_dir, tmp_path, monkeypatch):
    shift = install(monkeypatch, tmp_path / "code", "mypackage.shift", snippet("Add an analysis"))
    cfg = shift.ShiftConfig(model=str(model_dir), data=text_of(model_dir), mode="pack", seq_len=32, num_sequences=8,
                            batch_size=2, groups=4, shift=100)
    run = poslens.load(shift.run_shift(cfg, tmp_path / "shift", progress=False))
    assert run.meta["kind"] == "shift" and run.meta["groups"]["used"] == 4
    # reference without poslens's hooks: the same sequences through the plain model, a torch forward hook on the
    # last decoder layer, positions moved by hand
    from poslens.engine.data import iter_documents, make_sequences
    from poslens.engine.models import load_model

    model, tok = load_model(str(model_dir))
    ids, _ = make_sequences(tok, iter_documents(cfg.data), 32, 8, mode="pack")
    kept = {}
    for s in (0, 100):
        handle = model.model.layers[-1].register_forward_hook(
            lambda m, args, out, s=s: kept.__setitem__(s, (out[0] if isinstance(out, tuple) else out).double()
                                                       .norm(dim=-1).mean(0)))
        with torch.no_grad():
            model(ids, position_ids=torch.arange(32).expand_as(ids) + s)
        handle.remove()
    assert run["ratio"].shape == (32,)
    # the same float32 forwards (read-only hooks leave the forward bit-identical); the means differ only by the
    # order of float64 sums over groups: 1e-12 relative
    torch.testing.assert_close(run["norm_orig"], kept[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(run["norm_moved"], kept[100], rtol=1e-12, atol=0)
    # RoPE depends on i - j only: moving every position changes the norms by float32 rounding alone (1e-5 relative)
    assert run.metrics["largest_change"] < 1e-5
    assert bool((run["ratio_lo"] <= run["ratio"]).all() and (run["ratio"] <= run["ratio_hi"]).all())


def test_recipe_add_a_command(model_dir, tmp_path, capsys, monkeypatch):
    from poslens import cli

    install(monkeypatch, tmp_path / "code", "mypackage.shift", snippet("Add an analysis"))
    monkeypatch.setattr(cli, "COMMANDS", dict(cli.COMMANDS))  # the recipe's entry is undone afterwards
    exec(compile(snippet("Add a command"), "docs/architecture.md", "exec"), {})
    out = tmp_path / "cmd"
    assert cli.main(["shift", str(model_dir), "--data", text_of(model_dir), "--mode", "pack", "--seq-len", "32",
                     "--num-sequences", "8", "--batch-size", "2", "--shift", "7", "--quiet", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    run = poslens.load(out)
    assert run.config["shift"] == 7 and run.config["groups"] == 20 and run.meta["groups"]["used"] == 4
    assert lines == [f"largest change {run.metrics['largest_change']:.2g}", run.meta["groups"]["note"],
                     f"wrote {out}"]
    assert cli.main(["shift", str(model_dir), "--shift", "0", "--out", str(tmp_path / "bad")]) == 2
    assert capsys.readouterr().err.strip() == "poslens shift: error: --shift must be >= 1, got 0"


def test_recipe_add_a_report_section(tmp_path, monkeypatch):
    """A function returning a Section with one Claim, registered with @section: reproduce walks the registry and
    the row lands in run.json with the verdict the rule gives."""
    from poslens.report import reproduce as rep
    from poslens.report import section as registry_module

    registry_module.registry()  # the real sections imported (registered) before the registry is emptied
    monkeypatch.setattr(registry_module, "REGISTRY", [])
    install(monkeypatch, tmp_path / "code", "mypackage.demo", snippet("Add a report section"))
    out = rep.reproduce(out=str(tmp_path / "r"), quick=True, progress=False)
    meta = json.loads((Path(out) / "run.json").read_text())
    (row,) = meta["metrics"]["claims"]
    assert (row["id"], row["verdict"], row["section_name"]) == ("poslens-demo-mean", "holds", "demo")
    assert meta["config"]["sizes"] == {"demo": {"n": 8}}
    assert "poslens-demo-mean" in (Path(out) / "report.html").read_text()


@pytest.mark.slow
def test_recipe_add_an_intervention(smollm2, capsys):
    """As printed, on the embedded model: position 0 replaced by the mean embedding moves the logits, and the read
    hook saw the patched forward."""
    exec(compile(snippet("Add an intervention"), "docs/architecture.md", "exec"), {})
    line = capsys.readouterr().out.strip()
    match = re.fullmatch(r"position 0 after layer 6: norm (\S+); largest logit change (\S+)", line)
    assert match and float(match.group(1)) > 0 and float(match.group(2)) > 0.1, line
