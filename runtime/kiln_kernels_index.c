/*
 * kiln_kernels_index — scatter_nd, scatter_elements, gather_nd, topk
 * (see kiln_kernels_index.h).  Prepare proves every loop bound; the
 * indices, which are data, are checked one by one as they are read.
 */
#include "runtime/kiln_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/kiln_exec.h"

/* --- helpers ---------------------------------------------------------- */

static int64_t
s_index (const void *ind, bool i64, int64_t e)
{
    return i64 ? ((const int64_t *) ind)[e] : ((const int32_t *) ind)[e];
}

/* Index v of an axis of d elements, negative counting from the end, into
 * *out; false when outside -d..d-1 (a fault is recorded naming `what`). */
static bool
s_fix (int64_t v, int64_t d, int64_t e, int axis, int64_t *out)
{
    int64_t w = v < 0 ? v + d : v;
    if (w < 0 || w >= d) {
        kiln_exec_fault ("index %lld (element %lld of the indices) is outside -%lld..%lld "
                         "of axis %d", (long long) v, (long long) e, (long long) d,
                         (long long) d - 1, axis);
        return false;
    }
    *out = w;
    return true;
}

/* Row-major strides of the data's dims in elements. */
static void
s_strides (const kiln_kindex_plan_t *ip, int64_t *st)
{
    int64_t c = 1;
    for (int i = ip->rank - 1; i >= 0; i--) {
        st[i] = c;
        c *= ip->dims[i];
    }
}

/* y[0..n) op= u[0..n) in dtype dt (reduction add, mul, max or min), or a
 * copy (none). */
#define S_REDUCE(TN, T)                                                        \
    static void                                                               \
    s_reduce_##TN (int red, T *y, const T *u, int64_t n)                      \
    {                                                                         \
        for (int64_t e = 0; e < n; e++)                                       \
            switch (red) {                                                    \
            case KILN_SCATTER_ADD: y[e] = (T) (y[e] + u[e]); break;           \
            case KILN_SCATTER_MUL: y[e] = (T) (y[e] * u[e]); break;           \
            case KILN_SCATTER_MAX: y[e] = u[e] > y[e] ? u[e] : y[e]; break;   \
            default: y[e] = u[e] < y[e] ? u[e] : y[e]; break;                 \
            }                                                                 \
    }
S_REDUCE (f32, float)
S_REDUCE (f64, double)
S_REDUCE (i32, int32_t)
S_REDUCE (i64, int64_t)
#undef S_REDUCE

static void
s_apply (const kiln_kindex_plan_t *ip, uint8_t *y, const uint8_t *u, int64_t n)
{
    if (ip->reduction == KILN_SCATTER_NONE) {
        memcpy (y, u, (size_t) n * ip->esz);
        return;
    }
    switch (ip->dt) {
    case KILN_DT_FLOAT32: s_reduce_f32 (ip->reduction, (float *) y, (const float *) u, n); break;
    case KILN_DT_FLOAT64: s_reduce_f64 (ip->reduction, (double *) y, (const double *) u, n); break;
    case KILN_DT_INT32: s_reduce_i32 (ip->reduction, (int32_t *) y, (const int32_t *) u, n); break;
    default: s_reduce_i64 (ip->reduction, (int64_t *) y, (const int64_t *) u, n); break;
    }
}

/* --- scatter_nd ------------------------------------------------------- */

static void
s_run_scatter_nd (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kindex_plan_t *ip = &plan->u.index;
    const uint8_t *x = data[plan->in[0]], *u = data[plan->in[2]];
    const void *ind = data[plan->in[1]];
    uint8_t *y = data[plan->out];
    int64_t st[KILN_MAX_RANK];
    s_strides (ip, st);
    if (y != x)
        memcpy (y, x, (size_t) ip->n_data * ip->esz);
    for (int64_t t = 0; t < ip->n_idx; t++) {
        int64_t off = 0, v;
        for (int j = 0; j < ip->k; j++) {
            if (!s_fix (s_index (ind, ip->idx64, t * ip->k + j), ip->dims[j], t * ip->k + j, j,
                        &v))
                return;
            off += v * st[j];
        }
        s_apply (ip, y + (size_t) off * ip->esz, u + (size_t) (t * ip->slice) * ip->esz,
                 ip->slice);
    }
}

