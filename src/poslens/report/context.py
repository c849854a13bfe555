"""What a report section gets from `poslens reproduce`: where to write, the sample budget, caches of finished
Monte Carlo runs and Gram flows, and a record of the inputs it used (for provenance).

Monte Carlo with intervals. Each setting's samples are drawn in 2G sub-runs (G = `MC_GROUPS`): sub-run s has its
own seed (seed * 2G + s), goes to group s mod G and to half s div G. Every statistic of the maps is then a
function of grouped means with a delete-one-group jackknife interval (`poslens.engine.stats.GroupedSums`), and
the two halves give noise-free products such as E[P(m_a) P(m_b)]. Finished settings are kept in the parts
directory beside the report, so an interrupted reproduce resumes.
"""

from __future__ import annotations

import hashlib
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from poslens import plotting
from poslens.engine.stats import GroupedSums
from poslens.io.checkpoint import fingerprint, read_cache, write_cache
from poslens.io.protect import cache_root
from poslens.maps import as_numpy
from poslens.stack.config import StackConfig
from poslens.stack.gramflow import GramFlowResult, gram_flow
from poslens.stack.simulate import simulate

MC_GROUPS = 10  # jackknife groups of a Monte Carlo setting (each holds two independent halves)
LEVEL = 0.95


@dataclass
class MonteCarlo:
    """Mean pre-softmax scores of one stack setting: pooled `mean` [L, n, n] and its standard error `se`, and the
    grouped sums behind them (names "a" and "b": the two halves)."""

    config: StackConfig
    samples: int
    sums: GroupedSums
    mean: np.ndarray
    se: np.ndarray

    def estimate(self, fn, level: float = LEVEL):
        """fn(mean a, mean b) -> tensor, with its jackknife interval over the groups (fn gets float64 tensors)."""
        return self.sums.estimate(lambda m: torch.as_tensor(fn(m["a"], m["b"])), level)

    def pooled(self, fn, level: float = LEVEL):
        """fn(pooled mean) -> tensor, with its jackknife interval."""
        return self.sums.estimate(lambda m: torch.as_tensor(fn((m["a"] + m["b"]) / 2)), level)


def joint(fn, *runs: MonteCarlo, level: float = LEVEL):
    """fn([(mean a, mean b) of each run]) -> tensor, with a delete-one-group jackknife interval that drops group g
    of every run at once (the runs' groups are independent, so their statistics can be compared with one
    interval: e.g. a difference between two settings)."""
    state = {}
    for k, r in enumerate(runs):
        for key, v in r.sums.state_dict().items():
            kind, name = key.split("/", 1)
            state[f"{kind}/{k}{name}"] = v
    sums = GroupedSums(MC_GROUPS)
    sums.load_state_dict(state)
    return sums.estimate(lambda m: torch.as_tensor(fn([(m[f"{k}a"], m[f"{k}b"]) for k in range(len(runs))])), level)


