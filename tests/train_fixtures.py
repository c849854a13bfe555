"""A real-text token directory built once per session for the training tests (their `pytest_plugins`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tokens(tmp_path_factory) -> Path:
    """The first 300 documents of the embedded corpus (real text), tokenized with a 512-entry BPE."""
    from poslens.engine.data import default_documents
    from poslens.train.tokens import tokenize_corpus

    root = tmp_path_factory.mktemp("tokens")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for _, d in zip(range(300), default_documents())))
    tokenize_corpus(str(docs), root / "bpe512", tokenizer="bpe:512", progress=False)
    return root / "bpe512"