/* --- scatter_elements ------------------------------------------------- */

static void
s_run_scatter_elements (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kindex_plan_t *ip = &plan->u.index;
    const uint8_t *x = data[plan->in[0]], *u = data[plan->in[2]];
    const void *ind = data[plan->in[1]];
    uint8_t *y = data[plan->out];
    int64_t st[KILN_MAX_RANK], c[KILN_MAX_RANK] = { 0 };
    s_strides (ip, st);
    if (y != x)
        memcpy (y, x, (size_t) ip->n_data * ip->esz);
    for (int64_t e = 0; e < ip->n_idx; e++) {
        int64_t v, off = 0;
        if (!s_fix (s_index (ind, ip->idx64, e), ip->dims[ip->axis], e, ip->axis, &v))
            return;
        for (int i = 0; i < ip->rank; i++)
            off += (i == ip->axis ? v : c[i]) * st[i];
        s_apply (ip, y + (size_t) off * ip->esz, u + (size_t) e * ip->esz, 1);
        for (int i = ip->irank - 1; i >= 0; i--) {      /* next index element */
            if (++c[i] < ip->idims[i])
                break;
            c[i] = 0;
        }
    }
}

/* --- gather_nd -------------------------------------------------------- */

static void
s_run_gather_nd (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kindex_plan_t *ip = &plan->u.index;
    const uint8_t *x = data[plan->in[0]];
    const void *ind = data[plan->in[1]];
    uint8_t *y = data[plan->out];
    int64_t st[KILN_MAX_RANK];
    s_strides (ip, st);
    int b = ip->axis;                           /* batch_dims */
    int64_t per_batch = b > 0 ? st[b - 1] : ip->n_data;
    for (int64_t bi = 0; bi < ip->batch; bi++)
        for (int64_t t = 0; t < ip->n_idx; t++) {
            int64_t at = (bi * ip->n_idx + t) * ip->k, off = bi * per_batch, v;
            for (int j = 0; j < ip->k; j++) {
                if (!s_fix (s_index (ind, ip->idx64, at + j), ip->dims[b + j], at + j, b + j,
                            &v))
                    return;
                off += v * st[b + j];
            }
            memcpy (y + (size_t) ((bi * ip->n_idx + t) * ip->slice) * ip->esz,
                    x + (size_t) off * ip->esz, (size_t) ip->slice * ip->esz);
        }
}

/* --- topk -------------------------------------------------------------- */

typedef struct {
    const uint8_t *base;        /* the row's first element */
    int64_t stride;             /* elements between neighbours on the axis */
    kiln_dtype_t dt;
    bool largest;
} s_topk_ctx_t;

/* -1 when element i goes before element j: larger (smaller) first, NaN
 * as the largest value, equal values by lower index (ONNX). */
static int
s_topk_cmp (const void *a, const void *b, void *arg)
{
    const s_topk_ctx_t *c = arg;
    int64_t i = *(const int64_t *) a, j = *(const int64_t *) b;
    int ord = 0;                /* > 0: element i is larger */
    switch (c->dt) {
    case KILN_DT_FLOAT32:
    case KILN_DT_FLOAT64: {
        double vi = c->dt == KILN_DT_FLOAT32 ? ((const float *) c->base)[i * c->stride]
                                             : ((const double *) c->base)[i * c->stride];
        double vj = c->dt == KILN_DT_FLOAT32 ? ((const float *) c->base)[j * c->stride]
                                             : ((const double *) c->base)[j * c->stride];
        bool ni = isnan (vi), nj = isnan (vj);
        ord = ni || nj ? (int) ni - (int) nj : (vi > vj) - (vi < vj);
        break;
    }
    case KILN_DT_INT32: {
        int32_t vi = ((const int32_t *) c->base)[i * c->stride];
        int32_t vj = ((const int32_t *) c->base)[j * c->stride];
        ord = (vi > vj) - (vi < vj);
        break;
    }
    default: {
        int64_t vi = ((const int64_t *) c->base)[i * c->stride];
        int64_t vj = ((const int64_t *) c->base)[j * c->stride];
        ord = (vi > vj) - (vi < vj);
        break;
    }
    }
    if (ord != 0)
        return c->largest ? -ord : ord;
    return (i > j) - (i < j);
}

