"""Benchmark: poslens capture vs the published procedure vs a plain forward (run by hand, not a test).

Methods, on the same model and the same batches, interleaved within one run (the order rotates per repeat):

* plain:     `model(ids)` with SDPA and logits, no capture (the baseline).
* base:      the base model alone (no LM head), SDPA, no capture: what `update()` runs besides the capture.
* poslens:   `Capture(model).update(ids)` for every batch, all layers, then `result()`.
* published: the procedure of Kim et al.'s `rope_llms.ipynb`, re-implemented here: the model's module-level
             `eager_attention_forward` patched to return (scaling * q k^T + causal float mask) averaged over
             batch and heads in the model dtype, `output_attentions=True`, the full model with logits, every
             layer's [T, T] map copied to the host each batch, summed there in float32, divided by the number
             of batches.

Reported per method: wall and CPU time (median and min over repeats; ratio to plain), peak memory above the
pre-run level (CUDA: max_memory_allocated; CPU: sampled RSS with glibc's mmap threshold pinned so freed
tensors go back to the OS), and the max |map - reference| over the lower triangle of all layers against

* same-forward: float64 sums of q k^T * scaling taken inside an SDPA forward in the run dtype (the capture's
  own arithmetic error; the published maps come from an eager forward, so theirs also holds eager vs SDPA);
* float64: the model copied to float64, eager scores summed in float64 (forward rounding included).

    .venv/bin/python benchmarks/capture.py --batch 4 --seq-len 512
    .venv/bin/python benchmarks/capture.py --device cuda --dtype bfloat16 --batch 1 --seq-len 8192
    .venv/bin/python benchmarks/capture.py --model smollm2-135m      # real weights via poslens.engine.models
    PYTHONPATH=src python benchmarks/capture.py --shape llama-3.1-8b --device cuda --dtype bfloat16 \
        --batch 20 --seq-len 1024 --batches 1 --repeats 3 --reference same
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import importlib
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

try:  # transformers >= 4.53 (both 5.17 and 5.23 have these); fall back to the registries' own entries
    from transformers import AttentionMaskInterface
    from transformers.masking_utils import eager_mask, sdpa_mask
except ImportError:  # pragma: no cover - older layouts
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as AttentionMaskInterface

    eager_mask, sdpa_mask = AttentionMaskInterface["eager"], AttentionMaskInterface["sdpa"]
try:
    from transformers.integrations.sdpa_attention import repeat_kv
except ImportError:  # pragma: no cover
    from transformers.models.llama.modeling_llama import repeat_kv

from poslens.engine.capture import Capture

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- model -------------------------------------------------------------------------------------------


def _rescale_qk(model: LlamaForCausalLM, cfg: LlamaConfig) -> None:
    """q/k weights ~ N(0, std) so first-layer scores have std ~3 (trained-like): with unit-RMS inputs, q and k
    entries have variance a = hidden * std^2 and scaling * q.k has std a * sqrt(head_dim) * scaling = 3."""
    head_dim = cfg.head_dim
    scaling = head_dim**-0.5
    std = (3.0 / (scaling * head_dim**0.5)) ** 0.5 / cfg.hidden_size**0.5
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0.0, std)
            layer.self_attn.k_proj.weight.normal_(0.0, std)


def smollm2_shaped(dtype: torch.dtype, device: str, seed: int = 0) -> LlamaForCausalLM:
    """Random model with SmolLM2-135M's shape; q/k rescaled so first-layer scores have std ~3 (trained-like)."""
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
        _rescale_qk(model, cfg)
    return model.to(device=device, dtype=dtype).eval()


def llama_8b_shaped(dtype: torch.dtype, device: str, seed: int = 0) -> LlamaForCausalLM:
    """Random model with Llama-3.1-8B's shape (8.03 B parameters), built directly on `device` in `dtype`
    (a float32 CPU initialisation of 8 B parameters is far too slow); q/k rescaled like smollm2_shaped."""
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
    devices = [torch.device(device).index or 0] if str(device).startswith("cuda") else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=dtype)
        _rescale_qk(model, cfg)
    return model.eval()


