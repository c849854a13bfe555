"""Other libraries' progress bars (transformers', huggingface_hub's) switched off for a while: `library_bars`.

transformers 5.x draws "Loading weights" and "Writing model shards" bars with no argument of its own to stop them;
the switches are global (`transformers.utils.logging.disable_progress_bar`, which turns huggingface_hub's off too,
and `HF_HUB_DISABLE_PROGRESS_BARS`, which huggingface_hub reads when it is imported). `poslens --quiet` and the
trainers' checkpoint writes use this one piece; the previous state is restored on exit. transformers' GGUF
conversion draws a plain tqdm bar that neither switch reaches (tqdm reads `TQDM_DISABLE` only when it is imported):
`gguf_bar` silences that one bar while a GGUF file loads, when transformers' bars are off.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator

ENV = "HF_HUB_DISABLE_PROGRESS_BARS"


@contextlib.contextmanager
def library_bars(enabled: bool) -> Iterator[None]:
    """transformers' and huggingface_hub's progress bars off for the duration unless `enabled`: switched off where
    the library is imported, and by the environment for one imported later; restored on exit."""
    if enabled:
        yield
        return
    env = os.environ.get(ENV)
    os.environ[ENV] = "1"
    tf = sys.modules.get("transformers.utils.logging")
    hub = sys.modules.get("huggingface_hub.utils")
    tf_on = tf is not None and tf.is_progress_bar_enabled()
    hub_off = hub is not None and hub.are_progress_bars_disabled()
    if tf is not None:
        tf.disable_progress_bar()  # huggingface_hub's too
    elif hub is not None:
        hub.disable_progress_bars()
    try:
        yield
    finally:
        if env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = env
        if tf_on:
            tf.enable_progress_bar()  # turns huggingface_hub's back on too
        if hub is not None:
            (hub.disable_progress_bars if hub_off else hub.enable_progress_bars)()


@contextlib.contextmanager
def gguf_bar() -> Iterator[None]:
    """transformers' "Converting and de-quantizing GGUF tensors" bar off for the duration when transformers' bars
    are off (`library_bars(False)`, `poslens --quiet`); on otherwise. Restored on exit."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as tf_logging

    if tf_logging.is_progress_bar_enabled():
        yield
        return
    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar
