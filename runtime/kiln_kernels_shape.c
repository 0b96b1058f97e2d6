/*
 * kiln_kernels_shape — data movement (strided, concat, gather, pad,
 * gather_elements, trilu, eye), resize and cumsum (see
 * kiln_kernels_shape.h and docs/program-format.md).
 *
 * Every prepare function proves that run stays inside its operands:
 * shapes are checked against the parameters, every index a loop can
 * compute is bounded, and every product is overflow-checked.  The run
 * functions do not check and do not fail; data-dependent indices (gather)
 * are the one exception, and an index out of range gives zeros.
 */
#include "runtime/kiln_kernels_priv.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cblas.h>

#include "runtime/kiln_exec.h"
#include "runtime/kiln_gemm.h"

/* The values of the `mode`, `coord` and `nearest` parameters
 * (docs/program-format.md); the compiler writes the same numbers. */
enum { S_PAD_CONSTANT = 0, S_PAD_REFLECT = 1, S_PAD_EDGE = 2 };
enum { S_NEAREST = 0, S_LINEAR = 1 };
enum { S_HALF_PIXEL = 0, S_ASYMMETRIC = 1, S_ALIGN_CORNERS = 2, S_PYTORCH_HALF_PIXEL = 3 };
enum { S_ROUND_PREFER_FLOOR = 0, S_ROUND_PREFER_CEIL = 1, S_FLOOR = 2, S_CEIL = 3 };

/* --- helpers ---------------------------------------------------------- */

static int
s_same_dtype (const kiln_program_t *p, const kiln_kplan_t *plan, kiln_err_t *err)
{
    kiln_dtype_t dt = kiln_ktensor (p, plan->out)->dtype;
    for (int i = 0; i < plan->n_in; i++)
        if (kiln_ktensor (p, plan->in[i])->dtype != dt)
            return kiln_error (err, KILN_EFORMAT, "input %d is %s but the output is %s", i,
                               kiln_dtype_name (kiln_ktensor (p, plan->in[i])->dtype),
                               kiln_dtype_name (dt));
    return 0;
}

/* Copy n elements of `es` bytes from src (stride `st` elements) to dst
 * (contiguous). */
static inline void
s_copy_strided (uint8_t *dst, const uint8_t *src, int64_t n, int64_t st, size_t es)
{
    if (st == 1) {
        memcpy (dst, src, (size_t) n * es);
        return;
    }
#define S_GATHER(T)                                                 \
    do {                                                            \
        const T *s = (const T *) (const void *) src;                \
        T *d = (T *) (void *) dst;                                  \
        for (int64_t i = 0; i < n; i++)                             \
            d[i] = s[i * st];                                       \
        return;                                                     \
    } while (0)
    switch (es) {
    case 4: S_GATHER (uint32_t);
    case 8: S_GATHER (uint64_t);
    case 2: S_GATHER (uint16_t);
#undef S_GATHER
    default:
        for (int64_t i = 0; i < n; i++)
            dst[i] = src[i * st];
    }
}

/* --- strided ---------------------------------------------------------- */

/* y[i·n + j] = x[i + j·st] for i < a, j < n, by blocks of 8 × 8.  Row
 * by row (each y row a gather of n elements st apart) the source rows
 * are touched once per row of y, and when st is a multiple of 256 floats
 * they share a few cache sets: a head split's [128, 8, 32] → [8, 32,
 * 128] took 31 µs, 1 ns an element.  Blocked, eight source rows are
 * used up while they are in cache.  A whole block on AVX2 is eight
 * loads, the 24 shuffles of an 8 × 8 transpose and eight stores (the
 * bits moved as they are), element by element elsewhere. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define S_T8_AVX2 1

__attribute__ ((target ("avx2"))) static void
s_t8_avx2 (uint32_t *y, int64_t n, const uint32_t *x, int64_t st)
{
    __m256 r[8], t[8];
    for (int q = 0; q < 8; q++)
        r[q] = _mm256_loadu_ps ((const float *) (const void *) (x + q * st));
    for (int q = 0; q < 8; q += 2) {
        t[q] = _mm256_unpacklo_ps (r[q], r[q + 1]);
        t[q + 1] = _mm256_unpackhi_ps (r[q], r[q + 1]);
    }
    r[0] = _mm256_shuffle_ps (t[0], t[2], 0x44);
    r[1] = _mm256_shuffle_ps (t[0], t[2], 0xEE);
    r[2] = _mm256_shuffle_ps (t[1], t[3], 0x44);
    r[3] = _mm256_shuffle_ps (t[1], t[3], 0xEE);
    r[4] = _mm256_shuffle_ps (t[4], t[6], 0x44);
    r[5] = _mm256_shuffle_ps (t[4], t[6], 0xEE);
    r[6] = _mm256_shuffle_ps (t[5], t[7], 0x44);
    r[7] = _mm256_shuffle_ps (t[5], t[7], 0xEE);
    for (int q = 0; q < 4; q++) {
        _mm256_storeu_ps ((float *) (void *) (y + q * n),
                          _mm256_permute2f128_ps (r[q], r[q + 4], 0x20));
        _mm256_storeu_ps ((float *) (void *) (y + (q + 4) * n),
                          _mm256_permute2f128_ps (r[q], r[q + 4], 0x31));
    }
}
#else
#define S_T8_AVX2 0
#endif

/* Rows i0..i1 - 1 of one matrix's transpose, in blocks of 8 columns:
 * its output rows written in order. */
