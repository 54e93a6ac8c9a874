"""Importing existing checkpoints into a history (``datastates-hist import``): writing them.

Sources: ``torch.save`` files (``.pt``, ``.pth``, ``.bin``, Lightning's ``.ckpt``), safetensors files,
folders written by transformers (a Trainer's ``checkpoint-N`` or
``save_pretrained``) and PyTorch DCP folders (``torch.distributed.checkpoint``).
No source can run code: torch files are read with ``weights_only=True`` (numpy
arrays allowed, as transformers allows them for its RNG states), a DCP folder's
pickled metadata through an unpickler that knows only DCP's metadata classes,
and its non-tensor items with ``weights_only=True`` too.

Each source becomes one step, numbered from its name (:func:`.sources.find_sources`),
written through a :class:`.Checkpointer`, so that an imported step is stored as
a training run stores it. Every step is written as a main unit (the model's
tensors, the extras' tensors and the values) and a restore unit (the optimizer
state and the RNG states); a source with optimizer state or a Trainer's RNG
states stays a *restore point*, the others become *trajectory points* (their
restore unit, which holds only this process's RNG state, is removed): no
tensor of a source is lost either way. Names are
those of a native run: ``model/<state dict key>``, the optimizer state as
:class:`.optimizer_state.OptimizerProvider` lays it out (``optim/state/<param>/<key>``,
parameters by name where the source names them, else ``@<position>``), and the
other parts of a checkpoint as extras (``extra/scheduler``, ``extra/trainer_state``).
"""

from __future__ import annotations

import itertools
import os
import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from ..items import TensorItem
from ..providers import StateProvider, register_provider
from ..collect import RESTORE_OPTIONS
from ..optimizer_state import OptimizerProvider, optimizer_items
from ..torch_providers import ModuleProvider
from .reading import is_inside
from .sources import Source, read_source


@dataclass(frozen=True)
class ImportedStep:
    """What :func:`import_sources` wrote of one source: the kind of step, and the
    count and bytes of its model tensors."""

    source: Source
    restore_point: bool
    tensors: int
    nbytes: int


# --- writing -----------------------------------------------------------------------------

class ModelState(dict):
    """A model's state dict read from a source (name -> tensor)."""


class ModelStateProvider(StateProvider):
    """A model's state dict stored as :class:`.torch_providers.ModuleProvider` stores a
    module's (same names, same kind), so that a restore into a module takes it."""

    kind = ModuleProvider.kind

    def items(self, state, ctx):
        for name, t in state.items():
            yield TensorItem(name, t, immutable=True)  # read from a file: nothing changes it

    def load(self, state, stored, ctx):
        return {name: stored.tensor(name) for name in stored.records}


@dataclass
class OptimizerState:
    """An optimizer state dict read from a source; ``type_name``: the optimizer's class
    (a state dict does not say it)."""

    state_dict: dict
    type_name: str

    def parameter_names(self) -> dict[Any, str]:
        """Each parameter's key in the state dict -> its stored name: its own when the
        source names parameters (DCP's ``get_state_dict``), else ``@<position>`` as
        :class:`.optimizer_state.OptimizerProvider` names a parameter it cannot name."""
        keys = [p for g in self.state_dict["param_groups"] for p in g["params"]]
        # DCP keeps state keys as strings ("0") beside int params (0): compare them as strings
        return {str(p): p if isinstance(p, str) else f"@{k}" for k, p in enumerate(keys)}


