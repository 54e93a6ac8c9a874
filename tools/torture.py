"""Crash torture: kill a checkpointing process with SIGKILL, again and again.

A child process trains a small model and checkpoints every step into one run,
pruning old steps every few steps and now and then truncating the newest ones
(branching). The parent kills it with SIGKILL at chosen moments: while it
copies a snapshot, flushes pieces, publishes a step (fsync and rename),
commits the index row, removes steps (retention), opens the run (restore and
verify), or at a random time. After each kill a new child opens the same run,
restores the newest committed step, verifies every checksum of every step
(:func:`datastates_hist.verify.verify_run`) and resumes writing.

Checked after every kill: no committed step was lost (a step committed before
the kill is still committed after it, unless the child was removing it on
purpose), the newest step restores with its own values, no data is left that
no index row names, and no checksum fails. Zero failures are allowed.

With ``--policies`` the child's Checkpointer keeps a history instead:
``keep=KeepLast(2) | KeepEvery(25)``, ``trajectory=Trajectory("model/*")`` and
the default codec (deltas), so retention demotes restore points to trajectory
points on the flusher thread after every commit; the child neither prunes nor
truncates. Checked besides: every committed step stays committed (a trajectory
of every step removes none), the model tensors of every committed step are
stored with the checksums of the values written (the child journals them;
verify decodes every delta chain against them), every unit on disk is one that
an index row names (a step's main unit, and a restore point's restore unit),
and the newest step is a restore point.

With ``--during repair,prune,close`` a child is killed instead while it runs
``repair_run(force=True)`` (building the new index, swapping it in, or at a
random moment), ``prune`` (deleting rows, deleting data, or at random), or
``close()`` (with writes still to commit); each operation gets its own run,
grown by a writer child (not killed) before every kill. The parent then opens
the run as the next writer would, and checks: after a repair, every step
committed before it is committed again after a second repair (which reads
every tensor); after a prune, only steps the prune announced are gone; after
a close, every step committed at the kill is still committed, and when close
returned before the kill, every write issued before it is committed.

    python tools/torture.py --kills 100 --backend adios2
    python tools/torture.py --kills 100 --backend adios2 --policies
    python tools/torture.py --kills 100 --during repair,prune,close

Children are forked from a forkserver that has imported torch and the library
once, so that a restart costs milliseconds, not seconds.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import mmap
import multiprocessing
import os
import random
import shutil
import struct
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# One byte per phase in a shared page: 1 while some thread of the child is in it.
WRITE_PHASES = ("snapshot", "flush", "publish", "index commit", "retention", "startup")
OP_PHASES = ("repair", "repair build", "repair swap", "prune", "prune rows", "prune data", "close")
PHASES = WRITE_PHASES + OP_PHASES
SLOT = {name: i for i, name in enumerate(PHASES)}
WRITES_AT = 32  # int32: writes issued by the current child
HOLD_AT = 36  # byte: a phase (its slot + 1) whose thread, once inside, stays there until the kill
HOLDING_AT = 37  # byte: the phase (its slot + 1) a thread is held in now
TARGETS = WRITE_PHASES + ("anywhere",)
# the phases each operation's kills aim at, in turn; the operation itself: a random moment in it
OP_TARGETS = {"repair": ("repair build", "repair swap", "repair"),
              "prune": ("prune rows", "prune data", "prune"),
              "close": ("close",)}
GROW_WRITES, CLOSE_WRITES = 3, 4
PRUNE_EVERY, KEEP_LAST, KEEP_EVERY = 5, 4, 25
TRUNCATE_EVERY = 11


# --- the child ----------------------------------------------------------------------------

def _instrument(shared: mmap.mmap) -> None:
    """Mark, in ``shared``, when the child is inside each phase (wrapping library calls)."""
    from datastates_hist import repair, retention
    from datastates_hist.backends.base import Backend, StagedStepWriter
    from datastates_hist.checkpointer import Checkpointer
    from datastates_hist.flush import Flusher
    from datastates_hist.index import Index
    from datastates_hist.snapshot import Snapshotter

    def mark(owner, attr, phase):
        original = getattr(owner, attr)

        def marked(*args, **kwargs):
            shared[SLOT[phase]] = 1
            try:
                while shared[HOLD_AT] == SLOT[phase] + 1:  # the parent kills the child here
                    shared[HOLDING_AT] = SLOT[phase] + 1
                    time.sleep(0.001)
                return original(*args, **kwargs)
            finally:
                shared[SLOT[phase]] = 0

        setattr(owner, attr, marked)

    mark(Snapshotter, "_copy", "snapshot")
    mark(Flusher, "_put", "flush")
    mark(StagedStepWriter, "publish", "publish")
    mark(Index, "commit_step", "index commit")
    mark(retention, "remove_steps", "retention")
    mark(retention, "demote_steps", "retention")
    mark(repair, "repair_run", "repair")
    mark(repair, "_build_aside", "repair build")
    mark(repair, "_swap_in", "repair swap")
    mark(Checkpointer, "prune", "prune")
    mark(Index, "delete_steps", "prune rows")
    mark(Backend, "remove_step", "prune data")
    mark(Checkpointer, "close", "close")


def make_model(seed: int):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _shared(shared_path: str) -> mmap.mmap:
    with open(shared_path, "r+b") as f:
        return mmap.mmap(f.fileno(), 64)


def train_step(model, opt) -> None:
    import torch

    model(torch.randn(16, 128)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def history_policies() -> dict:
    """The Checkpointer arguments of ``--policies``: a history kept by retention."""
    import datastates_hist as dh

    return dict(keep=dh.KeepLast(2) | dh.KeepEvery(25), trajectory=dh.Trajectory("model/*"))


def named_units(index) -> list[str]:
    """The units the index rows name: each step's, and a restore point's restore unit."""
    from datastates_hist.layout import restore_unit

    return sorted([r.location for r in index.step_rows()] +
                  [restore_unit(r.location) for r in index.step_rows() if r.tier == "restore"])


def journal_written(journal: str, step: int, model) -> None:
    """Say in the journal which values of the model's tensors step ``step`` writes."""
    import torch

    from datastates_hist.digest import checksum_bytes

    sums = {f"model/{name}": checksum_bytes(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
            for name, t in model.state_dict().items()}
    with open(journal, "a") as f:
        f.write(json.dumps({"written": step, "model": sums}) + "\n")


def run_state(run_dir: str, index, policies: bool) -> dict:
    """What the parent checks of a run: its steps, restore points, units on disk and
    those the index names, and (``policies``) the model tensors' checksums per step."""
    rows = index.step_rows()
    return {"steps": [r.step for r in rows], "restore_points": [r.step for r in rows if r.tier != "trajectory"],
            "units": sorted(os.listdir(os.path.join(run_dir, "steps"))), "named": named_units(index),
            "model": {r.step: {t.name: t.checksum for t in index.records(r.step) if t.name.startswith("model/")}
                      for r in rows} if policies else {}}


def child_main(run_dir: str, backend: str, shared_path: str, journal: str, reports: str, *args) -> None:
    """:func:`write_child`; an exception it raises is reported with its traceback (a child
    that exits with 1 tells the parent why)."""
    try:
        write_child(run_dir, backend, shared_path, journal, reports, *args)
    except BaseException:
        with open(reports, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "error": traceback.format_exc()}) + "\n")
        raise


