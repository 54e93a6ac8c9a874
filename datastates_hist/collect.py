"""What one ``write()`` checkpoints: the State Providers' items of every object,
checked before anything is queued, and this rank's part of them.

No tensor bytes are copied here: tensors are referenced (the snapshot copies
them later); plain values are encoded to JSON now, since they may change as
soon as ``write()`` returns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import values as values_codec
from .dtypes import STORABLE, storage_dtype
from .group import Group
from .items import TensorItem, ValueItem, too_big_for_numpy, under
from .layout import MAX_STEP, integral
from .providers import provider_for
from .sharding import dtensor_item, is_dtensor, split_replicated
from .snapshot import PendingCheckpoint
from .torch_providers import RNG, context_for, rng_prefix


# restore()'s keyword options, which its **extra cannot take
RESTORE_OPTIONS = {"strict": "", "rng": " (whether to restore RNG states; write() always captures them)"}


class Collector:
    """Turns the objects of a ``write()`` into a :class:`PendingCheckpoint` of this rank."""

    def __init__(self, group: Group):
        self.group = group
        self._checked_names: tuple[str, ...] = ()
        # whether a step keeps this process's RNG states: not a step imported from files that hold none
        self.capture_rng = True

    @property
    def rng_prefix(self) -> str:
        """RNG states differ between ranks: each rank keeps its own."""
        return rng_prefix(self.group.rank, self.group.size)

    def collect(self, step: int, model: Any, optimizer: Any, extra: dict) -> PendingCheckpoint:
        """Items of every object, checked; volatile tensors first."""
        ctx = context_for(model)
        objects = {"model": model, **({self.rng_prefix: RNG()} if self.capture_rng else {})}
        if optimizer is not None:
            objects["optim"] = optimizer
        for key, value in extra.items():
            if key in RESTORE_OPTIONS:  # restore(**extra) could never be given it back
                raise ValueError(f"an extra cannot be named {key!r}: restore() takes {key}= as its own option"
                                 f"{RESTORE_OPTIONS[key]}; rename it")
            check_name(f"extra/{key}", "extra")
            objects[f"extra/{key}"] = value
        tensors: list[TensorItem] = []
        items_values: dict[str, Any] = {}
        kinds: dict[str, str] = {}
        for prefix, obj in objects.items():
            provider = provider_for(obj)
            kinds[prefix] = provider.kind
            try:
                for item in provider.items(obj, ctx):
                    name = f"{prefix}/{item.name}" if item.name else prefix
                    if isinstance(item, ValueItem):
                        if name in items_values:
                            raise ValueError(f"two values are named {name!r}; rename one")
                        items_values[name] = item.value
                        continue
                    item.name = name
                    if item.predictor is not None:
                        item.predictor = _resolved(item.predictor, prefix)
                    if is_dtensor(item.tensor):
                        item = self._dtensor_block(item)
                        if item is None:
                            continue
                    _check_tensor(name, item.tensor)
                    _check_shard(name, item)
                    tensors.append(item)
            except values_codec.UnsupportedValueError as exc:
                raise TypeError(f"cannot checkpoint {prefix!r}: {exc}") from None
            except (values_codec.NestingError, values_codec.NameClashError) as exc:
                raise ValueError(f"cannot checkpoint {prefix!r}: {exc}") from None
            except Exception as exc:  # the object's own state_dict(), say: keep its error, say whose
                exc.add_note(f"datastates-hist: raised while collecting {prefix!r} for step {step}")
                raise
        self._check_names(tensors)
        replicated = None
        if self.group.size > 1:
            tensors, replicated = self._my_part(tensors)
        tensors.sort(key=lambda t: not t.volatile)  # volatile first; stable otherwise
        return PendingCheckpoint(step, tensors, {"items": items_values, "objects": kinds}, replicated=replicated)

    def _check_names(self, tensors: list[TensorItem]) -> None:
        """Names the backends can store; checked once per set of names (the same every step)."""
        names = tuple(t.name for t in tensors)
        if names != self._checked_names:
            check_tensor_names(names)
            self._checked_names = names

    def _dtensor_block(self, item: TensorItem) -> TensorItem | None:
        mesh_size = item.tensor.device_mesh.size()
        if mesh_size > self.group.size:
            raise ValueError(
                f"tensor {item.name!r} is a DTensor over {mesh_size} ranks, but this Checkpointer has "
                f"{self.group.size}: create it with comm=... on every rank"
            )
        return dtensor_item(item)

    def _my_part(self, tensors: list[TensorItem]) -> tuple[list[TensorItem], list]:
        """Blocks of shards stay; tensors every rank holds are split among the ranks;
        this rank's own (RNG) tensors stay whole. Also ``[name, dtype, shape]`` of each
        tensor taken as replicated, which every rank must hold alike (:func:`.sharding.replicated_problem`)."""
        own = [t for t in tensors if under(t.name, self.rng_prefix)]
        rest = [t for t in tensors if not under(t.name, self.rng_prefix)]
        shards = [t for t in rest if t.global_shape is not None]
        replicated = [t for t in rest if t.global_shape is None]
        layout = [[t.name, str(t.tensor.dtype).removeprefix("torch."), list(t.tensor.shape)] for t in replicated]
        return own + shards + split_replicated(replicated, self.group.rank, self.group.size), layout


def step_number(step: Any) -> int:
    """``step`` as an int, refused unless a whole number from 0 to :data:`MAX_STEP`."""
    try:
        step = integral(step)
    except TypeError:
        raise ValueError(f"step must be a non-negative int, got {step!r}") from None
    if step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if step > MAX_STEP:
        raise ValueError(f"step {step} is too large: steps go up to 2**63-1 = {MAX_STEP} (a signed "
                         "64-bit integer, as the index stores them)")
    return step


def check_tensor_names(names: "tuple[str, ...] | list[str]") -> None:
    """Refuse tensor names the backends cannot store: HDF5 and ADIOS2 take ``/``-separated
    paths (HDF5 reads ``a//b`` as ``a/b`` and ``a/.`` as ``a``), in UTF-8, up to a NUL; a
    tensor cannot also be the group of others (``x`` beside ``x/y``), nor appear twice."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"two tensors are named {name!r}; rename one")
        seen.add(name)
        check_name(name)
    for name in names:
        parent = name.rpartition("/")[0]
        while parent:
            if parent in seen:
                raise ValueError(f"tensor {parent!r} is also the group of tensor {name!r}: a name "
                                 "cannot be both a tensor and the prefix of another; rename one")
            parent = parent.rpartition("/")[0]


def check_name(name: str, kind: str = "tensor") -> None:
    """Refuse a name with an empty, ``.`` or ``..`` component, a NUL, or no UTF-8 form."""
    for part in name.split("/"):
        if part in ("", ".", ".."):
            what = "an empty" if part == "" else f"a {part!r}"
            raise ValueError(f"{kind} {name!r} has {what} name component (between '/'), which the "
                             "backends cannot store; use keys that are not empty, '.' or '..'")
    if "\0" in name:
        raise ValueError(f"{kind} {name!r} holds a NUL character, which ends a name in the backends")
    try:
        name.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{kind} {name!r} is not valid Unicode (it holds a lone surrogate)") from None


# the most dimensions a stored tensor may have: HDF5's limit (H5S_MAX_RANK), under
# numpy's 64 and ADIOS2's; the same for every backend, so that a run can be exported
MAX_DIMS = 32


# dtypes a conjugate view cannot have: the fast path needs no is_conj() call (complex tensors take the checks below)
_NEVER_CONJ = STORABLE - {torch.complex64, torch.complex128}
_Tensor = torch.Tensor  # looked up once, not at every call of the fast path


def _check_tensor(name: str, t: torch.Tensor) -> None:
    if type(t) is _Tensor and t.layout is torch.strided and not (t.is_meta or t.is_nested) \
            and t.dtype in _NEVER_CONJ and not t.is_neg() and t.dim() <= MAX_DIMS and t.numel():
        return  # the common case, in a fraction of the checks below (write() runs every step)
    if t.is_meta:
        raise ValueError(f"tensor {name!r} is on the meta device and has no data to checkpoint")
    if t.is_nested:
        raise TypeError(f"tensor {name!r} is a nested tensor; only dense tensors can be checkpointed")
    if t.layout is not torch.strided:
        raise TypeError(f"tensor {name!r} has layout {t.layout}; only dense tensors can be checkpointed")
    # the snapshot cannot read a subclass with a __torch_dispatch__ (the Python dispatch key): .numpy()
    # refuses it, and a wrapper has no bytes of its own; one that only overrides __torch_function__
    # (nn.Parameter, as_subclass) reads as a plain tensor
    if type(t) is not _Tensor and torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python):
        what = "that wraps other tensors" if is_traceable_wrapper_subclass(t) else "with its own __torch_dispatch__"
        raise TypeError(f"tensor {name!r} is a torch.Tensor subclass ({type(t).__name__}) {what}; only plain "
                        "tensors (and DTensor) can be checkpointed: checkpoint the plain tensors it holds instead")
    # the snapshot copies a tensor's bytes, which a conjugate or negative view holds unconjugated or unnegated
    if t.is_conj():
        raise ValueError(f"tensor {name!r} is a conjugate view (its conjugate bit is set, as .conj() leaves "
                         "it); call .resolve_conj() on it and checkpoint that tensor, which holds the same values")
    if t.is_neg():
        raise ValueError(f"tensor {name!r} is a negative view (its negative bit is set, as .conj().imag leaves "
                         "it); call .resolve_neg() on it and checkpoint that tensor, which holds the same values")
    try:
        storage_dtype(t.dtype)
    except TypeError:
        raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which cannot be stored") from None
    if t.dim() > MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {t.dim()} dimensions; a stored tensor has at most {MAX_DIMS}")
    why = too_big_for_numpy(t.shape, storage_dtype(t.dtype).itemsize)  # an empty tensor's other dimensions
    if why:
        raise ValueError(f"tensor {name!r} cannot be stored: it has the {why}")


def _check_shard(name: str, item: TensorItem) -> None:
    if (item.global_shape is None) != (item.offset is None):
        raise ValueError(f"shard {name!r} needs both global_shape and offset")
    if item.global_shape is not None:
        why = too_big_for_numpy(item.global_shape, storage_dtype(item.tensor.dtype).itemsize)
        if why:
            raise ValueError(f"shard {name!r} cannot be stored: its global tensor has the {why}")
        shape = tuple(item.tensor.shape)
        if len(item.global_shape) != len(shape) or len(item.offset) != len(shape) or any(
            o < 0 or o + n > g for o, n, g in zip(item.offset, shape, item.global_shape)
        ):
            raise ValueError(
                f"shard {name!r} of shape {list(shape)} at offset {list(item.offset)} does not fit "
                f"its global shape {list(item.global_shape)}"
            )


def _resolved(predictor: dict, prefix: str) -> dict:
    """A provider's predictor with full tensor names: ``first`` and ``second`` are the
    object's (as its items' names), ``weight`` a parameter of the model."""
    out = dict(predictor)
    for key in ("first", "second"):
        if key in out:
            out[key] = f"{prefix}/{out[key]}"
    if "weight" in out:
        out["weight"] = f"model/{out['weight']}"
    return out
