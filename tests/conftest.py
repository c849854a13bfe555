"""Shared test set-up: offline Hugging Face, a non-interactive plotting backend, no downloads.

Converted models (the embedded SmolLM2 GGUF) go to one temporary cache per test session, so the
conversion runs at most once per session and never touches the user's ~/.cache/poslens.
"""

import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["POSLENS_CACHE"] = tempfile.mkdtemp(prefix="poslens-test-cache-")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M (the embedded GGUF), converted once per session into the session cache."""
    from poslens.engine.models import load_model

    model, tok = load_model("smollm2-135m")
    return model, tok, os.environ["POSLENS_CACHE"]