def write_child(run_dir: str, backend: str, shared_path: str, journal: str, reports: str,
                seed: int, max_writes: int | None, branch: bool = True, policies: bool = False) -> None:
    """Open the run, restore the newest step, verify everything, then train and checkpoint
    (pruning now and then, and, if ``branch``, truncating the newest steps now and then;
    with ``policies``, retention keeps the history instead, see :func:`history_policies`)."""
    import torch

    import datastates_hist as dh
    from datastates_hist.retention import doomed
    from datastates_hist.retention import policies as rules
    from datastates_hist.verify import verify_run

    torch.set_num_threads(1)
    shared = _shared(shared_path)
    _instrument(shared)
    shared[SLOT["startup"]] = 1
    model, opt = make_model(seed)
    ckpt = dh.Checkpointer(run_dir, backend=backend, host_cache_bytes=64 << 10, piece_bytes=8 << 10,
                           **(history_policies() if policies else {}))
    steps = ckpt.steps()
    report = {"pid": os.getpid(), "restored": None, "value": None, **run_state(run_dir, ckpt.index, policies)}
    if steps:
        restored = ckpt.restore(model=model, optimizer=opt)
        report["restored"], report["value"] = restored.step, restored.extra.get("data")
    problems = verify_run(run_dir)
    report["problems"] = [str(p) for p in problems]
    report["tensors_verified"] = sum(r.ntensors for r in ckpt.index.step_rows())
    with open(reports, "a") as f:
        f.write(json.dumps(report) + "\n")
    shared[SLOT["startup"]] = 0

    step, writes = (steps[-1] + 1 if steps else 0), 0
    while max_writes is None or writes < max_writes:
        train_step(model, opt)
        if policies:
            journal_written(journal, step, model)
        ckpt.write(step, model, opt, data={"step": step})
        writes += 1
        struct.pack_into("<i", shared, WRITES_AT, writes)
        if not policies and step % PRUNE_EVERY == PRUNE_EVERY - 1:
            ckpt.wait()
            _retention(journal, doomed(ckpt.steps(), rules(KEEP_LAST, KEEP_EVERY)),
                       lambda: ckpt.prune(keep_last=KEEP_LAST, keep_every=KEEP_EVERY))
        if branch and not policies and step % TRUNCATE_EVERY == TRUNCATE_EVERY - 1:
            ckpt.wait()  # branch: drop the two newest steps and write them again
            after = step - 2
            _retention(journal, [s for s in ckpt.steps() if s > after], lambda: ckpt.truncate(after=after))
            step = after
        step += 1
    ckpt.close()


