/*
 * kiln_kernels_binary — the typed math kernels that broadcast their
 * operands (numpy's rules, worked out once at load): the binary rows of
 * common/kiln_ops_binary.h, add/sub/mul/div on dtypes other than float32
 * (kiln_kmath_prepare_arith), Pow, PRelu, Mod, Fmod, the variadic
 * Max/Min/Sum/Mean and Where.  kiln_kmath_prepare (kiln_kernels_math.c)
 * hands them to kiln_km_prep_broadcast.
 */
#include "runtime/kiln_kernels_math_priv.h"

#include <limits.h>
#include <string.h>
#include <tgmath.h>

/* --- broadcasting ----------------------------------------------------- */

/* Strides of operands src[0..n) over the result `y` (numpy broadcasting:
 * each operand right-aligned, each dim equal to y's or 1), then unit dims
 * dropped and neighbours contiguous in every operand merged.  Row n of
 * mp->st is the result's own contiguous strides. */
static int
s_plan_broadcast (const kiln_program_t *p, const int *src, int n,
                  const kiln_prog_tensor_t *y, kiln_kmath_plan_t *mp,
                  kiln_err_t *err)
{
    int r = y->shape.rank;
    int64_t st[KILN_PROG_MAX_OP_IO + 1][KILN_MAX_RANK];
    for (int k = 0; k <= n; k++) {
        const kiln_prog_tensor_t *t = k < n ? kiln_ktensor (p, src[k]) : y;
        if (t->shape.rank > r)
            return kiln_error (err, KILN_EFORMAT, "input %d has rank %d, more "
                               "than the output's %d", k, t->shape.rank, r);
        int64_t c = 1;
        for (int i = r - 1; i >= 0; i--) {
            int j = i - (r - t->shape.rank);
            int64_t d = j >= 0 ? t->shape.dims[j] : 1;
            if (d != y->shape.dims[i] && d != 1)
                return kiln_error (err, KILN_EFORMAT, "input %d: dimension %d "
                                   "is %lld, which does not broadcast to %lld",
                                   k, i, (long long) d,
                                   (long long) y->shape.dims[i]);
            st[k][i] = d == 1 ? 0 : c;
            c *= d;
        }
        mp->esz[k] = kiln_dtype_size (t->dtype);
    }
    int m = 0;
    for (int i = 0; i < r; i++) {
        int64_t d = y->shape.dims[i];
        if (d == 1)
            continue;
        bool merge = m > 0;
        for (int k = 0; merge && k <= n; k++)
            merge = mp->st[k][m - 1] == st[k][i] * d;
        if (merge) {
            mp->dims[m - 1] *= d;
            for (int k = 0; k <= n; k++)
                mp->st[k][m - 1] = st[k][i];
            continue;
        }
        mp->dims[m] = d;
        for (int k = 0; k <= n; k++)
            mp->st[k][m] = st[k][i];
        m++;
    }
    if (m == 0) {
        mp->dims[0] = 1;
        for (int k = 0; k <= n; k++)
            mp->st[k][0] = 0;
        m = 1;
    }
    mp->rank = m;
    mp->n_src = n;
    return 0;
}

/* Walk the result (row `n_src` of the strides) calling `fn` on each
 * innermost run, with operand a on stride row ra and b on row rb. */
static void
s_walk2 (const kiln_kmath_plan_t *mp, kiln_km_binary_fn fn, const void *a, int ra,
         const void *b, int rb, void *y)
{
    int r = mp->rank;
    int64_t n = mp->dims[r - 1], outer = kiln_kdims_prod (mp->dims, 0, r - 1);
    const int64_t *sa = mp->st[ra], *sb = mp->st[rb];
    size_t ea = mp->esz[ra], eb = mp->esz[rb], ey = mp->esz[mp->n_src];
    int64_t oa = 0, ob = 0, idx[KILN_MAX_RANK] = { 0 };
    for (int64_t o = 0; o < outer; o++) {
        fn (n, (const char *) a + oa * (int64_t) ea, sa[r - 1],
            (const char *) b + ob * (int64_t) eb, sb[r - 1],
            (char *) y + o * n * (int64_t) ey);
        for (int i = r - 2; i >= 0; i--) {
            oa += sa[i];
            ob += sb[i];
            if (++idx[i] < mp->dims[i])
                break;
            oa -= sa[i] * mp->dims[i];
            ob -= sb[i] * mp->dims[i];
            idx[i] = 0;
        }
    }
}

