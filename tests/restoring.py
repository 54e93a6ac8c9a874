"""The check that a step restores: into a fresh copy of the model and optimizer, bit-exact."""

import copy

import torch

import datastates_hist as dh


def assert_step_restores(run_dir, step, model, opt):
    """Step ``step`` of ``run_dir`` restores into a copy of ``model`` whose parameters are
    zeroed and a new optimizer of ``opt``'s type, giving ``model``'s parameters and
    ``opt``'s Adam moments bit for bit."""
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh_opt = type(opt)(fresh.parameters())
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.restore(step, model=fresh, optimizer=fresh_opt)
    assert all(same_bits(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    assert len(opt.state) == len(fresh_opt.state)
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        assert all(same_bits(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (``torch.equal`` takes -0.0 for 0.0)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))
