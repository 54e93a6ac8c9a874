"""The State Provider of ``torch.optim`` optimizers: state keyed by parameter names.

Registered by :mod:`.torch_providers` for every :class:`torch.optim.Optimizer`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import quote

import torch

from . import predictors, values
from .items import TensorItem, ValueItem
from .providers import Context, Problems, StateProvider, decoded, flatten_under, placeholders
from .sharding import is_dtensor

class OptimizerProvider(StateProvider):
    """Optimizer state keyed by parameter names, so that restore survives a reordering.

    Items: the value ``param_groups`` (hyper-parameters, params as names, the
    optimizer's type), tensors ``state/<param>/<key>``, and the value ``state``:
    the rest of each parameter's state (values that are not tensors; the whole
    state of a parameter that has a key other than a string, its tensors as
    placeholders). A tensor inside a hyper-parameter or a state value (a list of
    tensors) is the tensor ``param_groups/<i>/<path>`` or ``state/<param>/<key>/<path>``,
    named by a ``{"__tensor__": name}`` placeholder in the value.

    A non-strict restore loads all or nothing of an optimizer of the same type and
    param-group structure, as ``load_state_dict`` does; within it, a parameter
    whose stored state does not fit (another shape than the optimizer's own) or
    that the step lacks keeps its own state whole, so that the optimizer can step on.
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
        all_names = self._names(opt, ctx)
        groups = [({k: v for k, v in group.items() if k != "params"}, names)
                  for group, names in zip(opt.param_groups, all_names)]
        entries = ((hyper, pname, opt.state.get(p, {})) for group, (hyper, names) in zip(opt.param_groups, groups)
                   for p, pname in zip(group["params"], names))
        yield from optimizer_items(type(opt).__qualname__, groups, entries,
                                   predict=lambda *state: _adam_predictor(opt, *state))

    def check(self, opt, state, ctx):
        problems = Problems()
        stored = state.values.get("param_groups")
        if stored is None:
            problems.missing.append("param_groups")
            return problems
        if stored["type"] != type(opt).__qualname__:
            problems.mismatched.append(("param_groups", type(opt).__qualname__, stored["type"]))
            return problems  # another optimizer: its parameters and state mean nothing here
        for group in stored["groups"]:  # a placeholder names a tensor the step holds
            _held(state, placeholders(group["options"]))
        problems.mismatched += self._group_problems(opt, stored, ctx)
        have = {n for names in self._names(opt, ctx) for n in names}
        saved = _saved_names(stored)
        problems.missing += sorted(f"param {n}" for n in have - saved)
        problems.unexpected += sorted(f"param {n}" for n in saved - have)
        problems.mismatched += [problem for _, problem in self._state_problems(opt, state, ctx, saved)]
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

    def _state_problems(self, opt, state, ctx: Context, saved: set[str]) -> list[tuple[str, tuple[str, str, str]]]:
        """``(parameter name, problem)`` of each stored state that would not fit the live
        parameter. A state tensor is compared with the optimizer's own of the same key; where
        it has none (a fresh optimizer), a tensor of the parameter's shape or a scalar fits,
        and one of another shape does but for optimizers whose state is all of those
        (torch.optim's but Adafactor and LBFGS) and sharded parameters (whose state of another
        shape can be laid out only as the optimizer's own: there is no other to reshard it by)."""
        params, out = self._params(opt, ctx), []
        for pname, entry in _stored_state(state, saved).items():
            p = params.get(pname)
            if p is None:
                continue
            own = opt.state.get(p, {})
            for key, rname, data in entry:
                if rname is None:
                    held = _held(state, placeholders(data))
                    if held and is_dtensor(p):
                        out.append((pname, (f"state/{pname}/{key}", "no tensors in a list or dict (the parameter is "
                                            "sharded: they cannot be resharded)",
                                            f"{held} tensor{'s' if held > 1 else ''} in a list or dict")))
                    continue
                shape, live = state.records[rname].shape, own.get(key)
                if isinstance(live, torch.Tensor):
                    if shape != tuple(live.shape):
                        out.append((pname, (rname, f"shape {list(live.shape)}", f"shape {list(shape)}")))
                elif shape in (tuple(p.shape), ()):
                    continue
                elif type(opt) in _PARAM_SHAPED:
                    out.append((pname, (rname, f"shape {list(p.shape)}", f"shape {list(shape)}")))
                elif is_dtensor(p):
                    out.append((pname, (rname, f"shape {list(p.shape)} or [] (the parameter is sharded: a state "
                                        "tensor of another shape is laid out as the optimizer's own, and it holds "
                                        "none to reshard it by)", f"shape {list(shape)}")))
        return out

    def leaves_unloaded(self, problems):
        # all but a parameter's state: the optimizer's type, or its param-group structure
        return "param_groups" in problems.missing or any(
            not name.startswith("state/") for name, _, _ in problems.mismatched)

    def load(self, opt, state, ctx):
        stored = state.values["param_groups"]
        saved = _saved_names(stored)
        group_of = {n: g for g in stored["groups"] for n in g["params"]}
        entries = _stored_state(state, saved)
        params = self._params(opt, ctx)
        misfit = {pname for pname, _ in self._state_problems(opt, state, ctx, saved)}
        sd_groups, sd_state, k = [], {}, 0
        texts = []  # (parameter, key, value) of the state values that hold strings
        for group, names in zip(opt.param_groups, self._names(opt, ctx)):
            options = {key: v for key, v in group.items() if key != "params"}
            found = next((group_of[n] for n in names if n in group_of), None)
            if found is not None:
                options.update(_onto(decoded(state, found["options"]), options))
            ids = []
            for name in names:
                p = params[name]
                if name in misfit or name not in saved:  # keeps its own state
                    entry = dict(opt.state.get(p, {}))
                else:
                    own, entry = opt.state.get(p, {}), {}
                    for key, rname, data in entries.get(name, []):
                        if rname is None:
                            entry[key] = decoded(state, data)
                        else:  # sharded as the optimizer's own, else as the parameter if of its shape
                            live = own.get(key)
                            if not is_dtensor(live):
                                live = p if state.records[rname].shape == tuple(p.shape) else None
                            entry[key] = state.tensor(rname) if live is None else state.tensor_like(rname, live)
                texts += [(p, key, v) for key, v in entry.items() if _holds_text(v)]
                if entry:
                    sd_state[k] = entry
                ids.append(k)
                k += 1
            sd_groups.append({**options, "params": ids})
        opt.load_state_dict({"state": sd_state, "param_groups": sd_groups})
        for p, key, value in texts:  # load_state_dict makes a string in the state the text of a generator
            opt.state[p][key] = _cast(value, p)
        return opt


def optimizer_items(kind: str, groups: list[tuple[dict, list[str]]], entries: Iterable[tuple[dict | None, str, dict]],
                    *, immutable: bool = False, predict: Callable | None = None,
                    label: str | None = None) -> Iterator[TensorItem | ValueItem]:
    """The items of an optimizer of type ``kind`` in the layout of :class:`OptimizerProvider`,
    for a live optimizer and for a state dict read from a file (:mod:`.importing`) alike.

    ``groups``: each param group's hyper-parameters and its parameters' names; ``entries``:
    each parameter's group's hyper-parameters, name and state, in the groups' order (the
    state of a parameter that no group lists, its hyper-parameters None, is stored as well).
    ``immutable``: the tensors are read from a file, so nothing changes them until they are
    written (no hyper-parameter is volatile). ``predict(hyper, pname, key, entry)``: the
    predictor of a state tensor of a string key, or None. ``label``: what errors call the
    optimizer (``kind`` by default).
    """
    named = label or kind
    hypers, tensors = [], {}  # tensors: item name -> tensor, of every value below
    for i, (hyper, names) in enumerate(groups):
        hypers.append({"params": names,
                       "options": _flattened(hyper, f"param_groups/{i}", tensors, f"{named} param group {i}")})
    yield ValueItem("param_groups", {"type": kind, "groups": hypers})
    for name, t in tensors.items():
        # hyper-parameters of a live optimizer: a scheduler sets them in place
        yield TensorItem(name, t, volatile=not immutable, immutable=immutable)
    rest, known = {}, {n for _, names in groups for n in names}
    for hyper, pname, entry in entries:
        # keys all strings: the tensors are items of their own, the rest a dict by key;
        # else the whole state as key-value pairs (tensors as placeholders), keys kept exact
        plain = all(isinstance(key, str) for key in entry) and _TAGS.isdisjoint(entry)
        pairs = []
        for key, v in entry.items():
            # said only in an error (write() runs every step: no text made for nothing)
            where = lambda key=key, pname=pname: f"{named} state {key!r} of parameter {pname!r}"  # noqa: E731
            if isinstance(key, str):
                _check_state_name(pname, key, known)
            else:
                _check_state_key(key, where())
            if isinstance(v, torch.Tensor):
                name, t = f"state/{pname}/{key}" if type(key) is str else _state_name(pname, key), v.detach()
                _claim(name, tensors, t, where)
                use = predict is not None and hyper is not None and isinstance(key, str)
                yield TensorItem(name, t, predictor=predict(hyper, pname, key, entry) if use else None,
                                 immutable=immutable)
                if not plain:
                    pairs.append((key, {"__tensor__": name}))
            else:
                mine = {}
                data = _flattened(v, _state_name(pname, key), mine, where())
                for name, t in mine.items():
                    _claim(name, tensors, t, where)
                    yield TensorItem(name, t, immutable=immutable)
                pairs.append((key, data))
        if not pairs:
            continue
        if plain:
            rest[pname] = dict(pairs)
        else:
            rest[pname] = {"__dict__": [[values.encode(key, f"state/{pname}"), data] for key, data in pairs]}
    yield ValueItem("state", rest)


# torch.optim's optimizers whose per-parameter state tensors are all of the parameter's
# shape, or scalars (not Adafactor's factored moments, nor LBFGS's flat history)
_PARAM_SHAPED = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop",
    "SparseAdam") if hasattr(torch.optim, name))

