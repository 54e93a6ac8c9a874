"""A bounded slice of tools/fuzz_store.py: damaged runs end in a named error or a correct read.

The full run (500 cases and more per backend) is ``python tools/fuzz_store.py``.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import fuzz_store  # noqa: E402

CASES = 100


def test_fuzzed_runs_end_in_a_named_error_or_a_correct_read(backend):
    results = fuzz_store.fuzz(backend, range(CASES), seed=1, timeout=120, log=lambda *_: None)
    assert len(results) == CASES
    findings = [f"case {r['case']}: {r.get('what', '')}: {r['finding']}" for r in results if r.get("finding")]
    assert findings == []
    # the slice reaches every kind of mutation
    assert {r["mutation"] for r in results} == {m.__name__ for m in fuzz_store.MUTATIONS}
