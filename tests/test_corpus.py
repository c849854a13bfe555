"""The embedded corpus: size in SmolLM2 tokens, deduplication, licences, fixed order, and its cache."""

import importlib.metadata as metadata
import re
from pathlib import Path

import pytest

from poslens.engine import corpus
from poslens.engine.data import default_documents, default_label


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's tokenizer from the converted copy in the run's cache (tests/test_data.py reads it from the GGUF)."""
    from poslens.engine.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


def test_sources_are_exactly_the_declared_dependencies():
    """The text cannot depend on optional packages: every source is a package poslens requires (all of them but
    pyarrow, declared later for Parquet input and left out so that the corpus stays as documented)."""
    declared = {re.split(r"[<>=!~; \[]", r, maxsplit=1)[0].lower() for r in metadata.requires("poslens")
                if "extra ==" not in r}
    assert set(corpus.SOURCES) == declared - {"pyarrow"}
    assert list(corpus.SOURCES) == sorted(corpus.SOURCES)


@pytest.mark.parametrize("expression, permissive", [
    ("BSD-3-Clause AND 0BSD AND MIT AND Zlib AND CC0-1.0", True),
    ("Apache Software License", True),
    ("Python Software Foundation License", True),
    ("MPL-2.0 AND MIT", False),  # part of the code is under a weak copyleft licence
    ("GPL-3.0-or-later", False),
    ("LGPL-2.1", False),
    ("unknown", False),
])
def test_licence_rule(expression, permissive):
    assert corpus.is_permissive(expression) is permissive


def test_tqdm_is_left_out_for_its_mpl_licence():
    assert "MPL" in corpus.licence("tqdm")
    assert not corpus.is_permissive(corpus.licence("tqdm"))
    assert "tqdm" not in corpus.label()


@pytest.mark.slow
def test_a_million_smollm2_tokens_without_duplicate_paragraphs(smollm2_tokenizer):
    """Read lazily until 1,000,000 SmolLM2 tokens: the corpus must get there, in a fixed order, and no paragraph
    of at least MIN_PARAGRAPH_CHARS characters (whitespace collapsed) may occur twice."""
    tokens, docs, seen = 0, [], set()
    for doc in corpus.documents():
        docs.append(doc)
        tokens += len(smollm2_tokenizer(doc, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        for para in doc.split("\n\n"):
            key = " ".join(para.split())
            if len(key) >= corpus.MIN_PARAGRAPH_CHARS:
                assert key not in seen, key[:80]
                seen.add(key)
        if tokens >= 1_000_000:
            break
    assert tokens >= 1_000_000
    assert all(len(d) >= corpus.MIN_DOCUMENT_CHARS for d in docs)
    again = []
    for doc in default_documents():  # the data module's embedded default is this corpus, in the same order
        again.append(doc)
        if len(again) == len(docs):
            break
    assert again == docs
    assert docs[0].startswith('The "assert" statement')  # CPython docs first, topics sorted by name


def test_cache_is_written_once_complete_and_read_back(tmp_path, monkeypatch):
    """A small corpus (CPython docs + two packages) built lazily, cached when read to the end, then served from
    the cache with identical documents; the cache key follows the package versions."""
    monkeypatch.setenv("POSLENS_CACHE", str(tmp_path))
    monkeypatch.setattr(corpus, "SOURCES", ("gguf", "safetensors"))
    path = corpus.cache_path()
    assert not path.exists()
    first = list(corpus.documents())
    assert path.is_file()
    docs, manifest = corpus._read_cache(path)
    assert list(docs) == first == list(corpus.documents())
    names = [s["name"] for s in manifest["sources"]]
    assert names == ["cpython-docs", "gguf", "safetensors"]
    assert manifest["documents"] == len(first) == sum(s["documents"] for s in manifest["sources"])
    assert all(s["used"] == corpus.is_permissive(s["licence"]) for s in manifest["sources"])
    monkeypatch.setattr(corpus, "versions", lambda: {"python": "0", "format": "1", "gguf": "other"})
    assert corpus.cache_path() != path


def test_default_label_names_the_versions():
    label = default_label()
    assert "numpy " + metadata.version("numpy") in label and "transformers" in label


def test_a_full_disk_while_caching_the_corpus_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    from poslens.errors import UsageError

    monkeypatch.setenv("POSLENS_CACHE", str(tmp_path))
    path = corpus.cache_path()
    path.parent.mkdir(parents=True)
    write_bytes = Path.write_bytes

    def full(self, data):
        write_bytes(self, data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(UsageError, match=rf"^no space left on the device to write {path} \(it needs [\d,]+ bytes"):
        corpus._write_cache(path, ["a document " * 100], {"documents": 1})
    assert list(path.parent.iterdir()) == []



def test_parsing_in_worker_processes_gives_the_same_documents_in_the_same_order(monkeypatch):
    """A package's files are parsed by fresh Python processes, each every k-th file; read back in order and
    deduplicated here, the documents equal those of parsing one file after another. A worker that fails (here: one
    that cannot import poslens) falls back to parsing here, with the same documents."""
    serial = list(corpus._package("accelerate", corpus._Dedup(), 1))
    assert len(serial) > 20
    assert list(corpus._package("accelerate", corpus._Dedup(), 3)) == serial
    monkeypatch.setattr(corpus, "_WORKER", "import poslens_missing")
    assert list(corpus._package("accelerate", corpus._Dedup(), 2)) == serial
