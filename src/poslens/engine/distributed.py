"""Where this process runs: rank, world size, local rank and device, one set-up for every job.

One process, or any number under ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK in the environment): gloo on the
CPU, NCCL on GPUs, one GPU per process (cuda:LOCAL_RANK). `setup` joins the process group once; the analysis
driver and the training loop both take their `Dist` from it.

    d = setup("cuda")           # Dist(rank=1, world=4, local=1, device=cuda:1) on the second process
    mine = d.shard(sequences, 20)   # this rank's contiguous block of whole batches of 20
    first = sum(d.batches(len(sequences), 20)[:d.rank])   # run-wide index of its first batch
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from poslens.errors import UsageError, check_int, require


@dataclass
class Dist:
    """This process's place: rank, world size, local rank, device."""

    rank: int
    world: int
    local: int
    device: torch.device

    @property
    def main(self) -> bool:
        """Rank 0: the process that writes the run directory."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (any picklable object)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def first(self, fn: Callable[[], Any]) -> Any:
        """fn() on rank 0 (None on the others), its one-line refusal (UsageError) raised on every rank: a rank that
        stops alone leaves the others waiting at the next collective for a peer that is gone (a traceback there)."""
        value, error = None, None
        if self.main:
            try:
                value = fn()
            except UsageError as e:
                error = e
        shared = self.broadcast(None if error is None else (str(error), error.param))
        if error is not None:
            raise error
        if shared is not None:
            raise UsageError(*shared)
        return value

    def batches(self, n: int, batch_size: int) -> list[int]:
        """How many of the run's batches each rank takes: the ceil(n / batch_size) batches one process would cut
        from `n` rows, dealt out as contiguous blocks in rank order, counts differing by at most one, every rank at
        least one. A rank's batches are the single process's, row for row, so batch b of the run lands in group
        b mod G whatever the number of processes: the groups, and every interval, are the single process's."""
        check_int("batch_size", batch_size, 1)
        k = -(-n // batch_size)
        require(k >= self.world, f"{n} sequences make {k} batches of {batch_size}, fewer than the {self.world} "
                                 "processes; use more --num-sequences, a smaller --batch-size or fewer processes")
        return [(r + 1) * k // self.world - r * k // self.world for r in range(self.world)]

    def bounds(self, n: int, batch_size: int) -> tuple[int, int]:
        """Rows [start, stop) of `n` that this rank takes: its block of whole batches (`batches`)."""
        counts = self.batches(n, batch_size)
        first = sum(counts[:self.rank])
        return first * batch_size, min((first + counts[self.rank]) * batch_size, n)

    def shard(self, rows: torch.Tensor, batch_size: int) -> torch.Tensor:
        """This rank's block of `rows`, whole batches of `batch_size` (see `batches`)."""
        start, stop = self.bounds(rows.shape[0], batch_size)
        return rows[start:stop]


def setup(device: str = "auto") -> Dist:
    """Join the torchrun process group when launched by torchrun (once per process) and pick the device.

    `device`: auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N. Under torchrun with a GPU every
    process takes cuda:LOCAL_RANK, so only "cuda" (or auto) is accepted there."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    want = "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    require(isinstance(want, str) and (want == "cpu" or want.startswith("cuda")),
            f"device must be auto, cpu, cuda or cuda:N; got {device!r}")
    if want.startswith("cuda"):
        require(torch.cuda.is_available(), f"device {want}: torch sees no GPU here; use --device cpu")
        if world > 1:
            if want != "cuda":
                raise UsageError(f"device {want}: under torchrun every process uses cuda:LOCAL_RANK; pass cuda",
                                 param="device")
            here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            if here > torch.cuda.device_count():
                raise UsageError(f"torchrun started {here} processes on this node but torch sees "
                                 f"{torch.cuda.device_count()} GPU(s); use --nproc-per-node "
                                 f"{torch.cuda.device_count()}")
            where = torch.device("cuda", local)
        else:
            where = torch.device(want if ":" in want else "cuda:0")
            require(where.index < torch.cuda.device_count(),
                    f"device {want}: only {torch.cuda.device_count()} CUDA device(s) visible")
        torch.cuda.set_device(where)
    else:
        where = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if where.type == "cuda" else "gloo")
        atexit.register(_leave)
    return Dist(rank, world, local, where)


LEAVE_TIMEOUT_S = 30  # how long a gloo rank waits at exit for the others (a rank that failed never arrives)


def _leave() -> None:
    """Leave the process group before the interpreter shuts down: a gloo group torn down by the interpreter's
    own finalisation can abort the process ("terminate called without an active exception") after a good run, and
    so can one rank tearing its group down while another is still in its last steps (seen under load: 2 runs of 20
    of a two-rank FSDP run stopped after 3 steps). Gloo ranks first wait for each other, at most LEAVE_TIMEOUT_S."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=LEAVE_TIMEOUT_S))
        except RuntimeError:  # a rank that failed, or left already: tear down alone, as before
            pass
    dist.destroy_process_group()
