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

from poslens import plotting
from poslens.engine.data import BOS_POLICIES, MODES
from poslens.errors import UsageError, check_choice, check_int
from poslens.io.checkpoint import load_partial, save_partial
from poslens.io.results import check_output, sharded_run_directory, write_run
from poslens.maps import as_numpy, diagonal_normalise, quantile_limits
from poslens.options import option

DEFAULT_SEQUENCES = 1000  # the paper's count (Section 5.2)


@dataclass
class ScoresConfig:
    """Everything that determines a `scores` run (recorded in run.json and in the checkpoint fingerprint)."""

    model: str = option(help="hub id, local directory, .gguf file, the alias smollm2-135m, or random:<config.json> "
                        "for a randomly initialised model", positional=True, metavar="MODEL")
    data: str | None = option(None, help="text file, directory of text files, .jsonl, .parquet, or a "
                              "datasets.save_to_disk directory (default: embedded CPython documentation text)")
    text_field: str = option("text", help="field/column holding the text")
    seq_len: int = option(1024, help="tokens per sequence, BOS included")
    num_sequences: int | None = option(None, help="sequences to average over; exactly this many or an error "
                                       f"(default: as many as the text gives, up to {DEFAULT_SEQUENCES})")
    batch_size: int = option(20, help="sequences per forward pass")
    mode: str = option("first", help="first: the first seq-len tokens of each long-enough document (the paper); "
                       "pack: concatenate documents and cut blocks", choices=MODES)
    bos: str = option("auto", help="auto (as the tokenizer does), always, never", choices=BOS_POLICIES)
    layers: list[int] | None = option(None, help="comma-separated layer indices, negatives from the end (default all)")
    per_head: bool = option(False, help="also keep one map per head")
    probs: bool = option(False, help="also keep mean attention probabilities")
    log_probs: bool = option(False, help="also keep mean log-probabilities and log-partitions")
    hidden_cosine: bool = option(False, help="also keep hidden-state cosine-similarity maps")
    no_rope: bool = option(False, help="run the same model with RoPE disabled (ablation)")
    pe: str = option("auto", help="positional encoding of the loaded model: auto (as the checkpoint says; known NoPE "
                     "checkpoints load as NoPE), none (a checkpoint trained without RoPE), rope",
                     choices=("auto", "none", "rope"))
    groups: int | None = option(None, help="independent groups of sequences kept for confidence intervals (batch b "
                                "goes to group b mod G); default 20, fewer if the sums would not fit in a quarter "
                                "of the device's memory (at least 2)")
    dtype: str = option("auto", help="auto (float32 on CPU, the checkpoint's dtype on GPU), float32, bfloat16, "
                        "float16")
    device: str = option("cpu", help="cpu, cuda or cuda:N")
    attn_implementation: str = option("sdpa", help="attention kernel the model is loaded with (the capture engine "
                                      "switches to the kernel it needs while capturing)")
    tokenizer: str | None = option(None, help="tokenizer to use (same forms as MODEL); needed for random: configs "
                                   "without tokenizer files")
    checkpoint_every: int = option(10, help="save partial sums every N batches; rerunning the same command resumes")

    def validate(self) -> None:
        check_int("seq_len", self.seq_len, 2)
        if self.num_sequences is not None:
            check_int("num_sequences", self.num_sequences, 1)
        check_int("batch_size", self.batch_size, 1)
        check_int("checkpoint_every", self.checkpoint_every, 1)
        if self.groups is not None:
            check_int("groups", self.groups, 1)
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
    from poslens.engine.data import iter_documents, make_sequences, shard, shard_bounds, source_label
    from poslens.engine.models import load_model, max_positions, model_record

    cfg.validate()
    started = time.perf_counter()
    rank, world = distributed(cfg.device)
    target = check_output(out, force) if rank == 0 else Path(out).expanduser().absolute()
    device = cfg.device
    if device.startswith("cuda") and world > 1:  # one GPU per process: cuda:LOCAL_RANK
        if device != "cuda":
            raise UsageError(f"device {device}: under torchrun every process uses cuda:LOCAL_RANK; pass cuda")
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    documents = iter_documents(cfg.data, cfg.text_field)
    first_doc = next(documents, None)  # a bad --data fails here, before the model loads
    if first_doc is None:
        raise UsageError(f"--data {cfg.data}: no documents found")
    documents = itertools.chain([first_doc], documents)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, device=device, pe=cfg.pe,
                                  attn_implementation=cfg.attn_implementation, tokenizer=cfg.tokenizer)
    window = max_positions(model)
    if cfg.seq_len > window:
        raise UsageError(f"--seq-len {cfg.seq_len} is beyond the model's window of {window} positions; "
                         f"use --seq-len <= {window}")
    groups = cfg.groups or auto_groups(model, cfg, device)
    capture = Capture(model, layers=cfg.layers, per_head=cfg.per_head, probs=cfg.probs, log_probs=cfg.log_probs,
                      hidden_cosine=cfg.hidden_cosine, device=device, groups=groups)  # checks layers first
    ids, data_stats = make_sequences(tokenizer, documents, cfg.seq_len,
                                     cfg.num_sequences or DEFAULT_SEQUENCES, mode=cfg.mode, bos=cfg.bos,
                                     minimum=1 if cfg.num_sequences is None else None)
    data_stats["source"] = source_label(cfg.data)
    mine = shard(ids, rank, world)
    first_batch = shard_bounds(len(ids), rank, world)[0] // cfg.batch_size  # batch b of the run -> group b mod G
    batches = list(torch.split(mine, cfg.batch_size)) if len(mine) else []
    ckpt = partial_path(target, rank, world)
    fp = {**cfg.fingerprint_fields(), "world": world, "rank": rank}
    done = 0
    resumed = load_partial(ckpt, fp)
    if resumed is not None:
        state, done = resumed
        capture.load_state_dict(state)
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(batches), initial=done, desc="scores", unit="batch")
    with _no_rope(model) if cfg.no_rope else contextlib.nullcontext():
        for b in range(done, len(batches)):
            capture.update(batches[b].to(device), group=first_batch + b)
            if bar is not None:
                bar.update(1)
            if (b + 1) % cfg.checkpoint_every == 0 and b + 1 < len(batches):
                save_partial(ckpt, capture.state_dict(), b + 1, fp)
    if bar is not None:
        bar.close()
    capture.all_reduce()
    result = capture.result()
    result.update(noise_maps(capture))
    with sharded_run_directory(target, force, rank, world, ckpt) as tmp:
        if tmp is not None:
            metrics = summarise_scores(result, capture)
            figures(result, tmp / "figures", cfg.model + (" (RoPE off)" if cfg.no_rope else "")
                    + (" (NoPE)" if cfg.pe == "none" else ""))
            write_run(tmp, result, {"kind": "scores", "config": asdict(cfg), "data": data_stats,
                                    "world_size": world, "resumed_from_batch": done, "metrics": metrics,
                                    "groups": groups,
                                    "model": model_record(model),
                                    "timings": {"seconds": time.perf_counter() - started}})
    return target if rank == 0 else None