SHAPES = {"smollm2-135m": smollm2_shaped, "llama-3.1-8b": llama_8b_shaped}


def load(args) -> torch.nn.Module:
    if args.model is None:
        return SHAPES[args.shape](DTYPES[args.dtype], args.device)
    try:
        from poslens.engine.models import load_model
    except ImportError:
        sys.exit("--model needs poslens.engine.models (not available in this checkout)")
    model, _ = load_model(args.model, dtype=args.dtype, device=args.device, attn_implementation="sdpa")
    return model.eval()


# ---- the published procedure (re-implemented from its description) -----------------------------------


def _published_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    k = repeat_kv(key, module.num_key_value_groups)
    v = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    mean = scores.mean(dim=(0, 1))  # in the model dtype, like the notebook
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).contiguous()
    return out, mean


@contextmanager
def published_patch(model):
    """Patch the modeling module's eager function and switch the model to eager (undone on exit)."""
    mod = importlib.import_module(type(model).__module__)
    saved_fn, saved_impl = mod.eager_attention_forward, model.config._attn_implementation
    mod.eager_attention_forward = _published_eager
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        mod.eager_attention_forward = saved_fn
        model.set_attn_implementation(saved_impl)


def run_published(model, batches) -> torch.Tensor:
    acc = None
    with published_patch(model), torch.no_grad():
        for ids in batches:
            out = model(ids, output_attentions=True, use_cache=False)
            maps = [a.float().cpu() for a in out.attentions]
            acc = torch.stack(maps) if acc is None else acc + torch.stack(maps)
    return acc / len(batches)


_SPLIT: dict = {"update_s": [], "result_s": []}  # poslens time in update() (all batches) and in result()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_poslens(model, batches, query_block: int, gemm: str, groups: int = 1) -> torch.Tensor:
    cap = Capture(model, query_block=query_block, gemm=gemm, **({"groups": groups} if groups > 1 else {}))
    dev = batches[0].device
    t0 = time.perf_counter()
    for ids in batches:
        cap.update(ids)
    _sync(dev)
    t1 = time.perf_counter()
    out = cap.result()["scores"]
    _SPLIT["update_s"].append(t1 - t0)
    _SPLIT["result_s"].append(time.perf_counter() - t1)
    return out


def run_plain(model, batches) -> None:
    with torch.no_grad():
        for ids in batches:
            model(ids, use_cache=False).logits.sum().item()


def run_base(model, batches) -> None:
    with torch.no_grad():
        for ids in batches:
            model.base_model(ids, use_cache=False).last_hidden_state.sum().item()


# ---- references ---------------------------------------------------------------------------------------

_REF: dict = {}


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """float64 sums over batch and heads of q k^T * scaling, by query blocks, kept on the host; the output
    comes from the model's own attention function (SDPA for the same-forward reference, eager in float64)."""
    k = repeat_kv(key, module.num_key_value_groups).double().transpose(2, 3)
    n = query.shape[2]
    acc = _REF["sums"].setdefault(module.layer_idx, torch.zeros(n, n, dtype=torch.float64))
    for s in range(0, n, 256):
        e = min(n, s + 256)
        acc[s:e, :e] += (torch.matmul(query[:, :, s:e].double(), k[..., :e]) * scaling).sum((0, 1)).cpu()
    if _REF["output"] == "sdpa":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    eager = importlib.import_module(type(module).__module__).eager_attention_forward
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register("bench_ref_sdpa", _reference_attention)
AttentionMaskInterface.register("bench_ref_sdpa", sdpa_mask)
AttentionInterface.register("bench_ref_eager", _reference_attention)
AttentionMaskInterface.register("bench_ref_eager", eager_mask)


