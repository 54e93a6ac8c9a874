#!/usr/bin/env python3
"""Snapshot bandwidth and checkpointing overhead of datastates-hist on a CUDA GPU.

    python tools/bench_gpu.py [--gb 2] [--steps 20] [--warmup 3] [--reps 5]
                              [--every 1] [--backend adios2] [--codec delta]
                              [--target /dev/shm] [--save FILE] [--json]
    python tools/bench_gpu.py --quick   # smoke run: 0.5 GB of parameters

Model: ``Linear(width, width)`` layers with ReLU between them, ``--gb`` GB of
float32 parameters on the GPU, Adam (``foreach=True``), random inputs made on
the GPU. State: the parameters and Adam's two moments (3x the parameters).

1. Device-to-host snapshot: the state's bytes over the median time of
   ``--reps`` repetitions (after an untimed one) of, raw, ``host.copy_(dev,
   non_blocking=True)`` of every tensor into its own pinned buffer and
   ``torch.cuda.synchronize()``; and of ``ckpt.write(step, model, optimizer)``,
   ``ckpt.wait_snapshot()`` (it returns once the copies are issued on the
   snapshot stream) and ``torch.cuda.synchronize()`` (until they are done),
   into a pinned host cache of the state + 10%, empty at each repetition (each
   step is then waited for until committed, untimed). Also: the time
   ``write()`` blocks, the first write (it allocates the cache), ``write()``
   until committed (the flush rate to ``--target``), and one synchronous
   ``torch.save`` of the same state to ``--target``, for comparison.
2. Overhead: the mean step time (forward, backward, optimizer step,
   ``torch.cuda.synchronize()``) of ``--steps`` steps after ``--warmup``, with
   no checkpointing and with ``ckpt.write`` every ``--every`` steps (the first
   timed step writes one; with ``--every 1`` the warm-up steps write too), and
   their ratio (target <= 1.03); the slowest step against the mean without
   checkpointing (every iteration counts, not only the mean); the time training
   is blocked (``write()`` and the hooks' waits) per step and per checkpoint;
   the drain time of ``ckpt.close()``; the tensors stored raw to keep up. The
   cache holds one checkpoint, so when checkpoints come faster than the flush
   writes them, a checkpoint waits for the previous one's flush: choose
   ``--every`` and ``--steps`` so that every timed checkpoint's flush ends
   within the timed steps.

The run directory is made under ``--target`` and removed at the end; a thread
prunes all but the newest committed step as training goes (as an every-step run
must): room for 3 checkpoints.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GB = 1e9


def fail(message: str) -> None:
    print(f"bench_gpu.py: {message}", file=sys.stderr)
    sys.exit(2)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def train(model, opt, args, ckpt=None, step0: int = 0) -> tuple[float, float, float, int]:
    """Mean and slowest step time after the warm-up; with ``ckpt``, the time training was
    blocked over the timed steps and the checkpoints written in them."""
    import torch

    times, blocked0, written = [], 0.0, 0
    for i in range(args.warmup + args.steps):
        if i == args.warmup and ckpt is not None:
            blocked0 = ckpt.blocked_seconds
        t0 = time.perf_counter()
        x = torch.randn(args.batch, args.width, device="cuda")
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if ckpt is not None and (i - args.warmup) % args.every == 0:
            ckpt.write(step0 + i, model, opt)
            written += i >= args.warmup
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    blocked = ckpt.blocked_seconds - blocked0 if ckpt is not None else 0.0
    return statistics.mean(times), max(times), blocked, written


def raw_copy(tensors, reps: int) -> float:
    """Median seconds to copy every tensor into its own pinned buffer."""
    import torch

    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for h, t in zip(hosts, tensors):
            h.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del hosts
    getattr(torch._C, "_host_emptyCache", lambda: None)()  # give the pinned pages back
    return statistics.median(times[1:])


def snapshot(ckpt, model, opt, reps: int, prune) -> dict:
    """write() + wait_snapshot() + synchronize, each from an empty cache; medians after the first."""
    import torch

    rows = []
    for step in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ckpt.write(step, model, opt)
        t1 = time.perf_counter()
        ckpt.wait_snapshot()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        ckpt.wait()
        rows.append((t1 - t0, t2 - t0, time.perf_counter() - t0))
        prune()
    med = [statistics.median(r[k] for r in rows[1:]) for k in range(3)]
    return {"first_s": rows[0][1], "write_s": med[0], "seconds": med[1], "commit_s": med[2]}


def torch_save(model, opt, target: str) -> float:
    """Seconds of one synchronous ``torch.save`` of the same state to ``target`` (the
    alternative: training stalls for the whole copy and write)."""
    import torch

    fd, path = tempfile.mkstemp(prefix="dh-bench-gpu-", suffix=".pt", dir=target)
    os.close(fd)
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        return time.perf_counter() - t0
    finally:
        os.remove(path)


def prune_until(stop, prune) -> None:
    """The pruning thread: keep the newest committed step only, until ``stop`` is set."""
    while not stop.wait(0.2):
        prune()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0, help="GB of float32 parameters (Adam adds twice that)")
    p.add_argument("--steps", type=int, default=20, help="timed training steps per configuration")
    p.add_argument("--warmup", type=int, default=3, help="untimed training steps first")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of each snapshot measurement")
    p.add_argument("--width", type=int, default=4096, help="features of each Linear layer")
    p.add_argument("--batch", type=int, default=8192, help="rows of the random input of a step")
    p.add_argument("--cache-gb", type=float, help="host cache of datastates-hist (default: state + 10%%)")
    p.add_argument("--target", default="/dev/shm", help="where the run directory is created")
    p.add_argument("--every", type=int, default=1, help="checkpoint every this many training steps")
    p.add_argument("--backend", choices=["adios2", "hdf5"], default="adios2", help="datastates-hist's backend")
    p.add_argument("--codec", choices=["delta", "key", "raw"], default="delta",
                   help="how datastates-hist stores tensors (Checkpointer's codec=)")
    p.add_argument("--save", metavar="FILE", help="also write the JSON document to FILE")
    p.add_argument("--quick", action="store_true", help="smoke run: --gb 0.5 --steps 8")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    args = p.parse_args()
    if args.quick:
        args.gb, args.steps = 0.5, 8
    if min(args.steps, args.reps, args.width, args.batch, args.every) < 1 or args.warmup < 0 or args.gb <= 0:
        p.error("--gb, --steps, --reps, --width, --batch and --every must be positive, --warmup not negative")
    try:
        import torch
    except ImportError:
        fail("a CUDA GPU is needed, and torch is not even installed")
    if not torch.cuda.is_available():
        fail(f"a CUDA GPU is needed; torch {torch.__version__} (CUDA {torch.version.cuda}) sees none")
    w = args.width
    layers = max(1, round(args.gb * GB / (4 * w * (w + 1))))
    state = 3 * 4 * layers * w * (w + 1)  # parameters and Adam's two moments, float32
    if not os.path.isdir(args.target):
        fail(f"--target {args.target} is not a directory")
    free = shutil.disk_usage(args.target).free
    if free < 3 * state:
        fail(f"{args.target} has {free / GB:.1f} GB free, this run needs about {3 * state / GB:.1f} GB "
             "(three checkpoints): choose another --target or a smaller --gb")

    import datastates_hist as dh
    from datastates_hist.index import Index
    from datastates_hist.retention import KeepLast, prune_index

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(w, w, device="cuda"), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods[:-1])
    opt = torch.optim.Adam(model.parameters(), lr=1e-5, foreach=True)
    log(f"{layers} x Linear({w}, {w}), state {state / GB:.2f} GB: training without checkpointing")
    base_s, base_max_s, _, _ = train(model, opt, args)  # also creates Adam's state
    tensors = [q.detach() for q in model.parameters()] + [
        v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.is_cuda]
    state = sum(t.numel() * t.element_size() for t in tensors)  # the same, counted
    log(f"step {base_s * 1e3:.1f} ms; raw copy_ to pinned memory")
    with torch.no_grad():
        raw_s = raw_copy(tensors, args.reps)
    del tensors
    log(f"raw {state / raw_s / GB:.1f} GB/s; one torch.save of the state")
    save_s = torch_save(model, opt, args.target)
    cache = int(args.cache_gb * GB) if args.cache_gb else int(state * 1.1)
    run = tempfile.mkdtemp(prefix="dh-bench-gpu-", dir=args.target)
    try:
        ckpt = dh.Checkpointer(run, host_cache_bytes=cache, codec=args.codec, backend=args.backend)
        index = Index(run, create=True)  # for pruning, beside the Checkpointer's own connections
        prune = functools.partial(prune_index, run, index, [KeepLast(1)])
        log(f"torch.save {save_s:.2f} s; datastates-hist snapshots")
        snap = snapshot(ckpt, model, opt, args.reps, prune)
        log(f"snapshot {state / snap['seconds'] / GB:.1f} GB/s, committed in {snap['commit_s']:.2f} s; "
            f"training with a checkpoint every {args.every} step(s)")
        stop = threading.Event()
        pruner = threading.Thread(target=prune_until, args=(stop, prune), name="bench-prune", daemon=True)
        pruner.start()
        raw0 = ckpt.raw_to_keep_up
        dh_s, dh_max_s, blocked, written = train(model, opt, args, ckpt, step0=args.reps + 1)
        stop.set()
        pruner.join()
        t0 = time.perf_counter()
        ckpt.close()
        drain = time.perf_counter() - t0
        raw_to_keep_up = ckpt.raw_to_keep_up - raw0  # those of the training steps, the drain's too
        index.close()
    finally:
        shutil.rmtree(run, ignore_errors=True)

    report = {
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
        "layers": layers, "width": w, "batch": args.batch, "state_bytes": state,
        "host_cache_bytes": cache, "target": args.target, "reps": args.reps, "codec": args.codec,
        "backend": args.backend, "every": args.every,
        "raw": {"seconds": raw_s, "GBps": state / raw_s / GB},
        "torch_save": {"seconds": save_s, "GBps": state / save_s / GB},
        "datastates_hist": {**snap, "GBps": state / snap["seconds"] / GB, "vs_raw": raw_s / snap["seconds"],
                            "flush_GBps": state / snap["commit_s"] / GB},
        "e2e": {"steps": args.steps, "warmup": args.warmup, "none_step_s": base_s, "dh_step_s": dh_s,
                "ratio": dh_s / base_s, "target_ratio": 1.03, "none_max_step_s": base_max_s,
                "dh_max_step_s": dh_max_s, "max_ratio": dh_max_s / base_s, "checkpoints": written,
                "blocked_per_step_s": blocked / args.steps,
                "blocked_per_checkpoint_s": blocked / written if written else None,
                "close_drain_s": drain, "raw_to_keep_up": raw_to_keep_up},
    }
    if args.save:
        with open(args.save, "w") as f:
            json.dump(report, f, indent=1)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    d = report["datastates_hist"]

    def row(label: str, ms: float, *cells: float, note: str = "") -> None:
        print(f"{label:<44} {ms:>9.1f}" + "".join(f" {c:>7.3f}" for c in cells) + note)

    print(f"GPU {report['gpu']}, torch {report['torch']}, CUDA {report['cuda']}")
    print(f"model {layers} x Linear({w}, {w}) float32, batch {args.batch}")
    print(f"state {state / GB:.2f} GB (parameters + Adam), host cache {cache / GB:.2f} GB")
    print(f"{args.backend}, codec {args.codec}, run on {args.target}")
    print(f"\n{f'device-to-host snapshot, median of {args.reps}':<44} {'ms':>9} {'GB/s':>7} {'x raw':>7}")
    row("raw copy_ to pinned buffers", raw_s * 1e3, state / raw_s / GB, 1.0)
    row("datastates-hist write + wait_snapshot", d["seconds"] * 1e3, d["GBps"], d["vs_raw"])
    row("  write() blocks", d["write_s"] * 1e3)
    row("  first write (allocates the pinned cache)", d["first_s"] * 1e3)
    row("  write until committed (flush)", d["commit_s"] * 1e3, d["flush_GBps"])
    row("torch.save of the same state, once", save_s * 1e3, state / save_s / GB)
    print(f"\n{f'training step, mean of {args.steps} after {args.warmup}':<44} {'ms':>9} {'x none':>7}")
    row("no checkpointing", base_s * 1e3, 1.0)
    every = "every step" if args.every == 1 else f"every {args.every} steps"
    row(f"ckpt.write {every}", dh_s * 1e3, dh_s / base_s, note="  (target <= 1.03)")
    row("  slowest step, x no checkpointing's mean", dh_max_s * 1e3, dh_max_s / base_s)
    row("  slowest step without checkpointing", base_max_s * 1e3, base_max_s / base_s)
    row("  blocked per step (write and hooks)", blocked / args.steps * 1e3)
    if written:
        row(f"  blocked per checkpoint ({written} timed)", blocked / written * 1e3)
    row("  close() drain", drain * 1e3)
    print(f"tensors stored raw to keep up with training: {raw_to_keep_up}")

if __name__ == "__main__":
    main()
