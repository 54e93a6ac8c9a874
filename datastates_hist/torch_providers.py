"""Built-in State Providers for PyTorch modules, optimizers, and RNG state.

Importing this module registers them (:func:`.providers.register_provider`).
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch
from torch import nn

from . import predictors, values
from .items import TensorItem, ValueItem
from .providers import Context, Problems, StateProvider, matching, register_provider
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
    """Parameters and persistent buffers by fully qualified name."""

    kind = "ModuleProvider"

    def _tensors(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return {
            k: v for k, v in unwrap(module).state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor)
        }

    def items(self, module, ctx):
        for name, t in self._tensors(module).items():
            # Buffers (BatchNorm statistics) change during forward: copy them first.
            yield TensorItem(name, t.detach(), volatile=not isinstance(t, nn.Parameter))

    def check(self, module, state, ctx):
        problems = super().check(module, state, ctx)
        # copy_ into a meta tensor does nothing: loading would silently leave the model empty
        problems.mismatched += [(n, "a tensor with data", "a meta tensor: materialize the model first "
                                 "(model.to_empty(device=...))")
                                for n, t in self._tensors(module).items() if t.is_meta]
        return problems

    def leaves_unloaded(self, problems):
        return False  # tensor by tensor: what matches loads (load_state_dict(strict=False))

    def destinations(self, module, ctx):
        # the store reads only into those it can (CPU, contiguous, of the stored dtype and shape)
        return {n: t for n, t in self._tensors(module).items() if not is_dtensor(t)}

    def load(self, module, state, ctx):
        live = self._tensors(module)
        with torch.no_grad():
            for name in matching(live, state):
                if live[name].is_meta:
                    continue
                if is_dtensor(live[name]):  # read only this rank's shard
                    live[name].to_local().copy_(state.tensor_like(name, live[name]).to_local())
                else:
                    stored = state.tensor(name)
                    if stored.data_ptr() != live[name].data_ptr():  # not already read into it
                        live[name].copy_(stored)
        return module


class OptimizerProvider(StateProvider):
    """Optimizer state keyed by parameter names, so that restore survives a reordering.

    Items: the value ``param_groups`` (hyper-parameters, params as names, the
    optimizer's type), tensors ``state/<param>/<key>``, and non-tensor state
    values under the same names.

    A non-strict restore loads all or nothing of an optimizer of the same type and
    param-group structure, as ``load_state_dict`` does; within it, a parameter
    whose stored state does not fit (another shape) or that the step lacks keeps
    its own state whole, so that the optimizer can step on.
    """

    kind = "OptimizerProvider"

    def _names(self, opt: torch.optim.Optimizer, ctx: Context) -> list[list[str]]:
        out, k = [], 0
        for group in opt.param_groups:
            names = []
            for p in group["params"]:
                names.append(ctx.param_names.get(id(p), f"@{k}"))
                k += 1
            out.append(names)
        return out

    def _params(self, opt: torch.optim.Optimizer, ctx: Context) -> dict[str, torch.Tensor]:
        """Parameter name -> parameter."""
        return {n: p for g, names in zip(opt.param_groups, self._names(opt, ctx)) for p, n in zip(g["params"], names)}

    def items(self, opt, ctx):
        groups, all_names = [], self._names(opt, ctx)
        for group, names in zip(opt.param_groups, all_names):
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({"params": names, "options": values.encode(hyper, "param_groups")})
        yield ValueItem("param_groups", {"type": type(opt).__qualname__, "groups": groups})
        scalars, state, known = {}, opt.state, {n for names in all_names for n in names}
        for group, names in zip(opt.param_groups, all_names):
            for p, pname in zip(group["params"], names):
                for key, v in state.get(p, {}).items():
                    _check_state_name(pname, str(key), known)
                    if isinstance(v, torch.Tensor):
                        predictor = _adam_predictor(opt, group, pname, str(key), state[p])
                        yield TensorItem(f"state/{pname}/{key}", v.detach(), predictor=predictor)
                    else:
                        scalars.setdefault(pname, {})[key] = values.encode(v, f"state/{pname}/{key}")
        yield ValueItem("state", scalars)

    def check(self, opt, state, ctx):
        problems = Problems()
        stored = state.values.get("param_groups")
        if stored is None:
            problems.missing.append("param_groups")
            return problems
        if stored["type"] != type(opt).__qualname__:
            problems.mismatched.append(("param_groups", type(opt).__qualname__, stored["type"]))
            return problems  # another optimizer: its parameters and state mean nothing here
        problems.mismatched += self._group_problems(opt, stored, ctx)
        have = {n for names in self._names(opt, ctx) for n in names}
        saved = _saved_names(stored)
        problems.missing += sorted(f"param {n}" for n in have - saved)
        problems.unexpected += sorted(f"param {n}" for n in saved - have)
        problems.mismatched += self._shape_problems(opt, state, ctx, saved)
        return problems

    def _group_problems(self, opt, stored: dict, ctx: Context) -> list[tuple[str, str, str]]:
        """The param-group structure: as many groups, each parameter in the group of the same index."""
        live, saved = self._names(opt, ctx), [g["params"] for g in stored["groups"]]
        if len(live) != len(saved):
            return [("param_groups", f"{type(opt).__qualname__} with {_groups(len(live))}",
                     f"{stored['type']} with {_groups(len(saved))}")]
        group_of = {n: i for i, names in enumerate(saved) for n in names}
        return sorted((f"param {n}", f"in param group {i}", f"in param group {group_of[n]}")
                      for i, names in enumerate(live) for n in names if group_of.get(n, i) != i)

    def _shape_problems(self, opt, state, ctx: Context, saved: set[str]) -> list[tuple[str, str, str]]:
        params, out = self._params(opt, ctx), []
        for name, rec in state.records.items():
            p = params.get(_split_state_name(name, saved)[0])
            if p is not None and rec.shape not in (tuple(p.shape), ()):
                out.append((name, f"shape {list(p.shape)}", f"shape {list(rec.shape)}"))
        return out

    def leaves_unloaded(self, problems):
        # all but a parameter's state: the optimizer's type, or its param-group structure
        return "param_groups" in problems.missing or any(
            not name.startswith("state/") for name, _, _ in problems.mismatched)

    def load(self, opt, state, ctx):
        stored = state.values["param_groups"]
        saved = _saved_names(stored)
        group_of = {n: g for g in stored["groups"] for n in g["params"]}
        scalars = state.values.get("state", {})
        params = self._params(opt, ctx)
        by_param: dict[str, list[tuple[str, str]]] = {}  # param name -> [(state key, record name)]
        for rname in state.records:
            pname, key = _split_state_name(rname, saved)
            by_param.setdefault(pname, []).append((key, rname))
        misfit = {_split_state_name(n, saved)[0] for n, _, _ in self._shape_problems(opt, state, ctx, saved)}
        sd_groups, sd_state, k = [], {}, 0
        for group, names in zip(opt.param_groups, self._names(opt, ctx)):
            options = {key: v for key, v in group.items() if key != "params"}
            found = next((group_of[n] for n in names if n in group_of), None)
            if found is not None:
                options.update(values.decode(found["options"]))
            ids = []
            for name in names:
                if name in misfit or name not in saved:  # keeps its own state
                    entry = dict(opt.state.get(params[name], {}))
                else:
                    entry = {key: values.decode(v) for key, v in scalars.get(name, {}).items()}
                    for key, rname in by_param.get(name, []):
                        entry[key] = state.tensor_like(rname, params[name])
                if entry:
                    sd_state[k] = entry
                ids.append(k)
                k += 1
            sd_groups.append({**options, "params": ids})
        opt.load_state_dict({"state": sd_state, "param_groups": sd_groups})
        return opt


def _saved_names(stored_groups: dict) -> set[str]:
    """The parameter names of the stored ``param_groups`` value."""
    return {n for g in stored_groups["groups"] for n in g["params"]}


def _groups(count: int) -> str:
    return f"{count} param group" + ("" if count == 1 else "s")


def _split_state_name(name: str, params: set[str]) -> tuple[str, str]:
    """(parameter name, state key) of the item ``state/<param>/<key>``, given the stored
    parameter names. A parameter name may hold ``/`` (``nn.ModuleDict({"enc/a": ...})``):
    the longest stored name that the item starts with wins, so a key without ``/`` always
    splits off right (keys with ``/`` are checked at write, :func:`_check_state_name`)."""
    rest = name.removeprefix("state/")
    cut = rest.rfind("/")
    while cut > 0:
        if rest[:cut] in params:
            return rest[:cut], rest[cut + 1:]
        cut = rest.rfind("/", 0, cut)
    pname, _, key = rest.rpartition("/")  # a parameter the stored groups do not name
    return pname, key


def _check_state_name(pname: str, key: str, params: set[str]) -> None:
    """Refuse a state key whose item name would read back as another parameter's state."""
    if "/" not in key:
        return
    name = f"state/{pname}/{key}"
    read_as = _split_state_name(name, params)
    if read_as != (pname, key):
        raise ValueError(f"cannot checkpoint optimizer state {key!r} of parameter {pname!r}: its item name "
                         f"{name} would read back as state {read_as[1]!r} of parameter {read_as[0]!r}; "
                         "rename the state key or the parameter")


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


# Optimizers whose state follows Adam's moments: exp_avg = lerp(exp_avg, g, 1 - beta1),
# exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g, and the parameter's update from them
# (torch.optim's Adam and AdamW; AdamW's weight decay is decoupled, Adam's is in g).
_ADAM_MOMENTS = (torch.optim.Adam, torch.optim.AdamW)


def _adam_predictor(opt, group: dict, pname: str, key: str, state: dict) -> dict | None:
    """An Adam moment's predictor (:mod:`.predictors`): the second from the first (GPT
    small: 0.59 -> 0.06 of the raw bytes), the first from the parameter's update (0.82 ->
    0.37; not with amsgrad, whose update uses another tensor). Names are the optimizer's;
    ``weight`` is the parameter's name in the model (:mod:`.collect` resolves it)."""
    if key not in ("exp_avg", "exp_avg_sq") or type(opt) not in _ADAM_MOMENTS:
        return None
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    if not (isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor) and m.dtype == v.dtype == torch.float32
            and m.shape == v.shape):
        return None
    try:
        beta1, beta2 = (float(b) for b in group["betas"])
        eps, weight_decay = float(group["eps"]), float(group["weight_decay"])
        step = int(state["step"])
    except (KeyError, TypeError, ValueError, RuntimeError):
        return None
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0) or step < 1:
        return None
    if key == "exp_avg_sq":
        return predictors.adam_second_moment(f"state/{pname}/exp_avg", beta1, beta2)
    if group.get("amsgrad") or not (eps >= 0 and math.isfinite(eps)):
        return None
    fit_decay = isinstance(opt, torch.optim.AdamW) and weight_decay != 0
    return predictors.adam_first_moment(pname, f"state/{pname}/exp_avg_sq", beta1, beta2, eps, step, fit_decay)
