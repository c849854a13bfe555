"""Monte Carlo of the parameter-free stack (poslens.stack.simulate).

Exact checks against a per-sample float64 reference written here from the paper's Eq. 1, plus properties
the math predicts (layer 1 = input Gram, E<x_i, x_j> ~ alpha, position independence without a mask,
1/sqrt(N) standard errors) and the reproducibility guarantees (chunking, checkpoint + resume).
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_identical

from poslens.errors import UsageError
from poslens.io.checkpoint import load_partial
from poslens.stack import simulate as sim
from poslens.stack.config import StackConfig, visible
from poslens.stack.rope import cos_sin, rotate

FIELDS = ("scores_mean", "scores_se", "probs_mean", "probs_se", "cosine_mean", "cosine_se")
SMALL = dict(n=8, d=16, layers=3)


def inputs(config: StackConfig, samples: int, seed: int, dtype=torch.float64, device="cpu") -> torch.Tensor:
    """All of a run's X^(0), block by block, as simulate draws them (on the CPU)."""
    blocks = []
    for k in range(-(-samples // sim.BLOCK)):
        b = min(sim.BLOCK, samples - k * sim.BLOCK)
        blocks.append(sim.draw_inputs(config, seed, k, b, device=device, dtype=dtype).cpu())
    return torch.cat(blocks)


def reference(config: StackConfig, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Eq. 1 on all samples at once in float64, written independently of poslens.stack.simulate; mean and SE."""
    hidden = ~torch.as_tensor(visible(config.n, config.mask, config.window))
    cos, sin = cos_sin(config.n, config.d, config.rope_theta, config.rope_scaling, dtype=torch.float64)

    def cosine(x):
        return F.cosine_similarity(x[:, :, None], x[:, None], dim=-1, eps=0.0)

    x = x.double()
    scores, probs, cosines = [], [], []
    for _ in range(config.layers):
        cosines.append(cosine(x))
        if config.norm == "l2":
            y = x / (x.norm(dim=-1, keepdim=True) + 1e-12)
        else:
            y = F.layer_norm(x, (config.d,), eps=1e-12)
        q = rotate(y, cos, sin) if config.positional == "rope" else y
        s = (q @ q.mT) / config.score_divisor
        a = torch.softmax(s.masked_fill(hidden, -math.inf), dim=-1)
        scores.append(s)
        probs.append(a)
        x = a @ y + x if config.residual else a @ y
    cosines.append(cosine(x))
    out = {}
    for name, v in (("scores", scores), ("probs", probs), ("cosine", cosines)):
        v = torch.stack(v, dim=1)  # [samples, layers, n, n]
        out[f"{name}_mean"] = v.mean(0)
        out[f"{name}_se"] = v.std(0) / math.sqrt(len(v))
    out["scores_mean"][:, hidden] = math.nan
    out["scores_se"][:, hidden] = math.nan
    return out


CONFIGS = [
    StackConfig(alpha=0.3, **SMALL),
    StackConfig(alpha=0.0, norm="layernorm-sqrt-d", positional="rope", **SMALL),
    StackConfig(alpha=0.5, positional="rope", mask="none", rope_theta=100.0, **SMALL),
    StackConfig(alpha=0.2, norm="layernorm-d", mask="sliding", window=3, residual=False, **SMALL),
    StackConfig(alpha=0.1, mask="none", **SMALL),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.norm}-{c.positional}-{c.mask}-res{c.residual}")
def test_matches_float64_reference(config):
    # 300 samples = blocks of 128, 128 and a short one of 44. float64 throughout: the streamed float64 sums
    # and the reference's stacked mean agree to round-off (1e-12); SEs too, except where the variance is
    # pure round-off (the l2 diagonal, exactly 1), hence the absolute 1e-9 on SEs.
    samples = 300
    got = sim.simulate(config, samples, seed=3, chunk=256, dtype=torch.float64)
    want = reference(config, inputs(config, samples, 3))
    for name in FIELDS:
        torch.testing.assert_close(getattr(got, name), want[name], rtol=1e-9, atol=1e-12 if "mean" in name else 1e-9,
                                   equal_nan=True, msg=name)
    assert got.samples == samples and got.seconds > 0


def test_layer1_scores_are_the_input_gram():
    # l2: Y^(1) = X^(0) (unit rows, Sec. 3.2), so layer-1 scores = <x_i, x_j> and their mean is the
    # empirical Gram of the inputs; its diagonal is 1. float32 compute: agreement to 1e-6.
    config = StackConfig(alpha=0.2, **SMALL)
    r = sim.simulate(config, 500, seed=1)
    x = inputs(config, 500, 1)
    gram = (x @ x.mT).mean(0)
    vis = torch.as_tensor(visible(config.n))
    torch.testing.assert_close(r.scores_mean[0][vis], gram[vis], rtol=0, atol=1e-6)
    torch.testing.assert_close(r.cosine_mean[0], gram, rtol=0, atol=1e-6)
    torch.testing.assert_close(r.scores_mean[0].diagonal(), torch.ones(config.n, dtype=torch.float64),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("alpha, pe", [(0.3, "none"), (0.0, "rope")])
def test_layer1_off_diagonal_mean_is_alpha(alpha, pe):
    # E<x_i, x_j> = alpha (Eq. 2), up to an O(1/d) bias from normalising (about -0.002 at d = 64, alpha =
    # 0.3): at 1000 samples the SE is about 0.005, so every off-diagonal entry is within 4 SE of alpha. With RoPE
    # and independent inputs (alpha = 0) the rotated inner products are 0 in expectation too (Barbero et al.; the
    # report's layer-1 context line of Kim et al. Sections 4.1 and 5.1 rests on this test).
    r = sim.simulate(StackConfig(n=10, d=64, alpha=alpha, layers=1, positional=pe), 1000, seed=5)
    low = torch.tril(torch.ones(10, 10, dtype=torch.bool), -1)
    z = (r.scores_mean[0][low] - alpha) / r.scores_se[0][low]
    assert z.abs().max() < 4, z
    assert r.scores_se[0][low].max() < 0.01


@pytest.mark.parametrize("chunk", [1, 200, 384, 10_000])
def test_result_does_not_depend_on_chunk(chunk):
    # Draws and per-block reductions are fixed, block sums fold in block order: bit-identical (CPU).
    config = StackConfig(alpha=0.2, positional="rope", **SMALL)
    base = sim.simulate(config, 700, seed=2, chunk=128)
    other = sim.simulate(config, 700, seed=2, chunk=chunk)
    for name in FIELDS:
        assert_identical(getattr(base, name), getattr(other, name), name)


def test_result_does_not_depend_on_threads():
    config = StackConfig(alpha=0.2, **SMALL)
    base = sim.simulate(config, 600, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = sim.simulate(config, 600, seed=4)
        assert torch.get_num_threads() == 1  # simulate leaves the caller's thread setting as it found it
    finally:
        torch.set_num_threads(threads)
    for name in FIELDS:
        assert_identical(getattr(base, name), getattr(single, name), name)


def interrupted(monkeypatch, at: int, *args, **kwargs) -> None:
    """simulate(*args, **kwargs) killed at its `at`-th chunk (a KeyboardInterrupt, as a kill would be)."""
    run, calls, lock = sim._Stack.run, [0], threading.Lock()

    def failing(self, *a):
        with lock:
            calls[0] += 1
            if calls[0] == at:
                raise KeyboardInterrupt
        return run(self, *a)

    monkeypatch.setattr(sim._Stack, "run", failing)
    with pytest.raises(KeyboardInterrupt):
        sim.simulate(*args, **kwargs)
    monkeypatch.setattr(sim._Stack, "run", run)


def fingerprint(config: StackConfig, samples: int, seed: int, **extra) -> dict:
    """The checkpoint fingerprint simulate writes (pinned here: a change to it orphans users' checkpoints)."""
    return {"config": config.to_dict(), "samples": samples, "seed": seed, "block": sim.BLOCK,
            "device": "cpu", "dtype": str(torch.float32), "what": "poslens.simulate", **extra}


def test_checkpoint_resume_is_bit_identical(tmp_path, monkeypatch):
    config = StackConfig(alpha=0.2, norm="layernorm-sqrt-d", **SMALL)
    samples, seed = 1000, 7  # 8 blocks
    full = sim.simulate(config, samples, seed=seed, chunk=128)
    path = tmp_path / "partial.safetensors"

    # Interrupt at the 5th chunk; checkpoints are saved after every chunk.
    threads = torch.get_num_threads()
    interrupted(monkeypatch, 5, config, samples, seed=seed, chunk=128, checkpoint=path, checkpoint_every=1)
    assert torch.get_num_threads() == threads  # the workers' single-thread setting is undone
    fp = fingerprint(config, samples, seed)
    _, done = load_partial(path, fp)
    assert 0 < done < 8

    resumed = sim.simulate(config, samples, seed=seed, chunk=256, checkpoint=path, checkpoint_every=1)
    for name in FIELDS:
        assert_identical(getattr(full, name), getattr(resumed, name), name)
    assert load_partial(path, fp)[1] == 8
    # A finished checkpoint is a finished run; another seed's checkpoint is refused.
    again = sim.simulate(config, samples, seed=seed, checkpoint=path)
    assert torch.equal(again.probs_mean, full.probs_mean)
    with pytest.raises(UsageError, match="different configuration"):
        sim.simulate(config, samples, seed=seed + 1, checkpoint=path)


MAP_CONFIGS = [CONFIGS[0], CONFIGS[1], CONFIGS[3]]  # l2 NoPE causal (S is the cosine), LayerNorm RoPE, sliding


@pytest.mark.parametrize("config", MAP_CONFIGS, ids=["l2-nope", "layernorm-rope", "sliding-nores"])
@pytest.mark.parametrize("maps", [("scores",), ("probs",), ("cosine",), ("cosine", "scores"), ("probs", "cosine"),
                                  "scores"])
def test_requested_maps_equal_a_full_run_bit_for_bit(config, maps):
    # Skipping the other maps' work changes nothing in the requested ones (same draws, same arithmetic),
    # whatever the chunking; the maps left out are None.
    full = sim.simulate(config, 300, seed=6)
    part = sim.simulate(config, 300, seed=6, maps=maps, chunk=256)
    wanted = {maps} if isinstance(maps, str) else set(maps)
    for name in FIELDS:
        if name.split("_")[0] in wanted:
            assert_identical(getattr(part, name), getattr(full, name), name)
        else:
            assert getattr(part, name) is None, name
    assert part.samples == 300


def test_default_maps_are_all_maps():
    config = StackConfig(alpha=0.2, **SMALL)
    a, b = sim.simulate(config, 200, seed=1), sim.simulate(config, 200, seed=1, maps=("probs", "scores", "cosine"))
    assert sim.MAPS == ("scores", "probs", "cosine")
    for name in FIELDS:
        assert_identical(getattr(a, name), getattr(b, name), name)


def test_checkpoint_resume_with_maps(tmp_path, monkeypatch):
    # The fingerprint holds the maps: a scores-only run resumes bit-identically from its own checkpoint,
    # and a run asking for other maps refuses it.
    config = StackConfig(alpha=0.2, **SMALL)
    samples, seed, maps = 1000, 8, ("scores",)
    full = sim.simulate(config, samples, seed=seed, maps=maps)
    path = tmp_path / "partial.safetensors"
    interrupted(monkeypatch, 4, config, samples, seed=seed, chunk=128, checkpoint=path, checkpoint_every=1, maps=maps)
    fp = fingerprint(config, samples, seed, maps=["scores"])
    assert 0 < load_partial(path, fp)[1] < 8
    resumed = sim.simulate(config, samples, seed=seed, checkpoint=path, checkpoint_every=1, maps=maps)
    assert_identical(resumed.scores_mean, full.scores_mean)
    assert_identical(resumed.scores_se, full.scores_se)
    assert resumed.probs_mean is None and resumed.cosine_mean is None
    with pytest.raises(UsageError, match="different configuration"):
        sim.simulate(config, samples, seed=seed, checkpoint=path)
    with pytest.raises(UsageError, match="different configuration"):
        sim.simulate(config, samples, seed=seed, checkpoint=path, maps=("scores", "probs"))


def test_unmasked_nope_maps_are_position_independent():
    # Without a mask or RoPE the stack is permutation-equivariant and the inputs exchangeable, so every
    # off-diagonal mean is the same number in every layer (and the l2 diagonal is 1). Entries are
    # correlated, so compare each with the pooled mean at 5 SE.
    config = StackConfig(n=8, d=16, alpha=0.2, layers=3, mask="none")
    r = sim.simulate(config, 2000, seed=11)
    off = ~torch.eye(8, dtype=torch.bool)
    for m, se in ((r.scores_mean, r.scores_se), (r.probs_mean, r.probs_se), (r.cosine_mean, r.cosine_se)):
        for layer in range(m.shape[0]):
            dev = (m[layer][off] - m[layer][off].mean()).abs() / se[layer][off]
            assert dev.max() < 5, (layer, dev.max())
    torch.testing.assert_close(r.scores_mean.diagonal(dim1=1, dim2=2), torch.ones(3, 8, dtype=torch.float64),
                               rtol=0, atol=1e-6)


def test_standard_error_shrinks_like_one_over_sqrt_samples():
    config = StackConfig(alpha=0.2, **SMALL)
    small = sim.simulate(config, 400, seed=0)
    large = sim.simulate(config, 6400, seed=1)
    vis = torch.as_tensor(visible(config.n)) & ~torch.eye(config.n, dtype=torch.bool)
    ratio = (small.scores_se[:, vis] / large.scores_se[:, vis]).median()
    assert 3.6 < ratio < 4.4, ratio  # sqrt(6400 / 400) = 4; each SE estimate is good to a few %


def test_maps_are_well_formed():
    config = StackConfig(alpha=0.4, positional="rope", **SMALL)
    r = sim.simulate(config, 300, seed=0)
    L, n = config.layers, config.n
    hidden = ~torch.as_tensor(visible(n))
    assert r.scores_mean.shape == r.probs_se.shape == (L, n, n)
    assert r.cosine_mean.shape == r.cosine_se.shape == (L + 1, n, n)
    assert all(getattr(r, f).dtype == torch.float64 and getattr(r, f).device.type == "cpu" for f in FIELDS)
    assert r.scores_mean[:, hidden].isnan().all() and r.scores_mean[:, ~hidden].isfinite().all()
    assert (r.probs_mean[:, hidden] == 0).all() and (r.probs_se[:, hidden] == 0).all()
    torch.testing.assert_close(r.probs_mean.sum(-1), torch.ones(L, n, dtype=torch.float64), rtol=0, atol=1e-6)
    # cosine of X^(0) .. X^(L): 1 on the diagonal (to float32 round-off), symmetric
    torch.testing.assert_close(r.cosine_mean.diagonal(dim1=1, dim2=2), torch.ones(L + 1, n, dtype=torch.float64),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(r.cosine_mean, r.cosine_mean.mT, rtol=0, atol=1e-6)
    assert (r.scores_se[:, ~hidden] >= 0).all()


def test_float32_agrees_with_float64():
    # Same float32 draws; the float32 pipeline's round-off (~1e-7 per operation) stays far below 1e-5.
    config = StackConfig(n=16, d=64, alpha=0.2, layers=4)
    a = sim.simulate(config, 300, seed=9)
    b = sim.simulate(config, 300, seed=9, dtype=torch.float64)
    for name in ("scores_mean", "probs_mean", "cosine_mean"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=1e-5, equal_nan=True, msg=name)


def test_progress_bar(capsys):
    sim.simulate(StackConfig(**SMALL), 300, progress=True)
    assert "simulate" in capsys.readouterr().err


def test_single_sample_has_no_standard_error():
    r = sim.simulate(StackConfig(**SMALL), 1)
    assert r.samples == 1 and r.scores_se[0, 0, 0].isnan()


@pytest.mark.parametrize("kwargs, match", [
    (dict(samples=0), "samples must be >= 1"),
    (dict(samples=2.5), "samples must be an integer"),
    (dict(chunk=0), "chunk must be >= 1"),
    (dict(seed=-1), "seed must be >= 0"),
    (dict(checkpoint_every=0), "checkpoint_every must be >= 1"),
    (dict(dtype=torch.float16), "dtype must be"),
    (dict(device="tpu"), "device must be cpu or cuda"),
    (dict(device="nonsense:x"), "device must be cpu or cuda"),
    (dict(config={"n": 8}), "config must be a StackConfig"),
    (dict(maps=()), r"^maps must be a non-empty subset of scores, probs, cosine; got \(\)$"),
    (dict(maps=("scores", "attention")), "maps must be a non-empty subset"),
    (dict(maps=3), "maps must be a non-empty subset"),
    (dict(maps=("scores", None)), "maps must be a non-empty subset"),
])
def test_bad_arguments_raise_usage_error(kwargs, match):
    args = dict(config=StackConfig(**SMALL), samples=10) | kwargs
    with pytest.raises(UsageError, match=match):
        sim.simulate(**args)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@needs_gpu
@pytest.mark.parametrize("config", CONFIGS[:2], ids=["l2-nope", "layernorm-rope"])
def test_cuda_matches_float64_reference(config):
    # CUDA draws (its own generator), float32 on the GPU vs the float64 reference on the same inputs.
    got = sim.simulate(config, 300, seed=3, device="cuda")
    want = reference(config, inputs(config, 300, 3, device="cuda"))
    for name in ("scores_mean", "probs_mean", "cosine_mean"):
        torch.testing.assert_close(getattr(got, name), want[name], rtol=0, atol=2e-5, equal_nan=True, msg=name)


@needs_gpu
def test_cuda_chunking_changes_only_round_off():
    config = StackConfig(alpha=0.2, **SMALL)
    a = sim.simulate(config, 700, seed=2, device="cuda", chunk=128)
    b = sim.simulate(config, 700, seed=2, device="cuda")
    for name in FIELDS:
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=1e-6, equal_nan=True, msg=name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu_is_a_usage_error():
    with pytest.raises(UsageError, match="^device cuda requested but torch sees no GPU; use --device cpu$"):
        sim.simulate(StackConfig(**SMALL), 10, device="cuda")


def test_corrupt_checkpoint_is_a_usage_error(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="corrupt"):
        sim.simulate(StackConfig(**SMALL), 10, checkpoint=path)


# ---------------------------------------------------------------- issue 8: resumable by default, flat memory, limits


def test_inside_a_run_directory_simulate_resumes_by_default(tmp_path, monkeypatch):
    # No checkpoint argument: inside open_run the partial sums go to the run's work directory, an interrupted
    # run leaves them there, and the rerun finishes only the chunks that were missing, bit for bit.
    from poslens.io.rundir import open_run

    config = StackConfig(alpha=0.2, **SMALL)
    samples, seed = 1000, 3  # 8 blocks
    full = sim.simulate(config, samples, seed=seed)
    out = tmp_path / "r"
    with pytest.raises(KeyboardInterrupt), open_run(out):
        interrupted(monkeypatch, 5, config, samples, seed=seed, chunk=128, checkpoint_every=1)
        raise KeyboardInterrupt  # `interrupted` caught it; it goes on up through the run directory, as in the CLI
    (ckpt,) = (tmp_path / ".r.partial").glob("simulate-*.safetensors")
    _, done = load_partial(ckpt, fingerprint(config, samples, seed))
    assert 0 < done < 8 and not out.exists()

    run, chunks = sim._Stack.run, []
    monkeypatch.setattr(sim._Stack, "run", lambda self, s, first, sizes: chunks.append(first) or run(self, s, first,
                                                                                                   sizes))
    with open_run(out):
        resumed = sim.simulate(config, samples, seed=seed, chunk=128)
    assert sorted(chunks) == list(range(done, 8))  # only the missing blocks were computed
    for name in FIELDS:
        assert_identical(getattr(full, name), getattr(resumed, name), name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]  # the checkpoint went with the completed run


def test_memory_is_flat_in_samples(monkeypatch):
    # 1e12 samples are 7.8e9 blocks: a chunk list built up front would need hundreds of GB of Python objects.
    import tracemalloc

    tracemalloc.start()
    try:
        interrupted(monkeypatch, 4, StackConfig(n=4, d=4, layers=1), 10**12, chunk=128)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20


@pytest.mark.parametrize("config", [StackConfig(n=10**6), StackConfig(n=2, d=10**12), StackConfig(n=2, layers=10**12)],
                         ids=["n", "d", "layers"])
def test_what_cannot_fit_in_memory_is_refused_up_front_with_the_estimate(config):
    with pytest.raises(UsageError, match=r"^simulate \(n=\d+, d=\d+, layers=\d+, chunks of 128 samples\) would need "
                                         r"about [\d.]+ GiB of memory but [\d.]+ [GM]iB is available; lower n, d, "
                                         r"layers or chunk$"):
        sim.simulate(config, 10)


@pytest.mark.parametrize("n, d, pe", [(256, 16, "none"), (64, 1024, "rope")])
def test_memory_estimate_bounds_the_measured_peak(n, d, pe):
    # Peak resident memory of one worker's run (in a fresh process, after a warm-up) never exceeds the estimate
    # (what refusing a run relies on). No lower bound: the growth of the peak RSS is not a reliable measure of
    # use from below (ratios 0.39-0.93 in isolation, 0 inside a full test session, where the allocator reuses
    # pages); the estimate's own arithmetic is checked against the tensor sizes by the refusal test above.
    code = ("import resource, torch\nfrom poslens.stack.config import StackConfig\nfrom poslens.stack import "
            "simulate as sim\ntorch.set_num_threads(1)\nsim.simulate(StackConfig(n=4, d=4, layers=1), 10)\n"
            "rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\nbase = rss()\n"
            f"sim.simulate(StackConfig(n={n}, d={d}, layers=2, positional='{pe}'), 256, chunk=256)\n"
            "print(rss() - base)\n")
    import subprocess
    import sys

    measured = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                  timeout=300).stdout)
    estimate = sim.memory_estimate(StackConfig(n=n, d=d, layers=2, positional=pe), 256, 1)
    assert measured <= estimate


@pytest.mark.parametrize("kwargs, match", [
    (dict(alpha="0.2"), r"^alpha must be a number, got '0.2'$"),
    (dict(alpha=math.nan), r"^alpha must be a finite number, got nan$"),
    (dict(rope_theta=math.inf), r"^rope_theta must be a finite number, got inf$"),
    (dict(rope_scaling=math.inf, positional="rope"), r"^rope_scaling must be a finite number, got inf$"),
    (dict(rope_theta=-math.inf), r"^rope_theta must be a finite number, got -inf$"),
    (dict(n="50"), r"^n must be an integer, got '50'$"),
    (dict(layers=None), r"^layers must be an integer, got None$"),
    (dict(residual="no"), r"^residual must be True or False, got 'no'$"),
    (dict(norm=None), r"^norm must be one of"),
    (dict(positional="rope", d=2, rope_scaling=2.0), r"^rope_scaling needs d >= 4"),
    (dict(positional="rope", rope_theta=1e300, rope_scaling=1e10), r"gives an infinite RoPE base"),
])
def test_stack_config_refuses_strings_and_non_finite_numbers(kwargs, match):
    with pytest.raises(UsageError, match=match):
        StackConfig(**kwargs)


@pytest.mark.parametrize("field, value", [("rope_scaling", 0.5), ("rope_scaling", 2.0), ("rope_theta", 5.0)])
def test_rope_settings_without_rope_are_refused(field, value):
    """Without RoPE the base and its scaling change nothing; a run recording them (rope_scaling 0.5, below its own
    bound, was accepted with positional none) would mislead, so they are refused by name."""
    with pytest.raises(UsageError, match=rf"^{field} {value:g} has no effect without RoPE \(positional 'none'\)"):
        StackConfig(**{**SMALL, "positional": "none", field: value})
    if field == "rope_scaling" and value < 1:
        with pytest.raises(UsageError, match="rope_scaling must be >= 1"):
            StackConfig(**{**SMALL, "positional": "rope", field: value})
