"""Built-in State Providers for PyTorch modules, optimizers, and RNG state.

Importing this module registers them (:func:`.providers.register_provider`).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parameter import is_lazy

from . import values
from .items import TensorItem, ValueItem
from .optimizer_state import OptimizerProvider
from .providers import (EXPANDED, Context, Problems, StateProvider, compare, decoded, expanded, flatten_under,
                        matching, register_provider)
from .sharding import is_dtensor


def unwrap(module: nn.Module) -> nn.Module:
    """The user's module inside DDP/FSDP-style (``.module``) and compiled (``._orig_mod``) wrappers."""
    while True:
        if hasattr(module, "_orig_mod") and isinstance(module._orig_mod, nn.Module):
            module = module._orig_mod
        elif type(module).__name__ in ("DistributedDataParallel", "DataParallel") and isinstance(
            getattr(module, "module", None), nn.Module
        ):
            module = module.module
        else:
            return module


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter)`` -> fully qualified name (first name wins for tied weights)."""
    names: dict[int, str] = {}
    for name, p in unwrap(module).named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def context_for(model: Any) -> Context:
    """The :class:`Context` of a write or restore of ``model`` (any object, or None)."""
    return Context(param_names=parameter_names(model) if isinstance(model, nn.Module) else {})


class ModuleProvider(StateProvider):
    """Parameters and persistent buffers by fully qualified name, and whatever else the
    module's ``state_dict()`` holds: a submodule's extra state (``get_extra_state()``) is
    a value, its tensors items ``<name>/<path>``.

    Restore reads straight into the module's own parameters and buffers. An entry that
    ``state_dict()`` makes (an extra state, a tensor a state-dict hook computes) goes back
    through the module's ``load_state_dict()``, which hands it to ``set_extra_state()`` or
    to the hooks that take it apart.
    """

    kind = "ModuleProvider"

    @staticmethod
    def _tensors(entries: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors among the module's ``state_dict(keep_vars=True)`` entries."""
        return {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}

    @staticmethod
    def _entries(module: nn.Module) -> dict[str, Any]:
        # one state_dict() per call: its hooks and get_extra_state() may cost something
        return unwrap(module).state_dict(keep_vars=True)

    def items(self, module, ctx):
        return self._items(self._entries(module))

    def _items(self, entries: dict[str, Any]):
        for name, v in entries.items():
            if isinstance(v, torch.Tensor):
                if is_lazy(v):
                    raise ValueError(f"{name!r} of a lazy module (nn.LazyLinear, ...) has no shape yet: "
                                     "run a forward pass first")
                # Buffers (BatchNorm statistics) change during forward: copy them first.
                yield TensorItem(name, v.detach(), volatile=not isinstance(v, nn.Parameter))
                continue
            tensors: dict[str, torch.Tensor] = {}
            yield ValueItem(name, flatten_under(v, name, f"module state {name!r}", tensors.__setitem__))
            for tname, t in tensors.items():
                yield TensorItem(tname, t, volatile=True)

    def check(self, module, state, ctx):
        entries = self._entries(module)
        items = list(self._items(entries))
        problems = compare(items, state)
        live = {i.name for i in items if isinstance(i, ValueItem)}
        stored = _entry_values(state)
        problems.missing += [n for n in live if n not in stored]
        problems.unexpected += [n for n in stored if n not in live]
        tensors = self._tensors(entries)
        # copy_ into a meta tensor does nothing: loading would silently leave the model empty
        problems.mismatched += [(n, "a tensor with data", "a meta tensor: materialize the model first "
                                 "(model.to_empty(device=...))")
                                for n, t in tensors.items() if t.is_meta]
        problems.mismatched += [(n, *EXPANDED) for n, t in tensors.items() if expanded(t)]
        return problems

    def leaves_unloaded(self, problems):
        return False  # tensor by tensor: what matches loads (load_state_dict(strict=False))

    def destinations(self, module, ctx):
        # the store reads only into those it can (CPU, contiguous, of the stored dtype and shape)
        return {n: t for n, t in self._tensors(self._entries(module)).items() if not is_dtensor(t)}

    def load(self, module, state, ctx):
        live, inner = self._tensors(self._entries(module)), unwrap(module)
        own = {id(t) for t in (*inner.parameters(), *inner.buffers())}
        made = {}  # entries state_dict() makes: the module's load_state_dict() takes them back
        with torch.no_grad():
            for name in matching(live, state):
                if live[name].is_meta or expanded(live[name]):  # reported by check()
                    continue
                if id(live[name]) not in own:
                    made[name] = state.tensor(name)
                elif is_dtensor(live[name]):  # read only this rank's shard
                    live[name].to_local().copy_(state.tensor_like(name, live[name]).to_local())
                else:
                    stored = state.tensor(name)
                    if stored.data_ptr() != live[name].data_ptr():  # not already read into it
                        live[name].copy_(stored)
        made.update((name, decoded(state, data)) for name, data in _entry_values(state).items())
        if made:
            left = inner.load_state_dict(made, strict=False).unexpected_keys
            if left:
                raise RuntimeError(f"the module's load_state_dict() does not take {', '.join(map(repr, left))}, "
                                   "which its state_dict() gives (a state_dict hook without a load hook?): "
                                   "not loaded")
        return module


def _entry_values(state) -> dict:
    """The stored values that are entries of a module's state dict; not ``""``, the
    skeleton of a tree of tensors stored by name (read into a module, as the Lightning
    integration writes one)."""
    return {name: data for name, data in state.values.items() if name}


class RNG:
    """The random number generators of this process: torch (CPU and CUDA), numpy, python."""


def rng_prefix(rank: int, size: int) -> str:
    """Where the RNG states of ``rank`` of ``size`` ranks are stored: they differ
    between ranks, so each rank keeps its own."""
    return "rng" if size == 1 else f"rng/rank{rank}"


class RNGProvider(StateProvider):
    """Captures RNG states at write time (they are fresh copies, so safe to copy lazily)."""

    kind = "RNGProvider"

    def items(self, obj, ctx):
        yield TensorItem("torch", torch.get_rng_state())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                yield TensorItem(f"cuda/{i}", s)
        yield ValueItem("numpy", values.encode(_numpy_state(), "numpy RNG"))
        yield ValueItem("python", values.encode(random.getstate(), "python RNG"))

    def check(self, obj, state, ctx):
        return Problems(missing=[n for n in ("torch",) if n not in state.records])

    def load(self, obj, state, ctx):
        torch.set_rng_state(state.tensor("torch"))
        cuda = sorted(n for n in state.records if n.startswith("cuda/"))
        if cuda and torch.cuda.is_available():
            for name in cuda[: torch.cuda.device_count()]:
                torch.cuda.set_rng_state(state.tensor(name), int(name.split("/")[1]))
        if "numpy" in state.values:
            kind, keys, pos, has_gauss, gauss = values.decode(state.values["numpy"])
            np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
        if "python" in state.values:
            random.setstate(values.decode(state.values["python"]))
        return obj


def _numpy_state():
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return (kind, keys.tolist(), int(pos), int(has_gauss), float(gauss))


register_provider(nn.Module, ModuleProvider())
register_provider(torch.optim.Optimizer, OptimizerProvider())
register_provider(RNG, RNGProvider())
