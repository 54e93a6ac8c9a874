"""Built-in State Providers for PyTorch modules, optimizers, and RNG state."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from . import values
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


class ModuleProvider(StateProvider):
    """Parameters and persistent buffers by fully qualified name."""

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
    """

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
        scalars, state = {}, opt.state
        for group, names in zip(opt.param_groups, all_names):
            for p, pname in zip(group["params"], names):
                for key, v in state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        yield TensorItem(f"state/{pname}/{key}", v.detach())
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
        have = {n for names in self._names(opt, ctx) for n in names}
        saved = {n for g in stored["groups"] for n in g["params"]}
        problems.missing += sorted(f"param {n}" for n in have - saved)
        problems.unexpected += sorted(f"param {n}" for n in saved - have)
        params = self._params(opt, ctx)
        for name, rec in state.records.items():
            pname = name.split("/")[1]
            p = params.get(pname)
            if p is not None and rec.shape not in (tuple(p.shape), ()) and len(rec.shape) > 0:
                problems.mismatched.append((name, f"shape {list(p.shape)}", f"shape {list(rec.shape)}"))
        return problems

    def load(self, opt, state, ctx):
        stored = state.values["param_groups"]
        group_of = {n: g for g in stored["groups"] for n in g["params"]}
        scalars = state.values.get("state", {})
        problems = self.check(opt, state, ctx)
        bad = {n for n, _, _ in problems.mismatched}
        params = self._params(opt, ctx)
        by_param: dict[str, list[tuple[str, str]]] = {}  # param name -> [(state key, record name)]
        for rname in state.records:
            _, pname, key = rname.split("/", 2)
            by_param.setdefault(pname, []).append((key, rname))
        sd_groups, sd_state, k = [], {}, 0
        for group, names in zip(opt.param_groups, self._names(opt, ctx)):
            options = {key: v for key, v in group.items() if key != "params"}
            found = next((group_of[n] for n in names if n in group_of), None)
            if found is not None:
                options.update(values.decode(found["options"]))
            ids = []
            for name in names:
                entry = {key: values.decode(v) for key, v in scalars.get(name, {}).items()}
                for key, rname in by_param.get(name, []):
                    if rname not in bad:
                        entry[key] = state.tensor_like(rname, params.get(name))
                if entry:
                    sd_state[k] = entry
                ids.append(k)
                k += 1
            sd_groups.append({**options, "params": ids})
        opt.load_state_dict({"state": sd_state, "param_groups": sd_groups})
        return opt


class RNG:
    """The random number generators of this process: torch (CPU and CUDA), numpy, python."""


class RNGProvider(StateProvider):
    """Captures RNG states at write time (they are fresh copies, so safe to copy lazily)."""

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
