"""How each torch dtype is stored: the numpy dtype of its bytes in the file.

ADIOS2 and HDF5 have no bfloat16 (ADIOS2 has no float16 either), and float8
has no numpy type at all: such tensors are stored as their bit patterns in an
unsigned integer of the same width, and the real dtype is recorded beside them.
"""

from __future__ import annotations

import numpy as np
import torch

_STORAGE: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "uint16",
    torch.bfloat16: "uint16",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "uint8",
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _STORAGE[getattr(torch, _name)] = _name
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _STORAGE[getattr(torch, _name)] = "uint8"

_BY_NAME = {str(d).removeprefix("torch."): d for d in _STORAGE}
STORABLE = frozenset(_STORAGE)  # the torch dtypes a tensor may have to be stored


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; raises for dtypes that cannot be stored."""
    if dtype not in _STORAGE:
        raise TypeError(f"tensors of dtype {dtype} cannot be stored")
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype recorded as ``name``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise TypeError(f"unknown stored dtype {name!r}") from None


def storage_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype whose bytes are written for a tensor of ``dtype``."""
    if dtype not in _STORAGE:
        raise TypeError(f"tensors of dtype {dtype} cannot be stored")
    return np.dtype(_STORAGE[dtype])


def storage_torch_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch dtype that views a tensor's bytes as its storage dtype."""
    return _BY_NAME[_STORAGE[dtype]]