/* --- binary loops ------------------------------------------------------ */

/* Generate s_<op>_<tn>: y = S_B_<op> (T, x0, x1) with result type R.  No
 * restrict: Sum and friends accumulate into y, which is then operand a. */
/* The floored remainder of floats: fmod's, moved to the divisor's sign. */
#define S_FLOOR_MOD(T)                                                        \
    static inline T                                                           \
    s_floor_mod_##T (T a, T b)                                                \
    {                                                                         \
        T r = fmod (a, b);                                                    \
        return r != 0 && ((r < 0) != (b < 0)) ? r + b : r;                    \
    }
S_FLOOR_MOD (float)
S_FLOOR_MOD (double)

#define S_BINARY(OP, TN, T, R) S_BINARY_E (OP, TN, T, R, S_B_##OP (T, a, b))
/* The loop itself: EXPR computes one result from the elements a and b. */
#define S_BINARY_E(OP, TN, T, R, EXPR)                                        \
    static void                                                               \
    s_##OP##_##TN (int64_t n, const void *a_, int64_t ia, const void *b_,     \
                   int64_t ib, void *y_)                                      \
    {                                                                         \
        const T *pa = a_, *pb = b_;                                           \
        R *y = y_;                                                            \
        if (ia == 1 && ib == 1)                                               \
            for (int64_t j = 0; j < n; j++) {                                 \
                T a = pa[j], b = pb[j];                                       \
                y[j] = (R) (EXPR);                                            \
            }                                                                 \
        else if (ia == 1 && ib == 0) {                                        \
            T b = pb[0];                                                      \
            for (int64_t j = 0; j < n; j++) {                                 \
                T a = pa[j];                                                  \
                y[j] = (R) (EXPR);                                            \
            }                                                                 \
        } else if (ia == 0 && ib == 1) {                                      \
            T a = pa[0];                                                      \
            for (int64_t j = 0; j < n; j++) {                                 \
                T b = pb[j];                                                  \
                y[j] = (R) (EXPR);                                            \
            }                                                                 \
        } else                                                                \
            for (int64_t j = 0; j < n; j++) {                                 \
                T a = pa[j * ia], b = pb[j * ib];                             \
                y[j] = (R) (EXPR);                                            \
            }                                                                 \
    }

#define S_BIN_SAME(OP, TN, T) S_BINARY (OP, TN, T, T)
#define S_BIN_BOOL(OP, TN, T) S_BINARY (OP, TN, T, uint8_t)

#define S_B_addf(T, a, b) ((a) + (b))
#define S_B_subf(T, a, b) ((a) - (b))
#define S_B_mulf(T, a, b) ((a) * (b))
#define S_B_divf(T, a, b) ((a) / (b))
#define S_B_addi(T, a, b) ((T) ((uint64_t) (a) + (uint64_t) (b)))
#define S_B_subi(T, a, b) ((T) ((uint64_t) (a) - (uint64_t) (b)))
#define S_B_muli(T, a, b) ((T) ((uint64_t) (a) * (uint64_t) (b)))
/* Truncating, as C and ONNX Runtime; x / 0 is 0 and MIN / -1 wraps. */
#define S_B_divi(T, a, b)                                                     \
    ((b) == 0 ? (T) 0                                                         \
     : ((T) -1 < 0 && (b) == (T) -1) ? (T) (0 - (uint64_t) (a)) : (T) ((a) / (b)))
#define S_B_prelu(T, a, b) ((a) < 0 ? (a) * (b) : (a))
/* Mod: fmod (the dividend's sign; integers truncate, x % 0 is 0) and
 * the floored one (the divisor's sign, as Python), ONNX's fmod = 1 and 0 */
