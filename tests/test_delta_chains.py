"""Reading a delta decodes each value of its chain once, whatever the decoded-value budget
keeps, and a crafted second base cannot make a read blame an intact step."""

import pytest
import torch

import datastates_hist as dh
import datastates_hist.step_data as step_data_module
import datastates_hist.store as store_module
from test_paths_and_sizes import rewrite_manifest


@pytest.fixture
def decodes(monkeypatch):
    """The count of tensor values decoded, with the budget of decoded values kept at 2 MiB
    (as 1 GiB is to a tensor of 768 MiB)."""
    count = [0]
    decode = step_data_module.decode

    def counting(*args, **kwargs):
        count[0] += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(step_data_module, "decode", counting)
    monkeypatch.setattr(store_module, "DECODED_BYTES", 2 << 20)
    return count


def test_a_tensor_of_more_than_half_the_budget_decodes_each_value_of_its_chain_once(run_dir, backend, decodes):
    """Only one value of the tensor stays remembered; the base's own base was decoded again
    from the key at every step (2583 decodes for a chain of 16)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2, bias=False)
    model.register_buffer("big", torch.randn(384 * 1024))  # 1.5 MiB
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        for step in range(16):
            model.big += 1e-3 * torch.randn_like(model.big)
            ckpt.write(step, model)
    with dh.open(run_dir) as h:
        assert [r.encoding for r in h.step_data(15).records.values() if r.name == "model/big"] == ["delta"]
        decodes[0] = 0
        assert torch.equal(h.read("big", 15), model.big)
    assert decodes[0] == 16
    fresh = torch.nn.Linear(2, 2, bias=False)
    fresh.register_buffer("big", torch.zeros(384 * 1024))
    decodes[0] = 0
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.restore(15, model=fresh, rng=False)
    assert torch.equal(fresh.big, model.big) and decodes[0] == 2 * 16  # the weight's chain too


def test_a_restore_of_more_than_the_budget_decodes_each_value_once(run_dir, backend, decodes):
    """Many tensors, together beyond the budget: the bases a restore decodes a step at a
    time are held until the last step that needs them (2816 decodes for 96 values)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(6)])  # 6 x 256 KiB
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        for step in range(16):
            model(torch.randn(4, 256)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.write(step, model, opt)
    fresh = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(6)])
    decodes[0] = 0
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.restore(15, model=fresh, rng=False)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    assert decodes[0] == 6 * 16


def test_a_crafted_second_base_reads_right_and_blames_no_intact_step(run_dir, decodes):
    """``base2`` need only be earlier than ``base``: set to five steps back (the tensor is
    zeros, so every prediction is zero and the read is still right), a chain of 36 needs
    more steps open than are kept open; the read decodes each value once, and does not
    lose a step it still reads (it failed with "Invalid location identifier" of step 32)."""
    model = torch.nn.Linear(2, 2)
    model.register_buffer("zeros", torch.zeros(256))
    with dh.Checkpointer(run_dir, backend="hdf5", key_every=10_000) as ckpt:
        for step in range(40):
            ckpt.write(step, model)

    for step in range(5, 40):
        def edit(doc, step=step):
            rec = next(r for r in doc["tensors"] if r["name"] == "model/zeros")
            rec["base2"] = step - 5
        rewrite_manifest(run_dir, step, edit)
    with dh.open(run_dir) as h:
        decodes[0] = 0
        assert torch.equal(h.read("zeros", 36), torch.zeros(256))
        assert decodes[0] == 37
