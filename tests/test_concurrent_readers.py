"""Readers in other processes, while a writer appends and prunes or demotes, never see a
partial step.

A writer process trains and checkpoints every step, either pruning as it goes
(``prune``: steps stored as keys, so the rules alone decide what goes), or with
retention policies (``retention``: ``keep=KeepLast(2)`` and a trajectory of the
model's tensors, so every older restore point is demoted to a trajectory point
on the writer's flusher thread; its model tensors are deltas, raw where the
flush has fallen behind). Three reader processes loop meanwhile: one through
``Store`` (every tensor read and its checksum verified), one through the CLI
(``ls``, ``show``, ``verify``), one through ``dh.open`` and the xarray engine.
Every step a reader sees must be complete: all tensors of a restore point, or
exactly the model's of a trajectory point (and then the step must be a
trajectory point now: demotion is one-way), with matching values. The only
errors allowed are ``StepNotFoundError`` (or exit code 3) for a step that
pruning removed while it was being read, and then the step must indeed be gone;
and a restore tensor that a demotion took away between listing and reading it,
when the step is then indeed a trajectory point.
"""

import json
import subprocess
import sys

import pytest
import torch

import datastates_hist as dh
from datastates_hist.errors import StepNotFoundError
from datastates_hist import store as store_module
from datastates_hist.store import Store

WRITER = r"""
import os, sys, time, torch
import datastates_hist as dh
run, backend, mode, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
opt = torch.optim.Adam(model.parameters())
policies = (dict(codec="key") if mode == "prune" else
            dict(keep=dh.KeepLast(2), trajectory=dh.Trajectory("model/*")))
with dh.Checkpointer(run, backend=backend, host_cache_bytes=64 << 10, piece_bytes=8 << 10, **policies) as ckpt:
    step = 0
    # at least `steps`, and on until every reader has made three passes while steps are written
    # (a fast writer on a loaded machine could otherwise finish within a slow reader's second)
    while step < steps or any(not os.path.exists(f"{run}.{kind}.passes") for kind in ("store", "cli", "history")):
        model(torch.randn(4, 64)).sum().backward()
        opt.step(); opt.zero_grad()
        ckpt.write(step, model, opt, data={"step": step})
        if mode == "prune" and step % 4 == 3:
            ckpt.prune(keep_last=3, keep_every=8)
        time.sleep(0.03)
        step += 1
open(run + ".done", "w").close()
"""

READER = r"""
import io, json, os, random, sys, time, contextlib, warnings
warnings.simplefilter("ignore")
import torch, xarray as xr
import datastates_hist as dh
from datastates_hist.cli import main as cli
from datastates_hist.errors import StepNotFoundError, StoreNotFoundError
from datastates_hist import store as store_module
from datastates_hist.store import Store

run, kind = sys.argv[1], sys.argv[2]
MODEL = {"model/0.weight", "model/0.bias", "model/1.weight", "model/1.bias"}
EXPECTED = MODEL | {"rng/torch"} | {
    f"optim/state/{p}/{k}" for p in ("0.weight", "0.bias", "1.weight", "1.bias")
    for k in ("step", "exp_avg", "exp_avg_sq")}
report = {"complete": 0, "trajectory_points": 0, "pruned_while_reading": 0, "demoted_while_reading": 0,
          "errors": [], "iterations": 0, "seconds": []}
rng = random.Random(kind)
# What a first read would load lazily, loaded before the writer starts: xarray's engines and dask
# took 1 s (4-5 s on a loaded machine) of a writer's run of 6 to 10 s.
xr.backends.list_engines()
try:
    import dask.array
except ImportError:
    pass
print("ready", flush=True)

def row(step):
    store = Store(run)
    try:
        return store.index.step_row(step)
    finally:
        store.close()

def gone(step):
    return row(step) is None

def demoted(step):
    now = row(step)
    return now is not None and now.tier == "trajectory"

def check(step, names, data_value):
    names = set(names)
    if names == MODEL and data_value == {"step": step} and demoted(step):  # demotion is one-way
        report["trajectory_points"] += 1
    elif names != EXPECTED or data_value != {"step": step}:
        report["errors"].append(f"step {step} is partial: {sorted(EXPECTED ^ names)} {data_value}")
    else:
        report["complete"] += 1

def run_cli(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()) as err:
        code = cli(list(args))
    return code, out.getvalue(), err.getvalue()

def sample(steps):
    return set(rng.sample(steps, min(2, len(steps))) + steps[-1:])

def via_store(store):
    for step in sample(store.steps()):
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
    for step in sample([r["step"] for r in json.loads(out)]):
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
        for step in sample(steps):
            try:
                names = []
                for n in h.names(step):
                    try:
                        if h.read(n, step) is not None:
                            names.append(n)
                    except KeyError:  # listed as a restore point's, read from a trajectory point
                        if n in MODEL or not demoted(step):
                            raise
                        report["demoted_while_reading"] += 1
                        break
                else:
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
    began = time.perf_counter()
    try:
        if kind == "store":
            store = store or Store(run)  # one long-lived reader
            via_store(store)
        elif kind == "cli":
            via_cli()
        else:
            via_history()
        report["iterations"] += 1
        if report["iterations"] == 3:
            open(f"{run}.{kind}.passes", "w").close()
    except StoreNotFoundError:
        time.sleep(0.01)  # the writer has not created the run yet
    except Exception as exc:
        report["errors"].append(f"{type(exc).__name__}: {exc}")
        time.sleep(0.01)
    report["seconds"].append(round(time.perf_counter() - began, 3))
print(json.dumps(report))
"""


