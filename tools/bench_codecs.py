"""Measure datastates_hist.codecs on the example GPT's real training state.

Trains examples/train_gpt.py's model (AdamW, its LR schedule, the standard library's
source as data) for ``--warmup`` steps, takes the weights and AdamW's exp_avg and
exp_avg_sq at 4 consecutive steps, and encodes every tensor as the flusher would:

  key      each step alone (no delta)
  delta    the residual against the same tensor at the previous step (1 base), or against
           the extrapolation from the two previous steps (2 bases, what the writer stores)
  predicted  exp_avg as a delta against its prediction from the weights' update, exp_avg_sq
           from exp_avg (datastates_hist.predictors: what the writer stores for AdamW)
  lossy    weights rounded to ``--keep-bits`` mantissa bits, the residual against the two
           previous rounded weights shifted right by the bits rounding dropped (as the
           writer stores a trajectory point); with the largest relative error measured
           against the exact ones

Ratios are stored / raw bytes; MB/s are per core (the encoder compresses on one thread).
``--compare`` adds the blosc2 settings table (zstd level x shuffle) on the same data.
``--bounds`` adds how small the weights' 2-base residuals could get (beside the writer's
encoding and format 4's, ungrouped): the entropy of
each byte plane (what a byte shuffle and an order-0 entropy coder can reach), the
entropy of each residual's bit length alone and given the bit length of the previous
update (``b1 - b2``, known to the decoder) plus its explicit bits, and two encodings
that were tried: residuals compressed apart by the class of that previous bit length,
and a damped prediction ``b1 + 15/16 (b1 - b2)``.

    python tools/bench_codecs.py [--size small] [--warmup 50] [--keep-bits 8] [--compare] [--bounds]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Per-core speeds: the update ratio's dot products must not spread over BLAS threads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import blosc2  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "examples")]
import train_gpt  # noqa: E402

from datastates_hist import codecs, predictors, rounding  # noqa: E402

KINDS = ("weights", "exp_avg", "exp_avg_sq")
BETAS, EPS = (0.9, 0.95), 1e-8  # train_gpt.make_optimizer's
DECAYS: list[bool] = []  # per parameter: in AdamW's decayed group (train_gpt.make_optimizer)


def training_states(size: str, warmup: int, count: int, seed: int = 1337) -> list[dict]:
    """``count`` consecutive states after ``warmup`` steps: {kind: [float32 numpy arrays]}."""
    torch.manual_seed(seed)
    model = train_gpt.build_model(size, block_size=128)
    optimizer = train_gpt.make_optimizer(model, lr=1e-3)
    scheduler = train_gpt.make_scheduler(optimizer, total_steps=warmup + count + 100,
                                         warmup_steps=10)
    corpus = train_gpt.load_corpus(2 << 20)
    states = []
    for step in range(warmup + count):
        x, y = train_gpt.get_batch(corpus, 8, 128)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step >= warmup:
            params = list(model.parameters())
            decayed = {id(p) for p in optimizer.param_groups[0]["params"]}
            DECAYS[:] = [id(p) in decayed for p in params]
            states.append({
                "step": int(optimizer.state[params[0]]["step"]),
                "weights": [p.detach().numpy().copy() for p in params],
                "exp_avg": [optimizer.state[p]["exp_avg"].numpy().copy() for p in params],
                "exp_avg_sq": [optimizer.state[p]["exp_avg_sq"].numpy().copy() for p in params],
            })
    return states


def as_bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def encode_all(tensors, bases, bases2=None, drop=0, grouped=True):
    """Encode each tensor (against its base when ``bases``, extrapolated from two with
    ``bases2``; ``drop``: the mantissa bits rounding made zero, as the writer passes them;
    ``grouped``: a delta's residual grouped by exponent, as the writer stores it);
    (raw, stored, seconds, encoded)."""
    raw = stored = 0
    seconds = 0.0
    encoded = []
    for i, tensor in enumerate(tensors):
        piece = as_bytes(tensor)
        base = as_bytes(bases[i]) if bases is not None else None
        base2 = as_bytes(bases2[i]) if bases2 is not None else None
        start = time.perf_counter()
        encoder = codecs.Encoder("float32", delta=base is not None, drop=drop, grouped=grouped)
        encoder.add(piece, base, base2)
        blob, chunks, _ = encoder.finish()
        seconds += time.perf_counter() - start
        raw += piece.size
        stored += blob.size
        encoded.append((blob, chunks, piece, base, base2, drop))
    return raw, stored, seconds, encoded


def decode_seconds(encoded) -> float:
    seconds = 0.0
    for blob, chunks, piece, base, base2, drop in encoded:
        out = np.empty(piece.size, np.uint8)
        start = time.perf_counter()
        codecs.decode(blob, chunks, 4, out, base, base2, drop=drop, dtype="float32")
        seconds += time.perf_counter() - start
        assert np.array_equal(out, piece), "round trip differs"
    return seconds


def max_relative_error(exact: np.ndarray, rounded: np.ndarray) -> float:
    exact, rounded = exact.astype(np.float64), rounded.astype(np.float64)
    nonzero = exact != 0
    if not nonzero.any():
        return 0.0
    return float(np.max(np.abs(rounded[nonzero] - exact[nonzero]) / np.abs(exact[nonzero])))


def codec_rows(states: list[dict], keep_bits: int) -> list[tuple]:
    rows = []
    for kind in KINDS:
        for mode in ("key", "delta", "delta, 2 bases", "delta, 2 bases, ungrouped"):
            raw = stored = 0
            enc = dec = 0.0
            for t in range(2, len(states)):
                bases = states[t - 1][kind] if mode != "key" else None
                bases2 = states[t - 2][kind] if mode.startswith("delta, 2 bases") else None
                r, s, e, encoded = encode_all(states[t][kind], bases, bases2, grouped="ungrouped" not in mode)
                raw, stored, enc = raw + r, stored + s, enc + e
                dec += decode_seconds(encoded)
            rows.append((kind, mode, stored / raw, raw / enc / 1e6, raw / dec / 1e6, ""))
    rows += predicted_rows(states, [s["step"] for s in states])
    rows += predicted_rows(states, [s["step"] for s in states], grouped=False)
    writer = {("weights", "delta, 2 bases"), ("exp_avg", "predicted from the weights' update, ungrouped"),
              ("exp_avg_sq", "predicted from exp_avg")}  # predictors.GROUPED
    rows = [row[:5] + ("the writer's",) if (row[0], row[1]) in writer else row for row in rows]
    ratios = [row[2] for row in rows if (row[0], row[1]) in writer]  # the three are of equal size
    rows.append(("all state", "the writer's", sum(ratios) / len(ratios), float("nan"), float("nan"),
                 "weights, exp_avg, exp_avg_sq as above"))
    rounded = [[rounding.round_mantissa(w, "float32", keep_bits) for w in s["weights"]]
               for s in states]
    worst = max(max_relative_error(w, r) for s, rs in zip(states, rounded)
                for w, r in zip(s["weights"], rs))
    raw = stored = 0
    enc = dec = 0.0
    for t in range(2, len(states)):
        r, s, e, encoded = encode_all(rounded[t], rounded[t - 1], rounded[t - 2],
                                      drop=rounding.mantissa_bits("float32") - keep_bits)
        raw, stored, enc = raw + r, stored + s, enc + e
        dec += decode_seconds(encoded)
    rows.append(("weights", f"lossy {keep_bits} bits + delta, 2 bases", stored / raw,
                 raw / enc / 1e6, raw / dec / 1e6,
                 f"max rel err {worst:.3g} (bound {rounding.rounding_bound('float32', keep_bits):.3g})"))
    return rows


def _predicted(predictor, x, values, base, grouped=True) -> tuple[int, float, float]:
    """Encode ``x`` as a delta against ``predictor``'s prediction, decode it back (checked):
    (stored bytes, encode seconds, decode seconds)."""
    start = time.perf_counter()
    if "fit_decay" in predictor:  # a first moment: fitted as the writer fits it
        predictor = predictors.fitted(predictor, values[0], values[1], x, base, values[2])
    encoder = codecs.Encoder("float32", delta=True, grouped=grouped)
    if predictor is None:
        encoder.add(x, base)
    else:  # as the writer encodes: the prediction (and the update ratio's sums) chunk by chunk
        encoder.add(x, None, predict=predictors.in_chunks(predictor, values, base, x))
    blob, chunks, _ = encoder.finish()
    encode = time.perf_counter() - start
    out = np.empty(x.size, np.uint8)
    start = time.perf_counter()
    if predictor is None:
        codecs.decode(blob, chunks, 4, out, base, dtype="float32")
    else:  # as the reader decodes: the prediction computed chunk by chunk
        codecs.decode(blob, chunks, 4, out, dtype="float32", predict=predictors.in_chunks(predictor, values, base))
    decode = time.perf_counter() - start
    assert np.array_equal(out, x), "round trip differs"
    return blob.size, encode, decode


def predicted_rows(states: list[dict], steps: list[int], grouped: bool = True) -> list[tuple]:
    """AdamW's moments as the writer stores them in consecutive restore points: exp_avg
    against its prediction from the weights' update, exp_avg_sq from exp_avg
    (datastates_hist.predictors, the example's betas; ``steps``: each tensor's AdamW step
    count, for the bias correction)."""
    rows = []
    for kind in ("exp_avg", "exp_avg_sq"):
        raw = stored = 0
        enc = dec = 0.0
        for t in range(2, len(states)):
            now, before = states[t], states[t - 1]
            for i in range(len(now[kind])):
                b = [as_bytes(a) for a in (now["weights"][i], before["weights"][i], now["exp_avg"][i],
                                           before["exp_avg"][i], now["exp_avg_sq"][i], before["exp_avg_sq"][i])]
                w, w1, m, m1, v, v1 = b
                if kind == "exp_avg":
                    template = predictors.adam_first_moment("w", "v", *BETAS, EPS, steps[t], DECAYS[i])
                    size, e, d = _predicted(template, m, [w, w1, v1], m1, grouped)
                else:
                    size, e, d = _predicted(predictors.adam_second_moment("m", *BETAS), v, [m, m1], v1, grouped)
                raw, stored, enc, dec = raw + m.size, stored + size, enc + e, dec + d
        source = "the weights' update" if kind == "exp_avg" else "exp_avg"
        rows.append((kind, f"predicted from {source}{'' if grouped else ', ungrouped'}", stored / raw,
                     raw / enc / 1e6, raw / dec / 1e6, ""))
    return rows


def settings_rows(states: list[dict]) -> list[tuple]:
    """Stored / raw for zstd level x shuffle kind, XOR deltas of consecutive steps."""
    deltas = {kind: [np.bitwise_xor(as_bytes(a), as_bytes(b))
                     for t in range(1, len(states))
                     for a, b in zip(states[t][kind], states[t - 1][kind])] for kind in KINDS}
    rows = []
    for clevel in (1, 3):
        for name, flt in (("shuffle", blosc2.Filter.SHUFFLE), ("bitshuffle", blosc2.Filter.BITSHUFFLE)):
            cparams = blosc2.CParams(codec=blosc2.Codec.ZSTD, clevel=clevel, typesize=4,
                                     nthreads=1, filters=[flt])
            ratios, raw_total, seconds = [], 0, 0.0
            for kind in KINDS:
                raw = stored = 0
                for d in deltas[kind]:
                    for start in range(0, d.size, codecs.CHUNK_BYTES):
                        chunk = d[start:start + codecs.CHUNK_BYTES]
                        t0 = time.perf_counter()
                        stored += min(len(blosc2.compress2(chunk, cparams=cparams)), chunk.size)
                        seconds += time.perf_counter() - t0
                        raw += chunk.size
                ratios.append(stored / raw)
                raw_total += raw
            rows.append((f"zstd {clevel}", name, *ratios, raw_total / seconds / 1e6))
    return rows


def _zigzag(d: np.ndarray) -> np.ndarray:
    """int64 differences of 32-bit patterns, modulo 2**32, zigzag-coded (as the writer)."""
    d = ((d + 2**31) % 2**32) - 2**31
    return ((d << 1) ^ (d >> 63)).astype(np.uint32)


def _entropy(symbols: np.ndarray) -> float:
    """Order-0 entropy in bits per symbol of small non-negative integers."""
    p = np.bincount(symbols).astype(np.float64)
    p = p[p > 0] / symbols.size
    return float(-(p * np.log2(p)).sum())


def _bit_length(a: np.ndarray) -> np.ndarray:
    return np.where(a > 0, np.floor(np.log2(np.maximum(a, 1).astype(np.float64))).astype(np.int64) + 1, 0)


def bounds_rows(states: list[dict]) -> list[tuple[str, float]]:
    """(what, stored/raw) for the weights' 2-base residuals of steps 3-4 (see the docstring)."""
    cparams = blosc2.CParams(codec=blosc2.Codec.ZSTD, clevel=codecs.CLEVEL, typesize=4, nthreads=1,
                             filters=[codecs.SHUFFLE], blocksize=codecs.CHUNK_BYTES)

    bit_cparams = blosc2.CParams(codec=blosc2.Codec.ZSTD, clevel=codecs.CLEVEL, typesize=4, nthreads=1,
                                 filters=[codecs.GROUPED_SHUFFLE], blocksize=codecs.CHUNK_BYTES)

    def compressed(a: np.ndarray) -> int:
        b = a.view(np.uint8)
        return min(len(blosc2.compress2(b, cparams=cparams)), b.size) if b.size else 0

    def bits(a: np.ndarray) -> np.ndarray:
        return a.reshape(-1).view(np.uint32).astype(np.int64)

    residuals, previous, damped, split, grouped = [], [], 0, 0, 0
    edges = (6, 9, 11, 12, 13, 14, 15, 16, 18)  # classes of the previous update's bit length
    for t in range(2, len(states)):
        for x, b1, b2 in zip(states[t]["weights"], states[t - 1]["weights"], states[t - 2]["weights"]):
            x, b1, b2 = bits(x), bits(b1), bits(b2)
            r, c = _zigzag(x - (2 * b1 - b2)), _zigzag(b1 - b2)
            residuals.append(r)
            previous.append(c)
            keyed = np.empty_like(r)  # the writer's: grouped by b1's exponent, bit-shuffled
            codecs.group(r.view(np.uint8), b1.astype(np.uint32).view(np.uint8), keyed.view(np.uint8), "float32")
            grouped += min(len(blosc2.compress2(keyed.view(np.uint8), cparams=bit_cparams)), keyed.nbytes)
            damped += compressed(_zigzag(x - (b1 + (((b1 - b2) * 15) >> 4))))
            for at in range(0, r.size, codecs.CHUNK_BYTES // 4):
                rc, cc = r[at:at + codecs.CHUNK_BYTES // 4], _bit_length(c[at:at + codecs.CHUNK_BYTES // 4])
                classes = np.digitize(cc, edges)
                split += sum(compressed(rc[classes == k]) for k in range(len(edges) + 1))
    r, c = np.concatenate(residuals), np.concatenate(previous)
    raw_bits = 32 * r.size
    planes = r.view(np.uint8).reshape(-1, 4)
    length, before = _bit_length(r), _bit_length(c)
    explicit = float(np.maximum(length - 1, 0).sum())  # below the leading one
    alone = _entropy(length) * r.size
    given = (_entropy(length * 64 + before) - _entropy(before)) * r.size
    return [
        ("grouped by b1's exponent, bit shuffle, zstd (the writer's)", grouped * 8 / raw_bits),
        ("byte shuffle, zstd (format 4)", sum(compressed(a) for a in residuals) * 8 / raw_bits),
        ("entropy of the byte planes (order 0)", sum(_entropy(planes[:, i]) for i in range(4)) * r.size / raw_bits),
        ("bit length (order 0) + explicit bits", (alone + explicit) / raw_bits),
        ("bit length given the previous update's + explicit bits", (given + explicit) / raw_bits),
        ("compressed apart by the previous update's bit length", split * 8 / raw_bits),
        ("damped prediction b1 + 15/16 (b1 - b2)", damped * 8 / raw_bits),
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(train_gpt.SIZES), default="small")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--keep-bits", type=int, default=8)
    parser.add_argument("--compare", action="store_true", help="also compare blosc2 settings")
    parser.add_argument("--bounds", action="store_true", help="also how small the weights' residuals could get")
    args = parser.parse_args(argv)
    try:
        rounding.check_keep_bits("float32", args.keep_bits)
    except ValueError as e:
        parser.error(str(e))
    torch.set_num_threads(1)
    states = training_states(args.size, args.warmup, 4)
    nbytes = sum(a.nbytes for a in states[0]["weights"])
    print(f"GPT {args.size}: {nbytes / 1e6:.1f} MB of float32 weights; steps "
          f"{args.warmup + 1}-{args.warmup + 4}; blosc2 {blosc2.__version__}, zstd level "
          f"{codecs.CLEVEL}, {codecs.SHUFFLE.name.lower()}")
    print(f"| {'state':10} | {'encoding':34} | stored/raw | encode MB/s | decode MB/s | |")
    print(f"|{'-' * 12}|{'-' * 36}|------------|-------------|-------------|---|")
    for kind, mode, ratio, enc, dec, note in codec_rows(states, args.keep_bits):
        speeds = "          - |           -" if enc != enc else f"{enc:11.0f} | {dec:11.0f}"
        print(f"| {kind:10} | {mode:34} | {ratio:10.3f} | {speeds} | {note} |")
    if args.compare:
        print("\nXOR deltas of consecutive steps, stored/raw by blosc2 setting (one thread):")
        print("| codec | filter | weights | exp_avg | exp_avg_sq | encode MB/s |")
        print("|---|---|---|---|---|---|")
        for codec, name, w, m, v, speed in settings_rows(states):
            print(f"| {codec} | {name} | {w:.3f} | {m:.3f} | {v:.3f} | {speed:.0f} |")
    if args.bounds:
        print("\nWeights, residuals against 2 bases, stored/raw:")
        print("| bound or encoding | stored/raw |")
        print("|---|---|")
        for what, ratio in bounds_rows(states):
            print(f"| {what} | {ratio:.4f} |")


if __name__ == "__main__":
    main()
