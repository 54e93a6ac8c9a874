"""The ``datastates`` xarray engine: a run opened with ``xr.open_dataset``.

``xr.open_dataset(run, engine="datastates")`` gives every tensor of the run as a
lazy variable over ``step``, and every scalar (loss, lr) as a variable over ``step``
(:func:`.xarray_views.open_history_dataset`, which says how they are named). xarray
finds this engine through the ``xarray.backends`` entry point; ``import
datastates_hist`` does not import this module, nor xarray.

Example:
    >>> ds = xr.open_dataset("runs/gpt", engine="datastates", chunks={})
    >>> ds["model.blocks.0.qkv.weight"].isel(step=-1)[:4].values
    >>> ds["extra.data.loss"].to_pandas()
"""

from __future__ import annotations

import os

import xarray as xr
from xarray.backends import BackendEntrypoint

from .history import History
from .layout import INDEX_FILE
from .xarray_views import open_history_dataset


class DatastatesBackendEntrypoint(BackendEntrypoint):
    """``xr.open_dataset(run_dir, engine="datastates", names=..., steps=...)``."""

    description = "Open a datastates-hist run: every tensor and scalar as a variable over `step`"
    url = ""  # no public home page yet; the format is in docs/format.md
    open_dataset_parameters = ("filename_or_obj", "drop_variables", "names", "steps")

    def open_dataset(self, filename_or_obj, *, drop_variables=None, names=None, steps=None) -> xr.Dataset:
        """Open the run at ``filename_or_obj``; ``names``: glob(s) or names, ``steps``: see
        :func:`.xarray_views.select_steps`."""
        if isinstance(drop_variables, str):
            drop_variables = [drop_variables]
        history = History(os.fspath(filename_or_obj))
        try:
            ds = open_history_dataset(history, names, steps, drop_variables or ())
        except BaseException:
            history.close()
            raise
        ds.set_close(history.close)
        return ds

    def guess_can_open(self, filename_or_obj) -> bool:
        try:
            return os.path.isfile(os.path.join(os.fspath(filename_or_obj), INDEX_FILE))
        except TypeError:
            return False
