"""The speed of ``datastates-hist import`` against the read speed of its sources.

Writes SOURCES torch.save files (a model of MODEL_MB of float32 weights and its
Adam state, as a training script saves them), then measures in the same run:
``torch.load`` of every file (the read speed of the sources: each byte read
into memory), and the import of the same files into a new run, for each backend
and codec. Prints MB/s of each and the ratio import / read (target >= 0.8).
Files are read from the page cache in both (written just before); with ``--cold``,
from the disk: the sources' pages are dropped from the page cache
(``posix_fadvise(DONTNEED)``) before every timing, as for checkpoints saved
long before the import. An import ends with the data durable on disk, so the
bench also measures a durable copy of the same files (write, fsync) into the
same place as the imported run: the floor of any import there. ``--into DIR``
puts both there (default: beside the sources); ``--into /dev/shm`` takes the
destination's write out of the timing and leaves the importer's own cost.

    python tools/bench_import.py [--model-mb 64] [--sources 4] [--codec raw delta] [--cold] [--into DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datastates_hist.importing import import_sources  # noqa: E402
from datastates_hist.importing.sources import find_sources  # noqa: E402


def make_sources(folder: str, model_mb: int, count: int) -> list[str]:
    """``count`` checkpoints of a model of ``model_mb`` MB (8 layers) and its AdamW state."""
    torch.manual_seed(0)
    width = int((model_mb * 2**20 / 4 / 8) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    paths = []
    for step in range(1, count + 1):
        model(torch.randn(4, width)).sum().backward()
        opt.step()
        opt.zero_grad()
        paths.append(os.path.join(folder, f"step_{step * 100}.pt"))
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, paths[-1])
    return paths


def drop_pages(paths: list[str]) -> None:
    """Evict ``paths`` from the page cache (written back first), so the next read is from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn, before=None) -> float:
    """The wall time of ``fn``, after ``before`` (not timed)."""
    if before is not None:
        before()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_seconds(fn, before=None) -> float:
    """The CPU time of this process (every thread) spent in ``fn`` (after ``before``, not
    counted): steadier than wall time on a machine that other work shares."""
    if before is not None:
        before()
    def used():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    t0 = used()
    fn()
    return used() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-mb", type=int, default=64)
    p.add_argument("--sources", type=int, default=4)
    p.add_argument("--codec", nargs="+", default=["raw", "delta"])
    p.add_argument("--repeat", type=int, default=2, help="the best of this many timings of each")
    p.add_argument("--cold", action="store_true", help="read the sources from the disk, not the page cache")
    p.add_argument("--into", metavar="DIR", help="where the imported runs and the durable copies go "
                   "(default: beside the sources)")
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="bench_import_")
    into = tempfile.mkdtemp(prefix="bench_import_into_", dir=args.into) if args.into else folder
    try:
        paths = make_sources(folder, args.model_mb, args.sources)
        nbytes = sum(os.path.getsize(p) for p in paths)
        print(f"{len(paths)} torch.save files, {nbytes / 2**20:.0f} MiB in all (model and AdamW state)")

        def fresh():
            """Before each timing: with --cold, the sources' pages dropped (not timed)."""
            if args.cold:
                drop_pages(paths)

        def read_all():
            for path in paths:
                torch.load(path, map_location="cpu", weights_only=True)

        read_s = min(timed(read_all, fresh) for _ in range(args.repeat))
        read_cpu = min(cpu_seconds(read_all, fresh) for _ in range(args.repeat))
        read_rate = nbytes / read_s / 1e6
        where = "the disk" if args.cold else "the page cache"
        print(f"torch.load (weights_only=True) of every file, from {where}: {read_s:.2f} s, {read_rate:.0f} MB/s, "
              f"{read_cpu:.2f} CPU s")
        def copy_all():
            for path in paths:
                copy = os.path.join(into, os.path.basename(path) + ".copy")
                shutil.copyfile(path, copy)
                with open(copy, "rb+") as f:
                    os.fsync(f.fileno())
                os.remove(copy)

        copy_s = min(timed(copy_all, fresh) for _ in range(args.repeat))
        copy_rate = nbytes / copy_s / 1e6
        print(f"durable copy (write, fsync) of every file into {into}: {copy_s:.2f} s, {copy_rate:.0f} MB/s")
        sources = find_sources(paths)
        for backend in ("adios2", "hdf5"):
            for codec in args.codec:
                times, cpus = [], []
                run = os.path.join(into, f"run-{backend}-{codec}")
                for _ in range(args.repeat):
                    cpus.append(cpu_seconds(lambda: times.append(
                        timed(lambda: import_sources(run, sources, backend=backend, codec=codec))), fresh))
                    shutil.rmtree(run)
                best = min(times)
                rate = nbytes / best / 1e6
                print(f"import {backend:6s} codec={codec:5s}: {best:.2f} s, {rate:.0f} MB/s, {min(cpus):.2f} CPU s; "
                      f"{rate / read_rate:.2f}x the read speed ({read_cpu / min(cpus):.2f}x by CPU time), "
                      f"{rate / copy_rate:.2f}x the durable copy")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(into, ignore_errors=True)


if __name__ == "__main__":
    main()
