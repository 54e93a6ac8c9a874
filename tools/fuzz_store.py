"""Store fuzzer: damage committed runs at random, then read them as a user would.

Each case copies a small committed run (3 steps of a model with Adam state,
extras, a bfloat16 and an integer tensor), applies one to three random
mutations and then reads everything through the public API: ``dh.open`` (steps, tensor
tables, statistics, every tensor of every step, a diff), ``verify_run``, the
CLI's ``ls``/``show``/``verify``, and a strict ``restore`` into a fresh model
and optimizer. Mutations: index rows (locations, backends, step numbers,
sizes, checksums, shapes, dtypes, names, format version), manifests rewritten
with a matching checksum (shapes, dtypes, sizes, names, blocks, values,
nesting), unit files (truncated, bit flips, appended, deleted, renamed,
replaced by symlinks) and the index file itself.

Every case must end in a correct read (equal to what was written) or in one of
``datastates_hist.errors``' named errors. A finding is anything else: another
exception, a crash of the process, a hang (no answer in ``--timeout``
seconds), peak memory above twice the run's declared data plus a fixed
allowance for the interpreter, or a file touched outside the run (every case
has a sentinel folder beside the run, and crafted paths point into it).

    python tools/fuzz_store.py --cases 500 --backend adios2 --seed 1
    python tools/fuzz_store.py --backend hdf5 --only 137      # replay one case

Cases run in a worker process that is restarted after a crash or a hang.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import select
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

STEPS = (0, 1, 2)
# Memory a case may add beyond twice its declared data: torch and the readers
# allocate small buffers, arenas and caches of their own.
MEMORY_ALLOWANCE = 96 << 20


# --- the base run ---------------------------------------------------------------------------

def make_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    model.register_buffer("counts", torch.arange(6, dtype=torch.int64))
    model.register_buffer("scale_bf16", torch.linspace(-1, 1, 10).to(torch.bfloat16))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def build_base(run_dir: str, backend: str) -> None:
    import numpy as np
    import torch

    import datastates_hist as dh

    model, opt = make_model()
    with dh.Checkpointer(run_dir, backend=backend, host_cache_bytes=1 << 20) as ckpt:
        for step in STEPS:
            model(torch.randn(5, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.write(step, model, opt, data={"epoch": step, "tag": "base"},
                       table=np.arange(12, dtype=np.float32).reshape(3, 4) * step)


def reference(run_dir: str) -> dict:
    """(step, name) -> the tensor as written, read from the intact run."""
    import datastates_hist as dh

    ref = {}
    with dh.open(run_dir) as h:
        for step in h.steps:
            data = h.step_data(step)
            for name in data.records:
                ref[(step, name)] = data.read(name).clone()
    return ref


# --- mutations ------------------------------------------------------------------------------
# Each takes (rng, run_dir, outside) and returns a description. ``outside`` is a
# folder beside the run holding a copy of one unit and sentinel files.

def _index(run_dir):
    return sqlite3.connect(os.path.join(run_dir, "index.sqlite"))


def _units(run_dir):
    return sorted(os.listdir(os.path.join(run_dir, "steps")))


def _files(path):
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs)


def _crafted_location(rng, run_dir, outside):
    unit = rng.choice(_units(run_dir))
    return rng.choice([
        os.path.join(outside, "unit"), outside, "/", "", ".", "..", "steps", unit + "/",
        "../../x/" + unit, "../outside/unit", "./" + unit, unit + "/../" + unit,
        os.path.join(os.path.abspath(run_dir), "steps", unit), "link-out", unit[:-1],
        rng.choice(_units(run_dir)), "000000000009" + os.path.splitext(unit)[1], "x" * 300, "a\x00b",
    ])


def mutate_location(rng, run_dir, outside):
    location = _crafted_location(rng, run_dir, outside)
    if location == "link-out":
        os.symlink(os.path.join(outside, "unit"), os.path.join(run_dir, "steps", "link-out"))
    step = rng.choice(STEPS)
    with _index(run_dir) as db:
        db.execute("UPDATE steps SET location=? WHERE step=?", (location, step))
    return f"steps.location of step {step} = {location!r}"


STEP_COLUMNS = {
    "backend": ["", "nope", "hdf5", "adios2", "../x"],
    "step": [-1, 7, 2 ** 62, 2 ** 63 - 1, 1],
    "nbytes": [-1, 0, 2 ** 62, 1],
    "ntensors": [-1, 0, 10 ** 9],
    "tier": ["", "trajectory", "x"],
    "manifest_checksum": ["", "0" * 16, "zz"],
    "time": [-1.0, 1e300, float("nan")],
}


def mutate_step_row(rng, run_dir, outside):
    column = rng.choice(sorted(STEP_COLUMNS))
    value = rng.choice(STEP_COLUMNS[column])
    step = rng.choice(STEPS)
    with _index(run_dir) as db:
        try:
            db.execute(f"UPDATE steps SET {column}=? WHERE step=?", (value, step))
        except sqlite3.IntegrityError:
            db.execute("DELETE FROM steps WHERE step=?", (value,))
            db.execute(f"UPDATE steps SET {column}=? WHERE step=?", (value, step))
    return f"steps.{column} of step {step} = {value!r}"


SHAPES = ["[2147483648, 2147483648]", "[134217728, 4]", "[-1]", "\"x\"", "[]", "null", "[1.5]",
          "[0]", "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33]",
          "[4, 4]", "[9223372036854775807]", "not json"]
TENSOR_COLUMNS = {
    "shape": SHAPES,
    "dtype": ["float64", "nope", "", "bfloat16", "int8", "bool", "complex64", "float8_e4m3fn"],
    "nbytes": [-1, 0, 2 ** 62, 3],
    "checksum": ["", "0" * 16],
    "name": ["", "model/0.weight", "../x", "model/\x00", "x" * 1000],
    "encoding": ["delta", "", "raw"],
    "norm": [float("nan"), None, -1.0, 1e308],
}


def mutate_tensor_row(rng, run_dir, outside):
    column = rng.choice(sorted(TENSOR_COLUMNS))
    value = rng.choice(TENSOR_COLUMNS[column])
    with _index(run_dir) as db:
        step, name = rng.choice(db.execute("SELECT step, name FROM tensors").fetchall())
        try:
            db.execute(f"UPDATE tensors SET {column}=? WHERE step=? AND name=?", (value, step, name))
        except sqlite3.IntegrityError:
            db.execute("DELETE FROM tensors WHERE step=? AND name=?", (step, name))
            return f"tensor row {name!r} of step {step} deleted"
    return f"tensors.{column} of {name!r} at step {step} = {value!r}"


def mutate_meta(rng, run_dir, outside):
    key, value = rng.choice([("format_version", "999"), ("format_version", "x"), ("format_version", "-1"),
                             ("backend", "nope"), ("backend", ""), ("created", "x")])
    with _index(run_dir) as db:
        db.execute("UPDATE meta SET value=? WHERE key=?", (value, key))
    return f"meta {key} = {value!r}"


def mutate_index_file(rng, run_dir, outside):
    path = os.path.join(run_dir, "index.sqlite")
    with _index(run_dir) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = os.path.getsize(path)
    how = rng.choice(["empty", "truncate", "flip", "drop steps", "drop tensors"])
    if how == "empty":
        open(path, "w").close()
    elif how == "truncate":
        os.truncate(path, rng.randrange(size))
    elif how == "flip":
        _flip(rng, path, rng.randint(1, 8))
    else:
        with _index(run_dir) as db:
            db.execute(f"DROP TABLE {how.split()[1]}")
    return f"index file: {how}"


def _flip(rng, path, n):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        for _ in range(n):
            at = rng.randrange(size)
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))


def mutate_unit_file(rng, run_dir, outside):
    unit = os.path.join(run_dir, "steps", rng.choice(_units(run_dir)))
    path = rng.choice(_files(unit))
    size = os.path.getsize(path)
    how = rng.choice(["truncate", "flip", "append", "delete", "empty"])
    if how == "truncate":
        os.truncate(path, rng.randrange(max(size, 1)))
    elif how == "flip" and size:
        _flip(rng, path, rng.randint(1, 16))
    elif how == "append":
        with open(path, "ab") as f:
            f.write(rng.randbytes(rng.randint(1, 4096)))
    elif how == "delete":
        os.remove(path)
    else:
        open(path, "w").close()
    return f"{how} {os.path.relpath(path, run_dir)} ({size} bytes)"


def mutate_unit_entry(rng, run_dir, outside):
    steps = os.path.join(run_dir, "steps")
    units = _units(run_dir)
    unit = rng.choice(units)
    how = rng.choice(["rename", "swap", "symlink out", "symlink in", "delete", "junk", "junk link"])
    if how == "rename":
        os.rename(os.path.join(steps, unit), os.path.join(steps, rng.choice(["x", unit + ".partial", "9" + unit])))
    elif how == "swap":
        other = rng.choice([u for u in units if u != unit])
        os.rename(os.path.join(steps, unit), os.path.join(steps, "tmp"))
        os.rename(os.path.join(steps, other), os.path.join(steps, unit))
        os.rename(os.path.join(steps, "tmp"), os.path.join(steps, other))
    elif how == "symlink out":  # the unit replaced by a link to an identical copy outside
        shutil.rmtree(os.path.join(steps, unit)) if os.path.isdir(os.path.join(steps, unit)) else \
            os.remove(os.path.join(steps, unit))
        os.symlink(os.path.join(outside, "unit"), os.path.join(steps, unit))
    elif how == "symlink in":
        other = rng.choice([u for u in units if u != unit])
        shutil.rmtree(os.path.join(steps, unit)) if os.path.isdir(os.path.join(steps, unit)) else \
            os.remove(os.path.join(steps, unit))
        os.symlink(other, os.path.join(steps, unit))
    elif how == "delete":
        path = os.path.join(steps, unit)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    elif how == "junk":
        with open(os.path.join(steps, "000000000007" + os.path.splitext(unit)[1]), "wb") as f:
            f.write(rng.randbytes(100))
    else:
        os.symlink(outside, os.path.join(steps, "000000000008" + os.path.splitext(unit)[1]))
    return f"unit {unit}: {how}"


def _manifest_edits(rng, doc):
    """One edit of a parsed manifest; returns its description."""
    tensors = doc["tensors"]
    t = rng.choice(tensors)
    edit = rng.randrange(14)
    if edit == 0:
        t["shape"] = rng.choice([[2 ** 31, 2 ** 31], [2 ** 27, 4], [-1], [1.5], "x", None, [0], [2 ** 63]])
    elif edit == 1:
        t["dtype"] = rng.choice(["float64", "nope", "", "int8", "bool", None, 3])
    elif edit == 2:
        t["nbytes"] = rng.choice([-1, 0, 2 ** 62, "x", None])
    elif edit == 3:
        t["name"] = rng.choice(["", "../x", "model/0.weight", "optim/state/0/exp_avg", None, 5])
    elif edit == 4:
        t["checksum"] = rng.choice(["", "0" * 16, None])
    elif edit == 5:
        t["blocks"] = rng.choice([
            [{"start": [0] * len(t["shape"]), "count": list(t["shape"]), "checksum": t["checksum"], "part": 7}],
            [{"start": [0] * len(t["shape"]), "count": list(t["shape"]), "checksum": t["checksum"], "part": "../x"}],
            [{"start": [-1], "count": [2 ** 40]}], "x", [None], [],
        ])
    elif edit == 6:
        t["encoding"] = rng.choice(["delta", "zstd", None])
    elif edit == 7:
        del tensors[rng.randrange(len(tensors))]
    elif edit == 8:
        tensors.append(dict(t, name=t["name"] + "/extra"))
    elif edit == 9:
        doc["values"] = rng.choice([None, [], {"items": None}, {"items": {}, "objects": {"model": "Nope"}},
                                    {"items": doc["values"]["items"], "objects": {"optim": "RNG", "model": 3}}])
    elif edit == 10:
        nested = []
        for _ in range(rng.choice([50, 5000, 100000])):
            nested = [nested]
        doc["values"]["items"]["extra/data"] = nested
    elif edit == 11:
        doc[rng.choice(["format_version", "step", "world_size", "layout"])] = rng.choice(
            [999, -1, "x", None, 2 ** 70, 4])
    elif edit == 12:
        t["global_shape"], t["offset"] = rng.choice([([4, 4], [0, 0]), ([1], [5]), ("x", None)])
    else:
        t["stats"] = rng.choice([None, {"norm": "x"}, {"norm": None, "min": 1e400}])
    return f"manifest edit {edit} of {t.get('name')!r}"


def mutate_manifest(rng, run_dir, outside):
    """Rewrite one unit with an edited manifest, and give the index its checksum, so that
    the edit is read past the manifest's checksum."""
    import numpy as np

    from datastates_hist.backends import get_backend
    from datastates_hist.digest import checksum_bytes
    from datastates_hist.dtypes import storage_dtype, torch_dtype

    step = rng.choice(STEPS)
    with _index(run_dir) as db:
        backend, location = db.execute("SELECT backend, location FROM steps WHERE step=?", (step,)).fetchone()
    be = get_backend(backend)
    steps = os.path.join(run_dir, "steps")
    reader = be.open_step(steps, location)
    try:
        raw = reader.manifest()
        doc = json.loads(raw)
        arrays = {}
        for rec in doc["tensors"]:
            arr = np.empty(rec["shape"], dtype=storage_dtype(torch_dtype(rec["dtype"])))
            if arr.size:
                reader.read(rec["name"], arr, (0,) * arr.ndim)
            arrays[rec["name"]] = (arr, rec["dtype"])
    finally:
        reader.close()
    what = "; ".join(_manifest_edits(rng, doc) for _ in range(rng.choice((1, 1, 2))))
    new = json.dumps(doc).encode() if rng.random() < 0.9 else rng.choice([b"[]", b"{", b"null", b"\xff\xfe"])
    path = os.path.join(steps, location)
    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    writer = be.writer_at(path, step)
    for name, (arr, real) in arrays.items():
        writer.define(name, arr.dtype, arr.shape, real)
        if arr.size:
            writer.put(name, np.ascontiguousarray(arr), (0,) * arr.ndim)
    writer.finish(new)
    with _index(run_dir) as db:
        db.execute("UPDATE steps SET manifest_checksum=? WHERE step=?", (checksum_bytes(new), step))
    return f"step {step}: {what}"


