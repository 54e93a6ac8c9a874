"""Readers in other processes, while a writer appends and prunes, never see a partial step.

A writer process trains and checkpoints every step, pruning as it goes. Three
reader processes loop meanwhile: one through ``Store`` (every tensor read and
its checksum verified), one through the CLI (``ls``, ``show``, ``verify``),
one through ``dh.open`` and the xarray engine. Every step a reader sees must
be complete (all tensors, matching values); the only error allowed is
``StepNotFoundError`` (or exit code 3) for a step that pruning removed while
it was being read, and then the step must indeed be gone.
"""

import json
import subprocess
import sys

import pytest

WRITER = r"""
import sys, time, torch
import datastates_hist as dh
run, backend, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
opt = torch.optim.Adam(model.parameters())
with dh.Checkpointer(run, backend=backend, host_cache_bytes=64 << 10, piece_bytes=8 << 10) as ckpt:
    for step in range(steps):
        model(torch.randn(4, 64)).sum().backward()
        opt.step(); opt.zero_grad()
        ckpt.write(step, model, opt, data={"step": step})
        if step % 4 == 3:
            ckpt.prune(keep_last=3, keep_every=8)
        time.sleep(0.03)
open(run + ".done", "w").close()
"""

READER = r"""
import io, json, os, random, sys, time, contextlib, warnings
warnings.simplefilter("ignore")
import torch, xarray as xr
import datastates_hist as dh
from datastates_hist.cli import main as cli
from datastates_hist.errors import StepNotFoundError, StoreNotFoundError
from datastates_hist.store import Store

run, kind = sys.argv[1], sys.argv[2]
EXPECTED = {"model/0.weight", "model/0.bias", "model/1.weight", "model/1.bias", "rng/torch"} | {
    f"optim/state/{p}/{k}" for p in ("0.weight", "0.bias", "1.weight", "1.bias")
    for k in ("step", "exp_avg", "exp_avg_sq")}
report = {"complete": 0, "pruned_while_reading": 0, "errors": [], "iterations": 0}
rng = random.Random(kind)
print("ready", flush=True)

def gone(step):
    store = Store(run)
    try:
        return step not in store.steps()
    finally:
        store.close()

def check(step, names, data_value):
    if set(names) != EXPECTED or data_value != {"step": step}:
        report["errors"].append(f"step {step} is partial: {sorted(set(EXPECTED) ^ set(names))} {data_value}")
    else:
        report["complete"] += 1

def run_cli(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()) as err:
        code = cli(list(args))
    return code, out.getvalue(), err.getvalue()

def via_store(store):
    steps = store.steps()
    for step in set(rng.sample(steps, min(2, len(steps))) + steps[-1:]):
        try:
            with store.open_step(step) as data:
                names = [n for n in data.records if data.read(n) is not None]
                check(step, names, data.values["items"]["extra/data"])
        except StepNotFoundError:
            report["pruned_while_reading" if gone(step) else "errors"] += 1

def via_cli():
    code, out, err = run_cli("ls", run, "--json")
    if code != 0:
        report["errors"].append(f"ls exit {code}: {err}")
        return
    steps = [r["step"] for r in json.loads(out)]
    for step in set(rng.sample(steps, min(2, len(steps))) + steps[-1:]):
        code, out, err = run_cli("show", run, str(step), "--json")
        if code == 0:
            check(step, [r["name"] for r in json.loads(out)], {"step": step})
        elif code == 3 and gone(step):
            report["pruned_while_reading"] += 1
        else:
            report["errors"].append(f"show {step} exit {code}: {err}")
        code, out, err = run_cli("verify", run, str(step), "--json")
        if code != 0 and not (code == 3 and gone(step)):
            report["errors"].append(f"verify {step} exit {code}: {out} {err}")

def via_history():
    with dh.open(run) as h:
        steps = h.steps
        for step in set(rng.sample(steps, min(2, len(steps))) + steps[-1:]):
            try:
                names = [n for n in h.names(step) if h.read(n, step) is not None]
                check(step, names, {"step": step})
            except StepNotFoundError:
                report["pruned_while_reading" if gone(step) else "errors"] += 1
    try:
        ds = xr.open_dataset(run, engine="datastates", names="model/*", steps=steps[-2:]).load()
        if list(ds["step"].values) != steps[-2:]:
            report["errors"].append(f"xarray steps {list(ds['step'].values)} != {steps[-2:]}")
    except StepNotFoundError:
        report["pruned_while_reading"] += 1

while True:  # until the writer has created the run and committed a step
    try:
        with contextlib.closing(Store(run)) as first:
            if first.steps():
                break
    except StoreNotFoundError:
        pass
    time.sleep(0.01)
store = None
while not os.path.exists(run + ".done"):
    try:
        if kind == "store":
            store = store or Store(run)  # one long-lived reader
            via_store(store)
        elif kind == "cli":
            via_cli()
        else:
            via_history()
        report["iterations"] += 1
    except StoreNotFoundError:
        time.sleep(0.01)  # the writer has not created the run yet
    except Exception as exc:
        report["errors"].append(f"{type(exc).__name__}: {exc}")
        time.sleep(0.01)
print(json.dumps(report))
"""


@pytest.mark.parametrize("steps", [48])
def test_readers_never_see_a_partial_step_and_never_fail(tmp_path, backend, steps):
    run = str(tmp_path / "run")
    readers = {kind: subprocess.Popen([sys.executable, "-c", READER, run, kind], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
               for kind in ("store", "cli", "history")}
    try:
        for kind, proc in readers.items():
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        writer = subprocess.run([sys.executable, "-c", WRITER, run, backend, str(steps)],
                                capture_output=True, text=True, timeout=300)
        assert writer.returncode == 0, writer.stderr[-3000:]
        reports = {}
        for kind, proc in readers.items():
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            reports[kind] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in readers.values():
            proc.kill()
    for kind, report in reports.items():
        assert report["errors"] == [], (kind, report["errors"][:5])
        assert report["iterations"] >= 3 and report["complete"] >= 3, (kind, report)
    from datastates_hist.store import Store

    store = Store(run)
    kept = store.steps()
    store.close()
    assert kept == [0, 8, 16, 24, 32, 40, 45, 46, 47]  # pruning really ran
