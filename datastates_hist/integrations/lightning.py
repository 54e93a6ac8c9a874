"""Lightning: every training step of a ``lightning.Trainer`` into a history, and resume from it.

Lightning splits checkpointing in two, and so does this module:

- :class:`HistoryCheckpointIO` is a ``CheckpointIO`` plugin, where Lightning puts the storage of
  its checkpoint dict (``trainer.save_checkpoint`` hands it the dict; ``fit(ckpt_path=...)``
  asks it for one). Saved to its run directory, the dict becomes a step of the history, numbered
  by ``trainer.global_step``: the model's ``state_dict`` under ``model/``, everything else Lightning
  dumps (optimizer and LR-scheduler states, loops' progress, the stateful dataloaders' positions,
  callbacks', precision plugin's and datamodule's states, hyper-parameters) under
  ``extra/lightning/``, the process's RNG states under ``rng/``. Plain values are stored as tagged
  JSON (:mod:`..values`), so loading runs no pickle; a value that JSON cannot hold is refused when
  saved. Loading ``RUN`` (the newest restore point) or ``RUN:STEP`` rebuilds the dict and restores
  the RNG states. Other paths (``ModelCheckpoint``'s ``.ckpt`` files) go to Lightning's
  ``TorchCheckpointIO``.
- :class:`HistoryCheckpoint` is the ``Checkpoint`` callback that decides when: it saves every
  ``every_n_steps`` optimizer steps (at the end of the batch, as ``ModelCheckpoint`` does) and makes
  training wait for the lazy snapshot only where it must: before the next optimizer update
  (``on_before_optimizer_step``, after forward and backward), for a model with buffers before the
  next batch, before validation (callbacks such as ``EMAWeightAveraging`` swap weights in place
  then), and right after the save of an epoch's or the fit's last batch.

    history = HistoryCheckpoint("runs/lit", keep=dh.KeepLast(2) | dh.KeepEvery(1000),
                                trajectory=dh.Trajectory("model/*"))
    trainer = L.Trainer(max_steps=1000, callbacks=[history], plugins=[history.checkpoint_io])
    trainer.fit(model, loader, ckpt_path=history.resume_path())   # None: a fresh start
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.callbacks import Checkpoint

from ..checkpointer import Checkpointer
from ..errors import RestoreMismatchError, StepNotFoundError, StepOrderError
from ..layout import index_path
from ..providers import TreeProvider, register_provider
from ..restore import restore_step
from ..store import Store

# The extra that holds all of Lightning's checkpoint dict but its state_dict (the model, under model/).
LIGHTNING_KEY = "lightning"

# The keys every checkpoint dict Lightning dumps holds, and their types: a stored value without
# them is not a Lightning checkpoint.
LIGHTNING_KEYS = {"epoch": int, "global_step": int, "pytorch-lightning_version": str}

# What ``trainer.save_checkpoint(RUN, storage_options=...)`` may pass.
STORAGE_OPTIONS = ("data",)


class LightningModelState(dict):
    """Lightning's ``checkpoint["state_dict"]``: stored as the step's model (``model/<key>``)
    and loaded back in place."""


class LightningModelStateProvider(TreeProvider):
    """The model's state dict as a tree of tensors (stored as any tree: readable without this
    module), filled in place on load."""

    kind = TreeProvider.kind

    def load(self, obj, state, ctx):
        obj.update(super().load(obj, state, ctx))
        return obj


register_provider(LightningModelState, LightningModelStateProvider())


def history_target(path: Any) -> tuple[str, int | None] | None:
    """``(run, step)`` when ``path`` names a step of a history: ``RUN`` (the newest restore
    point, step None) or ``RUN:STEP``; None for any other path."""
    try:
        text = os.fspath(path)
    except TypeError:
        return None
    if _is_run(text):
        return text, None
    run, colon, step = text.rpartition(":")
    if colon and run and step.isascii() and step.isdigit() and _is_run(run):
        return run, int(step)
    return None


def _is_run(path: str) -> bool:
    return os.path.isfile(index_path(path))


class HistoryCheckpointIO(CheckpointIO):
    """Lightning's checkpoint dicts as steps of the history at ``path``.

    Args:
        path: the run directory this plugin writes (created at the first save).
        rng: restore the RNG states (torch, numpy, ``random``) saved with the step when loading
            it (in a single process; under several ranks each keeps its own).
        **options: the :class:`~datastates_hist.Checkpointer`'s (``backend``, ``keep``,
            ``trajectory``, ``codec``, ``host_cache_bytes``, ...).

    Attributes:
        lazy: set by :class:`HistoryCheckpoint` while it guards training: a save returns before
            the tensors are copied. Otherwise a save returns once its step is committed (so a
            plain ``trainer.save_checkpoint(RUN)`` is as safe as ``torch.save``).
    """

    def __init__(self, path: str | os.PathLike, *, rng: bool = True, **options: Any):
        try:
            inspect.signature(Checkpointer).bind(path, **options)
        except TypeError as exc:
            raise TypeError(f"HistoryCheckpointIO: {exc} (options are the Checkpointer's)") from None
        self.path = os.fspath(path)
        self.rng = rng
        self.options = options
        self.lazy = False
        self.fallback = TorchCheckpointIO()
        self._checkpointer: Checkpointer | None = None

    @property
    def checkpointer(self) -> Checkpointer:
        """The history's writer, opened at first use (it holds the run's writer lock until
        :meth:`teardown`)."""
        if self._checkpointer is None or self._checkpointer.closed:
            self._checkpointer = Checkpointer(self.path, **self.options)
        return self._checkpointer

    def _owns(self, path: Any) -> bool:
        try:
            return os.path.realpath(os.fspath(path)) == os.path.realpath(self.path)
        except TypeError:
            return False

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Write ``checkpoint`` as step ``checkpoint["global_step"]`` when ``path`` is this
        plugin's run directory; ``storage_options={"data": {...}}`` adds plain values (stored as
        ``extra/data``, scalars such as ``loss``). Other paths are saved by ``TorchCheckpointIO``."""
        if not self._owns(path):
            if history_target(path) is not None:
                raise ValueError(f"cannot save a Lightning checkpoint to {os.fspath(path)!r}: this "
                                 f"HistoryCheckpointIO writes the history {self.path!r}, whose steps are "
                                 "numbered by trainer.global_step; save to that run directory")
            self.fallback.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        extra = {"data": data} if (data := _data_option(storage_options)) else {}
        state = dict(checkpoint)
        model = LightningModelState(state.pop("state_dict", {}))
        step = checkpoint["global_step"]
        # outside HistoryCheckpoint's guard (a save after fit) the run's writer lock is not kept
        opened_here = self._checkpointer is None or self._checkpointer.closed
        checkpointer = self.checkpointer
        try:
            try:
                checkpointer.write(step, model, **{LIGHTNING_KEY: state}, **extra)
            except StepOrderError:
                checkpointer.wait()
                raise StepOrderError(
                    f"cannot save the checkpoint of trainer.global_step {step} to {self.path!r}: the history "
                    f"already holds step {checkpointer.steps()[-1]}, and its steps only grow (one per "
                    "global step; to branch from an earlier step, call "
                    "checkpoint_io.checkpointer.truncate(after=...) first)") from None
            if not self.lazy:
                checkpointer.wait()
        finally:
            if opened_here and not self.lazy:
                checkpointer.close()

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's checkpoint dict of the step ``path`` names (``RUN``: its newest restore
        point; ``RUN:STEP``), with the step's RNG states restored; tensors come on the CPU (Lightning
        moves them where the model and optimizers are). Other paths: ``TorchCheckpointIO``."""
        target = history_target(path)
        if target is None:
            return self.fallback.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        run, step = target
        if self._checkpointer is not None and not self._checkpointer.closed:
            self._checkpointer.wait()  # steps in flight are read once committed
        model = LightningModelState()
        try:
            restored = restore_step(run, step, model, None, strict=True, rng=False, extra={})
        except RestoreMismatchError as exc:  # its model was not stored as Lightning's state_dict
            raise not_lightning(path, exc.step) from None
        state = restored.extra.get(LIGHTNING_KEY)
        if state is None:
            raise not_lightning(path, restored.step)
        if (wrong := _not_lightning_dict(state)) is not None:
            raise not_lightning(path, restored.step, f"extra/{LIGHTNING_KEY} {wrong}")
        if self.rng and not _distributed():  # only once the step is known to be Lightning's
            restore_step(run, restored.step, None, None, strict=True, rng=True, extra={})
        return {**state, "state_dict": dict(model)}

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint file (``TorchCheckpointIO``); steps of a history are not removed
        this way."""
        if history_target(path) is not None or self._owns(path):
            raise ValueError(f"cannot remove {os.fspath(path)!r}: which steps of a history stay is "
                             "decided by its retention policies (keep=, trajectory=) or by "
                             "`datastates-hist prune`")
        self.fallback.remove_checkpoint(path)

    def wait_snapshot(self) -> None:
        """Wait until the last save's tensors are copied (before they change)."""
        if self._checkpointer is not None and not self._checkpointer.closed:
            self._checkpointer.wait_snapshot()

    def teardown(self) -> None:
        """Commit every step in flight and give the run's writer lock back (end of fit); a
        failed step is raised here."""
        if self._checkpointer is not None:
            self._checkpointer.close()


