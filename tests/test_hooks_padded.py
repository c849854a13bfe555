"""Reading hook points never changes a padded forward, on every family in the registry.

A left-padded batch (rows padded by 0, 3 and 7 tokens) with a reader at every hook point but the maps (scores,
pattern) and the per-head results (whose readers make W_O's output their sum), the other optional ones included
(hook_mlp_in, the per-head inputs where the family has them),
gives the plain Hugging Face forward's logits bit for bit, through `HookedModel.run` (positions as the plain forward
counts them) and through the TransformerLens surface (`run_with_cache`, calling the model), which counts each row's
positions from its first real token as TransformerLens does: that path equals the plain forward given those same
position ids. With every point read, the logits are those of the maps' and the results' readers alone, bit for bit:
the other readers add nothing.

The two are different forwards, and comparing the surface against the plain forward without its position ids is what
once looked like readers moving GPT-NeoX's and Falcon's logits by ~3e-7 on padded batches (bit-identical without
padding, where the offsets are 0): rotary scores depend on j - i only, so shifting a row's positions changes its
logits by float32 rounding alone (2e-7 to 7e-7 on these models), and a learned table (GPT-2) by a great deal.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import ALL_FAMILIES, build, config, token_batch

from poslens.engine.families import FAMILIES
from poslens.engine.hooks import HookedModel
from poslens.engine.tl_surface import offset_positions

PADS = (0, 3, 7)  # left padding of each row


def _padded_batch(seq_len: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    ids = token_batch(len(PADS), seq_len, seed=11)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(PADS):
        ids[row, :pad], mask[row, :pad] = 0, 0  # the pad id where there is no token
    return ids, mask


def test_the_padded_tests_cover_every_family_of_the_registry():
    assert {config(f).model_type for f in ALL_FAMILIES} == set(FAMILIES)


# the points whose readers change how the forward computes: the [B, H, T, T] maps (attention's output from the pattern
# read) and the per-head results (W_O's output as their sum)
MAPS = ("attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_result")


@pytest.mark.parametrize("family", ALL_FAMILIES)
@torch.no_grad()
def test_a_padded_batch_with_every_point_read_gives_the_plain_logits_bit_for_bit(family):
    """Readers on every point but the maps: the plain forward's logits bit for bit. Readers on every point: the logits
    of the maps' readers alone, bit for bit, and the plain forward's within float32 rounding at the real tokens (bit
    for bit while attention's output is the model's own kernel, as now; what a formed pattern may change is
    tests/test_hooks.py's)."""
    model = build(family)
    hm = HookedModel(model)
    ids, mask = _padded_batch()
    seen = []

    def read(x, ctx):
        seen.append(ctx.name)
        x.sum()  # reads the value (a dense scores reader: the [B, H, T, T] scores are formed)

    maps = [p for p in hm.points if p.endswith(MAPS)]
    others = [p for p in hm.points if p not in maps]
    plain = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(hm.run(ids, mask, hooks={p: read for p in others}, logits=True).logits, plain)
    with_maps = hm.run(ids, mask, hooks={p: read for p in maps}, logits=True).logits
    seen.clear()
    got = hm.run(ids, mask, hooks={p: read for p in hm.points}, logits=True).logits
    assert sorted(seen) == sorted(hm.points)  # every point fired, once
    assert torch.equal(got, with_maps)
    real = mask.bool()  # and within float32 rounding of the plain forward at the real tokens (1e-5 of the largest)
    assert (with_maps[real] - plain[real]).abs().max() <= 1e-5 * plain[real].abs().max()

    positions = offset_positions(mask)  # TransformerLens's: counted from each row's first real token
    assert bool((positions[1:] != torch.arange(ids.shape[1])).any())  # they differ from the plain forward's
    shifted = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    logits, cache = hm.run_with_cache(ids, others, attention_mask=mask)
    assert list(cache) == others
    assert torch.equal(logits, shifted)
    assert torch.equal(hm(ids, attention_mask=mask), shifted)
    logits, cache = hm.run_with_cache(ids, hm.points, attention_mask=mask)
    assert list(cache) == hm.points
    shifted_maps = hm.run(ids, mask, hooks={p: read for p in maps}, position_ids=positions, logits=True).logits
    assert torch.equal(logits, shifted_maps)
    assert torch.equal(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, plain)  # model untouched