static void
s_transpose_f32 (uint32_t *y, const uint32_t *x, int64_t n, int64_t st, int64_t i0,
                 int64_t i1, bool avx2)
{
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        int64_t j1 = j0 + 8 < n ? j0 + 8 : n;
#if S_T8_AVX2
        if (avx2 && i1 - i0 == 8 && j1 - j0 == 8) {
            s_t8_avx2 (y + i0 * n + j0, n, x + i0 + j0 * st, st);
            continue;
        }
#else
        (void) avx2;
#endif
        if (i1 - i0 == 8 && j1 - j0 == 8) {
            for (int64_t i = i0; i < i0 + 8; i++)
                for (int64_t j = j0; j < j0 + 8; j++)
                    y[i * n + j] = x[i + j * st];
            continue;
        }
        for (int64_t i = i0; i < i1; i++)
            for (int64_t j = j0; j < j1; j++)
                y[i * n + j] = x[i + j * st];
    }
}

/* The transposes of a strided copy over the pool: a task is 8 rows of
 * one matrix's transpose (the outer dimensions' index o, its source
 * offset computed from o). */
typedef struct {
    const kiln_kshape_plan_t *sp;
    uint32_t *y;
    const uint32_t *x;
    int64_t a, n, st, nb;           /* nb: blocks of 8 rows a matrix */
    bool avx2;
} s_tr_t;

static void
s_tr_rows (void *arg, int64_t first, int64_t count)
{
    const s_tr_t *t = arg;
    const kiln_kshape_plan_t *sp = t->sp;
    for (int64_t b = first; b < first + count; b++) {
        int64_t o = b / t->nb, i0 = b % t->nb * 8;
        int64_t src = sp->offset, rest = o;
        for (int i = sp->rank - 3; i >= 0; i--) {
            src += rest % sp->dims[i] * sp->st[i];
            rest /= sp->dims[i];
        }
        s_transpose_f32 (t->y + o * t->a * t->n, t->x + src, t->n, t->st, i0,
                         i0 + 8 < t->a ? i0 + 8 : t->a, t->avx2);
    }
}

static void
s_run_strided (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kshape_plan_t *sp = &plan->u.shape;
    const uint8_t *x = data[plan->in[0]];
    uint8_t *y = data[plan->out];
    int r = sp->rank;
    int64_t n = sp->dims[r - 1], st = sp->st[r - 1];
    int64_t outer = kiln_kdims_prod (sp->dims, 0, r - 1);
    int64_t idx[KILN_PROG_MAX_PARAM_INTS] = { 0 }, src = sp->offset;
    size_t es = sp->esz;
    if (es == 4 && r >= 2 && sp->st[r - 2] == 1 && st != 1 && n >= 8
        && sp->dims[r - 2] >= 8) {
        /* The two inner loops are a transpose (the axis X walks
         * contiguously is not the last): by blocks, over the rest. */
        int64_t a = sp->dims[r - 2];
        s_tr_t t = { sp, (uint32_t *) (void *) y, (const uint32_t *) (const void *) x,
                     a, n, st, (a + 7) / 8, false };
#if S_T8_AVX2
        /* (KILN_RT_ISA=generic runs the element-by-element blocks) */
        t.avx2 = __builtin_cpu_supports ("avx2") && strcmp (kiln_gemm_isa (), "generic") != 0;
#endif
        /* tasks of about 4096 elements */
        kiln_krows_run (s_tr_rows, &t, outer / a * t.nb, 4096 / (8 * n) + 1);
        return;
    }
    for (int64_t o = 0; o < outer; o++) {
        s_copy_strided (y + (size_t) (o * n) * es, x + src * (int64_t) es, n, st, es);
        for (int i = r - 2; i >= 0; i--) {
            src += sp->st[i];
            if (++idx[i] < sp->dims[i])
                break;
            src -= sp->st[i] * sp->dims[i];
            idx[i] = 0;
        }
    }
}

static int
s_prep_strided (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                kiln_err_t *err)
{
    kiln_kshape_plan_t *sp = &plan->u.shape;
    int64_t dims[KILN_PROG_MAX_PARAM_INTS], st[KILN_PROG_MAX_PARAM_INTS], offset;
    int r, rc;
    if ((rc = s_same_dtype (p, plan, err))
        || (rc = kiln_prog_op_ints_any (op, "dims", dims, &r, err))
        || (rc = kiln_prog_op_ints (op, "strides", r, st, err))
        || (rc = kiln_prog_op_int (op, "offset", &offset, err)))
        return rc;
    int64_t n = 1;
    for (int i = 0; i < r; i++) {
        if (dims[i] < 0 || dims[i] > KILN_MAX_DIM || __builtin_mul_overflow (n, dims[i], &n))
            return kiln_error (err, KILN_EFORMAT, "dims[%d] is %lld", i, (long long) dims[i]);
        if (st[i] < -KILN_MAX_TENSOR_ELEMS || st[i] > KILN_MAX_TENSOR_ELEMS)
            return kiln_error (err, KILN_EFORMAT, "strides[%d] is %lld", i, (long long) st[i]);
    }
    if (n != kiln_ktensor_numel (kiln_ktensor (p, plan->out)))
        return kiln_error (err, KILN_EFORMAT, "the loop covers %lld elements, the output holds %lld",
                           (long long) n, (long long) kiln_ktensor_numel (kiln_ktensor (p, plan->out)));
    /* The lowest and highest element the loop nest reads: each term is
     * below 2^31 * 2^32, and there are at most 16, so __int128 holds
     * the sums exactly. */
    __int128 lo = offset, hi = offset;
    for (int i = 0; i < r; i++) {
        __int128 span = (__int128) (dims[i] > 0 ? dims[i] - 1 : 0) * st[i];
        if (span < 0)
            lo += span;
        else
            hi += span;
    }
    if (n > 0 && (lo < 0 || hi >= kiln_ktensor_numel (kiln_ktensor (p, plan->in[0]))))
        return kiln_error (err, KILN_EFORMAT, "the loop reads elements %lld..%lld of an input of %lld",
                           (long long) lo, (long long) hi,
                           (long long) kiln_ktensor_numel (kiln_ktensor (p, plan->in[0])));
    /* Drop unit loops and merge a loop into the one inside it when they
     * walk X contiguously, so the inner loop is as long as possible. */
    int k = 0;
    for (int i = 0; i < r; i++) {
        if (dims[i] == 1)
            continue;
        if (k > 0 && sp->st[k - 1] == st[i] * dims[i]) {
            sp->dims[k - 1] *= dims[i];
            sp->st[k - 1] = st[i];
            continue;
        }
        sp->dims[k] = dims[i];
        sp->st[k] = st[i];
        k++;
    }
    if (k == 0 || n == 0) {
        sp->dims[0] = n;
        sp->st[0] = 1;
        k = 1;
    }
    sp->rank = k;
    sp->offset = offset;
    sp->esz = kiln_dtype_size (kiln_ktensor (p, plan->out)->dtype);
    plan->run = s_run_strided;
    return 0;
}

