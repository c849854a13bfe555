"""The idioms of TransformerLens's Main Demo and Exploratory Analysis Demo notebooks (tests/tl_demo.py) and its
per-head attention inputs run on poslens's HookedModel with only the model changed, on the embedded SmolLM2-135M,
and give TransformerLens 3.9's results on the same weights (tests/reference/tl39_demo_idioms.json, made once by
tests/reference/make_tl_demo_reference.py). What poslens cannot do fails in one line (NoEquivalent).

Tolerances: token ids, strings, labels, hook names, shapes and head rankings exactly; every number within TOLERANCE
of the largest |value| of its quantity, or of 1 where that is smaller (probabilities, and patching results normalized
so that 1 is full recovery, are on that scale). TransformerLens folds the norms' gains into the weights and poslens
keeps them, so the two float32 forwards round differently through 30 layers: largest measured 1.4e-5 (the BOS logit
differences; 7e-6 absolute on the patched patterns); a wrong meaning (a head's copy read by another head, a position
off by one, a gain applied twice) moves the numbers by percents. The hook names and shapes: TransformerLens's ln1
points fire three times per layer, poslens's once (_one_input_norm)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import tl_demo
import torch

import poslens.utils as utils
from poslens.engine.activation_cache import NoEquivalent
from poslens.errors import UsageError

# see the module docstring: about 7x the largest difference measured
TOLERANCE = 1e-4
REFERENCE = json.loads((Path(__file__).parent / "reference" / "tl39_demo_idioms.json").read_text())


def _agree(got, ref, where: str, worst: list) -> None:
    """got equals ref: exactly for everything but floats, and lists of floats within TOLERANCE of max(their largest
    |value|, 1) (a single float: of max(|itself|, 1))."""
    if isinstance(ref, float) or (isinstance(ref, list) and ref and all(isinstance(v, float) for v in ref)):
        a, b = torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
        assert a.shape == b.shape, f"{where}: shape {tuple(a.shape)} against {tuple(b.shape)}"
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a)), f"{where}: non-finite entries differ"
        scale = max(float(b[finite].abs().max()) if bool(finite.any()) else 0.0, 1.0)
        rel = (float((a - b)[finite].abs().max()) if bool(finite.any()) else 0.0) / scale
        worst.append((rel, where))
        assert rel <= TOLERANCE, f"{where}: relative difference {rel:.3g} (largest |value| {scale:.4g})"
    elif isinstance(ref, list) and isinstance(got, list) and any(isinstance(v, (list, dict, float)) for v in ref):
        assert len(got) == len(ref), f"{where}: {len(got)} entries against {len(ref)}"
        for i, (g, r) in enumerate(zip(got, ref)):
            _agree(g, r, f"{where}[{i}]", worst)
    elif isinstance(ref, dict):
        assert sorted(got) == sorted(ref), f"{where}: keys {sorted(got)} against {sorted(ref)}"
        for k in ref:
            _agree(got[k], ref[k], f"{where}.{k}", worst)
    else:
        assert got == ref, f"{where}: {got!r} against {ref!r}"


def _json(value):
    return json.loads(json.dumps(value))  # tuples as lists, as stored


@pytest.fixture(scope="module")
def hooked(smollm2):
    from poslens.engine.hooks import HookedModel

    model, tokenizer, _ = smollm2
    return HookedModel(model, tokenizer)


def _one_input_norm(ref: dict) -> dict:
    """TransformerLens's results with its ln1 points fired once per layer: it applies ln1 to its q, k and v inputs
    (three firings of the same values), poslens once (docs/hooks.md, "Where poslens differs")."""
    if "hook_names_and_shapes" not in ref:
        return ref
    seen, names = set(), []
    for name, shape in ref["hook_names_and_shapes"]:
        if name not in seen:
            seen.add(name)
            names.append([name, shape])
    return {**ref, "hook_names_and_shapes": names}


@pytest.mark.slow
@pytest.mark.parametrize("part", ["split_inputs", "main_demo", "exploratory_demo"])
def test_demo_idioms_give_transformer_lens_results(hooked, part):
    worst: list = []
    _agree(_json(getattr(tl_demo, part)(hooked, utils)), _one_input_norm(REFERENCE[part]), part, worst)
    assert worst and max(worst)[0] <= TOLERANCE and not math.isnan(max(worst)[0])


def test_split_inputs_meanings(hooked):
    """Beyond agreeing with TransformerLens: the copies equal resid_pre; a query head reading a zero input has q = 0
    and a uniform causal pattern (1/(i+1) on row i, float32 rounding), the other heads stay; each write moves the
    logit difference."""
    ref = REFERENCE["split_inputs"]
    assert all(ref["copies_of_resid_pre"]) and ref["zeroed_q_head"] == 0.0 and ref["other_q_heads"] > 1
    assert ref["uniform_pattern_error"] < 1e-6
    assert ref["shapes"] == [[1, 17, 9, 576], [1, 17, 3, 576], [1, 17, 3, 576]]  # H = 9 query, K = 3 key/value heads
    moved = [abs(v - ref["logit_diff"]) for k, v in ref.items() if k.startswith("edited_")]
    assert len(moved) == 3 and min(moved) > 1e-3


def test_attn_in_refused_on_grouped_query_attention_as_transformer_lens_does(hooked):
    assert "GroupedQueryAttention" in REFERENCE["set_use_attn_in"]
    with pytest.raises(UsageError, match="grouped-query attention"):
        hooked.set_use_attn_in(True)


@pytest.mark.parametrize("what,code", tl_demo.NO_EQUIVALENT, ids=[w for w, _ in tl_demo.NO_EQUIVALENT])
def test_demo_idioms_without_equivalent_fail_in_one_line(hooked, what, code):
    with pytest.raises(NoEquivalent) as err:
        eval(code, {"model": hooked, "utils": utils})
    message = str(err.value)
    assert "\n" not in message and "no poslens equivalent" in message, message
