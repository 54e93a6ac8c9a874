"""Benchmark: what checkpointing every iteration costs the training loop.

For the example GPT (examples/train_gpt.py), on /dev/shm and on local disk,
measures in one run, alternating configurations in fresh processes:
the mean step time with no checkpointing, with ``torch.save`` every step, and
with datastates-hist every step (each backend), and the time the training
thread was blocked per checkpoint. Prints a table of medians over repetitions
and ratios against no checkpointing.

    python tools/bench_overhead.py --size small --steps 30 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)


def child(config: str, target: str, size: str, steps: int, warmup: int) -> dict:
    """Train ``steps`` steps under one configuration; report step and blocked times."""
    import torch

    import train_gpt

    torch.manual_seed(0)
    model = train_gpt.build_model(size, block_size=128)
    opt = train_gpt.make_optimizer(model, 1e-3)
    corpus = train_gpt.load_corpus(2 << 20)
    ckpt = None
    if config.startswith("dh-"):
        import datastates_hist as dh

        ckpt = dh.Checkpointer(target, backend=config[3:])
    step_times, blocked = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = train_gpt.get_batch(corpus, 8, 128)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        b0 = time.perf_counter()
        if config == "torch.save":
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()},
                       os.path.join(target, f"step{step}.pt"))
        elif ckpt is not None:
            ckpt.write(step, model, opt, data={"step": step})
        t1 = time.perf_counter()
        if step >= warmup:
            step_times.append(t1 - t0)
            if config == "torch.save":
                blocked.append(t1 - b0)
    drain = 0.0
    if ckpt is not None:
        d0 = time.perf_counter()
        ckpt.close()
        drain = time.perf_counter() - d0
        blocked = [ckpt.blocked_seconds / ckpt.writes]
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    return {"step_s": statistics.mean(step_times), "blocked_s": statistics.mean(blocked) if blocked else 0.0,
            "drain_s": drain, "state_bytes": nbytes}


def run_child(config, target, args) -> dict:
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    out = subprocess.run(
        [sys.executable, __file__, "--child", config, target, "--size", args.size,
         "--steps", str(args.steps), "--warmup", str(args.warmup)],
        check=True, capture_output=True, text=True,
    )
    shutil.rmtree(target, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--backends", default="adios2,hdf5")
    p.add_argument("--targets", default="/dev/shm," + tempfile.gettempdir())
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", nargs=2, metavar=("CONFIG", "TARGET"))
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.size, args.steps, args.warmup)))
        return
    configs = ["none", "torch.save"] + [f"dh-{b}" for b in args.backends.split(",") if b]
    results = {}
    for target_root in args.targets.split(","):
        target = os.path.join(target_root, f"dh-bench-{os.getpid()}")
        for _ in range(args.reps):
            for config in configs:  # alternate, so that drifts hit every configuration alike
                results.setdefault((target_root, config), []).append(run_child(config, target, args))
    table = []
    for target_root in args.targets.split(","):
        base = statistics.median(r["step_s"] for r in results[(target_root, "none")])
        save_blocked = statistics.median(r["blocked_s"] for r in results[(target_root, "torch.save")])
        for config in configs:
            rs = results[(target_root, config)]
            step = statistics.median(r["step_s"] for r in rs)
            blocked = statistics.median(r["blocked_s"] for r in rs)
            table.append({
                "target": target_root, "config": config, "step_ms": step * 1e3,
                "vs_none": step / base, "blocked_ms": blocked * 1e3,
                "blocked_vs_torch_save": blocked / save_blocked if config != "none" else None,
                "drain_ms": statistics.median(r["drain_s"] for r in rs) * 1e3,
            })
    state_mb = results[(args.targets.split(",")[0], "none")][0]["state_bytes"] / 1e6
    if args.json:
        print(json.dumps({"size": args.size, "state_mb": state_mb, "rows": table}, indent=1))
        return
    print(f"model {args.size}, state {state_mb:.1f} MB (params + Adam), {args.steps} steps "
          f"({args.warmup} warm-up excluded), median of {args.reps} runs")
    print(f"{'target':<10} {'config':<12} {'step ms':>9} {'x none':>7} {'blocked ms':>11} "
          f"{'x torch.save':>13} {'drain ms':>9}")
    for r in table:
        rel = "" if r["blocked_vs_torch_save"] is None else f"{r['blocked_vs_torch_save']:.3f}"
        print(f"{r['target']:<10} {r['config']:<12} {r['step_ms']:>9.1f} {r['vs_none']:>7.3f} "
              f"{r['blocked_ms']:>11.2f} {rel:>13} {r['drain_ms']:>9.1f}")


if __name__ == "__main__":
    main()
