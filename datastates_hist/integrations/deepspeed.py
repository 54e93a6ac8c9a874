"""A DeepSpeed checkpoint engine that keeps ``engine.save_checkpoint`` in a history.

DeepSpeed saves a checkpoint as several files under ``SAVE_DIR/TAG/`` (the model
states ``mp_rank_00_model_states.pt``, with ZeRO the optimizer partitions
``zero_pp_rank_0_mp_rank_00_optim_states.pt``), each through its checkpoint
engine: ``create(info)``, ``save(state_dict, path)`` per file, then
``commit(info)``, after which DeepSpeed writes ``SAVE_DIR/latest``.
:class:`HistoryCheckpointEngine` gathers the files of one tag and writes them as
one step of a datastates-hist history, numbered by DeepSpeed's ``global_steps``:

- ``model/<parameter>``: the module's state dict (the model states' ``module``);
- ``extra/<file>/...``: the rest of each file (``<file>``: its name without
  ``.pt``), tensors as tensors and every other value through the value store.

Each file DeepSpeed asked for is written, once the step is committed, as a small
JSON pointer to its step in the history, so DeepSpeed's own loading (``latest``,
then the files of the tag) finds it, and ``load`` reads that file's part of the step.
The step keeps the tag it was saved as (``extra/deepspeed_tag``) and each pointer its
tag, so a pointer moved to another tag's folder, or left over from a step since
truncated and saved again, is refused. No pickle is written or read: the few
objects DeepSpeed's state dicts hold (loss scalers, ``ZeroStageEnum``,
``fragment_address``, ``torch.Size``, ``torch.dtype``) are stored as their fields
(a dtype by its name) and rebuilt from a fixed list of classes, with no field a
fresh object of the class lacks.

Use::

    engine, *_ = deepspeed.initialize(...)
    attach(engine, "runs/exp1")  # before the first save_checkpoint or load_checkpoint
    engine.save_checkpoint("ckpt")
"""

from __future__ import annotations

import enum
import json
import os
from typing import Any, Callable

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from ..checkpointer import Checkpointer
from ..durable import fsync_path, rename_into_place
from ..errors import CorruptionError, StepNotFoundError, StepOrderError
from ..items import under
from ..retention import Policy, check_policy
from ..step_data import StepData
from ..store import Store
from ..values import check_nesting, decode

ENGINE_NAME = "HistoryCheckpointEngine"

# The JSON a checkpoint file holds in place of DeepSpeed's pickle.
POINTER_FORMAT = "datastates-hist deepspeed pointer"
POINTER_VERSION = 1  # "tag" was added later: a pointer without it is read without the checks it allows
MAX_POINTER_BYTES = 64 << 10
# The extra item that holds the tag a step was saved as (refused as a DeepSpeed file name).
TAG_ITEM = "deepspeed_tag"

# A DeepSpeed object stored as {OBJECT_KEY: its class, "fields": ...}; MODULE_MARK
# stands where the model states' module was (it is stored as the step's model).
OBJECT_KEY = "__deepspeed__"
MODULE_MARK = {OBJECT_KEY: "model"}


def _object_classes() -> dict[str, type]:
    """The DeepSpeed (and torch) classes whose objects are stored by their fields, by name."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    classes = (torch.Size, torch.dtype, ZeroStageEnum, *_field_names())
    return {f"{cls.__module__}.{cls.__qualname__}": cls for cls in classes}


def _field_names() -> dict[type, frozenset[str]]:
    """The classes whose objects are stored as their ``__dict__``, with the fields a fresh
    object of each has: a stored object with any other field is refused (it could shadow a method)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.utils.tensor_fragment import fragment_address

    fresh = (fragment_address(numel=0, start=0), LossScaler(),
             DynamicLossScaler(init_scale=1.0, scale_window=1, min_scale=1, delayed_shift=1,
                               consecutive_hysteresis=False))
    return {type(obj): frozenset(vars(obj)) for obj in fresh}


