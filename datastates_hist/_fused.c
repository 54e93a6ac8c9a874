/* The digest's and the delta codec's kernels.
 *
 * Copy a chunk of float32 or float64 values and summarise it in one pass over
 * memory, accumulating in float64. datastates_hist.digest calls it chunk by
 * chunk and falls back to numpy (seven passes) when it is not built.
 *
 * The copy is a loop, not memcpy: glibc's memcpy (rep movsb) runs 10x slower on
 * AMD Zen when the destination lies a few bytes after the source modulo 4 KiB. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 32 /* independent accumulators: the compiler vectorises across them */

/* x86-64 ELF (ifunc): an AVX2 build of each kernel beside the baseline (SSE2) one, chosen
 * at load time: 1.3-1.4x faster here. AVX2 alone, without FMA, so that no multiply-add is
 * contracted and both builds give the same values (a NaN's sign bit aside). */
#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
/* The predictions' float64 divisions and square roots run 1.34x (second moment) and 1.41x
 * (first moment) faster in 512-bit vectors where the CPU has them (AMD Zen 4; the same
 * bits: -ffp-contract=off forbids the multiply-adds AVX-512 would allow). The integer
 * kernels gained nothing from it (0.88-0.97x), so they keep AVX2. */
#define MULTIVERSION_WIDE __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef MULTIVERSION
#define MULTIVERSION
#endif
#ifndef MULTIVERSION_WIDE
#define MULTIVERSION_WIDE MULTIVERSION
#endif

/* One pass over memory: the copy, the sums, the minima and maxima, and the counts of values
 * by sign and biased binary exponent (counts[sign * NB + exponent], the top bits of each
 * value, when counts is not NULL). The sums are of x - c, c the chunk's first value, in
 * float64: m2 = S2 - S1**2 / n then loses at most a factor n of float64's precision, since
 * m2 >= (c - mean)**2 (a chunk of 2**16 values: about 1e-11 relative), and a constant chunk
 * gives exactly 0. Three passes (sums, deviations from the mean, exponents) ran at 1.5-1.8
 * GB/s here, this one at 1.9-2.2. SUM_LANES sums in float64 and as many minima and maxima
 * in T (exact: the conversion to float64 is monotonic). The counts go to four tables in
 * turn, so that runs of values with the same exponent do not wait on one counter; 32-bit
 * counters (blocks of 2**30 values) keep them small. Finite values whose sums overflow
 * (float64 near its largest) are summed again the old way, mean first. */