def auto_groups(model, cfg: ScoresConfig, device: str, most: int = 20) -> int:
    """How many groups of sums fit: `most`, or fewer so that the sums take at most a quarter of the device's
    memory (at least 2; with fewer than 2 fitting, a UsageError with the estimate and the fix)."""
    from poslens.engine.families import num_layers

    n_layers = len(cfg.layers) if cfg.layers else num_layers(model)
    maps = sum([True, cfg.probs, cfg.log_probs, cfg.hidden_cosine])
    heads = model.config.num_attention_heads if cfg.per_head else 1
    per_group = n_layers * maps * heads * cfg.seq_len**2 * 4
    if str(device).startswith("cuda"):
        free = torch.cuda.mem_get_info(torch.device(device))[1]  # total memory of the GPU
    else:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fits = int(free // 4 // max(per_group, 1))
    if fits < 2:
        raise UsageError(f"the sums of two groups of maps need {2 * per_group / 2**30:.1f} GiB, more than a quarter "
                         f"of {free / 2**30:.0f} GiB; capture fewer layers or maps, a shorter seq_len, or set groups=1 "
                         "(no confidence intervals)")
    return min(most, fits)


def pattern_rms(m: torch.Tensor) -> float:
    """Size of the non-relative pattern of a mean score map: the RMS of its diagonal-normalised entries over keys
    j >= 1 (key 0, the attention sink, is reported on its own; `poslens.maps.diagonal_normalise`)."""
    return float(np.sqrt(np.nanmean(diagonal_normalise(m.numpy())[:, 1:] ** 2)))


def noise_maps(capture) -> dict[str, torch.Tensor]:
    """Per-entry jackknife standard error of the diagonal-normalised score map (`normalised_se`), when the capture
    kept two or more groups of sequences (the raw maps' `scores_se` comes from `Capture.result`)."""
    if "scores" not in capture._keys():
        return {}
    ests = capture.estimate(lambda m: torch.as_tensor(diagonal_normalise(m.numpy())))
    if ests[0].groups < 2:
        return {}
    return {"normalised_se": torch.stack([e.se for e in ests]).float()}


def _no_rope(model):
    from poslens.engine.ablations import no_rope

    return no_rope(model)


def summarise_scores(result: dict, capture=None, level: float = 0.95) -> dict:
    """Per layer: the typical score scale (1%-99% range) next to the non-relative pattern's size, with its
    jackknife interval over groups of sequences and the noise level of the normalised map (when groups >= 2).

    `layer` counts from 1 (the paper's numbering, used in every figure and report); `index` is the 0-based index
    the API and the hook names use.
    """
    scores = as_numpy(result["scores"])
    layer_ids = result["layers"].tolist() if "layers" in result else list(range(len(scores)))
    sizes = capture.estimate(pattern_rms, level=level) if capture is not None and "scores" in capture._keys() else None
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
        if "normalised_se" in result:
            noise = as_numpy(result["normalised_se"][ell])[:, 1:]
            entry["normalised_noise_rms"] = float(np.sqrt(np.nanmean(noise ** 2)))
            entry["scores_se_max"] = float(np.nanmax(as_numpy(result["scores_se"][ell])))
        layers.append(entry)
    return {"layers": layers, "groups": int(result["groups"][0]) if "groups" in result else 1, "level": level}


def figures(result: dict, directory: Path, label: str) -> list[Path]:
    """All layers raw and diagonal-normalised (colour limits at the 1% and 99% quantiles), Figures 11-16 style."""
    layer_ids = result.get("layers", torch.arange(len(result["scores"]))).tolist()
    return plotting.layer_maps(result["scores"], directory, "scores", label, [f"layer {i + 1}" for i in layer_ids],
                               ncols=min(8, len(layer_ids)))
