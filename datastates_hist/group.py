"""The processes that write one history together, and the few collectives they need.

A Checkpointer with ``comm=`` runs on every rank of a job. Its ranks agree (on
each step, in its flusher thread; on the constructor, truncate, prune and close, in
the caller's thread once the flusher is idle) through a private copy of the job's
communicator (an mpi4py ``Comm.Dup()``, or a new gloo group of
``torch.distributed``), so that their collectives never interleave with the
training loop's. One thread of a process at a time makes them.

Messages are small JSON documents (tensor records, verdicts); tensor bytes
never travel between ranks.
"""

from __future__ import annotations

import json
import numbers
import time
from typing import Any


SPIN_S = 2e-4  # how long a rank polls the others' arrival before it sleeps between polls


class Group:
    """One process alone: every collective is the identity."""

    rank = 0
    size = 1
    mpi_comm = None  # an mpi4py communicator when ranks can share one ADIOS2 file collectively

    @property
    def root(self) -> bool:
        return self.rank == 0

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` at rank 0 (in rank order); None elsewhere."""
        return [obj]

    def bcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank (in rank order)."""
        return [obj]

    def barrier(self) -> None:
        pass


class MPIGroup(Group):
    """The ranks of an mpi4py communicator (duplicated: the job's own traffic stays apart)."""

    def __init__(self, comm):
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "datastates-hist talks MPI from its background threads: initialize MPI with "
                "thread level MULTIPLE (mpi4py's default; check mpi4py.rc.thread_level)"
            )
        self.mpi_comm = comm.Dup()
        self.rank, self.size = self.mpi_comm.Get_rank(), self.mpi_comm.Get_size()
        local = self.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.nodes = self.mpi_comm.allreduce(1 if local.Get_rank() == 0 else 0)
        self.ranks_per_node = self.mpi_comm.allreduce(local.Get_size(), op=MPI.MAX)
        local.Free()

    def gather(self, obj):
        text = _encode(obj)
        self._arrive()
        got = self.mpi_comm.gather(text, root=0)
        return [_decode(g) for g in got] if got is not None else None

    def bcast(self, obj):
        text = _encode(obj) if self.root else None
        self._arrive()
        return _decode(self.mpi_comm.bcast(text, root=0))

    def allgather(self, obj):
        text = _encode(obj)
        self._arrive()
        return [_decode(g) for g in self.mpi_comm.allgather(text)]

    def barrier(self):
        self._arrive()

    def _arrive(self) -> None:
        """Wait for every rank without spinning for long: MPI waits by busy polling, which
        would take the CPU from the ranks still writing (and from training). A short spin
        first: ranks arriving together complete the barrier in microseconds, where the
        first sleep alone made each collective take about 3 ms (docs/performance.md)."""
        request = self.mpi_comm.Ibarrier()
        spin_until = time.perf_counter() + SPIN_S
        while time.perf_counter() < spin_until:
            if request.Test():
                return
        pause = 1e-4
        while not request.Test():
            time.sleep(pause)
            pause = min(pause * 1.5, 2e-3)


class TorchGroup(Group):
    """The ranks of a ``torch.distributed`` job, through a new gloo group of its own."""

    def __init__(self, group=None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("comm=torch.distributed needs torch.distributed.init_process_group() first")
        ranks = None if group in (None, dist.group.WORLD) else dist.get_process_group_ranks(group)
        self.group = dist.new_group(ranks=ranks, backend="gloo")
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._dist = dist

    def gather(self, obj):
        out = [None] * self.size if self.root else None
        self._dist.gather_object(_encode(obj), out, dst=self._global(0), group=self.group)
        return [_decode(g) for g in out] if out is not None else None

    def bcast(self, obj):
        box = [_encode(obj) if self.root else None]
        self._dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        return _decode(box[0])

    def allgather(self, obj):
        out = [None] * self.size
        self._dist.all_gather_object(out, _encode(obj), group=self.group)
        return [_decode(g) for g in out]

    def barrier(self):
        self._dist.barrier(group=self.group)

    def _global(self, rank: int) -> int:
        return self._dist.get_global_rank(self.group, rank)


def as_group(comm: Any) -> Group:
    """A :class:`Group` for ``comm``: None (one process), an mpi4py communicator,
    ``"torch"``, or a ``torch.distributed`` process group."""
    if comm is None or isinstance(comm, Group):
        return comm or Group()
    if comm == "torch" or type(comm).__name__ == "ProcessGroup":
        return TorchGroup(None if comm == "torch" else comm)
    if type(comm).__module__.startswith("mpi4py"):
        return MPIGroup(comm)
    raise TypeError(
        f"comm must be an mpi4py communicator, a torch.distributed process group or 'torch', "
        f"got {type(comm).__name__}"
    )


# Messages cross as JSON text, so what one rank sends can only ever be data to another.
# Encoding never raises: a rank that skipped a collective would leave the others waiting
# in it, so what JSON has no form for goes as a number (numpy's) or as its repr, which
# the other ranks then see differ.
def _encode(obj: Any) -> str:
    return json.dumps(obj, allow_nan=True, separators=(",", ":"), default=_as_data)


def _as_data(value: Any) -> int | float | str:
    if isinstance(value, numbers.Integral):
        return int(value)
    return float(value) if isinstance(value, numbers.Real) else repr(value)


def _decode(text: str) -> Any:
    return json.loads(text)