MUTATIONS = [mutate_location, mutate_step_row, mutate_tensor_row, mutate_meta, mutate_index_file,
             mutate_unit_file, mutate_unit_entry, mutate_manifest]


# --- reading a case as a user would ------------------------------------------------------

def read_everything(run_dir: str, ref: dict) -> list[str]:
    """Read the run through every public path; returns the wrong reads (an exception
    that is not one of the library's named errors propagates)."""
    import torch

    import datastates_hist as dh
    from datastates_hist.cli import main as cli_main
    from datastates_hist.verify import verify_run

    wrong = []
    attempts = [
        lambda: _read_history(run_dir, ref, wrong),
        lambda: verify_run(run_dir),
        lambda: _restore(run_dir, ref, wrong),
    ]
    for args in (["ls", run_dir], ["show", run_dir, "2"], ["verify", run_dir]):
        attempts.append(lambda args=args: _cli(cli_main, args))
    for attempt in attempts:
        try:
            attempt()
        except NAMED_ERRORS:
            pass
    del torch, dh
    return wrong


def _read_history(run_dir, ref, wrong):
    import torch

    import datastates_hist as dh

    with dh.open(run_dir) as h:
        steps = h.steps
        for step in steps:
            try:
                h.tensors(step)
                data = h.step_data(step)
                for name in list(data.records):
                    got = data.read(name)
                    want = ref.get((step, name))
                    if want is not None and not (got.dtype == want.dtype and got.shape == want.shape
                                                 and torch.equal(got.view(-1).view(torch.uint8),
                                                                 want.view(-1).view(torch.uint8))):
                        wrong.append(f"step {step} tensor {name!r} read back different")
            except NAMED_ERRORS:
                pass
        for name in h.names() if steps else []:
            with contextlib.suppress(*NAMED_ERRORS):
                h.stats(name)
        if len(steps) >= 2:
            with contextlib.suppress(*NAMED_ERRORS):
                h.diff(steps[0], steps[-1])


