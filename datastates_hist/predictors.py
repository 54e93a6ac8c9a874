"""Predictions of a tensor from other tensors, named by its State Provider.

A delta (:mod:`.codecs`) stores the residual against a prediction. By default the
prediction comes from the tensor's own earlier values. Some state is a known function of
other state, and its provider says so: Adam's second moment ``v`` follows

    g = (m - beta1 * m1) / (1 - beta1)       (the gradient, recovered from the first moments)
    v = beta2 * v1 + (1 - beta2) * g * g

where ``m`` is the first moment of the same step, ``m1`` and ``v1`` those of the base
step. Predicted so, ``v`` leaves a residual of a few rounding bits: GPT small's
``exp_avg_sq`` goes from 0.59 to about 0.06 of its raw bytes (docs/benchmarks.md).

The prediction is computed in float64, one IEEE operation at a time, so that the C
kernel (``_fused.second_moment``) and the numpy reference here give the same bits on any
machine; where an input or the result is unusual (subnormal, NaN, infinite, out of
float32's normal range) the prediction is ``v1`` itself, which no floating-point mode
can change. A prediction need not be accurate to be lossless: only reproducible.

A record's ``predictor`` (docs/format.md, section 6) is
``{"kind": "adam_second_moment", "first": NAME, "beta1": b1, "beta2": b2}``.
"""

from __future__ import annotations

import math

import numpy as np

from .digest import _fused

ADAM_SECOND_MOMENT = "adam_second_moment"
KINDS = (ADAM_SECOND_MOMENT,)
DTYPES = ("float32",)
BLOCK = 1 << 16  # elements per numpy pass: the passes stay in the CPU cache

_FLOAT32_MIN = 2.0 ** -126


def adam_second_moment(first: str, beta1: float, beta2: float) -> dict:
    """The predictor of an Adam second moment whose first moment is tensor ``first``."""
    return check({"kind": ADAM_SECOND_MOMENT, "first": first, "beta1": float(beta1), "beta2": float(beta2)})


def _is_beta(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and 0.0 <= x < 1.0


def check(predictor) -> dict:
    """``predictor`` if well formed (as read from a manifest), else ValueError."""
    if not isinstance(predictor, dict) or predictor.get("kind") not in KINDS:
        raise ValueError(f"the predictor {str(predictor)[:200]} is not one of {list(KINDS)}")
    if set(predictor) != {"kind", "first", "beta1", "beta2"} or not isinstance(predictor["first"], str) \
            or not predictor["first"] or not _is_beta(predictor["beta1"]) or not _is_beta(predictor["beta2"]):
        raise ValueError(f"the predictor {str(predictor)[:200]} needs a tensor name 'first' and float "
                         "'beta1', 'beta2' in [0, 1)")
    return predictor


def _unusual(bits: np.ndarray) -> np.ndarray:
    exponent = bits & np.uint32(0x7F800000)
    return (exponent == np.uint32(0x7F800000)) | ((exponent == 0) & ((bits & np.uint32(0x007FFFFF)) != 0))


def _second_moment_numpy(m, m1, v1, out, beta1, beta2, x):
    """The reference of ``_fused.second_moment`` (same operations, same order)."""
    inv1, c2 = 1.0 / (1.0 - beta1), 1.0 - beta2
    diff_sq = base_sq = 0.0
    m, m1, v1, out = (a.view(np.uint32) for a in (m, m1, v1, out))
    with np.errstate(all="ignore"):
        for start in range(0, m.size, BLOCK):
            cut = slice(start, start + BLOCK)
            fm, fm1, fv1 = (a[cut].view(np.float32).astype(np.float64) for a in (m, m1, v1))
            g = (fm - beta1 * fm1) * inv1
            p = beta2 * fv1 + c2 * (g * g)
            bits = p.astype(np.float32).view(np.uint32)
            keep = (_unusual(m[cut]) | _unusual(m1[cut]) | _unusual(v1[cut]) | ~(np.abs(p) >= _FLOAT32_MIN)
                    | ((bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000)))
            out[cut] = np.where(keep, v1[cut], bits)
            if x is not None:
                d = x.view(np.float32)[cut].astype(np.float64) - fv1
                diff_sq += float(np.dot(d, d))
                base_sq += float(np.dot(fv1, fv1))
    return diff_sq, base_sq


def predict(predictor: dict, first: np.ndarray, first_base: np.ndarray, base: np.ndarray,
            out: np.ndarray, x: np.ndarray | None = None, use_kernel: bool = True) -> tuple[float, float]:
    """Write the prediction's bytes into ``out`` (1-D uint8, as the others): ``first`` is the
    first moment at this step, ``first_base`` and ``base`` the first and second moments at
    the base step. With ``x`` (this step's value), returns the sums ``||x - base||**2`` and
    ``||base||**2`` of the update ratio, else (0, 0)."""
    if predictor["kind"] != ADAM_SECOND_MOMENT:
        raise ValueError(f"unknown predictor {predictor['kind']!r}")
    arrays = (first, first_base, base, out) + (() if x is None else (x,))
    if any(a.size != out.size for a in arrays) or out.size % 4:
        raise ValueError("a prediction needs arrays of the same whole number of float32 values")
    if _fused is not None and use_kernel:
        return _fused.second_moment(first, first_base, base, out, predictor["beta1"], predictor["beta2"], x)
    return _second_moment_numpy(first, first_base, base, out, predictor["beta1"], predictor["beta2"], x)
