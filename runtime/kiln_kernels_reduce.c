/*
 * kiln_kernels_reduce — the math kernels that reduce along axes: the
 * reductions (one per KILN_REDUCE_OPS row, common/kiln_ops_reduce.h, and
 * ReduceLogSumExp), ArgMax/ArgMin, Softmax/LogSoftmax, Hardmax and
 * NegativeLogLikelihoodLoss, for the dtypes of kiln_kernels_math.h.
 * kiln_kmath_prepare (kiln_kernels_math.c) calls their prepare steps.
 */
#include "runtime/kiln_kernels_math_priv.h"
#include "runtime/kiln_vmath.h"

#include <stdio.h>
#include <string.h>
#include <tgmath.h>

/* --- reductions ------------------------------------------------------ */

/* Each reduction is an accumulator (type AC: double for floats, int64 for
 * integers) with INIT, STEP and FINI (which gets the element count).
 * The reduced axes are either one block of X, seen as [pre, len, post]
 * (summed a row at a time when post > 1, 64 columns at once so that the
 * loads are contiguous), or spread out, walked element by element. */
#define S_R_CHUNK 64

#define S_REDUCE(OP, TN, T, AC)                                               \
    static void                                                               \
    s_red_##OP##_##TN (const kiln_kmath_plan_t *mp, const void *x_, void *y_) \
    {                                                                         \
        const T *x = x_;                                                      \
        T *y = y_;                                                            \
        if (mp->block && mp->post == 1) {                                     \
            for (int64_t o = 0; o < mp->pre; o++) {                           \
                const T *xp = x + o * mp->len;                                \
                AC acc = s_ri_##OP##_##TN ();                                 \
                for (int64_t r = 0; r < mp->len; r++)                         \
                    acc = s_rs_##OP##_##TN (acc, xp[r]);                      \
                y[o] = s_rf_##OP##_##TN (acc, mp->len);                       \
            }                                                                 \
        } else if (mp->block) {                                               \
            AC acc[S_R_CHUNK];                                                \
            for (int64_t o = 0; o < mp->pre; o++)                             \
                for (int64_t c0 = 0; c0 < mp->post; c0 += S_R_CHUNK) {        \
                    int64_t w = mp->post - c0 < S_R_CHUNK ? mp->post - c0     \
                                                          : S_R_CHUNK;        \
                    for (int64_t i = 0; i < w; i++)                           \
                        acc[i] = s_ri_##OP##_##TN ();                         \
                    for (int64_t r = 0; r < mp->len; r++) {                   \
                        const T *xr = x + (o * mp->len + r) * mp->post + c0;  \
                        for (int64_t i = 0; i < w; i++)                       \
                            acc[i] = s_rs_##OP##_##TN (acc[i], xr[i]);        \
                    }                                                         \
                    for (int64_t i = 0; i < w; i++)                           \
                        y[o * mp->post + c0 + i]                              \
                            = s_rf_##OP##_##TN (acc[i], mp->len);             \
                }                                                             \
        } else {                                                              \
            int64_t nout = kiln_kdims_prod (mp->kd, 0, mp->nk);               \
            int64_t cnt = kiln_kdims_prod (mp->rd, 0, mp->nr);                \
            int64_t kidx[KILN_MAX_RANK] = { 0 }, base = 0;                    \
            for (int64_t o = 0; o < nout; o++) {                              \
                AC acc = s_ri_##OP##_##TN ();                                 \
                int64_t ridx[KILN_MAX_RANK] = { 0 }, off = 0;                 \
                for (int64_t e = 0; e < cnt; e++) {                           \
                    acc = s_rs_##OP##_##TN (acc, x[base + off]);              \
                    for (int i = mp->nr - 1; i >= 0; i--) {                   \
                        off += mp->rs[i];                                     \
                        if (++ridx[i] < mp->rd[i])                            \
                            break;                                            \
                        off -= mp->rs[i] * mp->rd[i];                         \
                        ridx[i] = 0;                                          \
                    }                                                         \
                }                                                             \
                y[o] = s_rf_##OP##_##TN (acc, cnt);                           \
                for (int i = mp->nk - 1; i >= 0; i--) {                       \
                    base += mp->ks[i];                                        \
                    if (++kidx[i] < mp->kd[i])                                \
                        break;                                                \
                    base -= mp->ks[i] * mp->kd[i];                            \
                    kidx[i] = 0;                                              \
                }                                                             \
            }                                                                 \
        }                                                                     \
    }

