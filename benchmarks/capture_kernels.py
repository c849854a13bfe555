"""Micro-benchmark of the two capture costs that grow with T (run by hand on a GPU, not a test).

1. The score GEMM of one layer (`Capture._scores_gemm`, head sums of q against k over the lower triangle, in
   query blocks), in the variants considered, against one SDPA call of the same layer as the yardstick:

   * two:   hi and lo bfloat16 GEMMs with float32 output, summed into a float32 temporary, added to the sums
   * cat:   one GEMM over the concatenated contraction [hi | lo] @ [k ; k] (same products, one launch)
   * addmm: the same concatenated GEMM accumulating straight into the sums (`addmm(out_dtype=float32)`)
   * square: one addmm over the whole [T, T] square (twice the products, one launch per layer)
   * fp32:  float32 GEMM of the float32 head sums (the CPU path; TF32 off)

   and each variant's max deviation from a float64 GEMM of the same inputs (their own arithmetic).
2. Handing L finished float32 [T, T] maps from the GPU to the host, first and second call in the process:
   poslens' chunked copy through two page-locked staging buffers, `.cpu()` per layer into a fresh tensor
   (pageable), `copy_` into one preallocated pageable tensor, and into one page-locked tensor with
   asynchronous copies (fast once torch's page-locked cache holds the memory; slow to allocate the first time).

    PYTHONPATH=src python benchmarks/capture_kernels.py --shape 1x8192 --shape 4x4096 --shape 20x1024
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from poslens.engine.capture import _blocks, _to_host


def _timed(fn):
    """(fn(), seconds), the GPU's queue drained before and after."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def _timeit(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call (cuBLAS heuristics, allocator)."""
    fn()
    return statistics.median(_timed(fn)[1] for _ in range(repeats))


def gemm_variants(b: int, n: int, heads: int, kv_heads: int, head_dim: int, layers: int, rows: int,
                  repeats: int, sweep: list[int]) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, heads, n, head_dim, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(b, kv_heads, n, head_dim, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn_like(k)
    scaling = head_dim**-0.5
    qs = q.unflatten(1, (kv_heads, heads // kv_heads)).sum(2, dtype=torch.float32)
    qs = qs.permute(2, 0, 1, 3).reshape(n, -1)  # [T, B*Hkv*D] float32
    ks = k.permute(2, 0, 1, 3).reshape(n, -1)  # [T, B*Hkv*D] bfloat16
    hi = qs.to(torch.bfloat16)
    lo = (qs - hi.float()).to(torch.bfloat16)
    a = torch.cat([hi, lo], 1)
    kk = torch.cat([ks, ks], 1)
    acc = torch.zeros(n, n, device="cuda")
    want = (qs.double() @ ks.double().T * scaling).tril()
    m = torch.backends.cuda.matmul
    m.allow_bf16_reduced_precision_reduction = False

    def two():
        for s, e, _ in _blocks(n, rows, 0):
            kt = ks[:e].T
            part = torch.mm(hi[s:e], kt, out_dtype=torch.float32).add_(torch.mm(lo[s:e], kt, out_dtype=torch.float32))
            acc[s:e, :e].add_(part, alpha=scaling)

    def cat():
        for s, e, _ in _blocks(n, rows, 0):
            acc[s:e, :e].add_(torch.mm(a[s:e], kk[:e].T, out_dtype=torch.float32), alpha=scaling)

    def addmm():
        for s, e, _ in _blocks(n, rows, 0):
            view = acc[s:e, :e]
            torch.addmm(view, a[s:e], kk[:e].T, alpha=scaling, out_dtype=torch.float32, out=view)

    def addmm_rows(r: int):
        def run():
            for s, e, _ in _blocks(n, r, 0):
                view = acc[s:e, :e]
                torch.addmm(view, a[s:e], kk[:e].T, alpha=scaling, out_dtype=torch.float32, out=view)
        return run

    def square():
        torch.addmm(acc, a, kk.T, alpha=scaling, out_dtype=torch.float32, out=acc)

    ksf = ks.float()

    def fp32():
        for s, e, _ in _blocks(n, rows, 0):
            acc[s:e, :e].addmm_(qs[s:e], ksf[:e].T, alpha=scaling)

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    rows_out = []
    t_sdpa = _timeit(lambda: [sdpa() for _ in range(layers)], repeats)
    rows_out.append(dict(variant="sdpa (yardstick)", seconds=t_sdpa, vs_sdpa=1.0, max_dev=None))
    variants = dict(two=two, cat=cat, addmm=addmm, square=square, fp32=fp32)
    variants.update({f"addmm, {r}-row blocks": addmm_rows(r) for r in sweep if r < n})
    for name, fn in variants.items():
        try:
            acc.zero_()
            fn()
            dev = float(((acc.double() - want).tril()).abs().max())
            t = _timeit(lambda fn=fn: [fn() for _ in range(layers)], repeats)
        except (RuntimeError, TypeError) as err:
            rows_out.append(dict(variant=name, seconds=None, vs_sdpa=None, max_dev=None, error=str(err)[:160]))
            continue
        rows_out.append(dict(variant=name, seconds=t, vs_sdpa=t / t_sdpa, max_dev=dev))
    return rows_out


def copy_variants(n: int, layers: int) -> list[dict]:
    """Each variant twice: its first call in the process (allocations included) and a second one."""
    maps = [torch.randn(n, n, device="cuda") for _ in range(layers)]
    out = []

    def staged():  # poslens: two 64 MiB page-locked staging buffers, chunked and overlapped
        host = torch.empty(layers, n, n)
        for i, x in enumerate(maps):
            _to_host(x, host[i])
        return host

    def fresh():
        host = torch.empty(layers, n, n)
        for i, x in enumerate(maps):
            host[i] = x.cpu()
        return host

    def prealloc():
        host = torch.empty(layers, n, n)
        for i, x in enumerate(maps):
            host[i].copy_(x)
        return host

    def pinned():
        host = torch.empty(layers, n, n, pin_memory=True)
        for i, x in enumerate(maps):
            host[i].copy_(x, non_blocking=True)
        return host

    for name, fn in dict(staged=staged, fresh=fresh, prealloc=prealloc, pinned=pinned).items():
        host, first = _timed(fn)
        del host
        host, second = _timed(fn)
        ok = bool(torch.equal(host[-1], maps[-1].cpu()))
        del host
        out.append(dict(variant=name, first_s=first, second_s=second, gb=layers * n * n * 4 / 1e9, identical=ok))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", default=None, help="BATCHxSEQ_LEN, e.g. 4x4096 (repeatable)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rows", type=int, default=None, help="query rows per block (default: poslens' choice)")
    p.add_argument("--sweep", default="256,1024,2048,4096", help="also time addmm with these block rows")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-copy", action="store_true")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    sweep = [int(x) for x in args.sweep.split(",") if x]
    for shape in args.shape or ["1x8192", "4x4096", "20x1024"]:
        b, n = (int(x) for x in shape.split("x"))
        rows = args.rows or (512 if n >= 4096 else 128)
        print(f"\n== {b} x {n}: {args.layers} layers, {args.heads}/{args.kv_heads} heads x {args.head_dim}, "
              f"{rows}-row blocks", flush=True)
        for r in gemm_variants(b, n, args.heads, args.kv_heads, args.head_dim, args.layers, rows, args.repeats,
                               sweep):
            print(r, flush=True)
        if not args.no_copy:
            for r in copy_variants(n, args.layers):
                print(r, flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
