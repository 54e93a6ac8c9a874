"""``examples/explore_history.ipynb`` runs top to bottom in a real Jupyter kernel, as the
README starts it: ``DH_RUN=runs/gpt jupyter lab examples/explore_history.ipynb`` from the
directory holding the run, so the kernel's working directory is ``examples/`` while
``DH_RUN`` is relative to the directory jupyter was started in (its ``PWD``)."""

import base64
import json
import math
import os
import re
import sqlite3
import statistics
import subprocess
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("xarray")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
NOTEBOOK = os.path.join(EXAMPLES, "explore_history.ipynb")


def kernel_name() -> str:
    """``python3``: the installed spec, or ipykernel's own spec for this interpreter."""
    from jupyter_client.kernelspec import KernelSpecManager

    if "python3" not in KernelSpecManager().find_kernel_specs():
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--user", "--name", "python3"],
                       check=True, capture_output=True)
    return "python3"


@pytest.fixture(scope="module")
def started_in(tmp_path_factory):
    """A directory holding ``runs/gpt`` (12 steps of the example GPT), where jupyter is started."""
    root = tmp_path_factory.mktemp("root")
    subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_gpt.py"), "--size", "tiny",
                    "--steps", "12", "--block-size", "32", "--batch-size", "4",
                    "--corpus-bytes", "1048576", "--run-dir", str(root / "runs" / "gpt")],
                   check=True, capture_output=True, timeout=300)
    return root


def execute(monkeypatch, started: str, dh_run: str, cells: slice = slice(None)):
    """Run ``cells`` of the notebook in a kernel started in ``examples/``, jupyter started in ``started``;
    the executed code cells."""
    # the kernel inherits this environment: the run, where jupyter started, the package from this checkout
    monkeypatch.setenv("DH_RUN", dh_run)
    monkeypatch.setenv("PWD", started)
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells = nb.cells[cells]
    client = nbclient.NotebookClient(nb, kernel_name=kernel_name(), timeout=180,
                                     resources={"metadata": {"path": EXAMPLES}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, if any cell raises
    return [c for c in nb.cells if c.cell_type == "code"]


def outputs_of(cells) -> list:
    return [o for c in cells for o in c.outputs]


def text_of(outputs) -> str:
    return "\n".join(o.get("text", "") + o.get("data", {}).get("text/plain", "")
                     + o.get("data", {}).get("text/html", "") for o in outputs)


def median_recent_ratios(run_dir: str) -> dict[str, float]:
    """From the index itself: per weight matrix (2-D tensor under ``model/``), the median
    of its last 10 update ratios; and the run must store those matrices as deltas."""
    with sqlite3.connect(os.path.join(run_dir, "index.sqlite")) as db:
        last, = db.execute("SELECT max(step) FROM steps").fetchone()
        layers = [name for name, shape in db.execute(
            "SELECT name, shape FROM tensors WHERE step=? AND name LIKE 'model/%' ORDER BY name", (last,))
            if len(json.loads(shape)) == 2]
        medians = {}
        for name in layers:
            rows = db.execute("SELECT step, encoding, update_ratio FROM tensors WHERE name=? ORDER BY step",
                              (name,)).fetchall()
            # 12 steps and a key every 16: a key at step 0, deltas against the step before after it
            assert [(s, e, r is None) for s, e, r in rows] == [(0, "key", True)] + [
                (s, "delta", False) for s in range(1, 12)], name
            medians[name.removeprefix("model/")] = statistics.median([r for _, _, r in rows[-10:]])
    return medians


def test_notebook_executes_as_the_readme_says(started_in, monkeypatch):
    cells = execute(monkeypatch, str(started_in), "runs/gpt")
    outputs = outputs_of(cells)
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    # loss beside a layer's norm, norm trajectories, change heatmap, update ratios, distributions
    assert len(images) >= 5
    if os.environ.get("DH_NOTEBOOK_FIGURES"):  # to look at the figures: a folder to write them to
        for i, image in enumerate(images):
            with open(os.path.join(os.environ["DH_NOTEBOOK_FIGURES"], f"figure{i}.png"), "wb") as f:
                f.write(base64.b64decode(image["data"]["image/png"]))
    text = text_of(outputs)
    assert f"{started_in / 'runs' / 'gpt'}: 12 committed steps, 0..11" in text
    assert "extra/data/loss" in text and "optim/param_groups/0/lr" in text  # the loss and lr table
    assert "rel_l2" in text and "blocks.0.qkv.weight" in text  # the diff table

    ratios, = [c for c in cells if c.get("id") == "update-ratio-per-layer"]
    assert [o.output_type for o in ratios.outputs] == ["display_data", "stream"]  # the figure, the table
    assert ratios.outputs[0].data["image/png"]
    header, columns, *rows = ratios.outputs[1].text.splitlines()
    assert (header, columns.split()) == ("median update ratio of the last 10 steps that have one", ["median", "ratio"])
    printed = {name: float(value) for name, value in (row.split() for row in rows)}
    want = median_recent_ratios(str(started_in / "runs" / "gpt"))
    assert len(want) == 3 * 4 + 3  # the tiny GPT's 3 blocks of 4 matrices; tok_emb, pos_emb, head
    assert printed == {name: pytest.approx(value, rel=1e-4) for name, value in want.items()}

    distributions, = [c for c in cells if c.get("id") == "distribution-over-steps"]
    assert [o.output_type for o in distributions.outputs] == ["display_data", "stream", "execute_result"]
    line = distributions.outputs[1].text.strip()
    with sqlite3.connect(os.path.join(started_in / "runs" / "gpt", "index.sqlite")) as db:
        bins = {e + i for d, in db.execute("SELECT distribution FROM tensors WHERE name='model/blocks.0.qkv.weight'")
                for e in [json.loads(d)["exp0"]] for i, n in enumerate(json.loads(d)["positive"]) if n}
        shape, = db.execute("SELECT shape FROM tensors WHERE name='model/blocks.0.qkv.weight' AND step=11").fetchone()
    found = re.fullmatch(r"blocks\.0\.qkv\.weight: 12 steps, (\d+) bins, (\d+) values at step 11", line)
    assert found, line
    assert int(found[2]) == math.prod(json.loads(shape))  # every value of the qkv matrix, in some bin
    assert int(found[1]) >= len(bins)  # at least the positive bins any step uses


def test_notebook_opens_the_run_from_examples_too(started_in, monkeypatch):
    # cd examples && DH_RUN=<relative path to the run> jupyter lab explore_history.ipynb
    relative = os.path.relpath(started_in / "runs" / "gpt", EXAMPLES)
    cells = execute(monkeypatch, EXAMPLES, relative, cells=slice(0, 2))  # the introduction and the opening
    assert f"{os.path.join(EXAMPLES, relative)}: 12 committed steps, 0..11" in text_of(outputs_of(cells))
