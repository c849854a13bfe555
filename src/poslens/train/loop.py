"""The training loop of `poslens train`, nanoGPT-style: AdamW, cosine schedule with warm-up, gradient
accumulation and clipping, bf16 autocast on GPU, held-out loss, checkpoints, resume, DDP and FSDP2.

One process, or any number under ``torchrun`` (RANK/WORLD_SIZE/LOCAL_RANK in the environment): gloo on
the CPU, NCCL on GPUs. The run writes into ``.NAME.partial/`` beside `out` (checkpoint + metrics.jsonl),
resumes from there when restarted with the same configuration, and renames the finished model into
`out` (a ``save_pretrained`` directory that is also a poslens run directory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from poslens.engine.distributed import Dist, setup
from poslens.errors import UsageError, check_int, require
from poslens.io.bars import library_bars
from poslens.subnormals import subnormals_flushed
from poslens.train import checkpoint as ckpt
from poslens.train.config import TrainConfig
from poslens.train.data import (
    PAD,
    counted_rows,
    eval_batches,
    eval_block_count,
    loss_shares,
    num_blocks,
    train_batches,
)
from poslens.train.model import (
    build_model,
    causal_attention,
    check_compatible,
    check_memory_fits,
    count_parameters,
    flops_per_token,
)
from poslens.train.tokens import TokenFile, default_tokens, open_tokens

# bf16 dense datasheet peaks (FLOP/s) used for MFU on known GPUs
GPU_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


# ---------------------------------------------------------------- schedule and optimizer


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate after `step` updates: linear warm-up to cfg.lr, then cosine down to min_lr_ratio * lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    floor = cfg.min_lr_ratio * cfg.lr
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains are not decayed); torch's fused kernel when every
    parameter is a plain CUDA tensor (one kernel per step instead of one per tensor group: the same update up to
    float32 rounding, the same state dict), the default multi-tensor kernel otherwise (CPU, FSDP2's sharded ones)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.is_cuda and not isinstance(p, DTensor) for p in params)
    return adamw([p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2], cfg, fused=fused)


def adamw(decay: list[torch.Tensor], rest: list[torch.Tensor], cfg: TrainConfig,
          fused: bool = False) -> torch.optim.AdamW:
    """AdamW of `cfg` over two groups: `decay` (weight decay) and `rest` (none), in this order; `fused`: torch's
    fused kernel (one pass per tensor; the same update up to float32 rounding, the same state dict)."""
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=fused or None)


def make_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule of `lr_at` as a LambdaLR (factor of the peak rate)."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, cfg) / cfg.lr)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `logits` [B, T, V] against `targets` [B, T], the log-softmax in float32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=PAD)


@functools.cache
def compiled_cross_entropy() -> Any:
    """`cross_entropy` compiled: one fused kernel reads the bf16 logits (no float32 copy of [B, T, V] in memory)."""
    return torch.compile(cross_entropy)


def next_token_loss(model: torch.nn.Module, block: torch.Tensor, compiled: bool = False) -> torch.Tensor:
    """Mean cross-entropy of predicting block[:, 1:] from block[:, :-1] (implicit causal mask) over the counted
    targets: a padded one (`data.PAD`, after a document shorter than a document-start block) is not counted, and a
    padded input reads as token 0, after every counted target of its row (so no counted prediction sees it);
    `compiled`: the loss through `compiled_cross_entropy` (with a compiled model)."""
    logits = model(input_ids=block[:, :-1].clamp(min=0)).logits
    return (compiled_cross_entropy() if compiled else cross_entropy)(logits, block[:, 1:])


# ---------------------------------------------------------------- processes and devices


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    """The FLOP/s that MFU is measured against: the bf16 datasheet peak of a known GPU, else None."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAKS.items():
            if key in name:
                return peak, f"{key} bf16 datasheet"
    return None, "unknown"