/* --- concat ----------------------------------------------------------- */

static void
s_run_concat (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kshape_plan_t *sp = &plan->u.shape;
    uint8_t *y = data[plan->out];
    for (int64_t o = 0; o < sp->outer; o++)
        for (int i = 0; i < plan->n_in; i++) {
            const uint8_t *x = data[plan->in[i]];
            memcpy (y, x + o * sp->chunk[i], (size_t) sp->chunk[i]);
            y += sp->chunk[i];
        }
}

static int
s_prep_concat (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
               kiln_err_t *err)
{
    kiln_kshape_plan_t *sp = &plan->u.shape;
    int64_t axis;
    int rc;
    if ((rc = s_same_dtype (p, plan, err)) || (rc = kiln_prog_op_int (op, "axis", &axis, err)))
        return rc;
    const kiln_prog_tensor_t *y = kiln_ktensor (p, plan->out);
    int r = y->shape.rank;
    if (axis < 0 || axis >= r)
        return kiln_error (err, KILN_EFORMAT, "axis %lld is outside 0..%d", (long long) axis, r - 1);
    int64_t sum = 0;
    sp->esz = kiln_dtype_size (y->dtype);
    sp->inner = kiln_kdims_prod (y->shape.dims, (int) axis + 1, r);
    sp->outer = kiln_kdims_prod (y->shape.dims, 0, (int) axis);
    for (int i = 0; i < plan->n_in; i++) {
        const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[i]);
        if (x->shape.rank != r)
            return kiln_error (err, KILN_EFORMAT, "input %d has rank %d, the output %d", i,
                               x->shape.rank, r);
        for (int k = 0; k < r; k++)
            if (k != axis && x->shape.dims[k] != y->shape.dims[k])
                return kiln_error (err, KILN_EFORMAT, "input %d differs from the output along axis %d",
                                   i, k);
        sum += x->shape.dims[axis];
        sp->chunk[i] = x->shape.dims[axis] * sp->inner * (int64_t) sp->esz;
    }
    if (sum != y->shape.dims[axis])
        return kiln_error (err, KILN_EFORMAT, "the inputs add up to %lld along axis %lld, the output has %lld",
                           (long long) sum, (long long) axis, (long long) y->shape.dims[axis]);
    plan->run = s_run_concat;
    return 0;
}

/* --- gather ----------------------------------------------------------- */

static void
s_run_gather (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kshape_plan_t *sp = &plan->u.shape;
    const uint8_t *x = data[plan->in[0]];
    const void *ind = data[plan->in[1]];
    uint8_t *y = data[plan->out];
    size_t chunk = (size_t) sp->inner * sp->esz;
    int64_t d = sp->axis_len;
    for (int64_t o = 0; o < sp->outer; o++)
        for (int64_t j = 0; j < sp->n_idx; j++) {
            int64_t k = sp->idx64 ? ((const int64_t *) ind)[j] : ((const int32_t *) ind)[j];
            if (k < 0)
                k += d;
            if (k < 0 || k >= d) {
                /* data, not a crash: the run fails naming it */
                kiln_exec_fault ("index %lld (element %lld of the indices) is outside "
                                 "-%lld..%lld", (long long) (k < 0 ? k - d : k), (long long) j,
                                 (long long) d, (long long) d - 1);
                return;
            }
            memcpy (y, x + (size_t) ((o * d + k) * sp->inner) * sp->esz, chunk);
            y += chunk;
        }
}

static int
s_prep_gather (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
               kiln_err_t *err)
{
    kiln_kshape_plan_t *sp = &plan->u.shape;
    const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[0]), *ind = kiln_ktensor (p, plan->in[1]);
    const kiln_prog_tensor_t *y = kiln_ktensor (p, plan->out);
    int64_t axis;
    int rc = kiln_prog_op_int (op, "axis", &axis, err);
    if (rc)
        return rc;
    if (x->dtype != y->dtype)
        return kiln_error (err, KILN_EFORMAT, "data is %s but the output is %s",
                           kiln_dtype_name (x->dtype), kiln_dtype_name (y->dtype));
    if (ind->dtype != KILN_DT_INT64 && ind->dtype != KILN_DT_INT32)
        return kiln_error (err, KILN_EFORMAT, "indices are %s, expected int64 or int32",
                           kiln_dtype_name (ind->dtype));
    int r = x->shape.rank, q = ind->shape.rank;
    if (axis < 0 || axis >= r || y->shape.rank != r - 1 + q)
        return kiln_error (err, KILN_EFORMAT, "axis %lld and the ranks do not fit", (long long) axis);
    for (int i = 0; i < y->shape.rank; i++) {
        int64_t want = i < axis ? x->shape.dims[i]
                       : i < axis + q ? ind->shape.dims[i - axis]
                       : x->shape.dims[i - q + 1];
        if (y->shape.dims[i] != want)
            return kiln_error (err, KILN_EFORMAT, "output dimension %d is %lld, expected %lld", i,
                               (long long) y->shape.dims[i], (long long) want);
    }
    sp->esz = kiln_dtype_size (x->dtype);
    sp->outer = kiln_kdims_prod (x->shape.dims, 0, (int) axis);
    sp->inner = kiln_kdims_prod (x->shape.dims, (int) axis + 1, r);
    sp->axis_len = x->shape.dims[axis];
    sp->n_idx = kiln_ktensor_numel (ind);
    sp->idx64 = ind->dtype == KILN_DT_INT64;
    plan->run = s_run_gather;
    return 0;
}

