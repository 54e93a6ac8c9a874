"""A process killed with SIGKILL while checkpointing leaves a restorable store."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import datastates_hist as dh
from datastates_hist.store import Store

CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[3])
import datastates_hist as dh
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
opt = torch.optim.Adam(model.parameters())
ckpt = dh.Checkpointer(sys.argv[1], backend=sys.argv[2], host_cache_bytes=1 << 20, piece_bytes=64 << 10)
start = (ckpt.steps() or [-1])[-1] + 1
if start:
    ckpt.restore(model=model, optimizer=opt)
for step in range(start, start + 100000):
    model(torch.randn(8, 256)).sum().backward()
    opt.step(); opt.zero_grad()
    ckpt.write(step, model, opt, data={"step": step})
    if step == start + 2:
        print("running", flush=True)
"""


def verify_all(run_dir, step):
    store = Store(run_dir)
    with store.open_step(step) as data:
        for name in data.records:
            data.read(name)  # raises on any checksum mismatch
    store.close()


@pytest.mark.parametrize("kills", [3])
def test_sigkill_while_writing_leaves_newest_committed_step_restorable(tmp_path, backend, kills):
    run_dir = str(tmp_path / "run")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    last = -1
    for k in range(kills):
        child = subprocess.Popen([sys.executable, "-c", CHILD, run_dir, backend, root],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "running", child.stderr.read()
        time.sleep(0.05 + 0.1 * k)  # land at different moments of snapshot, flush and commit
        child.send_signal(signal.SIGKILL)
        child.wait()
        with dh.Checkpointer(run_dir) as ckpt:  # a new writer cleans what was not committed
            steps = ckpt.steps()
            assert steps == list(range(len(steps))) and steps[-1] > last
            last = steps[-1]
            model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
            opt = torch.optim.Adam(model.parameters())
            r = ckpt.restore(model=model, optimizer=opt)
            assert r.step == last and r.extra["data"] == {"step": last}
            assert len(os.listdir(os.path.join(run_dir, "steps"))) == len(steps)
        verify_all(run_dir, last)
