/* Copy a chunk of float32 or float64 values and summarise it in one pass over
 * memory (the deviations in a second pass, over the copy while it is in the CPU
 * cache), accumulating in float64. datastates_hist.digest calls it chunk by
 * chunk and falls back to numpy (seven passes) when it is not built.
 *
 * The copy is a loop, not memcpy: glibc's memcpy (rep movsb) runs 10x slower on
 * AMD Zen when the destination lies a few bytes after the source modulo 4 KiB. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#define LANES 32 /* independent accumulators: the compiler vectorises across them */

#define KERNEL(NAME, T)                                                                \
static void NAME(const T *x, T *out, Py_ssize_t n, double *res) {                      \
    double sum[LANES] = {0}, lo[LANES], hi[LANES], m2[LANES] = {0};                    \
    Py_ssize_t i, tail = n - n % LANES, bad = 0;                                       \
    for (int k = 0; k < LANES; k++) { lo[k] = INFINITY; hi[k] = -INFINITY; }          \
    for (i = 0; i < tail; i += LANES)                                                  \
        for (int k = 0; k < LANES; k++) {                                              \
            if (out) out[i + k] = x[i + k];                                            \
            double v = (double)x[i + k];                                               \
            sum[k] += v;                                                               \
            lo[k] = v < lo[k] ? v : lo[k];                                             \
            hi[k] = v > hi[k] ? v : hi[k];                                             \
        }                                                                              \
    for (; i < n; i++) {                                                               \
        if (out) out[i] = x[i];                                                        \
        double v = (double)x[i];                                                       \
        sum[0] += v; lo[0] = v < lo[0] ? v : lo[0]; hi[0] = v > hi[0] ? v : hi[0];     \
    }                                                                                  \
    double s = 0, l = INFINITY, h = -INFINITY, m = 0;                                  \
    for (int k = 0; k < LANES; k++) {                                                  \
        s += sum[k]; l = lo[k] < l ? lo[k] : l; h = hi[k] > h ? hi[k] : h;             \
    }                                                                                  \
    if (isfinite(s)) { /* the deviations, from the copy if there is one (in cache) */  \
        const T *y = out ? out : x;                                                    \
        double mean = s / (double)n;                                                   \
        for (i = 0; i < tail; i += LANES)                                              \
            for (int k = 0; k < LANES; k++) {                                          \
                double d = (double)y[i + k] - mean; m2[k] += d * d;                    \
            }                                                                          \
        for (; i < n; i++) { double d = (double)y[i] - mean; m2[0] += d * d; }         \
        for (int k = 0; k < LANES; k++) m += m2[k];                                    \
    } else { /* infinities or NaN: count them; a NaN makes min and max NaN */          \
        int nan = 0;                                                                   \
        for (i = 0; i < n; i++) {                                                      \
            double v = (double)x[i];                                                   \
            bad += !isfinite(v); nan |= isnan(v);                                      \
        }                                                                              \
        m = NAN;                                                                       \
        if (nan) l = h = NAN;                                                          \
    }                                                                                  \
    res[0] = s; res[1] = m; res[2] = l; res[3] = h; res[4] = (double)bad;              \
}

KERNEL(stats_f32, float)
KERNEL(stats_f64, double)

/* copy_stats(src, dst or None, itemsize) -> (sum, m2, min, max, nonfinite) */
static PyObject *copy_stats(PyObject *self, PyObject *args) {
    Py_buffer src, dst = {0};
    PyObject *dst_obj;
    int itemsize;
    if (!PyArg_ParseTuple(args, "y*Oi", &src, &dst_obj, &itemsize)) return NULL;
    if (dst_obj != Py_None && PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    if ((itemsize != 4 && itemsize != 8) || src.len % itemsize || src.len == 0) {
        PyErr_SetString(PyExc_ValueError, "copy_stats needs a non-empty float32 or float64 buffer");
    } else if (dst.buf && dst.len != src.len) {
        PyErr_SetString(PyExc_ValueError, "copy_stats: destination and source differ in size");
    } else {
        double res[5];
        Py_ssize_t n = src.len / itemsize;
        Py_BEGIN_ALLOW_THREADS
        if (itemsize == 4) stats_f32((const float *)src.buf, (float *)dst.buf, n, res);
        else stats_f64((const double *)src.buf, (double *)dst.buf, n, res);
        Py_END_ALLOW_THREADS
        result = Py_BuildValue("(ddddn)", res[0], res[1], res[2], res[3], (Py_ssize_t)res[4]);
    }
    if (dst.buf) PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_stats", copy_stats, METH_VARARGS,
     "copy_stats(src, dst, itemsize) -> (sum, m2, min, max, nonfinite): copy src into dst "
     "(unless dst is None) and return the sum, the sum of squared deviations from the mean, "
     "the min, the max and the count of non-finite values of its float32/float64 values."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fused(void) { return PyModule_Create(&module); }