/* An accumulator's init, step and result (the row's expressions). */
#define S_RFNS(id, TN, T_, AC_, init, step, fini)                             \
    static inline AC_                                                         \
    s_ri_##id##_##TN (void)                                                   \
    {                                                                         \
        typedef AC_ AC __attribute__ ((unused));                              \
        return (AC_) (init);                                                  \
    }                                                                         \
    static inline AC_                                                         \
    s_rs_##id##_##TN (AC_ acc, T_ v)                                          \
    {                                                                         \
        typedef AC_ AC __attribute__ ((unused));                              \
        step;                                                                 \
        return acc;                                                           \
    }                                                                         \
    static inline T_                                                          \
    s_rf_##id##_##TN (AC_ acc, int64_t n)                                     \
    {                                                                         \
        typedef T_ T __attribute__ ((unused));                                \
        typedef AC_ AC __attribute__ ((unused));                              \
        (void) n;                                                             \
        return fini;                                                          \
    }

/* The rows of KILN_REDUCE_OPS (common/kiln_ops_reduce.h): float32 and
 * float64 loops (double accumulator), int32 and int64 ones (int64) when
 * the row has them, and their table. */
#define S_RROW(X_, id, name, onnx, ex, i0, s0, f0, ints, i1, s1, f1)          \
    S_RFNS (id, f32, float, double, i0, s0, f0)                               \
    S_RFNS (id, f64, double, double, i0, s0, f0)                              \
    S_REDUCE (id, f32, float, double)                                         \
    S_REDUCE (id, f64, double, double)                                        \
    S_RROW_INTS_##ints (id, i1, s1, f1)                                       \
    const kiln_km_tab_t kiln_km_tab_r_##id = {                                \
        [KILN_KM_F32] = (kiln_km_fn_t) s_red_##id##_f32, [KILN_KM_F64] = (kiln_km_fn_t) s_red_##id##_f64, \
        S_RTAB_INTS_##ints (id) };
#define S_RROW_INTS_0(id, i1, s1, f1)
#define S_RROW_INTS_1(id, i1, s1, f1)                                         \
    S_RFNS (id, i32, int32_t, int64_t, i1, s1, f1)                            \
    S_RFNS (id, i64, int64_t, int64_t, i1, s1, f1)                            \
    S_REDUCE (id, i32, int32_t, int64_t)                                      \
    S_REDUCE (id, i64, int64_t, int64_t)
#define S_RTAB_INTS_0(id)
#define S_RTAB_INTS_1(id)                                                     \
    [KILN_KM_I32] = (kiln_km_fn_t) s_red_##id##_i32, [KILN_KM_I64] = (kiln_km_fn_t) s_red_##id##_i64
KILN_REDUCE_OPS (S_RROW, _)
#undef S_RROW

/* log(sum(exp(x))) = m + log(sum(exp(x - m))) with m the maximum, so
 * that large values do not overflow; infinities and NaN give m itself. */
#define S_LSE(TN, T)                                                          \
    static void                                                               \
    s_red_lse_##TN (const kiln_kmath_plan_t *mp, const void *x_, void *y_)    \
    {                                                                         \
        const T *x = x_;                                                      \
        T *y = y_;                                                            \
        int64_t nout = kiln_kdims_prod (mp->kd, 0, mp->nk);                   \
        int64_t cnt = kiln_kdims_prod (mp->rd, 0, mp->nr);                    \
        int64_t kidx[KILN_MAX_RANK] = { 0 }, base = 0;                        \
        for (int64_t o = 0; o < nout; o++) {                                  \
            for (int pass = 0; pass < 2; pass++) {                            \
                double m = -INFINITY, s = 0;                                  \
                if (pass == 1)                                                \
                    m = (double) y[o];                                        \
                int64_t ridx[KILN_MAX_RANK] = { 0 }, off = 0;                 \
                for (int64_t e = 0; e < cnt; e++) {                           \
                    double v = (double) x[base + off];                        \
                    if (pass == 0 && (v > m || v != v))                       \
                        m = v;                                                \
                    else if (pass == 1)                                       \
                        s += exp (v - m);                                     \
                    for (int i = mp->nr - 1; i >= 0; i--) {                   \
                        off += mp->rs[i];                                     \
                        if (++ridx[i] < mp->rd[i])                            \
                            break;                                            \
                        off -= mp->rs[i] * mp->rd[i];                         \
                        ridx[i] = 0;                                          \
                    }                                                         \
                    if (pass == 0 && m != m)                                  \
                        break;                                                \
                }                                                             \
                if (pass == 0)                                                \
                    y[o] = (T) m;                                             \
                else if (isfinite (m))                                        \
                    y[o] = (T) (m + log (s));                                 \
            }                                                                 \
            for (int i = mp->nk - 1; i >= 0; i--) {                           \
                base += mp->ks[i];                                            \
                if (++kidx[i] < mp->kd[i])                                    \
                    break;                                                    \
                base -= mp->ks[i] * mp->kd[i];                                \
                kidx[i] = 0;                                                  \
            }                                                                 \
        }                                                                     \
    }