#define S_B_fmodf(T, a, b) fmod (a, b)
#define S_B_fmodi(T, a, b) ((b) == 0 || ((T) -1 < 0 && (b) == (T) -1) ? (T) 0 : (T) ((a) % (b)))
#define S_B_modf(T, a, b) s_floor_mod_##T (a, b)
#define S_B_modi(T, a, b)                                                     \
    ((b) == 0 || ((T) -1 < 0 && (b) == (T) -1) ? (T) 0                        \
     : (T) ((a) % (b) != 0 && (((a) % (b) < 0) != ((b) < 0)) ? (a) % (b) + (b) : (a) % (b)))
#define S_B_maxf(T, a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define S_B_minf(T, a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))
#define S_B_maxi(T, a, b) ((a) > (b) ? (a) : (b))
#define S_B_mini(T, a, b) ((a) < (b) ? (a) : (b))
KILN_KM_FLOATS (S_BIN_SAME, addf)
KILN_KM_FLOATS (S_BIN_SAME, subf)
KILN_KM_FLOATS (S_BIN_SAME, mulf)
KILN_KM_FLOATS (S_BIN_SAME, divf)
KILN_KM_FLOATS (S_BIN_SAME, prelu)
KILN_KM_FLOATS (S_BIN_SAME, fmodf)
KILN_KM_FLOATS (S_BIN_SAME, modf)
KILN_KM_INTS (S_BIN_SAME, fmodi)
S_BIN_SAME (modi, i8, int8_t)
S_BIN_SAME (modi, i32, int32_t)
S_BIN_SAME (modi, i64, int64_t)
KILN_KM_FLOATS (S_BIN_SAME, maxf)
KILN_KM_FLOATS (S_BIN_SAME, minf)
KILN_KM_INTS (S_BIN_SAME, addi)
KILN_KM_INTS (S_BIN_SAME, subi)
KILN_KM_INTS (S_BIN_SAME, muli)
KILN_KM_INTS (S_BIN_SAME, divi)
KILN_KM_INTS (S_BIN_SAME, maxi)
KILN_KM_INTS (S_BIN_SAME, mini)

/* The rows of KILN_BINARY_OPS (common/kiln_ops_binary.h): the loops of
 * their kind's dtypes and their table. */
#define S_BROW(X_, id, name, onnx, kind, expr) S_BROW_##kind (id, expr)
#define S_BROW_compare(id, expr)                                              \
    S_BINARY_E (id, f32, float, uint8_t, expr)                                \
    S_BINARY_E (id, f64, double, uint8_t, expr)                               \
    S_BINARY_E (id, i8, int8_t, uint8_t, expr)                                \
    S_BINARY_E (id, u8, uint8_t, uint8_t, expr)                               \
    S_BINARY_E (id, i32, int32_t, uint8_t, expr)                              \
    S_BINARY_E (id, i64, int64_t, uint8_t, expr)                              \
    S_BINARY_E (id, b, uint8_t, uint8_t, expr)                                \
    static const kiln_km_tab_t s_tab_b_##id = { KILN_KM_TAB_FLOATS (id), KILN_KM_TAB_INTS (id), \
                                          [KILN_KM_BOOL] = (kiln_km_fn_t) s_##id##_b };
#define S_BROW_logical(id, expr)                                              \
    S_BINARY_E (id, b, uint8_t, uint8_t, expr)                                \
    static const kiln_km_tab_t s_tab_b_##id = { [KILN_KM_BOOL] = (kiln_km_fn_t) s_##id##_b };
KILN_BINARY_OPS (S_BROW, _)
#undef S_BROW

