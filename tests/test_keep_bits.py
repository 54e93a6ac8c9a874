"""Lossy trajectory points: ``dh.Trajectory(..., keep_bits=N)``.

A run of 12 steps with ``keep=KeepLast(2)`` and ``Trajectory("model/*", keep_bits=8)``, on both
backends: every trajectory point holds its float tensors rounded (within the bound of the exact
tensor, kept by the test; NaN, infinities and zeros kept), the restore points read and restore
bit-exact, verify finds nothing, repair rebuilds the same rows, and a damaged low-bits object is
reported. Then the bad inputs of the new argument.
"""

import json
import os
import shutil
import sqlite3
import subprocess
import sys

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist import rounding
from datastates_hist.index import FORMAT_VERSION
from datastates_hist.layout import index_path, restore_unit, step_stem, steps_dir
from datastates_hist.repair import repair_run
from datastates_hist.store import Store
from datastates_hist.verify import verify_run

STEPS = 12
KEEP_BITS = 8
RESTORE_POINTS = [10, 11]  # KeepLast(2)
TRAJECTORY_POINTS = list(range(10))
ROUNDED = ["model/0.weight", "model/0.bias", "model/2.weight", "model/2.bias", "model/special", "model/small"]
EXACT = ["model/counter", "model/brain"]  # int64; bfloat16 has 7 mantissa bits, fewer than 8
SAVED: dict[str, dict] = {}  # run_dir -> {"model": {step: state dict}, "optim": the last optimizer state}
# the special values a rounding must keep: NaN, infinities, zeros of both signs, a subnormal
SPECIAL = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 3.0, -1.0009765625]


def fresh_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model.register_buffer("special", torch.tensor(SPECIAL))
    model.register_buffer("small", torch.linspace(-3, 3, 40, dtype=torch.float16))
    model.register_buffer("counter", torch.arange(5))
    model.register_buffer("brain", torch.linspace(-2, 2, 9, dtype=torch.bfloat16))
    return model


def train(run_dir: str, backend: str, steps: int = STEPS, **options) -> dict:
    model = fresh_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    saved = SAVED[run_dir] = {"model": {}}
    options = {"keep": dh.KeepLast(2), "trajectory": dh.Trajectory("model/*", keep_bits=KEEP_BITS), **options}
    with dh.Checkpointer(run_dir, backend=backend, **options) as ckpt:
        for step in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                model.small.mul_(1.01)
                model.counter.add_(1)
            ckpt.write(step, model, optimizer)
            saved["model"][step] = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    saved["optim"] = {k: v for k, v in optimizer.state_dict().items()}
    return saved


@pytest.fixture(scope="module", params=["adios2", "hdf5"])
def written(tmp_path_factory, request):
    run_dir = str(tmp_path_factory.mktemp(f"keep_bits_{request.param}") / "run")
    train(run_dir, request.param)
    return run_dir, request.param


