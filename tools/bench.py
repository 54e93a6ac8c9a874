"""Benchmark datastates-hist against torch.save and PyTorch DCP, side by side, in one run.

Sections (``--sections``, default all):
  e2e      training step time checkpointing every iteration, for no checkpointing,
           torch.save, torch.distributed.checkpoint.async_save (thread and process modes)
           and datastates-hist (each backend): median over repetitions and the slowest
           repetition; training-thread blocking per checkpoint; CPU seconds per checkpoint
           (all threads of the training process and its child processes, over no
           checkpointing's; DCP's writer process also alone); peak RSS. ``bytes.write`` is
           the floor: a background thread writes the state's bytes to a new file every
           step (the optimizer step waits for it), and does nothing else. ``checks``
           compares each datastates-hist row with the others of its target (the
           performance issue's targets 1-4).
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
Workloads (``--sizes``): the example GPT (tiny, small, medium; batch 8 x 128 tokens) and
``storage``: a wide MLP trained with Adam, 176 MB of state against a step of about 130 ms on
2 cores, where checkpointing every step is bound by bytes and CPU, not by compute.
``--figure PATH`` draws the end-to-end step times per configuration (matplotlib).
Each configuration runs in a fresh process; configurations alternate across repetitions so
that drifts of a shared machine hit all alike. Medians are printed with ratios.

    python tools/bench.py --sections e2e --sizes small,storage --targets /dev/shm,/var/tmp
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

E2E_CONFIGS = ("none", "bytes.write", "torch.save", "dcp.async_save", "dcp.async_save-process",
               "dh-adios2", "dh-adios2-raw", "dh-adios2-history", "dh-hdf5", "dh-hdf5-raw")
# The storage-heavy workload: (input, width, hidden layers, batch) -> 14.7 M parameters.
STORAGE_MLP = (512, 2048, 3, 160)


class Workload:
    """A model, its optimizer, and a batch and loss to train it on, by ``--sizes`` name: the
    example GPT's sizes, or ``storage`` (a wide MLP fitting a fixed random target with Adam)."""

    def __init__(self, size: str):
        import torch

        torch.manual_seed(0)
        self.size = size
        if size == "storage":
            inputs, width, depth, self.batch_size = STORAGE_MLP
            layers = [torch.nn.Linear(inputs, width), torch.nn.GELU()]
            for _ in range(depth):
                layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
            self.model = torch.nn.Sequential(*layers, torch.nn.Linear(width, inputs))
            self.optimizer = torch.optim.Adam(self.model.parameters(), 1e-4)
            self.target = torch.randn(inputs, inputs) / inputs ** 0.5
        else:
            import train_gpt

            self.model = train_gpt.build_model(size, block_size=128)
            self.optimizer = train_gpt.make_optimizer(self.model, 1e-3)
            self.corpus = train_gpt.load_corpus(2 << 20)

    def backward(self) -> None:
        """One batch forward and backward (the optimizer step is the caller's)."""
        import torch
        import torch.nn.functional as F

        if self.size == "storage":
            x = torch.randn(self.batch_size, self.target.shape[0])
            F.mse_loss(self.model(x), torch.tanh(x @ self.target)).backward()
        else:
            import train_gpt

            x, y = train_gpt.get_batch(self.corpus, 8, 128)
            F.cross_entropy(self.model(x).flatten(0, 1), y.flatten()).backward()


def dh_options(config: str) -> tuple[str, dict]:
    """``dh-BACKEND[-raw|-key|-history][-keepup|-always]`` -> (backend, Checkpointer options):
    the default codec (deltas, every step kept), raw or key-only storage, or the quickstart's
    history policies; ``-keepup``: with ``keep_up=True`` (raw from a half-full cache, the
    flush at nice 19), ``-always``: ``keep_up=False`` (encoded however far behind); the
    default stores raw from a 90%-full cache that holds a later step."""
    import datastates_hist as dh

    backend, *variants = config[3:].split("-")
    options = {}
    for variant in variants:
        if variant == "history":
            options.update(keep=dh.KeepLast(2) | dh.KeepEvery(1000), trajectory=dh.Trajectory("model/*"))
        elif variant in ("keepup", "always"):
            options["keep_up"] = variant == "keepup"
        elif variant in ("raw", "key"):
            options["codec"] = variant
        else:
            raise SystemExit(f"unknown configuration {config!r}: its variants are raw, key, history, keepup, always")
    return backend, options


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


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds of this process, all threads; of its child processes, live or reaped)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), children.ru_utime + children.ru_stime + sum(
        proc_cpu_seconds(pid) for pid in descendants(os.getpid()))


