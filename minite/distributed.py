"""The processes of one run: the process group, this process's rank, and collectives on Python values.

`torchrun --nproc-per-node=N -m minite.cli train ...` starts N processes with RANK, LOCAL_RANK,
WORLD_SIZE and a rendezvous in the environment; `init()` joins them into one process group: NCCL
between GPUs (each process on the GPU numbered by its LOCAL_RANK), gloo on the CPU. `init_single()`
makes a group of one process (no launcher, no network): a run sharded across N processes resumes
into one through the same code. Rank 0 is the main process: the only one that writes files or logs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher setting WORLD_SIZE)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclass(frozen=True)
class Group:
    """This process's place in the run: rank, world size, backend, and the device it computes on."""

    rank: int
    world_size: int
    backend: str
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, n: int) -> range:
        """This rank's contiguous share of `n` items (the first n % world ranks get one more)."""
        base, extra = divmod(n, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def broadcast(self, value):
        """Rank 0's Python value on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value) -> list:
        """Every rank's Python value, in rank order, on every rank."""
        out = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (all ranks get the same answer)."""
        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        dist.barrier()


def _backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _group(device: str) -> Group:
    d = torch.device(device)
    if d.type == "cuda":
        d = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(d)
    return Group(dist.get_rank(), dist.get_world_size(), dist.get_backend(), d)


def init(device: str) -> Group:
    """Join the launcher's process group (once; later calls return the same group). `device` is the
    run's ("cpu" or "cuda"): NCCL for CUDA, gloo for the CPU."""
    if not dist.is_initialized():
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(_backend(device))
    return _group(device)


def init_single(device: str) -> Group:
    """A process group of this one process (rank 0 of 1), for a sharded run resumed without torchrun."""
    if not dist.is_initialized():
        dist.init_process_group(_backend(device), store=dist.HashStore(), rank=0, world_size=1)
    return _group(device)


def close() -> None:
    """Leave the process group (at the end of a run), once every rank got there: a rank leaving while
    another still reads the last collective's data would break that read."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
