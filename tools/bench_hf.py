"""Benchmark: HistoryCallback against the Trainer's own checkpoint of every step, on one model.

Runs the Trainer of examples/train_hf.py (a GPT-2 with random weights, byte tokens) in three
configurations, in this process, alternating across repetitions (rotated, and reversed every
other one) so that the drifts of a shared machine hit all alike:

- ``none``: no checkpoint;
- ``trainer``: Trainer saves a checkpoint every step (``save_steps=1``: ``model.safetensors``,
  ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``), keeping the
  newest two (``save_total_limit=2``) so that the disk does not fill;
- ``history``: ``HistoryCallback`` writes every step, with the example's default policies
  (``KeepLast(2) | KeepEvery(1000)``, ``Trajectory("model/*")``).

Measured per configuration: ``step``, the mean time of a step after the first ``--warmup``
steps (from one ``on_step_end`` to the next: the forward, backward, update and the checkpoint
of each step); ``cpu``, the CPU time of the process's threads in those steps, per step (the
history's background threads included: where training leaves no core free, as on a small
shared machine, their work slows the steps down); ``train``, the whole ``train()`` per step
(the history's close, which waits for the last commits, included); ``save``, the Trainer's time in its ``_save_checkpoint`` per step
(``trainer``); ``blocked``, the training thread's time in HistoryCallback's writes and in the
waits for their snapshots per step (``history``). Prints each median over the repetitions and
the ratios the target names: step time history/trainer (< 1), blocking history / Trainer's save
(<= 1/20).

    python tools/bench_hf.py --size medium --steps 30 --reps 3 [--target /var/tmp] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

import train_hf  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

CONFIGS = ("none", "trainer", "history")


class StepClock(TrainerCallback):
    """The wall time and the process's CPU time (every thread's) of every ``on_step_end``."""

    def __init__(self):
        self.ends: list[tuple[float, float]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append((time.perf_counter(), time.process_time()))


def run(config: str, workdir: str, args) -> dict:
    """Train once in ``config``; its times per step."""
    run_dir = os.path.join(workdir, config)
    argv = ["--run-dir", run_dir, "--output-dir", run_dir + ".trainer", "--size", args.size,
            "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--block-size", str(args.block_size),
            "--corpus-bytes", str(args.corpus_bytes), "--logging-steps", str(args.steps), "--threads", str(args.threads)]
    if config == "history":
        argv += ["--codec", args.codec]
    else:
        argv.append("--no-history")
    if config == "trainer":
        argv += ["--trainer-save-steps", "1"]
    options = train_hf.build_parser().parse_args(argv)
    clock = StepClock()
    trainer, history = train_hf.build_trainer(options, [clock])
    trainer.remove_callback(PrinterCallback)  # its logs would go into the report
    if config == "trainer":
        trainer.args.save_total_limit = 2
    save_seconds = []
    save_checkpoint = trainer._save_checkpoint

    def timed_save(*a, **k):  # the Trainer's own checkpoint, timed
        t0 = time.perf_counter()
        save_checkpoint(*a, **k)
        save_seconds.append(time.perf_counter() - t0)

    trainer._save_checkpoint = timed_save
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    (wall0, cpu0), (wall1, cpu1) = clock.ends[args.warmup], clock.ends[-1]
    steps = len(clock.ends) - 1 - args.warmup
    out = {"step": (wall1 - wall0) / steps, "cpu": (cpu1 - cpu0) / steps, "train": train_s / args.steps}
    if config == "trainer":
        out["save"] = statistics.mean(save_seconds)
    if config == "history":
        out["blocked"] = history.blocked_seconds / args.steps
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(run_dir + ".trainer", ignore_errors=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(train_hf.SIZES), default="medium")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step time")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--corpus-bytes", type=int, default=1 << 20)
    p.add_argument("--threads", type=int, default=1,
                   help="torch's threads (one: on a shared machine, more spin against the other processes)")
    p.add_argument("--codec", choices=["delta", "key", "raw"], default="delta", help="the history's codec")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--target", default=None, help="where the checkpoints go (default: the system's temp folder)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.steps - args.warmup < 2:
        p.error("--steps must be at least --warmup + 2")
    results: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    workdir = tempfile.mkdtemp(prefix="bench_hf-", dir=args.target)
    try:
        for rep in range(args.reps):
            order = CONFIGS[rep % len(CONFIGS):] + CONFIGS[:rep % len(CONFIGS)]
            for config in (order if rep % 2 == 0 else order[::-1]):
                results[config].append(run(config, workdir, args))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    medians = {c: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for c, runs in results.items()}
    ratios = {"step history/trainer": medians["history"]["step"] / medians["trainer"]["step"],
              "step history/none": medians["history"]["step"] / medians["none"]["step"],
              "step trainer/none": medians["trainer"]["step"] / medians["none"]["step"],
              "blocked history / save trainer": medians["history"]["blocked"] / medians["trainer"]["save"]}
    report = {"size": args.size, "steps": args.steps, "reps": args.reps, "medians_s": medians, "ratios": ratios}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{args.size} GPT-2, {args.steps} steps, median of {args.reps} (seconds per step)")
        for config, m in medians.items():
            print(f"  {config:8s} " + "  ".join(f"{k} {v * 1e3:8.2f} ms" for k, v in m.items()))
        for name, value in ratios.items():
            print(f"  {name:32s} {value:.3f}")
    return report


if __name__ == "__main__":
    main()
