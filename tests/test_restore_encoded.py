"""A restore of an encoded step decodes each tensor straight into the model's and the
optimizer's own tensors, after reading the stored bytes in one batch per unit."""

import pytest
import torch

import datastates_hist as dh
from datastates_hist.errors import CorruptionError


def train(run_dir, backend, steps=5, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with dh.Checkpointer(run_dir, backend=backend, **options) as ckpt:
        for step in range(steps):
            model(torch.randn(16, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.write(step, model, opt)
    return model, opt


@pytest.mark.parametrize("codec", ["delta", "key"])
def test_encoded_tensors_are_decoded_into_the_live_tensors_bit_exact(run_dir, backend, codec):
    model, opt = train(run_dir, backend, codec=codec)
    with dh.open(run_dir) as h:
        rows = h.tensors(4).set_index("name")
        assert rows.loc["model/0.weight", "encoding"] == ("delta" if codec == "delta" else "key")
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    pointers = [p.data_ptr() for p in fresh.parameters()]
    with dh.Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=fresh, optimizer=fresh_opt).step == 4
    assert [p.data_ptr() for p in fresh.parameters()] == pointers  # read in place
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), key


@pytest.mark.parametrize("damaged", [["model/0.weight"], ["model/2.weight", "model/0.weight"]])
def test_a_damaged_encoded_tensor_fails_the_restore_by_name(run_dir, damaged):
    """The error names the first damaged tensor in the step's order."""
    train(run_dir, "hdf5", codec="key", steps=1)
    import glob

    import h5py

    (unit,) = glob.glob(f"{run_dir}/steps/*.h5")
    with h5py.File(unit, "r+") as f:
        for name in damaged:
            data = f[name]
            blob = data[...]
            blob[len(blob) // 2] ^= 0xFF
            data[...] = blob
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(CorruptionError, match=r"^tensor 'model/0\.weight' of step 0 in .* (cannot be decoded|"
                                                  r"does not match its checksum)"):
            ckpt.restore(model=fresh)


def test_encoded_tensors_are_read_in_batches_of_bounded_size(run_dir, monkeypatch):
    from datastates_hist import step_data
    from datastates_hist.backends.adios2_bp5 import Adios2StepReader

    model, opt = train(run_dir, "adios2", codec="key", steps=1)
    monkeypatch.setattr(step_data, "BATCH_BYTES", 4096)  # about a tensor a batch
    batches, read_many = [], Adios2StepReader.read_many

    def recorded(self, requests):
        batches.append([name for name, _, _ in requests])
        read_many(self, requests)

    monkeypatch.setattr(Adios2StepReader, "read_many", recorded)
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.restore(model=fresh, optimizer=fresh_opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    names = sum(batches, [])
    assert len(batches) >= 6 and len(names) == len(set(names)) and "model/0.weight" in names


def test_a_failed_prefetch_leaves_nothing_a_later_read_would_return_unchecked(run_dir):
    """The tensors of a batch whose decode failed are not kept as prefetched: a read of
    the damaged one afterwards fails again, by name; an intact one reads exact."""
    import glob

    import h5py

    from datastates_hist.store import Store

    model, _ = train(run_dir, "hdf5", codec="key", steps=1)
    (unit,) = glob.glob(f"{run_dir}/steps/*.h5")
    with h5py.File(unit, "r+") as f:
        blob = f["model/0.weight"][...]
        blob[len(blob) // 2:len(blob) // 2 + 64] ^= 0x5A
        f["model/0.weight"][...] = blob
    store = Store(run_dir)
    try:
        with store.open_step(0) as data:
            with pytest.raises(CorruptionError, match=r"^tensor 'model/0\.weight' of step 0"):
                data.prefetch(["model/0.weight", "model/2.weight"])
            with pytest.raises(CorruptionError, match=r"^tensor 'model/0\.weight' of step 0"):
                data.read("model/0.weight")
            assert torch.equal(data.read("model/2.weight"), model[2].weight.detach())
    finally:
        store.close()


def test_the_bases_of_a_restore_are_read_a_step_at_a_time(run_dir, monkeypatch):
    """Step 4's deltas need steps 0-3 of each tensor: each of those steps is read in one
    batch (read_many), none tensor by tensor (read), and the restore is exact."""
    from datastates_hist.backends.adios2_bp5 import Adios2StepReader

    model, opt = train(run_dir, "adios2", codec="delta", steps=5)
    one_by_one, batches, read, read_many = [], [], Adios2StepReader.read, Adios2StepReader.read_many

    def read_one(self, name, out, start, part=None):
        one_by_one.append(name)
        read(self, name, out, start, part)

    def read_batch(self, requests):
        batches.append(len(requests))
        read_many(self, requests)

    monkeypatch.setattr(Adios2StepReader, "read", read_one)
    monkeypatch.setattr(Adios2StepReader, "read_many", read_batch)
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    with dh.Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=fresh, optimizer=fresh_opt).step == 4
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"])
    assert one_by_one == [] and len(batches) <= 5 + 2, batches  # steps 0-3, then step 4's units


class Tied(torch.nn.Module):
    """An embedding and an output layer that share one weight, as GPT-2's wte and lm_head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.emb(tokens))


@pytest.mark.parametrize("backend", ["adios2", "hdf5"])
def test_two_records_of_one_tied_tensor_are_never_decoded_into_it_at_once(run_dir, backend, monkeypatch):
    """A tied weight is two records restored into one tensor. Their decodes are held
    until both run at once; neither may write memory the other writes (each checks
    its checksum against what it wrote), and the tie is restored with the values."""
    import threading

    from datastates_hist import step_data

    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        for step in range(3):
            model(torch.randint(0, 64, (8,))).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.write(step, model, opt)
    tied = {"model/emb.weight", "model/head.weight"}
    both_running = threading.Barrier(2, timeout=30)
    written, decode = {}, step_data.StepData._decode

    def held(self, rec, blob, out, bases):
        if rec.name in tied:
            written[rec.name] = (out.ctypes.data, out.ctypes.data + out.nbytes)
            both_running.wait()  # a BrokenBarrierError here: the two decodes never overlapped
        decode(self, rec, blob, out, bases)

    monkeypatch.setattr(step_data, "DECODERS", 2)
    monkeypatch.setattr(step_data, "WAVE_BYTES", 1)  # a task per tensor, so that the two may run at once
    monkeypatch.setattr(step_data.StepData, "_decode", held)
    torch.manual_seed(1)
    fresh = Tied()
    with dh.Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=fresh, optimizer=torch.optim.Adam(fresh.parameters(), lr=1e-2)).step == 2
    (a_start, a_end), (b_start, b_end) = written.values()
    assert a_end <= b_start or b_end <= a_start, "two decodes wrote the same memory at once"
    assert fresh.head.weight is fresh.emb.weight and torch.equal(fresh.emb.weight, model.emb.weight)
