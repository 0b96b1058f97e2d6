/*
 * kiln_kernels_norm — the normalisation kernels: BatchNormalization (with
 * a fused activation on float32), InstanceNormalization,
 * LayerNormalization (and its statistics) and LRN, on float32 and
 * float64.  kiln_kmath_prepare (kiln_kernels_math.c) calls their prepare
 * steps.
 */
#include "runtime/kiln_kernels_math_priv.h"
#include "runtime/kiln_vmath.h"

#include <stdio.h>
#include <string.h>
#include <tgmath.h>

/* --- normalisations -------------------------------------------------- */

/* BatchNormalization (inference): per channel c of X [N, C, ...],
 * y = (x - mean) / sqrt(var + eps) * scale + b, folded to x * a + b'.
 * float32 may carry the activation that followed it (a pre-activation
 * block's BatchNormalization -> Relu, fused by the compiler): relu in the
 * same pass, the others over the plane just written (in L1). */
void
kiln_km_run_bn_f32 (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kmath_plan_t *mp = &plan->u.math;
    const float *x = data[plan->in[0]], *sc = data[plan->in[1]];
    const float *bi = data[plan->in[2]], *mu = data[plan->in[3]];
    const float *var = data[plan->in[4]];
    float *y = data[plan->out];
    int64_t ch = mp->len, sp = mp->post;
    kiln_act_t act = plan->epi.act;
    for (int64_t n = 0; n < mp->pre; n++)
        for (int64_t c = 0; c < ch; c++) {
            double a = (double) sc[c] / sqrt ((double) var[c] + mp->f[0]);
            float ta = (float) a, tb = (float) ((double) bi[c] - (double) mu[c] * a);
            const float *restrict xp = x + (n * ch + c) * sp;
            float *restrict yp = y + (n * ch + c) * sp;
            if (act == KILN_ACT_RELU) {
                /* v < 0 is false for NaN and -0, which pass (as relu) */
                for (int64_t i = 0; i < sp; i++) {
                    float v = xp[i] * ta + tb;
                    yp[i] = v < 0.0f ? 0.0f : v;
                }
                continue;
            }
            for (int64_t i = 0; i < sp; i++)
                yp[i] = xp[i] * ta + tb;
            if (act != KILN_ACT_NONE)
                kiln_act_apply (yp, sp, act, plan->epi.a, plan->epi.b);
        }
}

#define S_BN(TN, T)                                                           \
    void                                                                      \
    kiln_km_run_bn_##TN (const kiln_kplan_t *plan, void *const *data)         \
    {                                                                         \
        const kiln_kmath_plan_t *mp = &plan->u.math;                          \
        const T *x = data[plan->in[0]], *sc = data[plan->in[1]];              \
        const T *bi = data[plan->in[2]], *mu = data[plan->in[3]];             \
        const T *var = data[plan->in[4]];                                     \
        T *y = data[plan->out];                                               \
        int64_t ch = mp->len, sp = mp->post;                                  \
        for (int64_t n = 0; n < mp->pre; n++)                                 \
            for (int64_t c = 0; c < ch; c++) {                                \
                double a = (double) sc[c] / sqrt ((double) var[c] + mp->f[0]); \
                T ta = (T) a, tb = (T) ((double) bi[c] - (double) mu[c] * a); \
                const T *restrict xp = x + (n * ch + c) * sp;                 \
                T *restrict yp = y + (n * ch + c) * sp;                       \
                for (int64_t i = 0; i < sp; i++)                              \
                    yp[i] = xp[i] * ta + tb;                                  \
            }                                                                 \
    }
S_BN (f64, double)
#undef S_BN

/* Mean and variance (population) of n elements `stride` apart, in
 * double, two passes. */
#define S_MOMENTS(TN, T)                                                      \
    static void                                                               \
    s_moments_##TN (const T *x, int64_t n, double *mean, double *var)         \
    {                                                                         \
        double s = 0, q = 0;                                                  \
        for (int64_t i = 0; i < n; i++)                                       \
            s += (double) x[i];                                               \
        double m = n ? s / (double) n : 0;                                    \
        for (int64_t i = 0; i < n; i++) {                                     \
            double d = (double) x[i] - m;                                     \
            q += d * d;                                                       \
        }                                                                     \
        *mean = m;                                                            \
        *var = n ? q / (double) n : 0;                                        \
    }
S_MOMENTS (f32, float)
S_MOMENTS (f64, double)

