"""Predicted deltas (datastates_hist.predictors): Adam's moments from the weights' update
and from each other.

The contract suite (test_backend_contract.py) runs the round trip on every backend; here:
the C kernel against the numpy reference, bit for bit; what the writer predicts and what
it leaves alone; and crafted records, refused by name."""

import json

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist import codecs, predictors
from datastates_hist.digest import _fused
from datastates_hist.errors import CorruptionError
from datastates_hist.items import TensorRecord
from datastates_hist.store import Store

from test_paths_and_sizes import rewrite_manifest

SPECIAL = np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1e-40, -1e-42, 1.4e-45, 3.4e38, -3e38,
                    1.2e-38, 1e-30, 1e-20, 1.0, 1e20], np.float32)


def moments(n, seed):
    """m, m1, v1 as float32 bytes: Adam-like values, special values and random bit patterns."""
    rng = np.random.default_rng(seed)
    m1 = rng.standard_normal(n) * 1e-3
    m = 0.9 * m1 + 0.1 * rng.standard_normal(n) * 1e-3
    v1 = np.abs(rng.standard_normal(n)) * 1e-6
    out = []
    for a in (m, m1, v1):
        a = a.astype(np.float32)
        a[rng.integers(0, n, n // 20)] = rng.choice(SPECIAL, n // 20)
        a.view(np.uint32)[-(n // 20):] = rng.integers(0, 2**32, n // 20, dtype=np.uint64).astype(np.uint32)
        out.append(a.view(np.uint8))
    return out


@pytest.mark.skipif(_fused is None, reason="the C kernel is not built")
@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.9, 0.999), (0.0, 0.0), (0.5, 0.99999)])
def test_kernel_and_numpy_reference_predict_the_same_bits(betas):
    m, m1, v1 = moments(200_003, seed=int(sum(betas) * 1000))
    with np.errstate(all="ignore"):
        x = (v1.view(np.float32) * np.float32(1.01)).view(np.uint8)
    predictor = predictors.adam_second_moment("m", *betas)
    kernel, reference = np.empty_like(m), np.empty_like(m)
    sums = predictors.predict(predictor, [m, m1], v1, kernel, x=x)
    expected = predictors.predict(predictor, [m, m1], v1, reference, x=x, use_kernel=False)
    assert np.array_equal(kernel, reference)
    assert np.allclose(sums, expected, equal_nan=True)
    # where an input is unusual, the prediction is v1's bits
    bits = [a.view(np.uint32) for a in (m, m1, v1)]
    unusual = np.logical_or.reduce([predictors._unusual(b) for b in bits])
    assert np.array_equal(kernel.view(np.uint32)[unusual], bits[2][unusual])


FIRST = {"kind": "adam_first_moment", "weight": "w", "second": "v", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
         "bias2": 0.9, "step_size": 1e-3, "decay": 1e-4}


@pytest.mark.skipif(_fused is None, reason="the C kernel is not built")
@pytest.mark.parametrize("changes", [{}, {"beta1": 0.0, "beta2": 0.0, "eps": 0.0, "bias2": 1.0, "step_size": -5.0,
                                          "decay": 0.0}, {"eps": 1e-3, "step_size": 1e-7, "decay": -0.5}])
def test_first_moment_kernel_and_numpy_reference_predict_the_same_bits(changes):
    m, m1, v1 = moments(200_003, seed=7)
    rng = np.random.default_rng(8)
    w1 = (rng.standard_normal(m.size // 4) * 0.05).astype(np.float32)
    with np.errstate(all="ignore"):
        w = (w1 * np.float32(0.9999) - np.float32(1e-3) * m.view(np.float32)).view(np.uint8)
    w.view(np.float32)[rng.integers(0, w1.size, 2000)] = rng.choice(SPECIAL, 2000)
    w1 = w1.view(np.uint8)
    v1 = np.abs(v1.view(np.float32)).view(np.uint8)
    predictor = {**FIRST, **changes}
    kernel, reference = np.empty_like(m), np.empty_like(m)
    predictors.predict(predictor, [w, w1, v1], m1, kernel)
    predictors.predict(predictor, [w, w1, v1], m1, reference, use_kernel=False)
    assert np.array_equal(kernel, reference)


@pytest.mark.parametrize("path", ["kernel", "numpy"])
def test_the_first_moment_is_recovered_from_the_update(path, monkeypatch):
    """An AdamW step of torch's, predicted from the weights before and after it (the fit's
    sums by the C kernel and by numpy)."""
    if path == "numpy":
        monkeypatch.setattr(predictors, "_fused", None)
    elif _fused is None:
        pytest.skip("the C kernel is not built")
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4096))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(3):
        p.grad = torch.randn(4096)
        opt.step()
    w1, m1, v1 = (t.detach().clone().numpy().view(np.uint8) for t in (p, opt.state[p]["exp_avg"],
                                                                       opt.state[p]["exp_avg_sq"]))
    p.grad = torch.randn(4096)
    opt.step()
    w, m = (t.detach().numpy().view(np.uint8) for t in (p, opt.state[p]["exp_avg"]))
    template = predictors.adam_first_moment("w", "v", 0.9, 0.95, 1e-8, 4, fit_decay=True)
    fitted = predictors.fitted(template, w, w1, m, m1, v1)
    assert abs(fitted["step_size"] - 1e-3 / (1 - 0.9 ** 4)) < 1e-6 and abs(fitted["decay"] - 1e-4) < 1e-6
    out = np.empty_like(m)
    predictors.predict(fitted, [w, w1, v1], m1, out)
    exact, before = m.view(np.float32), m1.view(np.float32)
    error = np.median(np.abs(out.view(np.float32) - exact) / np.abs(exact))
    assert error < 1e-3 and error < 1e-2 * np.median(np.abs(before - exact) / np.abs(exact))
    assert predictors.fitted(template, w1, w1, m, m1, v1) is None  # no update: nothing fits


@pytest.mark.skipif(_fused is None, reason="the C kernel is not built")
@pytest.mark.parametrize("n", [1, 5, 8191, 8192, 8193, 100_003])
def test_the_fit_sums_of_the_kernel_and_of_numpy_agree(n):
    """Over every stride-th element, skipping those whose values are not finite."""
    rng = np.random.default_rng(n)
    w1, m1 = rng.standard_normal(n).astype(np.float32), (rng.standard_normal(n) * 1e-3).astype(np.float32)
    v1 = (np.abs(rng.standard_normal(n)) * 1e-6).astype(np.float32)
    m = (0.9 * m1 + 1e-4 * rng.standard_normal(n)).astype(np.float32)
    w = (w1 - 1e-3 * m / (np.sqrt(v1) + 1e-8)).astype(np.float32)
    w[::7], v1[3::11] = np.nan, np.inf
    arrays = [a.view(np.uint8) for a in (w, w1, m, m1, v1)]
    stride = max(1, n // predictors.FIT_ELEMENTS)
    count = min(predictors.FIT_ELEMENTS, -(-n // stride))
    got = _fused.fit_sums(*arrays, stride, count, 0.9, 0.95, 0.97, 1e-8)
    want = predictors._fit_sums(*arrays, n, stride, 0.9, 0.95, 0.97, 1e-8)
    assert got == pytest.approx(want, rel=1e-9, abs=0)
    with pytest.raises(ValueError, match="^fit_sums: the elements lie beyond the buffers$"):
        _fused.fit_sums(*arrays, stride, (n - 1) // stride + 2, 0.9, 0.95, 0.97, 1e-8)  # one past the end


def test_the_prediction_follows_adams_update():
    m1 = np.float32([1e-3, -2e-3]).view(np.uint8)
    v1 = np.float32([4e-6, 1e-6]).view(np.uint8)
    g = np.float64([3e-3, 1e-3])
    m = (0.9 * m1.view(np.float32) + 0.1 * g).astype(np.float32).view(np.uint8)
    out = np.empty_like(m)
    predictors.predict(predictors.adam_second_moment("m", 0.9, 0.95), [m, m1], v1, out)
    expected = 0.95 * v1.view(np.float32).astype(np.float64) + 0.05 * g * g
    assert np.allclose(out.view(np.float32), expected, rtol=1e-5)


def train(model, opt, steps, run_dir=None, **options):
    torch.manual_seed(1)
    ckpt = dh.Checkpointer(run_dir, **options) if run_dir else None
    for step in range(steps):
        opt.zero_grad()
        model(torch.randn(32, model[0].in_features)).pow(2).mean().backward()
        opt.step()
        if ckpt:
            ckpt.write(step, model, opt)
    if ckpt:
        ckpt.close()


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))


def step_records(run_dir, step):
    store = Store(run_dir)
    try:
        with store.open_step(step) as data:
            return dict(data.records)
    finally:
        store.close()


def test_adamw_moments_store_little_more_than_rounding(tmp_path):
    model = mlp()
    train(model, torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95)), 20, str(tmp_path / "run"))
    records = step_records(str(tmp_path / "run"), 19)
    second = records["optim/state/0.weight/exp_avg_sq"]
    first = records["optim/state/0.weight/exp_avg"]
    assert second.predictor["kind"] == "adam_second_moment" and first.predictor["kind"] == "adam_first_moment"
    # against their 2-step extrapolations they took 0.59 and 0.82 of their bytes (GPT small)
    assert second.stored < 0.25 * second.nbytes, second.stored / second.nbytes
    assert first.stored < 0.6 * first.nbytes, first.stored / first.nbytes
    # the second moment's residual grouped by exponent, the first moment's not (predictors.GROUPED)
    assert {flag & codecs.GROUPED for _, _, flag in second.chunks} == {codecs.GROUPED}
    assert {flag & codecs.GROUPED for _, _, flag in first.chunks} == {0}
    with dh.open(str(tmp_path / "run")) as h:  # against the base, not the prediction
        for name, rec in (("exp_avg", first), ("exp_avg_sq", second)):
            x, base = (h.read(f"optim/state/0.weight/{name}", s).to(torch.float64) for s in (19, 18))
            assert rec.update_ratio == pytest.approx(float((x - base).norm() / base.norm()), rel=1e-9)


def test_an_embedding_whose_first_rows_no_batch_holds_is_predicted(tmp_path):
    """Adam without decay leaves the rows of tokens never looked up where they were, with
    zero moments: no update to fit there. The fit samples the whole piece, so the rows
    that do change give it the step size (fitted on the first 32 Ki elements, this
    embedding's first moment was stored against its own extrapolation instead)."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(4096, 16)  # rows 0..3583 (57 Ki elements) never looked up
    opt = torch.optim.Adam(embedding.parameters())
    run_dir = str(tmp_path / "run")
    with dh.Checkpointer(run_dir) as ckpt:
        for step in range(4):
            opt.zero_grad()
            embedding(torch.randint(3584, 4096, (64,))).pow(2).mean().backward()
            opt.step()
            ckpt.write(step, embedding, opt)
    first = step_records(run_dir, 3)["optim/state/weight/exp_avg"]
    assert first.predictor is not None and first.predictor["kind"] == "adam_first_moment"
    assert first.predictor["decay"] == 0.0 and first.predictor["step_size"] != 0.0
    with dh.open(run_dir) as h:
        assert torch.equal(h.read("optim/state/weight/exp_avg", 3), opt.state[embedding.weight]["exp_avg"])


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                  lambda p: torch.optim.Adagrad(p)], ids=["SGD", "Adagrad"])
def test_other_optimizers_are_not_predicted(tmp_path, make):
    model = mlp()
    train(model, make(model.parameters()), 4, str(tmp_path / "run"))
    records = step_records(str(tmp_path / "run"), 3)
    assert all(r.predictor is None for r in records.values())
    assert any(r.encoding == "delta" for r in records.values())


def test_a_second_moment_is_predicted_only_beside_its_first_in_one_unit(tmp_path):
    """With a trajectory that holds exp_avg_sq but not exp_avg, a demotion would delete
    the first moment the prediction needs: the writer does not predict it."""
    model = mlp()
    train(model, torch.optim.AdamW(model.parameters()), 5, str(tmp_path / "run"),
          trajectory=dh.Trajectory("model/*", "optim/state/*/exp_avg_sq"), keep=dh.KeepLast(5))
    records = step_records(str(tmp_path / "run"), 4)
    assert records["optim/state/0.weight/exp_avg_sq"].encoding == "delta"
    assert all(r.predictor is None for r in records.values())


def predicted_record(**changes):
    doc = {"name": "o/v", "dtype": "float32", "shape": [4], "nbytes": 16, "checksum": "0" * 16,
           "encoding": "delta", "stored": 16, "base": 3, "chunks": [[16, 16, 1]],
           "predictor": {"kind": "adam_second_moment", "first": "o/m", "beta1": 0.9, "beta2": 0.95}}
    doc.update(changes)
    return doc


@pytest.mark.parametrize("changes, message", [
    ({"predictor": {"kind": "sgd", "first": "o/m", "beta1": 0.9, "beta2": 0.9}},
     "tensor 'o/v': the predictor {'kind': 'sgd'"),
    ({"predictor": {"kind": "adam_second_moment", "first": "o/m", "beta1": 1.0, "beta2": 0.9}},
     "tensor names ['first'] and float 'beta1', 'beta2' in [0, 1)"),
    ({"predictor": {"kind": "adam_second_moment", "first": "o/m", "beta1": True, "beta2": 0.9}},
     "tensor names ['first'] and float 'beta1', 'beta2' in [0, 1)"),
    ({"predictor": {"kind": "adam_second_moment", "first": "o/m", "beta1": 0.9}},
     "tensor names ['first'] and float 'beta1', 'beta2' in [0, 1)"),
    ({"encoding": "key", "base": None}, "is predicted from 'o/m' but is not an exact float32 delta"),
    ({"encoding": "raw", "stored": None, "base": None, "chunks": None}, "is predicted from 'o/m' but is not"),
    ({"base2": 2}, "is predicted from 'o/m' but is not an exact float32 delta against one base step"),
    ({"dtype": "float64", "nbytes": 32, "chunks": [[32, 16, 0]]}, "is predicted from 'o/m' but is not"),
    ({"predictor": {"kind": "adam_second_moment", "first": "o/v", "beta1": 0.9, "beta2": 0.9}},
     "is predicted from 'o/v' but is not"),
    ({"predictor": {**FIRST, "step_size": 0.0}}, "needs float 'eps' >= 0, 'bias2' in (0, 1], 'step_size' not 0"),
    ({"predictor": {**FIRST, "bias2": 1.5}}, "needs float 'eps' >= 0, 'bias2' in (0, 1], 'step_size' not 0"),
    ({"predictor": {**FIRST, "eps": float("nan")}}, "needs float 'eps' >= 0"),
    ({"predictor": {k: v for k, v in FIRST.items() if k != "decay"}}, "needs the keys ['beta1', 'beta2', 'bias2'"),
    ({"predictor": {**FIRST, "weight": "o/v"}}, "is predicted from 'o/v', 'v' but is not"),
])
def test_malformed_predictors_are_refused_by_name(changes, message):
    with pytest.raises(ValueError) as info:
        TensorRecord.from_json(predicted_record(**changes))
    assert message in str(info.value)


def written(tmp_path, backend="hdf5"):
    run_dir = str(tmp_path / "run")
    model = mlp()
    train(model, torch.optim.AdamW(model.parameters()), 3, run_dir, backend=backend)
    return run_dir


def entry(doc, name):
    return next(r for r in doc["tensors"] if r["name"] == name)


@pytest.mark.parametrize("edit, message", [
    (lambda doc: entry(doc, "optim/state/0.weight/exp_avg_sq")["predictor"].update(first="optim/state/nothing"),
     "tensor 'optim/state/0.weight/exp_avg_sq' is predicted from 'optim/state/nothing', which the step does not "
     "hold as a tensor of the same dtype, shape and unit"),
    (lambda doc: entry(doc, "optim/state/0.weight/exp_avg_sq")["predictor"].update(first="optim/state/0.bias/exp_avg"),
     "is predicted from 'optim/state/0.bias/exp_avg', which the step does not hold as a tensor of the same"),
    (lambda doc: entry(doc, "optim/state/0.weight/exp_avg")["predictor"].update(
        weight="optim/state/0.weight/exp_avg_sq"),
     "tensor 'optim/state/0.weight/exp_avg' is predicted from itself (through 'optim/state/0.weight/exp_avg', "
     "'optim/state/0.weight/exp_avg_sq')"),
])
def test_crafted_predicted_deltas_are_refused_by_name(tmp_path, edit, message):
    run_dir = written(tmp_path)
    rewrite_manifest(run_dir, 2, edit)
    with dh.open(run_dir) as h, pytest.raises(CorruptionError) as info:
        h.read("optim/state/0.weight/exp_avg_sq", 2)
    assert message in str(info.value)


def test_a_wrong_beta_is_damage_found_by_the_checksum(tmp_path):
    run_dir = written(tmp_path)
    rewrite_manifest(run_dir, 2, lambda doc: entry(doc, "optim/state/0.weight/exp_avg_sq")["predictor"].update(
        beta2=0.5))
    with dh.open(run_dir) as h, pytest.raises(CorruptionError) as info:
        h.read("optim/state/0.weight/exp_avg_sq", 2)
    assert "tensor 'optim/state/0.weight/exp_avg_sq' of step 2" in str(info.value)
    assert "does not match its checksum" in str(info.value)
    doc = json.dumps(step_records(run_dir, 1)["optim/state/0.weight/exp_avg_sq"].to_json())
    assert '"predictor"' in doc  # the step before is intact
