"""A full disk: the error reaches the training loop once, as the library's exception,
committed steps survive, writing resumes.

The run lives on a real, small file system: an 8 MiB tmpfs mounted by the
test (root is needed; without it the test is skipped).
"""

import contextlib
import errno
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.layout import PARTIAL, unit_name
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


def assert_quiet(stderr):
    """Nothing of a storage library's own on stderr: no ADIOS2 error, no h5py or HDF5 traceback."""
    for printed in ("ADIOS2", "Exception ignored", "HDF5-DIAG", "Traceback"):
        assert printed not in stderr, stderr


def train_step(model, opt):
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_disk_full_is_reported_at_the_next_call_and_writing_resumes_after_freeing_space(tmp_path, backend, capfd):
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
        for _, exc in errors:  # the space of the step's file is refused before the library writes
            # steps in flight together fail together: "checkpoints of steps 3, 4 ... (step 3's error)"
            steps = re.match(r"checkpoints? of steps? ([\d, ]+) in ", str(exc))[1].split(", ")
            failed = int(steps[0])
            assert steps == [str(s) for s in range(failed, failed + len(steps))], str(exc)
            unit = os.path.join(run_dir, "steps", unit_name(failed, ".bp" if backend == "adios2" else ".h5"))
            # ADIOS2: a file of the step's, or the room held from its open to its close
            file = re.escape(unit + PARTIAL) + ("/((data|md|mmd)\\.(0|idx)|closing-room)" if backend == "adios2" else "")
            what = (f"checkpoint of step {failed} in {re.escape(run_dir)} failed and was not committed"
                    if len(steps) == 1 else
                    f"checkpoints of steps {', '.join(steps)} in {re.escape(run_dir)} failed and were not "
                    f"committed \\(step {failed}'s error\\)")
            assert re.fullmatch(
                rf"{what}: OSError: "
                rf"\[Errno 28\] cannot reserve \d+ bytes for {file}: No space left on device; no space left on "
                r"device: free space, then write again \(committed steps are intact\)", str(exc)), str(exc)
        assert_quiet(capfd.readouterr().err)
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
        assert_quiet(capfd.readouterr().err)


def test_steps_that_fail_together_are_named_in_one_error_with_the_first_ones_cause():
    """Steps in flight when the disk fills fail together and are reported once, by one error."""
    from datastates_hist.pipeline import checkpoint_failed
    from datastates_hist.snapshot import PendingCheckpoint

    failed = [PendingCheckpoint(step, [], {}) for step in (3, 4)]
    failed[0].fail(OSError(errno.ENOSPC, "No space left on device"))
    failed[1].fail(OSError(errno.EIO, "Input/output error"))
    assert str(checkpoint_failed("/r", failed)) == (
        "checkpoints of steps 3, 4 in /r failed and were not committed (step 3's error): OSError: "
        "[Errno 28] No space left on device; no space left on device: free space, then write again "
        "(committed steps are intact)")
    assert str(checkpoint_failed("/r", failed[1:])) == (
        "checkpoint of step 4 in /r failed and was not committed: OSError: [Errno 5] Input/output error")


@pytest.mark.parametrize("left", [16 << 10, 0], ids=["16 KiB left", "nothing left"])
def test_a_step_whose_first_space_is_refused_leaves_nothing_of_its_unit(tmp_path, backend, capfd, left):
    """A disk too full for even the space a step's writer takes at its open (ADIOS2: the
    room it holds until it closes; HDF5: the file's own metadata, or, with no byte left,
    the file itself): the error names that file, no part of the unit stays, and the run
    writes again once there is space."""
    with small_file_system(str(tmp_path / "small"), size="2m") as fs:
        run_dir = os.path.join(fs, "run")
        model = torch.nn.Linear(4, 4)
        ckpt = dh.Checkpointer(run_dir, backend=backend)
        ckpt.write(0, model)
        ckpt.wait()
        filler = os.path.join(fs, "filler")
        with open(filler, "wb") as f:  # less than the 64 KiB either writer takes first
            f.write(b"\0" * (free_bytes(fs) - left))
        assert free_bytes(fs) == left
        ckpt.write(1, model)
        with pytest.raises(dh.CheckpointError) as failed:
            ckpt.wait()
        suffix = ".bp" if backend == "adios2" else ".h5"
        unit = os.path.join(run_dir, "steps", unit_name(1, suffix)) + PARTIAL
        refused = (f"cannot reserve 65536 bytes for {unit}/closing-room" if backend == "adios2" else
                   f"cannot create {unit}" if left == 0 else f"cannot reserve 65536 bytes for {unit}")
        assert str(failed.value) == (
            f"checkpoint of step 1 in {run_dir} failed and was not committed: OSError: [Errno 28] "
            f"{refused}: No space left on device; no space left on device: "
            "free space, then write again (committed steps are intact)")
        assert sorted(os.listdir(os.path.join(run_dir, "steps"))) == [unit_name(0, suffix)]
        os.remove(filler)
        ckpt.write(1, model)
        ckpt.close()
        with dh.open(run_dir) as h:
            assert h.steps == [0, 1]
        assert verify_run(run_dir) == []
        assert_quiet(capfd.readouterr().err)


