"""A Checkpointer through fork and Ctrl-C: the run is never given back while its steps
are still being written, and a process forked from the writer neither holds the run
nor waits for steps only its parent writes.

Each case runs in a child process (a hang fails it at the timeout instead of stopping
the suite; a stray KeyboardInterrupt stays there). Commits are slowed down where a
case needs steps still in flight when it acts.
"""

import os
import subprocess
import sys

import pytest
import torch

import datastates_hist as dh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 120

PRELUDE = r"""
import os, sys, signal, threading, time, warnings
sys.path.insert(0, ROOT)
import torch
import datastates_hist as dh
from datastates_hist import commit

run, backend = sys.argv[1], sys.argv[2]


def slow_commits(seconds):
    original = commit.commit_step
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)
    commit.commit_step = slow


def state(step):
    return torch.randn(256, 256, generator=torch.Generator().manual_seed(step))
""".replace("ROOT", repr(ROOT))


def run_child(program, run_dir, backend):
    child = subprocess.run([sys.executable, "-c", PRELUDE + program, run_dir, backend],
                           capture_output=True, text=True, timeout=TIMEOUT)
    assert child.returncode == 0, child.stdout + child.stderr[-3000:]
    return child.stdout.splitlines(), child.stderr


def assert_steps_hold_their_values(run_dir, steps):
    with dh.open(run_dir) as h:
        assert h.steps == steps
        for step in steps:
            expected = torch.randn(256, 256, generator=torch.Generator().manual_seed(step))
            assert torch.equal(h.read("extra/w", step), expected), step


# A DataLoader's persistent workers are forked after the Checkpointer opened the run:
# each holds a copy of every descriptor, the writer lock's among them.
FORKED_WORKERS = r"""
import multiprocessing
ds = torch.utils.data.TensorDataset(torch.arange(16.0))
loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True,
                                     multiprocessing_context=multiprocessing.get_context("fork"))
ckpt = dh.Checkpointer(run, backend=backend)
model = torch.nn.Linear(2, 2)
step = 0
for epoch in range(2):
    for (batch,) in loader:
        ckpt.write(step, model, w=state(step))
        step += 1
ckpt.close()
workers = loader._iterator._workers
assert all(w.is_alive() for w in workers), "the workers ended: nothing was tested"
with dh.Checkpointer(run, backend=backend) as again:  # this process, the workers alive
    again.write(step, model, w=state(step))
other = f"import sys; sys.path.insert(0, {ROOT!r}); import datastates_hist as dh; dh.Checkpointer({run!r}).close()"
import subprocess
opened = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True)
print("another process:", opened.returncode, opened.stderr.strip()[-300:])
print("workers alive:", all(w.is_alive() for w in workers))
""".replace("ROOT", repr(ROOT))