def not_lightning(path: Any, step: int, why: str = "") -> ValueError:
    """The error of loading a step that was not written through :class:`HistoryCheckpointIO`
    (``why``: what it holds instead)."""
    return ValueError(f"cannot load {os.fspath(path)!r} into Lightning: its step {step} was not written "
                      "through HistoryCheckpointIO (it holds no Lightning checkpoint" +
                      (f": {why})" if why else ")"))


def _not_lightning_dict(state: Any) -> str | None:
    """What makes ``state`` other than a checkpoint dict Lightning dumped, in words; None if nothing."""
    if not isinstance(state, dict):
        return f"is of type {type(state).__name__}, not Lightning's checkpoint dict"
    for key, kind in LIGHTNING_KEYS.items():
        if key not in state:
            return f"has no {key!r}"
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            return f"has a {key!r} of type {type(state[key]).__name__}, not {kind.__name__}"
    return None


def _data_option(storage_options: Any) -> dict:
    if storage_options is None:
        return {}
    if not isinstance(storage_options, dict) or set(storage_options) - set(STORAGE_OPTIONS):
        raise ValueError(f"HistoryCheckpointIO takes storage_options={{'data': {{...}}}} (plain values "
                         f"stored with the step), got {storage_options!r}")
    return storage_options.get("data") or {}


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


