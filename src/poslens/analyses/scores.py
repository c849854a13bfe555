"""`poslens scores MODEL`: averaged attention-score maps of a causal LM over real text (Kim et al. 2025, Section 5.2).

One statistic on the analysis pipeline (`poslens.engine.pipeline`): the capture engine (`Capture`) over the
sequences, optionally with RoPE removed for the pass (`--no-rope`, an ablation of a RoPE model). The summary gives
per layer the score range next to the size of the non-relative pattern, with its jackknife interval over groups
of sequences and the noise level of the diagonal-normalised map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from poslens.engine.config import ModelData
from poslens.engine.pipeline import Analysis, Job, Output, Pass, run_analysis
from poslens.errors import check_int, require
from poslens.maps import as_numpy, diagonal_normalise, quantile_limits
from poslens.options import option


@dataclass
class ScoresConfig(ModelData):
    """Everything that determines a `scores` run (recorded in run.json and in the checkpoint fingerprint)."""

    layers: list[int] | None = option(None, help="comma-separated layer indices, negatives from the end (default all)")
    per_head: bool = option(False, help="also keep one map per head")
    probs: bool = option(False, help="also keep mean attention probabilities")
    log_probs: bool = option(False, help="also keep mean log-probabilities and log-partitions")
    hidden_cosine: bool = option(False, help="also keep hidden-state cosine-similarity maps")
    no_rope: bool = option(False, help="run the same model with RoPE disabled (ablation)")

    def validate(self) -> None:
        super().validate()
        require(not (self.no_rope and self.pe == "rope"), "pe rope keeps RoPE and no_rope removes it: give one of "
                                                           "them")


class Scores(Analysis):
    """The scores analysis: one pass of `Capture`."""

    kind = "scores"

    def configure(self, job: Job) -> None:
        """no_rope: RoPE removed from the loaded model for the whole run (as pe none), so that run.json's model
        record says what ran."""
        if job.config.no_rope:
            from poslens.engine.families import rotary_modules, set_positional_encoding

            require(bool(rotary_modules(job.model)), f"no_rope: {type(job.model).__name__} has no rotary embedding "
                                                     "module to disable")
            set_positional_encoding(job.model, "none")

    def check(self, job: Job) -> None:
        n = job.hm.n_layers
        for layer in job.config.layers or []:
            check_int("layers", layer, -n, n - 1)

    def memory(self, job: Job) -> dict[str, tuple[float, str]]:
        from poslens.engine.families import num_layers

        cfg = job.config
        n_layers = len(cfg.layers) if cfg.layers else num_layers(job.model)
        maps = sum([True, cfg.probs, cfg.log_probs, cfg.hidden_cosine])
        heads = job.model.config.num_attention_heads if cfg.per_head else 1
        return {"grouped sums of the maps": (cfg.groups * n_layers * maps * heads * cfg.seq_len ** 2 * 4, "groups")}

    def passes(self, job: Job) -> list[Pass]:
        from poslens.engine.capture import Capture

        cfg = job.config
        maps = Capture(job.model, cfg.layers, per_head=cfg.per_head, probs=cfg.probs, log_probs=cfg.log_probs,
                       hidden_cosine=cfg.hidden_cosine, device=job.dist.device, groups=job.groups)
        return [Pass("scores", [maps])]

    def finish(self, job: Job, passes: list[Pass]) -> Output:
        maps = passes[0].statistics[0]
        result = maps.result(level=job.config.level)
        result.update(noise_maps(maps))
        return Output(result, summarise_scores(result, maps, job.config.level))

    def figures(self, job: Job, output: Output, directory: Path) -> list[Path]:
        return figures(output.tensors, directory, job.label + (" (RoPE off)" if job.config.no_rope else ""))


SCORES = Scores()


def run_scores(cfg: ScoresConfig, out: str | Path, force: bool = False, progress: bool = True) -> Path | None:
    """Compute the maps and write the run directory `out`; returns its path (on rank 0; None on other ranks)."""
    return run_analysis(SCORES, cfg, out, force=force, progress=progress)


def pattern_rms(m: torch.Tensor) -> float:
    """Size of the non-relative pattern of a mean score map: the RMS of its diagonal-normalised entries over keys
    j >= 1 (key 0, the attention sink, is reported on its own; `poslens.maps.diagonal_normalise`)."""
    return float(np.sqrt(np.nanmean(diagonal_normalise(m.numpy())[:, 1:] ** 2)))


def noise_maps(capture) -> dict[str, torch.Tensor]:
    """Per-entry jackknife standard error of the diagonal-normalised score map (`normalised_se`), when the capture
    kept two or more groups of sequences (the raw maps' `scores_se` comes from `Capture.result`)."""
    if "scores" not in capture.keys():
        return {}
    ests = capture.estimate(lambda m: torch.as_tensor(diagonal_normalise(m.numpy())))
    if ests[0].groups < 2:
        return {}
    return {"normalised_se": torch.stack([e.se for e in ests]).float()}


def summarise_scores(result: dict, capture=None, level: float = 0.95) -> dict:
    """Per layer: the typical score scale (1%-99% range) next to the non-relative pattern's size, with its
    jackknife interval over groups of sequences (cut at 0) and the noise level of the normalised map (when groups >= 2).

    `layer` counts from 1 (the paper's numbering, used in every figure and report); `index` is the 0-based index
    the API and the hook names use.
    """
    scores = as_numpy(result["scores"])
    layer_ids = result["layers"].tolist() if "layers" in result else list(range(len(scores)))
    sizes = (capture.estimate(pattern_rms, level=level, keep_replicates=True, support=(0.0, math.inf))  # an RMS
             if capture is not None and "scores" in capture.keys() else None)
    layers = []
    for ell, m in enumerate(scores):
        lo, hi = quantile_limits(m)
        normalised = diagonal_normalise(m)
        nlo, nhi = quantile_limits(normalised)
        entry = {"layer": int(layer_ids[ell]) + 1, "index": int(layer_ids[ell]),
                 "score_q01_q99": [lo, hi], "normalised_q01_q99": [nlo, nhi],
                 # key 0 (the attention sink) is reported on its own
                 "normalised_rms": float(np.sqrt(np.nanmean(normalised[:, 1:] ** 2))),
                 "sink_column_mean": float(np.nanmean(m[1:, 0]))}
        if sizes is not None and sizes[ell].groups >= 2:
            entry["normalised_rms_ci"] = sizes[ell].item()
            # leave-one-group-out values: another model's run on the same groups pairs with this one through them
            entry["normalised_rms_replicates"] = sizes[ell].replicates.tolist()
        if "normalised_se" in result:
            noise = as_numpy(result["normalised_se"][ell])[:, 1:]
            entry["normalised_noise_rms"] = float(np.sqrt(np.nanmean(noise ** 2)))
            entry["scores_se_max"] = float(np.nanmax(as_numpy(result["scores_se"][ell])))
        layers.append(entry)
    return {"layers": layers, "groups": int(result["groups"][0]) if "groups" in result else 1, "level": level}


def noise_text(m: dict) -> str:
    """What is printed beside a layer's non-relative pattern: its rms, the confidence interval of that rms when
    the metrics carry one ({"value", "lo", "hi"[, "level"]} under a key starting "normalised_rms"), and the
    noise rms of the normalised map (an rms of pure noise is positive, so the interval alone cannot say that a
    pattern is resolved; the noise level beside it can)."""
    parts = [f"rms {m['normalised_rms']:.3f}"] if "normalised_rms" in m else []
    for key, v in m.items():
        if key.startswith("normalised_rms") and isinstance(v, dict) and {"value", "lo", "hi"} <= v.keys():
            level = f"{100 * v['level']:g}% " if "level" in v else ""
            parts.append(f"{level}interval [{v['lo']:.3f}, {v['hi']:.3f}]")
            break
    if "normalised_noise_rms" in m:
        parts.append(f"noise rms {m['normalised_noise_rms']:.3f}")
    elif len(parts) < 2:
        parts.append("no noise estimate (one batch)")
    return ", ".join(parts)


def summary_lines(meta: dict) -> list[str]:
    """What `poslens scores` prints: one line per layer (score range, non-relative pattern and its noise)."""
    lines = []
    for m in meta["metrics"]["layers"]:
        lo, hi = m["score_q01_q99"]
        nlo, nhi = m["normalised_q01_q99"]
        lines.append(f"layer {m['layer']}: scores [{lo:+.2f}, {hi:+.2f}]  non-relative pattern [{nlo:+.3f}, "
                     f"{nhi:+.3f}] ({noise_text(m)})")
    return lines


def figures(result: dict, directory: Path, label: str) -> list[Path]:
    """All layers raw and diagonal-normalised (colour limits at the 1% and 99% quantiles), Figures 11-16 style."""
    from poslens import plotting

    layer_ids = result.get("layers", torch.arange(len(result["scores"]))).tolist()
    return plotting.layer_maps(result["scores"], directory, "scores", label, [f"layer {i + 1}" for i in layer_ids],
                               ncols=min(8, len(layer_ids)))
