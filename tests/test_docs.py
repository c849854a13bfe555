"""The documentation site (mkdocs.yml: the pages of docs/ and the API reference generated from the docstrings) builds
in strict mode: a broken link between pages, a page missing from the navigation or an unresolved reference in a
docstring fails the build, so the docs cannot drift from the code unnoticed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, cwd=config.parent)


def test_the_docs_build_strict(tmp_path):
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "engine" / "index.html").read_text()
    for name in ("poslens.engine.hooks.HookedModel", "poslens.engine.models.load_model"):  # from the docstrings
        assert f'id="{name}"' in api


def test_a_broken_link_fails_the_build(tmp_path):
    """The same configuration (without the API plugin) on a copy of the pages with one link to a page that does not
    exist: refused."""
    import shutil

    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "options.md"
    page.write_text(page.read_text() + "\nSee [the missing page](missing.md).\n")
    config = (ROOT / "mkdocs.yml").read_text()
    (tmp_path / "mkdocs.yml").write_text(config[:config.index("  - mkdocstrings:")])  # the pages alone: faster
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "missing.md" in done.stderr


def test_user_documents_name_no_temporary_path_or_commit():
    """README.md and docs/ describe runs by date, machine and command: no temporary path of a machine that measured,
    no commit hash (a 7-40 character hexadecimal word with a letter and a digit), which a reader cannot use."""
    import re

    commit = re.compile(r"(?<![0-9A-Za-z_./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if "/tmp" in line or commit.search(line):
                found.append(f"{page.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


def _docs_numbers():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_numbers", ROOT / "scripts" / "docs_numbers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DOCS_RUN = ROOT / "tests" / "reference" / "reproduce-full-2026-11-30"  # the run docs/results.md names


def test_the_results_page_numbers_are_the_named_runs(capsys):
    """docs/results.md's numbers block is exactly what scripts/docs_numbers.py writes from the run it names
    (tests/reference/reproduce-full-2026-11-30: the fields of the full `poslens reproduce` run's run.json), so the page
    cannot drift from that run's report; --check passes on the page as committed."""
    dn = _docs_numbers()
    page = (ROOT / "docs" / "results.md").read_text()
    meta = dn.read_run(DOCS_RUN)
    expected = dn.block(DOCS_RUN, meta)
    assert page[page.index(dn.BEGIN):page.index(dn.END) + len(dn.END)] == expected
    assert dn.main([str(DOCS_RUN), "--doc", str(ROOT / "docs" / "results.md"), "--check"]) == 0
    for c in meta["metrics"]["claims"]:  # every row of the run, its verdict and key number as the report prints it
        assert f"- {c['verdict']}: {c['claim']} ({c['key']}) `{c['id']}`" in expected
    assert "/tmp" not in expected and "runs/" not in expected


def test_docs_numbers_rewrites_only_its_block_and_check_fails_on_a_drift(tmp_path, capsys):
    dn = _docs_numbers()
    expected = dn.block(DOCS_RUN, dn.read_run(DOCS_RUN))
    doc = tmp_path / "page.md"
    doc.write_text(f"before\n\n{dn.BEGIN}\nold numbers\n{dn.END}\n\nafter\n")
    assert dn.main([str(DOCS_RUN), "--doc", str(doc), "--check"]) == 1  # the drift is caught, nothing written
    assert "old numbers" in doc.read_text()
    assert dn.main([str(DOCS_RUN), "--doc", str(doc)]) == 0
    assert doc.read_text() == f"before\n\n{expected}\n\nafter\n"
    assert dn.main([str(DOCS_RUN), "--doc", str(doc), "--check"]) == 0
    doc.write_text("no markers\n")
    with __import__("pytest").raises(SystemExit) as e:
        dn.main([str(DOCS_RUN), "--doc", str(doc)])
    assert e.value.code == 2 and "needs one block" in capsys.readouterr().err  # bad input: one line, status 2
    assert doc.read_text() == "no markers\n"


def test_every_command_in_the_docs_code_blocks_parses_and_validates():
    """Each `poslens ...` line in a code block of README.md and docs/*.md (continuations joined, `&&` chains split,
    `torchrun ... -m poslens` included) parses with the command line and its configs pass their own validation, as
    the command would before loading anything (docs/commands.md showed `--preset cpu --pe-layers 0111`, refused on
    the preset's 6 layers). A GPU example is accepted where the only refusal is that this machine has no CUDA."""
    import re
    import shlex

    from poslens.cli import COMMANDS, build_parser
    from poslens.errors import UsageError
    from poslens.options import from_args
    from poslens.train.command import train_config

    checked, bad = 0, []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        inside, pending = False, ""
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip().startswith("```"):
                inside = not inside
                continue
            if not inside:
                continue
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            line, pending = pending + line, ""
            for part in re.split(r"&&|;|\|", line):
                part = part.split("  #")[0].strip()
                m = re.match(r"^(?:\S+=\S+\s+)*(?:\.venv/bin/)?(?:torchrun .*?-m )?poslens\s+(.*)$", part)
                if not m:
                    continue
                checked += 1
                try:
                    args = build_parser().parse_args(shlex.split(m.group(1)))
                    if args.command == "train":
                        train_config(args)
                    for cls, _ in COMMANDS[args.command].classes() if args.command != "train" else []:
                        config = from_args(cls, args)
                        if hasattr(config, "validate"):
                            config.validate()
                except UsageError as e:
                    if "CUDA is not available here" not in str(e):
                        bad.append(f"{path.name}:{no}: {part}: {e}")
                except SystemExit as e:
                    bad.append(f"{path.name}:{no}: {part}: exit {e.code}")
    assert checked >= 60 and not bad, "\n".join(bad)
