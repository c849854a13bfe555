"""`poslens tokenize`: memory-mapped token files with a document-level train/validation split."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from poslens.engine.data import default_documents
from poslens.errors import UsageError
from poslens.io.tokenfile import dtype_for, open_tokens
from poslens.train.tokens import is_validation, tokenize_corpus

N_DOCS = 40


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 real documents (the embedded corpus's first ones) as a .jsonl file."""
    docs = [d for _, d in zip(range(N_DOCS), default_documents())]
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path, docs


@pytest.fixture(scope="module")
def written(corpus, tmp_path_factory):
    path, docs = corpus
    out = tmp_path_factory.mktemp("tok") / "tokens"
    header = tokenize_corpus(str(path), out, tokenizer="bpe:400", val_fraction=0.25, seed=3, progress=False)
    return out, header, docs


def _split_documents(ids: np.ndarray, sep: int) -> list[np.ndarray]:
    """Cut a packed stream after each separator (every document ends with one)."""
    assert len(ids) and ids[-1] == sep
    ends = np.flatnonzero(ids == sep)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [ids[s:e] for s, e in zip(starts, ends)]


def test_round_trip_and_document_split(written):
    """Decoding each packed document gives back exactly the original text, each document lies whole in
    the split its seeded hash assigns, and the header's counts match the files."""
    out, header, docs = written
    tf = open_tokens(out)
    tok = tf.tokenizer()
    sep = header["separator_token_id"]
    assert tf.train.dtype == np.uint16 and header["dtype"] == "uint16"
    got = {"train": _split_documents(np.asarray(tf.train), sep), "val": _split_documents(np.asarray(tf.val), sep)}
    expect = {"train": [d for i, d in enumerate(docs) if not is_validation(i, 0.25, 3)],
              "val": [d for i, d in enumerate(docs) if is_validation(i, 0.25, 3)]}
    for split in ("train", "val"):
        assert [tok.decode(x.tolist()) for x in got[split]] == expect[split]  # byte-level BPE is lossless
        assert header[split]["documents"] == len(expect[split])
        assert header[split]["tokens"] == len(getattr(tf, split))
    assert 0 < len(expect["val"]) < N_DOCS


def test_token_directory_as_data_reads_its_held_out_documents(written):
    """`--data TOKEN_DIR` (the data layer) yields the held-out documents as text, in order, and the model's
    tokenizer gives back their ids: `poslens intermediates` on a trained model reads text it never trained on."""
    from poslens.engine.data import iter_documents

    out, header, docs = written
    val = [d for i, d in enumerate(docs) if is_validation(i, 0.25, 3)]
    assert list(iter_documents(str(out))) == val
    tf = open_tokens(out)
    ids = tf.tokenizer()(list(iter_documents(str(out))), add_special_tokens=False)["input_ids"]
    stream = np.concatenate([np.asarray(r + [header["separator_token_id"]]) for r in ids])
    assert np.array_equal(stream, np.asarray(tf.val))


def test_split_fraction_is_binomial():
    """The held-out share over 20,000 indices is within 4 standard errors of val_fraction (binomial)."""
    n, p = 20_000, 0.1
    share = np.mean([is_validation(i, p, 0) for i in range(n)])
    assert abs(share - p) < 4 * np.sqrt(p * (1 - p) / n)
    # another seed gives another split (the overlap is p^2, not p)
    both = np.mean([is_validation(i, p, 0) and is_validation(i, p, 1) for i in range(n)])
    assert both < p / 2


def test_dtype_boundary():
    """uint16 holds ids 0..65535, so a vocabulary of 65,536 fits and 65,537 needs uint32."""
    assert dtype_for(65_536) == "uint16" and np.iinfo(np.uint16).max == 65_535
    assert dtype_for(65_537) == "uint32"


def test_corrupt_and_missing(written, tmp_path):
    out, _, _ = written
    with pytest.raises(UsageError, match="not a token directory"):
        open_tokens(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("header.json", "train.bin", "val.bin"):
        (broken / name).write_bytes((out / name).read_bytes())
    (broken / "train.bin").write_bytes((out / "train.bin").read_bytes()[:-2])  # one token short
    with pytest.raises(UsageError, match="corrupt token directory"):
        open_tokens(broken)


def test_bad_input(corpus, tmp_path):
    path, _ = corpus
    with pytest.raises(UsageError, match="tokenizer"):
        tokenize_corpus(str(path), tmp_path / "a", tokenizer="wordpiece", progress=False)
    with pytest.raises(UsageError, match="val_fraction"):
        tokenize_corpus(str(path), tmp_path / "b", tokenizer="bpe:300", val_fraction=1.0, progress=False)
    one = tmp_path / "one.txt"
    one.write_text("a single document cannot be split into training and held-out text")
    with pytest.raises(UsageError, match="too few to split"):
        tokenize_corpus(str(one), tmp_path / "c", tokenizer="bpe:300", progress=False)
    assert not (tmp_path / "c").exists()  # nothing half-written


def test_command(corpus, tmp_path, capsys):
    """`poslens tokenize` through add_command, on a parser of our own."""
    from poslens.train.command import add_command

    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers(dest="command"))
    out = tmp_path / "t"
    args = parser.parse_args(["tokenize", str(corpus[0]), "--tokenizer", "bpe:300", "--val-fraction", "0.2",
                              "--out", str(out), "--quiet"])
    args.func(args)
    assert "training tokens" in capsys.readouterr().out
    assert open_tokens(out).header["val_fraction"] == 0.2