/* add/sub/mul/div for float64 and integers (float32 is kiln_kernels_elementwise.c's) */
static const kiln_km_tab_t s_tab_add = { KILN_KM_TAB_FLOATS (addf), KILN_KM_TAB_INTS (addi) };
static const kiln_km_tab_t s_tab_sub = { KILN_KM_TAB_FLOATS (subf), KILN_KM_TAB_INTS (subi) };
static const kiln_km_tab_t s_tab_mul = { KILN_KM_TAB_FLOATS (mulf), KILN_KM_TAB_INTS (muli) };
static const kiln_km_tab_t s_tab_div = { KILN_KM_TAB_FLOATS (divf), KILN_KM_TAB_INTS (divi) };
static const kiln_km_tab_t s_tab_prelu = { KILN_KM_TAB_FLOATS (prelu) };
static const kiln_km_tab_t s_tab_fmod = { KILN_KM_TAB_FLOATS (fmodf), KILN_KM_TAB_INTS (fmodi) };
/* unsigned: the floored remainder is the truncated one */
static const kiln_km_tab_t s_tab_mod = {
    KILN_KM_TAB_FLOATS (modf), [KILN_KM_I8] = (kiln_km_fn_t) s_modi_i8, [KILN_KM_U8] = (kiln_km_fn_t) s_fmodi_u8,
    [KILN_KM_I32] = (kiln_km_fn_t) s_modi_i32, [KILN_KM_I64] = (kiln_km_fn_t) s_modi_i64,
};
static const kiln_km_tab_t s_tab_max = { KILN_KM_TAB_FLOATS (maxf), KILN_KM_TAB_INTS (maxi) };
static const kiln_km_tab_t s_tab_min = { KILN_KM_TAB_FLOATS (minf), KILN_KM_TAB_INTS (mini) };

/* A binary op: one walk over the result. */
static void
s_run_binary (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kmath_plan_t *mp = &plan->u.math;
    s_walk2 (mp, (kiln_km_binary_fn) mp->fn, data[plan->in[0]], 0, data[plan->in[1]],
             1, data[plan->out]);
}

/* Max, Min, Sum, Mean over 1..8 operands: y = in0 op in1, then y = y op
 * in_k for each further operand (y walked on its own strides), then for
 * Mean y /= n.  One operand alone is copied (broadcast). */
static void
s_run_variadic (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kmath_plan_t *mp = &plan->u.math;
    kiln_km_binary_fn fn = (kiln_km_binary_fn) mp->fn;
    int n = mp->n_src;
    void *y = data[plan->out];
    if (n == 1) {
        /* max(x, x) is x for every value, NaN included. */
        s_walk2 (mp, fn, data[plan->in[0]], 0, data[plan->in[0]], 0, y);
    } else {
        s_walk2 (mp, fn, data[plan->in[0]], 0, data[plan->in[1]], 1, y);
        for (int k = 2; k < n; k++)
            s_walk2 (mp, fn, y, n, data[plan->in[k]], k, y);
    }
    if (plan->kernel == KILN_K_MEAN) {
        int64_t total = kiln_kdims_prod (mp->dims, 0, mp->rank);
        if (mp->dt == KILN_DT_FLOAT32) {
            float *v = y;
            for (int64_t i = 0; i < total; i++)
                v[i] = v[i] / (float) n;
        } else {
            double *v = y;
            for (int64_t i = 0; i < total; i++)
                v[i] = v[i] / (double) n;
        }
    }
}

/* --- Pow -------------------------------------------------------------- */

/* Element i of a tensor of dtype dt as a double. */
static double
s_ld (const void *p, kiln_dtype_t dt, int64_t i)
{
    switch (dt) {
    case KILN_DT_FLOAT32: return ((const float *) p)[i];
    case KILN_DT_FLOAT64: return ((const double *) p)[i];
    case KILN_DT_INT8: return ((const int8_t *) p)[i];
    case KILN_DT_UINT8: return ((const uint8_t *) p)[i];
    case KILN_DT_INT32: return ((const int32_t *) p)[i];
    case KILN_DT_INT64: return (double) ((const int64_t *) p)[i];
    default: return 0;
    }
}

/* x^e for integers, exactly (wrapping), by squaring; a negative exponent
 * gives the truncated 1/x^-e. */
static int64_t
s_ipow (int64_t x, int64_t e)
{
    if (e < 0)
        return x == 1 ? 1 : x == -1 ? ((e & 1) ? -1 : 1) : 0;
    uint64_t r = 1, b = (uint64_t) x;
    while (e > 0) {
        if (e & 1)
            r *= b;
        b *= b;
        e >>= 1;
    }
    return (int64_t) r;
}