static void
s_run_topk (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kindex_plan_t *ip = &plan->u.index;
    const uint8_t *x = data[plan->in[0]];
    int64_t *y = data[plan->out];
    size_t ws_bytes;
    int64_t *order = (int64_t *) (void *) kiln_exec_ws (&ws_bytes);
    s_topk_ctx_t c = { NULL, ip->inner, ip->dt, ip->largest };
    for (int64_t o = 0; o < ip->outer; o++)
        for (int64_t in = 0; in < ip->inner; in++) {
            c.base = x + (size_t) (o * ip->len * ip->inner + in) * ip->esz;
            for (int64_t j = 0; j < ip->len; j++)
                order[j] = j;
            qsort_r (order, (size_t) ip->len, sizeof *order, s_topk_cmp, &c);
            for (int64_t t = 0; t < ip->k; t++)
                y[(o * ip->k + t) * ip->inner + in] = order[t];
        }
}

/* --- prepare ---------------------------------------------------------- */


static int
s_want_indices (const kiln_prog_tensor_t *ind, kiln_err_t *err)
{
    if (ind->dtype != KILN_DT_INT64 && ind->dtype != KILN_DT_INT32)
        return kiln_error (err, KILN_EFORMAT, "indices are %s, expected int64 or int32",
                           kiln_dtype_name (ind->dtype));
    return 0;
}

static int
s_reduction (kiln_prog_op_t *op, kiln_kindex_plan_t *ip, kiln_err_t *err)
{
    int64_t red;
    int rc = kiln_prog_op_int (op, "reduction", &red, err);
    if (rc)
        return rc;
    if (red < KILN_SCATTER_NONE || red > KILN_SCATTER_MIN)
        return kiln_error (err, KILN_EFORMAT, "reduction %lld is not 0..4", (long long) red);
    ip->reduction = (int) red;
    if (red != KILN_SCATTER_NONE && ip->dt != KILN_DT_FLOAT32 && ip->dt != KILN_DT_FLOAT64
        && ip->dt != KILN_DT_INT32 && ip->dt != KILN_DT_INT64)
        return kiln_error (err, KILN_EFORMAT, "a reduction needs float32, float64, int32 or "
                           "int64 data, not %s", kiln_dtype_name (ip->dt));
    return 0;
}