/* --- pad -------------------------------------------------------------- */

/* Source coordinate of output coordinate o along an axis of size d
 * padded by `pb` in front, or -1 for the constant. */
static inline int64_t
s_pad_src (int mode, int64_t o, int64_t pb, int64_t d)
{
    int64_t j = o - pb;
    if (j >= 0 && j < d)
        return j;
    if (mode == S_PAD_CONSTANT || d == 0)
        return -1;
    if (mode == S_PAD_EDGE || d == 1)
        return j < 0 ? 0 : d - 1;
    /* reflect: the pattern repeats every 2 (d - 1) */
    int64_t period = 2 * (d - 1);
    j %= period;
    if (j < 0)
        j += period;
    return j < d ? j : period - j;
}

/* One row of a constant pad: lo elements of the constant, n of the row
 * xr, the constant to ow; inlined, so that with es a constant 4 the
 * moves are the compiler's own, where a memcpy an element (and one a
 * run) called libc's (a Pad of inception_v3's, 768 planes of 12 x 12 to
 * 14 x 14, took 0.30 ms). */
static inline __attribute__ ((always_inline)) void
s_pad_row_es (uint8_t *y, const uint8_t *xr, const uint8_t *value, size_t es, int64_t lo,
              int64_t n, int64_t ow)
{
    for (int64_t c = 0; c < lo; c++)
        memcpy (y + (size_t) c * es, value, es);
    if (es == 4)                /* (a short row: moves, not a call) */
        for (int64_t k = 0; k < n; k++)
            memcpy (y + 4 * (lo + k), xr + 4 * k, 4);
    else
        memcpy (y + (size_t) lo * es, xr, (size_t) n * es);
    for (int64_t c = lo + n; c < ow; c++)
        memcpy (y + (size_t) c * es, value, es);
}

static void
s_pad_row_const (uint8_t *y, const uint8_t *xr, const uint8_t *value, size_t es, int64_t lo,
                 int64_t n, int64_t ow)
{
    if (es == 4)
        s_pad_row_es (y, xr, value, 4, lo, n, ow);
    else
        s_pad_row_es (y, xr, value, es, lo, n, ow);
}

static void
s_run_pad (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kshape_plan_t *sp = &plan->u.shape;
    const uint8_t *x = data[plan->in[0]];
    uint8_t *y = data[plan->out];
    int r = sp->rank;
    size_t es = sp->esz;
    /* Along each axis the kept part of X starts at pads[r + i] (what a
     * negative begin pad crops) and is in_dims[i] long; pads[i] is the
     * (non-negative) padding in front of it. */
    int64_t ow = sp->dims[r - 1], iw = sp->in_dims[r - 1], pb = sp->pads[r - 1];
    int64_t rows = kiln_kdims_prod (sp->dims, 0, r - 1);
    int64_t idx[KILN_MAX_RANK] = { 0 };
    for (int64_t row = 0; row < rows; row++, y += (size_t) ow * es) {
        /* The source row, or none (a row of the constant). */
        int64_t src = sp->pads[2 * r - 1];
        bool fill = false;
        for (int i = 0; i < r - 1; i++) {
            int64_t j = s_pad_src (sp->mode, idx[i], sp->pads[i], sp->in_dims[i]);
            if (j < 0)
                fill = true;
            else
                src += (sp->pads[r + i] + j) * sp->st[i];
        }
        const uint8_t *xr = x + (size_t) src * es;
        if (sp->mode == S_PAD_CONSTANT) {
            /* the constant, the row's kept part, the constant (a row of
             * the constant alone when it has no source) */
            int64_t lo = fill || pb > ow ? ow : pb;
            int64_t n = ow - lo < iw ? ow - lo : iw;
            s_pad_row_const (y, xr, sp->value, es, lo, n, ow);
        } else {
            for (int64_t c = 0; c < ow; c++) {
                int64_t j = fill ? -1 : s_pad_src (sp->mode, c, pb, iw);
                if (j < 0)
                    memcpy (y + (size_t) c * es, sp->value, es);
                else if (j == c - pb && c + 1 < ow && c + 1 - pb < iw) {
                    /* The inside of the row in one copy. */
                    int64_t n = (iw - j < ow - c) ? iw - j : ow - c;
                    memcpy (y + (size_t) c * es, xr + (size_t) j * es, (size_t) n * es);
                    c += n - 1;
                }
                else
                    memcpy (y + (size_t) c * es, xr + (size_t) j * es, es);
            }
        }
        for (int i = r - 2; i >= 0; i--) {
            if (++idx[i] < sp->dims[i])
                break;
            idx[i] = 0;
        }
    }
}

