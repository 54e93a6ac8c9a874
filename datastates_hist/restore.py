"""Restore: load a committed step into live objects, in place, in two phases.

Phase one asks every target's State Provider what would not match
(:meth:`StateProvider.check`); a strict restore raises one
:class:`RestoreMismatchError` listing everything before anything is loaded.
Phase two loads (:meth:`StateProvider.load`), verifying every tensor's checksum;
a non-strict restore skips the targets whose problems concern them whole
(:meth:`StateProvider.leaves_unloaded`), leaving them as they were.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .errors import CorruptionError, RestoreMismatchError, StepNotFoundError
from .items import under
from .providers import Problems, StoredState, provider_for, rebuild
from .store import Store
from .torch_providers import RNG, ModuleProvider, context_for, rng_prefix


@dataclass
class Restored:
    """What :meth:`Checkpointer.restore` loaded.

    Attributes:
        step: the restored step.
        extra: every extra value of the step by keyword: the objects loaded in
            place, and plain values, tensors and state dicts rebuilt.
        problems: what did not match (only with ``strict=False``).
        skipped: the prefixes (``optim``, ``extra/<key>``) of the objects left as they
            were, because a problem concerns them whole (an optimizer of another type
            or param-group structure, a state dict of another class); ``extra``
            holds them as passed.
        rounded: the tensors loaded with their mantissas rounded (a trajectory point's
            ``keep_bits``, only with ``strict=False``): name -> mantissa bits kept
            (relative error at most ``2**-(bits + 1)``).
    """

    step: int
    time: float
    extra: dict[str, Any] = field(default_factory=dict)
    problems: Problems = field(default_factory=Problems)
    skipped: list[str] = field(default_factory=list)
    rng: bool = False  # whether RNG states were restored (not across a change of the number of ranks)
    rounded: dict[str, int] = field(default_factory=dict)


def restore_step(run_dir: str, step: int | None, model: Any, optimizer: Any, *,
                 strict: bool, rng: bool, extra: dict, rank: int = 0, world_size: int = 1) -> Restored:
    store = Store(run_dir)
    try:
        step = store.latest_restore_point() if step is None else step
        row = store.row(step)
        if row.tier == "trajectory" and strict:
            raise StepNotFoundError(f"{store.not_a_restore_point(row)}; "
                                    "restore(step, strict=False) loads what it has and lists the rest")
        with store.open_step(step) as data:
            items, objects = data.values["items"], data.values["objects"]
            ctx = context_for(model)
            targets: dict[str, Any] = {}
            if model is not None:
                targets["model"] = model
            if optimizer is not None:
                targets["optim"] = optimizer
            # RNG states cannot be carried over to another number of ranks
            own_rng = rng_prefix(rank, world_size) if data.world_size == world_size else None
            if rng and own_rng in objects:
                targets[own_rng] = RNG()
            for key, obj in extra.items():
                if obj is not None:  # None: nothing to load into (rebuilt, as an extra not passed)
                    targets[f"extra/{key}"] = obj
            _check_model_given(items, model, optimizer)

            def state_of(prefix: str) -> StoredState:
                records = {_rel(n, prefix): r for n, r in data.records.items() if under(n, prefix)}
                vals = {_rel(n, prefix): v for n, v in items.items() if under(n, prefix)}
                full = lambda rel: f"{prefix}/{rel}" if rel else prefix  # noqa: E731
                return StoredState(records, vals, lambda rel: data.read(full(rel)),
                                   lambda rel, start, count: data.read_box(full(rel), start, count, verify=True))

            problems, checked, other_kind = Problems(), {}, []
            # a trajectory point lacks the objects whose tensors were in its restore unit; a
            # model's provider names its missing tensors itself (the rest loads with strict=False)
            gone = {p for p in data.restore_objects if objects.get(p) != ModuleProvider.kind
                    } if data.row.tier == "trajectory" else set()
            for prefix, obj in targets.items():
                if prefix not in objects or prefix in gone:
                    problems.missing.append(prefix)
                elif not _reads(provider_for(obj).kind, objects[prefix]):  # its provider could not read the state
                    problems.mismatched.append((prefix, f"{_a(type(obj).__qualname__)} ({provider_for(obj).kind})",
                                                f"the state of {_a(_KINDS.get(objects[prefix], objects[prefix]))}"))
                    other_kind.append(prefix)
                else:
                    with _named_as_damage(prefix, step, run_dir):
                        checked[prefix] = provider_for(obj).check(obj, state_of(prefix), ctx)
                    problems.extend(checked[prefix], prefix)
            if strict and problems:
                raise RestoreMismatchError(step, problems.missing, problems.unexpected, problems.mismatched)
            loading = {prefix: targets[prefix] for prefix, found in checked.items()
                       if not provider_for(targets[prefix]).leaves_unloaded(found)}
            restored = Restored(step=step, time=data.row.time, problems=problems, rng=own_rng in loading,
                                skipped=[prefix for prefix in targets
                                         if prefix in other_kind or prefix in checked and prefix not in loading],
                                rounded=_rounded(data, loading, run_dir))
            if world_size == 1:  # one process takes whole tensors: read them in one batch
                into = {f"{prefix}/{rel}": t for prefix, obj in loading.items()
                        for rel, t in provider_for(obj).destinations(obj, ctx).items()}
                data.prefetch([n for n in data.records if any(under(n, p) for p in loading)], into)
            for prefix, obj in targets.items():
                if prefix in loading:
                    with _named_in_errors(prefix, step, list(loading)):
                        obj = provider_for(obj).load(obj, state_of(prefix), ctx)
                if prefix.startswith("extra/") and (prefix in checked or prefix in other_kind):
                    restored.extra[prefix[6:]] = obj
            for prefix, kind in objects.items():
                key = prefix[6:]
                if prefix.startswith("extra/") and key not in restored.extra:
                    if data.row.tier == "trajectory" and prefix in data.restore_objects:
                        problems.missing.append(prefix)  # its tensors went with the restore unit
                        continue
                    with _named_as_damage(prefix, step, run_dir):
                        restored.extra[key] = rebuild(state_of(prefix), kind)
            return restored
    finally:
        store.close()


def _check_model_given(items: dict, model: Any, optimizer: Any) -> None:
    """An optimizer whose state the step keys by parameter names in the model cannot be
    restored without the model (only one whose parameters had no names, ``@<k>``, can)."""
    groups = items.get("optim/param_groups")
    if optimizer is None or model is not None or not isinstance(groups, dict):
        return
    named = [n for g in groups.get("groups") or [] if isinstance(g, dict) for n in g.get("params") or []]
    if any(not str(n).startswith("@") for n in named):
        raise TypeError("restore() of an optimizer needs the model: the optimizer's state is matched to its "
                        "parameters by their names in the model (pass model=..., or bind it: "
                        "Checkpointer(path, model=...))")


def _rounded(data, loading: dict, run_dir: str) -> dict[str, int]:
    """The tensors of ``loading``'s objects that a trajectory point keeps rounded (its
    low bits went with its restore unit); said in a warning too, as they load inexact."""
    rounded = {name: record.rounded_bits for name, record in data.records.items()
               if record.rounded_bits is not None and any(under(name, prefix) for prefix in loading)}
    if rounded:
        shown = ", ".join(list(rounded)[:3]) + (f" and {len(rounded) - 3} more" if len(rounded) > 3 else "")
        bits, alike = min(rounded.values()), len(set(rounded.values())) == 1
        warnings.warn(f"datastates-hist: step {data.row.step} of {run_dir} is a trajectory point that keeps "
                      f"{len(rounded)} tensor(s) rounded to {bits}{'' if alike else ' or more'} mantissa bits "
                      f"(relative error at most 2**-{bits + 1}): {shown} loaded so, not exact", RuntimeWarning,
                      stacklevel=4)
    return rounded


@contextmanager
def _named_as_damage(prefix: str, step: int, run_dir: str):
    """A stored state that its provider cannot take apart (a value of another
    structure than the provider writes: damaged or crafted) is named as damage."""
    try:
        yield
    except (TypeError, KeyError, AttributeError, IndexError) as exc:
        raise CorruptionError(f"the stored state of {prefix!r} in step {step} of {run_dir} is not what its "
                              f"provider wrote ({type(exc).__name__}: {exc}): the step's data is damaged") from exc


# what each built-in provider stores, as a restore mismatch names it
_KINDS = {"ModuleProvider": "module", "OptimizerProvider": "optimizer", "StateDictProvider": "object with state_dict()",
          "TreeProvider": "plain value or tensor", "RNGProvider": "RNG"}


def _reads(target: str, stored: str) -> bool:
    """Whether a target whose provider is of kind ``target`` can load a state stored by
    one of kind ``stored``: the same kind, or a module from a plain tree of its tensors
    by their ``state_dict()`` names (as the Lightning integration writes it)."""
    return target == stored or (target, stored) == ("ModuleProvider", "TreeProvider")


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


@contextmanager
def _named_in_errors(prefix: str, step: int, order: list[str]):
    """An object's own ``load_state_dict()`` (or a provider's load) that raises: the
    error says which object of the step, and which were loaded before it (``order``:
    the objects loaded, in order)."""
    try:
        yield
    except Exception as exc:
        before = order[:order.index(prefix)]
        exc.add_note(f"datastates-hist: raised while loading {prefix!r} of step {step}"
                     + (f", after {', '.join(repr(p) for p in before)} had been loaded" if before else ""))
        raise


def _rel(name: str, prefix: str) -> str:
    return "" if name == prefix else name[len(prefix) + 1:]