static int
s_prep_scatter (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan, bool nd,
                kiln_err_t *err)
{
    kiln_kindex_plan_t *ip = &plan->u.index;
    const kiln_prog_tensor_t *x = &p->tensors[plan->in[0]], *ind = &p->tensors[plan->in[1]];
    const kiln_prog_tensor_t *u = &p->tensors[plan->in[2]], *y = &p->tensors[plan->out];
    int rc;
    if (x->dtype != y->dtype || u->dtype != x->dtype || !kiln_shape_equal (&x->shape, &y->shape))
        return kiln_error (err, KILN_EFORMAT, "Y and updates must have data's dtype and Y "
                           "its shape");
    if ((rc = s_want_indices (ind, err)))
        return rc;
    ip->dt = x->dtype;
    ip->esz = kiln_dtype_size (x->dtype);
    ip->idx64 = ind->dtype == KILN_DT_INT64;
    ip->rank = x->shape.rank;
    memcpy (ip->dims, x->shape.dims, sizeof ip->dims);
    ip->n_data = kiln_ktensor_numel (x);
    if ((rc = s_reduction (op, ip, err)))
        return rc;
    int r = x->shape.rank, q = ind->shape.rank;
    if (nd) {
        /* updates = indices[:-1] + data[k:] */
        int64_t k = q >= 1 ? ind->shape.dims[q - 1] : -1;
        bool ok = q >= 1 && k >= 1 && k <= r && u->shape.rank == q - 1 + r - (int) k;
        for (int i = 0; ok && i < q - 1; i++)
            ok = u->shape.dims[i] == ind->shape.dims[i];
        for (int i = (int) k; ok && i < r; i++)
            ok = u->shape.dims[q - 1 + i - (int) k] == x->shape.dims[i];
        if (!ok)
            return kiln_error (err, KILN_EFORMAT, "updates must be indices' shape but the last "
                               "axis followed by data's axes from indices' last dim on "
                               "(at most data's rank, at least 1)");
        ip->k = k;
        ip->n_idx = kiln_ktensor_numel (ind) / k;
        ip->slice = 1;
        for (int i = (int) k; i < r; i++)
            ip->slice *= x->shape.dims[i];
        plan->run = s_run_scatter_nd;
        return 0;
    }
    int64_t axis;
    if ((rc = kiln_prog_op_int (op, "axis", &axis, err)))
        return rc;
    if (axis < 0 || axis >= r || q != r || !kiln_shape_equal (&ind->shape, &u->shape))
        return kiln_error (err, KILN_EFORMAT, "indices and updates must have one shape of "
                           "data's rank, and axis %lld be one of its", (long long) axis);
    for (int i = 0; i < r; i++)
        if (i != axis && ind->shape.dims[i] > x->shape.dims[i])
            return kiln_error (err, KILN_EFORMAT, "indices' axis %d is longer than data's", i);
    ip->axis = (int) axis;
    ip->irank = q;
    memcpy (ip->idims, ind->shape.dims, sizeof ip->idims);
    ip->n_idx = kiln_ktensor_numel (ind);
    plan->run = s_run_scatter_elements;
    return 0;
}

static int
s_prep_gather_nd (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan, kiln_err_t *err)
{
    kiln_kindex_plan_t *ip = &plan->u.index;
    const kiln_prog_tensor_t *x = &p->tensors[plan->in[0]], *ind = &p->tensors[plan->in[1]];
    const kiln_prog_tensor_t *y = &p->tensors[plan->out];
    int64_t bd;
    int rc;
    if ((rc = kiln_prog_op_int (op, "batch_dims", &bd, err)) || (rc = s_want_indices (ind, err)))
        return rc;
    int r = x->shape.rank, q = ind->shape.rank;
    int64_t k = q >= 1 ? ind->shape.dims[q - 1] : -1;
    bool ok = x->dtype == y->dtype && bd >= 0 && bd < q && bd < r && k >= 1 && k <= r - bd
              && y->shape.rank == q - 1 + r - (int) bd - (int) k;
    for (int i = 0; ok && i < bd; i++)
        ok = ind->shape.dims[i] == x->shape.dims[i];
    for (int i = 0; ok && i < q - 1; i++)
        ok = y->shape.dims[i] == ind->shape.dims[i];
    for (int i = (int) (bd + k); ok && i < r; i++)
        ok = y->shape.dims[q - 1 + i - (int) (bd + k)] == x->shape.dims[i];
    if (!ok)
        return kiln_error (err, KILN_EFORMAT, "Y must be indices' shape but the last axis "
                           "followed by data's axes past batch_dims + k, of data's dtype; "
                           "batch axes equal in data and indices");
    ip->dt = x->dtype;
    ip->esz = kiln_dtype_size (x->dtype);
    ip->idx64 = ind->dtype == KILN_DT_INT64;
    ip->rank = r;
    memcpy (ip->dims, x->shape.dims, sizeof ip->dims);
    ip->n_data = kiln_ktensor_numel (x);
    ip->axis = (int) bd;
    ip->k = k;
    ip->batch = 1;
    for (int i = 0; i < bd; i++)
        ip->batch *= x->shape.dims[i];
    ip->n_idx = ip->batch ? kiln_ktensor_numel (ind) / k / ip->batch : 0;
    ip->slice = 1;
    for (int i = (int) (bd + k); i < r; i++)
        ip->slice *= x->shape.dims[i];
    plan->run = s_run_gather_nd;
    return 0;
}

