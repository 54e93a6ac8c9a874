"""Benchmark datastates-hist against torch.save and PyTorch DCP, side by side, in one run.

Sections (``--sections``, default all):
  e2e      mean training step time checkpointing every iteration, for no checkpointing,
           torch.save, torch.distributed.checkpoint.async_save and datastates-hist (each
           backend); training-thread blocking per checkpoint; peak RSS. ``bytes.write`` is
           the floor: a background thread writes the state's bytes to a new file every
           step (the optimizer step waits for it), and does nothing else.
  flush    flush throughput of a state larger than the host cache, against dd with fdatasync
           to the same target: the second checkpoint of a process (``first``: the first, which
           also faults the fresh host cache in).
  restore  restore time against torch.load(mmap=True) and torch.distributed.checkpoint.load;
           ``ready``: the restore plus the first optimizer step after it (which touches every
           byte of the optimizer's state: what a lazy load leaves for later is paid there).
  slow     storage slower than training (``--slow-mb-per-s``, emulated by a writer that
           takes state bytes / rate per put): step times (median, 95th percentile), the
           step time the storage allows, and peak RSS against no checkpointing, with a
           host cache of ``--slow-cache-mb``.
  query    one tensor across 50 steps from a history against 50 torch.load (the
           query benchmark of tools/bench_query.py, run from here).
``--figure PATH`` draws the end-to-end step times per configuration (matplotlib).
Each configuration runs in a fresh process; configurations alternate across repetitions so
that drifts of a shared machine hit all alike. Medians are printed with ratios.

    python tools/bench.py --sizes small --targets /dev/shm,/var/tmp --reps 3 [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)

E2E_CONFIGS = ("none", "bytes.write", "torch.save", "dcp.async_save", "dh-adios2", "dh-adios2-raw",
               "dh-adios2-history", "dh-hdf5", "dh-hdf5-raw")


def dh_options(config: str) -> tuple[str, dict]:
    """``dh-BACKEND[-raw|-key|-history]`` -> (backend, Checkpointer options): the default codec
    (deltas, every step kept), raw or key-only storage, or the quickstart's history policies."""
    import datastates_hist as dh

    backend, _, variant = config[3:].partition("-")
    if variant == "history":
        return backend, {"keep": dh.KeepLast(2) | dh.KeepEvery(1000), "trajectory": dh.Trajectory("model/*")}
    return backend, ({"codec": variant} if variant else {})


