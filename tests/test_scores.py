"""`poslens scores` end to end on a local-directory model: exact maps, sharding, resume, bad input."""

import json
import os
import subprocess
import sys

import pytest
import torch
from tiny_models import build
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import poslens
from poslens.analyses.scores import ScoresConfig, distributed, partial_path, run_scores
from poslens.engine.capture import attention_scores
from poslens.engine.data import iter_documents, make_sequences
from poslens.engine.models import load_model
from poslens.errors import UsageError

SEQ, NUM, BATCH = 48, 8, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama saved with a byte-level tokenizer, loaded back through from_pretrained(dir)."""
    d = tmp_path_factory.mktemp("tiny-llama")
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab={**vocab, "<s>": 256, "</s>": 257}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    model = build("llama", vocab_size=258, max_position_embeddings=128)
    model.save_pretrained(d)
    fast.save_pretrained(d)
    return d


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
    from poslens.engine import capture as capture_mod

    calls = {"n": 0}
    original = capture_mod.Capture.update

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(self, *a, **k)

    monkeypatch.setattr(capture_mod.Capture, "update", flaky)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        run_scores(cfg(model_dir, checkpoint_every=1), out, progress=False)
    assert not out.exists() and partial_path(out.absolute(), 0, 1).exists()
    monkeypatch.setattr(capture_mod.Capture, "update", original)
    resumed = poslens.load(run_scores(cfg(model_dir, checkpoint_every=1), out, progress=False))
    assert resumed.meta["resumed_from_batch"] == 2
    assert not partial_path(out.absolute(), 0, 1).exists()
    for key in ("scores", "scores_se", "normalised_se"):
        torch.testing.assert_close(resumed[key], full[key], rtol=0, atol=0, equal_nan=True)


def test_corrupt_checkpoint_is_a_usage_error(model_dir, tmp_path):
    out = tmp_path / "run"
    partial_path(out.absolute(), 0, 1).write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="corrupt"):
        run_scores(cfg(model_dir), out, progress=False)
    assert not out.exists()


def test_torchrun_two_ranks_equal_single_process(model_dir, tmp_path):
    single = poslens.load(run_scores(cfg(model_dir), tmp_path / "single", progress=False))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
           "-m", "poslens", "scores", str(model_dir), "--seq-len", str(SEQ), "--num-sequences", str(NUM),
           "--batch-size", str(BATCH), "--mode", "pack", "--quiet", "--out", str(tmp_path / "sharded")]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    sharded = poslens.load(tmp_path / "sharded")
    assert sharded.meta["world_size"] == 2
    # different summation order over ranks: equal to float32 round-off
    torch.testing.assert_close(sharded["scores"], single["scores"], rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.equal(sharded["count"], single["count"])


def test_more_processes_per_node_than_gpus_is_refused(monkeypatch):
    """NCCL needs one GPU per process: 2 processes on a 1-GPU node fail with the fix, before any group forms."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UsageError, match=r"2 processes on this node .* 1 GPU\(s\); use --nproc-per-node 1$"):
        distributed("cuda")


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "poslens", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


@pytest.mark.parametrize("args, words", [
    (["scores", "/no/such/model", "--out", "{out}"], "no/such/model"),
    (["scores", "{model}", "--seq-len", "100000", "--out", "{out}"], "window"),
    (["scores", "{model}", "--num-sequences", "100000", "--seq-len", "48", "--out", "{out}"], "sequences"),
    (["scores", "{model}", "--device", "cuda", "--out", "{out}"], "cuda"),
    (["scores", "{model}", "--layers", "0,99", "--seq-len", "48", "--num-sequences", "2", "--out", "{out}"],
     "layers"),
    (["scores", "{model}", "--data", "/no/such/file.jsonl", "--seq-len", "48", "--out", "{out}"], "file.jsonl"),
])
def test_bad_input_one_line_exit_2_nothing_written(model_dir, tmp_path, args, words):
    out = tmp_path / "out"
    res = run_cli(*[a.format(model=model_dir, out=out) for a in args])
    assert res.returncode == 2, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert words in lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_compare_draws_figure5(model_dir, tmp_path):
    a = run_scores(cfg(model_dir), tmp_path / "a", progress=False)
    b = run_scores(cfg(model_dir, no_rope=True), tmp_path / "b", progress=False)
    res = run_cli("compare", str(a), str(b), "--out", str(tmp_path / "fig5"))
    assert res.returncode == 0, res.stderr
    meta = json.loads((tmp_path / "fig5" / "run.json").read_text())
    assert meta["config"]["labels"][1].endswith("(RoPE off)")
    assert (tmp_path / "fig5" / "figures" / "figure5.pdf").exists()
