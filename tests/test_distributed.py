"""One history written by several ranks: real jobs under ``mpirun`` and ``torchrun``.

Each job (tests/jobs/dist_train.py) trains a small model with DDP (gloo) or
sharded with DTensor, checkpoints every step, and keeps the global tensors of
every step; restores on 1, 2 and 4 ranks compare every tensor bit for bit, and
the history is read back through ``datastates_hist.open``. Oversubscribed on
the CI machine's 2 cores.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.sharding import combine_stats, merge_records, split_replicated
from datastates_hist.items import TensorItem, TensorRecord

JOB = os.path.join(os.path.dirname(__file__), "jobs", "dist_train.py")


def _mpi_ready() -> str | None:
    if shutil.which("mpirun") is None:
        return "mpirun is not installed (tools/install_mpi.sh)"
    try:
        import adios2
        import mpi4py  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed (tools/install_mpi.sh)"
    if not adios2.is_built_with_mpi:
        return "adios2 is built without MPI (tools/install_mpi.sh)"
    return None


needs_mpi = pytest.mark.skipif(_mpi_ready() is not None, reason=str(_mpi_ready()))


def launch(how: str, n: int, *args: str, timeout: float = 600) -> str:
    """Run the job on ``n`` ranks (``how``: mpirun, torchrun, or none for one process); its output."""
    cmd = [sys.executable, JOB, *args]
    if how == "mpirun":
        cmd = ["mpirun", "-n", str(n), *cmd]
    elif how == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *cmd[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-4000:]}"
    return out


def restored_lines(out: str, n: int, step: int) -> list[str]:
    lines = sorted(re.findall(r"rank \d+: restored step .*?differ \[.*?\]", out))
    assert len(lines) == n, out
    for line in lines:
        assert f"restored step {step} " in line and "17 tensors compared, 0 differ" in line, line
    return lines


def check_restores(how: str, run: str, writers: int, model: str, step: int) -> None:
    """Restore ``step`` on 1, 2 and 4 ranks: every global tensor equal to the one written."""
    restored_lines(launch("none", 1, "restore", run, str(step), "--model", "plain"), 1, step)
    for n in (2, 4):
        lines = restored_lines(launch(how, n, "restore", run, str(step), "--model", model), n, step)
        # RNG states are per rank: restored only on as many ranks as wrote them
        assert all(("(rng True)" in line) == (n == writers) for line in lines), lines


def trained(how: str, n: int, run: str, *args: str) -> list[int]:
    out = launch(how, n, "train", run, *args)
    steps = set(re.findall(r"rank \d+: steps (\[.*\])", out))
    assert len(steps) == 1 and len(re.findall(r"rank \d+: steps", out)) == n, out
    return json.loads(steps.pop())


@needs_mpi
@pytest.mark.parametrize("writers", [2, 4])
@pytest.mark.parametrize("model", ["ddp", "dtensor"])
def test_mpi_history_restores_bit_exact_on_1_2_4_ranks(tmp_path, model, writers):
    run = str(tmp_path / "run")
    assert trained("mpirun", writers, run, "--model", model) == list(range(10))
    # one BP5 file per step, written collectively (not a file per rank)
    unit = os.path.join(run, "steps", "000000000009.bp")
    assert os.path.isdir(unit) and os.path.exists(os.path.join(unit, "md.idx"))
    with dh.open(run) as h:
        assert h.steps == list(range(10))
        rows = h.tensors(9).set_index("name")
        assert {"rng/rank0/torch", f"rng/rank{writers - 1}/torch"} <= set(rows.index)
        assert tuple(rows.loc["model/fc1.weight", "shape"]) == (10, 12)
    check_restores("mpirun", run, writers, model, 9 if writers == 4 else 4)


@needs_mpi
@pytest.mark.parametrize("model", ["ddp", "dtensor"])
def test_a_one_process_history_restores_on_4_ranks(tmp_path, model):
    run = str(tmp_path / "run")
    assert trained("none", 1, run, "--model", "plain", "--steps", "3") == [0, 1, 2]
    restored_lines(launch("mpirun", 4, "restore", run, "2", "--model", model), 4, 2)


@needs_mpi
def test_mpi_aggregators_set_the_number_of_subfiles(tmp_path):
    run = str(tmp_path / "run")
    trained("mpirun", 4, run, "--model", "ddp", "--steps", "2", "--aggregators", "2")
    files = sorted(f for f in os.listdir(os.path.join(run, "steps", "000000000001.bp")) if f.startswith("data."))
    assert files == ["data.0", "data.1"]
    restored_lines(launch("none", 1, "restore", run, "1", "--model", "plain"), 1, 1)


@needs_mpi
@pytest.mark.parametrize("how", ["raise", "put"])
@pytest.mark.parametrize("writers", [2, 4])
def test_mpi_a_failing_rank_leaves_the_step_uncommitted_everywhere(tmp_path, how, writers):
    run = str(tmp_path / "run")
    out = launch("mpirun", writers, "train", run, "--model", "dtensor",
                 "--fail-rank", "1", "--fail-step", "5", "--fail-how", how)
    steps = re.findall(r"rank \d+: steps (\[.*\])", out)
    assert steps == ["[0, 1, 2, 3, 4, 6, 7, 8, 9]"] * writers, out
    # every rank learned that step 5 failed, and why
    for rank in range(writers):
        failures = re.findall(rf"rank {rank}: FAILURE .*", out)
        assert any("step 5" in f and "not committed" in f for f in failures), (rank, out)
        if rank != 1:
            assert any("rank 1 of" in f for f in failures), (rank, out)
    assert sorted(os.listdir(os.path.join(run, "steps"))) == [f"{s:012d}.bp" for s in (0, 1, 2, 3, 4, 6, 7, 8, 9)]
    restored_lines(launch("mpirun", 2, "restore", run, "6", "--model", "dtensor"), 2, 6)


@needs_mpi
def test_mpi_hdf5_writes_a_file_per_rank(tmp_path):
    run = str(tmp_path / "run")
    assert trained("mpirun", 2, run, "--model", "ddp", "--backend", "hdf5") == list(range(10))
    unit = os.path.join(run, "steps", "000000000009.ranks")
    assert sorted(os.listdir(unit)) == ["rank00000.h5", "rank00001.h5"]
    check_restores("mpirun", run, 2, "ddp", 9)


@pytest.mark.parametrize("model", ["ddp", "dtensor"])
def test_torchrun_history_restores_bit_exact(tmp_path, model):
    run = str(tmp_path / "run")
    assert trained("torchrun", 2, run, "--model", model) == list(range(10))
    unit = os.path.join(run, "steps", "000000000009.ranks")
    assert sorted(os.listdir(unit)) == ["rank00000.bp", "rank00001.bp"]  # serial BP5, one per rank
    check_restores("torchrun", run, 2, model, 9)


@pytest.mark.parametrize("how, rank", [("put", 0), ("open", 1)])
def test_torchrun_a_failing_rank_leaves_the_step_uncommitted(tmp_path, how, rank):
    run = str(tmp_path / "run")
    out = launch("torchrun", 2, "train", run, "--model", "ddp", "--fail-rank", str(rank), "--fail-step", "3",
                 "--fail-how", how)
    assert re.findall(r"rank \d+: steps (\[.*\])", out) == ["[0, 1, 2, 4, 5, 6, 7, 8, 9]"] * 2, out
    other = 1 - rank
    assert re.search(rf"rank {other}: FAILURE .*step 3 .*rank {rank} of 2: OSError: injected failure", out), out


@pytest.mark.parametrize("how", ["mpirun", "torchrun"])
def test_a_tensor_one_rank_alone_holds_leaves_the_step_uncommitted_and_named(tmp_path, how):
    """Each rank writes its part of a plan made from its own tensors: one that a rank alone
    holds would be written by nobody, and the step committed without it."""
    run = str(tmp_path / "run")
    out = launch(how, 2, "train", run, "--model", "ddp", "--fail-rank", "1", "--fail-step", "3",
                 "--fail-how", "extra")
    assert re.findall(r"rank \d+: steps (\[.*\])", out) == ["[0, 1, 2, 4, 5, 6, 7, 8, 9]"] * 2, out
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: FAILURE .*step 3 .*write\(\) needs the same tensors on every rank .*"
                         r"tensor 'extra/only_mine' is on rank 1, not on rank 0", out), out


@pytest.mark.parametrize("how, backend", [("torchrun", "adios2"), ("mpirun", "hdf5")])
def test_ranks_writing_to_different_run_directories_commit_nothing(tmp_path, how, backend):
    """One file per rank: rank 1's files went to its own folder, and rank 0 published a step
    without them (every restore of it failed); now no step is committed."""
    run = str(tmp_path / "run")
    dh.Checkpointer(run + ".elsewhere", backend=backend).close()  # rank 1's run: an existing one
    out = launch(how, 2, "train", run, "--model", "ddp", "--backend", backend, "--steps", "2",
                 "--fail-rank", "1", "--fail-how", "elsewhere")
    assert re.findall(r"rank \d+: steps (\[.*\])", out) == ["[]"] * 2, out
    suffix = {"adios2": "bp", "hdf5": "h5"}[backend]
    assert re.search(rf"rank 0: FAILURE close: .*write step 0: rank 0 \(publishing\): FileNotFoundError: the ranks' "
                     rf"files rank00001.{suffix} of this step are not in {re.escape(run)}/steps/000000000000"
                     r"\.ranks\.partial: every rank must write to the same run directory", out), out


# A job that disagrees must end with an error on every rank, never hang: these would
# wait forever in a collective (ADIOS2's close, a gather) without the ranks' agreements.
HANG_S = 180

BOTH = [pytest.param("mpirun", "adios2", marks=needs_mpi), pytest.param("mpirun", "hdf5", marks=needs_mpi),
        ("torchrun", "adios2")]


@pytest.mark.parametrize("how, backend", BOTH)
def test_a_rank_that_cannot_open_the_step_file_fails_the_step_on_every_rank(tmp_path, how, backend):
    """Rank 1 runs out of file descriptors at step 3: inside ADIOS2's collective open (or
    h5py's), while rank 0's writer is open; rank 0 used to wait in the collective close."""
    run = str(tmp_path / "run")
    out = launch(how, 2, "train", run, "--model", "ddp", "--backend", backend, "--steps", "6",
                 "--fail-rank", "1", "--fail-step", "3", "--fail-how", "fds", timeout=HANG_S)
    assert re.findall(r"rank \d+: steps (\[.*\])", out) == ["[0, 1, 2, 4, 5]"] * 2, out
    assert re.search(r"rank 1: FAILURE write 3: checkpoint of step 3 .* failed and was not committed", out), out
    assert re.search(r"rank 0: FAILURE .*step 3 .*the ranks did not all write step 3: rank 1 of 2: ", out), out
    assert not [e for e in os.listdir(os.path.join(run, "steps")) if e.startswith("000000000003")]
    restored_lines(launch(how, 2, "restore", run, "5", "--model", "ddp"), 2, 5)


@pytest.mark.parametrize("how, backend", BOTH)
def test_a_rank_that_skips_a_write_fails_the_steps_after_it_and_nothing_hangs(tmp_path, how, backend):
    run = str(tmp_path / "run")
    out = launch(how, 2, "train", run, "--model", "ddp", "--backend", backend, "--steps", "6",
                 "--fail-rank", "1", "--fail-step", "3", "--fail-how", "skip", timeout=HANG_S)
    assert re.findall(r"rank \d+: steps (\[.*\])", out) == ["[0, 1, 2]"] * 2, out
    assert re.search(r"rank 0: FAILURE close: checkpoints of steps 3, 4, 5 .*the ranks did not all write step 3: "
                     r"rank 1 wrote step 4 while rank 0 wrote step 3: write\(\) must be called on every rank "
                     r"with the same steps", out), out
    assert re.search(r"rank 1: FAILURE close: checkpoints of steps 4, 5 .*rank 1 wrote step 4 while rank 0 wrote "
                     r"step 3", out), out
    assert sorted(os.listdir(os.path.join(run, "steps"))) == [f"{s:012d}.{_suffix(how, backend)}" for s in (0, 1, 2)]


@pytest.mark.parametrize("how, backend", BOTH)
def test_a_rank_that_writes_a_step_more_fails_it_and_the_others_close(tmp_path, how, backend):
    run = str(tmp_path / "run")
    out = launch(how, 2, "train", run, "--model", "ddp", "--backend", backend, "--steps", "3",
                 "--fail-rank", "0", "--fail-how", "one-more", timeout=HANG_S)
    assert re.findall(r"rank \d+: steps (\[.*\])", out) == ["[0, 1, 2]"] * 2, out
    closed = (r"rank 1 closed its Checkpointer while rank 0 wrote step 3: write\(\), truncate\(\), prune\(\) and "
              r"close\(\) must be called on every rank alike, in the same order")
    assert re.search(rf"rank 0: FAILURE close: checkpoint of step 3 .*not committed: .*{closed}", out), out
    assert re.search(rf"rank 1: FAILURE close: the ranks did not all write the same steps to .*{closed}", out), out


@pytest.mark.parametrize("how", [pytest.param("mpirun", marks=needs_mpi), "torchrun"])
def test_ranks_opening_with_different_backends_all_fail_to_open(tmp_path, how):
    run = str(tmp_path / "run")
    out = launch(how, 2, "train", run, "--model", "ddp", "--backend", "hdf5",
                 "--fail-rank", "1", "--fail-how", "backend", timeout=HANG_S)
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: FAILURE open: not every rank could open {re.escape(run)} for writing: "
                         r"rank 1 writes with the backend 'adios2' and rank 0 with 'hdf5': pass the same backend= "
                         "on every rank", out), out
    with dh.open(run) as h:
        assert h.steps == []


@pytest.mark.parametrize("how", [pytest.param("mpirun", marks=needs_mpi), "torchrun"])
def test_truncate_after_a_failure_one_rank_has_reported_truncates_on_every_rank(tmp_path, how):
    """Rank 1's write(4) raised; rank 0 reported the failed step at wait(); rank 1 has it still
    to report when both call truncate(): it used to raise it there and skip the change that
    rank 0 waited in."""
    run = str(tmp_path / "run")
    out = launch(how, 2, "train", run, "--model", "ddp", "--steps", "5",
                 "--fail-rank", "1", "--fail-step", "4", "--fail-how", "truncate", timeout=HANG_S)
    assert re.findall(r"rank \d+: steps (\[.*\])", out) == ["[0, 1]"] * 2, out
    assert re.findall(r"rank \d+: truncated (\[.*\])", out) == ["[2, 3]"], out  # rank 0's; rank 1 raised
    assert re.search(r"rank 0: FAILURE wait: checkpoint of step 4 .*rank 1 of 2: ", out), out
    assert re.search(r"rank 1: FAILURE truncate: checkpoint of step 4 .*not committed", out), out


@pytest.mark.parametrize("how", [pytest.param("mpirun", marks=needs_mpi), "torchrun"])
def test_truncate_on_one_rank_while_the_others_close_changes_nothing(tmp_path, how):
    run = str(tmp_path / "run")
    out = launch(how, 2, "train", run, "--model", "ddp", "--steps", "4", "--fail-rank", "1",
                 "--fail-how", "truncate-one", timeout=HANG_S)
    assert re.findall(r"rank \d+: steps (\[.*\])", out) == ["[0, 1, 2, 3]"] * 2, out
    why = (r"rank 0 closed its Checkpointer while rank 1 called truncate\(after=1\): write\(\), truncate\(\), "
           r"prune\(\) and close\(\) must be called on every rank alike")
    assert re.search(rf"rank 1: FAILURE truncate: truncate\(\) changed nothing in .*: {why}", out), out
    assert re.search(rf"rank 0: FAILURE close: the ranks did not all write the same steps to .*{why}", out), out


@pytest.mark.parametrize("how", [pytest.param("mpirun", marks=needs_mpi), "torchrun"])
def test_ranks_opening_with_different_keep_policies_all_fail_to_open(tmp_path, how):
    """keep= on rank 1 alone was ignored without a word (rank 0 applies retention)."""
    run = str(tmp_path / "run")
    out = launch(how, 2, "train", run, "--model", "ddp", "--fail-rank", "1", "--fail-how", "keep", timeout=HANG_S)
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: FAILURE open: not every rank could open .* for writing: rank 1 has "
                         r"keep=KeepLast\(n=2\) and rank 0 keep=None: pass the same keep= on every rank", out), out


@pytest.mark.parametrize("how, backend", BOTH)
def test_rank_0_failing_to_open_the_index_fails_the_step_on_every_rank(tmp_path, how, backend):
    run = str(tmp_path / "run")
    out = launch(how, 2, "train", run, "--model", "ddp", "--backend", backend, "--steps", "3",
                 "--fail-how", "index", timeout=HANG_S)
    assert re.findall(r"rank \d+: steps (\[.*\])", out) == ["[1, 2]"] * 2, out
    assert re.search(r"rank 0: FAILURE .*step 0 .*not committed: OSError: injected failure to open the index", out)
    assert re.search(r"rank 1: FAILURE .*step 0 .*rank 0 of 2: OSError: injected failure to open the index", out), out


@pytest.mark.parametrize("how", [pytest.param("mpirun", marks=needs_mpi), "torchrun"])
def test_finite_values_whose_squares_overflow_are_committed_with_their_statistics(tmp_path, how):
    """Rank 0 merging the blocks' statistics raised OverflowError (not caught: the other
    ranks waited for its verdict forever). The merged statistics are those of one process."""
    run = str(tmp_path / "run")
    out = launch(how, 2, "train", run, "--model", "ddp", "--steps", "2", "--fail-how", "huge", timeout=HANG_S)
    assert re.findall(r"rank \d+: steps (\[.*\])", out) == ["[0, 1]"] * 2, out
    huge = torch.full((4, 8), 2e200, dtype=torch.float64)
    huge[2:] *= -1
    with dh.Checkpointer(str(tmp_path / "one")) as one:  # the statistics of one process, for the same tensor
        one.write(0, torch.nn.Linear(1, 1), huge=huge)
    stats = ["mean", "std", "norm", "min", "max"]
    with dh.open(run) as h, dh.open(str(tmp_path / "one")) as alone:
        assert torch.equal(h.read("extra/huge", 1), huge)
        row = h.tensors(1).set_index("name").loc["extra/huge", stats]
        assert row.equals(alone.tensors(0).set_index("name").loc["extra/huge", stats]), row
        assert (row["mean"], row["min"], row["max"]) == (0.0, -2e200, 2e200)


@pytest.mark.parametrize("how", [pytest.param("mpirun", marks=needs_mpi), "torchrun"])
def test_a_plain_value_that_differs_between_ranks_is_rank_0s_and_said_once(tmp_path, how):
    run = str(tmp_path / "run")
    out = launch(how, 2, "train", run, "--model", "ddp", "--steps", "3", "--fail-how", "values", timeout=HANG_S)
    assert re.findall(r"rank \d+: steps (\[.*\])", out) == ["[0, 1, 2]"] * 2, out
    said = re.findall(r"RuntimeWarning: datastates-hist: at step (\d+) of .*, other ranks' plain values differ from "
                      r"rank 0's: 'extra/loader' \(rank 1\); the history keeps rank 0's", out)
    assert said == ["0"], out
    with dh.open(run) as h:
        assert [h.step_data(s).values["items"]["extra/loader"] for s in range(3)] == [{"position": s} for s in range(3)]


def _suffix(how: str, backend: str) -> str:
    return "bp" if (how, backend) == ("mpirun", "adios2") else "ranks"


# --- the pieces, without launching ranks -------------------------------------------------

def test_replicated_tensors_are_split_into_disjoint_parts_that_cover_them():
    import torch

    items = [TensorItem(f"t{i}", torch.zeros(shape)) for i, shape in
             enumerate([(1000, 8), (7, 3), (5,), (), (64, 64), (3, 2)])]
    for size in (1, 2, 3, 4, 8):
        parts = [split_replicated(items, r, size) for r in range(size)]
        records = [[TensorRecord(p.name, "float32", tuple(p.tensor.shape), p.tensor.numel() * 4, f"c{r}",
                                 stats={}, global_shape=p.global_shape, offset=p.offset).to_json()
                    for p in part] for r, part in enumerate(parts)]
        merged = {r.name: r for r in merge_records(records, parts=True)}
        assert sorted(merged) == sorted(i.name for i in items)
        for item in items:
            assert merged[item.name].shape == tuple(item.tensor.shape)
        loads = [sum(p.tensor.numel() for p in part) for part in parts]
        assert max(loads) <= 1.5 * sum(loads) / size + 64 * 64  # balanced within one tensor


def test_the_ranks_replicated_tensors_are_compared_by_name_dtype_and_shape():
    from datastates_hist.sharding import replicated_problem

    a = [["model/w", "float32", [4, 2]], ["extra/b", "float32", [10]]]
    assert replicated_problem([a, list(a)]) is None
    said = "write() needs the same tensors on every rank (a tensor not sharded is taken as replicated): "
    assert replicated_problem([a, a[:1]]) == said + "tensor 'extra/b' is on rank 0, not on rank 1"
    assert replicated_problem([a, a, [*a, ["extra/c", "int64", []]]]) == said + \
        "tensor 'extra/c' is on rank 2, not on rank 0"
    assert replicated_problem([a, [a[0], ["extra/b", "float32", [12]]]]) == said + \
        "tensor 'extra/b' is float32[10] on rank 0 but float32[12] on rank 1"


def _rec(name, shape, offset, gshape=(4, 4)):
    return TensorRecord(name, "float32", shape, 4 * shape[0] * shape[1], "x", stats={},
                        global_shape=gshape, offset=offset).to_json()


def test_messages_between_ranks_always_encode():
    """A rank whose message raised would skip the collective the others wait in."""
    from datastates_hist.group import _decode, _encode

    message = {"step": np.int64(5), "lr": np.float32(0.5), "odd": object, "nan": math.nan}
    assert _decode(_encode(message)) == {"step": 5, "lr": 0.5, "odd": "<class 'object'>",
                                         "nan": pytest.approx(math.nan, nan_ok=True)}


def test_merged_statistics_of_finite_values_whose_squares_overflow():
    """Two blocks of opposite sign near 1e200: their squares overflow a float64 (Python's
    ** raised OverflowError); the merged figures are those of the whole tensor."""
    big = {"mean": 1e200, "std": 0.0, "norm": 2e200, "min": 1e200, "max": 1e200}
    low = {"mean": -1e200, "std": 0.0, "norm": 2e200, "min": -1e200, "max": -1e200}
    merged = combine_stats([(4, big), (4, low)])
    assert (merged["mean"], merged["min"], merged["max"], merged["nonfinite"]) == (0.0, -1e200, 1e200, 0)
    assert merged["std"] == pytest.approx(1e200, rel=1e-15)
    assert merged["norm"] == pytest.approx(8 ** 0.5 * 1e200, rel=1e-15)
    # a block with NaN keeps the norm NaN, as one process's statistics do (hypot(nan, inf) is inf)
    nan = {"mean": math.nan, "std": math.nan, "norm": math.nan, "min": math.nan, "max": math.nan, "nonfinite": 1}
    inf = {"mean": math.inf, "std": math.nan, "norm": math.inf, "min": 0.0, "max": math.inf, "nonfinite": 1}
    assert math.isnan(combine_stats([(2, nan), (2, inf)])["norm"])


def test_merging_blocks_names_a_gap_an_overlap_and_a_disagreement():
    with pytest.raises(ValueError, match=r"'w' of shape \[4, 4\]: the ranks wrote 8 of its 16"):
        merge_records([[_rec("w", (2, 4), (0, 0))], []], parts=False)
    with pytest.raises(ValueError, match=r"'w': blocks at \[0, 0\] and \[1, 0\] overlap"):
        merge_records([[_rec("w", (2, 4), (0, 0))], [_rec("w", (2, 4), (1, 0))],
                       [_rec("w", (1, 4), (3, 0))]], parts=False)
    with pytest.raises(ValueError, match=r"'w' differs between ranks"):
        merge_records([[_rec("w", (2, 4), (0, 0))], [_rec("w", (2, 4), (2, 0), gshape=(5, 4))]], parts=False)

