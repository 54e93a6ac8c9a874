"""write() lets at most ``max_steps_in_flight`` written steps wait for their commit: a small
state written every step commits faster than training runs only so far, and what a crash
or close() has left to do stays bounded."""
import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.checkpointer import DEFAULT_STEPS_IN_FLIGHT


def committed(run):
    with dh.open(run) as h:
        return h.steps


@pytest.mark.parametrize("bound", [1, 3])
def test_write_waits_for_the_oldest_commit_beyond_the_bound(backend, run_dir, bound):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    with dh.Checkpointer(run_dir, backend=backend, max_steps_in_flight=bound) as ckpt:
        for step in range(12):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            ckpt.write(step, model, opt)
            # the step just written and at most bound - 1 before it are in flight
            done = committed(run_dir)
            assert done == list(range(len(done))) and len(done) >= step - bound + 1, (step, done)
    assert committed(run_dir) == list(range(12))


def test_the_default_bound_and_bad_values(run_dir):
    with dh.Checkpointer(run_dir) as ckpt:
        assert ckpt.max_steps_in_flight == DEFAULT_STEPS_IN_FLIGHT == 8
    with dh.Checkpointer(run_dir, max_steps_in_flight=np.int64(2)) as ckpt:
        assert ckpt.max_steps_in_flight == 2 and type(ckpt.max_steps_in_flight) is int
    for value in (0, -1, 2.0, True, "4", None):
        with pytest.raises(ValueError) as err:
            dh.Checkpointer(run_dir, max_steps_in_flight=value)
        assert str(err.value) == f"max_steps_in_flight needs a whole number >= 1, got {value!r}"
    with dh.Checkpointer(run_dir) as ckpt:  # a refused value left the run free
        ckpt.write(0, torch.nn.Linear(2, 2))