static int
s_prep_topk (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan, kiln_err_t *err)
{
    kiln_kindex_plan_t *ip = &plan->u.index;
    const kiln_prog_tensor_t *x = &p->tensors[plan->in[0]], *y = &p->tensors[plan->out];
    int64_t axis, k, largest;
    int rc;
    if ((rc = kiln_prog_op_int (op, "axis", &axis, err))
        || (rc = kiln_prog_op_int (op, "k", &k, err))
        || (rc = kiln_prog_op_int (op, "largest", &largest, err)))
        return rc;
    int r = x->shape.rank;
    if (axis < 0 || axis >= r || k < 0 || k > x->shape.dims[axis] || y->dtype != KILN_DT_INT64
        || y->shape.rank != r)
        return kiln_error (err, KILN_EFORMAT, "axis %lld must be one of X's, k at most its "
                           "length and Y int64 of X's rank", (long long) axis);
    for (int i = 0; i < r; i++)
        if (y->shape.dims[i] != (i == axis ? k : x->shape.dims[i]))
            return kiln_error (err, KILN_EFORMAT, "Y must be X's shape with k on the axis");
    if (x->dtype != KILN_DT_FLOAT32 && x->dtype != KILN_DT_FLOAT64 && x->dtype != KILN_DT_INT32
        && x->dtype != KILN_DT_INT64)
        return kiln_error (err, KILN_EFORMAT, "X is %s, expected float32, float64, int32 or "
                           "int64", kiln_dtype_name (x->dtype));
    ip->dt = x->dtype;
    ip->esz = kiln_dtype_size (x->dtype);
    ip->axis = (int) axis;
    ip->k = k;
    ip->len = x->shape.dims[axis];
    ip->outer = 1;
    ip->inner = 1;
    for (int i = 0; i < axis; i++)
        ip->outer *= x->shape.dims[i];
    for (int i = (int) axis + 1; i < r; i++)
        ip->inner *= x->shape.dims[i];
    ip->largest = largest != 0;
    plan->ws_bytes = (size_t) ip->len * sizeof (int64_t);
    plan->run = s_run_topk;
    return 0;
}

/* --- grid_sample -------------------------------------------------------- */

/* Grid value g in -1..1 to a pixel coordinate of an axis of n pixels,
 * with the padding mode's reflection or clamping applied.  NaN (and an
 * infinity, when reflecting) maps to -1, outside the axis: zeros, or the
 * border; values far outside are clamped to just outside, so that every
 * pixel index computed from the result fits in an int64. */
/* x (finite) reflected into lo..hi until it lands there; 0 when the
 * range is empty. */
static double
s_reflect (double x, double lo, double hi)
{
    double span = hi - lo;
    if (span <= 0)
        return 0;
    double v = fabs (x - lo);
    double flips = floor (v / span);
    double extra = v - flips * span;
    return fmod (flips, 2) == 0 ? lo + extra : hi - extra;
}

static double
s_grid_coord (const kiln_kindex_plan_t *ip, double g, int64_t n)
{
    double x = ip->galign ? (g + 1) / 2 * (double) (n - 1) : ((g + 1) * (double) n - 1) / 2;
    if (x != x || (ip->gpad == 2 && !isfinite (x)))
        x = -1;
    if (ip->gpad != 2)
        x = x < -2 ? -2 : x > (double) n + 1 ? (double) n + 1 : x;
    if (ip->gpad == 2)                          /* reflection */
        x = s_reflect (x, ip->galign ? 0 : -0.5, ip->galign ? (double) (n - 1) : n - 0.5);
    if (ip->gpad >= 1)                          /* border, and reflection's ends */
        x = x < 0 ? 0 : x > (double) (n - 1) ? (double) (n - 1) : x;
    return x;
}

/* X's pixel (i, j) of one plane, 0 outside it. */
static float
s_pixel (const float *plane, int64_t h, int64_t w, int64_t i, int64_t j)
{
    return i >= 0 && i < h && j >= 0 && j < w ? plane[i * w + j] : 0.0f;
}