S_LSE (f32, float)
S_LSE (f64, double)
const kiln_km_tab_t kiln_km_tab_rlse = { [KILN_KM_F32] = (kiln_km_fn_t) s_red_lse_f32,
                                    [KILN_KM_F64] = (kiln_km_fn_t) s_red_lse_f64 };

void
kiln_km_run_reduce (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kmath_plan_t *mp = &plan->u.math;
    ((kiln_km_reduce_fn) mp->fn) (mp, data[plan->in[0]], data[plan->out]);
}

/* --- ArgMax, ArgMin -------------------------------------------------- */

static inline bool
s_isnan (double v)
{
    return v != v;
}

/* Index of the largest (smallest) element along the axis, as numpy: the
 * first one, or the last with select_last_index; a NaN beats any number. */
#define S_ARG(TN, T)                                                          \
    static void                                                               \
    s_arg_##TN (const kiln_kmath_plan_t *mp, const void *x_, void *y_)        \
    {                                                                         \
        const T *x = x_;                                                      \
        int64_t *y = y_;                                                      \
        bool want_max = mp->f[0] > 0, last = mp->i0 != 0;                     \
        for (int64_t o = 0; o < mp->pre; o++)                                 \
            for (int64_t c = 0; c < mp->post; c++) {                          \
                const T *xp = x + o * mp->len * mp->post + c;                 \
                T best = xp[0];                                               \
                int64_t at = 0;                                               \
                for (int64_t r = 1; r < mp->len; r++) {                       \
                    T v = xp[r * mp->post];                                   \
                    bool take;                                                \
                    if (s_isnan ((double) best))                              \
                        take = last && s_isnan ((double) v);                  \
                    else if (s_isnan ((double) v))                            \
                        take = true;                                          \
                    else if (want_max)                                        \
                        take = last ? v >= best : v > best;                   \
                    else                                                      \
                        take = last ? v <= best : v < best;                   \
                    if (take) {                                               \
                        best = v;                                             \
                        at = r;                                               \
                    }                                                         \
                }                                                             \
                y[o * mp->post + c] = at;                                     \
            }                                                                 \
    }
S_ARG (f32, float)
S_ARG (f64, double)
S_ARG (i8, int8_t)
S_ARG (u8, uint8_t)
S_ARG (i32, int32_t)
S_ARG (i64, int64_t)
static const kiln_km_tab_t s_tab_arg = {
    [KILN_KM_F32] = (kiln_km_fn_t) s_arg_f32, [KILN_KM_F64] = (kiln_km_fn_t) s_arg_f64,
    [KILN_KM_I8] = (kiln_km_fn_t) s_arg_i8, [KILN_KM_U8] = (kiln_km_fn_t) s_arg_u8,
    [KILN_KM_I32] = (kiln_km_fn_t) s_arg_i32, [KILN_KM_I64] = (kiln_km_fn_t) s_arg_i64,
};

/* --- Softmax, LogSoftmax --------------------------------------------- */

/* Over `len` elements `post` apart, for each of pre * post positions:
 * exp(x - max) / sum, or x - max - log(sum); sums in double. */
