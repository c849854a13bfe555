"""`poslens leakage` without redundant work: each pass's metrics evaluated once for every contrast (equal to the
joint sums' estimates, number for number), the head-mean maps of the passes whose per-head metrics nothing reads
(equal to the per-head maps' layer metrics within float32 rounding), the mask checked on the device.

Tolerances: `combine` evaluates the same functions on the same float64 means as `GroupedSums.estimate` on the joint
sums, and `LayerMaps` reads the same head-mean sums as `LeakageMaps`, so they are compared bit for bit. The head-mean
sums add each batch's float32 per-head sums in float64, where the per-layer metrics used to read the head mean of
float32 sums over batches: the means differ by float32 rounding (~6e-8 relative per addition, a few additions here),
so every metric, its interval included, must agree with the old reading to 1e-5 of its magnitude plus 1e-9 of the
largest value of that metric over layers (a difference of two nearly equal energies is compared on their scale).
"""

from types import SimpleNamespace

import pytest
import torch
from test_leakage_causal import one_thread  # noqa: F401 (autouse: one intra-op thread for small tensors)
from tiny_models import build

from poslens.analyses.leakage.causal import (
    ENERGIES,
    MEAN_SCORES,
    METRICS,
    NOT_CAUSAL,
    Domains,
    LayerMaps,
    LeakageMaps,
    alpha0,
    joint,
    over_layers,
    unprefix,
)
from poslens.analyses.leakage.contrast import contrast, removed_by_head, unflatten
from poslens.analyses.leakage.nulls import paired_with_starts
from poslens.analyses.leakage.run import ESTIMATE_MAPS, Leakage, LeakageConfig
from poslens.engine.hooks import HookedModel
from poslens.engine.stats import Estimate, combine
from poslens.errors import UsageError

DOMAINS = Domains(early_queries=8)


def one_pass(model, ids: torch.Tensor, stats: list[LeakageMaps], shift: int = 0) -> None:
    """Every statistic reads the same forwards (batches of 2 sequences, batch b in group b), the tokens after the
    first rolled by `shift` (another pass over the same sequences)."""
    hm = HookedModel(model)
    ids = torch.cat([ids[:, :1], ids[:, 1:].roll(shift, 1)], 1)
    hooks: dict = {}
    for stat in stats:
        for point, fn in stat.hooks(hm).items():
            hooks.setdefault(point, []).append(fn)
    for b, batch in enumerate(torch.split(ids, 2)):
        for stat in stats:
            stat.group = b
        hm.run(batch, hooks=hooks)
        for stat in stats:
            if hasattr(stat, "end_batch"):
                stat.end_batch()


def ids(n: int = 8, t: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 200, (n, t), generator=torch.Generator().manual_seed(seed))


def equal(a: Estimate, b: Estimate) -> None:
    """Bit for bit (NaN where the other is NaN: a metric undefined on a domain)."""
    for k in ("value", "lo", "hi", "se"):
        torch.testing.assert_close(getattr(a, k), getattr(b, k), rtol=0, atol=0, equal_nan=True, msg=k)


def reference_contrast(base: LeakageMaps, other: LeakageMaps, level: float = 0.95) -> list[Estimate]:
    """`contrast` as it was computed before each pass's evaluations were shared: one function of the joint sums."""
    sums, energy, shapes = joint({"base": base, "other": other}), [METRICS.index(k) for k in ENERGIES], []

    def fn(means):
        a, b = base.layer_metrics(unprefix(means, "base")), other.layer_metrics(unprefix(means, "other"))
        ea, eb = a[:, energy], b[:, energy]
        oa, ob = over_layers(a), over_layers(b)
        parts = [b, b - a, 1.0 - eb / ea, 1.0 - eb.flatten(2).sum(-1) / ea.flatten(2).sum(-1), ob, ob - oa]
        shapes[:] = [tuple(p.shape) for p in parts]
        return torch.cat([p.reshape(-1) for p in parts])

    return unflatten(sums.estimate(fn, level=level), shapes)