def test_a_bp5_file_given_up_on_a_full_disk_is_closed_and_what_adios2_says_is_in_the_error(tmp_path, capfd):
    """Its data refused, the file is still ended and closed (ADIOS2 writes, fails and prints
    while it is given up): ADIOS2's words go into the error, none to stderr, and no space stays taken."""
    from datastates_hist.backends import _adios2_capi as capi
    from datastates_hist.backends.adios2_bp5 import WRITE_PARAMETERS

    with small_file_system(str(tmp_path / "small"), size="2m") as fs:
        unit = os.path.join(fs, "000000000000.bp.partial")
        block = np.arange(1 << 17, dtype=np.float64)  # 1 MiB
        adios = capi.Adios()
        writer = capi.FileWriter(adios, unit, WRITE_PARAMETERS)
        writer.define("w", block.dtype, block.shape)
        writer.put("w", block.ctypes.data, (0,), block.shape)
        with open(os.path.join(fs, "filler"), "wb") as f:  # 64 KiB left: the metadata fits, the data not
            f.write(b"\0" * (free_bytes(fs) - (64 << 10)))
        with pytest.raises(capi.Adios2Error) as failed:
            writer.close()
        text = str(failed.value)
        ours = f"[Errno 28] cannot reserve {(1 << 20) + 8 + 4096} bytes for {unit}/data.0: No space left on device"
        assert text.startswith(f"{ours} (ADIOS2, giving the file up: ") and text.endswith(")"), text
        assert f"couldn't write to file {unit}/data.0 : errno = 28: No space left on device" in text, text
        assert "\x1b" not in text and "\n" not in text
        assert failed.value.__cause__.errno == errno.ENOSPC
        assert adios.handle  # closed, so the context is finalized, not abandoned
        adios.close()
        assert capfd.readouterr().err == ""
        assert os.path.getsize(os.path.join(unit, "data.0")) == 0
        os.remove(os.path.join(fs, "filler"))
        shutil.rmtree(unit)  # as the step's writer does: every byte comes back (no file left open)
        assert free_bytes(fs) == 2 << 20


@pytest.mark.parametrize("name", [
    lambda i: f"t{i}",                                   # flat
    lambda i: f"model/layer{i}.weight",                  # one group
    lambda i: f"g{i}/h{i}/k{i}/w",                       # three new groups each
    lambda i: "m/" + "x" * 400 + str(i),                 # long names
    lambda i: "/".join(f"d{i}_{k}" for k in range(30)),  # thirty new groups each
], ids=["flat", "grouped", "new-groups", "long-names", "deep"])
def test_an_hdf5_step_reserves_every_byte_its_file_takes(tmp_path, name):
    """A full disk fails cleanly only if HDF5 never writes past the space reserved before
    it: the file a step leaves (metadata of every dataset and group, the manifest) lies
    within what its writer reserved, whatever the names."""
    from datastates_hist.backends.hdf5 import HDF5StepWriter

    writer = HDF5StepWriter(str(tmp_path / "000000000000.h5"), 0)
    for i in range(300):
        data = np.arange(i % 7 + 1, dtype=np.uint16)
        writer.define(name(i), data.dtype, data.shape, "bfloat16")  # with its dtype attribute
        writer.put(name(i), data, (0,))
    writer.write_manifest(b"{}" * 50_000)
    writer.close_files()
    assert os.path.getsize(writer.tmp) <= writer.reserved, (os.path.getsize(writer.tmp), writer.reserved)
