#!/usr/bin/env python3
"""Aggregate checkpoint write throughput on 1, 2 and 4 MPI ranks, against ``dd``.

    python tools/bench_mpi.py [--mb 512] [--steps 5] [--targets /dev/shm,/var/tmp] [--json]

Every rank holds the same state (as with DDP): ``--mb`` MB of float32 tensors
plus a small model. Each step is written with ``Checkpointer(comm=MPI.COMM_WORLD)``
(one BP5 file per step, written collectively; the ranks split the replicated
tensors so that each byte is written once) and waited for until committed.
Throughput is the state's bytes over the slowest rank's write-to-commit time,
the median over the steps after the first. ``dd`` writes the same bytes to the
same target with ``conv=fdatasync`` in the same run. Also printed: the bytes
and files each step leaves on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def worker(args) -> None:
    import torch
    from mpi4py import MPI

    import datastates_hist as dh

    comm = MPI.COMM_WORLD
    n = args.mb * (1 << 20) // 4
    count = 8
    state = {f"t{i}": torch.randn(n // count) for i in range(count)}  # the same seed: replicated
    model = torch.nn.Linear(64, 64)
    params = dict(kv.split("=", 1) for kv in args.params.split(",")) if args.params else {}
    ckpt = dh.Checkpointer(args.run, comm=comm, host_cache_bytes=max(256 << 20, 2 * args.mb << 20),
                           backend_options={"parameters": params} if params else None)
    times = []
    for step in range(args.steps):
        comm.Barrier()
        t0 = time.perf_counter()
        ckpt.write(step, model, state=state)
        ckpt.wait()
        mine = time.perf_counter() - t0
        times.append(comm.allreduce(mine, op=MPI.MAX))
        for t in state.values():
            t.add_(1.0)
    ckpt.close()
    if comm.rank == 0:
        unit = os.path.join(args.run, "steps", f"{args.steps - 1:012d}.bp")
        files = [os.path.join(root, f) for root, _, fs in os.walk(unit) for f in fs]
        nbytes = args.mb * (1 << 20) + sum(p.numel() * 4 for p in model.parameters())
        print(json.dumps({
            "ranks": comm.size, "state_bytes": nbytes, "seconds": times,
            "files": len(files), "disk_bytes": sum(os.path.getsize(f) for f in files),
            "subfiles": sum(1 for f in files if os.path.basename(f).startswith("data.")),
        }), flush=True)


def dd(target: str, mb: int) -> float:
    path = os.path.join(target, "dh-bench-dd.tmp")
    try:
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={mb // 4}", "conv=fdatasync"],
                       check=True, capture_output=True)
        return mb * (1 << 20) / (time.perf_counter() - t0)
    finally:
        if os.path.exists(path):
            os.remove(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=512, help="state size in MB")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--targets", default="/dev/shm,/var/tmp")
    p.add_argument("--params", default="", help="BP5 parameters, as Key=Value,Key=Value")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    for target in args.targets.split(","):
        for n in [int(x) for x in args.ranks.split(",")]:
            run = tempfile.mkdtemp(prefix="dh-bench-mpi-", dir=target)
            try:
                cmd = ["mpirun", "-n", str(n), sys.executable, __file__, "--worker", "--run", run,
                       "--mb", str(args.mb), "--steps", str(args.steps), "--params", args.params]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
                doc = json.loads(re.findall(r"^\{.*\}$", out, re.M)[-1])
            finally:
                shutil.rmtree(run, ignore_errors=True)
            seconds = statistics.median(doc["seconds"][1:] or doc["seconds"])
            dd_rate = dd(target, args.mb)  # right after, on the same target
            rows.append({"target": target, **doc, "median_s": seconds,
                         "rate": doc["state_bytes"] / seconds, "dd_rate": dd_rate})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"state {args.mb} MB replicated on every rank, {args.steps} steps, median of steps 2..{args.steps}")
    print(f"{'target':<10} {'ranks':>5} {'s/step':>8} {'MB/s':>8} {'dd MB/s':>8} {'x dd':>6} "
          f"{'MB/step':>8} {'files':>6} {'subfiles':>8}")
    for r in rows:
        print(f"{r['target']:<10} {r['ranks']:>5} {r['median_s']:>8.3f} {r['rate'] / 1e6:>8.0f} "
              f"{r['dd_rate'] / 1e6:>8.0f} {r['rate'] / r['dd_rate']:>6.2f} {r['disk_bytes'] / 1e6:>8.1f} "
              f"{r['files']:>6} {r['subfiles']:>8}")


if __name__ == "__main__":
    main()