def reference(model, batches, float64: bool) -> torch.Tensor:
    """Mean maps [L, T, T] (float64, CPU): same-forward sums (float64=False) or a float64 eager forward."""
    m = copy.deepcopy(model).double() if float64 else model
    saved = m.config._attn_implementation
    _REF.update(sums={}, output="eager" if float64 else "sdpa")
    m.set_attn_implementation("bench_ref_eager" if float64 else "bench_ref_sdpa")
    try:
        with torch.no_grad():
            for ids in batches:
                m.base_model(ids, use_cache=False)
    finally:
        m.set_attn_implementation(saved)
    heads = model.config.num_attention_heads
    n = sum(b.shape[0] for b in batches) * heads
    out = torch.stack([_REF["sums"][i].cpu() for i in sorted(_REF["sums"])]) / n
    _REF["sums"] = {}
    if float64:
        del m
    return out


def deviation(maps: torch.Tensor, ref: torch.Tensor) -> float:
    """max |maps - ref| over the lower triangle (j <= i) of every layer."""
    n = ref.shape[-1]
    low = torch.ones(n, n, dtype=torch.bool).tril()
    return max((m.cpu().double()[low] - r[low]).abs().max().item() for m, r in zip(maps, ref, strict=True))


# ---- measurement --------------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak bytes above the level at entry: CUDA allocator statistics, else sampled RSS (every ~1 ms)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def __enter__(self):
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self.peak = _rss()
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self.base
        else:
            self.stop.set()
            self.thread.join()
            self.bytes = max(self.peak, _rss()) - self.base


def pin_glibc_mmap_threshold() -> None:
    """Large allocations always via mmap (returned to the OS on free), so RSS peaks are per method. Set after
    poslens's own setting (`keep_freed_memory`, which HookedModel makes once per process) so that it stays."""
    from poslens.engine.allocator import keep_freed_memory

    keep_freed_memory()
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB, disables the dynamic threshold
    except OSError:
        pass