def sub_runs(samples: int, groups: int = MC_GROUPS) -> list[int]:
    """Samples of each of the 2G sub-runs (as even as possible; empty sub-runs dropped)."""
    k = 2 * groups
    return [n for s in range(k) if (n := samples // k + (s < samples % k)) > 0]


def sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex digest of a file, or of a directory's files (sorted relative paths and contents)."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        if path.is_dir():
            h.update(p.relative_to(path).as_posix().encode() + b"\0")
        with open(p, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    return h.hexdigest()


class Context:
    """Passed to every section's build function.

    root: the report being built (a temporary directory until it is placed at `target`, the --out path that row
    commands name); parts: finished work kept until the report is written; figures: root/figures; draw: False
    when only the numbers are wanted (`poslens.report.remeasure`): figure helpers then draw nothing; pdf: False
    writes the raster image of each figure alone (no vector PDF beside it)."""

    def __init__(self, root: Path, target: Path, parts: Path, samples: int, seed: int, quick: bool,
                 progress: bool, draw: bool = True, pdf: bool = True):
        self.root, self.target, self.parts = Path(root), Path(target), Path(parts)
        self.samples, self.seed, self.quick, self.progress, self.draw = samples, seed, quick, progress, draw
        self.pdf = pdf
        self.figures = self.root / "figures"
        self.tensors: dict[str, torch.Tensor] = {}
        self.inputs: dict[str, dict] = {}  # provenance: name -> {"path", "sha256", "how"}
        self._mc: dict[str, MonteCarlo] = {}
        self._gf: dict[StackConfig, GramFlowResult] = {}
        self.mc_done = 0

    # ---- Monte Carlo and Gram flow

    def mc(self, config: StackConfig, samples: int | None = None) -> MonteCarlo:
        """Mean scores of `config` over `samples` (default: the run's) in 2G seeded sub-runs (module docstring),
        computed once and kept in the parts directory."""
        samples = samples or self.samples
        key = fingerprint({"config": config.to_dict(), "samples": samples, "seed": self.seed, "groups": MC_GROUPS,
                           "what": "report Monte Carlo, scores"})
        if key in self._mc:
            return self._mc[key]
        path = self.parts / f"mc-{key}.safetensors"
        state = read_cache(path)  # a corrupt file is reported, deleted and recomputed
        sums = GroupedSums(MC_GROUPS)
        if state is None:
            self.mc_done += 1
            if self.progress:
                print(f"  Monte Carlo {self.mc_done}: {setting(config)}, d={config.d}, n={config.n}, "
                      f"{config.layers} layers, {samples:,} samples", flush=True)
            sizes = sub_runs(samples)
            var = None
            for s, n in enumerate(sizes):
                r = simulate(config, samples=n, seed=self.seed * 2 * MC_GROUPS + s, maps=("scores",))
                sums.add("ab"[s // MC_GROUPS], s % MC_GROUPS, r.scores_mean * n, n)
                v = (r.scores_se.double() * n) ** 2
                var = v if var is None else var + v
            state = {**sums.state_dict(), "se": var.sqrt() / samples}
            write_cache(path, state)
        else:
            sums.load_state_dict({k: v for k, v in state.items() if k != "se"})
        total = sums.sums["a"].sum(0, dtype=torch.float64) + sums.sums["b"].sum(0, dtype=torch.float64)
        mean = as_numpy(total / (sums.counts["a"].sum() + sums.counts["b"].sum()))
        out = MonteCarlo(config, samples, sums, mean, as_numpy(state["se"]))
        self._mc[key] = out
        return out

    def gf(self, config: StackConfig) -> GramFlowResult:
        """The Gram flow (exact d -> infinity limit) of `config`, computed once per run."""
        if config not in self._gf:
            self._gf[config] = gram_flow(config)
        return self._gf[config]

    # ---- outputs

    def keep(self, prefix: str, tensors: dict) -> None:
        """Store maps in the report's tensors.safetensors under prefix/name."""
        for k, v in tensors.items():
            self.tensors[f"{prefix}/{k}"] = torch.as_tensor(np.asarray(as_numpy(v)))

    def save(self, fig, stem: str, big: bool = False) -> Path:
        """Save a matplotlib figure as figures/stem.png (JPEG for big grids) with a PDF beside it (unless pdf is
        False); returns the raster image's path."""
        raster = "jpg" if big else "png"
        return plotting.save(fig, self.figures, stem, formats=(raster, "pdf") if self.pdf else (raster,))[0]

    def record(self, name: str, path: str | os.PathLike, how: str, digest: str | None = None) -> None:
        """Provenance of an input: its path, how it was obtained ('trained now', 'from the cache', 'embedded'),
        and its SHA-256 (of the file or directory at `path`, unless `digest` is given)."""
        self.inputs[name] = {"path": str(path), "how": how, "sha256": digest or sha256(path)}

    def remeasure(self, claim_id: str) -> str:
        """The command that re-measures a claim of this run and prints its tests, with the cache this run read its
        models from (`with_cache`)."""
        return with_cache(shlex.join(["python", "-m", "poslens.report.remeasure", str(self.target), claim_id]))


def with_cache(command: str) -> str:
    """`command` run against the poslens cache in force now, the one this run reads and trains its models in:
    'POSLENS_CACHE=/path/to/cache poslens sweep ...', so that the command, run as printed in another shell, reads
    the same models instead of training them again into another cache."""
    return f"POSLENS_CACHE={shlex.quote(str(cache_root().absolute()))} {command}"


def setting(c: StackConfig) -> str:
    """'RoPE, l2, alpha=0.2, causal mask': what a figure or progress line is about."""
    mask = {"causal": "causal mask", "none": "no mask", "sliding": f"sliding window {c.window}"}[c.mask]
    return (f"{'RoPE' if c.positional == 'rope' else 'NoPE'}, {c.norm}{'' if c.residual else ', no residual'}, "
            f"alpha={c.alpha:g}, {mask}")


def est_text(est, index=None, digits: int = 3) -> str:
    """'value [lo, hi]' of a jackknife Estimate (element `index` of a tensor estimate)."""
    from poslens.report.claims import interval_text

    pick = (lambda t: float(t)) if index is None else (lambda t: float(t[index]))
    return interval_text({"value": pick(est.value), "lo": pick(est.lo), "hi": pick(est.hi)}, digits)


def test_of(statistic: str, est, side: str, threshold: float = 0.0, index=None, digits: int = 3,
            margin: float | None = None):
    """A claims Test from a jackknife Estimate (element `index` of a tensor estimate)."""
    from poslens.report.claims import Test

    pick = (lambda t: float(t)) if index is None else (lambda t: float(t[index]))
    return Test(statistic, pick(est.value), side, threshold, pick(est.lo), pick(est.hi),
                f"{100 * est.level:g}% jackknife over {est.groups} groups", digits, margin)