def op_main(op: str, run_dir: str, backend: str, shared_path: str, journal: str, seed: int) -> None:
    """Run one operation on the run (to be killed in it): ``repair``, ``prune`` or ``close``."""
    import torch

    import datastates_hist as dh
    from datastates_hist import repair
    from datastates_hist.retention import doomed, policies

    torch.set_num_threads(1)
    _instrument(_shared(shared_path))
    if op == "repair":
        repair.repair_run(run_dir, force=True)  # through the module: the instrumented function
        return
    ckpt = dh.Checkpointer(run_dir, backend=backend, host_cache_bytes=64 << 10, piece_bytes=8 << 10)
    if op == "prune":
        _retention(journal, doomed(ckpt.steps(), policies(keep_last=2)), lambda: ckpt.prune(keep_last=2))
        ckpt.close()
        return
    model, opt = make_model(seed)
    step, issued = (ckpt.steps() or [-1])[-1] + 1, []
    for _ in range(CLOSE_WRITES):  # left to commit in the background: close() waits for them
        train_step(model, opt)
        ckpt.write(step, model, opt, data={"step": step})
        issued.append(step)
        step += 1
    ckpt.close()
    with open(journal, "a") as f:
        f.write(json.dumps({"closed": issued}) + "\n")


def _retention(journal: str, victims: list[int], remove) -> None:
    """Remove steps on purpose, saying so first in the journal (the parent excuses them)."""
    with open(journal, "a") as f:
        f.write(json.dumps({"remove": victims}) + "\n")
    remove()
    with open(journal, "a") as f:
        f.write(json.dumps({"done": True}) + "\n")


# --- the parent ---------------------------------------------------------------------------