def test_shared_evaluations_give_the_joint_sums_estimates_exactly():
    """Contrasts, per-head removed shares and the four-pass pairing from each pass's evaluations equal the
    estimates of the same functions on the joint sums, bit for bit (the summary's numbers did not move)."""
    model = build("llama")
    x = ids()
    base, other, start, inside = (LeakageMaps(groups=4, domains=DOMAINS) for _ in range(4))
    one_pass(model, x, [base])
    one_pass(model, x, [other], shift=3)
    one_pass(model, x, [start], shift=5)
    one_pass(model, x, [inside], shift=7)
    got = contrast(base, other)
    for name, ref in zip(("pass", "difference", "removed", "removed_all", "pass_over_layers",
                          "difference_over_layers"), reference_contrast(base, other)):
        equal(got[name], ref)
    sums = joint({"base": base, "other": other})
    equal(removed_by_head(base, other), sums.estimate(
        lambda m: 1.0 - other.head_energies(unprefix(m, "other")) / base.head_energies(unprefix(m, "base"))))
    equal(combine(lambda x: x, [base.evaluated("heads")]), base.sums.estimate(base.head_metrics))
    paired = paired_with_starts(base, start, other, inside)
    four, e = joint({"o": base, "s": start, "f": other, "i": inside}), [METRICS.index(ENERGIES[0])]

    def first_energy(stat: LeakageMaps, means, prefix: str) -> torch.Tensor:
        return stat.layer_metrics(unprefix(means, prefix))[:, e]

    removed = four.estimate(lambda m: (1.0 - first_energy(start, m, "s") / first_energy(base, m, "o"))
                            - (1.0 - first_energy(inside, m, "i") / first_energy(other, m, "f")))
    equal(paired["removed"][:, :1], removed)
    # a pass read after more sums were added is evaluated again, not served stale
    before = base.evaluated("layers").value.clone()
    one_pass(model, ids(seed=1), [base])
    assert not torch.equal(base.evaluated("layers").value, before)


def zeroed_halves(sums, names):
    """`contrast.by_parity` as it was: each half an explicit copy of the sums with the other half's groups zeroed."""
    from poslens.engine.stats import GroupedSums

    out = GroupedSums(sums.groups)
    for name in names:
        out.sums[name], out.counts[name] = sums.sums[name], sums.counts[name]
    for name in names:
        s, c = sums.sums[name], sums.counts[name]
        for h in (0, 1):
            keep = (torch.arange(sums.groups) % 2 == h).double()
            out.sums[f"{h}:{name}"] = s * keep.reshape(-1, *(1,) * (s.dim() - 1)).to(s.dtype)
            out.counts[f"{h}:{name}"] = c * keep.reshape(-1, *(1,) * (c.dim() - 1))
    return out