/* Bicubic, as ONNX (and ONNX Runtime) do it: the grid value g to a pixel
 * coordinate; one outside the sampled range (-0.5..n-0.5, or 0..n-1
 * with align_corners) is clamped to the pixels (border) or reflected
 * into the range (reflection), each axis on its own; with zeros padding
 * it stays, clamped to where all four taps are outside anyway.  NaN and
 * infinities map to -1 as in s_grid_coord. */
static double
s_cubic_coord (const kiln_kindex_plan_t *ip, double g, int64_t n)
{
    double x = ip->galign ? (g + 1) / 2 * (double) (n - 1) : ((g + 1) * (double) n - 1) / 2;
    double lo = ip->galign ? 0 : -0.5, hi = ip->galign ? (double) (n - 1) : n - 0.5;
    if (!isfinite (x))
        x = -1;
    if (x < lo || x > hi) {
        if (ip->gpad == 1)
            x = x < 0 ? 0 : x > (double) (n - 1) ? (double) (n - 1) : x;
        else if (ip->gpad == 2)
            x = s_reflect (x, lo, hi);
    }
    return x < -3 ? -3 : x > (double) n + 2 ? (double) n + 2 : x;
}

/* Tap i (an integer, |i| <= n + 4) of an axis of n pixels under the
 * padding mode: -1 (zero) when outside with zeros padding. */
static int64_t
s_cubic_tap (const kiln_kindex_plan_t *ip, int64_t i, int64_t n)
{
    if (i >= 0 && i < n)
        return i;
    if (ip->gpad == 0)
        return -1;
    if (ip->gpad == 2)
        i = (int64_t) s_reflect ((double) i, ip->galign ? 0 : -0.5,
                                 ip->galign ? (double) (n - 1) : n - 0.5);
    return i < 0 ? 0 : i > n - 1 ? n - 1 : i;
}

/* The cubic convolution weights (Keys, a = -0.75) of the four taps
 * around a point t (0..1) past the second. */
static void
s_cubic_coeffs (double t, double c[4])
{
    const double a = -0.75;
    double t1 = t + 1, t2 = 1 - t, t3 = 2 - t;
    c[0] = ((a * t1 - 5 * a) * t1 + 8 * a) * t1 - 4 * a;
    c[1] = ((a + 2) * t - (a + 3)) * t * t + 1;
    c[2] = ((a + 2) * t2 - (a + 3)) * t2 * t2 + 1;
    c[3] = ((a * t3 - 5 * a) * t3 + 8 * a) * t3 - 4 * a;
}

static float
s_bicubic (const kiln_kindex_plan_t *ip, const float *plane, double gx, double gy)
{
    int64_t h = ip->gh, w = ip->gw, j0 = (int64_t) floor (gx) - 1, i0 = (int64_t) floor (gy) - 1;
    double cx[4], cy[4], v = 0;
    s_cubic_coeffs (gx - floor (gx), cx);
    s_cubic_coeffs (gy - floor (gy), cy);
    for (int a = 0; a < 4; a++) {
        int64_t i = s_cubic_tap (ip, i0 + a, h);
        double row = 0;
        for (int b = 0; b < 4; b++) {
            int64_t j = s_cubic_tap (ip, j0 + b, w);
            row += cx[b] * (i < 0 || j < 0 ? 0.0 : (double) plane[i * w + j]);
        }
        v += cy[a] * row;
    }
    return (float) v;
}

