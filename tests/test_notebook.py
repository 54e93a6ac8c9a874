"""``examples/explore_history.ipynb`` runs top to bottom in a real Jupyter kernel."""

import os
import subprocess
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("xarray")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "examples", "explore_history.ipynb")


def kernel_name() -> str:
    """``python3``: the installed spec, or ipykernel's own spec for this interpreter."""
    from jupyter_client.kernelspec import KernelSpecManager

    if "python3" not in KernelSpecManager().find_kernel_specs():
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--user", "--name", "python3"],
                       check=True, capture_output=True)
    return "python3"


def test_explore_history_notebook_executes(tmp_path, monkeypatch):
    run = str(tmp_path / "gpt")
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--size", "tiny",
                    "--steps", "12", "--block-size", "32", "--batch-size", "4",
                    "--corpus-bytes", "1048576", "--run-dir", run],
                   check=True, capture_output=True, timeout=300)
    # the kernel inherits this environment: where the run is, and the package from this checkout
    monkeypatch.setenv("DH_RUN", run)
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=kernel_name(), timeout=180,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, if any cell raises

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # norm trajectories, change heatmap, weight distributions
    text = "\n".join(o.get("text", "") + o.get("data", {}).get("text/plain", "")
                     + o.get("data", {}).get("text/html", "") for o in outputs)
    assert f"{run}: 12 committed steps, 0..11" in text
    assert "rel_l2" in text and "blocks.0.qkv.weight" in text  # the diff table
