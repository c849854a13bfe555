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
    ids = tf.tokenizer()(list(iter_documents(str(out))), add_special_tokens=False,
                         split_special_tokens=True)["input_ids"]
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


def _copy(src, dst, header=None, skip=()):
    """A copy of token directory `src` with header fields replaced and files left out."""
    import shutil

    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n in skip])
    if header is not None:
        h = json.loads((src / "header.json").read_text())
        (dst / "header.json").write_text(json.dumps({**h, **header}))
    return dst


def test_every_broken_token_directory_is_one_line_also_as_data(written, tmp_path):
    """A header field of the wrong type, ids at or above vocab_size, no tokenizer/ folder: one line naming the
    directory and what is wrong, from open_tokens and from the data layer (`intermediates --data DIR`); a missing
    bos_token_id only where a BOS is needed."""
    from poslens.engine.data import iter_documents

    out, header, _ = written
    top = int(np.asarray(open_tokens(out).val).max())  # an id the held-out text holds: every reader meets it
    cases = {"vocab_size must be an integer": _copy(out, tmp_path / "abc", {"vocab_size": "abc"}),
             "holds id": _copy(out, tmp_path / "small", {"vocab_size": top}),
             "no tokenizer/ folder": _copy(out, tmp_path / "notok", skip=("tokenizer",)),
             "dtype must be": _copy(out, tmp_path / "dtype", {"dtype": "float32"})}
    for words, path in cases.items():
        for read in (open_tokens, iter_documents):
            with pytest.raises(UsageError, match="corrupt token directory") as e:
                read(str(path))
            assert words in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    nobos = open_tokens(_copy(out, tmp_path / "nobos", {"bos_token_id": None}))
    assert list(iter_documents(str(nobos.path)))  # reading text needs no BOS
    with pytest.raises(UsageError, match="no bos_token_id, which training with bos needs"):
        nobos.bos_id("training with bos")


def test_tokenize_force_replaces_its_own_output_and_keeps_its_input(corpus, tmp_path, capfd):
    """A token directory is a run directory: `tokenize --force` replaces it; a vocabulary smaller than asked is
    said and recorded; an --out equal to the input is refused."""
    from poslens.cli import main

    src = tmp_path / "three.jsonl"
    src.write_text("".join(json.dumps({"text": f"abc ab{i}"}) + "\n" for i in range(12)))
    out = tmp_path / "tok"
    argv = ["tokenize", str(src), "--tokenizer", "bpe:100000", "--val-fraction", "0.5", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    assert "of the 100,000 asked for" in capfd.readouterr().out
    header = open_tokens(out).header
    assert header["vocab_requested"] == 100_000 and header["vocab_size"] < 300
    assert main(argv) == 2 and "already exists" in capfd.readouterr().err
    assert main(argv + ["--force"]) == 0 and open_tokens(out).header == header
    assert main(["tokenize", str(corpus[0].parent), "--out", str(corpus[0].parent), "--force"]) == 2


def test_bad_input(corpus, tmp_path):
    path, _ = corpus
    with pytest.raises(UsageError, match="tokenizer"):
        tokenize_corpus(str(path), tmp_path / "a", tokenizer="wordpiece", progress=False)
    with pytest.raises(UsageError, match="val_fraction"):
        tokenize_corpus(str(path), tmp_path / "b", tokenizer="bpe:300", val_fraction=1.0, progress=False)
    one = tmp_path / "one.txt"
    one.write_text("a single document cannot be split into training and held-out text")
    with pytest.raises(UsageError, match="1 document, .*a .txt file is one document"):  # how to give several
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


def test_cached_tokens_are_built_once_while_a_second_process_waits_and_rebuilt_when_corrupt(tmp_path, monkeypatch,
                                                                                            capfd):
    """Two callers building the same cached token directory at once (threads here: each holds its own lock file
    descriptor, as two processes do): one builds it, the other says it waits and then uses it. A cached entry
    that no longer opens, or whose content differs from its manifest's hashes, is rebuilt, saying why, instead of
    failing on every run or being used as it is."""
    import threading

    import poslens.engine.corpus as corpus
    import poslens.train.tokens as tokens

    docs = [f"document {i}: " + "the causal mask encodes position " * (i % 5 + 1) for i in range(30)]
    monkeypatch.setattr(corpus, "documents", lambda: iter(docs))
    monkeypatch.setenv("POSLENS_CACHE", str(tmp_path / "cache"))
    built, real = [], tokens.tokenize_corpus

    def slow(*a, **kw):
        built.append(1)
        threading.Event().wait(0.3)  # long enough for the second caller to find the entry being built
        return real(*a, **kw)

    monkeypatch.setattr(tokens, "tokenize_corpus", slow)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(tokens.default_tokens("bpe:300", progress=False)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and len(paths) == 2 and paths[0] == paths[1]
    assert "waiting for another poslens process" in capfd.readouterr().err
    path = paths[0]
    (path / "val.bin").write_bytes((path / "val.bin").read_bytes()[:-2])
    assert tokens.default_tokens("bpe:300", progress=False) == path and len(built) == 2
    assert "cached token directory is corrupt (val.bin has" in capfd.readouterr().err
    open_tokens(path)
    # issue 34: an id changed at the same size (still below the vocabulary, so the entry opens) was used without a
    # word; the manifest's content hash finds it, and the entry is rebuilt
    data = bytearray((path / "train.bin").read_bytes())
    data[0] ^= 1
    (path / "train.bin").write_bytes(bytes(data))
    open_tokens(path)
    assert tokens.default_tokens("bpe:300", progress=False) == path and len(built) == 3
    assert "train.bin was changed after poslens wrote it (its content differs" in capfd.readouterr().err
    assert (path / "train.bin").read_bytes() != bytes(data)


@pytest.mark.parametrize("tokenizer", ["smollm2", "bpe:400"])
def test_a_special_tokens_spelling_inside_a_document_ends_nothing(corpus, tokenizer, tmp_path):
    """A document that writes the separator's spelling (<|endoftext|>) is still one document: only the separator
    poslens writes after each document ends one (a docstring's spelling cut the embedded corpus's training
    stream into 2,476 separator-delimited documents for 2,449 texts)."""
    _, docs = corpus
    texts = [f"{d}\nGPT-2 ends its texts with <|endoftext|> and chats with <|im_end|>, written here as text."
             for d in docs[:12]]
    path = tmp_path / "specials.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    header = tokenize_corpus(str(path), tmp_path / "tok", tokenizer=tokenizer, val_fraction=0.25, seed=3,
                             progress=False)
    tf = open_tokens(tmp_path / "tok")
    sep = header["separator_token_id"]
    got = [tf.tokenizer().decode(x.tolist()) for split in ("train", "val")
           for x in _split_documents(np.asarray(getattr(tf, split)), sep)]
    assert sorted(got) == sorted(texts)
    assert header["train"]["documents"] + header["val"]["documents"] == len(texts)
