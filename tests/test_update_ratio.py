"""``update_ratio`` over the steps: ``h.trace(names, "update_ratio")`` and
``datastates-hist trace RUN NAME --stat update_ratio``, checked against the weights
of a real training run (AdamW, the default delta codec) saved while it trained."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import datastates_hist as dh

NAME = "model/0.weight"
KEY_EVERY = 4  # 8 steps: keys at steps 0 and 4, deltas against the step before elsewhere
UNKNOWN_STAT = "unknown statistic 'ratio'; one of norm, min, max, mean, std, nonfinite, update_ratio"


def cli(*args):
    return subprocess.run([sys.executable, "-m", "datastates_hist.cli", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 8 AdamW steps of a small model and the first layer's weight after each step."""
    run_dir = str(tmp_path_factory.mktemp("ratio") / "run")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    weights = []
    with dh.Checkpointer(run_dir, key_every=KEY_EVERY) as ckpt:
        for step in range(8):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            weights.append(model[0].weight.detach().clone().double())
            ckpt.write(step, model, opt)
    return run_dir, weights


def expected_ratios(weights) -> list[float]:
    """||w_t - w_{t-1}|| / ||w_{t-1}|| at every step but the first (NaN there)."""
    return [math.nan] + [float(torch.linalg.norm(b - a) / torch.linalg.norm(a))
                         for a, b in zip(weights[:-1], weights[1:])]


def key_steps(h) -> list[int]:
    encodings = {s: h.tensors(s).set_index("name").loc[NAME, "encoding"] for s in h.steps}
    assert set(encodings.values()) == {"key", "delta"}
    return [s for s, e in encodings.items() if e == "key"]


def test_trace_update_ratio_equals_the_relative_update_of_the_weights(trained):
    run_dir, weights = trained
    want = expected_ratios(weights)
    with dh.open(run_dir) as h:
        keys = key_steps(h)
        df = h.trace(["0.weight"], "update_ratio")
    assert keys == [0, KEY_EVERY]
    assert list(df.index) == list(range(8)) and list(df.columns) == [NAME]
    got = df[NAME]
    assert [s for s in df.index if math.isnan(got[s])] == keys  # a key step has no base: no ratio
    for step in df.index:
        if step not in keys:
            assert got[step] == pytest.approx(want[step], rel=1e-5), step
    assert 1e-4 < got[1] < 1  # AdamW at lr 1e-2 moves a small layer by about a percent a step


def test_trace_update_ratio_of_a_glob_and_an_unknown_statistic(trained):
    run_dir, _ = trained
    with dh.open(run_dir) as h:
        ratios = h.trace(["0.*"], "update_ratio")
        assert list(ratios.columns) == ["model/0.bias", NAME]
        for name in ratios.columns:  # the index's update_ratio column, as h.stats reads it
            np.testing.assert_array_equal(ratios[name].to_numpy(), h.stats(name)["update_ratio"].to_numpy())
        with pytest.raises(ValueError) as err:
            h.trace(["0.weight"], "ratio")
    assert str(err.value) == UNKNOWN_STAT


def test_cli_trace_update_ratio_json_table_and_unknown_stat(trained):
    run_dir, weights = trained
    want = expected_ratios(weights)
    out = cli("trace", run_dir, "0.weight", "--stat", "update_ratio", "--json")
    assert out.returncode == 0 and out.stderr == ""
    data = json.loads(out.stdout)
    assert (data["stat"], data["name"], data["steps"]) == ("update_ratio", NAME, list(range(8)))
    for step, value in enumerate(data["values"]):
        if step in (0, KEY_EVERY):
            assert value is None
        else:
            assert value == pytest.approx(want[step], rel=1e-5), step
    with dh.open(run_dir) as h:  # the very numbers h.trace gives
        assert data["values"] == [None if math.isnan(v) else v for v in h.trace("0.weight", "update_ratio")[NAME]]

    out = cli("trace", run_dir, "0.weight", "--stat", "update_ratio")
    assert out.returncode == 0 and out.stderr == ""
    lines = out.stdout.strip().splitlines()
    rows = [line.split() for line in lines[:9]]
    assert rows[0] == ["step", "0.weight", "update_ratio"]
    assert [r for r in rows[1:] if len(r) == 1] == [["0"], [str(KEY_EVERY)]]  # blank at the key steps
    spark = lines[-1].removeprefix("0.weight update_ratio: ")
    assert len(spark) == 8 and spark[0] == spark[KEY_EVERY] == " " and " " not in spark[1:KEY_EVERY]

    out = cli("trace", run_dir, "0.weight", "--stat", "ratio")
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == (
        "datastates-hist trace: error: argument --stat: invalid choice: 'ratio' (choose from 'norm', "
        "'min', 'max', 'mean', 'std', 'nonfinite', 'update_ratio')")


def test_cli_trace_plots_update_ratios(trained, tmp_path):
    image = pytest.importorskip("matplotlib.image")
    run_dir, _ = trained
    png = tmp_path / "ratio.png"
    out = cli("trace", run_dir, "0.weight", "2.weight", "--stat", "update_ratio", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    pixels = image.imread(str(png))
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.shape[2] in (3, 4)
    assert pixels[..., :3].std() > 0.05  # lines, labels and a legend on the white background


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_signalling_nan_is_stored_without_a_warning_and_has_no_update_ratio(tmp_path):
    """Casting a float32 signalling NaN to float64 raises numpy's "invalid" flag: the
    update ratio's check of non-finite values warned from the flush thread, and a
    warning turned into an error failed the step."""
    run = str(tmp_path / "run")
    model = torch.nn.Linear(1, 1)
    model.register_buffer("b", torch.tensor([0x7F800001, 0x3F800000], dtype=torch.int32).view(torch.float32))
    with dh.Checkpointer(run) as ckpt:  # codec="delta": an update ratio from step 1 on
        for step in range(3):
            ckpt.write(step, model)
            ckpt.wait_snapshot()
    with dh.open(run) as h:
        assert torch.equal(h.read("model/b", 2).view(torch.int32), model.b.view(torch.int32))
        assert math.isnan(h.tensors(2).set_index("name").loc["model/b", "update_ratio"])
