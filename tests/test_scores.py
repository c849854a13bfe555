"""`poslens scores` end to end on a local-directory model: exact maps, sharding, resume, bad input (on the
analysis pipeline, poslens.engine.pipeline)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import free_port, interrupted_at
from test_pipeline import saved_tiny_llama

import poslens
from poslens.analyses.scores import ScoresConfig, run_scores
from poslens.cli import main
from poslens.engine.capture import attention_scores
from poslens.engine.data import iter_documents, make_sequences
from poslens.engine.distributed import setup
from poslens.engine.models import load_model
from poslens.engine.pipeline import checkpoint_path
from poslens.errors import UsageError

SEQ, NUM, BATCH = 48, 8, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama saved with a byte-level tokenizer, loaded back through from_pretrained(dir)."""
    return saved_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")


def cfg(model_dir, **kw):
    return ScoresConfig(**{"model": str(model_dir), "seq_len": SEQ, "num_sequences": NUM, "batch_size": BATCH,
                           "mode": "pack", **kw})


def test_scores_equal_direct_capture(model_dir, tmp_path):
    out = run_scores(cfg(model_dir), tmp_path / "run", progress=False)
    run = poslens.load(out)
    model, tok = load_model(str(model_dir))
    ids, _ = make_sequences(tok, iter_documents(None), SEQ, NUM, mode="pack")
    direct = attention_scores(model, ids)
    assert run["scores"].shape == (model.config.num_hidden_layers, SEQ, SEQ)
    # same batches in the same order: the sums are the same float32 operations
    torch.testing.assert_close(run["scores"], direct, rtol=0, atol=1e-5, equal_nan=True)
    assert run.meta["data"]["sequences"] == NUM and run.meta["kind"] == "scores"
    layers = run.metrics["layers"]
    assert all(m["normalised_noise_rms"] > 0 for m in layers)  # jackknife error bars over groups present
    assert all(m["normalised_rms_ci"]["lo"] <= m["normalised_rms"] <= m["normalised_rms_ci"]["hi"] for m in layers)
    assert (tmp_path / "run" / "figures" / "scores_normalised.png").exists()


def test_resume_after_interrupt_equals_uninterrupted(model_dir, tmp_path, monkeypatch):
    full = poslens.load(run_scores(cfg(model_dir), tmp_path / "full", progress=False))
    out = tmp_path / "resumed"
    with interrupted_at(3):
        run_scores(cfg(model_dir, checkpoint_every=1), out, progress=False)
    assert not out.exists() and checkpoint_path(out).exists()
    resumed = poslens.load(run_scores(cfg(model_dir, checkpoint_every=1), out, progress=False))
    assert resumed.meta["resumed_from_unit"] == 2
    assert not checkpoint_path(out).exists()
    for key in ("scores", "scores_se", "normalised_se"):
        torch.testing.assert_close(resumed[key], full[key], rtol=0, atol=0, equal_nan=True)


def test_corrupt_checkpoint_is_a_usage_error(model_dir, tmp_path):
    out = tmp_path / "run"
    checkpoint_path(out).parent.mkdir()
    checkpoint_path(out).write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="corrupt"):
        run_scores(cfg(model_dir), out, progress=False)
    assert not out.exists()


