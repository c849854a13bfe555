"""`poslens scores MODEL`: averaged attention-score maps of a causal LM over real text (paper Section 5.2).

Pipeline: load the model (poslens.engine.models) -> documents to token sequences (poslens.engine.data) -> the capture
engine (poslens.engine.capture) over batches -> one run directory. Under torchrun every rank takes its shard of
the sequences and the sums are all-reduced; each rank saves its partial sums atomically every
`checkpoint_every` batches and a rerun of the same command resumes from them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from poslens.analyses.maps import as_numpy, diagonal_normalise, quantile_limits
from poslens.errors import UsageError, check_choice, check_int
from poslens.io.checkpoint import load_partial, save_partial
from poslens.io.results import check_output, run_directory, write_run
from poslens.report import plotting

DEFAULT_SEQUENCES = 1000  # the paper's count (Section 5.2)


@dataclass
class ScoresConfig:
    """Everything that determines a `scores` run (recorded in run.json and in the checkpoint fingerprint)."""

    model: str
    data: str | None = None
    text_field: str = "text"
    seq_len: int = 1024
    num_sequences: int | None = None  # None: as many as the text gives, up to DEFAULT_SEQUENCES
    batch_size: int = 20
    mode: str = "first"
    bos: str = "auto"
    layers: list[int] | None = None
    per_head: bool = False
    probs: bool = False
    log_probs: bool = False
    hidden_cosine: bool = False
    no_rope: bool = False
    dtype: str = "auto"
    device: str = "cpu"
    attn_implementation: str = "sdpa"
    tokenizer: str | None = None
    checkpoint_every: int = 10

    def validate(self) -> None:
        check_int("seq_len", self.seq_len, 2)
        if self.num_sequences is not None:
            check_int("num_sequences", self.num_sequences, 1)
        check_int("batch_size", self.batch_size, 1)
        check_int("checkpoint_every", self.checkpoint_every, 1)
        from poslens.engine.data import BOS_POLICIES, MODES
        from poslens.engine.models import check_device

        check_choice("mode", self.mode, MODES)
        check_choice("bos", self.bos, BOS_POLICIES)
        check_device(self.device)

    def fingerprint_fields(self) -> dict:
        d = asdict(self)
        d.pop("checkpoint_every")
        d.pop("device")
        return d


def distributed(device: str = "cpu") -> tuple[int, int]:
    """(rank, world_size); initialises torch.distributed under torchrun (gloo for --device cpu, nccl for cuda)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if cuda and local > torch.cuda.device_count():
        raise UsageError(f"torchrun started {local} processes on this node but torch sees "
                         f"{torch.cuda.device_count()} GPU(s); use --nproc-per-node {torch.cuda.device_count()}")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return dist.get_rank(), world


def partial_path(out: Path, rank: int, world: int) -> Path:
    return out.parent / f".{out.name}.partial-{rank}-of-{world}.safetensors"


def run_scores(cfg: ScoresConfig, out: str, force: bool = False, progress: bool = True) -> Path | None:
    """Compute the maps and write the run directory (rank 0); returns its path on rank 0, None elsewhere."""
    from poslens.engine.capture import Capture
    from poslens.engine.data import iter_documents, make_sequences, shard, source_label
    from poslens.engine.models import load_info, load_model, max_positions

    cfg.validate()
    started = time.perf_counter()
    rank, world = distributed(cfg.device)
    target = check_output(out, force) if rank == 0 else Path(out).expanduser().absolute()
    device = cfg.device
    if device == "cuda" and world > 1:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    documents = iter_documents(cfg.data, cfg.text_field)
    first_doc = next(documents, None)  # a bad --data fails here, before the model loads
    if first_doc is None:
        raise UsageError(f"--data {cfg.data}: no documents found")
    documents = itertools.chain([first_doc], documents)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, device=device,
                                  attn_implementation=cfg.attn_implementation, tokenizer=cfg.tokenizer)
    window = max_positions(model)
    if cfg.seq_len > window:
        raise UsageError(f"--seq-len {cfg.seq_len} is beyond the model's window of {window} positions; "
                         f"use --seq-len <= {window}")
    capture = Capture(model, layers=cfg.layers, per_head=cfg.per_head, probs=cfg.probs, log_probs=cfg.log_probs,
                      hidden_cosine=cfg.hidden_cosine, device=device)  # checks --layers before any tokenising
    ids, data_stats = make_sequences(tokenizer, documents, cfg.seq_len,
                                     cfg.num_sequences or DEFAULT_SEQUENCES, mode=cfg.mode, bos=cfg.bos,
                                     minimum=1 if cfg.num_sequences is None else None)
    data_stats["source"] = source_label(cfg.data)
    mine = shard(ids, rank, world)
    batches = list(torch.split(mine, cfg.batch_size)) if len(mine) else []
    ckpt = partial_path(target, rank, world)
    fp = {**cfg.fingerprint_fields(), "world": world, "rank": rank}
    half_at = len(batches) // 2  # split-half error bars: the sums after the first half of this rank's batches
    done, half = 0, None
    resumed = load_partial(ckpt, fp)
    if resumed is not None:
        state, done = resumed
        half = {k[5:]: v for k, v in state.items() if k.startswith("half/")} or None
        capture.load_state_dict({k: v for k, v in state.items() if not k.startswith("half/")})
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(batches), initial=done, desc="scores", unit="batch")
    with (_no_rope(model) if cfg.no_rope else contextlib.nullcontext()), capture:
        for b in range(done, len(batches)):
            capture.update(batches[b].to(device))
            if bar is not None:
                bar.update(1)
            if b + 1 == half_at:
                half = capture.state_dict()
            if (b + 1) % cfg.checkpoint_every == 0 and b + 1 < len(batches):
                extra = {f"half/{k}": v for k, v in (half or {}).items()}
                save_partial(ckpt, {**capture.state_dict(), **extra}, b + 1, fp)
    if bar is not None:
        bar.close()
    result = reduce_with_halves(capture, half, world)
    path = None
    if rank == 0:
        with run_directory(target, force) as tmp:
            metrics = summarise_scores(result)
            figures(result, tmp / "figures", cfg.model + (" (RoPE off)" if cfg.no_rope else ""))
            write_run(tmp, result, {"kind": "scores", "config": asdict(cfg), "data": data_stats,
                                    "world_size": world, "resumed_from_batch": done, "metrics": metrics,
                                    "model": {"class": type(model).__name__,
                                              "model_type": getattr(model.config, "model_type", None),
                                              **load_info(model)},
                                    "timings": {"seconds": time.perf_counter() - started}})
        path = target
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    ckpt.unlink(missing_ok=True)
    return path