def test_the_sink_heads_halves_read_the_shared_sums_and_give_the_zeroed_copies_numbers(monkeypatch):
    """The sink heads' cross-fitted attention and removed share read each half of the groups from the passes' own
    sums (no copy: the memory of a large model's estimates) and give, bit for bit, what explicit zeroed copies gave."""
    from poslens.analyses.leakage import contrast as ct

    model = build("llama")
    base, other = (LeakageMaps(groups=4, domains=DOMAINS) for _ in range(2))
    one_pass(model, ids(), [base])
    one_pass(model, ids(), [other], shift=3)
    halves = ct.by_parity(joint({"base": base, "other": other}), ("base/scores",))
    assert halves.sums["0:base/scores"].data_ptr() == base.sums.sums["scores"].data_ptr()
    threshold = float(alpha0(base.sums.mean("key0")).median())  # some heads on each side of it
    got = (ct.sink_attention(base, other, threshold), ct.sink_heads_removed(base, other, threshold))
    monkeypatch.setattr(ct, "by_parity", zeroed_halves)
    want = (ct.sink_attention(base, other, threshold), ct.sink_heads_removed(base, other, threshold))
    assert got[0] is not None and got[1] is not None and got == want


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: a sliding window of 12 keys at 20 tokens
def test_layer_maps_give_the_per_head_maps_layer_metrics_exactly(family):
    """The same forwards read by LeakageMaps and LayerMaps: every per-layer metric, interval included, and the
    contrast against another pass are the same numbers (both read the head-mean sums); LayerMaps keep no per-head
    map and refuse per-head metrics in one line. The head-mean sums agree with the per-head float32 sums' mean
    (what the layer metrics read before) to float32 rounding (module docstring), and so do the metrics."""
    model = build(family)
    x = ids()
    heads, layers = LeakageMaps(groups=4, domains=DOMAINS), LayerMaps(groups=4, domains=DOMAINS)
    one_pass(model, x, [heads, layers])
    assert heads.sums.sums["scores"].shape[2] == model.config.num_attention_heads > 1
    assert "scores" not in layers.sums and layers.sums.sums[MEAN_SCORES].shape == heads.sums.sums[MEAN_SCORES].shape
    equal(layers.sums.estimate(layers.layer_metrics), heads.sums.estimate(heads.layer_metrics))
    base = LeakageMaps(groups=4, domains=DOMAINS)
    one_pass(model, x, [base], shift=3)
    for name, est in contrast(base, heads).items():
        equal(contrast(base, layers)[name], est)
    with pytest.raises(UsageError, match="per-head metrics need the per-head maps"):
        layers.head_metrics({k: layers.sums.mean(k) for k in layers.KEYS})
    # against the head mean of the per-head float32 sums
    torch.testing.assert_close(heads.sums.mean(MEAN_SCORES), heads.sums.mean("scores").mean(1), rtol=1e-6, atol=1e-6)
    a = heads.sums.estimate(heads.layer_metrics)
    b = heads.sums.estimate(lambda m: heads.layer_metrics({k: m[k] for k in heads.KEYS if k != MEAN_SCORES}))
    for k in ("value", "lo", "hi"):
        x1, x2 = getattr(a, k), getattr(b, k)
        scale = x1.abs().nan_to_num().amax(-1, keepdim=True)  # per variant and metric, over layers
        assert torch.equal(x1.isnan(), x2.isnan())
        ok = x1.isnan() | ((x1 - x2).abs() <= 1e-5 * x1.abs() + 1e-9 * scale)
        assert bool(ok.all()), (k, (x1 - x2).abs().nan_to_num().max())


def test_the_memory_estimate_of_a_group_is_what_the_sums_hold():
    """`group_bytes` (what the command's memory estimate multiplies by groups and passes) equals the bytes the sums of
    each class hold after a pass, per group: the estimate cannot drift from the storage. On a Llama-3.1-8B shape at
    512 tokens and the defaults (8 groups; 3 passes per head, 4 head-mean) the maps' part is 53.9 GiB: every pass's
    sums (29.9 GiB, not the 61.9 GiB of one per-head class for every pass) and the estimates' ESTIMATE_MAPS per-head
    float64 maps (benchmarks/leakage_memory.py measured 9.3 of them)."""
    model = build("mistral")  # a sliding-window layer too
    c = model.config
    for cls in (LeakageMaps, LayerMaps):
        stat = cls(groups=4, domains=DOMAINS)
        one_pass(model, ids(), [stat])
        held = sum(v.nbytes for v in stat.sums.sums.values())
        assert held == 4 * cls.group_bytes(c.num_hidden_layers, c.num_attention_heads, 20)
    L, H, T = 32, 32, 512
    sums = 8 * (3 * LeakageMaps.group_bytes(L, H, T) + 4 * LayerMaps.group_bytes(L, H, T))
    assert round(sums / 2**30, 1) == 29.9 and round(7 * 8 * LeakageMaps.group_bytes(L, H, T) / 2**30, 1) == 61.9
    estimate = Leakage().memory(SimpleNamespace(
        config=LeakageConfig(model="x", seq_len=T, num_sequences=64, groups=8, interventions=["mean", "random"]),
        hm=SimpleNamespace(n_layers=L), model=SimpleNamespace(config=SimpleNamespace(
            num_attention_heads=H, hidden_size=4096))))["grouped sums of the maps"][0]
    assert estimate == sums + ESTIMATE_MAPS * L * H * T * T * 8 and round(estimate / 2**30, 1) == 53.9
    assert LayerMaps.group_bytes(L, H, T) < LeakageMaps.group_bytes(L, H, T) / 9


