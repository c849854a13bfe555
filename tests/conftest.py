"""Shared test set-up: offline Hugging Face, a non-interactive plotting backend, no downloads.

Converted models (the embedded SmolLM2 GGUF) go to one temporary cache per test process, so the
conversion runs at most once per process and never touches the user's ~/.cache/poslens. Under pytest-xdist
(pyproject's addopts: `-n auto --dist loadfile`, every test file in one worker) each worker has its own cache and
an equal share of torch's threads; `-n 0` runs the suite in this one process.
"""

import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["POSLENS_CACHE"] = tempfile.mkdtemp(prefix="poslens-test-cache-")  # one per process: per xdist worker

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # pyproject's addopts: -n auto --dist loadfile
MAX_WORKERS = 4  # each worker holds torch, the session's models and its own cache (the embedded model converted once)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per CPU core, at most MAX_WORKERS (a 2-core machine runs two test files at a time)."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


# The longest test files, longest first (their share of the suite by --durations, 2 cores): under xdist a file
# runs whole on one worker, taken in collection order, so a long file started last would leave the other worker idle
# while it finishes; started first, the short files fill in beside it.
LONGEST_FIRST = ("test_reproduce.py", "test_train.py", "test_intermediates.py", "test_data.py", "test_batched.py",
                 "test_leakage_run.py", "test_corpus.py", "test_card.py", "test_scores.py", "test_length_run.py")


def pytest_collection_modifyitems(session, config, items) -> None:
    """Run the LONGEST_FIRST files first, in that order; every other file after them in its usual order (a stable
    sort: the tests within a file keep their order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))


if WORKERS > 1:  # the cores shared out among the workers, as `poslens sweep` shares torch's threads among its jobs
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads() // WORKERS))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M (the embedded GGUF), converted once per session into the session cache."""
    from poslens.engine.models import load_model

    model, tok = load_model("smollm2-135m")
    return model, tok, os.environ["POSLENS_CACHE"]