@pytest.mark.parametrize("mode", ["prune", "retention"])
def test_readers_never_see_a_partial_step_and_never_fail(tmp_path, backend, mode, steps=48):
    run = str(tmp_path / "run")
    readers = {kind: subprocess.Popen([sys.executable, "-c", READER, run, kind], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
               for kind in ("store", "cli", "history")}
    try:
        for kind, proc in readers.items():
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        writer = subprocess.run([sys.executable, "-c", WRITER, run, backend, mode, str(steps)],
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
        seen_whole = report["complete"] + report["trajectory_points"]
        assert report["iterations"] >= 3 and seen_whole >= 3, (kind, report)
    store = Store(run)
    kept, restore_points = store.steps(), store.restore_points()
    store.close()
    if mode == "prune":
        assert kept == [0, 8, 16, 24, 32, 40, 45, 46, 47]  # pruning really ran
        assert sum(r["trajectory_points"] for r in reports.values()) == 0
    else:  # every step stays, as a trajectory point but the two newest
        assert kept == list(range(steps)) and restore_points == [46, 47]
        assert sum(r["complete"] for r in reports.values()) >= 3, reports
        assert sum(r["trajectory_points"] for r in reports.values()) >= 3, reports


def test_a_delta_step_pruned_with_its_bases_while_being_read_is_not_found(run_dir):
    """A reader holding a step open whose base goes away with it: the step is gone, not damaged."""
    model = torch.nn.Linear(4, 3)
    with dh.Checkpointer(run_dir, key_every=2) as ckpt:  # 0 a key, 1 a delta against 0, 2 a key
        for step in range(3):
            ckpt.wait_snapshot()
            with torch.no_grad():
                model.weight.add_(1)
            ckpt.write(step, model)
    store = Store(run_dir)
    try:
        with store.open_step(1) as data:
            assert (data.records["model/weight"].encoding, data.records["model/weight"].base) == ("delta", 0)
            with dh.Checkpointer(run_dir) as ckpt:
                assert ckpt.prune(keep_last=1) == [0, 1]
            with pytest.raises(StepNotFoundError) as info:
                data.read("model/weight")
    finally:
        store.close()
    assert str(info.value) == f"step 1 was removed from {run_dir} while it was being read"


@pytest.mark.parametrize("rewrites", [3, store_module.REOPENS])
def test_a_step_rewritten_while_being_opened_is_read_again(run_dir, backend, monkeypatch, rewrites):
    """A writer that truncates and rewrites a step between a reader's look at its index row
    and the opening of its data, again and again: the reader reads the newest step, or says
    the step keeps being rewritten (never that the run is damaged)."""
    model = torch.nn.Linear(4, 3)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(0, model, w=torch.zeros(8))
    opened = Store._open
    versions = []

    def rewritten_first(self, row, *args):  # the writer rewrites step 0 before each open
        if len(versions) < rewrites:
            versions.append(torch.full((8,), float(len(versions) + 1)))
            with dh.Checkpointer(run_dir) as writer:
                writer.truncate(after=-1)
                writer.write(0, model, w=versions[-1])
        return opened(self, row, *args)

    monkeypatch.setattr(Store, "_open", rewritten_first)
    store = Store(run_dir)
    try:
        if rewrites < store_module.REOPENS:
            with store.open_step(0) as data:
                assert torch.equal(data.read("extra/w"), versions[-1])
        else:
            with pytest.raises(StepNotFoundError) as info:
                store.open_step(0)
            assert str(info.value) == (f"step 0 of {run_dir} was written again {store_module.REOPENS} times while "
                                       "it was being opened (a writer truncates and rewrites it): read it again")
    finally:
        store.close()
