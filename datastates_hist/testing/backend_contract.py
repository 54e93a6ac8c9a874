"""The backend contract suite: every backend passes these or is not done.

The tests write and read runs through the public API (:class:`~datastates_hist.Checkpointer`,
:func:`datastates_hist.open`, :class:`~datastates_hist.store.Store`), so they hold a
backend to the whole lifecycle of :mod:`datastates_hist.backends.base`: every dtype
bit for bit, views and empty tensors, tensors streamed through a small host cache,
statistics, plain values, truncation, damage named, and a failure at any point of a
step leaving it uncommitted.

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

import numpy as np
import pytest
import torch
import xxhash

import datastates_hist as dh
from datastates_hist.backends import Backend, get_backend, register_backend, unregister_backend
from datastates_hist.layout import steps_dir
from datastates_hist.store import Store

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

    def begin_step(self, steps_dir, step):
        if step == self.fail_step and self.where == "begin":
            raise OSError("injected failure at begin")
        writer = self.inner.begin_step(steps_dir, step)
        if step == self.fail_step:
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
        # 2 x 16 MiB of Adam state read into fresh memory: large enough that a reader of one
        # thread reads the later half after a second thread faulted it in (store._read_while_faulting)
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
        with dh.Checkpointer(run_dir, backend=backend) as ckpt:
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
        # a cache smaller than the state, so that the flusher must write out mid-step
        ckpt = dh.Checkpointer(run_dir, backend=name, host_cache_bytes=8 << 10, piece_bytes=2 << 10)
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

    def test_index_and_manifest_agree(self, run_dir, backend):
        model = torch.nn.Linear(3, 2)
        with dh.Checkpointer(run_dir, backend=backend) as ckpt:
            ckpt.write(5, model)
        store = Store(run_dir)
        with store.open_step(5) as data:
            assert {r.name: r for r in store.records(5)} == data.records
            assert "model/weight" in data.records and "rng/torch" in data.records
        store.close()
