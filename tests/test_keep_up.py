"""A flush that has fallen behind training stores tensors raw until it catches up
(``keep_up=True``: from half the host cache; by default: from 90%, when training is about
to wait), and every step still reads back bit-exact; with ``keep_up=False`` it encodes
every tensor however far behind.

The flush is held back by a backend that makes the first step's writer wait until the
test lets it go: a storage device that stalls, on the flusher thread, as a slow one does.
"""

import sqlite3
import threading
import time

import pytest
import torch

import datastates_hist as dh
from datastates_hist.backends import get_backend, register_backend, unregister_backend
from datastates_hist.flush import BEHIND_FRACTION


def encodings(run):
    conn = sqlite3.connect(f"{run}/index.sqlite")
    try:
        rows = conn.execute("SELECT step, name, encoding FROM tensors ORDER BY step, name").fetchall()
    finally:
        conn.close()
    by_step = {}
    for step, name, encoding in rows:
        by_step.setdefault(step, {})[name] = encoding
    return by_step


def _stalling(backend: str, gates: dict[int, threading.Event]):
    """Register a backend whose writer of step ``s`` waits for ``gates[s]``: its name."""
    inner = get_backend(backend)

    class Stalled(type(inner)):
        def begin_step(self, steps_dir, step, group=None, part=""):
            if step in gates:
                assert gates[step].wait(60), "the test never let the flush go"
            return inner.begin_step(steps_dir, step, group, part)

    register_backend(f"stalled-{backend}", Stalled())
    return f"stalled-{backend}"


@pytest.fixture
def stalled(backend):
    """(name of a backend whose step-0 writer waits for ``go``, go)."""
    go = threading.Event()
    yield _stalling(backend, {0: go}), go
    unregister_backend(f"stalled-{backend}")


@pytest.fixture
def stalled_twice(backend):
    """(name of a backend whose writers of steps 0 and 1 wait for their gate, the gates)."""
    gates = {0: threading.Event(), 1: threading.Event()}
    yield _stalling(backend, gates), gates
    unregister_backend(f"stalled-{backend}")