/* InstanceNormalization: each (n, c) plane normalised on its own. */
#define S_IN(TN, T)                                                           \
    void                                                                      \
    kiln_km_run_in_##TN (const kiln_kplan_t *plan, void *const *data)         \
    {                                                                         \
        const kiln_kmath_plan_t *mp = &plan->u.math;                          \
        const T *x = data[plan->in[0]], *sc = data[plan->in[1]];              \
        const T *bi = data[plan->in[2]];                                      \
        T *y = data[plan->out];                                               \
        int64_t ch = mp->len, sp = mp->post;                                  \
        for (int64_t n = 0; n < mp->pre; n++)                                 \
            for (int64_t c = 0; c < ch; c++) {                                \
                const T *xp = x + (n * ch + c) * sp;                          \
                T *yp = y + (n * ch + c) * sp;                                \
                double mean, var;                                             \
                s_moments_##TN (xp, sp, &mean, &var);                         \
                double a = (double) sc[c] / sqrt (var + mp->f[0]);            \
                T ta = (T) a, tb = (T) ((double) bi[c] - mean * a);           \
                for (int64_t i = 0; i < sp; i++)                              \
                    yp[i] = xp[i] * ta + tb;                                  \
            }                                                                 \
    }
S_IN (f32, float)
S_IN (f64, double)

/* LayerNormalization: each of `pre` rows of `len` elements normalised;
 * scale and bias have len elements or one (stride 0).  layer_norm_stats
 * also writes each row's mean and 1/sqrt(var + eps) (float32). */
#define S_LN(TN, T)                                                           \
    static void                                                               \
    s_run_ln_##TN (const kiln_kplan_t *plan, void *const *data)               \
    {                                                                         \
        const kiln_kmath_plan_t *mp = &plan->u.math;                          \
        const T *x = data[plan->in[0]], *sc = data[plan->in[1]];              \
        const T *bi = plan->n_in > 2 ? data[plan->in[2]] : NULL;              \
        T *y = data[plan->out];                                               \
        float *smean = mp->out2 >= 0 ? data[mp->out2] : NULL;                 \
        float *sinv = mp->out3 >= 0 ? data[mp->out3] : NULL;                  \
        int64_t len = mp->len;                                                \
        for (int64_t o = 0; o < mp->pre; o++) {                               \
            const T *xp = x + o * len;                                        \
            T *yp = y + o * len;                                              \
            double mean, var;                                                 \
            s_moments_##TN (xp, len, &mean, &var);                            \
            double inv = 1.0 / sqrt (var + mp->f[0]);                         \
            for (int64_t i = 0; i < len; i++) {                               \
                double v = ((double) xp[i] - mean) * inv                      \
                           * (double) sc[i * mp->sc_st];                      \
                if (bi)                                                       \
                    v += (double) bi[i * mp->b_st];                           \
                yp[i] = (T) v;                                                \
            }                                                                 \
            if (smean)                                                        \
                smean[o] = (float) mean;                                      \
            if (sinv)                                                         \
                sinv[o] = (float) inv;                                        \
        }                                                                     \
    }
S_LN (f64, double)

typedef struct {
    const kiln_kplan_t *plan;
    void *const *data;
} s_ln_rows_t;

static void
s_ln_rows (void *arg, int64_t first, int64_t count)
{
    const kiln_kplan_t *plan = ((const s_ln_rows_t *) arg)->plan;
    void *const *data = ((const s_ln_rows_t *) arg)->data;
    const kiln_kmath_plan_t *mp = &plan->u.math;
    const float *x = data[plan->in[0]], *sc = data[plan->in[1]];
    const float *bi = plan->n_in > 2 ? data[plan->in[2]] : NULL;
    float *y = data[plan->out];
    float *smean = mp->out2 >= 0 ? data[mp->out2] : NULL;
    float *sinv = mp->out3 >= 0 ? data[mp->out3] : NULL;
    for (int64_t o = first; o < first + count; o++) {
        double mean, inv;
        kiln_vlayer_norm_row (x + o * mp->len, y + o * mp->len, mp->len, sc,
                              mp->sc_st, bi, mp->b_st, mp->f[0], &mean, &inv);
        if (smean)
            smean[o] = (float) mean;
        if (sinv)
            sinv[o] = (float) inv;
    }
}

/* Rows spread over the pool (a transformer's 128 or 197 tokens). */
static void
s_run_ln_f32 (const kiln_kplan_t *plan, void *const *data)
{
    s_ln_rows_t r = { plan, data };
    kiln_krows_run (s_ln_rows, &r, plan->u.math.pre, 4096 / (plan->u.math.len + 1) + 1);
}

/* LRN across channels: y = x / (bias + alpha / size * sum x^2)^beta, the
 * sum over channels c - floor((size-1)/2) .. c + ceil((size-1)/2). */
