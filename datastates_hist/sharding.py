"""Global tensors written by many ranks: who writes which block, and how the
blocks become one record again.

On every rank of a job, each tensor item is one of:

- a shard: a ``DTensor`` (Shard/Replicate placements) or an item that declares
  ``global_shape`` and ``offset``; the rank writes its block of the global array
  (of DTensor replicas, only the one at coordinate 0 of each replicated mesh
  dimension writes);
- replicated (every other tensor of the model, optimizer and extras, as with
  DDP): the ranks split the writing, so each byte is written once and the
  bandwidth of every rank is used (:func:`split_replicated`);
- per rank (RNG states): stored under ``rng/rank<r>``.

At commit, rank 0 merges the per-rank records of each tensor into one
record whose ``blocks`` say where each part lies (:func:`merge_records`), after
checking that the blocks tile the global shape exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .digest import checksum_bytes, combine_distributions
from .dtypes import storage_dtype
from .items import RAW, TensorItem, TensorRecord, tiling_problem


def is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "placements")


def local_box(t) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offset, shape)`` of this rank's shard of DTensor ``t`` in its global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if type(p).__name__ not in ("Shard", "Replicate"):
            raise ValueError(
                f"a DTensor with placement {p} cannot be checkpointed (Shard and Replicate can; "
                "reduce Partial tensors first)"
            )
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(int(o) for o in offset), tuple(int(s) for s in shape)


def dtensor_item(item: TensorItem) -> TensorItem | None:
    """The block this rank writes of a DTensor item, or None (a replica another rank writes)."""
    t = item.tensor
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh
        return None
    offset, shape = local_box(t)
    local = t.to_local().detach()
    if tuple(local.shape) != shape:
        raise ValueError(f"DTensor {item.name!r}: local shard {list(local.shape)} is not the expected {list(shape)}")
    replica = any(c != 0 for c, p in zip(coordinate, t.placements) if type(p).__name__ == "Replicate")
    if replica:
        return None
    return TensorItem(item.name, local, item.volatile, tuple(t.shape), offset)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * storage_dtype(t.dtype).itemsize


def split_replicated(items: list[TensorItem], rank: int, size: int) -> list[TensorItem]:
    """This rank's part of tensors that every rank holds in full.

    Every rank computes the same plan from the same items: tensors larger than
    an even share are cut along their first dimension across all ranks; the
    others go whole, largest first, to the rank with the fewest bytes so far.
    """
    if size == 1:
        return list(items)
    share = sum(nbytes(i.tensor) for i in items) / size
    load = [0.0] * size
    mine = []
    for item in sorted(items, key=lambda i: (-nbytes(i.tensor), i.name)):
        t, n = item.tensor, nbytes(item.tensor)
        if n > share and t.dim() > 0 and t.shape[0] >= size:
            rows = t.shape[0]
            for r in range(size):
                a, b = rows * r // size, rows * (r + 1) // size
                load[r] += n * (b - a) / rows
                if r == rank:
                    mine.append(TensorItem(item.name, t.narrow(0, a, b - a), item.volatile,
                                           tuple(t.shape), (a,) + (0,) * (t.dim() - 1)))
        else:
            r = min(range(size), key=lambda k: load[k])
            load[r] += n
            if r == rank:
                mine.append(item)
    return mine


def replicated_problem(per_rank: list[list | None]) -> str | None:
    """Why the ranks' replicated tensors (``[name, dtype, shape]`` each, from every rank)
    differ, or None. Each rank writes its part of a plan made from its own list: a tensor
    one rank lacks, or holds with another shape, would be written by nobody or twice."""
    mine = {name: (dtype, shape) for name, dtype, shape in per_rank[0] or []}
    for rank, layout in enumerate(per_rank[1:], 1):
        theirs = {name: (dtype, shape) for name, dtype, shape in layout or []}
        if theirs == mine:
            continue
        said = "write() needs the same tensors on every rank (a tensor not sharded is taken as replicated): "
        for name in sorted(mine.keys() ^ theirs.keys()):
            where, lacks = (0, rank) if name in mine else (rank, 0)
            return said + f"tensor {name!r} is on rank {where}, not on rank {lacks}"
        name = next(n for n in sorted(mine) if mine[n] != theirs[n])
        return (said + f"tensor {name!r} is {mine[name][0]}{mine[name][1]} on rank 0 but "
                f"{theirs[name][0]}{theirs[name][1]} on rank {rank}")
    return None


# --- merging per-rank records at commit ------------------------------------------------

def merge_records(per_rank: list[list[dict]], parts: bool) -> list[TensorRecord]:
    """One record per global tensor from every rank's records of its blocks.

    ``parts``: whether each rank wrote its own file (blocks then name the rank).
    Raises ValueError naming the tensor when the blocks do not tile it.
    """
    by_name: dict[str, list[tuple[int, TensorRecord]]] = {}
    for rank, records in enumerate(per_rank):
        for doc in records:
            rec = TensorRecord.from_json(doc)
            by_name.setdefault(rec.name, []).append((rank, rec))
    return [_merge(name, blocks, parts) for name, blocks in by_name.items()]


def _merge(name: str, found: list[tuple[int, TensorRecord]], parts: bool) -> TensorRecord:
    first = found[0][1]
    shape = first.global_shape if first.global_shape is not None else first.shape
    blocks = []
    for rank, rec in found:
        gshape = rec.global_shape if rec.global_shape is not None else rec.shape
        if rec.dtype != first.dtype or gshape != shape:
            raise ValueError(
                f"tensor {name!r} differs between ranks: rank {found[0][0]} has {first.dtype}{list(shape)}, "
                f"rank {rank} has {rec.dtype}{list(gshape)}"
            )
        start = rec.offset if rec.offset is not None else (0,) * len(shape)
        blocks.append({"start": list(start), "count": list(rec.shape), "checksum": rec.checksum,
                       "part": rank if parts else None, "stats": rec.stats, "distribution": rec.distribution})
    blocks.sort(key=lambda b: b["start"])
    _check_tiling(name, shape, blocks, [r for r, _ in found])
    whole = len(blocks) == 1
    checksum = blocks[0]["checksum"] if whole else "blocks:" + checksum_bytes(
        ",".join(b["checksum"] for b in blocks).encode())
    stats = combine_stats([(math.prod(b["count"]), b.pop("stats")) for b in blocks])
    distributions = [b.pop("distribution") for b in blocks]
    distribution = None if None in distributions else combine_distributions(distributions)
    total = sum(r.nbytes for _, r in found)  # the blocks tile the tensor (checked above)
    return TensorRecord(name, first.dtype, tuple(shape), total, checksum, RAW, stats, blocks=blocks,
                        distribution=distribution)


def _check_tiling(name: str, shape, blocks: list[dict], ranks: list[int]) -> None:
    problem = tiling_problem(tuple(shape), blocks)
    if problem is None:
        return
    if "overlap" in problem:
        raise ValueError(f"tensor {name!r}: {problem.removeprefix('its ')} (two ranks wrote the same part: "
                         "is a replicated tensor declared as a shard?)")
    covered = sum(math.prod(b["count"]) for b in blocks)
    raise ValueError(
        f"tensor {name!r} of shape {list(shape)}: the ranks wrote {covered} of its {math.prod(shape)} elements "
        f"(blocks from ranks {sorted(set(ranks))}); every element must be written by exactly one rank"
    )


def combine_stats(parts: list[tuple[int, dict]]) -> dict:
    """Statistics of a tensor from those of its blocks, all blocks at once (a weighted
    mean, then each block's squared deviations about it): one block's infinite mean
    makes the mean infinite, where merging blocks pairwise would make it NaN."""
    parts = [(n, s) for n, s in parts if n and "mean" in s]
    nonfinite = sum(int(s.get("nonfinite", 0)) for _, s in parts)
    if not parts:
        return {"nonfinite": nonfinite}
    total = sum(n for n, _ in parts)
    mean = sum(n / total * s["mean"] for n, s in parts)
    # squares taken of values scaled to at most 1: finite values near float64's largest
    # would overflow (OverflowError from a Python float's ** 2)
    spreads = [(n, s["std"], s["mean"] - mean) for n, s in parts]
    scale = max((abs(v) for _, std, d in spreads for v in (std, d) if math.isfinite(v) and v), default=1.0)
    m2 = sum(n * ((std / scale) ** 2 + (d / scale) ** 2) for n, std, d in spreads)
    nan = any(math.isnan(s["min"]) for _, s in parts)  # min() and max() would skip a NaN after a number
    return {
        "norm": math.nan if any(math.isnan(s["norm"]) for _, s in parts) else math.hypot(*(s["norm"] for _, s in parts)),
        "min": math.nan if nan else min(s["min"] for _, s in parts),
        "max": math.nan if nan else max(s["max"] for _, s in parts),
        "mean": mean, "std": scale * math.sqrt(m2 / total) if m2 >= 0 else math.nan, "nonfinite": nonfinite,
    }