static void
s_run_pow (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kmath_plan_t *mp = &plan->u.math;
    int r = mp->rank;
    int64_t n = mp->dims[r - 1], outer = kiln_kdims_prod (mp->dims, 0, r - 1);
    const void *a = data[plan->in[0]], *b = data[plan->in[1]];
    void *y = data[plan->out];
    int64_t oa = 0, ob = 0, idx[KILN_MAX_RANK] = { 0 };
    int64_t ia = mp->st[0][r - 1], ib = mp->st[1][r - 1];
    bool ints = mp->dt2 != KILN_DT_FLOAT32 && mp->dt2 != KILN_DT_FLOAT64;
    for (int64_t o = 0; o < outer; o++) {
        int64_t base = o * n;
        switch (mp->dt) {
        case KILN_DT_FLOAT32:
            if (mp->dt2 == KILN_DT_FLOAT32) {
                const float *pa = (const float *) a + oa, *pb = (const float *) b + ob;
                for (int64_t j = 0; j < n; j++)
                    ((float *) y)[base + j] = pow (pa[j * ia], pb[j * ib]);
            } else
                for (int64_t j = 0; j < n; j++)
                    ((float *) y)[base + j] = (float) pow (
                        (double) ((const float *) a)[oa + j * ia],
                        s_ld (b, mp->dt2, ob + j * ib));
            break;
        case KILN_DT_FLOAT64:
            for (int64_t j = 0; j < n; j++)
                ((double *) y)[base + j] = pow (((const double *) a)[oa + j * ia],
                                                s_ld (b, mp->dt2, ob + j * ib));
            break;
        case KILN_DT_INT32:
        case KILN_DT_INT64:
            for (int64_t j = 0; j < n; j++) {
                int64_t v, xa = mp->dt == KILN_DT_INT64
                                ? ((const int64_t *) a)[oa + j * ia]
                                : ((const int32_t *) a)[oa + j * ia];
                if (ints)
                    v = s_ipow (xa, mp->dt2 == KILN_DT_INT64
                                ? ((const int64_t *) b)[ob + j * ib]
                                : (int64_t) s_ld (b, mp->dt2, ob + j * ib));
                else
                    v = kiln_km_sat_i64 (pow ((double) xa, s_ld (b, mp->dt2, ob + j * ib)));
                if (mp->dt == KILN_DT_INT32)
                    ((int32_t *) y)[base + j] = (int32_t) v;
                else
                    ((int64_t *) y)[base + j] = v;
            }
            break;
        default:
            break;
        }
        for (int i = r - 2; i >= 0; i--) {
            oa += mp->st[0][i];
            ob += mp->st[1][i];
            if (++idx[i] < mp->dims[i])
                break;
            oa -= mp->st[0][i] * mp->dims[i];
            ob -= mp->st[1][i] * mp->dims[i];
            idx[i] = 0;
        }
    }
}

/* --- Where ----------------------------------------------------------- */

/* y = c ? x : z by element size (Where moves elements, whatever they
 * hold). */
#define S_WHERE(BITS)                                                         \
    static void                                                               \
    s_where_##BITS (const kiln_kmath_plan_t *mp, const uint8_t *c,            \
                    const void *x_, const void *z_, void *y_)                 \
    {                                                                         \
        const uint##BITS##_t *x = x_, *z = z_;                                \
        uint##BITS##_t *y = y_;                                               \
        int r = mp->rank;                                                     \
        int64_t n = mp->dims[r - 1], outer = kiln_kdims_prod (mp->dims, 0, r - 1); \
        int64_t off[3] = { 0, 0, 0 }, idx[KILN_MAX_RANK] = { 0 };             \
        int64_t ic = mp->st[0][r - 1], ix = mp->st[1][r - 1];                 \
        int64_t iz = mp->st[2][r - 1];                                        \
        for (int64_t o = 0; o < outer; o++) {                                 \
            const uint8_t *pc = c + off[0];                                   \
            const uint##BITS##_t *px = x + off[1], *pz = z + off[2];          \
            uint##BITS##_t *py = y + o * n;                                   \
            if (ic == 1 && ix == 1 && iz == 1)                                \
                for (int64_t j = 0; j < n; j++)                               \
                    py[j] = pc[j] ? px[j] : pz[j];                            \
            else                                                              \
                for (int64_t j = 0; j < n; j++)                               \
                    py[j] = pc[j * ic] ? px[j * ix] : pz[j * iz];             \
            for (int i = r - 2; i >= 0; i--) {                                \
                for (int k = 0; k < 3; k++)                                   \
                    off[k] += mp->st[k][i];                                   \
                if (++idx[i] < mp->dims[i])                                   \
                    break;                                                    \
                for (int k = 0; k < 3; k++)                                   \
                    off[k] -= mp->st[k][i] * mp->dims[i];                     \
                idx[i] = 0;                                                   \
            }                                                                 \
        }                                                                     \
    }
