"""Shared test set-up: offline Hugging Face, a non-interactive plotting backend, no downloads.

Converted models (the embedded SmolLM2 GGUF), the embedded corpus and the trained tokenizers go to one temporary
cache per test run, never the user's ~/.cache/poslens (the converted model and the corpus that setup.sh put there
are copied in at the start, `seed_cache`): the process that runs pytest makes it and removes it at the
end, and its pytest-xdist workers (pyproject's addopts: `-n auto --dist loadfile`, every test file in one worker)
inherit it, so each entry is built once per run (the cache's entry locks make a second worker wait for the first
builder, `poslens.io.lock.cache_lock`). Each worker gets an equal share of torch's threads; `-n 0` runs the suite
in this one process.
"""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from poslens.io.protect import cache_root

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
SHARED_CACHE = "POSLENS_TEST_RUN_CACHE"  # the run's cache, made by the process that runs pytest
SEEDS = ("models/smollm2-135m", "corpus")  # what setup.sh prepares in the user's cache (about 80 CPU-s to build)


def seed_cache(user: Path, run: Path) -> None:
    """Copy (never link: tests corrupt cache entries on purpose) the entries setup.sh prepared in the user's cache
    into the run's; the code under test checks each as it checks any cache entry (a converted model's source stamp,
    the corpus's name by content), and builds again what is not current. Nothing is written to the user's cache."""
    for entry in SEEDS:
        if (user / entry).is_dir() and not (run / entry).exists():
            try:
                shutil.copytree(user / entry, run / entry, ignore=shutil.ignore_patterns(".*"))  # no temp or lock
            except OSError:  # unreadable or changing: the tests build it
                shutil.rmtree(run / entry, ignore_errors=True)


if os.environ.get("PYTEST_XDIST_WORKER") and os.path.isdir(os.environ.get(SHARED_CACHE, "")):
    OWN_CACHE = None  # a worker: the run's cache, inherited from the process that started it
else:
    OWN_CACHE = os.environ[SHARED_CACHE] = tempfile.mkdtemp(prefix="poslens-test-cache-")
    seed_cache(cache_root(), Path(OWN_CACHE))  # the user's cache: $POSLENS_CACHE as given, else ~/.cache/poslens
os.environ["POSLENS_CACHE"] = os.environ[SHARED_CACHE]


def pytest_unconfigure(config) -> None:
    """The process that made the run's cache removes it when the run ends."""
    if OWN_CACHE is not None:
        shutil.rmtree(OWN_CACHE, ignore_errors=True)

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # pyproject's addopts: -n auto --dist loadfile
MAX_WORKERS = 4  # each worker holds torch and the session's models (the embedded model loaded once per worker)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per CPU core, at most MAX_WORKERS (a 2-core machine runs two test files at a time)."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


# The longest test files, longest first (their share of the suite by --durations=0, 2 cores, 2026-11-29): under xdist a
# file runs whole on one worker, the files handed out in collection order (pyproject's --no-loadscope-reorder: xdist
# would otherwise put the files with the most tests first, which ran the longest file, test_reproduce.py, last while
# the other worker sat idle for 150 s), so a long file started last would leave the other worker idle while it
# finishes; started first, the short files fill in beside it.
LONGEST_FIRST = ("test_reproduce.py", "test_train.py", "test_intermediates.py", "test_tl_demo.py", "test_sweep.py",
                 "test_leakage_run.py", "test_data.py", "test_batched.py", "test_family_runs.py", "test_scores.py")


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
