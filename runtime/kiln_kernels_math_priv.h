/*
 * kiln_kernels_math_priv — what the typed math kernels share: the dtype
 * index of their per-operation loop tables, the loops' signatures and the
 * checks of their prepare steps.  Internal to libkilnrt; included by
 * kiln_kernels_math.c (unary ops, Cast, Clip, IsInf, and the dispatch
 * kiln_kmath_prepare), kiln_kernels_binary.c (the broadcasting ops),
 * kiln_kernels_reduce.c (reductions,
 * ArgMax/ArgMin, Softmax, Hardmax, NegativeLogLikelihoodLoss) and
 * kiln_kernels_norm.c (BatchNormalization, InstanceNormalization,
 * LayerNormalization, LRN).
 */
#ifndef KILN_KERNELS_MATH_PRIV_H
#define KILN_KERNELS_MATH_PRIV_H

#include "common/kiln_half.h"
#include "runtime/kiln_kernels_priv.h"

/* Index of a dtype in the per-operation tables. */
enum {
    KILN_KM_F32, KILN_KM_F64, KILN_KM_I8, KILN_KM_U8, KILN_KM_I32, KILN_KM_I64,
    KILN_KM_BOOL, KILN_KM_F16, KILN_KM_BF16, KILN_KM_NT
};

static inline int
kiln_km_ti (kiln_dtype_t dt)
{
    switch (dt) {
    case KILN_DT_FLOAT32: return KILN_KM_F32;
    case KILN_DT_FLOAT64: return KILN_KM_F64;
    case KILN_DT_INT8: return KILN_KM_I8;
    case KILN_DT_UINT8: return KILN_KM_U8;
    case KILN_DT_INT32: return KILN_KM_I32;
    case KILN_DT_INT64: return KILN_KM_I64;
    case KILN_DT_BOOL: return KILN_KM_BOOL;
    case KILN_DT_FLOAT16: return KILN_KM_F16;
    case KILN_DT_BFLOAT16: return KILN_KM_BF16;
    default: return -1;
    }
}

typedef void (*kiln_km_fn_t) (void);      /* any inner loop, cast back to call */
typedef kiln_km_fn_t kiln_km_tab_t[KILN_KM_NT];

/* Loops of one kind share a signature. */
typedef void (*kiln_km_unary_fn) (int64_t n, const void *x, void *y,
                                  const kiln_kmath_plan_t *mp);
typedef void (*kiln_km_binary_fn) (int64_t n, const void *a, int64_t ia,
                                   const void *b, int64_t ib, void *y);
typedef void (*kiln_km_reduce_fn) (const kiln_kmath_plan_t *mp, const void *x,
                                   void *y);


/* GEN (OP, tn, T) for the float (and integer) element types. */
#define KILN_KM_FLOATS(GEN, OP) GEN (OP, f32, float) GEN (OP, f64, double)
#define KILN_KM_INTS(GEN, OP)                                                 \
    GEN (OP, i8, int8_t) GEN (OP, u8, uint8_t) GEN (OP, i32, int32_t)         \
    GEN (OP, i64, int64_t)

/* The table entries of the float (and integer) loops s_<op>_<tn>. */
#define KILN_KM_TAB_FLOATS(OP)                                                \
    [KILN_KM_F32] = (kiln_km_fn_t) s_##OP##_f32, [KILN_KM_F64] = (kiln_km_fn_t) s_##OP##_f64
#define KILN_KM_TAB_INTS(OP)                                                  \
    [KILN_KM_I8] = (kiln_km_fn_t) s_##OP##_i8, [KILN_KM_U8] = (kiln_km_fn_t) s_##OP##_u8, \
    [KILN_KM_I32] = (kiln_km_fn_t) s_##OP##_i32, [KILN_KM_I64] = (kiln_km_fn_t) s_##OP##_i64

/* --- half precision (common/kiln_half.h) ------------------------------ */

#define kiln_km_f2h kiln_f32_to_f16
#define kiln_km_h2f kiln_f16_to_f32
#define kiln_km_f2bf kiln_f32_to_bf16
#define kiln_km_bf2f kiln_bf16_to_f32

/* Float to integer conversions saturate; NaN gives 0 (C leaves both
 * undefined). */
