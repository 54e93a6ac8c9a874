"""Which earlier values each tensor is encoded against, on the flusher thread.

A step's tensors are stored compressed (:mod:`.codecs`): as a *key* (the bytes
alone) or as a *delta* (the residual against a prediction from the same
tensor's values at earlier steps: its *base*, and the base's own base when
the base is itself a delta, for a linear extrapolation). Bases are *anchors*:
steps that stay in the history as long as anything encoded against them (every
step when nothing is removed while training; with a trajectory, the steps on
its grid). The flusher keeps each tensor's two newest anchor values in memory,
so encoding reads nothing back; an anchor step overwrites the older one piece
by piece as it encodes. A chain of deltas is cut by a key every ``key_every``
anchors, so reading any step decodes at most ``key_every`` stored values. A tensor
rounded to ``keep_bits`` (a lossy trajectory point) is encoded and anchored as its
rounded value, so that a delta against it decodes from main units alone; its low bits
are compressed beside it, for the restore unit.

A tensor whose provider names a predictor (:mod:`.predictors`: Adam's moments from the
weights and each other) is a delta against that prediction instead, when the tensors it
reads are at hand: those of the same step encoded before it (whole), those of the base
step its anchors.

Anything uncertain forgets every anchor (the next step is a key): a failed
step, a tensor whose size or dtype changed, a new Checkpointer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import predictors
from .codecs import Encoder, _NormAccumulator
from .rounding import MantissaSplit, mantissa_bits
from .items import DELTA, KEY


@dataclass
class _Anchor:
    step: int
    depth: int  # deltas since the key: reading this value decodes depth + 1 stored values
    dtype: str
    data: np.ndarray  # uint8, the tensor's stored bytes at ``step``
    base: "_Anchor | None" = None  # the anchor it is a delta against (None: a key)
    filled: int = 0  # bytes of ``data`` written so far (all of them once its step is encoded)


@dataclass
class _Prediction:
    """A delta against a prediction from other tensors: ``values``, the whole tensors it
    reads (:func:`predictors.dependencies`, in order), ``base2`` the delta's own second
    base, taken again if the prediction is given up (nothing fits: see :meth:`Encoding.add`)."""

    predictor: dict
    values: list[np.ndarray]
    base2: "_Anchor | None"
    norms: _NormAccumulator


@dataclass
class Encoding:
    """One tensor of one step being encoded, piece by piece (in memory order)."""

    encoder: Encoder
    base: _Anchor | None  # None: a key
    base2: _Anchor | None  # the base's base, for the extrapolation
    data: np.ndarray | None  # where this step's bytes go when it is an anchor
    pos: int = 0
    # a tensor rounded to keep_bits: what is encoded (and anchored) is the rounded value,
    # so that the main unit decodes alone; the low bits are encoded beside it
    lossy: MantissaSplit | None = None
    anchor: _Anchor | None = None  # the pending anchor this step's bytes go to
    prediction: _Prediction | None = None

    @property
    def kind(self) -> str:
        return KEY if self.base is None else DELTA

    def add(self, piece: np.ndarray, compress: bool = True) -> None:
        """Encode the next piece (a 1-D uint8 view of the tensor's stored bytes); without
        ``compress``, its chunks are stored raw (:meth:`codecs.Encoder.add`)."""
        if self.lossy is not None:
            piece = self.lossy.add(piece)
        end = self.pos + piece.size
        base = None if self.base is None else self.base.data[self.pos:end]
        p = self.prediction
        if p is not None and self.pos == 0 and "fit_decay" in p.predictor:  # a first moment: fit it now
            p.predictor = predictors.fitted(p.predictor, *p.values[:2], piece, base, p.values[2])
            if p.predictor is None:  # no update to fit: its own extrapolation instead
                self.prediction, self.base2, p = None, p.base2, None
        base2 = None if self.base2 is None else self.base2.data[self.pos:end]
        keep = None if self.data is None else self.data[self.pos:end]
        predict = None
        if p is not None:  # the prediction replaces the base (base2 is None)
            if self.pos == 0:  # the update ratio is against the base: computed with the prediction
                self.encoder.skip_ratio()
            predict = predictors.in_chunks(p.predictor, [v[self.pos:end] for v in p.values], base, piece, p.norms)
            base = None
        # the anchor's copy comes after encoding: its buffer may be base2's
        self.encoder.add(piece, base, base2, keep, compress, predict=predict)
        self.pos = end
        if self.anchor is not None:
            self.anchor.filled = end

    def finish(self):
        """``(blob, chunks, update_ratio)`` (:meth:`codecs.Encoder.finish`); a predicted
        delta's update ratio is against its base, not its prediction."""
        blob, chunks, ratio = self.encoder.finish()
        if self.prediction is not None:
            ratio = self.prediction.norms.ratio()
        return blob, chunks, ratio


class Anchors:
    """Each tensor's newest anchor (and its base), for the tensors encoded with deltas."""

    def __init__(self, key_every: int):
        self.key_every = key_every
        self._anchors: dict[str, _Anchor] = {}
        self._pending: dict[str, _Anchor] = {}

    def begin(self, name: str, dtype: str, nbytes: int, step: int, delta: bool, anchor: bool,
              keep_bits: int | None = None) -> Encoding:
        """The encoding of tensor ``name`` at ``step``: ``delta`` if it may be a delta,
        ``anchor`` if this step becomes its newest anchor, ``keep_bits`` if its value is
        rounded (then its anchor holds the rounded value, what a reader decodes)."""
        base = self._anchors.get(name) if delta else None
        if base is not None and (base.dtype != dtype or base.data.size != nbytes or base.step >= step):
            base = None
        # the oldest value's buffer, read by nothing this step but a delta against it
        oldest = None if base is None or base.base is None else base.base.data
        if base is not None and anchor and base.depth + 1 >= self.key_every:
            base = None  # a key starts a new chain: its oldest value's buffer is free too
        base2 = None if base is None else base.base
        data = pending = None
        if anchor and delta:
            # the oldest value's buffer is reused: each piece replaces its bytes once encoded
            # (at a key too: a new buffer there held three values of every tensor at once)
            data = oldest if oldest is not None else np.empty(nbytes, np.uint8)
            depth = 0 if base is None else base.depth + 1
            # the new anchor's base keeps its own data, but no longer its base (never used again)
            kept = None if base is None else _Anchor(base.step, base.depth, base.dtype, base.data)
            pending = self._pending[name] = _Anchor(step, depth, dtype, data, kept)
        lossy = None if keep_bits is None else MantissaSplit(dtype, keep_bits)
        drop = 0 if keep_bits is None else mantissa_bits(dtype) - keep_bits
        return Encoding(Encoder(dtype, delta=base is not None, drop=drop), base, base2, data, lossy=lossy,
                        anchor=pending)

    def predict(self, encoding: Encoding, predictor: dict) -> bool:
        """Make ``encoding`` (a delta just begun, not rounded) a delta against ``predictor``'s
        prediction if the tensors it reads are at hand: those of this step encoded whole
        as anchors, those of the base step its anchors too. Returns whether it did."""
        base = encoding.base
        if base is None or encoding.lossy is not None or encoding.anchor is None or base.dtype not in predictors.DTYPES:
            return False
        values = []
        for step, name in predictors.dependencies(predictor, encoding.anchor.step, base.step):
            now = step == encoding.anchor.step
            found = (self._pending if now else self._anchors).get(name)
            if (found is None or found.step != step or found.dtype != base.dtype
                    or found.data.size != base.data.size or (now and found.filled != found.data.size)):
                return False
            values.append(found.data)
        encoding.prediction = _Prediction(dict(predictor), values, encoding.base2, _NormAccumulator(base.dtype))
        encoding.base2 = None
        if not predictors.GROUPED[predictor["kind"]]:  # nothing added yet: the encoder is new
            encoding.encoder = Encoder(base.dtype, delta=True, grouped=False)
        return True

    def committed(self) -> None:
        """The step whose encodings began since the last call is committed: its anchors count."""
        self._anchors.update(self._pending)
        self._pending.clear()

    def drop(self, steps) -> None:
        """``steps`` were removed from the run: forget every anchor that is or needs one of them."""
        gone = set(steps)
        if any(a.step in gone or (a.base is not None and a.base.step in gone) for a in self._anchors.values()):
            self.forget()

    def forget(self) -> None:
        """Start again from keys: a step failed (its anchors' buffers hold a mix of two steps),
        or steps were removed that anchors are or need."""
        self._anchors.clear()
        self._pending.clear()
