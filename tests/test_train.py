"""`poslens train`: NoPE/RoPE decoders as stock SmolLM3, presets, schedule, resume, DDP, bad input."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import free_port

from poslens.engine.pe import parse_rope_flags
from poslens.errors import UsageError
from poslens.train.config import PRESETS, TrainConfig, load_preset, resolve_config
from poslens.train.data import num_blocks, step_samples
from poslens.train.loop import check_batch, lr_at, train
from poslens.train.model import build_model, count_parameters, parameter_count
from poslens.train.tokens import open_tokens

pytest_plugins = ("train_fixtures",)  # the session's token directory (fixture `tokens`)
MICRO = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, seq_len=32, steps=6, batch_size=8,
             micro_batch=4, lr=3e-3, warmup=2, eval_every=3, eval_batches=2, save_every=0, device="cpu")


def micro(tokens: Path, **kw) -> TrainConfig:
    return resolve_config("tiny", **{**MICRO, "tokens": str(tokens), **kw})


def rows(run: Path, key: str) -> list[float]:
    return [r[key] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r]


# ---------------------------------------------------------------- the model


def _logits_with_and_without_rotary(model_dir: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a plain transformers reload, and of the same reload with the rotary function made the identity."""
    import transformers.models.smollm3.modeling_smollm3 as smollm3
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        plain = model(ids).logits
        original = smollm3.apply_rotary_pos_emb
        smollm3.apply_rotary_pos_emb = lambda q, k, cos, sin, unsqueeze_dim=1: (q, k)
        try:
            identity = model(ids).logits
        finally:
            smollm3.apply_rotary_pos_emb = original
    return plain, identity


@pytest.mark.parametrize("pe", ["none", "rope"])
def test_reload_keeps_positional_encoding(pe, tmp_path):
    """A saved NoPE model reloaded by plain from_pretrained never calls RoPE: the logits are identical
    (bit for bit) whether or not the rotary function is applied; a RoPE model's logits change."""
    cfg = resolve_config("tiny", pe=pe, layers=2)
    model = build_model(cfg, 300)
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    plain, identity = _logits_with_and_without_rotary(tmp_path, ids)
    with torch.no_grad():
        assert torch.equal(plain, model(ids).logits)  # the reload is the trained model
    if pe == "none":
        assert torch.equal(plain, identity)
    else:
        assert (plain - identity).abs().max() > 1e-3


def test_per_layer_pattern(tmp_path):
    """0/1 patterns: comma or compact, tiled when a unit divides the depth; reloaded layers follow them."""
    assert parse_rope_flags("000", 3) == [0, 0, 0] and parse_rope_flags([1, 1], 2) == [1, 1]
    assert parse_rope_flags("0,1,1,1", 4) == [0, 1, 1, 1]
    assert parse_rope_flags("10", 6) == [1, 0, 1, 0, 1, 0]
    for bad in ("0,2", "011", "abc"):
        with pytest.raises(UsageError, match="pe_layers"):
            parse_rope_flags(bad, 4)
    from transformers import AutoModelForCausalLM

    build_model(resolve_config("tiny", pe_layers="0110"), 300).save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert [layer.self_attn.use_rope for layer in reloaded.model.layers] == [0, 1, 1, 0]


def test_every_preset_parses_and_builds():
    """Each shipped preset resolves; its model builds (small and paper-1.5b on the meta device only) with the
    paper's shape."""
    for name in PRESETS:
        cfg = resolve_config(name)
        vocab = 49_152 if cfg.tokenizer == "smollm2" else int(cfg.tokenizer.split(":")[1])
        model = build_model(cfg, vocab, device="cpu" if name in ("tiny", "cpu") else "meta")  # 123M, 1.44B: meta
        assert model.config.num_hidden_layers == cfg.layers and model.config.no_rope_layers == [0] * cfg.layers
        assert parameter_count(cfg, vocab) == count_parameters(model)["total"]  # the memory estimate's count
    paper = resolve_config("paper-1.5b")
    assert (paper.layers, paper.hidden, paper.heads, paper.kv_heads, paper.seq_len) == (22, 2048, 32, 8, 1024)
    assert paper.hidden // paper.heads == 64 and paper.lr == 3e-4
    assert paper.batch_size * paper.seq_len == 2**20  # the paper's ~1M-token global batch
    assert abs(paper.steps * 2**20 - 20e9) < 2**20  # 20B tokens
    n = count_parameters(build_model(paper, 49_152, device="meta"))["total"]
    assert 1.4e9 < n < 1.6e9  # "1.5B parameters"