@pytest.mark.parametrize("num, batch", [(NUM, BATCH), (12, 4)])
def test_torchrun_two_ranks_equal_single_process(model_dir, tmp_path, num, batch):
    """Means, standard errors and groups of two ranks equal one process's. 12 sequences in batches of 4: each rank
    takes whole batches (2 + 1 of the 3); before, each took 6 sequences and cut them into 2 batches, 4 in all, other
    groups, and standard errors 0.8 apart (relative)."""
    single = poslens.load(run_scores(cfg(model_dir, num_sequences=num, batch_size=batch, groups=3),
                                     tmp_path / "single", progress=False))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "poslens", "scores", str(model_dir), "--seq-len", str(SEQ), "--num-sequences", str(num),
           "--batch-size", str(batch), "--groups", "3", "--mode", "pack", "--quiet", "--out", str(tmp_path / "sharded")]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    sharded = poslens.load(tmp_path / "sharded")
    assert sharded.meta["world_size"] == 2 and sharded.meta["groups"] == single.meta["groups"]
    # different summation order over ranks: equal to float32 round-off
    for name in ("scores", "scores_se"):
        torch.testing.assert_close(sharded[name], single[name], rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.equal(sharded["count"], single["count"])


def test_more_processes_per_node_than_gpus_is_refused(monkeypatch):
    """NCCL needs one GPU per process: 2 processes on a 1-GPU node fail with the fix, before any group forms."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UsageError, match=r"2 processes on this node .* 1 GPU\(s\); use --nproc-per-node 1$"):
        setup("cuda")


@pytest.mark.parametrize("args, words", [
    (["scores", "/no/such/model"], "no/such/model"),
    (["scores", "{model}", "--seq-len", "1000"], "--seq-len 1000 is beyond the model's window of 128"),
    (["scores", "{model}", "--num-sequences", "50", "--seq-len", "48", "--data", "{small}"], "only"),
    (["scores", "{model}", "--device", "cuda"], "cuda"),
    (["scores", "{model}", "--layers", "0,99", "--seq-len", "48", "--num-sequences", "2", "--batch-size", "1"],
     "--layers must be in [-3, 2], got 99"),
    (["scores", "{model}", "--data", "/no/such/file.jsonl", "--seq-len", "48"], "file.jsonl"),
    (["scores", "{model}", "--num-sequences", "1"], "--num-sequences must be >= 2"),
    (["scores", "{model}", "--num-sequences", "16", "--batch-size", "20"], "--batch-size 20 puts all 16"),
    (["scores", "{model}", "--groups", "1"], "--groups must be >= 2, got 1"),
    (["scores", "{model}", "--seed", "-1"], "--seed must be >= 0, got -1"),
    (["scores", "{model}", "--level", "1"], "--level must be in (0, 1), got 1"),
])
def test_bad_input_one_line_exit_2_nothing_written(model_dir, tmp_path, capsys, args, words):
    """In-process (no torch import per case); every refusal before the model computes anything."""
    before = sorted(os.listdir(model_dir))
    small = tmp_path / "data"
    small.mkdir()
    (small / "a.txt").write_text("A few words of text. " * 20)
    out = tmp_path / "out"
    argv = [a.format(model=model_dir, small=small) for a in args]
    code = main([*argv, "--quiet", *([] if "--out" in argv else ["--out", str(out)])])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert words in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"] and os.listdir(small) == ["a.txt"]
    assert sorted(os.listdir(model_dir)) == before


def test_a_batch_beyond_memory_is_refused_with_the_estimate(model_dir, tmp_path, capsys, monkeypatch):
    """The size check runs before any sequence is cut: with 64 MiB free, batches of 1,000 sequences are refused
    with the estimate and the parameter that lowers it."""
    from poslens.engine import pipeline

    monkeypatch.setattr(pipeline, "available_memory", lambda: 64 << 20)
    assert main(["scores", str(model_dir), "--batch-size", "100000", "--seq-len", "128", "--quiet",
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("poslens scores: error: --batch-size 100000: the run would need about ") and \
        "but 64 MiB is free on cpu; lower --batch-size" in err and "\n" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_no_rope_records_the_model_that_ran_and_contradicting_pe_is_refused(model_dir, tmp_path, capsys):
    """--no-rope runs the model without RoPE for the whole run: run.json's model record says none, and the maps are
    those of --pe none, number for number; with --pe rope it is refused in one line naming both flags."""
    assert main(["scores", str(model_dir), "--no-rope", "--pe", "rope", "--quiet", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip() == \
        "poslens scores: error: --pe rope keeps RoPE and --no-rope removes it: give one of them"
    assert not (tmp_path / "x").exists()
    off = poslens.load(run_scores(cfg(model_dir, no_rope=True), tmp_path / "off", progress=False))
    none = poslens.load(run_scores(cfg(model_dir, pe="none"), tmp_path / "none", progress=False))
    assert set(off.meta["model"]["positional_encoding"]) == {"none"}
    torch.testing.assert_close(off["scores"], none["scores"], rtol=0, atol=0, equal_nan=True)  # the same numbers


def test_a_length_past_the_window_is_refused_before_the_sizes(model_dir, tmp_path, capsys, monkeypatch):
    """Past the model's window no memory would do: the window is named, not a size to lower."""
    from poslens.engine import pipeline

    monkeypatch.setattr(pipeline, "available_memory", lambda: 64 << 20)
    assert main(["scores", str(model_dir), "--seq-len", "100000", "--quiet", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--seq-len 100000 is beyond the model's window" in err and "memory" not in err, err


def test_compare_draws_figure5(model_dir, tmp_path):
    a = run_scores(cfg(model_dir), tmp_path / "a", progress=False)
    b = run_scores(cfg(model_dir, no_rope=True), tmp_path / "b", progress=False)
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "fig5")]) == 0
    meta = json.loads((tmp_path / "fig5" / "run.json").read_text())
    assert meta["config"]["labels"][1].endswith("(RoPE off)")
    # as every run.json: metrics (the layers drawn), timings, the inputs by absolute path, the versions
    assert meta["metrics"]["layers"] == [[0, 1, 2], [0, 1, 2]] and meta["timings"]["seconds"] > 0
    assert meta["config"]["runs"] == [str(a), str(b)] and "transformers" in meta["environment"]
    assert (tmp_path / "fig5" / "figures" / "figure5.pdf").exists()


