"""The C allocator's handling of freed memory: kept for reuse instead of handed back to the kernel.

glibc returns large freed blocks to the kernel (each allocation above the mmap threshold is its own mapping, and the
top of the heap is trimmed), so a loop that frees and allocates the same tensors again faults in fresh zeroed pages
every time. On the 2-core development machine a page fault costs about 2.7 us (30,720 faults, 120 MiB, in 80-95 ms);
a hooked forward reading every point at GPT-2 small's body with Falcon-RW's attention faulted 14,500-37,000 pages per
call (the per-head results, [H, B*T, d], most of them) where the plain forward faulted almost none, and a `pe-sinks`
model's training step took 104 ms against 48 ms with the memory kept (BENCHMARKS.md). `keep_freed_memory` is called
by `HookedModel` and by the batched trainer; the process keeps its peak of blocks under 32 MiB mapped. Larger blocks
glibc still maps and unmaps every time (32 MiB is the most its threshold can be raised to), so the hook engine reuses
its largest per-layer tensor, the per-head results, itself (`hooks._reusable`).
"""

from __future__ import annotations

import contextlib

_KEPT: bool | None = None  # None: not asked yet; then whether glibc took the setting
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse: the largest fixed mmap threshold (32 MiB) and no trimming of
    the heap (1 GiB threshold). Once per process (later calls change nothing, so a setting made after the first call
    stays); the same answer every call: False where the C library is not glibc (nothing changed)."""
    global _KEPT
    if _KEPT is None:
        _KEPT = False
        import ctypes
        import ctypes.util

        with contextlib.suppress(OSError, AttributeError, TypeError):
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _KEPT = bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    return _KEPT