class OptimizerStateProvider(StateProvider):
    """An optimizer state dict in the layout of :class:`.optimizer_state.OptimizerProvider`
    (its items made by the same function): tensors in hyper-parameters and state values,
    and state keys other than strings, stored as a live optimizer's are."""

    kind = OptimizerProvider.kind

    def items(self, opt, ctx):
        names = opt.parameter_names()
        groups = [({k: v for k, v in g.items() if k != "params"}, [names[str(p)] for p in g["params"]])
                  for g in opt.state_dict["param_groups"]]
        hyper_of = {pname: hyper for hyper, pnames in groups for pname in pnames}
        states = {}  # parameter name -> (its key in the state dict, its state)
        for key, entry in opt.state_dict["state"].items():
            pname = names.get(str(key))
            if pname is None:  # a parameter no group lists
                pname = f"@{key}"
                if pname in hyper_of:  # the name of a listed parameter, by its position
                    raise ValueError(f"the optimizer state {key!r} is of a parameter that no param group lists, "
                                     f"and would be stored as that of parameter {pname!r}, which one lists")
            if pname in states:  # keys 0 and "0"
                raise ValueError(f"the optimizer states {states[pname][0]!r} and {key!r} would both be stored as "
                                 f"that of parameter {pname!r}")
            states[pname] = key, entry
        # in the groups' order, as a live optimizer's; then the states of parameters no group lists
        order = [pname for _, pnames in groups for pname in pnames if pname in states]
        order += [pname for pname in states if pname not in hyper_of]
        # read from a file: nothing changes its tensors until they are written, nor sets a
        # hyper-parameter in place; no predictors: a live optimizer's name the model's parameters
        yield from optimizer_items(opt.type_name, groups, ((hyper_of.get(pname), pname, states[pname][1])
                                                           for pname in order), immutable=True,
                                   label="optimizer" if opt.type_name == DEFAULT_OPTIMIZER_TYPE else None)

    def load(self, opt, stored, ctx):
        raise TypeError("an imported optimizer state is read through a History, not restored into")


register_provider(ModelState, ModelStateProvider())
register_provider(OptimizerState, OptimizerStateProvider())


@contextmanager
def rng_states(states: dict | None) -> Iterator[None]:
    """This process's RNG states set to a Trainer's ``rng_state.pth`` states while the
    write captures them (then set back): the restore point restores the training's."""
    if not states:
        yield
        return
    saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        if "cpu" in states:
            torch.set_rng_state(states["cpu"])
        if "numpy" in states:
            np.random.set_state(states["numpy"])
        if "python" in states:
            random.setstate(states["python"])
        yield
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


DEFAULT_OPTIMIZER_TYPE = "unknown"
# The host cache of an import: its tensors are already in host memory (mapped from the
# source files), and a small cache, reused as a ring, costs fewer page faults than a
# training run's default (measured in tools/bench_import.py: half the CPU time).
IMPORT_CACHE_BYTES = 128 << 20


