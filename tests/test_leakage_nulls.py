"""Nulls and their power: the predecessor's sign-flip test at the permutation count BH needs, the paired contrast's
size on passes without an effect, and the windows inside documents that the offset null runs on.

Sizes are checked over repetitions against their nominal level with binomial tolerances (stated per test).
"""

import math
from types import SimpleNamespace

import pytest
import torch
from test_leakage_causal import one_thread  # noqa: F401 (autouse: one intra-op thread for small tensors)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from poslens.analyses.leakage import nulls
from poslens.analyses.leakage import predecessor as pr
from poslens.analyses.leakage.causal import METRICS, VARIANTS, Domains, LeakageMaps
from poslens.analyses.leakage.contrast import contrast, excludes_zero
from poslens.engine.data import document_windows
from poslens.errors import UsageError

HEADS = 270  # SmolLM2-135M: 30 layers x 9 heads


def gaps(sequences: int, planted: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence Delta R^2 of real and null inputs [N, 270] from one law; head 0 gets `planted` added."""
    g = torch.Generator().manual_seed(seed)
    real = torch.randn(sequences, HEADS, generator=g, dtype=torch.float64)
    null = torch.randn(sequences, HEADS, generator=g, dtype=torch.float64)
    real[:, 0] += planted
    return real, null


def test_permutation_count_makes_one_head_among_270_detectable():
    """R = ceil(2 m / q) - 1 = 10,799 sign flips: smallest p 1/10,800 = 9.3e-5, under BH's first threshold
    0.05 / 270 = 1.85e-4. A head whose per-sequence gap is 2 sd is found over 32 sequences (the sign-flip
    statistic's z is about 0.82 sqrt(32) = 4.6: no flip of 10,799 reaches it), with at most one false discovery
    among the 269 others; the predecessor's 5,000 flips cannot find it (1/5,001 > 1.85e-4: nothing is
    significant, whatever the data), nor can 8 sequences (2^-8 = 1/256, the 256 sign vectors enumerated)."""
    assert pr.permutations_for(HEADS) == 10799 > 20 * HEADS
    res = pr.paired_test(*gaps(32, 2.0, seed=0), bootstrap=200, seed=0)
    assert res.power["detectable"] and res.power["smallest_p"] == pytest.approx(1 / 10800)
    assert res.power["bh_first_threshold"] == pytest.approx(0.05 / 270)
    assert bool(res.significant[0]) and float(res.lo[0]) > 0
    assert int(res.significant[1:].sum()) <= 1
    old = pr.paired_test(*gaps(32, 2.0, seed=0), bootstrap=10, permutations=5000, seed=0)
    assert not old.power["detectable"] and not bool(old.significant.any())
    few = pr.paired_test(*gaps(8, 2.0, seed=0), bootstrap=10, seed=0)
    assert few.power["exact"] and few.power["smallest_p"] == 1 / 256 and not bool(few.significant.any())


def test_sign_flip_test_has_its_nominal_size():
    """No effect (real and null from one law): the share of raw p <= 0.05 over 270 heads is 0.05 within 3 binomial
    sd (0.013), Monte Carlo (16 sequences, 10,799 flips) and exact (10 sequences, all 1,024 sign vectors); and over
    20 repetitions of 270 heads, BH at 0.05 rejects anything in at most 3 (its familywise rate under the complete
    null is at most q = 0.05; P(Binomial(20, 0.05) >= 4) = 0.016)."""
    g = torch.Generator().manual_seed(1)
    for n in (16, 10):
        real, null = gaps(n, 0.0, seed=n)
        p = pr.sign_flip_p(real - null, pr.permutations_for(HEADS), g)
        assert abs(float((p <= 0.05).double().mean()) - 0.05) <= 3 * math.sqrt(0.05 * 0.95 / HEADS)
    diff = torch.randn(16, 20, HEADS, generator=g, dtype=torch.float64)  # 20 repetitions side by side
    p = pr.sign_flip_p(diff, pr.permutations_for(HEADS), g)
    assert sum(bool(pr.benjamini_hochberg(row).any()) for row in p) <= 3


def synthetic_pass(seed: int, reps: int, groups: int = 8, per_group: int = 4, n: int = 16) -> LeakageMaps:
    """A pass of `groups` x `per_group` sequences whose maps are phi(i - j) + 0.5 (-1)^j + N(0, 1) noise, fed to
    LeakageMaps through its hook as one layer with `reps` heads: each head is an independent repetition."""
    stat = LeakageMaps(groups=groups, domains=Domains(early_queries=6))
    stat._layers = 1
    g = torch.Generator().manual_seed(seed)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    base = -0.2 * (i - j) + 0.5 * (1 - 2 * (j % 2))
    for group in range(groups):
        s = base + torch.randn(per_group, reps, n, n, generator=g)
        stat.group = group
        stat._read(s.masked_fill(j > i, -math.inf), SimpleNamespace(layer=0, attention_mask=None, window=0))
    return stat


def test_paired_contrast_has_its_nominal_size_on_passes_without_an_effect():
    """Two passes from one law (what the offset and circular nulls compare when token position carries no content):
    over 200 repetitions the 95% paired jackknife interval of the difference (8 groups) excludes 0 at a rate within
    0.05 +- 0.046 (3 binomial sd) for every energy and fraction on every domain."""
    reps = 200
    diff = contrast(synthetic_pass(0, reps), synthetic_pass(1, reps), heads=True)["difference"]
    rate = excludes_zero(diff).double().mean(-1)[..., 0]  # [V, M], over the repetitions
    tol = 3 * math.sqrt(0.05 * 0.95 / reps)
    for v, (variant, _, _) in enumerate(VARIANTS):
        for metric in ("scores/trf", "scores/energy", "attn/e_total", "attn/mask_only", "attn/residual",
                       "log_probs/trf"):
            got = float(rate[v, METRICS.index(metric)])
            assert abs(got - 0.05) <= tol, (variant, metric, got)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab={**vocab, "<s>": 256}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")


def test_windows_inside_documents_are_slices_of_the_same_documents():
    """Start and inside windows come from one document each, with its BOS; the inside window is tokens
    [o, o + body) at the recorded offset, o in [min_offset, len - body]; documents too short are skipped; the
    same seed gives the same offsets; the offset null runs on exactly these windows."""
    tok = byte_tokenizer()
    docs = ["short", "abcdefghijklmnopqrstuvwxyz" * 3, "0123456789" * 5, "x" * 11, "ABCDEFGHIJ" * 4]
    start, inside, stats = document_windows(tok, docs, 9, 3, min_offset=4, max_offset=30, seed=5, bos="always")
    assert stats["documents_skipped"] == 2 and stats["documents_used"] == 3 and start.shape == inside.shape == (3, 9)
    for row, text, o in zip(range(3), [docs[1], docs[2], docs[4]], stats["offsets"]):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert 4 <= o <= min(30, len(ids) - 8)
        assert start[row].tolist() == [256] + ids[:8] and inside[row].tolist() == [256] + ids[o:o + 8]
    assert document_windows(tok, docs, 9, 3, min_offset=4, max_offset=30, seed=5, bos="always")[2]["offsets"] == \
        stats["offsets"]
    assert nulls.prepare("offset", start, inside=inside)[0] is inside
    rolled = nulls.prepare("circular", start, batch_index=3, seed=1)[0]
    assert torch.equal(rolled[:, 0], start[:, 0]) and not torch.equal(rolled, start)
    assert all(sorted(r.tolist()) == sorted(s.tolist()) for r, s in zip(rolled, start))
    with pytest.raises(UsageError, match="2 of 4 documents"):
        document_windows(tok, docs[:3], 9, 4, min_offset=4, seed=5, bos="always")


@pytest.mark.parametrize("spec", ["mean", "token:9", "patch:inside:1@1", "patch:start:1@0", "nobos"])
def test_offset_intervention_is_the_start_intervention_on_the_inside_windows(spec):
    """The offset null's pass of an intervention runs the windows inside the documents (not their starts) through
    `interventions.prepare`, with the starts as an `inside` patch's source: the same inputs, hooks and forward as
    the intervention at starts given the two windows the other way round (bit for bit; a `start` patch copies
    another document's start in both), and not the same as the unmodified inside windows."""
    from tiny_models import build, token_batch

    from poslens.analyses.leakage import interventions as iv
    from poslens.engine.hooks import HookedModel

    model = build("llama")
    hm = HookedModel(model)
    starts, inside = token_batch(3, 12, seed=5), token_batch(3, 12, seed=6)
    starts[:, 0] = inside[:, 0] = 1  # the BOS

    def scores(prepared) -> torch.Tensor:
        ids, hooks, pos = prepared
        got = []
        hm.run(ids, hooks={**hooks, "blocks.2.attn.hook_attn_scores": lambda s, ctx: got.append(s.clone())},
               position_ids=pos)
        return got[0]

    prepared = nulls.prepare_intervention(spec, model, hm, starts, inside=inside, seed=3)
    assert torch.equal(prepared[0], inside if spec != "nobos" else inside[:, 1:])
    same = scores(iv.prepare(spec, model, hm, inside, None, 3, inside=starts, starts=starts))
    assert torch.equal(scores(prepared), same)
    assert not torch.allclose(scores((inside, {}, None))[..., -same.shape[-1]:, -same.shape[-1]:], same)
    with pytest.raises(UsageError, match="offset null"):
        nulls.prepare_intervention(spec, model, hm, starts, inside=None)
