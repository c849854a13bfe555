"""`poslens scores MODEL`: averaged attention-score maps of a causal LM over real text (paper Section 5.2).

Pipeline: load the model (poslens.models) -> documents to token sequences (poslens.data) -> the capture
engine (poslens.capture) over batches -> one run directory. Under torchrun every rank takes its shard of
the sequences and the sums are all-reduced; each rank saves its partial sums atomically every
`checkpoint_every` batches and a rerun of the same command resumes from them.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from poslens import plotting
from poslens.checkpoint import load_partial, save_partial
from poslens.errors import UsageError, check_choice, check_int
from poslens.maps import as_numpy, diagonal_normalise, quantile_limits
from poslens.results import check_output, run_directory, write_run

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
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        check_int("seq_len", self.seq_len, 2)
        if self.num_sequences is not None:
            check_int("num_sequences", self.num_sequences, 1)
        check_int("batch_size", self.batch_size, 1)
        check_int("checkpoint_every", self.checkpoint_every, 1)
        check_choice("mode", self.mode, ("first", "pack"))
        check_choice("bos", self.bos, ("auto", "always", "never"))
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise UsageError("device cuda requested but torch sees no GPU; use --device cpu")

    def fingerprint_fields(self) -> dict:
        d = asdict(self)
        d.pop("checkpoint_every")
        d.pop("device")
        return d


def distributed() -> tuple[int, int]:
    """(rank, world_size); initialises torch.distributed under torchrun (gloo on CPU, nccl on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), world


def partial_path(out: Path, rank: int, world: int) -> Path:
    return out.parent / f".{out.name}.partial-{rank}-of-{world}.safetensors"


def run_scores(cfg: ScoresConfig, out: str, force: bool = False, progress: bool = True) -> Path | None:
    """Compute the maps and write the run directory (rank 0); returns its path on rank 0, None elsewhere."""
    from poslens.capture import Capture
    from poslens.data import iter_documents, make_sequences, shard, source_label
    from poslens.models import load_info, load_model, max_positions

    cfg.validate()
    started = time.perf_counter()
    rank, world = distributed()
    target = check_output(out, force) if rank == 0 else Path(out).expanduser().absolute()
    device = cfg.device
    if device == "cuda" and world > 1:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, device=device,
                                  attn_implementation=cfg.attn_implementation, tokenizer=cfg.tokenizer)
    window = max_positions(model)
    if cfg.seq_len > window:
        raise UsageError(f"--seq-len {cfg.seq_len} is beyond the model's window of {window} positions; "
                         f"use --seq-len <= {window}")
    n_layers = model.config.num_hidden_layers
    if cfg.layers and max(cfg.layers) >= n_layers:
        raise UsageError(f"--layers: the model has layers 0..{n_layers - 1}, got {max(cfg.layers)}")
    ids, data_stats = make_sequences(tokenizer, iter_documents(cfg.data, cfg.text_field), cfg.seq_len,
                                     cfg.num_sequences or DEFAULT_SEQUENCES, mode=cfg.mode, bos=cfg.bos,
                                     minimum=1 if cfg.num_sequences is None else None)
    data_stats["source"] = source_label(cfg.data)
    mine = shard(ids, rank, world)
    batches = list(torch.split(mine, cfg.batch_size)) if len(mine) else []
    capture = Capture(model, layers=cfg.layers, per_head=cfg.per_head, probs=cfg.probs, log_probs=cfg.log_probs,
                      hidden_cosine=cfg.hidden_cosine, device=device)
    ckpt = partial_path(target, rank, world)
    fp = {**cfg.fingerprint_fields(), "world": world, "rank": rank}
    done = 0
    resumed = load_partial(ckpt, fp)
    if resumed is not None:
        capture.load_state_dict(resumed[0])
        done = resumed[1]
    context = _no_rope(model) if cfg.no_rope else _null()
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(batches), initial=done, desc="scores", unit="batch")
    with context:
        for b in range(done, len(batches)):
            capture.update(batches[b].to(device))
            if bar is not None:
                bar.update(1)
            if (b + 1) % cfg.checkpoint_every == 0 and b + 1 < len(batches):
                save_partial(ckpt, capture.state_dict(), b + 1, fp)
    if bar is not None:
        bar.close()
    capture.all_reduce()
    result = capture.result()
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


def _no_rope(model):
    from poslens.ablations import no_rope

    return no_rope(model)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def summarise_scores(result: dict) -> dict:
    """Per layer: the typical score scale (1%-99% range) next to the non-relative pattern's size."""
    scores = as_numpy(result["scores"])
    layers = []
    for ell, m in enumerate(scores):
        lo, hi = quantile_limits(m)
        nlo, nhi = quantile_limits(diagonal_normalise(m))
        layers.append({"layer": ell, "score_q01_q99": [lo, hi], "normalised_q01_q99": [nlo, nhi],
                       "normalised_rms": float(np.sqrt(np.nanmean(diagonal_normalise(m) ** 2))),
                       "sink_column_mean": float(np.nanmean(m[1:, 0]))})
    return {"layers": layers}


def figures(result: dict, directory: Path, label: str) -> list[Path]:
    """All layers raw and diagonal-normalised (colour limits at the 1% and 99% quantiles), Figures 11-16 style."""
    scores = as_numpy(result["scores"])
    layer_ids = result.get("layers", torch.arange(len(scores))).tolist()
    titles = [f"layer {i}" for i in layer_ids]
    ncols = min(8, len(scores))
    paths = plotting.save(plotting.map_grid(list(scores), titles, ncols=ncols, limits="quantile",
                                            suptitle=f"{label}: mean pre-softmax scores"), directory, "scores")
    paths += plotting.save(plotting.map_grid(list(diagonal_normalise(scores)), titles, ncols=ncols,
                                             limits="quantile", cmap=plotting.DIVERGING,
                                             suptitle=f"{label}: diagonal-normalised"), directory,
                           "scores_normalised")
    return paths
