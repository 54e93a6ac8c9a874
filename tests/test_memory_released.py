"""What a closed Checkpointer or History lets go of: a script that keeps the object (a module
global, an evaluation after training) must not keep its memory."""
import pytest
import torch

import datastates_hist as dh


def test_close_lets_go_of_the_host_cache_and_the_delta_anchors(backend, run_dir):
    model = torch.nn.Linear(256, 256)
    ckpt = dh.Checkpointer(run_dir, backend=backend, host_cache_bytes=8 << 20)
    for step in range(3):
        with torch.no_grad():
            model.weight.add_(0.01)
        ckpt.write(step, model)
    ckpt.wait()
    assert ckpt.cache.buffer.numel() == 8 << 20
    ckpt.close()
    assert ckpt.cache.buffer.numel() == 0
    assert not ckpt._pipeline._flusher.anchors._anchors  # no value kept to encode a delta against
    with dh.open(run_dir) as h:  # and what it wrote reads back
        assert torch.equal(h.read("model/weight", 2), model.weight.detach())


def test_a_closed_history_holds_no_decoded_values(backend, run_dir):
    model = torch.nn.Linear(64, 64)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        for step in range(4):
            with torch.no_grad():
                model.weight.mul_(1.01)
            ckpt.write(step, model)
    h = dh.open(run_dir)
    for step in h.steps:
        h.read("model/weight", step)  # deltas: each read decodes its bases and keeps them
    assert h.store._decoded_bytes > 0
    h.close()
    assert h.store._decoded_bytes == 0 and not h.store._decoded


def test_close_lets_go_of_the_cache_when_the_ranks_disagree_at_the_close(run_dir):
    """With several ranks the committer's close raises when they did not all write the same
    steps; the memory goes all the same (the committer's failure is stood in for here)."""
    ckpt = dh.Checkpointer(run_dir, host_cache_bytes=8 << 20)
    for step in range(3):
        ckpt.write(step, torch.nn.Linear(64, 64))
    committer_close = ckpt._pipeline.committer.close

    def disagreeing():
        committer_close()
        raise dh.CheckpointError("the ranks did not all write the same steps")

    ckpt._pipeline.committer.close = disagreeing
    with pytest.raises(dh.CheckpointError, match="the ranks did not all write the same steps"):
        ckpt.close()
    assert ckpt.cache.buffer.numel() == 0
    assert not ckpt._pipeline._flusher.anchors._anchors
    with dh.open(run_dir) as h:
        assert h.steps == [0, 1, 2]
