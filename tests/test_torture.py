"""Crash torture, short: processes really killed with SIGKILL in every phase of a checkpoint.

``tools/torture.py`` runs the same with 100 kills. Here each backend gets one
kill aimed at each of the snapshot copy, the flush, the publish (fsync and
rename), the index commit, retention (prune and truncate; with policies,
demotion), the opening of the run (restore and verify), and a random moment:
once with a child that prunes and truncates, once with a child whose
Checkpointer keeps a history by policies (``--policies``: ``KeepLast(2) |
KeepEvery(25)``, a trajectory of the model, deltas). After each kill a new
process restores the newest committed step, verifies every checksum of the run
(decoding every delta chain) and resumes writing; no committed step may be
lost, and with policies every step's model tensors are the values written.

Then, on a run of its own, each of ``repair``, ``prune`` and ``close()`` is
killed a few times (``tools/torture.py --during repair,prune,close`` runs 100
each): after a killed repair, a second repair commits every step again; after
a killed prune only the steps it announced are gone; after a killed close
every step committed at the kill is still committed.
"""

import pytest

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import torture  # noqa: E402

KILLS = len(torture.TARGETS)  # each phase once


@pytest.mark.parametrize("policies", [False, True], ids=["prune", "policies"])
def test_sigkill_at_every_phase_loses_no_committed_step(tmp_path, backend, policies):
    run = torture.Torture(str(tmp_path / "run"), backend, seed=1, policies=policies, held=True)
    ok = run.run(KILLS)
    summary = run.summary()
    assert ok and run.failures == [], summary
    assert sum(run.kills.values()) == KILLS and set(run.kills) == set(torture.TARGETS), summary
    assert run.lost == 0
    # every child that opened a run with steps restored its newest (else a failure is
    # recorded); only children killed while opening did not get that far
    assert run.restores >= KILLS - run.kills["startup"], summary
    assert run.verified > 0 and len(run.final_steps) >= 3
    # each kill aimed at a phase is held at its entry: it lands in that phase
    assert {p for p in torture.WRITE_PHASES if run.kills[p]} <= set(run.landed), summary
    if policies:  # retention demoted the older steps; the newest restores
        assert run.final_steps[-1] in run.final_restore_points, summary
        assert len(run.final_restore_points) < len(run.final_steps), summary
        assert run.model_checksums > 0, summary


OP_KILLS = 3


@pytest.mark.parametrize("op", list(torture.OP_TARGETS))
def test_sigkill_during_repair_prune_and_close_loses_no_committed_step(tmp_path, backend, op):
    run = torture.OperationTorture(str(tmp_path / "run"), backend, op, seed=1)
    ok = run.run(OP_KILLS)
    summary = run.summary()
    assert ok and run.failures == [], summary
    assert run.lost == 0, summary
    targets = torture.OP_TARGETS[op]
    assert dict(run.kills) == {t: OP_KILLS // len(targets) for t in targets}, summary
    assert run.landed[op] >= 1, summary  # the kills really hit the operation
    if op != "repair":  # only a repair killed between its renames leaves the run without an index
        assert run.refusals == [], summary
    # the writer children restored the newest step and verified every checksum (a truncate on
    # purpose may leave a child an empty run, so not every child has a step to restore)
    assert run.restores >= 1 and run.verified > 0 and run.final_steps, summary
