"""The run-directory format: atomic writes, no overwrite without force, round trip."""

import json

import pytest
import torch

import poslens
from poslens.errors import UsageError, check_int
from poslens.io.results import run_directory, write_run


def test_round_trip_and_metadata(tmp_path):
    out = tmp_path / "run"
    with run_directory(out) as tmp:
        write_run(tmp, {"scores": torch.arange(6.0).reshape(2, 3)}, {"config": {"n": 3}, "metrics": {"x": 1.5}})
        assert not out.exists()  # nothing visible until the block finishes
    run = poslens.load(out)
    assert torch.equal(run["scores"], torch.arange(6.0).reshape(2, 3))
    assert run.config == {"n": 3} and run.metrics == {"x": 1.5}
    meta = json.loads((out / "run.json").read_text())
    assert meta["environment"]["torch"] == torch.__version__
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_failure_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with run_directory(out) as tmp:
            (tmp / "partial.txt").write_text("half")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_no_overwrite_without_force(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep").write_text("old")
    with pytest.raises(UsageError, match="--force"):
        with run_directory(out):
            pass
    assert (out / "keep").read_text() == "old"
    with run_directory(out, force=True) as tmp:
        write_run(tmp, {"a": torch.zeros(1)}, {})
    assert not (out / "keep").exists() and (out / "tensors.safetensors").exists()


def test_load_rejects_non_run(tmp_path):
    with pytest.raises(UsageError, match="not a poslens run"):
        poslens.load(tmp_path)


@pytest.mark.parametrize("broken", ["run.json", "tensors.safetensors"])
def test_load_rejects_a_corrupt_run_in_one_line(tmp_path, broken):
    with run_directory(tmp_path / "run") as tmp:
        write_run(tmp, {"a": torch.zeros(3)}, {"kind": "test"})
    (tmp_path / "run" / broken).write_bytes(b"\x00garbage{")
    with pytest.raises(UsageError, match=r"^.*run: corrupt run directory \(\w+\); rerun the command that wrote it$"):
        poslens.load(tmp_path / "run")
    if broken == "tensors.safetensors":  # run.json alone still reads
        assert poslens.load(tmp_path / "run", tensors=False).meta["kind"] == "test"


@pytest.mark.parametrize("value", [None, "abc", float("nan"), float("inf"), 1.5, True])
def test_check_int_refuses_non_integers_in_one_line(value):
    with pytest.raises(UsageError, match=r"^samples must be an integer, got "):
        check_int("samples", value, 1)
