"""Robust to the machine: the sweep's models retrained with another CPU kernel set, and every row on them re-judged.

Training is bit-identical when repeated on one machine, not across processors whose CPU kernels differ: over the
sweep's steps, tiny models trained at a high learning rate drift apart with the rounding, and a verdict at the edge
of its interval can move. `poslens reproduce --robustness` asks whether each verdict on the sweep's models (a row
whose tests are t-intervals over seeds) survives that: it retrains the sweep in a subprocess whose kernels are
`ALTERNATIVE` (ATen's CPU capability lowered to its `default`, non-vector, kernels; MKL in its COMPATIBLE code path),
into a cache of its own beside the model cache (`alternative_cache`: every other entry, the corpus and its tokens
included, is the model cache's own, linked), rebuilds those sections on the retrained models in this process, and
gives each row a robustness line: the same verdict, or the verdict the other kernels give. Without the flag the line
says "not checked" (`NOT_CHECKED`): the check costs a second training of the sweep and a second measurement.

`rounding(env)` runs a fixed float32 matmul in a subprocess under `env`; tests/test_robustness.py checks that the
alternative kernels change its bits (so the line can fail) while it stays within float32 rounding.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from poslens.report.claims import Claim
from poslens.train.sweep import SweepConfig

ALTERNATIVE = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
KERNELS = ("another CPU kernel set (ATen's CPU capability lowered to its default, non-vector kernels: "
           "ATEN_CPU_CAPABILITY=default; MKL's COMPATIBLE code path: MKL_CBWR=COMPATIBLE)")
NOT_CHECKED = (f"not checked: `poslens reproduce --robustness` retrains the sweep's models with {KERNELS} and "
               "re-judges this row on them")
ALT_CACHE = "kernels-default"  # the retrained models' cache, inside the model cache
SEEDS = re.compile(r"over \d+ seeds")

PROBE = """
import json, numpy, torch
rng = numpy.random.default_rng(0)  # the inputs from numpy: torch.randn's own kernels round differently too
a, b = (torch.from_numpy(rng.standard_normal(s).astype(numpy.float32)) for s in ((64, 257), (257, 63)))
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "matmul": (a @ b).flatten().tolist(),
                  "exact": (a.double() @ b.double()).flatten().tolist()}))
"""


def kernel_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a process that runs on the alternative kernels (`base`: default os.environ)."""
    return {**(os.environ if base is None else base), **ALTERNATIVE}


def rounding(env: Mapping[str, str] | None = None) -> dict:
    """A fixed 64 x 257 by 257 x 63 float32 matmul in a subprocess under `env` (default: this environment without
    the alternative's variables): its CPU capability, its values and the float64 product."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k not in ALTERNATIVE}
    out = subprocess.run([sys.executable, "-c", PROBE], env=dict(env), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def on_seeds(claim: Claim) -> bool:
    """The row is measured on the sweep's models: one of its tests is a t-interval over seeds."""
    return any(SEEDS.search(t.interval or "") for _, t in claim.all_tests())


def robustness_line(claim: Claim) -> str:
    """What the row says about the machine: its `robustness` when checked, `NOT_CHECKED` for a row on the sweep's
    models, else '' (a row on exact or simulated quantities, or on a model not trained here)."""
    return claim.robustness or (NOT_CHECKED if on_seeds(claim) else "")


def judged(verdict: str, other: str | None) -> str:
    """The robustness line of a row that read `verdict` and, on the retrained models, `other`."""
    if other is None:
        return f"not checked: the row was not built on the models retrained with {KERNELS}"
    if other == verdict:
        return f"the same verdict ({verdict}) with the sweep's models retrained with {KERNELS}"
    return (f"changes with the machine: {other} (not {verdict}) with the sweep's models retrained with {KERNELS}; "
            "the verdict is at the edge of its interval, and more seeds would settle it")


def alternative_cache(root: Path) -> Path:
    """The cache the retrained models go into: `root`/kernels-default, where every entry of `root` but the trained
    models (the corpus, its tokens, converted models) is a link to `root`'s own, so nothing else is rebuilt."""
    alt = Path(root) / ALT_CACHE
    alt.mkdir(parents=True, exist_ok=True)
    for entry in Path(root).iterdir():
        if entry.name in (ALT_CACHE, "trained") or entry.name.startswith("."):
            continue
        link = alt / entry.name
        if not os.path.lexists(link):
            link.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return alt


@contextlib.contextmanager
def cache_at(root: Path) -> Iterator[None]:
    """POSLENS_CACHE set to `root` inside the block, restored after."""
    old = os.environ.get("POSLENS_CACHE")
    os.environ["POSLENS_CACHE"] = str(root)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("POSLENS_CACHE", None)
        else:
            os.environ["POSLENS_CACHE"] = old


def retrain(cfg: SweepConfig, alt: Path, out: Path, progress: bool = False) -> None:
    """Train the sweep `cfg` into the cache `alt` in a subprocess on the alternative kernels (`poslens sweep`, its
    run directory at `out`)."""
    argv = [sys.executable, "-m", "poslens", "sweep", "--preset", cfg.preset, "--out", str(out), "--force"]
    if cfg.train:
        argv += ["--train", cfg.train]
    if cfg.seeds is not None:
        argv += ["--seeds", ",".join(map(str, cfg.seeds))]
    if not progress:
        argv.append("--quiet")
    subprocess.run(argv, env={**kernel_env(), "POSLENS_CACHE": str(alt)}, check=True,
                   stdout=None if progress else subprocess.DEVNULL)


def check(steps: list, sections: list, make_context, progress: bool = False) -> dict[str, str]:
    """Retrain the sweep of every section with rows on the sweep's models on the alternative kernels, rebuild those
    sections on the retrained models (`make_context()`: a fresh context that draws nothing), and set each such row's
    `robustness` (`judged`); returns {claim id: the verdict on the retrained models}."""
    from poslens.engine.models import cache_root
    from poslens.report.sweep import planned_sweeps

    names = {s.name for s in sections if any(on_seeds(c) for c in s.claims)}
    todo = [(spec, size) for spec, size in steps if spec.name in names]
    if not todo:
        return {}
    alt = alternative_cache(cache_root())
    ctx = make_context()
    Path(ctx.parts).mkdir(parents=True, exist_ok=True)
    for k, cfg in enumerate(planned_sweeps(todo)):  # every matrix those sections read (the leakage's BOS sweep too)
        if progress:
            print(f"  robustness: retraining the sweep {cfg.preset} with {KERNELS}", flush=True)
        retrain(cfg, alt, Path(ctx.parts) / f"sweep-{k}", progress)
    other: dict[str, str] = {}
    with cache_at(alt):
        for spec, size in todo:
            if progress:
                print(f"  robustness: {spec.title} on the retrained models", flush=True)
            other.update({c.id: c.verdict for c in spec.build(ctx, size).claims})
    for s in sections:
        for c in s.claims:
            if on_seeds(c):
                c.robustness = judged(c.verdict, other.get(c.id))
    return other
