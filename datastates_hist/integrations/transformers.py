"""The Hugging Face ``transformers.Trainer``: every optimizer step into a history, and resume from it.

    history = HistoryCallback("runs/hf", keep=dh.KeepLast(2) | dh.KeepEvery(1000),
                              trajectory=dh.Trajectory("model/*"))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[history])
    trainer.train(resume_from_checkpoint=history.resume_from_checkpoint(trainer))

**When.** Step N (Trainer's ``global_step``: N optimizer updates done) is written when
update N+1 begins (``on_step_begin``, after its batches were fetched), and the last step
when training ends (when Trainer logs its training summary, before
``load_best_model_at_end`` loads another checkpoint's weights); a new run's first write is
step 0, the initial state. By then Trainer
has logged and evaluated step N, as its own checkpoint of step N would hold, and the
random generators stand where update N+1 starts drawing (dropout), so that a resumed run
draws the same. ``write()`` returns before any tensor is copied: the forward of update N+1
waits only for the model's buffers, its optimizer update for the rest of the snapshot.

**What.** The model, the optimizer (inside accelerate's wrapper), the LR scheduler and the
RNG states, as ``Checkpointer.write`` takes them; ``extra/trainer_state``, Trainer's own
``trainer_state.json`` text (global step, epoch, log history, the state of stateful
callbacks such as ``EarlyStoppingCallback``); and ``extra/data``, the data position and the
numbers Trainer logged at that step, as scalars (``loss``, ``learning_rate``, ``epoch``,
``global_step``).

**Resume.** Trainer positions its data itself when it resumes from a checkpoint folder: it
skips the epochs and batches already trained, and its seedable sampler orders each epoch's
batches by ``seed + epoch``. :meth:`HistoryCallback.resume_from_checkpoint` gives it one: it
restores the model from the newest restore point, writes a model-only Trainer checkpoint of
it (the weights and ``trainer_state.json``, what ``save_only_model=True`` writes) into a
folder under ``args.output_dir`` named after the history (the one a crashed resume left
there is replaced), and returns its path. When the first update begins, the callback restores
the model, optimizer, scheduler and RNG states from the same step, and the run goes on as if
it had not stopped. The folder is removed when training begins. A finished run (its newest
restore point at the Trainer's ``max_steps``) is not trained again: ``resume_from_checkpoint``
returns None, sets ``history.finished`` and leaves the model with the last step's weights, and
``train()`` is refused with an error.

**Errors.** An exception inside ``trainer.train()`` leaves the history open; the steps written
are committed when the process exits, or at once by ``history.close()``:

    try:
        trainer.train(resume_from_checkpoint=history.resume_from_checkpoint(trainer))
    finally:
        history.close()
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState

from ..checkpointer import Checkpointer
from ..errors import RestoreMismatchError


class HistoryCallback(TrainerCallback):
    """A Trainer callback that writes every optimizer step into the history at ``path``.

    Args:
        path: the run directory of the history.
        **options: the :class:`~datastates_hist.Checkpointer`'s keyword arguments
            (``backend=``, ``keep=``, ``trajectory=``, ``codec=``, ...).

    One process: a Trainer of several processes is refused.
    """

    def __init__(self, path: str | os.PathLike, **options: Any):
        self.path = os.fspath(path)
        self.options = options
        # opened here for its checks (and the run directory), then closed: the history is
        # written only inside train(), so a callback dropped unused (a notebook cell run
        # again) holds no lock on it
        Checkpointer(self.path, **options).close()
        self.checkpointer: Checkpointer | None = None
        self._began: TrainerState | None = None  # the state of the train() under way
        self.resumed_from: int | None = None  # the step the last resume_from_checkpoint() found
        self.finished = False  # that step is at the Trainer's max_steps: nothing is left to train
        self._trainer = None
        self._resuming = False  # the next train() starts at step resumed_from
        self._restore_pending = False  # the first update of a resumed run restores the rest
        self._resume_dir: str | None = None
        self._written: int | None = None  # the newest step in the history
        self._encode_seconds = 0.0  # the Trainer state's text, the data position
        self._closed_blocked_seconds = 0.0  # of the Checkpointers closed at the end of training

    # --- resuming -----------------------------------------------------------------------

    def resume_from_checkpoint(self, trainer) -> str | None:
        """What to pass to ``trainer.train(resume_from_checkpoint=...)``: None when the
        history has no step yet (a new run), else a Trainer checkpoint of the newest restore
        point (see the module's docstring). Steps after that restore point, if any, are
        dropped from the history: they belong to the run that stopped.

        None also when that restore point is at the Trainer's ``max_steps``: the run is
        finished, :attr:`finished` is True, the model holds that step's weights, and
        ``trainer.train()`` is refused (raise ``max_steps`` to train on).

        Also gives the callback the Trainer, whose stateful callbacks are then saved with
        every step."""
        self._trainer = trainer
        ckpt = self._open()
        self._remove_resume_dir()
        self.resumed_from, self._resuming, self.finished = None, False, False
        # named after the history: a resume that crashed before training began left it there
        resume_dir = os.path.join(trainer.args.output_dir, ".datastates-resume-" + hashlib.sha256(
            os.path.realpath(self.path).encode()).hexdigest()[:16])
        shutil.rmtree(resume_dir, ignore_errors=True)
        ckpt.wait()  # a train() of this process that stopped may have left steps being written
        if not ckpt.steps():
            return None
        try:
            restored = ckpt.restore(model=trainer.model, rng=False)
        except RestoreMismatchError as exc:  # the Trainer resumes strictly: strict=False is no choice here
            raise RestoreMismatchError(exc.step, exc.missing, exc.unexpected, exc.mismatched, advice=(
                f"the Trainer's model is not the model {self.path} was written from: resume with that model, "
                "or write to a new directory")) from None
        if "trainer_state" not in restored.extra:
            raise ValueError(f"step {restored.step} of {self.path} holds no Trainer state (extra/trainer_state): "
                             "its history was not written by HistoryCallback")
        ckpt.truncate(after=restored.step)
        self.resumed_from = restored.step
        if restored.step >= trainer.set_initial_training_values(trainer.args, trainer.get_train_dataloader())[-1]:
            self.finished = True
            return None
        self._resume_dir = resume_dir
        folder = os.path.join(self._resume_dir, f"checkpoint-{restored.step}")
        trainer.save_model(folder, _internal_call=True)  # a folder to read back, not to push to the Hub
        with open(os.path.join(folder, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(restored.extra["trainer_state"])
        self._resuming = True
        return folder

    def _remove_resume_dir(self) -> None:
        if self._resume_dir is not None:
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._resume_dir = None

    # --- Trainer's events ---------------------------------------------------------------

    def on_train_begin(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        if args.world_size > 1:
            raise ValueError(f"HistoryCallback writes the history of one process; this Trainer runs "
                             f"{args.world_size} processes")
        if state is self._began:  # every event of this train() would come twice
            raise ValueError(f"the HistoryCallback of {self.path} is in the Trainer's callbacks twice; add it once")
        self._began = state
        ckpt = self._open()
        self._remove_resume_dir()  # Trainer has read it
        ckpt.wait()
        steps = ckpt.steps()
        if self._resuming:
            self._resuming = False  # a later train() starts anew unless resumed again
            if state.global_step != self.resumed_from:
                raise RuntimeError(
                    f"the Trainer starts at step {state.global_step}, not at step {self.resumed_from} of "
                    f"{self.path}: pass history.resume_from_checkpoint(trainer) to "
                    "trainer.train(resume_from_checkpoint=...)")
            self._restore_pending = True
        elif self.finished:
            raise ValueError(
                f"{self.path} is finished: its step {self.resumed_from} reached the Trainer's max_steps "
                f"({state.max_steps}); raise max_steps to train on, or write to a new directory")
        elif steps and steps[-1] >= state.global_step:
            raise ValueError(
                f"{self.path} already holds steps up to {steps[-1]} and the Trainer starts at step "
                f"{state.global_step}: resume with trainer.train(resume_from_checkpoint="
                "history.resume_from_checkpoint(trainer)), or write to a new directory")
        self._written = steps[-1] if steps else None

    def on_step_begin(self, args, state: TrainerState, control: TrainerControl, model=None, optimizer=None,
                      lr_scheduler=None, **kwargs):
        if self._restore_pending:  # the RNG states too: this update draws as the stopped run's did
            self.checkpointer.restore(state.global_step, model, torch_optimizer(optimizer),
                                      **_extras(scheduler=lr_scheduler))
            self._restore_pending = False
        elif self._written is None or state.global_step > self._written:
            self._write(state, control, model, optimizer, lr_scheduler)

    def on_log(self, args, state: TrainerState, control: TrainerControl, logs=None, model=None, optimizer=None,
               lr_scheduler=None, **kwargs):
        # Trainer's training summary: the last update is done, and load_best_model_at_end has not
        # yet put another checkpoint's weights into the model; it does so in place, so the
        # snapshot must be taken before
        if "train_runtime" in (logs or {}) and (self._written is None or state.global_step > self._written):
            self._write(state, control, model, optimizer, lr_scheduler)
            self.checkpointer.wait_snapshot()

    def on_train_end(self, args, state: TrainerState, control: TrainerControl, model=None, optimizer=None,
                     lr_scheduler=None, **kwargs):
        if self._written is None or state.global_step > self._written:
            self._write(state, control, model, optimizer, lr_scheduler)
        self.close()

    # --- writing ------------------------------------------------------------------------

    def _write(self, state: TrainerState, control: TrainerControl, model, optimizer, lr_scheduler) -> None:
        t0 = time.perf_counter()
        extras = _extras(scheduler=lr_scheduler, trainer_state=self._state_text(state, control),
                         data=data_position(state))
        self._encode_seconds += time.perf_counter() - t0
        self.checkpointer.write(state.global_step, model, torch_optimizer(optimizer), **extras)
        self._written = state.global_step

    def _state_text(self, state: TrainerState, control: TrainerControl) -> str:
        """``trainer_state.json`` as Trainer writes it, with the stateful callbacks' state of now."""
        fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
        stateful = [control]
        if self._trainer is not None:
            stateful = [cb for cb in self._trainer.callback_handler.callbacks if isinstance(cb, ExportableState)
                        ] + stateful
        fields["stateful_callbacks"] = TrainerState(stateful_callbacks=stateful).stateful_callbacks
        return json.dumps(fields, indent=2, sort_keys=True) + "\n"

    # --- the Checkpointer ---------------------------------------------------------------

    def _open(self) -> Checkpointer:
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(self.path, **self.options)
        return self.checkpointer

    def close(self) -> None:
        """Wait until every written step is committed, and close the history (a later
        ``train()`` opens it again)."""
        self._remove_resume_dir()
        if self.checkpointer is not None:
            try:
                self.checkpointer.close()
            finally:
                self._closed_blocked_seconds += self.checkpointer.blocked_seconds
                self.checkpointer = None

    @property
    def blocked_seconds(self) -> float:
        """Training-thread time spent on the history: in the writes (the Trainer state's
        text included) and in the waits for their snapshots."""
        open_now = self.checkpointer.blocked_seconds if self.checkpointer is not None else 0.0
        return self._encode_seconds + self._closed_blocked_seconds + open_now


def torch_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` inside accelerate's ``AcceleratedOptimizer``: its own
    step runs the hooks that wait for the snapshot, and its type names the stored state."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def data_position(state: TrainerState) -> dict[str, Any]:
    """Where the run stands in its data (Trainer resumes its data order from ``global_step``),
    and the numbers Trainer logged at this step."""
    data = {"global_step": state.global_step, "epoch": float(state.epoch or 0),
            "num_input_tokens_seen": state.num_input_tokens_seen}
    for logged in reversed(state.log_history):  # the entries of this step are the newest
        if logged.get("step") != state.global_step:
            break
        data.update({k: v for k, v in logged.items() if k not in data and k != "step"
                     and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return data


def _extras(**extras: Any) -> dict[str, Any]:
    """The extras that are there (a Trainer without an LR scheduler has none)."""
    return {k: v for k, v in extras.items() if v is not None}