def test_the_pattern_rms_interval_is_cut_at_0():
    """An RMS cannot be negative. Two groups of sequences (t_1 = 12.7) give raw jackknife intervals reaching below 0
    on a tiny GPT-J: run.json's interval, and so the printed line and the card's panel, is cut at 0 and records
    that support; the upper ends, and the intervals that stay above 0, are as they were."""
    import math

    from tiny_models import build, token_batch

    from poslens.analyses.scores import noise_text, pattern_rms, summarise_scores
    from poslens.engine.capture import Capture

    capture = Capture(build("gptj"), groups=2)
    for seed in range(2):
        capture.update(token_batch(2, 12, seed=seed))
    layers = summarise_scores(capture.result(), capture)["layers"]
    raw = capture.estimate(pattern_rms)
    assert any(float(e.lo) < 0 for e in raw) and any(float(e.lo) > 0 for e in raw)
    for m, e in zip(layers, raw):
        ci = m["normalised_rms_ci"]
        assert ci["support"] == [0.0, math.inf] and ci["lo"] == max(float(e.lo), 0.0) and ci["hi"] == float(e.hi)
    first = next(m for m, e in zip(layers, raw) if float(e.lo) < 0)
    assert "interval [0.000, " in noise_text(first)


@pytest.mark.parametrize("groups, lower", [(4, "groups"), (2, "seq_len")])
def test_maps_beyond_memory_name_the_size_that_can_still_be_lowered(monkeypatch, groups, lower):
    """The grouped map sums grow with groups and seq_len squared: at the least groups (2) the refusal names seq_len
    (`scores --seq-len 100000 --groups 2` said "lower --groups" where groups could not go lower)."""
    from poslens.analyses.scores import ScoresConfig
    from poslens.engine import pipeline
    from poslens.errors import UsageError

    monkeypatch.setattr(pipeline, "available_memory", lambda: 1 << 30)
    cfg = ScoresConfig(model="m", seq_len=100000, num_sequences=4, batch_size=2, groups=groups)
    parts = {"grouped sums of the maps": (groups * 2.0**40, "groups"), "one batch's forward": (2.0**33, "batch_size")}
    with pytest.raises(UsageError) as e:
        pipeline.check_memory(cfg, parts, torch.device("cpu"))
    assert str(e.value).endswith(f"lower {lower}") and e.value.param == lower
