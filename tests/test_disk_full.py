"""A full disk: the error reaches the training loop, committed steps survive, writing resumes.

The run lives on a real, small file system: an 8 MiB tmpfs mounted by the
test (root is needed; without it the test is skipped).
"""

import contextlib
import os
import subprocess

import pytest
import torch

import datastates_hist as dh
from datastates_hist.verify import verify_run


@contextlib.contextmanager
def small_file_system(path, size="8m"):
    os.makedirs(path)
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path])


def free_bytes(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def train_step(model, opt):
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_disk_full_is_reported_at_the_next_call_and_writing_resumes_after_freeing_space(tmp_path, backend):
    with small_file_system(str(tmp_path / "small")) as fs:
        filler = os.path.join(fs, "filler")
        with open(filler, "wb") as f:
            f.write(b"\0" * (3 << 20))
        run_dir = os.path.join(fs, "run")
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 512)  # 0.5 MiB of weights, 1.5 MiB per step with Adam
        opt = torch.optim.Adam(model.parameters())
        ckpt = dh.Checkpointer(run_dir, backend=backend, host_cache_bytes=1 << 20, piece_bytes=256 << 10)
        errors, step = [], -1
        for step in range(20):  # the training loop
            train_step(model, opt)
            try:
                ckpt.write(step, model, opt, data={"step": step})
            except dh.CheckpointError as exc:
                errors.append(("write", exc))
                break
        while True:  # steps still in flight may fail too; each failure is raised once
            try:
                ckpt.wait()
                break
            except dh.CheckpointError as exc:
                errors.append(("wait", exc))
        assert errors, f"the file system never filled up ({free_bytes(fs)} bytes free)"
        assert errors[0][0] == "write"  # raised by the loop's next write()
        for _, exc in errors:
            text = str(exc)
            assert f"in {run_dir} failed and was not committed" in text
            assert "no space left on device" in text.lower(), text
        committed = ckpt.steps()
        assert committed and committed == list(range(len(committed)))
        assert not any(e.endswith(".partial") for e in os.listdir(os.path.join(run_dir, "steps")))

        # the newest committed step restores, every checksum intact
        fresh = torch.nn.Linear(256, 512)
        restored = ckpt.restore(model=fresh, optimizer=torch.optim.Adam(fresh.parameters()))
        assert restored.step == committed[-1] and restored.extra["data"] == {"step": committed[-1]}
        assert verify_run(run_dir) == []

        # free space: the same Checkpointer writes again
        os.remove(filler)
        for extra_step in (step + 1, step + 2):
            train_step(model, opt)
            ckpt.write(extra_step, model, opt, data={"step": extra_step})
        ckpt.wait()
        assert ckpt.steps()[-2:] == [step + 1, step + 2]
        ckpt.close()
        with dh.Checkpointer(run_dir) as again:
            back = torch.nn.Linear(256, 512)
            assert again.restore(model=back).step == step + 2
            assert torch.equal(back.weight, model.weight)
        assert verify_run(run_dir) == []