/* `v` as one element of `dt`, into out[8]. */
static int
s_value_bytes (kiln_dtype_t dt, double v, uint8_t *out, kiln_err_t *err)
{
    memset (out, 0, 8);
    switch (dt) {
    case KILN_DT_FLOAT32: { float f = (float) v; memcpy (out, &f, 4); return 0; }
    case KILN_DT_FLOAT64: memcpy (out, &v, 8); return 0;
    case KILN_DT_BOOL: out[0] = v != 0.0; return 0;
    default: break;
    }
    if (!(v >= -9.2e18 && v <= 9.2e18))
        return kiln_error (err, KILN_EFORMAT, "value %g does not fit %s", v, kiln_dtype_name (dt));
    int64_t i = (int64_t) v;
    switch (dt) {
    case KILN_DT_INT64: memcpy (out, &i, 8); return 0;
    case KILN_DT_INT32: { int32_t x = (int32_t) i; memcpy (out, &x, 4); return 0; }
    case KILN_DT_INT8: case KILN_DT_UINT8: out[0] = (uint8_t) i; return 0;
    default:
        if (v == 0.0)
            return 0;           /* float16 zero is all-zero bits */
        return kiln_error (err, KILN_EFORMAT, "a non-zero pad value for %s", kiln_dtype_name (dt));
    }
}

static int
s_prep_pad (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan, kiln_err_t *err)
{
    kiln_kshape_plan_t *sp = &plan->u.shape;
    const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[0]), *y = kiln_ktensor (p, plan->out);
    int r = x->shape.rank, rc;
    int64_t mode;
    double value;
    if ((rc = s_same_dtype (p, plan, err))
        || (rc = kiln_prog_op_ints (op, "pads", 2 * r, sp->pads, err))
        || (rc = kiln_prog_op_int (op, "mode", &mode, err))
        || (rc = kiln_prog_op_float (op, "value", &value, err)))
        return rc;
    if (y->shape.rank != r)
        return kiln_error (err, KILN_EFORMAT, "X has rank %d, Y rank %d", r, y->shape.rank);
    if (mode < S_PAD_CONSTANT || mode > S_PAD_EDGE)
        return kiln_error (err, KILN_EFORMAT, "mode %lld", (long long) mode);
    int64_t pads[2 * KILN_MAX_RANK], st = 1;
    memcpy (pads, sp->pads, sizeof pads);
    for (int i = r - 1; i >= 0; i--) {
        int64_t pb = pads[i], pe = pads[r + i], d = x->shape.dims[i];
        if (pb < -KILN_MAX_DIM || pb > KILN_MAX_DIM || pe < -KILN_MAX_DIM || pe > KILN_MAX_DIM
            || d + pb + pe != y->shape.dims[i])
            return kiln_error (err, KILN_EFORMAT, "axis %d: %lld + %lld + %lld is not %lld", i,
                               (long long) pb, (long long) d, (long long) pe,
                               (long long) y->shape.dims[i]);
        /* Negative pads crop X first; the rest pads what is left, as
         * onnxruntime does. */
        int64_t kept = d + (pb < 0 ? pb : 0) + (pe < 0 ? pe : 0);
        if (kept < 0)
            return kiln_error (err, KILN_EFORMAT, "axis %d: pads %lld and %lld crop more than its %lld",
                               i, (long long) pb, (long long) pe, (long long) d);
        if (mode != S_PAD_CONSTANT && kept == 0 && y->shape.dims[i] > 0)
            return kiln_error (err, KILN_EFORMAT, "axis %d is empty and cannot be padded from", i);
        sp->dims[i] = y->shape.dims[i];
        sp->in_dims[i] = kept;
        sp->pads[i] = pb > 0 ? pb : 0;
        sp->pads[r + i] = pb < 0 ? -pb : 0;
        sp->st[i] = st;
        st *= d;
    }
    if ((rc = s_value_bytes (x->dtype, value, sp->value, err)))
        return rc;
    /* A scalar is a row of one. */
    if (r == 0) {
        sp->dims[0] = sp->in_dims[0] = sp->st[0] = 1;
        sp->pads[0] = sp->pads[1] = 0;
        r = 1;
    }
    sp->rank = r;
    sp->mode = (int) mode;
    sp->esz = kiln_dtype_size (x->dtype);
    plan->run = s_run_pad;
    return 0;
}

/* --- resize ----------------------------------------------------------- */

/* Where output coordinate `o` along axis a reads, as in the ONNX
 * reference: the two neighbours i0, i1 (clamped) and i1's weight. */
static inline void
s_resize_coord (const kiln_kshape_plan_t *sp, int a, int64_t o, int64_t *i0, int64_t *i1,
                double *w1)
{
    double in = (double) sp->in_dims[a], s = sp->scale[a], x;
    double out_len = s * in;           /* the reference's "output_width", a float */
    switch (sp->coord) {
    case S_ASYMMETRIC:
        x = (double) o / s;
        break;
    case S_ALIGN_CORNERS:
        x = out_len == 1.0 ? 0.0 : (double) o * (in - 1.0) / (out_len - 1.0);
        break;
    case S_PYTORCH_HALF_PIXEL:
        x = out_len == 1.0 ? -0.5 : ((double) o + 0.5) / s - 0.5;
        break;
    default:
        x = ((double) o + 0.5) / s - 0.5;
        break;
    }
    double f = floor (x), r = x - f;
    int64_t lo = (int64_t) f, hi = lo + 1, last = sp->in_dims[a] - 1;
    if (sp->mode == S_NEAREST) {
        bool up;
        switch (sp->nearest) {
        case S_ROUND_PREFER_CEIL: up = r >= 0.5; break;
        case S_FLOOR: up = false; break;
        case S_CEIL: up = r > 0.0; break;
        default: up = r > 0.5; break;
        }
        lo = up ? hi : lo;
        r = 0.0;
    }
    *i0 = lo < 0 ? 0 : lo > last ? last : lo;
    *i1 = hi < 0 ? 0 : hi > last ? last : hi;
    *w1 = r;
}

/* Row by row: the neighbours and weights of the outer axes are worked
 * out once per output row (at most 2^(rank-1) combinations, in `off` and
 * `wt`), the last axis's per element. */