def descendants(pid: int) -> list[int]:
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # the process ended meanwhile
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:  # so did the thread
            continue
        for kid in kids:
            found += [kid, *descendants(kid)]
    return found


def proc_cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def dcp_saver(config: str):
    """``dcp.async_save[-process]`` -> a function that starts saving a state dict to a path
    and returns its future. The process mode runs the write in a writer process, which needs
    a process group (here gloo, one rank); pinned-memory staging needs CUDA (DCP ignores it
    on a CPU-only machine), so neither mode pins."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    mode = AsyncCheckpointerType.THREAD
    if config.endswith("-process"):
        mode = AsyncCheckpointerType.PROCESS
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return lambda state, path: dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=mode)


def e2e_child(config: str, target: str, size: str, steps: int, warmup: int, cache_mb: int,
              slow_mb_per_s: float = 0) -> dict:
    """Train ``steps`` steps under one configuration; CPU seconds are counted from the first
    step after ``warmup`` until the last checkpoint is written."""
    import torch

    work = Workload(size)
    model, opt = work.model, work.optimizer
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
        async_save = dcp_saver(config)
    step_times, blocked, cpu0 = [], [], cpu_seconds()
    for step in range(steps):
        t0 = time.perf_counter()
        if step == warmup:
            cpu0 = cpu_seconds()
        work.backward()
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
        elif config.startswith("dcp"):
            if pending is not None:
                pending.result()  # one in flight, as its documentation advises
            pending = async_save(state_of(model, opt), os.path.join(target, f"step{step}"))
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
    cpu1 = cpu_seconds()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    return {"step_s": statistics.median(step_times), "step_p95_s": sorted(step_times)[int(0.95 * (len(step_times) - 1))],
            "total_s": sum(step_times) + drain, "cpu_s": cpu1[0] - cpu0[0], "child_cpu_s": cpu1[1] - cpu0[1],
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

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    work = Workload(size)
    model, opt = work.model, work.optimizer
    work.backward()
    opt.step()
    blank = Workload(size)
    fresh, fresh_opt = blank.model, blank.optimizer
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
    # The last line that is a result: DCP's writer process logs to the same stdout.
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def med(rs, key):
    return statistics.median(r[key] for r in rs)


def collect(section: str, configs, targets, args) -> dict:
    """``(target, config) -> [result per repetition]``, configurations alternating."""
    results: dict = {}
    reps = args.reps or (5 if section == "e2e" else 3)
    for target in targets:
        for _ in range(reps):
            for config in configs:
                print(f"{section} {args.size} {target} {config} ({time.strftime('%H:%M:%S')})", file=sys.stderr)
                results.setdefault((target, config), []).append(run_child(section, config, target, args))
    return results


def bench_e2e(args, targets, configs) -> list[dict]:
    results = collect("e2e", configs, targets, args)
    checkpoints = args.steps - args.warmup
    rows = []
    for target in targets:
        def of(config, key):
            return med(results[(target, config)], key) if config in configs else None

        base, save = of("none", "step_s"), of("torch.save", "blocked_s")
        base_total, base_cpu = of("none", "total_s"), of("none", "cpu_s")
        floor_cpu = of("bytes.write", "cpu_s")
        if floor_cpu is not None and base_cpu is not None:
            floor_cpu += of("bytes.write", "child_cpu_s") - base_cpu
            floor_cpu = floor_cpu if floor_cpu > 0 else None  # lost in the noise: no ratio
        for config in configs:
            rs = results[(target, config)]
            step = med(rs, "step_s")
            cpu = med(rs, "cpu_s") - base_cpu + med(rs, "child_cpu_s") if base_cpu is not None else None
            rows.append({"target": target, "config": config, "step_ms": step * 1e3,
                         "max_ms": max(r["step_s"] for r in rs) * 1e3,
                         "max_vs_med": max(r["step_s"] for r in rs) / step,
                         "vs_none": step / base if base else None,
                         "drained_vs_none": med(rs, "total_s") / base_total if base_total else None,
                         "blocked_ms": med(rs, "blocked_s") * 1e3,
                         "blocked_vs_torch_save": (med(rs, "blocked_s") / save
                                                   if save and config != "none" else None),
                         "drain_ms": med(rs, "drain_s") * 1e3,
                         "cpu_ms": cpu / checkpoints * 1e3 if cpu is not None else None,
                         "writer_cpu_ms": med(rs, "child_cpu_s") / checkpoints * 1e3,
                         "cpu_vs_floor": cpu / floor_cpu if floor_cpu and cpu is not None else None,
                         "peak_rss_mb": med(rs, "rss_mb"), "state_mb": rs[0]["state_bytes"] / 1e6,
                         "stored_mb_per_step": med(rs, "stored_bytes") / 1e6})
    return rows


def e2e_checks(rows: list[dict]) -> list[dict]:
    """Each datastates-hist row against the performance issue's targets 1-4: its step-time
    ratio against torch.save's and each DCP mode's (<= 1), its overhead over the floor's in
    percentage points (<= 3 for the GPT), its CPU against the floor's (<= 1.5) and its
    slowest repetition against the median (<= 1.25)."""
    checks = []
    for row in rows:
        if not row["config"].startswith("dh-") or row["vs_none"] is None:
            continue
        peer = {r["config"]: r for r in rows if r["target"] == row["target"]}

        def over(name):
            return row["step_ms"] / peer[name]["step_ms"] if name in peer else None

        floor = peer.get("bytes.write")
        checks.append({"target": row["target"], "config": row["config"], "vs_torch_save": over("torch.save"),
                       "vs_dcp_thread": over("dcp.async_save"), "vs_dcp_process": over("dcp.async_save-process"),
                       "over_floor_pp": (row["vs_none"] - floor["vs_none"]) * 100 if floor else None,
                       "cpu_vs_floor": row["cpu_vs_floor"], "max_vs_med": row["max_vs_med"]})
    return checks


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
    p.add_argument("--sections", default="e2e,flush,restore,slow",
                   help="of e2e, flush, restore, slow, query (default: %(default)s)")
    p.add_argument("--sizes", default="small",
                   help="workloads: GPT tiny, small, medium; storage: a wide MLP with "
                        "Adam (default: %(default)s)")
    p.add_argument("--targets", default="/dev/shm," + tempfile.gettempdir(),
                   help="directories to write to (default: %(default)s)")
    p.add_argument("--configs", default=",".join(E2E_CONFIGS),
                   help="e2e configurations (default: all: " + ", ".join(E2E_CONFIGS) + "); any "
                        "dh-BACKEND[-raw|-key|-history][-keepup|-always] besides")
    p.add_argument("--backends", default="adios2,hdf5", help="of the other sections (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="training steps per run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out (default: %(default)s)")
    p.add_argument("--reps", type=int,
                   help="repetitions (default: 5 for e2e, 3 for the other sections)")
    p.add_argument("--cache-mb", type=int, default=1024, help="datastates-hist host cache (default: %(default)s)")
    p.add_argument("--flush-mb", type=int, default=1024, help="state of the flush section (default: %(default)s)")
    p.add_argument("--slow-mb-per-s", type=float, default=40,
                   help="storage speed of the slow section (default: %(default)s)")
    p.add_argument("--slow-cache-mb", type=int, default=128,
                   help="host cache of the slow section (default: %(default)s)")
    p.add_argument("--figure", metavar="PNG", help="draw the end-to-end step times here")
    p.add_argument("--omp-wait-policy", choices=["passive", "active"],
                   help="OMP_WAIT_POLICY of the training processes (default: the environment's; "
                        "docs/performance.md, 'Idle OpenMP threads')")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--child", nargs=3, metavar=("SECTION", "CONFIG", "TARGET"), help=argparse.SUPPRESS)
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
    if args.omp_wait_policy:  # read by libgomp when torch loads it: set for the child processes
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    report: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset")}}
    for size in args.sizes.split(","):
        args.size = size
        if "e2e" in sections:
            report[f"e2e {size}"] = bench_e2e(args, targets, args.configs.split(","))
            report[f"checks {size}"] = e2e_checks(report[f"e2e {size}"])
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
        machine = report["machine"]
        print(f"{machine['cpus']} CPUs, Python {machine['python']}, OMP_WAIT_POLICY {machine['omp_wait_policy']}")
        for title, rows in report.items():
            if title != "machine":
                print_table(title, rows)
    if "query" in sections:
        import bench_query

        bench_query.main(["--size", args.sizes.split(",")[0], "--reps", str(args.reps or 3)])


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
