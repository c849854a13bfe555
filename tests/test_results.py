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
    # every run says which source made it and when: a model read back from a cache names the code that trained it
    env = meta["environment"]
    assert env["source"].startswith(("git ", "poslens ")) and env["date"].endswith(" UTC")
    from poslens.report.sweep import _trained_by

    # and the processor and torch's CPU kernels that trained it (models drift apart across instruction sets)
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and env["cpu"]
    assert _trained_by(out) == (f"trained by {env['source']} on {env['date']}, {env['cpu']} with torch's "
                                f"{env['cpu_capability']} kernels")
    assert "did not record" in _trained_by(tmp_path / "nothing-here")


def test_failure_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with run_directory(out) as tmp:
            (tmp / "partial.txt").write_text("half")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_no_overwrite_without_force(tmp_path):
    out = tmp_path / "run"
    with run_directory(out) as tmp:
        write_run(tmp, {"a": torch.ones(1)}, {"kind": "test"})
    with pytest.raises(UsageError, match="--force"):
        with run_directory(out):
            pass
    assert torch.equal(poslens.load(out)["a"], torch.ones(1))
    with run_directory(out, force=True) as tmp:  # a run poslens wrote may be replaced with force
        write_run(tmp, {"a": torch.zeros(1)}, {"kind": "test"})
    assert torch.equal(poslens.load(out)["a"], torch.zeros(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no lock, work or old directory left


def test_run_json_carries_the_poslens_marker(tmp_path):
    with run_directory(tmp_path / "run") as tmp:
        write_run(tmp, {"a": torch.zeros(1)}, {"kind": "test", "poslens_run": 0})
    assert json.loads((tmp_path / "run" / "run.json").read_text())["poslens_run"] == 1


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


@pytest.mark.parametrize("meta, what", [([], "run.json is not a JSON object"), ({"config": [1]}, "'config' is not"),
                                        ({"metrics": "x"}, "'metrics' is not")])
def test_load_rejects_a_structurally_wrong_run_json(tmp_path, meta, what):
    with run_directory(tmp_path / "run") as tmp:
        write_run(tmp, {"a": torch.zeros(3)}, {"kind": "test"})
    (tmp_path / "run" / "run.json").write_text(json.dumps(meta))
    with pytest.raises(UsageError, match=f"corrupt run directory \\({what}"):
        poslens.load(tmp_path / "run")


def test_a_missing_tensor_is_a_usage_error(tmp_path):
    with run_directory(tmp_path / "run") as tmp:
        write_run(tmp, {"a": torch.zeros(3)}, {"kind": "scores"})
    with pytest.raises(UsageError, match=r"the run has no tensor 'scores' \(it has: a\); rerun"):
        poslens.load(tmp_path / "run")["scores"]


def test_the_tensors_writer_is_byte_identical_to_safetensors(tmp_path):
    """poslens writes tensors.safetensors itself, a tensor at a time, hashing as it writes (poslens.io.writing): the
    file is byte for byte the one safetensors' own writer makes (the independent reference), for every dtype and
    shape (0-d, empty), and the hash it recorded for the manifest is the file's."""
    import hashlib

    from safetensors.torch import save_file

    from poslens.io.writing import recorded, write_tensors

    g = torch.Generator().manual_seed(0)
    tensors = {"f64": torch.randn(3, 2, dtype=torch.float64, generator=g), "f32": torch.randn(5, generator=g),
               "bf16": torch.randn(4, generator=g).bfloat16(), "f16": torch.randn(3, generator=g).half(),
               "i64": torch.arange(7), "i32": torch.arange(3, dtype=torch.int32), "i16": torch.arange(2).short(),
               "i8": torch.arange(-2, 3, dtype=torch.int8), "u8": torch.arange(5, dtype=torch.uint8),
               "bool": torch.tensor([True, False]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
               "c64": torch.randn(2, dtype=torch.complex64, generator=g), "u16": torch.zeros(3, dtype=torch.uint16),
               "e4m3": torch.zeros(2, dtype=torch.float8_e4m3fn), "b": torch.randn(2, 2, generator=g).t()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "reference.safetensors"))
    write_tensors(tmp_path / "ours.safetensors", tensors)
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "reference.safetensors").read_bytes()
    assert recorded(tmp_path / "ours.safetensors") == hashlib.sha256(ours).hexdigest()
    meta = {"__done__": "12", "fingerprint": "0123abcd"}  # a checkpoint's metadata (poslens.io.checkpoint)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "reference-meta.safetensors"), meta)
    write_tensors(tmp_path / "ours-meta.safetensors", tensors, meta)
    ours, ref = ((tmp_path / f).read_bytes() for f in ("ours-meta.safetensors", "reference-meta.safetensors"))
    n = int.from_bytes(ours[:8], "little")  # safetensors orders the metadata as a hash map does (per process): the
    assert ours[:8] == ref[:8] and json.loads(ours[8:8 + n]) == json.loads(ref[8:8 + n])  # header as JSON, the
    assert ours[8 + n:] == ref[8 + n:]  # data byte for byte