def test_forked_workers_do_not_keep_the_run_locked(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    out, _ = run_child(FORKED_WORKERS, run_dir, backend)
    assert out == ["another process: 0 ", "workers alive: True"]
    assert_steps_hold_their_values(run_dir, list(range(9)))


# The child of a fork has none of its parent's threads: it must neither wait for the
# steps in flight (in the training hooks, at its exit: it would hang) nor write through
# the inherited Checkpointer. The last snapshot is still being copied at the fork.
FORKED_CHILD = r"""
from datastates_hist import snapshot
slow_commits(0.2)
copy = snapshot.Snapshotter._copy
def slow_copy(self, ckpt):
    if ckpt.step == 3:
        time.sleep(1)
    return copy(self, ckpt)
snapshot.Snapshotter._copy = slow_copy
model = torch.nn.Linear(2, 2)
ckpt = dh.Checkpointer(run, backend=backend)
for step in range(4):
    ckpt.write(step, model, w=state(step))
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(read)
    model(torch.ones(1, 2))  # the forward hook waits for nothing here
    said = []
    for call in (lambda: ckpt.write(10, model, w=state(10)), ckpt.wait):
        try:
            call()
            said.append("went through")
        except RuntimeError as exc:
            said.append(str(exc))
    said = said[0] if said[0] == said[1] else repr(said)
    os.write(write, said.encode())
    os.close(write)
    with ckpt:  # __exit__ and the exit handler: close() of an inherited Checkpointer
        pass
    sys.exit(0)  # a normal exit: atexit handlers run
os.close(write)
said = os.read(read, 4096).decode()
_, status = os.waitpid(pid, 0)
for step in range(4, 6):
    ckpt.write(step, model, w=state(step))
ckpt.close()
print("child:", said.replace(str(os.getpid()), "PID"))
print("child exit status:", status)
"""


def test_a_forked_child_leaves_the_checkpointer_to_its_parent(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    out, err = run_child(FORKED_CHILD, run_dir, backend)
    assert out == [f"child: the Checkpointer of {run_dir} belongs to process PID, which this one was forked "
                   "from: a forked process cannot use it (open a History to read)", "child exit status: 0"]
    assert err == ""
    assert_steps_hold_their_values(run_dir, list(range(6)))


# Ctrl-C twice while close() waits: the first in the wait for the commits, the second
# while the threads are being ended. Each is sent once the main thread is blocked there.
CTRL_C_TWICE = r"""
then = sys.argv[3]  # after the interrupted close(): close() again, end the program, or a step fails meanwhile
slow_commits(0.5)
if then == "failure":
    import errno
    slowed = commit.commit_step
    def failing(index, backend, step, *args, **kwargs):
        if step == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return slowed(index, backend, step, *args, **kwargs)
    commit.commit_step = failing
main = threading.main_thread()


def inside(function, file):
    frame = sys._current_frames().get(main.ident)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_code.co_filename.endswith(file):
            return True
        frame = frame.f_back
    return False


def interrupt():
    for function in ("wait", "close"):  # Pipeline.wait(), then Pipeline.close()
        while not inside(function, os.path.join("datastates_hist", "pipeline.py")):
            time.sleep(0.001)
        time.sleep(0.05)  # blocked in it
        signal.pthread_kill(main.ident, signal.SIGINT)


model = torch.nn.Linear(2, 2)
ckpt = dh.Checkpointer(run, backend=backend)
for step in range(5):
    ckpt.write(step, model, w=state(step))
threading.Thread(target=interrupt).start()
with warnings.catch_warnings(record=True) as warned:
    warnings.simplefilter("always")
    try:
        ckpt.close()
        print("close() returned")
    except KeyboardInterrupt:
        print("close() interrupted")
print("warned:", [str(w.message).replace(run, "RUN") for w in warned])
try:
    dh.Checkpointer(run, backend=backend)
    print("opened by a second writer")
except dh.StoreLockedError as exc:
    print("second writer:", str(exc).replace(run, "RUN"))
print("committed when refused:", len(dh.open(run).steps) < 5)
if then == "exit":
    sys.exit(0)  # the exit handler waits for the steps in flight
try:
    ckpt.close()  # waits for the steps in flight
except dh.CheckpointError as exc:
    print("close() again:", str(exc).replace(run, "RUN"))
print("threads:", sorted(t.name for t in threading.enumerate() if t.name.startswith("dh-")))
with dh.Checkpointer(run, backend=backend) as again:
    again.write(5, model, w=state(5))
"""


@pytest.mark.parametrize("then", ["close", "exit", "failure"])
def test_ctrl_c_twice_in_close_keeps_the_run_until_its_steps_are_written(tmp_path, backend, then):
    run_dir = str(tmp_path / "run")
    child = subprocess.run([sys.executable, "-c", PRELUDE + CTRL_C_TWICE, run_dir, backend, then],
                           capture_output=True, text=True, timeout=TIMEOUT)
    assert child.returncode == 0, child.stdout + child.stderr[-3000:]
    expected = [
        "close() interrupted",
        "warned: " + repr(["datastates-hist: close() of RUN was interrupted while steps were being written: they "
                           "are finished in the background, and the run stays locked until they are (close() "
                           "again, or the program's end, waits for them)"]),
        "second writer: RUN is being written by a Checkpointer of this process whose close() was interrupted: "
        "it still writes the steps it had in flight (call its close() again to wait for them)",
        "committed when refused: True",
    ]
    if then == "failure":
        expected.append("close() again: checkpoint of step 3 in RUN failed and was not committed: OSError: "
                        "[Errno 28] No space left on device; no space left on device: free space, then write "
                        "again (committed steps are intact)")
    if then != "exit":
        expected.append("threads: []")
    assert child.stdout.splitlines() == expected, child.stderr
    assert child.stderr == ""
    committed = {"close": [0, 1, 2, 3, 4, 5], "exit": [0, 1, 2, 3, 4], "failure": [0, 1, 2, 4, 5]}[then]
    assert_steps_hold_their_values(run_dir, committed)


# Ctrl-C in write() just before the step reaches the snapshot thread (the step is not
# written: write() may be called for it again) or just after (it is written). Without
# extras, the step holds no tensor that the next forward waits for (a Linear has no buffers).
CTRL_C_IN_WRITE = r"""
from datastates_hist import snapshot
when, extras = sys.argv[3], sys.argv[4] == "extras"
original, interrupted_once = snapshot.Snapshotter.submit, []
def interrupted(self, ckpt):
    if ckpt.step == 2 and not interrupted_once:
        interrupted_once.append(ckpt.step)
        if when == "after":
            original(self, ckpt)
        raise KeyboardInterrupt
    original(self, ckpt)
snapshot.Snapshotter.submit = interrupted
model = torch.nn.Linear(2, 2)
with dh.Checkpointer(run, backend=backend) as ckpt:
    for step in range(4):
        try:
            ckpt.write(step, model, **({"w": state(step)} if extras else {}))
        except KeyboardInterrupt:
            print("interrupted at", step)
            try:
                ckpt.write(step, model, **({"w": state(step)} if extras else {}))
                print("written again")
            except dh.StepOrderError as exc:
                print(str(exc).replace(run, "RUN"))
"""


@pytest.mark.parametrize("extras", ["extras", "model"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_ctrl_c_in_write_leaves_nothing_to_wait_for(tmp_path, backend, when, extras):
    run_dir = str(tmp_path / "run")
    child = subprocess.run([sys.executable, "-c", PRELUDE + CTRL_C_IN_WRITE, run_dir, backend, when, extras],
                           capture_output=True, text=True, timeout=TIMEOUT)
    assert child.returncode == 0, child.stderr[-3000:]
    again = ("written again" if when == "before" else
             "step 2 is not after step 2, the newest in RUN; steps only grow (to branch from an earlier step, "
             "call truncate(after=...) first)")
    assert child.stdout.splitlines() == ["interrupted at 2", again], child.stderr
    if extras == "extras":
        assert_steps_hold_their_values(run_dir, list(range(4)))
    else:
        with dh.open(run_dir) as h:
            assert h.steps == list(range(4))


# close() from several threads at once (a training thread and a watchdog, say): each
# returns once every step is committed, and the lock's descriptor is closed only once
# (closed twice, the second close() failed with EBADF, or closed a file opened since).
CONCURRENT_CLOSE = r"""
slow_commits(0.1)
ckpt = dh.Checkpointer(run, backend=backend)
for step in range(4):
    ckpt.write(step, torch.nn.Linear(2, 2), w=state(step))
lock_fd, close_fd = ckpt._lock_fd, os.close
def slow_close(fd):  # every thread that gets there closes the lock before any forgets it
    if fd == lock_fd:
        time.sleep(0.3)
    close_fd(fd)
os.close = slow_close
start = threading.Barrier(3)
outcomes = []
def close():
    start.wait()
    try:
        ckpt.close()
        outcomes.append(("closed", None))
    except BaseException as exc:
        outcomes.append((type(exc).__name__, str(exc)))
threads = [threading.Thread(target=close) for _ in range(3)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(sorted(outcomes))
dh.Checkpointer(run, backend=backend).close()  # the run was given back
"""


def test_close_from_several_threads_at_once(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    out, _ = run_child(CONCURRENT_CLOSE, run_dir, backend)
    assert out == ["[('closed', None), ('closed', None), ('closed', None)]"]
    assert_steps_hold_their_values(run_dir, list(range(4)))


# A Ctrl-C may land while close() gives the run back (here: as it closes the index):
# close() again gives it back, as the error of the next writer says to do.
INTERRUPTED_GIVING_BACK = r"""
ckpt = dh.Checkpointer(run, backend=backend)
ckpt.write(0, torch.nn.Linear(2, 2), w=state(0))
ckpt.wait()
def interrupted():
    del ckpt.index.close
    raise KeyboardInterrupt
ckpt.index.close = interrupted  # the index of the Checkpointer, closed as it gives the run back
try:
    ckpt.close()
except KeyboardInterrupt:
    print("interrupted")
try:
    dh.Checkpointer(run, backend=backend)
except dh.StoreLockedError as exc:
    print(str(exc).replace(run, "RUN"))
ckpt.close()
dh.Checkpointer(run, backend=backend).close()
print("opened again")
"""


def test_close_interrupted_while_it_gives_the_run_back(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    out, _ = run_child(INTERRUPTED_GIVING_BACK, run_dir, backend)
    assert out == ["interrupted",
                   "RUN is being written by a Checkpointer of this process whose close() was interrupted: it still "
                   "writes the steps it had in flight (call its close() again to wait for them)",
                   "opened again"]
    assert_steps_hold_their_values(run_dir, [0])