@functools.cache  # measured once per process and device: a second train() reuses it
def gemm_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int | None = None,
               seconds: float = 1.0) -> float:
    """The MFU reference where no datasheet peak is known (a CPU, an unknown GPU): a fair upper GEMM rate (FLOP/s).

    The best of many short timed trials of an n x n GEMM (n = 1024 on a CPU, 4096 on a GPU), after one
    untimed call, for about `seconds` (1.1-1.3 s in all on the 2-core development CPU). On a CPU the
    trials run on one thread and the best rate is multiplied by torch's thread count: every thread at
    the rate of one undisturbed core, an upper rate since GEMMs scale at most linearly over cores.

    The former reference (one 0.3 s average of a 2-thread 1024 GEMM) measured the load as much as the
    hardware: on a shared machine another process holds a core for much of any window, and one
    preempted OpenMP thread stalls the other. On the 2-core CPU beside another 2-thread job it read
    55-65 GFLOP/s, and even the best of 2-thread 2048 GEMMs read 78-85 while `tiny` training steps that
    met a quiet moment ran at 94 (120% MFU). One thread's best needs only one free core now and then:
    90-96, so 185-195 on 2 threads; quiet, the same machine gave 2-thread 2048 GEMMs 182-188 and the
    `cpu` preset's largest GEMMs (LM head, 4080 x 256 x 4096, and its backward) at most 176.
    The inputs come from a private generator (the global RNG is left alone).
    """
    cpu = device.type == "cpu"
    threads = torch.get_num_threads() if cpu else 1
    n = n or (1024 if cpu else 4096)
    gen = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)

    def timed(reps: int) -> float:  # seconds per call
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        if not cpu:
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / reps

    if cpu:
        torch.set_num_threads(1)
    try:
        timed(1)  # warm-up: thread pool, packing buffers, cuBLAS handle
        best = timed(1)
        reps = max(1, round(0.02 / best))  # calls per trial: 1 on a CPU, several on a GPU
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            best = min(best, timed(reps))
    finally:
        if cpu:
            torch.set_num_threads(threads)
    return threads * 2.0 * n**3 / best


# ---------------------------------------------------------------- the run


@dataclasses.dataclass
class Work:
    """The resumable work directory beside `out`: checkpoint/ and metrics.jsonl."""

    path: Path

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"


def work_directory(out: Path) -> Work:
    return Work(out.parent / f".{out.name}.partial")


def _tokens(cfg: TrainConfig, d: Dist, progress: bool) -> TokenFile:
    if cfg.tokens is not None:
        return open_tokens(cfg.tokens)
    if d.main:
        default_tokens(cfg.tokenizer, progress=progress)
    d.barrier()
    return open_tokens(default_tokens(cfg.tokenizer, progress=False))


def _wrap(model: torch.nn.Module, cfg: TrainConfig, d: Dist) -> torch.nn.Module:
    if d.world > 1 and cfg.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    if cfg.compile:
        causal_attention(model)  # no explicit causal mask under compile: SDPA's causal kernels
        model.compile()
    if d.world > 1 and cfg.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    return model


def _full_state(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: TrainConfig,
                d: Dist) -> tuple[dict | None, dict]:
    """Model weights (None: take them from the module) and optimizer state, gathered whole on every rank."""
    if d.world > 1 and cfg.parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights, optim = get_state_dict(model, opt, options=opts)
        weights.pop("lm_head.weight", None)  # tied to the embedding, as save_pretrained writes it
        return weights, optim
    return None, opt.state_dict()


def _optimizer_format(cfg: TrainConfig, d: Dist) -> str:
    """How the optimizer state is keyed: FSDP's full state dict (parameter names) or torch's (indices)."""
    return "fsdp-full" if d.world > 1 and cfg.parallel == "fsdp" else "plain"


def _load_optimizer(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict, cfg: TrainConfig,
                    d: Dist) -> None:
    if d.world > 1 and cfg.parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, opt, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))
    else:
        opt.load_state_dict(state)


def attention_kernel(cfg: TrainConfig) -> contextlib.AbstractContextManager:
    """The attention kernel `cfg.attention` names for every scaled_dot_product_attention call inside (compiled
    graphs take it when they are traced); "auto": torch's own choice."""
    if cfg.attention == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[cfg.attention])


