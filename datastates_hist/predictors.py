"""Predictions of a tensor from other tensors, named by its State Provider.

A delta (:mod:`.codecs`) stores the residual against a prediction. By default the
prediction comes from the tensor's own earlier values. Some state is a known function of
other state, and its provider says so. Adam's moments follow, with g the gradient:

    m = beta1 * m1 + (1 - beta1) * g
    v = beta2 * v1 + (1 - beta2) * g * g
    w = w1 * (1 - decay) - step_size * m / (sqrt(v) / bias2 + eps)

(``m1``, ``v1``, ``w1``: the base step's; ``bias2 = sqrt(1 - beta2**t)``,
``step_size = lr / (1 - beta1**t)``, ``decay = lr * weight_decay`` for AdamW.) Two
predictors use it:

- ``adam_second_moment``: v from m (this step) and m1, v1: g = (m - beta1*m1) / (1 - beta1).
  GPT small's exp_avg_sq: 0.59 -> 0.06 of its raw bytes (docs/benchmarks.md).
- ``adam_first_moment``: m from the weights w, w1 and m1, v1: g solves the update's
  equation (a quadratic, once squared: the root that gives m the update's sign), and m
  follows. ``step_size`` and ``decay`` are
  fitted by the writer on the tensor's first piece (the learning rate a scheduler has
  already moved on is not the one the step used) and stored. GPT small's exp_avg: 0.82 ->
  0.37. The weights stay a delta of their own (a trajectory point keeps them alone).

Predictions are computed in float64, one IEEE operation at a time, so that the C kernels
(``_fused.second_moment``, ``_fused.first_moment``) and the numpy references here give
the same bits on any machine; where an input or the result is unusual (subnormal, NaN,
infinite, below float32's smallest normal) the prediction is the tensor's own base value,
which no floating-point mode can change. A prediction need not be accurate to be
lossless: only reproducible. Formats: docs/format.md, section 6, *Predicted deltas*.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .digest import _fused

ADAM_SECOND_MOMENT = "adam_second_moment"
ADAM_FIRST_MOMENT = "adam_first_moment"
KINDS = (ADAM_SECOND_MOMENT, ADAM_FIRST_MOMENT)
DTYPES = ("float32",)
# Whether the writer stores a kind's residual grouped by exponent (codecs.GROUPED; the
# decoder reads either from the chunk table). The second moment's: 0.055 -> 0.037 of its
# raw bytes. The first moment's only 0.373 -> 0.359, for a decode 1.4x slower (the
# prediction's float64 quadratic and the ungrouping's gather are its two largest costs;
# small GPT, tools/bench_codecs.py; docs/performance.md, "Codec speed"): left ungrouped.
GROUPED = {ADAM_SECOND_MOMENT: True, ADAM_FIRST_MOMENT: False}
BLOCK = 1 << 16  # elements per numpy pass: the passes stay in the CPU cache
# the first moment's step size and decay are fitted on this many elements, spread evenly over
# the first piece (the GPT small's ratio is the same as with 32 Ki, and the fit 4x cheaper)
FIT_ELEMENTS = 1 << 13

_FLOAT32_MIN = 2.0 ** -126
# the keys of each kind's record, and which of them name tensors: (key, at this step)
_KEYS = {ADAM_SECOND_MOMENT: {"kind", "first", "beta1", "beta2"},
         ADAM_FIRST_MOMENT: {"kind", "weight", "second", "beta1", "beta2", "eps", "bias2", "step_size", "decay"}}
_NAMES = {ADAM_SECOND_MOMENT: (("first", True), ("first", False)),
          ADAM_FIRST_MOMENT: (("weight", True), ("weight", False), ("second", False))}


def adam_second_moment(first: str, beta1: float, beta2: float) -> dict:
    """The predictor of an Adam second moment whose first moment is tensor ``first``."""
    return check({"kind": ADAM_SECOND_MOMENT, "first": first, "beta1": float(beta1), "beta2": float(beta2)})


def adam_first_moment(weight: str, second: str, beta1: float, beta2: float, eps: float, step: int,
                      fit_decay: bool) -> dict:
    """What a provider says of an Adam first moment (its parameter ``weight``, its second
    moment ``second``, the optimizer's step count ``step`` after the update): the writer
    fits ``step_size`` (and ``decay`` if ``fit_decay``) and completes it (:func:`fitted`)."""
    return {"kind": ADAM_FIRST_MOMENT, "weight": weight, "second": second, "beta1": float(beta1),
            "beta2": float(beta2), "eps": float(eps), "bias2": math.sqrt(1.0 - float(beta2) ** int(step)),
            "fit_decay": bool(fit_decay)}


def _is_beta(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and 0.0 <= x < 1.0


def _is_real(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def check(predictor) -> dict:
    """``predictor`` if well formed (as read from a manifest), else ValueError."""
    kind = predictor.get("kind") if isinstance(predictor, dict) else None
    if kind not in KINDS:
        raise ValueError(f"the predictor {str(predictor)[:200]} is not one of {list(KINDS)}")
    names = {key for key, _ in _NAMES[kind]}
    if set(predictor) != _KEYS[kind] or not all(isinstance(predictor[k], str) and predictor[k] for k in names) \
            or not _is_beta(predictor["beta1"]) or not _is_beta(predictor["beta2"]):
        raise ValueError(f"the predictor {str(predictor)[:200]} needs the keys {sorted(_KEYS[kind])}: tensor "
                         f"names {sorted(names)} and float 'beta1', 'beta2' in [0, 1)")
    if kind == ADAM_FIRST_MOMENT:
        p = predictor
        if not (_is_real(p["eps"]) and p["eps"] >= 0 and _is_real(p["bias2"]) and 0 < p["bias2"] <= 1
                and _is_real(p["step_size"]) and p["step_size"] != 0 and _is_real(p["decay"])):
            raise ValueError(f"the predictor {str(predictor)[:200]} needs float 'eps' >= 0, 'bias2' in (0, 1], "
                             "'step_size' not 0 and 'decay'")
    return predictor


def dependencies(predictor: dict, step: int, base: int) -> list[tuple[int, str]]:
    """The values ``(step, name)`` a prediction reads besides the tensor's own base value,
    in the order :func:`predict` takes them."""
    return [(step if now else base, predictor[key]) for key, now in _NAMES[predictor["kind"]]]


def same_step(predictor: dict) -> list[str]:
    """The tensors of the same step a prediction reads (decoded before it)."""
    if not predictor:
        return []
    return [predictor[key] for key, now in _NAMES[predictor["kind"]] if now]


def _unusual(bits: np.ndarray) -> np.ndarray:
    exponent = bits & np.uint32(0x7F800000)
    return (exponent == np.uint32(0x7F800000)) | ((exponent == 0) & ((bits & np.uint32(0x007FFFFF)) != 0))


def _as_f64(bits: np.ndarray) -> np.ndarray:
    return bits.view(np.float32).astype(np.float64)


def _rounded(p: np.ndarray, fallback: np.ndarray, unusual: np.ndarray) -> np.ndarray:
    """p as float32 bits, or ``fallback``'s bits where unusual (or p is)."""
    bits = p.astype(np.float32).view(np.uint32)
    keep = unusual | ~(np.abs(p) >= _FLOAT32_MIN) | ((bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000))
    return np.where(keep, fallback, bits)


def _sums(x, base, cut) -> tuple[float, float]:
    if x is None:
        return 0.0, 0.0
    b = _as_f64(base[cut])
    d = x.view(np.uint32)[cut].view(np.float32).astype(np.float64) - b
    return float((d * d).sum()), float((b * b).sum())


def _second_moment_numpy(m, m1, v1, out, beta1, beta2, x):
    """The reference of ``_fused.second_moment`` (same operations, same order)."""
    inv1, c2 = 1.0 / (1.0 - beta1), 1.0 - beta2
    diff_sq = base_sq = 0.0
    m, m1, v1, out = (a.view(np.uint32) for a in (m, m1, v1, out))
    with np.errstate(all="ignore"):
        for start in range(0, m.size, BLOCK):
            cut = slice(start, start + BLOCK)
            g = (_as_f64(m[cut]) - beta1 * _as_f64(m1[cut])) * inv1
            p = beta2 * _as_f64(v1[cut]) + c2 * (g * g)
            out[cut] = _rounded(p, v1[cut], _unusual(m[cut]) | _unusual(m1[cut]) | _unusual(v1[cut]))
            d, b = _sums(x, v1, cut)
            diff_sq, base_sq = diff_sq + d, base_sq + b
    return diff_sq, base_sq


def _first_moment_numpy(w, w1, v1, m1, out, p, x):
    """The reference of ``_fused.first_moment`` (same operations, same order)."""
    b1, b2, eps, c, s = p["beta1"], p["beta2"], p["eps"], p["bias2"], p["step_size"]
    keep_w, one_b1, one_b2 = 1.0 - p["decay"], 1.0 - p["beta1"], 1.0 - p["beta2"]
    inv_s, inv_c = 1.0 / s, 1.0 / c
    diff_sq = base_sq = 0.0
    w, w1, v1, m1, out = (a.view(np.uint32) for a in (w, w1, v1, m1, out))
    with np.errstate(all="ignore"):
        for start in range(0, w.size, BLOCK):
            cut = slice(start, start + BLOCK)
            fm1, cv = _as_f64(m1[cut]), b2 * _as_f64(v1[cut])
            r = (_as_f64(w1[cut]) * keep_w - _as_f64(w[cut])) * inv_s  # = m / (sqrt(v) / c + eps)
            a = b1 * fm1 - r * eps
            k = r * inv_c
            kk = k * k
            qa = one_b1 * one_b1 - kk * one_b2
            qb = 2.0 * (a * one_b1)
            qc = a * a - kk * cv
            disc = qb * qb - 4.0 * (qa * qc)
            sd = np.sqrt(disc)
            qq = -0.5 * (qb + np.copysign(sd, qb))
            g1, g2 = qq / qa, qc / qq
            # the root of the unsquared equation: m has the sign of k (sqrt(v) >= 0)
            g = np.where((a + one_b1 * g1 >= 0) == (k >= 0), g1, g2)
            m = b1 * fm1 + one_b1 * g
            unusual = _unusual(w[cut]) | _unusual(w1[cut]) | _unusual(v1[cut]) | _unusual(m1[cut]) | ~(disc >= 0)
            out[cut] = _rounded(m, m1[cut], unusual)
            d, b = _sums(x, m1, cut)
            diff_sq, base_sq = diff_sq + d, base_sq + b
    return diff_sq, base_sq


def predict(predictor: dict, values: list[np.ndarray], base: np.ndarray, out: np.ndarray,
            x: np.ndarray | None = None, use_kernel: bool = True) -> tuple[float, float]:
    """Write the prediction's bytes into ``out`` (1-D uint8, as the others): ``values``
    are those :func:`dependencies` names, ``base`` the tensor's own value at the base
    step. With ``x`` (this step's value), returns the sums ``||x - base||**2`` and
    ``||base||**2`` of the update ratio, else (0, 0)."""
    arrays = (*values, base, out) + (() if x is None else (x,))
    if any(a.size != out.size for a in arrays) or out.size % 4:
        raise ValueError("a prediction needs arrays of the same whole number of float32 values")
    kernel = _fused is not None and use_kernel
    if predictor["kind"] == ADAM_SECOND_MOMENT:
        m, m1 = values
        if kernel:
            return _fused.second_moment(m, m1, base, out, predictor["beta1"], predictor["beta2"], x)
        return _second_moment_numpy(m, m1, base, out, predictor["beta1"], predictor["beta2"], x)
    if predictor["kind"] == ADAM_FIRST_MOMENT:
        w, w1, v1 = values
        if kernel:
            p = predictor
            return _fused.first_moment(w, w1, v1, base, out, p["beta1"], p["beta2"], p["eps"], p["bias2"],
                                       p["step_size"], p["decay"], x)
        return _first_moment_numpy(w, w1, v1, base, out, predictor, x)
    raise ValueError(f"unknown predictor {predictor['kind']!r}")


def in_chunks(predictor: dict, values: list[np.ndarray], base: np.ndarray, x: np.ndarray | None = None,
              norms=None) -> Callable[[int, int, np.ndarray], None]:
    """The prediction as :func:`codecs.decode` and :meth:`codecs.Encoder.add` ask for it:
    ``predict(start, stop, into)`` writes bytes ``[start, stop)`` of it into ``into``
    (``values``, ``base`` and ``x``: the same byte range as those offsets). With ``x``,
    each chunk's update-ratio sums are added to ``norms.diff_sq`` and ``norms.base_sq``."""
    def chunk(start: int, stop: int, into: np.ndarray) -> None:
        diff_sq, base_sq = predict(predictor, [v[start:stop] for v in values], base[start:stop], into,
                                   None if x is None else x[start:stop])
        if norms is not None:
            norms.diff_sq += diff_sq
            norms.base_sq += base_sq
    return chunk


def _fit_sums(w, w1, m, m1, v1, n: int, stride: int, b1: float, b2: float, bias2: float,
              eps: float) -> tuple[float, ...]:
    """The reference of ``_fused.fit_sums``: the sums (qq, qu, qw, ww, wu) over every
    ``stride``-th of the first ``n`` float32 elements (at most :data:`FIT_ELEMENTS`)."""
    w, w1, m, m1, v1 = (a[:n * 4].view(np.float32)[::stride][:FIT_ELEMENTS].astype(np.float64)
                        for a in (w, w1, m, m1, v1))
    with np.errstate(all="ignore"):
        g = (m - b1 * m1) / (1.0 - b1)
        v = b2 * v1 + (1.0 - b2) * g * g
        q = m / (np.sqrt(v) / bias2 + eps)
        update = w - w1
        ok = np.isfinite(q) & np.isfinite(update) & np.isfinite(w1)
        q, update, w1 = q[ok], update[ok], w1[ok]
        # products summed by numpy, not BLAS: its threads would compete with training's
        return (float((q * q).sum()), float((q * update).sum()), float((q * w1).sum()), float((w1 * w1).sum()),
                float((w1 * update).sum()))


def fitted(predictor: dict, w: np.ndarray, w1: np.ndarray, m: np.ndarray, m1: np.ndarray,
           v1: np.ndarray) -> dict | None:
    """A first moment's predictor completed with the ``step_size`` (and ``decay``) that fit
    the weights' update best (least squares on :data:`FIT_ELEMENTS` elements spread evenly
    over the range ``m`` covers, against the second moment as predicted from ``m``); None
    when nothing fits (no update). Spread, not the first ones: an embedding's first rows
    may be tokens that no batch holds."""
    n = min(a.size for a in (w, w1, m, m1, v1)) // 4
    stride = max(1, n // FIT_ELEMENTS)
    b1, b2 = predictor["beta1"], predictor["beta2"]
    if _fused is not None:  # one call without the GIL instead of twenty numpy passes (0.6 ms a tensor)
        qq, qu, qw, ww, wu = _fused.fit_sums(w, w1, m, m1, v1, stride, min(FIT_ELEMENTS, -(-n // stride)),
                                             b1, b2, predictor["bias2"], predictor["eps"])
    else:
        qq, qu, qw, ww, wu = _fit_sums(w, w1, m, m1, v1, n, stride, b1, b2, predictor["bias2"], predictor["eps"])
    if predictor["fit_decay"]:  # Python floats: an overflow is inf, not an error
        det = qq * ww - qw * qw
        step_size = -(ww * qu - qw * wu) / det if det else 0.0
        decay = -(qq * wu - qw * qu) / det if det else 0.0
    else:
        step_size, decay = (-qu / qq if qq else 0.0), 0.0
    step_size, decay = float(step_size), float(decay)
    if not (math.isfinite(step_size) and step_size != 0 and math.isfinite(decay)):
        return None
    out = {k: v for k, v in predictor.items() if k != "fit_decay"}
    out.update(step_size=step_size, decay=decay)
    return check(out)