S_WHERE (8)
S_WHERE (16)
S_WHERE (32)
S_WHERE (64)

static void
s_run_where (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kmath_plan_t *mp = &plan->u.math;
    const uint8_t *c = data[plan->in[0]];
    const void *x = data[plan->in[1]], *z = data[plan->in[2]];
    void *y = data[plan->out];
    switch (mp->esz[1]) {
    case 1: s_where_8 (mp, c, x, z, y); break;
    case 2: s_where_16 (mp, c, x, z, y); break;
    case 4: s_where_32 (mp, c, x, z, y); break;
    default: s_where_64 (mp, c, x, z, y); break;
    }
}

/* Two operands of one dtype broadcast to the output; `out_bool` when the
 * result is bool (comparisons), else the operands' dtype. */
static int
s_prep_binary (kiln_program_t *p, kiln_kplan_t *plan, const kiln_km_tab_t tab,
               bool out_bool, kiln_err_t *err)
{
    kiln_kmath_plan_t *mp = &plan->u.math;
    kiln_dtype_t dt = kiln_ktensor (p, plan->in[0])->dtype;
    int rc;
    if ((rc = kiln_km_pick (tab, dt, "input 0", mp, err))
        || (rc = kiln_km_same_dtype (p, plan, 0, dt, err))
        || (rc = kiln_km_need_dtype (p, plan->out, out_bool ? KILN_DT_BOOL : dt,
                               "the output", err))
        || (rc = s_plan_broadcast (p, plan->in, plan->n_in, kiln_ktensor (p, plan->out),
                                   mp, err)))
        return rc;
    plan->run = plan->n_in == 2 && plan->kernel != KILN_K_MEAN
                ? s_run_binary : s_run_variadic;
    return 0;
}

int
kiln_kmath_prepare_arith (kiln_program_t *p, kiln_prog_op_t *op,
                          kiln_kplan_t *plan, kiln_err_t *err)
{
    const kiln_prog_tensor_t *y = kiln_ktensor (p, plan->out);
    int r = y->shape.rank, rc;
    /* The shapes the float32 kernel takes as parameters must be the
     * operands' own, right-aligned. */
    const char *names[2] = { "shape_a", "shape_b" };
    for (int k = 0; k < 2; k++) {
        int64_t d[KILN_PROG_MAX_PARAM_INTS];
        if ((rc = kiln_prog_op_ints (op, names[k], r, d, err)))
            return rc;
        const kiln_prog_tensor_t *t = kiln_ktensor (p, plan->in[k]);
        for (int i = 0; i < r; i++) {
            int j = i - (r - t->shape.rank);
            if (d[i] != (j >= 0 ? t->shape.dims[j] : 1))
                return kiln_error (err, KILN_EFORMAT, "parameter '%s' does not "
                                   "match input %d's shape", names[k], k);
        }
    }
    const kiln_km_tab_t *tab = plan->kernel == KILN_K_ADD ? &s_tab_add
                         : plan->kernel == KILN_K_SUB ? &s_tab_sub
                         : plan->kernel == KILN_K_MUL ? &s_tab_mul : &s_tab_div;
    return s_prep_binary (p, plan, *tab, false, err);
}

