"""The backend contract suite: every backend passes these or is not done.

The tests write and read runs through the public API (:class:`~datastates_hist.Checkpointer`,
:func:`datastates_hist.open`, :class:`~datastates_hist.store.Store`), so they hold a
backend to the whole lifecycle of :mod:`datastates_hist.backends.base`: every dtype
bit for bit, stored raw and encoded (keys, deltas against one and two earlier steps),
views and empty tensors, tensors streamed through a small host cache, statistics, plain
values, truncation, restore points and trajectory points, damage named, bad arguments
refused, and a failure at any point of a step leaving it uncommitted.

A backend elsewhere registers itself and runs the suite by subclassing
:class:`BackendContract` in one of its pytest modules and giving the subclass a
``backend`` fixture that returns the registered name::

    import pytest
    from datastates_hist.backends import register_backend
    from datastates_hist.testing.backend_contract import BackendContract

    register_backend("mine", MyBackend())

    class TestMyBackend(BackendContract):
        @pytest.fixture
        def backend(self):
            return "mine"

Each test writes its run in its own temporary folder (the ``run_dir`` fixture).
The suite needs pytest, torch and xxhash; ``import datastates_hist`` does not import it.
"""

import os
from dataclasses import replace

import numpy as np
import pytest
import torch
import xxhash

import datastates_hist as dh
from datastates_hist.backends import Backend, get_backend, register_backend, unregister_backend
from datastates_hist.layout import restore_unit, steps_dir
from datastates_hist.store import Store
from datastates_hist.verify import verify_run