#define S_SOFTMAX(TN, T)                                                      \
    static void                                                               \
    s_softmax_##TN (const kiln_kmath_plan_t *mp, const void *x_, void *y_)    \
    {                                                                         \
        const T *x = x_;                                                      \
        T *y = y_;                                                            \
        bool log_form = mp->i0 != 0;                                          \
        int64_t len = mp->len, post = mp->post;                               \
        if (len == 0)                                                         \
            return;                                                           \
        for (int64_t o = 0; o < mp->pre; o++)                                 \
            for (int64_t c = 0; c < post; c++) {                              \
                const T *xp = x + o * len * post + c;                         \
                T *yp = y + o * len * post + c;                               \
                T m = xp[0];                                                  \
                for (int64_t r = 1; r < len; r++)                             \
                    if (xp[r * post] > m || xp[r * post] != xp[r * post])     \
                        m = xp[r * post];                                     \
                double s = 0;                                                 \
                if (log_form) {                                               \
                    for (int64_t r = 0; r < len; r++)                         \
                        s += (double) exp (xp[r * post] - m);                 \
                    T ls = (T) log (s);                                       \
                    for (int64_t r = 0; r < len; r++)                         \
                        yp[r * post] = xp[r * post] - m - ls;                 \
                    continue;                                                 \
                }                                                             \
                /* each exponential once: kept in y, then scaled */           \
                for (int64_t r = 0; r < len; r++) {                           \
                    T e = exp (xp[r * post] - m);                             \
                    yp[r * post] = e;                                         \
                    s += (double) e;                                          \
                }                                                             \
                double inv = 1.0 / s;                                         \
                for (int64_t r = 0; r < len; r++)                             \
                    yp[r * post] = (T) ((double) yp[r * post] * inv);         \
            }                                                                 \
    }
S_SOFTMAX (f32_any, float)
S_SOFTMAX (f64, double)

typedef struct {
    const kiln_kmath_plan_t *mp;
    const float *x;
    float *y;
} s_rows_t;

static void
s_softmax_rows (void *arg, int64_t first, int64_t count)
{
    const s_rows_t *r = arg;
    int64_t len = r->mp->len;
    for (int64_t o = first; o < first + count; o++)
        kiln_vsoftmax_row (r->x + o * len, r->y + o * len, len, r->mp->i0 != 0);
}

/* float32 rows that are contiguous: the vectorised row (kiln_vmath.h),
 * rows spread over the pool (attention's 12 × 197 rows of 197). */
static void
s_softmax_f32 (const kiln_kmath_plan_t *mp, const void *x_, void *y_)
{
    if (mp->post != 1) {
        s_softmax_f32_any (mp, x_, y_);
        return;
    }
    s_rows_t r = { mp, x_, y_ };
    kiln_krows_run (s_softmax_rows, &r, mp->pre, 4096 / (mp->len + 1) + 1);
}
static const kiln_km_tab_t s_tab_softmax = { [KILN_KM_F32] = (kiln_km_fn_t) s_softmax_f32,
                                       [KILN_KM_F64] = (kiln_km_fn_t) s_softmax_f64 };

/* X viewed around axes (sorted, unique): kept and reduced dims with their
 * strides, merged where neighbours are both kept or both reduced, and
 * [pre, len, post] when the reduced ones are one block. */
static void
s_plan_axes (const kiln_prog_tensor_t *x, const bool *red, kiln_kmath_plan_t *mp)
{
    int r = x->shape.rank;
    int64_t st[KILN_MAX_RANK], c = 1;
    for (int i = r - 1; i >= 0; i--) {
        st[i] = c;
        c *= x->shape.dims[i];
    }
    mp->nk = mp->nr = 0;
    int last = -1;          /* 0 kept, 1 reduced: the kind of the last dim kept */
    int groups = 0;
    for (int i = 0; i < r; i++) {
        int64_t d = x->shape.dims[i];
        if (d == 1)
            continue;       /* a unit dim is the same kept or reduced */
        int kind = red[i] ? 1 : 0;
        int64_t *dd = kind ? mp->rd : mp->kd, *ss = kind ? mp->rs : mp->ks;
        int *nn = kind ? &mp->nr : &mp->nk;
        if (kind == last) {
            dd[*nn - 1] *= d;
            ss[*nn - 1] = st[i];
        } else {
            dd[*nn] = d;
            ss[*nn] = st[i];
            (*nn)++;
            if (kind)
                groups++;
        }
        last = kind;
    }
    mp->block = groups <= 1;
    mp->pre = 1;
    mp->len = 1;
    mp->post = 1;
    if (mp->block) {
        /* kept dims before the block, the block, kept dims after it */
        bool after = false;
        for (int i = 0; i < r; i++) {
            int64_t d = x->shape.dims[i];
            if (d == 1)
                continue;
            if (red[i]) {
                mp->len *= d;
                after = true;
            } else if (after)
                mp->post *= d;
            else
                mp->pre *= d;
        }
    }
}

