"""The worked example of docs/hooks.md ("Coming from TransformerLens"): its code and the output it prints there."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "hooks.md"
HEADING = "### A worked example"
LOADING_LINE = re.compile(r"^model = HookedModel\.from_pretrained\(.*$", re.M)  # the one line a port changes


def _blocks(kind: str) -> list[str]:
    text = DOC.read_text()
    after = text[text.index(HEADING):]
    return re.findall(rf"```{kind}\n(.*?)```", after, re.S)


def example_code(loading: str | None = None) -> str:
    """The example's Python code; with `loading`, its model-loading line replaced by that line."""
    code = _blocks("python")[0]
    return code if loading is None else LOADING_LINE.sub(loading, code, count=1)


def example_output() -> list[str]:
    """The lines the doc says the example prints."""
    return _blocks("text")[0].rstrip("\n").splitlines()


def run_example(loading: str | None = None, **names) -> tuple[list[str], dict]:
    """Run the example (its loading line replaced by `loading`, with `names` defined), returning what it prints and
    its namespace."""
    import contextlib
    import io

    out = io.StringIO()
    namespace = {"__name__": "__example__", **names}
    # the example turns gradients off for the session, as a notebook does: torch's grad-mode context restores the
    # caller's mode on leaving, so the rest of the test session keeps it
    with contextlib.redirect_stdout(out), torch.set_grad_enabled(torch.is_grad_enabled()):
        exec(compile(example_code(loading), "docs/hooks.md worked example", "exec"), namespace)
    return out.getvalue().splitlines(), namespace


def example_numbers(ns: dict) -> dict[str, list[float]]:
    """The example's results at full precision, from its namespace: the logit differences, the logit lens, every
    head's direct logit attribution, the ablated logit difference, the head's attention row, the patching curve at
    the last position."""
    def floats(t) -> list[float]:
        return [float(v) for v in t.double().reshape(-1)]

    return {"logit_diff": [ns["clean_diff"], ns["corrupted_diff"]], "logit_lens": floats(ns["lens"][:, 0]),
            "head_attribution": floats(ns["attribution"]), "ablated_logit_diff": [ns["logit_diff"](ns["ablated"])],
            "attention_row": floats(ns["pattern"]), "patching_last_position": [float(r) for r in ns["recovered"]]}