#define KILN_KM_SAT(TN, T, LO, HI)                                            \
    static inline T                                                           \
    kiln_km_sat_##TN (double v)                                               \
    {                                                                         \
        if (v != v)                                                           \
            return 0;                                                         \
        if (v <= (double) (LO))                                               \
            return LO;                                                        \
        if (v >= (double) (HI))                                               \
            return HI;                                                        \
        return (T) v;                                                         \
    }
KILN_KM_SAT (i8, int8_t, INT8_MIN, INT8_MAX)
KILN_KM_SAT (u8, uint8_t, 0, UINT8_MAX)
KILN_KM_SAT (i32, int32_t, INT32_MIN, INT32_MAX)
KILN_KM_SAT (i64, int64_t, INT64_MIN, INT64_MAX)

#pragma GCC visibility push(hidden)

/* --- checks (kiln_kernels_math.c) ------------------------------------------ */

/* The loop of `tab` for dtype `dt` into mp, or an error naming the operand. */
int kiln_km_pick (const kiln_km_tab_t tab, kiln_dtype_t dt, const char *what,
                  kiln_kmath_plan_t *mp, kiln_err_t *err);

/* Inputs from `from` on are of dtype dt. */
int kiln_km_same_dtype (const kiln_program_t *p, const kiln_kplan_t *plan, int from,
                        kiln_dtype_t dt, kiln_err_t *err);

/* Tensor t (operand `what`) is of dtype dt. */
int kiln_km_need_dtype (const kiln_program_t *p, int t, kiln_dtype_t dt,
                        const char *what, kiln_err_t *err);

/* A float parameter that must be finite (a NaN epsilon would poison every
 * result silently). */
int kiln_km_float_param (kiln_prog_op_t *op, const char *name, double *out,
                         kiln_err_t *err);

/* --- broadcasting kernels (kiln_kernels_binary.c) ------------------------ */

/* Plan pow, prelu, mod, fmod, max, min, sum, mean, where and the rows of
 * KILN_BINARY_OPS. */
int kiln_km_prep_broadcast (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                            kiln_err_t *err);

/* --- reductions (kiln_kernels_reduce.c) ------------------------------------- */

/* X as [pre, len, post] around axis `axis` (or, with `flatten`, around
 * every axis from `axis` on, post = 1). */
int kiln_km_plan_axis (const kiln_prog_tensor_t *x, int64_t axis, bool flatten,
                       kiln_kmath_plan_t *mp, kiln_err_t *err);

/* The run of every kernel whose loop is a kiln_km_reduce_fn. */
void kiln_km_run_reduce (const kiln_kplan_t *plan, void *const *data);

int kiln_km_prep_reduce (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                         const kiln_km_tab_t tab, kiln_err_t *err);
int kiln_km_prep_arg (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                      kiln_err_t *err);
int kiln_km_prep_softmax (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                          kiln_err_t *err);
int kiln_km_prep_hardmax (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                          kiln_err_t *err);
int kiln_km_prep_nll (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                      kiln_err_t *err);

/* The loop tables of the reductions: one per KILN_REDUCE_OPS row
 * (kiln_km_tab_r_<id>) and ReduceLogSumExp's. */
#define KILN_KM_DECLARE_RTAB(X_, id, name, onnx, ex, i0, s0, f0, ints, i1, s1, f1) \
    extern const kiln_km_tab_t kiln_km_tab_r_##id;
KILN_REDUCE_OPS (KILN_KM_DECLARE_RTAB, _)
#undef KILN_KM_DECLARE_RTAB
extern const kiln_km_tab_t kiln_km_tab_rlse;

/* --- normalisations (kiln_kernels_norm.c) ----------------------------------- */

/* X [N, C, ...] of a float type; inputs from `from` on are per-channel
 * vectors of C elements of the same type. */
int kiln_km_prep_channels (kiln_program_t *p, kiln_kplan_t *plan, int from,
                           kiln_err_t *err);
int kiln_km_prep_layer_norm (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                             kiln_err_t *err);
void kiln_km_run_bn_f32 (const kiln_kplan_t *plan, void *const *data);
void kiln_km_run_bn_f64 (const kiln_kplan_t *plan, void *const *data);
void kiln_km_run_in_f32 (const kiln_kplan_t *plan, void *const *data);
void kiln_km_run_in_f64 (const kiln_kplan_t *plan, void *const *data);
void kiln_km_run_lrn_f32 (const kiln_kplan_t *plan, void *const *data);
void kiln_km_run_lrn_f64 (const kiln_kplan_t *plan, void *const *data);

#pragma GCC visibility pop

#endif
