"""The command line: runs write complete run directories; bad input is one line, exit 2, nothing written."""

import subprocess
import sys

import numpy as np
import pytest

import poslens
from poslens.cli import main
from poslens.stack.config import StackConfig
from poslens.stack.gramflow import gram_flow


def cli(*args):
    return subprocess.run([sys.executable, "-m", "poslens", *args], capture_output=True, text=True, timeout=300)


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
    (["simulate", "--seq-len", "1"], "n must be"),
    (["simulate", "--samples", "0"], "samples"),
    (["simulate", "--mask", "sliding"], "window"),
    (["simulate", "--mask", "sliding", "--window", "0"], "window"),
    (["simulate", "--window", "4"], "window"),
    (["simulate", "--norm", "batchnorm"], "norm must be one of"),
    (["simulate", "--device", "cuda"], "cuda"),
    (["gramflow", "--layers", "0"], "layers"),
    (["gramflow", "--rope-scaling", "0.5", "--pe", "rope"], "rope_scaling"),
    (["reproduce", "--samples", "0"], "samples"),
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


def test_unwritable_output_is_one_line(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        res = cli("gramflow", "--out", str(locked / "sub" / "run"))
    finally:
        locked.chmod(0o700)
    if res.returncode == 0:  # root ignores permissions: nothing to test
        pytest.skip("running as root: directory permissions are not enforced")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "writable" in res.stderr


def test_output_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    res = cli("gramflow", "--out", str(f / "run"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_help_everywhere():
    for sub in ([], ["simulate"], ["gramflow"], ["reproduce"], ["scores"], ["compare"]):
        res = cli(*sub, "--help")
        assert res.returncode == 0 and "usage: poslens" in res.stdout