CODECS = ("raw", "key", "delta")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
          torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
          torch.bool] + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def sample(dtype, shape=(5, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype)


def drift(t, step):
    """``t`` changed a little, as training changes a tensor from one step to the next."""
    g = torch.Generator().manual_seed(1000 + step)
    if t.dtype == torch.bool:
        return t ^ (torch.rand(t.shape, generator=g) < 0.1)
    if t.dtype.is_complex:
        return t + 0.01 * torch.randn(t.shape, dtype=t.dtype, generator=g)
    if t.dtype.is_floating_point:
        wide = torch.float64 if t.dtype == torch.float64 else torch.float32
        return (t.to(wide) * (1 + 0.01 * torch.randn(t.shape, dtype=wide, generator=g))).to(t.dtype)
    return t + torch.randint(0, 2, t.shape, generator=g, dtype=t.dtype)


def _blob(run_dir, step, name) -> bytes:
    """The blob of encoded tensor ``name`` of ``step``, as its unit holds it."""
    store = Store(run_dir)
    try:
        with store.open_step(step) as data:
            rec = data.records[name]
            assert rec.encoding != "raw", rec
            blob = np.empty(rec.stored, np.uint8)
            data.readers[rec.part].read(name, blob, (0,))
            return blob.tobytes()
    finally:
        store.close()


def _file_holding(unit: str, needle: bytes) -> str:
    """The file of a step's unit (a file, or any file under its folder) that holds ``needle``."""
    files = [unit] if os.path.isfile(unit) else [os.path.join(root, f) for root, _, names in os.walk(unit)
                                                 for f in names]
    holding = [f for f in files if needle in open(f, "rb").read()]
    assert holding, f"no file of {unit} holds the tensor's bytes"
    return holding[0]


def bits(t):
    """The tensor's bytes, for bit-exact comparison whatever the dtype (NaN included)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def roundtrip(run_dir, backend, tensors, **kw):
    model = torch.nn.Linear(2, 2)
    with dh.Checkpointer(run_dir, backend=backend, **kw) as ckpt:
        ckpt.write(0, model, data=tensors)
    with dh.Checkpointer(run_dir) as ckpt:
        return ckpt.restore(model=torch.nn.Linear(2, 2)).extra["data"]


class FailingBackend(Backend):
    """A real backend that raises at one chosen point of one step's lifecycle."""

    def __init__(self, inner, fail_step, where):
        self.inner, self.fail_step, self.where = inner, fail_step, where
        self.name = inner.name

    def begin_step(self, steps_dir, step, group=None, part=""):
        if step == self.fail_step and self.where == "begin":
            raise OSError("injected failure at begin")
        writer = self.inner.begin_step(steps_dir, step, group, part)
        if step == self.fail_step:
            if self.where == "write_out":
                # a writer that stores at put() is asked to write out only when the cache
                # runs short, which timing decides; holding its puts, the flusher asks at
                # every quarter of the cache
                writer.writes_at_put = False

            def fail(*args, **kwargs):
                raise OSError(f"injected failure at {self.where}")

            setattr(writer, self.where, fail)
        return writer

    def open_step(self, steps_dir, location):
        return self.inner.open_step(steps_dir, location)

    def writer_at(self, final, step):
        return self.inner.writer_at(final, step)

    def reader_at(self, path):
        return self.inner.reader_at(path)


class BackendContract:
    """The contract tests; a subclass named ``Test...`` runs them for its ``backend`` fixture."""

    @pytest.fixture
    def run_dir(self, tmp_path):
        return str(tmp_path / "run")

    def test_every_dtype_round_trips_bit_exact(self, run_dir, backend):
        tensors = {str(d): sample(d) for d in DTYPES}
        back = roundtrip(run_dir, backend, tensors)
        for name, t in tensors.items():
            assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
            assert bits(back[name]) == bits(t), name

    def test_views_scalars_and_empty_tensors(self, run_dir, backend):
        base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
        tensors = {
            "transposed": base.t(),
            "strided": base[::2, 1::3],
            "expanded": torch.tensor([1.5, 2.5]).expand(3, 2),
            "scalar": torch.tensor(3.25),
            "scalar_int": torch.tensor(7),
            "empty": torch.empty(0, 4),
            "empty_bf16": torch.empty(3, 0, dtype=torch.bfloat16),
        }
        back = roundtrip(run_dir, backend, tensors)
        for name, t in tensors.items():
            assert back[name].shape == t.shape, name
            assert torch.equal(back[name], t), name

    def test_large_tensor_streamed_through_small_cache(self, run_dir, backend):
        big = torch.randn(300, 257)  # about 300 KB, through a 64 KiB cache in pieces
        rows = torch.randn(3, 70000)  # one row larger than a piece: split within rows
        back = roundtrip(run_dir, backend, {"big": big, "rows": rows},
                         host_cache_bytes=64 << 10, piece_bytes=16 << 10)
        assert torch.equal(back["big"], big) and torch.equal(back["rows"], rows)
        store = Store(run_dir)
        rec = {r.name: r for r in store.records(0)}["extra/data/big"]
        raw = big.numpy()
        assert rec.checksum == xxhash.xxh3_64_hexdigest(raw.tobytes())
        assert rec.stats["norm"] == pytest.approx(float(np.linalg.norm(raw.astype(np.float64))), rel=1e-5)
        assert rec.stats["mean"] == pytest.approx(float(raw.astype(np.float64).mean()), abs=1e-6)
        assert rec.stats["std"] == pytest.approx(float(raw.astype(np.float64).std()), rel=1e-5)
        assert (rec.stats["min"], rec.stats["max"]) == (float(raw.min()), float(raw.max()))
        assert rec.stats["nonfinite"] == 0
        store.close()
        # boxes that cut across the pieces (which an ADIOS2 writer puts in several ADIOS2 steps)
        with dh.open(run_dir) as h:
            for name, t, index in (("big", big, (slice(10, 290), slice(3, 250))),
                                   ("big", big, (slice(None, None, -7), 100)),
                                   ("rows", rows, (slice(0, 3), slice(1000, 69000)))):
                want = torch.from_numpy(t.numpy()[index].copy())  # numpy: negative strides too
                assert torch.equal(h.read(f"extra/data/{name}", 0, index=index), want), (name, index)

    def test_nonfinite_values_are_counted(self, run_dir, backend):
        t = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
        back = roundtrip(run_dir, backend, {"t": t})
        assert bits(back["t"]) == bits(t)
        store = Store(run_dir)
        (rec,) = [r for r in store.records(0) if r.name == "extra/data/t"]
        assert rec.stats["nonfinite"] == 2
        store.close()

    def test_any_committed_step_restores(self, run_dir, backend):
        model = torch.nn.Linear(4, 3)
        seen = {}
        with dh.Checkpointer(run_dir, backend=backend) as ckpt:
            for step in (0, 3, 7, 12):
                ckpt.wait_snapshot()  # in-place edits outside the optimizer are not guarded
                with torch.no_grad():
                    model.weight.add_(step)
                seen[step] = model.weight.detach().clone()
                ckpt.write(step, model, data={"step": step})
            ckpt.wait()
            assert ckpt.steps() == [0, 3, 7, 12]
            for step in (7, 0, 12, 3):
                r = ckpt.restore(step, model=model)
                assert r.step == step and r.extra["data"] == {"step": step}
                assert torch.equal(model.weight, seen[step])

    def test_optimizer_state_restores_into_fresh_memory_bit_exact(self, run_dir, backend):
        # 2 x 16 MiB of Adam state read into fresh memory: large enough that a reader reads
        # it on several threads (ADIOS2's own; HDF5's byte ranges, two threads)
        torch.manual_seed(0)
        model = torch.nn.Linear(2048, 2048)
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(4, 2048)).sum().backward()
        opt.step()
        with dh.Checkpointer(run_dir, backend=backend) as ckpt:
            ckpt.write(1, model, opt)
        fresh = torch.nn.Linear(2048, 2048)
        fresh_opt = torch.optim.Adam(fresh.parameters())
        with dh.Checkpointer(run_dir) as ckpt:
            ckpt.restore(model=fresh, optimizer=fresh_opt)
        assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
        for p, q in zip(model.parameters(), fresh.parameters()):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert bits(fresh_opt.state[q][key].reshape(-1)) == bits(opt.state[p][key].reshape(-1)), key

    def test_adam_moments_are_predicted_and_restore_bit_exact(self, run_dir, backend):
        """Consecutive restore points of AdamW: exp_avg is a delta against its prediction
        from the weights' update, exp_avg_sq against its prediction from exp_avg
        (predictors.py), every step but the keys; each step reads back and restores bit for
        bit, going forward and back in time."""
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
        states, names = {}, [n for n, _ in model.named_parameters()]
        with dh.Checkpointer(run_dir, backend=backend, key_every=4) as ckpt:
            for step in range(9):
                opt.zero_grad()
                model(torch.randn(16, 64)).pow(2).mean().backward()
                opt.step()
                ckpt.write(step, model, opt)
                ckpt.wait()
                states[step] = [opt.state[p][k].clone() for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
        store = Store(run_dir)
        try:
            for step in range(9):
                with store.open_step(step) as data:
                    predicted = {r.name for r in data.records.values() if r.predictor is not None}
                    moments = {n for n in data.records if n.endswith(("/exp_avg", "/exp_avg_sq"))}
                    assert predicted == (set() if step % 4 == 0 else moments), step
                    for rec in data.records.values():
                        if rec.name.endswith("/exp_avg_sq") and rec.predictor is not None:
                            assert rec.predictor == {"kind": "adam_second_moment", "beta1": 0.9, "beta2": 0.95,
                                                     "first": rec.name[:-len("_sq")]}
                        if rec.name.endswith("/exp_avg") and rec.predictor is not None:
                            p = rec.predictor
                            assert (p["kind"], p["weight"], p["second"]) == (
                                "adam_first_moment", "model/" + rec.name.split("/")[2], rec.name + "_sq")
                            assert abs(p["bias2"] - (1 - 0.95 ** (step + 1)) ** 0.5) < 1e-12 and p["step_size"] > 0
                        if rec.predictor is not None:
                            assert rec.base == step - 1 and rec.base2 is None
        finally:
            store.close()
        for order in (range(9), reversed(range(9))):
            with dh.open(run_dir) as h:
                for step in order:
                    keys = [f"optim/state/{n}/{k}" for n in names for k in ("exp_avg", "exp_avg_sq")]
                    for name, value in zip(keys, states[step]):
                        assert bits(h.read(name, step)) == bits(value), (step, name)
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3, betas=(0.9, 0.95))
        with dh.Checkpointer(run_dir) as ckpt:
            ckpt.restore(7, model=fresh, optimizer=fresh_opt)
        restored = [fresh_opt.state[q][k] for q in fresh.parameters() for k in ("exp_avg", "exp_avg_sq")]
        for got, value in zip(restored, states[7]):
            assert bits(got.reshape(-1)) == bits(value.reshape(-1))
        assert verify_run(run_dir) == []

    def test_plain_values_round_trip(self, run_dir, backend):
        value = {"epoch": 3, "lr": 1e-3, "name": "x", "nested": {"t": (1, 2), "l": [None, True]},
                 "int_keys": {1: "a", 2: "b"}, "bytes": b"\x00\xff", "nan": float("nan"),
                 "tag_like": {"__tuple__": [1, 2]}, "inf": float("-inf")}
        back = roundtrip(run_dir, backend, value)
        assert np.isnan(back.pop("nan")) and value.pop("nan") is not None
        assert back == value

    def test_step_data_is_removed_with_truncate(self, run_dir, backend):
        model = torch.nn.Linear(2, 2)
        with dh.Checkpointer(run_dir, backend=backend) as ckpt:
            for step in range(4):
                ckpt.write(step, model)
            ckpt.wait()
            assert ckpt.truncate(after=1) == [2, 3]
            assert ckpt.steps() == [0, 1]
            assert len(os.listdir(steps_dir(run_dir))) == 2
            ckpt.write(2, model)  # the history grows again from step 1
        with dh.Checkpointer(run_dir) as ckpt:
            assert ckpt.steps() == [0, 1, 2]

    def test_damaged_tensor_data_is_detected_and_named(self, run_dir, backend):
        big = torch.arange(1 << 16, dtype=torch.float32)
        model = torch.nn.Linear(2, 2)
        with dh.Checkpointer(run_dir, backend=backend, codec="raw") as ckpt:
            ckpt.write(0, model, data={"big": big})
        needle = big.numpy()[1000:1004].tobytes()
        data_file = _file_holding(os.path.join(steps_dir(run_dir), os.listdir(steps_dir(run_dir))[0]), needle)
        raw = bytearray(open(data_file, "rb").read())
        at = bytes(raw).find(needle)
        raw[at] ^= 0x01
        open(data_file, "wb").write(bytes(raw))
        with dh.Checkpointer(run_dir) as ckpt:
            with pytest.raises(dh.CorruptionError, match=r"'extra/data/big' of step 0 .* checksum"):
                ckpt.restore(model=model)

    def test_damaged_encoded_tensor_data_is_detected_and_named(self, run_dir, backend):
        """A bit flipped in the blob of a key names the key's tensor, at its step and at
        the step stored as a delta against it."""
        big = torch.arange(1 << 16, dtype=torch.float32)
        model = torch.nn.Linear(2, 2)
        with dh.Checkpointer(run_dir, backend=backend) as ckpt:
            ckpt.write(0, model, data={"big": big})
            ckpt.write(1, model, data={"big": big + 1})
        store = Store(run_dir)
        assert [(r.encoding, r.base) for s in (0, 1) for r in store.records(s) if r.name == "extra/data/big"] == [
            ("key", None), ("delta", 0)]
        store.close()
        blob = _blob(run_dir, 0, "extra/data/big")
        data_file = _file_holding(os.path.join(steps_dir(run_dir), sorted(os.listdir(steps_dir(run_dir)))[0]), blob)
        raw = bytearray(open(data_file, "rb").read())
        raw[bytes(raw).find(blob) + len(blob) // 2] ^= 0x01
        open(data_file, "wb").write(bytes(raw))
        damaged = rf"tensor 'extra/data/big' of step 0 in {run_dir} (does not match its checksum|cannot be decoded)"
        with dh.Checkpointer(run_dir) as ckpt:
            for step in (0, 1):
                with pytest.raises(dh.CorruptionError, match=damaged):
                    ckpt.restore(step, model=model)
        problems = verify_run(run_dir)
        assert [(p.step, p.tensor) for p in problems] == [(0, "extra/data/big"), (1, "extra/data/big")]
        assert problems[1].message.startswith("its delta base at step 0 cannot be read: ")

    @pytest.mark.parametrize("where", ["begin", "define", "put", "write_out", "finish"])
    def test_a_failed_step_is_not_committed_and_reported(self, run_dir, backend, where):
        name = f"failing-{backend}-{where}"
        register_backend(name, FailingBackend(get_backend(backend), 2, where))
        try:
            self._fail_one_step(run_dir, name, where)
        finally:
            unregister_backend(name)

    def _fail_one_step(self, run_dir, name, where):
        model = torch.nn.Linear(64, 64)
        # a cache smaller than the state, so that the flusher must write out mid-step; raw
        # for write_out, since an unchanged model's deltas are a few bytes, which never
        # fill a quarter of the cache
        codec = {"codec": "raw"} if where == "write_out" else {}
        ckpt = dh.Checkpointer(run_dir, backend=name, host_cache_bytes=8 << 10, piece_bytes=2 << 10, **codec)
        for step in range(2):
            ckpt.write(step, model)
        ckpt.wait()
        ckpt.write(2, model)
        with pytest.raises(dh.CheckpointError, match=f"step 2 .*injected failure at {where}"):
            ckpt.wait()
        ckpt.wait()  # reported once
        ckpt.write(3, model)  # training goes on after a failed step
        ckpt.close()
        with dh.Checkpointer(run_dir) as again:
            assert again.steps() == [0, 1, 3]
            assert again.restore(model=model).step == 3
        assert sorted(os.listdir(steps_dir(run_dir)))[-1].startswith("000000000003")
        assert not any(f.endswith(".partial") for f in os.listdir(steps_dir(run_dir)))

    def test_mapped_bytes_are_the_stored_bytes_and_outlive_the_reader(self, run_dir, backend):
        """Encoded bytes a backend gives as views of its mapped file (``mapped_bytes``) are
        the bytes ``read_many`` reads, read-only, and still valid once the reader is closed."""
        with dh.Checkpointer(run_dir, backend=backend, codec="key") as ckpt:
            ckpt.write(0, torch.nn.Linear(2, 2), data={"big": torch.arange(1 << 16, dtype=torch.float32)})
        store = Store(run_dir)
        with store.open_step(0) as data:
            records = [r for r in data.records.values() if r.encoding == "key" and r.stored]
            assert "extra/data/big" in {r.name for r in records}
            reader = data.readers[""]
            mapped = reader.mapped_bytes([(r.name, r.stored) for r in records])
            read = {r.name: np.empty(r.stored, np.uint8) for r in records}
            reader.read_many([(name, out, (0,)) for name, out in read.items()])
        store.close()
        assert set(mapped) <= set(read)
        for name, view in mapped.items():
            assert not view.flags.writeable and view.dtype == np.uint8
            assert view.tobytes() == read[name].tobytes(), name

    @pytest.mark.parametrize("codec", CODECS)
    def test_index_and_manifest_agree(self, run_dir, backend, codec):
        model = torch.nn.Linear(3, 2)
        with dh.Checkpointer(run_dir, backend=backend, codec=codec) as ckpt:
            for step in (5, 6, 7):
                ckpt.wait_snapshot()
                with torch.no_grad():
                    model.weight.mul_(1.01)
                ckpt.write(step, model)
        store = Store(run_dir)
        for step in (5, 6, 7):
            with store.open_step(step) as data:
                # the index has no chunk tables and no second bases (a delta's base has its own)
                assert {r.name: r for r in store.records(step)} == {
                    name: replace(r, chunks=None, base2=None) for name, r in data.records.items()}
                assert "model/weight" in data.records and "rng/torch" in data.records
                weight = data.records["model/weight"]
                assert weight.encoding == ("raw" if codec == "raw" else "key" if codec == "key" or step == 5
                                           else "delta")
                assert (weight.chunks is None) == (codec == "raw")
                assert weight.base2 == (5 if codec == "delta" and step == 7 else None)
        store.close()

    # --- format version 2: encodings, restore and trajectory points, the new arguments ---

    @pytest.mark.parametrize("codec", CODECS)
    def test_every_dtype_round_trips_bit_exact_at_every_step_with_every_codec(self, run_dir, backend, codec):
        """Slowly changing tensors of every dtype over 5 steps: with ``delta``, step 0
        is stored as keys, step 1 as deltas against step 0, later steps against the two
        steps before them. Every step reads back bit for bit."""
        steps = range(5)
        written = {}
        tensors = {str(d): sample(d) for d in DTYPES}
        model = torch.nn.Linear(2, 2)
        with dh.Checkpointer(run_dir, backend=backend, codec=codec) as ckpt:
            for step in steps:
                written[step] = tensors
                ckpt.write(step, model, data=tensors)
                tensors = {name: drift(t, step) for name, t in tensors.items()}
        store = Store(run_dir)
        try:
            for step in steps:
                want = {f"extra/data/{name}": t for name, t in written[step].items()}
                with store.open_step(step) as data:
                    for name, t in want.items():
                        back = data.read(name)
                        assert back.dtype == t.dtype and back.shape == t.shape, (step, name)
                        assert bits(back) == bits(t), (step, name)
                        rec = data.records[name]
                        assert rec.base2 == (step - 2 if codec == "delta" and step >= 2 else None), (step, name)
                indexed = {r.name: (r.encoding, r.base) for r in store.records(step) if r.name in want}
                expected = (("raw", None) if codec == "raw" else ("key", None) if codec == "key" or step == 0
                            else ("delta", step - 1))
                assert indexed == {name: expected for name in want}, step
        finally:
            store.close()
        with dh.open(run_dir) as h:  # a reader going back in time decodes the chains too
            for step in reversed(steps):
                for name, t in written[step].items():
                    assert bits(h.read(f"extra/data/{name}", step)) == bits(t), (step, name)

    def test_restore_points_and_trajectory_points(self, run_dir, backend):
        """keep= decides which steps stay restore points; trajectory= what the others keep."""
        keep = dh.KeepLast(2) | dh.KeepEvery(3)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        opt = torch.optim.Adam(model.parameters())
        weights, expected_restore = {}, []
        with dh.Checkpointer(run_dir, backend=backend, keep=keep, trajectory=dh.Trajectory("model/*")) as ckpt:
            for step in range(8):
                model(torch.randn(2, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
                weights[step] = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
                ckpt.write(step, model, opt)
                # what the policy keeps after this commit: the newest, and what keep keeps
                points = expected_restore + [step]
                expected_restore = sorted(set(points[-1:]) | keep.keep(points))
            final_opt = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
        trajectory = [s for s in range(8) if s not in expected_restore]
        assert expected_restore == [0, 3, 6, 7] and trajectory == [1, 2, 4, 5]
        store = Store(run_dir)
        try:
            rows = {r.step: r for r in store.index.step_rows()}
            assert {s: r.tier for s, r in rows.items()} == {
                s: "restore" if s in expected_restore else "trajectory" for s in range(8)}
            assert store.restore_points() == expected_restore
            for step in trajectory:  # exactly the model's tensors, bit for bit
                with store.open_step(step) as data:
                    assert sorted(data.records) == sorted(weights[step])
                    for name, t in weights[step].items():
                        assert bits(data.read(name)) == bits(t), (step, name)
                assert (rows[step].ntensors, rows[step].nbytes) == (
                    len(weights[step]), sum(t.numel() * t.element_size() for t in weights[step].values()))
            units = {}
            for step, row in rows.items():
                units[row.location] = step
                if step in expected_restore:
                    units[restore_unit(row.location)] = step
            assert sorted(os.listdir(steps_dir(run_dir))) == sorted(units)  # demoted: restore units gone
        finally:
            store.close()

        fresh = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        fresh_opt = torch.optim.Adam(fresh.parameters())
        with dh.Checkpointer(run_dir) as ckpt:
            assert ckpt.restore(model=fresh, optimizer=fresh_opt).step == 7  # the newest restore point
            for k, v in fresh.state_dict().items():
                assert bits(v) == bits(weights[7][f"model/{k}"]), k
            for k, v in fresh_opt.state_dict()["state"][0].items():
                assert bits(v.reshape(-1)) == bits(final_opt[k].reshape(-1)), k

            with pytest.raises(dh.StepNotFoundError) as caught:
                ckpt.restore(4, model=fresh, optimizer=fresh_opt)
            assert str(caught.value) == (
                f"step 4 of {run_dir} is a trajectory point, not a restore point: it keeps 4 tensor(s) to read, "
                "not the whole state. The nearest restore points: 3 and 6; restore(step, strict=False) loads "
                "what it has and lists the rest")
            other = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
            other_opt = torch.optim.Adam(other.parameters())
            restored = ckpt.restore(4, model=other, optimizer=other_opt, strict=False)
            assert restored.step == 4
            assert (restored.problems.missing, restored.problems.unexpected, restored.problems.mismatched) == (
                ["optim", "rng"], [], [])
            for k, v in other.state_dict().items():
                assert bits(v) == bits(weights[4][f"model/{k}"]), k
            assert other_opt.state_dict()["state"] == {}  # nothing of it was stored at step 4

    def test_lossy_trajectory_points_and_exact_restore_points(self, run_dir, backend):
        """Trajectory(keep_bits=8): trajectory points hold the weights rounded to nearest
        even at 8 mantissa bits; restore points read and restore exact."""
        from ..rounding import round_mantissa

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        opt = torch.optim.Adam(model.parameters())
        weights = {}
        with dh.Checkpointer(run_dir, backend=backend, keep=dh.KeepLast(2),
                             trajectory=dh.Trajectory("model/*", keep_bits=8)) as ckpt:
            for step in range(5):
                model(torch.randn(2, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
                weights[step] = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
                ckpt.write(step, model, opt)
        with dh.open(run_dir) as h:
            assert h.restore_points == [3, 4]
            for step, tensors in weights.items():
                for name, t in tensors.items():
                    want = t if step >= 3 else torch.from_numpy(round_mantissa(t.numpy(), "float32", 8))
                    assert bits(h.read(name, step)) == bits(want), (step, name)
        fresh = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        with dh.Checkpointer(run_dir) as ckpt:
            assert ckpt.restore(model=fresh, optimizer=torch.optim.Adam(fresh.parameters())).step == 4
        for k, v in fresh.state_dict().items():
            assert bits(v) == bits(weights[4][f"model/{k}"]), k
        assert verify_run(run_dir) == []

    def test_bad_arguments_of_retention_and_encoding_are_refused_by_name(self, run_dir, backend):
        for kwargs, error, message in (
                ({"keep": 5}, TypeError,
                 "keep= needs a retention policy such as dh.KeepLast(2) | dh.KeepEvery(1000), got 5"),
                ({"keep": "last"}, TypeError,
                 "keep= needs a retention policy such as dh.KeepLast(2) | dh.KeepEvery(1000), got 'last'"),
                ({"trajectory": "model/*"}, TypeError,
                 "trajectory= needs dh.Trajectory('model/*', every=1), got 'model/*'"),
                ({"codec": "zip"}, ValueError, "codec= must be one of 'delta', 'key', 'raw', got 'zip'"),
                ({"key_every": 0}, ValueError, "key_every needs a whole number >= 1, got 0"),
                ({"trajectory": dh.Trajectory("model/*", keep_bits=8)}, ValueError,
                 "Trajectory(keep_bits=8) rounds the steps that become trajectory points, but without keep= "
                 "every step stays an exact restore point: pass keep= (dh.KeepLast(2) | dh.KeepEvery(1000), "
                 "say) or leave keep_bits out")):
            with pytest.raises(error) as caught:
                dh.Checkpointer(run_dir, backend=backend, **kwargs)
            assert str(caught.value) == message
            assert not os.path.exists(run_dir)  # refused before anything was created
        for make, message in ((lambda: dh.KeepLast(0), "KeepLast needs a whole number >= 1, got 0"),
                              (lambda: dh.KeepEvery(-3), "KeepEvery needs a whole number >= 1, got -3"),
                              (lambda: dh.Trajectory(keep_bits=53), "Trajectory(keep_bits=...) needs a whole "
                               "number of mantissa bits from 1 to 52 (float32 has 23, bfloat16 7), got 53")):
            with pytest.raises(ValueError) as caught:
                make()
            assert str(caught.value) == message
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        with dh.Checkpointer(run_dir, backend=backend, keep=dh.KeepLast(2),
                             trajectory=dh.Trajectory("nomatch/*")) as ckpt:
            with pytest.raises(ValueError) as caught:
                ckpt.write(0, model)
            assert str(caught.value) == ("Trajectory('nomatch/*') matches no tensor of step 0 (its tensors: "
                                         "model/0.weight, model/0.bias, model/1.weight, model/1.bias, ...)")
            assert ckpt.steps() == []