def _restore(run_dir, ref, wrong):
    import torch

    import datastates_hist as dh

    model, opt = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ckpt = dh.Checkpointer(run_dir)
    try:
        restored = ckpt.restore(model=model, optimizer=opt, data=None)
        for name, t in model.state_dict().items():
            want = ref.get((restored.step, f"model/{name}"))
            if want is None or not torch.equal(t.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)):
                wrong.append(f"restore of step {restored.step}: model/{name} differs from what was written")
    finally:
        ckpt.close()


def _cli(cli_main, args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli_main(args)
        except SystemExit:
            pass
    if "Traceback" in err.getvalue():
        raise RuntimeError(f"datastates-hist {' '.join(args[:1])} printed a traceback:\n{err.getvalue()}")


def _named_errors():
    from datastates_hist import errors

    return tuple(v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)
                 and v.__module__ == errors.__name__)


NAMED_ERRORS: tuple = ()


# --- the worker: runs cases, answers one JSON line each ----------------------------------------

def _tree_state(path: str) -> dict:
    state = {}
    for root, dirs, files in os.walk(path):
        for entry in dirs + files:
            full = os.path.join(root, entry)
            st = os.lstat(full)
            digest = ""
            if os.path.isfile(full) and not os.path.islink(full):
                with open(full, "rb") as f:
                    digest = hashlib.sha1(f.read()).hexdigest()
            state[os.path.relpath(full, path)] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return state