@pytest.fixture
def run(tmp_path, written):
    """A copy of the module's run (its units keep their times)."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(written[0], run_dir)
    SAVED[run_dir] = SAVED[written[0]]
    return run_dir


def rows(run_dir, sql, args=()):
    conn = sqlite3.connect(f"file:{index_path(run_dir)}?mode=ro", uri=True)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def bits(t: torch.Tensor) -> np.ndarray:
    """The bit patterns of ``t`` (NaN compared as bits)."""
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view).numpy() if t.is_floating_point() else t.numpy()


def storage(t: torch.Tensor) -> tuple[np.ndarray, str]:
    name = str(t.dtype).removeprefix("torch.")
    return (t.view(torch.uint16).numpy() if t.element_size() == 2 else t.numpy()), name


def assert_within_bound(got: torch.Tensor, exact: torch.Tensor, keep_bits: int, what) -> None:
    """Rounded to nearest even at ``keep_bits`` bits: the relative error of every normal
    number at most 2**-(keep_bits+1), NaN and infinities and zeros as they were."""
    g, x = got.double().numpy(), exact.double().numpy()
    assert np.array_equal(np.isnan(g), np.isnan(x)), what
    finite = np.isfinite(x)
    assert np.array_equal(g[~finite & ~np.isnan(x)], x[~finite & ~np.isnan(x)]), what  # infinities
    zero = x == 0
    assert np.array_equal(bits(got)[zero], bits(exact)[zero]), what  # zeros, their sign too
    tiny = np.finfo(np.dtype(str(exact.dtype).removeprefix("torch."))).tiny if exact.dtype != torch.bfloat16 else 2.0**-126
    normal = finite & (np.abs(x) >= tiny)
    rel = np.abs(g[normal] - x[normal]) / np.abs(x[normal])
    assert rel.max(initial=0) <= 2.0 ** -(keep_bits + 1), (what, rel.max())
    # and bit for bit what the rounding gives
    values, dtype = storage(exact)
    want = rounding.round_mantissa(values, dtype, keep_bits)
    assert storage(got)[0].tobytes() == want.tobytes(), what


# --- the run as written --------------------------------------------------------------------

def test_trajectory_points_hold_the_rounded_values_within_the_bound(run):
    saved = SAVED[run]["model"]
    with dh.open(run) as h:
        assert h.steps == list(range(STEPS)) and h.restore_points == RESTORE_POINTS
        rounded_somewhere = False
        for step in TRAJECTORY_POINTS:
            for name in ROUNDED:
                got, exact = h.read(name, step), saved[step][name]
                assert_within_bound(got, exact, KEEP_BITS, (step, name))
                rounded_somewhere |= not np.array_equal(bits(got), bits(exact))
            for name in EXACT:
                assert np.array_equal(bits(h.read(name, step)), bits(saved[step][name])), (step, name)
        assert rounded_somewhere


def test_restore_points_read_and_restore_bit_exact(run):
    saved = SAVED[run]
    with dh.open(run) as h:
        for step in RESTORE_POINTS:
            for name, want in saved["model"][step].items():
                assert np.array_equal(bits(h.read(name, step)), bits(want)), (step, name)
                # a selection of a restore point is exact too
                if want.ndim == 2:
                    assert np.array_equal(bits(h.read(name, step, (slice(1, 3),))), bits(want[1:3]))
    model = fresh_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with dh.Checkpointer(run) as ckpt:
        assert ckpt.restore(model=model, optimizer=optimizer).step == STEPS - 1
    for name, want in saved["model"][STEPS - 1].items():
        assert np.array_equal(bits(model.state_dict()[name.removeprefix("model/")]), bits(want)), name
    want, got = saved["optim"], optimizer.state_dict()
    for param, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][param][key], value), (param, key)


def test_the_index_records_how_each_tensor_is_rounded(run):
    assert rows(run, "SELECT value FROM meta WHERE key='format_version'") == [(str(FORMAT_VERSION),)]
    found = {(s, n): rest for s, n, *rest in rows(
        run, "SELECT step, name, keep_bits, bound, exact_checksum IS NOT NULL, low_stored > 0, part"
             " FROM tensors WHERE name LIKE 'model/%'")}
    bound = 2.0 ** -(KEEP_BITS + 1)
    for step in range(STEPS):
        restore = step in RESTORE_POINTS
        for name in ROUNDED:
            assert found[step, name] == [KEEP_BITS, bound, restore, True if restore else None, ""], (step, name)
        for name in EXACT:
            assert found[step, name] == [None, None, False, None, ""], (step, name)
    # the statistics are those of the exact values
    saved = SAVED[run]["model"]
    for step, lo, hi in rows(run, "SELECT step, min, max FROM tensors WHERE name='model/0.weight'"):
        exact = saved[step]["model/0.weight"]
        assert (lo, hi) == (exact.min().item(), exact.max().item())


def test_show_prints_the_kept_bits_and_the_bound(run):
    def show(*args):
        out = subprocess.run([sys.executable, "-m", "datastates_hist.cli", "show", run, *args],
                             capture_output=True, text=True, env={**os.environ, "COLUMNS": "120"})
        assert out.returncode == 0, out.stderr
        return out.stdout

    records = {r["name"]: r for r in json.loads(show("3", "--json"))}
    assert (records["model/0.weight"]["keep_bits"], records["model/0.weight"]["bound"]) == (8, 2.0**-9)
    assert (records["model/counter"]["keep_bits"], records["model/counter"]["bound"]) == (None, None)
    *lines, bounds = show("3").strip().splitlines()
    header, *lines = [line.split() for line in lines]
    assert header == ["name", "shape", "dtype", "encoding", "nbytes", "stored", "norm"]
    table = {line[0]: line for line in lines}
    assert table["model/0.weight"][3].endswith("*") and not table["model/counter"][3].endswith("*")
    assert bounds == "* rounded to 8 mantissa bits (relative error at most 0.00195)"


def test_a_restore_points_tensors_read_exact_and_are_not_marked_rounded(run, capsys):
    """A restore point keeps the low bits of the tensors its trajectory point will keep
    rounded: show and h.tensors call them exact, as reads, export and restore give them."""
    from datastates_hist.cli import main

    assert main(["show", run, "11", "--json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    for name in ROUNDED:
        assert (records[name]["keep_bits"], records[name]["bound"]) == (None, None), name
        assert records[name]["low_stored"] > 0, name  # its low bits, in the restore unit
    assert main(["show", run, "11"]) == 0
    out = capsys.readouterr().out
    assert "*" not in out and "rounded" not in out
    with dh.open(run) as h:
        exact, lossy = h.tensors(11).set_index("name"), h.tensors(3).set_index("name")
        assert exact.loc[ROUNDED, ["keep_bits", "bound"]].isna().all().all()
        assert (lossy.loc[ROUNDED, "keep_bits"] == KEEP_BITS).all()
        assert (lossy.loc[ROUNDED, "bound"] == 2.0 ** -(KEEP_BITS + 1)).all()
        assert lossy.loc[EXACT, "keep_bits"].isna().all()
        for name in ROUNDED:
            assert np.array_equal(bits(h.read(name, 11)), bits(SAVED[run]["model"][11][name])), name


def exported(path: str) -> dict:
    if path.endswith(".dcp"):
        import warnings

        import torch.distributed.checkpoint as dcp

        state = {k: torch.empty_like(v) for k, v in torch.load(path[:-4] + ".pt", weights_only=True).items()}
        with warnings.catch_warnings():  # no process group: one process, as intended
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=path, no_dist=True)
        return state
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, weights_only=True)


def test_export_says_which_tensors_are_rounded_and_what_a_trajectory_point_lacks(run, tmp_path, capsys):
    from safetensors import safe_open

    from datastates_hist.cli import main

    saved = SAVED[run]["model"]
    with dh.open(run) as h:
        order = [n.removeprefix("model/") for n in h.names(3) if n in ROUNDED]
        lacking = [n for n in h.names(10) if n not in h.names(3)]  # 10: the restore point nearest to 3
    shown = ", ".join(order[:5]) + " and 1 more"
    for step in (3, 11):
        for suffix in (".pt", ".safetensors", ".dcp"):  # the .pt first: the DCP's state dict is loaded by it
            target = str(tmp_path / f"s{step}{suffix}")
            assert main(["export", run, str(step), "--to", target]) == 0
            out, err = capsys.readouterr()
            assert out == f"wrote 8 tensors of step {step} to {target}\n"
            got = exported(target)
            if step == 11:  # a restore point: exact, and nothing to say
                assert err == ""
                for name, value in got.items():
                    assert np.array_equal(bits(value), bits(saved[11]["model/" + name])), name
                continue
            assert err == (f"datastates-hist: step 3 of {run} is a trajectory point: 6 of the 8 tensors written are "
                           f"rounded to 8 mantissa bits (relative error at most 0.00195), not exact: {shown}\n")
            for name, value in got.items():
                if "model/" + name in ROUNDED:
                    assert_within_bound(value, saved[3]["model/" + name], KEEP_BITS, name)
                else:
                    assert np.array_equal(bits(value), bits(saved[3]["model/" + name])), name
        with safe_open(str(tmp_path / f"s{step}.safetensors"), "pt") as f:
            metadata = f.metadata()
        assert json.loads(metadata.get("keep_bits", "{}")) == ({n: KEEP_BITS for n in order} if step == 3 else {})
    # every tensor: the trajectory point holds the model's alone
    assert {n.split("/")[0] for n in lacking} == {"optim", "rng"}
    groups = ", ".join(f"{g}/*: {sum(n.startswith(g + '/') for n in lacking)}" for g in ("optim", "rng"))
    target = str(tmp_path / "all.pt")
    assert main(["export", run, "3", "--to", target, "--all"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"datastates-hist: step 3 of {run} is a trajectory point: 6 of the 8 tensors written are rounded to 8 "
        f"mantissa bits (relative error at most 0.00195), not exact: {', '.join('model/' + n for n in order[:5])} "
        "and 1 more",
        f"datastates-hist: step 3 of {run} is a trajectory point, which keeps only the trajectory's tensors: it "
        f"lacks {len(lacking)} tensor(s) that restore point 10 (the nearest) holds ({groups}), and so does the export"]
    assert main(["export", run, "11", "--to", target, "--all", "--force"]) == 0
    assert capsys.readouterr().err == ""


def test_verify_is_clean_and_repair_rebuilds_the_same_rows(run):
    assert verify_run(run) == []
    sql = "SELECT * FROM tensors ORDER BY step, name"
    before, steps_before = rows(run, sql), rows(run, "SELECT step, tier, nbytes, ntensors FROM steps")
    for side in ("", "-wal", "-shm"):
        if os.path.exists(index_path(run) + side):
            os.remove(index_path(run) + side)
    report = repair_run(run)
    assert (report.steps, report.set_aside) == (list(range(STEPS)), {})
    assert rows(run, sql) == before
    assert rows(run, "SELECT step, tier, nbytes, ntensors FROM steps") == steps_before
    assert verify_run(run) == []


def unit_files(run_dir: str, unit: str) -> list[str]:
    path = os.path.join(steps_dir(run_dir), unit)
    if os.path.isdir(path):
        return [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.startswith("data.")]
    return [path]


def test_a_flipped_byte_in_low_bits_is_reported(run):
    step, name = 11, "model/0.weight"
    store = Store(run)
    with store.open_step(step) as data:
        rec = data.records[name]
        blob = np.empty(rec.low_stored, np.uint8)
        data.readers["restore"].read(name, blob, (0,))
    store.close()
    main = next(u for u in os.listdir(steps_dir(run)) if u.startswith(step_stem(step)) and ".restore" not in u)
    for path in unit_files(run, restore_unit(main)):
        with open(path, "rb") as fh:
            content = bytearray(fh.read())
        at = content.find(blob.tobytes())
        if at >= 0:
            content[at + len(blob) - 3] ^= 0x10
            with open(path, "wb") as fh:
                fh.write(content)
            break
    else:
        pytest.fail("the low bits are not found in the restore unit")
    problems = verify_run(run)
    assert [(p.step, p.tensor) for p in problems] == [(step, name)]
    assert ("its low bits cannot be decoded" in problems[0].message
            or "(its exact value, with its low bits) of step 11" in problems[0].message), problems[0].message
    with dh.open(run) as h:  # the other steps, and the rounded values, read as they did
        assert np.array_equal(bits(h.read(name, 10)), bits(SAVED[run]["model"][10][name]))


def test_a_demoted_step_forgets_its_low_bits_in_the_index(run):
    """Step 10 is demoted by one more write: its rows lose the exact checksum, its reads are rounded."""
    saved = SAVED[run]
    model = fresh_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with dh.Checkpointer(run, keep=dh.KeepLast(2), trajectory=dh.Trajectory("model/*", keep_bits=KEEP_BITS)) as ckpt:
        ckpt.restore(model=model, optimizer=optimizer)
        ckpt.write(STEPS, model, optimizer)
    assert rows(run, "SELECT tier FROM steps WHERE step=10") == [("trajectory",)]
    assert rows(run, "SELECT DISTINCT exact_checksum, low_stored FROM tensors WHERE step=10") == [(None, None)]
    with dh.open(run) as h:
        assert_within_bound(h.read("model/0.weight", 10), saved["model"][10]["model/0.weight"], KEEP_BITS, 10)
        assert h.tensors(10).set_index("name").loc["model/0.weight", "keep_bits"] == KEEP_BITS  # now rounded
        # step 12 (restored from 11, then written): its exact values
        assert np.array_equal(bits(h.read("model/0.weight", STEPS)), bits(saved["model"][11]["model/0.weight"]))
    assert verify_run(run) == []


# --- other runs ----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["adios2", "hdf5"])
def test_only_steps_on_the_grid_are_rounded_and_a_raw_codec_still_rounds(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    saved = train(run_dir, backend, steps=6, codec="raw",
                  trajectory=dh.Trajectory("model/*", every=2, keep_bits=KEEP_BITS))
    found = dict(rows(run_dir, "SELECT step, keep_bits FROM tensors WHERE name='model/0.weight'"))
    assert found == {0: 8, 2: 8, 4: 8, 5: None}  # 1 and 3 are off the grid: removed, never rounded
    assert dict(rows(run_dir, "SELECT step, encoding FROM tensors WHERE name='model/0.weight'")) == {
        0: "key", 2: "key", 4: "key", 5: "raw"}
    with dh.open(run_dir) as h:
        for step in (0, 2):
            assert_within_bound(h.read("model/0.weight", step), saved["model"][step]["model/0.weight"], KEEP_BITS, step)
        for step in (4, 5):
            assert torch.equal(h.read("model/0.weight", step), saved["model"][step]["model/0.weight"])
    assert verify_run(run_dir) == []


@pytest.mark.parametrize("keep_bits, message", [
    (0, "Trajectory(keep_bits=...) needs a whole number of mantissa bits from 1 to 52 (float32 has 23, "
        "bfloat16 7), got 0"),
    (53, "Trajectory(keep_bits=...) needs a whole number of mantissa bits from 1 to 52 (float32 has 23, "
         "bfloat16 7), got 53"),
    (8.0, "Trajectory(keep_bits=...) needs a whole number of mantissa bits from 1 to 52 (float32 has 23, "
          "bfloat16 7), got 8.0"),
    (True, "Trajectory(keep_bits=...) needs a whole number of mantissa bits from 1 to 52 (float32 has 23, "
           "bfloat16 7), got True"),
    ("8", "Trajectory(keep_bits=...) needs a whole number of mantissa bits from 1 to 52 (float32 has 23, "
          "bfloat16 7), got '8'"),
])
def test_bad_keep_bits_are_refused(keep_bits, message):
    with pytest.raises(ValueError) as exc:
        dh.Trajectory("model/*", keep_bits=keep_bits)
    assert str(exc.value) == message


def test_keep_bits_without_keep_is_refused(tmp_path):
    with pytest.raises(ValueError) as exc:
        dh.Checkpointer(tmp_path / "run", trajectory=dh.Trajectory("model/*", keep_bits=8))
    assert str(exc.value) == (
        "Trajectory(keep_bits=8) rounds the steps that become trajectory points, but without keep= every "
        "step stays an exact restore point: pass keep= (dh.KeepLast(2) | dh.KeepEvery(1000), say) or "
        "leave keep_bits out")
    assert not os.path.exists(tmp_path / "run" / "index.sqlite")


def test_a_damaged_record_of_rounding_is_refused():
    from datastates_hist.items import TensorRecord

    good = {"name": "model/w", "dtype": "float32", "shape": [2], "nbytes": 8, "checksum": "0" * 16,
            "encoding": "key", "stored": 8, "chunks": [[8, 8, 1]], "keep_bits": 8, "bound": 2.0**-9,
            "exact_checksum": "1" * 16, "low_stored": 8, "low_chunks": [[8, 8, 1]]}
    TensorRecord.from_json(good)
    for change, message in [
        ({"keep_bits": 30}, "tensor 'model/w' is rounded: keep_bits must be 1..23 for float32, got 30"),
        ({"bound": 0.5}, "tensor 'model/w' keeps 8 mantissa bits, whose bound is 0.001953125, but records 0.5"),
        ({"encoding": "raw"}, "tensor 'model/w' is recorded as rounded, but stored raw: a writer rounds only "
                              "encoded tensors of the main unit"),
        ({"part": "restore"}, "tensor 'model/w' is rounded, but stored in the unit 'restore': a writer rounds "
                              "only encoded tensors of the main unit"),
        ({"low_chunks": [[8, 9, 1]]}, "tensor 'model/w' (its low bits): chunk 0: stored raw but stored_len 9 "
                                      "!= raw_len 8"),
        ({"exact_checksum": None}, "tensor 'model/w' is rounded with low bits (None, 8, [[8, 8, 1]]): they need "
                                   "exact_checksum, low_stored and (in a manifest) low_chunks"),
    ]:
        with pytest.raises(ValueError) as exc:
            TensorRecord.from_json({**good, **change})
        assert str(exc.value) == message, change


def _crafted_run(run_dir: str, backend: str, monkeypatch, unit: str, name: str, change,
                 keep_every: int | None = None) -> None:
    """4 steps (restore points 2 and 3, and those ``KeepEvery(keep_every)`` keeps) whose step 3
    manifest of ``unit`` has ``change`` applied to tensor ``name``'s entry (the manifests'
    checksums stay consistent)."""
    import json

    from datastates_hist import commit

    original = commit.manifest_bytes

    def crafted(step, records, values, **more):
        raw = original(step, records, values, **more)
        if step != 3 or more.get("unit", "") != unit:
            return raw
        doc = json.loads(raw)
        for entry in doc["tensors"]:
            if entry["name"] == name:
                change(entry)
        return json.dumps(doc, separators=(",", ":")).encode()

    monkeypatch.setattr(commit, "manifest_bytes", crafted)
    torch.manual_seed(0)
    state, m = {"w": torch.randn(200, 30)}, torch.randn(300)
    keep = dh.KeepLast(2) if keep_every is None else dh.KeepLast(2) | dh.KeepEvery(keep_every)
    with dh.Checkpointer(run_dir, backend=backend, keep=keep,
                         trajectory=dh.Trajectory("model/*", keep_bits=8)) as ckpt:
        for step in range(4):
            state["w"].add_(torch.randn_like(state["w"]) * 1e-3)
            ckpt.write(step, state, m=m)
    monkeypatch.setattr(commit, "manifest_bytes", original)


@pytest.mark.parametrize("backend", ["adios2", "hdf5"])
@pytest.mark.parametrize("unit, name, change, message, keep_every", [
    ("", "model/w", lambda e: [e.pop(k) for k in ("exact_checksum", "low_stored", "low_chunks")],
     "tensor 'model/w' is rounded to 8 mantissa bits, but its record names no low bits: the exact value "
     "of this restore point is lost", None),
    # step 3 kept for good: its restore unit is encoded (a key)
    ("restore", "extra/m", lambda e: e.update(keep_bits=8, bound=2.0**-9),
     "tensor 'extra/m' of its restore unit is recorded as rounded ({'keep_bits': 8, 'bound': 0.001953125}): "
     "only tensors of the main unit are", 3),
    # step 3 let go later: its restore unit is stored raw
    ("restore", "extra/m", lambda e: e.update(keep_bits=8, bound=2.0**-9),
     "tensor 'extra/m' is recorded as rounded, but stored raw: a writer rounds only encoded tensors of the "
     "main unit", None),
])
def test_a_restore_point_whose_rounding_records_are_crafted_is_refused_and_repair_sets_it_aside(
        tmp_path, backend, monkeypatch, unit, name, change, message, keep_every):
    """A restore point must give exact values or none: a rounded tensor without its low bits, or
    a restore unit's tensor said to be rounded, is damage; repair keeps the main unit as a
    trajectory point and sets the restore unit aside."""
    run_dir = str(tmp_path / "run")
    _crafted_run(run_dir, backend, monkeypatch, unit, name, change, keep_every)
    with dh.open(run_dir) as h:
        with pytest.raises(dh.CorruptionError) as exc:
            h.read("model/w", 3)
    assert str(exc.value) == f"the manifest of step 3 in {run_dir} is damaged: {message}"
    assert [p.step for p in verify_run(run_dir)] == [3]
    os.remove(index_path(run_dir))
    report = repair_run(run_dir)
    unit = f"000000000003.restore.{'bp' if backend == 'adios2' else 'h5'}"
    assert report.steps == [0, 1, 2, 3] and list(report.set_aside) == [unit], report
    assert os.listdir(os.path.join(run_dir, "damaged")) == [unit]
    assert verify_run(run_dir) == []
    with dh.open(run_dir) as h:
        assert h.restore_points == ([0, 2] if keep_every else [2]) and h.steps == [0, 1, 2, 3]
        assert h.tensors(3).set_index("name").loc["model/w", "keep_bits"] == 8


@pytest.mark.parametrize("dtype, bits", [("bfloat16", 7), ("float16", 10), ("float32", 23)])
def test_a_dtype_with_no_more_mantissa_bits_than_kept_is_stored_exact(dtype, bits):
    trajectory = dh.Trajectory("model/*", keep_bits=bits)
    assert trajectory.rounds("model/w", dtype, 0) is None
    assert dh.Trajectory("model/*", keep_bits=bits - 1).rounds("model/w", dtype, 0) == bits - 1


def test_keep_bits_may_be_a_numpy_integer():
    assert dh.Trajectory("model/*", keep_bits=np.int64(8)).keep_bits == 8
    assert type(dh.Trajectory("model/*", keep_bits=np.int64(8)).keep_bits) is int