def test_overrides_and_unknown_fields(tmp_path):
    from poslens.train.command import add_command, train_config

    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers(dest="command"))
    cfg = train_config(parser.parse_args(["train", "--preset", "cpu", "--steps", "70", "--pe", "rope"]))
    cpu = load_preset("cpu")
    assert cfg.steps == 70 and cfg.pe == "rope" and cfg.layers == cpu["layers"] and cfg.lr == cpu["lr"]
    with pytest.raises(UsageError, match="unknown preset 'huge'"):
        resolve_config("huge")
    with pytest.raises(UsageError, match="unknown field.*depth"):
        resolve_config("tiny", depth=3)
    bad = tmp_path / "mine.json"
    bad.write_text(json.dumps({"layers": 2, "widht": 64}))
    with pytest.raises(UsageError, match="unknown field.*widht"):
        resolve_config(str(bad))
    with pytest.raises(UsageError, match="kv_heads"):
        resolve_config("tiny", heads=4, kv_heads=3)


# ---------------------------------------------------------------- schedule and data order


def test_learning_rate_schedule():
    """Linear warm-up reaching the peak at the last warm-up step, cosine to min_lr_ratio * lr at the end."""
    cfg = resolve_config("tiny", steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    assert lr_at(55, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half way down the cosine: the mid value
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 100))