static int
s_prep_pow (kiln_program_t *p, kiln_kplan_t *plan, kiln_err_t *err)
{
    kiln_kmath_plan_t *mp = &plan->u.math;
    kiln_dtype_t dt = kiln_ktensor (p, plan->in[0])->dtype, de = kiln_ktensor (p, plan->in[1])->dtype;
    if (dt != KILN_DT_FLOAT32 && dt != KILN_DT_FLOAT64 && dt != KILN_DT_INT32
        && dt != KILN_DT_INT64)
        return kiln_error (err, KILN_EFORMAT, "input 0 is %s, which pow does "
                           "not take", kiln_dtype_name (dt));
    int ei = kiln_km_ti (de);
    if (ei < 0 || ei == KILN_KM_BOOL || ei == KILN_KM_F16 || ei == KILN_KM_BF16)
        return kiln_error (err, KILN_EFORMAT, "input 1 is %s, which pow does "
                           "not take", kiln_dtype_name (de));
    int rc;
    if ((rc = kiln_km_need_dtype (p, plan->out, dt, "the output", err))
        || (rc = s_plan_broadcast (p, plan->in, 2, kiln_ktensor (p, plan->out), mp, err)))
        return rc;
    mp->dt = dt;
    mp->dt2 = de;
    plan->run = s_run_pow;
    return 0;
}

static int
s_prep_where (kiln_program_t *p, kiln_kplan_t *plan, kiln_err_t *err)
{
    kiln_kmath_plan_t *mp = &plan->u.math;
    kiln_dtype_t dt = kiln_ktensor (p, plan->in[1])->dtype;
    int rc;
    if ((rc = kiln_km_need_dtype (p, plan->in[0], KILN_DT_BOOL, "input 0 (the "
                            "condition)", err))
        || (rc = kiln_km_need_dtype (p, plan->in[2], dt, "input 2", err))
        || (rc = kiln_km_need_dtype (p, plan->out, dt, "the output", err))
        || (rc = s_plan_broadcast (p, plan->in, 3, kiln_ktensor (p, plan->out), mp, err)))
        return rc;
    size_t e = kiln_dtype_size (dt);
    if (e != 1 && e != 2 && e != 4 && e != 8)
        return kiln_error (err, KILN_EFORMAT, "cannot select %s elements",
                           kiln_dtype_name (dt));
    mp->dt = dt;
    plan->run = s_run_where;
    return 0;
}


int
kiln_km_prep_broadcast (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                        kiln_err_t *err)
{
    switch (plan->kernel) {
    case KILN_K_POW: return s_prep_pow (p, plan, err);
    case KILN_K_PRELU: return s_prep_binary (p, plan, s_tab_prelu, false, err);
    case KILN_K_FMOD: return s_prep_binary (p, plan, s_tab_fmod, false, err);
    case KILN_K_MOD: return s_prep_binary (p, plan, s_tab_mod, false, err);
    case KILN_K_MAX: return s_prep_binary (p, plan, s_tab_max, false, err);
    case KILN_K_MIN: return s_prep_binary (p, plan, s_tab_min, false, err);
    case KILN_K_SUM:
        /* Sum of one operand is a broadcast copy: max(x, x). */
        return s_prep_binary (p, plan, plan->n_in == 1 ? s_tab_max : s_tab_add,
                              false, err);
    case KILN_K_MEAN:
        if (kiln_ktensor (p, plan->in[0])->dtype != KILN_DT_FLOAT32
            && kiln_ktensor (p, plan->in[0])->dtype != KILN_DT_FLOAT64)
            return kiln_error (err, KILN_EFORMAT, "input 0 is %s, expected "
                               "float32 or float64",
                               kiln_dtype_name (kiln_ktensor (p, plan->in[0])->dtype));
        return s_prep_binary (p, plan, plan->n_in == 1 ? s_tab_max : s_tab_add,
                              false, err);
    case KILN_K_WHERE: return s_prep_where (p, plan, err);
#define S_ROW_CASE(X_, id, name, onnx, kind, expr)                            \
    case KILN_K_##id: return s_prep_binary (p, plan, s_tab_b_##id, true, err);
    KILN_BINARY_OPS (S_ROW_CASE, _)
#undef S_ROW_CASE
    default:
        return kiln_error (err, KILN_EFORMAT, "kernel %s is not a broadcasting kernel",
                           kiln_kernel_name (plan->kernel));
    }
}
