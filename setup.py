"""The optional C kernel of datastates_hist.digest; everything else is in pyproject.toml.

``optional=True``: without a C compiler the package installs anyway and the
digest runs on numpy (slower, the same results to rounding).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("datastates_hist._fused", ["datastates_hist/_fused.c"],
                             extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"], optional=True)])