/* Reductions: parameter axes (ascending, unique, each < rank; empty means
 * none: every output element reduces one input element). */
int
kiln_km_prep_reduce (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
               const kiln_km_tab_t tab, kiln_err_t *err)
{
    kiln_kmath_plan_t *mp = &plan->u.math;
    const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[0]);
    int64_t axes[KILN_PROG_MAX_PARAM_INTS];
    int na, rc;
    if ((rc = kiln_km_pick (tab, x->dtype, "input 0", mp, err))
        || (rc = kiln_km_need_dtype (p, plan->out, x->dtype, "the output", err))
        || (rc = kiln_prog_op_ints_any (op, "axes", axes, &na, err)))
        return rc;
    bool red[KILN_MAX_RANK] = { false };
    for (int i = 0; i < na; i++) {
        if (axes[i] < 0 || axes[i] >= x->shape.rank || (i > 0 && axes[i] <= axes[i - 1]))
            return kiln_error (err, KILN_EFORMAT, "parameter 'axes' must be "
                               "ascending axes of the rank-%d input",
                               x->shape.rank);
        red[axes[i]] = true;
    }
    int64_t kept = 1;
    for (int i = 0; i < x->shape.rank; i++)
        if (!red[i])
            kept *= x->shape.dims[i];
    if ((rc = kiln_kneed_numel (p, plan->out, kept, "the output", err)))
        return rc;
    s_plan_axes (x, red, mp);
    if (plan->kernel == KILN_K_REDUCE_LOG_SUM_EXP)
        mp->block = false;      /* its loop walks kept and reduced dims */
    plan->run = kiln_km_run_reduce;
    return 0;
}

/* X as [pre, len, post] around axis `axis` (or, with `flatten`, around
 * every axis from `axis` on, post = 1). */
int
kiln_km_plan_axis (const kiln_prog_tensor_t *x, int64_t axis, bool flatten,
             kiln_kmath_plan_t *mp, kiln_err_t *err)
{
    int r = x->shape.rank;
    if (axis < 0 || axis >= (r > 0 ? r : 1) || (r == 0 && !flatten))
        return kiln_error (err, KILN_EFORMAT, "parameter 'axis' is %lld, "
                           "outside the rank-%d input", (long long) axis, r);
    mp->pre = kiln_kdims_prod (x->shape.dims, 0, (int) axis);
    if (flatten) {
        mp->len = kiln_kdims_prod (x->shape.dims, (int) axis, r);
        mp->post = 1;
    } else {
        mp->len = x->shape.dims[axis];
        mp->post = kiln_kdims_prod (x->shape.dims, (int) axis + 1, r);
    }
    return 0;
}

int
kiln_km_prep_arg (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
            kiln_err_t *err)
{
    kiln_kmath_plan_t *mp = &plan->u.math;
    const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[0]);
    int64_t axis, last;
    int rc;
    if ((rc = kiln_km_pick (s_tab_arg, x->dtype, "input 0", mp, err))
        || (rc = kiln_km_need_dtype (p, plan->out, KILN_DT_INT64, "the output", err))
        || (rc = kiln_prog_op_int (op, "axis", &axis, err))
        || (rc = kiln_prog_op_int (op, "select_last", &last, err))
        || (rc = kiln_km_plan_axis (x, axis, false, mp, err)))
        return rc;
    if (last != 0 && last != 1)
        return kiln_error (err, KILN_EFORMAT, "parameter 'select_last' is "
                           "%lld, expected 0 or 1", (long long) last);
    if (mp->len == 0)
        return kiln_error (err, KILN_EFORMAT, "axis %lld is empty",
                           (long long) axis);
    if ((rc = kiln_kneed_numel (p, plan->out, mp->pre * mp->post, "the output", err)))
        return rc;
    mp->i0 = last;
    mp->f[0] = plan->kernel == KILN_K_ARGMAX ? 1 : -1;
    plan->run = kiln_km_run_reduce;
    return 0;
}