def _peak_rss_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident size


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def run_case(base: str, ref: dict, declared: int, backend: str, seed: int, case: int, work: str) -> dict:
    rng = random.Random(f"{seed}/{backend}/{case}")
    case_dir = os.path.join(work, f"case{case}")
    run_dir, outside = os.path.join(case_dir, "run"), os.path.join(case_dir, "outside")
    shutil.copytree(base, run_dir, symlinks=True)
    os.makedirs(outside)
    unit = sorted(os.listdir(os.path.join(base, "steps")))[-1]
    src = os.path.join(base, "steps", unit)
    (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, os.path.join(outside, "unit"))
    with open(os.path.join(outside, "sentinel"), "w") as f:
        f.write("must survive")
    mutations = [rng.choice(MUTATIONS) for _ in range(rng.choice((1, 1, 2, 3)))]  # damage comes in twos too
    result = {"case": case, "mutation": mutations[0].__name__, "what": []}
    for mutation in mutations:
        try:
            result["what"].append(mutation(rng, run_dir, outside))
        except Exception as exc:  # a mutation that does not apply to this run: still read it
            result["what"].append(f"{mutation.__name__} did not apply ({type(exc).__name__}: {exc})")
    result["what"] = "; ".join(result["what"])
    before = _tree_state(outside)  # after the damage: a mutation may write through a link it made
    _peak_rss_reset()
    base_rss = _peak_rss()
    try:
        wrong = read_everything(run_dir, ref)
        if wrong:
            result["finding"] = "wrong read: " + "; ".join(wrong[:3])
    except BaseException as exc:
        result["finding"] = f"unnamed error {type(exc).__name__}: {exc}\n" + traceback.format_exc(limit=-12)
    grown = _peak_rss() - base_rss
    if grown > 2 * declared + MEMORY_ALLOWANCE:
        result.setdefault("finding", f"peak memory grew by {grown >> 20} MiB")
    if _tree_state(outside) != before or sorted(os.listdir(case_dir)) != ["outside", "run"]:
        result["finding"] = result.get("finding", "") + " a file outside the run was touched"
    result["peak_mib"] = round(grown / 2 ** 20, 1)
    shutil.rmtree(case_dir, ignore_errors=True)
    return result