static void
s_run_resize (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kshape_plan_t *sp = &plan->u.shape;
    const float *x = data[plan->in[0]];
    float *y = data[plan->out];
    int r = sp->rank, last = r - 1;
    int64_t st[KILN_MAX_RANK], c = 1;
    for (int i = r - 1; i >= 0; i--) {
        st[i] = c;
        c *= sp->in_dims[i];
    }
    int64_t rows = kiln_kdims_prod (sp->dims, 0, last), ow = sp->dims[last];
    int64_t idx[KILN_MAX_RANK] = { 0 };
    int64_t off[1 << (KILN_MAX_RANK - 1)];
    double wt[1 << (KILN_MAX_RANK - 1)];
    for (int64_t row = 0; row < rows; row++, y += ow) {
        int n = 1;
        off[0] = 0;
        wt[0] = 1.0;
        for (int a = 0; a < last; a++) {
            int64_t lo, hi;
            double w;
            s_resize_coord (sp, a, idx[a], &lo, &hi, &w);
            if (w == 0.0 || hi == lo) {
                for (int m = 0; m < n; m++)
                    off[m] += lo * st[a];
                continue;
            }
            /* Each combination so far splits into its lo and hi halves. */
            for (int m = 0; m < n; m++) {
                off[n + m] = off[m] + hi * st[a];
                wt[n + m] = wt[m] * w;
                off[m] += lo * st[a];
                wt[m] *= 1.0 - w;
            }
            n *= 2;
        }
        for (int64_t q = 0; q < ow; q++) {
            int64_t lo, hi;
            double w, acc = 0.0;
            s_resize_coord (sp, last, q, &lo, &hi, &w);
            for (int m = 0; m < n; m++) {
                const float *xr = x + off[m];
                acc += wt[m] * (w == 0.0 ? (double) xr[lo]
                                         : (1.0 - w) * xr[lo] + w * (double) xr[hi]);
            }
            y[q] = (float) acc;
        }
        for (int a = last - 1; a >= 0; a--) {
            if (++idx[a] < sp->dims[a])
                break;
            idx[a] = 0;
        }
    }
}

static int
s_prep_resize (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan, kiln_err_t *err)
{
    kiln_kshape_plan_t *sp = &plan->u.shape;
    const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[0]), *y = kiln_ktensor (p, plan->out);
    int r = x->shape.rank, rc;
    int64_t mode, coord, nearest, bits[KILN_MAX_RANK];
    if ((rc = kiln_kneed_f32 (p, plan, err))
        || (rc = kiln_prog_op_int (op, "mode", &mode, err))
        || (rc = kiln_prog_op_int (op, "coord", &coord, err))
        || (rc = kiln_prog_op_int (op, "nearest", &nearest, err))
        || (rc = kiln_prog_op_ints (op, "scales", r, bits, err)))
        return rc;
    if (y->shape.rank != r || r < 1)
        return kiln_error (err, KILN_EFORMAT, "X and Y must have the same rank, at least 1");
    if (mode < 0 || mode > 1 || coord < 0 || coord > S_PYTORCH_HALF_PIXEL || nearest < 0
        || nearest > S_CEIL)
        return kiln_error (err, KILN_EFORMAT, "mode, coord or nearest out of range");
    for (int a = 0; a < r; a++) {
        int64_t in = x->shape.dims[a], out = y->shape.dims[a];
        if (in == 0 && out > 0)
            return kiln_error (err, KILN_EFORMAT, "axis %d: cannot resize an empty axis to %lld", a,
                               (long long) out);
        /* The scale: a float32 given as its bits, or 0 for out / in. */
        if (bits[a] < 0 || bits[a] > UINT32_MAX)
            return kiln_error (err, KILN_EFORMAT, "scales[%d] is not float32 bits", a);
        uint32_t b = (uint32_t) bits[a];
        float f;
        memcpy (&f, &b, 4);
        double s = b == 0 ? (in ? (double) out / (double) in : 1.0) : (double) f;
        if (!(s > 0.0) || !isfinite (s))
            return kiln_error (err, KILN_EFORMAT, "scales[%d] is %g", a, s);
        sp->scale[a] = s;
        sp->in_dims[a] = in;
        sp->dims[a] = out;
    }
    sp->rank = r;
    sp->mode = (int) mode;
    sp->coord = (int) coord;
    sp->nearest = (int) nearest;
    plan->run = s_run_resize;
    return 0;
}


/* --- Trilu, GatherElements, CumSum ------------------------------------ */

/* Trilu: the matrices of X's last two axes with the elements off the
 * kept triangle zeroed: kept where j - i >= k (upper) or <= k (lower). */
static void
s_run_trilu (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kshape_plan_t *sp = &plan->u.shape;
    const uint8_t *x = data[plan->in[0]];
    uint8_t *y = data[plan->out];
    int64_t rows = sp->h, cols = sp->w, k = sp->offset;
    for (int64_t b = 0; b < sp->outer; b++)
        for (int64_t i = 0; i < rows; i++) {
            /* kept columns [lo, hi) of row i */
            int64_t lo = sp->mode ? i + k : 0, hi = sp->mode ? cols : i + k + 1;
            lo = lo < 0 ? 0 : lo > cols ? cols : lo;
            hi = hi < lo ? lo : hi > cols ? cols : hi;
            size_t row = (size_t) ((b * rows + i) * cols) * sp->esz;
            memset (y + row, 0, (size_t) lo * sp->esz);
            memcpy (y + row + lo * sp->esz, x + row + lo * sp->esz, (size_t) (hi - lo) * sp->esz);
            memset (y + row + hi * sp->esz, 0, (size_t) (cols - hi) * sp->esz);
        }
}