static void
s_run_grid_sample (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kindex_plan_t *ip = &plan->u.index;
    const float *x = data[plan->in[0]], *grid = data[plan->in[1]];
    float *y = data[plan->out];
    int64_t h = ip->gh, w = ip->gw, oh = ip->goh, ow = ip->gow;
    for (int64_t n = 0; n < ip->gn; n++)
        for (int64_t p = 0; p < oh * ow; p++) {
            const float *g = grid + (n * oh * ow + p) * 2;
            bool cubic = ip->gmode == 2;
            double gx = cubic ? s_cubic_coord (ip, g[0], w) : s_grid_coord (ip, g[0], w);
            double gy = cubic ? s_cubic_coord (ip, g[1], h) : s_grid_coord (ip, g[1], h);
            for (int64_t c = 0; c < ip->gc; c++) {
                const float *plane = x + (n * ip->gc + c) * h * w;
                float v;
                if (cubic)
                    v = s_bicubic (ip, plane, gx, gy);
                else if (ip->gmode == 1)
                    v = s_pixel (plane, h, w, (int64_t) nearbyint (gy), (int64_t) nearbyint (gx));
                else {
                    double fx = floor (gx), fy = floor (gy), ax = gx - fx, ay = gy - fy;
                    int64_t j = (int64_t) fx, i = (int64_t) fy;
                    v = (float) ((1 - ay) * ((1 - ax) * s_pixel (plane, h, w, i, j)
                                             + ax * s_pixel (plane, h, w, i, j + 1))
                                 + ay * ((1 - ax) * s_pixel (plane, h, w, i + 1, j)
                                         + ax * s_pixel (plane, h, w, i + 1, j + 1)));
                }
                y[(n * ip->gc + c) * oh * ow + p] = v;
            }
        }
}

static int
s_prep_grid_sample (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                    kiln_err_t *err)
{
    kiln_kindex_plan_t *ip = &plan->u.index;
    const kiln_prog_tensor_t *x = &p->tensors[plan->in[0]], *g = &p->tensors[plan->in[1]];
    const kiln_prog_tensor_t *y = &p->tensors[plan->out];
    int64_t mode, pad, align;
    int rc;
    if ((rc = kiln_prog_op_int (op, "mode", &mode, err))
        || (rc = kiln_prog_op_int (op, "padding_mode", &pad, err))
        || (rc = kiln_prog_op_int (op, "align_corners", &align, err)))
        return rc;
    if (mode < 0 || mode > 2 || pad < 0 || pad > 2)
        return kiln_error (err, KILN_EFORMAT, "mode must be 0..2 and padding_mode 0..2");
    if (x->dtype != KILN_DT_FLOAT32 || g->dtype != KILN_DT_FLOAT32 || y->dtype != KILN_DT_FLOAT32
        || x->shape.rank != 4 || g->shape.rank != 4 || y->shape.rank != 4
        || g->shape.dims[0] != x->shape.dims[0] || g->shape.dims[3] != 2
        || y->shape.dims[0] != x->shape.dims[0] || y->shape.dims[1] != x->shape.dims[1]
        || y->shape.dims[2] != g->shape.dims[1] || y->shape.dims[3] != g->shape.dims[2])
        return kiln_error (err, KILN_EFORMAT, "X [N, C, H, W], grid [N, oh, ow, 2] and Y "
                           "[N, C, oh, ow] must be float32");
    ip->gn = x->shape.dims[0];
    ip->gc = x->shape.dims[1];
    ip->gh = x->shape.dims[2];
    ip->gw = x->shape.dims[3];
    ip->goh = g->shape.dims[1];
    ip->gow = g->shape.dims[2];
    ip->gmode = (int) mode;
    ip->gpad = (int) pad;
    ip->galign = align != 0;
    plan->run = s_run_grid_sample;
    return 0;
}

int
kiln_kindex_prepare (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                     kiln_err_t *err)
{
    switch (plan->kernel) {
    case KILN_K_SCATTER_ND: return s_prep_scatter (p, op, plan, true, err);
    case KILN_K_SCATTER_ELEMENTS: return s_prep_scatter (p, op, plan, false, err);
    case KILN_K_GATHER_ND: return s_prep_gather_nd (p, op, plan, err);
    case KILN_K_TOPK: return s_prep_topk (p, op, plan, err);
    case KILN_K_GRID_SAMPLE: return s_prep_grid_sample (p, op, plan, err);
    default:
        return kiln_error (err, KILN_EINVAL, "kernel %s is not an index kernel",
                           kiln_kernel_name (plan->kernel));
    }
}