def worker(backend: str, seed: int, base: str, work: str) -> None:
    global NAMED_ERRORS
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)
    NAMED_ERRORS = _named_errors()
    ref = reference(base)
    declared = sum(t.numel() * t.element_size() for t in ref.values())
    out = sys.stdout
    sys.stdout = sys.stderr  # only results go to the parent's pipe
    warm = os.path.join(work, f"warm-{os.getpid()}")
    shutil.copytree(base, warm)
    read_everything(warm, ref)  # first-use allocations of torch and the readers are no case's
    shutil.rmtree(warm)
    for line in sys.stdin:
        case = int(line)
        print(json.dumps({"start": case}), file=out, flush=True)
        print(json.dumps(run_case(base, ref, declared, backend, seed, case, work)), file=out, flush=True)


# --- the parent: feeds cases, watches for crashes and hangs -------------------------------------

class Worker:
    def __init__(self, backend, seed, base, work):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--backend", backend, "--seed", str(seed),
             "--base", base, "--work", work],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)

    def run(self, case: int, timeout: float) -> dict:
        self.proc.stdin.write(f"{case}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                self.proc.kill()
                self.proc.wait()
                return {"case": case, "finding": f"hang: no answer in {timeout:.0f} s"}
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                return {"case": case, "finding": f"the process died (exit {code})"}
            msg = json.loads(line)
            if "start" not in msg:
                return msg

    def close(self):
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
        self.proc.wait()


def fuzz(backend: str, cases, seed: int = 1, timeout: float = 60.0, log=print) -> list[dict]:
    """Run ``cases`` (an iterable of case numbers); returns every case's result."""
    with tempfile.TemporaryDirectory(prefix="dh-fuzz-") as work:
        base = os.path.join(work, "base")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--build", base, "--backend", backend],
                       check=True)
        results, w = [], None
        for case in cases:
            w = w or Worker(backend, seed, base, work)
            res = w.run(case, timeout)
            if "mutation" not in res:  # the worker is gone: start a new one for the next case
                w = None
            results.append(res)
            if res.get("finding"):
                log(f"case {case}: {res.get('what', '')}\n  FINDING: {res['finding']}")
        if w:
            w.close()
        return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="adios2")
    p.add_argument("--cases", type=int, default=500)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--only", type=int, help="run this one case")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--build", help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.build:
        build_base(args.build, args.backend)
        return 0
    if args.worker:
        worker(args.backend, args.seed, args.base, args.work)
        return 0
    cases = [args.only] if args.only is not None else range(args.cases)
    t0 = time.monotonic()
    results = fuzz(args.backend, cases, args.seed, args.timeout)
    findings = [r for r in results if r.get("finding")]
    by_kind: dict[str, int] = {}
    for r in results:
        by_kind[r.get("mutation", "?")] = by_kind.get(r.get("mutation", "?"), 0) + 1
    peak = max((r.get("peak_mib", 0) for r in results), default=0)
    print(f"{args.backend}: {len(results)} cases in {time.monotonic() - t0:.0f} s, {len(findings)} findings; "
          f"peak memory growth {peak} MiB; cases per mutation: "
          + ", ".join(f"{k} {v}" for k, v in sorted(by_kind.items())))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