def check_attention(cfg: TrainConfig, device: torch.device) -> None:
    """One-line UsageError, before any work, if the kernel `cfg.attention` names cannot run this model's attention
    on `device` (probed on a tiny input under the step's own autocast, with a mask where a sliding window needs
    one)."""
    if cfg.attention == "auto":
        return
    q = torch.zeros(1, 1, 4, 8, device=device)
    mask = torch.ones(4, 4, dtype=torch.bool, device=device).tril() if cfg.sliding_window else None
    try:
        with _autocast(cfg, device), attention_kernel(cfg):
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=mask is None)
    except RuntimeError:
        raise UsageError(f"attention {cfg.attention!r}: torch has no such kernel for this model on {device.type} "
                         "(a sliding window needs a mask, which the flash kernel does not take; some kernels exist "
                         "on GPUs only); choose another kernel or auto") from None


def _autocast(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    precision = cfg.precision if cfg.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _mean_over_ranks(x: torch.Tensor, d: Dist) -> float:
    if d.world > 1:
        dist.all_reduce(x)
        x = x / d.world
    return float(x)


def check_batch(batch_size: int, micro_batch: int, world: int) -> int:
    """Micro-batches per rank per step; one-line error unless the global batch splits evenly over ranks and
    into equal micro-batches (so the mean of micro-batch means is the global mean)."""
    require(batch_size % world == 0, f"batch_size ({batch_size}) does not divide over {world} ranks; use a "
                                     "multiple of the number of processes")
    per_rank = batch_size // world
    require(per_rank <= micro_batch or per_rank % micro_batch == 0,
            f"batch_size / ranks ({per_rank}) must be a multiple of micro_batch ({micro_batch}); change "
            "--batch-size or --micro-batch")
    return max(1, per_rank // micro_batch)


def bos_id(cfg: TrainConfig, tf: TokenFile) -> int | None:
    """The id every sequence starts with when `cfg.bos` (the token directory's BOS), else None."""
    return tf.bos_id("training with bos") if cfg.bos else None


def document_separator(cfg: TrainConfig, tf: TokenFile) -> int | None:
    """With document-start blocks (`cfg.blocks`), the token that ends every document of the stream; else None
    (packed cuts). `poslens.train.data` takes it as `separator`."""
    return tf.separator_id if cfg.blocks == "doc-start" else None


def evaluate(model: torch.nn.Module, tf: TokenFile, cfg: TrainConfig, d: Dist) -> float:
    """Held-out loss: mean next-token cross-entropy over the first eval_batches x micro_batch validation blocks."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=d.device)
    with torch.no_grad(), _autocast(cfg, d.device), attention_kernel(cfg):
        for block in eval_batches(tf.val, cfg.seq_len, cfg.eval_batches * cfg.micro_batch, cfg.micro_batch,
                                  d.rank, d.world, bos_id(cfg, tf), document_separator(cfg, tf)):
            rows = counted_rows(block)  # the block's rows, less its padded targets
            block = block.to(d.device)
            total[0] += next_token_loss(model, block).double() * rows
            total[1] += rows
    if d.world > 1:
        dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


# what a checkpoint records of its token directory, and a resume must find again: a directory rebuilt at the same path
# from other text, or split otherwise, differs in its counts, split and (written by tokenize since 2026-11-30) the
# SHA-256 of its .bin files
TOKENS_IDENTITY = ("vocab_size", "source", "tokenizer", "train", "val", "val_fraction", "seed", "sha256")


def check_training_data(cfg: TrainConfig, tf: TokenFile) -> dict[str, Any]:
    """One-line errors for token files too short for one batch or one held-out sequence; returns the token file's
    identity as a checkpoint records it (`TOKENS_IDENTITY`: the fields its header has)."""
    bos, separator = bos_id(cfg, tf), document_separator(cfg, tf)
    n_train = num_blocks(tf.train, cfg.seq_len, bos, separator)
    what = "documents" if separator is not None else f"sequences of seq_len {cfg.seq_len}"
    require(n_train >= cfg.batch_size, f"the training tokens ({len(tf.train)}) hold {n_train} {what}, fewer than "
                                       f"one batch ({cfg.batch_size}); use more text, a shorter --seq-len or a "
                                       "smaller --batch-size")
    eval_batches(tf.val, cfg.seq_len, 1, 1, 0, 1, bos, separator)  # fails early when the held-out text is too short
    return {k: tf.header[k] for k in TOKENS_IDENTITY if k in tf.header}


def resume_state(work: Work, model: torch.nn.Module, cfg: TrainConfig, header: dict[str, Any],
                 fmt: str) -> tuple[int, dict[str, Any] | None]:
    """The step and trainer state of the newest checkpoint in `work`, its weights loaded into `model`; (0, None)
    without one. One-line errors for a checkpoint of another configuration, token file (`header`) or optimizer
    format `fmt`."""
    found = ckpt.find(work.path)
    if found is None:
        return 0, None
    trainer = ckpt.load_trainer(found)
    check_compatible(trainer["config"], cfg, f"checkpoint {found}")
    recorded = trainer["tokens"]  # a checkpoint of an earlier poslens records fewer fields: compared on those
    differ = sorted(k for k in set(recorded) | set(header) if k in recorded and recorded.get(k) != header.get(k))
    require(not differ, f"checkpoint {found} was trained on other tokens ({', '.join(differ)} differ: the token "
                        "directory was rebuilt or replaced since); delete it or choose another --out")
    require(trainer.get("optimizer_format") == fmt, f"checkpoint {found} holds a {trainer.get('optimizer_format')} "
                                                    f"optimizer state and this run needs {fmt}; resume with the "
                                                    "same --parallel (fsdp under torchrun, or not)")
    ckpt.load_weights(found, model)
    return int(trainer["step"]), trainer


class _Stopped(Exception):
    """Raised to leave the run directory without placing it (stop_after reached); carries the metrics."""

    def __init__(self, metrics: dict[str, Any]):
        super().__init__("stopped")
        self.metrics = metrics


def train(cfg: TrainConfig, out: str | os.PathLike, force: bool = False, progress: bool = True,
          stop_after: int | None = None, label: str | None = None) -> dict[str, Any]:
    """Train `cfg` and write the finished model into `out`; returns the final metrics.

    The output is built with `poslens.io.results.open_run` (rank 0 holds its lock): checkpoints and
    metrics.jsonl live in its work directory ``.OUT.partial/``, so a run restarted with the same
    configuration resumes from the last checkpoint and follows the uninterrupted trajectory.
    `stop_after`: stop (as if interrupted) after that many steps, leaving checkpoint and metrics behind. A run that
    fails before its first checkpoint leaves nothing behind. `label`: what the progress bar calls the run.
    """
    from poslens.io.results import open_run

    cfg.check()
    if stop_after is not None:
        check_int("stop_after", stop_after, 1)
    d = setup(cfg.device)
    target = Path(os.path.abspath(os.path.expanduser(os.fspath(out))))
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(library_bars(progress))  # save_pretrained's "Writing model shards" bars
            # rank 0 checks the output and cleans leftovers, its refusal raised on every rank; an --out equal to
            # the token directory or containing it is refused, and a preset file is an input too
            preset = cfg.preset if cfg.preset.endswith(".json") else None
            run = d.first(lambda: stack.enter_context(open_run(target, force, inputs=[cfg.tokens, preset])))
            work, build = (Work(run.work), run.build) if d.main else (work_directory(target), None)
            try:
                with subnormals_flushed(d.device):
                    return _train(cfg, d, work, build, progress, stop_after, label)
            except BaseException as e:
                if d.main and not isinstance(e, _Stopped) and ckpt.find(work.path) is None:
                    _discard_metrics(work)  # nothing to resume from: leave no trace of the failed run
                raise
    except _Stopped as stopped:
        return stopped.metrics


def _train(cfg: TrainConfig, d: Dist, work: Work, build: Path | None, progress: bool,
           stop_after: int | None, label: str | None) -> dict[str, Any]:
    check_batch(cfg.batch_size, cfg.micro_batch, d.world)
    tf = _tokens(cfg, d, progress)
    header = check_training_data(cfg, tf)
    check_memory_fits(cfg, tf.vocab_size, d.device, d.world)
    check_attention(cfg, d.device)

    model = build_model(cfg, tf.vocab_size, bos_token_id=tf.header["bos_token_id"],
                        eos_token_id=tf.header["eos_token_id"])
    start, trainer = resume_state(work, model, cfg, header, _optimizer_format(cfg, d))
    model.to(d.device)
    raw = model
    model = _wrap(model, cfg, d)  # FSDP2 swaps in sharded parameters: the optimizer must come after
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg)
    if trainer is not None:
        _load_optimizer(raw, opt, trainer["optimizer"], cfg, d)
        sched.load_state_dict(trainer["scheduler"])
        ckpt.set_rng_state(trainer["rng"])

    if d.main:
        _truncate_metrics(work.metrics, start)
    d.barrier()
    tokenizer = tf.tokenizer() if d.main else None
    if tokenizer is not None and cfg.bos:
        tokenizer.add_bos_token = True  # the saved model's tokenizer starts every text with BOS, as in training
    fpt = flops_per_token(raw.config, cfg.seq_len)
    peak, peak_label = peak_flops(d.device)
    if peak is None:
        peak, peak_label = gemm_flops(d.device), "measured float32 GEMM"
    params = count_parameters(raw)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    writer = _tensorboard(work.path) if cfg.tensorboard and d.main else None
    log = work.metrics.open("a") if d.main else None

    def record(row: dict[str, Any]) -> None:
        if log is not None:
            log.write(json.dumps(row) + "\n")
            log.flush()
            if writer is not None:
                for k, v in row.items():
                    if k != "step" and isinstance(v, (int, float)):
                        writer.add_scalar(k, v, row["step"])

    from tqdm.auto import tqdm

    what = label or f"training {cfg.preset} ({cfg.positional_encoding().label()}, {params['total'] / 1e6:.1f}M params)"
    bar = tqdm(total=cfg.steps, initial=start, desc=what, disable=not (progress and d.main), unit="step")
    last: dict[str, Any] = {}
    stepped = 0.0  # seconds in the optimizer steps this process ran (evaluation and saving left out)
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    model.train()
    try:
        if start == 0:
            with oom_hint(cfg):
                record({"step": 0, "eval_loss": evaluate(model, tf, cfg, d)})
        for step in range(start, end):
            t0 = time.perf_counter()
            loss, gnorm = _step(model, opt, sched, tf, cfg, d, step, first=step == start)
            if d.device.type == "cuda":
                torch.cuda.synchronize(d.device)
            dt = time.perf_counter() - t0
            stepped += dt
            tps = tokens_per_step / dt
            mfu = tps * fpt / (peak * d.world)
            last = {"step": step + 1, "loss": loss, "lr": sched.get_last_lr()[0], "grad_norm": gnorm,
                    "tokens_per_s": tps, "mfu": mfu, "step_s": dt}
            record(last)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{100 * mfu:.1f}%")
            bar.update(1)
            done = step + 1
            if done % cfg.eval_every == 0 or done == cfg.steps:
                last["eval_loss"] = evaluate(model, tf, cfg, d)
                record({"step": done, "eval_loss": last["eval_loss"]})
                if progress and d.main:
                    bar.write(f"step {done}: held-out loss {last['eval_loss']:.4f}")
            if done < cfg.steps and ((cfg.save_every and done % cfg.save_every == 0) or done == end):
                _save(work.path, raw, model, opt, sched, cfg, d, done, header, tokenizer)
    finally:
        bar.close()
        if log is not None:
            log.close()
        if writer is not None:
            writer.close()
    if end < cfg.steps:
        raise _Stopped({**last, "stopped": True, "checkpoint": str(work.path / ckpt.NAME)})
    state = _full_state(model, opt, cfg, d)[0]  # None unless FSDP (then gathered by every rank)
    # the run's throughput: every step this process ran over their summed time (each step's own is in metrics.jsonl)
    tps = (end - start) * tokens_per_step / stepped if stepped > 0 else None
    metrics = {"final_loss": last.get("loss"), "final_eval_loss": last.get("eval_loss"), "tokens_per_s": tps,
               "mfu": tps * fpt / (peak * d.world) if tps else None, "mfu_reference": peak_label,
               "mfu_peak_flops": peak, "flops_per_token": fpt, "parameters": params, "ranks": d.world,
               "tokens_seen": cfg.steps * tokens_per_step,
               # the held-out blocks the loss is over: eval_batches x micro_batch, or all the held-out split holds
               "eval_blocks": eval_block_count(tf.val, cfg.seq_len, cfg.eval_batches * cfg.micro_batch,
                                               bos_id(cfg, tf), document_separator(cfg, tf)),
               "eval_blocks_asked": cfg.eval_batches * cfg.micro_batch}
    if d.main:
        _finish(build, raw, state, tokenizer, cfg, work, metrics, tf)
    d.barrier()
    return {**metrics, "tokens_path": str(tf.path.resolve())}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, tf: TokenFile, cfg: TrainConfig,
          d: Dist, step: int, first: bool) -> tuple[float, float]:
    """One optimizer step: accumulate gradients over this rank's micro-batches, clip, update, schedule."""
    micro = train_batches(tf.train, cfg.seq_len, step, cfg.batch_size, cfg.micro_batch, d.rank, d.world, cfg.seed,
                          bos_id(cfg, tf), document_separator(cfg, tf))
    shares = loss_shares(micro)  # None without padding: each micro-batch's mean weighs 1 / len(micro)
    total = torch.zeros((), device=d.device)
    with oom_hint(cfg) if first else contextlib.nullcontext():
        for i, block in enumerate(micro):
            block = block.to(d.device, non_blocking=True)
            sync = i == len(micro) - 1 or d.world == 1 or cfg.parallel != "ddp"
            no_sync = contextlib.nullcontext() if sync else model.no_sync()
            with no_sync, _autocast(cfg, d.device), attention_kernel(cfg):
                loss = next_token_loss(model, block, compiled=cfg.compile)
                loss = loss / len(micro) if shares is None else loss * shares[i]
            loss.backward()
            total += loss.detach()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return _mean_over_ranks(total, d), float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)


@contextlib.contextmanager
def oom_hint(cfg: TrainConfig) -> Any:
    """Turn running out of memory (GPU or CPU) into a one-line error suggesting a smaller micro-batch."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e) or "can't allocate memory" in str(e):
            raise UsageError(f"out of memory on the first step with micro_batch {cfg.micro_batch}; pass a smaller "
                             f"--micro-batch (e.g. {max(1, cfg.micro_batch // 2)}); gradient accumulation keeps "
                             "the global batch") from None
        raise


def _save(work: Path, raw: torch.nn.Module, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
          cfg: TrainConfig, d: Dist, step: int, header: dict, tokenizer: Any) -> None:
    weights, optim = _full_state(model, opt, cfg, d)
    if d.main:
        trainer = {"step": step, "config": dataclasses.asdict(cfg), "tokens": header, "optimizer": optim,
                   "optimizer_format": _optimizer_format(cfg, d),
                   "scheduler": sched.state_dict(), "rng": ckpt.rng_state()}
        ckpt.save(work, raw, weights, trainer, tokenizer)
    d.barrier()


def _finish(build: Path, raw: torch.nn.Module, state: dict | None, tokenizer: Any, cfg: TrainConfig,
            work: Work, metrics: dict, tf: TokenFile) -> None:
    """Write the finished run into `build`: the model and tokenizer (save_pretrained), metrics.jsonl, and the
    loss curves with run.json (a poslens run directory)."""
    from poslens.io.results import write_run

    rows = [json.loads(line) for line in work.metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    from poslens.io.space import disk_space, nbytes

    with disk_space(build / "model.safetensors", nbytes(state if state is not None else raw.state_dict())):
        raw.save_pretrained(build, state_dict=state)
    with disk_space(build, 1 << 20):
        tokenizer.save_pretrained(build)
        shutil.copy(work.metrics, build / "metrics.jsonl")
    tensors = {"train_loss": torch.tensor([r["loss"] for r in steps], dtype=torch.float64),
               "eval_step": torch.tensor([r["step"] for r in evals], dtype=torch.int64),
               "eval_loss": torch.tensor([r["eval_loss"] for r in evals], dtype=torch.float64)}
    from poslens.engine.pe import variant_record

    write_run(build, tensors, {"kind": "train", "command": "train", "config": dataclasses.asdict(cfg),
                               "variant": variant_record(raw), "metrics": metrics,
                               "tokens": {**tf.header, "path": str(tf.path.resolve())}})


def _discard_metrics(work: Work) -> None:
    """Remove what a run wrote into its work directory before its first checkpoint (metrics, TensorBoard)."""
    work.metrics.unlink(missing_ok=True)
    shutil.rmtree(work.path / "tensorboard", ignore_errors=True)


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics rows of steps <= `step` (a resumed run rewrites what came after its checkpoint)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    if step == 0:
        keep = []
    path.write_text("".join(line + "\n" for line in keep))


def _tensorboard(path: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter(str(path / "tensorboard"))