class Torture:
    """Runs the children, kills them, and checks the run after every kill."""

    targets = TARGETS  # where the kills aim, in turn

    def __init__(self, run_dir: str, backend: str, seed: int = 0, policies: bool = False, held: bool = False):
        """``held``: every kill aimed at a phase lands at its entry (the child's thread is
        held there until the kill), so that each kill is in the phase it aims at; else at a
        random moment inside it, which a short phase may have left by the kill."""
        self.run_dir, self.backend, self.policies, self.held = run_dir, backend, policies, held
        self.rng = random.Random(seed)
        work = os.path.dirname(os.path.abspath(run_dir))
        self.shared_path = os.path.join(work, "torture.shared")
        self.journal = os.path.join(work, "torture.journal")
        self.reports = os.path.join(work, "torture.reports")
        with open(self.shared_path, "wb") as f:
            f.write(b"\0" * 64)
        for path in (self.journal, self.reports):
            open(path, "w").close()
        with open(self.shared_path, "r+b") as f:
            self.shared = mmap.mmap(f.fileno(), 64)
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "datastates_hist", "datastates_hist.verify",
                                         "datastates_hist.backends.adios2_bp5",
                                         "datastates_hist.backends.hdf5", __name__])
        self.kills = collections.Counter()  # target phase -> kills
        self.landed = collections.Counter()  # phase the child was really in at the kill
        self.restores = self.verified = self.lost = self.children = 0
        self.failures: list[str] = []
        self.seen_reports = 0
        self.model_checksums = 0  # model tensors of committed steps compared with what was written
        self.final_restore_points: list[int] = []

    def _start(self, max_writes: int | None = None, branch: bool = True):
        self.shared[:] = b"\0" * 64
        child = self.ctx.Process(target=child_main, args=(
            self.run_dir, self.backend, self.shared_path, self.journal, self.reports,
            self.children, max_writes, branch, self.policies))
        child.start()
        self.children += 1
        return child

    def _wait(self, condition, child, timeout: float = 60.0) -> bool:
        """Poll ``condition`` (every 50 us) until it holds, the child exits, or time is up."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if condition():
                return True
            if not child.is_alive():
                return False
            time.sleep(0.00005)
        return False

    def _writes(self) -> int:
        return struct.unpack_from("<i", self.shared, WRITES_AT)[0]

    def _committed(self) -> list[int]:
        from datastates_hist.errors import StoreNotFoundError
        from datastates_hist.store import Store

        try:
            store = Store(self.run_dir)
        except StoreNotFoundError:  # no child has created the run yet
            return []
        try:
            return store.steps()
        finally:
            store.close()

    def _journal(self) -> list[dict]:
        with open(self.journal) as f:
            return [json.loads(line) for line in f if line.strip()]

    def _check_reports(self) -> None:
        """Every child that finished opening the run says what it found."""
        with open(self.reports) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        for report in lines[self.seen_reports:]:
            if "error" in report:
                self.failures.append(f"pid {report['pid']} raised:\n{report['error']}")
                continue
            steps = report["steps"]
            if report["problems"]:
                self.failures.append(f"pid {report['pid']}: verify found {report['problems'][:3]}")
            if steps and (report["restored"] != steps[-1] or report["value"] != {"step": steps[-1]}):
                self.failures.append(f"pid {report['pid']}: restored {report['restored']} "
                                     f"{report['value']} but the newest step is {steps[-1]}")
            self._check_state(f"pid {report['pid']} after opening", report)
            self.restores += report["restored"] is not None
            self.verified += report["tensors_verified"]
        self.seen_reports = len(lines)

    def _check_state(self, when: str, state: dict) -> None:
        """The units on disk are those the index names; with policies, the newest step is a
        restore point and every committed step's model tensors are the values written."""
        if state["units"] != state["named"]:
            self.failures.append(f"{when}: units no index row names {sorted(set(state['units']) - set(state['named']))}"
                                 f", named but missing {sorted(set(state['named']) - set(state['units']))}")
        if not self.policies or not state["steps"]:
            return
        if state["steps"][-1] not in state["restore_points"]:
            self.failures.append(f"{when}: the newest step {state['steps'][-1]} is no restore point "
                                 f"(restore points {state['restore_points'][-5:]})")
        written = {str(j["written"]): j["model"] for j in self._journal() if "written" in j}
        for step, sums in state["model"].items():
            if written.get(str(step)) != sums:
                self.failures.append(f"{when}: the model tensors of step {step} are not the values written")
            self.model_checksums += len(sums)

    def kill_once(self, target: str) -> None:
        held = self.held and target not in ("anywhere", "startup")  # startup lasts long enough
        child = self._start()
        if target == "startup":
            self._wait(lambda: self.shared[SLOT["startup"]], child)
            before, excused_from = None, None
        else:
            warmup = self.rng.randint(1, 4)  # writes before the kill, so that the run grows
            if not self._wait(lambda: not self.shared[SLOT["startup"]] and self._writes() >= warmup, child):
                self.failures.append(f"child {child.pid} did not start writing (exit {child.exitcode})")
            while not self._committed() and child.is_alive():  # the first child: until a step exists
                time.sleep(0.01)
            journal = self._journal()
            pending = [j["remove"] for j in journal[-1:] if "remove" in j]  # a removal under way
            before, excused_from = set(self._committed()), len(journal)
            if target == "anywhere":
                time.sleep(self.rng.uniform(0, 0.3))
            else:
                if held:  # after the warm-up writes: the next entry into the phase waits there
                    self.shared[HOLD_AT] = SLOT[target] + 1
                    # a thread already inside when the hold was set may leave before the kill:
                    # wait for one held at the entry
                    self._wait(lambda: self.shared[HOLDING_AT] == SLOT[target] + 1, child, timeout=10)
                else:
                    self._wait(lambda: self.shared[SLOT[target]], child, timeout=10)
        if not held and self.rng.random() < 0.5:  # sometimes a little later inside the phase
            time.sleep(self.rng.uniform(0, 0.002))
        inside = [p for p in PHASES if self.shared[SLOT[p]]]
        child.kill()
        child.join()
        self.shared[HOLD_AT] = self.shared[HOLDING_AT] = 0
        if child.exitcode != -9:
            self.failures.append(f"child {child.pid} exited with {child.exitcode} before the kill")
        self.kills[target] += 1
        for phase in inside or ["between phases"]:
            self.landed[phase] += 1
        self._check_reports()
        if before is not None:
            after = set(self._committed())
            excused = {s for j in self._journal()[excused_from:] if "remove" in j for s in j["remove"]}
            excused |= {s for steps in pending for s in steps}
            lost = sorted(before - after - excused)
            self.lost += len(lost)
            if lost:
                self.failures.append(f"kill during {target}: committed steps {lost} were lost")

    def finish(self, writes: int = 3) -> None:
        """A last child that is not killed: it must restore, verify, write and close cleanly."""
        from datastates_hist.verify import verify_run

        child = self._start(max_writes=writes)
        child.join(300)
        if child.exitcode != 0:
            self.failures.append(f"the last child exited with {child.exitcode}")
        self._check_reports()
        problems = verify_run(self.run_dir)
        if problems:
            self.failures.append(f"final verify: {[str(p) for p in problems[:3]]}")
        from datastates_hist.index import Index

        index = Index(self.run_dir)
        try:
            state = run_state(self.run_dir, index, self.policies)
        finally:
            index.close()
        self._check_state("at the end", state)
        self.final_steps, self.final_restore_points = state["steps"], state["restore_points"]

    def run(self, kills: int) -> bool:
        for k in range(kills):
            self.kill_once(self.targets[k % len(self.targets)])
        self.finish()
        return not self.failures

    def summary(self) -> str:
        lines = [
            f"torture: backend {self.backend}, run {self.run_dir}"
            + (", policies KeepLast(2) | KeepEvery(25), Trajectory('model/*'), deltas" if self.policies else ""),
            f"kills: {sum(self.kills.values())} (SIGKILL), targeted at: "
            + ", ".join(f"{t} {self.kills[t]}" for t in TARGETS),
            "  phases the child was in at the kill: "
            + ", ".join(f"{p} {n}" for p, n in sorted(self.landed.items(), key=lambda x: -x[1])),
        ]
        if self.policies:
            lines.append(f"restore points at the end: {len(self.final_restore_points)} "
                         f"({', '.join(map(str, self.final_restore_points[-4:]))}); model tensors compared "
                         f"with the values written: {self.model_checksums}")
        return "\n".join(lines + self._outcome_lines())

    def _outcome_lines(self) -> list[str]:
        """The lines every torture's summary ends with: processes, checks, losses, failures."""
        return [
            f"processes: {self.children}; restores of the newest step: {self.restores}; "
            f"tensor checksums verified: {self.verified}",
            f"committed steps at the end: {len(self.final_steps)} "
            f"(newest {self.final_steps[-1] if self.final_steps else None})",
            f"committed steps lost: {self.lost}",
            f"failures: {len(self.failures)}",
        ] + [f"  FAIL {f}" for f in self.failures[:20]]


