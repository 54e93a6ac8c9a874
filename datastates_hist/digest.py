"""Checksums and statistics of tensors, computed piece by piece during the flush.

The checksum is xxh3-64 of the stored bytes in C order (xxhash releases the GIL).
Statistics (L2 norm, min, max, mean, population std, count of non-finite values)
are combined across pieces with Chan's parallel formula, so a tensor streamed
through the host cache gets the same figures as one read whole.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import xxhash

CHUNK = 1 << 22  # elements per statistics pass, bounding temporary memory


def checksum_bytes(data) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class Digest:
    """Running checksum and statistics of one tensor."""

    def __init__(self) -> None:
        self.hasher = xxhash.xxh3_64()
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.nonfinite = 0

    def update(self, raw: np.ndarray, values: torch.Tensor) -> None:
        """Add a piece: ``raw`` its stored bytes, ``values`` the same memory in its real dtype."""
        self.hasher.update(raw)
        flat = values.reshape(-1)
        for i in range(0, flat.numel(), CHUNK):
            self._add(flat[i:i + CHUNK])

    def _add(self, x: torch.Tensor) -> None:
        if x.is_complex():
            x = x.abs()
        if x.dtype not in (torch.float32, torch.float64):
            x = x.to(torch.float32)
        n = x.numel()
        if n == 0:
            return
        # sum, then the dot product of deviations: exact enough in float32 chunks
        # and many times faster than torch.var_mean on CPU.
        mean_c = float(x.sum()) / n
        dev = x - mean_c
        m2_c = float(torch.dot(dev, dev))
        lo, hi = torch.aminmax(x)
        if not (math.isfinite(mean_c) and math.isfinite(m2_c)):
            self.nonfinite += n - int(torch.isfinite(x).sum())
        total = self.n + n
        delta = mean_c - self.mean
        self.mean += delta * n / total
        self.m2 += m2_c + delta * delta * self.n * n / total
        self.n = total
        self.min = min(self.min, float(lo)) if not math.isnan(float(lo)) else math.nan
        self.max = max(self.max, float(hi)) if not math.isnan(float(hi)) else math.nan

    def checksum(self) -> str:
        return self.hasher.hexdigest()

    def stats(self) -> dict[str, float]:
        if self.n == 0:
            return {"nonfinite": 0}
        sumsq = self.m2 + self.n * self.mean * self.mean
        return {
            "norm": math.sqrt(sumsq) if sumsq >= 0 else math.nan,
            "min": self.min, "max": self.max, "mean": self.mean,
            "std": math.sqrt(self.m2 / self.n) if self.m2 >= 0 else math.nan,
            "nonfinite": self.nonfinite,
        }