def write_three_steps_while_the_flush_stalls(run_dir, backend, go, cache_bytes=5 << 20, **options):
    """Steps 0, 1, 2 of a model with Adam (1.5 MiB each) into a cache of ``cache_bytes``
    (5 MiB: 90% full) while the flush of step 0 stalls, then step 3 after the flush caught
    up; each step's values kept."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 512)
    opt = torch.optim.Adam(model.parameters())
    written = {}
    ckpt = dh.Checkpointer(run_dir, backend=backend, host_cache_bytes=cache_bytes, **options)
    for step in range(4):
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ckpt.write(step, model, opt)
        written[step] = {"model/weight": model.weight.detach().clone(),
                         "optim/state/weight/exp_avg_sq": opt.state[model.weight]["exp_avg_sq"].clone()}
        if step == 2:  # three snapshots in the cache: the flush is behind
            ckpt.wait_snapshot()
            go.set()
            ckpt.wait()  # caught up
    ckpt.close()
    return ckpt, written


def test_a_flush_behind_training_stores_tensors_raw_until_it_catches_up(tmp_path, backend, stalled):
    run_dir = str(tmp_path / "run")
    ckpt, written = write_three_steps_while_the_flush_stalls(run_dir, *stalled, keep_up=True)
    stored = encodings(run_dir)
    assert set(stored[0].values()) == {"raw"}  # the cache was over half full throughout
    assert set(stored[3].values()) <= {"key", "delta"}  # caught up: encoded again
    assert "raw" not in stored[3].values()
    raw = sum(list(s.values()).count("raw") for s in stored.values())
    assert ckpt.raw_to_keep_up == raw >= len(stored[0])
    with dh.open(run_dir) as h:
        for step, values in written.items():
            for name, value in values.items():
                assert torch.equal(h.read(name, step), value), (step, name)
    with dh.Checkpointer(run_dir) as again:  # the newest step restores bit-exact
        fresh = torch.nn.Linear(256, 512)
        assert again.restore(model=fresh).step == 3
        assert torch.equal(fresh.weight, written[3]["model/weight"])


@pytest.mark.parametrize("cache_bytes, options", [(6 << 20, {}), (19 << 18, {"keep_up": False})],
                         ids=["default, 75% full", "keep_up=False, 95% full"])
def test_every_tensor_is_encoded_by_default_until_the_cache_is_nearly_full_and_always_without_keep_up(
        tmp_path, backend, stalled, cache_bytes, options):
    run_dir = str(tmp_path / "run")
    ckpt, written = write_three_steps_while_the_flush_stalls(run_dir, *stalled, cache_bytes, **options)
    stored = encodings(run_dir)
    assert ckpt.raw_to_keep_up == 0
    assert all(set(s.values()) <= {"key", "delta"} for s in stored.values()), stored
    with dh.open(run_dir) as h:
        assert all(torch.equal(h.read(name, step), value)
                   for step, values in written.items() for name, value in values.items())


def test_by_default_a_flush_behind_with_the_cache_nearly_full_stores_raw(tmp_path, backend, stalled):
    run_dir = str(tmp_path / "run")
    # 4.5 MiB of snapshots in 4.75 MiB: the first tensors flushed find the cache 95% full
    ckpt, written = write_three_steps_while_the_flush_stalls(run_dir, *stalled, 19 << 18)
    stored = encodings(run_dir)
    raw = sum(list(s.values()).count("raw") for s in stored.values())
    assert "raw" in stored[0].values() and ckpt.raw_to_keep_up == raw
    assert set(stored[3].values()) <= {"key", "delta"}  # caught up: encoded again
    with dh.open(run_dir) as h:
        for step, values in written.items():
            for name, value in values.items():
                assert torch.equal(h.read(name, step), value), (step, name)


@pytest.mark.parametrize("keep_up", [None, True])
def test_a_step_that_fills_the_cache_alone_is_encoded(tmp_path, backend, keep_up):
    """A flush that keeps up is not behind, however much of the cache one step fills: each
    step (1.5 MiB) is 94% of the cache, and the loop waits for its commit."""
    run_dir = str(tmp_path / "run")
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 512)
    opt = torch.optim.Adam(model.parameters())
    with dh.Checkpointer(run_dir, backend=backend, host_cache_bytes=1600 << 10, keep_up=keep_up) as ckpt:
        for step in range(4):
            model(torch.randn(8, 256)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.write(step, model, opt)
            ckpt.wait()
        assert ckpt.raw_to_keep_up == 0
    assert all(set(s.values()) <= {"key", "delta"} for s in encodings(run_dir).values())


def test_keep_up_must_be_none_or_a_bool(tmp_path):
    with pytest.raises(TypeError, match=r"^keep_up must be None, True or False, got 'no'$"):
        dh.Checkpointer(str(tmp_path / "run"), keep_up="no")


@pytest.mark.parametrize("keep_up, nice", [(True, 19), (None, 0), (False, 0)])
def test_with_keep_up_the_flush_thread_runs_at_nice_19(tmp_path, keep_up, nice):
    import os

    base = os.getpriority(os.PRIO_PROCESS, 0)
    with dh.Checkpointer(str(tmp_path / "run"), keep_up=keep_up) as ckpt:
        ckpt.write(0, torch.nn.Linear(2, 2))
        ckpt.wait()
        flush = ckpt._pipeline._flusher.thread  # this Checkpointer's (others may linger in the process)
        assert flush.name == "dh-flush" and flush.is_alive()
        assert os.getpriority(os.PRIO_PROCESS, flush.native_id) == (nice if keep_up else base)


@pytest.mark.parametrize("keep_up", [None, True, False])
def test_a_step_larger_than_the_cache_is_stored_raw_once_training_waits_for_its_snapshot(
        tmp_path, backend, stalled_twice, keep_up):
    """Step 0 (6 MiB: a weight and Adam's moments) in a cache of 2 MiB: its snapshot waits
    for the flush, which stalls until the training thread waits for that snapshot at the
    optimizer step. The cache is full then, and holds no later step: by default (and with
    ``keep_up=True``) the flush stores raw what it starts while training waits; with
    ``keep_up=False`` it encodes. The flush held training back (the snapshot waited for
    space, training for the snapshot), so the next steps are stored raw whole, from their
    first tensor, while their snapshots wait for space too (step 1) and until one fits the
    cache (step 2, the model alone); step 3, after it, is encoded. (The flush of step 1
    stalls until its snapshot has waited for space: else the raw flush may keep up.)"""
    name, gates = stalled_twice
    go = gates[0]
    run_dir = str(tmp_path / "run")
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 509)  # the weight, bias and torch RNG state fill all but 5 KiB of the cache
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 1024)).square().mean().backward()
    opt.step()
    ckpt = dh.Checkpointer(run_dir, backend=name, host_cache_bytes=2 << 20, keep_up=keep_up)
    ckpt.write(0, model, opt)
    written = {0: {"model/weight": model.weight.detach().clone(),
                   "optim/state/weight/exp_avg": opt.state[model.weight]["exp_avg"].clone()}}
    waits, cache = ckpt._pipeline.training_waits, ckpt._pipeline._flusher.cache
    full = BEHIND_FRACTION[None] * cache.capacity

    def release():  # once training waits and the snapshot has filled the cache (it may lag behind)
        deadline = time.monotonic() + 60
        while not (waits.is_set() and cache.held_bytes() > full) and time.monotonic() < deadline:
            time.sleep(0.001)
        go.set()

    releaser = threading.Thread(target=release)
    releaser.start()
    model(torch.randn(8, 1024)).square().mean().backward()
    opt.step()  # its pre-hook waits for step 0's snapshot: the flush goes on only then
    releaser.join()
    assert go.is_set() and not waits.is_set()
    opt.zero_grad()
    ckpt.wait()
    for step, optimizer in ((1, opt), (2, None), (3, opt)):
        waited = cache.waits
        ckpt.write(step, model, optimizer)
        if step == 1:
            deadline = time.monotonic() + 60
            while cache.waits == waited and time.monotonic() < deadline:
                time.sleep(0.001)
            gates[1].set()
        written[step] = {"model/weight": model.weight.detach().clone()}
        if optimizer is not None:
            written[step]["optim/state/weight/exp_avg"] = opt.state[model.weight]["exp_avg"].clone()
        ckpt.wait()
    ckpt.close()
    stored = encodings(run_dir)
    raw = sum(list(s.values()).count("raw") for s in stored.values())
    assert ckpt.raw_to_keep_up == raw
    if keep_up is False:
        assert raw == 0, stored
    else:  # the first tensor flushed: the cache full, training waiting
        assert stored[0]["model/weight"] == "raw", stored
        assert set(stored[1].values()) == {"raw"} and stored[1].keys() == stored[0].keys(), stored
        assert stored[2] == {"model/bias": "raw", "model/weight": "raw", "rng/torch": "raw"}, stored
    assert "raw" not in stored[3].values(), stored
    with dh.open(run_dir) as h:
        for step, values in written.items():
            for tensor, value in values.items():
                assert torch.equal(h.read(tensor, step), value), (step, tensor)


@pytest.mark.parametrize("keep_up", [True, None])
def test_with_keep_up_a_write_that_waits_for_a_commit_has_the_flush_store_raw(tmp_path, backend, stalled, keep_up):
    """``write()`` waits for the oldest commit beyond ``max_steps_in_flight``: with
    ``keep_up=True`` the flush then gives way (raw), however empty the cache; by default it
    encodes, as it does until the cache is nearly full."""
    name, go = stalled
    run_dir = str(tmp_path / "run")
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 512)
    opt = torch.optim.Adam(model.parameters())
    ckpt = dh.Checkpointer(run_dir, backend=name, host_cache_bytes=64 << 20, max_steps_in_flight=1,
                           keep_up=keep_up)
    written = []
    for step in range(2):
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()
        if step == 1:  # the flush of step 0 stalls until write(1) waits for its commit
            threading.Thread(target=lambda: ckpt._pipeline.commit_waits.wait(60) and go.set()).start()
        ckpt.write(step, model, opt)
        written.append(model.weight.detach().clone())
    ckpt.close()
    stored = encodings(run_dir)
    if keep_up:
        assert set(stored[0].values()) == {"raw"} and ckpt.raw_to_keep_up == len(stored[0])
    else:
        assert "raw" not in stored[0].values() and ckpt.raw_to_keep_up == 0
    with dh.open(run_dir) as h:
        assert all(torch.equal(h.read("model/weight", step), w) for step, w in enumerate(written))
