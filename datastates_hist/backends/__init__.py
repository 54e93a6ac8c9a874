"""Backends, found by name. Built-ins are imported only when first asked for,
so that ``import datastates_hist`` does not import adios2 or h5py."""

from __future__ import annotations

import importlib

from .base import Backend
from .step import StepReader, StepWriter

_BUILTIN = {
    "adios2": ("datastates_hist.backends.adios2_bp5", "Adios2Backend"),
    "hdf5": ("datastates_hist.backends.hdf5", "HDF5Backend"),
}
_REGISTERED: dict[str, Backend] = {}


def register_backend(name: str, backend: Backend) -> None:
    """Make ``backend`` available as ``Checkpointer(path, backend=name)``."""
    _REGISTERED[name] = backend


def unregister_backend(name: str) -> None:
    """Forget the backend registered as ``name`` (a built-in is found again on next use)."""
    _REGISTERED.pop(name, None)


def backend_names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_REGISTERED))


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; a clear error for unknown names or missing packages."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTIN:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(backend_names())}")
    module_name, cls_name = _BUILTIN[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f" (pip install {exc.name})" if exc.name else ""
        raise ImportError(f"the {name!r} backend cannot be used: {exc}{hint}") from exc
    backend = getattr(module, cls_name)()
    _REGISTERED[name] = backend
    return backend


def make_backend(name: str, options: dict | None = None) -> Backend:
    """The backend ``name``; a new instance with ``options`` (such as ADIOS2
    ``parameters``) when they are given."""
    backend = get_backend(name)
    if not options:
        return backend
    try:
        return type(backend)(**options)
    except TypeError as exc:
        raise TypeError(f"backend {name!r} does not take the options {sorted(options)}: {exc}") from None


__all__ = ["Backend", "StepReader", "StepWriter", "backend_names", "get_backend", "make_backend", "register_backend",
           "unregister_backend"]