class HistoryCheckpointEngine(CheckpointEngine):
    """DeepSpeed's checkpoint engine API over a datastates-hist history at ``run``.

    One process only (the history is written by this process's Checkpointer).
    ``commit`` returns once the step is committed and its pointer files are
    written, since DeepSpeed then points ``latest`` at the tag.

    Args:
        run: the history's run directory (created if missing).
        **options: passed to :class:`~datastates_hist.Checkpointer` (``backend``,
            ``keep``, ``codec``, ...).
    """

    def __init__(self, run: str | os.PathLike, **options: Any):
        super().__init__(None)
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            raise ValueError(f"{ENGINE_NAME} writes the history of one process, but this DeepSpeed job has "
                             f"{torch.distributed.get_world_size()} ranks; run it as one process, or keep "
                             "DeepSpeed's own checkpoint engine")
        self.name = ENGINE_NAME
        self.run = os.fspath(run)
        # DeepSpeed resumes from the tag its `latest` file names, which it moves only after
        # commit() returns: retention keeps that tag's step until `latest` has moved on
        self._latest = _KeepLatest()
        if options.get("keep") is not None:
            options["keep"] = check_policy(options["keep"]) | self._latest
        self.checkpointer = Checkpointer(self.run, **options)
        self._classes = _object_classes()
        self._names = {cls: name for name, cls in self._classes.items()}
        self._fields = _field_names()
        self._info: CheckpointCommitInfo | None = None
        self._files: dict[str, dict] = {}  # file name (relative to SAVE_DIR/TAG, no .pt) -> state dict
        self._paths: dict[str, str] = {}

    # --- saving -------------------------------------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        """Begin the files of ``info.tag`` (those of an earlier tag never committed are dropped)."""
        self._info = info
        self._files, self._paths = {}, {}

    def save(self, state_dict: Any, path: str) -> None:
        """Keep ``state_dict`` (DeepSpeed's file ``path``) for the step of the tag; nothing is written yet."""
        if self._info is None:
            raise RuntimeError(f"{ENGINE_NAME}.save({path!r}) before create(): DeepSpeed calls create(info) first")
        name = self._file_name(path)
        if name == TAG_ITEM:
            raise ValueError(f"{path}: {ENGINE_NAME} keeps the tag of each step as extra/{TAG_ITEM}, so it cannot "
                             f"store a file named {TAG_ITEM}.pt; name the file otherwise")
        if not isinstance(state_dict, dict):
            raise TypeError(f"{path}: {ENGINE_NAME} stores DeepSpeed's state dicts (dict), got "
                            f"{type(state_dict).__name__}")
        check_nesting(state_dict, path)
        self._files[name] = self._plain(state_dict, path)
        self._paths[name] = os.path.abspath(path)

    def _file_name(self, path: str) -> str:
        """``path`` relative to ``SAVE_DIR/TAG``, without ``.pt``; refused outside of it."""
        tag_dir = os.path.abspath(os.path.join(self._info.save_dir, self._info.tag))
        relative = os.path.relpath(os.path.abspath(path), tag_dir)
        if relative == os.curdir or relative.split(os.sep)[0] == os.pardir:
            raise ValueError(f"{path} is not under {tag_dir}: {ENGINE_NAME} keeps the files of "
                             "save_checkpoint(SAVE_DIR, TAG); save_16bit_model and other exports for "
                             "other tools need DeepSpeed's own checkpoint engine")
        return relative.replace(os.sep, "/").removesuffix(".pt")

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Write the tag's files as one step, wait until it is committed, then write the pointers."""
        if not self._files:
            return True
        if self._info is None or info.tag != self._info.tag or info.save_dir != self._info.save_dir:
            raise RuntimeError(f"{ENGINE_NAME}.commit({info}) does not match create({self._info})")
        files, paths = self._files, self._paths
        self._files, self._paths, self._info = {}, {}, None
        step = self._step_of(info.tag, files)
        committed = self.checkpointer.steps()
        latest = self._latest_step(info.save_dir)
        if committed and step <= committed[-1]:
            raise StepOrderError(self._order_problem(info.tag, step, committed, latest))
        self._latest.step = latest
        model: dict = {}
        for name, state in files.items():
            if isinstance(state.get("module"), dict) and "global_steps" in state:
                model = state["module"]
                files[name] = {**state, "module": MODULE_MARK}
                break
        self.checkpointer.write(step, model, **files, **{TAG_ITEM: info.tag})
        self.checkpointer.wait()
        for name, path in paths.items():
            self._write_pointer(path, step, name, info.tag)
        if info.save_latest:
            # DeepSpeed writes `latest` next, in place (a kill midway leaves it empty); the
            # engine writes it first, whole, so that it moves as soon as the step can be loaded
            self._write_file(os.path.join(info.save_dir, "latest"), info.tag)
        return True

    def _order_problem(self, tag: str, step: int, committed: list[int], latest: int | None) -> str:
        said = f"DeepSpeed's tag {tag!r} is global step {step}, but {self.run} already holds step {committed[-1]}"
        below = [s for s in committed if s < step]
        if below:
            return (f"{said}: steps only grow. To go on from an older checkpoint, drop the later steps first: "
                    f"checkpoint_engine.checkpointer.truncate(after={below[-1]})")
        if step == committed[-1] and latest is None:  # a first save killed before its pointers
            return (f"{said}, its only step, which DeepSpeed cannot load (no {ENGINE_NAME} pointer in the tag "
                    "that SAVE_DIR/latest names): left from a save that was killed, it is replaced by this one "
                    "once dropped: checkpoint_engine.checkpointer.truncate(after=-1)")
        if step == committed[-1]:
            return f"{said}, its only step: a history keeps one checkpoint per global step; save after training on"
        return (f"{said}, and no step before {step}: load one of its checkpoints first "
                "(engine.load_checkpoint), or save this run into a new history")

    def _latest_step(self, save_dir: str) -> int | None:
        """The step of the tag DeepSpeed's ``SAVE_DIR/latest`` names (read from its pointers),
        or None: no such file, or no pointer of this history under it."""
        try:
            with open(os.path.join(save_dir, "latest"), encoding="utf-8") as f:
                tag = f.read(4096).strip()
            folder = os.path.join(save_dir, tag)
            names = sorted(os.listdir(folder)) if tag and os.path.isdir(folder) else []
        except (OSError, UnicodeDecodeError):
            return None
        for name in names:
            try:
                return self._read_pointer(os.path.join(folder, name))[0]
            except (OSError, ValueError):  # a folder, another engine's file, another history's pointer
                continue
        return None

    def _step_of(self, tag: str, files: dict[str, dict]) -> int:
        for state in files.values():
            steps = state.get("global_steps")
            if isinstance(steps, int) and not isinstance(steps, bool):
                return steps
        raise ValueError(f"the files of tag {tag!r} ({', '.join(files)}) hold no global_steps, which numbers "
                         f"the step in the history: {ENGINE_NAME} keeps checkpoints that hold the model states")

    def _write_pointer(self, path: str, step: int, name: str, tag: str) -> None:
        pointer = {"format": POINTER_FORMAT, "version": POINTER_VERSION, "step": step, "file": name, "tag": tag,
                   "run": os.path.relpath(os.path.abspath(self.run), os.path.dirname(path))}
        self._write_file(path, json.dumps(pointer))

    @staticmethod
    def _write_file(path: str, text: str) -> None:
        """``path`` replaced by one holding ``text``, durably: a kill leaves the old or the new."""
        tmp = f"{path}.partial"
        with open(tmp, "w") as f:
            f.write(text)
        fsync_path(tmp)
        rename_into_place(tmp, path)

    def _plain(self, value: Any, where: str) -> Any:
        """``value`` with DeepSpeed's objects replaced by their fields (:data:`OBJECT_KEY`)."""
        kind = self._names.get(type(value))
        if kind is not None:
            if isinstance(value, torch.Size):
                fields = list(value)
            elif isinstance(value, torch.dtype):
                fields = str(value).removeprefix("torch.")
            elif isinstance(value, enum.Enum):
                fields = value.value
            else:
                fields = self._plain(dict(vars(value)), where)
            return {OBJECT_KEY: kind, "fields": fields}
        if isinstance(value, dict):
            if OBJECT_KEY in value:
                raise ValueError(f"{where}: a dict with the key {OBJECT_KEY!r} cannot be stored by {ENGINE_NAME} "
                                 "(the key marks DeepSpeed's objects); rename the key")
            return {k: self._plain(v, f"{where}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)) and not all(type(v) is int for v in value):
            items = [self._plain(v, f"{where}/{i}") for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    # --- loading ------------------------------------------------------------------------

    def load(self, path: str, map_location: Any = None) -> dict:
        """The state dict DeepSpeed saved as ``path``, read from the history (only that file's
        tensors, and the model's where it held the module).

        Tensors come on the CPU, or on ``map_location`` when it names a device.
        """
        step, name, tag = self._read_pointer(path)
        store = Store(self.run)
        try:
            if step not in store.steps():
                raise StepNotFoundError(f"{path} points at step {step}, which {self.run} does not hold (removed "
                                        "by keep= or prune?)")
            if store.row(step).tier == "trajectory":
                raise StepNotFoundError(f"{path} points at step {step} of {self.run}, which keep= made a trajectory "
                                        "point: it no longer holds the whole checkpoint")
            with store.open_step(step) as data:
                items = data.values["items"]
                if name == TAG_ITEM or f"extra/{name}" not in items:
                    raise CorruptionError(f"{path} points at file {name!r} of step {step} in {self.run}, which the "
                                          "step does not hold")
                saved_as = items.get(f"extra/{TAG_ITEM}")
                if tag is not None and saved_as is not None and saved_as != tag:
                    raise CorruptionError(f"{path} is the pointer of DeepSpeed's tag {tag!r}, but step {step} of "
                                          f"{self.run} was saved as tag {saved_as!r}: a stale or altered pointer "
                                          "(the history was truncated and the step saved again?); save the "
                                          "checkpoint again")
                state = self._rebuilt(_decoded(data, f"extra/{name}"), lambda: _decoded(data, "model"),
                                      f"{self.run} step {step} {name}")
        finally:
            store.close()
        if isinstance(map_location, (str, torch.device)):
            device = torch.device(map_location)
            state = _tensors_mapped(state, lambda t: t.to(device))
        return state

    def _read_pointer(self, path: str) -> tuple[int, str, str | None]:
        with open(path, "rb") as f:
            head = f.read(MAX_POINTER_BYTES + 1)
        try:
            pointer = json.loads(head) if len(head) <= MAX_POINTER_BYTES else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            pointer = None
        if not isinstance(pointer, dict) or pointer.get("format") != POINTER_FORMAT:
            raise ValueError(f"{path} is not a checkpoint file written by {ENGINE_NAME} (a torch.save file of "
                             "DeepSpeed's own engine?): load it with DeepSpeed's own checkpoint engine, or import "
                             "it into a history with: datastates-hist import")
        if pointer.get("version") != POINTER_VERSION:
            raise CorruptionError(f"{path} is a {ENGINE_NAME} pointer of version {pointer.get('version')!r}, but "
                                  f"this engine reads version {POINTER_VERSION}")
        problem = _pointer_problem(pointer)
        if problem:
            raise CorruptionError(f"{path} is a damaged {ENGINE_NAME} pointer: {problem}")
        step, name, tag = pointer["step"], pointer["file"], pointer.get("tag")
        if tag is not None:
            self._check_folder(path, name, tag)
        written_to = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(path)), pointer["run"]))
        if written_to != os.path.realpath(self.run):
            raise ValueError(f"{path} points into the history {written_to}, but this engine reads {self.run}: "
                             f"attach the engine to {written_to}")
        return step, name, tag

    @staticmethod
    def _check_folder(path: str, name: str, tag: str) -> None:
        """Refuse the pointer of ``tag``'s file ``name`` read from ``path`` outside of ``SAVE_DIR/tag``."""
        folder = os.path.dirname(os.path.abspath(path))
        for _ in range(name.count("/")):  # the file's own folders under the tag's
            folder = os.path.dirname(folder)
        if not (folder + os.sep).endswith(os.sep + os.path.normpath(tag) + os.sep):
            raise CorruptionError(f"{path} is the pointer of DeepSpeed's tag {tag!r}, but lies in {folder}, not in "
                                  f"the folder of that tag: a copied or moved pointer; load tag {tag!r} where it "
                                  "was saved, or save the checkpoint again")

    def _rebuilt(self, value: Any, read_model: Callable[[], dict], where: str) -> Any:
        """A stored file's state dict with DeepSpeed's objects and the module put back."""
        if isinstance(value, dict):
            if OBJECT_KEY not in value:
                return {k: self._rebuilt(v, read_model, where) for k, v in value.items()}
            kind = value[OBJECT_KEY]
            if value == MODULE_MARK:
                return read_model()
            cls = self._classes.get(kind) if isinstance(kind, str) else None
            if cls is None or set(value) != {OBJECT_KEY, "fields"}:
                raise CorruptionError(f"{where}: a stored DeepSpeed object of class {kind!r} is not one "
                                      f"{ENGINE_NAME} writes ({', '.join(sorted(self._classes))})")
            fields = value["fields"]
            try:
                if cls is torch.dtype:
                    dtype = getattr(torch, fields, None)
                    if not isinstance(dtype, torch.dtype):
                        raise ValueError(f"torch.{fields} is not a dtype")
                    return dtype
                if cls is torch.Size or issubclass(cls, enum.Enum):
                    return cls(fields)
                if not isinstance(fields, dict):
                    raise TypeError(f"{type(fields).__name__}, not a dict")
            except (TypeError, ValueError) as exc:
                raise CorruptionError(f"{where}: the stored fields of a {kind} are damaged ({exc})") from None
            unknown = set(fields) - self._fields[cls]
            if unknown:
                raise CorruptionError(f"{where}: a stored {kind} has the fields {sorted(unknown)}, which a "
                                      f"{cls.__name__} does not have")
            obj = cls.__new__(cls)
            obj.__dict__.update(self._rebuilt(fields, read_model, where))
            return obj
        if isinstance(value, list):
            return [self._rebuilt(v, read_model, where) for v in value]
        if isinstance(value, tuple):
            return tuple(self._rebuilt(v, read_model, where) for v in value)
        return value

    # --- the rest of the API ------------------------------------------------------------

    def cleanup(self) -> None:
        """Wait for the history's writes and close it."""
        self.checkpointer.close()

    close = cleanup

    def preserves_storage_sharing(self) -> bool:
        return False  # each tensor is stored on its own