int
kiln_km_prep_softmax (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                kiln_err_t *err)
{
    kiln_kmath_plan_t *mp = &plan->u.math;
    const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[0]);
    int64_t axis, flatten;
    int rc;
    if ((rc = kiln_km_pick (s_tab_softmax, x->dtype, "input 0", mp, err))
        || (rc = kiln_km_need_dtype (p, plan->out, x->dtype, "the output", err))
        || (rc = kiln_kneed_numel (p, plan->out, kiln_ktensor_numel (x), "the output", err))
        || (rc = kiln_prog_op_int (op, "axis", &axis, err))
        || (rc = kiln_prog_op_int (op, "flatten", &flatten, err)))
        return rc;
    if (flatten != 0 && flatten != 1)
        return kiln_error (err, KILN_EFORMAT, "parameter 'flatten' is %lld, "
                           "expected 0 or 1", (long long) flatten);
    if ((rc = kiln_km_plan_axis (x, axis, flatten != 0, mp, err)))
        return rc;
    mp->i0 = plan->kernel == KILN_K_LOG_SOFTMAX;
    plan->run = kiln_km_run_reduce;
    return 0;
}

/* --- hardmax, is_inf -------------------------------------------------------- */

/* Hardmax: 1 at the first largest element along the axis (X as [pre,
 * len, post]), 0 elsewhere; a NaN counts as larger than everything. */
#define S_HARDMAX(TN, T)                                                      \
    static void                                                               \
    s_hardmax_##TN (const kiln_kmath_plan_t *mp, const T *x, T *y)            \
    {                                                                         \
        int64_t len = mp->len, post = mp->post;                               \
        for (int64_t a = 0; a < mp->pre; a++)                                 \
            for (int64_t b = 0; b < post; b++) {                              \
                const T *xr = x + a * len * post + b;                         \
                T *yr = y + a * len * post + b;                               \
                int64_t best = 0;                                             \
                for (int64_t i = 0; i < len; i++) {                           \
                    yr[i * post] = 0;                                         \
                    if (xr[best * post] != xr[best * post])                   \
                        continue;                                             \
                    if (xr[i * post] > xr[best * post] || xr[i * post] != xr[i * post]) \
                        best = i;                                             \
                }                                                             \
                if (len > 0)                                                  \
                    yr[best * post] = 1;                                      \
            }                                                                 \
    }
S_HARDMAX (f32, float)
S_HARDMAX (f64, double)
#undef S_HARDMAX

static void
s_run_hardmax (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kmath_plan_t *mp = &plan->u.math;
    if (mp->dt == KILN_DT_FLOAT64)
        s_hardmax_f64 (mp, data[plan->in[0]], data[plan->out]);
    else
        s_hardmax_f32 (mp, data[plan->in[0]], data[plan->out]);
}

int
kiln_km_prep_hardmax (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan, kiln_err_t *err)
{
    kiln_kmath_plan_t *mp = &plan->u.math;
    const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[0]);
    int64_t axis, flatten;
    int rc;
    if (x->dtype != KILN_DT_FLOAT32 && x->dtype != KILN_DT_FLOAT64)
        return kiln_error (err, KILN_EFORMAT, "input 0 is %s, expected float32 or float64",
                           kiln_dtype_name (x->dtype));
    if ((rc = kiln_km_need_dtype (p, plan->out, x->dtype, "the output", err))
        || (rc = kiln_kneed_numel (p, plan->out, kiln_ktensor_numel (x), "the output", err))
        || (rc = kiln_prog_op_int (op, "axis", &axis, err))
        || (rc = kiln_prog_op_int (op, "flatten", &flatten, err))
        || (rc = kiln_km_plan_axis (x, axis, flatten != 0, mp, err)))
        return rc;
    mp->dt = x->dtype;
    plan->run = s_run_hardmax;
    return 0;
}

/* --- nll_loss ------------------------------------------------------------ */

/* NegativeLogLikelihoodLoss over X [N, C, D...] (as [N, C, D]) and the
 * class of each (n, d) in T: -X[n, t, d] · w[t] (w 1 without a weight),
 * 0 with weight 0 where t is the ignored index; none keeps them, sum adds
 * them (in double, in order), mean divides that by the weights' sum.  A
 * class outside 0..C-1 gives NaN (ONNX leaves it undefined). */
