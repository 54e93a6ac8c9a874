"""Benchmark: one tensor across 50 steps, from a history against from ``torch.save`` files.

Trains the example GPT (examples/train_gpt.py) for a few steps, then for 50
more steps writes, after every step, the same state (model and optimizer) both
to a datastates-hist history (each backend and codec asked for: ``raw``, and
``delta``, the default, whose steps are stored as deltas of the step before)
and to one ``torch.save`` file. Then, in the same process and with
repetitions, times getting one tensor at all 50 steps as one numpy array:

- ``h.to_xarray(name).values`` on a freshly opened history (each backend and codec);
- the same restricted to the first 8 rows (only those bytes are read; a delta's
  whole tensor is decoded);
- ``h.read(name, step)`` of one step in the middle, on a freshly opened history
  (a delta decodes its chain back to the last key step);
- ``torch.load`` of each of the 50 files, picking the tensor;
- ``torch.load(..., mmap=True)`` of each file, picking the tensor (its bytes copied).

Every method returns the same array (checked). OS caches cannot be dropped
without privileges the benchmark should not need, so every file was just
written and is likely in the page cache for all methods alike: this measures
reading from memory, not from the disk. The order of the methods alternates
between repetitions (rotated, and reversed every other one) so that none
always runs first or after the same one. Prints the median and minimum times
and the ratio of each ``torch.load`` method to the history.

    python tools/bench_query.py --size small --reps 5
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

import datastates_hist as dh  # noqa: E402
import train_gpt  # noqa: E402


def build(root: str, args) -> tuple[dict[str, str], list[str]]:
    """Train, then write ``args.steps`` steps to a history per backend and to torch.save files."""
    torch.manual_seed(0)
    model = train_gpt.build_model(args.size, block_size=args.block_size)
    opt = train_gpt.make_optimizer(model, 1e-3)
    corpus = train_gpt.load_corpus(2 << 20)
    runs = {f"{b} {c}": os.path.join(root, f"dh-{b}-{c}") for b in args.backends for c in args.codecs}
    ckpts = [dh.Checkpointer(path, backend=label.split()[0], codec=label.split()[1]) for label, path in runs.items()]
    pt_dir = os.path.join(root, "torch-save")
    os.makedirs(pt_dir)
    files = []
    for step in range(args.warmup + args.steps):
        x, y = train_gpt.get_batch(corpus, args.batch_size, args.block_size)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step < args.warmup:
            continue
        for ckpt in ckpts:
            ckpt.write(step, model, opt)
        files.append(os.path.join(pt_dir, f"step{step:06d}.pt"))
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, files[-1])
    for ckpt in ckpts:
        ckpt.close()
    return runs, files


def via_xarray(run: str, name: str, rows: int | None = None) -> np.ndarray:
    with dh.open(run) as h:
        da = h.to_xarray(name)
        return (da if rows is None else da[:, :rows]).values


def via_torch_load(files: list[str], name: str, mmap: bool = False, rows: int | None = None) -> np.ndarray:
    out = []
    for f in files:
        t = torch.load(f, mmap=mmap, weights_only=True)["model"][name]
        out.append(t.numpy() if rows is None else t[:rows].numpy())
    return np.stack(out)  # copies: with mmap=True this is where the bytes are read


def one_step(run: str, name: str, step: int) -> np.ndarray:
    with dh.open(run) as h:
        return h.read(name, step).numpy()


def size_of(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(train_gpt.SIZES), default="small")
    p.add_argument("--steps", type=int, default=50, help="checkpointed steps")
    p.add_argument("--warmup", type=int, default=3, help="training steps before the first checkpoint")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tensor", default="blocks.0.qkv.weight", help="model tensor to read")
    p.add_argument("--backends", nargs="+", default=["adios2", "hdf5"])
    p.add_argument("--codecs", nargs="+", default=["raw", "delta"], choices=["raw", "key", "delta"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the written files")
    args = p.parse_args(argv)

    root = tempfile.mkdtemp(prefix="dh-bench-query-", dir=args.dir)
    try:
        t0 = time.perf_counter()
        runs, files = build(root, args)
        print(f"wrote {args.steps} steps of GPT {args.size} in {time.perf_counter() - t0:.1f} s under {root}")
        name = args.tensor
        full = "model/" + name
        shape = torch.load(files[0], weights_only=True)["model"][name].shape
        print(f"tensor {name} {list(shape)} float32; one torch.save file {size_of(files[0]) / 1e6:.1f} MB; "
              + "; ".join(f"{b} history {size_of(r) / 1e6 / args.steps:.1f} MB per step"
                          for b, r in runs.items()))
        middle = args.warmup + args.steps // 2
        methods = {}
        for b, run in runs.items():
            methods[f"dh {b}: h.to_xarray(name).values"] = lambda run=run: via_xarray(run, full)
            methods[f"dh {b}: h.to_xarray(name)[:, :8].values"] = lambda run=run: via_xarray(run, full, 8)
            methods[f"dh {b}: h.read(name, {middle})"] = lambda run=run: one_step(run, full, middle)
        load_plain = f"torch.load x{args.steps}, pick the tensor"
        load_mmap = f"torch.load(mmap=True) x{args.steps}, pick the tensor"
        methods[load_plain] = lambda: via_torch_load(files, name)
        methods[load_mmap] = lambda: via_torch_load(files, name, mmap=True)

        want = via_torch_load(files, name)
        for label, fn in methods.items():  # every method gives the same numbers (and warms up)
            got = fn()
            expected = want[:, :8] if "[:, :8]" in label else want[args.steps // 2] if "h.read" in label else want
            assert np.array_equal(got, expected), label
        times = {label: [] for label in methods}
        order = list(methods)
        for rep in range(args.reps):
            k = rep % len(order)
            this = order[k:] + order[:k]
            for label in this[::-1] if rep % 2 else this:
                gc.collect()
                t = time.perf_counter()
                methods[label]()
                times[label].append(time.perf_counter() - t)

        med = {label: statistics.median(ts) for label, ts in times.items()}
        ref = {b: med[f"dh {b}: h.to_xarray(name).values"] for b in runs}
        print(f"\none tensor across {args.steps} steps, {args.reps} repetitions, page cache warm "
              "(cannot be dropped), method order alternated\n")
        width = max(map(len, methods))
        print(f"{'method':<{width}}  {'median s':>9}  {'min s':>9}  " + "  ".join(f"{'x ' + b:>10}" for b in runs))
        for label in methods:
            ratios = "  ".join(f"{med[label] / ref[b]:>10.2f}" for b in runs)
            print(f"{label:<{width}}  {med[label]:>9.4f}  {min(times[label]):>9.4f}  {ratios}")
        print("\n'x <backend>': median time / median time of h.to_xarray(name).values on that backend")
        for b in runs:
            for label in (load_plain, load_mmap):
                print(f"ratio {label} / dh {b} to_xarray: {med[label] / ref[b]:.1f}")
        for backend in args.backends:
            for codec in args.codecs:
                if codec == "raw" or "raw" not in args.codecs:
                    continue
                enc, raw = f"{backend} {codec}", f"{backend} raw"
                for what in ("h.to_xarray(name).values", f"h.read(name, {middle})"):
                    print(f"ratio {codec} / raw, {backend}, {what}: "
                          f"{med[f'dh {enc}: {what}'] / med[f'dh {raw}: {what}']:.2f}")
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