def test_data_order_is_a_permutation_split_over_ranks():
    """One epoch of steps reads every block exactly once; W ranks together read what one rank reads."""
    n, batch = 48, 8
    one = torch.cat([step_samples(s, batch, 0, 1, n, 7) for s in range(n // batch)])
    assert sorted(one.tolist()) == list(range(n))
    for s in range(8):  # steps cross the epoch boundary too
        split = torch.cat([step_samples(s, batch, r, 4, n, 7) for r in range(4)])
        assert torch.equal(split, step_samples(s, batch, 0, 1, n, 7))
    with pytest.raises(UsageError, match="does not divide over 3 ranks"):
        check_batch(8, 4, 3)
    with pytest.raises(UsageError, match="multiple of micro_batch"):
        check_batch(12, 8, 1)
    assert check_batch(16, 4, 2) == 2


def test_bos_blocks_start_with_bos_and_tile_the_stream():
    """With a BOS id every block is BOS then seq_len stream tokens; consecutive blocks overlap by one token (the
    last target of block b is the first input after BOS of block b + 1), as without BOS."""
    from poslens.train.data import blocks

    stream = np.arange(100, 200)
    b = blocks(stream, 8, torch.arange(4), bos=7)
    assert b.shape == (4, 9) and (b[:, 0] == 7).all()
    assert torch.equal(b[:, 1:].flatten().unique(), torch.arange(100, 129))
    assert all(b[k, -1] == b[k + 1, 1] for k in range(3))
    assert num_blocks(stream, 8, bos=7) == 99 // 7 and num_blocks(stream, 8) == 99 // 8


def test_doc_start_blocks_begin_with_the_bos_at_a_document_start():
    """--blocks doc-start: block b is document b's start, BOS first (or, without BOS, the document's first token),
    its separator the last counted target of a document shorter than the block and PAD after it; a document longer
    than the block gives its first seq_len tokens; empty documents (two separators in a row) are not blocks."""
    from poslens.train.data import PAD, blocks, counted_rows

    sep, bos = 0, 1
    docs = [[10, 11, 12], list(range(100, 120)), [30]]
    stream = np.array([t for d in docs for t in [*d, sep]][:-1] + [sep, sep], dtype=np.int64)  # an empty one too
    assert num_blocks(stream, 8, bos, separator=sep) == 3
    b = blocks(stream, 8, torch.arange(3), bos=bos, separator=sep)
    assert b.shape == (3, 9) and (b[:, 0] == bos).all()
    assert b[0].tolist() == [bos, 10, 11, 12, sep] + [PAD] * 4
    assert b[1].tolist() == [bos, *range(100, 108)]
    assert b[2].tolist() == [bos, 30, sep] + [PAD] * 6
    assert counted_rows(b) == (4 + 8 + 2) / 8  # padded targets are not counted
    nobos = blocks(stream, 8, torch.arange(3), separator=sep)
    assert nobos[0].tolist() == [10, 11, 12, sep] + [PAD] * 5 and nobos[1].tolist() == list(range(100, 109))


def test_doc_start_loss_counts_no_padding(tokens):
    """On real documents (the session's token directory): every block starts with the BOS followed by a document's
    first token (the stream's first token or one right after a separator); the loss of a padded block is the mean
    cross-entropy over its counted targets (recomputed per token, independently, to 1e-6) and does not change when
    the padded inputs are other tokens (they come after every counted target); a step's micro-batches are weighed
    by their counted targets (`loss_shares`), so the step's loss is the mean over every counted target."""
    import torch.nn.functional as F

    from poslens.train.data import PAD, loss_shares, train_batches
    from poslens.train.loop import next_token_loss

    tf = open_tokens(tokens)
    sep, bos = tf.separator_id, tf.header["bos_token_id"]
    micro = train_batches(tf.train, 64, 0, 16, 8, 0, 1, 0, bos, separator=sep)
    every = torch.cat(micro)
    assert (every[:, 0] == bos).all()
    train = torch.from_numpy(np.asarray(tf.train, dtype=np.int64))
    for row in every:
        first = int(row[1])
        matches = [i for i in (train == first).nonzero().flatten().tolist() if i == 0 or int(train[i - 1]) == sep]
        assert any(torch.equal(train[i:i + 63][row[1:64] != PAD], row[1:64][row[1:64] != PAD]) for i in matches)
    # a block made short by hand: a short document padded
    block = every[:2].clone()
    block[0, 20:] = PAD
    block[0, 19] = sep
    model = build_model(resolve_config("tiny", **{**MICRO, "pe": "rope", "seq_len": 64}), tf.vocab_size,
                        bos_token_id=bos, eos_token_id=sep).eval()
    with torch.no_grad():
        got = next_token_loss(model, block)
        logits = model(input_ids=block[:, :-1].clamp(min=0)).logits
        per_token = F.cross_entropy(logits.flatten(0, 1), block[:, 1:].clamp(min=0).flatten(), reduction="none")
        want = per_token[(block[:, 1:] != PAD).flatten()].mean()
        assert float(got) == pytest.approx(float(want), rel=1e-6)
        other = block.clone()
        other[0, 20:] = 5  # other padded inputs; the targets stay padding
        logits2 = model(input_ids=other[:, :-1]).logits
        again = F.cross_entropy(logits2.flatten(0, 1), block[:, 1:].flatten(), ignore_index=PAD)
        assert float(again) == pytest.approx(float(got), rel=1e-6)
        shares = loss_shares([block[:1], block[1:]])
        assert shares == pytest.approx([19 / (19 + 64), 64 / (19 + 64)])
        step = sum(share * next_token_loss(model, b) for share, b in zip(shares, (block[:1], block[1:])))
        assert float(step) == pytest.approx(float(want), rel=1e-6)
    assert loss_shares([block[1:], block[1:]]) is None  # nothing padded: the mean of means, as before


# ---------------------------------------------------------------- training runs


def test_run_writes_a_loadable_model_and_results(tokens, tmp_path, monkeypatch):
    """The output directory reloads with plain transformers and with poslens.io.results.load; the token directory,
    given relative to the working directory, is recorded by its absolute path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from poslens.io.results import load

    out = tmp_path / "run"
    monkeypatch.chdir(Path(tokens).parent)
    metrics = train(micro(Path(Path(tokens).name)), out, progress=False)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.no_rope_layers == [0, 0]
    assert len(AutoTokenizer.from_pretrained(out)) == open_tokens(tokens).vocab_size
    run = load(out)
    assert run["train_loss"].shape == (MICRO["steps"],) and run.metrics["tokens_seen"] == 6 * 8 * 32
    assert run["eval_step"].tolist() == [0, 3, 6]
    assert metrics["final_eval_loss"] == pytest.approx(run["eval_loss"][-1].item())
    # the run's throughput is every step's tokens over the steps' summed time (it was the last step's alone)
    steps = [r["step_s"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step_s" in r]
    assert len(steps) == MICRO["steps"]
    assert run.metrics["tokens_per_s"] == pytest.approx(6 * 8 * 32 / sum(steps), rel=1e-9)
    # the token directory is recorded, so its held-out text can be found again (intermediates --data)
    assert run.meta["tokens"]["path"] == metrics["tokens_path"] == str(Path(tokens).resolve())
    assert not (tmp_path / ".run.partial").exists()  # the work directory is gone once the model is in place
    with pytest.raises(UsageError, match="already exists"):
        train(micro(tokens), out, progress=False)


def test_bos_run_scores_and_saves_with_bos(tokens, tmp_path):
    """A --bos model: its held-out loss is the loss of the reloaded model on held-out blocks that start with BOS;
    its tokenizer prepends BOS by itself (so `make_sequences(bos="auto")` and every analysis follow the training
    convention); run.json and the model record say bos."""
    import torch.nn.functional as F

    from poslens.engine.data import make_sequences, tokenizer_adds_bos
    from poslens.engine.models import load_model, model_record
    from poslens.io.results import load
    from poslens.train.data import eval_batches

    out = tmp_path / "bos"
    cfg = micro(tokens, bos=True, pe="rope", sliding_window=8)
    train(cfg, out, progress=False)
    model, tok = load_model(str(out), dtype="float32")
    tf = open_tokens(tokens)
    blocks = torch.cat(eval_batches(tf.val, cfg.seq_len, cfg.eval_batches * cfg.micro_batch, 64, 0, 1,
                                    bos=tf.header["bos_token_id"]))
    with torch.no_grad():
        logits = model(blocks[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten()).item()
    assert loss == pytest.approx(load(out).metrics["final_eval_loss"], rel=1e-5)  # float32 sums in another order
    assert tokenizer_adds_bos(tok) and make_sequences(tok, ["some text here"] * 2, 4, 1, mode="pack")[0][0, 0] == \
        tf.header["bos_token_id"]
    record = model_record(model)["variant"]
    assert record["bos"] is True and record["label"] == "RoPE, window 8 in all layers"
    assert load(out).meta["variant"] == record


def test_doc_start_training_end_to_end(tokens, tmp_path):
    """`--blocks doc-start --bos` on a tiny RoPE config trains, saves and reloads; its held-out loss is the
    reloaded model's mean cross-entropy over the counted targets of the first held-out documents' starts (BOS
    first), recomputed independently (float32 sums in another order: 1e-5); the configuration and the cache name
    record the blocks, and a packed configuration keeps the cache key it had before the field existed."""
    import dataclasses

    import torch.nn.functional as F

    from poslens.engine.models import load_model
    from poslens.io.checkpoint import fingerprint
    from poslens.io.results import load
    from poslens.train.cache import CACHE_VERSION, slug, trained_model_dir
    from poslens.train.data import PAD, eval_batches

    out = tmp_path / "doc"
    cfg = micro(tokens, bos=True, pe="rope", blocks="doc-start")
    metrics = train(cfg, out, progress=False)
    assert math.isfinite(metrics["final_eval_loss"]) and load(out).meta["config"]["blocks"] == "doc-start"
    model, _ = load_model(str(out), dtype="float32")
    tf = open_tokens(tokens)
    held = torch.cat(eval_batches(tf.val, cfg.seq_len, cfg.eval_batches * cfg.micro_batch, 64, 0, 1,
                                  bos=tf.header["bos_token_id"], separator=tf.separator_id))
    assert (held[:, 0] == tf.header["bos_token_id"]).all()
    with torch.no_grad():
        logits = model(held[:, :-1].clamp(min=0)).logits
    loss = F.cross_entropy(logits.flatten(0, 1), held[:, 1:].flatten(), ignore_index=PAD).item()
    assert loss == pytest.approx(metrics["final_eval_loss"], rel=1e-5)
    assert slug(cfg).endswith("-bos-doc-start")
    packed = dataclasses.replace(cfg, blocks="packed")
    # the key of a release without the fields blocks and attention (pinned: a change orphans every cached model)
    before = {k: v for k, v in dataclasses.asdict(packed).items()
              if k not in ("device", "tensorboard", "tokens", "blocks", "attention")}
    header = json.loads((Path(tokens) / "header.json").read_text())
    key = fingerprint({**before, "tokens": str(tokens), "tokens_header": header, "cache_version": CACHE_VERSION})
    assert trained_model_dir(packed, Path(tokens)).name.endswith(key[:10])
    assert trained_model_dir(cfg, Path(tokens)) != trained_model_dir(packed, Path(tokens))


def test_quiet_run_draws_no_progress_bars(tokens, tmp_path, capfd):
    """progress=False (`poslens train --quiet`): neither the checkpoints nor the final save_pretrained draw
    transformers' "Writing model shards" bar, and transformers' progress-bar switch is restored afterwards."""
    from transformers.utils import logging

    before = logging.is_progress_bar_enabled()
    train(micro(tokens, save_every=3), tmp_path / "run", progress=False)  # a checkpoint at step 3, then the model
    assert "Writing model shards" not in capfd.readouterr().err
    assert logging.is_progress_bar_enabled() == before


def test_resume_equals_uninterrupted(tokens, tmp_path):
    """Stopped after 2 steps (checkpoint at step 2) and restarted, a run follows the uninterrupted loss curve
    and ends with the same weights, bit for bit: same data (the step fixes it), same optimizer state, same
    float32 kernels on the same CPU threads."""
    from safetensors.torch import load_file

    full, part = tmp_path / "full", tmp_path / "part"
    train(micro(tokens), full, progress=False)
    stopped = train(micro(tokens), part, progress=False, stop_after=2)
    assert stopped["stopped"] and (tmp_path / ".part.partial" / "checkpoint" / "trainer.pt").is_file()
    train(micro(tokens), part, progress=False)
    assert rows(part, "loss") == rows(full, "loss") and rows(part, "eval_loss") == rows(full, "eval_loss")
    a, b = load_file(str(full / "model.safetensors")), load_file(str(part / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_from_another_configuration(tokens, tmp_path):
    """A checkpoint of another architecture or preset is refused in one line and left untouched."""
    out = tmp_path / "run"
    train(micro(tokens), out, progress=False, stop_after=1)
    state = tmp_path / ".run.partial" / "checkpoint" / "trainer.pt"
    before = state.read_bytes()
    with pytest.raises(UsageError, match="another configuration \\(layers: 2 there, 3 now"):
        train(micro(tokens, layers=3), out, progress=False)
    with pytest.raises(UsageError, match="another configuration \\(preset"):
        train(resolve_config("cpu", **{**MICRO, "tokens": str(tokens)}), out, progress=False)
    # micro_batch sets the held-out set with eval_batches: the eval curve would switch sets mid-run
    m = MICRO["micro_batch"]
    with pytest.raises(UsageError, match=f"another configuration \\(held-out blocks \\(eval_batches x micro_batch"
                                         f"\\): {MICRO['eval_batches'] * m} there, {MICRO['eval_batches'] * m // 2}"):
        train(micro(tokens, micro_batch=m // 2), out, progress=False)
    assert state.read_bytes() == before


def test_resume_on_a_token_directory_rebuilt_in_place_is_refused(tokens, tmp_path):
    """A checkpoint records its token directory's counts, split and the SHA-256 of its .bin files: the directory
    rebuilt at the same path from other text in the same file (same tokenizer spec, same source) is refused in one
    line, the checkpoint kept; rebuilt from the same text, the resume goes on."""
    import json as _json
    import shutil

    from poslens.train.tokens import tokenize_corpus

    text = [_json.loads(line)["text"] for line in (tokens.parent / "docs.jsonl").read_text().splitlines()]
    docs, own = tmp_path / "docs.jsonl", tmp_path / "tok"

    def tokenize(documents) -> dict:
        docs.write_text("".join(_json.dumps({"text": t}) + "\n" for t in documents))
        shutil.rmtree(own, ignore_errors=True)
        return tokenize_corpus(str(docs), own, tokenizer="bpe:512", progress=False)

    assert set(tokenize(text)["sha256"]) == {"train", "val"}
    out = tmp_path / "run"
    train(micro(own), out, progress=False, stop_after=1)
    state = tmp_path / ".run.partial" / "checkpoint" / "trainer.pt"
    before = state.read_bytes()
    tokenize([" ".join(t.split()[::-1]) for t in text])  # other text: each document's words in reverse order
    with pytest.raises(UsageError, match="trained on other tokens \\(sha256, train, val differ: the token directory "
                                         "was rebuilt"):
        train(micro(own), out, progress=False)
    assert state.read_bytes() == before
    tokenize(text)  # the same ids again: resumed
    assert not train(micro(own), out, progress=False).get("stopped")


def test_corpus_smaller_than_one_batch(tokens, tmp_path):
    n = num_blocks(open_tokens(tokens).train, 32)
    with pytest.raises(UsageError, match="fewer than one batch"):
        train(micro(tokens, batch_size=4 * n, micro_batch=4 * n), tmp_path / "x", progress=False)
    assert list(tmp_path.iterdir()) == []  # no .x.partial/metrics.jsonl either


def test_out_of_memory_on_first_step(tokens, tmp_path, monkeypatch):
    """An allocation failure in the first step becomes a one-line error suggesting a smaller micro-batch."""
    import poslens.train.loop as loop

    def oom(model, block):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(loop, "next_token_loss", oom)
    with pytest.raises(UsageError, match="smaller --micro-batch \\(e.g. 2\\)"):
        train(micro(tokens, eval_every=6), tmp_path / "x", progress=False)
    assert list(tmp_path.iterdir()) == []  # a run that failed before its first checkpoint leaves nothing


# ---------------------------------------------------------------- bad input: one line, exit 2, nothing written


def _refused(argv: list[str], capfd, root: Path) -> str:
    """Run `poslens ARGV` in-process: exit status 2, one line on stderr, no traceback, nothing written under root."""
    from poslens.cli import main
    from poslens.io.rundir import remove_empty_parents

    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    remove_empty_parents()  # what the process's exit does (an atexit hook)
    err = capfd.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    return err


def test_bad_train_input_is_refused_before_any_work(tokens, tmp_path, capfd):
    """Each case is refused in one line before anything is allocated or written (the issue-15 cases of train)."""
    (tmp_path / "w").mkdir()
    base = ["train", "--tokens", str(tokens), *(f"--{k.replace('_', '-')}={v}" for k, v in MICRO.items())]
    out = ["--out", str(tmp_path / "w" / "o")]
    cases = {"--stop-after must be >= 1": ["--stop-after", "0"],
             "--stop-after must be >= 1, got -3": ["--stop-after=-3"],
             "would need about": ["--hidden", "1048576"], "--warmup (1000 steps) is longer": ["--warmup", "1000"],
             "--seed must be in [0, 4294967295], got -1": ["--seed=-1"],
             "--rope-scaling dynamic is the identity": ["--pe", "rope", "--rope-scaling", "dynamic:2"],
             "--sliding-window must be >= 0": ["--sliding-window=-4"]}
    for words, extra in cases.items():
        assert words in _refused(base + extra + out, capfd, tmp_path), words
    # an --out equal to the token directory, or containing it, would replace the training data
    for target in (tokens, tokens.parent):
        assert "input" in _refused(base + ["--out", str(target), "--force"], capfd, tokens.parent.parent)


def test_attention_kernel_the_device_lacks_is_refused(tokens, tmp_path, capfd):
    """`--attention efficient` on a CPU (torch has that kernel on GPUs only): one line naming the kernel, exit 2,
    nothing left behind."""
    (tmp_path / "w").mkdir()
    argv = ["train", "--tokens", str(tokens), *(f"--{k.replace('_', '-')}={v}" for k, v in MICRO.items()),
            "--attention", "efficient", "--out", str(tmp_path / "w" / "o")]
    assert "attention 'efficient'" in _refused(argv, capfd, tmp_path)


def test_default_out_of_a_preset_file_is_named_by_the_file(tmp_path):
    """A .json preset names the default --out by its file name (not its whole path), variants by their fields."""
    from poslens.train.command import default_out

    preset = tmp_path / "deep" / "mine.json"
    preset.parent.mkdir()
    preset.write_text(json.dumps({"layers": 2}))
    assert default_out(resolve_config(str(preset))) == "runs/train-mine-none"
    cfg = resolve_config("cpu", pe="rope", rope_scaling="ntk:8", sliding_window=32, bos=True)
    assert default_out(cfg) == "runs/train-cpu-rope-ntk-8-window-32-bos"


def test_full_disk_while_checkpointing(tokens, tmp_path, monkeypatch):
    """ENOSPC in torch.save of a checkpoint: one-line UsageError naming the file and the bytes; the previous
    checkpoint stays (the run resumes from it once there is space) and no temporary is left."""
    import errno

    import poslens.train.checkpoint as ckpt

    out = tmp_path / "run"
    train(micro(tokens, save_every=1), out, progress=False, stop_after=1)
    work = tmp_path / ".run.partial"
    before = (work / "checkpoint" / "trainer.pt").read_bytes()
    real = torch.save

    def full(obj, path, *a, **kw):
        if str(path).endswith("trainer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(obj, path, *a, **kw)

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(UsageError, match="no space left on the device to write .*trainer.pt"):
        train(micro(tokens, save_every=1), out, progress=False)
    assert (work / "checkpoint" / "trainer.pt").read_bytes() == before
    assert sorted(p.name for p in work.iterdir()) == ["checkpoint", "metrics.jsonl"] and not out.exists()


@pytest.fixture(scope="module")
def one_process(tokens, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    train(micro(tokens), out, progress=False)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp-resumed"])
def test_two_gloo_processes_equal_one(parallel, tokens, one_process, tmp_path):
    """torchrun with 2 gloo processes (DDP, or FSDP2 sharding every layer) follows the one-process trajectory
    on the same global batch, and writes the same weights. The FSDP2 run is stopped after 3 steps and resumed from
    its checkpoint (sharded optimizer state gathered, saved, and sharded again on load): its first 3 steps are an
    FSDP2 run from scratch, its last 3 a resumed one, every step compared (a separate uninterrupted FSDP2 run
    checked nothing more and cost 20 s of the suite).

    Tolerance 1e-5 relative (losses), 1e-5 absolute (weights of size ~0.02-1): the runs differ only in the
    order of float32 sums (gradient all-reduce or reduce-scatter, per-rank micro-batches instead of one
    accumulation), ~1e-7 relative per operation, over 6 steps.
    """
    from safetensors.torch import load_file

    one = one_process
    two = tmp_path / "two"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in MICRO.items()]
    resumed = parallel.endswith("-resumed")
    if resumed:
        flags = [f for f in flags if not f.startswith("--save-every")] + ["--save-every=1"]

    def launch(*extra: str) -> None:
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node=2", f"--master-port={free_port()}",
               "-m", "poslens.train", "train", "--preset", "tiny", "--tokens", str(tokens), *flags,
               "--parallel", parallel.removesuffix("-resumed"), "--out", str(two), "--quiet", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]

    if resumed:
        launch("--stop-after", "3")
        assert not two.exists() and (tmp_path / ".two.partial" / "checkpoint").is_dir()
    launch()
    a, b = rows(one, "loss"), rows(two, "loss")
    assert len(a) == len(b) == MICRO["steps"]
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a, b)), (a, b)
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(rows(one, "eval_loss"), rows(two, "eval_loss")))
    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-5) for k in a)


@pytest.mark.slow
def test_tiny_preset_learns_real_text(tmp_path):
    """The tiny preset on the embedded corpus: the held-out loss falls by more than 1.5 nats and ends below
    the held-out cross-entropy of the best context-free model (training unigram frequencies, add-one
    smoothed), so the model uses context, not just token frequencies."""
    out = tmp_path / "tiny"
    train(resolve_config("tiny"), out, progress=False)
    evals = rows(out, "eval_loss")
    from poslens.io.results import load

    tokens = load(out).meta["tokens"]
    assert tokens["tokenizer"] == "bpe:2048"
    from poslens.train.tokens import default_tokens

    tf = open_tokens(default_tokens("bpe:2048", progress=False))
    counts = torch.bincount(torch.from_numpy(tf.train.astype("int64")), minlength=tf.vocab_size).double() + 1
    val = torch.from_numpy(tf.val.astype("int64"))
    unigram = float(-(counts / counts.sum()).log()[val].mean())
    assert evals[0] - evals[-1] > 1.5, evals
    assert evals[-1] < unigram, (evals[-1], unigram)



@pytest.mark.parametrize("window", [0, 8])
def test_causal_attention_under_compile_tells_sdpa_is_causal(window):
    """Under torch.compile transformers hands a full layer the causal mask in its packed-sequence form (it cannot read
    the position ids inside a graph), so a check for the plain causal mask function left SDPA an explicit mask and
    `is_causal=False` (seen on an H200: the `small` preset's attention ran at the masked kernels' speed). The traced
    graph of a `causal_attention` model calls SDPA with no mask and `is_causal=True` in every layer without a window,
    and keeps the mask with one; the compiled logits equal the stock eager model's (1e-5: float32, other kernels)."""
    from poslens.train.model import causal_attention

    cfg = resolve_config("tiny", pe="rope", seq_len=16, sliding_window=window, kv_heads=2)
    stock, ours = build_model(cfg, 64), causal_attention(build_model(cfg, 64))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    calls: list[tuple[bool, bool]] = []

    def backend(gm, example_inputs):  # read the graph dynamo traced, run it as traced
        calls.extend((n.kwargs.get("attn_mask") is None, bool(n.kwargs.get("is_causal")))
                     for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(ours, backend=backend)(input_ids=ids).logits
        want = stock(input_ids=ids).logits
    torch._dynamo.reset()
    assert calls == ([(False, False)] if window else [(True, True)]) * cfg.layers
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_causal_attention_refuses_inputs_that_could_need_a_mask():
    """A `causal_attention` model drops the mask of its full layers, which is right only for input ids alone: an
    attention mask or position ids are refused in one line, not silently ignored."""
    from poslens.train.model import causal_attention

    model = causal_attention(build_model(resolve_config("tiny", seq_len=16), 64))
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(UsageError, match="input_ids only, not attention_mask"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    with pytest.raises(UsageError, match="position_ids"):
        model(input_ids=ids, position_ids=torch.arange(8)[None])
    assert model(input_ids=ids).logits.shape == (1, 8, 64)

def test_attention_kernel_choice_is_applied():
    """`TrainConfig.attention` picks torch's SDPA kernel for the step and the evaluation (`loop.attention_kernel`):
    under "math" the attention equals torch's default choice to float32 rounding (1e-6: the same softmax, other
    operation order), and a kernel the device lacks ("efficient" on a CPU) is refused by torch, so the choice is
    really passed on; a name that is no kernel is a one-line error."""
    from poslens.train.loop import attention_kernel

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    auto = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with attention_kernel(resolve_config("tiny", attention="math")):
        math_ = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(auto, math_, atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError), attention_kernel(resolve_config("tiny", attention="efficient")):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with pytest.raises(UsageError, match="attention"):
        resolve_config("tiny", attention="fast")


@pytest.mark.parametrize("window", [0, 8])
def test_causal_attention_drops_only_the_plain_causal_mask(monkeypatch, window):
    """`causal_attention`: SDPA gets `is_causal=True` and no mask when only causality is masked, and transformers'
    own mask when a window binds (the window cannot be said by `is_causal`); the logits equal the stock SDPA
    model's to float32 rounding (1e-6: the same softmax, other kernels). Transformers' condition under
    torch.compile before torch 2.14 (`is_torchdynamo_exporting` read as True: the stock model then builds the
    explicit [B, 1, T, T] mask) is simulated, so the stock model's calls show what `causal_attention` removes."""
    import transformers.masking_utils as mu

    from poslens.train.model import causal_attention

    cfg = resolve_config("tiny", pe="rope", seq_len=16, sliding_window=window)
    stock, ours = build_model(cfg, 64), causal_attention(build_model(cfg, 64))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    real = torch.nn.functional.scaled_dot_product_attention
    calls: list[tuple[bool, bool]] = []

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is None, bool(kwargs.get("is_causal"))))
        return real(*args, **kwargs)

    monkeypatch.setattr(mu, "is_torchdynamo_exporting", lambda: True)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        want = stock(input_ids=ids).logits
        stock_calls, calls[:] = list(calls), []
        got = ours(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert stock_calls == [(False, False)] * cfg.layers  # the explicit mask, as under compile
    assert calls == ([(False, False)] if window else [(True, True)]) * cfg.layers


def test_weights_get_the_umask_permissions(tokens, tmp_path):
    """safetensors writes the weights 0600 whatever the umask (transformers' save_pretrained through it); the
    checkpoint's and the finished run's model.safetensors get the umask's permissions like every other file."""
    out = tmp_path / "run"
    old = os.umask(0o002)
    try:
        train(micro(tokens), out, progress=False, stop_after=2)
        checkpoint = tmp_path / ".run.partial" / "checkpoint" / "model.safetensors"
        assert checkpoint.stat().st_mode & 0o777 == 0o664
        train(micro(tokens), out, progress=False)
    finally:
        os.umask(old)
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir() if f.is_file()} == {
        f.name: 0o664 for f in out.iterdir() if f.is_file()}


@pytest.mark.slow
def test_a_refused_out_under_torchrun_is_a_refusal_on_every_rank(tokens, tmp_path):
    """Only rank 0 checks --out; its refusal now reaches every rank (before: rank 1 died at the barrier with a gloo
    'Connection closed by peer' traceback through poslens's training loop)."""
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node=2", f"--master-port={free_port()}",
           "-m", "poslens", "train", "--preset", "tiny", "--tokens", str(tokens), "--steps", "2", "--warmup", "0",
           "--device", "cpu", "--out", str(out), "--quiet"]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0
    # one line per rank that got to print it (torchrun stops the other rank once one has failed; the two ranks
    # share stderr, so their lines may run together)
    assert done.stderr.count(f"poslens train: error: output directory {out} already exists") >= 1, done.stderr[-3000:]
    assert "poslens/train/loop.py" not in done.stderr and "Connection closed" not in done.stderr, done.stderr[-3000:]
    assert (out / "notes.txt").read_text() == "mine"


def test_warmup_longer_than_the_run_names_the_bound():
    """The preset's warmup (tiny: 15 steps) past a shortened run: the bound is named as a number."""
    with pytest.raises(UsageError, match="warmup \\(15 steps\\) is longer than the run \\(3 steps\\).*at most 3 steps"):
        resolve_config("tiny", steps=3)


def test_a_held_out_split_shorter_than_asked_is_said_and_recorded(tokens, tmp_path, capsys):
    """eval_batches x micro_batch blocks asked, fewer held out: the loss is over all it holds, and the command says
    how many of how many (run.json's metrics eval_blocks and eval_blocks_asked)."""
    from poslens.cli import main

    held = num_blocks(open_tokens(tokens).val, 32)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**MICRO, "steps": 2, "eval_every": 2,
                                                         "eval_batches": held}.items()]
    assert main(["train", "--preset", "tiny", "--tokens", str(tokens), *flags, "--quiet",
                 "--out", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr().out
    metrics = json.loads((tmp_path / "run" / "run.json").read_text())["metrics"]
    assert (metrics["eval_blocks"], metrics["eval_blocks_asked"]) == (held, held * MICRO["micro_batch"])
    assert f"over {held} blocks (the held-out split holds {held} of the {held * 4} blocks" in printed, printed
    # --parallel fsdp in one process: said, then the run is the plain one
    assert main(["train", "--preset", "tiny", "--tokens", str(tokens), *flags, "--parallel", "fsdp", "--quiet",
                 "--out", str(tmp_path / "fsdp")]) == 0
    assert "note: --parallel fsdp shards the model over torchrun's processes" in capsys.readouterr().err