#define S_NLL(TN, T)                                                          \
    static void                                                               \
    s_nll_##TN (const kiln_kmath_plan_t *mp, const T *x, const void *tg,      \
                const T *w, T *y)                                             \
    {                                                                         \
        int64_t nn = mp->pre, c = mp->len, d = mp->post;                      \
        double sum = 0, wsum = 0;                                             \
        for (int64_t n = 0; n < nn; n++)                                      \
            for (int64_t j = 0; j < d; j++) {                                 \
                int64_t e = n * d + j;                                        \
                int64_t t = mp->dt2 == KILN_DT_INT64 ? ((const int64_t *) tg)[e] \
                                                     : ((const int32_t *) tg)[e]; \
                T l, wt;                                                      \
                if (mp->has_lo && t == mp->i0) {                              \
                    l = 0;                                                    \
                    wt = 0;                                                   \
                } else if (t < 0 || t >= c) {                                 \
                    l = (T) NAN;                                              \
                    wt = (T) NAN;                                             \
                } else {                                                      \
                    wt = w ? w[t] : (T) 1;                                    \
                    l = -x[(n * c + t) * d + j] * wt;                         \
                }                                                             \
                if (mp->has_hi == 0)                                          \
                    y[e] = l;                                                 \
                sum += l;                                                     \
                wsum += wt;                                                   \
            }                                                                 \
        if (mp->has_hi == 1)                                                  \
            y[0] = (T) sum;                                                   \
        else if (mp->has_hi == 2)                                             \
            y[0] = (T) (sum / wsum);                                          \
    }
S_NLL (f32, float)
S_NLL (f64, double)
#undef S_NLL

static void
s_run_nll (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kmath_plan_t *mp = &plan->u.math;
    const void *w = plan->n_in > 2 ? data[plan->in[2]] : NULL;
    if (mp->dt == KILN_DT_FLOAT64)
        s_nll_f64 (mp, data[plan->in[0]], data[plan->in[1]], w, data[plan->out]);
    else
        s_nll_f32 (mp, data[plan->in[0]], data[plan->in[1]], w, data[plan->out]);
}

int
kiln_km_prep_nll (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan, kiln_err_t *err)
{
    kiln_kmath_plan_t *mp = &plan->u.math;
    const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[0]), *tg = kiln_ktensor (p, plan->in[1]);
    int64_t reduction, has_ignore, ignore;
    int rc;
    if ((rc = kiln_prog_op_int (op, "reduction", &reduction, err))
        || (rc = kiln_prog_op_int (op, "has_ignore", &has_ignore, err))
        || (rc = kiln_prog_op_int (op, "ignore_index", &ignore, err)))
        return rc;
    if (reduction < 0 || reduction > 2)
        return kiln_error (err, KILN_EFORMAT, "reduction %lld is not 0 (none), 1 (sum) "
                           "or 2 (mean)", (long long) reduction);
    if (x->dtype != KILN_DT_FLOAT32 && x->dtype != KILN_DT_FLOAT64)
        return kiln_error (err, KILN_EFORMAT, "input 0 is %s, expected float32 or float64",
                           kiln_dtype_name (x->dtype));
    if (tg->dtype != KILN_DT_INT64 && tg->dtype != KILN_DT_INT32)
        return kiln_error (err, KILN_EFORMAT, "the target is %s, expected int64 or int32",
                           kiln_dtype_name (tg->dtype));
    if (x->shape.rank < 2 || tg->shape.rank != x->shape.rank - 1
        || tg->shape.dims[0] != x->shape.dims[0])
        return kiln_error (err, KILN_EFORMAT, "input 0 must be [N, C, ...] and the target "
                           "[N, ...]");
    for (int i = 2; i < x->shape.rank; i++)
        if (tg->shape.dims[i - 1] != x->shape.dims[i])
            return kiln_error (err, KILN_EFORMAT, "the target's axis %d differs from "
                               "input 0's axis %d", i - 1, i);
    mp->dt = x->dtype;
    mp->dt2 = tg->dtype;
    mp->pre = x->shape.dims[0];
    mp->len = x->shape.dims[1];
    mp->post = kiln_kdims_prod (x->shape.dims, 2, x->shape.rank);
    if (plan->n_in > 2 && ((rc = kiln_km_need_dtype (p, plan->in[2], x->dtype, "the weight", err))
                           || (rc = kiln_kneed_numel (p, plan->in[2], mp->len, "the weight", err))))
        return rc;
    if ((rc = kiln_km_need_dtype (p, plan->out, x->dtype, "the output", err))
        || (rc = kiln_kneed_numel (p, plan->out, reduction ? 1 : kiln_ktensor_numel (tg), "the output", err)))
        return rc;
    mp->has_lo = has_ignore != 0;
    mp->i0 = ignore;
    mp->has_hi = (int) reduction;
    plan->run = s_run_nll;
    return 0;
}