#define S_LRN(TN, T)                                                          \
    void                                                                      \
    kiln_km_run_lrn_##TN (const kiln_kplan_t *plan, void *const *data)        \
    {                                                                         \
        const kiln_kmath_plan_t *mp = &plan->u.math;                          \
        const T *x = data[plan->in[0]];                                       \
        T *y = data[plan->out];                                               \
        int64_t ch = mp->len, sp = mp->post, size = mp->i0;                   \
        int64_t before = (size - 1) / 2, after = size - 1 - before;           \
        double alpha = mp->f[0], beta = mp->f[1], bias = mp->f[2];            \
        for (int64_t n = 0; n < mp->pre; n++)                                 \
            for (int64_t c = 0; c < ch; c++) {                                \
                int64_t lo = c - before < 0 ? 0 : c - before;                 \
                int64_t hi = c + after >= ch ? ch - 1 : c + after;            \
                const T *xp = x + (n * ch + c) * sp;                          \
                T *yp = y + (n * ch + c) * sp;                                \
                for (int64_t i = 0; i < sp; i++) {                            \
                    double s = 0;                                             \
                    for (int64_t k = lo; k <= hi; k++) {                      \
                        double v = (double) x[(n * ch + k) * sp + i];         \
                        s += v * v;                                           \
                    }                                                         \
                    yp[i] = (T) ((double) xp[i]                               \
                                 / pow (bias + alpha / (double) size * s, beta)); \
                }                                                             \
            }                                                                 \
    }
S_LRN (f32, float)
S_LRN (f64, double)

/* X [N, C, ...] of a float type; inputs from `from` on are per-channel
 * vectors of C elements of the same type. */
int
kiln_km_prep_channels (kiln_program_t *p, kiln_kplan_t *plan, int from,
                 kiln_err_t *err)
{
    kiln_kmath_plan_t *mp = &plan->u.math;
    const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[0]);
    int rc;
    if (x->dtype != KILN_DT_FLOAT32 && x->dtype != KILN_DT_FLOAT64)
        return kiln_error (err, KILN_EFORMAT, "input 0 is %s, expected float32 "
                           "or float64", kiln_dtype_name (x->dtype));
    if (x->shape.rank < 2)
        return kiln_error (err, KILN_EFORMAT, "input 0 has rank %d, expected "
                           "at least 2", x->shape.rank);
    if ((rc = kiln_km_same_dtype (p, plan, 0, x->dtype, err))
        || (rc = kiln_km_need_dtype (p, plan->out, x->dtype, "the output", err))
        || (rc = kiln_kneed_numel (p, plan->out, kiln_ktensor_numel (x), "the output", err)))
        return rc;
    for (int i = from; i < plan->n_in; i++) {
        char what[32];
        snprintf (what, sizeof what, "input %d", i);
        if ((rc = kiln_kneed_numel (p, plan->in[i], x->shape.dims[1], what, err)))
            return rc;
    }
    mp->dt = x->dtype;
    mp->pre = x->shape.dims[0];
    mp->len = x->shape.dims[1];
    mp->post = kiln_kdims_prod (x->shape.dims, 2, x->shape.rank);
    return 0;
}

int
kiln_km_prep_layer_norm (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                   kiln_err_t *err)
{
    kiln_kmath_plan_t *mp = &plan->u.math;
    const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[0]);
    int64_t axis;
    int rc;
    if (x->dtype != KILN_DT_FLOAT32 && x->dtype != KILN_DT_FLOAT64)
        return kiln_error (err, KILN_EFORMAT, "input 0 is %s, expected float32 "
                           "or float64", kiln_dtype_name (x->dtype));
    if ((rc = kiln_km_same_dtype (p, plan, 0, x->dtype, err))
        || (rc = kiln_km_need_dtype (p, plan->out, x->dtype, "the output", err))
        || (rc = kiln_kneed_numel (p, plan->out, kiln_ktensor_numel (x), "the output", err))
        || (rc = kiln_prog_op_int (op, "axis", &axis, err))
        || (rc = kiln_km_float_param (op, "epsilon", &mp->f[0], err))
        || (rc = kiln_km_plan_axis (x, axis, true, mp, err)))
        return rc;
    if (x->shape.rank == 0)
        return kiln_error (err, KILN_EFORMAT, "input 0 is a scalar");
    int64_t *st[2] = { &mp->sc_st, &mp->b_st };
    for (int i = 1; i < plan->n_in; i++) {
        int64_t n = kiln_ktensor_numel (kiln_ktensor (p, plan->in[i]));
        if (n != mp->len && n != 1)
            return kiln_error (err, KILN_EFORMAT, "input %d holds %lld "
                               "elements, expected %lld or 1", i, (long long) n,
                               (long long) mp->len);
        *st[i - 1] = n == 1 ? 0 : 1;
    }
    mp->out2 = mp->out3 = -1;
    if (plan->kernel == KILN_K_LAYER_NORM_STATS) {
        mp->out2 = op->outputs[1];
        mp->out3 = op->outputs[2];
        for (int k = 1; k < 3; k++) {
            if ((rc = kiln_km_need_dtype (p, op->outputs[k], KILN_DT_FLOAT32,
                                    k == 1 ? "output 1 (mean)" : "output 2 (inverse std dev)",
                                    err))
                || (rc = kiln_kneed_numel (p, op->outputs[k], mp->pre,
                                       k == 1 ? "output 1 (mean)" : "output 2 (inverse std dev)",
                                       err)))
                return rc;
        }
    }
    plan->run = x->dtype == KILN_DT_FLOAT32 ? s_run_ln_f32 : s_run_ln_f64;
    return 0;
}

