"""A program that ends without ``close()`` commits every step it issued.

The library's exit handler closes every open Checkpointer; it must run before
the exit handlers of the storage libraries (h5py unregisters its type
converters at exit, MPI finalizes), whatever order they were imported in:
here h5py and ADIOS2 are imported by the Checkpointer itself, after
``datastates_hist``, and the program ends while the flusher is still writing
(the host cache is a fraction of the state; bfloat16 and bool tensors make
HDF5 convert the strings of their ``dtype`` attributes).
"""

import os
import subprocess
import sys

import torch

import datastates_hist as dh
from test_distributed import needs_mpi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = 12  # per backend
AT_ONCE = 4
STEPS = 4
SHAPE = (512, 1024)  # 2 MiB of float32 (and its bfloat16 and bool forms), beside a 512 KiB host cache

CHILD = r"""
import sys
sys.path.insert(0, sys.argv[4])
import torch
import datastates_hist as dh

comm = None
if sys.argv[5:] == ["mpi"]:  # imported after datastates_hist: MPI_Finalize must still come after the commits
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
model = torch.nn.Linear(1, 1)
ckpt = dh.Checkpointer(sys.argv[1], backend=sys.argv[2], host_cache_bytes=512 << 10, piece_bytes=64 << 10,
                       comm=comm)
for step in range(int(sys.argv[3])):
    big = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(step))
    ckpt.write(step, model, big=big, half=big.bfloat16(), signs=big > 0)
# ends here, without close(): the flusher is still writing
""".replace("SHAPE", repr(SHAPE))


# The Checkpointer is dropped (no name holds it) while its steps are in flight.
DROPPED = r"""
import gc, sys
sys.path.insert(0, sys.argv[4])
import torch
import datastates_hist as dh

def train(model):
    ckpt = dh.Checkpointer(sys.argv[1], backend=sys.argv[2], host_cache_bytes=512 << 10, piece_bytes=64 << 10)
    for step in range(int(sys.argv[3])):
        big = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(step))
        ckpt.write(step, model, big=big, half=big.bfloat16(), signs=big > 0)

train(torch.nn.Linear(1, 1))
gc.collect()
""".replace("SHAPE", repr(SHAPE))


def expected(step):
    big = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(step))
    return {"extra/big": big, "extra/half": big.bfloat16(), "extra/signs": big > 0}


def run_children(run_dirs, backend, program=CHILD):
    """The program once per run directory, a few at a time; their outcomes in order."""
    outcomes = []
    for at in range(0, len(run_dirs), AT_ONCE):
        children = [subprocess.Popen([sys.executable, "-c", program, run_dir, backend, str(STEPS), ROOT],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for run_dir in run_dirs[at:at + AT_ONCE]]
        outcomes += [(child.communicate(timeout=300)[1], child.returncode) for child in children]
    return outcomes


def test_program_ending_without_close_commits_every_step(tmp_path, backend):
    run_dirs = [str(tmp_path / f"run{i}") for i in range(RUNS)]
    outcomes = run_children(run_dirs, backend)
    failed = [(i, code, err[-500:]) for i, (err, code) in enumerate(outcomes) if code != 0 or err]
    assert not failed, f"{len(failed)} of {RUNS} runs failed: {failed}"
    for run_dir in run_dirs:
        assert_every_step_restores(run_dir)


def test_a_checkpointer_dropped_without_close_commits_every_step(tmp_path, backend):
    run_dirs = [str(tmp_path / f"run{i}") for i in range(AT_ONCE)]
    outcomes = run_children(run_dirs, backend, DROPPED)
    failed = [(i, code, err[-500:]) for i, (err, code) in enumerate(outcomes) if code != 0 or err]
    assert not failed, f"{len(failed)} of {len(run_dirs)} runs failed: {failed}"
    for run_dir in run_dirs:
        assert_every_step_restores(run_dir)


@needs_mpi
def test_job_ending_without_close_commits_every_step_before_mpi_finalizes(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    job = subprocess.run(["mpirun", "-n", "2", sys.executable, "-c", CHILD, run_dir, backend, str(STEPS), ROOT, "mpi"],
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 0 and job.stderr == "", job.stderr[-2000:]
    assert_every_step_restores(run_dir)


def assert_every_step_restores(run_dir):
    with dh.open(run_dir) as h:
        assert h.steps == list(range(STEPS)), run_dir
        for step in range(STEPS):
            for name, want in expected(step).items():
                got = h.read(name, step)  # checksum verified
                assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
                    run_dir, step, name)