_TAGS = frozenset(values.TAGS)


def _state_name(pname: str, key: Any) -> str:
    """The item name of state ``key`` of parameter ``pname``: the key itself when a string
    (as always), else its text percent-quoted (an int ``0``: ``0``)."""
    return f"state/{pname}/{key}" if isinstance(key, str) else f"state/{pname}/{quote(str(key), safe='')}"


def _check_state_key(key: Any, where: str) -> None:
    """Refuse a state key that is not a string and that a value cannot hold (an object)."""
    try:
        values.encode(key, where)
    except values.UnsupportedValueError:
        raise values.UnsupportedValueError(
            f"{where}: a state key of type {type(key).__module__}.{type(key).__qualname__} cannot be "
            "stored; a key may be a string, int, float, bool, None or a tuple of them") from None


def _claim(name: str, tensors: dict, t: torch.Tensor, where: Callable[[], str]) -> None:
    """Add tensor item ``name`` to ``tensors``, refusing a name taken by another state
    (``where()`` says which)."""
    if name in tensors:
        raise values.NameClashError(f"{where()}: its tensor would be stored as {name}, which another state of the "
                                    "optimizer is stored as (keys that differ only in type, such as 1 and '1', "
                                    "or a key holding '/'); rename one")
    tensors[name] = t