def timed(fn, device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - w, time.process_time() - c


def profile(methods: dict, args) -> None:
    """One profiled call of plain and of poslens each; top operators by device (else CPU) time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = args.device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    key = "cuda_time_total" if cuda else "cpu_time_total"
    with open(args.profile, "w") as f:
        for name in ("plain", "poslens"):
            if name not in methods:
                continue
            with torch_profile(activities=acts) as prof:
                methods[name]()
                if cuda:
                    torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
            f.write(f"==== {name}\n{table}\n")
            print(f"==== profile {name}\n{table}", flush=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="poslens.models spec (e.g. smollm2-135m); default: random "
                   "SmolLM2-135M-shaped Llama")
    p.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES),
                   help="shape of the random Llama (without --model): SmolLM2-135M, or Llama-3.1-8B built directly "
                   "on --device in --dtype")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batches", type=int, default=2, help="batches per method call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--query-block", type=int, default=None, help="rows per GEMM (default: poslens' choice)")
    p.add_argument("--gemm", default="auto", choices=["auto", "float32", "split-bf16"],
                   help="Capture(gemm=...): auto = split-bf16 for bfloat16 on CUDA, else float32")
    p.add_argument("--reference", choices=["both", "same", "none"], default="both",
                   help="float64 references: same-forward and float64 model (both), same-forward only, none")
    p.add_argument("--methods", default="plain,base,poslens,published")
    p.add_argument("--groups", type=int, default=1, help="Capture(groups=G): sums kept per group for intervals")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--profile", default=None, help="after the timings, profile one call of plain and of poslens "
                   "(torch.profiler) and write the top operators by device time to this text file")
    args = p.parse_args(argv)

    pin_glibc_mmap_threshold()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load(args)
    vocab = model.config.vocab_size
    batches = [torch.randint(3, vocab, (args.batch, args.seq_len), device=args.device)
               for _ in range(args.batches)]
    methods = {"plain": lambda: run_plain(model, batches),
               "base": lambda: run_base(model, batches),
               "poslens": lambda: run_poslens(model, batches, args.query_block, args.gemm, args.groups),
               "published": lambda: run_published(model, batches)}
    methods = {k: methods[k] for k in args.methods.split(",")}
    info = {"args": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(),
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "transformers": importlib.import_module("transformers").__version__,
            "model": {"class": type(model).__name__, "layers": model.config.num_hidden_layers,
                      "params": sum(x.numel() for x in model.parameters())}}
    print(json.dumps(info), flush=True)

    failed = {}
    for name, fn in methods.items():  # warm-up (allocator, kernels, lazy imports)
        try:
            fn()
        except torch.OutOfMemoryError as e:
            failed[name] = f"out of memory (warm-up): {str(e).splitlines()[0]}"
            print(f"warm-up {name}: {failed[name]}", flush=True)
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    if _SPLIT["result_s"]:  # the warm-up call: the process's first result() (first page-locked allocation)
        info["first_call_update_s"] = _SPLIT["update_s"][0]
        info["first_call_result_s"] = _SPLIT["result_s"][0]
    _SPLIT["update_s"].clear()
    _SPLIT["result_s"].clear()
    times = {k: [] for k in methods}
    cpu = {k: [] for k in methods}
    memory = {k: 0 for k in methods}
    maps = {}
    loads = []  # 1-minute load average after each timed call (other processes share the machine)
    names = list(methods)
    for r in range(args.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            if name in failed:
                continue
            try:
                with PeakMemory(args.device) as mem:
                    out, wall, cpu_s = timed(methods[name], args.device)
            except torch.OutOfMemoryError as e:
                failed[name] = f"out of memory: {str(e).splitlines()[0]}"
                gc.collect()
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
                continue
            times[name].append(wall)
            cpu[name].append(cpu_s)
            memory[name] = max(memory[name], mem.bytes)
            if out is not None:
                maps[name] = out
            load1 = os.getloadavg()[0]
            loads.append(load1)
            print(f"repeat {r} {name}: {wall:.3f} s wall, {cpu_s:.3f} s cpu, peak +{mem.bytes / 2**20:.0f} MiB, "
                  f"load {load1:.2f}", flush=True)

    split = {k: list(v) for k, v in _SPLIT.items()}  # before the profiled call adds to it
    if args.profile:
        profile(methods, args)

    refs = {}
    for ref_name, float64 in (("same_forward", False), ("float64", True)):
        if args.reference == "none" or (float64 and args.reference == "same"):
            continue
        try:
            refs[ref_name] = reference(model, batches, float64=float64)
        except torch.OutOfMemoryError:
            info[f"reference_{ref_name}"] = "out of memory"
    base = statistics.median(times["plain"]) if times.get("plain") else None
    base_cpu = statistics.median(cpu["plain"]) if cpu.get("plain") else None
    rows = {}
    for name in methods:
        if name in failed:
            rows[name] = {"failed": failed[name]}
            continue
        med, cmed = statistics.median(times[name]), statistics.median(cpu[name])
        row = {"wall_median_s": med, "wall_min_s": min(times[name]), "cpu_median_s": cmed,
               "wall_ratio": med / base if base else math.nan, "cpu_ratio": cmed / base_cpu if base_cpu else math.nan,
               "peak_extra_mib": memory[name] / 2**20}
        if name == "poslens" and split["update_s"]:
            row["update_median_s"] = statistics.median(split["update_s"])
            row["result_median_s"] = statistics.median(split["result_s"])
            row["update_ratio"] = row["update_median_s"] / base if base else math.nan
        for ref_name, ref in refs.items():
            if name in maps:
                row[f"max_dev_vs_{ref_name}"] = deviation(maps[name], ref)
        rows[name] = row
    if refs:
        scale = refs[next(iter(refs))]
        low = torch.ones(scale.shape[-1], scale.shape[-1], dtype=torch.bool).tril()
        info["map_abs_max"] = max(m[low].abs().max().item() for m in scale)
    info["fused_addmm"] = importlib.import_module("poslens.engine.capture")._FUSED_ADDMM  # False: GEMM fell back
    info["load_average_1min"] = {"min": min(loads), "max": max(loads)} if loads else None
    report = {**info, "methods": rows}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