class HistoryCheckpoint(Checkpoint):
    """Saves the training state every ``every_n_steps`` optimizer steps into the history at
    ``path``, through its :attr:`checkpoint_io` (pass it to the Trainer:
    ``plugins=[history.checkpoint_io]``). The numbers logged so far (``trainer.callback_metrics``)
    are stored with each step as ``extra/data`` (``loss`` in ``History.scalars()``).

    Args:
        path: the run directory.
        every_n_steps: save when ``trainer.global_step`` is a multiple of it, and at the fit's last step.
        rng, **options: as :class:`HistoryCheckpointIO`'s.
    """

    def __init__(self, path: str | os.PathLike, *, every_n_steps: int = 1, rng: bool = True, **options: Any):
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive int, got {every_n_steps!r}")
        self.checkpoint_io = HistoryCheckpointIO(path, rng=rng, **options)
        self.every_n_steps = every_n_steps
        self._last_global_step: int | None = None
        self._waits_before_batch = False

    def resume_path(self, step: int | None = None) -> str | None:
        """``ckpt_path`` for ``trainer.fit``: the run (its newest restore point) or ``RUN:STEP``;
        None when the run has no restore point yet (a fresh start).

        Raises:
            StepNotFoundError: ``step`` is not a restore point of the run (the error names the
                nearest ones).
            StoreNotFoundError: ``step`` is given and the run does not exist.
        """
        run = self.checkpoint_io.path
        if step is None and not _is_run(run):
            return None
        store = Store(run)
        try:
            if step is None:
                return run if store.restore_points() else None
            if step not in store.restore_points():
                try:
                    row = store.row(step)
                except StepNotFoundError as exc:
                    raise StepNotFoundError(f"{exc}. {store.nearest_restore_points(step)}") from None
                raise StepNotFoundError(store.not_a_restore_point(row))
        finally:
            store.close()
        return f"{run}:{step}"

    def setup(self, trainer, pl_module, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        while io is not self.checkpoint_io and hasattr(io, "checkpoint_io"):  # wrapping plugins
            io = io.checkpoint_io
        if io is not self.checkpoint_io:
            raise ValueError("HistoryCheckpoint saves through its own CheckpointIO: pass it to the Trainer "
                             "too, Trainer(callbacks=[history], plugins=[history.checkpoint_io])")
        self.checkpoint_io.lazy = True

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.checkpoint_io.lazy = False

    def on_train_start(self, trainer, pl_module) -> None:
        self._last_global_step = trainer.global_step
        # here, not in setup: configure_model() builds the model after setup
        params = {name for name, _ in pl_module.named_parameters(remove_duplicate=False)}
        # buffers (BatchNorm statistics) change in forward: their copy must be done before it
        self._waits_before_batch = any(name not in params for name in pl_module.state_dict())
        if trainer.world_size == 1:  # several: rank 0 alone writes, at its saves, and only it opens the history
            self._check_order(trainer.global_step)

    def _check_order(self, global_step: int) -> None:
        """Refuse a fit that starts before the history's newest step now, not at its first save."""
        checkpointer = self.checkpoint_io.checkpointer
        checkpointer.wait()  # a fit of this process that raised may have left steps being written
        steps = checkpointer.steps()
        if steps and steps[-1] > global_step:
            raise StepOrderError(
                f"{self.checkpoint_io.path} already holds steps up to {steps[-1]} and the fit starts at "
                f"trainer.global_step {global_step}: resume with trainer.fit(..., "
                "ckpt_path=history.resume_path()), or write to a new directory (to branch from an earlier "
                "step, call history.checkpoint_io.checkpointer.truncate(after=...) first)")

    def on_validation_start(self, trainer, pl_module) -> None:
        # validation callbacks (EMAWeightAveraging) swap the weights in place
        self.checkpoint_io.wait_snapshot()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._waits_before_batch:
            self.checkpoint_io.wait_snapshot()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.checkpoint_io.wait_snapshot()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_global_step:  # no optimizer step in this batch (gradient accumulation)
            return
        self._last_global_step = step
        fit_ends = 0 <= trainer.max_steps <= step or (
            trainer.is_last_batch and 0 < (trainer.max_epochs or 0) <= trainer.current_epoch + 1)
        if (step % self.every_n_steps and not fit_ends) or trainer.fast_dev_run:  # fast_dev_run: as Lightning's
            return
        trainer.save_checkpoint(self.checkpoint_io.path, weights_only=False,
                                storage_options={"data": _numbers(trainer.callback_metrics)})
        if fit_ends or trainer.is_last_batch:  # epoch-end and train-end hooks may change weights in place
            self.checkpoint_io.wait_snapshot()


def _numbers(metrics: dict) -> dict[str, float]:
    """The logged metrics that are single numbers, as floats."""
    out = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[name] = float(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out
