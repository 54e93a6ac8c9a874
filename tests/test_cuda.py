"""Training on a CUDA device: the lazy snapshot's device-to-host path.

Every test here runs on the CPU too, so that what it asserts is checked on every machine;
on a machine with a CUDA device each also runs there, where the snapshot copies into a
pinned host cache on a side stream ordered by events (``snapshot.py``, ``pipeline.py``).
The expected values are cloned on the device at write() time, on the training stream and
without a synchronisation, so the GPU runs ahead as in training: a copy ordered wrongly
against the next forward or optimizer step would store a later value.
"""

import pytest
import torch
from torch import nn

import datastates_hist as dh
from datastates_hist.store import Store

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=NO_CUDA)])
def device(request):
    return torch.device(request.param)


class Net(nn.Module):
    """An embedding, a BatchNorm (buffers the forward changes: volatile) and linear layers."""

    def __init__(self, width: int, dtype=torch.float32):
        super().__init__()
        self.emb = nn.Embedding(256, width, dtype=dtype)
        self.up = nn.Linear(width, 4 * width, dtype=dtype)
        self.down = nn.Linear(4 * width, width, dtype=dtype)
        self.norm = nn.BatchNorm1d(width, dtype=dtype)
        self.head = nn.Linear(width, 256, bias=False, dtype=dtype)

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(self.norm(x + self.down(torch.relu(self.up(x)))))


def make(device, width=512, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = Net(width, dtype).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model, opt, device, batch=64):
    idx = torch.randint(0, 256, (batch,), device=device)
    nn.functional.cross_entropy(model(idx).float(), idx).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def state(model, opt) -> dict:
    """Clones of every tensor a restore point holds, on the device they live on."""
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for key, v in s.items():
            out[f"optim/{names[p]}/{key}"] = v.detach().clone()
    return out


def equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu(), b.detach().cpu()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_same(want: dict, got: dict, step: int) -> None:
    assert want.keys() == got.keys(), step
    for name in want:
        assert equal_bits(want[name], got[name]), (step, name)


@pytest.mark.parametrize("codec", ["delta", "raw"])
def test_every_step_written_while_training_runs_ahead_restores_bit_exact(run_dir, backend, device, codec):
    model, opt = make(device)
    # pieces of 64 KiB and a cache of 1 MiB, far below the state (about 27 MiB): many copies,
    # events and waits for space while training goes on
    ckpt = dh.Checkpointer(run_dir, backend=backend, codec=codec, keep=dh.KeepLast(100),
                           host_cache_bytes=1 << 20, piece_bytes=64 << 10)
    expected = {}
    for step in range(6):
        train_step(model, opt, device)
        expected[step] = state(model, opt)
        ckpt.write(step, model, opt)  # the next forward and optimizer step run at once
    if device.type == "cuda":
        assert ckpt.cache.buffer.is_pinned()
    ckpt.close()
    with dh.Checkpointer(run_dir) as reader:
        assert reader.steps() == list(range(6))
        for step, want in expected.items():
            fresh, fresh_opt = make(device, seed=step + 100)
            train_step(fresh, fresh_opt, device)  # Adam's state exists, with other values
            reader.restore(step, fresh, fresh_opt)
            assert next(fresh.parameters()).device.type == device.type
            assert_same(want, state(fresh, fresh_opt), step)


def test_bfloat16_model_restores_bit_exact(run_dir, backend, device):
    model, opt = make(device, width=256, dtype=torch.bfloat16)
    expected = {}
    with dh.Checkpointer(run_dir, backend=backend, keep=dh.KeepLast(10)) as ckpt:
        for step in range(3):
            train_step(model, opt, device)
            expected[step] = state(model, opt)
            ckpt.write(step, model, opt)
    store = Store(run_dir)
    try:
        for step, want in expected.items():
            with store.open_step(step) as data:
                for name in want:
                    if name.startswith("model/"):
                        assert equal_bits(want[name], data.read(name)), (step, name)
    finally:
        store.close()
    with dh.Checkpointer(run_dir) as reader:
        fresh, fresh_opt = make(device, width=256, dtype=torch.bfloat16, seed=7)
        train_step(fresh, fresh_opt, device)
        reader.restore(2, fresh, fresh_opt)
        assert_same(expected[2], state(fresh, fresh_opt), 2)


def test_a_step_written_on_the_device_restores_into_a_model_on_the_cpu(run_dir, device):
    model, opt = make(device)
    with dh.Checkpointer(run_dir) as ckpt:
        train_step(model, opt, device)
        want = state(model, opt)
        ckpt.write(0, model, opt)
    fresh, fresh_opt = make("cpu", seed=5)
    train_step(fresh, fresh_opt, "cpu")
    with dh.Checkpointer(run_dir) as reader:
        reader.restore(0, fresh, fresh_opt, rng=False)
    got = state(fresh, fresh_opt)
    assert all(t.device.type == "cpu" for t in got.values())
    assert_same(want, got, 0)


def test_restore_continues_the_random_streams_of_the_device(run_dir, device):
    model, _ = make(device)
    torch.manual_seed(3)
    torch.rand(5, device=device)  # the device's generator moves on from its seed
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, model)
    want = torch.rand(8, device=device)
    torch.manual_seed(9)
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.restore(0, model)
    assert torch.equal(torch.rand(8, device=device), want)


SLEEP_CYCLES = 200_000_000  # about 0.1 s of a GPU's clock: far longer than the copies


@NO_CUDA
def test_copies_are_ordered_after_the_step_before_and_before_the_step_after(run_dir, backend):
    """The GPU is made slow on one side at a time. The training stream sleeps before each
    optimizer step, so write() comes before that step's kernels ran: the copies must wait
    for them (the event recorded at write()). The snapshot stream sleeps before each
    step's copies, so the next optimizer step is issued before they ran: it must wait for
    them (the hook's wait on the copy event)."""
    model, opt = make("cuda")
    ckpt = dh.Checkpointer(run_dir, backend=backend, codec="raw", keep=dh.KeepLast(100))
    expected = {}
    for step in range(4):
        idx = torch.randint(0, 256, (64,), device="cuda")
        nn.functional.cross_entropy(model(idx), idx).backward()
        torch.cuda._sleep(SLEEP_CYCLES)
        opt.step()
        opt.zero_grad(set_to_none=True)
        expected[step] = state(model, opt)
        stream = ckpt._pipeline._snapshotter.stream if ckpt._pipeline._snapshotter else None
        if stream is not None:  # the side stream exists from the first snapshot on
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES)
        ckpt.write(step, model, opt)
    ckpt.close()
    with dh.Checkpointer(run_dir) as reader:
        for step, want in expected.items():
            fresh, fresh_opt = make("cuda", seed=step + 100)
            train_step(fresh, fresh_opt, "cuda")
            reader.restore(step, fresh, fresh_opt)
            assert_same(want, state(fresh, fresh_opt), step)
