"""A distributed training job for the multi-rank tests, run under ``mpirun`` or ``torchrun``.

    dist_train.py train RUN --model ddp|dtensor --steps 10 [--fail-rank R --fail-step S --fail-how HOW]
    dist_train.py restore RUN STEP --model ddp|dtensor|plain

``train`` checkpoints every step and saves, at rank 0, the global tensors of
every step (gathered with torch.distributed) to ``RUN.expected/<step>.pt``, so
that a later restore can be compared bit for bit. ``restore`` loads a step on
however many ranks it runs with, gathers the global tensors again and compares
them with the expected ones; it also reads every global tensor through
``datastates_hist.open`` at rank 0. Exit status 0 only when all are equal.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import datastates_hist as dh


def init_distributed():
    """torch.distributed over gloo, from torchrun's variables or from MPI."""
    if "TORCHRUN_JOBID" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        dist.init_process_group("gloo")
        return "torch"
    if "PMI_RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        return None  # one process, no launcher
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
    return comm


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        # uneven first dimensions: shards of 2 and 4 ranks differ in size
        self.fc1 = nn.Linear(12, 10)
        self.fc2 = nn.Linear(10, 6)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        return self.fc2(torch.tanh(self.fc1(x)))


def build(kind: str):
    torch.manual_seed(0)
    model = MLP()
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model), None
    if kind == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer, placement in ((model.fc1, Shard(0)), (model.fc2, Shard(1))):
            layer.weight = nn.Parameter(distribute_tensor(layer.weight.data, mesh, [placement]))
            layer.bias = nn.Parameter(distribute_tensor(layer.bias.data, mesh, [Replicate()]))
        return model, mesh
    return model, None  # plain: one process


def batch(step: int, rank: int, mesh):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)
    if mesh is not None:
        from torch.distributed.tensor import DTensor, Replicate

        g = torch.Generator().manual_seed(1000 * step)  # the same batch on every rank
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        y = DTensor.from_local(y, mesh, [Replicate()], run_check=False)
    return x, y