def write_bytes(tensors: list, path: str) -> None:
    """Each tensor's bytes written once to ``path``, nothing else (no copy, no checksum,
    no metadata): what storing every byte of the state costs at the least."""
    import torch

    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            f.write(t.detach().reshape(-1).view(torch.uint8).numpy().data)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def state_of(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def throttled(name: str, mb_per_s: float) -> str:
    """Register a backend that writes through ``name`` at no more than ``mb_per_s``: each put
    takes its bytes / rate longer, as on a slower device; its space in the host cache is
    held until then, as on a real one."""
    from datastates_hist.backends import get_backend, register_backend

    inner = get_backend(name)

    class Throttled(type(inner)):
        def begin_step(self, steps_dir, step, group=None, part=""):
            writer = inner.begin_step(steps_dir, step, group, part)
            put = writer.put

            def slow_put(var, array, start):
                put(var, array, start)
                time.sleep(array.nbytes / (mb_per_s * 1e6))
            writer.put = slow_put
            return writer

    register_backend(f"slow-{name}", Throttled())
    return f"slow-{name}"


def e2e_child(config: str, target: str, size: str, steps: int, warmup: int, cache_mb: int,
              slow_mb_per_s: float = 0) -> dict:
    """Train ``steps`` steps under one configuration."""
    import torch
    import torch.nn.functional as F

    import train_gpt

    torch.manual_seed(0)
    model = train_gpt.build_model(size, block_size=128)
    opt = train_gpt.make_optimizer(model, 1e-3)
    corpus = train_gpt.load_corpus(2 << 20)
    ckpt, pending = None, None
    if config == "bytes.write":
        from concurrent.futures import ThreadPoolExecutor

        writer = ThreadPoolExecutor(1)
    if config.startswith("dh-"):
        import datastates_hist as dh

        backend, options = dh_options(config)
        backend = throttled(backend, slow_mb_per_s) if slow_mb_per_s else backend
        ckpt = dh.Checkpointer(target, backend=backend, host_cache_bytes=cache_mb << 20, **options)
    if config.startswith("dcp"):
        import warnings

        import torch.distributed.checkpoint as dcp

        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    step_times, blocked = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = train_gpt.get_batch(corpus, 8, 128)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        w0 = time.perf_counter()
        if pending is not None and config == "bytes.write":
            pending.result()  # the state must not change while its bytes are written
        waited = time.perf_counter() - w0
        opt.step()
        opt.zero_grad(set_to_none=True)
        b0 = time.perf_counter() - waited
        if config == "bytes.write":
            tensors = list(model.state_dict().values()) + [
                v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
            pending = writer.submit(write_bytes, tensors, os.path.join(target, f"step{step}.bin"))
        elif config == "torch.save":
            torch.save(state_of(model, opt), os.path.join(target, f"step{step}.pt"))
        elif config == "dcp.async_save":
            if pending is not None:
                pending.result()  # one in flight, as its documentation advises
            pending = dcp.async_save(state_of(model, opt), checkpoint_id=os.path.join(target, f"step{step}"))
        elif ckpt is not None:
            ckpt.write(step, model, opt, data={"step": step})
        t1 = time.perf_counter()
        if step >= warmup:
            step_times.append(t1 - t0)
            blocked.append(t1 - b0)
    d0 = time.perf_counter()
    if pending is not None:
        pending.result()
    if ckpt is not None:
        ckpt.close()
        blocked = [ckpt.blocked_seconds / ckpt.writes]  # write() and the hooks' waits
    drain = time.perf_counter() - d0
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    return {"step_s": statistics.median(step_times), "step_p95_s": sorted(step_times)[int(0.95 * (len(step_times) - 1))],
            "blocked_s": statistics.mean(blocked), "drain_s": drain, "state_bytes": nbytes, "rss_mb": peak_rss_mb(),
            "stored_bytes": tree_bytes(target) / steps}


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def flush_child(config: str, target: str, total_mb: int, cache_mb: int) -> dict:
    """Write a synthetic state of ``total_mb`` through a host cache of ``cache_mb``."""
    if config == "dd":
        path = os.path.join(target, "dd.bin")
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={total_mb // 4}",
                        "conv=fdatasync"], check=True, capture_output=True)
        return {"seconds": time.perf_counter() - t0, "mb": total_mb}
    import torch

    import datastates_hist as dh

    tensors = {f"t{i}": torch.randn(16 << 20 >> 2) for i in range(total_mb // 16)}  # 16 MB each
    backend, options = dh_options(config)
    ckpt = dh.Checkpointer(target, backend=backend, host_cache_bytes=cache_mb << 20, **options)
    seconds = []
    for step in range(2):  # the first checkpoint of a process also faults the host cache in
        t0 = time.perf_counter()
        ckpt.write(step, torch.nn.Linear(1, 1), state=tensors)
        ckpt.wait()
        seconds.append(time.perf_counter() - t0)
    ckpt.close()
    return {"first_seconds": seconds[0], "seconds": seconds[1], "mb": total_mb, "rss_mb": peak_rss_mb()}


def restore_child(config: str, target: str, size: str) -> dict:
    """Write one checkpoint of the example model, then time loading it back (in the same process,
    after writing: the page cache holds the files for every configuration alike)."""
    import warnings

    import torch

    import train_gpt

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.manual_seed(0)
    model = train_gpt.build_model(size, block_size=128)
    opt = train_gpt.make_optimizer(model, 1e-3)
    x = torch.randint(0, 256, (2, 128))
    model(x).sum().backward()
    opt.step()
    fresh = train_gpt.build_model(size, block_size=128)
    fresh_opt = train_gpt.make_optimizer(fresh, 1e-3)
    for p in fresh.parameters():  # gradients for the first step after the restore
        p.grad = torch.full_like(p, 1e-3)
    if config == "torch.load":
        path = os.path.join(target, "state.pt")
        torch.save(state_of(model, opt), path)
        t0 = time.perf_counter()
        sd = torch.load(path, mmap=True, weights_only=True)
        fresh.load_state_dict(sd["model"])
        fresh_opt.load_state_dict(sd["optim"])
    elif config == "dcp.load":
        import torch.distributed.checkpoint as dcp

        dcp.save(state_of(model, opt), checkpoint_id=os.path.join(target, "dcp"))
        fresh_opt_state = {"model": fresh.state_dict(), "optim": state_of(model, opt)["optim"]}
        fresh_opt_state = {"model": fresh.state_dict(),
                           "optim": {"state": {k: {n: torch.empty_like(v) if torch.is_tensor(v) else v
                                                   for n, v in s.items()}
                                               for k, s in opt.state_dict()["state"].items()},
                                     "param_groups": opt.state_dict()["param_groups"]}}
        t0 = time.perf_counter()
        dcp.load(fresh_opt_state, checkpoint_id=os.path.join(target, "dcp"))
        fresh.load_state_dict(fresh_opt_state["model"])
        fresh_opt.load_state_dict(fresh_opt_state["optim"])
    else:
        import datastates_hist as dh

        backend, options = dh_options(config)
        with dh.Checkpointer(target, backend=backend, **options) as ckpt:
            ckpt.write(0, model, opt)
        t0 = time.perf_counter()
        with dh.Checkpointer(target) as ckpt:
            ckpt.restore(model=fresh, optimizer=fresh_opt)
    seconds = time.perf_counter() - t0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    t1 = time.perf_counter()
    fresh_opt.step()  # the first update touches every byte of the optimizer's state
    return {"seconds": seconds, "ready_seconds": seconds + time.perf_counter() - t1}


def run_child(section: str, config: str, target_root: str, args) -> dict:
    target = os.path.join(target_root, f"dh-bench-{os.getpid()}")
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--child", section, config, target, "--sizes", args.size,
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--cache-mb", str(args.cache_mb),
             "--flush-mb", str(args.flush_mb), "--slow-mb-per-s", str(args.slow_mb_per_s if section == "slow" else 0),
             "--slow-cache-mb", str(args.slow_cache_mb)],
            check=True, capture_output=True, text=True,
        )
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"{section} {config} on {target_root} failed:\n{exc.stderr}") from None
    finally:
        shutil.rmtree(target, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def med(rs, key):
    return statistics.median(r[key] for r in rs)


def collect(section: str, configs, targets, args) -> dict:
    """``(target, config) -> [result per repetition]``, configurations alternating."""
    results: dict = {}
    for target in targets:
        for _ in range(args.reps):
            for config in configs:
                results.setdefault((target, config), []).append(run_child(section, config, target, args))
    return results


def bench_e2e(args, targets, configs) -> list[dict]:
    results = collect("e2e", configs, targets, args)
    rows = []
    for target in targets:
        base = med(results[(target, "none")], "step_s") if "none" in configs else None
        save = med(results[(target, "torch.save")], "blocked_s") if "torch.save" in configs else None
        for config in configs:
            rs = results[(target, config)]
            rows.append({"target": target, "config": config, "step_ms": med(rs, "step_s") * 1e3,
                         "vs_none": med(rs, "step_s") / base if base else None,
                         "blocked_ms": med(rs, "blocked_s") * 1e3,
                         "blocked_vs_torch_save": (med(rs, "blocked_s") / save
                                                   if save and config != "none" else None),
                         "drain_ms": med(rs, "drain_s") * 1e3, "peak_rss_mb": med(rs, "rss_mb"),
                         "state_mb": rs[0]["state_bytes"] / 1e6,
                         "stored_mb_per_step": med(rs, "stored_bytes") / 1e6})
    return rows


def bench_flush(args, targets, backends) -> list[dict]:
    configs = ["dd"] + [f"dh-{b}" for b in backends]
    results = collect("flush", configs, targets, args)
    rows = []
    for target in targets:
        dd = args.flush_mb / med(results[(target, "dd")], "seconds")
        for config in configs:
            mbs = args.flush_mb / med(results[(target, config)], "seconds")
            first = args.flush_mb / med(results[(target, config)], "first_seconds") if config != "dd" else None
            rows.append({"target": target, "config": config, "MB_per_s": mbs, "vs_dd": mbs / dd,
                         "first_MB_per_s": first, "first_vs_dd": first / dd if first else None,
                         "peak_rss_mb": med(results[(target, config)], "rss_mb")
                         if config != "dd" else None})
    return rows


def bench_slow(args, targets, backends) -> list[dict]:
    configs = ["none"] + [f"dh-{b}" for b in backends]
    results = collect("slow", configs, targets, args)
    rows = []
    for target in targets:
        base = results[(target, "none")]
        for config in configs:
            rs = results[(target, config)]
            storage_ms = rs[0]["state_bytes"] / (args.slow_mb_per_s * 1e6) * 1e3
            rows.append({"target": target, "config": config, "step_ms": med(rs, "step_s") * 1e3,
                         "p95_ms": med(rs, "step_p95_s") * 1e3,
                         "storage_ms": storage_ms if config != "none" else None,
                         "peak_rss_mb": med(rs, "rss_mb"),
                         "rss_over_none_mb": med(rs, "rss_mb") - med(base, "rss_mb"),
                         "cache_mb": args.slow_cache_mb if config != "none" else None})
    return rows


def bench_restore(args, targets, backends) -> list[dict]:
    configs = ["torch.load", "dcp.load"] + [f"dh-{b}{v}" for b in backends for v in ("", "-raw")]
    results = collect("restore", configs, targets, args)
    rows = []
    for target in targets:
        tl, dl = med(results[(target, "torch.load")], "seconds"), med(results[(target, "dcp.load")], "seconds")
        tl_ready = med(results[(target, "torch.load")], "ready_seconds")
        dl_ready = med(results[(target, "dcp.load")], "ready_seconds")
        for config in configs:
            s = med(results[(target, config)], "seconds")
            ready = med(results[(target, config)], "ready_seconds")
            rows.append({"target": target, "config": config, "ms": s * 1e3,
                         "speedup_vs_torch_load": tl / s, "speedup_vs_dcp_load": dl / s,
                         "ready_ms": ready * 1e3, "ready_vs_torch_load": tl_ready / ready,
                         "ready_vs_dcp_load": dl_ready / ready})
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    if not rows:
        return
    cols = list(rows[0])
    fmt = [lambda v: "" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))]
    cells = [[fmt[0](r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", default="e2e,flush,restore,slow")
    p.add_argument("--sizes", default="small", help="example model sizes (tiny, small, medium)")
    p.add_argument("--targets", default="/dev/shm," + tempfile.gettempdir())
    p.add_argument("--configs", default=",".join(E2E_CONFIGS))
    p.add_argument("--backends", default="adios2,hdf5")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cache-mb", type=int, default=1024, help="datastates-hist host cache")
    p.add_argument("--flush-mb", type=int, default=1024, help="state size of the flush section")
    p.add_argument("--slow-mb-per-s", type=float, default=40, help="storage speed of the slow section")
    p.add_argument("--slow-cache-mb", type=int, default=128, help="host cache of the slow section")
    p.add_argument("--figure", help="write a PNG of the end-to-end step times here")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", nargs=3, metavar=("SECTION", "CONFIG", "TARGET"))
    args = p.parse_args()
    if args.child:
        section, config, target = args.child
        args.size = args.sizes
        if section == "e2e":
            out = e2e_child(config, target, args.size, args.steps, args.warmup, args.cache_mb)
        elif section == "slow":
            out = e2e_child(config, target, args.size, args.steps, args.warmup, args.slow_cache_mb,
                            args.slow_mb_per_s)
        elif section == "flush":
            out = flush_child(config, target, args.flush_mb, args.cache_mb)
        else:
            out = restore_child(config, target, args.size)
        print(json.dumps(out))
        return
    targets = args.targets.split(",")
    backends = [b for b in args.backends.split(",") if b]
    sections = args.sections.split(",")
    report: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    for size in args.sizes.split(","):
        args.size = size
        if "e2e" in sections:
            report[f"e2e {size}"] = bench_e2e(args, targets, args.configs.split(","))
        if "restore" in sections:
            report[f"restore {size}"] = bench_restore(args, targets, backends)
        if "slow" in sections:
            report[f"slow storage {size} ({args.slow_mb_per_s:g} MB/s)"] = bench_slow(args, targets, backends)
    if "flush" in sections:
        args.size = args.sizes.split(",")[0]
        report["flush"] = bench_flush(args, targets, backends)
    if args.figure:
        figure(report, args.figure)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for title, rows in report.items():
            if title != "machine":
                print_table(title, rows)
    if "query" in sections:
        import bench_query

        bench_query.main(["--size", args.sizes.split(",")[0], "--reps", str(args.reps)])


def figure(report: dict, path: str) -> None:
    """Bars of the median step time per configuration, one group per target, for each size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e2e = {k: v for k, v in report.items() if k.startswith("e2e")}
    if not e2e:
        return
    fig, axes = plt.subplots(1, len(e2e), figsize=(6 * len(e2e), 4), squeeze=False)
    for ax, (title, rows) in zip(axes[0], e2e.items()):
        targets = list(dict.fromkeys(r["target"] for r in rows))
        configs = list(dict.fromkeys(r["config"] for r in rows))
        width = 0.8 / len(configs)
        for i, config in enumerate(configs):
            ms = [next(r["step_ms"] for r in rows if r["target"] == t and r["config"] == config) for t in targets]
            bars = ax.bar([k + i * width for k in range(len(targets))], ms, width, label=config)
            ax.bar_label(bars, labels=[f"{m / ms0:.2f}x" for m, ms0 in zip(ms, [
                next(r["step_ms"] for r in rows if r["target"] == t and r["config"] == configs[0]) for t in targets])],
                fontsize=7)
        ax.set_xticks([k + width * (len(configs) - 1) / 2 for k in range(len(targets))], targets)
        ax.set_ylabel("median step time (ms)")
        ax.set_title(f"{title}: checkpoint every step (ratio to {configs[0]})")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)  # below the bars
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