def _pointer_problem(pointer: dict) -> str | None:
    """What is wrong with the fields of a pointer of this version, or None."""
    name = pointer.get("file")
    if type(pointer.get("step")) is not int:
        return "its step is not a whole number"
    if not isinstance(name, str):
        return "its file is not a string"
    if any(part in ("", os.curdir, os.pardir) for part in name.split("/")):
        return f"its file {name!r} is not a path inside a tag's folder"
    if not isinstance(pointer.get("run"), str):
        return "its run is not a string"
    if not isinstance(pointer.get("tag", ""), str):  # pointers written before tags were kept have none
        return "its tag is not a string"
    return None


def _decoded(data: StepData, prefix: str) -> Any:
    """The value stored under ``prefix`` (a plain tree) with its tensors read."""
    names = [n for n in data.records if under(n, prefix)]
    data.prefetch(names)
    return decode(data.values["items"][prefix], {n[len(prefix) + 1:]: data.read(n) for n in names})


def _tensors_mapped(value: Any, change) -> Any:
    """``value`` with ``change`` applied to each tensor in it (new containers)."""
    if isinstance(value, torch.Tensor):
        return change(value)
    if isinstance(value, dict):
        return {k: _tensors_mapped(v, change) for k, v in value.items()}
    if isinstance(value, list):
        return [_tensors_mapped(v, change) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(_tensors_mapped(v, change) for v in value)
    return value


class _KeepLatest(Policy):
    """Keeps ``step``: the step of the tag DeepSpeed's ``latest`` file names."""

    def __init__(self):
        self.step: int | None = None

    def keep(self, steps: list[int]) -> set[int]:
        return {self.step} if self.step is not None else set()

    def keeps_for_good(self, step: int) -> bool:
        return False


def attach(engine: Any, run: str | os.PathLike, **options: Any) -> HistoryCheckpointEngine:
    """Make ``engine`` (from ``deepspeed.initialize``) save and load checkpoints through a history
    at ``run``; ``options`` as :class:`~datastates_hist.Checkpointer`'s. Returns the checkpoint engine."""
    if not hasattr(engine, "checkpoint_engine"):
        raise TypeError(f"attach() needs a DeepSpeed engine (from deepspeed.initialize), got "
                        f"{type(engine).__name__}")
    checkpoint_engine = HistoryCheckpointEngine(run, **options)
    engine.checkpoint_engine = checkpoint_engine
    return checkpoint_engine
