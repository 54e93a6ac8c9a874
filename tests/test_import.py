"""``import datastates_hist`` stays light: storage libraries load only when used."""

import subprocess
import sys


def test_import_does_not_load_storage_libraries():
    code = ("import sys, datastates_hist; "
            "print(sorted(m for m in ('adios2', 'h5py', 'xarray', 'mpi4py', 'transformers', 'lightning', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_surface():
    import datastates_hist as dh

    assert {"Checkpointer", "StateProvider", "register_provider", "CheckpointError"} <= set(dh.__all__)
    assert all(hasattr(dh, name) for name in dh.__all__)