def global_tensors(model, opt) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer as the store names it, whole (collective for DTensors)."""
    from datastates_hist.torch_providers import unwrap

    inner = unwrap(model)
    out = {}
    for name, t in inner.state_dict().items():
        out[f"model/{name}"] = _whole(t)
    names = {id(p): n for n, p in inner.named_parameters()}
    for p, state in opt.state.items():
        for key, v in state.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/state/{names[id(p)]}/{key}"] = _whole(v)
    return out


def _whole(t):
    return t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone()


class RowBlock:
    """Rows ``[start, stop)`` of a global ``[rows, 3]`` table; each rank holds its own rows."""

    def __init__(self, rows: int, rank: int, size: int):
        self.rows, self.start, self.stop = rows, rows * rank // size, rows * (rank + 1) // size
        self.data = torch.zeros(self.stop - self.start, 3, dtype=torch.float64)

    def fill(self, step: int):
        self.data.copy_(expected_table(step, self.rows)[self.start:self.stop])


def expected_table(step: int, rows: int) -> torch.Tensor:
    return torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) * (step + 1)


class RowBlockProvider(dh.StateProvider):
    """A provider that declares its tensor as a block of a global one."""

    def items(self, obj, ctx):
        yield dh.TensorItem("table", obj.data, global_shape=(obj.rows, 3), offset=(obj.start, 0))

    def check(self, obj, state, ctx):
        from datastates_hist.providers import Problems

        rec = state.records.get("table")
        return Problems(missing=[] if rec is not None else ["table"])

    def load(self, obj, state, ctx):
        obj.data.copy_(state.box("table", (obj.start, 0), (obj.stop - obj.start, 3)))
        return obj


dh.register_provider(RowBlock, RowBlockProvider())
ROWS = 11


class Unstorable:
    """An extra value no provider can store: write() raises on the rank that passes it."""


def train(args, comm):
    model, mesh = build(args.model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.fail_how == "put" and rank == args.fail_rank:
        fail_puts_at(args.fail_step)
    if args.fail_how == "open" and rank == args.fail_rank:
        fail_open_at(args.fail_step)
    options = {"parameters": {"NumAggregators": str(args.aggregators)}} if args.aggregators else None
    if args.fail_how == "elsewhere" and rank == args.fail_rank:
        args.run += ".elsewhere"  # a run directory the other ranks do not write to
    backend = args.backend
    if args.fail_how == "backend" and rank == args.fail_rank:
        backend = "hdf5" if backend != "hdf5" else "adios2"  # not the other ranks' backend
    keep = dh.KeepLast(2) if args.fail_how == "keep" and rank == args.fail_rank else None
    if args.fail_how == "index" and rank == 0:
        fail_index_once()
    try:
        ckpt = dh.Checkpointer(args.run, comm=comm, backend=backend, backend_options=options, keep=keep)
    except dh.CheckpointError as exc:
        report(f"rank {rank}: FAILURE open: {exc}")
        return
    expected_dir = args.run + ".expected"
    os.makedirs(expected_dir, exist_ok=True)
    failures = []
    table = RowBlock(ROWS, rank, dist.get_world_size() if dist.is_initialized() else 1)
    for step in range(args.steps):
        ckpt.wait_snapshot()  # the table is edited in place, outside the optimizer
        table.fill(step)
        x, y = batch(step, rank, mesh)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        extra = {"data": {"step": step}, "table": table}
        if args.fail_how == "values":  # a plain value of each rank's own
            extra["loader"] = {"position": 1000 * rank + step}
        if args.fail_how == "huge":  # finite, but squares overflow a float64; each rank's half its own sign
            extra["huge"] = torch.full((4, 8), 1e200 * (step + 1), dtype=torch.float64)
            extra["huge"][2:] *= -1
        if args.fail_how in ("raise", "truncate") and step == args.fail_step and rank == args.fail_rank:
            extra["bad"] = Unstorable()
        if args.fail_how == "extra" and step == args.fail_step and rank == args.fail_rank:
            extra["only_mine"] = torch.ones(4)  # a tensor the other ranks do not hold
        fds = None
        if args.fail_how == "fds" and step == args.fail_step and rank == args.fail_rank:
            ckpt.wait()
            fds = no_more_files()  # this rank cannot open the step's file: a real failure inside the backend
        try:
            if not (args.fail_how == "skip" and step == args.fail_step and rank == args.fail_rank):
                ckpt.write(step, model, opt, **extra)
            if fds is not None:
                ckpt.wait()
        except (TypeError, dh.CheckpointError) as exc:
            failures.append(f"write {step}: {exc}")
        finally:
            if fds is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, fds)
        want = global_tensors(model, opt)
        if rank == 0:
            torch.save(want, os.path.join(expected_dir, f"{step}.pt"))
    if args.fail_how == "truncate":  # rank 0 alone has reported the failed step when all truncate
        if rank == 0:
            try:
                ckpt.wait()
            except dh.CheckpointError as exc:
                failures.append(f"wait: {exc}")
        try:
            report(f"rank {rank}: truncated {ckpt.truncate(after=1)}")
        except dh.CheckpointError as exc:
            failures.append(f"truncate: {exc}")
    if args.fail_how == "truncate-one" and rank == args.fail_rank:  # the others close meanwhile
        try:
            ckpt.truncate(after=1)
        except dh.CheckpointError as exc:
            failures.append(f"truncate: {exc}")
    if args.fail_how == "one-more" and rank == args.fail_rank:
        try:
            ckpt.write(args.steps, model, opt)  # a step the other ranks do not write
        except dh.CheckpointError as exc:
            failures.append(f"write {args.steps}: {exc}")
    try:
        ckpt.close()
    except dh.CheckpointError as exc:
        failures.append(f"close: {exc}")
    report(f"rank {rank}: steps {dh.open(args.run).steps}")
    for f in failures:
        report(f"rank {rank}: FAILURE {f}")


def report(line: str) -> None:
    """One write per line, so that the launcher does not interleave the ranks' lines."""
    sys.stdout.write(line.replace("\n", " ") + "\n")
    sys.stdout.flush()


def fail_puts_at(step: int):
    """Make this rank's puts of one step fail, inside the real backends' writers."""
    from datastates_hist.backends.adios2_bp5 import Adios2StepWriter
    from datastates_hist.backends.hdf5 import HDF5StepWriter

    for cls in (Adios2StepWriter, HDF5StepWriter):
        def put(self, name, array, start, _original=cls.put):
            if f"{step:012d}" in self.tmp:
                raise OSError(f"injected failure of a put at step {step}")
            return _original(self, name, array, start)

        cls.put = put


