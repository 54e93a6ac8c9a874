"""The backend contract: every backend passes these or is not done.

The suite lives in :mod:`datastates_hist.testing.backend_contract`, so that a backend
from outside the package runs it too; here it runs for the built-in backends (the
``backend`` fixture of conftest.py), and for a backend registered from outside.
"""

import os

import pytest
import torch

import datastates_hist as dh
from datastates_hist.backends import register_backend, unregister_backend
from datastates_hist.layout import steps_dir
from datastates_hist.testing.backend_contract import BackendContract, roundtrip


class TestBuiltInBackends(BackendContract):
    """The suite for every built-in backend (conftest.py's ``backend`` fixture)."""


def test_adios2_checkpoint_larger_than_half_the_cache_spans_adios2_steps(run_dir):
    """The cache is handed back by ending ADIOS2 steps (no copy into ADIOS2's buffers);
    a raw tensor cut across them is listed in __blocks__ and reads back whole. (An
    encoded tensor's pieces are compressed as they come, and its blob put whole.)"""
    from datastates_hist.backends.adios2_bp5 import Adios2StepReader

    big = torch.randn(300, 257)
    back = roundtrip(run_dir, "adios2", {"big": big}, host_cache_bytes=64 << 10, piece_bytes=16 << 10,
                     codec="raw")
    assert torch.equal(back["big"], big)
    (unit,) = [n for n in os.listdir(steps_dir(run_dir)) if n.endswith(".bp")]
    reader = Adios2StepReader(os.path.join(steps_dir(run_dir), unit))
    try:
        assert len({step for step, _, _ in reader.split["extra/data/big"]}) > 1
    finally:
        reader.close()


class TestABackendFromOutside(BackendContract):
    """A backend defined outside the package (here: HDF5 files under another name and
    suffix) registers itself and runs the importable suite."""

    @pytest.fixture
    def backend(self):
        from datastates_hist.backends.hdf5 import HDF5Backend

        class ElsewhereBackend(HDF5Backend):
            name = "hdf5-elsewhere"
            suffix = ".hdf"

        register_backend(ElsewhereBackend.name, ElsewhereBackend())
        yield ElsewhereBackend.name
        unregister_backend(ElsewhereBackend.name)

    def test_its_units_carry_its_suffix(self, run_dir, backend):
        roundtrip(run_dir, backend, {"t": torch.arange(4)})
        assert os.listdir(steps_dir(run_dir)) == ["000000000000.hdf"]

    def test_a_restore_point_of_two_units_carries_its_suffix_on_both(self, run_dir, backend):
        roundtrip(run_dir, backend, {"t": torch.arange(4)}, keep=dh.KeepLast(1), trajectory=dh.Trajectory("model/*"))
        assert sorted(os.listdir(steps_dir(run_dir))) == ["000000000000.hdf", "000000000000.restore.hdf"]
