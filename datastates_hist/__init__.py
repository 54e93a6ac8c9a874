"""datastates-hist: lazy asynchronous checkpointing of training into a versioned history.

    import datastates_hist as dh
    ckpt = dh.Checkpointer("runs/exp1")
    ckpt.write(step, model, optimizer, scheduler=scheduler)
    ckpt.restore(model=model, optimizer=optimizer, scheduler=scheduler)

The public names are imported on first use (PEP 562), so that ``import
datastates_hist`` and the command line's ``--help`` and ``ls`` do not import
torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module of this package that defines it
_HOMES = {
    "Checkpointer": "checkpointer",
    "Restored": "restore",
    "History": "history",
    "open": "history",
    "CheckpointError": "errors",
    "CorruptionError": "errors",
    "FormatError": "errors",
    "RestoreMismatchError": "errors",
    "ShapeChangeError": "errors",
    "StepNotFoundError": "errors",
    "StepOrderError": "errors",
    "StoreLockedError": "errors",
    "StoreNotFoundError": "errors",
    "TensorItem": "items",
    "ValueItem": "items",
    "Context": "providers",
    "StateProvider": "providers",
    "StoredState": "providers",
    "register_provider": "providers",
    "KeepLast": "retention",
    "KeepEvery": "retention",
    "Trajectory": "retention",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # found once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