#define SUM_LANES 16
#define KERNEL(NAME, T, U, BITS, EXP_BITS)                                             \
static inline void NAME##_block(const T *x, T *out, Py_ssize_t n, double c, double *s1, double *s2, \
                                T *lo, T *hi, uint32_t (*t)[2 << EXP_BITS], int counting) { \
    Py_ssize_t i, tail = n - n % SUM_LANES;                                            \
    for (i = 0; i < tail; i += SUM_LANES) {                                            \
        for (int k = 0; k < SUM_LANES; k++) {                                          \
            T v = x[i + k];                                                            \
            if (out) out[i + k] = v;                                                   \
            double d = (double)v - c;                                                  \
            s1[k] += d; s2[k] += d * d;                                                \
            lo[k] = v < lo[k] ? v : lo[k];                                             \
            hi[k] = v > hi[k] ? v : hi[k];                                             \
        }                                                                              \
        if (counting) {                                                                \
            const U *b = (const U *)(x + i);                                           \
            for (int k = 0; k < SUM_LANES; k += 4) {                                   \
                t[0][b[k] >> (BITS - 1 - EXP_BITS)]++; t[1][b[k + 1] >> (BITS - 1 - EXP_BITS)]++; \
                t[2][b[k + 2] >> (BITS - 1 - EXP_BITS)]++; t[3][b[k + 3] >> (BITS - 1 - EXP_BITS)]++; \
            }                                                                          \
        }                                                                              \
    }                                                                                  \
    for (; i < n; i++) {                                                               \
        T v = x[i];                                                                    \
        if (out) out[i] = v;                                                           \
        double d = (double)v - c;                                                      \
        s1[0] += d; s2[0] += d * d;                                                    \
        lo[0] = v < lo[0] ? v : lo[0]; hi[0] = v > hi[0] ? v : hi[0];                  \
        if (counting) t[0][((const U *)x)[i] >> (BITS - 1 - EXP_BITS)]++;              \
    }                                                                                  \
}                                                                                      \
MULTIVERSION static void NAME(const T *x, T *out, Py_ssize_t n, double *res, long long *counts) { \
    enum { SLOTS = 2 << EXP_BITS, BLOCK = 1 << 30 };                                   \
    double s1[SUM_LANES] = {0}, s2[SUM_LANES] = {0};                                   \
    T lo[SUM_LANES], hi[SUM_LANES];                                                    \
    uint32_t t[4][SLOTS]; /* on the stack: a thread-local array costs a call per access */ \
    const double c = (double)x[0];                                                     \
    Py_ssize_t i, bad = 0;                                                             \
    for (int k = 0; k < SUM_LANES; k++) { lo[k] = INFINITY; hi[k] = -INFINITY; }      \
    for (Py_ssize_t at = 0; at < n; at += BLOCK) {                                     \
        Py_ssize_t len = n - at < BLOCK ? n - at : BLOCK;                              \
        if (counts) { /* a constant flag in each call: each is built without the other's branch */ \
            memset(t, 0, sizeof t);                                                    \
            NAME##_block(x + at, out ? out + at : NULL, len, c, s1, s2, lo, hi, t, 1); \
            for (int k = 0; k < SLOTS; k++)                                            \
                counts[k] += (long long)t[0][k] + t[1][k] + t[2][k] + t[3][k];         \
        } else {                                                                       \
            NAME##_block(x + at, out ? out + at : NULL, len, c, s1, s2, lo, hi, t, 0); \
        }                                                                              \
    }                                                                                  \
    double a = 0, b = 0, l = INFINITY, h = -INFINITY, s, m;                            \
    for (int k = 0; k < SUM_LANES; k++) {                                              \
        a += s1[k]; b += s2[k];                                                        \
        l = (double)lo[k] < l ? (double)lo[k] : l; h = (double)hi[k] > h ? (double)hi[k] : h; \
    }                                                                                  \
    s = a + (double)n * c;                                                             \
    m = b - a * a / (double)n;                                                         \
    m = m > 0 ? m : 0;                                                                 \
    if (!(isfinite(a) && isfinite(b) && isfinite(s))) {                                \
        /* the plain sum: an infinite first value would make every shifted one NaN */  \
        double sum = 0;                                                                \
        int nan = 0;                                                                   \
        for (i = 0; i < n; i++) {                                                      \
            double v = (double)x[i];                                                   \
            sum += v; bad += !isfinite(v); nan |= isnan(v);                            \
        }                                                                              \
        s = sum;                                                                       \
        if (bad) { /* infinities or NaN: counted; a NaN makes min and max NaN */       \
            m = NAN;                                                                   \
            if (nan) l = h = NAN;                                                      \
        } else { /* finite values whose shifted sums overflowed: the deviations again */ \
            double mean = sum / (double)n, dev = 0;                                    \
            for (i = 0; i < n; i++) { double d = (double)x[i] - mean; dev += d * d; }   \
            m = isfinite(sum) ? dev : NAN;                                             \
        }                                                                              \
    }                                                                                  \
    res[0] = s; res[1] = m; res[2] = l; res[3] = h; res[4] = (double)bad;              \
}

KERNEL(stats_f32, float, uint32_t, 32, 8)
KERNEL(stats_f64, double, uint64_t, 64, 11)

