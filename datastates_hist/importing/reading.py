"""Reading checkpoint files so that no code runs: ``torch.load`` with
``weights_only=True`` (numpy arrays allowed, as transformers allows them for its
RNG states), safetensors, JSON; every failure as one line naming the file."""

from __future__ import annotations

import json
import pickle
from typing import Any

import numpy as np
import torch


def numpy_globals() -> list:
    """What an RNG state of numpy needs to load (the allowlist transformers uses)."""
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_torch(path: str) -> Any:
    """``torch.load`` of ``path`` that runs no code: plain tensors and values only
    (memory-mapped where the file's format allows)."""
    with torch.serialization.safe_globals(numpy_globals()):
        try:
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)  # the legacy format
        except pickle.UnpicklingError as exc:
            refused = refusal_line(exc)
            if refused is None:
                raise OSError(f"cannot read {path}: damaged or not a torch file") from exc
            raise ValueError(f"refused {path}: it holds more than tensors and plain values, and loading it "
                             f"could run code ({refused})") from None
        except (OSError, EOFError, RuntimeError, ValueError) as exc:
            raise OSError(f"cannot read {path}: {first_line(exc)}") from exc


# what torch's weights_only unpickler says when it refuses a global or a type to build
REFUSALS = ("GLOBAL", "Can only build")


def refusal_line(exc: BaseException) -> str | None:
    """The line of a ``weights_only`` refusal that names the global or type the file
    asks for; None when torch failed for another reason (random bytes, a truncated pickle)."""
    lines = [line.strip() for line in str(exc).splitlines()]
    named = [line for line in lines if any(word in line for word in REFUSALS)]
    return named[0].split(". ")[0].rstrip(".") if named else None  # torch's advice follows


def first_line(exc: BaseException) -> str:
    """The first sentence of an error's text (torch's go on with advice for another case)."""
    text = str(exc).strip().splitlines()
    return text[0].split(". ")[0].rstrip(".") if text else type(exc).__name__


def load_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError) as exc:
        raise OSError(f"cannot read {path}: {first_line(exc)}") from exc


def read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot read {path}: {first_line(exc)}") from exc
