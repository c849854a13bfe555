"""Run directories that cannot destroy user data (poslens.io.rundir) and checkpoint files (poslens.io.checkpoint).

Every case that must not lose data checks the user's bytes before and after; every refusal is a one-line
UsageError. Killed runs are imitated by the files they leave (a kill leaves exactly these paths behind).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import poslens
from poslens.errors import UsageError
from poslens.io import checkpoint, lock, manifest, rundir, space, writing
from poslens.io.lock import cache_lock
from poslens.io.results import check_output, open_run, run_directory, write_run


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root`, hidden ones included, with its bytes (None for a directory; a link: its target).
    Libraries' own caches under a test's HOME (matplotlib's ~/.cache and ~/.config) are not poslens output."""
    return {str(p.relative_to(root)): (os.readlink(p).encode() if p.is_symlink() else None if p.is_dir()
                                       else p.read_bytes())
            for p in sorted(root.rglob("*")) if not {".cache", ".config"} & set(p.relative_to(root).parts)}


def poslens_run(path: Path, value: float = 1.0) -> None:
    with run_directory(path, force=True) as tmp:
        write_run(tmp, {"a": torch.full((2,), value)}, {"kind": "test"})


def user_dir(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("the user's notes")


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


# ---------------------------------------------------------------- what --force may replace


def test_force_refuses_a_directory_poslens_did_not_write(tmp_path):
    user_dir(tmp_path / "d")
    before = tree(tmp_path)
    for call in (lambda: check_output(tmp_path / "d", force=True), lambda: open_run(tmp_path / "d", True).__enter__()):
        with pytest.raises(UsageError, match="replaces only a run directory written by poslens") as e:
            call()
        one_line(e)
    assert tree(tmp_path) == before


def test_without_force_force_is_suggested_only_where_it_would_replace(tmp_path):
    # a folder of the user's: --force would refuse it, so the refusal says to choose another --out, not --force
    user_dir(tmp_path / "mine")
    poslens_run(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    before = tree(tmp_path)
    with pytest.raises(UsageError, match="mine has no poslens-manifest.json") as e:
        check_output(tmp_path / "mine", force=False)
    assert "choose another --out" in one_line(e) and "--force" not in one_line(e)
    for name in ("run", "empty"):  # these --force replaces
        with pytest.raises(UsageError, match="already exists; pass --force to overwrite") as e:
            check_output(tmp_path / name, force=False)
        one_line(e)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("kind", ["manifest", "release-0.2", "older", "empty"])
def test_force_replaces_a_poslens_run_or_an_empty_directory(tmp_path, kind):
    out = tmp_path / "r"
    if kind == "empty":
        out.mkdir()
    else:
        poslens_run(out, 1.0)
        if kind != "manifest":  # written before manifests: run.json and what that release wrote
            (out / "poslens-manifest.json").unlink()
        if kind == "older":  # written before the marker: recognised by kind + environment.poslens
            meta = json.loads((out / "run.json").read_text())
            del meta["poslens_run"]
            (out / "run.json").write_text(json.dumps(meta))
    poslens_run(out, 2.0)
    assert torch.equal(poslens.load(out)["a"], torch.full((2,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_a_run_records_every_file_and_folder_it_wrote(tmp_path):
    out = tmp_path / "r"
    with open_run(out) as run:
        write_run(run.build, {"a": torch.zeros(3)}, {"kind": "test"})
        (run.build / "figures" / "deep").mkdir(parents=True)
        (run.build / "figures" / "deep" / "x.png").write_bytes(b"png" * 10)
        (run.build / "empty").mkdir()
    listed = manifest.read_manifest(out)
    assert listed == manifest.entries(out) | {manifest.NAME: {"type": "file"}}
    png = {"type": "file", "bytes": 30, "sha256": hashlib.sha256(b"png" * 10).hexdigest()}
    assert listed["figures/deep/x.png"] == png
    assert listed["empty"] == {"type": "dir"}
    # what poslens wrote itself was hashed while it was written: the recorded hash is the file's
    for name in ("tensors.safetensors", "run.json"):
        assert listed[name]["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest()
    assert manifest.foreign(out) is None


@pytest.mark.parametrize("change, first", [
    ("file", "notes.txt"), ("folder", "mydata"), ("nested", "figures/mine.txt"), ("grown", "run.json"),
    ("link", "tensors.safetensors"), ("manifest-dir", "poslens-manifest.json")])
def test_force_refuses_a_run_holding_anything_not_in_its_manifest(tmp_path, change, first):
    out = tmp_path / "r"
    poslens_run(out)
    (out / "figures").mkdir()
    manifest.write_manifest(out)  # figures/ is the run's own
    if change == "file":
        (out / "notes.txt").write_text("mine")
    elif change == "folder":
        user_dir(out / "mydata")
    elif change == "nested":
        (out / "figures" / "mine.txt").write_text("mine")
    elif change == "grown":
        with open(out / "run.json", "a") as f:
            f.write(" ")
    elif change == "link":  # same name, but a link now: deleting it would be harmless, yet it is not what was written
        (out / "tensors.safetensors").unlink()
        (out / "tensors.safetensors").symlink_to(tmp_path)
    else:
        (out / manifest.NAME).unlink()
        (out / manifest.NAME).mkdir()
    before = tree(tmp_path)
    for call in (lambda: check_output(out, force=True), lambda: poslens_run(out, 2.0)):
        with pytest.raises(UsageError, match="replaces only a run directory written by poslens") as e:
            call()
        assert str(out / first) in one_line(e)
    assert tree(tmp_path) == before


def test_release_02_runs_are_replaced_only_when_they_hold_what_02_wrote(tmp_path):
    # What release 0.2's commands wrote (no manifest): run.json, tensors, figures/ images, plus the report and
    # the runs under models/ for reproduce, the Hugging Face files and metrics.jsonl for train.
    def legacy(path: Path, kind: str, files: list[str]) -> Path:
        poslens_run(path)
        meta = json.loads((path / "run.json").read_text()) | {"kind": kind}
        (path / "run.json").write_text(json.dumps(meta))
        (path / manifest.NAME).unlink()
        for f in files:
            (path / f).parent.mkdir(parents=True, exist_ok=True)
            (path / f).write_text("x")
        return path

    figures = ["figures/scores.png", "figures/scores.pdf", "figures/big.jpg"]
    hf = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
          "chat_template.jinja", "metrics.jsonl", "model-00001-of-00002.safetensors", "model.safetensors.index.json"]
    runs = {"gramflow": legacy(tmp_path / "gf", "gramflow", figures),
            "train": legacy(tmp_path / "tr", "train", hf),
            "reproduce": legacy(tmp_path / "rp", "reproduce", ["report.html", "report.md", *figures])}
    legacy(runs["reproduce"] / "models" / "leakage-1234", "leakage", figures)
    for path in runs.values():
        assert manifest.foreign(path) is None, path
    refused = {"gf/config.json": "config.json is not a file poslens writes into a 'gramflow' run",
               "gf/figures/notes.txt": "notes.txt is not a file", "tr/mydata/a.txt": "mydata is not a file",
               "rp/models/leakage-1234/notes.txt": "leakage-1234/notes.txt is not a file",
               "rp/models/notes.txt": "models/notes.txt is not a file"}
    for rel, words in refused.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("mine")
        with pytest.raises(UsageError, match="replaces only") as e:
            check_output(tmp_path / rel.split("/")[0], force=True)
        assert words in one_line(e)
        (tmp_path / rel).unlink()
    poslens_run(runs["reproduce"], 2.0)  # what is left is 0.2's own: replaced
    assert sorted(p.name for p in runs["reproduce"].iterdir()) == [manifest.NAME, "run.json", "tensors.safetensors"]


@pytest.mark.parametrize("relation", ["same", "parent", "grandparent", "link-to-it", "file", "inside", "deep"])
def test_a_run_never_writes_over_its_inputs(tmp_path, relation):
    data = tmp_path / "runs" / "m"
    poslens_run(data)
    (tmp_path / "link").symlink_to(tmp_path / "runs")
    out = {"same": data, "parent": data.parent, "grandparent": tmp_path, "link-to-it": tmp_path / "link" / "m",
           "file": data / "run.json", "inside": data / "sub", "deep": tmp_path / "link" / "m" / "a" / "b"}[relation]
    given = data / "run.json" if relation == "file" else data
    before = tree(tmp_path)
    for force in (False, True):
        for call in (lambda f=force: check_output(out, f, inputs=[given]),
                     lambda f=force: run_directory(out, f, inputs=["not-there", given]).__enter__()):
            with pytest.raises(UsageError, match=r"this run's input .*; a run never writes over what it reads") as e:
                call()
            one_line(e)
    assert tree(tmp_path) == before
    assert check_output(tmp_path / "beside", inputs=[data]) == tmp_path / "beside"  # beside an input is fine


def test_a_run_json_that_only_looks_like_poslens_is_not_enough(tmp_path):
    out = tmp_path / "d"
    user_dir(out)
    (out / "run.json").write_text(json.dumps({"kind": "mine"}))  # no environment.poslens, no marker
    before = tree(tmp_path)
    with pytest.raises(UsageError, match="replaces only"):
        check_output(out, force=True)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("where", ["cwd", "dot", "empty", "parent", "home", "root"])
def test_never_the_cwd_its_parents_home_or_root(tmp_path, monkeypatch, where):
    work = tmp_path / "home" / "work"
    work.mkdir(parents=True)
    (work / "keep.txt").write_text("x")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    out = {"cwd": str(work), "dot": ".", "empty": "", "parent": "..", "home": "~", "root": "/"}[where]
    before = tree(tmp_path)
    with pytest.raises(UsageError, match=r"current directory|parent of the current|home directory|root directory|"
                                         r"--out is empty") as e:
        with run_directory(out, force=True):
            pass
    one_line(e)
    assert tree(tmp_path) == before


def test_links_files_and_long_names_are_refused(tmp_path):
    (tmp_path / "f").write_text("file")
    poslens_run(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    before = tree(tmp_path)
    with pytest.raises(UsageError, match="is a symbolic link"):
        check_output(tmp_path / "link", force=True)
    with pytest.raises(UsageError, match="exists and is not a directory"):
        check_output(tmp_path / "f", force=True)
    with pytest.raises(UsageError, match="cannot create output directory .*f is not a directory"):
        check_output(tmp_path / "f" / "sub")
    with pytest.raises(UsageError, match=r"--out name is 250 bytes long; at most \d+ fit here"):
        check_output(tmp_path / ("n" * 250))
    assert tree(tmp_path) == before


# ---------------------------------------------------------------- concurrency and placement


def test_a_second_run_of_the_same_output_is_refused_while_the_first_works(tmp_path):
    out = tmp_path / "r"
    with open_run(out) as run:
        (run.build / "x").write_text("first")
        for call in (lambda: check_output(out), lambda: open_run(out).__enter__()):
            with pytest.raises(UsageError, match=r"^another poslens run is writing .*r right now") as e:
                call()
            one_line(e)
    assert (out / "x").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]  # lock and work directory gone


def test_the_lock_is_exclusive_across_processes(tmp_path):
    out = tmp_path / "r"
    code = ("import sys; from poslens.io.rundir import open_run\n"
            "try:\n    open_run(sys.argv[1]).__enter__()\nexcept Exception as e:\n    print(e)\n")
    with open_run(out):
        res = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=60)
    assert "another poslens run is writing" in res.stdout


def test_what_appears_during_a_run_is_never_replaced(tmp_path):
    out = tmp_path / "r"
    with pytest.raises(UsageError, match="appeared while this run was working and was left as it is") as e:
        with open_run(out) as run:
            (run.build / "result").write_text("new")
            user_dir(out)
    one_line(e)
    assert (out / "notes.txt").read_text() == "the user's notes" and sorted(p.name for p in out.iterdir()) == [
        "notes.txt"]
    # with force too: only something poslens wrote may be swapped out
    with pytest.raises(UsageError, match="by something poslens did not write"):
        with open_run(tmp_path / "s", force=True):
            user_dir(tmp_path / "s")
    assert (tmp_path / "s" / "notes.txt").read_text() == "the user's notes"


def test_a_file_put_into_a_run_while_it_is_being_replaced_is_never_deleted(tmp_path, monkeypatch, capsys):
    # The user writes into the old run just after the swap checked it: the check after moving it aside sees the
    # file, puts the old run back and fails in one line. Written later still (through a directory handle held
    # into the moved run), the file is kept, with the old run, beside the output.
    out = tmp_path / "r"
    poslens_run(out, 1.0)
    real = manifest.foreign

    def racing(path):
        why = real(path)
        if path == out and (tmp_path / ".r.partial" / "build" / manifest.NAME).exists():  # _place's check
            (out / "notes.txt").write_text("mine")
        return why

    monkeypatch.setattr(rundir, "foreign", racing)
    with pytest.raises(UsageError, match=r"r was changed while this run was working by something poslens did not "
                                         r"write \(.*notes.txt was not written by poslens"):
        poslens_run(out, 2.0)
    assert (out / "notes.txt").read_text() == "mine" and torch.equal(poslens.load(out)["a"], torch.full((2,), 1.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]
    monkeypatch.undo()
    (out / "notes.txt").unlink()
    (tmp_path / "old").mkdir()
    out.rename(tmp_path / "old" / "r")
    poslens_run(out, 3.0)
    (tmp_path / "old" / "r" / "notes.txt").write_text("mine")
    rundir._discard(tmp_path / "old" / "r", out)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("r.replaced-")]
    assert len(kept) == 1 and (kept[0] / "notes.txt").read_text() == "mine" and (kept[0] / "run.json").exists()
    assert f"it was kept as {kept[0]}" in capsys.readouterr().err


def test_noreplace_rename_refuses_a_non_empty_target(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    user_dir(dst)
    with pytest.raises(FileExistsError):
        rundir._rename_noreplace(src, dst)
    assert src.is_dir() and (dst / "notes.txt").exists()


# ---------------------------------------------------------------- temporaries and leftovers


def test_a_failed_run_leaves_nothing_not_even_parents(tmp_path):
    before = tree(tmp_path)
    for exc in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(exc):
            with run_directory(tmp_path / "a" / "b" / "out") as tmp:
                (tmp / "half").write_text("half")
                raise exc()
    assert tree(tmp_path) == before


def test_leftovers_of_killed_runs_are_cleaned_and_a_swapped_out_run_restored(tmp_path):
    out = tmp_path / "r"
    poslens_run(tmp_path / "keep", 5.0)
    (tmp_path / "keep").rename(tmp_path / ".r.old-123-456")  # killed between the older layout's two renames
    (tmp_path / ".r.tmp-abc123").mkdir()  # the older layout's build directory
    (tmp_path / ".r.tmp-abc123" / "tensors.safetensors").write_bytes(b"x" * 100)
    (tmp_path / ".r.partial" / "build").mkdir(parents=True)
    pid = dead_pid()
    (tmp_path / f".r.partial-0-of-1.safetensors.tmp-{pid}").write_bytes(b"half a checkpoint")
    (tmp_path / f".r.partial-0-of-1.safetensors.tmp-{os.getpid()}").write_bytes(b"a live writer's")
    (tmp_path / ".r.parts").mkdir()
    (tmp_path / ".r.parts" / "abc.tmp").write_bytes(b"half")
    (tmp_path / "unrelated.tmp-1").write_text("not ours")
    assert check_output(out, force=True) == out
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f".r.partial-0-of-1.safetensors.tmp-{os.getpid()}", ".r.parts", "r", "unrelated.tmp-1"]
    assert torch.equal(poslens.load(out)["a"], torch.full((2,), 5.0))  # the previous result is back
    assert list((tmp_path / ".r.parts").iterdir()) == []


def test_a_run_killed_mid_swap_gets_its_previous_result_back(tmp_path):
    out = tmp_path / "r"
    poslens_run(out, 3.0)
    (tmp_path / ".r.partial").mkdir()
    out.rename(tmp_path / ".r.partial" / "old")  # killed after moving the old run aside
    (tmp_path / ".r.partial" / "build").mkdir()
    with pytest.raises(UsageError, match="already exists"):  # restored, so without force it is protected
        check_output(out)
    assert torch.equal(poslens.load(out)["a"], torch.full((2,), 3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_checkpoints_survive_an_interrupt_and_go_when_the_run_completes(tmp_path):
    out = tmp_path / "r"
    with pytest.raises(KeyboardInterrupt):
        with open_run(out) as run:
            assert rundir.current_run() is run
            checkpoint.save_partial(run.checkpoint("state"), {"s": torch.arange(3.0)}, 7, {"x": 1})
            (run.build / "half").write_text("half")
            raise KeyboardInterrupt
    assert rundir.current_run() is None
    assert sorted(p.name for p in tmp_path.rglob("*")) == [".r.partial", "state.safetensors"]
    with open_run(out) as run:
        sums, done = checkpoint.load_partial(run.checkpoint("state"), {"x": 1})
        assert done == 7 and torch.equal(sums["s"], torch.arange(3.0))
        write_run(run.build, sums, {"kind": "test"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]



def test_saving_by_time_waits_ten_seconds_and_costs_at_most_a_tenth(tmp_path, monkeypatch):
    """`Cadence` without a unit count: the first save once CHECKPOINT_SECONDS have passed, the next only after nine
    times as long as a save took (a 15-s save of a GPU run's maps: 135 s later), so saving is at most SAVE_SHARE of
    the run; with a unit count, every that many units whatever the clock says."""
    clock = [100.0]
    monkeypatch.setattr(checkpoint.time, "monotonic", lambda: clock[0])
    real = checkpoint.save_partial

    def slow_save(*args):
        real(*args)
        clock[0] += 15.0  # the save itself takes 15 s

    monkeypatch.setattr(checkpoint, "save_partial", slow_save)
    by_time, ck = checkpoint.Cadence(), tmp_path / "ck.safetensors"
    clock[0] += checkpoint.CHECKPOINT_SECONDS - 0.1
    assert not by_time.due(1)
    clock[0] += 0.1
    assert by_time.due(2)
    by_time.save(ck, {"s": torch.ones(2)}, 2, {})
    clock[0] += 134.0
    assert not by_time.due(3)
    clock[0] += 1.0
    assert by_time.due(4)
    assert checkpoint.load_partial(ck, {})[1] == 2
    every = checkpoint.Cadence(3)
    assert [every.due(u) for u in range(1, 7)] == [False, False, True, False, False, True]

@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_files_get_the_umask_permissions(tmp_path, mask):
    old = os.umask(mask)
    try:
        poslens_run(tmp_path / "a" / "r")
        checkpoint.save_partial(tmp_path / "ck.safetensors", {"s": torch.zeros(1)}, 1, {})
        checkpoint.write_cache(tmp_path / "cache.safetensors", {"s": torch.zeros(1)})
    finally:
        os.umask(old)
    for p in (tmp_path / "a", tmp_path / "a" / "r"):
        assert p.stat().st_mode & 0o777 == 0o777 & ~mask, p
    for p in (tmp_path / "a" / "r" / "run.json", tmp_path / "a" / "r" / "tensors.safetensors",
              tmp_path / "ck.safetensors", tmp_path / "cache.safetensors"):
        assert p.stat().st_mode & 0o777 == 0o666 & ~mask, p


# ---------------------------------------------------------------- checkpoint files


def test_a_failed_checkpoint_write_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "ck.safetensors"

    def half_written(filename, tensors, metadata=None, hashed=True):
        Path(filename).write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "write_tensors", half_written)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_partial(path, {"s": torch.zeros(1)}, 1, {})
    assert list(tmp_path.iterdir()) == []


def test_a_killed_writers_temporary_is_removed_by_the_next_load(tmp_path):
    path = tmp_path / "ck.safetensors"
    stale = tmp_path / f"ck.safetensors.tmp-{dead_pid()}"
    stale.write_bytes(b"x" * 1000)
    assert checkpoint.load_partial(path, {}) is None
    assert not stale.exists()


def test_a_corrupt_cache_entry_is_named_deleted_and_recomputed(tmp_path, capsys):
    path = tmp_path / "entry.safetensors"
    path.write_bytes(b"\x00garbage")
    assert checkpoint.read_cache(path) is None
    err = capsys.readouterr().err
    assert err.startswith("\n") and f"cache file {path} is corrupt" in err and "recomputing" in err
    assert not path.exists()
    save_file({"a": torch.ones(2)}, str(path))
    assert torch.equal(checkpoint.read_cache(path)["a"], torch.ones(2))


# ---------------------------------------------------------------- locks of shared cache entries

HOLDER = ("import sys, time\nfrom poslens.io.lock import cache_lock\n"
          "with cache_lock(sys.argv[1], 'the test entry'):\n    print('holding', flush=True)\n    time.sleep(60)\n")
WAITER = ("import sys\nfrom poslens.io.lock import cache_lock\n"
          "with cache_lock(sys.argv[1], 'the test entry'):\n    print(open(sys.argv[1]).read(), flush=True)\n")


def light_process(code: str, *args: str) -> subprocess.Popen:
    """A Python process running `code` that imports only poslens.io (no torch: about 0.1 s to start)."""
    env = {**os.environ, "PYTHONPATH": str(Path(rundir.__file__).parents[2])}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def test_a_second_process_waits_for_a_cache_entry_being_built_and_then_uses_it(tmp_path):
    entry = tmp_path / "cache" / "entry.txt"
    with cache_lock(entry, "the test entry"):
        waiter = light_process(WAITER, str(entry))
        line = waiter.stderr.readline()  # printed once, before it blocks
        assert line == f"waiting for another poslens process (pid {os.getpid()}) to finish building the test entry\n"
        time.sleep(0.2)
        assert waiter.poll() is None  # still waiting
        entry.write_text("built")
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0 and out == "built\n" and err == ""
    assert sorted(p.name for p in entry.parent.iterdir()) == ["entry.txt"]  # no lock file left


@pytest.mark.parametrize("what", ["cache", "run"])
def test_a_killed_lock_holder_never_blocks_the_next_process(tmp_path, capsys, what):
    entry = tmp_path / "entry"
    code = HOLDER if what == "cache" else ("import sys, time\nfrom poslens.io.rundir import open_run\n"
                                           "with open_run(sys.argv[1]):\n    print('holding', flush=True)\n"
                                           "    time.sleep(60)\n")
    holder = light_process(code, str(entry))
    assert holder.stdout.readline() == "holding\n"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    lock_file = tmp_path / (".entry.cache.lock" if what == "cache" else ".entry.lock")
    assert lock_file.exists()  # left by the kill, with the dead pid in it
    started = time.monotonic()
    if what == "cache":
        with cache_lock(entry, "the test entry"):
            entry.write_text("x")
    else:
        poslens_run(entry)
    assert time.monotonic() - started < 5 and capsys.readouterr().err == ""  # no wait
    assert not lock_file.exists()


class FullDisk:
    """`os` whose `write` finds the disk full (for the lock file's pid)."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def write(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("what", ["cache", "run"])
def test_a_full_disk_when_taking_a_lock_is_one_line_and_leaves_no_lock_file(tmp_path, monkeypatch, what):
    monkeypatch.setattr(lock, "os", FullDisk())
    with pytest.raises(UsageError, match=r"no space left on the device to write .*\.entry(\.cache)?\.lock \(it needs "
                                         r"\d+ bytes"):
        with (cache_lock(tmp_path / "entry", "x") if what == "cache" else open_run(tmp_path / "entry")):
            pass
    assert list(tmp_path.iterdir()) == []


def test_a_cache_entry_can_be_written_as_a_run_directory_under_its_lock(tmp_path):
    entry = tmp_path / "tokens" / "entry"
    with cache_lock(entry, "x"):  # the run's own lock is another file
        poslens_run(entry)
        poslens_run(entry, 2.0)  # a corrupt or stale entry is replaced
    assert torch.equal(poslens.load(entry)["a"], torch.full((2,), 2.0))
    assert sorted(p.name for p in entry.parent.iterdir()) == ["entry"]


def test_an_unwritable_cache_directory_is_refused_before_any_work(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match=r"cache directory .*file/corpus cannot be created: Not a directory; point "
                                         "POSLENS_CACHE at a writable directory"):
        with cache_lock(tmp_path / "file" / "corpus" / "entry", "x"):
            raise AssertionError("not reached")


# ---------------------------------------------------------------- a full disk

ENOSPC_SAFETENSORS = "Error while serializing: I/O error: No space left on device (os error 28)"


def tensors_full(filename, tensors, metadata=None, hashed=True):
    """`poslens.io.writing.write_tensors` on a full disk: part of the file written, then ENOSPC."""
    import errno

    Path(filename).write_bytes(b"half")
    raise OSError(errno.ENOSPC, "No space left on device", str(filename))


def safetensors_full(tensors, filename, metadata=None):
    from safetensors import SafetensorError

    Path(filename).write_bytes(b"half")
    raise SafetensorError(ENOSPC_SAFETENSORS)


class FullFile:
    """`os` (for `poslens.io.writing`) whose `write` to a file named `name` takes the first 10 bytes, then fails with
    `err` (ENOSPC: a full disk; EFBIG: the file-size limit); with `short`, it only ever takes 10 bytes and then
    reports 0 written (a device that takes nothing, with no error number)."""

    def __init__(self, name: str, err: int = errno.ENOSPC, short: bool = False):
        self.name, self.err, self.short = name, err, short

    def __getattr__(self, attr):
        return getattr(os, attr)

    def write(self, fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1] != self.name:
            return os.write(fd, data)
        if os.fstat(fd).st_size >= 10:
            if self.short:
                return 0
            raise OSError(self.err, os.strerror(self.err))
        return os.write(fd, bytes(memoryview(data)[:10]))


@pytest.mark.parametrize("writer", ["tensors.safetensors", "run.json", "poslens-manifest.json"])
@pytest.mark.parametrize("fault", ["ENOSPC", "EFBIG", "short"])
def test_a_full_disk_while_writing_a_run_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, writer, fault):
    monkeypatch.setattr(writing, "os", FullFile(writer, getattr(errno, fault, 0), short=fault == "short"))
    want = {"ENOSPC": rf"^no space left on the device to write \S+/{writer} \(it needs [\d,]+ bytes, .* free\); "
                      "free some space or write elsewhere$",
            "EFBIG": rf"^cannot write \S+/{writer}: the file-size limit \(ulimit -f\) stops it short of the [\d,]+ "
                     r"bytes it needs \(File too large\); raise the limit or write elsewhere$",
            "short": rf"^\S+/{writer} was written short: [\d,]+ bytes of [\d,]+ bytes reached the disk; free some "
                     "space or write elsewhere$"}[fault]
    with pytest.raises(UsageError, match=want):
        poslens_run(tmp_path / "a" / "r")
    rundir.remove_empty_parents()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("save", ["save_partial", "write_cache"])
def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path, monkeypatch, save):
    path = tmp_path / "ck.safetensors"
    write = (lambda v: checkpoint.save_partial(path, {"s": torch.full((4,), v)}, 1, {})) if save == "save_partial" \
        else (lambda v: checkpoint.write_cache(path, {"s": torch.full((4,), v)}))
    write(1.0)
    before = tree(tmp_path)
    monkeypatch.setattr(checkpoint, "write_tensors", tensors_full)
    with pytest.raises(UsageError, match=r"no space left on the device to write .*ck\.safetensors \(it needs "):
        write(2.0)
    assert tree(tmp_path) == before


def test_the_disk_space_helper_recognises_safetensors_on_a_full_disk(tmp_path):
    # safetensors' own writer (transformers' save_pretrained) names the error only in its message
    with pytest.raises(UsageError, match=r"no space left on the device to write .*model\.safetensors"):
        with space.disk_space(tmp_path / "model.safetensors", 100):
            safetensors_full({}, tmp_path / "model.safetensors")


def test_the_disk_space_helper_recognises_torch_save_on_a_full_disk(tmp_path, monkeypatch):
    # torch.save's zip writer names no errno; a failed write with less free space than it needed is a full disk
    state = {"w": torch.zeros(100_000), "step": 3}
    failure = RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")
    monkeypatch.setattr(space, "free_bytes", lambda path: 1000)
    with pytest.raises(UsageError, match=r"write .*state\.pt \(it needs 400,\d{3} bytes, 1,000 bytes free\)"):
        with space.disk_space(tmp_path / "state.pt", space.nbytes(state)):
            raise failure
    monkeypatch.setattr(space, "free_bytes", lambda path: 10**12)  # plenty of room: not a full disk
    with pytest.raises(RuntimeError, match="file write failed"):
        with space.disk_space(tmp_path / "state.pt", space.nbytes(state)):
            raise failure
    with pytest.raises(KeyError):  # other errors pass through
        with space.disk_space(tmp_path / "state.pt", 1):
            raise KeyError("x")


def test_a_failed_cache_build_leaves_no_empty_folders(tmp_path):
    # issue 37: a full cache left empty trained/, models/ and corpus/ folders behind
    entry = tmp_path / "cache" / "trained" / "m"
    with pytest.raises(UsageError, match="disk full"):
        with cache_lock(entry, "the test model"):
            assert (tmp_path / "cache" / "trained").is_dir()
            raise UsageError("disk full")
    assert list(tmp_path.iterdir()) == []
    with cache_lock(entry, "the test model"):  # a build that succeeds keeps its folders
        entry.mkdir()
    assert entry.is_dir() and sorted(p.name for p in entry.parent.iterdir()) == ["m"]


def test_only_the_cache_entry_being_built_may_be_written_inside_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POSLENS_CACHE", str(tmp_path / "cache"))
    entry = tmp_path / "cache" / "trained" / "m"
    with pytest.raises(UsageError, match=r"is inside the poslens cache .*; a run never writes over what it reads"):
        check_output(entry)
    with cache_lock(entry.with_name("m.cache"), "the test model", entry=entry):
        poslens_run(entry)  # its builder, under its lock
        with pytest.raises(UsageError, match="is inside the poslens cache"):
            check_output(entry.with_name("other"))  # another entry, even then
    assert poslens.load(entry).meta["kind"] == "test"


def test_torch_save_past_the_file_size_limit_is_one_line(tmp_path):
    # torch.save's writer names no error number ("file write failed"): under a file-size limit below what it writes
    # it is still the one line of the limit (RLIMIT_FSIZE lowered for this process only, and restored)
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    try:
        with pytest.raises(UsageError, match=r"^cannot write \S+big.pt: the file-size limit \(ulimit -f\) stops it "
                                             r"short of the 80,000 bytes it needs"):
            with space.disk_space(tmp_path / "big.pt", 80_000):
                torch.save({"a": torch.zeros(20_000)}, tmp_path / "big.pt")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_an_entry_lock_is_the_documented_file_and_goes_with_its_holder(tmp_path):
    """entry_lock's file is .NAME.cache.lock beside the entry (it was .NAME.cache.cache.lock), held while the block
    runs and removed after."""
    from poslens.io.lock import entry_lock

    entry = tmp_path / "model-s0-abc"
    with entry_lock(entry, "the test entry"):
        assert [p.name for p in tmp_path.iterdir()] == [".model-s0-abc.cache.lock"]
    assert list(tmp_path.iterdir()) == []