def no_more_files() -> tuple[int, int]:
    """Lower this process's limit of open files to those open now; the limits it had."""
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)  # the lowest free descriptor: no file can be opened below the new limit
    resource.setrlimit(resource.RLIMIT_NOFILE, (fd, limits[1]))
    return limits


def fail_index_once():
    """Make rank 0's first opening of the index for a commit fail (the Checkpointer's own
    opening, in the constructor, comes first and works)."""
    from datastates_hist import commit

    original, calls = commit.Index, []

    def index(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("injected failure to open the index")
        return original(*args, **kwargs)

    commit.Index = index


def fail_open_at(step: int):
    """Make this rank fail to open its writer of one step (before anything is written)."""
    from datastates_hist.backends.base import Backend

    original = Backend.begin_step

    def begin_step(self, steps_dir, at, group=None, part=""):
        if at == step:
            raise OSError(f"injected failure to open step {step}")
        return original(self, steps_dir, at, group, part)

    Backend.begin_step = begin_step


def restore(args, comm):
    model, mesh = build(args.model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    # one training step creates the optimizer state that restore loads into
    x, y = batch(0, 0, mesh)
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    rank = dist.get_rank() if dist.is_initialized() else 0
    ckpt = dh.Checkpointer(args.run, comm=comm)
    table = RowBlock(ROWS, rank, dist.get_world_size() if dist.is_initialized() else 1)
    restored = ckpt.restore(args.step, model, opt, table=table)
    got = global_tensors(model, opt)
    if not torch.equal(table.data, expected_table(args.step, ROWS)[table.start:table.stop]):
        got["extra/table/table"] = None  # reported as differing below
    want = torch.load(os.path.join(args.run + ".expected", f"{args.step}.pt"))
    bad = [n for n in want if n not in got or got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]
    bad += [n for n, t in got.items() if t is None]
    bad += [n for n in got if n not in want]
    if rank == 0:
        with dh.open(args.run) as h:
            for name, t in want.items():
                read = h.read(name, args.step)
                if read.dtype != t.dtype or not torch.equal(read, t):
                    bad.append(f"history read of {name}")
            if not torch.equal(h.read("extra/table/table", args.step), expected_table(args.step, ROWS)):
                bad.append("history read of the declared blocks")
    ckpt.close()
    report(f"rank {rank}: restored step {restored.step} (rng {restored.rng}) data={restored.extra['data']}; "
          f"{len(want)} tensors compared, {len(bad)} differ {bad[:5]}")
    return 1 if bad or restored.extra["data"] != {"step": args.step} else 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=["train", "restore"])
    p.add_argument("run")
    p.add_argument("step", type=int, nargs="?")
    p.add_argument("--model", default="ddp", choices=["ddp", "dtensor", "plain"])
    p.add_argument("--backend", default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--aggregators", type=int, default=0, help="BP5 NumAggregators (MPI)")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=-1)
    # raise: write() raises; put: a put fails; open: opening the step's writer fails; extra: a
    # tensor this rank alone holds; elsewhere: another run directory; backend: another
    # backend; fds: no file can be opened (a real failure); skip: write() not called at the
    # step; one-more: a step more than the other ranks; truncate: raise, then every rank
    # truncates after step 1 once rank 0 alone has reported the failure; truncate-one: this
    # rank alone truncates; keep: this rank alone has keep=; index: rank 0 cannot open the
    # index at its first commit; huge: every rank writes finite values whose squares overflow;
    # values: every rank writes a plain value of its own
    p.add_argument("--fail-how", default=None, choices=[
        "raise", "put", "open", "extra", "elsewhere", "backend", "fds", "skip", "one-more", "truncate",
        "truncate-one", "keep", "index", "huge", "values"])
    args = p.parse_args()
    comm = init_distributed()
    try:
        rc = train(args, comm) if args.action == "train" else restore(args, comm)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    end(rc or 0)


def end(rc: int) -> None:
    """Finalize MPI and exit at once, without C++ static destructors.

    torch keeps its gloo threads (and rank 0's TCPStore thread) running after
    ``destroy_process_group`` once DDP or DTensor used the group, so a normal exit
    runs the static destructors of every library beside them; an abort there
    ("terminate called without an active exception") was seen once after a
    correct restore. Everything of the job's own is closed by now.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    os._exit(rc)


if __name__ == "__main__":
    main()
