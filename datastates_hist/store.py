"""Read access to a run: its layout, its index, and verified reads of step data.

Layout of a run directory::

    RUN/index.sqlite      the index (committed steps, tensor records, statistics)
    RUN/steps/<step>.bp   one unit of step data per step (file or folder, by backend)
    RUN/writer.lock       held by the one process that may write
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from .backends import get_backend
from .backends.base import StepReader
from .digest import checksum_bytes
from .dtypes import storage_dtype, torch_dtype
from .errors import CorruptionError, StepNotFoundError, StoreNotFoundError
from .index import Index, StepRow
from .items import TensorRecord

STEPS_DIR = "steps"


def steps_dir(run_dir: str) -> str:
    return os.path.join(run_dir, STEPS_DIR)


class StepData:
    """An open step: its records and plain values, and verified tensor reads."""

    def __init__(self, run_dir: str, row: StepRow, reader: StepReader):
        self.run_dir, self.row, self.reader = run_dir, row, reader
        try:
            raw = reader.manifest()
        except Exception as exc:
            raise CorruptionError(
                f"the manifest of step {row.step} in {run_dir} cannot be read: the step's data is damaged ({exc})"
            ) from exc
        if checksum_bytes(raw) != row.manifest_checksum:
            raise CorruptionError(
                f"the manifest of step {row.step} in {run_dir} does not match its checksum: "
                "the step's data is damaged"
            )
        doc = json.loads(raw)
        self.records = {r["name"]: TensorRecord.from_json(r) for r in doc["tensors"]}
        self.values: dict[str, Any] = doc["values"]

    def read(self, name: str, verify: bool = True) -> torch.Tensor:
        """Tensor ``name`` in host memory, its checksum verified."""
        shape = self._record(name).shape
        try:
            out = self._read(name, (0,) * len(shape), shape)
        except Exception as exc:
            raise CorruptionError(
                f"tensor {name!r} of step {self.row.step} in {self.run_dir} cannot be read: {exc}"
            ) from exc
        if verify and checksum_bytes(out.reshape(-1).view(np.uint8)) != self.records[name].checksum:
            raise CorruptionError(
                f"tensor {name!r} of step {self.row.step} in {self.run_dir} does not match its "
                "checksum: the stored data is damaged"
            )
        return torch.from_numpy(out).view(torch_dtype(self.records[name].dtype))

    def read_box(self, name: str, start: tuple[int, ...], count: tuple[int, ...]) -> torch.Tensor:
        """The box ``start``/``count`` of tensor ``name``, read alone.

        A part of a tensor cannot be checked against the whole tensor's checksum:
        use :meth:`read` (or ``datastates-hist verify``) where that matters.
        """
        out = self._read(name, tuple(start), count)
        return torch.from_numpy(out).view(torch_dtype(self.records[name].dtype))

    def _record(self, name: str) -> TensorRecord:
        rec = self.records.get(name)
        if rec is None:
            raise KeyError(f"step {self.row.step} has no tensor {name!r}")
        return rec

    def _read(self, name: str, start: tuple[int, ...], count) -> np.ndarray:
        """The box's stored bytes, as an array of the storage dtype."""
        out = np.empty(count, dtype=storage_dtype(torch_dtype(self._record(name).dtype)))
        if out.size:
            self.reader.read(name, out, start)
        return out

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> "StepData":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Store:
    """A run opened for reading (safe while a writer appends)."""

    def __init__(self, run_dir: str):
        if not os.path.isdir(run_dir):
            raise StoreNotFoundError(f"no run at {run_dir}")
        self.run_dir = run_dir
        self.index = Index(run_dir)

    def steps(self) -> list[int]:
        return self.index.steps()

    def row(self, step: int) -> StepRow:
        row = self.index.step_row(step)
        if row is None:
            steps = self.index.steps()
            have = f"committed steps: {steps[0]}..{steps[-1]} ({len(steps)})" if steps else "no committed steps"
            raise StepNotFoundError(f"step {step} is not committed in {self.run_dir} ({have})")
        return row

    def latest(self) -> int:
        latest = self.index.latest()
        if latest is None:
            raise StepNotFoundError(f"{self.run_dir} has no committed steps")
        return latest

    def records(self, step: int) -> list[TensorRecord]:
        records = self.index.records(step)
        if not records:  # the step is not committed, or was pruned: its rows go in one transaction
            self.row(step)
        return records

    def open_step(self, step: int) -> StepData:
        row = self.row(step)
        try:
            return self._open(row)
        except Exception as exc:
            # A writer may have pruned the step (or truncated and rewritten it)
            # between reading its row and opening its data: that is no damage.
            now = self.index.step_row(step)
            if now is None:
                raise StepNotFoundError(
                    f"step {step} was removed from {self.run_dir} while it was being opened"
                ) from exc
            if now != row:
                return self._open(now)
            raise

    def _open(self, row: StepRow) -> StepData:
        step, backend = row.step, get_backend(row.backend)
        try:
            reader = backend.open_step(steps_dir(self.run_dir), row.location)
        except FileNotFoundError as exc:
            raise CorruptionError(f"step {step} is committed in {self.run_dir} but its data is missing: {exc}") from exc
        except Exception as exc:  # damaged files fail in whatever way their library chooses
            raise CorruptionError(f"the data of step {step} in {self.run_dir} is damaged: {exc}") from exc
        try:
            return StepData(self.run_dir, row, reader)
        except BaseException:
            reader.close()
            raise

    def close(self) -> None:
        self.index.close()
