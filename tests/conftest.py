import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

BACKENDS = ["adios2", "hdf5"]

# MPICH over UCX (Debian's ch4:ucx, UCX 1.13) rewrites glibc's mmap, munmap, brk, sbrk,
# madvise, mremap, shmat and shmdt in place at MPI_Init ("bistro" hooks), so that every
# call of them from any thread runs UCX's event handlers. The MPI jobs run six or more
# threads that allocate (gloo's workers, the snapshot and flush threads, ADIOS2's writer);
# a job crashed twice in malloc on a gloo worker thread, and that mechanism is the known
# cause of such crashes in threaded MPICH programs (openucx/ucx#3831). The jobs exchange
# data within one machine, where UCX needs no memory events: they run without the hooks.
os.environ.setdefault("UCX_MEM_EVENTS", "no")


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