/* copy_stats(src, dst or None, itemsize[, counts]) -> (sum, m2, min, max, nonfinite) */
static PyObject *copy_stats(PyObject *self, PyObject *args) {
    Py_buffer src, dst = {0}, counts = {0};
    PyObject *dst_obj, *counts_obj = Py_None;
    int itemsize;
    if (!PyArg_ParseTuple(args, "y*Oi|O", &src, &dst_obj, &itemsize, &counts_obj)) return NULL;
    if (dst_obj != Py_None && PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (counts_obj != Py_None && PyObject_GetBuffer(counts_obj, &counts, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        if (dst.buf) PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t slots = itemsize == 4 ? 2 * 256 : 2 * 2048;
    if ((itemsize != 4 && itemsize != 8) || src.len % itemsize || src.len == 0) {
        PyErr_SetString(PyExc_ValueError, "copy_stats needs a non-empty float32 or float64 buffer");
    } else if (dst.buf && dst.len != src.len) {
        PyErr_SetString(PyExc_ValueError, "copy_stats: destination and source differ in size");
    } else if (counts.buf && (counts.len != slots * (Py_ssize_t)sizeof(long long) || counts.itemsize != 8
                              || !counts.format || !strchr("lq", counts.format[0]) || counts.format[1])) {
        PyErr_SetString(PyExc_ValueError, "copy_stats: counts must be 2 * 256 int64 for float32, 2 * 2048 for float64");
    } else {
        double res[5];
        Py_ssize_t n = src.len / itemsize;
        Py_BEGIN_ALLOW_THREADS
        if (itemsize == 4)
            stats_f32((const float *)src.buf, (float *)dst.buf, n, res, (long long *)counts.buf);
        else
            stats_f64((const double *)src.buf, (double *)dst.buf, n, res, (long long *)counts.buf);
        Py_END_ALLOW_THREADS
        result = Py_BuildValue("(ddddn)", res[0], res[1], res[2], res[3], (Py_ssize_t)res[4]);
    }
    if (counts.buf) PyBuffer_Release(&counts);
    if (dst.buf) PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}


/* The residual of a delta (datastates_hist.codecs): out = zigzag(x - prediction), the
 * prediction being b1, or the extrapolation 2*b1 - b2, on each element's bit pattern as
 * an unsigned integer (modulo 2**BITS: exact both ways). In the same pass, for float32
 * and float64 (norms 1 and 2), sq[0] += sum((x - b1)**2) and sq[1] += sum(b1**2) in
 * float64 (the update ratio), and the piece is copied to keep (the tensor's next anchor,
 * which may be b2's own buffer: each block is copied once b2's block has been read). */
#define RBLOCK 4096
#define RESIDUAL(NAME, U, S, BITS, F)                                                   \
MULTIVERSION static void NAME(const U *x, const U *b1, const U *b2, U *out, U *keep,    \
                              Py_ssize_t n, int norms, double *sq) {                    \
    double d2[LANES] = {0}, n2[LANES] = {0};                                            \
    for (Py_ssize_t at = 0; at < n; at += RBLOCK) {                                     \
        Py_ssize_t end = n - at < RBLOCK ? n : at + RBLOCK;                             \
        if (b2)                                                                         \
            for (Py_ssize_t i = at; i < end; i++) {                                     \
                S d = (S)(U)(x[i] - (U)(b1[i] + b1[i] - b2[i]));                        \
                out[i] = (U)((U)d << 1) ^ (U)(d >> (BITS - 1));                         \
            }                                                                           \
        else                                                                            \
            for (Py_ssize_t i = at; i < end; i++) {                                     \
                S d = (S)(U)(x[i] - b1[i]);                                             \
                out[i] = (U)((U)d << 1) ^ (U)(d >> (BITS - 1));                         \
            }                                                                           \
        if (norms) {                                                                    \
            Py_ssize_t i = at, tail = end - (end - at) % LANES;                         \
            for (; i < tail; i += LANES)                                                \
                for (int k = 0; k < LANES; k++) {                                       \
                    F xv, bv;                                                           \
                    memcpy(&xv, &x[i + k], sizeof xv); memcpy(&bv, &b1[i + k], sizeof bv); \
                    double d = (double)xv - (double)bv;                                 \
                    d2[k] += d * d; n2[k] += (double)bv * (double)bv;                   \
                }                                                                       \
            for (; i < end; i++) {                                                      \
                F xv, bv;                                                               \
                memcpy(&xv, &x[i], sizeof xv); memcpy(&bv, &b1[i], sizeof bv);          \
                double d = (double)xv - (double)bv;                                     \
                d2[0] += d * d; n2[0] += (double)bv * (double)bv;                       \
            }                                                                           \
        }                                                                               \
        if (keep)                                                                       \
            for (Py_ssize_t i = at; i < end; i++) keep[i] = x[i];                       \
    }                                                                                   \
    for (int k = 0; k < LANES; k++) { sq[0] += d2[k]; sq[1] += n2[k]; }                 \
}

RESIDUAL(residual_u8, uint8_t, int8_t, 8, float)
RESIDUAL(residual_u16, uint16_t, int16_t, 16, float)
RESIDUAL(residual_u32, uint32_t, int32_t, 32, float)
RESIDUAL(residual_u64, uint64_t, int64_t, 64, double)

/* residual(x, b1, b2 or None, out, keep or None, itemsize, norms) -> (sum (x-b1)**2, sum b1**2) */
static PyObject *residual(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    Py_buffer bufs[5] = {{0}};
    int itemsize, norms;
    if (!PyArg_ParseTuple(args, "OOOOOii", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &itemsize, &norms))
        return NULL;
    PyObject *result = NULL;
    int got = 0;
    for (; got < 5; got++) {
        if (objs[got] == Py_None && (got == 2 || got == 4)) continue;
        int flags = got >= 3 ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS;
        if (PyObject_GetBuffer(objs[got], &bufs[got], flags) < 0) goto done;
    }
    Py_ssize_t len = bufs[0].len;
    int same = 1;
    for (int k = 1; k < 5; k++) same &= !bufs[k].buf || bufs[k].len == len;
    if ((itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) || len % itemsize) {
        PyErr_SetString(PyExc_ValueError, "residual needs whole elements of 1, 2, 4 or 8 bytes");
    } else if (!same) {
        PyErr_SetString(PyExc_ValueError, "residual: the buffers differ in size");
    } else if (norms && norms != itemsize / 4) {
        PyErr_SetString(PyExc_ValueError, "residual: norms 1 needs 4-byte elements, 2 8-byte ones");
    } else {
        double sq[2] = {0, 0};
        Py_ssize_t n = len / itemsize;
        const void *x = bufs[0].buf, *b1 = bufs[1].buf, *b2 = bufs[2].buf;
        void *out = bufs[3].buf, *keep = bufs[4].buf;
        Py_BEGIN_ALLOW_THREADS
        switch (itemsize) {
        case 1: residual_u8(x, b1, b2, out, keep, n, 0, sq); break;
        case 2: residual_u16(x, b1, b2, out, keep, n, 0, sq); break;
        case 4: residual_u32(x, b1, b2, out, keep, n, norms, sq); break;
        default: residual_u64(x, b1, b2, out, keep, n, norms, sq); break;
        }
        Py_END_ALLOW_THREADS
        result = Py_BuildValue("(dd)", sq[0], sq[1]);
    }
done:
    for (int k = 0; k < got && k < 5; k++)
        if (bufs[k].buf) PyBuffer_Release(&bufs[k]);
    return result;
}

/* A residual back to the element bytes, in place (datastates_hist.codecs.decode): z =
 * unzigzag(z) << shift, plus the prediction (b1, or 2*b1 - b2), modulo 2**BITS. One pass
 * instead of numpy's six to eight. */
#define UNRESIDUAL(NAME, U, BITS)                                                       \
MULTIVERSION static void NAME(U *z, const U *b1, const U *b2, Py_ssize_t n, int shift) { \
    if (b2)                                                                             \
        for (Py_ssize_t i = 0; i < n; i++) {                                            \
            U d = (U)((U)(z[i] >> 1) ^ (U)(0 - (U)(z[i] & 1)));                         \
            z[i] = (U)((U)(d << shift) + (U)(b1[i] + b1[i] - b2[i]));                   \
        }                                                                               \
    else                                                                                \
        for (Py_ssize_t i = 0; i < n; i++) {                                            \
            U d = (U)((U)(z[i] >> 1) ^ (U)(0 - (U)(z[i] & 1)));                         \
            z[i] = (U)((U)(d << shift) + b1[i]);                                        \
        }                                                                               \
}

UNRESIDUAL(unresidual_u8, uint8_t, 8)
UNRESIDUAL(unresidual_u16, uint16_t, 16)
UNRESIDUAL(unresidual_u32, uint32_t, 32)
UNRESIDUAL(unresidual_u64, uint64_t, 64)

/* unresidual(z, b1, b2 or None, itemsize, shift) -> None */
static PyObject *unresidual(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    Py_buffer bufs[3] = {{0}};
    int itemsize, shift;
    if (!PyArg_ParseTuple(args, "OOOii", &objs[0], &objs[1], &objs[2], &itemsize, &shift))
        return NULL;
    PyObject *result = NULL;
    int got = 0;
    for (; got < 3; got++) {
        if (objs[got] == Py_None && got == 2) continue;
        int flags = got == 0 ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS;
        if (PyObject_GetBuffer(objs[got], &bufs[got], flags) < 0) goto done;
    }
    Py_ssize_t len = bufs[0].len;
    if ((itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) || len % itemsize) {
        PyErr_SetString(PyExc_ValueError, "unresidual needs whole elements of 1, 2, 4 or 8 bytes");
    } else if (bufs[1].len != len || (bufs[2].buf && bufs[2].len != len)) {
        PyErr_SetString(PyExc_ValueError, "unresidual: the buffers differ in size");
    } else if (shift < 0 || shift >= 8 * itemsize) {
        PyErr_SetString(PyExc_ValueError, "unresidual: the shift must be less than the element's bits");
    } else {
        Py_ssize_t n = len / itemsize;
        void *z = bufs[0].buf;
        const void *b1 = bufs[1].buf, *b2 = bufs[2].buf;
        Py_BEGIN_ALLOW_THREADS
        switch (itemsize) {
        case 1: unresidual_u8(z, b1, b2, n, shift); break;
        case 2: unresidual_u16(z, b1, b2, n, shift); break;
        case 4: unresidual_u32(z, b1, b2, n, shift); break;
        default: unresidual_u64(z, b1, b2, n, shift); break;
        }
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    for (int k = 0; k < got && k < 3; k++)
        if (bufs[k].buf) PyBuffer_Release(&bufs[k]);
    return result;
}

/* A residual's elements grouped by the biased exponent of the prediction's element (the
 * delta codec's grouped chunks, datastates_hist.codecs): a stable counting sort by
 * (key[i] >> shift) & (2**bits - 1). A difference of bit patterns scales with the ulp of
 * the value, so elements of one exponent have residuals of one size: grouped, zstd's
 * blocks each see one size. Forward: dst[next[g]++] = src[i]; inverse: dst[i] =
 * src[next[g]++]. */
#define MAX_GROUP_BITS 11 /* float64's exponent */
/* The counting pass keeps GROUP_COUNTS interleaved sets of counters: one counter's
 * increments form a chain through memory (a store, then a load of it), and runs of one
 * exponent made that chain its pace. The kernel: 6-10% faster each way, the same bytes.
 * The placing pass walks the elements in order, as a stable sort must; four segments
 * placed side by side were no faster (the stores, not the chain, set its pace). Nor was the
 * decoder's inverse fused with its unresidual: through a block of 2048 elements in L1, the
 * small GPT's weights decoded at 1.64 GB/s against 1.84 in two passes (in the gather's own
 * loop, slower still): the second pass is vectorised and its bytes are in cache. */
#define GROUP_COUNTS 4
#define GROUP(NAME, U)                                                                  \
MULTIVERSION static void NAME(const U *src, const U *key, U *dst, Py_ssize_t n, int shift, \
                              int bits, int inverse, Py_ssize_t *next) {                \
    Py_ssize_t groups = (Py_ssize_t)1 << bits, at = 0, i = 0;                           \
    Py_ssize_t *c1 = next + groups, *c2 = c1 + groups, *c3 = c2 + groups;               \
    U mask = (U)(groups - 1);                                                           \
    memset(next, 0, (size_t)(GROUP_COUNTS * groups) * sizeof *next);                    \
    for (; i + GROUP_COUNTS <= n; i += GROUP_COUNTS) {                                  \
        next[(key[i] >> shift) & mask]++;                                               \
        c1[(key[i + 1] >> shift) & mask]++;                                             \
        c2[(key[i + 2] >> shift) & mask]++;                                             \
        c3[(key[i + 3] >> shift) & mask]++;                                             \
    }                                                                                   \
    for (; i < n; i++) next[(key[i] >> shift) & mask]++;                                \
    for (Py_ssize_t g = 0; g < groups; g++) {                                           \
        Py_ssize_t m = next[g] + c1[g] + c2[g] + c3[g];                                 \
        next[g] = at;                                                                   \
        at += m;                                                                        \
    }                                                                                   \
    if (inverse)                                                                        \
        for (i = 0; i < n; i++) dst[i] = src[next[(key[i] >> shift) & mask]++];         \
    else                                                                                \
        for (i = 0; i < n; i++) dst[next[(key[i] >> shift) & mask]++] = src[i];         \
}

GROUP(group_u16, uint16_t)
GROUP(group_u32, uint32_t)
GROUP(group_u64, uint64_t)

static int overlap(const Py_buffer *a, const Py_buffer *b) {
    const char *x = a->buf, *y = b->buf;
    return x < y + b->len && y < x + a->len;
}

/* group(src, key, dst, itemsize, shift, bits, inverse) -> None */
static PyObject *group(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    Py_buffer bufs[3] = {{0}};
    int itemsize, shift, bits, inverse;
    if (!PyArg_ParseTuple(args, "OOOiiip", &objs[0], &objs[1], &objs[2], &itemsize, &shift, &bits, &inverse))
        return NULL;
    PyObject *result = NULL;
    int got = 0;
    for (; got < 3; got++) {
        int flags = got == 2 ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS;
        if (PyObject_GetBuffer(objs[got], &bufs[got], flags) < 0) goto done;
    }
    Py_ssize_t len = bufs[0].len;
    if ((itemsize != 2 && itemsize != 4 && itemsize != 8) || len % itemsize) {
        PyErr_SetString(PyExc_ValueError, "group needs whole elements of 2, 4 or 8 bytes");
    } else if (bufs[1].len != len || bufs[2].len != len) {
        PyErr_SetString(PyExc_ValueError, "group: the buffers differ in size");
    } else if (bits < 1 || bits > MAX_GROUP_BITS || shift < 0 || shift > 8 * itemsize - bits) {
        PyErr_SetString(PyExc_ValueError, "group: the key's bits must lie within the element");
    } else if (len && (overlap(&bufs[2], &bufs[0]) || overlap(&bufs[2], &bufs[1]))) {
        PyErr_SetString(PyExc_ValueError, "group: the destination must not overlap the source or the key");
    } else {
        Py_ssize_t next[GROUP_COUNTS << MAX_GROUP_BITS];
        Py_ssize_t n = len / itemsize;
        const void *src = bufs[0].buf, *key = bufs[1].buf;
        void *dst = bufs[2].buf;
        Py_BEGIN_ALLOW_THREADS
        switch (itemsize) {
        case 2: group_u16(src, key, dst, n, shift, bits, inverse, next); break;
        case 4: group_u32(src, key, dst, n, shift, bits, inverse, next); break;
        default: group_u64(src, key, dst, n, shift, bits, inverse, next); break;
        }
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    for (int k = 0; k < got && k < 3; k++)
        if (bufs[k].buf) PyBuffer_Release(&bufs[k]);
    return result;
}

/* The prediction of Adam's second moment v from the same step's first moment m and the
 * previous step's m1 and v1 (datastates_hist.predictors): the gradient g = (m - beta1*m1)
 * * inv1 (inv1 = 1/(1 - beta1)), and p = beta2*v1 + c2*(g*g) (c2 = 1 - beta2), in float64,
 * one IEEE operation at a time (no contraction, -ffp-contract=off: the numpy reference gives
 * the same bits). Where an input is subnormal, NaN or infinite, or p is below the smallest
 * normal float32 or beyond the largest, the prediction is v1's bits: then no floating-point
 * mode (flush-to-zero, denormals-are-zero) changes a bit of it. With x, also sums (x - v1)**2
 * and v1**2 in float64 (the update ratio). */
typedef union { uint32_t u; float f; } f32_bits; /* type punning through a union: defined in GNU C */

static inline float as_f32(uint32_t u) { f32_bits b; b.u = u; return b.f; }
static inline uint32_t f32_as_bits(float f) { f32_bits b; b.f = f; return b.u; }
typedef union { uint64_t u; double d; } f64_bits;

static inline double f64_of_bits(uint64_t u) { f64_bits b; b.u = u; return b.d; }
static inline uint64_t f64_bits_of(double d) { f64_bits b; b.d = d; return b.u; }
static inline uint32_t unusual_f32(uint32_t bits) { /* subnormal, infinite or NaN */
    uint32_t e = bits & 0x7f800000u;
    return (e == 0x7f800000u) | ((e == 0) & ((bits & 0x007fffffu) != 0));
}

/* No branch in the loop (| not ||): the compiler vectorises it. */
#define SECOND_MOMENT_BODY                                                                   \
    uint32_t bm = m[i], bm1 = m1[i], bv1 = v1[i];                                           \
    double g = ((double)as_f32(bm) - beta1 * (double)as_f32(bm1)) * inv1;                   \
    double p = beta2 * (double)as_f32(bv1) + c2 * (g * g);                                  \
    uint32_t bits = f32_as_bits((float)p);                                                  \
    uint32_t keep = unusual_f32(bm) | unusual_f32(bm1) | unusual_f32(bv1) | !(fabs(p) >= 0x1p-126) \
                    | ((bits & 0x7f800000u) == 0x7f800000u);                                \
    out[i] = keep ? bv1 : bits;

MULTIVERSION_WIDE static void second_moment_f32(const uint32_t *m, const uint32_t *m1, const uint32_t *v1,
                                           uint32_t *out, Py_ssize_t n, double beta1, double inv1,
                                           double beta2, double c2) {
    for (Py_ssize_t i = 0; i < n; i++) {
        SECOND_MOMENT_BODY
    }
}

/* sum (x - b)**2 and b**2 in float64 (the update ratio against the base b) */
MULTIVERSION static void base_sums_f32(const uint32_t *x, const uint32_t *b, Py_ssize_t n, double *sq) {
    double diff_sq[LANES] = {0}, base_sq[LANES] = {0};
    Py_ssize_t i = 0, tail = n - n % LANES;
    for (; i < tail; i += LANES)
        for (int k = 0; k < LANES; k++) {
            double d = (double)as_f32(x[i + k]) - (double)as_f32(b[i + k]);
            diff_sq[k] += d * d;
            base_sq[k] += (double)as_f32(b[i + k]) * (double)as_f32(b[i + k]);
        }
    for (; i < n; i++) {
        double d = (double)as_f32(x[i]) - (double)as_f32(b[i]);
        diff_sq[0] += d * d;
        base_sq[0] += (double)as_f32(b[i]) * (double)as_f32(b[i]);
    }
    sq[0] = sq[1] = 0;
    for (int k = 0; k < LANES; k++) {
        sq[0] += diff_sq[k];
        sq[1] += base_sq[k];
    }
}

/* second_moment(m, m1, v1, out, beta1, beta2, x or None) -> (diff_sq, base_sq) */
static PyObject *second_moment(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    Py_buffer bufs[5] = {{0}};
    double beta1, beta2;
    if (!PyArg_ParseTuple(args, "OOOOddO", &objs[0], &objs[1], &objs[2], &objs[3], &beta1, &beta2, &objs[4]))
        return NULL;
    PyObject *result = NULL;
    int got = 0;
    for (; got < 5; got++) {
        if (objs[got] == Py_None && got == 4) continue;
        int flags = got == 3 ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS;
        if (PyObject_GetBuffer(objs[got], &bufs[got], flags) < 0) goto done;
    }
    Py_ssize_t len = bufs[0].len;
    int same = 1;
    for (int k = 1; k < 5; k++) same &= !bufs[k].buf || bufs[k].len == len;
    if (len % 4 || !same) {
        PyErr_SetString(PyExc_ValueError, "second_moment needs buffers of the same whole number of float32 values");
    } else if (!(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1)) {
        PyErr_SetString(PyExc_ValueError, "second_moment needs 0 <= beta1, beta2 < 1");
    } else {
        double sq[2] = {0, 0};
        double inv1 = 1.0 / (1.0 - beta1), c2 = 1.0 - beta2;
        Py_BEGIN_ALLOW_THREADS
        if (bufs[4].buf) base_sums_f32(bufs[4].buf, bufs[2].buf, len / 4, sq);
        second_moment_f32(bufs[0].buf, bufs[1].buf, bufs[2].buf, bufs[3].buf, len / 4, beta1, inv1, beta2, c2);
        Py_END_ALLOW_THREADS
        result = Py_BuildValue("(dd)", sq[0], sq[1]);
    }
done:
    for (int k = 0; k < got && k < 5; k++)
        if (bufs[k].buf) PyBuffer_Release(&bufs[k]);
    return result;
}

/* The prediction of Adam's first moment m from the weights w (this step), w1 and the
 * moments m1, v1 (the base step's) (datastates_hist.predictors): the gradient g solves
 * w = w1*(1 - decay) - step_size * m / (sqrt(v)/bias2 + eps), with m = b1*m1 + (1-b1)*g and
 * v = b2*v1 + (1-b2)*g*g, squared into a quadratic whose root that fits the unsquared
 * equation is taken (the one that gives m the sign of the update). float64, one IEEE operation at a time, in the numpy reference's
 * order; where an input is unusual, the quadratic has no real root, or the prediction is
 * below the smallest normal float32, infinite or NaN, the prediction is m1's bits. */
#define FIRST_MOMENT_BODY                                                                     \
    uint32_t bw = w[i], bw1 = w1[i], bv1 = v1[i], bm1 = m1[i];                                \
    double fm1 = (double)as_f32(bm1), cv = b2 * (double)as_f32(bv1);                          \
    double r = ((double)as_f32(bw1) * keep_w - (double)as_f32(bw)) * inv_s;                   \
    double a = b1 * fm1 - r * eps;                                                            \
    double k = r * inv_c;                                                                     \
    double kk = k * k;                                                                        \
    double qa = one_b1 * one_b1 - kk * one_b2;                                                \
    double qb = 2.0 * (a * one_b1);                                                           \
    double qc = a * a - kk * cv;                                                              \
    double disc = qb * qb - 4.0 * (qa * qc);                                                  \
    double sd = sqrt(disc);                                                                   \
    double qq = -0.5 * (qb + copysign(sd, qb));                                               \
    double g1 = qq / qa, g2 = qc / qq;                                                        \
    /* the root of the unsquared equation: m has the sign of k (sqrt(v) >= 0) */             \
    int64_t same = -(int64_t)((a + one_b1 * g1 >= 0) == (k >= 0));                            \
    double g = f64_of_bits((f64_bits_of(g1) & (uint64_t)same) | (f64_bits_of(g2) & ~(uint64_t)same)); \
    double p = b1 * fm1 + one_b1 * g;                                                         \
    uint32_t bits = f32_as_bits((float)p);                                                    \
    uint32_t keep = unusual_f32(bw) | unusual_f32(bw1) | unusual_f32(bv1) | unusual_f32(bm1)  \
                    | !(disc >= 0) | !(fabs(p) >= 0x1p-126) | ((bits & 0x7f800000u) == 0x7f800000u); \
    out[i] = keep ? bm1 : bits;

MULTIVERSION_WIDE static void first_moment_f32(const uint32_t *w, const uint32_t *w1, const uint32_t *v1,
                                          const uint32_t *m1, uint32_t *out, Py_ssize_t n, double b1,
                                          double b2, double eps, double c, double s, double decay) {
    double keep_w = 1.0 - decay, one_b1 = 1.0 - b1, one_b2 = 1.0 - b2, inv_s = 1.0 / s, inv_c = 1.0 / c;
    for (Py_ssize_t i = 0; i < n; i++) {
        FIRST_MOMENT_BODY
    }
}

/* first_moment(w, w1, v1, m1, out, beta1, beta2, eps, bias2, step_size, decay, x or None)
 * -> (diff_sq, base_sq) */
static PyObject *first_moment(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    Py_buffer bufs[6] = {{0}};
    double b1, b2, eps, c, s, decay;
    if (!PyArg_ParseTuple(args, "OOOOOddddddO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &b1, &b2,
                          &eps, &c, &s, &decay, &objs[5]))
        return NULL;
    PyObject *result = NULL;
    int got = 0;
    for (; got < 6; got++) {
        if (objs[got] == Py_None && got == 5) continue;
        int flags = got == 4 ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS;
        if (PyObject_GetBuffer(objs[got], &bufs[got], flags) < 0) goto done;
    }
    Py_ssize_t len = bufs[0].len;
    int same = 1;
    for (int k = 1; k < 6; k++) same &= !bufs[k].buf || bufs[k].len == len;
    if (len % 4 || !same) {
        PyErr_SetString(PyExc_ValueError, "first_moment needs buffers of the same whole number of float32 values");
    } else {
        double sq[2] = {0, 0};
        Py_BEGIN_ALLOW_THREADS
        if (bufs[5].buf) base_sums_f32(bufs[5].buf, bufs[3].buf, len / 4, sq);
        first_moment_f32(bufs[0].buf, bufs[1].buf, bufs[2].buf, bufs[3].buf, bufs[4].buf, len / 4, b1, b2, eps,
                         c, s, decay);
        Py_END_ALLOW_THREADS
        result = Py_BuildValue("(dd)", sq[0], sq[1]);
    }
done:
    for (int k = 0; k < got && k < 6; k++)
        if (bufs[k].buf) PyBuffer_Release(&bufs[k]);
    return result;
}

/* The least-squares sums that fit a first moment's step size and decay (predictors.fitted):
 * over elements 0, stride, 2*stride... (count of them) of float32 w, w1, m, m1, v1, the
 * second moment v predicted from m, q = m / (sqrt(v) / bias2 + eps) and the update u = w - w1;
 * where q, u and w1 are finite, the sums of q*q, q*u, q*w1, w1*w1 and w1*u in float64. The
 * numpy reference sums in another order: the fitted values differ in their last bits, and
 * only the record's values decode a tensor. */
static PyObject *fit_sums(PyObject *self, PyObject *args) {
    Py_buffer bufs[5] = {{0}};
    Py_ssize_t stride, count;
    double b1, b2, bias2, eps;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*nndddd", &bufs[0], &bufs[1], &bufs[2], &bufs[3], &bufs[4], &stride,
                          &count, &b1, &b2, &bias2, &eps))
        return NULL;
    PyObject *result = NULL;
    int fits = stride > 0 && count >= 0;
    for (int k = 0; k < 5 && fits; k++)
        fits = count == 0 || (bufs[k].len / 4 > (count - 1) * stride);
    if (!fits) {
        PyErr_SetString(PyExc_ValueError, "fit_sums: the elements lie beyond the buffers");
    } else {
        const float *w = bufs[0].buf, *w1 = bufs[1].buf, *m = bufs[2].buf, *m1 = bufs[3].buf, *v1 = bufs[4].buf;
        double s[5] = {0, 0, 0, 0, 0}, inv1 = 1.0 / (1.0 - b1), c2 = 1.0 - b2;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < count; k++) {
            Py_ssize_t i = k * stride;
            double fm = m[i], g = (fm - b1 * (double)m1[i]) * inv1;
            double v = b2 * (double)v1[i] + c2 * g * g;
            double q = fm / (sqrt(v) / bias2 + eps), a = w1[i], u = (double)w[i] - a;
            if (isfinite(q) && isfinite(u) && isfinite(a)) {
                s[0] += q * q; s[1] += q * u; s[2] += q * a; s[3] += a * a; s[4] += a * u;
            }
        }
        Py_END_ALLOW_THREADS
        result = Py_BuildValue("(ddddd)", s[0], s[1], s[2], s[3], s[4]);
    }
    for (int k = 0; k < 5; k++)
        if (bufs[k].buf) PyBuffer_Release(&bufs[k]);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_stats", copy_stats, METH_VARARGS,
     "copy_stats(src, dst, itemsize) -> (sum, m2, min, max, nonfinite): copy src into dst "
     "(unless dst is None) and return the sum, the sum of squared deviations from the mean, "
     "the min, the max and the count of non-finite values of its float32/float64 values; "
     "with counts (int64), also add its values' counts by sign and binary exponent to it."},
    {"residual", residual, METH_VARARGS,
     "residual(x, b1, b2, out, keep, itemsize, norms) -> (diff_sq, base_sq): out = zigzag(x - "
     "prediction) of unsigned itemsize-byte elements (prediction b1, or 2*b1 - b2 when b2 is not "
     "None); keep (or None) gets a copy of x; norms 1 (float32) or 2 (float64) also sums "
     "(x - b1)**2 and b1**2 in float64, else both are 0."},
    {"unresidual", unresidual, METH_VARARGS,
     "unresidual(z, b1, b2, itemsize, shift): in place, z = (unzigzag(z) << shift) + prediction "
     "of unsigned itemsize-byte elements (prediction b1, or 2*b1 - b2 when b2 is not None)."},
    {"group", group, METH_VARARGS,
     "group(src, key, dst, itemsize, shift, bits, inverse): dst = src's elements of unsigned itemsize "
     "bytes in a stable order by (key >> shift) & (2**bits - 1) of key's same elements; with inverse, "
     "the order undone (dst must not be src)."},
    {"fit_sums", fit_sums, METH_VARARGS,
     "fit_sums(w, w1, m, m1, v1, stride, count, beta1, beta2, bias2, eps) -> (qq, qu, qw, ww, wu): the "
     "least-squares sums of a first moment's fit over every stride-th float32 element (count of them)."},
    {"second_moment", second_moment, METH_VARARGS,
     "second_moment(m, m1, v1, out, beta1, beta2, x) -> (diff_sq, base_sq): out = Adam's second "
     "moment predicted from the first moments m (this step) and m1 (the previous) and the second "
     "moment v1 (the previous), float32 bytes (datastates_hist.predictors); with x (not None), "
     "also the sums of (x - v1)**2 and v1**2."},
    {"first_moment", first_moment, METH_VARARGS,
     "first_moment(w, w1, v1, m1, out, beta1, beta2, eps, bias2, step_size, decay, x) -> (diff_sq, base_sq): "
     "out = Adam's first moment predicted from the weights w (this step) and w1 and the moments v1 and m1 "
     "(the base step's), float32 bytes (datastates_hist.predictors); with x (not None), also the sums of "
     "(x - m1)**2 and m1**2."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fused(void) { return PyModule_Create(&module); }