static int
s_prep_trilu (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan, kiln_err_t *err)
{
    kiln_kshape_plan_t *sp = &plan->u.shape;
    const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[0]), *y = kiln_ktensor (p, plan->out);
    int64_t upper, k;
    int rc;
    if ((rc = kiln_prog_op_int (op, "upper", &upper, err))
        || (rc = kiln_prog_op_int (op, "k", &k, err)))
        return rc;
    if (x->dtype != y->dtype || !kiln_shape_equal (&x->shape, &y->shape) || x->shape.rank < 2)
        return kiln_error (err, KILN_EFORMAT, "X must have rank >= 2 and Y its type and shape");
    int r = x->shape.rank;
    sp->esz = kiln_dtype_size (x->dtype);
    sp->h = x->shape.dims[r - 2];
    sp->w = x->shape.dims[r - 1];
    sp->outer = sp->h != 0 && sp->w != 0 ? kiln_ktensor_numel (x) / (sp->h * sp->w) : 0;
    sp->mode = upper != 0;
    /* beyond ± the matrix size every k means the same */
    sp->offset = k < -(sp->h + 1) ? -(sp->h + 1) : k > sp->w + 1 ? sp->w + 1 : k;
    plan->run = s_run_trilu;
    return 0;
}

/* GatherElements: y[i] = x[i with i[axis] = indices[i]], negative indices
 * counted from the end; one out of range fails the run (as Gather does). */
static void
s_run_gather_elements (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kshape_plan_t *sp = &plan->u.shape;
    const uint8_t *x = data[plan->in[0]];
    const void *ind = data[plan->in[1]];
    uint8_t *y = data[plan->out];
    int64_t d = sp->axis_len, n = sp->n_idx, inner = sp->inner, xd = sp->in_dims[0];
    for (int64_t o = 0; o < sp->outer; o++)
        for (int64_t j = 0; j < n; j++)
            for (int64_t in = 0; in < inner; in++) {
                int64_t e = (o * n + j) * inner + in;
                int64_t k = sp->idx64 ? ((const int64_t *) ind)[e] : ((const int32_t *) ind)[e];
                if (k < 0)
                    k += xd;
                if (k < 0 || k >= xd) {
                    kiln_exec_fault ("index %lld (element %lld of the indices) is outside "
                                     "-%lld..%lld", (long long) (k < 0 ? k - xd : k),
                                     (long long) e, (long long) xd, (long long) xd - 1);
                    return;
                }
                memcpy (y + e * sp->esz, x + (size_t) ((o * xd + k) * d + in) * sp->esz,
                        sp->esz);
            }
}

static int
s_prep_gather_elements (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                        kiln_err_t *err)
{
    kiln_kshape_plan_t *sp = &plan->u.shape;
    const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[0]), *ind = kiln_ktensor (p, plan->in[1]);
    const kiln_prog_tensor_t *y = kiln_ktensor (p, plan->out);
    int64_t axis;
    int rc = kiln_prog_op_int (op, "axis", &axis, err);
    if (rc)
        return rc;
    int r = x->shape.rank;
    if (x->dtype != y->dtype || !kiln_shape_equal (&ind->shape, &y->shape)
        || ind->shape.rank != r || axis < 0 || axis >= r)
        return kiln_error (err, KILN_EFORMAT, "indices must have X's rank and Y their "
                           "shape and X's type, and axis %lld be an axis", (long long) axis);
    if (ind->dtype != KILN_DT_INT64 && ind->dtype != KILN_DT_INT32)
        return kiln_error (err, KILN_EFORMAT, "indices are %s, expected int64 or int32",
                           kiln_dtype_name (ind->dtype));
    /* The other axes of the indices must not go past X's: then y's
     * [outer, n, inner] maps onto x's [outer, xd, inner'] with inner' the
     * same as inner only when they are equal, which is required here. */
    for (int i = 0; i < r; i++)
        if (i != axis && ind->shape.dims[i] != x->shape.dims[i])
            return kiln_error (err, KILN_EUNSUPPORTED, "indices differ from X in axis %d "
                               "other than axis %lld", i, (long long) axis);
    sp->esz = kiln_dtype_size (x->dtype);
    sp->idx64 = ind->dtype == KILN_DT_INT64;
    sp->outer = kiln_kdims_prod (x->shape.dims, 0, (int) axis);
    sp->inner = kiln_kdims_prod (x->shape.dims, (int) axis + 1, r);
    sp->n_idx = ind->shape.dims[axis];
    sp->in_dims[0] = x->shape.dims[axis];
    sp->axis_len = sp->inner;
    plan->run = s_run_gather_elements;
    return 0;
}

/* CumSum along one axis (X as [outer, len, inner]), in X's type, in order
 * (reverse: from the end), inclusive or exclusive. */
#define S_CUMSUM(TN, T)                                                        \
    static void                                                               \
    s_cumsum_##TN (const kiln_kshape_plan_t *sp, const T *x, T *y)            \
    {                                                                         \
        int64_t len = sp->axis_len, inner = sp->inner;                        \
        for (int64_t o = 0; o < sp->outer; o++)                               \
            for (int64_t in = 0; in < inner; in++) {                          \
                T acc = 0;                                                    \
                for (int64_t t = 0; t < len; t++) {                           \
                    int64_t j = sp->mode & 2 ? len - 1 - t : t;               \
                    int64_t e = (o * len + j) * inner + in;                   \
                    T v = x[e];                                               \
                    if (sp->mode & 1) {                                       \
                        y[e] = acc;                                           \
                        acc = (T) (acc + v);                                  \
                    } else {                                                  \
                        acc = (T) (acc + v);                                  \
                        y[e] = acc;                                           \
                    }                                                         \
                }                                                             \
            }                                                                 \
    }
