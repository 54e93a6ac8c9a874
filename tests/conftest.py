import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

BACKENDS = ["adios2", "hdf5"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every test taking ``backend`` is part of the shared backend contract suite."""
    return request.param


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")