def _subtract(a: dict, b: dict) -> dict:
    """Capture state a - b (sums and counts are additive; windows and layer ids are not)."""
    return {k: (a[k] if k in ("sliding_window", "layers") else a[k] - b[k]) for k in a}


def reduce_with_halves(capture, half: dict | None, world: int) -> dict:
    """All-reduce the sums over ranks and return the means, plus split-half noise maps when there are halves.

    The sequences split into two halves (each rank's first and second half of batches); with m1, m2 the two
    halves' mean maps, |m1 - m2| / 2 estimates the standard error of their average (`scores_noise`). The
    noise of the diagonal-normalised map is kept the same way (`normalised_noise`).
    """
    if world > 1 and half is not None:
        full = capture.state_dict()
        capture.load_state_dict(half)
        capture.all_reduce()
        half = capture.state_dict()
        capture.load_state_dict(full)
    capture.all_reduce()
    result = capture.result()
    if half is None or int(half["count"].min()) == 0:
        return result
    full = capture.state_dict()
    capture.load_state_dict(half)
    first = capture.result()
    capture.load_state_dict(_subtract(full, half))
    second = capture.result()
    capture.load_state_dict(full)
    result["scores_noise"] = (first["scores"] - second["scores"]).abs() / 2
    result["normalised_noise"] = torch.as_tensor(
        np.abs(diagonal_normalise(first["scores"]) - diagonal_normalise(second["scores"])) / 2, dtype=torch.float32)
    return result


def _no_rope(model):
    from poslens.engine.ablations import no_rope

    return no_rope(model)


def summarise_scores(result: dict) -> dict:
    """Per layer: the typical score scale (1%-99% range) next to the non-relative pattern's size."""
    scores = as_numpy(result["scores"])
    layer_ids = result["layers"].tolist() if "layers" in result else list(range(len(scores)))
    layers = []
    for ell, m in enumerate(scores):
        lo, hi = quantile_limits(m)
        normalised = diagonal_normalise(m)
        nlo, nhi = quantile_limits(normalised)
        entry = {"layer": int(layer_ids[ell]), "score_q01_q99": [lo, hi], "normalised_q01_q99": [nlo, nhi],
                 # key 0 (the attention sink) is reported on its own
                 "normalised_rms": float(np.sqrt(np.nanmean(normalised[:, 1:] ** 2))),
                 "sink_column_mean": float(np.nanmean(m[1:, 0]))}
        if "normalised_noise" in result:
            noise = as_numpy(result["normalised_noise"][ell])[:, 1:]
            entry["normalised_noise_rms"] = float(np.sqrt(np.nanmean(noise ** 2)))
            entry["scores_noise_max"] = float(np.nanmax(as_numpy(result["scores_noise"][ell])))
        layers.append(entry)
    return {"layers": layers}


def figures(result: dict, directory: Path, label: str) -> list[Path]:
    """All layers raw and diagonal-normalised (colour limits at the 1% and 99% quantiles), Figures 11-16 style."""
    layer_ids = result.get("layers", torch.arange(len(result["scores"]))).tolist()
    return plotting.layer_maps(result["scores"], directory, "scores", label, [f"layer {i}" for i in layer_ids],
                               ncols=min(8, len(layer_ids)))
