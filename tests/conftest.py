import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

BACKENDS = ["adios2", "hdf5"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every test taking ``backend`` runs for every built-in backend; so does the contract
    suite (:mod:`datastates_hist.testing.backend_contract`) in test_backend_contract.py."""
    return request.param


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")


@pytest.fixture(scope="module")
def module_runs(tmp_path_factory, request):
    """Runs built once per test module and backend by the module's ``build_run(run_dir, backend)``;
    the tests only read them."""
    runs = {}

    def get(backend):
        if backend not in runs:
            name = request.module.__name__.rsplit(".", 1)[-1]
            runs[backend] = str(tmp_path_factory.mktemp(f"{name}-{backend}") / "run")
            request.module.build_run(runs[backend], backend)
        return runs[backend]
    return get
