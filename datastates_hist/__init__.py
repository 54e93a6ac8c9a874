"""datastates-hist: lazy asynchronous checkpointing of training into a versioned history.

    import datastates_hist as dh
    ckpt = dh.Checkpointer("runs/exp1")
    ckpt.write(step, model, optimizer, scheduler=scheduler)
    ckpt.restore(model=model, optimizer=optimizer, scheduler=scheduler)
"""

from .checkpointer import Checkpointer
from .restore import Restored
from .history import History, open
from .errors import (
    CheckpointError,
    CorruptionError,
    FormatError,
    RestoreMismatchError,
    ShapeChangeError,
    StepNotFoundError,
    StepOrderError,
    StoreLockedError,
    StoreNotFoundError,
)
from .items import TensorItem, ValueItem
from .providers import Context, StateProvider, StoredState, register_provider

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "Checkpointer", "Context", "CorruptionError", "FormatError",
    "History", "RestoreMismatchError", "Restored", "open", "ShapeChangeError", "StateProvider", "StepNotFoundError", "StepOrderError",
    "StoreLockedError", "StoreNotFoundError", "StoredState", "TensorItem", "ValueItem",
    "register_provider",
]