class OperationTorture(Torture):
    """Kills a child while it runs ``repair``, ``prune`` or ``close()`` (``op``); a writer
    child, not killed, grows the run before each kill."""

    def __init__(self, run_dir: str, backend: str, op: str, seed: int = 0):
        super().__init__(run_dir, backend, seed)
        self.op, self.targets = op, OP_TARGETS[op]
        self.refusals: list[str] = []  # the next writer refused the run (then repaired)
        self.finished_first = 0  # the operation ended before the kill
        self.repaired_steps = 0

    def _grow(self) -> None:
        child = self._start(max_writes=GROW_WRITES, branch=False)  # the run grows: each kill has work
        child.join(300)
        if child.exitcode != 0:
            self.failures.append(f"the writer child {child.pid} exited with {child.exitcode}")
        self._check_reports()

    def _start_op(self):
        self.shared[:] = b"\0" * 64
        child = self.ctx.Process(target=op_main, args=(
            self.op, self.run_dir, self.backend, self.shared_path, self.journal, self.children))
        child.start()
        self.children += 1
        return child

    def _open_as_writer(self) -> str | None:
        """Open and close the run as the next writer would; why it refused, or None."""
        import datastates_hist as dh

        try:
            dh.Checkpointer(self.run_dir).close()
        except dh.CorruptionError as exc:
            return str(exc)
        return None

    def kill_once(self, target: str) -> None:
        self._grow()
        committed = set(self._committed())
        journal_from = len(self._journal())
        child = self._start_op()
        self._wait(lambda: self.shared[SLOT[target]], child, timeout=60)
        if target == self.op:  # a random moment of the whole operation
            time.sleep(self.rng.uniform(0, 0.03))
        elif self.rng.random() < 0.5:  # sometimes a little later inside the phase
            time.sleep(self.rng.uniform(0, 0.002))
        # close() commits as it goes: what it committed before the kill must stay (a repair
        # or a prune only removes, and the index may be mid-swap)
        at_kill = set(self._committed()) if self.op == "close" else set()
        inside = [p for p in PHASES if self.shared[SLOT[p]]]
        child.kill()
        child.join()
        self.kills[target] += 1
        if child.exitcode != -9:
            self.finished_first += 1
            if child.exitcode != 0:
                self.failures.append(f"the {self.op} child {child.pid} exited with {child.exitcode}")
        for phase in inside or ["between phases"]:
            self.landed[phase] += 1
        self._check_after(target, committed | at_kill, journal_from)

    def _check_after(self, target: str, before: set[int], journal_from: int) -> None:
        refusal = self._open_as_writer()
        if refusal is not None:
            self.refusals.append(refusal)
            if self.op != "repair":  # only a repair killed between its renames leaves no index
                self.failures.append(f"kill during {target}: the next writer refused the run: {refusal}")
        if self.op == "repair":
            self._repair_again()
        after = set(self._committed())
        entries = self._journal()[journal_from:]
        excused = {s for j in entries if "remove" in j for s in j["remove"]}
        lost = sorted(before - after - excused)
        for j in entries:
            if "closed" in j:  # close() returned: every write issued before it is committed
                lost += sorted(set(j["closed"]) - after)
        self.lost += len(lost)
        if lost:
            self.failures.append(f"kill during {target}: committed steps {lost} were lost")
        finished = [u for u in os.listdir(os.path.join(self.run_dir, "steps")) if not u.endswith(".partial")]
        if refusal is None and len(finished) != len(after):
            self.failures.append(f"kill during {target}: {len(finished)} units for {len(after)} committed steps")

    def _repair_again(self) -> None:
        """A second repair, not killed: every unit with data is committed again, its tensors verified."""
        from datastates_hist.repair import repair_run

        report = repair_run(self.run_dir, force=True)
        self.repaired_steps += len(report.steps)
        if report.set_aside or report.lost:
            self.failures.append(f"the second repair set aside {report.set_aside}, lost {report.lost}")

    def summary(self) -> str:
        lines = [
            f"torture: kills during {self.op}, backend {self.backend}, run {self.run_dir}",
            f"kills: {sum(self.kills.values())} (SIGKILL), targeted at: "
            + ", ".join(f"{t} {self.kills[t]}" for t in self.targets)
            + f"; the {self.op} had finished before the kill: {self.finished_first}",
            "  phases the child was in at the kill: "
            + ", ".join(f"{p} {n}" for p, n in sorted(self.landed.items(), key=lambda x: -x[1])),
            f"the next writer refused the run: {len(self.refusals)}"
            + (f" (e.g. {self.refusals[0][:100]}...)" if self.refusals else ""),
        ]
        if self.op == "repair":
            lines.append(f"second repairs: {sum(self.kills.values())}, steps they committed (every tensor "
                         f"verified): {self.repaired_steps}")
        return "\n".join(lines + self._outcome_lines())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--backend", choices=["adios2", "hdf5", "both"], default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", help="where to put the run (default: a temporary folder, removed after)")
    p.add_argument("--policies", action="store_true",
                   help="the writer keeps a history: KeepLast(2) | KeepEvery(25), Trajectory('model/*'), "
                        "deltas (with --during write)")
    p.add_argument("--during", default="write",
                   help="comma-separated: write (every phase of a checkpoint, the default), repair, prune, "
                        "close; each gets --kills kills on its own run")
    args = p.parse_args(argv)
    during = args.during.split(",")
    unknown = set(during) - {"write", *OP_TARGETS}
    if unknown:
        p.error(f"--during: unknown {', '.join(sorted(unknown))} (choose from write, {', '.join(OP_TARGETS)})")
    if args.policies and "write" not in during:
        p.error("--policies: the writer's policies apply to --during write")
    ok = True
    backends = ["adios2", "hdf5"] if args.backend == "both" else [args.backend]
    for backend, op in itertools.product(backends, during):
        work = tempfile.mkdtemp(prefix=f"torture-{op}-{backend}-", dir=args.dir)
        t0 = time.monotonic()
        run = os.path.join(work, "run")
        torture = (Torture(run, backend, seed=args.seed, policies=args.policies) if op == "write"
                   else OperationTorture(run, backend, op, seed=args.seed))
        ok &= torture.run(args.kills)
        print(torture.summary())
        print(f"time: {time.monotonic() - t0:.0f} s\n", flush=True)
        if not torture.failures:
            shutil.rmtree(work)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