S_CUMSUM (f32, float)
S_CUMSUM (f64, double)
S_CUMSUM (i32, int32_t)
S_CUMSUM (i64, int64_t)
#undef S_CUMSUM

static void
s_run_cumsum (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kshape_plan_t *sp = &plan->u.shape;
    const void *x = data[plan->in[0]];
    void *y = data[plan->out];
    switch (sp->dt) {
    case KILN_DT_FLOAT32: s_cumsum_f32 (sp, x, y); break;
    case KILN_DT_FLOAT64: s_cumsum_f64 (sp, x, y); break;
    case KILN_DT_INT32: s_cumsum_i32 (sp, x, y); break;
    default: s_cumsum_i64 (sp, x, y); break;
    }
}

static int
s_prep_cumsum (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan, kiln_err_t *err)
{
    kiln_kshape_plan_t *sp = &plan->u.shape;
    const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[0]), *y = kiln_ktensor (p, plan->out);
    int64_t axis, exclusive, reverse;
    int rc;
    if ((rc = kiln_prog_op_int (op, "axis", &axis, err))
        || (rc = kiln_prog_op_int (op, "exclusive", &exclusive, err))
        || (rc = kiln_prog_op_int (op, "reverse", &reverse, err)))
        return rc;
    int r = x->shape.rank;
    if (x->dtype != y->dtype || !kiln_shape_equal (&x->shape, &y->shape) || axis < 0
        || axis >= r)
        return kiln_error (err, KILN_EFORMAT, "Y must have X's type and shape and axis "
                           "%lld be one of X's", (long long) axis);
    if (x->dtype != KILN_DT_FLOAT32 && x->dtype != KILN_DT_FLOAT64
        && x->dtype != KILN_DT_INT32 && x->dtype != KILN_DT_INT64)
        return kiln_error (err, KILN_EFORMAT, "X is %s, expected float32, float64, int32 "
                           "or int64", kiln_dtype_name (x->dtype));
    sp->dt = x->dtype;
    sp->outer = kiln_kdims_prod (x->shape.dims, 0, (int) axis);
    sp->inner = kiln_kdims_prod (x->shape.dims, (int) axis + 1, r);
    sp->axis_len = x->shape.dims[axis];
    sp->mode = (exclusive != 0) | (reverse != 0) << 1;
    plan->run = s_run_cumsum;
    return 0;
}

/* EyeLike: a [rows, cols] matrix of the output's type, ones on diagonal
 * k (j - i = k), zeros elsewhere; the input gives only the shape. */
static void
s_run_eye (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kshape_plan_t *sp = &plan->u.shape;
    uint8_t *y = data[plan->out];
    memset (y, 0, (size_t) (sp->h * sp->w) * sp->esz);
    for (int64_t i = 0; i < sp->h; i++) {
        int64_t j = i + sp->offset;
        if (j >= 0 && j < sp->w)
            memcpy (y + (size_t) (i * sp->w + j) * sp->esz, sp->value, sp->esz);
    }
}

static int
s_prep_eye (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan, kiln_err_t *err)
{
    kiln_kshape_plan_t *sp = &plan->u.shape;
    const kiln_prog_tensor_t *y = kiln_ktensor (p, plan->out);
    int64_t k;
    int rc = kiln_prog_op_int (op, "k", &k, err);
    if (rc)
        return rc;
    if (y->shape.rank != 2 || !kiln_shape_equal (&y->shape, &kiln_ktensor (p, plan->in[0])->shape))
        return kiln_error (err, KILN_EFORMAT, "the input and the output must be matrices "
                           "of one shape");
    sp->esz = kiln_dtype_size (y->dtype);
    sp->h = y->shape.dims[0];
    sp->w = y->shape.dims[1];
    sp->offset = k < -sp->h ? -sp->h : k > sp->w ? sp->w : k;
    /* one, as an element of the output's type */
    memset (sp->value, 0, sizeof sp->value);
    switch (y->dtype) {
    case KILN_DT_FLOAT32: { float v = 1.0f; memcpy (sp->value, &v, sizeof v); break; }
    case KILN_DT_FLOAT64: { double v = 1.0; memcpy (sp->value, &v, sizeof v); break; }
    case KILN_DT_INT32: { int32_t v = 1; memcpy (sp->value, &v, sizeof v); break; }
    case KILN_DT_INT64: { int64_t v = 1; memcpy (sp->value, &v, sizeof v); break; }
    case KILN_DT_INT8: case KILN_DT_UINT8: case KILN_DT_BOOL: sp->value[0] = 1; break;
    default:
        return kiln_error (err, KILN_EFORMAT, "the output is %s, which eye does not write",
                           kiln_dtype_name (y->dtype));
    }
    plan->run = s_run_eye;
    return 0;
}

/* --- dispatch --------------------------------------------------------- */

int
kiln_kshape_prepare (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                     kiln_err_t *err)
{
    switch (plan->kernel) {
    case KILN_K_STRIDED: return s_prep_strided (p, op, plan, err);
    case KILN_K_CONCAT: return s_prep_concat (p, op, plan, err);
    case KILN_K_GATHER: return s_prep_gather (p, op, plan, err);
    case KILN_K_PAD: return s_prep_pad (p, op, plan, err);
    case KILN_K_RESIZE: return s_prep_resize (p, op, plan, err);
    case KILN_K_TRILU: return s_prep_trilu (p, op, plan, err);
    case KILN_K_GATHER_ELEMENTS: return s_prep_gather_elements (p, op, plan, err);
    case KILN_K_CUMSUM: return s_prep_cumsum (p, op, plan, err);
    case KILN_K_EYE: return s_prep_eye (p, op, plan, err);
    default:
        return kiln_error (err, KILN_EINVAL, "kernel %s is not a shape kernel",
                           kiln_kernel_name (plan->kernel));
    }
}

