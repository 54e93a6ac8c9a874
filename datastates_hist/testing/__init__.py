"""Test suites for code that extends datastates-hist from outside (needs pytest);
``import datastates_hist`` does not import them."""

import pytest

# plain asserts in the suite report their operands, as in a test module
pytest.register_assert_rewrite("datastates_hist.testing.backend_contract")