def import_sources(run: str, sources: list[Source], *, backend: str | None = None, codec: str = "delta",
                   optimizer_type: str = DEFAULT_OPTIMIZER_TYPE, on_step=None) -> list[ImportedStep]:
    """Write ``sources`` (from :func:`find_sources`) into the run at ``run`` (created
    if missing), one step each; the steps committed, each given to
    ``on_step(ImportedStep)`` once committed (and, for a trajectory point, demoted).

    A run that already has steps takes only steps after its newest (steps only
    grow): otherwise nothing is imported. A source that fails to read or to store
    stops the import; the steps before it are committed, and a run this call
    created (or found an empty folder) is left as it was when no step of it was.
    """
    from ..checkpointer import Checkpointer
    from ..durable import remove_tree
    from ..retention import KeepEvery, Trajectory, demote_steps

    _check_run_is_no_source(run, sources)
    reading = ((source, read_source(source)) for source in sources)
    first = next(reading, None)  # a first source that cannot be read leaves no run behind
    if first is None:
        return []
    created = not os.path.lexists(run)
    was_empty = not created and os.path.isdir(run) and not os.path.islink(run) and not os.listdir(run)
    # every step in two units (model and extras' tensors; optimizer and RNG states): trajectory points drop
    # the second, which holds only this process's RNG state for them
    ckpt = Checkpointer(run, backend=backend, codec=codec, keep=KeepEvery(1),
                        trajectory=Trajectory("model/*", "extra/*"),
                        host_cache_bytes=IMPORT_CACHE_BYTES)
    trajectory_points: list[int] = []
    written: list[ImportedStep] = []
    try:
        _check_after(run, ckpt.steps(), sources)
        for source, contents in itertools.chain([first], reading):
            if not contents.model:
                raise ValueError(f"cannot import {source.path}: it holds no model tensors")
            if "" in contents.model:
                raise ValueError(f"cannot import {source.path}: one of its model tensors has an empty name (''), "
                                 "which the backends cannot store")
            optimizer = None if contents.optimizer is None else OptimizerState(contents.optimizer, optimizer_type)
            extra = extras(contents.extra, source)
            ckpt._collector.capture_rng = contents.rng is not None  # the importing process's states: not the run's
            with rng_states(contents.rng):
                try:
                    ckpt.write(source.step, ModelState(contents.model), optimizer, **extra)
                except (TypeError, ValueError) as exc:  # what no backend stores (a set, a sparse tensor, a name)
                    raise ValueError(f"cannot import {source.path}: {exc}") from None
            if not contents.restore_point:
                trajectory_points.append(source.step)
            written.append(ImportedStep(source, contents.restore_point, len(contents.model),
                                        sum(t.numel() * t.element_size() for t in contents.model.values())))
    finally:
        try:
            ckpt.wait()
        finally:
            committed = set(ckpt.steps())
            demote_steps(run, ckpt.index, [s for s in trajectory_points if s in committed])
            ckpt.close()
            if (created or was_empty) and not committed:  # nothing was imported: leave the run as it was
                for leftover in ([run] if created else [os.path.join(run, name) for name in os.listdir(run)]):
                    remove_tree(leftover)
            # only now is each step's line true: committed, and demoted where it is a trajectory point
            imported = [step for step in written if step.source.step in committed]
            if on_step is not None:
                for step in imported:
                    on_step(step)
    return imported


def _check_run_is_no_source(run: str, sources: list[Source]) -> None:
    """Refuse a run that is a source, or inside a source folder: the import would write into it."""
    real = os.path.realpath(run)
    for source in sources:
        if is_inside(source.path, run):
            inside = real != os.path.realpath(source.path)
            raise ValueError(f"cannot import into {run}: it is {'inside ' if inside else ''}the source "
                             f"{source.path}, which the import would write into; import into a new run")


# the parameters of Checkpointer.write besides its extras, and restore()'s options, which
# no extra may be named
WRITE_PARAMETERS = ("step", "model", "optimizer", *RESTORE_OPTIONS)


def extras(entries: dict[str, Any], source: Source) -> dict[str, Any]:
    """A source's other entries as ``write()``'s extras: one named as a parameter of
    ``write`` (a checkpoint's own ``step``) or an option of ``restore()`` (its ``rng``
    state) is stored as ``source_<name>``."""
    out = {f"source_{k}" if k in WRITE_PARAMETERS else k: v for k, v in entries.items()}
    if len(out) < len(entries):
        clash = next(k for k in WRITE_PARAMETERS if k in entries and f"source_{k}" in entries)
        raise ValueError(f"cannot import {source.path}: its entries {clash!r} and 'source_{clash}' would both "
                         f"be stored as 'source_{clash}'")
    return out


def _check_after(run: str, steps: list[int], sources: list[Source]) -> None:
    """Refuse (before anything is written) a source whose step the run has, or is before its newest."""
    if not steps or not sources or sources[0].step > steps[-1]:
        return
    have = set(steps)
    clash = next((s for s in sources if s.step in have), None)
    if clash is not None:
        raise ValueError(f"{run} already holds step {clash.step} ({clash.path}); nothing was imported: "
                         "import into a new run, or leave out the sources it holds")
    raise ValueError(f"step {sources[0].step} ({sources[0].path}) is before step {steps[-1]}, the newest "
                     f"in {run}; steps only grow, so nothing was imported: import into a new run")