def test_a_score_that_is_not_finite_under_the_mask_is_refused_when_the_sums_are_read():
    """The mask is checked on the device while the passes run and read once: a NaN score where a key is seen makes
    every read of the pass's sums a one-line error (the lag fit assumes the implicit causal mask)."""
    stat = LeakageMaps(groups=2, domains=Domains(early_queries=4))
    stat._layers, stat.windows = 1, [0]
    t = 8
    s = torch.randn(2, 2, t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
    ctx = SimpleNamespace(attention_mask=None, window=0, layer=0)
    for g in range(2):
        stat.group = g
        stat._read(s.clone(), ctx)
    stat.maps()  # a causal mask: read without complaint
    s[1, 0, 5, 2] = torch.nan
    stat._read(s, ctx)
    for read in (stat.maps, lambda: stat.evaluated("layers"), stat.estimates):
        with pytest.raises(UsageError, match="needs a causal mask") as e:
            read()
        assert str(e.value) == NOT_CAUSAL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_sums_stay_on_the_device_and_give_the_cpu_numbers():
    """On a GPU every sum, the predecessor's rows and position 0's states accumulate on the device (nothing copied
    per batch) and the metrics equal the CPU run's: float32 scores from another GEMM differ by ~1e-6 relative, so
    every per-layer metric agrees to 1e-4 of its magnitude plus 1e-6 of the largest value of that metric."""
    from poslens.analyses.leakage.predecessor import DeltaR2Rows
    from poslens.analyses.leakage.run import Position0

    torch.backends.cuda.matmul.allow_tf32 = False
    out = {}
    for device in ("cpu", "cuda"):
        model = build("llama").to(device)
        stats = [LeakageMaps(groups=4, domains=DOMAINS), DeltaR2Rows(), Position0(4)]
        one_pass(model, ids().to(device), stats)
        maps, rows, position = stats
        if device == "cuda":
            assert all(t.is_cuda for t in (*maps.sums.sums.values(), *maps.sums.counts.values(), *rows.rows,
                                           *position.rows.parts["states"]))
            maps.sums.to("cpu")
        out[device] = (maps.sums.estimate(maps.layer_metrics), rows.values(), position.spread().value)
    for k in ("value", "lo", "hi"):
        x1, x2 = getattr(out["cpu"][0], k), getattr(out["cuda"][0], k)
        scale = x1.abs().nan_to_num().amax(-1, keepdim=True)
        assert bool((x1.isnan() | ((x1 - x2).abs() <= 1e-4 * x1.abs() + 1e-6 * scale)).all()), k
    torch.testing.assert_close(out["cuda"][1], out["cpu"][1], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out["cuda"][2], out["cpu"][2], rtol=1e-4, atol=1e-6)


def test_sums_restored_on_the_cpu_move_to_the_device_the_batches_accumulate_on():
    """A run resumed on an accelerator: the checkpoint's sums load on the CPU and move, with their counts, to the
    device of the next batch's `buffer` (the meta device stands in for one here: only where the tensors live is
    checked); an in-place addition across devices would fail."""
    from poslens.engine.stats import GroupedSums

    sums = GroupedSums(2)
    sums.buffer("x", 0, (3,))[:] += 1.0
    restored = GroupedSums(2)
    restored.load_state_dict(sums.state_dict())
    assert restored.sums["x"].device.type == "cpu"
    assert restored.buffer("x", 1, (3,), device=torch.device("meta")).device.type == "meta"
    assert restored.counts["x"].device.type == "meta"