def _flattened(value: Any, base: str, tensors: dict, where: str) -> Any:
    """:func:`.providers.flatten_under`, each tensor added to ``tensors`` (refusing a name
    another state took)."""
    return flatten_under(value, base, where, lambda name, t: _claim(name, tensors, t, lambda: where))


def _held(state, names: list[str]) -> int:
    """How many ``names`` are; a name the step lacks (a damaged or crafted value) raises KeyError."""
    for name in names:
        if name not in state.records:
            raise KeyError(f"a value refers to tensor {name!r}, which the step does not hold")
    return len(names)


def _onto(value: Any, live: Any) -> Any:
    """Stored hyper-parameters on the devices of the live ones (a tensor learning rate on
    the GPU of a capturable optimizer stays there)."""
    if isinstance(value, torch.Tensor) and isinstance(live, torch.Tensor):
        return value.to(live.device)
    if isinstance(value, dict) and isinstance(live, dict):
        return {k: _onto(v, live.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and isinstance(live, (list, tuple)) and len(value) == len(live):
        return type(value)(_onto(v, w) for v, w in zip(value, live))
    return value


def _holds_text(value: Any) -> bool:
    """Whether a state value holds a string (as itself, or in its lists, tuples and dicts)."""
    todo = [value]
    while todo:
        x = todo.pop()
        if isinstance(x, str):
            return True
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return False


def _cast(value: Any, p: torch.Tensor) -> Any:
    """A state value as ``Optimizer.load_state_dict`` makes it (its tensors on the parameter's
    device, of its dtype when floating), but its strings kept: torch rebuilds every iterable
    from its items, a string into the text of a generator."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype=p.dtype, device=p.device) if p.is_floating_point() else value.to(device=p.device)
    if isinstance(value, dict):
        return {k: _cast(v, p) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, p) for v in value)
    return value


def _stored_state(state, saved: set[str]) -> dict[str, list[tuple[Any, str | None, Any]]]:
    """Each stored parameter's state, as ``(key, record name, None)`` for a state tensor
    and ``(key, None, data)`` for another value (its tensors as placeholders)."""
    out: dict[str, list] = {}
    referenced: set[str] = set()
    for pname, entry in state.values.get("state", {}).items():
        if isinstance(entry, dict) and len(entry) == 1 and "__dict__" in entry:  # keys not all strings
            pairs = [_pair(pair) for pair in entry["__dict__"]]
        else:
            pairs = list(entry.items())
        mine = out.setdefault(pname, [])
        for key, data in pairs:
            if isinstance(data, dict) and len(data) == 1 and isinstance(data.get("__tensor__"), str):
                mine.append((key, data["__tensor__"], None))  # a state tensor of this key
                referenced.add(data["__tensor__"])
            else:
                mine.append((key, None, data))
                referenced.update(placeholders(data))
    for rname in state.records:  # the state tensors of string keys, by their names
        if rname.startswith("state/") and rname not in referenced:
            pname, key = _split_state_name(rname, saved)
            out.setdefault(pname, []).append((key, rname, None))
    return out


def _pair(pair: Any) -> tuple[Any, Any]:
    """``(key, data)`` of a stored ``[key, data]`` pair, its key decoded; a pair that
    :meth:`OptimizerProvider.items` cannot have written (damaged or crafted) raises TypeError."""
    if not (isinstance(pair, list) and len(pair) == 2):
        raise TypeError(f"a state entry holds {type(pair).__name__} {str(pair)[:60]}, not a [key, value] pair")
    key = values.decode(pair[0])
    hash(key)  # a list, which only a damaged value holds, raises TypeError
    return key, pair[1]


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
