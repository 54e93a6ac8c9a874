"""What a checkpoint is made of: named tensor items and plain-value items.

State Providers turn objects into these; the snapshot engine copies the
tensors; the backends store them; the index records them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def under(name: str, prefix: str) -> bool:
    """Whether item ``name`` is ``prefix`` itself or lies below it (``prefix/...``)."""
    return name == prefix or name.startswith(prefix + "/")


@dataclass
class TensorItem:
    """One tensor to store under ``name``.

    Attributes:
        name: the item's full name, ``/``-separated (``model/blocks.0.attn.weight``).
        tensor: the live tensor; it is copied lazily, so it must not change before
            the snapshot completes (the hooks of the Checkpointer guard this).
        volatile: True for tensors that change during a forward pass (buffers
            such as BatchNorm statistics): they are copied first, and the next
            forward waits for them.
        global_shape / offset: when the tensor is a shard of a larger global
            tensor, its global shape and the offset of this shard in it.
    """

    name: str
    tensor: torch.Tensor
    volatile: bool = False
    global_shape: tuple[int, ...] | None = None
    offset: tuple[int, ...] | None = None


@dataclass
class ValueItem:
    """One plain value (already encoded as safe JSON data, see :mod:`values`)."""

    name: str
    value: Any


@dataclass
class TensorRecord:
    """What the store records of one tensor of one step (a manifest entry, an index row)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: str = ""
    encoding: str = "raw"  # room for delta encodings against earlier steps
    stats: dict[str, float] = field(default_factory=dict)
    global_shape: tuple[int, ...] | None = None  # set when the tensor is a shard
    offset: tuple[int, ...] | None = None
    # a tensor written by several ranks: where each part lies, as
    # {"start", "count", "checksum", "part"} (part: the rank whose file holds it, or None)
    blocks: list[dict] | None = None

    def to_json(self) -> dict:
        doc = {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape),
            "nbytes": self.nbytes, "checksum": self.checksum,
            "encoding": self.encoding, "stats": self.stats,
        }
        if self.global_shape is not None:
            doc["global_shape"], doc["offset"] = list(self.global_shape), list(self.offset)
        if self.blocks is not None:
            doc["blocks"] = self.blocks
        return doc

    @classmethod
    def from_json(cls, data: dict) -> "TensorRecord":
        return cls(
            name=data["name"], dtype=data["dtype"], shape=tuple(data["shape"]),
            nbytes=int(data["nbytes"]), checksum=data.get("checksum", ""),
            encoding=data.get("encoding", "raw"), stats=dict(data.get("stats", {})),
            global_shape=tuple(data["global_shape"]) if "global_shape" in data else None,
            offset=tuple(data["offset"]) if "offset" in data else None,
            blocks=list(data["blocks"]) if "blocks" in data else None,
        )
